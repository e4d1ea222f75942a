// NcclComm across processes, one GPU each: the conformance suite at world size 2 with the ranks
// started through the environment (env://, by hand and by tandemrun when it is built), at 3 and 4
// ranks by tandemrun, and at 2 under mpirun (nccl_from_mpi); and the never-hang paths across
// processes: a rank stopped by SIGSTOP (the others' watchdogs time out, each naming its rank, the
// operation and its sequence number) and a rank that dies (the others fail with NCCL's remote
// error, without waiting for the timeout). NCCL runs one rank per GPU, so with fewer than 2 GPUs
// this prints why and exits 77 (skipped), and a case needing more GPUs than there are is reported
// as skipped by doctest. On the simulated CUDA runtime and NCCL (cuda-sim: 4 devices per
// process, communicators across processes in shared memory) every case runs. The same executable
// is the worker: `nccl_processes env-worker` (or mpi-worker, stop-worker, crash-worker) runs one
// rank's part.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#if TANDEM_TEST_MPI
#include <mpi.h>
#endif
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
#if TANDEM_TEST_MPI
#include "tandem/comm/nccl/nccl_mpi.hpp"
#endif
#include "tandem/core/world.hpp"
#include "tandem/cuda/device.hpp"
#include "tandem/cuda/memory.hpp"
#include "tandem/cuda/runtime.hpp"

using namespace std::chrono_literals;

namespace {

using tandem::test::run_process;
using tandem::test::self_path;
using tandem::test::start_process;

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

std::string mode;  // "", "env-worker", "mpi-worker", "stop-worker" or "crash-worker"

int gpus() {
  return tandem::cuda::device_count();
}

/// The rank that stops or dies in the stop and crash cases.
constexpr int odd_rank = 1;

/// One rank of a group started through env:// that runs one all_reduce with every rank, after
/// which odd_rank stops itself (SIGSTOP) or dies (_Exit) and the others issue a second one: that
/// must end in an Error containing `expected`, not in a hang. Exit code 0 when it did.
int lose_a_rank(bool stop, tandem::Timeout timeout, const std::string& expected) {
  const tandem::World world = tandem::World::from_env();
  (void)tandem::cuda::select_device(world);
  tandem::NcclCommOptions options;
  options.timeout = timeout;
  options.watchdog_interval = std::chrono::milliseconds(50);
  auto comm = tandem::init_process_group<tandem::NcclComm>(world, "env://", options);
  tandem::Buffer<float, tandem::device> data(64);
  comm.all_reduce(data.view());  // on every rank
  comm.synchronize();
  if (comm.rank() == odd_rank) {
    if (stop) ::raise(SIGSTOP);  // the test kills it while it is stopped
    std::_Exit(9);
  }
  try {
    comm.all_reduce(data.view());  // odd_rank never joins this one
    comm.synchronize();
    std::printf("FAILED: rank %d finished an all_reduce without rank %d\n", comm.rank(), odd_rank);
    return 1;
  } catch (const tandem::Error& e) {
    const std::string text = e.what();
    // (Its sequence number counts the check-switch agreement made at init too.)
    const std::string named =
        "rank " + std::to_string(comm.rank()) + ": all_reduce (sequence number ";
    const bool ok =
        text.find(named) != std::string::npos && text.find(expected) != std::string::npos;
    std::printf("%s: rank %d: %s\n", ok ? "PASSED" : "FAILED", comm.rank(), text.c_str());
    return ok ? 0 : 1;
  }
}

/// Waits for `pid` until `limit`: "exit N", "signal N", "stopped", or "running" when the limit
/// passed (then it is killed). With `until_stopped`, a stop ends the wait too.
std::string wait_process(pid_t pid, std::chrono::seconds limit, bool until_stopped) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG | (until_stopped ? WUNTRACED : 0)) == pid) {
      if (WIFSTOPPED(status)) return "stopped";
      if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
      return "signal " + std::to_string(WTERMSIG(status));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return "running";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

/// Three ranks through env://, odd_rank lost after the first all_reduce (stop-worker or
/// crash-worker): the other two must end with exit code 0 (their Error was the expected one).
void check_lost_rank(const char* worker) {
  constexpr int ranks = 3;
  const std::string port = std::to_string(tandem::test::free_port());
  std::vector<pid_t> pids;
  for (int r = 0; r < ranks; ++r) {
    pids.push_back(
        start_process({self_path(), worker}, {{"RANK", std::to_string(r)},
                                              {"LOCAL_RANK", std::to_string(r)},
                                              {"WORLD_SIZE", std::to_string(ranks)},
                                              {"LOCAL_WORLD_SIZE", std::to_string(ranks)},
                                              {"MASTER_ADDR", "127.0.0.1"},
                                              {"MASTER_PORT", port}}));
  }
  const bool stop = std::string(worker) == "stop-worker";
  // The lost rank first: it stops (or dies) once the first all_reduce is done.
  const std::string lost = wait_process(pids[odd_rank], std::chrono::seconds(120), true);
  CHECK(lost == (stop ? "stopped" : "exit 9"));
  for (int r = 0; r < ranks; ++r) {
    if (r == odd_rank) continue;
    INFO("rank " << r);
    CHECK(wait_process(pids[static_cast<std::size_t>(r)], std::chrono::seconds(120), false) ==
          "exit 0");
  }
  if (lost == "stopped") {
    ::kill(-pids[odd_rank], SIGKILL);
    CHECK(wait_process(pids[odd_rank], std::chrono::seconds(60), false) == "signal 9");
  }
}

}  // namespace

