// tandem/tensor/dtype.hpp - the element types tandem moves and reduces (float, double, half,
// bfloat16, int32, int64, uint8), their traits, and host-side half / bfloat16 that need no CUDA.
//   tandem::half h(0.1f);  float back = h;            // round to nearest even, then exact
//   static_assert(tandem::dtype_traits<tandem::bfloat16>::size == 2);
// Needs: the standard library; under nvcc (and on tandem's simulated CUDA runtime, whose tests
// compile with the CUDA headers: TANDEM_CUDA_SIM) also converts to and from __half / __nv_bfloat16.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "tandem/core/config.hpp"

#if defined(__CUDACC__) || defined(TANDEM_CUDA_SIM)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace tandem {

namespace detail {

TANDEM_HD constexpr std::uint32_t float_bits(float value) noexcept {
  return __builtin_bit_cast(std::uint32_t, value);
}
TANDEM_HD constexpr float bits_float(std::uint32_t bits) noexcept {
  return __builtin_bit_cast(float, bits);
}

/// IEEE binary32 -> binary16, round to nearest, ties to even; NaN stays NaN (quieted).
TANDEM_HD constexpr std::uint16_t float_to_half_bits(float value) noexcept {
  const std::uint32_t x = float_bits(value);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t magnitude = x & 0x7fffffffu;
  if (magnitude > 0x7f800000u) {  // NaN: keep the top payload bits, force the quiet bit
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
  }
  if (magnitude >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520
  if (magnitude < 0x38800000u) {
    // Below 2^-14: a half subnormal or zero. Below 2^-25, half the smallest subnormal, it is
    // zero; 2^-25 itself is a tie that the rounding below sends to the even zero.
    if (magnitude < 0x33000000u) return sign;
    const std::uint32_t exponent = magnitude >> 23;
    const std::uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exponent;  // 14 .. 24
    std::uint32_t result = mantissa >> shift;
    const std::uint32_t rest = mantissa & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    if (rest > halfway || (rest == halfway && (result & 1u))) ++result;
    return static_cast<std::uint16_t>(sign | result);
  }
  const std::uint32_t rebiased = magnitude - 0x38000000u;  // exponent bias 127 -> 15
  std::uint32_t result = rebiased >> 13;
  const std::uint32_t rest = rebiased & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (result & 1u))) ++result;  // a carry is still exact
  return static_cast<std::uint16_t>(sign | result);
}

/// IEEE binary16 -> binary32, exact.
TANDEM_HD constexpr float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_float(sign);
  std::uint32_t e = 113;  // normalise the subnormal: shift until the implicit bit appears
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    --e;
  }
  return bits_float(sign | (e << 23) | ((mantissa & 0x3ffu) << 13));
}

/// binary32 -> bfloat16, round to nearest, ties to even; NaN stays NaN (quieted).
TANDEM_HD constexpr std::uint16_t float_to_bfloat16_bits(float value) noexcept {
  const std::uint32_t x = float_bits(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x0040u);
  const std::uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>((x + rounding) >> 16);
}

TANDEM_HD constexpr float bfloat16_bits_to_float(std::uint16_t b) noexcept {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

}  // namespace detail

/// A namespace of its own: argument-dependent lookup on half and bfloat16 looks into their base
/// class's namespace, and must find nothing there but the base.
namespace detail::float16 {

/// What half and bfloat16 share: their 16 bits, making one from a bit pattern, and equality as
/// floats (so +0 equals -0 and NaN equals nothing). Self converts to float.
template <class Self>
struct storage {
  std::uint16_t bits = 0;  ///< the bit pattern

  /// The value with the bit pattern `raw`.
  TANDEM_HD static constexpr Self from_bits(std::uint16_t raw) noexcept {
    Self value;
    value.bits = raw;
    return value;
  }

  friend TANDEM_HD constexpr bool operator==(Self a, Self b) noexcept {
    return static_cast<float>(a) == static_cast<float>(b);
  }
};

}  // namespace detail::float16

/// IEEE 754 binary16. Stores bits (`h.bits`, the binary16 bit pattern; half::from_bits(raw)
/// makes one from them); arithmetic happens in float (convert, compute, convert back).
struct half : detail::float16::storage<half> {
  half() = default;
  /// `value` rounded to the nearest binary16, ties to even (overflow gives infinity).
  TANDEM_HD constexpr explicit half(float value) noexcept
      : storage{detail::float_to_half_bits(value)} {}
  /// The exact float of the same value.
  TANDEM_HD constexpr operator float() const noexcept { return detail::half_bits_to_float(bits); }

#if defined(__CUDACC__) || defined(TANDEM_CUDA_SIM)
  // From CUDA's type implicitly; to it explicitly, or `a + b` would be ambiguous under nvcc
  // (__half's operators against float's) where g++ picks float.
  TANDEM_HD half(__half value) noexcept : storage{__half_as_ushort(value)} {}
  TANDEM_HD explicit operator __half() const noexcept {
    return __ushort_as_half(bits);
  }
#endif
};

