// tandem/comm/nccl/detail/watchdog.hpp - what never lets an NcclComm hang: the operations in
// flight and their end events, the failure that aborts the communicator (ncclCommAbort) and
// fails their Work, the host waits that poll for it, and the watchdog thread that completes the
// `_async` Works or aborts on NCCL's asynchronous error or an operation older than the timeout.
//   class Engine : public WatchedComm { ... start_watchdog(); ... stop_watchdog(); close(); };
// Needs: CUDA and NCCL. Not a public header: the engine (engine.hpp) derives from it.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tandem/comm/detail/flight_monitor.hpp"
#include "tandem/comm/flight_settings.hpp"
#include "tandem/comm/nccl/detail/nccl_runtime.hpp"
#include "tandem/comm/nccl/detail/nccl_support.hpp"
#include "tandem/comm/nccl/options.hpp"
#include "tandem/comm/work.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/cuda/runtime.hpp"

namespace tandem::detail::nccl {

/// One rank's NCCL communicator as the issuing thread and the watchdog share it: mutex_ keeps
/// the two from calling NCCL on it at once. The engine derives from it, starts the watchdog once
/// it is whole and stops it before it closes the communicator.
class WatchedComm {
 public:
  WatchedComm(const WatchedComm&) = delete;
  WatchedComm& operator=(const WatchedComm&) = delete;

  /// Blocks the host until every operation issued so far has finished on the GPU (or raises the
  /// Error that aborted the communicator).
  void synchronize() {
    DeviceGuard guard(device_);
    cudaEvent_t newest = nullptr;
    {
      std::lock_guard lock(mutex_);
      throw_if_failed("synchronize");
      if (pending_.empty()) return;  // the watchdog has seen every operation finish
      // issue() orders the operations across streams, so the newest one's end covers them all.
      // Its event is recycled only by take_event(), on the issuing thread: this one.
      newest = pending_.back().end;
    }
    wait_on_host(newest, "synchronize");
  }

  /// Work queued on `stream` from now on waits for every operation issued so far.
  void wait_stream(cudaStream_t stream) {
    DeviceGuard guard(device_);
    std::lock_guard lock(mutex_);
    throw_if_failed("wait_stream");
    if (pending_.empty()) return;  // every operation has finished
    cuda::check(cudaStreamWaitEvent(stream, pending_.back().end, 0), "cudaStreamWaitEvent", rank_);
  }

  /// Aborts the communicator from any thread (run_local_nccl does, when a rank fails): the
  /// operations in flight fail, and later calls raise an Error with `cause`.
  void abort(const std::string& cause) {
    std::lock_guard lock(mutex_);
    if (failure_) return;
    abort_locked("abort", sequence_, cause);
  }

  /// Whether an abort has begun (set before ncclCommAbort runs); lock-free, any thread.
  [[nodiscard]] bool aborted() const noexcept { return aborted_.load(std::memory_order_acquire); }

  /// The Error the communicator was aborted with, if it was.
  [[nodiscard]] std::optional<Error> failure() const {
    std::lock_guard lock(mutex_);
    return failure_;
  }

 protected:
  WatchedComm(ncclComm_t comm, int device, NcclCommOptions options)
      : comm_(comm), device_(device), options_(options) {}
  ~WatchedComm() { stop_watchdog(); }

  /// Starts the watchdog thread (last in the engine's constructor: it reads everything).
  void start_watchdog() {
    watchdog_ = std::thread([this] { watch(); });
  }

  /// Stops and joins the watchdog thread (first in the engine's destructor).
  void stop_watchdog() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
  }

