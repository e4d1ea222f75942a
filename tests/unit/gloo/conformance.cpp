// The collective conformance suite on GlooComm, one process per rank: started by tandemrun
// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each process joins with init_process_group over
// env:// and runs the same doctest cases on its own rank. Every rank must pass; tandemrun fails
// when any process exits non-zero.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "support/collective_suite.hpp"
#include "support/process_conformance.hpp"
#include "support/runners.hpp"
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"

namespace {

using namespace std::chrono_literals;

// made in main, before the tests run
constexpr auto& comm = tandem::test::job<tandem::GlooComm>;
using tandem::test::regroup;

/// Counts no world size up to 4 divides evenly, and an empty call; each case in one mode,
/// rotating (gloo over loopback costs milliseconds a call on a loaded machine: a smaller matrix
/// than LocalComm's).
const tandem::test::Matrix matrix{{0, 1, 13, 1031}, true};
const tandem::test::Matrix subgroup_matrix{{0, 1, 13}, true};

}  // namespace

// GlooComm checks unless switched off: the suite asks checks_collectives() at run time.
static_assert(tandem::can_check_collectives<tandem::GlooComm>);

TEST_CASE("GlooComm: the conformance suite") {
  tandem::test::ProcessRunner<tandem::GlooComm> run{&comm()};
  tandem::test::check_conformance<tandem::GlooComm>(run, comm().size(), matrix, subgroup_matrix);
}

// GlooComm's reduce_scatter is a ring of pieces of at most ring_piece_bytes: a slot of three
// pieces, the last one short, in every op; out apart from in, out as this rank's own slot, and out
// inside in across two slots (results held aside until every piece of in has been read).
TEST_CASE("GlooComm: reduce_scatter of slots several ring pieces long") {
  using tandem::ReduceOp;
  auto& c = comm();
  const int n = c.size();
  const int me = c.rank();
  const auto un = static_cast<std::size_t>(n);
  tandem::test::Failures failures;
  auto check = [&]<class T>() {
    const std::size_t count = 2 * tandem::detail::gloo_comm::ring_piece_bytes / sizeof(T) + 11;
    // Not periodic along a slot, so a piece reduced into the wrong place shows; prod's values
    // (1 and -2) keep every product exact.
    auto value = [](int rank, std::size_t j, ReduceOp op) {
      const auto k =
          static_cast<long>((j * 7919 + static_cast<std::size_t>(rank) * 104729) % 10007);
      if (op == ReduceOp::prod) return tandem::test::from_int<T>(k % 7 == 0 ? -2 : 1);
      return tandem::test::from_int<T>(k - 5003);
    };
    for (ReduceOp op : tandem::test::ops_for<T>()) {
      for (int where = 0; where < 3; ++where) {  // apart, own slot, across slots 0 and 1
        std::vector<T> in(un * count);
        for (std::size_t j = 0; j < in.size(); ++j) in[j] = value(me, j, op);
        const std::vector<T> original = in;
        std::vector<T> own(count, tandem::test::from_int<T>(99));
        std::span<T> out(own);
        if (where == 1) out = std::span<T>(in.data() + static_cast<std::size_t>(me) * count, count);
        if (where == 2) out = std::span<T>(in.data() + count / 2, count);
        const tandem::test::Mode mode{where != 0, where == 1};
        const tandem::test::Case label{
            "reduce_scatter (ring pieces)", tandem::dtype_traits<T>::name, count, mode, me, n, op};
        if (mode.async) {
          c.reduce_scatter_async(std::span<const T>(in), out, op).wait();
        } else {
          c.reduce_scatter(std::span<const T>(in), out, op);
        }
        tandem::test::compare(failures, label, out.data(), count, [&](std::size_t i) {
          const std::size_t j = static_cast<std::size_t>(me) * count + i;
          return tandem::test::reference<T>(n, op, [&](int r) { return value(r, j, op); });
        });
        if (where == 0) {
          tandem::test::compare(
              failures, label, in.data(), in.size(), [&](std::size_t j) { return original[j]; },
              "input");
        }
      }
    }
  };
  check.template operator()<float>();
  check.template operator()<double>();
  check.template operator()<std::int32_t>();
  failures.report();
}

