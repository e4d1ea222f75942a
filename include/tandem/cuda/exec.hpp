// tandem/cuda/exec.hpp - tandem::cuda_exec: runs tandem's element-wise and reduction functors on a
// CUDA stream (a grid-stride kernel for each index, CUB for reductions).
//   tandem::for_each_index(tandem::cuda_exec{stream}, n, Scale{device_data, 0.5f});
// Needs: the CUDA runtime and CUB (CUDA toolkit); include from .cu translation units (nvcc).
// On tandem's simulated CUDA runtime (tests only: TANDEM_CUDA_SIM, built by the host compiler)
// the same functors run as host functions queued on the stream (cudaLaunchHostFunc), in stream
// order on the stream's worker; reductions there combine left to right, as host_exec does.
#pragma once

#include "tandem/cuda/detail/nvcc_only.hpp"  // first: stops a non-nvcc build here

#include <algorithm>
#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include <cuda_runtime.h>
#if defined(__CUDACC__)
#include <thrust/iterator/counting_iterator.h>
#include <cub/device/device_reduce.cuh>
#endif

#include "tandem/core/config.hpp"
#include "tandem/core/error.hpp"
#include "tandem/cuda/runtime.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/memory.hpp"

namespace tandem {

namespace cuda::detail {

#if defined(__CUDACC__)
inline constexpr unsigned threads_per_block = 256;

/// Each thread takes every (grid size)-th index, so one grid of any size covers any n.
template <class F>
__global__ void __launch_bounds__(threads_per_block) for_each_index_kernel(std::size_t n, F f) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    f(i);
  }
}

/// Writes one value into device memory in stream order. A kernel argument, unlike a copy from a
/// host variable, is captured by value into CUDA graphs.
template <class T>
__global__ void store_kernel(T* out, T value) {
  *out = value;
}

/// Blocks for n indices: one per 256, but no more than the current device keeps resident at once;
/// beyond that the grid-stride loop gives each thread several indices instead of queueing waves.
inline unsigned grid_size(std::size_t n) {
  int device = 0;
  int multiprocessors = 0;
  int threads_per_multiprocessor = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute(MultiProcessorCount)");
  check(cudaDeviceGetAttribute(&threads_per_multiprocessor, cudaDevAttrMaxThreadsPerMultiProcessor,
                               device),
        "cudaDeviceGetAttribute(MaxThreadsPerMultiProcessor)");
  const std::size_t resident = std::max<std::size_t>(
      1, static_cast<std::size_t>(multiprocessors) *
             static_cast<std::size_t>(threads_per_multiprocessor / threads_per_block));
  const std::size_t needed = n / threads_per_block + (n % threads_per_block != 0 ? 1 : 0);
  return static_cast<unsigned>(std::min(needed, resident));
}
#else
/// The simulator's kernel: f(i) for each i in [0, n), run by a host function on the stream's
/// worker. It owns its copy of the functor and deletes itself once run.
template <class F>
struct HostKernel {
  std::size_t n;
  F f;

  static void run(void* self) {
    const std::unique_ptr<HostKernel> kernel(static_cast<HostKernel*>(self));
    for (std::size_t i = 0; i < kernel->n; ++i) kernel->f(i);
  }
};

/// Queues f(0 .. n-1) on `stream` as a host function, as a kernel launch would queue it.
template <class F>
void launch_on_host(cudaStream_t stream, std::size_t n, F f, const char* operation) {
  auto kernel = std::make_unique<HostKernel<F>>(HostKernel<F>{n, std::move(f)});
  check(cudaLaunchHostFunc(stream, &HostKernel<F>::run, kernel.get()), operation);
  (void)kernel.release();  // the host function owns it now
}

/// The simulator's reduction: *out = combine(...combine(init, map(0))..., map(n-1)), left to
/// right as host_exec combines, on the stream's worker.
template <class T, class Map, class Combine>
struct HostReduction {
  T* out;
  std::size_t n;
  T init;
  Map map;
  Combine combine;
  TANDEM_HD void operator()(std::size_t) const {
    T value = init;
    for (std::size_t i = 0; i < n; ++i) value = combine(value, map(i));
    *out = value;
  }
};
#endif

/// Device memory for one operation, allocated and freed in the order of `stream`: the free is
/// queued behind the work that uses it, so nothing waits for it.
class StreamScratch {
 public:
  StreamScratch(std::size_t bytes, cudaStream_t stream, const char* operation) : stream_(stream) {
    const cudaError_t status = cudaMallocAsync(&pointer_, bytes, stream);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      throw Error(operation, "cudaMallocAsync of " + std::to_string(bytes) +
                                 " bytes of scratch memory failed: " + cudaGetErrorName(status) +
                                 ": " + cudaGetErrorString(status));
    }
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  ~StreamScratch() {
    if (pointer_ && cudaFreeAsync(pointer_, stream_) != cudaSuccess) (void)cudaGetLastError();
  }

