// DistributedDataParallel on ShmComm: one process per rank under tandemrun (ctest shm_ddp_np3);
// the job joins with init_process_group (env://) and groups of 1 .. WORLD_SIZE ranks are split
// off it, each with a segment of its own.
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>

#include "tandem/comm/init.hpp"
#include "tandem/comm/shm/shm.hpp"
#include "unit/ddp/ddp_suite.hpp"

namespace {

namespace suite = tandem::test::ddp;

tandem::ShmComm& job() {
  static tandem::ShmComm comm = tandem::init_process_group<tandem::ShmComm>();
  return comm;
}

/// fn on ranks 0 .. n-1 of the job, on a group of their own; a rank that throws ends its process
/// (tandemrun then ends the others) instead of leaving them in a collective.
struct ShmProcessRunner {
  template <class Fn>
  void operator()(int n, Fn&& fn) {
    auto& world = job();
    const int me = world.rank();
    try {
      auto group = world.split(me < n ? 0 : tandem::no_color, me);
      if (group) fn(*group);
      world.barrier();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s; exiting\n", me, e.what());
      std::fflush(stderr);
      std::_Exit(1);
    }
  }
};

}  // namespace

TEST_CASE("DDP on ShmComm: N ranks x batch b equal 1 rank x batch N*b") {
  ShmProcessRunner run;
  CHECK(suite::check_theorems<tandem::ShmComm>(run, job().size()) == 0);
}

TEST_CASE("DDP on ShmComm: no_sync accumulation equals one step on the whole batch") {
  ShmProcessRunner run;
  CHECK(suite::check_no_syncs<tandem::ShmComm>(run, job().size()) == 0);
}

TEST_CASE("DDP on ShmComm: unused parameters, element types, reductions and bucket caps") {
  ShmProcessRunner run;
  CHECK(suite::check_reductions<tandem::ShmComm>(run, job().size()) == 0);
}

TEST_CASE("DDP on ShmComm: marking twice and mismatched registrations are errors") {
  ShmProcessRunner run;
  CHECK(suite::check_errors<tandem::ShmComm>(run, job().size()) == 0);
}

TEST_CASE("DDP on ShmComm: 16-bit compression stays within its rounding bound") {
  ShmProcessRunner run;
  CHECK(suite::check_compressions<tandem::ShmComm>(run, job().size()) == 0);
}