// With the check off nothing is exchanged first, so the ring itself meets the missing rank: the
// rank before it cannot send, the one after it cannot receive, the others see closed connections.
TEST_CASE("GlooComm: a rank that skips a reduce_scatter makes the ring fail within the timeout") {
  const int me = comm().rank();
  const int skipper = comm().size() / 2;
  auto quick = regroup(comm(), {.timeout = 1s, .check_collectives = false});
  if (me != skipper) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<float> in(static_cast<std::size_t>(comm().size()) * 300000, 1.0f);
    std::vector<float> out(300000);
    try {
      quick.reduce_scatter(std::span<const float>(in), out);
      FAIL("rank " << me << " completed a reduce_scatter that rank " << skipper << " skipped");
    } catch (const tandem::Error& e) {
      const std::string text = e.what();
      CHECK_MESSAGE(
          tandem::test::mentions(text, "rank " + std::to_string(me) + ":", "reduce_scatter"), text);
      CHECK_MESSAGE((tandem::test::mentions(text, "timed out after 1 s") ||
                     tandem::test::mentions(text, "closed")),
                    text);
    }
    CHECK(std::chrono::steady_clock::now() - start < 20s);
    CHECK_THROWS_WITH_AS(quick.barrier(), doctest::Contains("unusable"), tandem::Error);
  }
  comm().barrier();  // the skipper keeps its group open until the others have given up
}

TEST_CASE("GlooComm: a mismatched recv is an error and the pair stays usable") {
  tandem::test::check_mismatched_recv(comm());
}

TEST_CASE("GlooComm: a rank that skips a collective makes the others fail within the timeout") {
  // A group of its own with a short timeout: the timeout makes it unusable.
  auto quick = regroup(comm(), {.timeout = 1s});
  // Its own timeout, or (should another rank have given up first) the connections it closed.
  tandem::test::check_skipped_collective(
      comm(), quick, {.other_cause = "closed", .names_skipper = false, .within = 20s});
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

TEST_CASE("GlooComm: with the check switched off, nothing is exchanged and a mismatch goes by") {
  const int me = comm().rank();
  const int odd = comm().size() - 1;
  // Ranks that reduce with different ops on equal data: harmless to gloo (each rank combines
  // with its own function), so it shows whether the ranks compared their calls.
  auto mismatched_ops = [&](tandem::GlooComm& group) {
    std::vector<float> ones(64, 1.0f);
    group.all_reduce(ones, me == odd ? tandem::ReduceOp::max : tandem::ReduceOp::sum);
  };
  auto checked = regroup(comm(), {.timeout = 60s, .check_collectives = true});
  CHECK(checked.checks_collectives());
  CHECK_THROWS_WITH_AS(mismatched_ops(checked),
                       doctest::Contains("ranks disagree on the reduce op"), tandem::Error);
  auto unchecked = regroup(comm(), {.timeout = 60s, .check_collectives = false});
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
    (void)regroup(comm(), {.timeout = 60s, .check_collectives = me != 0});
    FAIL("a group whose ranks disagree on the check was made");
  } catch (const tandem::Error& e) {
    const std::string others = comm().size() == 2 ? "rank 1: on" : "ranks 1, ";
    CHECK_MESSAGE(tandem::test::mentions(e.what(), "rank " + std::to_string(me) + ":", "rendezvous",
                                         "TANDEM_CHECK_COLLECTIVES", "rank 0: off", others),
                  e.what());
  }
}

TEST_CASE("GlooComm: a bad TANDEM_CHECK_COLLECTIVES fails rendezvous on every rank") {
  tandem::test::check_bad_check_variable(comm(), {.timeout = 60s});
}

int main(int argc, char** argv) {
  return tandem::test::run_process_conformance(argc, argv, "gloo_conformance", [] {
    return tandem::init_process_group<tandem::GlooComm>("env://", {.timeout = 60s});
  });
}
