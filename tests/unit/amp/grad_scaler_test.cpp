// GradScaler against torch's GradScaler (golden data from tests/reference/golden_grad_scaler.py):
// scale, tracker, unscaled gradients and skip decisions bit for bit; PyTorch's misuse errors,
// state_dict keys and enabled=false; the inf flag all-reduced across LocalComm ranks.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "support/error_of.hpp"
#include "support/golden.hpp"
#include "tandem/amp/grad_scaler.hpp"
#include "tandem/comm/local/local.hpp"
#include "unit/amp/fake_optimizer.hpp"

namespace {

using tandem::GradScaler;
using tandem::GradScalerOptions;
using tandem::test::CountingOptimizer;
using tandem::test::error_of;

const tandem::test::Golden& golden() {
  static const tandem::test::Golden file("grad_scaler.txt");
  return file;
}

/// Bitwise equality of float32 values, NaN equal to NaN (any payload).
bool same_float(float got, double want) {
  const auto expected = static_cast<float>(want);
  if (std::isnan(expected)) return std::isnan(got);
  std::uint32_t a = 0;
  std::uint32_t b = 0;
  std::memcpy(&a, &got, 4);
  std::memcpy(&b, &expected, 4);
  return a == b;
}

void fill(CountingOptimizer<float>& opt, const std::vector<double>& values) {
  auto grads = opt.grads();
  REQUIRE(grads.size() == values.size());
  for (std::size_t i = 0; i < values.size(); ++i) grads[i] = static_cast<float>(values[i]);
}

/// Replays one golden case; `explicit_unscale` calls unscale_ before step on odd iterations (the
/// gradient-clipping pattern), step() unscales itself on the others.
void replay(const std::string& name) {
  const auto& g = golden();
  const auto config = g.values(name + "/config");
  GradScalerOptions options;
  options.init_scale = config[0];
  options.growth_factor = config[1];
  options.backoff_factor = config[2];
  options.growth_interval = static_cast<std::int64_t>(config[3]);
  const auto steps = static_cast<int>(config[4]);
  const auto optimizers = static_cast<std::size_t>(config[5]);

  GradScaler scaler(options);
  std::vector<CountingOptimizer<float>> opts;
  for (std::size_t o = 0; o < optimizers; ++o) opts.emplace_back(7);
  std::vector<int> expected_steps(optimizers, 0);

  for (int s = 0; s < steps; ++s) {
    const std::string prefix = name + "/s" + std::to_string(s);
    CAPTURE(prefix);
    const float loss = scaler.scale(1.0f);
    CHECK(same_float(loss, g.value(prefix + "/scale")));
    for (std::size_t o = 0; o < optimizers; ++o) {
      const std::string key = prefix + "/o" + std::to_string(o);
      fill(opts[o], g.values(key + "/grads"));
      if (s % 2 == 1) scaler.unscale_(opts[o]);
      const bool stepped = scaler.step(opts[o]);
      CHECK(stepped == (g.value(key + "/stepped") == 1.0));
      CHECK(scaler.last_step_skipped() == (g.value(key + "/found_inf") == 1.0));
      expected_steps[o] += stepped ? 1 : 0;
      CHECK(opts[o].steps == expected_steps[o]);
      const auto& unscaled = g.values(key + "/unscaled");
      auto grads = opts[o].grads();
      for (std::size_t i = 0; i < unscaled.size(); ++i) {
        CAPTURE(i);
        CHECK(same_float(grads[i], unscaled[i]));
      }
    }
    scaler.update();
    CHECK(same_float(static_cast<float>(scaler.get_scale()), g.value(prefix + "/scale_after")));
    CHECK(scaler.growth_tracker() == static_cast<std::int32_t>(g.value(prefix + "/tracker_after")));
  }

  const auto state = scaler.state_dict();
  const auto& want = g.values(name + "/state_dict");
  CHECK(state.at("scale") == want[0]);
  CHECK(state.at("growth_factor") == want[1]);
  CHECK(state.at("backoff_factor") == want[2]);
  CHECK(state.at("growth_interval") == want[3]);
  CHECK(state.at("_growth_tracker") == want[4]);
}

}  // namespace

