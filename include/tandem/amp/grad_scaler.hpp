// tandem/amp/grad_scaler.hpp - tandem::GradScaler, dynamic loss scaling with torch.amp's
// semantics, defaults, misuse errors and state_dict keys; one fused unscale + inf-check pass.
//   tandem::GradScaler scaler; backward(scaler.scale(loss)); scaler.step(opt); scaler.update();
//   (a hand-written backward is seeded with scaler.scale(1.0f), the gradient of scale * loss)
// Needs: the standard library, tandem/tensor, the Optimizer and Communicator concepts.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/error.hpp"
#include "tandem/optim/optimizer.hpp"
#include "tandem/tensor/detail/finite_check.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// GradScaler's settings: torch.amp.GradScaler's arguments and defaults.
struct GradScalerOptions {
  /// The scale the first scale() starts at: 2^16.
  double init_scale = 65536.0;
  /// What update() multiplies the scale by after growth_interval clean steps; must be > 1.
  double growth_factor = 2.0;
  /// What update() multiplies the scale by when an inf or NaN was found; must be < 1.
  double backoff_factor = 0.5;
  /// Clean steps in a row (no inf or NaN) before the scale grows; must be > 0.
  std::int64_t growth_interval = 2000;
  /// false makes every call a no-op except step(), which simply steps (the settings then go
  /// unchecked).
  bool enabled = true;
};

namespace detail::amp {

using finite::inf_flag;
using finite::is_finite;

/// Multiplies grads[i] by inv_scale and maps it to 1 when the value BEFORE unscaling was inf or
/// NaN, else 0: PyTorch's _amp_foreach_non_finite_check_and_unscale_ (in opmath, one rounding)
/// as one reduction over the flat gradient block.
template <class T>
struct unscale_and_check {
  T* grads;
  float inv_scale;
  TANDEM_HD inf_flag operator()(std::size_t i) const {
    using opmath = opmath_t<T>;
    const opmath value = static_cast<opmath>(grads[i]);
    grads[i] = T(value * static_cast<opmath>(inv_scale));
    return is_finite(value) ? 0 : 1;
  }
};

/// Reads the flag where the executor can (a device value comes back through a one-element
/// reduction, which synchronises the executor's stream).
struct load_flag {
  const inf_flag* value;
  TANDEM_HD inf_flag operator()(std::size_t) const { return *value; }
};

}  // namespace detail::amp

/// Dynamic loss scaling, as torch.amp.GradScaler does it. Each iteration:
///   backward(scaler.scale(loss)); [scaler.unscale_(opt); clip...;] scaler.step(opt);
///   scaler.update();
/// unscale_() multiplies the optimizer's gradients by 1/scale and detects inf/NaN in ONE pass on
/// the optimizer's executor; the inf flag stays in that executor's memory (Space) and only step()
/// reads it to decide whether to skip. Given a communicator, the flag is all-reduced (max) so
/// that every rank makes the same decision (needed without DDP or with sharded gradients).
/// Under DDP, `ddp.defer_average_to(scaler, opt)` folds DDP's division by world size into that
/// pass (divide_at_next_unscale): one multiplier pass over the gradients for both.
/// enabled=false makes every call a no-op except step(), which simply steps.
template <memory_space Space = host>
class GradScaler {
 public:
  /// Where the inf flags live: the memory space of the optimizers it steps.
  using memory_space = Space;

  /// A scaler for a single process (or one whose gradients are all-reduced already, as with DDP).
  /// An Error when enabled and a setting is out of range.
  explicit GradScaler(GradScalerOptions options = {}) : options_(options) { validate(); }

  /// All-reduces each inf flag over `comm` (max) before the skip decision. The communicator must
  /// outlive the scaler and move tensors of the scaler's memory space.
  template <Communicator C>
  requires std::same_as<typename C::memory_space, Space>
  explicit GradScaler(C& comm, GradScalerOptions options = {})
      : options_(options),
        rank_(comm.rank()),
        all_reduce_found_inf_(
            [&comm](View<detail::amp::inf_flag, Space> flag, const detail::ErasedExecutor& exec) {
              // The stream-ordering contract (comm/stream_order.hpp): after the check that wrote
              // the flag, its result handed back to the executor; on NcclComm and cuda_exec the
              // flag stays on the device and the host does not wait (step() reads it, once).
              detail::order_after_erased(comm, exec);
              comm.all_reduce(flag, ReduceOp::max);
              detail::hand_back_erased(comm, exec);
            }) {
    validate();
  }

