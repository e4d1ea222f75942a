// tandem/optim/lr_scheduler.hpp - learning-rate schedules with PyTorch's numbers and step
// conventions: lambda, step, multi_step, linear, cosine, warm-up + cosine, linear scaling rule.
//   auto schedule = tandem::lr::cosine(sgd, 100);  // sets the lr of step 0 now
//   for (...) { sgd.step(); schedule.step(); }
// Needs: the standard library and an optimizer with per-group learning rates (tandem/optim).
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <numbers>
#include <string>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"

namespace tandem::lr {

/// What a schedule needs of an optimizer (SGD and AdamW have it):
/// 1. `opt.group_count()`, the number of param groups;
/// 2. `opt.lr(g)`, group g's learning rate;
/// 3. `opt.set_lr(g, lr)`, which sets it.
template <class O>
concept GroupLearningRates = requires(O& opt, const O& read, std::size_t g, double lr) {
  { read.group_count() } -> std::convertible_to<std::size_t>;
  { read.lr(g) } -> std::convertible_to<double>;
  opt.set_lr(g, lr);
};

/// What a rule sees when it computes one group's learning rate for epoch `epoch`.
struct Context {
  /// PyTorch's last_epoch after the increment: 0 at construction.
  std::int64_t epoch;
  /// The param group's index.
  std::size_t group;
  /// The group's current lr (PyTorch's group['lr']), for chainable rules.
  double lr;
  /// The group's lr when the schedule was made (base_lrs).
  double base_lr;
};

/// A rule: the learning rate for a group at an epoch.
using Rule = std::function<double(const Context&)>;

/// Drives an optimizer's learning rates with a Rule, PyTorch's _LRScheduler conventions:
/// construction is step 0 (last_epoch 0) and already sets the lr; each step() increments
/// last_epoch, then sets every group's lr to rule(...). The optimizer must outlive it.
template <GroupLearningRates O>
class Scheduler {
 public:
  /// PyTorch's scheduler.state_dict() fields that matter here (the rule is code, as PyTorch's
  /// lambdas are not saved).
  struct State {
    /// PyTorch's last_epoch: 0 once constructed, +1 per step().
    std::int64_t last_epoch = -1;
    /// PyTorch's _step_count: the number of steps taken, the constructor's included.
    std::int64_t step_count = 0;
    /// Each group's lr when the schedule was made.
    std::vector<double> base_lrs;
    /// PyTorch's _last_lr: the lrs the last step set, one per group.
    std::vector<double> last_lr;
  };

  /// Records each group's current lr as its base_lr and takes step 0, which already sets the lrs.
  Scheduler(O& optimizer, Rule rule) : optimizer_(&optimizer), rule_(std::move(rule)) {
    for (std::size_t g = 0; g < optimizer.group_count(); ++g) {
      state_.base_lrs.push_back(optimizer.lr(g));
    }
    step();
  }

  /// Advances one epoch (or iteration) and sets every group's lr.
  void step() {
    ++state_.step_count;
    ++state_.last_epoch;
    std::vector<double> lrs;
    for (std::size_t g = 0; g < state_.base_lrs.size(); ++g) {
      lrs.push_back(rule_(Context{state_.last_epoch, g, optimizer_->lr(g), state_.base_lrs[g]}));
    }
    for (std::size_t g = 0; g < lrs.size(); ++g) optimizer_->set_lr(g, lrs[g]);
    state_.last_lr = std::move(lrs);
  }

  /// PyTorch's last_epoch: 0 after construction, +1 per step().
  [[nodiscard]] std::int64_t last_epoch() const noexcept { return state_.last_epoch; }
  /// PyTorch's get_last_lr(): the lrs the last step set, one per group.
  [[nodiscard]] const std::vector<double>& last_lr() const noexcept { return state_.last_lr; }
  /// Each group's lr when the schedule was made.
  [[nodiscard]] const std::vector<double>& base_lrs() const noexcept { return state_.base_lrs; }

  /// A copy of the counters and lrs, for checkpoints (the rule is not saved).
  [[nodiscard]] State state_dict() const { return state_; }
  /// Restores the counters and lrs (not the optimizer's lrs: load the optimizer's state too, as
  /// in PyTorch). An Error when the group count differs.
  void load_state_dict(const State& state) {
    if (state.base_lrs.size() != state_.base_lrs.size() ||
        state.last_lr.size() != state_.base_lrs.size()) {
      throw Error("lr::Scheduler::load_state_dict",
                  "the state has " + std::to_string(state.base_lrs.size()) +
                      " param groups, the optimizer " + std::to_string(state_.base_lrs.size()));
    }
    state_ = state;
  }

