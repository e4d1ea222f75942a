// tandem/comm/mpi/detail/worker.hpp - the threads an MpiComm keeps beside the caller's: the
// Worker, which runs `_async` collectives in MPI's blocking form one at a time (with a watchdog
// that fails the Work of one past its deadline), and the BlockingWatchdog, which ends the job when
// a blocking MPI call on the calling thread outlasts the timeout.
//   worker.add(std::move(call), state);   watchdog.begin("all_reduce"); ...; watchdog.end();
// Needs: an MPI (C API, MPI-3) and threads. Not a public header: mpi.hpp uses it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <mpi.h>
#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

#include "tandem/comm/checked.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/flight_monitor.hpp"
#include "tandem/comm/mpi/detail/mpi_runtime.hpp"
#include "tandem/comm/mpi/detail/progress.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"

namespace tandem::detail::mpi {

/// An `_async` collective queued for (or inside) the Worker's blocking call.
struct Queued {
  Queued(Call c, std::shared_ptr<WorkState> s, Deadline d, std::uint64_t n)
      : call(std::move(c)), state(std::move(s)), deadline(d), number(n) {}

  Call call;
  std::shared_ptr<WorkState> state;
  Deadline deadline;
  std::uint64_t number;  // in queueing order: tells the watchdog a new front from an old one
  bool started = false;  // the worker has entered its MPI call
  bool settled = false;  // its Work has completed or failed (by the worker or on a timeout)
};

/// The `_async` collectives of one communicator, run in MPI's blocking form (as PyTorch's
/// ProcessGroupMPI does): MPI never matches a blocking collective with a non-blocking one, so
/// running every collective blocking lets ranks mix sync and `_async` forms freely. A worker
/// thread takes them in queueing order, one at a time, runs the call and its `finish` and then
/// completes the Work. Needs MPI_THREAD_MULTIPLE (the caller's thread calls MPI meanwhile).
///
/// A blocked MPI call cannot be cancelled. A watchdog thread fails the Work of a collective not
/// complete at its deadline (and of every one queued behind it) and breaks the queue: nothing
/// more runs, the worker stays in MPI until MPI lets it go. Stopping waits for the queue at most
/// the timeout; a worker still inside MPI then is detached, and frees the communicator and
/// releases the runtime itself if MPI ever returns (until then MPI is not finalised at exit).
class Worker {
 public:
  Worker(Runtime& runtime, MPI_Comm comm, int rank, int size, Timeout timeout)
      : shared_(std::make_shared<Shared>(runtime, comm, rank, size, timeout)) {
    // The worker co-owns the shared state, so that it may outlive this object when detached.
    worker_ = std::thread([shared = shared_] { work(shared); });
    try {
      watchdog_ = std::thread([this] { watch(); });
    } catch (...) {
      {
        std::lock_guard lock(shared_->mutex);
        shared_->stopping = true;
      }
      shared_->changed.notify_all();
      worker_.join();
      throw;
    }
  }

  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  ~Worker() { (void)stop(); }

  /// Queues `call`; `state` completes (or fails) once the worker has run it. Fails `state` at
  /// once where the queue is broken.
  void add(Call call, std::shared_ptr<WorkState> state) {
    std::optional<Error> refused;
    {
      std::lock_guard lock(shared_->mutex);
      if (shared_->broken) {
        refused = unusable(call.operation);
      } else {
        shared_->queue.push_back(std::make_unique<Queued>(
            std::move(call), state, Deadline(shared_->timeout), shared_->next_number++));
      }
    }
    if (refused) {
      state->fail(std::make_exception_ptr(*refused));
    } else {
      shared_->changed.notify_all();
    }
  }

  /// Blocks until every queued collective has run (or the queue broke); false at `timeout`.
  bool wait_idle(Timeout timeout) {
    const Deadline deadline(timeout);  // saturates: Timeout::max() means forever
    std::unique_lock lock(shared_->mutex);
    return shared_->changed.wait_until(
        lock, deadline.at(), [&] { return shared_->queue.empty() || shared_->broken.has_value(); });
  }

