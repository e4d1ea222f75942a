// LR schedules against torch.optim.lr_scheduler (tests/reference/golden_lr.py): the lrs of
// epochs 0..E for two param groups, bitwise (double arithmetic in the same order as PyTorch's).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "support/golden.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/optim/lr_scheduler.hpp"
#include "tandem/optim/sgd.hpp"

namespace {

using tandem::Error;
namespace lr = tandem::lr;
namespace optim = tandem::optim;

const tandem::test::Golden& golden() {
  static const tandem::test::Golden file("lr.txt");
  return file;
}

/// Two groups at lr 0.1 and 0.2, as golden_lr.py's SGD.
struct TwoGroups {
  static tandem::Parameters<float> two_parameters() {
    tandem::Parameters<float> params;
    params.add("a", {1});
    params.add("b", {1});
    params.finalize();
    return params;
  }
  tandem::Parameters<float> params = two_parameters();
  optim::SGD<float> sgd{
      params, {{optim::param_range(0, 1), {.lr = 0.1}}, {optim::param_range(1, 2), {.lr = 0.2}}}};
};

bool same_bits(double a, double b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

/// Steps `schedule` through the golden record's epochs; every lr must be PyTorch's, bitwise.
template <class Schedule>
void check_sequence(TwoGroups& setup, Schedule& schedule, const std::string& key) {
  const auto& expected = golden().values("lr/" + key);
  REQUIRE(expected.size() % 2 == 0);
  const std::size_t epochs = expected.size() / 2;
  std::size_t mismatches = 0;
  for (std::size_t e = 0; e < epochs; ++e) {
    if (e > 0) {
      setup.sgd.step();
      schedule.step();
    }
    REQUIRE(schedule.last_epoch() == static_cast<std::int64_t>(e));
    for (std::size_t g = 0; g < 2; ++g) {
      const double want = expected[2 * e + g];
      if (!same_bits(setup.sgd.lr(g), want) || !same_bits(schedule.last_lr()[g], want)) {
        if (mismatches++ == 0) {
          MESSAGE(key << ": epoch " << e << " group " << g << ": " << setup.sgd.lr(g)
                      << " vs PyTorch " << want);
        }
      }
    }
  }
  CHECK(mismatches == 0);
}

}  // namespace

TEST_CASE("Construction is epoch 0 and already sets the lr, as in PyTorch") {
  TwoGroups setup;
  auto schedule = lr::linear(setup.sgd, 0.25, 1.0, 6);
  CHECK(schedule.last_epoch() == 0);
  CHECK(setup.sgd.lr(0) == 0.1 * 0.25);
  CHECK(schedule.base_lrs() == std::vector<double>{0.1, 0.2});
}

TEST_CASE("lr::lambda matches LambdaLR, one factor for all groups or one per group") {
  {
    TwoGroups setup;
    auto schedule = lr::lambda(setup.sgd, [](std::int64_t e) { return std::pow(0.95, e); });
    check_sequence(setup, schedule, "lambda_shared");
  }
  {
    TwoGroups setup;
    auto schedule = lr::lambda(
        setup.sgd, std::vector<std::function<double(std::int64_t)>>{
                       [](std::int64_t e) { return 1.0 / static_cast<double>(1 + e); },
                       [](std::int64_t e) { return 0.5 + 0.1 * static_cast<double>(e % 4); }});
    check_sequence(setup, schedule, "lambda_per_group");
  }
  TwoGroups setup;
  CHECK_THROWS_WITH_AS(
      lr::lambda(setup.sgd, std::vector<std::function<double(std::int64_t)>>{[](std::int64_t) {
                   return 1.0;
                 }}),
      "tandem: lr::lambda: expected 2 lr lambdas, but got 1", Error);
}

TEST_CASE("lr::step and lr::multi_step match StepLR and MultiStepLR") {
  {
    TwoGroups setup;
    auto schedule = lr::step(setup.sgd, 7, 0.5);
    check_sequence(setup, schedule, "step");
  }
  {
    TwoGroups setup;
    auto schedule = lr::step(setup.sgd, 3);
    check_sequence(setup, schedule, "step_default_gamma");
  }
  {
    TwoGroups setup;
    auto schedule = lr::multi_step(setup.sgd, {3, 8, 8, 15}, 0.3);  // 8 twice: gamma^2 there
    check_sequence(setup, schedule, "multi_step");
  }
  TwoGroups setup;
  CHECK_THROWS_AS(lr::step(setup.sgd, 0), Error);
}

TEST_CASE("lr::linear matches LinearLR's recursive form, warming up and decaying") {
  for (const auto& [key, start, end, total] :
       std::vector<std::tuple<std::string, double, double, std::int64_t>>{
           {"linear_warmup", 0.25, 1.0, 6}, {"linear_decay", 1.0, 0.1, 10}}) {
    CAPTURE(key);
    TwoGroups setup;
    auto schedule = lr::linear(setup.sgd, start, end, total);
    check_sequence(setup, schedule, key);
  }
  TwoGroups setup;
  auto defaults = lr::linear(setup.sgd);  // PyTorch's 1/3 -> 1 over 5
  check_sequence(setup, defaults, "linear_default");
  CHECK_THROWS_WITH_AS(lr::linear(setup.sgd, 1.5), doctest::Contains("starting multiplicative"),
                       Error);
  CHECK_THROWS_WITH_AS(lr::linear(setup.sgd, 0.5, -0.1), doctest::Contains("ending multiplicative"),
                       Error);
  CHECK_THROWS_AS(lr::linear(setup.sgd, 0.5, 1.0, 0), Error);
}

TEST_CASE("lr::cosine matches CosineAnnealingLR bitwise: the recursive form, not the closed one") {
  {
    TwoGroups setup;
    auto schedule = lr::cosine(setup.sgd, 10, 0.001);  // 35 epochs: past T_max, the restart
    check_sequence(setup, schedule, "cosine");
  }
  {
    TwoGroups setup;
    auto schedule = lr::cosine(setup.sgd, 7);
    check_sequence(setup, schedule, "cosine_zero_min");
  }
  // PyTorch's step() numbers are not the closed form's: they differ in the last bits.
  const auto& recursive = golden().values("lr/cosine");
  const auto& closed = golden().values("lr/cosine_closed_form");
  std::size_t differing = 0;
  for (std::size_t i = 0; i < 22; ++i) differing += same_bits(recursive[i], closed[i]) ? 0 : 1;
  CHECK(differing > 0);
  for (std::size_t i = 0; i < 22; ++i) CHECK(std::abs(recursive[i] - closed[i]) < 1e-15);
  TwoGroups setup;
  CHECK_THROWS_AS(lr::cosine(setup.sgd, 0), Error);
}

TEST_CASE("lr::warmup_cosine is the LambdaLR it is usually written as") {
  TwoGroups setup;
  auto schedule = lr::warmup_cosine(setup.sgd, 5, 20, 0.1, 0.01);
  check_sequence(setup, schedule, "warmup_cosine");

  const auto shape = lr::warmup_cosine(5, 20, 0.1, 0.01);
  CHECK(shape.lr(0) == doctest::Approx(0.02));  // (0 + 1) / 5 of lr_max
  CHECK(shape.lr(4) == doctest::Approx(0.1));
  CHECK(shape.lr(5) == doctest::Approx(0.1));
  CHECK(shape.lr(20) == doctest::Approx(0.01));
  CHECK(shape.lr(100) == 0.01);
  CHECK(shape(20) == doctest::Approx(0.1));
  CHECK_THROWS_AS(lr::warmup_cosine(5, 4, 0.1, 0.0), Error);
  CHECK_THROWS_AS(lr::warmup_cosine(5, 20, 0.1, 0.2), Error);
  CHECK_THROWS_AS(lr::warmup_cosine(-1, 20, 0.1, 0.0), Error);
}

TEST_CASE("The linear scaling rule: lr x world size, reached by a linear warm-up") {
  CHECK(lr::scaled_lr(0.1, 8) == doctest::Approx(0.8));
  CHECK_THROWS_AS(static_cast<void>(lr::scaled_lr(0.1, 0)), Error);
  TwoGroups setup;
  auto schedule = lr::linear_scaling(setup.sgd, 4, 5);
  check_sequence(setup, schedule, "linear_scaling");
  CHECK(setup.sgd.lr(0) == doctest::Approx(0.4));  // after the warm-up: 4 x 0.1
  CHECK(setup.sgd.lr(1) == doctest::Approx(0.8));
  TwoGroups no_warmup;
  auto immediate = lr::linear_scaling(no_warmup.sgd, 2, 0);
  CHECK(no_warmup.sgd.lr(0) == doctest::Approx(0.2));
  CHECK_THROWS_AS(lr::linear_scaling(no_warmup.sgd, 0, 5), Error);
}

TEST_CASE("A scheduler's state_dict resumes the sequence where it stopped") {
  const auto& expected = golden().values("lr/cosine");
  TwoGroups first;
  auto schedule = lr::cosine(first.sgd, 10, 0.001);
  for (int e = 0; e < 12; ++e) schedule.step();
  const auto saved = schedule.state_dict();
  CHECK(saved.last_epoch == 12);
  CHECK(saved.step_count == 13);
  const auto optimizer_state = first.sgd.state_dict();

  TwoGroups second;
  auto resumed = lr::cosine(second.sgd, 10, 0.001);
  second.sgd.load_state_dict(optimizer_state);  // the lrs live in the optimizer, as in PyTorch
  resumed.load_state_dict(saved);
  for (int e = 13; e < 36; ++e) {
    resumed.step();
    CHECK(same_bits(second.sgd.lr(0), expected[2 * static_cast<std::size_t>(e)]));
  }
  auto bad = saved;
  bad.base_lrs.pop_back();
  CHECK_THROWS_AS(resumed.load_state_dict(bad), Error);
}

TEST_CASE("Schedules drive any optimizer with per-group learning rates") {
  struct Fake {
    std::vector<double> lrs{1.0, 2.0, 3.0};
    std::size_t group_count() const { return lrs.size(); }
    double lr(std::size_t g) const { return lrs[g]; }
    void set_lr(std::size_t g, double value) { lrs[g] = value; }
  };
  static_assert(lr::GroupLearningRates<Fake>);
  static_assert(!lr::GroupLearningRates<int>);
  Fake fake;
  auto schedule = lr::step(fake, 2, 0.5);
  schedule.step();
  schedule.step();
  CHECK(fake.lrs == std::vector<double>{0.5, 1.0, 1.5});
}
