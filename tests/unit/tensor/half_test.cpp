#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "tandem/tensor/dtype.hpp"
#include "unit/tensor/rounding_reference.hpp"

using tandem::half;
using namespace tandem_test;  // the references these tests check against

static constexpr auto& to_half = narrow_bits<half>;
static constexpr auto& to_float = widened<half>;

TEST_CASE("half -> float is exact for all 65536 bit patterns") {
  check_widens_exactly<half>(half_format);
}

TEST_CASE("float -> half -> float round-trips every non-NaN half") {
  check_round_trips<half>(half_format, 1023);  // 2 signs x 1023 NaN mantissas
}

TEST_CASE("float -> half rounds midpoints to even and neighbours of a midpoint away from it") {
  check_boundaries<half>(half_format, 0x7c00u);
}

TEST_CASE("float -> half overflows to infinity from 65520 on") {
  CHECK(to_half(65504.0f) == 0x7bffu);
  CHECK(to_half(65519.99f) == 0x7bffu);
  CHECK(to_half(std::nextafter(65520.0f, 0.0f)) == 0x7bffu);
  CHECK(to_half(65520.0f) == 0x7c00u);
  CHECK(to_half(-65520.0f) == 0xfc00u);
  CHECK(to_half(1e10f) == 0x7c00u);
  CHECK(to_half(std::numeric_limits<float>::max()) == 0x7c00u);
  CHECK(to_half(std::numeric_limits<float>::infinity()) == 0x7c00u);
  CHECK(to_half(-std::numeric_limits<float>::infinity()) == 0xfc00u);
  CHECK(std::isinf(to_float(0x7c00u)));
  CHECK(to_float(0xfc00u) == -std::numeric_limits<float>::infinity());
}

TEST_CASE("float -> half below the smallest subnormal") {
  const float tiny = std::ldexp(1.0f, -25);  // half of the smallest subnormal 2^-24
  CHECK(to_half(tiny) == 0x0000u);           // a tie: to the even zero
  CHECK(to_half(std::nextafter(tiny, 1.0f)) == 0x0001u);
  CHECK(to_half(-tiny) == 0x8000u);
  CHECK(to_half(-std::nextafter(tiny, 1.0f)) == 0x8001u);
  CHECK(to_half(std::nextafter(tiny, 0.0f)) == 0x0000u);
  CHECK(to_half(std::numeric_limits<float>::denorm_min()) == 0x0000u);
  CHECK(to_half(-std::numeric_limits<float>::denorm_min()) == 0x8000u);
  CHECK(to_half(std::ldexp(3.0f, -25)) == 0x0002u);  // 1.5 ulp: a tie between 1 and 2, to 2
  CHECK(to_float(0x0001u) == std::ldexp(1.0f, -24));
  CHECK(to_float(0x03ffu) == std::ldexp(1023.0f, -24));  // largest subnormal
  CHECK(to_float(0x0400u) == std::ldexp(1.0f, -14));     // smallest normal
}

TEST_CASE("half keeps the sign of zero") {
  CHECK(to_half(0.0f) == 0x0000u);
  CHECK(to_half(-0.0f) == 0x8000u);
  CHECK_FALSE(std::signbit(to_float(0x0000u)));
  CHECK(std::signbit(to_float(0x8000u)));
  CHECK(to_float(0x8000u) == 0.0f);
  CHECK(half(0.0f) == half(-0.0f));  // == compares values, like float
}

TEST_CASE("float -> half keeps NaN a NaN, with its sign and top payload bits") {
  const auto is_half_nan = [](std::uint16_t h) { return half_format.is_nan(h); };
  CHECK(is_half_nan(to_half(std::numeric_limits<float>::quiet_NaN())));
  CHECK(is_half_nan(to_half(std::numeric_limits<float>::signaling_NaN())));
  CHECK(to_half(float_of(0x7fc00000u)) == 0x7e00u);
  CHECK(to_half(float_of(0xffc00000u)) == 0xfe00u);
  CHECK(to_half(float_of(0x7f800001u)) == 0x7e00u);  // payload below half's reach: still NaN
  CHECK(to_half(float_of(0xff800001u)) == 0xfe00u);
  CHECK(to_half(float_of(0x7fa02000u)) == 0x7f01u);  // signalling, payload kept and quieted
  CHECK(to_half(float_of(0x7fffe000u)) == 0x7fffu);
  CHECK(half(NAN) != half(NAN));
  Mismatches wrong;
  for (std::uint64_t bits = 0x7f800001u; bits <= 0xffffffffu; bits += 997) {
    const float value = float_of(static_cast<std::uint32_t>(bits));
    if (!std::isnan(value)) continue;
    const std::uint16_t h = to_half(value);
    if (!is_half_nan(h) || (h & 0x8000u) != ((bits >> 16) & 0x8000u) || (h & 0x0200u) == 0) {
      wrong.add(bits, " -> ", h);
    }
  }
  CHECK_MESSAGE(wrong.count() == 0, wrong.text());
}

TEST_CASE("float -> half agrees with a nearest-value search over sampled floats") {
  const NearestEncoder reference(half_format);
  Mismatches wrong;
  const auto check = [&](float value) { check_nearest<half>(reference, value, wrong); };
  for_sampled_floats(half_format, check);
  // Dense around the subnormal and overflow ranges, where the code takes other paths.
  for (std::uint32_t bits = 0x32f00000u; bits < 0x38900000u; bits += 61) check(float_of(bits));
  for (std::uint32_t bits = 0x477f0000u; bits < 0x47810000u; ++bits) check(float_of(bits));
  CHECK_MESSAGE(wrong.count() == 0, wrong.text());
}

#if defined(__FLT16_MAX__)
TEST_CASE("float -> half agrees with the compiler's _Float16") {
  Mismatches wrong;
  const auto check = [&](float value) {
    const std::uint16_t want = std::bit_cast<std::uint16_t>(static_cast<_Float16>(value));
    const std::uint16_t got = to_half(value);
    const bool agree = std::isnan(value) ? half_format.is_nan(got) && half_format.is_nan(want) &&
                                               (got & 0x8000u) == (want & 0x8000u)
                                         : got == want;
    if (!agree) wrong.add(bits_of(value), " -> ", got, " want ", want);
  };
  for_sampled_floats(half_format, check);
  CHECK_MESSAGE(wrong.count() == 0, wrong.text());

  Mismatches widened;
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const auto h = static_cast<std::uint16_t>(bits);
    const auto want = static_cast<float>(std::bit_cast<_Float16>(h));
    const float got = to_float(h);
    if (std::isnan(want) ? !std::isnan(got) : bits_of(got) != bits_of(want)) {
      widened.add(h, " -> ", bits_of(got), " want ", bits_of(want));
    }
  }
  CHECK_MESSAGE(widened.count() == 0, widened.text());
}
#endif

TEST_CASE("half converts in constant expressions") {
  static_assert(half(1.0f).bits == 0x3c00u);
  static_assert(half(-2.0f).bits == 0xc000u);
  static_assert(static_cast<float>(half::from_bits(0x3555u)) == 0x1.554p-2f);
  static_assert(half(0.1f).bits == 0x2e66u);
  CHECK(half(0.1f).bits == 0x2e66u);
}
