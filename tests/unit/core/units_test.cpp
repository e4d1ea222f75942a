#include <doctest/doctest.h>

#include "tandem/core/units.hpp"

using namespace tandem::literals;

TEST_CASE("byte literals are powers of 1024") {
  static_assert(1_KiB == 1024);
  CHECK(25_MiB == 25u * 1024u * 1024u);
  CHECK(2_GiB == std::size_t{2} << 30);
}
