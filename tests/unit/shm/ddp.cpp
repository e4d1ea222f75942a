// DistributedDataParallel on ShmComm: one process per rank under tandemrun (ctest shm_ddp_np3);
// the job joins with init_process_group (env://) and groups of 1 .. WORLD_SIZE ranks are split
// off it, each with a segment of its own. The Join cases too (join_suite.hpp).
#include <doctest/doctest.h>

#include "support/runners.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/shm/shm.hpp"
#include "unit/ddp/ddp_suite.hpp"

namespace {

namespace suite = tandem::test::ddp;

tandem::ShmComm& job() {
  static tandem::ShmComm comm = tandem::init_process_group<tandem::ShmComm>();
  return comm;
}

}  // namespace

TEST_CASE("DDP on ShmComm: N ranks x batch b equal 1 rank x batch N*b") {
  tandem::test::SplitRunner<tandem::ShmComm> run{&job()};
  CHECK(suite::check_theorems<tandem::ShmComm>(run, job().size()) == 0);
}

TEST_CASE("DDP on ShmComm: no_sync accumulation equals one step on the whole batch") {
  tandem::test::SplitRunner<tandem::ShmComm> run{&job()};
  CHECK(suite::check_no_syncs<tandem::ShmComm>(run, job().size()) == 0);
}

TEST_CASE("DDP on ShmComm: unused parameters, element types, reductions and bucket caps") {
  tandem::test::SplitRunner<tandem::ShmComm> run{&job()};
  CHECK(suite::check_reductions<tandem::ShmComm>(run, job().size()) == 0);
}

TEST_CASE("DDP on ShmComm: marking twice and mismatched registrations are errors") {
  tandem::test::SplitRunner<tandem::ShmComm> run{&job()};
  CHECK(suite::check_errors<tandem::ShmComm>(run, job().size()) == 0);
}

TEST_CASE("DDP on ShmComm: 16-bit compression stays within its rounding bound") {
  tandem::test::SplitRunner<tandem::ShmComm> run{&job()};
  CHECK(suite::check_compressions<tandem::ShmComm>(run, job().size()) == 0);
}

TEST_CASE("Join on ShmComm: uneven data equals the single-process schedule") {
  tandem::test::SplitRunner<tandem::ShmComm> run{&job()};
  CHECK(suite::check_joins<tandem::ShmComm>(run, job().size()) == 0);
}

TEST_CASE("Join on ShmComm: SyncBatchNorm between buckets; misuse is an Error, never a hang") {
  tandem::test::SplitRunner<tandem::ShmComm> run{&job()};
  CHECK(suite::check_join_norms_and_errors<tandem::ShmComm>(run, job().size()) == 0);
}
