// bench/step/step.cpp - one training step's non-model work on the host, over a GPT-2-small-sized
// arena (124 M float parameters by default): GradScaler unscale + inf check, SGD (momentum,
// weight decay) and AdamW steps, EMA update, fp32 -> half cast; each pass's achieved memory
// bandwidth beside memcpy's in the same run.
// Then the whole non-model part of an AdamW step through GradScaler, unfused (scaler.step, EMA
// update, cast: 54 bytes per parameter) and as amp::FusedStep (two passes, 42 bytes) on 1 and on
// --threads threads, each from restored gradients with a fresh scaler; the restore copy is timed
// alone and subtracted. The run fails (exit 1, no results) when the timed work did not happen.
//   bench_step [--params N] [--repeats R] [--threads T]   prints a Markdown table, RESULT lines
// Bandwidth counts the bytes each pass must read and write once (memcpy: read + write).
// --threads: the fused step's threads (default tandem::rank_cores(), this rank's share).
// --poison: one gradient is inf, every training step is skipped, and the run must fail (exit 1):
// the check of the checks.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "tandem/amp/grad_scaler.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/optim/adamw.hpp"
#include "tandem/optim/ema.hpp"
#include "tandem/optim/fused_step.hpp"
#include "tandem/optim/sgd.hpp"
#include "tandem/tensor/precision.hpp"

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
  int threads = tandem::rank_cores();
  bool poison =
      false;  // --poison: one gradient is inf, so every step is skipped and the run must fail
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--params" && i + 1 < argc) {
      n = parse_size(argv[++i]);
    } else if (arg == "--repeats" && i + 1 < argc) {
      repeats = static_cast<int>(parse_size(argv[++i]));
    } else if (arg == "--poison") {
      poison = true;
    } else if (arg == "--threads" && i + 1 < argc) {
      threads = static_cast<int>(parse_size(argv[++i]));
    } else {
      std::fprintf(stderr,
                   "usage: bench_step [--params N] [--repeats R] [--threads T] [--poison]\n");
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

  if (poison) grads[n / 2] = std::numeric_limits<float>::infinity();
  const std::vector<float> original_grads(grads.begin(), grads.end());

  // Training steps as a program runs them: fresh gradients (restored: GradScaler unscales them in
  // place), a GradScaler of their own at the default scale, every step counted.
  const auto restore = [&] { std::memcpy(grads.data(), original_grads.data(), n * sizeof(float)); };
  tandem::GradScaler unfused_scaler;
  tandem::GradScaler fused_scaler;
  tandem::amp::FusedStep fused_one(tandem::amp::FusedStepOptions{.threads = 1});
  tandem::amp::FusedStep fused_many(tandem::amp::FusedStepOptions{.threads = threads});
  std::int64_t training_calls = 0;
  std::int64_t training_stepped = 0;
  const auto unfused_step = [&] {
    restore();
    (void)unfused_scaler.scale(1.0f);
    training_stepped += unfused_scaler.step(adamw) ? 1 : 0;
    unfused_scaler.update();
    ema.update();
    compute.refresh(tandem::on_host, params.values());
    ++training_calls;
  };
  const auto fused_step = [&](tandem::amp::FusedStep& fused) {
    restore();
    (void)fused_scaler.scale(1.0f);
    training_stepped += fused.step(fused_scaler, adamw, ema, compute) ? 1 : 0;
    fused_scaler.update();
    ++training_calls;
  };

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
  passes.push_back({"gradient restore (memcpy, timed alone)", 8.0, restore, {}});
  passes.push_back({"AdamW training step, unfused: GradScaler step, EMA, cast (restore subtracted)",
                    54.0,
                    unfused_step,
                    {}});
  passes.push_back({"AdamW training step, amp::FusedStep, 1 thread (restore subtracted)",
                    42.0,
                    [&] { fused_step(fused_one); },
                    {}});
  if (threads > 1) {
    passes.push_back({"AdamW training step, amp::FusedStep, " + std::to_string(threads) +
                          " threads (restore subtracted)",
                      42.0,
                      [&] { fused_step(fused_many); },
                      {}});
  }
  passes.push_back({"fp32 -> half cast (O2 refresh)",
                    6.0,
                    [&] { compute.refresh(tandem::on_host, params.values()); },
                    {}});

  const std::vector<float> before(values.begin(), values.end());
  // Rounds: every pass once per round, memcpy first, so that each pass and the copy it is
  // compared with see the same load on a shared machine. Round 0 warms up and is not counted.
  for (int round = 0; round <= repeats; ++round) {
    for (auto& pass : passes) {
      const double seconds = seconds_of(pass.body);
      if (round > 0) pass.seconds.push_back(seconds);
    }
  }

  // The work must have happened, or the numbers below are not those of the passes named: every
  // optimizer step and EMA update ran, the gradients stayed finite (no unscale found an inf), and
  // the parameters changed. (A GPU run on 2026-11-23 timed skipped steps before such checks.)
  {
    const auto rounds = static_cast<std::int64_t>(repeats) + 1;
    std::size_t changed = 0;
    std::size_t non_finite = 0;
    for (std::size_t i = 0; i < n; ++i) {
      changed += values[i] != before[i] ? 1 : 0;
      non_finite += (grads[i] - grads[i] != 0.0f || values[i] - values[i] != 0.0f) ? 1 : 0;
    }
    std::vector<std::string> failures;
    // AdamW and the EMA step once per round in their own passes and once per training step.
    if (adamw.group_steps(0) != rounds + training_calls) {
      failures.push_back("AdamW did not step every round and every training step");
    }
    if (sgd.group_steps(0) != rounds) failures.push_back("SGD did not step every round");
    if (ema.updates() != static_cast<std::size_t>(rounds + training_calls)) {
      failures.push_back("the EMA did not update every round and every training step");
    }
    if (training_stepped != training_calls) {
      failures.push_back(std::to_string(training_calls - training_stepped) + " of " +
                         std::to_string(training_calls) +
                         " training steps were skipped (inf or NaN gradients)");
    }
    if (unfused_scaler.get_scale() != 65536.0 || fused_scaler.get_scale() != 65536.0) {
      failures.push_back("a training step's scale moved from 65536");
    }
    if (non_finite != 0) {
      failures.push_back(std::to_string(non_finite) + " gradients or parameters are inf/NaN");
    }
    if (changed < n / 2) {
      failures.push_back("only " + std::to_string(changed) + " of " + std::to_string(n) +
                         " parameters changed");
    }
    std::printf(
        "CHECK passes: %lld rounds, %lld training steps (%lld stepped), AdamW steps %lld, SGD "
        "steps %lld, EMA updates %zu, scales %g %g, %zu of %zu parameters changed, %zu inf/NaN\n",
        static_cast<long long>(rounds), static_cast<long long>(training_calls),
        static_cast<long long>(training_stepped), static_cast<long long>(adamw.group_steps(0)),
        static_cast<long long>(sgd.group_steps(0)), ema.updates(), unfused_scaler.get_scale(),
        fused_scaler.get_scale(), changed, n, non_finite);
    if (!failures.empty()) {
      for (const auto& failure : failures)
        std::fprintf(stderr, "bench_step: %s\n", failure.c_str());
      std::fprintf(stderr, "bench_step: the timed work did not happen; no results\n");
      return 1;
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
  double restore_seconds = 0;
  for (const auto& pass : passes) {
    if (pass.name.rfind("gradient restore", 0) == 0) restore_seconds = median(pass.seconds);
  }
  // A training step's time is its median less the restore's: the work a program's step does.
  const auto seconds_of_pass = [&](const Pass& pass) {
    const bool restored = pass.name.find("restore subtracted") != std::string::npos;
    return median(pass.seconds) - (restored ? restore_seconds : 0.0);
  };
  for (const auto& pass : passes) {
    const double seconds = seconds_of_pass(pass);
    const double shift = median(pass.seconds) - seconds;  // the restore, where subtracted
    const auto [low_it, high_it] = std::minmax_element(pass.seconds.begin(), pass.seconds.end());
    const double* low = &*low_it;
    const double* high = &*high_it;
    std::printf("| %s | %.0f | %.1f | %.1f - %.1f | %.2f | %.0f %% |\n", pass.name.c_str(),
                pass.bytes_per_element, seconds * 1e3, (*low - shift) * 1e3, (*high - shift) * 1e3,
                bandwidth(pass, seconds), 100.0 * bandwidth(pass, seconds) / copy_bandwidth);
    const bool separate_pass = pass.name.rfind("GradScaler", 0) == 0 ||
                               pass.name.rfind("AdamW step", 0) == 0 ||
                               pass.name.rfind("EMA", 0) == 0 || pass.name.rfind("fp32", 0) == 0;
    if (separate_pass) {
      step_seconds += seconds;  // an AdamW step: unscale, AdamW, EMA, cast
      step_bytes += pass.bytes_per_element;
    }
  }
  const double step_bandwidth = step_bytes * static_cast<double>(n) / step_seconds / 1e9;
  std::printf(
      "| sum of the separate passes above (unscale + AdamW + EMA + cast) | %.0f | %.1f | - | "
      "%.2f | %.0f %% |\n",
      step_bytes, step_seconds * 1e3, step_bandwidth, 100.0 * step_bandwidth / copy_bandwidth);
  for (const auto& pass : passes) {
    const double seconds = seconds_of_pass(pass);
    std::printf("RESULT pass=\"%s\" params=%zu seconds=%.6f GBps=%.3f\n", pass.name.c_str(), n,
                seconds, bandwidth(pass, seconds));
  }
  // Keep the results observable so that no pass can be optimised away.
  float checksum = copy_target[n / 2] + compute.values()[n / 3] + ema.shadow_values()[n / 5];
  std::printf("checksum %g (params %zu, repeats %d, fused threads %d)\n",
              static_cast<double>(checksum), n, repeats, threads);
  return 0;
}
