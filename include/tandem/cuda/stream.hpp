// tandem/cuda/stream.hpp - RAII CUDA streams and events: a Stream owns a non-blocking stream, an
// Event marks a point in one so another stream (or the host) can wait for it.
//   tandem::cuda::Stream stream;  tandem::cuda::Event done;
//   done.record(stream);  other.wait(done);  done.synchronize();
// Needs: the CUDA runtime; include from .cu translation units (nvcc).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "tandem/cuda/runtime.hpp"

namespace tandem::cuda {

class Event;

/// Owns a CUDA stream created non-blocking, so it never synchronises implicitly with the legacy
/// default stream. Move-only; destroying it does not wait (CUDA finishes queued work first).
class Stream {
 public:
  /// A new stream on the current device. Lower priority numbers run first (cudaDeviceGet-
  /// StreamPriorityRange); 0 is the default priority.
  explicit Stream(int priority = 0) {
    check(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority),
          "cudaStreamCreateWithPriority");
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  /// Takes over the stream; the source's handle becomes null (which CUDA reads as the legacy
  /// default stream), and it destroys nothing.
  Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  /// Destroys this stream (without waiting) and takes over the source's, as the move constructor.
  Stream& operator=(Stream&& other) noexcept {
    if (this != &other) {
      reset();
      stream_ = std::exchange(other.stream_, nullptr);
    }
    return *this;
  }
  ~Stream() { reset(); }

  /// The handle, still owned by this Stream: for CUDA calls, launches and cuda_exec.
  [[nodiscard]] cudaStream_t get() const noexcept { return stream_; }
  /// The handle, as get(): a Stream passes wherever a cudaStream_t is expected.
  operator cudaStream_t() const noexcept { return stream_; }  // NOLINT: a stream is its handle

  /// Blocks the host until everything queued so far has run; errors raised by it are thrown.
  void synchronize() const { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

  /// Whether everything queued so far has run, without blocking.
  [[nodiscard]] bool query() const {
    cudaError_t status = cudaStreamQuery(stream_);
    if (status == cudaErrorNotReady) return false;
    check(status, "cudaStreamQuery");
    return true;
  }

  /// Work queued on this stream after this call waits for `event` (recorded elsewhere).
  inline void wait(const Event& event) const;

 private:
  void reset() noexcept {
    if (stream_) (void)cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

  cudaStream_t stream_ = nullptr;
};

/// Owns a CUDA event. Timing is off unless asked for: timing events are slower to record and to
/// wait on, and handing a buffer from one stream to another needs none.
class Event {
 public:
  /// Whether an event records time, for elapsed_ms_since(): on costs on every record and wait.
  enum class timing { off, on };

  /// A new event on the current device; timing::on only to measure with elapsed_ms_since().
  explicit Event(timing measure = timing::off) {
    check(cudaEventCreateWithFlags(
              &event_, measure == timing::on ? cudaEventDefault : cudaEventDisableTiming),
          "cudaEventCreateWithFlags");
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  /// Takes over the event; the source is left with none (null) and destroys nothing.
  Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  /// Destroys this event and takes over the source's, as the move constructor.
  Event& operator=(Event&& other) noexcept {
    if (this != &other) {
      reset();
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }
  ~Event() { reset(); }

  /// The handle, still owned by this Event: for CUDA calls such as cudaStreamWaitEvent.
  [[nodiscard]] cudaEvent_t get() const noexcept { return event_; }

  /// Marks the current end of `stream`; waiting on the event waits for the work before it.
  void record(cudaStream_t stream) { check(cudaEventRecord(event_, stream), "cudaEventRecord"); }

  /// Whether the recorded work has finished, without blocking.
  [[nodiscard]] bool query() const {
    cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return false;
    check(status, "cudaEventQuery");
    return true;
  }

  /// Blocks the host until the recorded work has finished (at once if never recorded); errors
  /// raised by it are thrown.
  void synchronize() const { check(cudaEventSynchronize(event_), "cudaEventSynchronize"); }

  /// Milliseconds from `start` to this event; both must have been created with timing::on.
  [[nodiscard]] float elapsed_ms_since(const Event& start) const {
    float milliseconds = 0;
    check(cudaEventElapsedTime(&milliseconds, start.event_, event_), "cudaEventElapsedTime");
    return milliseconds;
  }

 private:
  void reset() noexcept {
    if (event_) (void)cudaEventDestroy(event_);
    event_ = nullptr;
  }

  cudaEvent_t event_ = nullptr;
};

inline void Stream::wait(const Event& event) const {
  check(cudaStreamWaitEvent(stream_, event.get(), 0), "cudaStreamWaitEvent");
}

}  // namespace tandem::cuda