 private:
  O* optimizer_;
  Rule rule_;
  State state_;
};

/// LambdaLR: lr = base_lr * factor(epoch), the same factor for every group.
template <GroupLearningRates O>
Scheduler<O> lambda(O& optimizer, std::function<double(std::int64_t)> factor) {
  return Scheduler<O>(optimizer, [factor = std::move(factor)](const Context& c) {
    return c.base_lr * factor(c.epoch);
  });
}

/// LambdaLR with one factor per param group; an Error when the count differs from the groups'.
template <GroupLearningRates O>
Scheduler<O> lambda(O& optimizer, std::vector<std::function<double(std::int64_t)>> factors) {
  if (factors.size() != static_cast<std::size_t>(optimizer.group_count())) {
    throw Error("lr::lambda", "expected " + std::to_string(optimizer.group_count()) +
                                  " lr lambdas, but got " + std::to_string(factors.size()));
  }
  return Scheduler<O>(optimizer, [factors = std::move(factors)](const Context& c) {
    return c.base_lr * factors[c.group](c.epoch);
  });
}

/// StepLR: multiplies the lr by gamma every step_size epochs (PyTorch's recursive form).
template <GroupLearningRates O>
Scheduler<O> step(O& optimizer, std::int64_t step_size, double gamma = 0.1) {
  if (step_size <= 0) {
    throw Error("lr::step", "step_size must be positive, not " + std::to_string(step_size));
  }
  return Scheduler<O>(optimizer, [step_size, gamma](const Context& c) {
    if (c.epoch == 0 || c.epoch % step_size != 0) return c.lr;
    return c.lr * gamma;
  });
}

/// MultiStepLR: multiplies the lr by gamma at each milestone (by gamma^k for a milestone listed
/// k times, as PyTorch's Counter does).
template <GroupLearningRates O>
Scheduler<O> multi_step(O& optimizer, std::vector<std::int64_t> milestones, double gamma = 0.1) {
  return Scheduler<O>(optimizer, [milestones = std::move(milestones), gamma](const Context& c) {
    const auto times = std::count(milestones.begin(), milestones.end(), c.epoch);
    if (times == 0) return c.lr;
    return c.lr * std::pow(gamma, static_cast<double>(times));
  });
}

/// LinearLR: the factor goes linearly from start_factor to end_factor over total_iters epochs,
/// PyTorch's recursive form (each step multiplies the current lr). Factors outside [0, 1] (a
/// start factor of 0 too: PyTorch would divide by zero) and total_iters < 1 are an Error.
template <GroupLearningRates O>
Scheduler<O> linear(O& optimizer, double start_factor = 1.0 / 3, double end_factor = 1.0,
                    std::int64_t total_iters = 5) {
  if (!(start_factor > 0 && start_factor <= 1)) {
    throw Error("lr::linear", "starting multiplicative factor expected to be in (0, 1], not " +
                                  std::to_string(start_factor));
  }
  if (!(end_factor >= 0 && end_factor <= 1)) {
    throw Error("lr::linear", "ending multiplicative factor expected to be between 0 and 1, not " +
                                  std::to_string(end_factor));
  }
  if (total_iters < 1) {
    throw Error("lr::linear", "total_iters must be at least 1, not " + std::to_string(total_iters));
  }
  return Scheduler<O>(optimizer, [=](const Context& c) {
    if (c.epoch == 0) return c.lr * start_factor;
    if (c.epoch > total_iters) return c.lr;
    return c.lr * (1. + (end_factor - start_factor) /
                            (static_cast<double>(total_iters) * start_factor +
                             static_cast<double>(c.epoch - 1) * (end_factor - start_factor)));
  });
}

/// CosineAnnealingLR in PyTorch's recursive form (what scheduler.step() computes; it differs
/// from the closed form eta_min + (base - eta_min)(1 + cos(pi t / T_max)) / 2 in the last bits),
/// including the restart branch past T_max.
template <GroupLearningRates O>
Scheduler<O> cosine(O& optimizer, std::int64_t t_max, double eta_min = 0) {
  if (t_max <= 0) throw Error("lr::cosine", "T_max must be positive, not " + std::to_string(t_max));
  return Scheduler<O>(optimizer, [t_max, eta_min](const Context& c) {
    constexpr double pi = std::numbers::pi;
    const auto t = static_cast<double>(t_max);
    const auto e = static_cast<double>(c.epoch);
    if (c.epoch == 0) return c.lr;
    if ((c.epoch - 1 - t_max) % (2 * t_max) == 0) {
      return c.lr + (c.base_lr - eta_min) * (1 - std::cos(pi / t)) / 2;
    }
    return (1 + std::cos(pi * e / t)) / (1 + std::cos(pi * (e - 1) / t)) * (c.lr - eta_min) +
           eta_min;
  });
}

/// Linear warm-up then cosine decay, the schedule usually written as a LambdaLR (nanoGPT's):
///   lr(s) = lr_max * (s + 1) / warmup                                   for s < warmup
///         = lr_min + (lr_max - lr_min) * (1 + cos(pi * (s - warmup) / (total - warmup))) / 2
///                                                                       for warmup <= s <= total
///         = lr_min                                                      after total.
/// As a factor (operator()) it is lr(s) / lr_max, for lr::lambda: a scheduler multiplies each
/// group's own starting lr by it, so on an optimizer lr_max and lr_min are factors of that lr and
/// only their ratio counts (warmup_cosine(opt, w, t, 1.0, 0.01): up to the optimizer's lr, down
/// to 1 % of it).
struct WarmupCosine {
  /// Steps of linear warm-up up to lr_max.
  std::int64_t warmup;
  /// The step at which the cosine reaches lr_min; >= warmup.
  std::int64_t total;
  /// The peak lr, reached at the end of warm-up.
  double lr_max;
  /// The floor the cosine decays to, and the lr after total.
  double lr_min;

