#include <doctest/doctest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>

#include "tandem/tensor/dtype.hpp"
#include "unit/tensor/rounding_reference.hpp"

using tandem::bfloat16;
using namespace tandem_test;  // the references these tests check against

static constexpr auto& to_bf16 = narrow_bits<bfloat16>;
static constexpr auto& to_float = widened<bfloat16>;

TEST_CASE("bfloat16 -> float is the top half of a binary32 for all 65536 bit patterns") {
  Mismatches wrong;
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const float got = to_float(static_cast<std::uint16_t>(bits));
    if (bits_of(got) != bits << 16) wrong.add(bits, " -> ", bits_of(got));
  }
  CHECK_MESSAGE(wrong.count() == 0, wrong.text());
  check_widens_exactly<bfloat16>(bfloat16_format);  // and the value the formula gives
}

TEST_CASE("float -> bfloat16 -> float round-trips every non-NaN bfloat16") {
  check_round_trips<bfloat16>(bfloat16_format, 127);  // 2 signs x 127 NaN mantissas
}

TEST_CASE("float -> bfloat16 rounds midpoints to even and neighbours of a midpoint away from it") {
  check_boundaries<bfloat16>(bfloat16_format, 0x7f80u);
}

TEST_CASE("float -> bfloat16 overflows to infinity above the last midpoint") {
  // Reference in double: the largest bfloat16 is (2 - 2^-7) * 2^127; infinity takes over from
  // half an ulp (2^119) above it, the tie going to the even pattern 0x7f80.
  const double largest = (2.0 - std::ldexp(1.0, -7)) * std::ldexp(1.0, 127);
  const double threshold = largest + std::ldexp(1.0, 119);
  REQUIRE(to_float(0x7f7fu) == static_cast<float>(largest));
  const float flt_max = std::numeric_limits<float>::max();
  REQUIRE(bits_of(flt_max) == 0x7f7fffffu);
  CHECK(static_cast<double>(flt_max) > threshold);
  CHECK(to_bf16(flt_max) == 0x7f80u);  // so FLT_MAX rounds to infinity under RNE
  CHECK(to_bf16(-flt_max) == 0xff80u);
  CHECK(to_bf16(static_cast<float>(threshold)) == 0x7f80u);
  CHECK(to_bf16(std::nextafter(static_cast<float>(threshold), 0.0f)) == 0x7f7fu);
  CHECK(to_bf16(static_cast<float>(largest)) == 0x7f7fu);
  CHECK(to_bf16(std::numeric_limits<float>::infinity()) == 0x7f80u);
  CHECK(to_bf16(-std::numeric_limits<float>::infinity()) == 0xff80u);
}

TEST_CASE("float -> bfloat16 keeps NaN a quiet NaN with its sign") {
  CHECK(to_bf16(float_of(0x7fc00000u)) == 0x7fc0u);
  CHECK(to_bf16(float_of(0xffc00000u)) == 0xffc0u);
  CHECK(to_bf16(float_of(0x7f800001u)) == 0x7fc0u);  // payload only in the dropped bits
  CHECK(to_bf16(float_of(0xff80ffffu)) == 0xffc0u);  // would round to -infinity if added to
  CHECK(to_bf16(float_of(0x7fbfffffu)) == 0x7fffu);  // would carry into the sign if rounded
  CHECK(to_bf16(float_of(0x7f810000u)) == 0x7fc1u);  // signalling: quieted, payload kept
  Mismatches wrong;
  for (std::uint64_t bits = 0x7f800001u; bits <= 0xffffffffu; bits += 991) {
    const float value = float_of(static_cast<std::uint32_t>(bits));
    if (!std::isnan(value)) continue;
    const std::uint16_t b = to_bf16(value);
    if (!bfloat16_format.is_nan(b) || (b & 0x8000u) != ((bits >> 16) & 0x8000u) ||
        (b & 0x0040u) == 0) {
      wrong.add(bits, " -> ", b);
    }
  }
  CHECK_MESSAGE(wrong.count() == 0, wrong.text());
}

TEST_CASE("float -> bfloat16 subnormals and signed zeros") {
  CHECK(to_bf16(0.0f) == 0x0000u);
  CHECK(to_bf16(-0.0f) == 0x8000u);
  CHECK(std::signbit(to_float(0x8000u)));
  CHECK(to_bf16(float_of(0x00000001u)) == 0x0000u);  // smallest float subnormal
  CHECK(to_bf16(float_of(0x00008000u)) == 0x0000u);  // tie to even zero
  CHECK(to_bf16(float_of(0x00008001u)) == 0x0001u);
  CHECK(to_bf16(float_of(0x00018000u)) == 0x0002u);  // tie between 1 and 2: to 2
  CHECK(to_bf16(float_of(0x807fffffu)) == 0x8080u);  // largest subnormal rounds up to normal
  CHECK(to_float(0x0001u) == std::ldexp(1.0f, -133));
  CHECK(to_float(0x0080u) == FLT_MIN);
}

TEST_CASE("float -> bfloat16 agrees with a nearest-value search over sampled floats") {
  const NearestEncoder reference(bfloat16_format);
  Mismatches wrong;
  for_sampled_floats(bfloat16_format,
                     [&](float value) { check_nearest<bfloat16>(reference, value, wrong); });
  CHECK_MESSAGE(wrong.count() == 0, wrong.text());
}

TEST_CASE("bfloat16 converts in constant expressions") {
  static_assert(bfloat16(1.0f).bits == 0x3f80u);
  static_assert(bfloat16(-2.0f).bits == 0xc000u);
  static_assert(static_cast<float>(bfloat16::from_bits(0x4049u)) == 3.140625f);
  CHECK(bfloat16(3.14159f).bits == 0x4049u);
  CHECK(bfloat16(NAN) != bfloat16(NAN));
  CHECK(bfloat16(0.0f) == bfloat16(-0.0f));
}
