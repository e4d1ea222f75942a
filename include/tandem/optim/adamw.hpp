// tandem/optim/adamw.hpp - tandem::optim::AdamW: PyTorch's AdamW (decoupled weight decay,
// optional amsgrad) over a Parameters arena, one fused pass per param group.
//   tandem::optim::AdamW adamw(params, {.lr = 3e-4, .weight_decay = 0.1});  adamw.step();
// Needs: the standard library, tandem/arena/parameters.hpp; device parameters need tandem/cuda.hpp.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/arena/parameters.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/error.hpp"
#include "tandem/optim/param_groups.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/host_cpu.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::optim {

/// AdamW's hyperparameters, PyTorch's names and defaults.
struct AdamWOptions {
  /// The learning rate (step size); >= 0.
  double lr = 1e-3;
  /// The decay rates of the running averages of the gradient and of its square; each in [0, 1).
  std::array<double, 2> betas{0.9, 0.999};
  /// Added to the denominator's square root for numerical stability; >= 0.
  double eps = 1e-8;
  /// Decoupled weight decay: each step first scales the parameters by 1 - lr * weight_decay.
  double weight_decay = 1e-2;
  /// Divide by the largest second moment seen so far (one more state tensor per parameter).
  bool amsgrad = false;
  /// Ascend the gradient instead of descending it.
  bool maximize = false;

  /// PyTorch's ValueError cases, as a tandem::Error: lr, eps or weight_decay negative (or NaN),
  /// a beta outside [0, 1); stricter than PyTorch, an infinite lr, eps or weight_decay (the first
  /// step would make every parameter inf or NaN).
  void validate(const char* optimizer = "optim::AdamW") const {
    if (!(0 <= lr) || std::isinf(lr))
      throw Error(optimizer, "invalid learning rate: " + std::to_string(lr));
    if (!(0 <= eps) || std::isinf(eps))
      throw Error(optimizer, "invalid epsilon value: " + std::to_string(eps));
    for (std::size_t i = 0; i < 2; ++i) {
      if (!(0 <= betas[i] && betas[i] < 1)) {
        throw Error(optimizer, "invalid beta parameter at index " + std::to_string(i) + ": " +
                                   std::to_string(betas[i]));
      }
    }
    if (!(0 <= weight_decay) || std::isinf(weight_decay)) {
      throw Error(optimizer, "invalid weight_decay value: " + std::to_string(weight_decay));
    }
  }
};

namespace detail {

/// One AdamW step over a group's slice, PyTorch's single-tensor update in M (float for float,
/// half and bfloat16 parameters; double for double) with its rounding. The bias corrections and
/// step size are computed once per step in double on the host, as PyTorch does in Python:
///   p *= 1 - lr * wd;  m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g;
///   vmax = max(vmax, v) (amsgrad);  p += (-step_size * m) / (sqrt(v or vmax) / sqrt(bc2) + eps)
template <class T, bool Amsgrad>
struct adamw_update {
  using M = opmath_t<T>;
  T* param;
  const T* grad;
  M* exp_avg;
  M* exp_avg_sq;
  M* max_exp_avg_sq;  // unused without amsgrad
  M decay;            // 1 - lr * weight_decay
  M beta1;
  M one_minus_beta1;
  M beta2;
  M one_minus_beta2;
  M bias_correction2_sqrt;
  M eps;
  M neg_step_size;  // -lr / (1 - beta1^step)
  bool maximize;

  TANDEM_HD void operator()(std::size_t i) const { (void)apply(i, static_cast<M>(grad[i])); }

