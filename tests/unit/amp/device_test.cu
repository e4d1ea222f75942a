// The device paths of the training toolkit on cuda_exec, each compared with the host: GradScaler's
// fused unscale + inf check (the flag in device memory, one value read for the skip decision),
// EMA's lerp pass (torch.lerp's FMA arithmetic, bit for bit) with integral buffers copied, and the
// O2 fp32 -> half / bfloat16 cast pass (blocks of four, and single elements where misaligned), and
// amp::FusedStep against the unfused device sequence, bit for bit. Its own main, so that it can
// exit 77 ("skipped") without a GPU; a failed check exits 1.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tandem/amp/grad_scaler.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/cuda/exec.hpp"
#include "tandem/cuda/memory.hpp"
#include "tandem/cuda/runtime.hpp"
#include "tandem/optim/adamw.hpp"
#include "tandem/optim/ema.hpp"
#include "tandem/optim/fused_step.hpp"
#include "tandem/tensor/precision.hpp"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (ok) return;
  if (failures++ < 20) std::printf("FAILED: %s\n", what.c_str());
}

std::uint32_t bits(float value) {
  std::uint32_t b = 0;
  std::memcpy(&b, &value, 4);
  return b;
}

}  // namespace

// Not in the unnamed namespace: nvcc warns about its members the Optimizer concept only names.
namespace amp_device_test {

/// An optimizer whose gradients live on the device; it counts its steps.
class DeviceOptimizer {
 public:
  using value_type = float;
  using memory_space = tandem::device;

  explicit DeviceOptimizer(std::size_t n) : grads_(n) {}
  void step() { ++steps; }
  void zero_grad() {}
  [[nodiscard]] tandem::View<float, tandem::device> grads() { return grads_.view(); }
  [[nodiscard]] tandem::cuda_exec executor() const { return {}; }
  [[nodiscard]] std::map<std::string, double> state_dict() const { return {}; }
  void load_state_dict(const std::map<std::string, double>&) {}

  int steps = 0;

 private:
  tandem::Buffer<float, tandem::device> grads_;
};
static_assert(tandem::Optimizer<DeviceOptimizer>);

}  // namespace amp_device_test

