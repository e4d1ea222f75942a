// GlooComm and MpiComm given DEVICE tensors (staged through pinned memory), with 2 to 4
// processes sharing one GPU: the collective conformance suite, each rank's host containers
// uploaded to the device by StagedComm. Without a GPU it prints why and exits 77 (skipped). The
// same executable is the worker: `host_comms_device gloo-worker` or `... mpi-worker`.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/staged_comm.hpp"
#include "support/child_process.hpp"
#include "support/collective_suite.hpp"
#include "support/runners.hpp"
#include "tandem/cuda.hpp"
#if TANDEM_TEST_GLOO
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"
#endif
#if TANDEM_TEST_MPI
#include "tandem/comm/mpi/mpi.hpp"
#endif

using namespace std::chrono_literals;

namespace {

std::string mode;  // "", "gloo-worker" or "mpi-worker"

using tandem::test::run_process;
using tandem::test::self_path;

/// Every call is a process round trip over TCP or shared memory plus two device copies: the
/// rotating matrix (one mode per case), as for Gloo's own conformance test.
template <class Comm>
void run_suite(Comm comm) {
  tandem::cuda::check(cudaSetDevice(0), "cudaSetDevice");  // every rank shares the one GPU
  tandem::test::StagedComm<Comm> staged(std::move(comm));
  tandem::test::ProcessRunner<tandem::test::StagedComm<Comm>> run{&staged};
  const int n = staged.size();
  const tandem::test::Matrix matrix{{0, 1, 13, 1031}, true};
  tandem::test::check_all_collectives(run, n, matrix);
  tandem::test::check_subgroups(run, n, tandem::test::Matrix{{0, 1, 13}, true});
  staged.barrier();
}

}  // namespace

#if TANDEM_TEST_GLOO
TEST_CASE("worker: a GlooComm rank with device tensors") {
  if (mode != "gloo-worker") return;
  run_suite(tandem::init_process_group<tandem::GlooComm>("env://", {.timeout = 120s}));
}
#ifdef TANDEMRUN
TEST_CASE("GlooComm with device tensors: 2, 3 and 4 processes on one GPU") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    CHECK(run_process({TANDEMRUN, "--standalone", "--nproc-per-node", std::to_string(n),
                       self_path(), "gloo-worker"},
                      {}, 300s) == 0);
  }
}
#endif
#endif

#if TANDEM_TEST_MPI
TEST_CASE("worker: an MpiComm rank with device tensors") {
  if (mode != "mpi-worker") return;
  run_suite(tandem::MpiComm::world());
}
#ifdef TANDEM_MPIEXEC
TEST_CASE("MpiComm with device tensors: 2, 3 and 4 processes on one GPU") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    CHECK(run_process({TANDEM_MPIEXEC, "-n", std::to_string(n), "--oversubscribe", "--bind-to",
                       "none", self_path(), "mpi-worker"},
                      {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}},
                      300s) == 0);
  }
}
#endif
#endif

int main(int argc, char** argv) {
  if (argc > 1) mode = argv[1];
  doctest::Context context;
  if (mode.empty()) {
    if (tandem::cuda::device_count() == 0) {
      std::printf("SKIPPED: no CUDA device (Gloo and MPI with device tensors need one GPU)\n");
      return 77;
    }
    context.addFilter("test-case-exclude", "worker:*");
  } else {
    context.addFilter("test-case", "worker:*");
  }
  return context.run();
}
