// tandem/tensor/detail/finite_check.hpp - the inf/NaN check over a gradient block: GradScaler's
// (amp/grad_scaler.hpp) and the fused step's (optim/fused_step.hpp), the same functor for both.
//   transform_reduce_into(exec, flag, n, inf_flag{0}, check_finite<float>{grads}, or_combine{});
// Needs: tandem/tensor/dtype.hpp. Not a public header.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tandem/core/config.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem::detail::finite {

/// Whether x is finite, by its exponent bits: the same on host and device, and immune to
/// -ffinite-math-only.
TANDEM_HD constexpr bool is_finite(float x) noexcept {
  return (detail::float_bits(x) & 0x7f800000u) != 0x7f800000u;
}
TANDEM_HD constexpr bool is_finite(double x) noexcept {
  return (__builtin_bit_cast(std::uint64_t, x) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

/// The inf flag: an int so that the host loop's OR-reduction vectorises (a float max would not
/// without -ffast-math); all-reduced with max, which is OR for 0 and 1.
using inf_flag = std::int32_t;

/// The reduction of inf flags.
struct or_combine {
  TANDEM_HD constexpr inf_flag operator()(inf_flag a, inf_flag b) const noexcept { return a | b; }
};

/// 1 where grads[i] is inf or NaN, else 0; changes nothing (PyTorch leaves the gradients
/// untouched when the inverse scale is 1: only the check).
template <class T>
struct check_finite {
  const T* grads;
  TANDEM_HD inf_flag operator()(std::size_t i) const {
    return is_finite(static_cast<opmath_t<T>>(grads[i])) ? 0 : 1;
  }
};

}  // namespace tandem::detail::finite
