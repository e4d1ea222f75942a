// tandem/ddp/detail/arena_access.hpp - what DistributedDataParallel does to its arena's memory:
// the per-element kernels of a step (division, 16-bit compression and back, control values), the
// small control arrays of the registration check, and ArenaAccess, behind which the arena's
// element type, memory space and executor are the constructor's choice, not the class's.
//   detail::ddp::ArenaAccessFor<Comm, Config, float, host, host_exec> access(comm, params, exec,
//   layout);
// Needs: what ddp/ddp.hpp needs; included by it, not by users.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/arena/parameters.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/error.hpp"
#include "tandem/ddp/buckets.hpp"
#include "tandem/ddp/detail/shared_grads.hpp"
#include "tandem/ddp/policies.hpp"
#include "tandem/ddp/shards.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::detail::ddp {

/// g[i] /= divisor, computed in opmath_t<T> (how pre-division keeps 16-bit sums in range).
template <class T>
struct divide {
  T* g;
  opmath_t<T> divisor;
  TANDEM_HD void operator()(std::size_t i) const {
    g[i] = static_cast<T>(static_cast<opmath_t<T>>(g[i]) / divisor);
  }
};

/// wire[i] = W(g[i] / divisor): the bucket as it travels under compress<W>.
template <class T, class W>
struct compress_into {
  const T* g;
  W* wire;
  float divisor;
  TANDEM_HD void operator()(std::size_t i) const {
    wire[i] = W(static_cast<float>(g[i]) / divisor);
  }
};

/// g[i] = T(wire[i]): the reduced bucket written back in the gradients' precision.
template <class T, class W>
struct expand_from {
  const W* wire;
  T* g;
  TANDEM_HD void operator()(std::size_t i) const {
    g[i] = static_cast<T>(static_cast<float>(wire[i]));
  }
};

/// data[i] = value; writes small control values (hashes, names) in any memory space.
template <class T>
struct store_value {
  T* data;
  T value;
  TANDEM_HD void operator()(std::size_t) const { *data = value; }
};

/// Reads data[0] back through a reduction of one element (the executor's way to the host).
template <class T>
struct load_value {
  const T* data;
  TANDEM_HD T operator()(std::size_t) const { return *data; }
};

/// Small arrays of control data (registration hashes and texts) in the communicator's memory
/// space, written and read one element at a time through the executor on devices.
template <class T, class Space, class Exec>
class ControlArray {
 public:
  ControlArray(const Exec& exec, std::size_t count) : exec_(exec), storage_(count) {
    if constexpr (!host_accessible<Space>) {
      for (std::size_t i = 0; i < count; ++i) set(i, T{});
    }
  }
  void set(std::size_t i, T value) {
    if constexpr (host_accessible<Space>) {
      storage_[i] = value;
    } else {
      for_each_index(exec_, 1, store_value<T>{storage_.data() + i, value});
    }
  }
  [[nodiscard]] T get(std::size_t i) const {
    if constexpr (host_accessible<Space>) {
      return storage_[i];
    } else {
      exec_.synchronize();
      return transform_reduce(exec_, 1, T{}, load_value<T>{storage_.data() + i}, plus_combine{});
    }
  }
  [[nodiscard]] View<T, Space> view() { return storage_.view(); }
  [[nodiscard]] std::size_t size() const noexcept { return storage_.size(); }

 private:
  const Exec& exec_;
  Buffer<T, Space> storage_;
};

/// wait_gathered's bucket index for every bucket.
inline constexpr std::size_t all_buckets = static_cast<std::size_t>(-1);

/// Stands in for the wire buffer when no compress<W> policy is given.
struct no_wire {};

/// What DistributedDataParallel does to the arena's memory in a step. Behind this interface the
/// arena's element type, memory space and executor are chosen by the constructor, not by the
/// class's type; it is called once per bucket (and once per unused parameter), never per element.
template <class Comm>
class ArenaAccess {
 public:
  ArenaAccess() = default;
  ArenaAccess(const ArenaAccess&) = delete;
  ArenaAccess& operator=(const ArenaAccess&) = delete;
  virtual ~ArenaAccess() = default;

