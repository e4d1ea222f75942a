// AdamW against torch.optim.AdamW (tests/reference/golden_optim.py): bitwise over 20 steps with
// two param groups, amsgrad on and off, PyTorch's errors, state_dict, half/bfloat16 parameters.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "golden_model.hpp"
#include "tandem/optim/adamw.hpp"
#include "tandem/optim/optimizer.hpp"

namespace {

using tandem::Error;
using tandem::Parameters;
using tandem::optim::AdamW;
using tandem::optim::AdamWOptions;
namespace optim = tandem::optim;
namespace test = tandem::test;

static_assert(tandem::Optimizer<AdamW<float>>);
static_assert(tandem::Optimizer<AdamW<tandem::half>>);
static_assert(tandem::Optimizer<AdamW<tandem::bfloat16>>);
static_assert(tandem::Optimizer<AdamW<double>>);

const char* const cases[] = {"default", "amsgrad", "mixed", "torch_defaults"};

AdamWOptions golden_options(const std::string& c, std::size_t group) {
  const auto& row = test::optim_golden().values("adamw/" + c + "/options");
  const std::size_t at = group * 7;
  return {row.at(at),          {row.at(at + 1), row.at(at + 2)},
          row.at(at + 3),      row.at(at + 4),
          row.at(at + 5) != 0, row.at(at + 6) != 0};
}

template <class T>
AdamW<T> golden_adamw(Parameters<T>& params, const std::string& c) {
  return AdamW<T>(params, test::golden_groups(golden_options(c, 0), golden_options(c, 1)));
}

}  // namespace

TEST_CASE("AdamW matches torch.optim.AdamW bitwise over 20 steps with two param groups") {
  for (const std::string c : cases) {
    CAPTURE(c);
    auto params = test::golden_model<float>();
    auto adamw = golden_adamw(params, c);
    const auto& trajectory = test::optim_golden().values("adamw/" + c + "/params");
    for (int step = 0; step < test::golden_steps; ++step) {
      test::set_golden_grads(params, step);
      adamw.step();
      CAPTURE(step);
      REQUIRE(test::count_bitwise_differences(params.values(), trajectory,
                                              static_cast<std::size_t>(step) * params.numel(),
                                              c + " params") == 0);
    }
    test::check_final_state(adamw.state_dict(), "adamw/" + c, params.size());
  }
}

TEST_CASE("The amsgrad golden case exercises the maximum: max_exp_avg_sq differs from exp_avg_sq") {
  const auto& golden = test::optim_golden();
  CHECK(golden.values("adamw/amsgrad/state/0/max_exp_avg_sq") !=
        golden.values("adamw/amsgrad/state/0/exp_avg_sq"));
  CHECK(golden.values("adamw/amsgrad/params") != golden.values("adamw/default/params"));
  CHECK(
      golden.values("adamw/torch_defaults/options") ==
      std::vector<double>{1e-3, 0.9, 0.999, 1e-8, 1e-2, 0, 0, 1e-3, 0.9, 0.999, 1e-8, 1e-2, 0, 0});
}

TEST_CASE("AdamW's defaults are PyTorch's: lr 1e-3, betas (0.9, 0.999), eps 1e-8, wd 1e-2") {
  const AdamWOptions defaults;
  CHECK(defaults.lr == 1e-3);
  CHECK(defaults.betas[0] == 0.9);
  CHECK(defaults.betas[1] == 0.999);
  CHECK(defaults.eps == 1e-8);
  CHECK(defaults.weight_decay == 1e-2);
  CHECK_FALSE(defaults.amsgrad);
  CHECK_FALSE(defaults.maximize);
  auto params = test::golden_model<float>();
  AdamW adamw(params);  // all parameters, PyTorch's defaults
  CHECK(adamw.group_count() == 1);
  CHECK(adamw.lr(0) == 1e-3);
}

TEST_CASE("AdamW rejects what PyTorch's AdamW rejects with a ValueError") {
  auto params = test::golden_model<float>();
  CHECK_THROWS_WITH_AS(AdamW(params, {.lr = -1e-3}),
                       doctest::Contains("optim::AdamW: invalid learning rate"), Error);
  CHECK_THROWS_WITH_AS(AdamW(params, {.eps = -1e-8}), doctest::Contains("invalid epsilon value"),
                       Error);
  // Stricter than PyTorch: an infinite value would make every parameter inf or NaN at once.
  CHECK_THROWS_WITH_AS(AdamW(params, {.lr = INFINITY}), doctest::Contains("invalid learning rate"),
                       Error);
  CHECK_THROWS_WITH_AS(AdamW(params, {.weight_decay = INFINITY}),
                       doctest::Contains("invalid weight_decay value"), Error);
  CHECK_THROWS_WITH_AS(AdamW(params, {.betas = {1.0, 0.999}}),
                       doctest::Contains("invalid beta parameter at index 0: 1.0"), Error);
  CHECK_THROWS_WITH_AS(AdamW(params, {.betas = {0.9, -0.1}}),
                       doctest::Contains("invalid beta parameter at index 1"), Error);
  CHECK_THROWS_WITH_AS(AdamW(params, {.betas = {NAN, 0.999}}),
                       doctest::Contains("invalid beta parameter at index 0"), Error);
  CHECK_THROWS_WITH_AS(AdamW(params, {.weight_decay = -1}),
                       doctest::Contains("invalid weight_decay value"), Error);
  CHECK_NOTHROW(AdamW(params, {.lr = 0, .betas = {0, 0}, .eps = 0, .weight_decay = 0}));
}

