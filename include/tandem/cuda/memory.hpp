// tandem/cuda/memory.hpp - pinned and device memory for tandem::Buffer (stream-ordered device
// allocation), and tandem::copy between host, pinned and device memory, synchronous or on a stream.
//   tandem::Buffer<float, tandem::device> grads(n);  tandem::copy(grads, host_values);
// Needs: the CUDA runtime; include from .cu translation units (nvcc).
#pragma once

#include "tandem/cuda/detail/nvcc_only.hpp"  // first: stops a non-nvcc build here

#include <concepts>
#include <cstddef>
#include <cstring>
#include <new>
#include <string>
#include <type_traits>

#include <cuda_runtime.h>

#include "tandem/core/error.hpp"
#include "tandem/cuda/exec.hpp"
#include "tandem/cuda/runtime.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

// How device memory is ordered (the convention every tandem CUDA part follows):
//
// Device memory comes from the device's stream-ordered pool (cudaMallocAsync), which reuses
// freed blocks without the device-wide synchronisation of cudaMalloc/cudaFree. A stream-ordered
// allocation may only be touched by work ordered after it, and its free must be ordered after
// the last work touching it. So:
// - Buffer(shape) (and allocate<T>(count)) allocate on the legacy default stream and wait for
//   that stream once: the memory is then usable on every stream, including non-blocking ones
//   (tandem::cuda::Stream, NCCL's), like cudaMalloc's. Setting up buffers is rare; reading a
//   freshly made buffer on the wrong stream is a silent race, so the wait is worth it here.
// - Buffer(shape, cuda_exec{stream}) allocates in the order of `stream` and never waits: the
//   memory is usable on `stream` (and streams that wait on it) at once. The Buffer frees on that
//   stream, so the stream must outlive it (declare a Stream member before the Buffers using it).
// - Both free with cudaFreeAsync on the stream they were allocated on, except that a buffer of
//   the per-thread default stream is freed on the legacy default stream, which waits for every
//   thread's per-thread stream: destroying it on another thread is then safe too. The legacy
//   stream also orders with every other blocking stream, but not with non-blocking streams:
//   work queued on those must have finished, or have been joined into the freeing stream with an
//   Event, before the Buffer is destroyed (NcclComm joins its stream back into the caller's).
// - Synchronous copies (tandem::copy(dst, src), space_copy) run on the legacy default stream of
//   the device that owns the memory and wait for it: they see everything that kernels on the
//   legacy, per-thread or other blocking streams wrote before the call, and what they wrote is
//   in place when they return. Data written on a non-blocking stream needs that stream
//   synchronised (or joined into the legacy stream with an Event) first.

namespace tandem {

namespace cuda::detail {

inline std::string status_text(cudaError_t status) {
  return std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status);
}

/// Throws for a failed call after clearing CUDA's last-error slot, so the failure is not reported
/// again by the next kernel launch's cudaGetLastError.
[[noreturn]] inline void fail(cudaError_t status, const char* operation, const std::string& what) {
  (void)cudaGetLastError();
  throw Error(operation, what + ": " + status_text(status));
}

/// Makes `device` current on this thread for a scope (when it is not already) and restores the
/// previous one. Used where an operation must reach a specific device's legacy stream.
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) noexcept {
    if (device < 0) return;
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();  // the call that needs the device reports the real failure
      return;
    }
    if (previous_ == device) return;
    switched_ = cudaSetDevice(device) == cudaSuccess;
    if (!switched_) (void)cudaGetLastError();
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;
  ~CurrentDevice() {
    if (switched_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
  bool switched_ = false;
};

/// The GPU that owns `pointer`'s memory, or -1 for host memory (pageable or pinned).
inline int device_of(const void* pointer) {
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, pointer);
  if (status != cudaSuccess) fail(status, "tandem::copy", "cudaPointerGetAttributes");
  if (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged) {
    return attributes.device;
  }
  return -1;
}

/// Whether `stream` is one of the default streams' pseudo handles rather than a created stream.
inline bool is_default_stream(cudaStream_t stream) noexcept {
  return stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread;
}

/// The synchronous copy behind tandem::copy(dst, src) and space_copy: on the legacy default
/// stream of the device that owns the memory (the source's, when both are device memory), then
/// waits for it. cudaMemcpyDefault lets unified addressing find each side's space.
inline void copy_synchronously(void* destination, const void* source, std::size_t bytes) {
  if (bytes == 0) return;
  const int source_device = device_of(source);
  const CurrentDevice on(source_device >= 0 ? source_device : device_of(destination));
  cudaError_t status =
      cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDefault, cudaStreamLegacy);
  if (status != cudaSuccess) {
    fail(status, "tandem::copy", "cudaMemcpyAsync of " + std::to_string(bytes) + " bytes");
  }
  status = cudaStreamSynchronize(cudaStreamLegacy);
  if (status != cudaSuccess) {
    fail(status, "tandem::copy", "waiting for a copy of " + std::to_string(bytes) + " bytes");
  }
}

}  // namespace cuda::detail

