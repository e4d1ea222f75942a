// tandem/comm/detail/issue_order.hpp - how a communicator runs its operations in issue order: a
// sync one on the calling thread once the pending `_async` ones have run, an `_async` one on a
// worker thread (started on first use) that completes the returned tandem::Work.
//   work = ops.later([=] { all_reduce(in, out, count, op); });   ops.now([&] { barrier(); });
// Needs: the standard library (threads). Not a public header: backends include it.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "tandem/comm/communicator.hpp"

namespace tandem::detail {

/// The thread that runs one communicator's `_async` operations in issue order.
class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ~Worker() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }

  void post(std::function<void()> task) {
    {
      std::lock_guard lock(mutex_);
      tasks_.push_back(std::move(task));
    }
    changed_.notify_all();
  }

  /// Waits until every task posted so far has run. Each task is bounded by the communicator's
  /// timeout, so this wait is too.
  void drain() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return tasks_.empty() && !busy_; });
  }

 private:
  void loop() {
    std::unique_lock lock(mutex_);
    for (;;) {
      changed_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping, and everything posted has run
      auto task = std::move(tasks_.front());
      tasks_.pop_front();
      busy_ = true;
      lock.unlock();
      task();  // never throws: the task completes its WorkState
      lock.lock();
      busy_ = false;
      changed_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> tasks_;
  bool busy_ = false;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after the members above exist
};

/// now() and later() of a communicator's engine (its base class). The engine's destructor calls
/// stop() first: the tasks still queued use the engine's members, which a base outlives.
class IssueOrder {
 public:
  IssueOrder() = default;
  IssueOrder(const IssueOrder&) = delete;
  IssueOrder& operator=(const IssueOrder&) = delete;
  ~IssueOrder() = default;

  /// Runs `body` now, after every `_async` operation issued before.
  template <class Body>
  void now(Body&& body) {
    if (worker_) worker_->drain();
    body();
  }

  /// Queues `body` on the worker; the Work completes when it has run.
  template <class Body>
  Work later(Body body) {
    auto state = std::make_shared<WorkState>();
    if (!worker_) worker_ = std::make_unique<Worker>();
    worker_->post([state, body = std::move(body)]() mutable {
      try {
        body();
        state->complete();
      } catch (...) {
        state->fail(std::current_exception());
      }
    });
    return Work(state);
  }

  /// Runs what is still queued and ends the worker.
  void stop() noexcept { worker_.reset(); }

 private:
  std::unique_ptr<Worker> worker_;  // started by the first `_async` operation
};

}  // namespace tandem::detail
