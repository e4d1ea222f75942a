// tandem/optim/ema.hpp - tandem::EMA, an exponential moving average of a Parameters arena (timm's
// ModelEmaV3 warm-up, torch.lerp's arithmetic) with O(1) apply_shadow()/restore().
//   tandem::EMA ema(params, {.decay = 0.999}); ema.update(); auto guard = ema.applied();
// Needs: the standard library, tandem/tensor, tandem/arena/parameters.hpp (device:
// tandem/cuda.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "tandem/arena/parameters.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/error.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/host_cpu.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// EMA's settings: timm's ModelEmaV3 arguments and defaults.
struct EMAOptions {
  /// The decay per update once past the copying steps (with use_warmup, the most the warm-up
  /// reaches); in [0, 1].
  double decay = 0.9999;
  /// With use_warmup, the least decay the warm-up gives (its curve is clamped to it).
  double min_decay = 0.0;
  /// Updates that only copy the live weights (decay 0): update numbers up to
  /// update_after_step + 1.
  std::size_t update_after_step = 0;
  /// Ramp the decay up as 1 - (1 + s / warmup_gamma)^-warmup_power instead of using `decay` from
  /// the start (see EMA::decay_at).
  bool use_warmup = false;
  /// The warm-up's time scale, in updates; must be > 0 with use_warmup.
  double warmup_gamma = 1.0;
  /// The warm-up's exponent: with gamma 1, 2/3 reaches a decay of 0.999 after about 31.6k
  /// updates (for runs of a million steps or more), 3/4 after 10k (for shorter runs).
  double warmup_power = 2.0 / 3.0;
  /// Average floating buffers (running statistics) like parameters; false copies every buffer
  /// (timm's exclude_buffers). Integral buffers (BufferKind::integral) are always copied.
  bool average_buffers = true;
};

namespace detail::ema {

/// a * b + c rounded once, as torch's vectorised lerp computes it (with an FMA). Without a
/// hardware FMA the host computes it in double: a * b is exact there, so only a double-rounding
/// tie (about one case in 2^29) could differ by one ulp, and the loop still vectorises. Hardware
/// selects __builtin_fmaf: true where the code runs in run_lerp's AVX2+FMA clone (one
/// instruction there, and exactly torch's rounding).
template <bool Hardware = false>
TANDEM_HD inline float fused_multiply_add(float a, float b, float c) noexcept {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#elif defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  if constexpr (Hardware) {
    return __builtin_fmaf(a, b, c);
  } else {
    return static_cast<float>(static_cast<double>(a) * static_cast<double>(b) +
                              static_cast<double>(c));
  }
#endif
}
template <bool Hardware = false>
TANDEM_HD inline double fused_multiply_add(double a, double b, double c) noexcept {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return __builtin_fma(a, b, c);
#endif
}

/// torch.lerp(start, end, weight): start + weight * (end - start) for |weight| < 0.5, else
/// end - (end - start) * (1 - weight), each as one fused multiply-add (ATen's lerp_vec).
template <bool Hardware = false, class Opmath>
TANDEM_HD inline Opmath lerp(Opmath start, Opmath end, Opmath weight) noexcept {
  const Opmath difference = end - start;
  const Opmath magnitude = weight < Opmath(0) ? -weight : weight;
  return magnitude < Opmath(0.5)
             ? fused_multiply_add<Hardware>(weight, difference, start)
             : fused_multiply_add<Hardware>(weight - Opmath(1), difference, end);
}

/// shadow[i] = lerp(shadow[i], live[i], weight), in opmath (float for half and bfloat16).
template <class T, bool Hardware = false>
struct lerp_into {
  T* shadow;
  const T* live;
  opmath_t<T> weight;
  TANDEM_HD void operator()(std::size_t i) const {
    using opmath = opmath_t<T>;
    shadow[i] =
        T(lerp<Hardware>(static_cast<opmath>(shadow[i]), static_cast<opmath>(live[i]), weight));
  }
};

/// The same for buffers, copying the elements whose mask is set (integral buffers).
template <class T, bool Hardware = false>
struct lerp_or_copy_into {
  T* shadow;
  const T* live;
  const std::uint8_t* copy;
  opmath_t<T> weight;
  TANDEM_HD void operator()(std::size_t i) const {
    using opmath = opmath_t<T>;
    shadow[i] = copy[i] ? live[i]
                        : T(lerp<Hardware>(static_cast<opmath>(shadow[i]),
                                           static_cast<opmath>(live[i]), weight));
  }
};