  /// The update of element i given its gradient (read from grad[i] by operator(); a fused step
  /// passes the unscaled gradient instead). Writes param[i] and the moments; returns the new
  /// parameter as stored.
  TANDEM_HD T apply(std::size_t i, M gradient) const {
    const M g = maximize ? -gradient : gradient;
    const M p = multiply(static_cast<M>(param[i]), decay);  // mul_, rounded before the add
    const M m = fused_multiply_add(one_minus_beta1, g, exp_avg[i] * beta1);         // add_(alpha=)
    const M v = fused_multiply_add(one_minus_beta2 * g, g, exp_avg_sq[i] * beta2);  // addcmul_
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    M second = v;
    if constexpr (Amsgrad) {
      const M previous = max_exp_avg_sq[i];
      second = (v > previous || v != v) ? v : previous;  // torch.maximum: NaN wins
      max_exp_avg_sq[i] = second;
    }
    const M denom = square_root(second) / bias_correction2_sqrt + eps;
    const T updated = static_cast<T>(p + (neg_step_size * m) / denom);  // addcdiv_(value=)
    param[i] = updated;
    return updated;
  }
};

#if defined(TANDEM_HOST_X86_KERNELS)
/// The last n % 8 elements, scalar and outside the AVX2+FMA clone (noinline): inside it GCC's
/// -ffp-contract=fast could fuse the weight-decay product into the final addition.
template <bool Amsgrad>
[[gnu::noinline]] void adamw_scalar_tail(const adamw_update<float, Amsgrad>& f, std::size_t i,
                                         std::size_t n) {
  for (; i < n; ++i) f(i);
}

/// adamw_update<float>'s arithmetic on eight elements with AVX2 and FMA: the one vector lane of
/// AdamW, used by adamw_avx2_fma and by the fused step (optim/fused_step.hpp), which feeds it
/// unscaled gradients. The scalar loop does not vectorise without -fno-math-errno (its square
/// root may set errno), which no function attribute turns off in GCC 12. The same IEEE
/// operations in the same order as adamw_update::apply, each correctly rounded, so the same bits.
/// Made once per pass (the scalars are broadcast here); inlined into its AVX2 callers.
template <bool Amsgrad>
class adamw_avx2_lane {
 public:
  [[gnu::target("avx2,fma"),
    gnu::always_inline]] explicit adamw_avx2_lane(const adamw_update<float, Amsgrad>& f)
      : f_(f),
        sign_(_mm256_set1_ps(f.maximize ? -0.0f : 0.0f)),
        decay_(_mm256_set1_ps(f.decay)),
        beta1_(_mm256_set1_ps(f.beta1)),
        one_minus_beta1_(_mm256_set1_ps(f.one_minus_beta1)),
        beta2_(_mm256_set1_ps(f.beta2)),
        one_minus_beta2_(_mm256_set1_ps(f.one_minus_beta2)),
        bias_correction2_sqrt_(_mm256_set1_ps(f.bias_correction2_sqrt)),
        eps_(_mm256_set1_ps(f.eps)),
        neg_step_size_(_mm256_set1_ps(f.neg_step_size)) {}

  /// Elements [i, i + 8) given their gradients: writes the parameters and the moments, returns
  /// the new parameters as stored.
  [[gnu::target("avx2,fma"), gnu::always_inline]] __m256 operator()(std::size_t i,
                                                                    __m256 gradient) const {
    const __m256 g = _mm256_xor_ps(gradient, sign_);  // -g flips the sign
    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(f_.param + i), decay_);
    // Opaque to the optimiser: GCC (-ffp-contract=fast, its default in gnu++ modes) would fuse
    // this product into the final addition, which PyTorch rounds separately.
    __asm__("" : "+x"(p));
    const __m256 m = _mm256_fmadd_ps(one_minus_beta1_, g,
                                     _mm256_mul_ps(_mm256_loadu_ps(f_.exp_avg + i), beta1_));
    const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(one_minus_beta2_, g), g,
                                     _mm256_mul_ps(_mm256_loadu_ps(f_.exp_avg_sq + i), beta2_));
    _mm256_storeu_ps(f_.exp_avg + i, m);
    _mm256_storeu_ps(f_.exp_avg_sq + i, v);
    __m256 second = v;
    if constexpr (Amsgrad) {
      const __m256 previous = _mm256_loadu_ps(f_.max_exp_avg_sq + i);
      const __m256 take_v =
          _mm256_or_ps(_mm256_cmp_ps(v, previous, _CMP_GT_OQ), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      second = _mm256_blendv_ps(previous, v, take_v);
      _mm256_storeu_ps(f_.max_exp_avg_sq + i, second);
    }
    const __m256 denom =
        _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(second), bias_correction2_sqrt_), eps_);
    const __m256 value = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step_size_, m), denom));
    _mm256_storeu_ps(f_.param + i, value);
    return value;
  }

 private:
  const adamw_update<float, Amsgrad>& f_;
  __m256 sign_;
  __m256 decay_;
  __m256 beta1_;
  __m256 one_minus_beta1_;
  __m256 beta2_;
  __m256 one_minus_beta2_;
  __m256 bias_correction2_sqrt_;
  __m256 eps_;
  __m256 neg_step_size_;
};

/// adamw_update<float> over n elements, eight at a time through adamw_avx2_lane (run-time
/// dispatched; the build needs no flags).
template <bool Amsgrad>
[[gnu::target("avx2,fma")]] void adamw_avx2_fma(const adamw_update<float, Amsgrad>& f,
                                                std::size_t n) {
  const adamw_avx2_lane<Amsgrad> lane(f);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) lane(i, _mm256_loadu_ps(f.grad + i));
  adamw_scalar_tail(f, i, n);
}
#endif

}  // namespace detail

