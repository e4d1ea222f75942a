// tandem/launch/spawn.hpp - tandem::spawn, torch.multiprocessing.spawn for C++: runs a function
// as n ranks in forked processes on this machine, with the environment tandemrun would give them.
//   tandem::spawn(4, [](tandem::World world) { train(world); });   // throws if a rank fails
// Needs: POSIX and Linux (fork, prctl); CUDA must not be initialised in the calling process.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <concepts>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/launch/launcher.hpp"

namespace tandem {

/// What tandem::spawn takes: where rank 0's store listens, and how long to wait.
struct SpawnOptions {
  std::string master_addr = "127.0.0.1";  ///< the address the ranks meet at
  int master_port = 0;                    ///< 0: a free port on 127.0.0.1
  /// How long the other ranks have to end after one failed, before SIGKILL.
  Timeout grace = std::chrono::seconds(5);
  /// How long the ranks may run in all; the default waits as long as they run (they are the job).
  Timeout timeout = Timeout::max();
  Timeout monitor_interval = std::chrono::milliseconds(50);  ///< how often the ranks are polled
};

namespace detail::spawning {

template <class Fn>
int run_rank(Fn& fn, const World& world) {
  int code = 0;
  try {
    if constexpr (std::invocable<Fn&, World>) {
      fn(world);
    } else {
      fn(world.rank);
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "[rank %d] %s\n", world.rank, error.what());
    code = 1;
  } catch (...) {
    std::fprintf(stderr, "[rank %d] an exception that is not a std::exception\n", world.rank);
    code = 1;
  }
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  return code;
}

}  // namespace detail::spawning

/// Runs fn(World) or fn(int rank) in `nprocs` forked child processes, rank r in the r-th, each
/// with tandemrun's variables set (RANK, LOCAL_RANK, WORLD_SIZE, ..., MASTER_ADDR, a free
/// MASTER_PORT, TORCHELASTIC_*, and a TANDEM_STORE_TOKEN: the inherited one, or a fresh random
/// one), so World::from_env() and init_process_group(world, "env://")
/// work in fn. Waits for all. When one fails (fn throws: the message is printed to stderr behind
/// "[rank r] " and the child exits 1; or it exits non-zero; or a signal kills it), the others get
/// SIGTERM, then SIGKILL after the grace period, and spawn throws tandem::Error naming the first
/// failing rank and its exit code or signal. Children end through _exit: fn's side effects that
/// matter must be flushed or written by fn. Call it from a single-threaded process, as with any
/// fork, and before CUDA is initialised (that is refused with a tandem::Error).
template <class Fn>
requires std::invocable<Fn&, World> || std::invocable<Fn&, int>
void spawn(int nprocs, Fn fn, const SpawnOptions& options = {}) {
  if (nprocs < 1) {
    throw Error("spawn",
                "the number of processes must be at least 1, not " + std::to_string(nprocs));
  }
  if (launch::detail::cuda_initialised()) {
    throw Error("spawn",
                "CUDA is already initialised in this process and a forked child cannot use it; "
                "call spawn before any CUDA call, or start the ranks with tandemrun");
  }
  if (options.master_port < 0 || options.master_port > 65535) {
    throw Error("spawn",
                "master_port " + std::to_string(options.master_port) + " is not a port number");
  }
  launch::LaunchPlan plan;
  plan.nproc_per_node = nprocs;
  plan.master_addr = options.master_addr;
  plan.master_port = options.master_port != 0 ? options.master_port : launch::detail::free_port();
  plan.run_id = launch::detail::unique_id();
  // The job token its store demands: the inherited one, or a fresh one only these ranks know.
  const char* inherited = std::getenv("TANDEM_STORE_TOKEN");
  plan.store_token = inherited != nullptr && *inherited != '\0' ? std::string(inherited)
                                                                : launch::detail::random_token();
  plan.set_omp_num_threads = std::getenv("OMP_NUM_THREADS") == nullptr && nprocs > 1;

  // What the parent has buffered must not be written once more by every child.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);

  std::vector<launch::detail::Worker> workers(static_cast<std::size_t>(nprocs));
  for (int rank = 0; rank < nprocs; ++rank) {
    auto& worker = workers[static_cast<std::size_t>(rank)];
    worker.rank = rank;
    worker.local_rank = rank;
    const auto vars = launch::worker_variables(plan, rank, 0);
    worker.child = launch::detail::fork_child({}, [&] {
      for (const auto& [key, value] : vars) ::setenv(key.c_str(), value.c_str(), 1);
      return detail::spawning::run_rank(fn, World::single_node(rank, nprocs));
    });
  }

  launch::detail::SuperviseOptions supervise;
  supervise.monitor_interval = options.monitor_interval;
  supervise.grace = options.grace;
  if (options.timeout != Timeout::max()) {
    supervise.deadline = Deadline(options.timeout).at();
  }
  const auto outcome = launch::detail::supervise(workers, supervise);
  using Kind = launch::GroupOutcome::Kind;
  if (outcome.kind == Kind::failed) {
    const auto& root = outcome.failures.front();
    throw Error(root.rank, "spawn",
                "the process (pid " + std::to_string(root.pid) + ") ended with " +
                    root.status.describe() + "; the other ranks were stopped");
  }
  if (outcome.kind == Kind::timed_out) {
    throw Error("spawn", std::to_string(nprocs) + " processes did not end within " +
                             describe(options.timeout) + "; they were stopped");
  }
}

}  // namespace tandem
