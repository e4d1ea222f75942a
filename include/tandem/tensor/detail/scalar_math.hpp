// tandem/tensor/detail/scalar_math.hpp - the scalar functions whose rounding tandem's functors
// need to be the same on the host and on the device: fused multiply-add, an unfused product and
// the square root, each for float and double (the functors' opmath types).
//   const float m = tandem::detail::fused_multiply_add(one_minus_beta1, g, exp_avg * beta1);
// Needs: the standard library (CUDA's math functions under nvcc). Not a public header.
#pragma once

#include <cmath>
#include <concepts>
#include <type_traits>

#include "tandem/core/config.hpp"

namespace tandem::detail {

/// float or double: the types these functions round in.
template <class T>
concept scalar_opmath = std::same_as<T, float> || std::same_as<T, double>;

/// a * b + c rounded once (fused multiply-add). PyTorch's CPU kernels compute
/// `add(x, alpha=a)` and `addcmul` with it, so matching them bitwise needs it too. The device has
/// it natively; on the host it is an instruction where the code is compiled for one (-mfma,
/// -march=native, or the optimizers' FMA clone in optim/param_groups.hpp's run_pass) and a call
/// to the C library otherwise. T comes from `a`; b and c convert to it.
template <scalar_opmath T>
TANDEM_HD inline T fused_multiply_add(T a, std::type_identity_t<T> b, std::type_identity_t<T> c) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) {
    return ::fmaf(a, b, c);
  } else {
    return ::fma(a, b, c);
  }
#else
  return std::fma(a, b, c);
#endif
}

/// a * b rounded on its own. nvcc fuses a product into a following addition by default
/// (--fmad=true); PyTorch stores the product first (`mul_`), so the device must not fuse it.
template <scalar_opmath T>
TANDEM_HD inline T multiply(T a, std::type_identity_t<T> b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) {
    return __fmul_rn(a, b);
  } else {
    return __dmul_rn(a, b);
  }
#else
  return a * b;
#endif
}

/// The square root, correctly rounded on the host and on the device alike.
template <scalar_opmath T>
TANDEM_HD inline T square_root(T x) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) {
    return ::sqrtf(x);
  } else {
    return ::sqrt(x);
  }
#else
  return std::sqrt(x);
#endif
}

}  // namespace tandem::detail