namespace {

using amp_device_test::DeviceOptimizer;

std::vector<float> to_host(tandem::View<float, tandem::device> device_values) {
  std::vector<float> host(device_values.size());
  tandem::copy(host, device_values);
  return host;
}

void grad_scaler_on_device() {
  constexpr std::size_t n = 100'003;  // several blocks, not a multiple of the block size
  DeviceOptimizer opt(n);
  tandem::GradScaler<tandem::device> scaler(tandem::GradScalerOptions{.init_scale = 1024.0});
  std::vector<float> scaled(n);
  for (std::size_t i = 0; i < n; ++i) scaled[i] = static_cast<float>(i % 17) * 1024.0f - 3.0f;

  // Iteration 1: one NaN far into the block: skipped, every other gradient still unscaled.
  scaled[n - 5] = std::numeric_limits<float>::quiet_NaN();
  tandem::copy(opt.grads(), scaled);
  (void)scaler.scale(1.0f);
  check(!scaler.step(opt), "a NaN gradient skips the step");
  auto unscaled = to_host(opt.grads());
  for (std::size_t i = 0; i < n; ++i) {
    if (i == n - 5) continue;
    if (bits(unscaled[i]) != bits(scaled[i] * (1.0f / 1024.0f))) {
      check(false, "unscaled gradient " + std::to_string(i));
      break;
    }
  }
  check(std::isnan(unscaled[n - 5]), "NaN stays NaN");
  scaler.update();
  check(scaler.get_scale() == 512.0, "backoff to 512");

  // Iteration 2: finite: the optimizer steps.
  scaled[n - 5] = 1.0f;
  tandem::copy(opt.grads(), scaled);
  (void)scaler.scale(1.0f);
  scaler.unscale_(opt);
  check(scaler.step(opt), "finite gradients step");
  check(opt.steps == 1, "one step");
  scaler.update();
  check(scaler.growth_tracker() == 1, "tracker counts the clean step");
}

void ema_on_device() {
  tandem::Parameters<float, tandem::device> params;
  params.add("w", {1000, 37});
  params.add_buffer("running_mean", {37});
  params.add_buffer("num_batches_tracked", {}, tandem::BufferKind::integral);
  params.finalize(tandem::cuda_exec{});
  const std::size_t n = params.numel();
  std::vector<float> initial(n);
  std::vector<float> live(n);
  for (std::size_t i = 0; i < n; ++i) {
    initial[i] = std::sin(static_cast<float>(i)) * 3.0f;
    live[i] = std::cos(static_cast<float>(i) * 0.7f);
  }
  std::vector<float> buffers(38, 2.0f);
  tandem::copy(params.values(), initial);
  tandem::copy(params.buffer_values(), buffers);

  tandem::EMA<float, tandem::device> ema(params, tandem::EMAOptions{.decay = 0.9});
  tandem::copy(params.values(), live);
  buffers.assign(38, 6.0f);
  tandem::copy(params.buffer_values(), buffers);
  ema.update(7);  // decay 0.9: weight 0.1 (< 0.5 branch)
  ema.update(8);
  ema.executor().synchronize();

  // The host reference: torch's lerp as two single-rounding FMAs.
  const auto weight = static_cast<float>(1.0 - 0.9);
  auto shadow = to_host(ema.shadow_values());
  for (std::size_t i = 0; i < n; ++i) {
    float want = std::fma(weight, live[i] - initial[i], initial[i]);
    want = std::fma(weight, live[i] - want, want);
    if (bits(shadow[i]) != bits(want)) {
      check(false, "EMA shadow element " + std::to_string(i));
      break;
    }
  }
  auto shadow_buffers = to_host(ema.shadow_buffer_values());
  const float mean =
      std::fma(weight, 6.0f - std::fma(weight, 4.0f, 2.0f), std::fma(weight, 4.0f, 2.0f));
  check(bits(shadow_buffers[0]) == bits(mean), "floating buffer averaged");
  check(shadow_buffers[37] == 6.0f, "integral buffer copied");

  {
    auto guard = ema.applied();
    check(ema.values().data() == ema.shadow_values().data(), "applied: the shadow is active");
  }
  check(ema.values().data() == params.values().data(), "restored: the live weights are active");
}

void cast_on_device() {
  constexpr std::size_t n = 70'001;
  std::vector<float> master(n);
  for (std::size_t i = 0; i < n; ++i) {
    master[i] = std::ldexp(static_cast<float>(i) * 0.37f - 9000.0f, static_cast<int>(i % 40) - 20);
  }
  tandem::Buffer<float, tandem::device> device_master(n);
  tandem::copy(device_master.view(), master);

  tandem::amp::ComputeWeights<tandem::amp::O2<>, tandem::device> halves(n);
  halves.refresh(tandem::cuda_exec{}, device_master.view());
  std::vector<tandem::half> got(n);
  tandem::copy(got, halves.values());
  for (std::size_t i = 0; i < n; ++i) {
    if (got[i].bits != tandem::half(master[i]).bits) {
      check(false, "half cast element " + std::to_string(i));
      break;
    }
  }

  tandem::amp::ComputeWeights<tandem::amp::O2<tandem::bfloat16>, tandem::device> bfloats(n);
  bfloats.refresh(tandem::cuda_exec{}, device_master.view());
  std::vector<tandem::bfloat16> got_bf(n);
  tandem::copy(got_bf, bfloats.values());
  for (std::size_t i = 0; i < n; ++i) {
    if (got_bf[i].bits != tandem::bfloat16(master[i]).bits) {
      check(false, "bfloat16 cast element " + std::to_string(i));
      break;
    }
  }
}

/// The device's FusedStep and the unfused sequence (scaler.step, ema.update, refresh) on two
/// identical device models, three steps (clean, inf, clean): the same bits everywhere.
struct DeviceModel {
  tandem::Parameters<float, tandem::device> params;
  std::unique_ptr<tandem::optim::AdamW<float, tandem::device>> adamw;
  std::unique_ptr<tandem::EMA<float, tandem::device>> ema;
  std::unique_ptr<tandem::amp::ComputeWeights<tandem::amp::O2<>, tandem::device>> compute;
  tandem::GradScaler<tandem::device> scaler{tandem::GradScalerOptions{.init_scale = 256.0}};