/// Adam with decoupled weight decay, PyTorch's semantics and numbers (torch.optim.AdamW, its
/// single-tensor form). exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad) are flat buffers
/// per group in the state type (float for half/bfloat16 parameters), zero at the first step.
template <element_type T, memory_space Space = host, class E = default_executor_t<Space>>
requires ExecutorFor<E, Space>
class AdamW : public detail::GroupedOptimizer<AdamWOptions, T, Space, E> {
  using Base = detail::GroupedOptimizer<AdamWOptions, T, Space, E>;
  using typename Base::Group;

 public:
  using typename Base::state_dict_type;
  using typename Base::state_type;

  /// Every trained parameter in one group.
  AdamW(Parameters<T, Space>& params, AdamWOptions options = {}, E exec = E{})
      : AdamW(params, {ParamGroup<AdamWOptions>{all_params(), options}}, std::move(exec)) {}

  /// One group per entry; groups may not overlap. Parameters in no group are not updated.
  AdamW(Parameters<T, Space>& params, std::initializer_list<ParamGroup<AdamWOptions>> groups,
        E exec = E{})
      : AdamW(params, std::span<const ParamGroup<AdamWOptions>>(groups.begin(), groups.size()),
              std::move(exec)) {}

  /// The same with groups made at run time (a std::vector converts).
  AdamW(Parameters<T, Space>& params, std::span<const ParamGroup<AdamWOptions>> groups,
        E exec = E{})
      : Base("optim::AdamW", params, groups, std::move(exec)), moments_(this->groups_.size()) {}

  /// One update of every group: one fused pass each (asynchronous on a device executor).
  void step() {
    step_with(
        [this](std::size_t, std::size_t size, const auto& update) { run_update(update, size); });
  }

  /// For fused steps (tandem/optim/fused_step.hpp): step() with its validation, step counts and
  /// bias corrections, but each group's pass is handed to `run(offset, size, update)` instead of
  /// being run here: `update` is the detail::adamw_update that step() would run over the arena's
  /// elements [offset, offset + size) (its pointers already point at element `offset`), and run
  /// must call update.apply(i, gradient) once for each i in [0, size).
  template <class Run>
  void step_with(Run&& run) {
    for (std::size_t g = 0; g < this->groups_.size(); ++g) {
      Group& group = this->groups_[g];
      const AdamWOptions& o = group.options;
      o.validate(this->name_);
      Moments& moments = moments_[g];
      ensure(moments.exp_avg, group.state_size);
      ensure(moments.exp_avg_sq, group.state_size);
      if (o.amsgrad) ensure(moments.max_exp_avg_sq, group.state_size);
      moments.amsgrad_used = moments.amsgrad_used || o.amsgrad;
      ++group.step;
      // PyTorch: step = step_t.item(); bias_correction = 1 - beta ** step, all in double.
      const double step = static_cast<double>(group.step);
      const double bias_correction1 = 1 - std::pow(o.betas[0], step);
      const double bias_correction2 = 1 - std::pow(o.betas[1], step);
      const double step_size = o.lr / bias_correction1;
      for (const auto& piece : group.pieces) {  // the whole group, or its owned parts (ZeRO)
        if (o.amsgrad) {
          run(piece.offset, piece.size,
              make_update<true>(group, piece, moments, step_size, bias_correction2));
        } else {
          run(piece.offset, piece.size,
              make_update<false>(group, piece, moments, step_size, bias_correction2));
        }
      }
    }
  }

  /// Each group's [offset, offset + size) within the arena's values, in group order (a fused
  /// step checks that they cover every trained value).
  [[nodiscard]] std::vector<std::pair<std::size_t, std::size_t>> group_slices() const {
    if (this->sharded()) {
      throw Error(std::string(this->name_) + "::group_slices",
                  "the optimizer is sharded (ZeRO): a fused step over the whole arena is not "
                  "offered for a sharded AdamW; step it through DistributedDataParallel::step");
    }
    std::vector<std::pair<std::size_t, std::size_t>> slices;
    for (const Group& group : this->groups_) slices.emplace_back(group.offset, group.size);
    return slices;
  }

  /// Bytes of optimizer state held (the moments): under sharding, this rank's part.
  [[nodiscard]] std::size_t state_bytes() const noexcept {
    std::size_t elements = 0;
    for (const auto& m : moments_) {
      elements += m.exp_avg.size() + m.exp_avg_sq.size() + m.max_exp_avg_sq.size();
    }
    return elements * sizeof(state_type);
  }

