// DistributedDataParallel on MpiComm: one process per rank under mpirun (registered with 4
// processes); groups of 1 to 4 ranks are split off the job, the processes outside a group wait.
#include <doctest/doctest.h>

#include <exception>
#include <optional>

#include <mpi.h>

#include "ddp_suite.hpp"
#include "tandem/comm/mpi/mpi.hpp"
#include "unit/mpi/mpi_support.hpp"

namespace {

namespace suite = tandem::test::ddp;

/// run(n, fn): fn on ranks 0 .. n-1 of the job, on a communicator of their own. A rank that
/// throws ends the job (MPI_Abort) instead of leaving the others inside a collective.
struct MpiRunner {
  template <class Fn>
  void operator()(int n, Fn&& fn) {
    try {
      auto world = tandem::MpiComm::world();
      const int me = world.rank();
      auto group = world.split(me < n ? 0 : tandem::no_color, me);
      if (group) fn(*group);
      world.barrier();
    } catch (const std::exception& e) {
      tandem::test::abort_job(e.what());
    }
  }
};

template <class Check>
void on_mpi(Check&& check) {
  MpiRunner run;
  check(run, tandem::test::job_size());
}

}  // namespace

TANDEM_DDP_SUITE_CASES("DDP on MpiComm", tandem::MpiComm, on_mpi)
