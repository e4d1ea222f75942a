// tandem/comm/nccl/options.hpp - tandem::NcclCommOptions, how an NcclComm is made and behaves
// (timeout, streams, device, watchdog interval, the collective check).
//   auto comm = tandem::init_process_group<tandem::NcclComm>(world, "env://", {.timeout = 60s});
// Needs: the CUDA runtime's header (cudaStream_t).
#pragma once

#include <cuda_runtime.h>

#include <chrono>

#include "tandem/comm/checked.hpp"
#include "tandem/core/timeout.hpp"

namespace tandem {

/// How an NcclComm is made and behaves.
struct NcclCommOptions {
  /// How long one operation may take from being issued to finishing on the GPU before the
  /// watchdog aborts the communicator; also bounds the rendezvous, NCCL's initialisation and
  /// every host wait. PyTorch's NCCL default.
  Timeout timeout = std::chrono::minutes(10);
  /// The caller's stream (see the top of this header). cudaStreamPerThread: the default stream
  /// of whichever thread issues the operation.
  cudaStream_t stream = cudaStreamPerThread;
  /// The GPU of this rank; -1: the device current on the thread that makes the communicator.
  int device = -1;
  /// How often the watchdog looks at NCCL's error state and the operations' ages while no
  /// `_async` Work waits (with one waiting, it looks every 50 microseconds, so that
  /// Work::wait() returns promptly).
  std::chrono::milliseconds watchdog_interval{100};
  /// Priority of the communicator's stream (lower runs first; cudaDeviceGetStreamPriorityRange).
  int stream_priority = 0;
  /// Where a sync operation (outside an NcclGroup) runs. true: on the caller's stream itself,
  /// which it would wait for anyway, so that nothing is handed between streams (one event
  /// for the watchdog is the whole per-call cost). false: on the communicator's stream, with
  /// an event each way, as the `_async` forms and PyTorch's ProcessGroupNCCL do.
  bool sync_on_caller_stream = true;
  /// Whether every collective's fingerprint (operation, element type, count, root, reduce op,
  /// how many came before) is compared across ranks before it runs, so that a mismatch is an
  /// Error naming both sides instead of a hang or mixed data. Unset: TANDEM_CHECK_COLLECTIVES,
  /// else off - on NCCL each check is an all-gather the host waits for, which stalls the
  /// caller's pipelining (see the top of this header).
  CollectiveCheck check_collectives{};
};

}  // namespace tandem
