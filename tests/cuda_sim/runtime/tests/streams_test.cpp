// Streams, host functions, the default streams' implicit synchronisation and events, against
// CUDA's documentation ("Stream synchronization behavior", cudaLaunchHostFunc, cudaEventRecord,
// cudaEventQuery, cudaEventElapsedTime, cudaStreamQuery).
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "sim_test.hpp"

using sim_test::Gate;
using sim_test::launch;
using sim_test::ScopedEvent;
using sim_test::ScopedStream;

TEST_CASE("a host function runs on its stream's worker, after the call that queued it returned") {
  ScopedStream stream;
  Gate gate;
  gate.hold(stream);
  std::atomic<bool> ran{false};
  std::thread::id runner;
  auto work = [&] {
    runner = std::this_thread::get_id();
    ran.store(true);
  };
  launch(stream, work);
  CHECK_FALSE(ran.load());  // the stream is held: the call returned without running it
  gate.open();
  SIM_REQUIRE(cudaStreamSynchronize(stream));
  CHECK(ran.load());
  CHECK(runner != std::this_thread::get_id());
  CHECK_FALSE(gate.timed_out());
}

TEST_CASE("a stream runs its work in the order it was queued") {
  ScopedStream stream;
  std::vector<int> order;
  std::vector<std::function<void()>> steps;
  steps.reserve(500);
  for (int i = 0; i < 500; ++i) steps.emplace_back([&order, i] { order.push_back(i); });
  for (auto& step : steps) launch(stream, step);
  SIM_REQUIRE(cudaStreamSynchronize(stream));
  REQUIRE(order.size() == 500);
  for (int i = 0; i < 500; ++i) CHECK(order[static_cast<std::size_t>(i)] == i);
}

TEST_CASE("cudaStreamQuery: cudaErrorNotReady while work is pending, not a last error") {
  ScopedStream stream;
  CHECK(cudaStreamQuery(stream) == cudaSuccess);  // nothing queued
  Gate gate;
  gate.hold(stream);
  CHECK(cudaStreamQuery(stream) == cudaErrorNotReady);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  gate.open();
  SIM_REQUIRE(cudaStreamSynchronize(stream));
  CHECK(cudaStreamQuery(stream) == cudaSuccess);
}

TEST_CASE("the legacy stream waits for blocking streams, and they wait for it") {
  // CUDA's example: k_1 in s, k_2 in the legacy stream, k_3 in s; k_2 waits for k_1, k_3 for k_2.
  for (const bool per_thread : {false, true}) {
    CAPTURE(per_thread);
    ScopedStream created;
    const cudaStream_t s = per_thread ? cudaStreamPerThread : static_cast<cudaStream_t>(created);
    Gate gate;
    gate.hold(s);
    std::atomic<bool> k1_done{false}, k2_done{false};
    bool k2_saw_k1 = false, k3_saw_k2 = false;
    auto k1 = [&] { k1_done.store(true); };
    auto k2 = [&] {
      k2_saw_k1 = k1_done.load();
      k2_done.store(true);
    };
    auto k3 = [&] { k3_saw_k2 = k2_done.load(); };
    launch(s, k1);
    launch(cudaStreamLegacy, k2);
    launch(s, k3);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // room for a wrong order to show
    gate.open();
    SIM_REQUIRE(cudaStreamSynchronize(s));
    SIM_REQUIRE(cudaStreamSynchronize(cudaStreamLegacy));
    CHECK(k2_saw_k1);
    CHECK(k3_saw_k2);
  }
}

TEST_CASE("a non-blocking stream orders with neither the legacy stream nor others") {
  ScopedStream nonblocking(cudaStreamNonBlocking);
  Gate gate;
  gate.hold(nonblocking);
  std::atomic<bool> legacy_ran{false};
  auto on_legacy = [&] { legacy_ran.store(true); };
  launch(cudaStreamLegacy, on_legacy);
  // The legacy stream's work runs although the non-blocking stream is held.
  CHECK(sim_test::eventually([&] { return legacy_ran.load(); }));
  gate.open();
  SIM_REQUIRE(cudaStreamSynchronize(nonblocking));
  // And the other way: work on the non-blocking stream does not wait for held legacy work.
  Gate legacy_gate;
  legacy_gate.hold(cudaStreamLegacy);
  std::atomic<bool> nonblocking_ran{false};
  auto on_nonblocking = [&] { nonblocking_ran.store(true); };
  launch(nonblocking, on_nonblocking);
  CHECK(sim_test::eventually([&] { return nonblocking_ran.load(); }));
  legacy_gate.open();
  SIM_REQUIRE(cudaStreamSynchronize(cudaStreamLegacy));
}

