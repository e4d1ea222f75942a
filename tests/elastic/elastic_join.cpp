// A replacement heals from a peer, with ranks as threads (LocalComm over a HashStore): a rank
// leaves, a new thread takes its first rank as a replacement (ElasticOptions::replacement), joins
// the group at a step boundary (or, with await_replacement, in the heal itself) and receives the
// state from the sender through Elastic::on_join; every member then holds the same parameters and
// momentum, which are what the schedule of groups gives. And a replacement that comes after the
// run has finished has nothing to do (finished()).
#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "tandem/comm/local/local.hpp"
#include "tandem/elastic/elastic.hpp"
#include "tandem/rendezvous/store.hpp"

namespace {

/// Thrown by the rank that leaves.
struct Leave {};

/// One rank's training: params -= momentum, momentum = 0.9 momentum + mean gradient, each rank's
/// gradient its first rank + 1 times the step + 1 (so the mean says which group reduced a step).
struct Outcome {
  std::vector<double> params;
  std::vector<double> momentum;
  std::vector<int> sizes;  // the group's size at each step this rank applied
  std::int64_t steps = 0;
  int generation = 0;
  int joins = 0;
  std::vector<int> members;
  std::string error;
};

struct Run {
  int ranks = 3;
  int steps = 8;
  int leaver = -1;  // leaves at the start of step leave_at
  int leave_at = 2;
  int wait_at = -1;  // the members wait at this step until a replacement asked to join
  std::chrono::milliseconds await{0};
};

void train(const Run& run, tandem::AnyStore& store, int r, bool replacement, Outcome& out) {
  try {
    tandem::Elastic<tandem::LocalComm> elastic(
        tandem::World::single_node(r, run.ranks), store,
        tandem::LocalCommOptions{std::chrono::seconds(60)},
        {.window = std::chrono::minutes(10),  // a leaver is known lost: never waited out
         .replacement = replacement,
         .await_replacement = run.await});
    if (elastic.finished()) {
      out.error = "finished";
      return;
    }
    std::vector<double> params(3, 0.0);
    std::vector<double> momentum(3, 0.0);
    std::vector<double> grads;
    elastic.on_join(
        [&] {
          std::vector<std::byte> bytes((params.size() + momentum.size()) * sizeof(double));
          std::memcpy(bytes.data(), params.data(), params.size() * sizeof(double));
          std::memcpy(bytes.data() + params.size() * sizeof(double), momentum.data(),
                      momentum.size() * sizeof(double));
          return bytes;
        },
        [&](std::span<const std::byte> bytes) {
          REQUIRE(bytes.size() == (params.size() + momentum.size()) * sizeof(double));
          std::memcpy(params.data(), bytes.data(), params.size() * sizeof(double));
          std::memcpy(momentum.data(), bytes.data() + params.size() * sizeof(double),
                      momentum.size() * sizeof(double));
        });
    while (elastic.steps_done() < run.steps) {
      elastic.step(
          [&](tandem::LocalComm& comm) {
            const auto step = elastic.steps_done();
            if (!replacement && r == run.leaver && step == run.leave_at) throw Leave{};
            if (step == run.wait_at) {  // white-box: the replacement's ticket (Elastic's prefix
                                        // ends in "/")
              const std::vector<std::string> asked{"tandem/elastic//join/1"};
              while (!store.check(asked)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
            }
            grads.assign(params.size(), static_cast<double>((r + 1) * (step + 1)));
            comm.all_reduce(grads, tandem::ReduceOp::avg);
          },
          [&] {
            for (std::size_t i = 0; i < params.size(); ++i) {
              momentum[i] = 0.9 * momentum[i] + grads[i];
              params[i] -= momentum[i];
            }
            out.sizes.push_back(static_cast<int>(elastic.members().size()));
          });
    }
    out.params = params;
    out.momentum = momentum;
    out.steps = elastic.steps_done();
    out.generation = elastic.generation();
    out.joins = elastic.joins();
    out.members = elastic.members();
  } catch (const Leave&) {
    out.error = "left";
  } catch (const std::exception& e) {
    out.error = e.what();
  }
}

/// Runs the group, the leaver's replacement started once the leaver's thread has ended.
std::vector<Outcome> run_with_replacement(const Run& run, Outcome& replaced) {
  tandem::AnyStore store(tandem::HashStore{});
  std::vector<Outcome> outcomes(static_cast<std::size_t>(run.ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < run.ranks; ++r) {
    threads.emplace_back(
        [&, r] { train(run, store, r, false, outcomes[static_cast<std::size_t>(r)]); });
  }
  threads[static_cast<std::size_t>(run.leaver)].join();
  std::thread replacement([&] { train(run, store, run.leaver, true, replaced); });
  for (int r = 0; r < run.ranks; ++r) {
    if (r != run.leaver) threads[static_cast<std::size_t>(r)].join();
  }
  replacement.join();
  return outcomes;
}

/// The parameter (or, with `want_momentum`, the momentum) the groups give, `sizes[s]` members at
/// step s: first ranks 0 .. size-1 (the leaver, when the group is smaller, is the last rank).
double expected(const std::vector<int>& sizes, bool want_momentum) {
  double param = 0.0;
  double momentum = 0.0;
  for (std::size_t s = 0; s < sizes.size(); ++s) {
    const double mean = (sizes[s] + 1) / 2.0;  // of the first ranks + 1
    momentum = 0.9 * momentum + mean * static_cast<double>(s + 1);
    param -= momentum;
  }
  return want_momentum ? momentum : param;
}

}  // namespace

TEST_CASE("a replacement thread joins at a step boundary and receives the state") {
  // Rank 2 leaves at step 2; the survivors go on as {0, 1} and wait at step 5 until the
  // replacement has asked, so that it joins at the boundary after step 5 or 6.
  const Run run{.ranks = 3, .steps = 9, .leaver = 2, .leave_at = 2, .wait_at = 5};
  Outcome replaced;
  const auto outcomes = run_with_replacement(run, replaced);
  CHECK(outcomes[2].error == "left");
  REQUIRE_MESSAGE(replaced.error.empty(), replaced.error);
  const auto& sizes = outcomes[0].sizes;
  REQUIRE(sizes.size() == 9);
  CHECK(sizes[0] == 3);
  CHECK(sizes[1] == 3);
  CHECK(sizes[2] == 2);  // the redone step, over the survivors
  CHECK(sizes.back() == 3);
  for (int r : {0, 1}) {
    CAPTURE(r);
    const auto& out = outcomes[static_cast<std::size_t>(r)];
    REQUIRE_MESSAGE(out.error.empty(), out.error);
    CHECK(out.sizes == sizes);
    CHECK(out.steps == run.steps);
    CHECK(out.generation == 2);  // the heal, then the join
    CHECK(out.joins == 1);
    CHECK(out.members == std::vector<int>{0, 1, 2});
    CHECK(out.params == replaced.params);  // bit for bit: the replacement got the sender's
    CHECK(out.momentum == replaced.momentum);
    CHECK(out.params[0] == expected(sizes, false));
    CHECK(out.momentum[0] == expected(sizes, true));
  }
  CHECK(replaced.steps == run.steps);
  CHECK(replaced.generation == 2);
  CHECK(replaced.members == std::vector<int>{0, 1, 2});
}

TEST_CASE("with await_replacement the replacement joins in the heal: the run is the undisturbed") {
  // Rank 0 leaves at step 3: its replacement becomes rank 0 again, the sender is rank 1.
  const Run run{
      .ranks = 3, .steps = 7, .leaver = 0, .leave_at = 3, .await = std::chrono::minutes(10)};
  Outcome replaced;
  const auto outcomes = run_with_replacement(run, replaced);
  REQUIRE_MESSAGE(replaced.error.empty(), replaced.error);
  const std::vector<int> all(7, 3);
  for (int r : {1, 2}) {
    CAPTURE(r);
    const auto& out = outcomes[static_cast<std::size_t>(r)];
    REQUIRE_MESSAGE(out.error.empty(), out.error);
    CHECK(out.sizes == all);  // the group never shrank
    CHECK(out.generation == 1);
    CHECK(out.joins == 1);
    CHECK(out.params == replaced.params);
    CHECK(out.momentum == replaced.momentum);
    CHECK(out.params[0] == expected(all, false));  // as if nobody had left
  }
  CHECK(replaced.members == std::vector<int>{0, 1, 2});
}

TEST_CASE("a replacement that comes after the run has finished has nothing to do") {
  tandem::AnyStore store(tandem::HashStore{});
  const Run run{.ranks = 2, .steps = 2};
  std::vector<Outcome> outcomes(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back(
        [&, r] { train(run, store, r, false, outcomes[static_cast<std::size_t>(r)]); });
  }
  for (auto& t : threads) t.join();
  for (const auto& out : outcomes) CHECK_MESSAGE(out.error.empty(), out.error);
  Outcome late;
  std::thread([&] { train(run, store, 1, true, late); }).join();
  CHECK(late.error == "finished");
}
