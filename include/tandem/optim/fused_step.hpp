// tandem/optim/fused_step.hpp - tandem::amp::FusedStep: the non-model part of a mixed-precision
// AdamW step (GradScaler's inf check and unscale, AdamW, the EMA's lerp, O2's half copy) in two
// passes.
//   tandem::amp::FusedStep fused;  fused.step(scaler, adamw, ema, compute);  scaler.update();
// Needs: the standard library, tandem/optim, tandem/tensor, and a loss scaler that models
// FusedStepScaler: tandem::GradScaler (tandem/amp/grad_scaler.hpp) does. Device: a .cu translation
// unit with tandem/cuda.hpp.
//
// The same results, bit for bit, as the unfused sequence
//   scaler.step(adamw) (unscale_ + inf check, then adamw.step()); ema.update(); compute.refresh()
// when the step runs, in two passes instead of four or five: one reads the gradients for the inf
// check (GradScaler must know before anything is written), the other reads parameters, gradients,
// both moments and the EMA shadow and writes all of them but the gradients, plus the half copy:
// 42 bytes per float parameter instead of 62. Differences from the unfused sequence, both by
// design: the gradients are left scaled (nothing reads them after the step; unscale_ would write
// them), and a step that finds inf or NaN changes nothing at all - parameters, moments, the EMA
// shadow and its update count, the half copy - as `if (scaler.step(opt)) ema.update();` would.
// The optimizer's groups must cover every trained value (the EMA and the cast cover them all).
//
// On the host both passes run on `threads` threads (default: this rank's share of the cores,
// rank_cores()); on float parameters with AVX2, FMA and F16C the update pass is vectorised by hand.
// On a device executor each pass is one kernel on AdamW's stream.
#pragma once

#include <algorithm>
#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/core/config.hpp"
#include "tandem/core/error.hpp"
#include "tandem/optim/adamw.hpp"
#include "tandem/optim/ema.hpp"
#include "tandem/tensor/detail/finite_check.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/host_cpu.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/precision.hpp"

namespace tandem::amp {

/// How FusedStep runs on the host.
struct FusedStepOptions {
  /// Threads for each host pass; 0: rank_cores().
  int threads = 0;
  /// A host pass uses no more threads than it has blocks of this many elements (threads cost
  /// tens of microseconds to start).
  std::size_t min_elements_per_thread = std::size_t{1} << 16;
};

/// What FusedStep needs of a loss scaler S for optimizer O: GradScaler's fused_step protocol
/// (tandem/amp/grad_scaler.hpp says what `check` and `apply` must do) in O's memory space.
/// tandem::GradScaler<Space> models it for every optimizer of Space.
template <class S, class O>
concept FusedStepScaler = std::same_as<typename S::memory_space, typename O::memory_space> &&
    requires(S& scaler, O& opt, void (*check)(::tandem::detail::finite::inf_flag*),
             void (*apply)(float)) {
  { scaler.fused_step(opt, check, apply) } -> std::same_as<bool>;
};

namespace detail::fused {

/// One element of the fused update: unscale the gradient as GradScaler::unscale_ would store it,
/// AdamW's update of it (adamw_update::apply), the EMA's lerp towards the new value, and its
/// cast into the compute copy (`low`, null for none). Hardware: the lerp's fused multiply-add,
/// as detail::ema::lerp.
template <class T, bool Amsgrad, class Low, bool Hardware>
struct adamw_ema_cast {
  using math = opmath_t<T>;  ///< GradScaler's, AdamW's and the EMA's arithmetic alike

  optim::detail::adamw_update<T, Amsgrad> update;  ///< pointers at the group's first element
  T* shadow;                                       ///< likewise
  Low* low;                                        ///< likewise; null: no compute copy
  math inv_scale;
  bool unscale;  ///< inv_scale != 1 (GradScaler then leaves the gradients as they are)
  math weight;

