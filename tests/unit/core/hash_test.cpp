// tandem::fnv1a against the FNV-1a 64-bit test vectors (Fowler, Noll, Vo), whole and continued.
#include <doctest/doctest.h>

#include <array>
#include <cstddef>
#include <span>
#include <string_view>

#include "tandem/core/hash.hpp"

TEST_CASE("fnv1a gives FNV-1a's published 64-bit values") {
  CHECK(tandem::fnv1a("") == 0xcbf29ce484222325ull);
  CHECK(tandem::fnv1a("a") == 0xaf63dc4c8601ec8cull);
  CHECK(tandem::fnv1a("foobar") == 0x85944171f73967e8ull);
  static_assert(tandem::fnv1a("") == tandem::fnv1a_offset_basis);
}

TEST_CASE("fnv1a continues from a hash and reads bytes as text") {
  CHECK(tandem::fnv1a("bar", tandem::fnv1a("foo")) == tandem::fnv1a("foobar"));
  const std::array<std::byte, 3> bytes{std::byte{'f'}, std::byte{'o'}, std::byte{'o'}};
  CHECK(tandem::fnv1a(std::span<const std::byte>(bytes)) == tandem::fnv1a("foo"));
  CHECK(tandem::fnv1a("a") != tandem::fnv1a("b"));
}
