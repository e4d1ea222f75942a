// ZeRO under tandem::Elastic (include/tandem/ddp/elastic_zero.hpp), ranks as threads: a rank
// leaves a ZeRO-1 or ZeRO-2 training with AdamW at a step (before the all_gather of the last
// step's parameters, after the gradient reduction, or after the replica's gradient exchange); the
// survivors heal, put the lost shard together from its replica and finish. The claim tested, bit
// for bit: the parameters and the full optimizer state at the end are those of an undisturbed run
// that took the steps before the loss at the full size, saved its state, and took the rest at the
// smaller size from that state (the learning rate set each step on the rank's optimizer, which
// the replica follows). A replacement joins and receives its shard through attach, bit for bit
// the runs at the group's sizes. And two ring neighbours lost together (a shard and its only
// replica): an Error naming the cause, also on replacements joining in that heal (no hang,
// nothing applied in part).
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "elastic/commit_losing_comm.hpp"
#include "elastic/training.hpp"
#include "support/mlp.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/ddp/ddp.hpp"
#include "tandem/ddp/elastic_zero.hpp"
#include "tandem/elastic/elastic.hpp"
#include "tandem/optim/adamw.hpp"
#include "tandem/rendezvous/store.hpp"

namespace {

using Opt = tandem::optim::AdamW<float>;
using Dict = Opt::state_dict_type;
template <int Stage, class Comm = tandem::LocalComm>
using Ddp = tandem::DistributedDataParallel<Comm, tandem::overlap, tandem::bucket_cap<512>,
                                            tandem::shard<Stage>>;
namespace el = tandem::test::elastic;

/// Where the leaver leaves its step.
/// start: before the step's first collective, the all_gather of the last step's parameters (so
/// the leaver's updated parts exist only on it and in its replica).
enum class Point { start, after_reduction, after_exchange };

/// Thrown by a rank that leaves.
struct Leave {};

/// The leavers of each step wait for each other before they leave, so that ranks lost "together"
/// are: otherwise, on a loaded machine, one leaver could still be inside the previous step's
/// commit point when the other leaves, fail there, join the heal, and leave only the next
/// generation (two heals of one loss each, not the loss of two at once).
class LeaveTogether {
 public:
  explicit LeaveTogether(const std::vector<std::int64_t>& steps) {
    for (const auto step : steps) ++expected_[step];
  }
  /// Called by a leaver at step `step`, right before it throws Leave. Bounded: a leaver that
  /// failed before its step (a test failure of its own) does not hang the others.
  void arrive(std::int64_t step) {
    std::unique_lock lock(mutex_);
    ++arrived_[step];
    changed_.notify_all();
    changed_.wait_for(lock, std::chrono::seconds(120),
                      [&] { return arrived_[step] >= expected_[step]; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::int64_t, int> expected_;
  std::map<std::int64_t, int> arrived_;
};

/// The full state a rank ends with: its parameters' bytes and the gathered optimizer state's
/// (every tensor in the dict's order, then every step count).
struct Final {
  std::vector<std::byte> params;
  std::vector<std::byte> state;
  std::int64_t steps = 0;
  int generation = 0;
  std::vector<int> members;
  int caught_up = 0;                  // steps applied during a heal
  std::vector<int> sizes;             // the group's size at each step applied (run_with_joins)
  std::int64_t optimizer_steps = -1;  // run_with_joins: its optimizer's steps (also on an Error)
  bool named = false;                 // run_with_joins: the error was a tandem::Error
};

std::vector<std::byte> bytes_of(const void* data, std::size_t size) {
  std::vector<std::byte> out(size);
  if (size != 0) std::memcpy(out.data(), data, size);
  return out;
}

/// A run's start: step `first`, and the state to load there (none: the model's initial values).
struct Start {
  std::int64_t first = 0;
  const std::vector<float>* params = nullptr;
  const Dict* dict = nullptr;
};

/// A rank (its first rank) that leaves at a step.
struct Loss {
  int rank = 0;
  std::int64_t step = 0;
};

/// The rarest path (CommitLosingComm): `loser` loses the end of step `step`'s commit point while
/// the others pass it and apply the step; the run's loss (at step + 1, Point::start) comes once
/// it has raised, and it applies the step during the heal.
struct CatchUp {
  int loser = -1;
  std::int64_t step = -1;
};

/// `ranks` threads train steps [start.first, last) under Elastic with ElasticZero (each rank's
/// batch a function of the step and its rank in the group); each of `losses` leaves at its step,
/// at `point` (at step `last`: before the last step's all_gather). Returns each rank's Final (empty
/// for a leaver) and writes errors[r]; with `saved`, the full state at the end too.
template <int Stage, class Comm = tandem::LocalComm>
std::vector<Final> run(int ranks, const Start& start, std::int64_t last,
                       const std::vector<Loss>& losses, Point point,
                       std::vector<std::string>& errors, Dict* saved = nullptr,
                       std::vector<float>* saved_params = nullptr, CatchUp catch_up = {}) {
  tandem::AnyStore store(tandem::HashStore{});
  std::vector<Final> finals(static_cast<std::size_t>(ranks));
  errors.assign(static_cast<std::size_t>(ranks), {});
  el::others_applied.count = 0;
  el::others_applied.expected = ranks - 1;
  el::others_applied.loser_threw = false;
  std::vector<std::int64_t> leave_steps;
  for (const auto& loss : losses) leave_steps.push_back(loss.step);
  LeaveTogether together(leave_steps);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      el::barriers_seen = 0;  // one barrier per step: the commit point
      el::lose_barrier_end_at = r == catch_up.loser ? static_cast<int>(catch_up.step) : -1;
      std::int64_t leave_at = -1;
      for (const auto& loss : losses) leave_at = loss.rank == r ? loss.step : leave_at;
      try {
        tandem::Elastic<Comm> elastic(
            tandem::World::single_node(r, ranks), store,
            tandem::LocalCommOptions{std::chrono::seconds(120)},
            {.window = std::chrono::minutes(10)});  // a leaver is known lost: never waited out
        tandem::test::Mlp<float> model({8, 24, 24, 4}, /*seed=*/7);
        auto& params = model.params();
        if (start.params) {
          std::memcpy(params.values().data(), start.params->data(), params.numel() * sizeof(float));
        }
        tandem::ElasticZero<Opt> zero(params, [&] { return Opt(params, {.lr = 0.01}); });
        std::optional<Ddp<Stage, Comm>> ddp;
        ddp.emplace(elastic.comm(), params);
        zero.attach(*ddp, elastic.members());
        Opt& opt = zero.optimizer();  // the same object across heals
        if (start.dict) zero.load_state_dict(*start.dict);
        elastic.on_heal([&] { ddp.reset(); },
                        [&](Comm& comm) {
                          ddp.emplace(comm, params);
                          zero.attach(*ddp, elastic.members());
                        });
        int caught_up = 0;
        while (start.first + elastic.steps_done() < last) {
          const std::int64_t step = start.first + elastic.steps_done();
          const bool leaving = step == leave_at;
          elastic.step(
              [&](Comm& comm) {
                if (leaving && catch_up.loser >= 0) el::others_applied.await_loser();
                if (leaving && point == Point::start) {
                  together.arrive(step);
                  throw Leave{};
                }
                zero.gather(*ddp);
                ddp->before_forward();
                params.zero_grad();
                constexpr std::size_t batch = 8;
                const auto samples = tandem::test::make_batch(
                    3, static_cast<std::size_t>(step),
                    static_cast<std::size_t>(comm.rank()) * batch, batch, 8, 4);
                (void)model.forward_backward(samples, 1.0 / batch,
                                             [&](auto& p) { ddp->grad_ready(p); });
                ddp->finish_gradient_sync();
                if (leaving && point == Point::after_reduction) {
                  together.arrive(step);
                  throw Leave{};
                }
                zero.exchange(*ddp);
                if (leaving && point == Point::after_exchange) {
                  together.arrive(step);
                  throw Leave{};
                }
              },
              [&] {
                opt.set_lr(0, 0.01 / static_cast<double>(1 + step));  // a schedule, on the shard
                zero.step();
                if (elastic.heals() > 0 && elastic.generation() == 0) ++caught_up;
                if (r != catch_up.loser && step == catch_up.step) el::others_applied.note_applied();
              });
        }
        if (leave_at == last) {  // before the last step's all_gather
          together.arrive(last);
          throw Leave{};
        }
        elastic.settle([&](Comm&) { zero.gather(*ddp); });
        auto& out = finals[static_cast<std::size_t>(r)];
        const auto dict = zero.state_dict();  // collective: the full state
        out.params = bytes_of(params.values().data(), params.numel() * sizeof(float));
        out.state = tandem::test::elastic::state_bytes(dict);
        out.steps = elastic.steps_done();
        out.generation = elastic.generation();
        out.members = elastic.members();
        out.caught_up = caught_up;
        if (saved && elastic.comm().rank() == 0) {
          *saved = zero.state_dict();
        } else if (saved) {
          (void)zero.state_dict();
        }
        if (saved_params && elastic.comm().rank() == 0) {
          saved_params->assign(params.values().data(), params.values().data() + params.numel());
        }
      } catch (const Leave&) {
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return finals;
}

/// Loses `losses` (sorted by step) from `ranks` at `point`, and compares the survivors' end with
/// the reference: each stretch between losses run undisturbed by the group of that size, started
/// from the state the stretch before saved.
template <int Stage, class Comm = tandem::LocalComm>
void lose_and_compare(int ranks, const std::vector<Loss>& losses, Point point,
                      CatchUp catch_up = {}) {
  constexpr std::int64_t steps = 7;
  std::vector<std::string> errors;
  std::vector<Dict> saved(losses.size());
  std::vector<std::vector<float>> saved_params(losses.size());
  Start start;
  int size = ranks;
  int heals = 0;
  for (std::size_t i = 0; i < losses.size(); ++i) {
    if (i > 0 && losses[i].step == losses[i - 1].step) {
      --size;
      continue;
    }
    (void)run<Stage>(size, start, losses[i].step, {}, point, errors, &saved[i], &saved_params[i]);
    for (const auto& e : errors) REQUIRE_MESSAGE(e.empty(), e);
    REQUIRE(saved_params[i].size() > 0);
    start = {losses[i].step, &saved_params[i], &saved[i]};
    --size;
    ++heals;
  }
  const auto reference = run<Stage>(size, start, steps, {}, point, errors);
  for (const auto& e : errors) REQUIRE_MESSAGE(e.empty(), e);

  const auto healed =
      run<Stage, Comm>(ranks, {}, steps, losses, point, errors, nullptr, nullptr, catch_up);
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    const auto& e = errors[static_cast<std::size_t>(r)];
    CHECK_MESSAGE(e.empty(), e);
    if (std::any_of(losses.begin(), losses.end(), [&](const Loss& l) { return l.rank == r; })) {
      continue;
    }
    const auto& out = healed[static_cast<std::size_t>(r)];
    CHECK(out.steps == steps);
    CHECK(out.generation == heals);
    CHECK(out.members.size() == static_cast<std::size_t>(size));
    CHECK(out.params == reference[0].params);  // bit for bit
    CHECK(out.state == reference[0].state);
    CHECK(out.state.size() > 0);
  }
  if (catch_up.loser >= 0) {
    CHECK(healed[static_cast<std::size_t>(catch_up.loser)].caught_up == 1);
  }
  // The reference's ranks agree with each other too.
  CHECK(reference[0].params == reference[1].params);
  CHECK(reference[0].state == reference[1].state);
}

/// `ranks` threads train `steps` steps under Elastic with ElasticZero: each of `leavers` leaves
/// at the start of step `leave_at` (before the parameters' all_gather), a replacement thread for
/// each joins (its ElasticZero attaches for the first time in elastic.start()'s rebuild; on_join
/// carries nothing: under ZeRO the optimizer state and the parameters come through attach): in
/// the heal with `await`, else at a step boundary after step `wait_at`, where the survivors wait
/// until the first has asked. Returns the members' Finals and the replacements' (after them, in
/// the order of `leavers`); a rank that raised has its steps and optimizer steps in its Final.
template <int Stage>
std::vector<Final> run_with_joins(int ranks, std::int64_t steps, const std::vector<int>& leavers,
                                  std::int64_t leave_at, std::vector<std::string>& errors,
                                  bool await = true, std::int64_t wait_at = -1) {
  tandem::AnyStore store(tandem::HashStore{});
  const std::size_t slots = static_cast<std::size_t>(ranks) + leavers.size();
  std::vector<Final> finals(slots);
  errors.assign(slots, {});
  const auto leaves = [&](int r) {
    return std::find(leavers.begin(), leavers.end(), r) != leavers.end();
  };
  LeaveTogether together(std::vector<std::int64_t>(leavers.size(), leave_at));
  const auto train = [&](int r, bool replacement, std::size_t slot) {
    auto& out = finals[slot];
    try {
      tandem::Elastic<tandem::LocalComm> elastic(
          tandem::World::single_node(r, ranks), store,
          tandem::LocalCommOptions{std::chrono::seconds(120)},
          {.window = std::chrono::minutes(10),
           .replacement = replacement,
           .await_replacement = await ? std::chrono::minutes(10) : std::chrono::minutes(0)});
      tandem::test::Mlp<float> model({8, 24, 24, 4}, /*seed=*/replacement ? 99 : 7);
      auto& params = model.params();
      tandem::ElasticZero<Opt> zero(params, [&] { return Opt(params, {.lr = 0.01}); });
      std::optional<Ddp<Stage>> ddp;
      elastic.on_join([] { return std::vector<std::byte>{}; }, [](std::span<const std::byte>) {});
      elastic.on_heal([&] { ddp.reset(); },
                      [&](tandem::LocalComm& comm) {
                        ddp.emplace(comm, params);
                        zero.attach(*ddp, elastic.members());
                      });
      // What this rank took when it raises: a failed heal applies nothing half.
      struct Record {
        Final& out;
        tandem::Elastic<tandem::LocalComm>& elastic;
        tandem::ElasticZero<Opt>& zero;
        ~Record() {
          out.steps = elastic.steps_done();
          out.optimizer_steps = zero.optimizer().group_steps(0);
        }
      } record{out, elastic, zero};
      elastic.start();
      std::vector<int> sizes;
      while (elastic.steps_done() < steps) {
        const std::int64_t step = elastic.steps_done();
        elastic.step(
            [&](tandem::LocalComm& comm) {
              if (!replacement && leaves(r) && step == leave_at) {
                together.arrive(step);
                throw Leave{};
              }
              if (step == wait_at) {  // white-box: the replacement's ticket (Elastic's prefix)
                const std::vector<std::string> asked{"tandem/elastic//join/1"};
                while (!store.check(asked))
                  std::this_thread::sleep_for(std::chrono::milliseconds(1));
              }
              zero.gather(*ddp);
              ddp->before_forward();
              params.zero_grad();
              constexpr std::size_t batch = 8;
              const auto samples = tandem::test::make_batch(
                  3, static_cast<std::size_t>(step), static_cast<std::size_t>(comm.rank()) * batch,
                  batch, 8, 4);
              (void)model.forward_backward(samples, 1.0 / batch,
                                           [&](auto& p) { ddp->grad_ready(p); });
              ddp->finish_gradient_sync();
              zero.exchange(*ddp);
            },
            [&] {
              zero.optimizer().set_lr(0, 0.01 / static_cast<double>(1 + step));
              zero.step();
              sizes.push_back(static_cast<int>(elastic.members().size()));
            });
      }
      elastic.settle([&](tandem::LocalComm&) { zero.gather(*ddp); });
      out.state = tandem::test::elastic::state_bytes(zero.state_dict());  // collective
      out.params = bytes_of(params.values().data(), params.numel() * sizeof(float));
      out.generation = elastic.generation();
      out.members = elastic.members();
      out.sizes = sizes;
    } catch (const Leave&) {
    } catch (const tandem::Error& e) {
      errors[slot] = e.what();
      out.named = true;
    } catch (const std::exception& e) {
      errors[slot] = e.what();
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] { train(r, false, static_cast<std::size_t>(r)); });
  }
  for (int leaver : leavers) threads[static_cast<std::size_t>(leaver)].join();
  std::vector<std::thread> replacements;
  for (std::size_t i = 0; i < leavers.size(); ++i) {
    replacements.emplace_back(
        [&, i] { train(leavers[i], true, static_cast<std::size_t>(ranks) + i); });
  }
  for (int r = 0; r < ranks; ++r) {
    if (!leaves(r)) threads[static_cast<std::size_t>(r)].join();
  }
  for (auto& replacement : replacements) replacement.join();
  return finals;
}

/// A rank lost and replaced: every member and the replacement end with the parameters and full
/// optimizer state of the undisturbed runs at the group's sizes (one run per stretch of a size,
/// started from the state the stretch before saved), bit for bit. With `await` the size never
/// changes; else it shrinks at `leave_at` and grows back after `wait_at`.
template <int Stage>
void replace_and_compare(int ranks, int leaver, std::int64_t leave_at, bool await = true,
                         std::int64_t wait_at = -1) {
  constexpr std::int64_t steps = 8;
  std::vector<std::string> errors;
  const auto healed =
      run_with_joins<Stage>(ranks, steps, {leaver}, leave_at, errors, await, wait_at);
  for (const auto& e : errors) REQUIRE_MESSAGE(e.empty(), e);
  const auto& sizes = healed[leaver == 0 ? 1 : 0].sizes;
  REQUIRE(sizes.size() == static_cast<std::size_t>(steps));
  CHECK(sizes.front() == ranks);
  CHECK(sizes.back() == ranks);
  if (!await) CHECK(sizes[static_cast<std::size_t>(leave_at)] == ranks - 1);
  // The reference: each stretch of one size run undisturbed from the last stretch's state.
  std::vector<Dict> saved(static_cast<std::size_t>(steps));
  std::vector<std::vector<float>> saved_params(static_cast<std::size_t>(steps));
  Start start;
  const auto size_at = [&](std::int64_t step) { return sizes[static_cast<std::size_t>(step)]; };
  for (;;) {
    std::int64_t end = start.first;
    while (end < steps && size_at(end) == size_at(start.first)) ++end;
    if (end == steps) break;
    const auto at = static_cast<std::size_t>(end);
    (void)run<Stage>(size_at(start.first), start, end, {}, Point::start, errors, &saved[at],
                     &saved_params[at]);
    for (const auto& e : errors) REQUIRE_MESSAGE(e.empty(), e);
    start = {end, &saved_params[at], &saved[at]};
  }
  const auto reference = run<Stage>(ranks, start, steps, {}, Point::start, errors);
  for (const auto& e : errors) REQUIRE_MESSAGE(e.empty(), e);
  for (int r = 0; r <= ranks; ++r) {
    CAPTURE(r);  // `ranks`: the replacement
    if (r == leaver) continue;
    const auto& out = healed[static_cast<std::size_t>(r)];
    CHECK(out.steps == steps);
    CHECK(out.generation == (await ? 1 : 2));  // the heal (and the join)
    CHECK(out.members.size() == static_cast<std::size_t>(ranks));
    CHECK(out.params == reference[0].params);  // bit for bit
    CHECK(out.state == reference[0].state);
    CHECK(out.state.size() > 0);
  }
}

}  // namespace

TEST_CASE_TEMPLATE(
    "ZeRO-1/2 under Elastic: a lost rank's shard comes back from its replica, exactly", Stage,
    std::integral_constant<int, 1>, std::integral_constant<int, 2>) {
  SUBCASE("rank 1 before the parameters' all_gather") {
    lose_and_compare<Stage::value>(3, {{1, 3}}, Point::start);
  }
  SUBCASE("rank 0 after the reduction") {
    lose_and_compare<Stage::value>(3, {{0, 3}}, Point::after_reduction);
  }
  SUBCASE("rank 2 after the exchange") {
    lose_and_compare<Stage::value>(3, {{2, 3}}, Point::after_exchange);
  }
  SUBCASE("rank 1 after the last step, before its all_gather (Elastic::settle)") {
    lose_and_compare<Stage::value>(3, {{1, 7}}, Point::start);
  }
  SUBCASE("rank 1 loses step 2's commit point, which the others pass; rank 2 leaves in step 3") {
    // Rank 1 applies step 2 during the heal, with the shard, the replica and (shard<2>) the
    // gradients it received, before the shards are put together.
    lose_and_compare<Stage::value, el::CommitLosingComm>(3, {{2, 3}}, Point::start, {1, 2});
  }
  SUBCASE("4 ranks: rank 1 at step 2, then rank 3 (its new ring neighbour keeps it) at step 4") {
    lose_and_compare<Stage::value>(4, {{1, 2}, {3, 4}}, Point::after_reduction);
  }
  SUBCASE("5 ranks: ranks 1 and 3 together (not neighbours) at step 2") {
    lose_and_compare<Stage::value>(5, {{1, 2}, {3, 2}}, Point::start);
  }
}

TEST_CASE_TEMPLATE(
    "ZeRO-1/2 under Elastic: options set on optimizer() before the first attach stay", Stage,
    std::integral_constant<int, 1>, std::integral_constant<int, 2>) {
  // An LR schedule is made over optimizer() before DDP exists (the examples' set-up): the first
  // attach makes the sharded optimizers afresh, with make()'s options, unless it keeps these.
  constexpr int ranks = 2;
  std::vector<double> lrs(ranks, 0.0);
  std::vector<double> decays(ranks, 0.0);
  tandem::run_local(ranks, [&](tandem::LocalComm& comm) {
    tandem::test::Mlp<float> model({8, 24, 4}, /*seed=*/7);
    auto& params = model.params();
    tandem::ElasticZero<Opt> zero(params, [&] { return Opt(params, {.lr = 0.01}); });
    zero.optimizer().set_lr(0, 0.25);
    zero.optimizer().options(0).weight_decay = 0.5;
    Ddp<Stage::value> ddp(comm, params);
    const std::vector<int> members{0, 1};
    zero.attach(ddp, members);
    lrs[static_cast<std::size_t>(comm.rank())] = zero.optimizer().lr(0);
    decays[static_cast<std::size_t>(comm.rank())] = zero.optimizer().options(0).weight_decay;
  });
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(lrs[static_cast<std::size_t>(r)] == 0.25);
    CHECK(decays[static_cast<std::size_t>(r)] == 0.5);
  }
}

TEST_CASE("ZeRO under Elastic: two ring neighbours lost together is an Error naming the cause") {
  std::vector<std::string> errors;
  // Both leave before the step's first collective: neither can see the other's loss first.
  (void)run<1>(4, {}, 5, {{1, 2}, {2, 2}}, Point::start, errors);
  for (int r : {0, 3}) {
    CAPTURE(r);
    CHECK_MESSAGE(
        errors[static_cast<std::size_t>(r)].find("were lost together") != std::string::npos,
        errors[static_cast<std::size_t>(r)]);
  }
}

TEST_CASE_TEMPLATE("ZeRO-1/2 under Elastic: a replacement joins and receives its shard, exactly",
                   Stage, std::integral_constant<int, 1>, std::integral_constant<int, 2>) {
  SUBCASE("rank 1 of 3 leaves at step 3") {
    replace_and_compare<Stage::value>(3, 1, 3);
  }
  SUBCASE("rank 0 of 3 (the first survivor sends the layout) leaves at step 2") {
    replace_and_compare<Stage::value>(3, 0, 2);
  }
  SUBCASE("rank 2 of 3 leaves at step 2, its replacement joins at a step boundary after step 5") {
    replace_and_compare<Stage::value>(3, 2, 2, /*await=*/false, /*wait_at=*/5);
  }
}

TEST_CASE_TEMPLATE(
    "ZeRO-1/2 under Elastic: two ring neighbours lost while their replacements join is an Error on "
    "every rank, with nothing applied half",
    Stage, std::integral_constant<int, 1>, std::integral_constant<int, 2>) {
  // Ranks 1 and 2 of 4 leave at the start of step 2; the survivors (0 and 3) wait in the heal for
  // both replacements and admit them. Rank 2's shard and its only replica (rank 1's) are gone:
  // the survivors' attach raises, and the replacements', which cannot see it, learn it from them.
  std::vector<std::string> errors;
  const auto finals = run_with_joins<Stage::value>(4, 5, {1, 2}, 2, errors);
  for (std::size_t slot : {0u, 3u, 4u, 5u}) {  // the survivors, then the replacements of 1 and 2
    CAPTURE(slot);
    const auto& e = errors[slot];
    const bool survivor = slot < 4;
    CHECK(finals[slot].named);
    CHECK_MESSAGE(e.find(survivor ? "were lost together"
                                  : "the survivors lost an optimizer "
                                    "shard") != std::string::npos,
                  e);
    // No step taken past the loss, and none applied in part: the survivors' shards stepped
    // exactly the steps before it, the replacements' never.
    CHECK(finals[slot].steps == 2);
    CHECK(finals[slot].optimizer_steps == (survivor ? 2 : 0));
  }
}
