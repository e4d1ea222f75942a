// tandem/tensor/precision.hpp - mixed-precision policies (apex O0..O3: which element type each
// number of a step lives in), the cast pass between element types, and the low-precision compute
// copy of fp32 master weights it refreshes.
//   tandem::amp::ComputeWeights<tandem::amp::O2<>> w(params.numel()); w.refresh(on_host, master);
// Needs: the standard library, tandem/tensor (device memory: tandem/cuda.hpp in a .cu file).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "tandem/core/config.hpp"
#include "tandem/core/error.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/host_cpu.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::amp {

/// A precision policy, chosen at compile time. Its four element types say where each number of a
/// training step lives:
///   master_type  - the parameters the optimizer updates (the arena's values and gradients);
///   compute_type - the weights the forward and backward passes read;
///   grad_type    - the gradients the backward pass writes;
///   reduce_type  - the gradients as they are all-reduced across ranks.
/// loss_scaling says whether a dynamic loss scale (GradScaler) belongs with it.
template <element_type Master, element_type Compute, element_type Grad, element_type Reduce,
          bool LossScaling>
struct precision {
  static_assert(dtype_traits<Master>::is_floating && dtype_traits<Compute>::is_floating &&
                    dtype_traits<Grad>::is_floating && dtype_traits<Reduce>::is_floating,
                "tandem: a precision policy names floating-point types only");

  /// The parameters the optimizer updates: the arena's values and gradients.
  using master_type = Master;
  /// The weights the forward and backward passes read.
  using compute_type = Compute;
  /// The gradients the backward pass writes.
  using grad_type = Grad;
  /// The gradients as they are all-reduced across ranks.
  using reduce_type = Reduce;
  /// Whether a dynamic loss scale (GradScaler) belongs with the policy: O1 and O2 with half, whose
  /// range loses small gradients without one; not O3, a speed baseline as in apex.
  static constexpr bool loss_scaling = LossScaling;
  /// Whether the compute weights are a separate low-precision copy of the master weights (apex O2)
  /// rather than the master weights themselves.
  static constexpr bool keeps_master_copy = !std::same_as<Master, Compute>;
};

/// Opt-in for user-written policies: specialise to true, or derive from tandem::amp::precision.
template <class P>
inline constexpr bool enable_precision_policy = requires {
  typename P::master_type;
  typename P::compute_type;
  typename P::grad_type;
  typename P::reduce_type;
  { P::loss_scaling } -> std::convertible_to<bool>;
  { P::keeps_master_copy } -> std::convertible_to<bool>;
};

/// A precision policy: 1. names master_type, compute_type, grad_type and reduce_type;
/// 2. says loss_scaling and keeps_master_copy.
template <class P>
concept PrecisionPolicy = enable_precision_policy<P>;

namespace detail {
template <class Low>
concept low_precision = std::same_as<Low, half> || std::same_as<Low, bfloat16>;
}  // namespace detail

/// apex O0: everything in fp32; the baseline.
struct O0 : precision<float, float, float, float, false> {
  /// apex's name for the level ("O0".."O3"), e.g. for logs and benchmark labels.
  static constexpr const char* name = "O0";
};

/// apex O1 (torch.autocast practice): fp32 parameters and gradients, layers compute in Low where
/// that is safe; dynamic loss scaling for half (bfloat16 has fp32's range and needs none).
template <detail::low_precision Low = half>
struct O1 : precision<float, Low, float, float, std::same_as<Low, half>> {
  /// apex's name for the level ("O0".."O3"), e.g. for logs and benchmark labels.
  static constexpr const char* name = "O1";
};

/// apex O2: fp32 master weights in the arena, a Low compute copy refreshed by one cast pass after
/// each step, Low gradients cast back to fp32 for the optimizer; gradients all-reduced in Low as
/// apex's DDP does; dynamic loss scaling for half.
template <detail::low_precision Low = half>
struct O2 : precision<float, Low, Low, Low, std::same_as<Low, half>> {
  /// apex's name for the level ("O0".."O3"), e.g. for logs and benchmark labels.
  static constexpr const char* name = "O2";
};

