// The collective conformance suite on ShmComm, one process per rank: started by tandemrun
// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each process joins with init_process_group over
// env:// and runs the same doctest cases on its own rank; then ShmComm's own cases (the same bits
// as LocalComm, tensors larger than a slot, a skipped collective, a mismatched recv, a bad
// TANDEM_CHECK_COLLECTIVES, nothing left in /dev/shm). tandemrun fails when any process does.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "support/collective_suite.hpp"
#include "support/process_conformance.hpp"
#include "support/runners.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/comm/shm/shm.hpp"

namespace {

using namespace std::chrono_literals;

// made in main, before the tests run
constexpr auto& comm = tandem::test::job<tandem::ShmComm>;
using tandem::test::regroup;

/// The full matrix, every mode: shared memory costs microseconds a call, not TCP's milliseconds.
const tandem::test::Matrix matrix{};
const tandem::test::Matrix subgroup_matrix{{0, 1, 13}};

}  // namespace

static_assert(tandem::can_check_collectives<tandem::ShmComm>);

TEST_CASE("ShmComm: the conformance suite") {
  CHECK(comm().checks_collectives());
  tandem::test::ProcessRunner<tandem::ShmComm> run{&comm()};
  tandem::test::check_conformance<tandem::ShmComm>(run, comm().size(), matrix, subgroup_matrix);
}

TEST_CASE("ShmComm: tensors larger than a slot go through in pieces, in every operation") {
  // 4 KiB slots: 1031 elements of 8 bytes take several rounds, the n-part ones more.
  auto small = regroup(comm(), {.timeout = 60s, .slot_bytes = 4096});
  const int n = small.size();
  const int me = small.rank();
  tandem::test::Failures failures;
  const tandem::test::Matrix big{{0, 1, 511, 512, 513, 1031, 5000}};
  tandem::test::all_reduce_body(small, failures, big);
  tandem::test::reduce_body(small, failures, big);
  tandem::test::broadcast_body(small, failures, big);
  tandem::test::all_gather_body(small, failures, big);
  tandem::test::gather_body(small, failures, big);
  tandem::test::scatter_body(small, failures, big);
  tandem::test::reduce_scatter_body(small, failures, big);
  tandem::test::all_to_all_body(small, failures, big);
  // Messages larger than the 64 KiB ring between two ranks, both ways at once.
  std::vector<double> out(20000), in(20000);
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = me * 1e6 + static_cast<double>(i);
  const int next = (me + 1) % n;
  const int prev = (me + n - 1) % n;
  small.send(std::span<const double>(out), next, 3);
  small.recv(in, prev, 3);
  failures.expect(in.front() == prev * 1e6 && in.back() == prev * 1e6 + 19999.0,
                  "large send/recv: got ", in.front(), " .. ", in.back());
  failures.report();
}

TEST_CASE("ShmComm: float reductions give LocalComm's bits on every rank") {
  // The same irregular values reduced by ShmComm here and by LocalComm threads in this process.
  const int n = comm().size();
  for (std::size_t count : {std::size_t{1031}, std::size_t{300000}}) {
    for (auto op : {tandem::ReduceOp::sum, tandem::ReduceOp::avg, tandem::ReduceOp::prod}) {
      auto mine = tandem::test::irregular_floats(comm().rank(), count);
      comm().all_reduce(mine, op);
      std::vector<float> local;
      tandem::run_local(n, [&](tandem::LocalComm& c) {
        auto data = tandem::test::irregular_floats(c.rank(), count);
        c.all_reduce(data, op);
        if (c.rank() == 0) local = data;
      });
      CHECK_MESSAGE(std::memcmp(mine.data(), local.data(), count * sizeof(float)) == 0,
                    "count " << count << " op " << tandem::name(op));
    }
  }
}

TEST_CASE("ShmComm: a rank that skips a collective makes the others fail within the timeout") {
  auto quick = regroup(comm(), {.timeout = 1s});
  tandem::test::check_skipped_collective(
      comm(), quick, {.other_cause = "failed first", .names_skipper = true, .within = 10s});
}

TEST_CASE("ShmComm: abort passes a cause to every rank, which raise it") {
  // The last rank aborts its group with a cause from outside it (what HierarchicalComm does with
  // the first failure of another level); every rank's next call raises it, and every rank reads
  // the cause itself, in the words it was given.
  auto group = regroup(comm(), {.timeout = 60s});
  const int last = group.size() - 1;
  const std::string cause = "rank 9 died elsewhere (its process is gone)";
  CHECK_FALSE(group.abort_cause().has_value());
  group.barrier();  // every rank has looked before the abort
  if (group.rank() == last) group.abort(cause);
  std::vector<float> data(16, 1.0f);
  try {
    group.all_reduce(data);
    FAIL_CHECK("an all_reduce of an aborted group completed");
  } catch (const tandem::Error& e) {
    const std::string what = e.what();
    CHECK_MESSAGE(what.find("rank " + std::to_string(last) + " aborted the group (" + cause +
                            ")") != std::string::npos,
                  what);
  }
  CHECK(group.abort_cause() == cause);
  CHECK_THROWS_AS(group.barrier(), tandem::Error);
  comm().barrier();
}

