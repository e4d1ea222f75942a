// DistributedDataParallel on LocalComm (ranks as threads), 1 to 4 ranks: the whole suite.
#include <doctest/doctest.h>

#include <chrono>

#include "ddp_suite.hpp"
#include "support/runners.hpp"
#include "tandem/comm/local/local.hpp"

namespace {

using namespace std::chrono_literals;
namespace suite = tandem::test::ddp;
using tandem::test::LocalRunner;

constexpr int max_ranks = 4;

}  // namespace

TEST_CASE("DDP on LocalComm: N ranks x batch b equal 1 rank x batch N*b") {
  LocalRunner run;
  CHECK(suite::check_theorems<tandem::LocalComm>(run, max_ranks) == 0);
}

TEST_CASE("DDP on LocalComm: no_sync accumulation equals one step on the whole batch") {
  LocalRunner run;
  CHECK(suite::check_no_syncs<tandem::LocalComm>(run, max_ranks) == 0);
}

TEST_CASE("DDP on LocalComm: unused parameters, element types, reductions and bucket caps") {
  LocalRunner run;
  CHECK(suite::check_reductions<tandem::LocalComm>(run, max_ranks) == 0);
}

TEST_CASE("DDP on LocalComm: marking twice and mismatched registrations are errors") {
  LocalRunner run;
  CHECK(suite::check_errors<tandem::LocalComm>(run, max_ranks) == 0);
}

TEST_CASE("DDP on LocalComm: 16-bit compression stays within its rounding bound") {
  LocalRunner run;
  CHECK(suite::check_compressions<tandem::LocalComm>(run, max_ranks) == 0);
}

TEST_CASE("Join on LocalComm: uneven data equals the single-process schedule, bit for bit") {
  LocalRunner run;
  CHECK(suite::check_joins<tandem::LocalComm>(run, max_ranks) == 0);
}

TEST_CASE("Join on LocalComm: SyncBatchNorm between buckets; misuse is an Error, never a hang") {
  LocalRunner run;
  CHECK(suite::check_join_norms_and_errors<tandem::LocalComm>(run, max_ranks) == 0);
}

TEST_CASE("DDP on LocalComm: before_forward() broadcasts the buffers the arena holds now") {
  // EMA's apply_shadow() swaps the arena's buffer storage; DDP must follow the arena, not keep
  // the storage it saw at construction.
  tandem::test::Failures failures;
  tandem::run_local(
      2,
      [&](tandem::LocalComm& comm) {
        const int me = comm.rank();
        tandem::Parameters<float> params;
        params.add("w", {2});
        params.add_buffer("stats", {3});
        params.finalize();
        tandem::DistributedDataParallel<tandem::LocalComm> ddp(comm, params);
        tandem::Buffer<float> shadow(3);
        for (std::size_t i = 0; i < 3; ++i) shadow.data()[i] = 10.0f * static_cast<float>(me + 1);
        params.swap_buffer_values(shadow);  // the arena now holds the rank's own values
        ddp.before_forward();
        for (auto v : params.buffer_values()) {
          failures.expect(v == 10.0f, "rank ", me, ": buffer ", v, " is not rank 0's 10");
        }
        for (std::size_t i = 0; i < 3; ++i) {
          failures.expect(shadow.data()[i] == 0.0f, "rank ", me,
                          ": the swapped-out storage was written: ", shadow.data()[i]);
        }
      },
      tandem::LocalCommOptions{30s});
  failures.report();
}
