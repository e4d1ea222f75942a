// tandem::SyncBatchNorm's device path without a GPU: tensors in support/fake_device.hpp's memory
// space (ordinary memory that host code may not index: View<T, fake_device> has no operator[],
// so a host dereference on the device path is a compile error) and a fake device executor that
// runs the same TANDEM_HD functors on the host, indices in reverse order, refusing functors that
// cuda_exec could not copy into a kernel. LocalComm takes the fake device tensors by staging them
// through (fake) pinned memory, as it does real device tensors. Checked: the shared suite
// (sync_batch_norm_suite.hpp: PyTorch's numbers on 1, 2 and 3 ranks, the errors that need values
// read back, a forward whose collective fails, a Parameters arena in device memory), results
// bitwise equal to the host path's, and host waits that do not grow with the number of channels.
// Fresh fake device memory is filled with NaN bytes, as device memory is not zeroed. Tolerances:
// see syncbn_golden.hpp.
#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/fake_device_space.hpp"  // first: it specialises templates the headers below use

#include "support/collective_suite.hpp"
#include "sync_batch_norm_suite.hpp"
#include "syncbn_golden.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/nn/sync_batch_norm.hpp"

using namespace std::chrono_literals;
using tandem::Buffer;
using tandem::host;
using tandem::LocalComm;
using tandem::Shape;
using tandem::SyncBatchNorm;
using tandem::View;
using tandem::test::Failures;
using tandem::test::fake_device;
using tandem::test::fake_device_exec;
using tandem::test::syncbn::assign;
using tandem::test::syncbn::filled;
using tandem::test::syncbn::GoldenCase;
using tandem::test::syncbn::host_copy;
using tandem::test::syncbn::in_space;

namespace {

using DeviceBN = SyncBatchNorm<LocalComm, float, fake_device, fake_device_exec>;
static_assert(std::same_as<DeviceBN::memory_space, fake_device>);
static_assert(std::same_as<DeviceBN::executor_type, fake_device_exec>);
static_assert(std::same_as<decltype(std::declval<DeviceBN&>().weight()), View<float, fake_device>>);

/// Every value rank r of golden case `name` produces in step s0 (forward, backward, running
/// statistics), as raw bytes, for a module in Space.
template <class T, class Space, class Exec>
std::vector<std::vector<T>> step_results(const std::string& name) {
  const GoldenCase gc(name);
  std::vector<std::vector<T>> results(static_cast<std::size_t>(gc.world));
  tandem::run_local(
      gc.world,
      [&](LocalComm& comm) {
        const std::string prefix = "s0/r" + std::to_string(comm.rank());
        const Shape shape = gc.shapes[static_cast<std::size_t>(comm.rank())];
        SyncBatchNorm<LocalComm, T, Space, Exec> bn(comm, gc.channels, gc.options);
        assign(bn.weight(), gc.at("weight"));
        assign(bn.bias(), gc.at("bias"));
        const auto x = in_space<T, Space>(filled<T>(shape, gc.at(prefix + "/input")));
        const auto dy = in_space<T, Space>(filled<T>(shape, gc.at(prefix + "/grad_output")));
        Buffer<T, Space> y(shape);
        Buffer<T, Space> dx(shape);
        bn.forward(x.view(), y.view());
        bn.backward(x.view(), dy.view(), dx.view());
        std::vector<T> all;
        for (View<const T, Space> part :
             {std::as_const(y).view(), std::as_const(dx).view(),
              View<const T, Space>(bn.grad_weight()), View<const T, Space>(bn.grad_bias()),
              View<const T, Space>(bn.running_mean()), View<const T, Space>(bn.running_var())}) {
          const auto values = host_copy<T, Space>(part);
          all.insert(all.end(), values.data(), values.data() + values.size());
        }
        results[static_cast<std::size_t>(comm.rank())] = std::move(all);
      },
      {.timeout = 60s});
  return results;
}

}  // namespace

