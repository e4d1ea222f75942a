// tandem::SyncBatchNorm on a GPU: the shared suite (sync_batch_norm_suite.hpp: PyTorch's numbers
// from syncbn.txt on 1, 2 and 3 LocalComm ranks, the errors that read values back, a forward whose
// collective fails, a Parameters arena in device memory) with every tensor in device memory
// (LocalComm stages them through pinned memory), and the golden numbers on a non-blocking stream.
// Each case asserts how many values its checks compared and that none differed. It also
// instantiates the module for NcclComm and for GlooComm with device tensors when those are built,
// and runs the golden cases over NcclComm (one GPU per rank: skipped by doctest with fewer GPUs
// than a case's ranks; on the simulated CUDA runtime and NCCL, label cuda-sim, they run on its 4
// devices). Without a GPU it prints "SKIPPED: no CUDA device ..." and exits 77 (its own main,
// hence NO_MAIN). Tolerances: see syncbn_golden.hpp; nvcc contracts a * b + c into FMAs, which
// moves double results by an ulp or so, far inside them.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
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
#include "sync_batch_norm_suite.hpp"
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
using tandem::cuda_exec;
using tandem::device;
using tandem::LocalComm;
using tandem::test::Failures;
using tandem::test::syncbn::GoldenCase;

using DeviceBN = tandem::SyncBatchNorm<LocalComm, float, device>;
static_assert(std::same_as<DeviceBN::executor_type, cuda_exec>);
static_assert(std::same_as<DeviceBN::memory_space, device>);

}  // namespace

TEST_CASE_TEMPLATE("on a GPU, SyncBatchNorm matches PyTorch on 1, 2 and 3 ranks", T, float,
                   double) {
  for (const char* name : {"r2", "r2empty", "r3", "w1"}) {
    CAPTURE(name);
    Failures failures;
    CHECK(tandem::test::syncbn::check_golden_case<T, device>(name, failures, 120s) > 0);
    failures.report();
  }
}

TEST_CASE("on a GPU, SyncBatchNorm on a non-blocking stream matches PyTorch") {
  const GoldenCase gc("r3");
  Failures failures;
  std::atomic<std::size_t> compared{0};
  tandem::run_local(gc.world,
                    [&](LocalComm& comm) {
                      const tandem::cuda::Stream stream;
                      compared += tandem::test::syncbn::check_golden_rank<float, device>(
                          comm, "r3", failures, cuda_exec{stream.get()});
                      tandem::cuda::check(cudaStreamSynchronize(stream.get()),
                                          "cudaStreamSynchronize");
                    },
                    {.timeout = 120s});
  CHECK(compared.load() > 0);
  failures.report();
}

#if TANDEM_TEST_NCCL
// NcclComm runs one rank per GPU: the cases of 3 ranks need 3 GPUs.
TEST_CASE_TEMPLATE("over NcclComm, one GPU per rank, SyncBatchNorm matches PyTorch" *
                       doctest::skip(tandem::cuda::device_count() < 3),
                   T, float, double) {
  for (const char* name : {"r2", "r2empty", "r3", "w1"}) {
    CAPTURE(name);
    const GoldenCase gc(name);
    Failures failures;
    std::atomic<std::size_t> compared{0};
    tandem::NcclCommOptions options;
    options.timeout = 120s;
    tandem::run_local_nccl(
        gc.world,
        [&](tandem::NcclComm& comm) {
          compared += tandem::test::syncbn::check_golden_rank<T, device>(comm, name, failures);
        },
        options);
    CHECK(compared.load() > 0);
    failures.report();
  }
}
#endif

TEST_CASE("on a GPU, the errors that need values read back name their cause") {
  Failures failures;
  CHECK(tandem::test::syncbn::check_errors_across_ranks<device>(failures, 60s) == 8);
  failures.report();
}

TEST_CASE("on a GPU, a forward whose collective fails leaves the running statistics alone") {
  Failures failures;
  CHECK(tandem::test::syncbn::check_failed_collective<device>(failures, 60s) > 0);
  failures.report();
}

TEST_CASE("on a GPU, parameters and buffers can live in a Parameters arena") {
  Failures failures;
  CHECK(tandem::test::syncbn::check_arena<device>(failures, 60s) > 0);
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
