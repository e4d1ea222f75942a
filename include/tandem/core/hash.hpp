// tandem/core/hash.hpp - FNV-1a, 64 bits: the one hash tandem uses to fingerprint what ranks must
// hold alike (DDP's registration, tandem::agree's values, a model's weights in the examples).
//   const std::uint64_t h = tandem::fnv1a("layer.weight float32 [64, 10]");
//   const std::uint64_t whole = tandem::fnv1a(more, h);   // continues from h
//   tandem::fnv1a(std::as_bytes(std::span(weights)));       // any bytes
// Needs: the standard library. Not a cryptographic hash: it tells equal inputs from unequal
// ones that nobody chose to collide.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace tandem {

/// FNV-1a's 64-bit offset basis: the hash of no bytes.
inline constexpr std::uint64_t fnv1a_offset_basis = 14695981039346656037ull;

/// FNV-1a, 64 bits, of `text`, continuing from `hash`: the same bytes hash alike on every rank
/// and machine, so ranks compare one number before they spend collectives on describing a
/// difference.
constexpr std::uint64_t fnv1a(std::string_view text,
                              std::uint64_t hash = fnv1a_offset_basis) noexcept {
  for (const char c : text) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 1099511628211ull;
  }
  return hash;
}

/// FNV-1a, 64 bits, of `bytes`, continuing from `hash`.
inline std::uint64_t fnv1a(std::span<const std::byte> bytes,
                           std::uint64_t hash = fnv1a_offset_basis) noexcept {
  return fnv1a(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), hash);
}

}  // namespace tandem