#if defined(TANDEM_HOST_X86_KERNELS)
/// torch.lerp(start, end, weight) on eight floats with AVX2 and FMA: lerp<true>'s two IEEE
/// operations per element in its order, so the same bits; the weight's branch is taken once, when
/// the lane is made. The one vector lerp: the EMA's pass below and FusedStep's update
/// (optim/fused_step.hpp) use it.
class lerp_avx2_lane {
 public:
  [[gnu::target("avx2,fma"), gnu::always_inline]] explicit lerp_avx2_lane(float weight)
      : near_start_((weight < 0.0f ? -weight : weight) < 0.5f),
        weight_(_mm256_set1_ps(near_start_ ? weight : weight - 1.0f)) {}

  /// lerp(start, end, weight) for each of the eight lanes.
  [[gnu::target("avx2,fma"), gnu::always_inline]] __m256 operator()(__m256 start,
                                                                    __m256 end) const {
    return _mm256_fmadd_ps(weight_, _mm256_sub_ps(end, start), near_start_ ? start : end);
  }

 private:
  bool near_start_;
  __m256 weight_;
};
#endif

#if defined(TANDEM_HOST_FMA_CLONE)
/// lerp_into<float> eight elements at a time: GCC 12 does not vectorise the FMA clone of the
/// scalar loop for it (its assembly is scalar vfmadd).
[[gnu::target("avx2,fma")]] inline void lerp_float_avx2_fma(const lerp_into<float, true>& f,
                                                            std::size_t n) {
  const lerp_avx2_lane lerp(f.weight);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(f.shadow + i,
                     lerp(_mm256_loadu_ps(f.shadow + i), _mm256_loadu_ps(f.live + i)));
  }
  for (; i < n; ++i) f(i);
}
#endif

/// Runs a lerp pass: on the host executor through the FMA clone where the CPU has AVX2 and FMA
/// (Pass<Hardware = true>), elsewhere through the executor (Pass<false>).
template <template <class, bool> class Pass, class T, class E, class... Args>
void run_lerp(const E& exec, std::size_t n, Args... args) {
#if defined(TANDEM_HOST_FMA_CLONE)
  if constexpr (std::is_same_v<E, host_exec>) {
    if (cpu_has(cpu_feature::avx2_fma)) {
      const Pass<T, true> pass{args...};
      if constexpr (std::is_same_v<Pass<T, true>, lerp_into<float, true>>) {
        lerp_float_avx2_fma(pass, n);
      } else {
        ::tandem::detail::cpu::for_range_fma(pass, 0, n);
      }
      return;
    }
  }
#endif
  for_each_index(exec, n, Pass<T, false>{args...});
}

template <class T>
struct copy_into {
  T* out;
  const T* in;
  TANDEM_HD void operator()(std::size_t i) const { out[i] = in[i]; }
};

struct fill_mask {
  std::uint8_t* mask;
  std::uint8_t value;
  TANDEM_HD void operator()(std::size_t i) const { mask[i] = value; }
};

}  // namespace detail::ema

/// An exponential moving average ("shadow") of every trained value and buffer of a Parameters
/// arena: after each optimizer step, update() sets shadow = decay * shadow + (1 - decay) * live,
/// computed as torch.lerp(shadow, live, 1 - decay), in one pass over the flat values and one over
/// the buffers on the executor.
///
/// apply_shadow() / restore() swap the arena's storage with the shadow's (Parameters::
/// swap_values, O(1), no copy): while applied, the arena itself - params.values(), every
/// Parameter's value(), the model's forward - holds the averaged weights, and the live ones wait in
/// the EMA. Views taken before the swap keep the storage they were taken of.
template <element_type T, memory_space Space = host, class Exec = default_executor_t<Space>>
requires ExecutorFor<Exec, Space>
class EMA {
 public:
  /// The element type of the arena and of the shadow.
  using value_type = T;
  /// Where the arena and the shadow live.
  using memory_space = Space;
  /// The arena's handle for one parameter or buffer, for value().
  using parameter = typename Parameters<T, Space>::Parameter;

