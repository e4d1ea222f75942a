// tandem/comm/shared_memory.hpp - tandem::SharedBlock and the SharedMemoryComm concept: a
// communicator that can lend memory its peers read directly (ShmComm: a block of the node's
// shared memory per rank), so that a collective on a tensor in it needs no copy in.
//   if constexpr (tandem::SharedMemoryComm<Comm>) { tandem::SharedBlock b =
//   comm.allocate_shared(n); }
// Needs: the standard library.
//
// DistributedDataParallel uses it for the arena's gradients (docs/backends.md, "Buckets in the
// segment"); any code that owns a buffer it reduces every step may do the same.
#pragma once

#include <concepts>
#include <cstddef>
#include <memory>

namespace tandem {

/// This rank's part of memory a communicator lends (SharedMemoryComm::allocate_shared): `bytes`
/// bytes at `data`, zeroed, 64-byte aligned, that stay mapped while any copy of `keep` lives -
/// also after the communicator is gone. An empty block (data null) where the communicator had
/// no room for it: the caller keeps its own memory, and collectives take their ordinary path.
struct SharedBlock {
  /// This rank's part, or nullptr.
  std::byte* data = nullptr;
  /// Bytes of it (0 for an empty block).
  std::size_t bytes = 0;
  /// Keeps the mapping alive.
  std::shared_ptr<void> keep;

  /// Whether the communicator lent memory.
  [[nodiscard]] explicit operator bool() const noexcept { return data != nullptr; }
};

/// A communicator that lends memory in which its collectives run faster (without copying a
/// tensor in): `comm.allocate_shared(bytes)` is collective (every rank asks for the same number
/// of bytes, and gets its own part) and may return an empty block. In-place collectives on a
/// tensor that lies in such a block on every rank, at the same offset, use it; any other tensor
/// takes the ordinary path.
template <class C>
concept SharedMemoryComm = requires(C& comm, std::size_t bytes) {
  { comm.allocate_shared(bytes) } -> std::same_as<SharedBlock>;
};

}  // namespace tandem