/// bfloat16: the top half of a binary32 (`b.bits`; bfloat16::from_bits(raw) makes one from
/// them). Arithmetic happens in float.
struct bfloat16 : detail::float16::storage<bfloat16> {
  bfloat16() = default;
  /// `value` rounded to the nearest bfloat16, ties to even (NaN stays NaN).
  TANDEM_HD constexpr explicit bfloat16(float value) noexcept
      : storage{detail::float_to_bfloat16_bits(value)} {}
  /// The exact float of the same value.
  TANDEM_HD constexpr operator float() const noexcept {
    return detail::bfloat16_bits_to_float(bits);
  }

#if defined(__CUDACC__) || defined(TANDEM_CUDA_SIM)
  // From CUDA's type implicitly; to it explicitly (see half).
  TANDEM_HD bfloat16(__nv_bfloat16 value) noexcept : storage{__bfloat16_as_ushort(value)} {}
  TANDEM_HD explicit operator __nv_bfloat16() const noexcept {
    return __ushort_as_bfloat16(bits);
  }
#endif
};

static_assert(sizeof(half) == 2 && std::is_trivially_copyable_v<half>);
static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16>);

/// The runtime tag of an element type, for messages and for checking peers agree.
enum class dtype : std::uint8_t { float32, float64, float16, bfloat16, int32, int64, uint8 };

/// Per element type: its dtype tag, name, size in bytes and whether it is floating point.
/// The primary template is a readable compile error for anything else.
template <class T>
struct dtype_traits {
  static_assert(sizeof(T) == 0,
                "tandem: not an element type; use float, double, tandem::half, "
                "tandem::bfloat16, std::int32_t, std::int64_t or std::uint8_t");
};

namespace detail {
template <dtype Id, const char* Name, class T, bool Floating>
struct dtype_info {
  static constexpr dtype id = Id;
  static constexpr const char* name = Name;
  static constexpr std::size_t size = sizeof(T);
  static constexpr bool is_floating = Floating;
};
inline constexpr char name_float32[] = "float32";
inline constexpr char name_float64[] = "float64";
inline constexpr char name_float16[] = "float16";
inline constexpr char name_bfloat16[] = "bfloat16";
inline constexpr char name_int32[] = "int32";
inline constexpr char name_int64[] = "int64";
inline constexpr char name_uint8[] = "uint8";
}  // namespace detail

// clang-format off
template <> struct dtype_traits<float> : detail::dtype_info<dtype::float32, detail::name_float32, float, true> {};
template <> struct dtype_traits<double> : detail::dtype_info<dtype::float64, detail::name_float64, double, true> {};
template <> struct dtype_traits<half> : detail::dtype_info<dtype::float16, detail::name_float16, half, true> {};
template <> struct dtype_traits<bfloat16> : detail::dtype_info<dtype::bfloat16, detail::name_bfloat16, bfloat16, true> {};
template <> struct dtype_traits<std::int32_t> : detail::dtype_info<dtype::int32, detail::name_int32, std::int32_t, false> {};
template <> struct dtype_traits<std::int64_t> : detail::dtype_info<dtype::int64, detail::name_int64, std::int64_t, false> {};
template <> struct dtype_traits<std::uint8_t> : detail::dtype_info<dtype::uint8, detail::name_uint8, std::uint8_t, false> {};
// clang-format on

/// True for the seven element types (cv-qualified ones included).
template <class T>
inline constexpr bool is_element_type_v = false;
/// \cond
template <class T>
requires std::is_const_v<T> || std::is_volatile_v<T>
inline constexpr bool is_element_type_v<T> = is_element_type_v<std::remove_cv_t<T>>;
template <>
inline constexpr bool is_element_type_v<float> = true;
template <>
inline constexpr bool is_element_type_v<double> = true;
template <>
inline constexpr bool is_element_type_v<half> = true;
template <>
inline constexpr bool is_element_type_v<bfloat16> = true;
template <>
inline constexpr bool is_element_type_v<std::int32_t> = true;
template <>
inline constexpr bool is_element_type_v<std::int64_t> = true;
template <>
inline constexpr bool is_element_type_v<std::uint8_t> = true;
/// \endcond

template <class T>
concept element_type = is_element_type_v<T>;

/// The dtype tag of element type T: `dtype_of<float> == dtype::float32`.
template <element_type T>
inline constexpr dtype dtype_of = dtype_traits<std::remove_cv_t<T>>::id;

/// The type element arithmetic runs in (PyTorch's "opmath"): double for double, float for the
/// other floating types; half and bfloat16 values are read into float, computed on, and rounded
/// back once. GradScaler, EMA, the optimizers, DDP's division and the fused step all use it.
template <class T>
using opmath_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

/// The dtype's name as PyTorch spells it without "torch." ("float32", "bfloat16", ...).
constexpr const char* name(dtype type) noexcept {
  switch (type) {
    case dtype::float32:
      return "float32";
    case dtype::float64:
      return "float64";
    case dtype::float16:
      return "float16";
    case dtype::bfloat16:
      return "bfloat16";
    case dtype::int32:
      return "int32";
    case dtype::int64:
      return "int64";
    case dtype::uint8:
      return "uint8";
  }
  return "unknown";
}

/// Bytes per element of the dtype.
constexpr std::size_t size_of(dtype type) noexcept {
  switch (type) {
    case dtype::float32:
    case dtype::int32:
      return 4;
    case dtype::float64:
    case dtype::int64:
      return 8;
    case dtype::float16:
    case dtype::bfloat16:
      return 2;
    case dtype::uint8:
      return 1;
  }
  return 0;
}

/// True for float32, float64, float16 and bfloat16.
constexpr bool is_floating(dtype type) noexcept {
  return type == dtype::float32 || type == dtype::float64 || type == dtype::float16 ||
         type == dtype::bfloat16;
}

}  // namespace tandem
