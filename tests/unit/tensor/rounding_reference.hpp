// Independent references for the half and bfloat16 tests: decode by formula in double, encode by
// searching a table of every finite value for the nearest one. Shares no code with dtype.hpp.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace tandem_test {

/// A small binary floating-point format: 1 sign bit, `exponent_bits`, `mantissa_bits`.
struct Format {
  int exponent_bits;
  int mantissa_bits;

  [[nodiscard]] int bias() const { return (1 << (exponent_bits - 1)) - 1; }
  [[nodiscard]] std::uint32_t max_exponent() const { return (1u << exponent_bits) - 1u; }
  [[nodiscard]] std::uint16_t sign_bit() const {
    return static_cast<std::uint16_t>(1u << (exponent_bits + mantissa_bits));
  }
  [[nodiscard]] std::uint16_t infinity() const {
    return static_cast<std::uint16_t>(max_exponent() << mantissa_bits);
  }
  [[nodiscard]] bool is_nan(std::uint16_t bits) const {
    const std::uint32_t magnitude = bits & (sign_bit() - 1u);
    return magnitude > infinity();
  }

  /// sign * 2^(e - bias) * (1 + m / 2^M) for normals, sign * m / 2^M * 2^(1 - bias) for
  /// subnormals, infinity, NaN; computed in double, where every such value is exact.
  [[nodiscard]] double decode(std::uint16_t bits) const {
    const double sign = (bits & sign_bit()) ? -1.0 : 1.0;
    const std::uint32_t e = (bits >> mantissa_bits) & max_exponent();
    const std::uint32_t m = bits & ((1u << mantissa_bits) - 1u);
    const double fraction = std::ldexp(static_cast<double>(m), -mantissa_bits);
    if (e == max_exponent()) {
      return m == 0 ? sign * std::numeric_limits<double>::infinity()
                    : std::numeric_limits<double>::quiet_NaN();
    }
    if (e == 0) return sign * std::ldexp(fraction, 1 - bias());
    return sign * std::ldexp(1.0 + fraction, static_cast<int>(e) - bias());
  }
};

inline constexpr Format half_format{5, 10};
inline constexpr Format bfloat16_format{8, 7};

/// The value the pattern after the largest finite one would have: 2^(emax + 1), where infinity
/// starts for rounding.
inline double beyond_largest(Format format) {
  return std::ldexp(1.0, static_cast<int>(format.max_exponent()) - format.bias());
}

/// A float where round-to-nearest-even decides, and the pattern it must round to.
struct Boundary {
  float value;
  std::uint16_t expected;
};

/// For each pair of adjacent non-negative finite values (the largest paired with infinity), of
/// both signs: their midpoint, exact in float, rounds to the even pattern; the floats just
/// towards zero and just away from it round to the lower and the upper value.
inline std::vector<Boundary> rounding_boundaries(Format format) {
  std::vector<Boundary> boundaries;
  for (std::uint32_t low = 0; low < format.infinity(); ++low) {
    const std::uint32_t high = low + 1;
    const double a = format.decode(static_cast<std::uint16_t>(low));
    const double b = high == format.infinity() ? beyond_largest(format)
                                               : format.decode(static_cast<std::uint16_t>(high));
    const auto midpoint = static_cast<float>((a + b) / 2);
    if (static_cast<double>(midpoint) != (a + b) / 2) throw std::logic_error("inexact midpoint");
    const std::uint32_t even = (low & 1u) == 0 ? low : high;
    for (std::uint32_t sign : {0u, static_cast<std::uint32_t>(format.sign_bit())}) {
      const float m = sign ? -midpoint : midpoint;
      const float away =
          sign ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity();
      boundaries.push_back({m, static_cast<std::uint16_t>(sign | even)});
      boundaries.push_back({std::nextafter(m, 0.0f), static_cast<std::uint16_t>(sign | low)});
      boundaries.push_back({std::nextafter(m, away), static_cast<std::uint16_t>(sign | high)});
    }
  }
  return boundaries;
}

/// Round-to-nearest-even encoder that knows nothing but the decoded values: the finite
/// non-negative values in increasing order, then a virtual next value standing for infinity
/// (2^(emax+1), with an even mantissa like the infinity pattern).
class NearestEncoder {
 public:
  explicit NearestEncoder(Format format) : format_(format) {
    for (std::uint32_t bits = 0; bits < format.infinity(); ++bits) {
      values_.push_back(format.decode(static_cast<std::uint16_t>(bits)));
    }
    values_.push_back(beyond_largest(format));
  }

  /// Not for NaN.
  [[nodiscard]] std::uint16_t encode(float value) const {
    const std::uint16_t sign = std::signbit(value) ? format_.sign_bit() : 0;
    const double magnitude = std::fabs(static_cast<double>(value));
    if (magnitude >= values_.back()) return static_cast<std::uint16_t>(sign | format_.infinity());
    // values_[upper] is the first value >= magnitude; values_[upper - 1] the one below it.
    const auto upper = static_cast<std::uint32_t>(
        std::lower_bound(values_.begin(), values_.end(), magnitude) - values_.begin());
    std::uint32_t chosen = upper;
    if (values_[upper] != magnitude) {
      const double below = magnitude - values_[upper - 1];
      const double above = values_[upper] - magnitude;
      if (below < above || (below == above && ((upper - 1) & 1u) == 0)) chosen = upper - 1;
    }
    return static_cast<std::uint16_t>(sign | chosen);
  }

