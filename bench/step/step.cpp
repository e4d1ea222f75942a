// bench/step/step.cpp - one training step's non-model work on the host, over a GPT-2-small-sized
// arena (124 M float parameters by default): GradScaler unscale + inf check, SGD (momentum,
// weight decay) and AdamW steps, EMA update, fp32 -> half cast; each pass's achieved memory
// bandwidth beside memcpy's in the same run.
//   bench_step [--params N] [--repeats R]     prints a Markdown table and RESULT lines
// Bandwidth counts the bytes each pass must read and write once (memcpy: read + write).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tandem/amp/grad_scaler.hpp"
#include "tandem/amp/precision.hpp"
#include "tandem/ddp/parameters.hpp"
#include "tandem/ema.hpp"
#include "tandem/optim/adamw.hpp"
#include "tandem/optim/sgd.hpp"

namespace {

struct Pass {
  std::string name;
  double bytes_per_element;
  std::function<void()> body;
  std::vector<double> seconds;
};

double seconds_of(const std::function<void()>& body) {
  const auto start = std::chrono::steady_clock::now();
  body();
  const auto stop = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(stop - start).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

std::size_t parse_size(const char* text) {
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  if (end == text || value <= 0) {
    std::fprintf(stderr, "bench_step: not a positive number: %s\n", text);
    std::exit(2);
  }
  return static_cast<std::size_t>(value);
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t n = 124'000'000;
  int repeats = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--params" && i + 1 < argc) {
      n = parse_size(argv[++i]);
    } else if (arg == "--repeats" && i + 1 < argc) {
      repeats = static_cast<int>(parse_size(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: bench_step [--params N] [--repeats R]\n");
      return 2;
    }
  }

  tandem::Parameters<float> params;
  params.add("flat", {static_cast<std::int64_t>(n)});
  params.finalize();
  auto values = params.values();
  auto grads = params.grads();
  for (std::size_t i = 0; i < n; ++i) {
    values[i] = static_cast<float>(static_cast<int>(i % 2001) - 1000) * 1e-3f;
    grads[i] = static_cast<float>(static_cast<int>(i % 997) - 498) * 1e-3f;
  }

  tandem::optim::SGD sgd(
      params, tandem::optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-4});
  tandem::optim::AdamW adamw(params, tandem::optim::AdamWOptions{.lr = 1e-3});
  tandem::EMA ema(params, tandem::EMAOptions{.decay = 0.999});
  tandem::amp::ComputeWeights<tandem::amp::O2<>> compute(n);
  tandem::GradScaler scaler;
  std::vector<float> copy_target(n);

  // The scale alternates between 2^16 and 2^-16 so that the gradients stay normal numbers
  // (repeated unscaling by 2^-16 would reach subnormals, which are slow on x86).
  bool upscale = false;
  std::vector<Pass> passes;
  passes.push_back({"memcpy (reference)",
                    8.0,
                    [&] { std::memcpy(copy_target.data(), grads.data(), n * sizeof(float)); },
                    {}});
  passes.push_back({"GradScaler unscale_ + inf check",
                    8.0,
                    [&] {
                      (void)scaler.scale(1.0f);
                      scaler.unscale_(sgd);
                      upscale = !upscale;
                      scaler.update(upscale ? 1.0f / 65536.0f : 65536.0f);
                    },
                    {}});
  passes.push_back({"SGD step (momentum, weight decay)", 20.0, [&] { sgd.step(); }, {}});
  passes.push_back({"AdamW step", 28.0, [&] { adamw.step(); }, {}});
  passes.push_back({"EMA update (lerp)", 12.0, [&] { ema.update(); }, {}});
  passes.push_back({"fp32 -> half cast (O2 refresh)",
                    6.0,
                    [&] { compute.refresh(tandem::on_host, params.values()); },
                    {}});

  // Rounds: every pass once per round, memcpy first, so that each pass and the copy it is
  // compared with see the same load on a shared machine. Round 0 warms up and is not counted.
  for (int round = 0; round <= repeats; ++round) {
    for (auto& pass : passes) {
      const double seconds = seconds_of(pass.body);
      if (round > 0) pass.seconds.push_back(seconds);
    }
  }

  const auto bandwidth = [n](const Pass& pass, double seconds) {
    return pass.bytes_per_element * static_cast<double>(n) / seconds / 1e9;
  };
  const double copy_seconds = median(passes[0].seconds);
  const double copy_bandwidth = bandwidth(passes[0], copy_seconds);
  std::printf("| pass | bytes/param | median ms | spread (min - max ms) | GB/s | of memcpy |\n");
  std::printf("|---|---:|---:|---:|---:|---:|\n");
  double step_seconds = 0;
  double step_bytes = 0;
  for (const auto& pass : passes) {
    const double seconds = median(pass.seconds);
    const auto [low, high] = std::minmax_element(pass.seconds.begin(), pass.seconds.end());
    std::printf("| %s | %.0f | %.1f | %.1f - %.1f | %.2f | %.0f %% |\n", pass.name.c_str(),
                pass.bytes_per_element, seconds * 1e3, *low * 1e3, *high * 1e3,
                bandwidth(pass, seconds), 100.0 * bandwidth(pass, seconds) / copy_bandwidth);
    if (&pass != &passes[0] && pass.name.rfind("SGD", 0) != 0) {
      step_seconds += seconds;  // an AdamW step: unscale, AdamW, EMA, cast
      step_bytes += pass.bytes_per_element;
    }
  }
  const double step_bandwidth = step_bytes * static_cast<double>(n) / step_seconds / 1e9;
  std::printf(
      "| AdamW step's non-model work (unscale + AdamW + EMA + cast) | %.0f | %.1f | - | "
      "%.2f | %.0f %% |\n",
      step_bytes, step_seconds * 1e3, step_bandwidth, 100.0 * step_bandwidth / copy_bandwidth);
  for (const auto& pass : passes) {
    const double seconds = median(pass.seconds);
    std::printf("RESULT pass=\"%s\" params=%zu seconds=%.6f GBps=%.3f\n", pass.name.c_str(), n,
                seconds, bandwidth(pass, seconds));
  }
  // Keep the results observable so that no pass can be optimised away.
  float checksum = copy_target[n / 2] + compute.values()[n / 3] + ema.shadow_values()[n / 5];
  std::printf("checksum %g (params %zu, repeats %d)\n", static_cast<double>(checksum), n, repeats);
  return 0;
}
