// NcclComm across processes, one GPU each: the conformance suite at world size 2 with the ranks
// started through the environment (env://, by hand and by tandemrun when it is built) and under
// mpirun (nccl_from_mpi). NCCL runs one rank per GPU, so with fewer than 2 GPUs this prints why
// and exits 77 (skipped). The same executable is the worker: `nccl_processes env-worker` or
// `nccl_processes mpi-worker` runs one rank's checks.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <mpi.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cuda/staged_comm.hpp"
#include "support/child_process.hpp"
#include "support/collective_suite.hpp"
#include "support/free_port.hpp"
#include "support/runners.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/nccl/nccl.hpp"
#include "tandem/comm/nccl/nccl_mpi.hpp"
#include "tandem/core/world.hpp"
#include "tandem/cuda/device.hpp"
#include "tandem/cuda/runtime.hpp"

using namespace std::chrono_literals;

namespace {

using tandem::test::run_process;
using tandem::test::self_path;

tandem::test::Matrix nccl_matrix(std::vector<std::size_t> counts = {0, 1, 7, 13, 1031}) {
  tandem::test::Matrix matrix{std::move(counts)};
  matrix.tagged_send_recv = false;
  return matrix;
}

void run_suite(tandem::NcclComm comm) {
  tandem::test::StagedComm<tandem::NcclComm> staged(std::move(comm));
  tandem::test::ProcessRunner<tandem::test::StagedComm<tandem::NcclComm>> run{&staged};
  const int n = staged.size();
  tandem::test::check_all_collectives(run, n, nccl_matrix());
  tandem::test::check_subgroups(run, n, nccl_matrix({0, 1, 13}));
  tandem::test::check_local_errors(run, n);
}

std::string mode;  // "", "env-worker" or "mpi-worker"

}  // namespace

TEST_CASE("worker: one rank started through the environment (env://)") {
  if (mode != "env-worker") return;
  const tandem::World world = tandem::World::from_env();
  (void)tandem::cuda::select_device(world);
  tandem::NcclCommOptions options;
  options.timeout = 120s;
  run_suite(tandem::init_process_group<tandem::NcclComm>(world, "env://", options));
}

TEST_CASE("worker: one rank under mpirun (nccl_from_mpi)") {
  if (mode != "mpi-worker") return;
  int provided = 0;
  REQUIRE(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) == MPI_SUCCESS);
  {
    const tandem::World world = tandem::World::from_env();
    (void)tandem::cuda::select_device(world);
    tandem::NcclCommOptions options;
    options.timeout = 120s;
    run_suite(tandem::nccl_from_mpi(MPI_COMM_WORLD, options));
  }
  MPI_Finalize();
}

TEST_CASE("two processes, one GPU each, meeting through env:// variables") {
  const std::string port = std::to_string(tandem::test::free_port());
  std::vector<std::thread> ranks;
  int codes[2] = {-2, -2};
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      codes[r] = run_process({self_path(), "env-worker"},
                             {{"RANK", std::to_string(r)},
                              {"LOCAL_RANK", std::to_string(r)},
                              {"WORLD_SIZE", "2"},
                              {"LOCAL_WORLD_SIZE", "2"},
                              {"MASTER_ADDR", "127.0.0.1"},
                              {"MASTER_PORT", port}},
                             240s);
    });
  }
  for (auto& rank : ranks) rank.join();
  CHECK(codes[0] == 0);
  CHECK(codes[1] == 0);
}

#ifdef TANDEMRUN
TEST_CASE("two processes started by tandemrun") {
  CHECK(run_process({TANDEMRUN, "--standalone", "--nproc-per-node", "2", self_path(), "env-worker"},
                    {}, 240s) == 0);
}
#endif

#ifdef TANDEM_MPIEXEC
TEST_CASE("two processes under mpirun, the unique id broadcast by MPI") {
  CHECK(run_process({TANDEM_MPIEXEC, "-n", "2", "--oversubscribe", "--bind-to", "none", self_path(),
                     "mpi-worker"},
                    {}, 240s) == 0);
}
#endif

int main(int argc, char** argv) {
  if (argc > 1) mode = argv[1];
  doctest::Context context;
  if (mode.empty()) {
    const int gpus = tandem::cuda::device_count();
    if (gpus < 2) {
      std::printf("SKIPPED: %s (NCCL runs one rank per GPU; these tests need 2)\n",
                  gpus == 0 ? "no CUDA device" : "only 1 CUDA device");
      return 77;
    }
    context.addFilter("test-case-exclude", "worker:*");
  } else {
    context.addFilter("test-case", "worker:*");
  }
  return context.run();
}
