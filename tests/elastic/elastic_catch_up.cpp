// Elastic's rarest path, made to happen: one survivor loses the step's commit point (the barrier
// ends on every rank, but this one raises as if its end had been lost) while the others pass it
// and apply the step, and a rank is lost in the next step. The survivor behind must apply the
// committed step during the heal (with the old group's gradients), and both then take the next
// step again over the new group: their parameters are what the schedule of groups gives, equal
// on both, and each step was applied exactly once on each. And a second loss during a heal (a
// rank lost while the group re-forms): another round, and the group goes on without both.
#include <doctest/doctest.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "elastic/commit_losing_comm.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/elastic/elastic.hpp"
#include "tandem/rendezvous/store.hpp"

namespace {

using tandem::test::elastic::CommitLosingComm;
using tandem::test::elastic::lose_barrier_end_at;
using tandem::test::elastic::others_applied;

/// Thrown by the rank that leaves.
struct Leave {};

struct Outcome {
  std::vector<double> params;
  std::int64_t steps = 0;
  int applied = 0;
  int caught_up = 0;  // steps applied during a heal
  int generation = 0;
  std::vector<int> members;
};

}  // namespace

TEST_CASE("a survivor that lost the commit point applies the committed step during the heal") {
  constexpr int ranks = 3;
  constexpr int steps = 6;
  constexpr int committed = 2;  // rank 1 loses the end of step 2's barrier; the others pass it
  constexpr int leaver = 2;     // and rank 2 leaves at the start of step 3
  tandem::AnyStore store(tandem::HashStore{});
  std::vector<Outcome> outcomes(ranks);
  std::vector<std::string> errors(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      lose_barrier_end_at = r == 1 ? committed : -1;
      auto& out = outcomes[static_cast<std::size_t>(r)];
      try {
        tandem::Elastic<CommitLosingComm> elastic(
            tandem::World::single_node(r, ranks), store,
            tandem::LocalCommOptions{std::chrono::seconds(60)},
            {.window = std::chrono::minutes(10)});  // the leaver is known lost: never waited out
        std::vector<double> params(4, 0.0);
        std::vector<double> grads;
        while (elastic.steps_done() < steps) {
          elastic.step(
              [&](CommitLosingComm& comm) {
                const auto step = elastic.steps_done();
                if (r == leaver && step == committed + 1) {
                  others_applied.await_loser();
                  throw Leave{};
                }
                // Each member's gradient is its first rank + 1, times the step: the average says
                // which group reduced the step.
                grads.assign(params.size(), static_cast<double>((r + 1) * (step + 1)));
                comm.all_reduce(grads, tandem::ReduceOp::avg);
              },
              [&] {
                if (r != 1 && elastic.steps_done() == committed) others_applied.note_applied();
                for (std::size_t i = 0; i < params.size(); ++i) params[i] -= grads[i];
                ++out.applied;
                if (elastic.heals() > 0 && elastic.generation() == 0) ++out.caught_up;
              });
        }
        out.params = params;
        out.steps = elastic.steps_done();
        out.generation = elastic.generation();
        out.members = elastic.members();
      } catch (const Leave&) {
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();

  // Steps 0..2 reduced by {0, 1, 2} (mean of 1, 2, 3 = 2), steps 3..5 by {0, 1} (mean 1.5).
  double expected = 0.0;
  for (int s = 0; s < steps; ++s) expected -= (s <= committed ? 2.0 : 1.5) * (s + 1);
  for (int r : {0, 1}) {
    CAPTURE(r);
    const auto& out = outcomes[static_cast<std::size_t>(r)];
    CHECK_MESSAGE(errors[static_cast<std::size_t>(r)].empty(), errors[static_cast<std::size_t>(r)]);
    CHECK(out.steps == steps);
    CHECK(out.applied == steps);
    CHECK(out.generation == 1);
    CHECK(out.members == std::vector<int>{0, 1});
    REQUIRE(out.params.size() == 4);
    CHECK(out.params[0] == expected);
  }
  CHECK(outcomes[1].caught_up == 1);  // rank 1 applied step 2 during the heal
  CHECK(outcomes[0].caught_up == 0);
  CHECK_MESSAGE(errors[2].empty(), errors[2]);
}

TEST_CASE("a second loss during the heal: another round, and the group goes on without both") {
  constexpr int ranks = 4;
  constexpr int steps = 5;
  constexpr int first_loss_step = 2;  // rank 3 leaves at the start of step 2
  tandem::AnyStore store(tandem::HashStore{});
  std::vector<Outcome> outcomes(ranks);
  std::vector<std::string> errors(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      auto& out = outcomes[static_cast<std::size_t>(r)];
      try {
        tandem::Elastic<tandem::LocalComm> elastic(
            tandem::World::single_node(r, ranks), store,
            tandem::LocalCommOptions{std::chrono::seconds(60)},
            {.window = std::chrono::minutes(10)});  // both leavers are known lost
        // Rank 2 leaves while the group re-forms after rank 3's loss: in its rebuild.
        elastic.on_heal([] {},
                        [&](tandem::LocalComm&) {
                          if (r == 2) throw Leave{};
                        });
        std::vector<double> params(2, 0.0);
        std::vector<double> grads;
        while (elastic.steps_done() < steps) {
          elastic.step(
              [&](tandem::LocalComm& comm) {
                const auto step = elastic.steps_done();
                if (r == 3 && step == first_loss_step) throw Leave{};
                grads.assign(params.size(), static_cast<double>((r + 1) * (step + 1)));
                comm.all_reduce(grads, tandem::ReduceOp::avg);
              },
              [&] {
                for (std::size_t i = 0; i < params.size(); ++i) params[i] -= grads[i];
                ++out.applied;
              });
        }
        out.params = params;
        out.steps = elastic.steps_done();
        out.generation = elastic.generation();
        out.members = elastic.members();
      } catch (const Leave&) {
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();

  // Steps 0 and 1 by {0, 1, 2, 3} (mean of 1..4 = 2.5), the rest by {0, 1} (mean 1.5).
  double expected = 0.0;
  for (int s = 0; s < steps; ++s) expected -= (s < first_loss_step ? 2.5 : 1.5) * (s + 1);
  for (int r : {0, 1}) {
    CAPTURE(r);
    const auto& out = outcomes[static_cast<std::size_t>(r)];
    CHECK_MESSAGE(errors[static_cast<std::size_t>(r)].empty(), errors[static_cast<std::size_t>(r)]);
    CHECK(out.steps == steps);
    CHECK(out.applied == steps);
    CHECK(out.generation == 2);  // two rounds: the second after rank 2's loss
    CHECK(out.members == std::vector<int>{0, 1});
    REQUIRE(out.params.size() == 2);
    CHECK(out.params[0] == expected);
  }
  CHECK_MESSAGE(errors[2].empty(), errors[2]);
  CHECK_MESSAGE(errors[3].empty(), errors[3]);
}
