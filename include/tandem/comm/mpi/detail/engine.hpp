// tandem/comm/mpi/detail/engine.hpp - detail::mpi::Engine, one MpiComm's per-rank state: its MPI
// communicator, the `_async` worker, the progress thread and the watchdog of blocking calls, and
// how a Call runs on this thread (run) or is handed on with its Work (launch).
//   engine.run(call);   tandem::Work work = engine.launch(std::move(call));
// Needs: an MPI (C API, MPI-3) and threads. Not a public header: mpi.hpp uses it.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <mpi.h>

#include "tandem/comm/checked.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/mpi/detail/mpi_runtime.hpp"
#include "tandem/comm/mpi/detail/worker.hpp"
#include "tandem/comm/mpi/options.hpp"
#include "tandem/comm/work.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem::detail::mpi {

/// One communicator's engine: the MPI handle, the collective worker and the progress thread.
/// Heap-allocated and owned by the MpiComm, so their threads may point at it while it moves.
class Engine {
 public:
  /// `checks_collectives`: options.check_collectives resolved (the same on every rank: see
  /// duplicate()).
  Engine(Runtime& runtime, MPI_Comm comm, MpiCommOptions options, bool checks_collectives)
      : runtime_(runtime), comm_(comm), options_(options), checks_collectives_(checks_collectives) {
    runtime_.attach();
    {
      auto lock = runtime_.lock();
      MPI_Comm_rank(comm_, &rank_);
      MPI_Comm_size(comm_, &size_);
      void* value = nullptr;
      int found = 0;
      MPI_Comm_get_attr(comm_, MPI_TAG_UB, &value, &found);
      if (found && value) tag_upper_bound_ = *static_cast<int*>(value);
    }
    watchdog_ = std::make_unique<BlockingWatchdog>(runtime_, rank_, options_.timeout);
  }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine() {
    // Both wait for their pending operations, at most the timeout each. A worker left inside a
    // blocking collective (detached) frees the communicator and releases the runtime itself.
    const bool worker_left = worker_ && !worker_->stop();
    worker_.reset();
    progress_.reset();
    watchdog_.reset();
    if (worker_left) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      auto lock = runtime_.lock();
      MPI_Comm_free(&comm_);
    }
    runtime_.detach();
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] MPI_Comm comm() const noexcept { return comm_; }
  [[nodiscard]] const MpiCommOptions& options() const noexcept { return options_; }
  [[nodiscard]] Runtime& runtime() const noexcept { return runtime_; }
  [[nodiscard]] int tag_upper_bound() const noexcept { return tag_upper_bound_; }
  [[nodiscard]] bool checks_collectives() const noexcept { return checks_collectives_; }

  /// The next collective's fingerprint where this communicator checks collectives.
  std::optional<CollectiveFingerprint> fingerprint(CollectiveOp op, dtype type, std::size_t count,
                                                   int root = 0,
                                                   ReduceOp reduce_op = ReduceOp::sum) {
    if (!checks_collectives_) return std::nullopt;
    return make_fingerprint(op, ++sequence_, type, count, root, reduce_op);
  }

  /// Compares `mine` with every rank's on this thread, under the watchdog; raises the mismatch.
  void compare(const char* operation, const CollectiveFingerprint& mine) {
    std::string mismatch;
    watchdog_->begin(operation);
    const int code =
        compare_fingerprints(runtime_, comm_, size_, mine, runtime_.serialized(), mismatch);
    watchdog_->end();
    if (code != MPI_SUCCESS) throw error(rank_, operation, code);
    if (!mismatch.empty()) throw Error(rank_, operation, mismatch);
  }

  /// Raises tandem::Error if an `_async` operation timed out earlier.
  void check_usable(const char* operation) const {
    std::optional<std::string> cause;
    if (worker_) cause = worker_->broken();
    if (!cause && progress_) cause = progress_->broken();
    if (cause) throw Error(rank_, operation, "this communicator is unusable: " + *cause);
  }

  /// Waits for the pending `_async` collectives (a sync collective must not overtake them).
  void drain(const char* operation) {
    const bool drained = (!worker_ || worker_->wait_idle(options_.timeout)) &&
                         (!progress_ || progress_->wait_for_collectives(options_.timeout));
    check_usable(operation);
    if (!drained) {
      throw Error(
          rank_, operation,
          "earlier `_async` collectives did not complete within " + describe(options_.timeout));
    }
  }

  /// Runs `call` to completion on this thread (a sync collective has drained first): MPI's
  /// blocking form, or where MPI calls are serialized its non-blocking form and polling.
  void run(Call& call) {
    check_usable(call.operation);
    if (call.fingerprint) compare(call.operation, *call.fingerprint);
    MPI_Status status{};
    watchdog_->begin(call.operation);
    const int code = runtime_.serialized() ? start_and_wait(call, status) : call.blocking(&status);
    watchdog_->end();
    if (code != MPI_SUCCESS) throw error(rank_, call.operation, code);
    if (call.finish) call.finish(status);
  }

  /// Hands `call` on; its Work completes when MPI has: a collective to the worker (blocking
  /// form) where MPI provides MPI_THREAD_MULTIPLE, anything else started here (non-blocking
  /// form) and completed by the progress thread; below MPI_THREAD_SERIALIZED, run here at once.
  Work launch(Call call) {
    check_usable(call.operation);
    auto state = std::make_shared<WorkState>();
    if (runtime_.eager()) {
      try {
        run(call);
        state->complete();
      } catch (...) {
        state->fail(std::current_exception());
      }
      return Work(state);
    }
    if (call.collective && !runtime_.serialized()) {
      if (!worker_) {
        worker_ = std::make_unique<Worker>(runtime_, comm_, rank_, size_, options_.timeout);
      }
      worker_->add(std::move(call), state);
      return Work(state);
    }
    if (call.fingerprint) {
      // Serialized: the comparison, polled here, must come before the request starts; a
      // mismatch fails the Work on every rank and nothing is started.
      try {
        compare(call.operation, *call.fingerprint);
      } catch (...) {
        state->fail(std::current_exception());
        return Work(state);
      }
    }
    // The progress thread first: once the request is started, nothing may throw before it is handed
    // over.
    if (!progress_) progress_ = std::make_unique<Progress>(runtime_, rank_, options_.timeout);
    auto pending = std::make_unique<Pending>(std::move(call), state, Deadline(options_.timeout));
    int code = MPI_SUCCESS;
    {
      auto lock = runtime_.lock();
      code = pending->call.start(&pending->request);
    }
    if (code != MPI_SUCCESS) {
      state->fail(std::make_exception_ptr(error(rank_, pending->call.operation, code)));
      return Work(state);
    }
    progress_->add(std::move(pending));
    return Work(state);
  }

  /// A blocking MPI call (MPI_Comm_split, MPI_Comm_dup), holding the lock where serialized.
  template <class Fn>
  void call_locked(const char* operation, Fn&& fn) {
    int code = MPI_SUCCESS;
    {
      auto lock = runtime_.lock();
      code = fn();
    }
    if (code != MPI_SUCCESS) throw error(rank_, operation, code);
  }

 private:
  /// A blocking call in its non-blocking form. Where MPI calls are serialized, the request is
  /// tested without holding the MPI lock in between, so that other threads (the progress thread
  /// among them) get their turns.
  int start_and_wait(Call& call, MPI_Status& status) {
    MPI_Request request = MPI_REQUEST_NULL;
    int code = MPI_SUCCESS;
    {
      auto lock = runtime_.lock();
      code = call.start(&request);
    }
    if (code == MPI_SUCCESS && !runtime_.serialized()) return MPI_Wait(&request, &status);
    Backoff backoff;
    while (code == MPI_SUCCESS) {
      int flag = 0;
      {
        auto lock = runtime_.lock();
        code = MPI_Test(&request, &flag, &status);
      }
      if (flag) break;
      backoff.pause();
    }
    return code;
  }

  Runtime& runtime_;
  MPI_Comm comm_;
  MpiCommOptions options_;
  bool checks_collectives_;
  std::uint64_t sequence_ = 0;  // collectives made, split included (one thread issues them)
  int rank_ = 0;
  int size_ = 1;
  int tag_upper_bound_ = 32767;         // MPI's guaranteed minimum, where the attribute is missing
  std::unique_ptr<Worker> worker_;      // started by the first `_async` collective
  std::unique_ptr<Progress> progress_;  // started by the first non-blocking `_async` operation
  std::unique_ptr<BlockingWatchdog> watchdog_;  // watches run()'s blocking calls
};

}  // namespace tandem::detail::mpi
