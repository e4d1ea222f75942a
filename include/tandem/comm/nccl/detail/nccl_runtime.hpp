// tandem/comm/nccl/detail/nccl_runtime.hpp - what NcclComm's engine stands on: a scope with its
// GPU current (DeviceGuard), an operation in flight (Pending), the polling of a nonblocking NCCL
// communicator (settle) and the making of one rank's communicator within a timeout (init_rank).
//   ncclComm_t comm = tandem::detail::nccl::init_rank(id, rank, size, std::chrono::minutes(10));
// Needs: CUDA and NCCL. Not a public header: the engine uses it.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tandem/comm/nccl/detail/nccl_support.hpp"
#include "tandem/comm/work.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/cuda/runtime.hpp"

namespace tandem::detail::nccl {

/// Makes `device` current for a scope and puts the previous one back.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : target_(device) {
    cuda::check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != target_) cuda::check(cudaSetDevice(target_), "cudaSetDevice");
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (previous_ != target_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  int target_ = 0;
};

/// An operation issued on the communicator's stream and not yet seen finished by the watchdog.
struct Pending {
  std::uint64_t sequence = 0;
  const char* operation = "";  ///< a literal: no allocation per operation
  std::string group;           ///< a group's description (empty for a single operation)
  Deadline::clock::time_point issued{};
  cudaEvent_t end = nullptr;
  std::vector<std::shared_ptr<WorkState>> works;  ///< the `_async` Works it completes

  [[nodiscard]] std::string name() const {
    return group.empty() ? describe_operation(operation, sequence) : group;
  }
};

/// Polls a nonblocking NCCL communicator until its pending call has settled. Returns its final
/// state (ncclSuccess or an error); ncclInProgress past the deadline is reported as such.
inline ncclResult_t settle(ncclComm_t comm, ncclResult_t state, const Deadline& deadline,
                           const std::atomic<bool>* stop = nullptr) {
  int spins = 0;
  while (state == ncclInProgress) {
    if (deadline.expired() || (stop && stop->load())) return ncclInProgress;
    if (++spins < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(spins < 1024 ? 20 : 1000));
    }
    ncclResult_t query = ncclCommGetAsyncError(comm, &state);
    if (query != ncclSuccess) state = query;
  }
  return state;
}

/// Makes this rank's NCCL communicator: nonblocking ncclCommInitRankConfig, polled until every
/// rank has joined or options.timeout has passed (then aborted: a rank that never joins is an
/// Error, not a hang). The device must be current.
inline ncclComm_t init_rank(const ncclUniqueId& id, int rank, int size, Timeout timeout,
                            const std::atomic<bool>* stop = nullptr) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  // NCCL's background initialisation may still write the handle after a timeout: it gets a slot
  // on the heap that is freed only once NCCL is done with it (leaked on the failure paths).
  auto slot = std::make_unique<ncclComm_t>(nullptr);
  const Deadline deadline(timeout);
  ncclResult_t state = ncclCommInitRankConfig(slot.get(), size, id, rank, &config);
  const ncclComm_t comm = *slot;
  // NCCL sets *slot before returning; its job writes it again when it ends. Poll the new
  // communicator until it has settled (ncclCommGetAsyncError then has joined the job's thread).
  if (comm && (state == ncclSuccess || state == ncclInProgress)) {
    state = settle(comm, ncclInProgress, deadline, stop);
  }
  if (state == ncclSuccess) return *slot;
  (void)slot.release();
  std::string why = error_text(state, comm);
  if (state == ncclInProgress) {
    why = stop && stop->load()
              ? "stopped while waiting for the other ranks (another rank failed)"
              : "not every one of the " + std::to_string(size) + " ranks joined within " +
                    describe(timeout) + " (a rank that never started, or another unique id)";
  }
  if (comm) (void)ncclCommAbort(comm);
  throw Error(rank, "NcclComm init", why);
}

}  // namespace tandem::detail::nccl
