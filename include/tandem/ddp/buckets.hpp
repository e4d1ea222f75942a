// tandem/ddp/buckets.hpp - how DistributedDataParallel groups gradients into buckets: slices of
// the flat gradient buffer, in reverse registration order, each under a byte cap.
//   auto plan = tandem::plan_buckets(sizes, sizeof(float), 1_MiB, 25_MiB);  // sizes in elements
// Needs: the standard library.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "tandem/core/error.hpp"

namespace tandem {

/// One bucket: the parameters [first_param, end_param) in registration order, whose gradients
/// are the elements [offset, offset + count) of the flat gradient buffer.
struct Bucket {
  /// First element of the bucket in the flat gradient buffer.
  std::size_t offset = 0;
  /// Number of gradient elements in the bucket.
  std::size_t count = 0;
  /// Registration index of the bucket's first parameter.
  std::size_t first_param = 0;
  /// One past the registration index of its last parameter.
  std::size_t end_param = 0;

  friend bool operator==(const Bucket&, const Bucket&) = default;
};

/// Buckets in launch order (bucket 0 holds the last-registered parameters) and, for every
/// parameter (registration index), the bucket that holds it.
struct BucketPlan {
  /// The buckets in launch order.
  std::vector<Bucket> buckets;
  /// For each parameter (registration index), the index of its bucket in `buckets`.
  std::vector<std::size_t> bucket_of;
};

/// Groups parameters of `sizes` elements (registration order, laid out contiguously in that
/// order) into buckets, walking from the last parameter to the first. A bucket takes the next
/// parameter while its bytes stay within its cap (first_cap_bytes for bucket 0, cap_bytes after);
/// a parameter larger than the cap gets a bucket of its own, and a parameter of no elements joins
/// the bucket being filled.
[[nodiscard]] inline BucketPlan plan_buckets(std::span<const std::size_t> sizes,
                                             std::size_t element_bytes, std::size_t first_cap_bytes,
                                             std::size_t cap_bytes) {
  if (element_bytes == 0 || first_cap_bytes == 0 || cap_bytes == 0) {
    throw Error("plan_buckets", "element size and bucket caps must be positive (got " +
                                    std::to_string(element_bytes) + ", " +
                                    std::to_string(first_cap_bytes) + ", " +
                                    std::to_string(cap_bytes) + " bytes)");
  }
  std::vector<std::size_t> offsets(sizes.size());
  std::size_t total = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    offsets[i] = total;
    total += sizes[i];
  }

  BucketPlan plan;
  plan.bucket_of.assign(sizes.size(), 0);
  bool open = false;
  Bucket current;
  auto close = [&] {
    if (open) plan.buckets.push_back(current);
    open = false;
  };
  for (std::size_t i = sizes.size(); i-- > 0;) {
    const std::size_t cap = plan.buckets.empty() ? first_cap_bytes : cap_bytes;
    const std::size_t bytes = sizes[i] * element_bytes;
    if (open && current.count != 0 && bytes != 0 && current.count * element_bytes + bytes > cap) {
      close();
    }
    if (!open) {
      current = Bucket{offsets[i] + sizes[i], 0, i + 1, i + 1};
      open = true;
    }
    current.offset = offsets[i];
    current.count += sizes[i];
    current.first_param = i;
    plan.bucket_of[i] = plan.buckets.size();
  }
  close();
  return plan;
}

}  // namespace tandem
