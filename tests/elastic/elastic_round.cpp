// The elastic heal's parts on their own (include/tandem/elastic/membership.hpp): the decision
// every survivor takes from a round's arrivals (who is in, which step is redone, who first
// applies the committed one), the World of a member of the new group, and the membership round
// over a HashStore with members as threads: it closes without a member known lost, without one
// that cannot be told after the window, and leaves a latecomer out with an Error; and the texts a
// replacement and the group exchange in the store (JoinRequest, Admission); and a group that
// grows (how_it_comes, the largest size agreed, refusals).
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "support/error_of.hpp"
#include "tandem/elastic/membership.hpp"
#include "tandem/rendezvous/store.hpp"

namespace el = tandem::elastic;

TEST_CASE("plan_heal: nobody committed the step in flight, so every survivor redoes it") {
  const auto plan = el::plan_heal({{3, 7, true}, {0, 7, false}, {2, 7, true}});
  CHECK(plan.members == std::vector<int>{0, 2, 3});
  CHECK(plan.steps_done == 7);
  CHECK(plan.catching_up.empty());
}

TEST_CASE("plan_heal: one survivor passed the commit point, the others apply the step first") {
  const auto plan = el::plan_heal({{1, 8, false}, {0, 7, true}, {3, 7, true}});
  CHECK(plan.members == std::vector<int>{0, 1, 3});
  CHECK(plan.steps_done == 8);
  CHECK(plan.catching_up == std::vector<int>{0, 3});
}

TEST_CASE("plan_heal: a state no step through Elastic can leave is an Error naming the member") {
  // Behind without the next step's reduced gradients: the others applied a step it cannot.
  auto message = tandem::test::error_of([] {
    (void)el::plan_heal({{0, 8, false}, {2, 7, false}});
  });
  CHECK(message.find("member 2 has applied 7 steps without") != std::string::npos);
  // Two steps behind.
  message = tandem::test::error_of([] { (void)el::plan_heal({{0, 9, false}, {1, 7, true}}); });
  CHECK(message.find("member 1 has applied 7 steps") != std::string::npos);
  message = tandem::test::error_of([] { (void)el::plan_heal({{1, 3, false}, {1, 3, false}}); });
  CHECK(message.find("member 1 arrived twice") != std::string::npos);
  message = tandem::test::error_of([] { (void)el::plan_heal({}); });
  CHECK(message.find("no member arrived") != std::string::npos);
}

TEST_CASE("world_of: dense ranks in first-rank order, nodes and local ranks renumbered") {
  const std::map<int, int> node_of{{0, 0}, {1, 0}, {2, 1}, {3, 1}, {4, 2}, {5, 2}};
  const std::vector<int> members{0, 2, 3, 5};  // rank 1 and 4 lost
  const auto w = el::world_of(members, node_of, 3);
  CHECK(w.rank == 2);
  CHECK(w.world_size == 4);
  CHECK(w.node_rank == 1);
  CHECK(w.nnodes == 3);
  CHECK(w.local_rank == 1);
  CHECK(w.local_world_size == 2);
  CHECK_NOTHROW(w.validate());
  const auto last = el::world_of(members, node_of, 5);
  CHECK(last.rank == 3);
  CHECK(last.node_rank == 2);
  CHECK(last.local_rank == 0);
  CHECK(last.local_world_size == 1);
}

TEST_CASE("MemberRecord: text round trip; a thread of this process that ended is known lost") {
  const auto mine = el::MemberRecord::mine(tandem::World::single_node(0, 1));
  const auto parsed = el::MemberRecord::parse(mine.text());
  REQUIRE(parsed);
  CHECK(parsed->text() == mine.text());
  CHECK_FALSE(mine.known_lost(mine));
  CHECK_FALSE(el::MemberRecord::parse("host only"));
  el::MemberRecord ended;
  std::thread([&] { ended = el::MemberRecord::mine(tandem::World::single_node(1, 2)); }).join();
  CHECK(ended.known_lost(mine));
  el::MemberRecord elsewhere = ended;
  elsewhere.host = mine.host + "-elsewhere";
  CHECK_FALSE(elsewhere.known_lost(mine));  // cannot be told from here: the window decides
}

namespace {

/// Members 0..n-1 announce themselves as threads of this process that stay alive while the round
/// runs (`alive`), except those in `lost`, whose threads have ended.
std::vector<el::MembershipRound<tandem::AnyStore>> rounds(tandem::AnyStore& store, int n,
                                                          const std::vector<int>& lost,
                                                          tandem::Timeout window) {
  std::vector<el::MembershipRound<tandem::AnyStore>> made;
  for (int m = 0; m < n; ++m) {
    el::MemberRecord record;
    std::thread([&] { record = el::MemberRecord::mine(tandem::World::single_node(m, n)); }).join();
    const bool gone = std::find(lost.begin(), lost.end(), m) != lost.end();
    // A live member's record names this (running) thread; a lost one's the thread that ended.
    if (!gone) record = el::MemberRecord::mine(tandem::World::single_node(m, n));
    made.emplace_back(store, m, record, el::RoundOptions{.window = window});
    made.back().announce();
  }
  return made;
}

}  // namespace

TEST_CASE("MembershipRound: closes as soon as every member arrived or is known lost") {
  tandem::AnyStore store(tandem::HashStore{});
  // A window no test waits out: the round must close because member 1 is known lost.
  auto members = rounds(store, 4, {1}, std::chrono::minutes(10));
  std::vector<std::vector<el::Arrival>> seen(4);
  std::vector<std::thread> threads;
  for (int m : {0, 2, 3}) {
    threads.emplace_back([&, m] {
      seen[static_cast<std::size_t>(m)] =
          members[static_cast<std::size_t>(m)].run(1, {0, 1, 2, 3}, {m, 5, m == 2});
    });
  }
  for (auto& t : threads) t.join();
  for (int m : {0, 2, 3}) {
    const auto plan = el::plan_heal(seen[static_cast<std::size_t>(m)]);
    CHECK(plan.members == std::vector<int>{0, 2, 3});
    CHECK(plan.steps_done == 5);
  }
}