  /// Whether each inf flag is all-reduced over a communicator (made with GradScaler(comm)), so
  /// that every rank makes the same skip decision (DistributedDataParallel's shard<2> needs it).
  [[nodiscard]] bool agrees_across_ranks() const noexcept {
    return static_cast<bool>(all_reduce_found_inf_);
  }

  GradScaler(const GradScaler&) = delete;
  GradScaler& operator=(const GradScaler&) = delete;
  /// Moves the scale, tracker and per-optimizer state; a communicator given stays attached.
  GradScaler(GradScaler&&) noexcept = default;
  /// Moves the scale, tracker and per-optimizer state; a communicator given stays attached.
  GradScaler& operator=(GradScaler&&) noexcept = default;
  ~GradScaler() = default;

  /// loss * scale, as torch does it: in float for float, half and bfloat16 losses (a half loss
  /// times PyTorch's float32 scale tensor is float32), in double for double. The loss unchanged
  /// when disabled. The first call starts the scale at init_scale.
  template <class T>
  requires(element_type<T>&& dtype_traits<T>::is_floating) [[nodiscard]] auto scale(T loss) {
    if (!options_.enabled) return static_cast<opmath_t<T>>(loss);
    started_ = true;
    return static_cast<opmath_t<T>>(loss) * static_cast<opmath_t<T>>(scale_);
  }

  /// Divides the optimizer's gradients by the scale in place and records whether any was inf or
  /// NaN: one fused pass on opt.executor(). Errors as PyTorch: twice since the last update(), or
  /// after step().
  template <Optimizer O>
  void unscale_(O& opt) {
    static_assert(std::same_as<typename O::memory_space, Space>,
                  "tandem: GradScaler<Space> unscales optimizers whose gradients live in Space");
    if (!options_.enabled) return;
    require_started("unscale_");
    auto& state = state_of(&opt);
    if (state.where == stage::unscaled) {
      fail("unscale_",
           "unscale_() has already been called on this optimizer since the last update()");
    }
    if (state.where == stage::stepped) fail("unscale_", "unscale_() is being called after step()");

    const float inv_scale = inverse_scale(std::exchange(state.pending_divisor, 1.0));
    auto exec = opt.executor();
    View<typename O::value_type, Space> grads = opt.grads();
    using detail::amp::inf_flag;
    using T = typename O::value_type;
    record_inf_check(state, exec, [&](inf_flag* flag) {
      if (inv_scale != 1.0f) {
        transform_reduce_into(exec, flag, grads.size(), inf_flag{0},
                              detail::amp::unscale_and_check<T>{grads.data(), inv_scale},
                              detail::finite::or_combine{});
      } else {
        transform_reduce_into(exec, flag, grads.size(), inf_flag{0},
                              detail::finite::check_finite<T>{grads.data()},
                              detail::finite::or_combine{});
      }
    });
    state.where = stage::unscaled;
  }

  /// Unscales (unless unscale_() was called), then calls opt.step() unless a gradient was inf or
  /// NaN. Returns whether the optimizer stepped. An Error when called twice since update().
  /// Disabled: just opt.step().
  template <Optimizer O>
  bool step(O& opt) {
    if (!options_.enabled) {
      opt.step();
      return true;
    }
    require_started("step");
    auto& state = state_of(&opt);
    if (state.where == stage::stepped) {
      fail("step", "step() has already been called since the last update()");
    }
    if (state.where == stage::ready) unscale_(opt);
    const bool skip = found_inf_of(state) != 0;
    if (!skip) opt.step();
    state.where = stage::stepped;
    last_step_skipped_ = skip;
    return !skip;
  }