TEST_CASE("AdamW's state_dict has PyTorch's keys and a restored optimizer continues bitwise") {
  const std::string c = "mixed";  // group 1 has amsgrad, group 0 not
  const auto& trajectory = test::optim_golden().values("adamw/" + c + "/params");
  auto params = test::golden_model<float>();
  auto adamw = golden_adamw(params, c);
  CHECK(adamw.state_dict().state.empty());
  for (int step = 0; step < 7; ++step) {
    test::set_golden_grads(params, step);
    adamw.step();
  }
  const auto saved = adamw.state_dict();
  REQUIRE(saved.state.size() == 4);
  CHECK(saved.state.at(0).scalars.at("step") == 7);
  CHECK(saved.state.at(0).tensors.size() == 2);  // exp_avg, exp_avg_sq
  CHECK(saved.state.at(3).tensors.size() == 3);  // and max_exp_avg_sq
  CHECK(saved.state.at(2).tensors.at("exp_avg").shape() == tandem::Shape{3, 5});
  CHECK(saved.param_groups[0].options.at("beta1") == 0.8);
  CHECK(saved.param_groups[0].options.at("beta2") == 0.99);
  CHECK(saved.param_groups[0].options.at("eps") == 1e-6);
  CHECK(saved.param_groups[1].options.at("amsgrad") == 1);
  CHECK(saved.param_groups[1].options.at("maximize") == 1);
  CHECK(saved.param_groups[1].step == 7);

  auto resumed_params = test::golden_model<float>();
  for (std::size_t i = 0; i < params.numel(); ++i) {
    resumed_params.values()[i] = params.values()[i];
  }
  auto resumed = golden_adamw(resumed_params, "default");  // options come from the dict
  resumed.load_state_dict(saved);
  CHECK(resumed.options(1).amsgrad);
  CHECK(resumed.group_steps(1) == 7);
  for (int step = 7; step < test::golden_steps; ++step) {
    test::set_golden_grads(resumed_params, step);
    resumed.step();
  }
  CHECK(test::count_bitwise_differences(resumed_params.values(), trajectory,
                                        19 * resumed_params.numel(), "resumed") == 0);
  test::check_final_state(resumed.state_dict(), "adamw/" + c, params.size());
}

TEST_CASE("AdamW's load_state_dict refuses a dict that does not fit, and changes nothing then") {
  auto params = test::golden_model<float>();
  auto adamw = golden_adamw(params, "mixed");
  test::set_golden_grads(params, 0);
  adamw.step();

  auto missing_option = adamw.state_dict();
  missing_option.param_groups[0].options.erase("beta2");
  CHECK_THROWS_WITH_AS(adamw.load_state_dict(missing_option),
                       doctest::Contains("AdamW::load_state_dict: param_groups entry has no "
                                         "option 'beta2'"),
                       Error);
  auto bad_beta = adamw.state_dict();
  bad_beta.param_groups[0].options["beta1"] = 1;
  CHECK_THROWS_AS(adamw.load_state_dict(bad_beta), Error);

  auto no_max = adamw.state_dict();
  no_max.state.at(2).tensors.erase("max_exp_avg_sq");
  CHECK_THROWS_WITH_AS(adamw.load_state_dict(no_max),
                       doctest::Contains("parameter 2 has no max_exp_avg_sq"), Error);

  auto partial = adamw.state_dict();
  partial.state.erase(1);
  CHECK_THROWS_WITH_AS(adamw.load_state_dict(partial),
                       doctest::Contains("state for 1 of its 2 parameters"), Error);

  auto other_step = adamw.state_dict();
  other_step.state.at(0).scalars["step"] = 3;
  CHECK_THROWS_WITH_AS(adamw.load_state_dict(other_step),
                       doctest::Contains("parameter 0's step is missing or differs"), Error);

  auto wrong_size = adamw.state_dict();
  wrong_size.state.at(1).tensors.at("exp_avg") = tandem::Buffer<float>(4);
  CHECK_THROWS_WITH_AS(adamw.load_state_dict(wrong_size),
                       doctest::Contains("exp_avg of parameter 1 has 4 elements"), Error);
  CHECK(adamw.group_steps(0) == 1);
  CHECK(adamw.options(0).betas[1] == 0.99);

  // A dict saved before any step restores a fresh start: zero moments, step 0.
  auto fresh_params = test::golden_model<float>();
  auto fresh = golden_adamw(fresh_params, "mixed");
  const auto empty = fresh.state_dict();
  adamw.load_state_dict(empty);
  CHECK(adamw.group_steps(0) == 0);
  auto restarted = test::golden_model<float>();
  for (std::size_t i = 0; i < params.numel(); ++i) params.values()[i] = restarted.values()[i];
  const auto& trajectory = test::optim_golden().values("adamw/mixed/params");
  test::set_golden_grads(params, 0);
  adamw.step();
  CHECK(test::count_bitwise_differences(params.values(), trajectory, 0, "restart") == 0);
}