  /// settle() with mutex_ released between polls, so the watchdog (or an abort) can step in.
  ncclResult_t settle_locked(std::unique_lock<std::mutex>& lock, ncclComm_t comm,
                             ncclResult_t state, const Deadline& deadline) {
    int spins = 0;
    while (state == ncclInProgress && !failure_) {
      if (deadline.expired()) return ncclInProgress;
      lock.unlock();
      if (++spins < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(spins < 1024 ? 20 : 1000));
      }
      lock.lock();
      if (failure_) break;
      ncclResult_t query = ncclCommGetAsyncError(comm, &state);
      if (query != ncclSuccess) state = query;
    }
    return failure_ ? ncclInternalError : state;
  }

  std::string settle_failure(ncclResult_t state) const {
    if (state == ncclInProgress) {
      return "NCCL did not finish queueing it within " + describe(options_.timeout);
    }
    return error_text(state, comm_);
  }

  void throw_if_failed(const std::string& operation) const {
    if (!failure_) return;
    throw Error(rank_, operation,
                "the communicator was aborted earlier (" + std::string(failure_->what()) + ")");
  }

  /// Records why, aborts NCCL's communicator (its kernels stop, so the streams drain) and fails
  /// every operation in flight. Inside a group the abort waits for the group to end: the
  /// thread's group still refers to the communicator.
  void abort_locked(const std::string& operation, std::uint64_t sequence,
                    const std::string& cause) {
    if (failure_) return;
    if (group_depth_ > 0 && !deferred_abort_) {
      deferred_abort_.emplace(operation, std::make_pair(sequence, cause));
      return;
    }
    const std::string name = operation.find("sequence number") == std::string::npos
                                 ? nccl::describe_operation(operation, sequence)
                                 : operation;
    failure_.emplace(rank_, name, cause);
    aborted_.store(true, std::memory_order_release);
    FlightRegistry::instance().dump_on_failure(failure_->what());  // comm/flight_recorder.hpp
    if (comm_) (void)ncclCommAbort(comm_);
    comm_ = nullptr;
    const auto error = std::make_exception_ptr(*failure_);
    for (auto& pending : pending_) {
      for (auto& work : pending.works) work->fail(error);
      free_events_.push_back(pending.end);
    }
    pending_.clear();
    async_pending_ = 0;
  }

  /// Waits on the host for `event`, polling so that an abort by the watchdog (or a timeout the
  /// watchdog has not seen yet) ends the wait with an Error. An event that has passed is not yet
  /// a result: NCCL may end an operation that failed (a peer that died) and report the failure
  /// only through ncclCommGetAsyncError, so that is asked once more (and aborts) before returning.
  void wait_on_host(cudaEvent_t event, const char* operation) {
    const Deadline deadline(options_.timeout + options_.watchdog_interval * 2);
    int spins = 0;
    for (;;) {
      const cudaError_t status = cudaEventQuery(event);
      if (status == cudaSuccess) {
        std::lock_guard lock(mutex_);
        throw_if_failed(operation);
        if (const ncclResult_t error = async_error(); error != ncclSuccess) {
          const auto [name, sequence] = oldest();
          abort_locked(name, sequence,
                       "NCCL reported an asynchronous error: " + error_text(error, comm_));
          throw_if_failed(operation);
        }
        return;
      }
      if (status != cudaErrorNotReady) cuda::check(status, operation, rank_);
      {
        std::lock_guard lock(mutex_);
        throw_if_failed(operation);
      }
      if (deadline.expired()) {
        abort(std::string(operation) + " waited " + describe(options_.timeout) +
              " on the host without the operations finishing");
        std::lock_guard lock(mutex_);
        throw_if_failed(operation);
      }
      if (++spins < 256) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  cudaEvent_t take_event() {
    if (!free_events_.empty()) {
      const cudaEvent_t event = free_events_.back();
      free_events_.pop_back();
      return event;
    }
    cudaEvent_t event = nullptr;
    cuda::check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                "cudaEventCreateWithFlags", rank_);
    return event;
  }

  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int device_ = 0;
  NcclCommOptions options_;
  int group_depth_ = 0;  ///< open NcclGroups (the issuing thread): an abort waits for their end

  // Shared with the watchdog: guarded by mutex_.
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::uint64_t sequence_ = 0;
  std::deque<Pending> pending_;
  std::size_t async_pending_ = 0;
  std::vector<cudaEvent_t> free_events_;
  std::optional<Error> failure_;
  std::atomic<bool> aborted_{false};  ///< failure_ is set: readable without mutex_
  std::optional<std::pair<std::string, std::pair<std::uint64_t, std::string>>> deferred_abort_;

 private:
  void watch() {
    std::unique_lock lock(mutex_);
    while (!stopping_) {
      const auto interval =
          async_pending_ > 0
              ? std::chrono::microseconds(50)
              : std::chrono::duration_cast<std::chrono::microseconds>(options_.watchdog_interval);
      wake_.wait_for(lock, interval);
      if (stopping_) break;
      if (!failure_ && comm_) inspect();
    }
  }

  /// NCCL's asynchronous error, or ncclSuccess (also while it is still working: ncclInProgress).
  /// mutex_ held, communicator not aborted.
  ncclResult_t async_error() const {
    if (!comm_) return ncclSuccess;
    ncclResult_t state = ncclSuccess;
    if (const ncclResult_t query = ncclCommGetAsyncError(comm_, &state); query != ncclSuccess) {
      return query;
    }
    return state == ncclInProgress ? ncclSuccess : state;
  }

  /// One look: NCCL's asynchronous error state, then the operations in issue order (they finish
  /// in that order: issue() chains them across streams).
  void inspect() {
    ncclResult_t state = ncclSuccess;
    if (const ncclResult_t query = ncclCommGetAsyncError(comm_, &state); query != ncclSuccess) {
      state = query;
    }
    if (state != ncclSuccess && state != ncclInProgress) {
      const auto [name, sequence] = oldest();
      abort_locked(name, sequence,
                   "NCCL reported an asynchronous error: " + error_text(state, comm_));
      return;
    }
    const auto now = Deadline::clock::now();
    bool asked_after_end = false;
    while (!pending_.empty()) {
      Pending& oldest_op = pending_.front();
      const cudaError_t status = cudaEventQuery(oldest_op.end);
      if (status == cudaErrorNotReady) {
        notice_waiting(oldest_op, now);
        if (now - oldest_op.issued > options_.timeout) {
          abort_locked(oldest_op.name(), oldest_op.sequence,
                       "did not finish within " + describe(options_.timeout) +
                           " (a rank that never called it, or called another collective); "
                           "NCCL's state: " +
                           error_text(state, comm_));
        }
        return;
      }
      if (status != cudaSuccess) {
        abort_locked(oldest_op.name(), oldest_op.sequence,
                     std::string("CUDA reported ") + cudaGetErrorName(status) + ": " +
                         cudaGetErrorString(status));
        return;
      }
      // NCCL may end a failed operation (a peer that died) and report it only as an
      // asynchronous error, which may have come after the look above: asked again before the
      // first completion this look hands out.
      if (!asked_after_end) {
        asked_after_end = true;
        if (const ncclResult_t error = async_error(); error != ncclSuccess) {
          abort_locked(oldest_op.name(), oldest_op.sequence,
                       "NCCL reported an asynchronous error: " + error_text(error, comm_));
          return;
        }
      }
      for (auto& work : oldest_op.works) work->complete();
      if (!oldest_op.works.empty()) --async_pending_;
      free_events_.push_back(oldest_op.end);
      pending_.pop_front();
    }
  }

  /// The flight recorder's waiting notice for the GPU's side: NCCL cannot tell the host which
  /// rank is missing, so the line names the operation; the ranks' records say the rest.
  void notice_waiting(const Pending& op, Deadline::clock::time_point now) {
    if (notice_interval_ <= Timeout::zero()) return;
    if (op.sequence != noticed_sequence_) {
      noticed_sequence_ = op.sequence;
      notices_ = 0;
    }
    const auto waited = std::chrono::duration_cast<Timeout>(now - op.issued);
    if (waited < notice_interval_ * (std::int64_t{1} << std::min(notices_, 20))) return;
    ++notices_;
    flight_say("tandem: rank " + std::to_string(rank_) + " has waited " + describe(waited) +
               " for " + op.name() + " to finish on the GPU; timeout in " +
               describe(std::max(options_.timeout - waited, Timeout::zero())));
  }

  std::pair<std::string, std::uint64_t> oldest() const {
    if (pending_.empty()) return {"no operation in flight", sequence_};
    return {pending_.front().name(), pending_.front().sequence};
  }

  std::thread watchdog_;
  Timeout notice_interval_ = safe_notice_interval();  ///< the flight recorder's (watchdog only)
  std::uint64_t noticed_sequence_ = 0;
  int notices_ = 0;

  static Timeout safe_notice_interval() noexcept {
    try {
      return flight_recorder_settings().notice_interval;
    } catch (...) {
      return FlightRecorderSettings{}.notice_interval;  // a bad variable is raised elsewhere
    }
  }
};

}  // namespace tandem::detail::nccl
