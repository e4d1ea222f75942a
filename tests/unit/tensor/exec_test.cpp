#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/exec.hpp"

namespace {

struct Axpy {
  float a;
  const float* x;
  float* y;
  TANDEM_HD void operator()(std::size_t i) const { y[i] += a * x[i]; }
};

struct NonFinite {
  const tandem::half* x;
  TANDEM_HD int operator()(std::size_t i) const {
    return std::isfinite(static_cast<float>(x[i])) ? 0 : 1;
  }
};

static_assert(tandem::Executor<tandem::host_exec>);
static_assert(tandem::ExecutorFor<tandem::host_exec, tandem::host>);
static_assert(tandem::ExecutorFor<tandem::host_exec, tandem::pinned>);
static_assert(!tandem::ExecutorFor<tandem::host_exec, tandem::device>);
static_assert(!tandem::Executor<int>);
static_assert(std::same_as<tandem::default_executor_t<tandem::pinned>, tandem::host_exec>);

}  // namespace

TEST_CASE("host_exec runs an element-wise functor over every index exactly once") {
  std::vector<float> x(1000), y(1000, 1.0f);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  tandem::for_each_index(tandem::on_host, x.size(), Axpy{2.0f, x.data(), y.data()});
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(y[i] == 1.0f + 2.0f * static_cast<float>(i));

  std::vector<int> visits(17, 0);
  tandem::for_each_index(tandem::on_host, visits.size(), [&](std::size_t i) { ++visits[i]; });
  for (int count : visits) CHECK(count == 1);
  tandem::for_each_index(tandem::on_host, 0, [&](std::size_t) { FAIL("called for n = 0"); });
}

TEST_CASE("host_exec reductions combine left to right from init") {
  // Left-to-right order is observable with a non-commutative combine.
  auto digits = tandem::transform_reduce(
      tandem::on_host, 4, 0L, [](std::size_t i) { return static_cast<long>(i + 1); },
      [](long a, long b) { return a * 10 + b; });
  CHECK(digits == 1234);
  CHECK(tandem::transform_reduce(
            tandem::on_host, 0, 7, [](std::size_t) { return 1; }, tandem::plus_combine{}) == 7);

  std::vector<tandem::half> grads(64, tandem::half(1.0f));
  CHECK(tandem::transform_reduce(tandem::on_host, grads.size(), 0, NonFinite{grads.data()},
                                 tandem::max_combine{}) == 0);
  grads[41] = tandem::half(std::numeric_limits<float>::infinity());
  int found = -1;
  tandem::transform_reduce_into(tandem::on_host, &found, grads.size(), 0, NonFinite{grads.data()},
                                tandem::max_combine{});
  CHECK(found == 1);
  CHECK(tandem::transform_reduce(
            tandem::on_host, 3, 5, [](std::size_t i) { return int(i); }, tandem::min_combine{}) ==
        0);
}