/// Page-locked host memory (cudaHostAlloc). Portable: pinned for every device's context, so one
/// process driving several GPUs (run_local) copies from it asynchronously to each of them.
/// Freeing it (cudaFreeHost) is not stream-ordered: destroy a pinned Buffer only after the
/// asynchronous copies that use it have finished (their stream synchronised). Pinning is slow
/// (page locking): keep staging buffers for the run rather than per step.
template <>
struct space_allocator<pinned> {
  /// `count` pinned elements, uninitialised; nullptr for 0. An Error when pinning fails.
  template <class T>
  static T* allocate(std::size_t count) {
    if (count == 0) return nullptr;
    if (count > static_cast<std::size_t>(-1) / sizeof(T)) throw std::bad_array_new_length();
    void* pointer = nullptr;
    const cudaError_t status = cudaHostAlloc(&pointer, count * sizeof(T), cudaHostAllocPortable);
    if (status != cudaSuccess) {
      cuda::detail::fail(status, "cudaHostAlloc",
                         "could not pin " + std::to_string(count * sizeof(T)) + " bytes");
    }
    return static_cast<T*>(pointer);
  }

  /// Unpins and frees at once (not stream-ordered: see above); failures are swallowed.
  template <class T>
  static void deallocate(T* pointer, std::size_t /*count*/) noexcept {
    // A destructor cannot report a failure; clear it so the next launch check does not either.
    if (pointer && cudaFreeHost(pointer) != cudaSuccess) (void)cudaGetLastError();
  }
};

/// Device memory from the current device's stream-ordered pool; see the convention above.
template <>
struct space_allocator<device> {
  /// `count` elements ordered on `stream` of the current device: usable on that stream (and on
  /// streams that wait for it) at once, on others only after synchronising it.
  template <class T>
  static T* allocate_on(std::size_t count, cudaStream_t stream) {
    if (count == 0) return nullptr;
    if (count > static_cast<std::size_t>(-1) / sizeof(T)) throw std::bad_array_new_length();
    void* pointer = nullptr;
    const cudaError_t status = cudaMallocAsync(&pointer, count * sizeof(T), stream);
    if (status != cudaSuccess) {
      int device = -1;
      (void)cudaGetDevice(&device);
      cuda::detail::fail(status, "cudaMallocAsync",
                         "could not allocate " + std::to_string(count * sizeof(T)) +
                             " bytes on device " + std::to_string(device));
    }
    return static_cast<T*>(pointer);
  }

  /// `count` elements usable on every stream of the current device once this returns.
  template <class T>
  static T* allocate(std::size_t count) {
    T* pointer = allocate_on<T>(count, cudaStreamLegacy);
    if (pointer == nullptr) return nullptr;
    const cudaError_t status = cudaStreamSynchronize(cudaStreamLegacy);
    if (status != cudaSuccess) {
      (void)cudaFreeAsync(pointer, cudaStreamLegacy);
      cuda::detail::fail(status, "cudaMallocAsync", "waiting for a device allocation");
    }
    return pointer;
  }

  /// As allocate(count), recording where the free must be ordered (Buffer(shape)).
  template <class T>
  static T* allocate(std::size_t count, allocation_state<device>& state) {
    T* pointer = allocate<T>(count);
    state = {cudaStreamLegacy, current_device_or(-1)};
    return pointer;
  }

  /// Ordered on exec's stream, without waiting (Buffer(shape, exec)).
  template <class T>
  static T* allocate(std::size_t count, const cuda_exec& exec, allocation_state<device>& state) {
    T* pointer = allocate_on<T>(count, exec.stream);
    state = {cuda::detail::is_default_stream(exec.stream) ? cudaStreamLegacy : exec.stream,
             current_device_or(-1)};
    return pointer;
  }

  /// Frees in the order of `stream` (which must be after the last work touching the memory).
  template <class T>
  static void deallocate_on(T* pointer, cudaStream_t stream) noexcept {
    if (pointer && cudaFreeAsync(pointer, stream) != cudaSuccess) (void)cudaGetLastError();
  }

