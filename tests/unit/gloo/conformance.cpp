// The collective conformance suite on GlooComm, one process per rank: started by tandemrun
// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each process joins with init_process_group over
// env:// and runs the same doctest cases on its own rank. Every rank must pass; tandemrun fails
// when any process exits non-zero.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <stdlib.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "support/collective_suite.hpp"
#include "support/process_conformance.hpp"
#include "support/runners.hpp"
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"

namespace {

using namespace std::chrono_literals;

std::optional<tandem::GlooComm> world_comm;  // made in main, before the tests run

tandem::GlooComm& comm() {
  REQUIRE(world_comm.has_value());
  return *world_comm;
}

/// Counts no world size up to 4 divides evenly, and an empty call; each case in one mode,
/// rotating (gloo over loopback costs milliseconds a call on a loaded machine: a smaller matrix
/// than LocalComm's).
const tandem::test::Matrix matrix{{0, 1, 13, 1031}, true};
const tandem::test::Matrix subgroup_matrix{{0, 1, 13}, true};

}  // namespace

// GlooComm checks unless switched off: the suite asks checks_collectives() at run time.
static_assert(tandem::detects_mismatched_collectives<tandem::GlooComm>);

TEST_CASE("GlooComm: the conformance suite") {
  tandem::test::ProcessRunner<tandem::GlooComm> run{&comm()};
  tandem::test::check_conformance<tandem::GlooComm>(run, comm().size(), matrix, subgroup_matrix);
}

TEST_CASE("GlooComm: a mismatched recv is an error and the pair stays usable") {
  tandem::test::check_mismatched_recv(comm());
}

TEST_CASE("GlooComm: a rank that skips a collective makes the others fail within the timeout") {
  auto& c = comm();
  const int me = c.rank();
  const int skipper = c.size() / 2;
  auto store = c.store();
  // A group of its own with a short timeout: the timeout makes it unusable.
  auto quick = tandem::GlooComm::rendezvous(tandem::World::single_node(me, c.size()), store,
                                            {.timeout = 1s});
  if (me != skipper) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<float> data(16);
    try {
      quick.all_reduce(data);
      FAIL("rank " << me << " completed an all_reduce that rank " << skipper << " skipped");
    } catch (const tandem::Error& e) {
      const std::string text = e.what();
      CHECK_MESSAGE(tandem::test::mentions(text, "rank " + std::to_string(me) + ":", "all_reduce"),
                    text);
      // Its own timeout, or (should another rank have given up first) the connections it closed.
      CHECK_MESSAGE((tandem::test::mentions(text, "timed out after 1 s") ||
                     tandem::test::mentions(text, "closed")),
                    text);
    }
    CHECK(std::chrono::steady_clock::now() - start < 20s);
    // Unusable afterwards, at once.
    try {
      quick.barrier();
      FAIL("a failed communicator ran a barrier");
    } catch (const tandem::Error& e) {
      CHECK_MESSAGE(tandem::test::mentions(e.what(), "barrier", "unusable"), e.what());
    }
  }
  // The skipper keeps its connections open until the others have given up.
  c.barrier();
}

TEST_CASE("GlooComm: async operations complete through Work, in issue order") {
  auto& c = comm();
  const int n = c.size();
  std::vector<double> a(100, 1.0), b(100, 2.0);
  std::vector<double> gathered(100 * static_cast<std::size_t>(n));
  auto first = c.all_reduce_async(a);
  auto second = c.all_gather_async(std::span<const double>(b), gathered);
  auto third = c.barrier_async();
  third.wait();
  CHECK(first.test());
  CHECK(second.test());
  CHECK_FALSE(first.failed());
  CHECK(a[0] == static_cast<double>(n));
  CHECK(gathered.back() == 2.0);
}

/// A new group of this world, met in the world's store, with `options`.
tandem::GlooComm regroup(const tandem::GlooCommOptions& options) {
  auto store = comm().store();
  return tandem::GlooComm::rendezvous(tandem::World::single_node(comm().rank(), comm().size()),
                                      store, options);
}

TEST_CASE("GlooComm: with the check switched off, nothing is exchanged and a mismatch goes by") {
  const int me = comm().rank();
  const int odd = comm().size() - 1;
  // Ranks that reduce with different ops on equal data: harmless to gloo (each rank combines
  // with its own function), so it shows whether the ranks compared their calls.
  auto mismatched_ops = [&](tandem::GlooComm& group) {
    std::vector<float> ones(64, 1.0f);
    group.all_reduce(ones, me == odd ? tandem::ReduceOp::max : tandem::ReduceOp::sum);
  };
  auto checked = regroup({.timeout = 60s, .check_agreement = true});
  CHECK(checked.checks_collectives());
  CHECK_THROWS_WITH_AS(mismatched_ops(checked),
                       doctest::Contains("ranks disagree on the reduce op"), tandem::Error);
  auto unchecked = regroup({.timeout = 60s, .check_agreement = false});
  CHECK_FALSE(unchecked.checks_collectives());
  CHECK_NOTHROW(mismatched_ops(unchecked));
  // The barrier, which the exchange used to be, still synchronises.
  std::vector<std::int64_t> sum{1};
  unchecked.barrier();
  unchecked.all_reduce(sum);
  CHECK(sum[0] == comm().size());
}

TEST_CASE("GlooComm: ranks that disagree on the check fail at rendezvous, naming each side") {
  const int me = comm().rank();
  try {
    (void)regroup({.timeout = 60s, .check_agreement = me != 0});
    FAIL("a group whose ranks disagree on the check was made");
  } catch (const tandem::Error& e) {
    const std::string others = comm().size() == 2 ? "rank 1: on" : "ranks 1, ";
    CHECK_MESSAGE(tandem::test::mentions(e.what(), "rank " + std::to_string(me) + ":", "rendezvous",
                                         "TANDEM_CHECK_COLLECTIVES", "rank 0: off", others),
                  e.what());
  }
}

TEST_CASE("GlooComm: a bad TANDEM_CHECK_COLLECTIVES fails rendezvous on every rank") {
  const int me = comm().rank();
  const int odd = comm().size() - 1;
  if (me == odd) ::setenv("TANDEM_CHECK_COLLECTIVES", "yes", 1);
  try {
    (void)regroup({.timeout = 60s});
    FAIL("a group was made with TANDEM_CHECK_COLLECTIVES=yes on rank " << odd);
  } catch (const tandem::Error& e) {
    if (me == odd) {
      CHECK_MESSAGE(tandem::test::mentions(e.what(), "TANDEM_CHECK_COLLECTIVES='yes'"), e.what());
    } else {
      CHECK_MESSAGE(tandem::test::mentions(e.what(), "rank " + std::to_string(me) + ":",
                                           "rank " + std::to_string(odd) + " could not read",
                                           "TANDEM_CHECK_COLLECTIVES"),
                    e.what());
    }
  }
  if (me == odd) ::unsetenv("TANDEM_CHECK_COLLECTIVES");
  comm().barrier();
}

int main(int argc, char** argv) {
  return tandem::test::run_process_conformance(argc, argv, "gloo_conformance", world_comm, [] {
    return tandem::init_process_group<tandem::GlooComm>("env://", {.timeout = 60s});
  });
}
