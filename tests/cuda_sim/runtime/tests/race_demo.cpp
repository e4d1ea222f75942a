// The simulator's purpose, shown under ThreadSanitizer: a host read of memory that stream work
// wrote is a reported data race unless the host synchronised with that work at one of CUDA's
// synchronisation points. `race_demo <case>` runs one case; CTest expects ThreadSanitizer's
// report from the racy cases and a clean exit from the others (CMakeLists.txt). Without
// ThreadSanitizer the racy cases skip (exit 77): nothing could report them.
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include "cuda_sim/control.h"

#if defined(__SANITIZE_THREAD__)
constexpr bool thread_sanitizer = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
constexpr bool thread_sanitizer = true;
#else
constexpr bool thread_sanitizer = false;
#endif
#else
constexpr bool thread_sanitizer = false;
#endif

namespace {

void check(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  std::fprintf(stderr, "race_demo: %s: %s\n", what, cudaGetErrorName(status));
  std::exit(2);
}

/// What the stream work writes and the host reads. `written` tells the host, without any
/// synchronisation (relaxed), that the write has happened, so each racy case reads after the
/// write in time: only the missing happens-before makes it a race.
struct Shared {
  int* value = nullptr;  // pinned memory
  std::atomic<bool> written{false};
  std::atomic<bool> release_stream{false};
};

Shared shared;

void write_value(void*) {
  *shared.value = 42;
  shared.written.store(true, std::memory_order_relaxed);
}

void write_then_hold(void*) {
  write_value(nullptr);
  while (!shared.release_stream.load(std::memory_order_relaxed)) std::this_thread::yield();
}

void wait_until_written() {
  while (!shared.written.load(std::memory_order_relaxed)) std::this_thread::yield();
}

// The access ThreadSanitizer reports in the racy cases; never inlined, so that its name is in the
// report's stack (which CTest matches) also in a build without debug information, as CI's.
[[gnu::noinline]] int host_read() {
  return *static_cast<volatile int*>(shared.value);
}

cudaStream_t make_stream(unsigned flags = cudaStreamNonBlocking) {
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, flags), "cudaStreamCreateWithFlags");
  return stream;
}

/// A stream whose work has written the value by the time this returns (as the host can tell,
/// without synchronising).
cudaStream_t stream_that_wrote(cudaHostFn_t writer = write_value) {
  const cudaStream_t stream = make_stream();
  check(cudaLaunchHostFunc(stream, writer, nullptr), "cudaLaunchHostFunc");
  wait_until_written();
  return stream;
}

/// The racy read, then the synchronisation that ends the case (too late to order the read).
int read_then_synchronize(cudaStream_t stream) {
  const int seen = host_read();
  shared.release_stream.store(true, std::memory_order_relaxed);  // for write_then_hold
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return seen;
}

/// Stream work on `stream` reads the value; what it read, once `stream` is synchronised.
int read_on_stream(cudaStream_t stream) {
  static int seen = 0;
  check(cudaLaunchHostFunc(
            stream, [](void*) { seen = host_read(); }, nullptr),
        "cudaLaunchHostFunc");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return seen;
}

/// Device memory that stream work on `stream` sets to 42 (queued, not yet synchronised).
int* device_value_written_on(cudaStream_t stream) {
  int* device = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&device), sizeof(int)), "cudaMalloc");
  check(cudaLaunchHostFunc(
            stream, [](void* d) { *static_cast<int*>(d) = 42; }, device),
        "cudaLaunchHostFunc");
  return device;
}

// ---- Racy: each must be reported ----

/// The stream wrote; the host reads without synchronising.
int unsynchronised_read() {
  const cudaStream_t stream = stream_that_wrote();
  return read_then_synchronize(stream);
}

/// Queuing more work after the write is no synchronisation: the queue orders host before
/// stream, never stream before host.
int read_after_more_work() {
  const cudaStream_t stream = stream_that_wrote();
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  for (int i = 0; i < 10; ++i) {
    check(cudaLaunchHostFunc(
              stream, [](void*) {}, nullptr),
          "cudaLaunchHostFunc");
    check(cudaEventRecord(event, stream), "cudaEventRecord");
  }
  return read_then_synchronize(stream);
}

/// cudaStreamQuery answering cudaErrorNotReady orders nothing.
int read_after_not_ready() {
  const cudaStream_t stream = stream_that_wrote(write_then_hold);
  if (cudaStreamQuery(stream) != cudaErrorNotReady) std::exit(3);
  return read_then_synchronize(stream);
}

