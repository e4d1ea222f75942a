// The Loader delivering batches to a GPU through cuda_delivery: pinned staging, copies on the
// loader's stream, the training stream ordered by events. Kernels on the training stream are
// slowed down on purpose, so that a slot reused before the training stream finished with it
// would show as wrong sums. Without a GPU it prints why and exits 77 (skipped). On the simulated
// CUDA runtime (cuda-sim) the same code runs with the copies and kernels on its stream workers.
#include <cuda_runtime.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <span>
#include <thread>
#include <vector>

#include "tandem/cuda.hpp"
#include "tandem/data/batches.hpp"
#include "tandem/data/cuda_delivery.hpp"
#include "tandem/data/loader.hpp"
#include "tandem/data/sampler.hpp"

namespace {

struct Ramp {
  using fields = tandem::sample_fields<float, std::int64_t>;
  std::size_t size() const { return 5000; }
  std::array<std::size_t, 2> field_numel() const { return {4, 1}; }
  void read(std::size_t i, std::span<float> x, std::span<std::int64_t> y) const {
    for (std::size_t k = 0; k < 4; ++k) x[k] = static_cast<float>(i % 1000) + static_cast<float>(k);
    y[0] = static_cast<std::int64_t>(i);
  }
};

// One index: waits a while (`spin` GPU cycles; on the simulated runtime a fifth of a
// millisecond), then sums the batch's labels and last features.
struct SumBatch {
  const float* x;
  const std::int64_t* y;
  std::size_t n;
  long long spin;
  long long* out;

  TANDEM_HD void operator()(std::size_t) const {
#if defined(__CUDA_ARCH__)
    const long long start = clock64();
    while (clock64() - start < spin) {
    }
#else
    std::this_thread::sleep_for(std::chrono::microseconds(200));
#endif
    long long sum = 0;
    for (std::size_t j = 0; j < n; ++j) sum += y[j] + static_cast<long long>(x[4 * j + 3]);
    *out = sum;
  }
};

int failures = 0;
void expect(bool ok, const char* what) {
  if (!ok) {
    ++failures;
    std::printf("FAILED: %s\n", what);
  }
}

}  // namespace

int main() {
  if (tandem::cuda::device_count() == 0) {
    std::printf("SKIPPED: no CUDA device (the Loader's CUDA delivery compiled, not run)\n");
    return 77;
  }
  try {
    tandem::cuda::check(cudaSetDevice(0), "cudaSetDevice");
    Ramp data;
    tandem::DistributedSampler sampler(data.size(), 1, 0, {.seed = 3});
    auto batches = sampler | tandem::views::batches(50);
    for (int workers : {0, 1, 3}) {
      tandem::cuda::Stream training;
      long long* sums = nullptr;
      tandem::cuda::check(cudaMalloc(&sums, batches.size() * sizeof(long long)), "cudaMalloc");
      {
        tandem::Loader loader(data, batches, {.workers = workers, .prefetch = 2},
                              tandem::cuda_delivery(training.get()));
        for (const auto& batch : loader) {
          auto [x, y] = batch.views();
          static_assert(std::is_same_v<decltype(x), tandem::View<float, tandem::device>>);
          tandem::for_each_index(
              tandem::cuda_exec{training.get()}, 1,
              SumBatch{x.data(), y.data(), batch.size(), 200000, sums + batch.index()});
        }
        training.synchronize();
      }
      std::vector<long long> got(batches.size());
      tandem::cuda::check(
          cudaMemcpy(got.data(), sums, got.size() * sizeof(long long), cudaMemcpyDeviceToHost),
          "cudaMemcpy");
      cudaFree(sums);
      for (std::size_t b = 0; b < batches.size(); ++b) {
        long long expected = 0;
        for (auto i : batches[b]) expected += i + static_cast<long long>(i % 1000) + 3;
        expect(got[b] == expected, "batch sums on the device equal the host's");
        if (got[b] != expected) break;
      }
    }
    // pin_memory=True: page-locked host batches, the same as the pageable ones.
    tandem::Loader pageable(data, batches, {.workers = 2});
    tandem::Loader pinned(data, batches, {.workers = 2}, tandem::pinned_delivery{});
    std::vector<std::int64_t> a, b;
    for (const auto& batch : pageable)
      a.insert(a.end(), batch.indices().begin(), batch.indices().end());
    for (const auto& batch : pinned) {
      auto [x, y] = batch.views();
      static_assert(std::is_same_v<decltype(y), tandem::View<std::int64_t, tandem::pinned>>);
      cudaPointerAttributes attributes{};
      tandem::cuda::check(cudaPointerGetAttributes(&attributes, y.data()),
                          "cudaPointerGetAttributes");
      expect(attributes.type == cudaMemoryTypeHost, "pinned batches are page-locked host memory");
      b.insert(b.end(), y.data(), y.data() + y.size());
    }
    expect(a == b, "pinned batches hold the same samples");
  } catch (const std::exception& e) {
    std::printf("FAILED: %s\n", e.what());
    return 1;
  }
  if (failures == 0) std::printf("PASSED: Loader -> cuda_delivery with 0, 1 and 3 workers\n");
  return failures == 0 ? 0 : 1;
}
