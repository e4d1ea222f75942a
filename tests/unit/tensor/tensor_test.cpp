#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/error_of.hpp"
#include "tandem/tensor/tensor.hpp"

using tandem::Buffer;
using tandem::Shape;
using tandem::View;

using tandem::test::error_of;

TEST_CASE("Shape counts elements and prints itself") {
  const Shape matrix{3, 4};
  CHECK(matrix.rank() == 2);
  CHECK(matrix[0] == 3);
  CHECK(matrix[1] == 4);
  CHECK(matrix.numel() == 12);
  CHECK(matrix.to_string() == "[3, 4]");
  CHECK(std::vector<std::int64_t>(matrix.begin(), matrix.end()) == std::vector<std::int64_t>{3, 4});

  const Shape scalar;
  CHECK(scalar.rank() == 0);
  CHECK(scalar.numel() == 1);
  CHECK(scalar.to_string() == "[]");

  CHECK(Shape{2, 0, 5}.numel() == 0);
  CHECK(Shape{1, 2, 3, 4, 5, 6, 7, 8}.rank() == Shape::max_rank);
  CHECK(Shape{3, 4} == Shape{3, 4});
  CHECK(Shape{3, 4} != Shape{4, 3});
  CHECK(Shape{12} != Shape{3, 4});
  CHECK(Shape{} != Shape{1});
}

TEST_CASE("Shape rejects negative extents and too many dimensions") {
  CHECK(error_of([] { (void)Shape{2, -1}; }, "Shape").find("-1") != std::string::npos);
  CHECK(error_of([] { (void)Shape{1, 1, 1, 1, 1, 1, 1, 1, 1}; }, "Shape").find("9") !=
        std::string::npos);
}

TEST_CASE("View is a non-owning window with a shape") {
  std::vector<float> storage(12);
  std::iota(storage.begin(), storage.end(), 0.0f);

  const View<float> flat(storage.data(), storage.size());
  CHECK(flat.data() == storage.data());
  CHECK(flat.size() == 12);
  CHECK(flat.size_bytes() == 48);
  CHECK_FALSE(flat.empty());
  CHECK(flat.shape() == Shape{12});
  CHECK(flat[5] == 5.0f);
  flat[5] = 50.0f;  // a View<float> writes through, even when the View itself is const
  CHECK(storage[5] == 50.0f);
  CHECK(std::accumulate(flat.begin(), flat.end(), 0.0f) == 66.0f + 45.0f);

  const View<float> matrix(storage.data(), Shape{3, 4});
  CHECK(matrix.size() == 12);
  CHECK(matrix.shape() == Shape{3, 4});

  const View<float> empty;
  CHECK(empty.data() == nullptr);
  CHECK(empty.size() == 0);
  CHECK(empty.empty());
  CHECK(empty.shape() == Shape{0});
  CHECK(empty.begin() == empty.end());
}