/// apex O3: everything in Low, no master copy, no loss scaling (apex's loss_scale 1.0); a speed
/// baseline rather than a way to train.
template <detail::low_precision Low = half>
struct O3 : precision<Low, Low, Low, Low, false> {
  /// apex's name for the level ("O0".."O3"), e.g. for logs and benchmark labels.
  static constexpr const char* name = "O3";
};

namespace detail {

/// 0xffffffff when condition holds, else 0: a select that stays branch-free.
TANDEM_HD constexpr std::uint32_t all_ones_if(bool condition) noexcept {
  return 0u - static_cast<std::uint32_t>(condition);
}

/// fp32 -> fp16 bits, round to nearest even: the same bits as tandem::half(value), written with
/// selects instead of branches so that the host loop vectorises (the cast pass runs at memory
/// speed). Subnormal results come from one float addition of 0.5, whose rounding does the work
/// (F. Giesen's float_to_half_fast3_rtne); NaN keeps its top payload bits, as tandem::half.
TANDEM_HD constexpr std::uint16_t float_to_half_bits_select(float value) noexcept {
  const std::uint32_t x = tandem::detail::float_bits(value);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t magnitude = x & 0x7fffffffu;
  // Normal results: rebias the exponent (127 -> 15), round the 13 dropped bits to nearest even.
  const std::uint32_t normal = (magnitude - 0x38000000u + 0xfffu + ((magnitude >> 13) & 1u)) >> 13;
  // Below 2^-14: adding 0.5 (2^-1) aligns the half subnormal's 10 bits at the bottom.
  const std::uint32_t subnormal =
      tandem::detail::float_bits(tandem::detail::bits_float(magnitude) + 0.5f) - 0x3f000000u;
  const std::uint32_t nan = 0x7e00u | ((magnitude >> 13) & 0x3ffu);
  // Masks rather than ?: throughout: GCC keeps ?: around a float addition (which may trap, as
  // far as it knows) as branches, and the loop would stay scalar.
  const std::uint32_t is_nan = all_ones_if(magnitude > 0x7f800000u);
  const std::uint32_t is_subnormal = all_ones_if(magnitude < 0x38800000u);
  const std::uint32_t is_special = all_ones_if(magnitude >= 0x47800000u);  // inf, NaN, overflow
  const std::uint32_t special = (nan & is_nan) | (0x7c00u & ~is_nan);
  std::uint32_t result = (subnormal & is_subnormal) | (normal & ~is_subnormal);
  result = (special & is_special) | (result & ~is_special);
  return static_cast<std::uint16_t>(sign | result);
}

/// out[i] = To(in[i]) with round-to-nearest-even (tandem's half/bfloat16 conversions).
template <class From, class To>
struct cast_element {
  const From* in;
  To* out;
  TANDEM_HD void operator()(std::size_t i) const {
    if constexpr (std::same_as<From, To>) {
      out[i] = in[i];
    } else if constexpr (std::same_as<From, float> && std::same_as<To, half>) {
      out[i] = half::from_bits(float_to_half_bits_select(in[i]));
    } else if constexpr (std::same_as<From, half> || std::same_as<From, bfloat16>) {
      out[i] = To(static_cast<float>(in[i]));
    } else {
      out[i] = To(in[i]);
    }
  }
};

/// Four floats and four halves as one load and one store: on a GPU each thread of the cast
/// moves 16 bytes in and 8 out (one vector instruction each) instead of 4 and 2, which is what
/// lets a memory-bound kernel approach copy bandwidth.
struct alignas(16) float_x4 {
  float v[4];
};
struct alignas(8) half_x4 {
  half v[4];
};

/// out[i] = the four halves of in[i]: cast_element<float, half>'s bits, four at a time.
struct cast_float_half_x4 {
  const float_x4* in;
  half_x4* out;
  TANDEM_HD void operator()(std::size_t i) const {
    const float_x4 x = in[i];
    half_x4 y;
    for (int k = 0; k < 4; ++k) y.v[k] = half::from_bits(float_to_half_bits_select(x.v[k]));
    out[i] = y;
  }
};

/// The float -> half cast on a non-host executor: blocks of four where both buffers are aligned
/// for them, the rest (or everything, when they are not) one element at a time.
template <class E>
void cast_float_half_blocks(const E& exec, const float* in, half* out, std::size_t n) {
  const bool aligned = reinterpret_cast<std::uintptr_t>(in) % alignof(float_x4) == 0 &&
                       reinterpret_cast<std::uintptr_t>(out) % alignof(half_x4) == 0;
  std::size_t done = 0;
  if (aligned && n >= 4) {
    const std::size_t blocks = n / 4;
    for_each_index(
        exec, blocks,
        cast_float_half_x4{reinterpret_cast<const float_x4*>(in), reinterpret_cast<half_x4*>(out)});
    done = blocks * 4;
  }
  if (done < n) for_each_index(exec, n - done, cast_element<float, half>{in + done, out + done});
}

#if defined(TANDEM_HOST_X86_KERNELS)
/// Outputs at least this large (elements) are written with non-temporal stores: they do not fit
/// in cache anyway, and a plain store would first read every destination line (a third more
/// memory traffic for this pass).
inline constexpr std::size_t f16c_streaming_threshold = std::size_t{1} << 23;  // 16 MiB of half

/// fp32 -> half with the F16C instruction, eight elements at a time, for CPUs that have it
/// (dispatched at run time; the build needs no -mf16c). VCVTPS2PH with an explicit
/// round-to-nearest-even (independent of MXCSR) gives float_to_half_bits_select's bits for every
/// one of the 2^32 inputs, NaN payloads and subnormals included (checked exhaustively once; the
/// test checks a sample).
[[gnu::target("avx,f16c")]] inline void float_to_half_f16c(const float* in, half* out,
                                                           std::size_t n) noexcept {
  std::size_t i = 0;
  if (n >= f16c_streaming_threshold) {
    // Scalar head up to a 32-byte aligned destination, which streaming stores need.
    for (; i < n && reinterpret_cast<std::uintptr_t>(out + i) % 32 != 0; ++i) {
      out[i] = half::from_bits(float_to_half_bits_select(in[i]));
    }
    for (; i + 16 <= n; i += 16) {
      // A page ahead: the hardware prefetcher stops at page boundaries, and this pass is bound
      // by its reads on one core.
      _mm_prefetch(reinterpret_cast<const char*>(in + i) + 4096, _MM_HINT_T0);
      const __m128i low = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
      const __m128i high = _mm256_cvtps_ph(_mm256_loadu_ps(in + i + 8), _MM_FROUND_TO_NEAREST_INT);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i),
                          _mm256_insertf128_si256(_mm256_castsi128_si256(low), high, 1));
    }
    _mm_sfence();  // the streamed stores are ordered before whatever the caller does next
  }
  for (; i + 8 <= n; i += 8) {
    const __m128i bits = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), bits);
  }
  for (; i < n; ++i) out[i] = half::from_bits(float_to_half_bits_select(in[i]));
}
#endif

}  // namespace detail