  /// Writes zeros over `count` gradients from `offset`, on the executor.
  virtual void zero_grads(std::size_t offset, std::size_t count) = 0;
  /// Divides bucket `k` by `divisor` (1: leaves it) or compresses it, orders the communicator
  /// after the executor's writes (order_after) and starts its all_reduce (under shard<2>: its
  /// reduce_scatter and its tail's all_reduce), adding the Works to `works`.
  virtual void launch(Comm& comm, const Bucket& bucket, std::size_t k, double divisor,
                      std::vector<Work>& works) = 0;
  /// Hands every Work back to the executor (hand_back; after a `failure` of their launch, waits
  /// for them on the host). Returns the first failure: `failure`, then the Works' in order.
  virtual std::exception_ptr hand_back(std::vector<Work>& works, std::exception_ptr failure) = 0;
  /// shard<2>: copies each bucket's reduce-scattered part into the rank's own gradients (where
  /// it did not land there: lends_memory).
  virtual void settle_shards() = 0;
  /// ZeRO: all-gathers the parameter values from every rank's own parts. Collective. `ahead`
  /// (prefetch_parameters): leaves the buckets' gathers in flight, forward order, until
  /// wait_gathered; else they have ended (as the stream-ordering contract says) on return.
  virtual void gather_values(Comm& comm, bool ahead) = 0;
  /// Ends bucket k's gather in flight (all_buckets: every one); nothing for a bucket not in
  /// flight. Rethrows the first failure, after every Work asked for has ended.
  virtual void wait_gathered(std::size_t k) = 0;
  /// Whether bucket k's gather is ended (or was never started).
  [[nodiscard]] virtual bool gathered(std::size_t k) const = 0;
  /// Writes the reduced 16-bit buckets back in the gradients' precision (compress<W> only).
  virtual void expand(const std::vector<Bucket>& buckets) = 0;
  /// Broadcasts the buffers from `root`, and the trained values too when `values_too`.
  virtual void broadcast(Comm& comm, bool values_too, int root) = 0;
};

/// ArenaAccess for an arena of T in Space, processed on Exec, under the policies of Config.
/// Holds the arena by address (so it sees the storage EMA swaps in) and the executor by value.
template <class Comm, class Config, class T, class Space, class Exec>
class ArenaAccessFor final : public ArenaAccess<Comm> {
 public:
  /// Collective where Comm lends memory under ZeRO (the staging: ShardStaging).
  ArenaAccessFor(Comm& comm, Parameters<T, Space>& params, const Exec& exec,
                 const ShardLayout& layout)
      : params_(&params), exec_(exec), layout_(&layout) {
    if constexpr (Config::compressed) wire_ = Buffer<wire_type, Space>(params.numel());
    if constexpr (Config::shard_stage > 0)
      staging_ = ShardStaging<T, Space>(comm, layout.staging());
  }

  void zero_grads(std::size_t offset, std::size_t count) override {
    for_each_index(exec_, count, fill_zero<T>{grads() + offset});
  }

  void launch(Comm& comm, const Bucket& bucket, std::size_t k, double divisor,
              std::vector<Work>& works) override {
    T* g = grads() + bucket.offset;
    if constexpr (Config::compressed) {
      wire_type* wire = wire_.data() + bucket.offset;
      const auto by = static_cast<float>(divisor);
      for_each_index(exec_, bucket.count, compress_into<T, wire_type>{g, wire, by});
      order_bucket(comm);
      works.push_back(
          comm.all_reduce_async(View<wire_type, Space>(wire, bucket.count), ReduceOp::sum));
    } else {
      if (divisor != 1.0) {
        for_each_index(exec_, bucket.count, divide<T>{g, static_cast<opmath_t<T>>(divisor)});
      }
      order_bucket(comm);
      if constexpr (Config::shard_stage == 2) {
        // The equal parts straight from the arena into this rank's staging - or, where the
        // communicator lends memory, in place into this rank's own part of the gradients; the
        // tail (fewer elements than ranks) all-reduced in place, which also leaves its owner its
        // element.
        const ShardedBucket& b = layout_->buckets()[k];
        const auto parts = static_cast<std::size_t>(comm.size()) * b.part;
        if (b.part > 0) {
          T* part = lends_memory<Comm, Space> ? g + layout_->rank() * b.part
                                              : staging_.data() + b.staging_offset;
          works.push_back(comm.reduce_scatter_async(View<T, Space>(g, parts),
                                                    View<T, Space>(part, b.part), ReduceOp::sum));
        }
        if (b.tail > 0) {
          works.push_back(comm.all_reduce_async(View<T, Space>(g + parts, b.tail), ReduceOp::sum));
        }
      } else {
        works.push_back(comm.all_reduce_async(View<T, Space>(g, bucket.count), ReduceOp::sum));
      }
    }
  }

  std::exception_ptr hand_back(std::vector<Work>& works, std::exception_ptr failure) override {
    return launch_and_hand_back(works, exec_, [&] {
      if (failure) std::rethrow_exception(failure);
    });
  }