TEST_CASE("ShmComm: a mismatched recv is an error and the pair stays usable") {
  tandem::test::check_mismatched_recv(comm());
}

TEST_CASE("ShmComm: a bad TANDEM_CHECK_COLLECTIVES fails rendezvous on every rank") {
  tandem::test::check_bad_check_variable(comm(), {.timeout = 60s});
}

namespace {

/// A group of comm()'s ranks made in a namespace `name` of the job's store, with that namespace:
/// its segment's record ("NAME SLOT RING", rank 0's announcement) is at "shm/1/segment".
std::pair<tandem::ShmComm, tandem::AnyStore> group_in(const std::string& name,
                                                      const tandem::ShmCommOptions& options) {
  tandem::AnyStore store(tandem::PrefixStore<tandem::AnyStore>(name + "/", comm().store()));
  auto group = tandem::ShmComm::rendezvous(tandem::World::single_node(comm().rank(), comm().size()),
                                           store, options);
  return {std::move(group), store};
}

/// The fields of the segment record: name, slot bytes, ring bytes.
struct Announced {
  std::string name;
  std::size_t slot = 0;
  std::size_t ring = 0;
};
Announced announced(tandem::AnyStore& store) {
  const std::string record = store.get("shm/1/segment", 60s);
  const auto ring_at = record.rfind(' ');
  const auto slot_at = record.rfind(' ', ring_at - 1);
  return {record.substr(0, slot_at), std::stoull(record.substr(slot_at + 1, ring_at - slot_at)),
          std::stoull(record.substr(ring_at + 1))};
}

}  // namespace

TEST_CASE("ShmComm: no segment is left in /dev/shm once a group is made") {
  auto [group, store] = group_in("no-segment-left", {.timeout = 60s});
  const Announced segment = announced(store);
  CHECK(segment.name.rfind("/tandem-shm-", 0) == 0);
  CHECK_MESSAGE(::access(("/dev/shm" + segment.name).c_str(), F_OK) != 0,
                "left in /dev/shm: " << segment.name);
  std::vector<std::int64_t> one{1};
  group.all_reduce(one);
  CHECK(one[0] == group.size());
}

TEST_CASE("ShmComm: where /dev/shm has little free, the segment is sized to fit, same results") {
  // TANDEM_SHM_FREE_BYTES caps what ShmComm counts on (rank 0 reads it): 1 MiB, where the default
  // options ask 8 MiB of slots per rank. The group takes at most half of it, with smaller slots
  // (and rings), and a tensor of many slots still sums right.
  ::setenv("TANDEM_SHM_FREE_BYTES", "1048576", 1);
  auto [group, store] = group_in("small-shm", {.timeout = 60s});
  ::unsetenv("TANDEM_SHM_FREE_BYTES");
  const Announced segment = announced(store);
  const tandem::detail::shm::Layout layout(group.size(), segment.slot, segment.ring);
  CHECK(segment.slot < (std::size_t{4} << 20));
  CHECK(layout.total <= (std::size_t{1} << 19));
  std::vector<double> data(300000);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<double>(i % 7);
  group.all_reduce(data);
  bool right = true;
  for (std::size_t i = 0; i < data.size(); ++i) {
    right =
        right && data[i] == static_cast<double>((i % 7) * static_cast<std::size_t>(group.size()));
  }
  CHECK(right);
}

TEST_CASE("ShmComm: where /dev/shm cannot hold the smallest segment, every rank says what to do") {
  ::setenv("TANDEM_SHM_FREE_BYTES", "16384", 1);
  try {
    (void)group_in("tiny-shm", {.timeout = 60s});
    FAIL_CHECK("a group was made in 16 KiB of /dev/shm");
  } catch (const tandem::Error& e) {
    CHECK_MESSAGE(tandem::test::mentions(e.what(), "rank " + std::to_string(comm().rank()) + ":",
                                         "ShmComm rendezvous", "needs at least", "of /dev/shm",
                                         "has 16 KiB free (as TANDEM_SHM_FREE_BYTES says)",
                                         "docker run --shm-size", "GlooComm or MpiComm"),
                  e.what());
  }
  ::unsetenv("TANDEM_SHM_FREE_BYTES");
  comm().barrier();
}

int main(int argc, char** argv) {
  // Small slots (the groups split off it inherit them): dozens of groups are made, and each
  // reserves 2 slots per rank in /dev/shm.
  return tandem::test::run_process_conformance(argc, argv, "shm_conformance", [] {
    return tandem::init_process_group<tandem::ShmComm>(
        "env://", {.timeout = 60s, .slot_bytes = std::size_t{256} << 10});
  });
}