  /// Why the communicator is unusable, if it is.
  [[nodiscard]] std::optional<std::string> broken() const {
    std::lock_guard lock(shared_->mutex);
    return shared_->broken;
  }

  /// Waits for the queue, at most the timeout, and ends both threads. True when the worker
  /// ended; false when it was still inside an MPI call and has been detached (it then frees the
  /// communicator and releases the runtime itself, once MPI returns). Idempotent.
  bool stop() {
    if (!watchdog_.joinable()) return !detached_;
    Failures failed;
    {
      const Deadline deadline(shared_->timeout);
      std::unique_lock lock(shared_->mutex);
      shared_->stopping = true;
      shared_->changed.notify_all();
      // A queue that broke on a timeout holds a collective blocked in MPI for good: waiting
      // another timeout for it would only delay the end of the job.
      shared_->changed.wait_until(lock, deadline.at(), [&] {
        return shared_->queue.empty() || shared_->broken.has_value();
      });
      if (!shared_->queue.empty()) {
        failed = break_queue(shared_->broken
                                 ? "the communicator was destroyed after an operation had timed "
                                   "out (it stays blocked in MPI)"
                                 : "the communicator was destroyed, and waited " +
                                       describe(shared_->timeout) + " for it");
        detached_ = true;
        shared_->release_comm = true;
      }
      shared_->watching = false;
    }
    shared_->changed.notify_all();
    settle(failed);
    watchdog_.join();
    if (detached_) {
      worker_.detach();
    } else {
      worker_.join();
    }
    return !detached_;
  }

 private:
  struct Shared {
    Shared(Runtime& r, MPI_Comm c, int k, int n, Timeout t)
        : runtime(r), comm(c), rank(k), size(n), timeout(t) {}

    Runtime& runtime;
    MPI_Comm comm;
    int rank;
    int size;
    Timeout timeout;
    std::mutex mutex;
    std::condition_variable changed;
    std::deque<std::unique_ptr<Queued>> queue;  // the front one is the worker's
    std::uint64_t next_number = 0;
    std::optional<std::string> broken;
    bool stopping = false;      // no more add(); the worker ends once the queue is empty
    bool watching = true;       // the watchdog runs until stop() has decided
    bool release_comm = false;  // detached: the worker frees `comm` and releases the runtime
  };

  static void work(const std::shared_ptr<Shared>& shared) {
    yield_to_callers();
    std::unique_lock lock(shared->mutex);
    for (;;) {
      shared->changed.wait(lock, [&] { return shared->stopping || !shared->queue.empty(); });
      if (shared->queue.empty()) break;
      Queued& job = *shared->queue.front();
      job.started = true;
      lock.unlock();
      MPI_Status status{};
      std::string mismatch;
      int code = MPI_SUCCESS;
      if (job.call.fingerprint) {
        code = compare_fingerprints(shared->runtime, shared->comm, shared->size,
                                    *job.call.fingerprint, false, mismatch);
      }
      // Every rank found the same mismatch: none makes the call, and the queue goes on.
      if (code == MPI_SUCCESS && mismatch.empty()) code = job.call.blocking(&status);
      lock.lock();
      if (!job.settled) {  // else its Work failed on a timeout: leave its buffers alone
        job.settled = true;
        lock.unlock();
        try {
          if (code != MPI_SUCCESS) throw error(shared->rank, job.call.operation, code);
          if (!mismatch.empty()) throw Error(shared->rank, job.call.operation, mismatch);
          if (job.call.finish) job.call.finish(status);
          job.state->complete();
        } catch (...) {
          job.state->fail(std::current_exception());
        }
        lock.lock();
      }
      // Off the queue only now: a sync collective waiting for the queue sees finish's results.
      shared->queue.pop_front();
      shared->changed.notify_all();
    }
    if (!shared->release_comm) return;
    lock.unlock();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&shared->comm);
    shared->runtime.detach();
  }