  /// For fused steps (tandem/optim/fused_step.hpp): step(opt) with the unscale folded into the
  /// optimizer's own pass. `check(flag)` must write into *flag (one inf_flag in Space, on
  /// opt.executor()) 1 if any of opt's gradients is inf or NaN and 0 otherwise, changing none;
  /// the flag is all-reduced as unscale_'s is. Then, unless it was set, `apply(inv_scale)` runs:
  /// the step itself, which multiplies each gradient by inv_scale as it reads it (1/scale; 1 when
  /// unscale_() has already unscaled them, whose check is used instead of `check`). Returns
  /// whether apply ran. Errors as step(); disabled: apply(1) and true.
  template <Optimizer O, class Check, class Apply>
  bool fused_step(O& opt, Check&& check, Apply&& apply) {
    if (!options_.enabled) {
      apply(1.0f);
      return true;
    }
    require_started("step");
    auto& state = state_of(&opt);
    if (state.where == stage::stepped) {
      fail("step", "step() has already been called since the last update()");
    }
    float inv_scale = 1.0f;
    if (state.where == stage::ready) {
      inv_scale = inverse_scale(std::exchange(state.pending_divisor, 1.0));
      record_inf_check(state, opt.executor(), check);
    }
    const bool skip = found_inf_of(state) != 0;
    if (!skip) apply(inv_scale);
    state.where = stage::stepped;
    last_step_skipped_ = skip;
    return !skip;
  }

  /// For DistributedDataParallel::defer_average_to: the next unscale of `opt`'s gradients
  /// (unscale_(), step() or fused_step()) also divides them by `divisor` (the world size), in
  /// the same pass: it multiplies by 1/(scale * divisor) instead of 1/scale; the inf check is
  /// unchanged. An Error when disabled (it would never unscale), for a divisor that is not a
  /// positive finite number, or while a division handed over earlier is still pending (the
  /// gradients were reduced again before the optimizer was unscaled).
  template <Optimizer O>
  void divide_at_next_unscale(O& opt, double divisor) {
    const char* operation = "divide_at_next_unscale";
    if (!options_.enabled) {
      fail(operation,
           "a disabled GradScaler never unscales, so it cannot take the division by world size");
    }
    if (!(divisor > 0.0) || !detail::amp::is_finite(divisor)) {
      fail(operation,
           "the divisor must be a positive finite number, got " + std::to_string(divisor));
    }
    auto& state = state_of(&opt);
    if (state.pending_divisor != 1.0) {
      fail(operation,
           "the gradients were reduced again before the division by world size handed over "
           "after the last reduction was applied: unscale_() or step() the optimizer after each "
           "finish_gradient_sync()");
    }
    state.pending_divisor = divisor;
  }

  /// Updates the scale from this iteration's inf checks: backoff on inf/NaN, growth after
  /// growth_interval clean steps in a row (never to inf), exactly torch._amp_update_scale_.
  /// An Error when no optimizer was unscaled since the last update().
  void update() {
    if (!options_.enabled) return;
    require_started("update");
    detail::amp::inf_flag found_inf = 0;
    bool recorded = false;
    for (auto& state : states_) {
      if (state->where == stage::ready) continue;
      found_inf += found_inf_of(*state);
      recorded = true;
    }
    if (!recorded) fail("update", "No inf checks were recorded prior to update()");
    if (found_inf != 0) {
      scale_ = static_cast<float>(static_cast<double>(scale_) * options_.backoff_factor);
      growth_tracker_ = 0;
    } else {
      const std::int32_t successful = growth_tracker_ + 1;
      if (successful == options_.growth_interval) {
        const auto grown = static_cast<float>(static_cast<double>(scale_) * options_.growth_factor);
        if (detail::amp::is_finite(grown)) scale_ = grown;
        growth_tracker_ = 0;
      } else {
        growth_tracker_ = successful;
      }
    }
    reset_states();
  }

  /// Sets the scale to new_scale (PyTorch's update(new_scale)); no inf check is needed.
  void update(float new_scale) {
    if (!options_.enabled) return;
    require_started("update");
    scale_ = new_scale;
    reset_states();
  }

