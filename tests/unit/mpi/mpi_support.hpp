// MPI test support: every process of the mpirun job is one rank. MpiRunner runs the collective
// conformance suite's per-rank bodies on MpiComm::world(); a rank that throws ends the whole job
// (MPI_Abort) instead of leaving the others waiting in a collective it left.
#pragma once

#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include <mpi.h>

#include "tandem/comm/mpi/mpi.hpp"
#include "tandem/core/timeout.hpp"

namespace tandem::test {

[[noreturn]] inline void abort_job(const std::string& what) {
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "rank %d: %s; aborting the job\n", rank, what.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

/// The number of processes mpirun started (initialises MPI through MpiComm's runtime).
inline int job_size() {
  (void)MpiComm::thread_level();
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

/// fn(comm) on this process's rank of a fresh MpiComm::world(options); an exception ends the job.
template <class Fn>
void on_every_rank(Fn&& fn, MpiCommOptions options = {}) {
  try {
    auto comm = MpiComm::world(options);
    fn(comm);
  } catch (const std::exception& e) {
    abort_job(e.what());
  }
}

/// The suite's Runner: the world size is fixed by mpirun, so run(n, fn) checks it matches.
struct MpiRunner {
  MpiCommOptions options;  // timed() replaces the timeout

  template <class Fn>
  void operator()(int world_size, Fn&& fn) {
    timed(world_size, options.timeout, fn);
  }
  template <class Fn>
  void timed(int world_size, Timeout timeout, Fn&& fn) {
    MpiCommOptions timed_options = options;
    timed_options.timeout = timeout;
    on_every_rank(
        [&](MpiComm& comm) {
          if (comm.size() != world_size) {
            abort_job("the suite asked for " + std::to_string(world_size) +
                      " ranks, mpirun started " + std::to_string(comm.size()));
          }
          fn(comm);
        },
        timed_options);
  }
};

}  // namespace tandem::test