TEST_CASE("View::subview takes a flat range and rejects one outside the view") {
  std::vector<std::int32_t> storage{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  const View<std::int32_t> all(storage.data(), Shape{2, 5});

  const auto middle = all.subview(3, 4);
  CHECK(middle.data() == storage.data() + 3);
  CHECK(middle.size() == 4);
  CHECK(middle.shape() == Shape{4});
  CHECK(middle[0] == 3);
  CHECK(all.subview(0, 10).size() == 10);
  CHECK(all.subview(10, 0).empty());  // an empty range at the end is fine
  CHECK(all.subview(4, 0).empty());

  const std::string message = error_of([&] { (void)all.subview(8, 3); }, "View::subview");
  CHECK(message.find("10 elements") != std::string::npos);
  error_of([&] { (void)all.subview(11, 0); }, "View::subview");
  error_of([&] { (void)all.subview(0, 11); }, "View::subview");
  // offset + count would wrap around: must still be rejected, not pass a sum check.
  error_of([&] { (void)all.subview(5, static_cast<std::size_t>(-1)); }, "View::subview");
  error_of([&] { (void)all.subview(static_cast<std::size_t>(-1), 2); }, "View::subview");
}

TEST_CASE("View::reshape keeps the elements and checks the count") {
  std::array<double, 6> storage{};
  const View<double> flat(storage.data(), storage.size());
  const auto matrix = flat.reshape(Shape{2, 3});
  CHECK(matrix.data() == storage.data());
  CHECK(matrix.size() == 6);
  CHECK(matrix.shape() == Shape{2, 3});
  CHECK(matrix.reshape(Shape{6}).shape() == Shape{6});
  CHECK(View<double>(storage.data(), 1).reshape(Shape{}).shape().rank() == 0);

  const std::string message = error_of([&] { (void)flat.reshape(Shape{4, 2}); }, "View::reshape");
  CHECK(message.find("[4, 2]") != std::string::npos);
  CHECK(message.find("8") != std::string::npos);
  CHECK(message.find("6") != std::string::npos);
}

TEST_CASE("View<T> converts to View<const T>, keeping data, size and shape") {
  std::vector<float> storage(6, 1.5f);
  const View<float> writable(storage.data(), Shape{2, 3});
  const View<const float> readable = writable;
  CHECK(readable.data() == storage.data());
  CHECK(readable.size() == 6);
  CHECK(readable.shape() == Shape{2, 3});
  CHECK(readable[4] == 1.5f);
  static_assert(std::is_same_v<decltype(readable[0]), const float&>);
  static_assert(std::is_convertible_v<View<float>, View<const float>>);
  static_assert(!std::is_convertible_v<View<const float>, View<float>>);
  static_assert(!std::is_convertible_v<View<float>, View<double>>);
  static_assert(!std::is_convertible_v<View<float, tandem::device>, View<float>>);
}

TEST_CASE("standard containers are tensors and view as such") {
  std::vector<float> vector(5, 2.0f);
  auto from_vector = tandem::view(vector);
  static_assert(std::is_same_v<decltype(from_vector), View<float, tandem::host>>);
  CHECK(from_vector.data() == vector.data());
  CHECK(from_vector.size() == 5);
  CHECK(from_vector.shape() == Shape{5});

  const std::vector<float>& constant = vector;
  auto from_const = tandem::view(constant);
  static_assert(std::is_same_v<decltype(from_const), View<const float, tandem::host>>);
  CHECK(from_const.data() == vector.data());

  std::array<std::int64_t, 3> array{7, 8, 9};
  auto from_array = tandem::view(array);
  static_assert(std::is_same_v<decltype(from_array), View<std::int64_t>>);
  CHECK(from_array[2] == 9);

  std::span<std::uint8_t> span;
  CHECK(tandem::view(span).empty());
  std::uint8_t bytes[4] = {1, 2, 3, 4};
  std::span<std::uint8_t, 4> fixed(bytes);
  CHECK(tandem::view(fixed).size() == 4);
  CHECK(tandem::view(std::span<const std::uint8_t>(bytes)).data() == bytes);

  // Implicit conversion, as a function taking View would see it; CTAD for the element type.
  const auto sum = [](View<const float> values) {
    return std::accumulate(values.begin(), values.end(), 0.0f);
  };
  CHECK(sum(vector) == 10.0f);
  CHECK(sum(from_vector) == 10.0f);
  View deduced(vector);
  static_assert(std::is_same_v<decltype(deduced), View<float>>);
  View deduced_const(constant);
  static_assert(std::is_same_v<decltype(deduced_const), View<const float>>);
}

TEST_CASE("Buffer owns zeroed host memory") {
  Buffer<float> buffer(1000);
  CHECK(buffer.size() == 1000);
  CHECK(buffer.size_bytes() == 4000);
  CHECK_FALSE(buffer.empty());
  REQUIRE(buffer.data() != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(buffer.data()) %
            tandem::space_allocator<tandem::host>::alignment ==
        0);
  CHECK(std::all_of(buffer.begin(), buffer.end(), [](float x) { return x == 0.0f; }));
  CHECK(buffer.shape() == Shape{1000});

  Buffer<tandem::half> halves(3);
  CHECK(halves[0].bits == 0);
  Buffer<tandem::bfloat16> bf16(3);
  CHECK(bf16[2].bits == 0);

  buffer[7] = 3.0f;
  const Buffer<float>& constant = buffer;
  CHECK(constant[7] == 3.0f);
  static_assert(std::is_same_v<decltype(constant.data()), const float*>);
  static_assert(std::is_same_v<decltype(constant[0]), const float&>);
  CHECK(std::accumulate(constant.begin(), constant.end(), 0.0f) == 3.0f);
}

TEST_CASE("Buffer with a shape, and empty buffers") {
  Buffer<double> matrix(Shape{4, 5});
  CHECK(matrix.size() == 20);
  CHECK(matrix.shape() == Shape{4, 5});
  CHECK(matrix.view().shape() == Shape{4, 5});

  Buffer<double> scalar(Shape{});
  CHECK(scalar.size() == 1);
  CHECK(scalar.shape() == Shape{});

  Buffer<double> none(0);
  CHECK(none.empty());
  CHECK(none.data() == nullptr);
  CHECK(none.shape() == Shape{0});

  const Buffer<double> defaulted;
  CHECK(defaulted.empty());
  CHECK(defaulted.data() == nullptr);
  CHECK(defaulted.shape() == Shape{0});
}

TEST_CASE("Buffer moves and leaves the source empty") {
  Buffer<std::int32_t> source(Shape{2, 3});
  source[4] = 42;
  std::int32_t* const storage = source.data();

  Buffer<std::int32_t> moved(std::move(source));
  CHECK(moved.data() == storage);
  CHECK(moved.size() == 6);
  CHECK(moved.shape() == Shape{2, 3});
  CHECK(moved[4] == 42);
  CHECK(source.data() == nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
  CHECK(source.size() == 0);
  CHECK(source.empty());
  CHECK(source.shape() == Shape{0});

  Buffer<std::int32_t> target(10);
  target = std::move(moved);
  CHECK(target.data() == storage);
  CHECK(target.size() == 6);
  CHECK(target.shape() == Shape{2, 3});
  CHECK(moved.empty());  // NOLINT(bugprone-use-after-move)

  // Self-move-assignment leaves the buffer intact.
  Buffer<std::int32_t>& alias = target;
  target = std::move(alias);
  CHECK(target.data() == storage);
  CHECK(target[4] == 42);

  // A moved-from buffer can be reused.
  source = Buffer<std::int32_t>(2);
  CHECK(source.size() == 2);

  static_assert(!std::is_copy_constructible_v<Buffer<float>>);
  static_assert(!std::is_copy_assignable_v<Buffer<float>>);
  static_assert(std::is_nothrow_move_constructible_v<Buffer<float>>);
  static_assert(std::is_nothrow_move_assignable_v<Buffer<float>>);
}

TEST_CASE("Buffer::view shares the storage and keeps the shape") {
  Buffer<float> buffer(Shape{2, 2});
  const auto view = buffer.view();
  static_assert(std::is_same_v<decltype(view), const View<float, tandem::host>>);
  view[3] = 9.0f;
  CHECK(buffer[3] == 9.0f);
  CHECK(view.data() == buffer.data());
  CHECK(view.shape() == Shape{2, 2});

  const Buffer<float>& constant = buffer;
  const auto read_only = constant.view();
  static_assert(std::is_same_v<decltype(read_only), const View<const float, tandem::host>>);
  CHECK(read_only[3] == 9.0f);

  // A Buffer is itself a Tensor: tandem::view and the View constructor take it (flat).
  CHECK(tandem::view(buffer).data() == buffer.data());
  const View<const float> converted = buffer;
  CHECK(converted.size() == 4);
}

TEST_CASE("space_allocator<host> rejects sizes that overflow") {
  using allocator = tandem::space_allocator<tandem::host>;
  CHECK(allocator::allocate<float>(0) == nullptr);
  CHECK_THROWS_AS((void)allocator::allocate<double>(static_cast<std::size_t>(-1) / 4),
                  std::bad_array_new_length);
  allocator::deallocate<float>(nullptr, 0);  // a no-op
  float* p = allocator::allocate<float>(3);
  CHECK(p != nullptr);
  allocator::deallocate(p, 3);
}