  TANDEM_HD void operator()(std::size_t i) const {
    const T gradient = unscale ? T(static_cast<math>(update.grad[i]) * inv_scale) : update.grad[i];
    const T value = update.apply(i, static_cast<math>(gradient));
    shadow[i] = T(::tandem::detail::ema::lerp<Hardware>(static_cast<math>(shadow[i]),
                                                        static_cast<math>(value), weight));
    if (low != nullptr) cast_element<T, Low>{&value, low + i}(0);
  }
};

/// Elements [begin, end) one at a time.
template <class F>
void run_range(const F& f, std::size_t begin, std::size_t end) {
  for (std::size_t i = begin; i < end; ++i) f(i);
}

#if defined(TANDEM_HOST_X86_KERNELS)
/// The last elements of a range, outside the AVX2 clone (as adamw_scalar_tail, for the same
/// reason: no contraction of the weight-decay product).
template <class F>
[[gnu::noinline]] void run_tail(const F& f, std::size_t begin, std::size_t end) {
  for (std::size_t i = begin; i < end; ++i) f(i);
}

/// adamw_ema_cast<float> eight elements at a time: AdamW's own vector lane
/// (optim::detail::adamw_avx2_lane) on the unscaled gradients, the EMA's
/// (::tandem::detail::ema::lerp_avx2_lane), then float_to_half_f16c's conversion, so the same
/// bits as the unfused passes on this CPU.
template <bool Amsgrad, class Low>
[[gnu::target("avx2,fma,f16c")]] void adamw_ema_cast_avx2(
    const adamw_ema_cast<float, Amsgrad, Low, true>& f, std::size_t begin, std::size_t end) {
  const optim::detail::adamw_avx2_lane<Amsgrad> adamw(f.update);
  const ::tandem::detail::ema::lerp_avx2_lane lerp(f.weight);
  const __m256 inv_scale = _mm256_set1_ps(f.inv_scale);
  const bool unscale = f.unscale;
  std::size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 g = _mm256_loadu_ps(f.update.grad + i);
    if (unscale) g = _mm256_mul_ps(g, inv_scale);
    const __m256 value = adamw(i, g);
    _mm256_storeu_ps(f.shadow + i, lerp(_mm256_loadu_ps(f.shadow + i), value));
    if constexpr (std::is_same_v<Low, half>) {
      if (f.low != nullptr) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(f.low + i),
                         _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT));
      }
    }
  }
  run_tail(f, i, end);
}
#endif

/// The inf check on the host: OR of "not finite" over [begin, end).
template <class T>
::tandem::detail::finite::inf_flag check_range(const T* grads, std::size_t begin, std::size_t end) {
  ::tandem::detail::finite::inf_flag found = 0;
  const ::tandem::detail::finite::check_finite<T> check{grads};
  for (std::size_t i = begin; i < end; ++i) found |= check(i);
  return found;
}

}  // namespace detail::fused

/// The fused non-model step; see the top of this header. Holds only its settings: one object can
/// serve any number of optimizers.
class FusedStep {
 public:
  /// threads 0 (or less) in `options` becomes rank_cores(), read once, here.
  explicit FusedStep(FusedStepOptions options = {})
      : options_(options), threads_(options.threads > 0 ? options.threads : rank_cores()) {}

  /// Host threads per pass.
  [[nodiscard]] int threads() const noexcept { return threads_; }
  /// The settings it was made with (threads 0 there means rank_cores(), as threads() says).
  [[nodiscard]] const FusedStepOptions& options() const noexcept { return options_; }

  /// scaler.step(adamw), ema.update() and compute.refresh(values) as two passes (see the top of
  /// this header). Returns whether the step ran (false: inf or NaN found, nothing changed). Call
  /// scaler.update() afterwards, as with scaler.step().
  template <class Scaler, element_type T, memory_space Space, class E, class EmaExec,
            PrecisionPolicy P>
  requires FusedStepScaler<Scaler, optim::AdamW<T, Space, E>>
  bool step(Scaler& scaler, optim::AdamW<T, Space, E>& adamw, EMA<T, Space, EmaExec>& ema,
            ComputeWeights<P, Space>& compute) {
    static_assert(std::is_same_v<typename P::master_type, T>,
                  "tandem: FusedStep needs the compute weights' master type to be the arena's");
    if constexpr (P::keeps_master_copy) {
      if (compute.numel() != ema.values().size()) {
        throw Error("amp::FusedStep",
                    "the compute weights have " + std::to_string(compute.numel()) +
                        " elements, the arena " + std::to_string(ema.values().size()));
      }
      return run(scaler, adamw, ema, compute.values().data());
    } else {
      const bool stepped = run(scaler, adamw, ema, static_cast<T*>(nullptr));
      compute.refresh(adamw.executor(), adamw.values());  // only remembers where they are
      return stepped;
    }
  }

  /// The same without a compute copy (O0, or models kept in fp32).
  template <class Scaler, element_type T, memory_space Space, class E, class EmaExec>
  requires FusedStepScaler<Scaler, optim::AdamW<T, Space, E>>
  bool step(Scaler& scaler, optim::AdamW<T, Space, E>& adamw, EMA<T, Space, EmaExec>& ema) {
    return run(scaler, adamw, ema, static_cast<T*>(nullptr));
  }

