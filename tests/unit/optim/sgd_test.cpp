// SGD against torch.optim.SGD (tests/reference/golden_optim.py): bitwise over 20 steps with two
// param groups, PyTorch's errors, state_dict, half/bfloat16 parameters.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "golden_model.hpp"
#include "tandem/optim/optimizer.hpp"
#include "tandem/optim/sgd.hpp"

namespace {

using tandem::Error;
using tandem::Parameters;
using tandem::optim::SGD;
using tandem::optim::SGDOptions;
namespace optim = tandem::optim;
namespace test = tandem::test;

static_assert(tandem::Optimizer<SGD<float>>);
static_assert(tandem::Optimizer<SGD<tandem::half>>);
static_assert(tandem::Optimizer<SGD<tandem::bfloat16>>);
static_assert(tandem::Optimizer<SGD<double>>);
static_assert(!tandem::Optimizer<SGDOptions>);

const char* const cases[] = {"plain",        "momentum", "dampening", "nesterov",
                             "weight_decay", "maximize", "mixed"};

SGDOptions golden_options(const std::string& c, std::size_t group) {
  const auto& row = test::optim_golden().values("sgd/" + c + "/options");
  const std::size_t at = group * 6;
  return {row.at(at),     row.at(at + 1),      row.at(at + 2),
          row.at(at + 3), row.at(at + 4) != 0, row.at(at + 5) != 0};
}

template <class T>
SGD<T> golden_sgd(Parameters<T>& params, const std::string& c) {
  return SGD<T>(params, test::golden_groups(golden_options(c, 0), golden_options(c, 1)));
}

}  // namespace

TEST_CASE("SGD matches torch.optim.SGD bitwise over 20 steps with two param groups") {
  for (const std::string c : cases) {
    CAPTURE(c);
    auto params = test::golden_model<float>();
    auto sgd = golden_sgd(params, c);
    const auto& trajectory = test::optim_golden().values(std::string("sgd/") + c + "/params");
    for (int step = 0; step < test::golden_steps; ++step) {
      test::set_golden_grads(params, step);
      sgd.step();
      CAPTURE(step);
      REQUIRE(test::count_bitwise_differences(params.values(), trajectory,
                                              static_cast<std::size_t>(step) * params.numel(),
                                              c + " params") == 0);
    }
    const auto dict = sgd.state_dict();
    test::check_final_state(dict, std::string("sgd/") + c, params.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      for (const auto& [key, tensor] : dict.state.at(i).tensors) {
        CHECK(tensor.shape() == params[test::golden_names[i]].shape());
      }
    }
  }
}

TEST_CASE("SGD's golden cases differ from each other, so each option is exercised") {
  const auto& plain = test::optim_golden().values("sgd/plain/params");
  for (const char* c : cases) {
    if (std::string(c) == "plain") continue;
    CAPTURE(c);
    CHECK(test::optim_golden().values(std::string("sgd/") + c + "/params") != plain);
  }
}

TEST_CASE("SGD rejects what PyTorch's SGD rejects with a ValueError") {
  auto params = test::golden_model<float>();
  CHECK_THROWS_WITH_AS(SGD(params, {.lr = 0.1, .nesterov = true}),
                       "tandem: optim::SGD: Nesterov momentum requires a momentum and zero "
                       "dampening",
                       Error);
  CHECK_THROWS_AS(SGD(params, {.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .nesterov = true}),
                  Error);
  CHECK_THROWS_WITH_AS(SGD(params, {.lr = -0.1}),
                       doctest::Contains("optim::SGD: invalid learning rate: -0.1"), Error);
  CHECK_THROWS_WITH_AS(SGD(params, {.lr = NAN}), doctest::Contains("invalid learning rate"), Error);
  // Stricter than PyTorch: an infinite value would make every parameter inf or NaN at once.
  CHECK_THROWS_WITH_AS(SGD(params, {.lr = INFINITY}), doctest::Contains("invalid learning rate"),
                       Error);
  CHECK_THROWS_WITH_AS(SGD(params, {.lr = 0.1, .momentum = INFINITY}),
                       doctest::Contains("invalid momentum value"), Error);
  CHECK_THROWS_WITH_AS(SGD(params, {.lr = 0.1, .momentum = -1}),
                       doctest::Contains("invalid momentum value"), Error);
  CHECK_THROWS_WITH_AS(SGD(params, {.lr = 0.1, .weight_decay = -1e-4}),
                       doctest::Contains("invalid weight_decay value"), Error);
  CHECK_NOTHROW(SGD(params, {.lr = 0, .momentum = 0.9, .nesterov = true}));

  // Options changed between steps are checked again, and a failed step changes nothing.
  SGD sgd(params, {.lr = 0.1, .momentum = 0.9});
  test::set_golden_grads(params, 0);
  const std::vector<float> before(params.values().begin(), params.values().end());
  sgd.options(0).nesterov = true;
  sgd.options(0).dampening = 0.5;
  CHECK_THROWS_AS(sgd.step(), Error);
  CHECK(std::vector<float>(params.values().begin(), params.values().end()) == before);
  CHECK_THROWS_WITH_AS(static_cast<void>(sgd.lr(1)),
                       "tandem: optim::SGD: param group 1 does not exist (there are 1)", Error);

  Parameters<float> unfinalized;
  unfinalized.add("w", {2});
  CHECK_THROWS_WITH_AS(SGD(unfinalized, {.lr = 0.1}), doctest::Contains("must be finalized"),
                       Error);
}

