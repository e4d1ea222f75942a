// tandem/ddp/policies.hpp - the policies of tandem::DistributedDataParallel (bucket caps,
// overlap or sync_at_end, average or sum, 16-bit compression, buffer broadcast, ZeRO sharding),
// checked at compile time.   DistributedDataParallel<Comm, tandem::bucket_cap<4_MiB>,
// tandem::sync_at_end> ddp(c, p); Needs: the standard library.
#pragma once

#include <cstddef>
#include <type_traits>

#include "tandem/tensor/dtype.hpp"

namespace tandem {

namespace detail::ddp_kind {
// What a policy decides; two policies of one kind in one list contradict or repeat each other.
struct bucket_cap {};
struct first_bucket_cap {};
struct schedule {};
struct reduction {};
struct compression {};
struct buffers {};
struct sharding {};
struct prefetch {};
}  // namespace detail::ddp_kind

/// Largest bucket, in bytes of gradient elements [25 MiB]. A parameter larger than the cap gets a
/// bucket of its own (buckets never split a parameter).
template <std::size_t Bytes>
struct bucket_cap {
  static_assert(Bytes > 0, "tandem: bucket_cap<0> would make no bucket; give a positive size");
  /// The kind of policy this is: a DDP takes at most one of each kind.
  using ddp_policy_kind = detail::ddp_kind::bucket_cap;
  /// The cap, in bytes of gradient elements.
  static constexpr std::size_t bytes = Bytes;
};

/// Cap of the first bucket (the last-registered parameters, whose gradients are ready first), so
/// that communication starts early [1 MiB, or bucket_cap when that is smaller].
template <std::size_t Bytes>
struct first_bucket_cap {
  static_assert(Bytes > 0,
                "tandem: first_bucket_cap<0> would make no bucket; give a positive size");
  /// The kind of policy this is: a DDP takes at most one of each kind.
  using ddp_policy_kind = detail::ddp_kind::first_bucket_cap;
  /// The cap, in bytes of gradient elements.
  static constexpr std::size_t bytes = Bytes;
};

/// Launch each bucket's asynchronous all_reduce as soon as all its gradients are marked ready
/// (in bucket order), overlapping communication with the rest of the backward [default].
struct overlap {
  /// The kind of policy this is (the schedule): a DDP takes at most one of each kind.
  using ddp_policy_kind = detail::ddp_kind::schedule;
  /// True: buckets launch during the backward.
  static constexpr bool overlapped = true;
};

/// Launch every bucket from finish_gradient_sync(): no overlap, the simplest schedule.
struct sync_at_end {
  /// The kind of policy this is (the schedule): a DDP takes at most one of each kind.
  using ddp_policy_kind = detail::ddp_kind::schedule;
  /// False: buckets launch from finish_gradient_sync().
  static constexpr bool overlapped = false;
};

/// Divide each gradient by the world size before summing: every rank ends with the mean, and
/// 16-bit sums stay in range [default].
struct average {
  /// The kind of policy this is (the reduction): a DDP takes at most one of each kind.
  using ddp_policy_kind = detail::ddp_kind::reduction;
  /// True: gradients are divided by the world size.
  static constexpr bool averaged = true;
};

/// Sum the gradients across ranks without dividing.
struct sum {
  /// The kind of policy this is (the reduction): a DDP takes at most one of each kind.
  using ddp_policy_kind = detail::ddp_kind::reduction;
  /// False: gradients are summed.
  static constexpr bool averaged = false;
};

/// The bucket travels as W (tandem::half or tandem::bfloat16) and is written back in the
/// gradients' own precision, as PyTorch's fp16/bf16 compress hooks do.
template <class W>
struct compress {
  static_assert(std::is_same_v<W, half> || std::is_same_v<W, bfloat16>,
                "tandem: compress<W> needs a 16-bit floating type: compress<tandem::half> or "
                "compress<tandem::bfloat16>");
  /// The kind of policy this is (the compression): a DDP takes at most one of each kind.
  using ddp_policy_kind = detail::ddp_kind::compression;
  /// The element type the buckets travel as.
  using wire_type = W;
};

/// Broadcast the buffers (running statistics) from rank 0 in before_forward() [default].
struct broadcast_buffers {
  /// The kind of policy this is (buffers): a DDP takes at most one of each kind.
  using ddp_policy_kind = detail::ddp_kind::buffers;
  /// True: before_forward() broadcasts the buffers from rank 0.
  static constexpr bool enabled = true;
};

/// Leave each rank's buffers as they are: before_forward() does nothing.
struct no_broadcast_buffers {
  /// The kind of policy this is (buffers): a DDP takes at most one of each kind.
  using ddp_policy_kind = detail::ddp_kind::buffers;
  /// False: before_forward() leaves the buffers alone.
  static constexpr bool enabled = false;
};

/// ZeRO: each bucket is cut into world-size parts and rank r owns part r of every bucket; the
/// optimizer (ddp.shard(opt)) keeps state for its own parts only and ddp.step(opt) all-gathers
/// the updated parameters. Stage 1 shards the optimizer state (gradients are all-reduced as
/// without it); stage 2 also shards the gradients: each bucket is reduce-scattered, leaving a
/// rank only its own parts' reduced gradients. See docs/zero.md.
template <int Stage>
struct shard {
  static_assert(Stage == 1 || Stage == 2,
                "tandem: shard<Stage>: stage 1 (optimizer state) or 2 (optimizer state and "
                "gradients); stage 3 (parameters) is not offered");
  /// The kind of policy this is (sharding): a DDP takes at most one of each kind.
  using ddp_policy_kind = detail::ddp_kind::sharding;
  /// The ZeRO stage.
  static constexpr int stage = Stage;
};

/// ZeRO prefetch (with shard<1> or shard<2>): ddp.step(opt) starts the parameters' all_gather,
/// bucket by bucket in forward order, and returns without waiting; ddp.wait_parameters(p) ends
/// the gather of p's bucket just before p's first use in the next forward (ddp.wait_parameters()
/// ends them all), so that the gather overlaps the forward. grad_ready(p) of a parameter whose
/// gather was not waited is an Error; every other call of the DDP waits first. See docs/zero.md.
struct prefetch_parameters {
  /// The kind of policy this is (prefetch): a DDP takes at most one of each kind.
  using ddp_policy_kind = detail::ddp_kind::prefetch;
  /// True: the parameters' all_gather stays in flight after ddp.step(opt).
  static constexpr bool enabled = true;
};

/// Whether P is one of the policies above.
template <class P>
concept ddp_policy = requires {
  typename P::ddp_policy_kind;
};

namespace detail {

/// P's kind, or void for a type that is no policy (so that one static_assert reports it).
template <class P>
struct kind_of {
  using type = void;
};
template <ddp_policy P>
struct kind_of<P> {
  using type = typename P::ddp_policy_kind;
};

template <class Kind, class... Ps>
inline constexpr std::size_t count_kind =
    (std::size_t{0} + ... + (std::is_same_v<typename kind_of<Ps>::type, Kind> ? 1 : 0));

template <class P, class... Ps>
inline constexpr bool has_policy = (std::is_same_v<P, Ps> || ...);

/// The policy of kind Kind in Ps, or Default.
template <class Kind, class Default, class... Ps>
struct find_kind {
  using type = Default;
};
template <class Kind, class Default, class P, class... Ps>
struct find_kind<Kind, Default, P, Ps...> {
  using type = std::conditional_t<std::is_same_v<typename kind_of<P>::type, Kind>, P,
                                  typename find_kind<Kind, Default, Ps...>::type>;
};

struct no_sharding {
  using ddp_policy_kind = ddp_kind::sharding;
  static constexpr int stage = 0;
};

struct no_compression {
  using ddp_policy_kind = ddp_kind::compression;
  using wire_type = void;
};

inline constexpr std::size_t default_bucket_cap_bytes = std::size_t{25} << 20;
inline constexpr std::size_t default_first_bucket_cap_bytes = std::size_t{1} << 20;

/// The settings a list of policies chooses, after the static_asserts that reject impossible or
/// repeated ones.
template <class... Ps>
struct ddp_config {
  static_assert((ddp_policy<Ps> && ...),
                "tandem: DistributedDataParallel<Comm, Policies...>: every policy must be one of "
                "bucket_cap<bytes>, first_bucket_cap<bytes>, overlap, sync_at_end, average, sum, "
                "compress<half>, compress<bfloat16>, broadcast_buffers, no_broadcast_buffers, "
                "shard<1>, shard<2>, prefetch_parameters");
  static_assert(!(has_policy<::tandem::overlap, Ps...> && has_policy<::tandem::sync_at_end, Ps...>),
                "tandem: DistributedDataParallel: overlap and sync_at_end exclude each other; "
                "choose one");
  static_assert(!(has_policy<::tandem::average, Ps...> && has_policy<::tandem::sum, Ps...>),
                "tandem: DistributedDataParallel: average and sum exclude each other; choose one");
  static_assert(!(has_policy<::tandem::broadcast_buffers, Ps...> &&
                  has_policy<::tandem::no_broadcast_buffers, Ps...>),
                "tandem: DistributedDataParallel: broadcast_buffers and no_broadcast_buffers "
                "exclude each other; choose one");
  static_assert(count_kind<ddp_kind::compression, Ps...> <= 1,
                "tandem: DistributedDataParallel: give at most one compress<W> policy");
  static_assert(count_kind<ddp_kind::bucket_cap, Ps...> <= 1,
                "tandem: DistributedDataParallel: bucket_cap is given more than once");
  static_assert(count_kind<ddp_kind::first_bucket_cap, Ps...> <= 1,
                "tandem: DistributedDataParallel: first_bucket_cap is given more than once");
  static_assert(count_kind<ddp_kind::schedule, Ps...> <= 1,
                "tandem: DistributedDataParallel: overlap or sync_at_end is given more than once");
  static_assert(count_kind<ddp_kind::reduction, Ps...> <= 1,
                "tandem: DistributedDataParallel: average or sum is given more than once");
  static_assert(count_kind<ddp_kind::buffers, Ps...> <= 1,
                "tandem: DistributedDataParallel: broadcast_buffers is given more than once");
  static_assert(count_kind<ddp_kind::sharding, Ps...> <= 1,
                "tandem: DistributedDataParallel: shard<Stage> is given more than once");

