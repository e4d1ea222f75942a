// The expected results of NCCL's reductions, computed independently of the simulator: half and
// bfloat16 through CUDA's own host implementations of __hadd, __hmul, __hmin and __hmax, floats
// in their type, integers modulo 2^bits; the inputs every rank of a test contributes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nccl.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace simtest {

template <class T>
constexpr ncclDataType_t nccl_type() {
  if constexpr (std::is_same_v<T, std::int8_t>) return ncclInt8;
  if constexpr (std::is_same_v<T, std::uint8_t>) return ncclUint8;
  if constexpr (std::is_same_v<T, std::int32_t>) return ncclInt32;
  if constexpr (std::is_same_v<T, std::uint32_t>) return ncclUint32;
  if constexpr (std::is_same_v<T, std::int64_t>) return ncclInt64;
  if constexpr (std::is_same_v<T, std::uint64_t>) return ncclUint64;
  if constexpr (std::is_same_v<T, __half>) return ncclFloat16;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return ncclBfloat16;
  if constexpr (std::is_same_v<T, float>) return ncclFloat32;
  if constexpr (std::is_same_v<T, double>) return ncclFloat64;
}

template <class T>
constexpr bool narrow_float = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

template <class T>
T from_float(float v) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half(v);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16(v);
  } else {
    return static_cast<T>(v);
  }
}

/// Rank r's element i: in [1, 2) with a sign for floats (rounding matters, products stay
/// small), small integers with both signs for signed types (products wrap in narrow ones).
template <class T>
T input(int rank, std::size_t i) {
  const auto spread = static_cast<int>((i * 7 + static_cast<std::size_t>(rank) * 11 + i / 5) % 29);
  const bool negative = (i + static_cast<std::size_t>(rank)) % 3 == 0;
  if constexpr (std::is_integral_v<T>) {
    const int v = spread % 11 + 1;
    if constexpr (std::is_signed_v<T>) return static_cast<T>(negative ? -v : v);
    return static_cast<T>(v + (negative ? 200 : 0));  // large ones make uint8 sums wrap
  } else {
    const float v = 1.0f + static_cast<float>(spread) / 29.0f;
    return from_float<T>(negative ? -v : v);
  }
}

template <class T>
T combine(ncclRedOp_t op, T a, T b) {
  if constexpr (narrow_float<T>) {
    switch (op) {
      case ncclSum:
        return __hadd(a, b);
      case ncclProd:
        return __hmul(a, b);
      case ncclMin:
        return __hmin(a, b);
      default:
        return __hmax(a, b);
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    switch (op) {
      case ncclSum:
        return a + b;
      case ncclProd:
        return a * b;
      case ncclMin:
        return std::fmin(a, b);
      default:
        return std::fmax(a, b);
    }
  } else {
    switch (op) {  // modulo 2^64, truncated to T at the end: the same as modulo 2^bits
      case ncclSum:
        return static_cast<T>(static_cast<std::uint64_t>(a) + static_cast<std::uint64_t>(b));
      case ncclProd:
        return static_cast<T>(static_cast<std::uint64_t>(a) * static_cast<std::uint64_t>(b));
      case ncclMin:
        return a < b ? a : b;
      default:
        return a < b ? b : a;
    }
  }
}

/// What element i of a reduction of n ranks' inputs must be (every rank: the same bits).
template <class T>
T expected(ncclRedOp_t op, int n, std::size_t i) {
  if (op != ncclAvg) {
    T acc = input<T>(0, i);
    for (int q = 1; q < n; ++q) acc = combine(op, acc, input<T>(q, i));
    return acc;
  }
  if constexpr (std::is_integral_v<T>) {
    // NCCL: the wrapped sum, divided by n with truncation toward zero.
    T sum = input<T>(0, i);
    for (int q = 1; q < n; ++q) sum = combine(ncclSum, sum, input<T>(q, i));
    return static_cast<T>(static_cast<std::int64_t>(sum) / n);
  } else {
    // NCCL's PreMulSum: each input times 1/n in the type (a double's is 1.0 / n, the others'
    // come from float(1.0 / n)), then summed.
    T scalar{};
    if constexpr (std::is_same_v<T, double>) {
      scalar = 1.0 / n;
    } else {
      scalar = from_float<T>(static_cast<float>(1.0 / n));
    }
    T acc = combine(ncclProd, input<T>(0, i), scalar);
    for (int q = 1; q < n; ++q)
      acc = combine(ncclSum, acc, combine(ncclProd, input<T>(q, i), scalar));
    return acc;
  }
}

template <class T>
bool same_bits(const std::byte* at, T value) {
  return std::memcmp(at, &value, sizeof(T)) == 0;
}

template <class T>
double as_double(T value) {
  if constexpr (std::is_same_v<T, __half>) {
    return static_cast<double>(__half2float(value));
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return static_cast<double>(__bfloat162float(value));
  } else {
    return static_cast<double>(value);
  }
}

}  // namespace simtest