TEST_CASE("SGD's defaults are PyTorch's") {
  const SGDOptions defaults;
  CHECK(defaults.lr == 1e-3);
  CHECK(defaults.momentum == 0);
  CHECK(defaults.dampening == 0);
  CHECK(defaults.weight_decay == 0);
  CHECK_FALSE(defaults.nesterov);
  CHECK_FALSE(defaults.maximize);
}

TEST_CASE("SGD's state_dict has PyTorch's keys and a restored optimizer continues bitwise") {
  const std::string c = "mixed";
  const auto& trajectory = test::optim_golden().values("sgd/" + c + "/params");
  auto params = test::golden_model<float>();
  auto sgd = golden_sgd(params, c);

  auto fresh = sgd.state_dict();
  CHECK(fresh.state.empty());  // PyTorch has no state before the first step
  REQUIRE(fresh.param_groups.size() == 2);
  CHECK(fresh.param_groups[0].params == std::vector<std::size_t>{0, 1});
  CHECK(fresh.param_groups[1].params == std::vector<std::size_t>{2, 3});

  for (int step = 0; step < 10; ++step) {
    test::set_golden_grads(params, step);
    sgd.step();
  }
  const auto saved = sgd.state_dict();
  CHECK(saved.param_groups[0].step == 10);
  CHECK(saved.param_groups[1].options.at("lr") == 0.2);
  CHECK(saved.param_groups[1].options.at("momentum") == 0.5);
  CHECK(saved.param_groups[1].options.at("dampening") == 0.3);
  CHECK(saved.param_groups[0].options.at("nesterov") == 1);
  CHECK(saved.param_groups[0].options.at("maximize") == 0);
  REQUIRE(saved.state.size() == 4);
  CHECK(saved.state.at(2).tensors.at("momentum_buffer").shape() == tandem::Shape{3, 5});

  // A second process: the same model at step 10's values, a fresh optimizer, the saved state.
  auto resumed_params = test::golden_model<float>();
  for (std::size_t i = 0; i < params.numel(); ++i) {
    resumed_params.values()[i] = params.values()[i];
  }
  SGD<float> resumed(resumed_params, {{optim::all_params(), {.lr = 5}}});
  CHECK_THROWS_WITH_AS(resumed.load_state_dict(saved),
                       doctest::Contains("different number of parameter groups"), Error);
  auto resumed_sgd = golden_sgd(resumed_params, "plain");  // options come from the dict
  resumed_sgd.load_state_dict(saved);
  CHECK(resumed_sgd.options(1).momentum == 0.5);
  CHECK(resumed_sgd.group_steps(0) == 10);
  for (int step = 10; step < test::golden_steps; ++step) {
    test::set_golden_grads(resumed_params, step);
    resumed_sgd.step();
  }
  CHECK(test::count_bitwise_differences(resumed_params.values(), trajectory,
                                        19 * resumed_params.numel(), "resumed") == 0);
}