  using schedule = typename find_kind<ddp_kind::schedule, ::tandem::overlap, Ps...>::type;
  using reduction = typename find_kind<ddp_kind::reduction, ::tandem::average, Ps...>::type;
  using compression = typename find_kind<ddp_kind::compression, no_compression, Ps...>::type;
  using buffers = typename find_kind<ddp_kind::buffers, ::tandem::broadcast_buffers, Ps...>::type;

  static constexpr std::size_t bucket_cap_bytes =
      find_kind<ddp_kind::bucket_cap, ::tandem::bucket_cap<default_bucket_cap_bytes>,
                Ps...>::type::bytes;
  static constexpr std::size_t first_bucket_cap_bytes =
      count_kind<ddp_kind::first_bucket_cap, Ps...> == 1
          ? find_kind<ddp_kind::first_bucket_cap,
                      ::tandem::first_bucket_cap<default_first_bucket_cap_bytes>,
                      Ps...>::type::bytes
          : (bucket_cap_bytes < default_first_bucket_cap_bytes ? bucket_cap_bytes
                                                               : default_first_bucket_cap_bytes);

  static constexpr bool overlapped = schedule::overlapped;
  static constexpr bool averaged = reduction::averaged;
  static constexpr bool broadcasts_buffers = buffers::enabled;
  using wire_type = typename compression::wire_type;  // void: no compression
  static constexpr bool compressed = !std::is_void_v<wire_type>;
  /// The ZeRO stage: 0 (no sharding), 1 or 2.
  static constexpr int shard_stage = find_kind<ddp_kind::sharding, no_sharding, Ps...>::type::stage;
  /// prefetch_parameters: the parameters' all_gather stays in flight after step().
  static constexpr bool prefetches = count_kind<ddp_kind::prefetch, Ps...> > 0;
  static_assert(count_kind<ddp_kind::prefetch, Ps...> <= 1,
                "tandem: DistributedDataParallel: prefetch_parameters is given more than once");
  static_assert(!prefetches || shard_stage > 0,
                "tandem: DistributedDataParallel: prefetch_parameters overlaps ZeRO's parameter "
                "all_gather with the next forward; give it with shard<1> or shard<2>");
  static_assert(!(shard_stage == 2 && compressed),
                "tandem: DistributedDataParallel: shard<2> reduce-scatters the gradients in their "
                "own precision; compress<W> is offered with shard<1> and without sharding only");
};

}  // namespace detail
}  // namespace tandem
