// tandem/core/units.hpp - byte-size literals for the places where a size really is in bytes
// (bucket caps, message limits). Element counts are plain std::size_t named *count or size().
//   using namespace tandem::literals;  constexpr std::size_t cap = 25_MiB;
// Needs: the standard library only.
#pragma once

#include <cstddef>

namespace tandem::literals {

consteval std::size_t operator""_KiB(unsigned long long n) {
  return static_cast<std::size_t>(n) << 10;
}
consteval std::size_t operator""_MiB(unsigned long long n) {
  return static_cast<std::size_t>(n) << 20;
}
consteval std::size_t operator""_GiB(unsigned long long n) {
  return static_cast<std::size_t>(n) << 30;
}

}  // namespace tandem::literals
