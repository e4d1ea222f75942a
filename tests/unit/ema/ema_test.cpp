// EMA against timm's ModelEmaV3 (golden data from tests/reference/golden_ema.py): warm-up decay,
// update_after_step, buffers averaged or copied, torch.lerp's arithmetic bit for bit; O(1)
// apply_shadow()/restore() and the RAII guard, exceptions included.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/golden.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/optim/ema.hpp"

namespace {

using tandem::BufferKind;
using tandem::EMA;
using tandem::EMAOptions;
using tandem::Parameters;

const tandem::test::Golden& golden() {
  static const tandem::test::Golden file("ema.txt");
  return file;
}

/// The golden model: fc.weight [3, 4], fc.bias [3]; buffers running_mean, running_var [3] and the
/// integral num_batches_tracked.
template <class T = float>
Parameters<T> make_model() {
  Parameters<T> params;
  params.add("fc.weight", {3, 4});
  params.add("fc.bias", {3});
  params.add_buffer("bn.running_mean", {3});
  params.add_buffer("bn.running_var", {3});
  params.add_buffer("bn.num_batches_tracked", {}, BufferKind::integral);
  params.finalize();
  return params;
}

void load(tandem::View<float> into, const std::vector<double>& values) {
  REQUIRE(into.size() == values.size());
  for (std::size_t i = 0; i < values.size(); ++i) into[i] = static_cast<float>(values[i]);
}

std::uint32_t bits(float value) {
  std::uint32_t b = 0;
  std::memcpy(&b, &value, 4);
  return b;
}

/// Every element bit for bit.
void check_equal(tandem::View<float> got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i);
    CHECK(bits(got[i]) == bits(static_cast<float>(want[i])));
  }
}

void replay(const std::string& name) {
  const auto& g = golden();
  const auto config = g.values(name + "/config");
  EMAOptions options;
  options.decay = config[0];
  options.min_decay = config[1];
  options.update_after_step = static_cast<std::size_t>(config[2]);
  options.use_warmup = config[3] != 0.0;
  options.warmup_gamma = config[4];
  options.warmup_power = config[5];
  options.average_buffers = config[6] == 0.0;
  const auto steps = static_cast<std::size_t>(config[7]);

  auto params = make_model();
  load(params.values(), g.values(name + "/initial/values"));
  load(params.buffer_values(), g.values(name + "/initial/buffers"));
  EMA ema(params, options);
  check_equal(ema.shadow_values(), g.values(name + "/initial/values"));

  for (std::size_t s = 1; s <= steps; ++s) {
    const std::string prefix = name + "/s" + std::to_string(s);
    CAPTURE(prefix);
    load(params.values(), g.values(prefix + "/values"));
    load(params.buffer_values(), g.values(prefix + "/buffers"));
    CHECK(ema.decay_at(s) == g.value(prefix + "/decay"));
    ema.update();
    CHECK(ema.updates() == s);
    check_equal(ema.shadow_values(), g.values(prefix + "/shadow_values"));
    check_equal(ema.shadow_buffer_values(), g.values(prefix + "/shadow_buffers"));
  }
}

}  // namespace

TEST_CASE("EMA matches timm's ModelEmaV3 on every golden case, bit for bit") {
  for (const char* name : {"plain", "warmup", "delayed_warmup", "exclude_buffers"}) {
    SUBCASE(name) {
      replay(name);
    }
  }
}

TEST_CASE("EMA's decay follows timm's warm-up formula and clamps") {
  auto params = make_model();
  EMA ema(params, {.decay = 0.99,
                   .min_decay = 0.6,
                   .update_after_step = 2,
                   .use_warmup = true,
                   .warmup_gamma = 1.0,
                   .warmup_power = 1.0});
  CHECK(ema.decay_at(0) == 0.0);
  CHECK(ema.decay_at(3) == 0.0);                         // step <= update_after_step + 1: copy
  CHECK(ema.decay_at(4) == 0.6);                         // 1 - 1/2, clamped up to min_decay
  CHECK(ema.decay_at(5) == doctest::Approx(2.0 / 3.0));  // 1 - 1/3
  CHECK(ema.decay_at(1000) == 0.99);                     // clamped down to decay
  EMA plain(params, {.decay = 0.9});
  CHECK(plain.decay_at(1) == 0.0);
  CHECK(plain.decay_at(2) == 0.9);
}

