// tandem/io/crc32c.hpp - CRC-32C (Castagnoli), the checksum of checkpoint data and of
// TensorBoard's record framing; SSE4.2's crc32 instruction where the CPU has it, a table else.
//   std::uint32_t crc = tandem::crc32c(bytes);                 // whole buffer
//   crc = tandem::crc32c(more, crc);                             // continued
// Needs: the standard library.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "tandem/tensor/host_cpu.hpp"

namespace tandem {

namespace detail {

inline constexpr std::uint32_t crc32c_polynomial = 0x82F63B78u;  // reflected Castagnoli

inline const std::array<std::uint32_t, 256>& crc32c_table() {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ crc32c_polynomial : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

inline std::uint32_t crc32c_portable(const unsigned char* p, std::size_t n, std::uint32_t crc) {
  const auto& table = crc32c_table();
  for (std::size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(TANDEM_X86_DISPATCH)
[[gnu::target("sse4.2")]] inline std::uint32_t crc32c_sse42(const unsigned char* p, std::size_t n,
                                                            std::uint32_t crc) {
  std::uint64_t c = crc;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t word;
    std::memcpy(&word, p + i, 8);
    c = _mm_crc32_u64(c, word);
  }
  auto c32 = static_cast<std::uint32_t>(c);
  for (; i < n; ++i) c32 = _mm_crc32_u8(c32, p[i]);
  return c32;
}
#endif

}  // namespace detail

/// CRC-32C of `bytes`, continuing from `crc` (the value of the bytes before them; 0 to start).
[[nodiscard]] inline std::uint32_t crc32c(std::span<const std::byte> bytes,
                                          std::uint32_t crc = 0) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  std::uint32_t state = ~crc;
#if defined(TANDEM_X86_DISPATCH)
  state = cpu_has(cpu_feature::sse42) ? detail::crc32c_sse42(p, bytes.size(), state)
                                      : detail::crc32c_portable(p, bytes.size(), state);
#else
  state = detail::crc32c_portable(p, bytes.size(), state);
#endif
  return ~state;
}

}  // namespace tandem