/// An event covers the work before its record only, even when later work has run by the time
/// the host waits for it.
int read_after_earlier_event() {
  const cudaStream_t stream = make_stream();
  cudaEvent_t before = nullptr;
  check(cudaEventCreateWithFlags(&before, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  check(cudaEventRecord(before, stream), "cudaEventRecord");
  check(cudaLaunchHostFunc(stream, write_value, nullptr), "cudaLaunchHostFunc");
  wait_until_written();
  check(cudaEventSynchronize(before), "cudaEventSynchronize");
  return read_then_synchronize(stream);
}

/// An asynchronous copy into pinned memory is complete only after a synchronisation.
int read_async_copy_to_pinned() {
  const cudaStream_t stream = make_stream();
  const int* device = device_value_written_on(stream);
  check(cudaMemcpyAsync(shared.value, device, sizeof(int), cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync");
  check(cudaLaunchHostFunc(
            stream, [](void*) { shared.written.store(true, std::memory_order_relaxed); }, nullptr),
        "cudaLaunchHostFunc");
  wait_until_written();
  return read_then_synchronize(stream);
}

/// A non-blocking stream does not order with the legacy stream: the stream work itself races.
int streams_without_event() {
  (void)stream_that_wrote();  // non-blocking
  return read_on_stream(cudaStreamLegacy);
}

// ---- Correct: none may be reported ----

int after_stream_synchronize() {
  const cudaStream_t stream = make_stream();
  check(cudaLaunchHostFunc(stream, write_value, nullptr), "cudaLaunchHostFunc");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return host_read();
}

int after_event_synchronize() {
  const cudaStream_t stream = make_stream();
  cudaEvent_t done = nullptr;
  check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  check(cudaLaunchHostFunc(stream, write_value, nullptr), "cudaLaunchHostFunc");
  check(cudaEventRecord(done, stream), "cudaEventRecord");
  check(cudaEventSynchronize(done), "cudaEventSynchronize");
  return host_read();
}

int after_successful_query() {
  const cudaStream_t stream = make_stream();
  check(cudaLaunchHostFunc(stream, write_value, nullptr), "cudaLaunchHostFunc");
  while (cudaStreamQuery(stream) == cudaErrorNotReady) std::this_thread::yield();
  return host_read();
}

int after_device_synchronize() {
  const cudaStream_t stream = make_stream(cudaStreamNonBlocking);
  check(cudaLaunchHostFunc(stream, write_value, nullptr), "cudaLaunchHostFunc");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return host_read();
}

int after_copy_to_pageable() {
  const cudaStream_t stream = make_stream();
  const int* device = device_value_written_on(stream);
  int pageable = 0;
  check(cudaMemcpyAsync(&pageable, device, sizeof(int), cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync");
  return pageable;  // returned once complete
}

int streams_joined_by_event() {
  const cudaStream_t writer = make_stream(cudaStreamNonBlocking);
  const cudaStream_t reader = make_stream(cudaStreamNonBlocking);
  cudaEvent_t written = nullptr;
  check(cudaEventCreateWithFlags(&written, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  check(cudaLaunchHostFunc(writer, write_value, nullptr), "cudaLaunchHostFunc");
  check(cudaEventRecord(written, writer), "cudaEventRecord");
  check(cudaStreamWaitEvent(reader, written, 0), "cudaStreamWaitEvent");
  return read_on_stream(reader);
}

int legacy_after_blocking_stream() {
  const cudaStream_t writer = make_stream(cudaStreamDefault);
  check(cudaLaunchHostFunc(writer, write_value, nullptr), "cudaLaunchHostFunc");
  return read_on_stream(cudaStreamLegacy);
}

/// Leaves work queued on several streams and returns from main: the process must exit cleanly.
int exit_with_work_queued() {
  for (int s = 0; s < 4; ++s) {
    const cudaStream_t stream = make_stream();
    for (int i = 0; i < 200; ++i) {
      check(cudaLaunchHostFunc(
                stream, [](void*) { std::this_thread::sleep_for(std::chrono::microseconds(20)); },
                nullptr),
            "cudaLaunchHostFunc");
    }
  }
  return 42;
}

}  // namespace

int main(int argc, char** argv) {
  const std::map<std::string, std::pair<bool, std::function<int()>>> cases{
      {"unsynchronised-read", {true, unsynchronised_read}},
      {"read-after-more-work", {true, read_after_more_work}},
      {"read-after-not-ready", {true, read_after_not_ready}},
      {"read-after-earlier-event", {true, read_after_earlier_event}},
      {"read-async-copy-to-pinned", {true, read_async_copy_to_pinned}},
      {"streams-without-event", {true, streams_without_event}},
      {"after-stream-synchronize", {false, after_stream_synchronize}},
      {"after-event-synchronize", {false, after_event_synchronize}},
      {"after-successful-query", {false, after_successful_query}},
      {"after-device-synchronize", {false, after_device_synchronize}},
      {"after-copy-to-pageable", {false, after_copy_to_pageable}},
      {"streams-joined-by-event", {false, streams_joined_by_event}},
      {"legacy-after-blocking-stream", {false, legacy_after_blocking_stream}},
      {"exit-with-work-queued", {false, exit_with_work_queued}},
  };
  const auto found = argc == 2 ? cases.find(argv[1]) : cases.end();
  if (found == cases.end()) {
    std::fprintf(stderr, "usage: race_demo <case>; cases:");
    for (const auto& entry : cases) std::fprintf(stderr, " %s", entry.first.c_str());
    std::fprintf(stderr, "\n");
    return 2;
  }
  const auto& [racy, run] = found->second;
  if (racy && !thread_sanitizer) {
    std::printf("race_demo skipped: %s needs a ThreadSanitizer build to be reported\n", argv[1]);
    return 77;
  }
  check(cudaMallocHost(reinterpret_cast<void**>(&shared.value), sizeof(int)), "cudaMallocHost");
  *shared.value = 0;
  const int seen = run();
  std::printf("race_demo %s: read %d\n", argv[1], seen);
  return seen == 42 ? 0 : 1;
}
