// A rank lost during start-up, with ranks as threads over a HashStore: lost in the group's first
// rendezvous (it wrote its membership record, then its thread ended), the survivors' rendezvous
// fails and they heal from step 0 inside Elastic's constructor (HierarchicalComm over LocalComm:
// its rendezvous waits for every rank, where LocalComm's alone does not); lost after the group
// formed, before the first step (LocalComm), a collective in the first rebuild (what DDP's
// constructor is) fails, and Elastic::start heals it. Either way the survivors form generation 1
// without it and train on. With await_replacement, one survivor's first rendezvous fails (it heals
// in the constructor, before on_join) while the other's succeeds (it heals in start()): both must
// admit the victim's replacement in the same heal (a GlooComm rank's rendezvous can fail so when
// a peer dies in it). The processes (SIGKILL under tandemrun, replacements):
// heal_driver.py --startup.
#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
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

/// After the constructor: builds through start() a "DDP" whose constructor is a collective,
/// takes a few steps of one all_reduce each, and notes what it saw.
template <class Comm>
void train(tandem::Elastic<Comm>& elastic, Outcome& out) {
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
}

/// A survivor: forms the group (or heals it in the constructor), then trains.
template <class Comm>
void survive(tandem::AnyStore& store, int r, Outcome& out) {
  try {
    typename Comm::options_type options;
    options.timeout = std::chrono::seconds(2);  // the first rendezvous's detection
    tandem::Elastic<Comm> elastic(
        tandem::World::single_node(r, ranks), store, options,
        {.window = std::chrono::minutes(10)});  // the victim is known lost: never waited out
    out.constructor_heals = elastic.heals();
    train(elastic, out);
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

/// The job's store as one rank sees it, whose reads of keys containing `fails_on` fail: with
/// generation 0's backend keys, that rank's first rendezvous fails after its writes, while the
/// others' succeed.
class FirstRendezvousFails {
 public:
  using store_concept = tandem::store_tag;

  FirstRendezvousFails(tandem::AnyStore store, std::string fails_on)
      : store_(std::move(store)), fails_on_(std::move(fails_on)) {}

  void set(const std::string& key, std::string_view value) { store_.set(key, value); }
  std::string get(const std::string& key) { return store_.get(checked(key)); }
  std::string get(const std::string& key, tandem::Timeout timeout) {
    return store_.get(checked(key), timeout);
  }
  std::int64_t add(const std::string& key, std::int64_t delta) { return store_.add(key, delta); }
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired) {
    return store_.compare_set(key, expected, desired);
  }
  void wait(std::span<const std::string> keys) { store_.wait(keys); }
  void wait(std::span<const std::string> keys, tandem::Timeout timeout) {
    store_.wait(keys, timeout);
  }
  bool check(std::span<const std::string> keys) { return store_.check(keys); }
  bool delete_key(const std::string& key) { return store_.delete_key(key); }
  std::int64_t num_keys() { return store_.num_keys(); }
  [[nodiscard]] tandem::Timeout timeout() const { return store_.timeout(); }
  void set_timeout(tandem::Timeout timeout) { store_.set_timeout(timeout); }

 private:
  const std::string& checked(const std::string& key) const {
    if (key.find(fails_on_) != std::string::npos) {
      throw tandem::Error("test store", "this rank's reads of " + key + " fail");
    }
    return key;
  }

  tandem::AnyStore store_;
  std::string fails_on_;
};

/// A member of a group that awaits replacements in its heals (member 1's replacement: a process
/// joining the running group, here a thread): registers on_join (the state: its first rank,
/// which the replacement must receive from the sender, member 0), then trains.
void take_part(tandem::AnyStore store, int r, bool replacement, Outcome& out, int& state_received) {
  try {
    tandem::Elastic<tandem::LocalComm> elastic(
        tandem::World::single_node(r, ranks), std::move(store),
        tandem::LocalCommOptions{std::chrono::seconds(10)},
        {.window = std::chrono::minutes(1),  // the victim is known lost: never waited out
         .replacement = replacement,
         .join_timeout = std::chrono::minutes(1),
         .await_replacement = std::chrono::minutes(1)});
    out.constructor_heals = elastic.heals();
    const int mine = r;
    elastic.on_join([&] { return std::vector<std::byte>{static_cast<std::byte>(mine)}; },
                    [&](std::span<const std::byte> bytes) {
                      state_received = bytes.size() == 1 ? static_cast<int>(bytes[0]) : -2;
                    });
    train(elastic, out);
  } catch (const std::exception& e) {
    out.error = e.what();
  }
}

/// Member `failing`'s first rendezvous fails (it heals in its constructor, before on_join), the
/// victim leaves after the group formed (the other survivor heals in start()), and the victim's
/// replacement starts once it is gone: every survivor must admit it in that one heal.
void replaced_while_one_heals_in_its_constructor(int failing) {
  tandem::AnyStore shared(tandem::HashStore{});
  std::vector<Outcome> outcomes(ranks + 1);  // the replacement's last
  int state_received = -1;
  int unused = -1;
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    if (r == victim) continue;
    tandem::AnyStore store =
        r == failing ? tandem::AnyStore(FirstRendezvousFails(shared, "/gen0/backend/")) : shared;
    threads.emplace_back([&, r, store]() mutable {
      take_part(std::move(store), r, false, outcomes[static_cast<std::size_t>(r)], unused);
    });
  }
  std::thread([&] {
    try {
      tandem::Elastic<tandem::LocalComm> elastic(tandem::World::single_node(victim, ranks), shared,
                                                 tandem::LocalCommOptions{std::chrono::seconds(60)},
                                                 {.window = std::chrono::minutes(1)});
      throw Leave{};  // in the group, before start()
    } catch (const Leave&) {
    }
  }).join();
  threads.emplace_back([&] {  // after the victim's thread ended: it is known lost
    take_part(shared, victim, true, outcomes[ranks], state_received);
  });
  for (auto& thread : threads) thread.join();
  for (int r = 0; r <= ranks; ++r) {
    if (r == victim) continue;
    const auto& out = outcomes[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << out.error);
    CHECK(out.error.empty());
    CHECK(out.generation == 1);
    CHECK(out.members == std::vector<int>{0, 1, 2});
    REQUIRE(!out.rebuilt_sizes.empty());
    CHECK(out.rebuilt_sizes.back() == 3);  // the replacement came in the heal
    CHECK(out.sum == std::int64_t{3} * steps);
    if (r != ranks) CHECK(out.heals == 1);
  }
  CHECK(outcomes[static_cast<std::size_t>(failing)].constructor_heals == 1);
  CHECK(state_received == 0);  // from the sender, member 0
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

TEST_CASE(
    "one survivor heals in its constructor, the other in start(): both admit the "
    "replacement") {
  SUBCASE("the sender heals in start()") {
    replaced_while_one_heals_in_its_constructor(2);
  }
  SUBCASE("the sender heals in its constructor, and sends in on_join") {
    replaced_while_one_heals_in_its_constructor(0);
  }
}