  /// The current scale (init_scale before the first scale()); 1 when disabled, as PyTorch.
  [[nodiscard]] double get_scale() const noexcept {
    if (!options_.enabled) return 1.0;
    return started_ ? static_cast<double>(scale_) : options_.init_scale;
  }
  /// The factor the scale grows by (GradScalerOptions::growth_factor).
  [[nodiscard]] double get_growth_factor() const noexcept { return options_.growth_factor; }
  /// The factor the scale backs off by (GradScalerOptions::backoff_factor).
  [[nodiscard]] double get_backoff_factor() const noexcept { return options_.backoff_factor; }
  /// Clean steps in a row before the scale grows (GradScalerOptions::growth_interval).
  [[nodiscard]] std::int64_t get_growth_interval() const noexcept {
    return options_.growth_interval;
  }
  /// Clean steps in a row since the scale last grew or backed off (PyTorch's _growth_tracker).
  [[nodiscard]] std::int32_t growth_tracker() const noexcept { return growth_tracker_; }
  /// Takes effect at the next growth; unchecked, as in PyTorch.
  void set_growth_factor(double factor) { options_.growth_factor = factor; }
  /// Takes effect at the next backoff; unchecked, as in PyTorch.
  void set_backoff_factor(double factor) { options_.backoff_factor = factor; }
  /// Takes effect at the next update(); unchecked, as in PyTorch.
  void set_growth_interval(std::int64_t interval) { options_.growth_interval = interval; }
  /// false: every call is a no-op except step(), which simply steps.
  [[nodiscard]] bool is_enabled() const noexcept { return options_.enabled; }
  /// Whether the last step() skipped the optimizer (inf or NaN gradients).
  [[nodiscard]] bool last_step_skipped() const noexcept { return last_step_skipped_; }

  /// PyTorch's keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker.
  /// Empty when disabled, as PyTorch.
  [[nodiscard]] std::map<std::string, double> state_dict() const {
    if (!options_.enabled) return {};
    return {{"scale", get_scale()},
            {"growth_factor", options_.growth_factor},
            {"backoff_factor", options_.backoff_factor},
            {"growth_interval", static_cast<double>(options_.growth_interval)},
            {"_growth_tracker", static_cast<double>(growth_tracker_)}};
  }

  /// Restores what state_dict() returned (a PyTorch GradScaler's state_dict too). An Error (and
  /// nothing changed) for an empty dict (saved from a disabled scaler), a missing key or a value
  /// out of range; a no-op when disabled.
  void load_state_dict(const std::map<std::string, double>& state) {
    if (!options_.enabled) return;
    if (state.empty()) {
      fail("load_state_dict",
           "The source state dict is empty, possibly because it was saved from a disabled "
           "instance of GradScaler");
    }
    // Every value is checked before any is taken: a bad dict changes nothing, and no cast of an
    // out-of-range double (undefined behaviour) happens.
    const double new_scale = required(state, "scale");
    const double growth_factor = required(state, "growth_factor");
    const double backoff_factor = required(state, "backoff_factor");
    const double growth_interval = required(state, "growth_interval");
    const double growth_tracker = required(state, "_growth_tracker");
    if (!(new_scale > 0) || !(new_scale <= std::numeric_limits<float>::max())) {
      refuse("scale", new_scale, "a finite float above 0");
    }
    if (!(growth_factor > 1.0) || std::isinf(growth_factor)) {
      refuse("growth_factor", growth_factor, "finite and above 1.0");
    }
    if (!(backoff_factor > 0.0 && backoff_factor < 1.0)) {
      refuse("backoff_factor", backoff_factor, "between 0 and 1");
    }
    if (!(growth_interval >= 1 && growth_interval <= std::numeric_limits<std::int32_t>::max()) ||
        growth_interval != std::floor(growth_interval)) {
      refuse("growth_interval", growth_interval, "a whole number of steps, at least 1");
    }
    if (!(growth_tracker >= 0 && growth_tracker < growth_interval) ||
        growth_tracker != std::floor(growth_tracker)) {
      refuse("_growth_tracker", growth_tracker, "a whole number below growth_interval");
    }
    options_.growth_factor = growth_factor;
    options_.backoff_factor = backoff_factor;
    options_.growth_interval = static_cast<std::int64_t>(growth_interval);
    growth_tracker_ = static_cast<std::int32_t>(growth_tracker);
    options_.init_scale = new_scale;
    scale_ = static_cast<float>(new_scale);
  }

 private:
  enum class stage : std::uint8_t { ready, unscaled, stepped };