TEST_CASE(
    "MembershipRound: a member that cannot be told is waited for until the window only; a "
    "latecomer is left out with an Error") {
  tandem::AnyStore store(tandem::HashStore{});
  auto members = rounds(store, 3, {}, std::chrono::milliseconds(300));
  std::vector<std::vector<el::Arrival>> seen(3);
  std::thread first([&] { seen[0] = members[0].run(1, {0, 1, 2}, {0, 2, false}); });
  std::thread second([&] { seen[1] = members[1].run(1, {0, 1, 2}, {1, 2, false}); });
  first.join();
  second.join();
  CHECK(el::plan_heal(seen[0]).members == std::vector<int>{0, 1});
  CHECK(el::plan_heal(seen[1]).members == std::vector<int>{0, 1});
  const auto late = tandem::test::error_of([&] {
    (void)members[2].run(1, {0, 1, 2}, {2, 2, false});
  });
  CHECK(late.find("re-formed as generation 1 without this rank") != std::string::npos);
  CHECK(late.find("rank 2") != std::string::npos);
}

TEST_CASE("JoinRequest and Admission: text round trips; what is not one is refused") {
  el::MemberRecord record;
  record.host = "node7";
  record.pid_space = "pid:[4026531836]";
  record.pid = 4242;
  record.tid = 4243;
  record.node_rank = 1;
  const auto request = el::JoinRequest::parse(el::JoinRequest{2, record}.text());
  REQUIRE(request);
  CHECK(request->member == 2);
  CHECK(request->record.text() == record.text());
  CHECK_FALSE(el::JoinRequest::parse("2"));
  CHECK_FALSE(el::JoinRequest::parse("x node7 ns 1 2 0"));
  CHECK_FALSE(el::JoinRequest::parse("-1 node7 ns 1 2 0"));
  CHECK_FALSE(el::JoinRequest::parse("2 node7 ns"));

  const el::Admission admitted{3, 41, 0, 2, {0, 1, 2}, {}};
  const auto back = el::Admission::parse(admitted.text());
  REQUIRE(back);
  CHECK(back->generation == 3);
  CHECK(back->steps_done == 41);
  CHECK(back->sender == 0);
  CHECK(back->tickets == 2);
  CHECK(back->members == std::vector<int>{0, 1, 2});
  CHECK(back->refused.empty());
  const auto refused = el::Admission::parse(el::Admission{0, 0, 0, 0, {}, "rank 1 is live"}.text());
  REQUIRE(refused);
  CHECK(refused->refused == "rank 1 is live");
  CHECK_FALSE(el::Admission::parse("3 41 0 2"));      // no members
  CHECK_FALSE(el::Admission::parse("3 41 0 2 2 0"));  // members out of order
  CHECK_FALSE(el::Admission::parse("three"));
}

TEST_CASE("a group that grows: how a joining process comes, the largest size, refusals") {
  tandem::HashStore store;
  const std::string size_key = "tandem/init/world_size";
  const std::string joined = "tandem/init/rank/";
  const auto timeout = std::chrono::milliseconds(50);
  // An empty store: no job (first_size 0), so the join finds it finished.
  auto coming = el::how_it_comes(store, size_key, joined, 2, timeout);
  CHECK(coming.first_size == 0);
  CHECK_FALSE(coming.grows);
  CHECK_FALSE(coming.fills_in);
  // A job of 2 that formed: rank 1 replaces a member, rank 2 is a new one.
  store.set(size_key, "2");
  store.set(joined + "0", "x");
  store.set(joined + "1", "x");
  coming = el::how_it_comes(store, size_key, joined, 1, timeout);
  CHECK(coming.first_size == 2);
  CHECK_FALSE(coming.grows);
  CHECK_FALSE(coming.fills_in);
  coming = el::how_it_comes(store, size_key, joined, 2, timeout);
  CHECK(coming.grows);
  CHECK_FALSE(coming.fills_in);

  // The members agree on the largest size; one that offers another raises, naming both.
  CHECK(el::agree_max_members(store, 0, 2, 4) == 4);
  CHECK(el::agree_max_members(store, 1, 2, 4) == 4);
  CHECK(tandem::test::error_of([&] {
          (void)el::agree_max_members(store, 1, 2, 6);
        }).find("allows the group up to 6 members") != std::string::npos);
  CHECK(tandem::test::error_of([&] {
          (void)el::agree_max_members(store, 1, 2, 0);
        }).find("allows the group up to 2 members") != std::string::npos);
  CHECK(el::max_members(store, 3, timeout) == 4);
  CHECK(tandem::test::error_of([&] {
          (void)el::max_members(store, 4, timeout);
        }).find("rank 4 is beyond the group's largest size, 4 ranks") != std::string::npos);

  const std::vector<int> members{0, 1};
  CHECK(el::refusal(el::JoinRequest{3, {}}, "", members, 4).empty());
  CHECK(el::refusal(el::JoinRequest{1, {}}, "", members, 4) == "rank 1 is a live member");
  CHECK(el::refusal(el::JoinRequest{4, {}}, "", members, 4).starts_with("rank 4 is beyond"));
  CHECK(el::refusal(std::nullopt, "junk", members, 4) == "its request 'junk' is unreadable");
}