  /// The learning rate at step `s` (the formula above).
  [[nodiscard]] double lr(std::int64_t s) const {
    if (s < warmup) return lr_max * static_cast<double>(s + 1) / static_cast<double>(warmup);
    if (s > total) return lr_min;
    const double progress =
        total == warmup ? 1.0
                        : static_cast<double>(s - warmup) / static_cast<double>(total - warmup);
    return lr_min + (lr_max - lr_min) * (1 + std::cos(std::numbers::pi * progress)) / 2;
  }
  /// The factor lr(s) / lr_max, for lr::lambda.
  [[nodiscard]] double operator()(std::int64_t s) const { return lr(s) / lr_max; }
};

/// The warm-up + cosine factor; an Error for warmup < 0, total < warmup, lr_max <= 0 or lr_min
/// outside [0, lr_max].
inline WarmupCosine warmup_cosine(std::int64_t warmup, std::int64_t total, double lr_max,
                                  double lr_min = 0) {
  if (warmup < 0 || total < warmup) {
    throw Error("lr::warmup_cosine", "need 0 <= warmup <= total, got warmup " +
                                         std::to_string(warmup) + ", total " +
                                         std::to_string(total));
  }
  if (!(lr_max > 0) || !(lr_min >= 0 && lr_min <= lr_max)) {
    throw Error("lr::warmup_cosine", "need 0 <= lr_min <= lr_max and lr_max > 0, got lr_max " +
                                         std::to_string(lr_max) + ", lr_min " +
                                         std::to_string(lr_min));
  }
  return {warmup, total, lr_max, lr_min};
}

/// A LambdaLR on `optimizer` whose factor is warmup_cosine(warmup, total, lr_max, lr_min): each
/// group's lr at step s is its starting lr times lr(s) / lr_max. lr_max and lr_min are factors of
/// the optimizer's rates, not rates: pass 1.0 and the floor's fraction (0.01 for 1 %). Rates work
/// only where lr_max equals the optimizer's lr (3e-4, 3e-6 on an optimizer at 3e-4); an
/// optimizer at 0.1 given lr_max = 0.01 still peaks at 0.1, with its floor at 0.1 * lr_min /
/// lr_max. An Error as for the factor (warmup < 0, total < warmup, lr_max <= 0, lr_min outside
/// [0, lr_max]).
template <GroupLearningRates O>
Scheduler<O> warmup_cosine(O& optimizer, std::int64_t warmup, std::int64_t total, double lr_max,
                           double lr_min = 0) {
  return lambda(optimizer,
                std::function<double(std::int64_t)>(warmup_cosine(warmup, total, lr_max, lr_min)));
}

/// The linear scaling rule (Goyal et al. 2017): with world_size times the batch, world_size
/// times the learning rate.
[[nodiscard]] inline double scaled_lr(double base_lr, int world_size) {
  if (world_size < 1) {
    throw Error("lr::scaled_lr",
                "world size must be at least 1, not " + std::to_string(world_size));
  }
  return base_lr * world_size;
}

/// The linear scaling rule with its gradual warm-up, as a LambdaLR on an optimizer set up with
/// the single-process lrs: factor(s) = 1 + (world_size - 1) * min(s, warmup) / warmup, so the lr
/// climbs from base_lr at step 0 to base_lr * world_size at step `warmup` and stays there.
template <GroupLearningRates O>
Scheduler<O> linear_scaling(O& optimizer, int world_size, std::int64_t warmup) {
  if (world_size < 1 || warmup < 0) {
    throw Error("lr::linear_scaling", "need world_size >= 1 and warmup >= 0, got " +
                                          std::to_string(world_size) + " and " +
                                          std::to_string(warmup));
  }
  const double k = world_size;
  return lambda(optimizer, std::function<double(std::int64_t)>([k, warmup](std::int64_t s) {
                  if (warmup == 0 || s >= warmup) return k;
                  return 1 + (k - 1) * static_cast<double>(s) / static_cast<double>(warmup);
                }));
}

}  // namespace tandem::lr