  /// Takes a copy of the arena's current values and buffers as the shadow (timm deep-copies the
  /// model at construction). The arena must be finalized and outlive the EMA.
  explicit EMA(Parameters<T, Space>& params, EMAOptions options = {}, Exec exec = {})
      : params_(&params), options_(options), exec_(std::move(exec)) {
    if (!params.finalized()) {
      throw Error("EMA", "the Parameters arena must be finalized before an EMA is made of it");
    }
    if (!(options_.decay >= 0.0 && options_.decay <= 1.0)) {
      throw Error("EMA", "decay " + std::to_string(options_.decay) + " lies outside [0, 1]");
    }
    if (options_.use_warmup && !(options_.warmup_gamma > 0.0)) {
      throw Error("EMA", "warmup_gamma must be > 0");
    }
    shadow_values_ = Buffer<T, Space>(params.numel());
    shadow_buffers_ = Buffer<T, Space>(params.buffer_numel());
    build_copy_mask();
    register_weights();
  }

  EMA(const EMA&) = delete;
  EMA& operator=(const EMA&) = delete;
  /// Moves the shadow, settings and update count; the arena stays where it is. Not while an
  /// AppliedGuard of the source lives (it keeps the source's address).
  EMA(EMA&&) noexcept = default;
  /// Moves as the move constructor does.
  EMA& operator=(EMA&&) noexcept = default;
  ~EMA() = default;

  /// shadow := the arena's current values and buffers; the update count restarts at 0. An Error
  /// while the shadow is applied.
  void register_weights() {
    require_not_applied("register_weights");
    copy(params_->values(), shadow_values_);
    copy(params_->buffer_values(), shadow_buffers_);
    updates_ = 0;
  }

  /// The decay for update number `step` (timm's get_decay): 0 (copy) while
  /// step <= update_after_step + 1; then `decay`, or with warm-up
  /// 1 - (1 + s / gamma)^-power clamped to [min_decay, decay], s = step - update_after_step - 1.
  [[nodiscard]] double decay_at(std::size_t step) const noexcept {
    if (step <= options_.update_after_step + 1) return 0.0;
    const auto s = static_cast<double>(step - options_.update_after_step - 1);
    if (!options_.use_warmup) return options_.decay;
    const double decay = 1.0 - std::pow(1.0 + s / options_.warmup_gamma, -options_.warmup_power);
    return std::max(std::min(decay, options_.decay), options_.min_decay);
  }

  /// Counts one more update and blends the arena into the shadow with decay_at(count): call it
  /// after each optimizer step (timm's `update(model, step=num_updates)`).
  void update() { update(updates_ + 1); }

  /// Blends with decay_at(step) and makes `step` the update count. Does not wait on devices. An
  /// Error while the shadow is applied (the live weights are not the active ones then).
  void update(std::size_t step) {
    update_with(step, [this](T* shadow, opmath_t<T> weight) {
      View<T, Space> live = params_->values();
      detail::ema::run_lerp<detail::ema::lerp_into, T>(exec_, live.size(), shadow, live.data(),
                                                       weight);
    });
  }

  /// The lerp weight (1 - decay) that update() would blend with now, as the elements' opmath.
  [[nodiscard]] opmath_t<T> next_weight() const noexcept {
    return static_cast<opmath_t<T>>(1.0 - decay_at(updates_ + 1));
  }

  /// For fused steps (tandem/optim/fused_step.hpp): update() with the blend of the trained values
  /// done by `blend(shadow, weight)`, which must set shadow[i] = lerp(shadow[i], values[i],
  /// weight) for every trained value (detail::ema::lerp's arithmetic); the buffers and the count
  /// are handled here as update() does.
  template <class Blend>
  void update_with(Blend&& blend) {
    update_with(updates_ + 1, std::forward<Blend>(blend));
  }

 private:
  template <class Blend>
  void update_with(std::size_t step, Blend&& blend) {
    require_not_applied("update");
    const double decay = decay_at(step);
    // timm passes weight=1-decay as a Python float; torch rounds it to the element type.
    const auto weight = static_cast<opmath_t<T>>(1.0 - decay);
    blend(shadow_values_.data(), weight);
    View<T, Space> live_buffers = params_->buffer_values();
    if (!live_buffers.empty()) {
      if (options_.average_buffers) {
        detail::ema::run_lerp<detail::ema::lerp_or_copy_into, T>(
            exec_, live_buffers.size(), shadow_buffers_.data(), live_buffers.data(),
            copy_mask_.data(), weight);
      } else {
        copy(live_buffers, shadow_buffers_);
      }
    }
    updates_ = step;
  }

 public:
  /// Makes the shadow the active weights: O(1). An Error when already applied.
  void apply_shadow() {
    require_not_applied("apply_shadow");
    swap_storage();
    applied_ = true;
  }

