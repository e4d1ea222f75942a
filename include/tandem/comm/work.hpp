// tandem/comm/work.hpp - tandem::Work, the handle on an asynchronous operation that every
// communicator's `_async` operations return, and the completion state a backend shares with it.
//   tandem::Work work = comm.all_reduce_async(grads, tandem::ReduceOp::sum);
//   ... overlap other work ...;  work.wait();   // rethrows the operation's tandem::Error
// Needs: the standard library.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>

#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"

namespace tandem {

namespace detail {

/// Completion state shared between an operation in flight and the Work handles that watch it.
class WorkState {
 public:
  void complete() noexcept { finish(nullptr); }
  void fail(std::exception_ptr error) noexcept { finish(std::move(error)); }

  [[nodiscard]] bool done() const {
    std::lock_guard lock(mutex_);
    return done_;
  }

  void wait() {
    std::unique_lock lock(mutex_);
    finished_.wait(lock, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }

  bool wait_for(Timeout timeout) {
    std::unique_lock lock(mutex_);
    if (!finished_.wait_for(lock, timeout, [&] { return done_; })) return false;
    if (error_) std::rethrow_exception(error_);
    return true;
  }

  [[nodiscard]] bool failed() const {
    std::lock_guard lock(mutex_);
    return done_ && error_ != nullptr;
  }

  /// For an operation that runs on a device stream: how another stream waits for it (NcclComm
  /// sets this; `stream` is a cudaStream_t). Set before the Work is handed out.
  void set_stream_waiter(std::function<void(void*)> waiter) { stream_waiter_ = std::move(waiter); }

  /// Makes `stream` wait for the operation without blocking the host where the backend can
  /// (set_stream_waiter); otherwise waits on the host, which orders the stream's later work too.
  void wait_on_stream(void* stream) {
    if (stream_waiter_ && !done()) {
      stream_waiter_(stream);
    } else {
      wait();
    }
  }

  /// Runs `observer(error)` once the operation has ended (`error` null when it succeeded), on
  /// the thread that ends it after the waiters are woken, or on this one when it already has.
  /// The flight recorder's way to see an operation end that a backend hands on; one observer.
  void on_end(std::function<void(const std::exception_ptr&)> observer) {
    std::unique_lock lock(mutex_);
    if (!ended_) {
      observer_ = std::move(observer);
      return;
    }
    const std::exception_ptr error = error_;
    lock.unlock();
    observer(error);
  }

  /// Runs `step` once the operation has succeeded and before anyone waiting sees it finish: on
  /// the thread that completes it, or on this one when it already has. A step that throws fails
  /// the operation. This is how a staged copy back to the device joins the operation it ends.
  void after_success(std::function<void()> step) {
    {
      std::lock_guard lock(mutex_);
      if (!finishing_) {
        if (step_) {
          step_ = [first = std::move(step_), then = std::move(step)] {
            first();
            then();
          };
        } else {
          step_ = std::move(step);
        }
        return;
      }
    }
    std::unique_lock lock(mutex_);
    finished_.wait(lock, [&] { return done_; });
    if (error_) return;
    lock.unlock();
    step();
  }

 private:
  void finish(std::exception_ptr error) noexcept {
    std::function<void()> step;
    {
      std::lock_guard lock(mutex_);
      finishing_ = true;
      step = std::move(step_);
    }
    if (!error && step) {
      try {
        step();
      } catch (...) {
        error = std::current_exception();
      }
    }
    step = nullptr;  // what the step holds is released before anyone waiting wakes
    std::function<void(const std::exception_ptr&)> observer;
    std::exception_ptr seen;
    {
      std::lock_guard lock(mutex_);
      error_ = std::move(error);
      ended_ = true;  // an observer registered from now on runs at once, on its own thread
      observer = std::move(observer_);
      seen = error_;
    }
    // The observer runs before anyone waiting sees the end: a waiter rethrows the error and
    // destroys it once handled, while the observer may still be reading it (ThreadSanitizer
    // reported the flight recorder's what() against a waiter's catch under mpi_comm).
    if (observer) {
      try {
        observer(seen);
      } catch (...) {
        // An observer only records; its failure must not change the operation's outcome.
      }
    }
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    finished_.notify_all();
  }

  mutable std::mutex mutex_;
  std::condition_variable finished_;
  bool done_ = false;
  bool ended_ = false;  // the outcome is set (the observer may still run)
  bool finishing_ = false;
  std::exception_ptr error_;
  std::function<void()> step_;
  std::function<void(const std::exception_ptr&)> observer_;
  std::function<void(void*)> stream_waiter_;  // written before the Work is shared, then only read
};

}  // namespace detail

/// A handle on an asynchronous operation (what the `_async` operations return). Copies watch the
/// same operation. A default-constructed Work is already complete.
class [[nodiscard]] Work {
 public:
  Work() = default;
  /// Watches the operation whose shared state a backend made.
  explicit Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

  /// Blocks until the operation has finished; rethrows its failure (a tandem::Error).
  void wait() const {
    if (state_) state_->wait();
  }
  /// Whether the operation has finished, successfully or not. Never blocks or throws.
  [[nodiscard]] bool test() const { return !state_ || state_->done(); }
  /// Blocks at most `timeout`; true when the operation finished in time (a failure rethrows).
  [[nodiscard]] bool wait_for(Timeout timeout) const {
    return !state_ || state_->wait_for(timeout);
  }
  /// Whether the operation has finished with a failure (wait() would rethrow it).
  [[nodiscard]] bool failed() const { return state_ && state_->failed(); }

  /// Makes a device stream (a cudaStream_t) wait for the operation: on the GPU for NcclComm's
  /// operations, without blocking the host; for host backends' operations, by waiting here.
  template <class Stream>
  requires std::is_pointer_v<Stream>
  void wait(Stream stream) const {
    if (state_) state_->wait_on_stream(static_cast<void*>(stream));
  }

  /// The shared state, for backends that add a step to the end of an operation.
  [[nodiscard]] const std::shared_ptr<detail::WorkState>& state() const noexcept { return state_; }

 private:
  std::shared_ptr<detail::WorkState> state_;
};

}  // namespace tandem
