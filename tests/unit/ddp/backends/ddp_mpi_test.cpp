// DistributedDataParallel on MpiComm: one process per rank under mpirun (registered with 4
// processes); groups of 1 to 4 ranks are split off the job, the processes outside a group wait.
#include <doctest/doctest.h>

#include <exception>
#include <optional>

#include <mpi.h>

#include "tandem/comm/mpi/mpi.hpp"
#include "unit/ddp/ddp_suite.hpp"
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

}  // namespace

TEST_CASE("DDP on MpiComm: N ranks x batch b equal 1 rank x batch N*b") {
  MpiRunner run;
  CHECK(suite::check_theorems<tandem::MpiComm>(run, tandem::test::job_size()) == 0);
}

TEST_CASE("DDP on MpiComm: no_sync accumulation equals one step on the whole batch") {
  MpiRunner run;
  CHECK(suite::check_no_syncs<tandem::MpiComm>(run, tandem::test::job_size()) == 0);
}

TEST_CASE("DDP on MpiComm: unused parameters, element types, reductions and bucket caps") {
  MpiRunner run;
  CHECK(suite::check_reductions<tandem::MpiComm>(run, tandem::test::job_size()) == 0);
}

TEST_CASE("DDP on MpiComm: marking twice and mismatched registrations are errors") {
  MpiRunner run;
  CHECK(suite::check_errors<tandem::MpiComm>(run, tandem::test::job_size()) == 0);
}

TEST_CASE("DDP on MpiComm: 16-bit compression stays within its rounding bound") {
  MpiRunner run;
  CHECK(suite::check_compressions<tandem::MpiComm>(run, tandem::test::job_size()) == 0);
}

TEST_CASE("Join on MpiComm: uneven data equals the single-process schedule") {
  MpiRunner run;
  CHECK(suite::check_joins<tandem::MpiComm>(run, tandem::test::job_size()) == 0);
}

TEST_CASE("Join on MpiComm: SyncBatchNorm between buckets; misuse is an Error, never a hang") {
  MpiRunner run;
  CHECK(suite::check_join_norms_and_errors<tandem::MpiComm>(run, tandem::test::job_size()) == 0);
}
