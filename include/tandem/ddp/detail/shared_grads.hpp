// tandem/ddp/detail/shared_grads.hpp - where DistributedDataParallel's gradients live: in memory
// the communicator lends (tandem::SharedMemoryComm: ShmComm's shared memory), so that every
// bucket's all_reduce reads the peers' gradients straight from theirs, with no copy in.
//   const T* grads = detail::ddp::place_grads(comm, params);   // collective
// Needs: what ddp/ddp.hpp needs; included by it, not by users.
#pragma once

#include <array>
#include <concepts>
#include <cstdint>
#include <span>
#include <utility>

#include "tandem/arena/parameters.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/shared_memory.hpp"
#include "tandem/tensor/memory.hpp"

namespace tandem::detail::ddp {

/// Collective. Where `comm` lends shared memory and the arena is on the host, moves the arena's
/// gradients into a block of it (Parameters::move_grads) - on every rank or on none: a rank whose
/// gradients were viewed before (an optimizer or a layer made before DistributedDataParallel
/// holds a view) keeps them where they are, and then so do the others. Where the communicator
/// has no room (an empty block), the gradients stay too. Nothing else changes: the same buckets,
/// the same bits (docs/backends.md, "Buckets in the segment"). Returns where the gradients are.
template <class Comm, class T, class Space>
const T* place_grads(Comm& comm, Parameters<T, Space>& params) {
  if constexpr (SharedMemoryComm<Comm> && std::same_as<Space, host>) {
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

}  // namespace tandem::detail::ddp
