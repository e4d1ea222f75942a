// What the simulated runtime's tests share: a call check that names the error, and a Gate that
// holds a stream still so a test can see what the host does meanwhile.
#pragma once

#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "cuda_sim/control.h"

/// Requires a CUDA call to succeed, naming the error when it does not.
#define SIM_REQUIRE(call)                                      \
  do {                                                         \
    const cudaError_t sim_status_ = (call);                    \
    INFO(#call " returned " << cudaGetErrorName(sim_status_)); \
    REQUIRE(sim_status_ == cudaSuccess);                       \
  } while (false)

namespace sim_test {

/// Long enough for any loaded machine; a test that waits this long has failed.
constexpr auto patience = std::chrono::seconds(120);

/// Spins (yielding) until `done()` or patience runs out; whether it became true.
template <class Condition>
bool eventually(Condition done) {
  const auto deadline = std::chrono::steady_clock::now() + patience;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return true;
}

/// Queued as a host function, holds its stream until open() (or patience runs out, which
/// timed_out() then reports). The open is a release, so what the host wrote before opening is
/// ordered before the stream's later work.
class Gate {
 public:
  void hold(cudaStream_t stream) { SIM_REQUIRE(cudaLaunchHostFunc(stream, &Gate::wait, this)); }
  void open() { open_.store(true, std::memory_order_release); }
  [[nodiscard]] bool reached() const { return reached_.load(std::memory_order_relaxed); }
  [[nodiscard]] bool timed_out() const { return timed_out_.load(std::memory_order_relaxed); }

 private:
  static void wait(void* self) {
    auto* gate = static_cast<Gate*>(self);
    gate->reached_.store(true, std::memory_order_relaxed);
    if (!eventually([gate] { return gate->open_.load(std::memory_order_acquire); })) {
      gate->timed_out_.store(true, std::memory_order_relaxed);
    }
  }
  std::atomic<bool> open_{false};
  std::atomic<bool> reached_{false};
  std::atomic<bool> timed_out_{false};
};

/// A stream made and destroyed with the test.
class ScopedStream {
 public:
  explicit ScopedStream(unsigned flags = cudaStreamDefault) {
    SIM_REQUIRE(cudaStreamCreateWithFlags(&stream_, flags));
  }
  ScopedStream(const ScopedStream&) = delete;
  ScopedStream& operator=(const ScopedStream&) = delete;
  ~ScopedStream() { (void)cudaStreamDestroy(stream_); }
  operator cudaStream_t() const { return stream_; }  // NOLINT: a stream is its handle

 private:
  cudaStream_t stream_ = nullptr;
};

/// An event made and destroyed with the test.
class ScopedEvent {
 public:
  explicit ScopedEvent(unsigned flags = cudaEventDisableTiming) {
    SIM_REQUIRE(cudaEventCreateWithFlags(&event_, flags));
  }
  ScopedEvent(const ScopedEvent&) = delete;
  ScopedEvent& operator=(const ScopedEvent&) = delete;
  ~ScopedEvent() { (void)cudaEventDestroy(event_); }
  operator cudaEvent_t() const { return event_; }  // NOLINT: an event is its handle

 private:
  cudaEvent_t event_ = nullptr;
};

/// Queues `work()` on `stream` as a host function; `work` must outlive its run.
template <class Work>
void launch(cudaStream_t stream, Work& work) {
  SIM_REQUIRE(cudaLaunchHostFunc(
      stream, [](void* self) { (*static_cast<Work*>(self))(); }, &work));
}

}  // namespace sim_test