  [[nodiscard]] void* get() const noexcept { return pointer_; }
  [[nodiscard]] unsigned char* bytes() const noexcept {
    return static_cast<unsigned char*>(pointer_);
  }

 private:
  void* pointer_ = nullptr;
  cudaStream_t stream_;
};

/// map(i) as the accumulator type T, so CUB accumulates in exactly the type the host does.
template <class T, class Map>
struct MapAs {
  Map map;
  TANDEM_HD T operator()(std::size_t i) const { return static_cast<T>(map(i)); }
};

/// combine(a, b) as T: CUB derives its accumulator type from the combiner's result.
template <class T, class Combine>
struct CombineAs {
  Combine combine;
  TANDEM_HD T operator()(const T& a, const T& b) const { return static_cast<T>(combine(a, b)); }
};

/// CUB's alignment for temporary storage; the result slot after it keeps that alignment.
inline constexpr std::size_t scratch_alignment = 256;

}  // namespace cuda::detail

/// Runs functors as kernels on `stream` of the current device (the stream must belong to it).
/// Copyable and cheap: it is just the stream. A default one uses the calling thread's per-thread
/// default stream, which orders with the legacy default stream (and so with device Buffers made
/// without an executor, see tandem/cuda/memory.hpp) but not with non-blocking streams.
/// Functors are structs with a TANDEM_HD operator() (no lambdas: tandem does not require
/// --extended-lambda) holding device pointers; they are copied into the kernel by value.
struct cuda_exec {
  /// The memory its kernels may touch: device memory.
  using memory_space = device;

  /// Where the kernels run; default: the calling thread's per-thread default stream.
  cudaStream_t stream = cudaStreamPerThread;

  /// Launches f(i) for every i in [0, n) on the stream and returns without waiting. Order across
  /// indices is unspecified: each index should write only its own elements. n == 0 launches
  /// nothing. A launch that fails (bad stream, no device, kernel too large) throws.
  template <class F>
  void for_each_index(std::size_t n, F&& f) const {
    using Functor = std::decay_t<F>;
    static_assert(std::is_trivially_copyable_v<Functor>,
                  "tandem: a functor for cuda_exec is copied into the kernel's arguments, so it "
                  "must be trivially copyable (plain pointers and values)");
    if (n == 0) return;
#if defined(__CUDACC__)
    const unsigned blocks = cuda::detail::grid_size(n);
    cuda::detail::for_each_index_kernel<Functor>
        <<<blocks, cuda::detail::threads_per_block, 0, stream>>>(n, Functor(std::forward<F>(f)));
    cuda::check(cudaGetLastError(), "cuda_exec::for_each_index (kernel launch)");
#else
    cuda::detail::launch_on_host(stream, n, Functor(std::forward<F>(f)),
                                 "cuda_exec::for_each_index (cudaLaunchHostFunc)");
#endif
  }

  /// Reduces map(0..n-1) with combine from init (CUB), copies the result to the host and waits
  /// for the stream. combine must be associative and commutative: CUB reduces in a tree, so
  /// floating-point sums may differ from host_exec's left-to-right order in the last bits.
  /// n == 0 returns init without touching the device. Not for use while the stream is being
  /// captured into a CUDA graph (it synchronises); transform_reduce_into is.
  template <class T, class Map, class Combine>
  [[nodiscard]] T transform_reduce(std::size_t n, T init, Map&& map, Combine&& combine) const {
    static_assert(std::is_trivially_copyable_v<T>,
                  "tandem: a reduction's value is copied from the device as bytes, so its type "
                  "must be trivially copyable");
    if (n == 0) return init;
    const auto mapped = cuda::detail::MapAs<T, std::decay_t<Map>>{std::forward<Map>(map)};
    const auto combined =
        cuda::detail::CombineAs<T, std::decay_t<Combine>>{std::forward<Combine>(combine)};
    const std::size_t temp_bytes = reduce_storage_bytes(n, init, mapped, combined);
    // One allocation: CUB's temporary storage, then the result slot.
    const std::size_t result_offset = (temp_bytes + cuda::detail::scratch_alignment - 1) /
                                      cuda::detail::scratch_alignment *
                                      cuda::detail::scratch_alignment;
    cuda::detail::StreamScratch scratch(result_offset + sizeof(T), stream,
                                        "cuda_exec::transform_reduce");
    T* device_result = reinterpret_cast<T*>(scratch.bytes() + result_offset);
    reduce(scratch.get(), temp_bytes, device_result, n, init, mapped, combined);
    T result = init;
    cuda::check(cudaMemcpyAsync(&result, device_result, sizeof(T), cudaMemcpyDeviceToHost, stream),
                "cuda_exec::transform_reduce (cudaMemcpyAsync of the result)");
    synchronize();
    return result;
  }