TEST_CASE("apply_shadow and restore swap the arena's storage in O(1), without copying") {
  auto params = make_model();
  for (auto& v : params.values()) v = 1.0f;
  EMA ema(params, {.decay = 0.5});
  for (auto& v : params.values()) v = 3.0f;
  ema.update(5);  // shadow = lerp(1, 3, 0.5) = 2
  const float* live = params.values().data();
  const float* shadow = ema.shadow_values().data();
  CHECK(ema.values().data() == live);

  ema.apply_shadow();
  CHECK(ema.shadow_applied());
  CHECK(ema.values().data() == shadow);
  CHECK(ema.buffer_values().data() == ema.shadow_buffer_values().data());
  CHECK(ema.values()[0] == 2.0f);
  // The arena itself holds the averaged weights, so a model reading its parameters sees them.
  CHECK(params.values().data() == shadow);
  CHECK(params.values()[0] == 2.0f);
  CHECK(params["fc.weight"].value()[0] == 2.0f);
  CHECK(ema.shadow_values().data() == shadow);
  CHECK(ema.value(params["fc.bias"]).data() == shadow + 12);
  CHECK(ema.value(params["fc.bias"]).shape() == tandem::Shape{3});
  CHECK_THROWS_WITH_AS(ema.apply_shadow(),
                       "tandem: EMA::apply_shadow: the shadow is applied; call restore() (or "
                       "leave the applied() scope) first",
                       tandem::Error);
  CHECK_THROWS_AS(ema.update(), tandem::Error);
  CHECK_THROWS_AS(ema.register_weights(), tandem::Error);

  ema.restore();
  CHECK(ema.values().data() == live);
  CHECK(params.values().data() == live);
  CHECK(ema.shadow_values().data() == shadow);
  CHECK(ema.value(params["fc.weight"])[0] == 3.0f);
  CHECK(params["fc.weight"].value()[0] == 3.0f);
  CHECK_THROWS_WITH_AS(ema.restore(),
                       "tandem: EMA::restore: the shadow is not applied; nothing to restore",
                       tandem::Error);
}

TEST_CASE("The applied() guard restores on scope exit, exceptions included") {
  auto params = make_model();
  EMA ema(params);
  const float* live = params.values().data();
  {
    auto guard = ema.applied();
    CHECK(ema.shadow_applied());
    CHECK(params.values().data() != live);
  }
  CHECK_FALSE(ema.shadow_applied());
  CHECK(params.values().data() == live);

  try {
    auto guard = ema.applied();
    CHECK(ema.shadow_applied());
    throw std::runtime_error("evaluation failed");
  } catch (const std::runtime_error&) {
  }
  CHECK_FALSE(ema.shadow_applied());
  CHECK(params.values().data() == live);

  {
    auto guard = ema.applied();
    ema.restore();  // restored early by hand: the guard does not restore twice
    CHECK_FALSE(ema.shadow_applied());
  }
  CHECK_FALSE(ema.shadow_applied());
  CHECK(params.values().data() == live);
}

TEST_CASE("EMA copies integral buffers and averages floating ones") {
  auto params = make_model();
  EMA ema(params, {.decay = 0.75});
  auto live = params.buffer_values();
  live[0] = 4.0f;  // running_mean[0]
  live[6] = 7.0f;  // num_batches_tracked
  ema.update(10);
  CHECK(ema.shadow_buffer_values()[0] == 1.0f);  // lerp(0, 4, 0.25)
  CHECK(ema.shadow_buffer_values()[6] == 7.0f);  // copied, not 1.75
}

TEST_CASE("register_weights takes a fresh snapshot and restarts the count") {
  auto params = make_model();
  EMA ema(params, {.decay = 0.5});
  params.values()[0] = 8.0f;
  ema.update();
  ema.update();
  CHECK(ema.updates() == 2);
  CHECK(ema.shadow_values()[0] == 8.0f);  // update 1 copies (decay 0), update 2 averages 8 and 8
  params.values()[0] = -1.0f;
  ema.register_weights();
  CHECK(ema.updates() == 0);
  CHECK(ema.shadow_values()[0] == -1.0f);
}

TEST_CASE("EMA over half weights blends in float and rounds once") {
  auto params = make_model<tandem::half>();
  for (auto& v : params.values()) v = tandem::half(1.0f);
  EMA ema(params, {.decay = 0.9});
  for (auto& v : params.values()) v = tandem::half(2.0f);
  ema.update(3);
  const float weight = static_cast<float>(1.0 - 0.9);
  const float expected = std::fma(weight, 1.0f, 1.0f);
  CHECK(ema.shadow_values()[0].bits == tandem::half(expected).bits);
}

TEST_CASE("EMA refuses an unfinalized arena and a decay outside [0, 1]") {
  Parameters<float> unfinished;
  unfinished.add("w", {2});
  CHECK_THROWS_AS(EMA<float>{unfinished}, tandem::Error);
  auto params = make_model();
  CHECK_THROWS_AS((EMA<float>{params, {.decay = 1.5}}), tandem::Error);
}
