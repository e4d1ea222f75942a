// join_store (tandem/rendezvous/join.hpp), the meeting every process backend starts with, with
// ranks as threads on one HashStore (the joining is the store's keys; the network is the store
// tests' business): a rank that never comes is named with where it was expected, and two
// processes with one rank or world sizes that differ end every waiting rank at once with an Error
// that says what to check, instead of a wait until the timeout.
#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "tandem/rendezvous/join.hpp"

using namespace std::chrono_literals;
using tandem::World;

namespace {

constexpr const char* url = "tcp://10.0.0.1:29500";

std::string this_host() {
  char name[256] = {};
  REQUIRE(::gethostname(name, sizeof name - 1) == 0);
  return name;
}

/// join_store for each World on a thread of its own, all on one store; each one's Error ("":
/// it joined).
std::vector<std::string> join_all(const std::vector<World>& worlds, tandem::Timeout timeout) {
  tandem::HashStore base(60s);
  std::vector<std::string> errors(worlds.size());
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < worlds.size(); ++i) {
    threads.emplace_back([&, i] {
      tandem::AnyStore store(base);
      try {
        tandem::join_store(store, worlds[i], timeout, url, tandem::Timeout::max());
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return errors;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("a rank that never joins is named with where it was expected and what to check") {
  // WORLD_SIZE=3 with two processes: ranks 0 and 1 wait for rank 2, the third of this host's.
  const auto errors = join_all({World::single_node(0, 3), World::single_node(1, 3)}, 1500ms);
  for (const auto& error : errors) {
    CAPTURE(error);
    CHECK(contains(error, "rank(s) 2 did not join " + std::string(url) + " within 1500 ms"));
    CHECK(contains(error, "(expected on host " + this_host() +
                              " as local rank 2: not started, or started with another "
                              "MASTER_ADDR, MASTER_PORT or run id?)"));
    CHECK(contains(error,
                   "check that WORLD_SIZE=3 is the number of processes started (the "
                   "launch command's --nnodes times --nproc-per-node)"));
  }
}

TEST_CASE("the waiting notice names the missing ranks, and the nodes where none has joined") {
  // Two nodes of two, as the launchers place them: node 0 (ranks 0, 1) has joined, node 1 and
  // rank 1 of node 0 have not... as rank 0 sees it.
  tandem::AnyStore store(tandem::HashStore(60s));
  const World rank0{0, 4, 0, 2, 0, 2};
  store.set("tandem/init/rank/0", tandem::detail::JoinRecord::mine(rank0).text());
  const std::string where =
      tandem::detail::missing_places(store, rank0, "tandem/init/rank/", {1, 2, 3});
  CHECK(where == "expected on host " + this_host() +
                     " (node 0) as local rank 1; ranks 2, 3 expected on node 1 as local ranks "
                     "0, 1, where no rank has joined yet (is that node's launcher running?): "
                     "not started, or started with another MASTER_ADDR, MASTER_PORT or run id?");
  CHECK(tandem::detail::waiting_notice(0, {1, 2, 3}, 4, "join", where, 30s, 30min) ==
        "tandem: rank 0 waiting for ranks 1, 2, 3 of 4 to join (" + where + ") (30 s of 1800 s)");
  CHECK(tandem::detail::waiting_notice(3, {5}, 8, "", "", 30s, tandem::Timeout::max()) ==
        "tandem: rank 3 waiting for rank 5 of 8 (30 s of no limit)");

  // Ranks that joined but have not reached a later step are named by process and host.
  const std::string late = tandem::detail::missing_places(store, rank0, "tandem/init/ready/", {0});
  CHECK(late == "rank 0 is pid " + std::to_string(::getpid()) + " on host " + this_host() +
                    " (node 0, local rank 0)");
}

TEST_CASE("a join record reads back what it wrote, and tolerates other text") {
  const auto mine = tandem::detail::JoinRecord::mine(World{5, 8, 1, 4, 1, 2});
  const auto back = tandem::detail::JoinRecord::parse(mine.text());
  CHECK(back.token == mine.token);
  CHECK(back.host == this_host());
  CHECK(back.pid == std::to_string(::getpid()));
  CHECK(back.node_rank == 1);
  CHECK(back.local_rank == 1);
  const auto bare = tandem::detail::JoinRecord::parse("somehost:42#0");
  CHECK(bare.describe() == "pid 42 on host somehost");
  const auto odd = tandem::detail::JoinRecord::parse("x y z");
  CHECK(odd.node_rank == -1);
  CHECK(odd.describe() == "x");
}

TEST_CASE("two processes with one rank end every waiting rank with what to check") {
  // Ranks 0, 1 and 1 again of 3 (a process too many, or two with one RANK), 60 s to join: the
  // second claim ends the join for all of them long before the timeout.
  const auto errors =
      join_all({World::single_node(0, 3), World::single_node(1, 3), World::single_node(1, 3)}, 60s);
  int twice = 0;
  int told = 0;
  for (const auto& error : errors) {
    CAPTURE(error);
    CHECK(!contains(error, "did not join"));
    twice += contains(error, "rank 1 joined " + std::string(url) + " twice: it is already held by");
    told += contains(error, "rank 1 was claimed by two processes at " + std::string(url));
    CHECK(contains(error,
                   "check the launch command (--nnodes, and --nproc-per-node and "
                   "--node-rank on every node)"));
  }
  CHECK(twice == 1);
  CHECK(told == 2);
}

TEST_CASE("processes that disagree on the world size end every waiting rank with what to check") {
  // Rank 0 thinks the job has 2 ranks, ranks 1 and 2 think 3: whoever joins first sets the size,
  // and every rank ends with an Error (none waits out the 60 s).
  const auto errors =
      join_all({World::single_node(0, 2), World::single_node(1, 3), World::single_node(2, 3)}, 60s);
  int disagree = 0;
  for (const auto& error : errors) {
    CAPTURE(error);
    CHECK(!contains(error, "did not join"));
    disagree += contains(error, "earlier have world_size=");
    CHECK((contains(error, "every process of a job needs the same WORLD_SIZE") ||
           contains(error, "processes disagree on the world size")));
  }
  CHECK(disagree >= 1);
}