TEST_CASE("two created blocking streams do not order with each other") {
  ScopedStream first, second;
  Gate gate;
  gate.hold(first);
  std::atomic<bool> ran{false};
  auto work = [&] { ran.store(true); };
  launch(second, work);
  CHECK(sim_test::eventually([&] { return ran.load(); }));
  gate.open();
  SIM_REQUIRE(cudaStreamSynchronize(first));
}

TEST_CASE("synchronising the legacy stream waits for the blocking streams' earlier work") {
  ScopedStream blocking;
  Gate gate;
  gate.hold(blocking);
  std::atomic<bool> done{false};
  auto work = [&] { done.store(true); };
  launch(blocking, work);
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    gate.open();
  });
  SIM_REQUIRE(cudaStreamSynchronize(cudaStreamLegacy));
  CHECK(done.load());
  opener.join();
}

TEST_CASE("each host thread has its own per-thread default stream, and the legacy one is shared") {
  unsigned long long main_id = 0, other_id = 0, main_legacy = 0, other_legacy = 0;
  SIM_REQUIRE(cudaStreamGetId(cudaStreamPerThread, &main_id));
  SIM_REQUIRE(cudaStreamGetId(cudaStreamLegacy, &main_legacy));
  std::thread other([&] {
    CHECK(cudaStreamGetId(cudaStreamPerThread, &other_id) == cudaSuccess);
    CHECK(cudaStreamGetId(nullptr, &other_legacy) == cudaSuccess);
  });
  other.join();
  CHECK(main_id != other_id);
  CHECK(main_legacy == other_legacy);
  unsigned flags = 99;
  SIM_REQUIRE(cudaStreamGetFlags(cudaStreamPerThread, &flags));
  CHECK(flags == cudaStreamDefault);  // blocking
}