  // Per-optimizer bookkeeping, found by the optimizer's address as PyTorch does by id().
  struct Entry {
    const void* optimizer = nullptr;
    stage where = stage::ready;
    Buffer<detail::amp::inf_flag, Space> found_inf;
    std::function<detail::amp::inf_flag()> read_found_inf;
    std::optional<detail::amp::inf_flag> found_inf_value;
    double pending_divisor = 1.0;  // divide_at_next_unscale's, until the next unscale takes it
  };

  void validate() const {
    if (!options_.enabled) return;
    if (!(options_.growth_factor > 1.0)) fail("GradScaler", "The growth factor must be > 1.0");
    if (!(options_.backoff_factor < 1.0)) fail("GradScaler", "The backoff factor must be < 1.0");
    if (options_.growth_interval <= 0) fail("GradScaler", "The growth interval must be > 0");
  }

  void require_started(const char* operation) {
    if (!started_) {
      // PyTorch asserts this; the scale and tracker start at the first scale().
      fail(operation, std::string("Attempted ") + operation +
                          " but the scale is not initialised. This may indicate your script did "
                          "not use scaler.scale(loss) earlier in the iteration");
    }
  }

  Entry& state_of(const void* optimizer) {
    for (auto& entry : states_) {
      if (entry->optimizer == optimizer) return *entry;
    }
    states_.push_back(std::make_unique<Entry>());
    states_.back()->optimizer = optimizer;
    return *states_.back();
  }

  /// 1/(scale * divisor) as unscale_() multiplies by it (divisor: a division handed over by
  /// divide_at_next_unscale, else 1). PyTorch takes the reciprocal in double: float division can
  /// be imprecise under some flags. The product is exact in double (24 + 31 bits).
  [[nodiscard]] float inverse_scale(double divisor = 1.0) const {
    return static_cast<float>(1.0 / (static_cast<double>(scale_) * divisor));
  }

  /// The inf check of one optimizer's gradients, shared by unscale_() and fused_step():
  /// `check(flag)` writes 0 or 1 into the optimizer's flag (one inf_flag in Space, on `exec`);
  /// with a communicator the flag is all-reduced (max); step() reads it later, once.
  template <class Exec, class Check>
  void record_inf_check(Entry& state, const Exec& exec, Check&& check) {
    using detail::amp::inf_flag;
    if (state.found_inf.empty()) state.found_inf = Buffer<inf_flag, Space>(1);
    inf_flag* flag = state.found_inf.data();
    check(flag);
    if (all_reduce_found_inf_) {
      all_reduce_found_inf_(View<inf_flag, Space>(flag, 1), detail::ErasedExecutor(exec));
    }
    state.read_found_inf = [exec, flag] {
      return transform_reduce(exec, 1, inf_flag{0}, detail::amp::load_flag{flag},
                              detail::finite::or_combine{});
    };
    state.found_inf_value.reset();
  }

  detail::amp::inf_flag found_inf_of(Entry& state) {
    if (!state.found_inf_value) state.found_inf_value = state.read_found_inf();
    return *state.found_inf_value;
  }

  void reset_states() {
    for (auto& entry : states_) {
      entry->where = stage::ready;
      entry->found_inf_value.reset();
      entry->read_found_inf = nullptr;
    }
  }

  static double required(const std::map<std::string, double>& state, const char* key) {
    auto found = state.find(key);
    if (found == state.end()) {
      throw Error("GradScaler::load_state_dict",
                  std::string("the state dict has no key '") + key + "'");
    }
    return found->second;
  }

  [[noreturn]] void refuse(const char* key, double value, const char* expected) const {
    std::ostringstream text;
    text << "the state dict's '" << key << "' is " << value << "; expected " << expected;
    fail("load_state_dict", text.str());
  }

  [[noreturn]] void fail(const std::string& operation, const std::string& cause) const {
    throw Error(rank_, "GradScaler::" + operation, cause);
  }

  GradScalerOptions options_;
  int rank_ = unknown_rank;
  std::function<void(View<detail::amp::inf_flag, Space>, const detail::ErasedExecutor&)>
      all_reduce_found_inf_;
  float scale_ = static_cast<float>(options_.init_scale);
  std::int32_t growth_tracker_ = 0;
  bool started_ = false;
  bool last_step_skipped_ = false;
  std::vector<std::unique_ptr<Entry>> states_;
};

}  // namespace tandem
