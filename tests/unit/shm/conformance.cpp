// The collective conformance suite on ShmComm, one process per rank: started by tandemrun
// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each process joins with init_process_group over
// env:// and runs the same doctest cases on its own rank; then ShmComm's own cases (the same bits
// as LocalComm, tensors larger than a slot, a skipped collective, a mismatched recv, a bad
// TANDEM_CHECK_COLLECTIVES, nothing left in /dev/shm). tandemrun fails when any process does.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <dirent.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "support/collective_suite.hpp"
#include "support/process_conformance.hpp"
#include "support/runners.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/comm/shm/shm.hpp"

namespace {

using namespace std::chrono_literals;

std::optional<tandem::ShmComm> world_comm;  // made in main, before the tests run

tandem::ShmComm& comm() {
  REQUIRE(world_comm.has_value());
  return *world_comm;
}

/// A new group of this world, met in the world's store, with `options`.
tandem::ShmComm regroup(const tandem::ShmCommOptions& options) {
  auto store = comm().store();
  return tandem::ShmComm::rendezvous(tandem::World::single_node(comm().rank(), comm().size()),
                                     store, options);
}

/// The full matrix, every mode: shared memory costs microseconds a call, not TCP's milliseconds.
const tandem::test::Matrix matrix{};
const tandem::test::Matrix subgroup_matrix{{0, 1, 13}};

}  // namespace

static_assert(tandem::detects_mismatched_collectives<tandem::ShmComm>);

TEST_CASE("ShmComm: the conformance suite") {
  CHECK(comm().checks_collectives());
  tandem::test::ProcessRunner<tandem::ShmComm> run{&comm()};
  tandem::test::check_conformance<tandem::ShmComm>(run, comm().size(), matrix, subgroup_matrix);
}

TEST_CASE("ShmComm: tensors larger than a slot go through in pieces, in every operation") {
  // 4 KiB slots: 1031 elements of 8 bytes take several rounds, the n-part ones more.
  auto small = regroup({.timeout = 60s, .slot_bytes = 4096});
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
  auto values = [](int rank, std::size_t count) {
    std::vector<float> data(count);
    std::uint32_t state = 777u + static_cast<std::uint32_t>(rank) * 7919u;
    for (auto& x : data) {
      state = state * 1664525u + 1013904223u;
      x = static_cast<float>(state >> 8) * 0x1p-17f - 60.0f;
    }
    return data;
  };
  const int n = comm().size();
  for (std::size_t count : {std::size_t{1031}, std::size_t{300000}}) {
    for (auto op : {tandem::ReduceOp::sum, tandem::ReduceOp::avg, tandem::ReduceOp::prod}) {
      auto mine = values(comm().rank(), count);
      comm().all_reduce(mine, op);
      std::vector<float> local;
      tandem::run_local(n, [&](tandem::LocalComm& c) {
        auto data = values(c.rank(), count);
        c.all_reduce(data, op);
        if (c.rank() == 0) local = data;
      });
      CHECK_MESSAGE(std::memcmp(mine.data(), local.data(), count * sizeof(float)) == 0,
                    "count " << count << " op " << tandem::name(op));
    }
  }
}

TEST_CASE("ShmComm: a rank that skips a collective makes the others fail within the timeout") {
  auto& c = comm();
  const int me = c.rank();
  const int skipper = c.size() / 2;
  auto quick = regroup({.timeout = 1s});
  if (me != skipper) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<float> data(16);
    try {
      quick.all_reduce(data);
      FAIL("rank " << me << " completed an all_reduce that rank " << skipper << " skipped");
    } catch (const tandem::Error& e) {
      const std::string text = e.what();
      CHECK_MESSAGE(tandem::test::mentions(text, "rank " + std::to_string(me) + ":", "all_reduce",
                                           "rank " + std::to_string(skipper)),
                    text);
      CHECK_MESSAGE((tandem::test::mentions(text, "timed out after 1 s") ||
                     tandem::test::mentions(text, "failed first")),
                    text);
    }
    CHECK(std::chrono::steady_clock::now() - start < 10s);
    try {
      quick.barrier();
      FAIL("a failed communicator ran a barrier");
    } catch (const tandem::Error& e) {
      CHECK_MESSAGE(tandem::test::mentions(e.what(), "barrier", "unusable"), e.what());
    }
  }
  c.barrier();  // the skipper stays until the others have given up
}

TEST_CASE("ShmComm: a mismatched recv is an error and the pair stays usable") {
  tandem::test::check_mismatched_recv(comm());
}

TEST_CASE("ShmComm: a bad TANDEM_CHECK_COLLECTIVES fails rendezvous on every rank") {
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

TEST_CASE("ShmComm: no segment is left in /dev/shm once a group is made") {
  auto group = regroup({.timeout = 60s});
  const std::string mine = "tandem-shm-" + std::to_string(::getpid()) + "-";
  std::vector<std::string> left;
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (const dirent* entry = ::readdir(dir)) {
      if (std::string(entry->d_name).rfind(mine, 0) == 0) left.push_back(entry->d_name);
    }
    ::closedir(dir);
  }
  CHECK_MESSAGE(left.empty(), "left in /dev/shm: " << (left.empty() ? "" : left.front()));
  std::vector<std::int64_t> one{1};
  group.all_reduce(one);
  CHECK(one[0] == group.size());
}

int main(int argc, char** argv) {
  // Small slots (the groups split off it inherit them): dozens of groups are made, and each
  // reserves 2 slots per rank in /dev/shm.
  return tandem::test::run_process_conformance(argc, argv, "shm_conformance", world_comm, [] {
    return tandem::init_process_group<tandem::ShmComm>(
        "env://", {.timeout = 60s, .slot_bytes = std::size_t{256} << 10});
  });
}