TEST_CASE("worker: one rank started through the environment (env://)") {
  if (mode != "env-worker") return;
  const tandem::World world = tandem::World::from_env();
  (void)tandem::cuda::select_device(world);
  tandem::NcclCommOptions options;
  options.timeout = 120s;
  run_suite(tandem::init_process_group<tandem::NcclComm>(world, "env://", options));
}

TEST_CASE("worker: one rank that stops or dies after one all_reduce, or sees another do it") {
  if (mode == "stop-worker") {
    // The watchdog's timeout is what ends the wait for a stopped rank.
    CHECK(lose_a_rank(true, std::chrono::seconds(5), "did not finish within 5 s") == 0);
  } else if (mode == "crash-worker") {
    // A dead peer is NCCL's remote error, reported long before the (far) timeout.
    CHECK(lose_a_rank(false, std::chrono::seconds(120), "ncclRemoteError") == 0);
  }
}

#if TANDEM_TEST_MPI
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
#endif

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

TEST_CASE("three processes started by tandemrun" * doctest::skip(gpus() < 3)) {
  CHECK(run_process({TANDEMRUN, "--standalone", "--nproc-per-node", "3", self_path(), "env-worker"},
                    {}, 240s) == 0);
}

TEST_CASE("four processes started by tandemrun" * doctest::skip(gpus() < 4)) {
  CHECK(run_process({TANDEMRUN, "--standalone", "--nproc-per-node", "4", self_path(), "env-worker"},
                    {}, 240s) == 0);
}
#endif

TEST_CASE("a stopped rank: the others' watchdogs time out, each naming itself and the operation" *
          doctest::skip(gpus() < 3)) {
  check_lost_rank("stop-worker");
}

TEST_CASE("a rank that dies: the others fail with NCCL's remote error, not a hang" *
          doctest::skip(gpus() < 3)) {
  check_lost_rank("crash-worker");
}

#if defined(TANDEM_MPIEXEC) && TANDEM_TEST_MPI
TEST_CASE("two processes under mpirun, the unique id broadcast by MPI") {
  CHECK(run_process({TANDEM_MPIEXEC, "-n", "2", "--oversubscribe", "--bind-to", "none", self_path(),
                     "mpi-worker"},
                    {}, 240s) == 0);
}
#endif

int main(int argc, char** argv) {
  if (argc > 1 && argv[1][0] != '-') mode = argv[1];  // a worker; else doctest's options
  doctest::Context context;
  if (mode.empty()) {
    const int visible = gpus();
    if (visible < 2) {
      std::printf("SKIPPED: %s (NCCL runs one rank per GPU; these tests need 2)\n",
                  visible == 0 ? "no CUDA device" : "only 1 CUDA device");
      return 77;
    }
    context.applyCommandLine(argc, argv);
    context.addFilter("test-case-exclude", "worker:*");
  } else {
    context.addFilter("test-case", "worker:*");
  }
  return context.run();
}