TEST_CASE("SGD's load_state_dict refuses a dict that does not fit, and changes nothing then") {
  auto params = test::golden_model<float>();
  auto sgd = golden_sgd(params, "momentum");
  test::set_golden_grads(params, 0);
  sgd.step();

  auto missing_option = sgd.state_dict();
  missing_option.param_groups[1].options.erase("dampening");
  CHECK_THROWS_WITH_AS(sgd.load_state_dict(missing_option),
                       doctest::Contains("has no option 'dampening'"), Error);

  auto invalid = sgd.state_dict();
  invalid.param_groups[0].options["lr"] = -1;
  CHECK_THROWS_WITH_AS(sgd.load_state_dict(invalid), doctest::Contains("invalid learning rate"),
                       Error);

  auto partial = sgd.state_dict();
  partial.state.at(1).tensors.clear();
  CHECK_THROWS_WITH_AS(sgd.load_state_dict(partial),
                       doctest::Contains("momentum_buffer for 1 of its 2 parameters"), Error);

  auto wrong_size = sgd.state_dict();
  wrong_size.state.at(3).tensors.at("momentum_buffer") = tandem::Buffer<float>(7);
  CHECK_THROWS_WITH_AS(sgd.load_state_dict(wrong_size),
                       doctest::Contains("momentum_buffer of parameter 3 has 7 elements"), Error);

  auto wrong_params = sgd.state_dict();
  wrong_params.param_groups[0].params = {0};
  CHECK_THROWS_AS(sgd.load_state_dict(wrong_params), Error);

  auto unknown = sgd.state_dict();
  unknown.state[9];
  CHECK_THROWS_WITH_AS(sgd.load_state_dict(unknown),
                       doctest::Contains("state for parameter 9 names no parameter"), Error);

  CHECK(sgd.lr(0) == 0.1);  // nothing changed
  CHECK(sgd.group_steps(0) == 1);
}

TEST_CASE("Param groups select contiguous runs of the arena by prefix, names or indices") {
  Parameters<float> params;
  params.add("layer1.weight", {2, 2});
  params.add("layer2.weight", {3});
  params.add("layer2.bias", {1});
  params.add("layer3.weight", {2});
  params.add_buffer("bn.running_mean", {2});
  params.add("layer2.extra", {1});
  params.finalize();

  CHECK(optim::all_params().resolve(params) == optim::ParamRange{0, 5});
  CHECK(optim::param_range(1, 3).resolve(params) == optim::ParamRange{1, 3});
  CHECK(optim::params_between("layer2.weight", "layer3.weight").resolve(params) ==
        optim::ParamRange{1, 4});
  CHECK(optim::params_with_prefix("layer1.").resolve(params) == optim::ParamRange{0, 1});
  CHECK_THROWS_WITH_AS(static_cast<void>(optim::params_with_prefix("layer2.").resolve(params)),
                       doctest::Contains("are not contiguous ('layer2.extra' follows others)"),
                       Error);
  CHECK_THROWS_WITH_AS(static_cast<void>(optim::params_with_prefix("conv").resolve(params)),
                       doctest::Contains("parameters named 'conv...' selects no parameters"),
                       Error);
  CHECK_THROWS_AS(static_cast<void>(optim::param_range(3, 6).resolve(params)), Error);
  CHECK_THROWS_AS(static_cast<void>(optim::param_range(2, 1).resolve(params)), Error);
  CHECK_THROWS_WITH_AS(
      static_cast<void>(optim::params_between("layer3.weight", "layer2.bias").resolve(params)),
      doctest::Contains("'layer3.weight' is registered after 'layer2.bias'"), Error);
  CHECK_THROWS_WITH_AS(
      static_cast<void>(optim::params_between("bn.running_mean", "layer2.bias").resolve(params)),
      doctest::Contains("is a buffer"), Error);
  CHECK_THROWS_WITH_AS(
      static_cast<void>(optim::params_between("nope", "layer2.bias").resolve(params)),
      doctest::Contains("no parameter is called 'nope'"), Error);

  CHECK_THROWS_WITH_AS(SGD(params, {{optim::param_range(0, 2), {.lr = 0.1}},
                                    {optim::param_range(1, 3), {.lr = 0.2}}}),
                       doctest::Contains("appear in more than one parameter group"), Error);
  CHECK_THROWS_WITH_AS(SGD(params, std::vector<optim::ParamGroup<SGDOptions>>{}),
                       doctest::Contains("no param groups"), Error);
}