  explicit DeviceModel(const std::vector<float>& initial) {
    params.add("a", {static_cast<std::int64_t>(initial.size() - 7)});
    params.add("b", {7});
    params.finalize(tandem::cuda_exec{});
    tandem::copy(params.values(), initial);
    adamw = std::make_unique<tandem::optim::AdamW<float, tandem::device>>(
        params, tandem::optim::AdamWOptions{.lr = 1e-2, .weight_decay = 0.05});
    ema = std::make_unique<tandem::EMA<float, tandem::device>>(params,
                                                               tandem::EMAOptions{.decay = 0.8});
    compute = std::make_unique<tandem::amp::ComputeWeights<tandem::amp::O2<>, tandem::device>>(
        params.numel());
    compute->refresh(tandem::cuda_exec{}, params.values());
  }
};

void fused_step_on_device() {
  constexpr std::size_t n = 50'003;
  std::vector<float> initial(n);
  for (std::size_t i = 0; i < n; ++i) initial[i] = std::sin(static_cast<float>(i) * 0.1f);
  DeviceModel fused(initial);
  DeviceModel plain(initial);
  tandem::amp::FusedStep step;
  for (int s = 0; s < 3; ++s) {
    std::vector<float> grads(n);
    for (std::size_t i = 0; i < n; ++i)
      grads[i] = std::cos(static_cast<float>(i * (s + 1))) * 300.0f;
    if (s == 1) grads[n / 3] = std::numeric_limits<float>::infinity();
    tandem::copy(fused.params.grads(), grads);
    tandem::copy(plain.params.grads(), grads);
    (void)fused.scaler.scale(1.0f);
    (void)plain.scaler.scale(1.0f);
    const bool a = step.step(fused.scaler, *fused.adamw, *fused.ema, *fused.compute);
    const bool b = plain.scaler.step(*plain.adamw);
    if (b) {
      plain.ema->update();
      plain.compute->refresh(tandem::cuda_exec{}, plain.params.values());
    }
    fused.scaler.update();
    plain.scaler.update();
    check(a == b && a == (s != 1), "fused step " + std::to_string(s) + " stepped as unfused");
    const auto same = [&](auto x, auto y, const std::string& what) {
      std::vector<float> hx(x.size());
      std::vector<float> hy(y.size());
      tandem::copy(hx, x);
      tandem::copy(hy, y);
      if (hx.size() != hy.size()) check(false, what + ": sizes differ");
      for (std::size_t i = 0; i < hx.size(); ++i) {
        if (bits(hx[i]) != bits(hy[i])) {
          check(false, what + " after step " + std::to_string(s) + " at " + std::to_string(i));
          return;
        }
      }
    };
    same(fused.params.values(), plain.params.values(), "fused values");
    same(fused.ema->shadow_values(), plain.ema->shadow_values(), "fused EMA shadow");
    const auto da = fused.adamw->state_dict();
    const auto db = plain.adamw->state_dict();
    for (const auto& [index, entry] : db.state) {
      for (const auto& [key, tensor] : entry.tensors) {
        same(da.state.at(index).tensors.at(key).view(), tensor.view(), "fused " + key);
      }
    }
    std::vector<tandem::half> ha(n), hb(n);
    tandem::copy(ha, fused.compute->values());
    tandem::copy(hb, plain.compute->values());
    for (std::size_t i = 0; i < n; ++i) {
      if (ha[i].bits != hb[i].bits) {
        check(false, "fused half copy at " + std::to_string(i));
        break;
      }
    }
    check(fused.ema->updates() == plain.ema->updates(), "EMA update counts");
    check(fused.scaler.get_scale() == plain.scaler.get_scale(), "scales");
  }
}

}  // namespace

int main() {
  if (tandem::cuda::device_count() == 0) {
    std::printf("SKIPPED: no CUDA device (GradScaler, EMA and cast passes on cuda_exec)\n");
    return 77;
  }
  try {
    grad_scaler_on_device();
    ema_on_device();
    cast_on_device();
    fused_step_on_device();
  } catch (const std::exception& e) {
    std::printf("FAILED: exception: %s\n", e.what());
    return 1;
  }
  if (failures != 0) {
    std::printf("%d check(s) failed\n", failures);
    return 1;
  }
  std::printf(
      "PASSED: GradScaler, EMA and cast passes on the device match the host; FusedStep "
      "matches the unfused device sequence\n");
  return 0;
}