TEST_CASE("GradScaler matches torch's GradScaler on every golden case") {
  for (const char* name : {"defaults", "growth", "overflow", "odd_factors", "two_optimizers"}) {
    SUBCASE(name) {
      replay(name);
    }
  }
}

TEST_CASE("GradScaler's defaults and state_dict keys are PyTorch's") {
  GradScaler scaler;
  CHECK(scaler.is_enabled());
  CHECK(scaler.get_scale() == 65536.0);
  CHECK(scaler.get_growth_factor() == 2.0);
  CHECK(scaler.get_backoff_factor() == 0.5);
  CHECK(scaler.get_growth_interval() == 2000);
  const auto state = scaler.state_dict();
  std::vector<std::string> keys;
  for (const auto& [key, value] : state) keys.push_back(key);
  CHECK(keys == std::vector<std::string>{"_growth_tracker", "backoff_factor", "growth_factor",
                                         "growth_interval", "scale"});
  CHECK(state.at("scale") == 65536.0);
  CHECK(state.at("_growth_tracker") == 0.0);
  CHECK(scaler.scale(0.5f) == 32768.0f);
  CHECK(scaler.scale(0.25) == 16384.0);
  CHECK(static_cast<float>(scaler.scale(tandem::half(2.0f))) == 131072.0f);
}

TEST_CASE("GradScaler raises PyTorch's misuse errors") {
  CountingOptimizer<float> opt(3);

  SUBCASE("before the first scale()") {
    GradScaler scaler;
    CHECK(error_of([&] { scaler.unscale_(opt); }).find("scaler.scale(loss)") != std::string::npos);
    CHECK(error_of([&] { scaler.step(opt); }).find("Attempted step") != std::string::npos);
    CHECK(error_of([&] { scaler.update(); }).find("Attempted update") != std::string::npos);
  }
  SUBCASE("unscale_ twice") {
    GradScaler scaler;
    (void)scaler.scale(1.0f);
    scaler.unscale_(opt);
    CHECK(error_of([&] { scaler.unscale_(opt); }) ==
          "tandem: GradScaler::unscale_: unscale_() has already been called on this optimizer "
          "since the last update()");
  }
  SUBCASE("unscale_ after step") {
    GradScaler scaler;
    (void)scaler.scale(1.0f);
    scaler.step(opt);
    CHECK(error_of([&] { scaler.unscale_(opt); }).find("unscale_() is being called after step()") !=
          std::string::npos);
  }
  SUBCASE("step twice") {
    GradScaler scaler;
    (void)scaler.scale(1.0f);
    scaler.step(opt);
    CHECK(error_of([&] {
            scaler.step(opt);
          }).find("step() has already been called since the last update()") != std::string::npos);
    CHECK(opt.steps == 1);
  }
  SUBCASE("update with no inf check") {
    GradScaler scaler;
    (void)scaler.scale(1.0f);
    CHECK(error_of([&] { scaler.update(); }).find("No inf checks were recorded prior to update") !=
          std::string::npos);
  }
  SUBCASE("after update() the next iteration may unscale and step again") {
    GradScaler scaler;
    (void)scaler.scale(1.0f);
    scaler.step(opt);
    scaler.update();
    scaler.unscale_(opt);
    CHECK(scaler.step(opt));
    CHECK(opt.steps == 2);
  }
  SUBCASE("invalid factors") {
    CHECK(error_of([] { GradScaler s(GradScalerOptions{.growth_factor = 1.0}); }) ==
          "tandem: GradScaler::GradScaler: The growth factor must be > 1.0");
    CHECK(error_of([] { GradScaler s(GradScalerOptions{.backoff_factor = 1.0}); }) ==
          "tandem: GradScaler::GradScaler: The backoff factor must be < 1.0");
  }
}

