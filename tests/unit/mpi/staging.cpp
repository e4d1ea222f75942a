// MpiComm with device tensors (a fake device space, so no GPU is needed): staged through pinned
// memory, in sync and `_async` forms; see support/staging_checks.hpp.
#include <doctest/doctest.h>

#include "mpi_support.hpp"
#include "support/staging_checks.hpp"
#include "tandem/comm/mpi/mpi.hpp"

TEST_CASE("MpiComm stages device tensors through pinned memory") {
  tandem::test::on_every_rank([](tandem::MpiComm& comm) {
    const std::string failures = tandem::test::check_device_staging(comm);
    CHECK_MESSAGE(failures.empty(), failures);
  });
}