TEST_CASE("stream creation flags and priorities") {
  ScopedStream nonblocking(cudaStreamNonBlocking);
  unsigned flags = 0;
  SIM_REQUIRE(cudaStreamGetFlags(nonblocking, &flags));
  CHECK(flags == cudaStreamNonBlocking);
  int least = 1, greatest = 1;
  SIM_REQUIRE(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  CHECK(least == 0);
  CHECK(greatest < 0);
  cudaStream_t urgent = nullptr;
  SIM_REQUIRE(cudaStreamCreateWithPriority(&urgent, cudaStreamNonBlocking, greatest - 10));
  int priority = 0;
  SIM_REQUIRE(cudaStreamGetPriority(urgent, &priority));
  CHECK(priority == greatest);  // clamped into the range
  SIM_REQUIRE(cudaStreamDestroy(urgent));
  cudaStream_t bad = nullptr;
  CHECK(cudaStreamCreateWithFlags(&bad, 0x10) == cudaErrorInvalidValue);
  CHECK(cudaStreamCreate(nullptr) == cudaErrorInvalidValue);
  (void)cudaGetLastError();
}

TEST_CASE("a destroyed stream finishes its queued work; its handle is then invalid") {
  cudaStream_t stream = nullptr;
  SIM_REQUIRE(cudaStreamCreate(&stream));
  Gate gate;
  gate.hold(stream);
  std::atomic<bool> ran{false};
  auto work = [&] { ran.store(true); };
  launch(stream, work);
  SIM_REQUIRE(cudaStreamDestroy(stream));  // returns at once, work still queued
  CHECK_FALSE(ran.load());
  gate.open();
  CHECK(sim_test::eventually([&] { return ran.load(); }));
  CHECK(cudaStreamQuery(stream) == cudaErrorInvalidResourceHandle);
  CHECK(cudaStreamDestroy(stream) == cudaErrorInvalidResourceHandle);
  CHECK(cudaStreamDestroy(cudaStreamLegacy) == cudaErrorInvalidResourceHandle);
  (void)cudaGetLastError();
}

TEST_CASE("cudaStreamAddCallback runs in order with the stream's status") {
  ScopedStream stream;
  struct Seen {
    cudaError_t status = cudaErrorUnknown;
    cudaStream_t stream = nullptr;
  } seen;
  SIM_REQUIRE(cudaStreamAddCallback(
      stream,
      [](cudaStream_t s, cudaError_t status, void* data) {
        *static_cast<Seen*>(data) = {status, s};
      },
      &seen, 0));
  SIM_REQUIRE(cudaStreamSynchronize(stream));
  CHECK(seen.status == cudaSuccess);
  CHECK(seen.stream == static_cast<cudaStream_t>(stream));
  CHECK(cudaStreamAddCallback(stream, nullptr, nullptr, 0) == cudaErrorInvalidValue);
  (void)cudaGetLastError();
}

TEST_CASE("host functions may not call CUDA: cudaErrorNotPermitted, except the harmless calls") {
  ScopedStream stream;
  struct Seen {
    cudaError_t malloc_status = cudaSuccess;
    cudaError_t get_device = cudaErrorUnknown;
    int in_work = 0;
  } seen;
  auto work = [&] {
    void* pointer = nullptr;
    seen.malloc_status = cudaMalloc(&pointer, 16);
    int device = -1;
    seen.get_device = cudaGetDevice(&device);
    seen.in_work = cuda_sim_in_stream_work();
  };
  launch(stream, work);
  SIM_REQUIRE(cudaStreamSynchronize(stream));
  CHECK(seen.malloc_status == cudaErrorNotPermitted);
  CHECK(seen.get_device == cudaSuccess);
  CHECK(seen.in_work == 1);
  CHECK(cuda_sim_in_stream_work() == 0);
}

TEST_CASE("events: never recorded is complete; cudaEventQuery says cudaErrorNotReady until run") {
  ScopedStream stream;
  ScopedEvent event;
  CHECK(cudaEventQuery(event) == cudaSuccess);
  SIM_REQUIRE(cudaEventSynchronize(event));
  SIM_REQUIRE(cudaStreamWaitEvent(stream, event, 0));
  Gate gate;
  gate.hold(stream);
  SIM_REQUIRE(cudaEventRecord(event, stream));
  CHECK(cudaEventQuery(event) == cudaErrorNotReady);
  CHECK(cudaGetLastError() == cudaSuccess);  // not ready is not an error
  gate.open();
  SIM_REQUIRE(cudaEventSynchronize(event));
  CHECK(cudaEventQuery(event) == cudaSuccess);
}

TEST_CASE("an event covers the work queued before its record only") {
  ScopedStream stream;
  ScopedEvent event;
  std::atomic<bool> before{false};
  auto first = [&] { before.store(true); };
  launch(stream, first);
  SIM_REQUIRE(cudaEventRecord(event, stream));
  Gate gate;
  gate.hold(stream);  // after the record: the event completes without it
  SIM_REQUIRE(cudaEventSynchronize(event));
  CHECK(before.load());
  CHECK(cudaStreamQuery(stream) == cudaErrorNotReady);
  gate.open();
  SIM_REQUIRE(cudaStreamSynchronize(stream));
}

TEST_CASE("cudaStreamWaitEvent orders another stream's later work after the recorded work") {
  ScopedStream producer(cudaStreamNonBlocking), consumer(cudaStreamNonBlocking);
  ScopedEvent ready;
  Gate gate;
  gate.hold(producer);
  std::vector<int> data;
  auto produce = [&] { data.assign(1000, 7); };
  launch(producer, produce);
  SIM_REQUIRE(cudaEventRecord(ready, producer));
  SIM_REQUIRE(cudaStreamWaitEvent(consumer, ready, 0));
  long long sum = -1;
  auto consume = [&] {
    sum = 0;
    for (const int value : data) sum += value;
  };
  launch(consumer, consume);
  CHECK(cudaStreamQuery(consumer) == cudaErrorNotReady);
  gate.open();
  SIM_REQUIRE(cudaStreamSynchronize(consumer));
  CHECK(sum == 7000);
  SIM_REQUIRE(cudaStreamSynchronize(producer));
}

TEST_CASE("a wait uses the record made before it; re-recording moves later queries and waits") {
  ScopedStream first, held(cudaStreamNonBlocking), waiter(cudaStreamNonBlocking);
  ScopedEvent event;
  SIM_REQUIRE(cudaEventRecord(event, first));
  SIM_REQUIRE(cudaStreamSynchronize(first));
  SIM_REQUIRE(cudaStreamWaitEvent(waiter, event, 0));
  Gate gate;
  gate.hold(held);
  SIM_REQUIRE(cudaEventRecord(event, held));  // after the wait: the waiter is not held by it
  SIM_REQUIRE(cudaStreamSynchronize(waiter));
  CHECK(cudaEventQuery(event) == cudaErrorNotReady);  // the latest record is held
  gate.open();
  SIM_REQUIRE(cudaEventSynchronize(event));
  CHECK(cudaEventQuery(event) == cudaSuccess);
}

TEST_CASE("cudaEventElapsedTime: the documented errors, then a time") {
  ScopedStream stream;
  ScopedEvent start(cudaEventDefault), stop(cudaEventDefault), untimed(cudaEventDisableTiming);
  float ms = -1;
  CHECK(cudaEventElapsedTime(&ms, start, stop) == cudaErrorInvalidResourceHandle);  // unrecorded
  CHECK(cudaEventElapsedTime(nullptr, start, stop) == cudaErrorInvalidValue);
  Gate gate;
  SIM_REQUIRE(cudaEventRecord(start, stream));
  gate.hold(stream);
  SIM_REQUIRE(cudaEventRecord(stop, stream));
  SIM_REQUIRE(cudaEventRecord(untimed, stream));
  CHECK(cudaEventElapsedTime(&ms, start, stop) == cudaErrorNotReady);
  CHECK(cudaEventElapsedTime(&ms, start, untimed) == cudaErrorInvalidResourceHandle);
  SIM_REQUIRE(cudaEventSynchronize(start));  // its time is taken: `stop`'s comes after the sleep
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  gate.open();
  SIM_REQUIRE(cudaEventSynchronize(stop));
  SIM_REQUIRE(cudaEventElapsedTime(&ms, start, stop));
  CHECK(ms >= 5.0f);  // the held stream reached `stop` at least 5 ms after `start`
  float back = 0;
  SIM_REQUIRE(cudaEventElapsedTime(&back, stop, start));
  CHECK(back == doctest::Approx(-ms));
  (void)cudaGetLastError();
}

TEST_CASE("events belong to their device: recording one on another device's stream fails") {
  REQUIRE(cuda_sim_device_count() >= 2);
  ScopedEvent event;  // on device 0
  SIM_REQUIRE(cudaSetDevice(1));
  cudaStream_t other = nullptr;
  SIM_REQUIRE(cudaStreamCreate(&other));
  CHECK(cudaEventRecord(event, other) == cudaErrorInvalidResourceHandle);
  // Waiting on an event of another device is allowed.
  SIM_REQUIRE(cudaSetDevice(0));
  SIM_REQUIRE(cudaEventRecord(event, cudaStreamLegacy));
  SIM_REQUIRE(cudaStreamWaitEvent(other, event, 0));
  SIM_REQUIRE(cudaStreamSynchronize(other));
  SIM_REQUIRE(cudaStreamDestroy(other));
  CHECK(cudaEventQuery(reinterpret_cast<cudaEvent_t>(&other)) == cudaErrorInvalidResourceHandle);
  (void)cudaGetLastError();
}

TEST_CASE("cudaDeviceSynchronize waits for every stream of the device, non-blocking ones too") {
  ScopedStream nonblocking(cudaStreamNonBlocking);
  Gate gate;
  gate.hold(nonblocking);
  std::atomic<bool> done{false};
  auto work = [&] { done.store(true); };
  launch(nonblocking, work);
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    gate.open();
  });
  SIM_REQUIRE(cudaDeviceSynchronize());
  CHECK(done.load());
  opener.join();
}