TEST_CASE("SGD updates only its groups; grads() spans them and zero_grad clears only theirs") {
  Parameters<float> params;
  params.add("frozen", {2});
  params.add("a", {3});
  params.add("middle", {1});
  params.add("b", {2});
  params.add("tail", {1});
  params.finalize();
  for (auto& g : params.grads()) g = 1;
  SGD sgd(params, {{optim::params_between("b", "b"), {.lr = 0.5}},
                   {optim::param_range(1, 2), {.lr = 0.25}}});
  // groups in any order: grads() is the smallest span holding both, "a" through "b"
  CHECK(sgd.grads().data() == params.grads().data() + 2);
  CHECK(sgd.grads().size() == 6);
  CHECK(sgd.values().data() == params.values().data() + 2);
  sgd.step();
  const std::vector<float> expected{0, 0, -0.25f, -0.25f, -0.25f, 0, -0.5f, -0.5f, 0};
  CHECK(std::vector<float>(params.values().begin(), params.values().end()) == expected);
  sgd.zero_grad();
  const std::vector<float> grads{1, 1, 0, 0, 0, 1, 0, 0, 1};
  CHECK(std::vector<float>(params.grads().begin(), params.grads().end()) == grads);
  // PyTorch numbers state by group order: group 0 ("b") is parameter 0.
  auto dict = sgd.state_dict();
  CHECK(dict.param_groups[0].params == std::vector<std::size_t>{0});
  CHECK(dict.param_groups[1].params == std::vector<std::size_t>{1});
  sgd.set_lr(1, 0.125);
  CHECK(sgd.lr(1) == 0.125);
  CHECK(sgd.group_params(0) == optim::ParamRange{3, 4});
}

TEST_CASE_TEMPLATE("SGD on half/bfloat16 parameters computes in float and rounds once per step", T,
                   tandem::half, tandem::bfloat16) {
  // Reference: a float optimizer whose parameters and gradients are rounded to T around every
  // step. The state is float in both, so they agree bitwise.
  for (const std::string c : {"mixed", "maximize", "dampening"}) {
    CAPTURE(c);
    auto low = test::golden_model<T>();
    auto reference = test::golden_model<float>();
    for (auto& v : reference.values()) v = static_cast<float>(T(v));
    auto low_sgd = golden_sgd(low, c);
    auto reference_sgd = golden_sgd(reference, c);
    static_assert(std::is_same_v<typename decltype(low_sgd)::state_type, float>);
    for (int step = 0; step < test::golden_steps; ++step) {
      test::set_golden_grads(low, step);
      test::set_golden_grads(reference, step);
      for (auto& g : reference.grads()) g = static_cast<float>(T(g));
      low_sgd.step();
      reference_sgd.step();
      for (auto& v : reference.values()) v = static_cast<float>(T(v));
      std::size_t differences = 0;
      for (std::size_t i = 0; i < low.numel(); ++i) {
        differences += static_cast<float>(low.values()[i]) != reference.values()[i] ? 1 : 0;
      }
      REQUIRE(differences == 0);
    }
    // and stays close to the float trajectory: within T's rounding of the values it moves
    const auto& golden = test::optim_golden().values(std::string("sgd/") + c + "/params");
    const double epsilon = std::is_same_v<T, tandem::half> ? 0x1p-10 : 0x1p-7;
    for (std::size_t i = 0; i < low.numel(); ++i) {
      const double want = golden.at(19 * low.numel() + i);
      CHECK(std::abs(static_cast<float>(low.values()[i]) - want) <=
            20 * epsilon * (1 + std::abs(want)));
    }
  }
}

TEST_CASE("SGD on double parameters follows the float32 golden trajectory within 1e-5") {
  // The math is double here and float32 in PyTorch's float run: not bitwise, close.
  auto params = test::golden_model<double>();
  auto sgd = golden_sgd(params, "mixed");
  static_assert(std::is_same_v<decltype(sgd)::state_type, double>);
  const auto& trajectory = test::optim_golden().values("sgd/mixed/params");
  for (int step = 0; step < test::golden_steps; ++step) {
    test::set_golden_grads(params, step);
    sgd.step();
  }
  for (std::size_t i = 0; i < params.numel(); ++i) {
    const double want = trajectory.at(19 * params.numel() + i);
    CHECK(std::abs(params.values()[i] - want) <= 1e-5 * (1 + std::abs(want)));
  }
}