 private:
  template <class Scaler, class T, class Space, class E, class EmaExec, class Low>
  bool run(Scaler& scaler, optim::AdamW<T, Space, E>& adamw, EMA<T, Space, EmaExec>& ema,
           Low* low) {
    if (ema.shadow_applied())
      throw Error("amp::FusedStep", "the EMA's shadow is applied; restore() it first");
    const std::size_t n = ema.values().size();  // the arena's trained values
    if (ema.values().data() != adamw.values().data()) {
      throw Error("amp::FusedStep",
                  "the EMA and the optimizer are of different arenas, or the optimizer's groups "
                  "leave out the first values");
    }
    require_cover(adamw.group_slices(), n);
    const E& exec = adamw.executor();
    const T* grads = adamw.grads().data();
    return scaler.fused_step(
        adamw, [&](::tandem::detail::finite::inf_flag* flag) { check(exec, grads, n, flag); },
        [&](float inv_scale) {
          ema.update_with([&](T* shadow, opmath_t<T> weight) {
            adamw.step_with([&](std::size_t offset, std::size_t size, const auto& update) {
              update_pass(exec, update, size, shadow + offset, low ? low + offset : nullptr,
                          inv_scale, weight);
            });
          });
        });
  }

  static void require_cover(std::vector<std::pair<std::size_t, std::size_t>> slices,
                            std::size_t n) {
    std::sort(slices.begin(), slices.end());
    std::size_t covered = 0;
    for (const auto& [offset, size] : slices) {
      if (offset != covered) break;
      covered += size;
    }
    if (covered != n) {
      throw Error("amp::FusedStep",
                  "the optimizer's param groups must cover every trained value (the EMA and the "
                  "cast cover them all); they leave out some of the " +
                      std::to_string(n) + " values");
    }
  }

  template <class E, class T>
  void check(const E& exec, const T* grads, std::size_t n,
             ::tandem::detail::finite::inf_flag* flag) const {
    using ::tandem::detail::finite::inf_flag;
    if constexpr (std::is_same_v<E, host_exec>) {
      std::vector<inf_flag> found(static_cast<std::size_t>(threads_), 0);
      std::atomic<std::size_t> next{0};
      ::tandem::detail::cpu::parallel_ranges(
          threads_, options_.min_elements_per_thread, n, [&](std::size_t begin, std::size_t end) {
            found[next.fetch_add(1)] = detail::fused::check_range(grads, begin, end);
          });
      inf_flag any = 0;
      for (inf_flag f : found) any |= f;
      *flag = any;
    } else {
      transform_reduce_into(exec, flag, n, inf_flag{0},
                            ::tandem::detail::finite::check_finite<T>{grads},
                            ::tandem::detail::finite::or_combine{});
    }
  }

  template <class E, class T, bool Amsgrad, class Low>
  void update_pass(const E& exec, const optim::detail::adamw_update<T, Amsgrad>& update,
                   std::size_t size, T* shadow, Low* low, float inv_scale,
                   opmath_t<T> weight) const {
    const bool unscale = inv_scale != 1.0f;
    const auto make = [&]<bool Hardware>() {
      return detail::fused::adamw_ema_cast<T, Amsgrad, Low, Hardware>{
          update, shadow, low, static_cast<opmath_t<T>>(inv_scale), unscale, weight};
    };
    if constexpr (std::is_same_v<E, host_exec>) {
#if defined(TANDEM_HOST_X86_KERNELS)
      if (cpu_has(cpu_feature::avx2_fma)) {
        const auto f = make.template operator()<true>();
        constexpr bool vector_float =
            std::is_same_v<T, float> && (std::is_same_v<Low, half> || std::is_same_v<Low, float>);
        const bool f16c = cpu_has(cpu_feature::f16c);
        ::tandem::detail::cpu::parallel_ranges(
            threads_, options_.min_elements_per_thread, size,
            [&](std::size_t begin, std::size_t end) {
              if constexpr (vector_float) {
                if (f16c) {
                  detail::fused::adamw_ema_cast_avx2(f, begin, end);
                  return;
                }
              }
              ::tandem::detail::cpu::for_range_fma(f, begin, end);
            });
        return;
      }
#endif
      const auto f = make.template operator()<false>();
      ::tandem::detail::cpu::parallel_ranges(
          threads_, options_.min_elements_per_thread, size,
          [&](std::size_t begin, std::size_t end) { detail::fused::run_range(f, begin, end); });
    } else {
      for_each_index(exec, size, make.template operator()<false>());
    }
  }

  FusedStepOptions options_;
  int threads_;
};

}  // namespace tandem::amp