  /// The same reduction written to *out, which must be device memory (or managed); returns
  /// without waiting. The scratch memory is allocated and freed in stream order. n == 0 stores
  /// init into *out with a one-thread kernel (still in stream order).
  template <class T, class Map, class Combine>
  void transform_reduce_into(T* out, std::size_t n, T init, Map&& map, Combine&& combine) const {
    static_assert(std::is_trivially_copyable_v<T>,
                  "tandem: a reduction's value lives in device memory, so its type must be "
                  "trivially copyable");
    if (n == 0) {
#if defined(__CUDACC__)
      cuda::detail::store_kernel<T><<<1, 1, 0, stream>>>(out, init);
      cuda::check(cudaGetLastError(), "cuda_exec::transform_reduce_into (kernel launch)");
#else
      launch_reduction(out, 0, init, cuda::detail::MapAs<T, std::decay_t<Map>>{map},
                       cuda::detail::CombineAs<T, std::decay_t<Combine>>{combine});
#endif
      return;
    }
    const auto mapped = cuda::detail::MapAs<T, std::decay_t<Map>>{std::forward<Map>(map)};
    const auto combined =
        cuda::detail::CombineAs<T, std::decay_t<Combine>>{std::forward<Combine>(combine)};
    const std::size_t temp_bytes = reduce_storage_bytes(n, init, mapped, combined);
    // At least one byte: CUB takes a null pointer as "how much storage do you need?".
    cuda::detail::StreamScratch scratch(std::max<std::size_t>(temp_bytes, 1), stream,
                                        "cuda_exec::transform_reduce_into");
    reduce(scratch.get(), temp_bytes, out, n, init, mapped, combined);
  }

  /// Blocks the host until the stream's queued work has run; errors from it are thrown.
  void synchronize() const {
    cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }

 private:
#if defined(__CUDACC__)
  template <class T, class Map, class Combine>
  std::size_t reduce_storage_bytes(std::size_t n, const T& init, const Map& map,
                                   const Combine& combine) const {
    std::size_t bytes = 0;
    cuda::check(cub::DeviceReduce::TransformReduce(
                    nullptr, bytes, thrust::counting_iterator<std::size_t>(0),
                    static_cast<T*>(nullptr), n, combine, map, init, stream),
                "cub::DeviceReduce::TransformReduce (storage size)");
    return bytes;
  }

  template <class T, class Map, class Combine>
  void reduce(void* temp, std::size_t temp_bytes, T* out, std::size_t n, const T& init,
              const Map& map, const Combine& combine) const {
    cuda::check(cub::DeviceReduce::TransformReduce(temp, temp_bytes,
                                                   thrust::counting_iterator<std::size_t>(0), out,
                                                   n, combine, map, init, stream),
                "cub::DeviceReduce::TransformReduce");
  }
#else
  // The simulator's reductions need no temporary storage: one host function combines in order.
  template <class T, class Map, class Combine>
  std::size_t reduce_storage_bytes(std::size_t, const T&, const Map&, const Combine&) const {
    return 0;
  }

  template <class T, class Map, class Combine>
  void reduce(void*, std::size_t, T* out, std::size_t n, const T& init, const Map& map,
              const Combine& combine) const {
    launch_reduction(out, n, init, map, combine);
  }

  template <class T, class Map, class Combine>
  void launch_reduction(T* out, std::size_t n, const T& init, const Map& map,
                        const Combine& combine) const {
    cuda::detail::launch_on_host(
        stream, 1, cuda::detail::HostReduction<T, Map, Combine>{out, n, init, map, combine},
        "cuda_exec reduction (cudaLaunchHostFunc)");
  }
#endif
};

/// Opts cuda_exec in to the Executor concept.
template <>
inline constexpr bool enable_executor<cuda_exec> = true;

/// Device memory is processed on the calling thread's per-thread default stream unless a
/// cuda_exec with another stream is given.
template <>
struct default_executor<device> {
  /// A default cuda_exec: the per-thread default stream.
  using type = cuda_exec;
};

}  // namespace tandem
