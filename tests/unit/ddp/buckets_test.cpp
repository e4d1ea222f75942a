// Bucket planning (reverse registration order, caps, oversized and empty parameters) and what a
// list of DDP policies resolves to.
#include <doctest/doctest.h>

#include <cstddef>
#include <type_traits>
#include <vector>

#include "tandem/core/units.hpp"
#include "tandem/ddp/buckets.hpp"
#include "tandem/ddp/policies.hpp"

namespace {

using namespace tandem::literals;
using tandem::Bucket;

tandem::BucketPlan plan(std::vector<std::size_t> sizes, std::size_t first_cap, std::size_t cap) {
  return tandem::plan_buckets(sizes, sizeof(float), first_cap, cap);
}

}  // namespace

TEST_CASE("buckets are filled from the last parameter, the first under its own cap") {
  // Offsets 0, 10, 30, 35, 75. Bucket 0 (cap 100 B = 25 floats) takes p4 (5) and p3 (40 > 25?)
  auto p = plan({10, 20, 5, 40, 5}, 100, 200);
  // p4 = 5 floats = 20 B; + p3 = 160 B > 100: closes. p3 alone = 160 B; + p2 = 180 <= 200;
  // + p1 = 260 > 200: closes. p1 + p0 = 120 B.
  const std::vector<Bucket> expected{{75, 5, 4, 5}, {30, 45, 2, 4}, {0, 30, 0, 2}};
  CHECK(p.buckets == expected);
  CHECK(p.bucket_of == std::vector<std::size_t>{2, 2, 1, 1, 0});
}

TEST_CASE("a parameter larger than the cap gets a bucket of its own") {
  auto p = plan({2, 1000, 3}, 16, 16);
  const std::vector<Bucket> expected{{1002, 3, 2, 3}, {2, 1000, 1, 2}, {0, 2, 0, 1}};
  CHECK(p.buckets == expected);
}

TEST_CASE("a cap of one element makes one bucket per parameter; empty ones join a bucket") {
  auto p = plan({1, 0, 2, 1, 0}, sizeof(float), sizeof(float));
  const std::vector<Bucket> expected{{3, 1, 3, 5}, {1, 2, 1, 3}, {0, 1, 0, 1}};
  CHECK(p.buckets == expected);
  CHECK(p.bucket_of == std::vector<std::size_t>{2, 1, 1, 0, 0});
  // The buckets tile the flat buffer exactly, in reverse.
  std::size_t end = 4;
  for (const auto& b : p.buckets) {
    CHECK(b.offset + b.count == end);
    end = b.offset;
  }
  CHECK(end == 0);
}

TEST_CASE("default caps: everything small fits the 1 MiB first bucket") {
  auto p = plan({1000, 2000, 3000}, 1_MiB, 25_MiB);
  REQUIRE(p.buckets.size() == 1);
  CHECK(p.buckets[0] == Bucket{0, 6000, 0, 3});
  // 300k floats (1.2 MB) overflow the first bucket; the rest share a 25 MiB one.
  auto big = plan({300000, 300000, 300000}, 1_MiB, 25_MiB);
  const std::vector<Bucket> expected{{600000, 300000, 2, 3}, {0, 600000, 0, 2}};
  CHECK(big.buckets == expected);
}

TEST_CASE("no parameters, no buckets; zero caps are errors") {
  CHECK(plan({}, 4, 4).buckets.empty());
  CHECK_THROWS_AS(plan({1}, 0, 4), tandem::Error);
}

TEST_CASE("policies resolve to their defaults and to what is given") {
  using defaults = tandem::detail::ddp_config<>;
  static_assert(defaults::overlapped && defaults::averaged && defaults::broadcasts_buffers);
  static_assert(!defaults::compressed);
  static_assert(defaults::bucket_cap_bytes == 25_MiB && defaults::first_bucket_cap_bytes == 1_MiB);

  using chosen =
      tandem::detail::ddp_config<tandem::sync_at_end, tandem::sum,
                                 tandem::compress<tandem::bfloat16>, tandem::bucket_cap<4_MiB>,
                                 tandem::no_broadcast_buffers>;
  static_assert(!chosen::overlapped && !chosen::averaged && !chosen::broadcasts_buffers);
  static_assert(std::is_same_v<chosen::wire_type, tandem::bfloat16>);
  static_assert(chosen::bucket_cap_bytes == 4_MiB && chosen::first_bucket_cap_bytes == 1_MiB);

  // A bucket cap below 1 MiB lowers the first bucket's cap too, unless that is given.
  using small = tandem::detail::ddp_config<tandem::bucket_cap<64>>;
  static_assert(small::first_bucket_cap_bytes == 64);
  using both = tandem::detail::ddp_config<tandem::bucket_cap<64>, tandem::first_bucket_cap<8>>;
  static_assert(both::first_bucket_cap_bytes == 8 && both::bucket_cap_bytes == 64);
  CHECK(small::bucket_cap_bytes == 64);  // the static_asserts above are the test
}
