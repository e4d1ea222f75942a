// NCCL's reductions on the host (reduce.hpp).
#include "reduce.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace simnccl {
namespace {

template <class T>
T load(const std::byte* at) noexcept {
  T value;
  std::memcpy(&value, at, sizeof value);
  return value;
}

template <class T>
void store(std::byte* at, T value) noexcept {
  std::memcpy(at, &value, sizeof value);
}

// A binary floating format of 16 bits: Frac fraction bits, ExpBits exponent bits.
template <int Frac, int ExpBits>
struct Narrow {
  static constexpr int bias = (1 << (ExpBits - 1)) - 1;
  static constexpr int exp_min = 1 - bias;
  static constexpr std::uint16_t exp_all = (1u << ExpBits) - 1;
  static constexpr std::uint16_t infinity = static_cast<std::uint16_t>(exp_all << Frac);
  static constexpr std::uint16_t quiet_nan = static_cast<std::uint16_t>(0x7fff);

  // Rounds to nearest even; doubles hold every value of the format and every sum or product
  // of two of them exactly enough that this single rounding is the format's own.
  static std::uint16_t encode(double x) noexcept {
    if (std::isnan(x)) return quiet_nan;
    const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    double magnitude = std::fabs(x);
    if (std::isinf(magnitude)) return sign | infinity;
    if (magnitude == 0) return sign;
    int e = 0;
    (void)std::frexp(magnitude, &e);
    int exponent = e - 1;  // magnitude in [2^exponent, 2^(exponent+1))
    if (exponent < exp_min) {
      // Subnormal: a multiple of 2^(exp_min - Frac); 1 << Frac carries into the smallest normal.
      const double units = std::nearbyint(std::ldexp(magnitude, Frac - exp_min));
      return sign | static_cast<std::uint16_t>(units);
    }
    double fraction = std::nearbyint((std::ldexp(magnitude, -exponent) - 1.0) * (1 << Frac));
    if (fraction == (1 << Frac)) {
      fraction = 0;
      ++exponent;
    }
    if (exponent > bias) return sign | infinity;
    return sign | static_cast<std::uint16_t>((exponent + bias) << Frac) |
           static_cast<std::uint16_t>(fraction);
  }

  static double decode(std::uint16_t bits) noexcept {
    const double sign = (bits & 0x8000) ? -1.0 : 1.0;
    const int exponent = (bits >> Frac) & exp_all;
    const int fraction = bits & ((1 << Frac) - 1);
    if (exponent == exp_all) return fraction ? std::nan("") : sign * INFINITY;
    if (exponent == 0) return sign * std::ldexp(fraction, exp_min - Frac);
    return sign * std::ldexp(fraction + (1 << Frac), exponent - bias - Frac);
  }
};

using HalfFormat = Narrow<10, 5>;
using BfloatFormat = Narrow<7, 8>;

// Arithmetic of one element type: V is what a value is computed in.
template <class T>
struct Native {
  using V = T;
  static V get(const std::byte* at) noexcept { return load<T>(at); }
  static void put(std::byte* at, V v) noexcept { store<T>(at, v); }
  static V add(V a, V b) noexcept { return a + b; }
  static V mul(V a, V b) noexcept { return a * b; }
  static V min(V a, V b) noexcept { return std::fmin(a, b); }
  static V max(V a, V b) noexcept { return std::fmax(a, b); }
  // NCCL's PreMulSum scalar for ncclAvg: 1/nranks in the type (float(1.0/n) for float).
  static V avg_scalar(int n) noexcept { return static_cast<T>(1.0 / n); }
  static V post_avg(V v, int) noexcept { return v; }
  static constexpr bool pre_multiplies = true;
};

template <class Format>
struct Rounded {
  using V = double;
  static V round(double v) noexcept { return Format::decode(Format::encode(v)); }
  static V get(const std::byte* at) noexcept { return Format::decode(load<std::uint16_t>(at)); }
  static void put(std::byte* at, V v) noexcept { store<std::uint16_t>(at, Format::encode(v)); }
  static V add(V a, V b) noexcept { return round(a + b); }
  static V mul(V a, V b) noexcept { return round(a * b); }
  static V min(V a, V b) noexcept { return std::fmin(a, b); }
  static V max(V a, V b) noexcept { return std::fmax(a, b); }
  // __float2half(float(1.0 / n)), as NCCL computes the scalar.
  static V avg_scalar(int n) noexcept { return round(static_cast<float>(1.0 / n)); }
  static V post_avg(V v, int) noexcept { return v; }
  static constexpr bool pre_multiplies = true;
};

// Integers wrap (computed unsigned); ncclAvg divides the wrapped sum, truncating toward zero.
template <class T>
struct Integer {
  using V = T;
  using U = std::make_unsigned_t<T>;
  static V get(const std::byte* at) noexcept { return load<T>(at); }
  static void put(std::byte* at, V v) noexcept { store<T>(at, v); }
  static V add(V a, V b) noexcept { return static_cast<T>(static_cast<U>(a) + static_cast<U>(b)); }
  static V mul(V a, V b) noexcept {
    using Wide = std::conditional_t<sizeof(T) < sizeof(unsigned), unsigned, U>;
    return static_cast<T>(static_cast<Wide>(static_cast<U>(a)) *
                          static_cast<Wide>(static_cast<U>(b)));
  }
  static V min(V a, V b) noexcept { return b < a ? b : a; }
  static V max(V a, V b) noexcept { return a < b ? b : a; }
  static V avg_scalar(int) noexcept { return 1; }
  static V post_avg(V v, int n) noexcept {
    if constexpr (std::is_signed_v<T>) {
      // |v| / n with v's sign, as NCCL's FuncSumPostDiv (also for the most negative value).
      const bool negative = v < 0;
      const U magnitude = negative ? static_cast<U>(U(0) - static_cast<U>(v)) : static_cast<U>(v);
      const U quotient = static_cast<U>(magnitude / static_cast<U>(n));
      return static_cast<T>(negative ? static_cast<U>(U(0) - quotient) : quotient);
    } else {
      return static_cast<T>(v / static_cast<T>(n));
    }
  }
  static constexpr bool pre_multiplies = false;
};

// out[i] = post(pre(x_0) step pre(x_1) step ... pre(x_{n-1})), the inputs in rank order.
template <class A, class Pre, class Step, class Post>
void fold(int nranks, const std::byte* const* inputs, std::byte* out, std::size_t count,
          std::size_t size, Pre pre, Step step, Post post) {
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t at = i * size;
    typename A::V acc = pre(A::get(inputs[0] + at));
    for (int q = 1; q < nranks; ++q) acc = step(acc, pre(A::get(inputs[q] + at)));
    A::put(out + at, post(acc));
  }
}