/// Writes To(in[i]) into out[i] for every element, in ONE pass on exec (does not wait on
/// devices). Sizes must match.
template <Executor E, element_type From, element_type To, memory_space Space>
requires ExecutorFor<E, Space>
void cast(const E& exec, View<const From, Space> in, View<To, Space> out) {
  if (in.size() != out.size()) {
    throw Error("amp::cast", "input has " + std::to_string(in.size()) + " elements, output " +
                                 std::to_string(out.size()));
  }
#if defined(TANDEM_HOST_X86_KERNELS)
  if constexpr (std::same_as<E, host_exec> && std::same_as<From, float> && std::same_as<To, half>) {
    if (cpu_has(cpu_feature::f16c)) {
      detail::float_to_half_f16c(in.data(), out.data(), in.size());
      return;
    }
  }
#endif
  if constexpr (!std::same_as<E, host_exec> && std::same_as<From, float> &&
                std::same_as<To, half>) {
    detail::cast_float_half_blocks(exec, in.data(), out.data(), in.size());
    return;
  }
  for_each_index(exec, in.size(), detail::cast_element<From, To>{in.data(), out.data()});
}

template <Executor E, element_type From, element_type To, memory_space Space>
requires ExecutorFor<E, Space>
void cast(const E& exec, View<From, Space> in, View<To, Space> out) {
  cast(exec, View<const From, Space>(in), out);
}

