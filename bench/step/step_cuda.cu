// bench/step/step_cuda.cu - the same training-step passes as bench_step (unscale + inf check, SGD,
// AdamW, EMA update, fp32 -> half cast) over 124 M float parameters on one GPU with cuda_exec,
// each pass's achieved bandwidth beside a device-to-device copy in the same run; exits 77 without
// a GPU. step_torch.py is the PyTorch peer (fused AdamW + GradScaler + torch._foreach_lerp_).
//   bench_step_cuda [--params N] [--repeats R]     prints a Markdown table and RESULT lines
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "tandem/amp/grad_scaler.hpp"
#include "tandem/amp/precision.hpp"
#include "tandem/cuda/exec.hpp"
#include "tandem/cuda/memory.hpp"
#include "tandem/cuda/runtime.hpp"
#include "tandem/ddp/parameters.hpp"
#include "tandem/ema.hpp"
#include "tandem/optim/adamw.hpp"
#include "tandem/optim/sgd.hpp"

namespace {

struct Measurement {
  std::string name;
  double bytes_per_element;
  double seconds;
};

/// Fills values[i] and grads[i] with small normal numbers, on the device.
struct fill_arena {
  float* values;
  float* grads;
  TANDEM_HD void operator()(std::size_t i) const {
    values[i] = static_cast<float>(static_cast<int>(i % 2001) - 1000) * 1e-3f;
    grads[i] = static_cast<float>(static_cast<int>(i % 997) - 498) * 1e-3f;
  }
};

/// Median time of `repeats` calls of body, each timed with events on the executor's stream.
double median_seconds(int repeats, cudaStream_t stream, const std::function<void()>& body) {
  body();
  tandem::cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  tandem::cuda::check(cudaEventCreate(&start), "cudaEventCreate");
  tandem::cuda::check(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    tandem::cuda::check(cudaEventRecord(start, stream), "cudaEventRecord");
    body();
    tandem::cuda::check(cudaEventRecord(stop, stream), "cudaEventRecord");
    tandem::cuda::check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    tandem::cuda::check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    times.push_back(ms / 1e3);
  }
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t n = 124'000'000;
  int repeats = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--params" && i + 1 < argc) {
      n = static_cast<std::size_t>(std::strtod(argv[++i], nullptr));
    } else if (arg == "--repeats" && i + 1 < argc) {
      repeats = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: bench_step_cuda [--params N] [--repeats R]\n");
      return 2;
    }
  }
  if (tandem::cuda::device_count() == 0) {
    std::printf("SKIPPED: no CUDA device (bench_step_cuda needs a GPU)\n");
    return 77;
  }

  try {
    const tandem::cuda_exec exec{};
    tandem::Parameters<float, tandem::device> params;
    params.add("flat", {static_cast<std::int64_t>(n)});
    params.finalize(exec);
    tandem::for_each_index(exec, n, fill_arena{params.values().data(), params.grads().data()});

    tandem::optim::SGD sgd(
        params, tandem::optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-4}, exec);
    tandem::optim::AdamW adamw(params, tandem::optim::AdamWOptions{.lr = 1e-3}, exec);
    tandem::EMA<float, tandem::device> ema(params, tandem::EMAOptions{.decay = 0.999}, exec);
    tandem::amp::ComputeWeights<tandem::amp::O2<>, tandem::device> compute(n);
    tandem::GradScaler<tandem::device> scaler;
    tandem::Buffer<float, tandem::device> copy_target(n);
    exec.synchronize();

    std::vector<Measurement> results;
    results.push_back(
        {"device-to-device copy (reference)", 8.0, median_seconds(repeats, exec.stream, [&] {
           tandem::cuda::check(
               cudaMemcpyAsync(copy_target.data(), params.grads().data(), n * sizeof(float),
                               cudaMemcpyDeviceToDevice, exec.stream),
               "cudaMemcpyAsync");
         })});
    bool upscale = false;
    // unscale_ keeps the flag on the device; update() reads it (one 4-byte copy per step, as
    // PyTorch's step() does). The scale alternates so the gradients stay normal numbers.
    results.push_back(
        {"GradScaler unscale_ + inf check", 8.0, median_seconds(repeats, exec.stream, [&] {
           (void)scaler.scale(1.0f);
           scaler.unscale_(sgd);
           upscale = !upscale;
           scaler.update(upscale ? 1.0f / 65536.0f : 65536.0f);
         })});
    results.push_back({"SGD step (momentum, weight decay)", 20.0,
                       median_seconds(repeats, exec.stream, [&] { sgd.step(); })});
    results.push_back(
        {"AdamW step", 28.0, median_seconds(repeats, exec.stream, [&] { adamw.step(); })});
    results.push_back(
        {"EMA update (lerp)", 12.0, median_seconds(repeats, exec.stream, [&] { ema.update(); })});
    results.push_back(
        {"fp32 -> half cast (O2 refresh)", 6.0,
         median_seconds(repeats, exec.stream, [&] { compute.refresh(exec, params.values()); })});
    // The whole non-model part of an AdamW step, as the PyTorch peer times it.
    results.push_back({"AdamW training step (GradScaler step + update, EMA, cast)", 54.0,
                       median_seconds(repeats, exec.stream, [&] {
                         (void)scaler.scale(1.0f);
                         scaler.step(adamw);
                         scaler.update();
                         ema.update();
                         compute.refresh(exec, params.values());
                       })});

    const double copy_bandwidth = 8.0 * static_cast<double>(n) / results[0].seconds / 1e9;
    std::printf("| pass | bytes/param | median ms | GB/s | of copy |\n|---|---:|---:|---:|---:|\n");
    for (const auto& r : results) {
      const double bandwidth = r.bytes_per_element * static_cast<double>(n) / r.seconds / 1e9;
      std::printf("| %s | %.0f | %.3f | %.1f | %.0f %% |\n", r.name.c_str(), r.bytes_per_element,
                  r.seconds * 1e3, bandwidth, 100.0 * bandwidth / copy_bandwidth);
    }
    for (const auto& r : results) {
      std::printf("RESULT impl=tandem pass=\"%s\" params=%zu seconds=%.6f\n", r.name.c_str(), n,
                  r.seconds);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_step_cuda: %s\n", e.what());
    return 1;
  }
  return 0;
}