TEST_CASE("GradScaler with enabled=false is a no-op that still steps") {
  GradScaler scaler(GradScalerOptions{.enabled = false});
  CountingOptimizer<float> opt(2);
  opt.grads()[0] = std::numeric_limits<float>::infinity();
  opt.grads()[1] = 3.0f;
  CHECK(scaler.scale(2.5f) == 2.5f);
  CHECK(scaler.scale(2.5) == 2.5);
  scaler.unscale_(opt);
  CHECK(scaler.step(opt));
  CHECK(scaler.step(opt));  // no stage checks when disabled
  scaler.update();
  CHECK(opt.steps == 2);
  CHECK(opt.grads()[1] == 3.0f);
  CHECK(scaler.get_scale() == 1.0);
  CHECK(scaler.state_dict().empty());
  scaler.load_state_dict({});  // ignored, as PyTorch
}

TEST_CASE("GradScaler unscales once per step, skips on inf and NaN, and backs off") {
  GradScaler scaler(GradScalerOptions{.init_scale = 8.0});
  CountingOptimizer<float> opt(4);
  (void)scaler.scale(1.0f);
  auto grads = opt.grads();
  grads[0] = 8.0f;
  grads[1] = -4.0f;
  grads[2] = std::numeric_limits<float>::quiet_NaN();
  grads[3] = 2.0f;
  CHECK_FALSE(scaler.step(opt));
  CHECK(opt.steps == 0);
  CHECK(grads[0] == 1.0f);
  CHECK(grads[1] == -0.5f);
  CHECK(grads[3] == 0.25f);
  scaler.update();
  CHECK(scaler.get_scale() == 4.0);

  (void)scaler.scale(1.0f);
  grads[2] = 4.0f;
  CHECK(scaler.step(opt));
  CHECK(grads[2] == 1.0f);
  CHECK(opt.steps == 1);
  scaler.update(1024.0f);  // a user-given scale; no inf check needed
  CHECK(scaler.get_scale() == 1024.0);
  CHECK(scaler.growth_tracker() == 0);
}

TEST_CASE("GradScaler unscales half gradients in float, rounding once") {
  GradScaler scaler(GradScalerOptions{.init_scale = 3.0});
  CountingOptimizer<tandem::half> opt(3);
  (void)scaler.scale(1.0f);
  auto grads = opt.grads();
  grads[0] = tandem::half(1.0f);
  grads[1] = tandem::half(-7.0f);
  grads[2] = tandem::half(0.1f);
  const auto inv = static_cast<float>(1.0 / 3.0);
  const float before[3] = {grads[0], grads[1], grads[2]};
  CHECK(scaler.step(opt));
  for (int i = 0; i < 3; ++i) CHECK(grads[i].bits == tandem::half(before[i] * inv).bits);
  scaler.update();

  (void)scaler.scale(1.0f);
  grads[1] = tandem::half::from_bits(0x7c00);  // +inf
  CHECK_FALSE(scaler.step(opt));
}

TEST_CASE("GradScaler's load_state_dict restores scale and tracker, and rejects bad dicts") {
  GradScaler first(GradScalerOptions{.init_scale = 16.0, .growth_interval = 3});
  CountingOptimizer<float> opt(1);
  for (int i = 0; i < 2; ++i) {
    (void)first.scale(1.0f);
    first.step(opt);
    first.update();
  }
  CHECK(first.growth_tracker() == 2);
  const auto saved = first.state_dict();

  GradScaler second;
  second.load_state_dict(saved);
  CHECK(second.get_scale() == 16.0);
  CHECK(second.get_growth_interval() == 3);
  CHECK(second.growth_tracker() == 2);
  (void)second.scale(1.0f);
  second.step(opt);
  second.update();  // the third clean step in a row: growth
  CHECK(second.get_scale() == 32.0);
  CHECK(second.growth_tracker() == 0);

  CHECK(error_of([&] { second.load_state_dict({}); })
            .find("The source state dict is empty, possibly because it was saved from a "
                  "disabled instance of GradScaler") != std::string::npos);
  auto missing = saved;
  missing.erase("_growth_tracker");
  CHECK(error_of([&] { second.load_state_dict(missing); }).find("'_growth_tracker'") !=
        std::string::npos);

  // Values out of range (a damaged or hand-made file) are refused by name, and change nothing.
  const std::vector<std::pair<std::string, double>> bad = {
      {"scale", 0.0},
      {"scale", std::numeric_limits<double>::infinity()},
      {"scale", 1e300},
      {"scale", std::nan("")},
      {"growth_factor", 1.0},
      {"growth_factor", std::numeric_limits<double>::infinity()},
      {"backoff_factor", 1.0},
      {"backoff_factor", 0.0},
      {"growth_interval", 0.0},
      {"growth_interval", 2.5},
      {"growth_interval", 1e30},
      {"_growth_tracker", -1.0},
      {"_growth_tracker", 3.0},  // growth_interval is 3: the tracker is reset before it gets there
      {"_growth_tracker", 1e30},
  };
  for (const auto& [key, value] : bad) {
    CAPTURE(key);
    CAPTURE(value);
    auto damaged = saved;
    damaged[key] = value;
    const std::string error = error_of([&] { second.load_state_dict(damaged); });
    CHECK(error.find("GradScaler::load_state_dict") != std::string::npos);
    CHECK(error.find("'" + key + "' is ") != std::string::npos);
    CHECK(second.get_scale() == 32.0);
    CHECK(second.growth_tracker() == 0);
    CHECK(second.get_growth_interval() == 3);
  }
}