TEST_CASE_TEMPLATE("AdamW on half/bfloat16 parameters computes in float and rounds once per step",
                   T, tandem::half, tandem::bfloat16) {
  // Reference: a float optimizer whose parameters and gradients are rounded to T around every
  // step. The state is float in both, so they agree bitwise.
  for (const std::string c : {"mixed", "amsgrad"}) {
    CAPTURE(c);
    auto low = test::golden_model<T>();
    auto reference = test::golden_model<float>();
    for (auto& v : reference.values()) v = static_cast<float>(T(v));
    auto low_adamw = golden_adamw(low, c);
    auto reference_adamw = golden_adamw(reference, c);
    static_assert(std::is_same_v<typename decltype(low_adamw)::state_type, float>);
    for (int step = 0; step < test::golden_steps; ++step) {
      test::set_golden_grads(low, step);
      test::set_golden_grads(reference, step);
      for (auto& g : reference.grads()) g = static_cast<float>(T(g));
      low_adamw.step();
      reference_adamw.step();
      for (auto& v : reference.values()) v = static_cast<float>(T(v));
      std::size_t differences = 0;
      for (std::size_t i = 0; i < low.numel(); ++i) {
        differences += static_cast<float>(low.values()[i]) != reference.values()[i] ? 1 : 0;
      }
      REQUIRE(differences == 0);
    }
    const auto low_state = low_adamw.state_dict();
    const auto reference_state = reference_adamw.state_dict();
    for (std::size_t i = 0; i < low.size(); ++i) {
      const auto& a = low_state.state.at(i).tensors.at("exp_avg_sq");
      const auto& b = reference_state.state.at(i).tensors.at("exp_avg_sq");
      CHECK(std::vector<float>(a.begin(), a.end()) == std::vector<float>(b.begin(), b.end()));
    }
  }
}

TEST_CASE("AdamW on double parameters follows the float32 golden trajectory within 1e-5") {
  // The math is double here and float32 in PyTorch's float run: not bitwise, close.
  auto params = test::golden_model<double>();
  auto adamw = golden_adamw(params, "mixed");
  const auto& trajectory = test::optim_golden().values("adamw/mixed/params");
  for (int step = 0; step < test::golden_steps; ++step) {
    test::set_golden_grads(params, step);
    adamw.step();
  }
  for (std::size_t i = 0; i < params.numel(); ++i) {
    const double want = trajectory.at(19 * params.numel() + i);
    CHECK(std::abs(params.values()[i] - want) <= 1e-5 * (1 + std::abs(want)));
  }
}

TEST_CASE("Every host path of a pass gives the same bits: the FMA clone and the plain loop") {
  // run_pass takes an AVX2+FMA clone of the loop where the CPU has one; host_exec's plain loop
  // calls fma() from the C library. Both round a * b + c once, so they must agree bitwise.
  constexpr std::size_t n = 4099;  // vector bodies and a scalar tail
  std::vector<float> grad(n), exp_avg(n), exp_avg_sq(n), max_exp_avg_sq(n);
  std::vector<float> values(n);
  for (std::size_t i = 0; i < n; ++i) {
    values[i] = std::sin(0.1f * static_cast<float>(i));
    grad[i] = std::cos(0.37f * static_cast<float>(i)) * (i % 7 == 0 ? 100.0f : 1.0f);
    exp_avg[i] = 0.01f * std::sin(static_cast<float>(i));
    exp_avg_sq[i] = 1e-4f * static_cast<float>(i % 13);
    max_exp_avg_sq[i] = 1e-4f * static_cast<float>(i % 5);
  }
  auto run = [&](bool clone) {
    auto p = values;
    auto m = exp_avg;
    auto v = exp_avg_sq;
    auto vmax = max_exp_avg_sq;
    const optim::detail::adamw_update<float, true> update{
        p.data(), grad.data(), m.data(), v.data(), vmax.data(), 0.999f, 0.9f,
        0.1f,     0.999f,      1e-3f,    0.3f,     1e-8f,       -0.01f, true};
    if (clone) {
      optim::detail::run_pass(tandem::on_host, n, update);
    } else {
      tandem::for_each_index(tandem::on_host, n, update);
    }
    p.insert(p.end(), v.begin(), v.end());
    return p;
  };
  const auto plain = run(false);
  const auto cloned = run(true);
  CHECK(std::memcmp(plain.data(), cloned.data(), plain.size() * sizeof(float)) == 0);
}
