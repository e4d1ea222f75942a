// DistributedDataParallel on GlooComm over Gloo's TCP transport on 127.0.0.1, groups of 1 to 4
// ranks, in two set-ups:
// - alone (ctest ddp_gloo): each rank is a thread of this process with its own GlooComm, meeting
//   the others in a HashStore;
// - under tandemrun (ctest ddp_gloo_np3, WORLD_SIZE set): each rank is a process; the job joins
//   with init_process_group (env://) and groups of 1 .. WORLD_SIZE ranks are split off it.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <thread>
#include <vector>

#include "support/runners.hpp"
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/store.hpp"
#include "unit/ddp/ddp_suite.hpp"

namespace {

using namespace std::chrono_literals;
namespace suite = tandem::test::ddp;
using tandem::test::GlooThreadRunner;
using tandem::test::LocalRunner;

/// This process's rank of the tandemrun job, or nullptr when it runs alone.
tandem::GlooComm* job() {
  static std::optional<tandem::GlooComm> comm = []() -> std::optional<tandem::GlooComm> {
    if (!std::getenv("WORLD_SIZE")) return std::nullopt;
    return tandem::init_process_group<tandem::GlooComm>();
  }();
  return comm ? &*comm : nullptr;
}

/// Runs the check on processes under tandemrun, on threads otherwise.
template <class Check>
void on_gloo(Check&& check) {
  if (auto* comm = job()) {
    tandem::test::SplitRunner<tandem::GlooComm> run{comm};
    check(run, comm->size());
  } else {
    GlooThreadRunner run;
    check(run, 4);
  }
}

}  // namespace

TEST_CASE("DDP on GlooComm: N ranks x batch b equal 1 rank x batch N*b") {
  on_gloo([](auto& run, int max_ranks) {
    CHECK(suite::check_theorems<tandem::GlooComm>(run, max_ranks) == 0);
  });
}

TEST_CASE("DDP on GlooComm: no_sync accumulation equals one step on the whole batch") {
  on_gloo([](auto& run, int max_ranks) {
    CHECK(suite::check_no_syncs<tandem::GlooComm>(run, max_ranks) == 0);
  });
}

TEST_CASE("DDP on GlooComm: unused parameters, element types, reductions and bucket caps") {
  on_gloo([](auto& run, int max_ranks) {
    CHECK(suite::check_reductions<tandem::GlooComm>(run, max_ranks) == 0);
  });
}

TEST_CASE("DDP on GlooComm: marking twice and mismatched registrations are errors") {
  on_gloo([](auto& run, int max_ranks) {
    CHECK(suite::check_errors<tandem::GlooComm>(run, max_ranks) == 0);
  });
}

TEST_CASE("DDP on GlooComm: 16-bit compression stays within its rounding bound") {
  on_gloo([](auto& run, int max_ranks) {
    CHECK(suite::check_compressions<tandem::GlooComm>(run, max_ranks) == 0);
  });
}

TEST_CASE("Join on GlooComm: uneven data equals the single-process schedule") {
  on_gloo([](auto& run, int max_ranks) {
    CHECK(suite::check_joins<tandem::GlooComm>(run, max_ranks) == 0);
  });
}

TEST_CASE("Join on GlooComm: SyncBatchNorm between buckets; misuse is an Error, never a hang") {
  on_gloo([](auto& run, int max_ranks) {
    CHECK(suite::check_join_norms_and_errors<tandem::GlooComm>(run, max_ranks) == 0);
  });
}
