// amp::FusedStep against the unfused sequence it replaces - scaler.step(adamw), then (when it
// stepped) ema.update() and compute.refresh() - bit for bit: parameters, both moments, the EMA
// shadow, the half copy, step counts and the scale, over several steps with clean, inf and NaN
// gradients; float (hand-vectorised path) and double, amsgrad and maximize, two param groups,
// sizes with tails, 1 and 3 threads. And its errors.
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tandem/amp/grad_scaler.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/optim/adamw.hpp"
#include "tandem/optim/ema.hpp"
#include "tandem/optim/fused_step.hpp"
#include "tandem/tensor/precision.hpp"

namespace {

using tandem::optim::AdamW;
using tandem::optim::AdamWOptions;

// FusedStep takes GradScaler through FusedStepScaler (optim/ includes no amp/ header): a scaler of
// the optimizer's memory space models it; one of another space, or an optimizer, does not.
static_assert(tandem::amp::FusedStepScaler<tandem::GradScaler<>, AdamW<float>>);
static_assert(tandem::amp::FusedStepScaler<tandem::GradScaler<>, AdamW<double>>);
static_assert(!tandem::amp::FusedStepScaler<tandem::GradScaler<tandem::device>, AdamW<float>>);
static_assert(!tandem::amp::FusedStepScaler<AdamW<float>, AdamW<float>>);

/// Bitwise equality of two arrays (NaN equals NaN with the same bits); names the first mismatch.
template <class T>
void require_same_bits(const T* a, const T* b, std::size_t n, const std::string& what) {
  for (std::size_t i = 0; i < n; ++i) {
    if (std::memcmp(a + i, b + i, sizeof(T)) != 0) {
      FAIL_CHECK(what << " differs at " << i << " of " << n << ": " << static_cast<double>(a[i])
                      << " vs " << static_cast<double>(b[i]));
      return;
    }
  }
}

/// One model's worth of training state: arena, AdamW (one group, or two splitting the arena),
/// EMA, the O2 half copy, a GradScaler with a short growth interval.
template <class T>
struct Model {
  tandem::Parameters<T> params;
  std::unique_ptr<AdamW<T>> adamw;
  std::unique_ptr<tandem::EMA<T>> ema;
  std::unique_ptr<tandem::amp::ComputeWeights<tandem::amp::O2<>>> compute;
  tandem::GradScaler<> scaler{
      tandem::GradScalerOptions{.init_scale = 1024.0, .growth_interval = 3}};