TEST_CASE("stress mode delays tasks but keeps every ordering") {
  unsigned long long previous_seed = 0;
  const int previously = cuda_sim_stress_enabled(&previous_seed);  // TANDEM_CUDA_SIM_STRESS
  cuda_sim_set_stress(1, 12345);
  unsigned long long seed = 0;
  CHECK(cuda_sim_stress_enabled(&seed) == 1);
  CHECK(seed == 12345);
  ScopedStream a(cudaStreamNonBlocking), b(cudaStreamNonBlocking);
  ScopedEvent handoff;
  std::vector<int> log;
  std::vector<std::function<void()>> steps;
  steps.reserve(40);
  for (int i = 0; i < 40; ++i) steps.emplace_back([&log, i] { log.push_back(i); });
  for (int i = 0; i < 20; ++i) launch(a, steps[static_cast<std::size_t>(i)]);
  SIM_REQUIRE(cudaEventRecord(handoff, a));
  SIM_REQUIRE(cudaStreamWaitEvent(b, handoff, 0));
  for (int i = 20; i < 40; ++i) launch(b, steps[static_cast<std::size_t>(i)]);
  SIM_REQUIRE(cudaStreamSynchronize(b));
  cuda_sim_set_stress(previously, previous_seed);
  REQUIRE(log.size() == 40);
  for (int i = 0; i < 40; ++i) CHECK(log[static_cast<std::size_t>(i)] == i);
}

TEST_CASE("a thread's per-thread stream outlives the thread: its work runs, the legacy waits") {
  Gate gate;
  std::atomic<bool> ran{false};
  auto work = [&] { ran.store(true); };
  SIM_REQUIRE(cudaStreamSynchronize(cudaStreamLegacy));  // its worker exists before the count
  const int workers_before = cuda_sim_worker_threads();
  std::thread thread([&] {
    gate.hold(cudaStreamPerThread);
    launch(cudaStreamPerThread, work);
  });
  thread.join();  // its per-thread stream is destroyed with work still queued
  bool legacy_saw = false;
  auto on_legacy = [&] { legacy_saw = ran.load(); };
  launch(cudaStreamLegacy, on_legacy);
  CHECK(cudaStreamQuery(cudaStreamLegacy) == cudaErrorNotReady);
  gate.open();
  SIM_REQUIRE(cudaStreamSynchronize(cudaStreamLegacy));
  CHECK(legacy_saw);
  // The thread's stream ended with its work, and its worker with it.
  CHECK(sim_test::eventually([&] { return cuda_sim_worker_threads() <= workers_before; }));
}
