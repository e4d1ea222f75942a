// What runs on a stream: a Launch (one ungrouped NCCL call, or one ncclGroupEnd's operations of
// the communicators that share streams) is a host function queued with cudaLaunchHostFunc. It
// waits for its turn on each communicator (a communicator's work runs in issue order, as NCCL's
// does across streams), then advances every operation as far as the other ranks allow until all
// have finished, the communicator is aborted, or a peer is gone.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "state.hpp"

namespace simnccl {

enum class Kind : std::uint8_t {
  all_reduce,
  reduce,
  broadcast,
  all_gather,
  reduce_scatter,
  send,
  recv
};

/// One operation of one rank. Gather, scatter and all-to-all become sends and receives (as in
/// NCCL 2.28); the other collectives run in rounds through the segment's slots.
struct Op {
  Kind kind = Kind::all_reduce;
  const char* api = "";        ///< the NCCL call it came from, for messages
  CommState* comm = nullptr;   ///< held by the launch (CommState::hold) until its work has run
  Segment* segment = nullptr;  ///< the communicator's: alive while the communicator is
  const std::byte* send = nullptr;
  std::byte* recv = nullptr;
  std::size_t count = 0;  ///< elements (per rank for all-gather and reduce-scatter)
  ncclDataType_t type = ncclFloat32;
  ncclRedOp_t op = ncclSum;
  int root = 0;  ///< the root, or the peer of a send or receive
  cudaStream_t stream = nullptr;

  // Progress (the launch's host function only).
  bool done = false;
  int phase = 0;
  std::size_t offset = 0;  ///< elements (collectives) or bytes (point to point) done
  std::size_t chunk = 0;
  std::uint64_t round = 0;
  std::uint64_t end = 0;  ///< a send: where its message ends in the ring
  std::size_t comm_index = 0;
};

/// Queues `ops` (one group's, or one call's) on their streams: operations that share a
/// communicator or a stream run as one host function, on the first one's stream (the others
/// joined to it by events). Returns ncclInProgress where stress mode delayed a launch of a
/// nonblocking communicator.
ncclResult_t launch(std::vector<Op> ops);

}  // namespace simnccl
