// tandem/ddp/shards.hpp - how ZeRO (the shard<1>/shard<2> policies of DistributedDataParallel)
// cuts the flat arena between ranks: every bucket into world-size parts, rank r owning part r.
//   auto layout = tandem::plan_shards(ddp.buckets(), world_size, rank);  layout.owned();
// Needs: the standard library; all_gather_parts needs a Communicator and an executor.
//
// A bucket of `count` elements at `offset` is split as count = N * q + rem (N ranks): its first
// N * q elements are N equal parts of q, rank r owning [offset + r*q, offset + (r+1)*q), and
// travel through one reduce_scatter or all_gather of N * q elements straight from the arena; the
// last rem elements (rem < N) are the bucket's tail, element j owned by rank j, and travel through
// a small collective of N elements padded with zeros. No element is lost, and a rank owns at most
// ceil(count / N) elements of each bucket: its optimizer state is 1/N of DDP's plus at most one
// element per bucket.
#pragma once

#include <algorithm>
#include <cstddef>
#include <exception>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/stream_order.hpp"
#include "tandem/core/config.hpp"
#include "tandem/ddp/buckets.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// One bucket (its offset and count in the flat arena) and how ZeRO cuts it.
struct ShardedBucket : Bucket {
  /// Elements of each rank's equal part (count / world size).
  std::size_t part = 0;
  /// Elements in the tail (count % world size), owned one each by ranks 0 .. tail - 1.
  std::size_t tail = 0;
  /// Where the bucket's own part starts in the rank's staging buffer (ShardLayout::staging).
  std::size_t staging_offset = 0;
};

/// The shards of one rank: which elements of the arena it owns and the staging it needs.
class ShardLayout {
 public:
  ShardLayout() = default;
  /// Cuts each bucket into world_size equal parts and a tail (count % world_size elements, one
  /// each for the first ranks), and collects the parts that `rank` owns.
  ShardLayout(const std::vector<Bucket>& buckets, int world_size, int rank)
      : world_(static_cast<std::size_t>(world_size)), rank_(static_cast<std::size_t>(rank)) {
    std::vector<std::pair<std::size_t, std::size_t>> owned;
    for (const auto& bucket : buckets) {
      ShardedBucket b{bucket, bucket.count / world_, bucket.count % world_, staging_};
      // staging: the own part, then (with a tail) one element sent and world_ received.
      staging_ += b.part + (b.tail > 0 ? 1 + world_ : 0);
      if (b.part > 0) owned.emplace_back(b.offset + rank_ * b.part, b.part);
      if (rank_ < b.tail) owned.emplace_back(b.offset + world_ * b.part + rank_, 1);
      buckets_.push_back(b);
    }
    std::sort(owned.begin(), owned.end());
    for (const auto& [begin, size] : owned) {  // adjacent ranges merge into one
      if (!owned_.empty() && owned_.back().first + owned_.back().second == begin) {
        owned_.back().second += size;
      } else {
        owned_.emplace_back(begin, size);
      }
      owned_elements_ += size;
    }
  }

  /// The buckets, in the DDP's launch order.
  [[nodiscard]] const std::vector<ShardedBucket>& buckets() const noexcept { return buckets_; }
  /// The arena elements this rank owns, as sorted, disjoint (offset, size) ranges.
  [[nodiscard]] const std::vector<std::pair<std::size_t, std::size_t>>& owned() const noexcept {
    return owned_;
  }
  /// How many arena elements this rank owns.
  [[nodiscard]] std::size_t owned_elements() const noexcept { return owned_elements_; }
  /// Elements of staging a rank needs for one pass of collectives over every bucket.
  [[nodiscard]] std::size_t staging() const noexcept { return staging_; }
  /// The number of ranks the buckets are cut for.
  [[nodiscard]] std::size_t world_size() const noexcept { return world_; }
  /// The rank whose parts owned() lists.
  [[nodiscard]] std::size_t rank() const noexcept { return rank_; }

 private:
  std::size_t world_ = 1;
  std::size_t rank_ = 0;
  std::vector<ShardedBucket> buckets_;
  std::vector<std::pair<std::size_t, std::size_t>> owned_;
  std::size_t owned_elements_ = 0;
  std::size_t staging_ = 0;
};

/// The shards of rank `rank` among `world_size` over DistributedDataParallel's buckets.
[[nodiscard]] inline ShardLayout plan_shards(const std::vector<Bucket>& buckets, int world_size,
                                             int rank) {
  return ShardLayout(buckets, world_size, rank);
}