  void settle_shards() override {
    if constexpr (Config::shard_stage == 2 && !lends_memory<Comm, Space>) {
      const std::size_t r = layout_->rank();
      for (const auto& b : layout_->buckets()) {
        if (b.part == 0) continue;
        for_each_index(
            exec_, b.part,
            copy_range<T>{staging_.data() + b.staging_offset, grads() + b.offset + r * b.part});
      }
    }
  }

  ~ArenaAccessFor() override {
    for (auto& g : in_flight_) (void)wait_all(g.works);  // staging_ outlives what reads it
  }

  void gather_values(Comm& comm, bool ahead) override {
    if constexpr (Config::shard_stage > 0) {
      wait_gathered(all_buckets);  // the previous step's, should any be left
      T* values = params_->values().data();
      if (!ahead) {
        all_gather_parts<T, Space>(comm, exec_, *layout_, values, staging_.data(), 0,
                                   params_->numel());
        return;
      }
      in_flight_ = start_gather_parts<T, Space>(comm, exec_, *layout_, values, staging_.data(), 0,
                                                params_->numel(), GatherOrder::forward);
      pending_.assign(layout_->buckets().size(), 0);
      for (const auto& g : in_flight_) pending_[index_of(g)] = 1;
    } else {
      (void)comm;
      (void)ahead;
    }
  }

  void wait_gathered(std::size_t k) override {
    std::exception_ptr failure;
    for (auto& g : in_flight_) {
      const std::size_t i = index_of(g);
      if (!pending_[i] || (k != all_buckets && i != k)) continue;
      pending_[i] = 0;
      if (failure) {
        (void)wait_all(g.works);
        continue;
      }
      try {
        finish_gather_part(exec_, *layout_, params_->values().data(), staging_.data(), g);
      } catch (...) {
        failure = std::current_exception();
      }
    }
    if (std::none_of(pending_.begin(), pending_.end(), [](unsigned char p) { return p != 0; })) {
      in_flight_.clear();
      pending_.clear();
    }
    if (failure) std::rethrow_exception(failure);
  }

  [[nodiscard]] bool gathered(std::size_t k) const override {
    return k >= pending_.size() || pending_[k] == 0;
  }

  void expand(const std::vector<Bucket>& buckets) override {
    if constexpr (Config::compressed) {
      for (const auto& bucket : buckets) {
        for_each_index(
            exec_, bucket.count,
            expand_from<T, wire_type>{wire_.data() + bucket.offset, grads() + bucket.offset});
      }
    }
  }

  void broadcast(Comm& comm, bool values_too, int root) override {
    tandem::order_after(comm, exec_);  // what the forward (or the caller) queued is written first
    if (values_too) comm.broadcast(params_->values(), root);
    if (params_->buffer_numel() > 0) comm.broadcast(params_->buffer_values(), root);
    tandem::hand_back(comm, exec_);
  }

 private:
  using wire_type = std::conditional_t<Config::compressed, typename Config::wire_type, float>;
  using wire_storage = std::conditional_t<Config::compressed, Buffer<wire_type, Space>, no_wire>;

  [[nodiscard]] T* grads() const { return params_->grads().data(); }

  /// order_after(comm, exec_) before a bucket's collectives: the communicator reads the bucket
  /// after what the executor wrote into it (the backward, the division). The one place a test
  /// build (TANDEM_TEST_DROP_ORDER_AFTER, tests only: tests/unit/ddp/stream_order_test.cu) drops
  /// the contract's call, to show that the simulated GPU catches the race it leaves.
  void order_bucket(Comm& comm) {
#if defined(TANDEM_TEST_DROP_ORDER_AFTER)
    (void)comm;
#else
    tandem::order_after(comm, exec_);
#endif
  }

  /// The index in layout_->buckets() of a gather's bucket.
  [[nodiscard]] std::size_t index_of(const GatherInFlight& g) const {
    return static_cast<std::size_t>(g.bucket - layout_->buckets().data());
  }

  Parameters<T, Space>* params_;
  Exec exec_;
  const ShardLayout* layout_;
  std::vector<GatherInFlight> in_flight_;  // prefetch_parameters: the gathers still on the wire
  std::vector<unsigned char> pending_;     // per bucket: its gather is in in_flight_, not ended
  wire_storage wire_;
  ShardStaging<T, Space> staging_;  // ZeRO: the own parts on the wire (empty without sharding)
};

}  // namespace tandem::detail::ddp
