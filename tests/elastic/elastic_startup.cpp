// A rank lost during start-up, with ranks as threads over a HashStore: lost in the group's first
// rendezvous (it wrote its membership record, then its thread ended), the survivors' rendezvous
// fails and they heal from step 0 inside Elastic's constructor (HierarchicalComm over LocalComm:
// its rendezvous waits for every rank, where LocalComm's alone does not); lost after the group
// formed, before the first step (LocalComm), a collective in the first rebuild (what DDP's
// constructor is) fails, and Elastic::start heals it. Either way the survivors form generation 1
// without it and train on. The processes (SIGKILL under tandemrun, replacements):
// heal_driver.py --startup.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "tandem/comm/hierarchical/hierarchical.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/elastic/elastic.hpp"
#include "tandem/elastic/membership.hpp"
#include "tandem/rendezvous/store.hpp"

namespace {

/// Thrown by the rank that leaves.
struct Leave {};

struct Outcome {
  int generation = -1;
  int heals = -1;
  std::vector<int> members;
  std::vector<int> rebuilt_sizes;  // comm().size() at each rebuild
  int constructor_heals = -1;      // heals() when the constructor returned
  std::int64_t sum = 0;            // an all_reduce of 1 per rank in each of the steps
  std::string error;
};

constexpr int ranks = 3;
constexpr int victim = 1;
constexpr int steps = 3;

/// A survivor: forms the group (or heals it in the constructor), builds through start() a
/// "DDP" whose constructor is a collective, and takes a few steps of one all_reduce each.
template <class Comm>
void survive(tandem::AnyStore& store, int r, Outcome& out) {
  try {
    typename Comm::options_type options;
    options.timeout = std::chrono::seconds(2);  // the first rendezvous's detection
    tandem::Elastic<Comm> elastic(
        tandem::World::single_node(r, ranks), store, options,
        {.window = std::chrono::minutes(10)});  // the victim is known lost: never waited out
    out.constructor_heals = elastic.heals();
    elastic.on_heal([] {},
                    [&](Comm& comm) {
                      std::int64_t one = 1;
                      comm.all_reduce(std::span(&one, 1));  // as DDP's constructor broadcasts
                      out.rebuilt_sizes.push_back(comm.size());
                    });
    elastic.start();
    while (elastic.steps_done() < steps) {
      std::int64_t sum = 0;
      elastic.step(
          [&](Comm& comm) {
            sum = 1;
            comm.all_reduce(std::span(&sum, 1));
          },
          [&] { out.sum += sum; });
    }
    out.generation = elastic.generation();
    out.heals = elastic.heals();
    out.members = elastic.members();
  } catch (const std::exception& e) {
    out.error = e.what();
  }
}

void check_survivors(const std::vector<Outcome>& outcomes) {
  for (int r = 0; r < ranks; ++r) {
    if (r == victim) continue;
    const auto& out = outcomes[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << out.error);
    CHECK(out.error.empty());
    CHECK(out.generation == 1);
    CHECK(out.heals == 1);
    CHECK(out.members == std::vector<int>{0, 2});
    REQUIRE(!out.rebuilt_sizes.empty());
    CHECK(out.rebuilt_sizes.back() == 2);  // the last rebuild: over the survivors
    CHECK(out.sum == std::int64_t{2} * steps);
  }
}

/// Runs every rank as a thread over one store: the survivors survive<Comm>, the victim
/// `lose(store)`; returns what the survivors saw.
template <class Comm, class Lose>
std::vector<Outcome> run_ranks(Lose lose) {
  tandem::AnyStore store(tandem::HashStore{});
  std::vector<Outcome> outcomes(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      if (r == victim) {
        lose(store);
      } else {
        survive<Comm>(store, r, outcomes[static_cast<std::size_t>(r)]);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  check_survivors(outcomes);
  return outcomes;
}

}  // namespace

TEST_CASE("a member lost in the first rendezvous: the survivors heal from step 0") {
  // Its rendezvous waits for every rank (LocalComm's alone does not).
  using Comm = tandem::HierarchicalComm<tandem::LocalComm, tandem::LocalComm>;
  const auto outcomes = run_ranks<Comm>([](tandem::AnyStore& store) {
    // What the constructor does before its rendezvous (white-box: Elastic's record of a member),
    // and then the thread ends: lost between joining and the group's forming.
    const auto record =
        tandem::elastic::MemberRecord::mine(tandem::World::single_node(victim, ranks));
    store.set("tandem/elastic//member/" + std::to_string(victim), record.text());
  });
  for (int r = 0; r < ranks; ++r) {
    if (r == victim) continue;
    // Healed in the constructor, and nobody rebuilt over the first group: it never formed.
    CHECK(outcomes[static_cast<std::size_t>(r)].constructor_heals == 1);
    CHECK(outcomes[static_cast<std::size_t>(r)].rebuilt_sizes.size() == 1);
  }
}

TEST_CASE("a member lost before the first step: Elastic::start heals the first rebuild") {
  (void)run_ranks<tandem::LocalComm>([](tandem::AnyStore& store) {
    try {
      tandem::Elastic<tandem::LocalComm> elastic(tandem::World::single_node(victim, ranks), store,
                                                 tandem::LocalCommOptions{std::chrono::seconds(60)},
                                                 {.window = std::chrono::minutes(10)});
      throw Leave{};  // in the group, before start(): its end fails the others' rebuild
    } catch (const Leave&) {
    }
  });
}
