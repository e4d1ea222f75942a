// tandem::SyncBatchNorm on a GPU: PyTorch's numbers (syncbn.txt) on 1, 2 and 3 LocalComm ranks
// with every tensor in device memory (LocalComm stages them through pinned memory), on the
// default stream and on a non-blocking one; the errors that read values back; a Parameters arena
// in device memory. It also instantiates the module for NcclComm and for GlooComm with device
// tensors when those are built (compile-time checks only: one GPU cannot host NCCL ranks).
// Without a GPU it prints "SKIPPED: no CUDA device ..." and exits 77 (its own main, hence
// NO_MAIN). Tolerances: see syncbn_golden.hpp; nvcc contracts a * b + c into FMAs, which moves
// double results by an ulp or so, far inside them.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "tandem/cuda.hpp"
#if TANDEM_TEST_NCCL
#include "tandem/comm/nccl/nccl.hpp"
#endif
#if TANDEM_TEST_GLOO
#include "tandem/comm/gloo/gloo.hpp"
#endif
#include "syncbn_golden.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/nn/sync_batch_norm.hpp"

// Every member compiled for device memory, whether or not a test below calls it.
template class tandem::SyncBatchNorm<tandem::LocalComm, float, tandem::device>;
template class tandem::SyncBatchNorm<tandem::LocalComm, double, tandem::device>;
#if TANDEM_TEST_NCCL
static_assert(std::same_as<tandem::SyncBatchNorm<tandem::NcclComm>::memory_space, tandem::device>);
template class tandem::SyncBatchNorm<tandem::NcclComm, float>;
#endif
#if TANDEM_TEST_GLOO
template class tandem::SyncBatchNorm<tandem::GlooComm, float, tandem::device>;
#endif

namespace {

using namespace std::chrono_literals;
using tandem::Buffer;
using tandem::cuda_exec;
using tandem::device;
using tandem::LocalComm;
using tandem::Shape;
using tandem::test::Failures;
using tandem::test::syncbn::assign;
using tandem::test::syncbn::expect_close;
using tandem::test::syncbn::filled;
using tandem::test::syncbn::GoldenCase;
using tandem::test::syncbn::host_copy;
using tandem::test::syncbn::in_space;

using DeviceBN = tandem::SyncBatchNorm<LocalComm, float, device>;
static_assert(std::same_as<DeviceBN::executor_type, cuda_exec>);
static_assert(std::same_as<DeviceBN::memory_space, device>);

template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const tandem::Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE_TEMPLATE("on a GPU, SyncBatchNorm matches PyTorch on 1, 2 and 3 ranks", T, float,
                   double) {
  for (const char* name : {"r2", "r2empty", "r3", "w1"}) {
    CAPTURE(name);
    const GoldenCase gc(name);
    Failures failures;
    tandem::run_local(gc.world,
                      [&](LocalComm& comm) {
                        tandem::test::syncbn::check_golden_rank<T, device>(comm, name, failures);
                      },
                      {.timeout = 120s});
    failures.report();
  }
}

TEST_CASE("on a GPU, SyncBatchNorm on a non-blocking stream matches PyTorch") {
  const GoldenCase gc("r3");
  Failures failures;
  tandem::run_local(gc.world,
                    [&](LocalComm& comm) {
                      const tandem::cuda::Stream stream;
                      tandem::test::syncbn::check_golden_rank<float, device>(
                          comm, "r3", failures, cuda_exec{stream.get()});
                      tandem::cuda::check(cudaStreamSynchronize(stream.get()),
                                          "cudaStreamSynchronize");
                    },
                    {.timeout = 120s});
  failures.report();
}

TEST_CASE("on a GPU, the errors that need values read back name their cause") {
  std::vector<std::string> messages(4);
  std::vector<std::int64_t> tracked(2, -1);
  tandem::run_local(
      2,
      [&](LocalComm& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        const std::int64_t channels = 3 + comm.rank();
        DeviceBN disagree(comm, channels);
        Buffer<float, device> x(Shape{2, channels, 2});
        Buffer<float, device> y(x.shape());
        messages[r] = error_of([&] { disagree.forward(x.view(), y.view()); });

        DeviceBN bn(comm, 2);
        const auto one = in_space<float, device>(filled<float>(
            Shape{comm.rank() == 0 ? 1 : 0, 2},
            comm.rank() == 0 ? std::vector<double>{1.0, 2.0} : std::vector<double>{}));
        Buffer<float, device> one_out(one.shape());
        messages[2 + r] = error_of([&] { bn.forward(one.view(), one_out.view()); });
        tracked[r] = bn.num_batches_tracked();
      },
      {.timeout = 60s});
  for (std::size_t r = 0; r < 2; ++r) {
    CHECK(tracked[r] == 0);
    CAPTURE(messages[r]);
    CAPTURE(messages[2 + r]);
    CHECK(contains(messages[r], "disagree on the number of channels"));
    CHECK((contains(messages[r], "rank 1 has 4") || contains(messages[r], "rank 0 has 3")));
    CHECK(contains(messages[2 + r],
                   "expected more than 1 value per channel when training, got 1 across 2 ranks"));
  }
}

TEST_CASE("on a GPU, parameters and buffers can live in a Parameters arena") {
  const GoldenCase gc("r2");
  Failures failures;
  tandem::run_local(
      gc.world,
      [&](LocalComm& comm) {
        const std::string prefix = "s0/r" + std::to_string(comm.rank());
        tandem::Parameters<float, device> arena;
        DeviceBN bn(comm, arena, "bn.", gc.channels, gc.options);
        arena.finalize(cuda_exec{});
        bn.reset_parameters();
        bn.executor().synchronize();  // before the synchronous copies below
        assign(arena["bn.weight"].value(), gc.at("weight"));
        assign(arena["bn.bias"].value(), gc.at("bias"));
        const Shape shape = gc.shapes[static_cast<std::size_t>(comm.rank())];
        const auto x = in_space<float, device>(filled<float>(shape, gc.at(prefix + "/input")));
        const auto dy =
            in_space<float, device>(filled<float>(shape, gc.at(prefix + "/grad_output")));
        Buffer<float, device> y(shape);
        Buffer<float, device> dx(shape);
        bn.forward(x.view(), y.view());
        bn.backward(x.view(), dy.view(), dx.view());
        bn.executor().synchronize();
        expect_close<float>(failures, "output", host_copy<float, device>(y.view()).view(),
                            gc.at(prefix + "/output"));
        expect_close<float>(failures, "grad_input", host_copy<float, device>(dx.view()).view(),
                            gc.at(prefix + "/grad_input"));
        expect_close<float>(failures, "grad of bn.weight",
                            host_copy<float, device>(arena["bn.weight"].grad()).view(),
                            gc.at(prefix + "/grad_weight"));
        expect_close<float>(failures, "bn.running_var",
                            host_copy<float, device>(arena["bn.running_var"].value()).view(),
                            gc.at("s0/running_var"), 4.0);
        failures.expect(bn.num_batches_tracked() == 1, "num_batches_tracked ",
                        bn.num_batches_tracked());
      },
      {.timeout = 60s});
  failures.report();
}

int main(int argc, char** argv) {
  if (tandem::cuda::device_count() == 0) {
    std::printf(
        "SKIPPED: no CUDA device (cudaGetDeviceCount found none); SyncBatchNorm's device path "
        "was compiled but not run\n");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