TEST_CASE("GradScaler all-reduces the inf flag so every rank skips together") {
  for (bool with_comm : {true, false}) {
    CAPTURE(with_comm);
    std::vector<int> steps(2, -1);
    std::vector<double> scales(2, 0.0);
    tandem::run_local(2, [&](tandem::LocalComm& comm) {
      auto scaler = with_comm ? GradScaler(comm) : GradScaler();
      CountingOptimizer<float> opt(5);
      for (int iteration = 0; iteration < 3; ++iteration) {
        (void)scaler.scale(1.0f);
        for (auto& g : opt.grads()) g = 1.0f;
        // Only rank 1 overflows, and only in iteration 1.
        if (comm.rank() == 1 && iteration == 1) opt.grads()[4] = -INFINITY;
        scaler.step(opt);
        scaler.update();
      }
      steps[static_cast<std::size_t>(comm.rank())] = opt.steps;
      scales[static_cast<std::size_t>(comm.rank())] = scaler.get_scale();
    });
    if (with_comm) {
      CHECK(steps == std::vector<int>{2, 2});
      CHECK(scales == std::vector<double>{32768.0, 32768.0});
    } else {
      CHECK(steps == std::vector<int>{3, 2});
      CHECK(scales == std::vector<double>{65536.0, 32768.0});
    }
  }
}

TEST_CASE("GradScaler names the rank in errors when it has a communicator") {
  tandem::run_local(1, [](tandem::LocalComm& comm) {
    GradScaler scaler(comm);
    CHECK(error_of([&] { scaler.update(); }).rfind("tandem: rank 0: GradScaler::update", 0) == 0);
  });
}

TEST_CASE("GradScaler folds a division handed over by DDP into its next unscale, once") {
  using tandem::test::contains;
  CountingOptimizer<float> opt(3);
  GradScaler scaler;
  (void)scaler.scale(1.0f);
  fill(opt, {65536.0 * 8, -65536.0 * 4, 3.0});
  scaler.divide_at_next_unscale(opt, 4.0);  // DDP's average over 4 ranks
  CHECK(scaler.step(opt));
  CHECK(opt.grads()[0] == 2.0f);
  CHECK(opt.grads()[1] == -1.0f);
  CHECK(opt.grads()[2] == 3.0f / 262144.0f);
  scaler.update();

  (void)scaler.scale(1.0f);
  fill(opt, {65536.0, 0.0, 0.0});
  scaler.unscale_(opt);  // the division was taken once
  CHECK(opt.grads()[0] == 1.0f);
  CHECK(scaler.step(opt));
  scaler.update();

  scaler.divide_at_next_unscale(opt, 2.0);
  CHECK(contains(error_of([&] { scaler.divide_at_next_unscale(opt, 2.0); },
                          "GradScaler::divide_at_next_unscale"),
                 "reduced again"));
  CountingOptimizer<float> other(1);
  CHECK(contains(error_of([&] { scaler.divide_at_next_unscale(other, 0.0); }), "positive finite"));
  GradScaler disabled(GradScalerOptions{.enabled = false});
  CHECK(contains(error_of([&] { disabled.divide_at_next_unscale(opt, 2.0); }), "disabled"));
}
