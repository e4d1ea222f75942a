// The collective conformance suite on MpiComm: one process per rank under mpirun (the test is
// registered with 2 and 3 processes), every collective, element type, op, count, in-place and
// out-of-place, sync and async, on the world and on subgroups.
#include <doctest/doctest.h>

#include <mpi.h>

#include "mpi_support.hpp"
#include "support/collective_suite.hpp"
#include "tandem/comm/mpi/mpi.hpp"

namespace {

const tandem::test::Matrix counts{{0, 1, 13, 1031}};

}  // namespace

TEST_CASE("MpiComm: MPI provides MPI_THREAD_MULTIPLE when MpiComm initialises it") {
  CHECK(tandem::MpiComm::thread_level() == MPI_THREAD_MULTIPLE);
}

// MpiComm compares fingerprints unless switched off: the suite asks checks_collectives().
static_assert(tandem::can_check_collectives<tandem::MpiComm>);

TEST_CASE("MpiComm: the conformance suite on the whole job") {
  tandem::test::MpiRunner run;
  run.options.check_collectives = true;  // whatever TANDEM_CHECK_COLLECTIVES says
  tandem::test::check_conformance<tandem::MpiComm>(run, tandem::test::job_size(), counts, counts);
}