  /// Fails the queue's front collective when its deadline passes (the front has the earliest
  /// deadline: all are queued with one timeout, in order).
  void watch() {
    yield_to_callers();
    std::unique_lock lock(shared_->mutex);
    for (;;) {
      shared_->changed.wait(lock, [&] {
        return !shared_->watching ||
               (!shared_->broken && !shared_->queue.empty() && !shared_->queue.front()->settled);
      });
      if (!shared_->watching) return;
      const std::uint64_t front = shared_->queue.front()->number;
      const auto deadline = shared_->queue.front()->deadline.at();
      const bool moved_on = shared_->changed.wait_until(lock, deadline, [&] {
        return !shared_->watching || shared_->broken || shared_->queue.empty() ||
               shared_->queue.front()->number != front || shared_->queue.front()->settled;
      });
      if (moved_on) continue;
      Failures failed = break_queue("it did not complete within " + describe(shared_->timeout) +
                                    " (a rank may not have called it)");
      lock.unlock();
      shared_->changed.notify_all();
      settle(failed);
      lock.lock();
    }
  }

  using Failures = std::vector<std::pair<std::shared_ptr<WorkState>, Error>>;

  /// Makes the calling thread (the worker or the watchdog) one that never preempts another on
  /// waking (Linux's SCHED_BATCH; same share of the CPU otherwise). Woken by add(), the worker
  /// used to take the CPU of the thread that queued the collective and spin in MPI, so that
  /// thread - the backward pass that should go on computing - got it back only when the
  /// collective ended. A free CPU still runs it at once. Best effort: a refusal changes nothing.
  static void yield_to_callers() noexcept {
#ifdef __linux__
    sched_param param{};
    param.sched_priority = 0;
    (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
#endif
  }

  /// Under the lock: the front collective fails because `why`; the communicator becomes unusable
  /// (before any Work fails, so that whoever sees a failure also finds it so) and the ones queued
  /// behind the front fail unstarted. Returns the failures to settle outside the lock.
  Failures break_queue(const std::string& why) {
    auto& queue = shared_->queue;
    const char* operation = queue.front()->call.operation;
    if (!shared_->broken) {
      shared_->broken = std::string("an earlier `_async` ") + operation + " failed: " + why +
                        ", and MPI cannot cancel a collective";
    }
    Failures failed;
    for (auto it = queue.begin(); it != queue.end();) {
      Queued& job = **it;
      if (!job.settled) {
        job.settled = true;
        if (it == queue.begin()) {
          failed.emplace_back(job.state,
                              Error(shared_->rank, operation,
                                    why + ". MPI cannot cancel a collective: this communicator "
                                          "is now unusable and MPI may still write the "
                                          "operation's buffers, so end the job (MPI_Abort)"));
        } else {
          failed.emplace_back(job.state, unusable(job.call.operation));
        }
      }
      if (job.started) {
        ++it;  // the worker removes it once MPI returns
      } else {
        it = queue.erase(it);
      }
    }
    return failed;
  }

  /// Under the lock, once broken.
  [[nodiscard]] Error unusable(const char* operation) const {
    return Error(shared_->rank, operation, "this communicator is unusable: " + *shared_->broken);
  }

  static void settle(Failures& failed) {
    for (auto& [state, error] : failed) state->fail(std::make_exception_ptr(std::move(error)));
  }

  std::shared_ptr<Shared> shared_;
  bool detached_ = false;
  std::thread worker_;
  std::thread watchdog_;
};

/// The exit status of a job the watchdog ended (MPI_Abort's error code): GNU timeout's.
inline constexpr int watchdog_exit_code = 124;

/// Watches the blocking MPI call a communicator makes on the calling thread (sync collectives,
/// send, recv, split): MPI cannot time one out or cancel it, so a peer that stopped or never
/// calls would hang this rank forever. Past the timeout the watchdog prints the tandem::Error
/// (rank, operation, how long, the timeout) to stderr and ends the job: MPI_Abort on
/// MPI_COMM_WORLD with watchdog_exit_code, which ends every process of the job (the stopped one
/// too). Where the thread level forbids this thread to call MPI (FUNNELED, SINGLE) it ends this
/// process with that code instead (std::_Exit; mpirun then ends the others, as for any process
/// that exits without MPI_Finalize); where calls are serialized it takes the runtime's lock
/// first (no thread ever blocks inside MPI holding it).
///
/// Cost on the calling thread: begin() reads the clock and makes two atomic stores, end() one.
/// The watchdog thread wakes every timeout / 8 (10 ms .. 500 ms) to look.
class BlockingWatchdog {
 public:
  BlockingWatchdog(Runtime& runtime, int rank, Timeout timeout)
      : runtime_(runtime), rank_(rank), timeout_(timeout) {
    if (timeout_ == Timeout::max()) return;  // forever: nothing to watch for
    thread_ = std::thread([this] { watch(); });
  }
  BlockingWatchdog(const BlockingWatchdog&) = delete;
  BlockingWatchdog& operator=(const BlockingWatchdog&) = delete;
  ~BlockingWatchdog() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  /// A blocking call named `operation` (a string literal) starts on the calling thread.
  void begin(const char* operation) noexcept {
    started_.store(now(), std::memory_order_relaxed);
    operation_.store(operation, std::memory_order_release);
  }
  /// It returned.
  void end() noexcept { operation_.store(nullptr, std::memory_order_release); }

