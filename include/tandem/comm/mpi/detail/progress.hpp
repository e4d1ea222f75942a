// tandem/comm/mpi/detail/progress.hpp - how MpiComm describes one MPI operation and completes the
// non-blocking ones: a Call (its blocking and non-blocking forms, its fingerprint, and what follows
// completion), the fingerprint exchange before a collective, and the Progress, a thread that
// completes the Work of non-blocking requests (point to point; and collectives too where MPI
// calls are serialized) by testing them.
//   progress.add(std::make_unique<Pending>(...));
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

#include "tandem/comm/checked.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/mpi/detail/mpi_runtime.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"

namespace tandem::detail::mpi {

/// One operation, prepared on the calling thread. Scratch buffers live in the closures' captures
/// (shared_ptr), so they outlive the MPI request that uses them.
struct Call {
  const char* operation = "";
  bool collective = true;
  std::function<int(MPI_Status*)> blocking;
  std::function<int(MPI_Request*)> start;
  /// After MPI completed successfully (avg's division, copying out of scratch, recv's count
  /// check); may throw tandem::Error.
  std::function<void(const MPI_Status&)> finish;
  /// Where the communicator checks collectives: this call's fingerprint, compared with every
  /// rank's (compare_fingerprints) right before the call is made, on the thread that makes it.
  std::optional<CollectiveFingerprint> fingerprint{};
};

/// Every rank's fingerprint of the next collective (one MPI_Allgather of 64 bytes a rank) and
/// their comparison: MPI's error code, and in `cause` the mismatch Error's text ("" when the
/// ranks agree). `polled`: MPI_Iallgather, tested under the runtime's lock between pauses (where
/// MPI calls are serialized no thread may block inside MPI).
inline int compare_fingerprints(Runtime& runtime, MPI_Comm comm, int size,
                                const CollectiveFingerprint& mine, bool polled,
                                std::string& cause) {
  std::vector<CollectiveFingerprint> all(static_cast<std::size_t>(size));
  constexpr int bytes = static_cast<int>(sizeof(CollectiveFingerprint));
  int code = MPI_SUCCESS;
  if (!polled) {
    code = MPI_Allgather(&mine, bytes, MPI_BYTE, all.data(), bytes, MPI_BYTE, comm);
  } else {
    MPI_Request request = MPI_REQUEST_NULL;
    {
      auto lock = runtime.lock();
      code = MPI_Iallgather(&mine, bytes, MPI_BYTE, all.data(), bytes, MPI_BYTE, comm, &request);
    }
    Backoff backoff;
    while (code == MPI_SUCCESS) {
      int flag = 0;
      {
        auto lock = runtime.lock();
        code = MPI_Test(&request, &flag, MPI_STATUS_IGNORE);
      }
      if (flag) break;
      backoff.pause();
    }
  }
  if (code == MPI_SUCCESS) cause = fingerprint_disagreement(all);
  return code;
}

/// An `_async` operation in flight as an MPI request.
struct Pending {
  Pending(Call c, std::shared_ptr<WorkState> s, Deadline d)
      : call(std::move(c)), state(std::move(s)), deadline(d) {}

