// tandem::Parameters: registration, flat layout, lookup, zero_grad and the errors it promises.
#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "support/error_of.hpp"
#include "tandem/arena/parameters.hpp"

using tandem::test::contains;
using tandem::test::error_of;

TEST_CASE_TEMPLATE("parameters lie contiguously in registration order", T, float, double,
                   tandem::half, tandem::bfloat16) {
  tandem::Parameters<T> params;
  auto& w1 = params.add("fc1.weight", {4, 3});
  auto& b1 = params.add("fc1.bias", {4});
  auto& mean = params.add_buffer("bn.running_mean", {4});
  auto& count = params.add_buffer("bn.num_batches_tracked", {}, tandem::BufferKind::integral);
  auto& w2 = params.add("fc2.weight", {2, 4});
  CHECK_FALSE(params.finalized());
  params.finalize();
  CHECK(params.finalized());

  CHECK(params.size() == 3);
  CHECK(params.numel() == 12 + 4 + 8);
  CHECK(params.buffer_count() == 2);
  CHECK(params.buffer_numel() == 4 + 1);
  CHECK(params.values().size() == params.numel());
  CHECK(params.grads().size() == params.numel());
  CHECK(params.buffer_values().size() == params.buffer_numel());

  CHECK(w1.offset() == 0);
  CHECK(b1.offset() == 12);
  CHECK(w2.offset() == 16);
  CHECK(w2.index() == 2);
  CHECK(mean.offset() == 0);
  CHECK(count.offset() == 4);
  CHECK(count.index() == 1);
  CHECK(count.kind() == tandem::BufferKind::integral);
  CHECK(mean.kind() == tandem::BufferKind::floating);
  CHECK(count.is_buffer());
  CHECK_FALSE(w1.is_buffer());
  CHECK(count.size() == 1);

  CHECK(w1.value().shape() == tandem::Shape{4, 3});
  CHECK(w2.grad().shape() == tandem::Shape{2, 4});
  CHECK(w2.value().data() == params.values().data() + 16);
  CHECK(w2.grad().data() == params.grads().data() + 16);
  CHECK(count.value().data() == params.buffer_values().data() + 4);

  std::vector<std::string> names;
  for (auto& p : params) names.push_back(p.name());
  CHECK(names == std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight"});
  names.clear();
  for (auto& b : params.buffers()) names.push_back(b.name());
  CHECK(names == std::vector<std::string>{"bn.running_mean", "bn.num_batches_tracked"});

  // Host storage starts at zero.
  for (auto v : params.values()) CHECK(static_cast<float>(v) == 0.0f);
  for (auto v : params.buffer_values()) CHECK(static_cast<float>(v) == 0.0f);
}

TEST_CASE("lookup by name finds parameters and buffers, and names what it cannot find") {
  tandem::Parameters<float> params;
  auto& w = params.add("w", {2});
  auto& b = params.add_buffer("stats", {3});
  params.finalize();
  CHECK(&params["w"] == &w);
  CHECK(&params["stats"] == &b);
  CHECK(params.find("w") == &w);
  CHECK(params.find("nope") == nullptr);
  const auto& constant = params;
  CHECK(&constant["w"] == &w);
  CHECK(constant.find("stats") == &b);
  CHECK(contains(error_of([&] { (void)params["nope"]; }), "'nope'"));
}

TEST_CASE("registration errors name the parameter") {
  tandem::Parameters<float> params;
  params.add("w", {2});
  CHECK(contains(error_of([&] { params.add("w", {3}); }), "'w' is already registered"));
  CHECK(contains(error_of([&] { params.add_buffer("w", {3}); }), "'w' is already registered"));
  CHECK(contains(error_of([&] { params.add("", {3}); }), "non-empty name"));
  CHECK(contains(error_of([&] { (void)params["w"].value(); }), "before Parameters::finalize"));
  CHECK(contains(error_of([&] { (void)params.grads(); }), "before finalize"));
  CHECK(contains(error_of([&] { params.zero_grad(); }), "before Parameters::finalize"));
  params.finalize();
  CHECK(contains(error_of([&] { params.add("late", {1}); }),
                 "cannot register 'late' after Parameters::finalize()"));
  CHECK(contains(error_of([&] { params.add_buffer("late", {1}); }), "'late'"));
  CHECK(contains(error_of([&] { params.finalize(); }), "already finalized"));
}

TEST_CASE("a buffer has no gradient") {
  tandem::Parameters<float> params;
  auto& stats = params.add_buffer("bn.running_var", {3});
  params.finalize();
  CHECK(contains(error_of([&] { (void)stats.grad(); }), "'bn.running_var' is a buffer"));
}

TEST_CASE_TEMPLATE("zero_grad clears every gradient and nothing else", T, float, tandem::half,
                   tandem::bfloat16) {
  tandem::Parameters<T> params;
  params.add("a", {5});
  params.add("b", {2, 2});
  params.add_buffer("s", {2});
  params.finalize();
  for (auto& v : params.values()) v = T(1.5f);
  for (auto& g : params.grads()) g = T(-2.0f);
  for (auto& s : params.buffer_values()) s = T(3.0f);
  params.zero_grad();
  for (auto g : params.grads()) CHECK(static_cast<float>(g) == 0.0f);
  for (auto v : params.values()) CHECK(static_cast<float>(v) == 1.5f);
  for (auto s : params.buffer_values()) CHECK(static_cast<float>(s) == 3.0f);

  for (auto& g : params.grads()) g = T(4.0f);
  params.zero_grad(tandem::on_host);
  for (auto g : params.grads()) CHECK(static_cast<float>(g) == 0.0f);
}

TEST_CASE("references survive more registrations, finalize and moving the arena") {
  tandem::Parameters<float> params;
  auto& first = params.add("first", {1});
  for (int i = 0; i < 1000; ++i) params.add("p" + std::to_string(i), {3});
  params.finalize();
  params["p999"].value()[2] = 7.0f;
  tandem::Parameters<float> moved = std::move(params);
  CHECK(first.name() == "first");
  CHECK(&moved["first"] == &first);
  CHECK(first.value().data() == moved.values().data());
  CHECK(moved["p999"].value()[2] == 7.0f);
  CHECK(moved.values()[moved.numel() - 1] == 7.0f);
  static_assert(!std::is_copy_constructible_v<tandem::Parameters<float>>);
}

TEST_CASE("a scalar parameter holds one element and an empty one none") {
  tandem::Parameters<double> params;
  auto& scalar = params.add("scale", {});
  auto& empty = params.add("nothing", {0, 4});
  auto& after = params.add("after", {2});
  params.finalize();
  CHECK(scalar.size() == 1);
  CHECK(empty.size() == 0);
  CHECK(after.offset() == 1);
  CHECK(params.numel() == 3);
}

TEST_CASE("swap_values and swap_buffer_values exchange storage in O(1) and check sizes") {
  tandem::Parameters<float> params;
  auto& w = params.add("w", {2, 2});
  params.add_buffer("running", {3});
  CHECK_THROWS_WITH_AS(
      [&] {
        tandem::Buffer<float> early(4);
        params.swap_values(early);
      }(),
      "tandem: Parameters::swap_values: no storage before finalize()", tandem::Error);
  params.finalize();
  for (auto& v : params.values()) v = 1.0f;

  tandem::Buffer<float> other(4);
  for (auto& v : other) v = 5.0f;
  const float* arena_storage = params.values().data();
  const float* other_storage = other.data();
  params.swap_values(other);
  CHECK(params.values().data() == other_storage);
  CHECK(other.data() == arena_storage);
  CHECK(w.value()[3] == 5.0f);  // a Parameter follows the swap
  CHECK(other[0] == 1.0f);      // nothing was copied or lost

  tandem::Buffer<float> buffers(3);
  buffers[2] = 9.0f;
  params.swap_buffer_values(buffers);
  CHECK(params["running"].value()[2] == 9.0f);

  tandem::Buffer<float> wrong(5);
  CHECK_THROWS_WITH_AS(params.swap_values(wrong),
                       "tandem: Parameters::swap_values: the other buffer holds 5 elements, the "
                       "arena 4",
                       tandem::Error);
  CHECK(params.values().data() == other_storage);  // unchanged by the failed call
}

TEST_CASE("move_grads moves the gradients where no view of them was taken, and only there") {
  tandem::Parameters<float> p;
  auto& w = p.add("w", {3, 2});
  auto& b = p.add("b", {2});
  CHECK_THROWS_AS((void)p.move_grads(nullptr, nullptr), tandem::Error);  // before finalize
  p.finalize();
  CHECK_FALSE(p.grads_viewed());
  CHECK_THROWS_AS((void)p.move_grads(nullptr, nullptr), tandem::Error);  // no memory
  auto home = std::make_shared<std::vector<float>>(8, -1.0f);
  CHECK(p.move_grads(home->data(), home));
  CHECK(p.grads().data() == home->data());  // the gradients are there now, zeroed as before
  CHECK(p.grads_viewed());
  for (const float g : *home) CHECK(g == 0.0f);
  w.grad()[5] = 2.0f;
  b.grad()[1] = 3.0f;
  CHECK((*home)[5] == 2.0f);
  CHECK((*home)[7] == 3.0f);
  p.zero_grad();
  CHECK((*home)[7] == 0.0f);
  // A view was taken: the gradients stay.
  auto other = std::make_shared<std::vector<float>>(8);
  CHECK_FALSE(p.move_grads(other->data(), other));
  CHECK(p.grads().data() == home->data());
  // A Parameter's grad() counts as a view too.
  tandem::Parameters<float> q;
  auto& v = q.add("v", {4});
  q.finalize();
  v.grad()[0] = 1.0f;
  CHECK(q.grads_viewed());
  CHECK_FALSE(q.move_grads(other->data(), other));
}