TEST_CASE_TEMPLATE("on device memory, SyncBatchNorm matches PyTorch on 1, 2 and 3 ranks", T, float,
                   double) {
  for (const char* name : {"r2", "r2empty", "r3", "w1"}) {
    CAPTURE(name);
    Failures failures;
    CHECK(tandem::test::syncbn::check_golden_case<T, fake_device>(name, failures, 60s,
                                                                  fake_device_exec{}) > 0);
    failures.report();
    CHECK(tandem::test::staging_counters.pinned_live.load() == 0);
  }
}

TEST_CASE("the device path computes bit for bit what the host path computes") {
  for (const char* name : {"r2", "r3"}) {
    CAPTURE(name);
    const auto on_host = step_results<float, host, tandem::host_exec>(name);
    const auto on_device = step_results<float, fake_device, fake_device_exec>(name);
    REQUIRE(on_host.size() == on_device.size());
    for (std::size_t r = 0; r < on_host.size(); ++r) {
      CAPTURE(r);
      REQUIRE(on_host[r].size() == on_device[r].size());
      CHECK(std::memcmp(on_host[r].data(), on_device[r].data(),
                        on_host[r].size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("a synchronised step waits on the host a fixed number of times, whatever C is") {
  // One rank's host waits and reads back in its second training step (the first also checks
  // num_features once), for 2 and for 64 channels.
  auto second_step = [](std::int64_t channels) {
    std::vector<int> waits(2, -1);
    std::vector<int> reads(2, -1);
    tandem::run_local(
        2,
        [&](LocalComm& comm) {
          const Shape shape{3, channels, 5};
          Buffer<float> values(shape);
          for (std::size_t i = 0; i < values.size(); ++i) {
            values[i] = float((i * 7 + std::size_t(comm.rank())) % 11);
          }
          const auto x = in_space<float, fake_device>(values);
          Buffer<float, fake_device> y(shape);
          Buffer<float, fake_device> dx(shape);
          DeviceBN bn(comm, channels);
          bn.forward(x.view(), y.view());
          bn.backward(x.view(), x.view(), dx.view());
          comm.barrier();  // the counters are per process: both ranks start counting together
          const int waits_before = fake_device_exec::host_waits.load();
          const int reads_before = tandem::test::reads_back.load();
          comm.barrier();
          bn.forward(x.view(), y.view());
          bn.backward(x.view(), x.view(), dx.view());
          comm.barrier();
          if (comm.rank() == 0) {
            waits[0] = fake_device_exec::host_waits.load() - waits_before;
            reads[0] = tandem::test::reads_back.load() - reads_before;
          }
        },
        {.timeout = 30s});
    return std::pair{waits[0], reads[0]};
  };
  const auto [waits_2, reads_2] = second_step(2);
  const auto [waits_64, reads_64] = second_step(64);
  CAPTURE(waits_2);
  CAPTURE(reads_2);
  // Per rank: a wait before each staged collective (all_gather, all_reduce) and one before the
  // total count is read back (the only read back); both ranks counted.
  CHECK(waits_2 == 2 * 3);
  CHECK(reads_2 == 2 * 1);
  CHECK(waits_64 == waits_2);
  CHECK(reads_64 == reads_2);
}

TEST_CASE("on device memory, the errors that need values read back name their cause") {
  Failures failures;
  CHECK(tandem::test::syncbn::check_errors_across_ranks<fake_device, fake_device_exec>(failures,
                                                                                       30s) == 8);
  failures.report();
}

TEST_CASE("on device memory, a failed collective leaves the running statistics alone") {
  Failures failures;
  CHECK(tandem::test::syncbn::check_failed_collective<fake_device, fake_device_exec>(failures,
                                                                                     30s) > 0);
  failures.report();
}

TEST_CASE("on device memory, parameters and buffers can live in a Parameters arena") {
  Failures failures;
  CHECK(tandem::test::syncbn::check_arena<fake_device, fake_device_exec>(failures, 30s) > 0);
  failures.report();
}