namespace detail::ddp {

/// to[i] = from[i], in any memory space.
template <class T>
struct copy_range {
  const T* from;
  T* to;
  TANDEM_HD void operator()(std::size_t i) const { to[i] = from[i]; }
};

/// to[0] = (have ? from[0] : 0): a tail element sent, or the padding of a rank without one.
template <class T>
struct copy_or_zero {
  const T* from;
  T* to;
  bool have;
  TANDEM_HD void operator()(std::size_t) const { to[0] = have ? from[0] : T{}; }
};

/// Waits on the host for every Work (each one, even after a failure) and empties `works`;
/// returns the first failure, or null.
inline std::exception_ptr wait_all(std::vector<Work>& works) {
  std::exception_ptr failure;
  for (auto& work : works) {
    try {
      work.wait();
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  works.clear();
  return failure;
}

/// One bucket's parameter all_gather on the wire (start_gather_parts): its Works, and with a
/// tail, the copy of the received tail elements still due (finish_gather_part).
struct GatherInFlight {
  const ShardedBucket* bucket = nullptr;
  std::vector<Work> works;
};

/// The order start_gather_parts launches the buckets in: the layout's (bucket 0 first), or a
/// forward's (the last bucket, which holds the first-registered parameters, first).
enum class GatherOrder : unsigned char { buckets, forward };

/// Starts making data[begin, end) (arena coordinates) whole on every rank from each rank's own
/// parts: one all_gather per bucket overlapping [begin, end) for its equal parts (straight into
/// the arena) and one of world-size padded elements for its tail, every one asynchronous and all
/// in flight together, buckets in `order` (forward: the last bucket first, the order a forward
/// reads the parameters in; the buckets' own order otherwise). Collective: every rank calls it
/// with the same range. `staging` holds layout.staging() elements of S in Space and must stay
/// alive, and the own parts unwritten, until finish_gather_part has run for every bucket
/// returned. Ordered through the stream-ordering contract (comm/stream_order.hpp): the
/// collectives after exec's copies. On a failure to launch, waits on the host for what started
/// and rethrows.
template <class S, class Space, class Comm, class Exec>
[[nodiscard]] std::vector<GatherInFlight> start_gather_parts(Comm& comm, const Exec& exec,
                                                             const ShardLayout& layout, S* data,
                                                             S* staging, std::size_t begin,
                                                             std::size_t end, GatherOrder order) {
  const std::size_t n = layout.world_size();
  const std::size_t r = layout.rank();
  std::vector<GatherInFlight> chosen;
  for (const auto& b : layout.buckets()) {
    if (b.count > 0 && b.offset < end && b.offset + b.count > begin) chosen.push_back({&b, {}});
  }
  if (order == GatherOrder::forward) std::reverse(chosen.begin(), chosen.end());
  for (const auto& g : chosen) {
    const ShardedBucket* b = g.bucket;
    S* own = staging + b->staging_offset;
    if (b->part > 0) {
      for_each_index(exec, b->part, copy_range<S>{data + b->offset + r * b->part, own});
    }
    if (b->tail > 0) {
      const std::size_t tail_at = b->offset + n * b->part;
      for_each_index(exec, 1, copy_or_zero<S>{data + tail_at + r, own + b->part, r < b->tail});
    }
  }
  tandem::order_after(comm, exec);  // the copies are written before the communicator reads them
  try {
    for (auto& g : chosen) {
      const ShardedBucket* b = g.bucket;
      S* own = staging + b->staging_offset;
      if (b->part > 0) {
        g.works.push_back(comm.all_gather_async(View<S, Space>(own, b->part),
                                                View<S, Space>(data + b->offset, n * b->part)));
      }
      if (b->tail > 0) {
        g.works.push_back(comm.all_gather_async(View<S, Space>(own + b->part, 1),
                                                View<S, Space>(own + b->part + 1, n)));
      }
    }
  } catch (...) {
    for (auto& g : chosen) (void)wait_all(g.works);  // the launch's failure is the one raised
    throw;
  }
  return chosen;
}

/// Ends one bucket's gather: hands its Works back to exec (comm/stream_order.hpp: on a host
/// communicator the host waits) and copies its received tail into the arena. Rethrows the
/// first failure of its Works (then the tail is left as it was).
template <class S, class Exec>
void finish_gather_part(const Exec& exec, const ShardLayout& layout, S* data, S* staging,
                        GatherInFlight& gather) {
  std::vector<Work> works = std::move(gather.works);
  gather.works.clear();
  const std::exception_ptr failure = launch_and_hand_back(works, exec, [] {});
  if (failure) std::rethrow_exception(failure);
  const ShardedBucket* b = gather.bucket;
  if (b->tail == 0) return;
  const std::size_t n = layout.world_size();
  const S* received = staging + b->staging_offset + b->part + 1;
  for_each_index(exec, b->tail, copy_range<S>{received, data + b->offset + n * b->part});
}

/// Makes data[begin, end) whole on every rank (start_gather_parts, then finish_gather_part for
/// every bucket): on a communicator that orders on the device the host waits for none of it
/// (exec's later work sees the parameters; a host read needs exec.synchronize()), on a host one
/// it waits as the contract says. `staging` must stay alive until exec's queued work has run (a
/// Buffer made with exec is freed in its stream order). Rethrows the first failure, after every
/// bucket's Works have ended.
template <class S, class Space, class Comm, class Exec>
void all_gather_parts(Comm& comm, const Exec& exec, const ShardLayout& layout, S* data, S* staging,
                      std::size_t begin, std::size_t end) {
  auto gathers = start_gather_parts<S, Space>(comm, exec, layout, data, staging, begin, end,
                                              GatherOrder::buckets);
  std::exception_ptr failure;
  for (auto& g : gathers) {
    if (failure) {
      (void)wait_all(g.works);
      continue;
    }
    try {
      finish_gather_part(exec, layout, data, staging, g);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace detail::ddp
}  // namespace tandem