template <class A>
void reduce_as(ncclRedOp_t op, int nranks, const std::byte* const* inputs, std::byte* out,
               std::size_t count, std::size_t size) {
  using V = typename A::V;
  const auto same = [](V v) { return v; };
  const auto run = [&](auto pre, V (*step)(V, V), auto post) {
    fold<A>(nranks, inputs, out, count, size, pre, step, post);
  };
  switch (op) {
    case ncclSum:
      return run(same, A::add, same);
    case ncclProd:
      return run(same, A::mul, same);
    case ncclMin:
      return run(same, A::min, same);
    case ncclMax:
      return run(same, A::max, same);
    case ncclAvg:
      if constexpr (A::pre_multiplies) {
        const V scalar = A::avg_scalar(nranks);
        return run([scalar](V v) { return A::mul(v, scalar); }, A::add, same);
      } else {
        return run(same, A::add, [nranks](V v) { return A::post_avg(v, nranks); });
      }
    default:
      return;
  }
}

}  // namespace

std::size_t type_size(ncclDataType_t type) noexcept {
  switch (type) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

bool reducible(ncclDataType_t type) noexcept {
  return type_size(type) != 0 && type != ncclFloat8e4m3 && type != ncclFloat8e5m2;
}

const char* type_name(ncclDataType_t type) noexcept {
  switch (type) {
    case ncclInt8:
      return "ncclInt8";
    case ncclUint8:
      return "ncclUint8";
    case ncclInt32:
      return "ncclInt32";
    case ncclUint32:
      return "ncclUint32";
    case ncclInt64:
      return "ncclInt64";
    case ncclUint64:
      return "ncclUint64";
    case ncclFloat16:
      return "ncclFloat16";
    case ncclFloat32:
      return "ncclFloat32";
    case ncclFloat64:
      return "ncclFloat64";
    case ncclBfloat16:
      return "ncclBfloat16";
    case ncclFloat8e4m3:
      return "ncclFloat8e4m3";
    case ncclFloat8e5m2:
      return "ncclFloat8e5m2";
    default:
      return "an invalid type";
  }
}

const char* op_name(ncclRedOp_t op) noexcept {
  switch (op) {
    case ncclSum:
      return "ncclSum";
    case ncclProd:
      return "ncclProd";
    case ncclMax:
      return "ncclMax";
    case ncclMin:
      return "ncclMin";
    case ncclAvg:
      return "ncclAvg";
    default:
      return "an invalid op";
  }
}

void reduce(ncclDataType_t type, ncclRedOp_t op, int nranks, const std::byte* const* inputs,
            std::byte* out, std::size_t count) {
  const std::size_t size = type_size(type);
  switch (type) {
    case ncclInt8:
      return reduce_as<Integer<std::int8_t>>(op, nranks, inputs, out, count, size);
    case ncclUint8:
      return reduce_as<Integer<std::uint8_t>>(op, nranks, inputs, out, count, size);
    case ncclInt32:
      return reduce_as<Integer<std::int32_t>>(op, nranks, inputs, out, count, size);
    case ncclUint32:
      return reduce_as<Integer<std::uint32_t>>(op, nranks, inputs, out, count, size);
    case ncclInt64:
      return reduce_as<Integer<std::int64_t>>(op, nranks, inputs, out, count, size);
    case ncclUint64:
      return reduce_as<Integer<std::uint64_t>>(op, nranks, inputs, out, count, size);
    case ncclFloat16:
      return reduce_as<Rounded<HalfFormat>>(op, nranks, inputs, out, count, size);
    case ncclBfloat16:
      return reduce_as<Rounded<BfloatFormat>>(op, nranks, inputs, out, count, size);
    case ncclFloat32:
      return reduce_as<Native<float>>(op, nranks, inputs, out, count, size);
    case ncclFloat64:
      return reduce_as<Native<double>>(op, nranks, inputs, out, count, size);
    default:
      return;
  }
}

unsigned short to_half(double value) noexcept {
  return HalfFormat::encode(value);
}
unsigned short to_bfloat16(double value) noexcept {
  return BfloatFormat::encode(value);
}
double from_half(unsigned short bits) noexcept {
  return HalfFormat::decode(bits);
}
double from_bfloat16(unsigned short bits) noexcept {
  return BfloatFormat::decode(bits);
}

}  // namespace simnccl
