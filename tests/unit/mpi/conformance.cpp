// The collective conformance suite on MpiComm: one process per rank under mpirun (the test is
// registered with 2 and 3 processes), every collective, element type, op, count, in-place and
// out-of-place, sync and async, on the world and on subgroups.
#include <doctest/doctest.h>

#include <mpi.h>

#include "mpi_support.hpp"
#include "support/collective_suite.hpp"
#include "tandem/comm/mpi.hpp"

namespace {

const tandem::test::Matrix counts{{0, 1, 13, 1031}};

}  // namespace

TEST_CASE("MpiComm: MPI provides MPI_THREAD_MULTIPLE when MpiComm initialises it") {
  CHECK(tandem::MpiComm::thread_level() == MPI_THREAD_MULTIPLE);
}

TEST_CASE("MpiComm: every collective, element type and op on the whole job") {
  tandem::test::MpiRunner run;
  tandem::test::check_all_collectives(run, tandem::test::job_size(), counts);
}

TEST_CASE("MpiComm: collectives on subgroups made by split and new_group") {
  tandem::test::MpiRunner run;
  tandem::test::check_subgroups(run, tandem::test::job_size(), counts);
}

TEST_CASE("MpiComm: size mismatches and avg on integers are errors before anything is sent") {
  tandem::test::MpiRunner run;
  tandem::test::check_local_errors(run, tandem::test::job_size());
}
