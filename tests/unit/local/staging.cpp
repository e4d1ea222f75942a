// LocalComm with device tensors (a fake device space, so no GPU is needed): staged through pinned
// memory like Gloo and MPI; see support/staging_checks.hpp. Also Work's after_success step,
// which the `_async` staging relies on.
#include <doctest/doctest.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "support/staging_checks.hpp"
#include "tandem/comm/local/local.hpp"

TEST_CASE("LocalComm stages device tensors through pinned memory") {
  for (int ranks : {1, 3}) {
    std::atomic<int> failed{0};
    std::string first;
    std::mutex mutex;
    tandem::run_local(ranks, [&](tandem::LocalComm& comm) {
      auto failures = tandem::test::check_device_staging(comm, /*per_rank_counters=*/false);
      if (!failures.empty()) {
        std::lock_guard lock(mutex);
        if (failed++ == 0) first = failures;
      }
    });
    CHECK_MESSAGE(failed.load() == 0, first);
    CHECK(tandem::test::staging_counters.pinned_live.load() == 0);
    CHECK(tandem::test::staging_counters.to_device.load() > 0);
  }
}

TEST_CASE("WorkState::after_success runs before waiters wake, once, and only on success") {
  SUBCASE("registered before completion: runs on the completing thread") {
    auto state = std::make_shared<tandem::detail::WorkState>();
    std::atomic<int> steps{0};
    state->after_success([&] { ++steps; });
    state->after_success([&] { steps = steps * 10; });  // chained, in order
    std::thread completer([&] { state->complete(); });
    tandem::Work(state).wait();
    CHECK(steps.load() == 10);
    completer.join();
  }
  SUBCASE("registered after completion: runs at once") {
    auto state = std::make_shared<tandem::detail::WorkState>();
    state->complete();
    int steps = 0;
    state->after_success([&] { ++steps; });
    CHECK(steps == 1);
  }
  SUBCASE("a failed operation skips the step") {
    auto state = std::make_shared<tandem::detail::WorkState>();
    int steps = 0;
    state->after_success([&] { ++steps; });
    state->fail(std::make_exception_ptr(std::runtime_error("boom")));
    CHECK_THROWS_AS(tandem::Work(state).wait(), std::runtime_error);
    CHECK(steps == 0);
  }
  SUBCASE("a stream waits through the backend's waiter while pending, else on the host") {
    auto state = std::make_shared<tandem::detail::WorkState>();
    void* seen = nullptr;
    state->set_stream_waiter([&](void* stream) { seen = stream; });
    int stream_object = 0;
    tandem::Work(state).wait(&stream_object);
    CHECK(seen == &stream_object);  // not done yet: the device-side wait was used
    state->complete();
    seen = nullptr;
    tandem::Work(state).wait(&stream_object);
    CHECK(seen == nullptr);  // already done: nothing to wait for

    auto host_only = std::make_shared<tandem::detail::WorkState>();
    std::thread completer([&] { host_only->complete(); });
    tandem::Work(host_only).wait(&stream_object);  // no waiter: waits on the host
    CHECK(host_only->done());
    completer.join();
  }
  SUBCASE("a throwing step fails the operation") {
    auto state = std::make_shared<tandem::detail::WorkState>();
    state->after_success([] { throw std::runtime_error("copy back failed"); });
    state->complete();
    tandem::Work work(state);
    CHECK(work.failed());
    CHECK_THROWS_WITH(work.wait(), "copy back failed");
  }
}