  /// PyTorch's layout: state[i] has "step", "exp_avg", "exp_avg_sq" (and "max_exp_avg_sq" with
  /// amsgrad) once its group has stepped; param_groups carry "lr", "beta1", "beta2", "eps",
  /// "weight_decay", "amsgrad", "maximize". Waits for the copies.
  /// Sharded (DistributedDataParallel::shard): a collective that gathers the full state.
  [[nodiscard]] state_dict_type state_dict() const {
    const auto options_of = [](const AdamWOptions& o) -> std::map<std::string, double> {
      return {{"lr", o.lr},
              {"beta1", o.betas[0]},
              {"beta2", o.betas[1]},
              {"eps", o.eps},
              {"weight_decay", o.weight_decay},
              {"amsgrad", o.amsgrad ? 1.0 : 0.0},
              {"maximize", o.maximize ? 1.0 : 0.0}};
    };
    return this->collect_state_dict(
        options_of, [this](const Group& group, std::size_t g, state_dict_type& dict) {
          const Moments& moments = moments_[g];
          Buffer<state_type, Space> avg_scratch;
          Buffer<state_type, Space> sq_scratch;
          Buffer<state_type, Space> max_scratch;
          const M* exp_avg = this->full_state(group, moments.exp_avg, avg_scratch);
          const M* exp_avg_sq = this->full_state(group, moments.exp_avg_sq, sq_scratch);
          const M* max_exp_avg_sq =
              moments.amsgrad_used ? this->full_state(group, moments.max_exp_avg_sq, max_scratch)
                                   : nullptr;
          for (std::size_t p = group.params.first; p < group.params.last; ++p) {
            auto& entry = dict.state[Base::state_index(group, p)];
            entry.scalars.emplace("step", static_cast<double>(group.step));
            entry.tensors.emplace("exp_avg", this->export_state(group, p, exp_avg));
            entry.tensors.emplace("exp_avg_sq", this->export_state(group, p, exp_avg_sq));
            if (moments.amsgrad_used) {
              entry.tensors.emplace("max_exp_avg_sq", this->export_state(group, p, max_exp_avg_sq));
            }
          }
        });
  }

  /// Restores hyperparameters, step counts and moments; an Error (and nothing changed) when the
  /// dict does not fit these groups, an option is missing or invalid, some of a group's
  /// parameters have state and others not, their steps differ, or a moment is missing.
  void load_state_dict(const state_dict_type& dict) {
    const std::string operation = std::string(this->name_) + "::load_state_dict";
    const char* op = operation.c_str();
    this->check_layout(dict);
    std::vector<AdamWOptions> options(this->groups_.size());
    std::vector<bool> has_state(this->groups_.size());
    for (std::size_t g = 0; g < this->groups_.size(); ++g) {
      const auto& in = dict.param_groups[g].options;
      options[g] = {detail::option(in, "lr", op),
                    {detail::option(in, "beta1", op), detail::option(in, "beta2", op)},
                    detail::option(in, "eps", op),
                    detail::option(in, "weight_decay", op),
                    detail::option(in, "amsgrad", op) != 0,
                    detail::option(in, "maximize", op) != 0};
      options[g].validate(op);
      const Group& group = this->groups_[g];
      has_state[g] = this->group_has_state(dict, g, "state", [](const auto&) { return true; });
      for (std::size_t p = group.params.first; p < group.params.last && has_state[g]; ++p) {
        const std::size_t index = Base::state_index(group, p);
        const auto& entry = dict.state.at(index);
        auto step = entry.scalars.find("step");
        if (step == entry.scalars.end() ||
            step->second != static_cast<double>(dict.param_groups[g].step)) {
          throw Error(operation, "parameter " + std::to_string(index) +
                                     "'s step is missing or differs from its group's step " +
                                     std::to_string(dict.param_groups[g].step));
        }
        this->require_state(group, p, entry, "exp_avg");
        this->require_state(group, p, entry, "exp_avg_sq");
        if (options[g].amsgrad) this->require_state(group, p, entry, "max_exp_avg_sq");
      }
    }
    for (std::size_t g = 0; g < this->groups_.size(); ++g) {
      Group& group = this->groups_[g];
      group.options = options[g];
      group.step = dict.param_groups[g].step;
      Moments& moments = moments_[g];
      ensure(moments.exp_avg, group.state_size);
      ensure(moments.exp_avg_sq, group.state_size);
      if (options[g].amsgrad) ensure(moments.max_exp_avg_sq, group.state_size);
      moments.amsgrad_used = moments.amsgrad_used || options[g].amsgrad;
      Buffer<state_type, Space> avg_scratch;
      Buffer<state_type, Space> sq_scratch;
      Buffer<state_type, Space> max_scratch;
      M* exp_avg = this->import_target(group, moments.exp_avg, avg_scratch);
      M* exp_avg_sq = this->import_target(group, moments.exp_avg_sq, sq_scratch);
      M* max_exp_avg_sq = options[g].amsgrad
                              ? this->import_target(group, moments.max_exp_avg_sq, max_scratch)
                              : nullptr;
      for (std::size_t p = group.params.first; p < group.params.last; ++p) {
        if (!has_state[g]) break;
        const auto& entry = dict.state.at(Base::state_index(group, p));
        this->import_state(group, p, entry.tensors.at("exp_avg"), "exp_avg", exp_avg);
        this->import_state(group, p, entry.tensors.at("exp_avg_sq"), "exp_avg_sq", exp_avg_sq);
        if (options[g].amsgrad) {
          this->import_state(group, p, entry.tensors.at("max_exp_avg_sq"), "max_exp_avg_sq",
                             max_exp_avg_sq);
        }
      }
      if (has_state[g]) {
        this->keep_owned(group, avg_scratch, moments.exp_avg);
        this->keep_owned(group, sq_scratch, moments.exp_avg_sq);
        if (options[g].amsgrad) this->keep_owned(group, max_scratch, moments.max_exp_avg_sq);
      }
      if (!has_state[g]) {  // a fresh start: zero moments, as PyTorch's lazily made state
        zero(moments.exp_avg);
        zero(moments.exp_avg_sq);
        if (options[g].amsgrad) zero(moments.max_exp_avg_sq);
      }
    }
    this->exec_.synchronize();  // the dict may go away as soon as this returns
  }

