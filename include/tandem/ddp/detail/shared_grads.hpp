// tandem/ddp/detail/shared_grads.hpp - where DistributedDataParallel's gradients, and ZeRO's
// staging, live: in memory the communicator lends (tandem::SharedMemoryComm: ShmComm's shared
// memory), so that every bucket's all_reduce (or, under shard<2>, reduce_scatter) reads the
// peers' gradients straight from theirs, and the parameters' all_gather reads the peers' own
// parts straight from their staging, with no copy in.
//   const T* grads = detail::ddp::place_grads(comm, params);   // collective
//   detail::ddp::ShardStaging<T, Space> staging(comm, layout.staging());   // collective
// Needs: what ddp/ddp.hpp needs; included by it, not by users.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include "tandem/arena/parameters.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/shared_memory.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::detail::ddp {

/// Whether DistributedDataParallel over Comm puts an arena in Space in memory the communicator
/// lends (its gradients, ZeRO's staging), and so, under shard<2>, reduce-scatters each bucket in
/// place: each rank's reduced part lands in its own gradients, where its optimizer reads it
/// (on ShmComm straight from the peers' gradients when they lie in the block).
template <class Comm, class Space>
inline constexpr bool lends_memory = SharedMemoryComm<Comm>&& std::same_as<Space, host>;

/// Collective. Where `comm` lends shared memory and the arena is on the host, moves the arena's
/// gradients into a block of it (Parameters::move_grads) - on every rank or on none: a rank whose
/// gradients were viewed before (an optimizer or a layer made before DistributedDataParallel
/// holds a view) keeps them where they are, and then so do the others. Where the communicator
/// has no room (an empty block), the gradients stay too. Nothing else changes: the same buckets,
/// the same bits (docs/backends.md, "Buckets in the segment"). Returns where the gradients are.
template <class Comm, class T, class Space>
const T* place_grads(Comm& comm, Parameters<T, Space>& params) {
  if constexpr (lends_memory<Comm, Space>) {
    if (params.numel() > 0 && comm.size() > 1) {
      std::array<std::int32_t, 1> movable{params.grads_viewed() ? 0 : 1};
      comm.all_reduce(std::span<std::int32_t>(movable), ReduceOp::min);
      SharedBlock block;
      if (movable[0] != 0) block = comm.allocate_shared(params.numel() * sizeof(T));
      if (block) (void)params.move_grads(reinterpret_cast<T*>(block.data), std::move(block.keep));
    }
  } else {
    (void)comm;
  }
  return params.grads().data();
}

/// ZeRO's staging (ShardLayout::staging elements: each bucket's own part on the wire, and its
/// tail's padding). Where `comm` lends memory, a block of it (collective: every rank makes one,
/// the same size), so that the parameters' all_gather reads every rank's own part straight from
/// its staging (ShmComm: the all_gather from a block); else - or where the communicator had no
/// room - a Buffer of this rank's.
template <class T, class Space>
class ShardStaging {
 public:
  ShardStaging() = default;
  /// `count` elements; collective where Comm lends memory and the group has several ranks.
  template <class Comm>
  ShardStaging(Comm& comm, std::size_t count) {
    if constexpr (lends_memory<Comm, Space>) {
      if (count > 0 && comm.size() > 1) block_ = comm.allocate_shared(count * sizeof(T));
    } else {
      (void)comm;
    }
    if (!block_) own_ = Buffer<T, Space>(count);
  }

  /// The first element.
  [[nodiscard]] T* data() noexcept {
    return block_ ? reinterpret_cast<T*>(block_.data) : own_.data();
  }
  /// Whether it lies in memory the communicator lent.
  [[nodiscard]] bool shared() const noexcept { return static_cast<bool>(block_); }

 private:
  SharedBlock block_;
  Buffer<T, Space> own_;
};

}  // namespace tandem::detail::ddp