  /// Makes the live weights active again: O(1). An Error when the shadow is not applied.
  void restore() {
    if (!applied_) throw Error("EMA::restore", "the shadow is not applied; nothing to restore");
    swap_storage();
    applied_ = false;
  }

  /// Whether the shadow is the active weights now (between apply_shadow() and restore()).
  [[nodiscard]] bool shadow_applied() const noexcept { return applied_; }

  /// Applies the shadow until the guard leaves scope, even by an exception.
  class [[nodiscard]] AppliedGuard {
   public:
    /// Applies the shadow now; an Error when it already is.
    explicit AppliedGuard(EMA& ema) : ema_(&ema) { ema.apply_shadow(); }
    /// Takes over the restore; the source then restores nothing.
    AppliedGuard(AppliedGuard&& other) noexcept : ema_(std::exchange(other.ema_, nullptr)) {}
    AppliedGuard(const AppliedGuard&) = delete;
    AppliedGuard& operator=(const AppliedGuard&) = delete;
    AppliedGuard& operator=(AppliedGuard&&) = delete;
    ~AppliedGuard() {
      if (ema_ && ema_->applied_) {
        ema_->swap_storage();
        ema_->applied_ = false;
      }
    }

   private:
    EMA* ema_;
  };

  /// `auto guard = ema.applied();` - the shadow is active until guard's scope ends.
  [[nodiscard]] AppliedGuard applied() { return AppliedGuard(*this); }

  /// The active trained values, the arena's: the shadow while applied, the live ones otherwise.
  [[nodiscard]] View<T, Space> values() { return params_->values(); }
  /// The active buffers, likewise.
  [[nodiscard]] View<T, Space> buffer_values() { return params_->buffer_values(); }
  /// One parameter's or buffer's active value, shaped.
  [[nodiscard]] View<T, Space> value(const parameter& p) {
    View<T, Space> block = p.is_buffer() ? buffer_values() : values();
    return View<T, Space>(block.data() + p.offset(), p.shape());
  }

  /// The shadow itself, wherever it is (in the arena while applied), for checkpoints.
  [[nodiscard]] View<T, Space> shadow_values() {
    return applied_ ? params_->values() : shadow_values_.view();
  }
  /// The shadow's buffers, likewise.
  [[nodiscard]] View<T, Space> shadow_buffer_values() {
    return applied_ ? params_->buffer_values() : shadow_buffers_.view();
  }

  /// The update count: the step the last update() used.
  [[nodiscard]] std::size_t updates() const noexcept { return updates_; }
  /// Restores the update count a checkpoint recorded (with the shadow, written through
  /// shadow_values()), so the next update() uses the decay it would have without the restart.
  void set_updates(std::size_t updates) noexcept { updates_ = updates; }
  /// The settings it was made with.
  [[nodiscard]] const EMAOptions& options() const noexcept { return options_; }
  /// The executor its copy and blend passes run on.
  [[nodiscard]] const Exec& executor() const noexcept { return exec_; }

 private:
  void require_not_applied(const char* operation) const {
    if (applied_) {
      throw Error(std::string("EMA::") + operation,
                  "the shadow is applied; call restore() (or leave the applied() scope) first");
    }
  }

  // Sizes match by construction, so the swaps cannot throw.
  void swap_storage() {
    params_->swap_values(shadow_values_);
    params_->swap_buffer_values(shadow_buffers_);
  }

  void copy(View<T, Space> from, Buffer<T, Space>& to) {
    for_each_index(exec_, from.size(), detail::ema::copy_into<T>{to.data(), from.data()});
  }

  // Integral buffers are copied, the rest averaged; the mask lets one pass do both.
  void build_copy_mask() {
    if (!options_.average_buffers || params_->buffer_numel() == 0) return;
    copy_mask_ = Buffer<std::uint8_t, Space>(params_->buffer_numel());
    for_each_index(exec_, copy_mask_.size(), detail::ema::fill_mask{copy_mask_.data(), 0});
    for (const auto& buffer : params_->buffers()) {
      if (buffer.kind() != BufferKind::integral) continue;
      for_each_index(exec_, buffer.size(),
                     detail::ema::fill_mask{copy_mask_.data() + buffer.offset(), 1});
    }
  }

  Parameters<T, Space>* params_;
  EMAOptions options_;
  Exec exec_;
  Buffer<T, Space> shadow_values_;
  Buffer<T, Space> shadow_buffers_;
  Buffer<std::uint8_t, Space> copy_mask_;
  std::size_t updates_ = 0;
  bool applied_ = false;
};

}  // namespace tandem