 private:
  struct Moments {
    Buffer<state_type, Space> exp_avg;
    Buffer<state_type, Space> exp_avg_sq;
    Buffer<state_type, Space> max_exp_avg_sq;  // allocated when amsgrad is first used
    bool amsgrad_used = false;                 // (a sharded group may own no elements)
  };

  /// Allocates a zeroed state buffer of `size` elements the first time it is needed.
  using M = state_type;

  template <bool Amsgrad>
  detail::adamw_update<T, Amsgrad> make_update(const Group& group,
                                               const typename Base::Piece& piece, Moments& moments,
                                               double step_size, double bias_correction2) {
    const AdamWOptions& o = group.options;
    auto state = [&piece](Buffer<state_type, Space>& buffer) {
      return buffer.data() != nullptr ? buffer.data() + piece.state_offset : nullptr;
    };
    return detail::adamw_update<T, Amsgrad>{this->values_.data() + piece.offset,
                                            this->grads_.data() + piece.offset,
                                            state(moments.exp_avg),
                                            state(moments.exp_avg_sq),
                                            state(moments.max_exp_avg_sq),
                                            static_cast<M>(1 - o.lr * o.weight_decay),
                                            static_cast<M>(o.betas[0]),
                                            static_cast<M>(1 - o.betas[0]),
                                            static_cast<M>(o.betas[1]),
                                            static_cast<M>(1 - o.betas[1]),
                                            static_cast<M>(std::sqrt(bias_correction2)),
                                            static_cast<M>(o.eps),
                                            static_cast<M>(-step_size),
                                            o.maximize};
  }

  template <bool Amsgrad>
  void run_update(const detail::adamw_update<T, Amsgrad>& update, std::size_t size) {
#if defined(TANDEM_HOST_X86_KERNELS)
    if constexpr (std::is_same_v<E, host_exec> && std::is_same_v<T, float>) {
      if (cpu_has(cpu_feature::avx2_fma)) {
        detail::adamw_avx2_fma(update, size);
        return;
      }
    }
#endif
    detail::run_pass(this->exec_, size, update);
  }

  void ensure(Buffer<state_type, Space>& buffer, std::size_t size) {
    if (buffer.size() == size) return;
    buffer = Buffer<state_type, Space>(size);
    zero(buffer);
  }

  void zero(Buffer<state_type, Space>& buffer) {
    if (buffer.size() == 0) return;
    for_each_index(this->exec_, buffer.size(), detail::fill_zeros<state_type>{buffer.data()});
  }

  std::vector<Moments> moments_;
};

}  // namespace tandem::optim