  Model(const std::vector<std::int64_t>& sizes, AdamWOptions options, bool two_groups) {
    for (std::size_t p = 0; p < sizes.size(); ++p) params.add("p" + std::to_string(p), {sizes[p]});
    params.finalize();
    auto values = params.values();
    std::mt19937 gen(7);
    std::normal_distribution<double> normal(0.0, 0.5);
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<T>(normal(gen));
    if (two_groups) {
      AdamWOptions second = options;
      second.weight_decay = 0.0;
      second.lr = options.lr * 0.5;
      adamw = std::make_unique<AdamW<T>>(
          params, std::initializer_list<tandem::optim::ParamGroup<AdamWOptions>>{
                      {tandem::optim::param_range(0, 1), options},
                      {tandem::optim::param_range(1, sizes.size()), second}});
    } else {
      adamw = std::make_unique<AdamW<T>>(params, options);
    }
    ema = std::make_unique<tandem::EMA<T>>(params,
                                           tandem::EMAOptions{.decay = 0.9, .use_warmup = true});
    if constexpr (std::is_same_v<T, float>) {
      compute = std::make_unique<tandem::amp::ComputeWeights<tandem::amp::O2<>>>(params.numel());
      compute->refresh(tandem::on_host, params.values());
    }
  }
};

/// Gradients for step s, the same for both models; `poison` puts an inf or a NaN in one.
template <class T>
void set_grads(tandem::Parameters<T>& params, int s, int poison) {
  auto grads = params.grads();
  std::mt19937 gen(100 + s);
  std::normal_distribution<double> normal(0.0, 40.0);  // scaled gradients, as backward leaves them
  for (std::size_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<T>(normal(gen));
  if (poison == 1) grads[grads.size() / 2] = std::numeric_limits<T>::infinity();
  if (poison == 2) grads[grads.size() - 1] = std::numeric_limits<T>::quiet_NaN();
}

template <class T>
void compare(Model<T>& fused, Model<T>& plain, const std::string& when) {
  INFO(when);
  const std::size_t n = plain.params.numel();
  require_same_bits(fused.params.values().data(), plain.params.values().data(), n, "values");
  require_same_bits(fused.ema->shadow_values().data(), plain.ema->shadow_values().data(), n,
                    "EMA shadow");
  CHECK(fused.ema->updates() == plain.ema->updates());
  CHECK(fused.scaler.get_scale() == plain.scaler.get_scale());
  CHECK(fused.scaler.growth_tracker() == plain.scaler.growth_tracker());
  for (std::size_t g = 0; g < plain.adamw->group_count(); ++g) {
    CHECK(fused.adamw->group_steps(g) == plain.adamw->group_steps(g));
  }
  const auto a = fused.adamw->state_dict();
  const auto b = plain.adamw->state_dict();
  REQUIRE(a.state.size() == b.state.size());
  for (const auto& [index, entry] : b.state) {
    for (const auto& [key, tensor] : entry.tensors) {
      const auto& other = a.state.at(index).tensors.at(key);
      REQUIRE(other.size() == tensor.size());
      require_same_bits(other.data(), tensor.data(), tensor.size(),
                        key + " of parameter " + std::to_string(index));
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    const auto x = fused.compute->values();
    const auto y = plain.compute->values();
    for (std::size_t i = 0; i < n; ++i) {
      if (std::memcmp(&x[i], &y[i], sizeof(tandem::half)) != 0) {
        FAIL_CHECK("half copy differs at " << i);
        break;
      }
    }
  }
}

/// Six steps (clean, inf, clean, NaN, clean, clean) through both paths, compared after each.
template <class T>
void run_against_unfused(const std::vector<std::int64_t>& sizes, AdamWOptions options,
                         bool two_groups, int threads) {
  Model<T> fused(sizes, options, two_groups);
  Model<T> plain(sizes, options, two_groups);
  tandem::amp::FusedStep step(
      tandem::amp::FusedStepOptions{.threads = threads, .min_elements_per_thread = 64});
  const int poison[] = {0, 1, 0, 2, 0, 0};
  for (int s = 0; s < 6; ++s) {
    set_grads(fused.params, s, poison[s]);
    set_grads(plain.params, s, poison[s]);
    const auto before = std::vector<T>(fused.params.values().begin(), fused.params.values().end());
    (void)fused.scaler.scale(1.0f);
    (void)plain.scaler.scale(1.0f);
    bool stepped = false;
    if constexpr (std::is_same_v<T, float>) {
      stepped = step.step(fused.scaler, *fused.adamw, *fused.ema, *fused.compute);
    } else {
      stepped = step.step(fused.scaler, *fused.adamw, *fused.ema);
    }
    const bool plain_stepped = plain.scaler.step(*plain.adamw);
    if (plain_stepped) {
      plain.ema->update();
      if constexpr (std::is_same_v<T, float>)
        plain.compute->refresh(tandem::on_host, plain.params.values());
    }
    CHECK(stepped == plain_stepped);
    CHECK(stepped == (poison[s] == 0));
    CHECK(fused.scaler.last_step_skipped() == !stepped);
    if (!stepped) {  // nothing at all changed
      require_same_bits(fused.params.values().data(), before.data(), before.size(),
                        "values after a skipped step");
    } else {
      std::size_t changed = 0;
      for (std::size_t i = 0; i < before.size(); ++i)
        changed += fused.params.values()[i] != before[i];
      CHECK(changed > before.size() / 2);  // the comparison below is not of two idle models
    }
    fused.scaler.update();
    plain.scaler.update();
    compare(fused, plain, "after step " + std::to_string(s));
  }
}

}  // namespace

TEST_CASE("FusedStep equals scaler.step + ema.update + refresh bit for bit: float, O2 half") {
  for (int threads : {1, 3}) {
    INFO("threads " << threads);
    run_against_unfused<float>({1000}, AdamWOptions{.lr = 1e-2}, false, threads);
    run_against_unfused<float>({37, 2053, 5}, AdamWOptions{.lr = 3e-3, .weight_decay = 0.1}, true,
                               threads);
    run_against_unfused<float>({4099}, AdamWOptions{.lr = 1e-3, .amsgrad = true}, false, threads);
    run_against_unfused<float>({1031, 9}, AdamWOptions{.lr = 1e-3, .maximize = true}, true,
                               threads);
  }
}

TEST_CASE("FusedStep equals the unfused sequence for double parameters, without a compute copy") {
  run_against_unfused<double>({777, 300}, AdamWOptions{.lr = 1e-2, .amsgrad = true}, true, 2);
  run_against_unfused<double>({5000}, AdamWOptions{.lr = 1e-3}, false, 1);
}

TEST_CASE(
    "FusedStep after unscale_ (gradient clipping) uses that check and does not unscale twice") {
  Model<float> fused({2000}, AdamWOptions{.lr = 1e-2}, false);
  Model<float> plain({2000}, AdamWOptions{.lr = 1e-2}, false);
  tandem::amp::FusedStep step(tandem::amp::FusedStepOptions{.threads = 2});
  set_grads(fused.params, 0, 0);
  set_grads(plain.params, 0, 0);
  (void)fused.scaler.scale(1.0f);
  (void)plain.scaler.scale(1.0f);
  fused.scaler.unscale_(*fused.adamw);
  plain.scaler.unscale_(*plain.adamw);
  CHECK(step.step(fused.scaler, *fused.adamw, *fused.ema, *fused.compute));
  CHECK(plain.scaler.step(*plain.adamw));
  plain.ema->update();
  plain.compute->refresh(tandem::on_host, plain.params.values());
  fused.scaler.update();
  plain.scaler.update();
  compare(fused, plain, "after unscale_ then the fused step");
}

TEST_CASE("FusedStep's errors: twice per update, an applied shadow, groups that leave values out") {
  Model<float> model({100, 50}, AdamWOptions{}, false);
  tandem::amp::FusedStep step;
  CHECK(step.threads() >= 1);
  set_grads(model.params, 0, 0);
  (void)model.scaler.scale(1.0f);
  CHECK(step.step(model.scaler, *model.adamw, *model.ema, *model.compute));
  CHECK_THROWS_WITH_AS(step.step(model.scaler, *model.adamw, *model.ema, *model.compute),
                       doctest::Contains("already been called"), tandem::Error);
  model.scaler.update();
  {
    auto guard = model.ema->applied();
    (void)model.scaler.scale(1.0f);
    CHECK_THROWS_WITH_AS(step.step(model.scaler, *model.adamw, *model.ema, *model.compute),
                         doctest::Contains("shadow is applied"), tandem::Error);
  }
  tandem::optim::AdamW<float> partial(model.params, {tandem::optim::ParamGroup<AdamWOptions>{
                                                        tandem::optim::param_range(1, 2), {}}});
  tandem::GradScaler<> scaler;
  (void)scaler.scale(1.0f);
  CHECK_THROWS_AS(step.step(scaler, partial, *model.ema, *model.compute), tandem::Error);
}

TEST_CASE("rank_cores: this rank's share of the machine, from LOCAL_WORLD_SIZE") {
  const int all = tandem::rank_cores();
  CHECK(all >= 1);
  ::setenv("LOCAL_WORLD_SIZE", "1000000", 1);  // more ranks than cores: ignored
  CHECK(tandem::rank_cores() == all);
  ::setenv("LOCAL_WORLD_SIZE", "x", 1);
  CHECK(tandem::rank_cores() == all);
  ::unsetenv("LOCAL_WORLD_SIZE");
}