 private:
  Format format_;
  std::vector<double> values_;
};

/// Counts failures of a long loop and keeps the first few, so that a loop over millions of
/// values asserts once and still says which values failed.
class Mismatches {
 public:
  template <class... Parts>
  void add(const Parts&... parts) {
    if (count_++ < 8) {
      std::ostringstream line;
      line << std::hex;
      (line << ... << parts);
      text_ += line.str() + "\n";
    }
  }
  [[nodiscard]] std::size_t count() const { return count_; }
  [[nodiscard]] std::string text() const {
    return std::to_string(count_) + " mismatches, first ones:\n" + text_;
  }

 private:
  std::size_t count_ = 0;
  std::string text_;
};

inline std::uint32_t bits_of(float value) {
  return std::bit_cast<std::uint32_t>(value);
}
inline float float_of(std::uint32_t bits) {
  return std::bit_cast<float>(bits);
}

// The checks the half and bfloat16 tests share, for a 16-bit type Narrow with `Narrow(float).bits`
// and `Narrow::from_bits(bits)`.

/// Narrow(value)'s bits.
template <class Narrow>
std::uint16_t narrow_bits(float value) {
  return Narrow(value).bits;
}
/// The float that Narrow's pattern `bits` widens to.
template <class Narrow>
float widened(std::uint16_t bits) {
  return static_cast<float>(Narrow::from_bits(bits));
}

/// Every one of the 65536 patterns widens to float exactly: the formula's value with its sign; a
/// NaN stays NaN with its sign and its payload in the top mantissa bits.
template <class Narrow>
void check_widens_exactly(Format format) {
  Mismatches wrong;
  const std::uint32_t mantissa_mask = (1u << format.mantissa_bits) - 1u;
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const auto narrow = static_cast<std::uint16_t>(bits);
    const float got = widened<Narrow>(narrow);
    const double want = format.decode(narrow);
    if (format.is_nan(narrow)) {
      const std::uint32_t expected = (bits & format.sign_bit()) << 16 | 0x7f800000u |
                                     (bits & mantissa_mask) << (23 - format.mantissa_bits);
      if (!std::isnan(got) || bits_of(got) != expected) wrong.add(narrow, " -> ", bits_of(got));
    } else if (static_cast<double>(got) != want || std::signbit(got) != std::signbit(want)) {
      wrong.add(narrow, " -> ", got, " formula ", want);
    }
  }
  CHECK_MESSAGE(wrong.count() == 0, wrong.text());
}

/// Every non-NaN pattern of format comes back from float unchanged; nan_mantissas per sign are
/// left out of the count.
template <class Narrow>
void check_round_trips(Format format, std::uint32_t nan_mantissas) {
  Mismatches wrong;
  std::uint32_t checked = 0;
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const auto narrow = static_cast<std::uint16_t>(bits);
    if (format.is_nan(narrow)) continue;
    ++checked;
    const std::uint16_t back = Narrow(static_cast<float>(Narrow::from_bits(narrow))).bits;
    if (back != narrow) wrong.add(narrow, " -> ", back);
  }
  CHECK(checked == 65536 - 2 * nan_mantissas);
  CHECK_MESSAGE(wrong.count() == 0, wrong.text());
}

/// Every rounding boundary of format (3 floats x 2 signs for each of the pairs of neighbouring
/// finite patterns, infinity last) rounds to its expected pattern.
template <class Narrow>
void check_boundaries(Format format, std::size_t pairs) {
  const auto boundaries = rounding_boundaries(format);
  CHECK(boundaries.size() == 6 * pairs);
  Mismatches wrong;
  for (const auto& [value, expected] : boundaries) {
    const std::uint16_t got = Narrow(value).bits;
    if (got != expected) wrong.add(bits_of(value), " -> ", got, " want ", expected);
  }
  CHECK_MESSAGE(wrong.count() == 0, wrong.text());
}

/// Calls check on every 4099th float pattern and on every rounding boundary of format.
template <class Check>
void for_sampled_floats(Format format, const Check& check) {
  for (std::uint64_t bits = 0; bits <= 0xffffffffu; bits += 4099) {
    check(float_of(static_cast<std::uint32_t>(bits)));
  }
  for (const auto& boundary : rounding_boundaries(format)) check(boundary.value);
}

/// Records value in wrong when Narrow's rounding of it differs from the nearest-value search.
template <class Narrow>
void check_nearest(const NearestEncoder& reference, float value, Mismatches& wrong) {
  if (std::isnan(value)) return;
  const std::uint16_t got = Narrow(value).bits;
  const std::uint16_t want = reference.encode(value);
  if (got != want) wrong.add(bits_of(value), " -> ", got, " want ", want);
}

}  // namespace tandem_test