/// The weights and gradients the model computes with under policy P, beside the master arena.
/// When P keeps a master copy (O2) it owns compute_type copies of the values and gradients;
/// otherwise (O0, O1, O3) it owns nothing and simply views the master arena, and both passes are
/// free. One object per arena; the numbers of elements must agree.
template <PrecisionPolicy P, memory_space Space = host>
class ComputeWeights {
  static_assert(P::keeps_master_copy ||
                    std::same_as<typename P::grad_type, typename P::master_type>,
                "tandem: without a master copy the gradients are the master gradients");

 public:
  /// The precision policy it serves.
  using policy = P;
  /// The arena's element type (P::master_type).
  using master_type = typename P::master_type;
  /// The element type of values() (P::compute_type).
  using compute_type = typename P::compute_type;
  /// The element type of grads() (P::grad_type).
  using grad_type = typename P::grad_type;
  /// Where the compute copy lives: the master arena's memory space.
  using memory_space = Space;

  /// For an arena of `numel` elements; allocates the two compute_type copies only when P keeps a
  /// master copy (uninitialised until refresh()).
  explicit ComputeWeights(std::size_t numel) : numel_(numel) {
    if constexpr (P::keeps_master_copy) {
      values_ = Buffer<compute_type, Space>(numel);
      grads_ = Buffer<grad_type, Space>(numel);
    }
  }

  /// Refreshes the compute copy from the master values: ONE cast pass after each optimizer step
  /// (apex O2's master -> model copy). Without a master copy the compute weights ARE the master
  /// weights, and this only remembers where they are.
  template <Executor E>
  requires ExecutorFor<E, Space>
  void refresh(const E& exec, View<master_type, Space> master) {
    check_size("amp::ComputeWeights::refresh", master.size());
    if constexpr (P::keeps_master_copy) {
      cast(exec, View<const master_type, Space>(master), values_.view());
    } else {
      master_values_ = master;
    }
  }

  /// Casts the compute gradients into the master gradients the optimizer (and GradScaler) reads:
  /// one pass; nothing to do without a master copy.
  template <Executor E>
  requires ExecutorFor<E, Space>
  void grads_to_master(const E& exec, View<master_type, Space> master_grads) {
    check_size("amp::ComputeWeights::grads_to_master", master_grads.size());
    if constexpr (P::keeps_master_copy) {
      cast(exec, View<const grad_type, Space>(grads_.view()), master_grads);
    } else {
      master_grads_ = master_grads;
    }
  }

  /// The weights to compute with. Without a master copy, the master values last given to
  /// refresh() (empty before that).
  [[nodiscard]] View<compute_type, Space> values() noexcept {
    if constexpr (P::keeps_master_copy)
      return values_.view();
    else
      return master_values_;
  }

  /// Where the backward pass writes gradients. Without a master copy, the master gradients last
  /// given to grads_to_master() (empty before that).
  [[nodiscard]] View<grad_type, Space> grads() noexcept {
    if constexpr (P::keeps_master_copy)
      return grads_.view();
    else
      return master_grads_;
  }

  /// The arena's number of elements, as given to the constructor (even when nothing is owned).
  [[nodiscard]] std::size_t numel() const noexcept { return numel_; }

 private:
  void check_size(const char* operation, std::size_t size) const {
    if (size != numel_) {
      throw Error(operation, "the master view has " + std::to_string(size) +
                                 " elements, the compute weights " + std::to_string(numel_));
    }
  }

  std::size_t numel_;
  Buffer<compute_type, Space> values_;
  Buffer<grad_type, Space> grads_;
  View<compute_type, Space> master_values_;
  View<grad_type, Space> master_grads_;
};

}  // namespace tandem::amp
