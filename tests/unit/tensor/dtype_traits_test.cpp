#include <doctest/doctest.h>

#include <cstdint>
#include <string_view>

#include "tandem/tensor/dtype.hpp"

namespace {

template <class T>
void check_traits(tandem::dtype id, std::string_view name, std::size_t size, bool floating) {
  using traits = tandem::dtype_traits<T>;
  CAPTURE(name);
  CHECK(traits::id == id);
  CHECK(std::string_view(traits::name) == name);
  CHECK(traits::size == size);
  CHECK(traits::size == sizeof(T));
  CHECK(traits::is_floating == floating);
  CHECK(tandem::dtype_of<T> == id);
  CHECK(tandem::dtype_of<const T> == id);
  // The runtime functions agree with the compile-time traits.
  CHECK(std::string_view(tandem::name(id)) == name);
  CHECK(tandem::size_of(id) == size);
  CHECK(tandem::is_floating(id) == floating);
}

}  // namespace

TEST_CASE("dtype_traits of the seven element types") {
  using tandem::dtype;
  check_traits<float>(dtype::float32, "float32", 4, true);
  check_traits<double>(dtype::float64, "float64", 8, true);
  check_traits<tandem::half>(dtype::float16, "float16", 2, true);
  check_traits<tandem::bfloat16>(dtype::bfloat16, "bfloat16", 2, true);
  check_traits<std::int32_t>(dtype::int32, "int32", 4, false);
  check_traits<std::int64_t>(dtype::int64, "int64", 8, false);
  check_traits<std::uint8_t>(dtype::uint8, "uint8", 1, false);
}

TEST_CASE("every dtype tag has a distinct name") {
  using tandem::dtype;
  const dtype all[] = {dtype::float32, dtype::float64, dtype::float16, dtype::bfloat16,
                       dtype::int32,   dtype::int64,   dtype::uint8};
  for (dtype a : all) {
    CHECK(std::string_view(tandem::name(a)) != "unknown");
    for (dtype b : all) {
      if (a != b) CHECK(std::string_view(tandem::name(a)) != std::string_view(tandem::name(b)));
    }
  }
  CHECK(std::string_view(tandem::name(static_cast<dtype>(200))) == "unknown");
  CHECK(tandem::size_of(static_cast<dtype>(200)) == 0);
  CHECK_FALSE(tandem::is_floating(static_cast<dtype>(200)));
}

TEST_CASE("dtype functions are usable at compile time") {
  static_assert(tandem::size_of(tandem::dtype_of<tandem::bfloat16>) == 2);
  static_assert(tandem::is_floating(tandem::dtype::float16));
  static_assert(!tandem::is_floating(tandem::dtype::uint8));
  static_assert(tandem::dtype_traits<double>::is_floating);
  CHECK(std::string_view(tandem::name(tandem::dtype_of<std::int64_t>)) == "int64");
}