  /// Frees on the current device's legacy default stream (memory from allocate(count)).
  template <class T>
  static void deallocate(T* pointer, std::size_t /*count*/) noexcept {
    deallocate_on(pointer, cudaStreamLegacy);
  }

  /// Frees where `state` says, with the allocating device current (its legacy stream is meant).
  template <class T>
  static void deallocate(T* pointer, std::size_t /*count*/,
                         const allocation_state<device>& state) noexcept {
    if (!pointer) return;
    const cuda::detail::CurrentDevice on(state.device);
    deallocate_on(pointer, static_cast<cudaStream_t>(state.stream));
  }

 private:
  static int current_device_or(int fallback) noexcept {
    int device = fallback;
    if (cudaGetDevice(&device) == cudaSuccess) return device;
    (void)cudaGetLastError();  // no device (an empty Buffer): not an error for later calls
    return fallback;
  }
};

/// Copies to or from device memory, synchronously (see the convention above). What the Gloo and
/// MPI communicators use to stage device tensors through pinned memory.
template <memory_space To, memory_space From>
requires(std::same_as<To, device> || std::same_as<From, device>) struct space_copy<To, From> {
  /// Copies `bytes` on the source's device (the destination's for host sources) through its
  /// legacy default stream, and waits for the copy.
  static void copy(void* destination, const void* source, std::size_t bytes) {
    cuda::detail::copy_synchronously(destination, source, bytes);
  }
};

namespace cuda::detail {

template <class Dst, class Src>
concept copyable_between = MutableTensor<Dst> && Tensor<Src> &&
    std::same_as<std::remove_cv_t<tensor_element_t<Dst>>, std::remove_cv_t<tensor_element_t<Src>>>;

/// Bytes to copy; a size mismatch is an Error before anything is touched.
template <class Dst, class Src>
std::size_t copy_bytes(const Dst& destination, const Src& source) {
  const auto destination_size = static_cast<std::size_t>(destination.size());
  const auto source_size = static_cast<std::size_t>(source.size());
  if (destination_size != source_size) {
    throw Error("tandem::copy", "the destination holds " + std::to_string(destination_size) +
                                    " elements, the source " + std::to_string(source_size));
  }
  return source_size * sizeof(std::remove_cv_t<tensor_element_t<Src>>);
}

}  // namespace cuda::detail

/// Copies src's elements into dst, between any two of host, pinned and device memory; the same
/// element type and count (else a tandem::Error). Synchronous: dst holds the data on return.
/// Device memory is copied on the legacy default stream, which has waited for kernels on blocking
/// streams (the per-thread default stream included); data written on a non-blocking stream needs
/// that stream synchronised first.
template <class Dst, class Src>
requires cuda::detail::copyable_between<Dst, Src>
void copy(Dst&& dst, Src&& src) {
  const std::size_t bytes = cuda::detail::copy_bytes(dst, src);
  if (bytes == 0) return;
  space_copy<tensor_space_t<Dst>, tensor_space_t<Src>>::copy(dst.data(), src.data(), bytes);
}

/// The same copy queued on `stream`: ordered after the stream's earlier work and before its later
/// work, returning at once where CUDA allows it. Truly asynchronous between device and pinned
/// memory; with pageable host memory CUDA stages through its own buffers (a copy to pageable
/// memory returns once complete). Between two host-accessible spaces the stream is waited for
/// and the bytes copied at once. Keep both sides alive until the stream has passed the copy.
template <class Dst, class Src>
requires cuda::detail::copyable_between<Dst, Src>
void copy(Dst&& dst, Src&& src, cudaStream_t stream) {
  using To = tensor_space_t<Dst>;
  using From = tensor_space_t<Src>;
  const std::size_t bytes = cuda::detail::copy_bytes(dst, src);
  if (bytes == 0) return;
  if constexpr (host_accessible<To> && host_accessible<From>) {
    cuda::check(cudaStreamSynchronize(stream), "tandem::copy (cudaStreamSynchronize)");
    std::memcpy(dst.data(), src.data(), bytes);
  } else {
    const cudaError_t status =
        cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDefault, stream);
    if (status != cudaSuccess) {
      cuda::detail::fail(status, "tandem::copy",
                         std::string("cudaMemcpyAsync of ") + std::to_string(bytes) +
                             " bytes from " + From::name + " to " + To::name + " memory");
    }
  }
}

/// The same, on an executor's stream.
template <class Dst, class Src>
requires cuda::detail::copyable_between<Dst, Src>
void copy(Dst&& dst, Src&& src, const cuda_exec& exec) {
  copy(std::forward<Dst>(dst), std::forward<Src>(src), exec.stream);
}

}  // namespace tandem