  /// The Error the watchdog prints for `operation`, in flight for `elapsed`.
  [[nodiscard]] Error error(const char* operation, std::chrono::nanoseconds elapsed) const {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count();
    return Error(rank_, operation,
                 "no progress after " + std::to_string(ms / 1000) + "." +
                     std::to_string(ms % 1000 / 100) + " s, over the timeout of " +
                     describe(timeout_) +
                     ": a rank has stopped, died or not called it. MPI cannot cancel a blocking "
                     "call, so the watchdog ends the job (exit code " +
                     std::to_string(watchdog_exit_code) + ")");
  }

 private:
  static std::int64_t now() noexcept {
    return std::chrono::steady_clock::now().time_since_epoch().count();
  }

  void watch() {
    const auto period = std::clamp<Timeout>(timeout_ / 8, std::chrono::milliseconds(10),
                                            std::chrono::milliseconds(500));
    const auto limit = std::chrono::duration_cast<std::chrono::steady_clock::duration>(timeout_);
    std::unique_lock lock(mutex_);
    while (!wake_.wait_for(lock, period, [&] { return stopping_; })) {
      const char* operation = operation_.load(std::memory_order_acquire);
      const std::int64_t started = started_.load(std::memory_order_relaxed);
      if (operation == nullptr) continue;
      const std::chrono::steady_clock::duration elapsed(now() - started);
      if (elapsed <= limit) continue;
      // Still the same call (a new one would have a new start)?
      if (operation_.load(std::memory_order_acquire) != operation ||
          started_.load(std::memory_order_relaxed) != started) {
        continue;
      }
      end_job(error(operation, elapsed));
    }
  }

  [[noreturn]] void end_job(const Error& error) {
    std::fprintf(stderr, "%s\n", error.what());
    std::fflush(stderr);
    // The job ends now: this is the flight record's last chance (every rank's watchdog fires).
    FlightRegistry::instance().dump_on_failure(error.what());
    if (!runtime_.eager()) {
      // Where serialized, MPI calls take turns on the runtime's lock; a thread polling a request
      // holds it only for one MPI_Test.
      auto lock = runtime_.lock();
      MPI_Abort(MPI_COMM_WORLD, watchdog_exit_code);
    }
    std::_Exit(watchdog_exit_code);
  }

  Runtime& runtime_;
  int rank_;
  Timeout timeout_;
  std::atomic<std::int64_t> started_{0};
  std::atomic<const char*> operation_{nullptr};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;  // last: started once everything above is ready
};

}  // namespace tandem::detail::mpi