  Call call;
  std::shared_ptr<WorkState> state;
  Deadline deadline;
  MPI_Request request = MPI_REQUEST_NULL;
  bool timed_out = false;  // its Work has failed; MPI still owns the request
  bool finished = false;   // MPI completed the request
  bool settled = false;    // its Work has completed or failed, and the engine has counted it
};

/// The progress thread of one communicator: it MPI_Test's the pending requests (MPI progresses
/// non-blocking operations inside its calls), runs each completed one's `finish` and completes
/// its Work, in any order. An operation pending longer than its deadline fails its Work with a
/// tandem::Error and breaks the communicator: MPI cannot cancel a collective, so it stays pending
/// (its request and scratch kept) and nothing more may be issued.
class Progress {
 public:
  Progress(Runtime& runtime, int rank, Timeout timeout)
      : runtime_(runtime), rank_(rank), timeout_(timeout) {
    thread_ = std::thread([this] { loop(); });
  }

  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  /// Waits for the pending operations, at most the timeout; ones still pending then are
  /// abandoned: their requests and scratch buffers are leaked on purpose, since MPI may still
  /// write to them.
  ~Progress() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      stop_deadline_ = Deadline(timeout_);
    }
    changed_.notify_all();
    thread_.join();
    for (auto& pending : pending_) (void)pending.release();
  }

  void add(std::unique_ptr<Pending> pending) {
    {
      std::lock_guard lock(mutex_);
      if (pending->call.collective) ++open_collectives_;
      pending_.push_back(std::move(pending));
    }
    changed_.notify_all();
  }

  /// Blocks until no `_async` collective is open (each completed or failed); false at `timeout`.
  bool wait_for_collectives(Timeout timeout) {
    const Deadline deadline(timeout);  // saturates: Timeout::max() means forever
    std::unique_lock lock(mutex_);
    return changed_.wait_until(lock, deadline.at(), [&] { return open_collectives_ == 0; });
  }

  /// Why the communicator is unusable, if it is.
  [[nodiscard]] std::optional<std::string> broken() const {
    std::lock_guard lock(mutex_);
    return broken_;
  }

 private:
  void loop() {
    Backoff backoff;
    std::vector<Pending*> snapshot;
    std::vector<Pending*> settled;  // finished, or newly timed out
    std::unique_lock lock(mutex_);
    for (;;) {
      changed_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
      if (pending_.empty() || (stopping_ && stop_deadline_.expired())) return;
      // Only this thread removes entries, so the pointers stay valid while the lock is released
      // (MPI_Test may take a while, and must not hold up add()).
      snapshot.clear();
      for (auto& pending : pending_) snapshot.push_back(pending.get());
      lock.unlock();
      settled.clear();
      for (Pending* pending : snapshot) {
        if (advance(*pending)) settled.push_back(pending);
      }
      lock.lock();
      if (settled.empty()) {
        const auto pause = backoff.next();
        if (pause.count() == 0) {
          lock.unlock();
          std::this_thread::yield();
          lock.lock();
        } else {
          changed_.wait_for(lock, pause);
        }
        continue;
      }
      backoff.reset();
      for (Pending* pending : settled) {
        // Its Work is settled now (or was, when it timed out and MPI completes it later).
        if (pending->call.collective && !pending->settled) --open_collectives_;
        pending->settled = true;
      }
      std::erase_if(pending_, [](const std::unique_ptr<Pending>& p) { return p->finished; });
      changed_.notify_all();
    }
  }

  /// Tests one request; true when it finished or timed out just now.
  bool advance(Pending& pending) {
    int flag = 0;
    MPI_Status status{};
    int code = MPI_SUCCESS;
    {
      auto lock = runtime_.lock();
      code = MPI_Test(&pending.request, &flag, &status);
    }
    if (code != MPI_SUCCESS || flag) {
      pending.finished = true;
      // A timed-out operation's Work has failed and its buffers may be gone: leave them alone.
      if (pending.timed_out) return true;
      try {
        if (code != MPI_SUCCESS) throw error(rank_, pending.call.operation, code);
        if (pending.call.finish) pending.call.finish(status);
        pending.state->complete();
      } catch (...) {
        pending.state->fail(std::current_exception());
      }
      return true;
    }
    if (!pending.timed_out && pending.deadline.expired()) {
      pending.timed_out = true;
      {
        // Before the Work fails: whoever sees the failure must also find the comm broken.
        std::lock_guard lock(mutex_);
        if (!broken_) {
          broken_ = std::string("an earlier `_async` ") + pending.call.operation +
                    " did not complete within " + describe(timeout_) + " and MPI cannot cancel it";
        }
      }
      pending.state->fail(std::make_exception_ptr(Error(
          rank_, pending.call.operation,
          "did not complete within " + describe(timeout_) +
              " (a rank may not have called it). MPI cannot cancel an operation: this "
              "communicator is now unusable and MPI may still write the operation's buffers, so "
              "end the job (MPI_Abort)")));
      return true;
    }
    return false;
  }

  Runtime& runtime_;
  int rank_;
  Timeout timeout_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::unique_ptr<Pending>> pending_;
  int open_collectives_ = 0;
  std::optional<std::string> broken_;
  bool stopping_ = false;
  Deadline stop_deadline_{Timeout::zero()};
  std::thread thread_;  // last: started once everything above is ready
};

}  // namespace tandem::detail::mpi
