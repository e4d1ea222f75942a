// The CPU half of the memory-space copies and stream-aware Buffers: space_copy between host and
// pinned memory is a plain copy (no CUDA needed), what a host Buffer made for an executor looks
// like, and that host allocations keep no per-allocation state.
#include <doctest/doctest.h>

#include <cstddef>
#include <type_traits>
#include <vector>

#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace {

using tandem::host;
using tandem::pinned;

// The signature the CPU communicators take a copy function with (comm/detail/staging.hpp).
using copy_function = void (*)(void*, const void*, std::size_t);
static_assert(
    std::is_convertible_v<decltype(&tandem::space_copy<host, pinned>::copy), copy_function>);
static_assert(noexcept(tandem::space_copy<pinned, host>::copy(nullptr, nullptr, 0)));
static_assert(std::is_empty_v<tandem::allocation_state<host>>);
static_assert(std::is_empty_v<tandem::allocation_state<pinned>>);
static_assert(!std::is_empty_v<tandem::allocation_state<tandem::device>>);
static_assert(std::is_constructible_v<tandem::Buffer<float>, std::size_t, tandem::host_exec>);

template <class To, class From>
void check_pair() {
  std::vector<double> from{1.5, -2.25, 3.0, 1e300}, to(4, 0.0);
  tandem::space_copy<To, From>::copy(to.data(), from.data(), from.size() * sizeof(double));
  CHECK(to == from);
  tandem::space_copy<To, From>::copy(nullptr, nullptr, 0);  // nothing to copy: no access
}

}  // namespace

TEST_CASE("space_copy between host and pinned memory copies the bytes") {
  check_pair<host, host>();
  check_pair<host, pinned>();
  check_pair<pinned, host>();
  check_pair<pinned, pinned>();
}

TEST_CASE("a host Buffer made for an executor is an ordinary zeroed Buffer") {
  tandem::Buffer<float> flat(5, tandem::on_host);
  CHECK(flat.size() == 5);
  for (float value : flat) CHECK(value == 0.0f);
  tandem::Buffer<int> shaped(tandem::Shape{2, 3}, tandem::on_host);
  CHECK(shaped.shape() == tandem::Shape{2, 3});
  CHECK(shaped.size() == 6);
  shaped[5] = 7;
  tandem::Buffer<int> moved(std::move(shaped));
  CHECK(moved[5] == 7);
  CHECK(shaped.data() == nullptr);
  tandem::Buffer<int> empty(0, tandem::on_host);
  CHECK(empty.data() == nullptr);
}
