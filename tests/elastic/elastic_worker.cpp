// elastic_worker: one rank (or, for --backend local, every rank as a thread) of a short
// data-parallel training under tandem::Elastic, which one rank, the victim, abandons at a chosen
// step and point; the survivors must heal and finish. tests/elastic/elastic_driver.py starts it,
// injects the fault and judges the results.
//
// The training is tests/fault's (tests/support/mlp.hpp's perceptron, DistributedDataParallel
// overlapping small bucket all_reduces with the backward, plain SGD, the loss averaged over the
// ranks), over one shuffled epoch that a DistributedSampler splits, re-split over the survivors
// in Elastic's rebuild callback (DistributedSampler::resplit); the fault protocol is tests/fault's
// (the files DIR/rank<R>.pid, DIR/rank<V>.at, DIR/signalled, read by the helpers
// tests/fault/fault_driver.py has): the victim announces its point, and the driver sends it SIGKILL
// or SIGSTOP (before: before the step's forward; inside: with the collective in flight, the
// survivors entering it only once the signal is sent; after: once the collective returned, before
// the step's commit). A thread victim (local) leaves its rank function
// (--fault exit) or blocks for good (--fault stop) itself. The fault fires in generation 0 only:
// the step taken again after the heal runs clean.
//
// The ranks meet in a FileStore in DIR (file://), which outlives any rank, so any rank may be the
// victim. Every rank that finishes writes DIR/rank<R>.result: "steps applied generation size
// hash heals compared heal_us" (R its first rank; applied counts the optimizer steps it took; hash
// is FNV-1a of its parameters' bytes, and under --zero of the full optimizer state's too;
// compared counts the heals after which --zero's ShadowCheck compared the state; heal_us how long
// its last heal took) and DIR/rank<R>.samples
// (how often each sample of the epoch went into an applied step, counted for every member of the
// group that reduced the step), and exits 0 when the loss fell; a rank that fails prints its
// tandem::Error.
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include "elastic/training.hpp"
#include "fault/handoff.hpp"
#include "fault/worker.hpp"
#include "support/mlp.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/hash.hpp"
#include "tandem/data/sampler.hpp"
#include "tandem/ddp/ddp.hpp"
#include "tandem/ddp/elastic_zero.hpp"
#include "tandem/elastic/elastic.hpp"
#include "tandem/optim/sgd.hpp"
#include "tandem/rendezvous/file_store.hpp"
#if TANDEM_ELASTIC_WITH_GLOO
#include "tandem/comm/gloo/gloo.hpp"
#endif
#if TANDEM_ELASTIC_WITH_SHM
#include "tandem/comm/shm/shm.hpp"
#endif
#if TANDEM_ELASTIC_WITH_SHM && TANDEM_ELASTIC_WITH_GLOO
#include "tandem/comm/hierarchical/hierarchical.hpp"
#endif

namespace {

namespace fault = tandem::test::fault;
using fault::LocalStop;
using fault::monotonic_ns;
using fault::VictimExit;

struct Settings {
  std::string backend = "local";
  int ranks = 3;
  int steps = 24;
  int timeout_ms = 2000;
  int window_ms = 10000;
  int fault_step = -1;
  std::string point = "before";  // before | inside | after
  std::string target = "grads";  // grads | loss
  std::string fault = "exit";    // local: exit | stop
  int victim = 1;
  std::string dir = ".";
  std::string url;  // empty: file://DIR/store
  int zero = 0;     // a ZeRO stage (ElasticZero, SGD with momentum), 0: plain DDP and SGD
};

/// Writes `text` to DIR/name whole (tests/fault/handoff.hpp), so the driver never reads half of it.
void publish(const Settings& settings, const std::string& name, const std::string& text) {
  fault::publish("elastic_worker", settings.dir, name, text);
}

/// Waits (at most 300 s) for DIR/name, a file another process writes.
bool await_file(const Settings& settings, const std::string& name) {
  return fault::await_file(settings.dir, name, std::chrono::seconds(300));
}

/// What the victim does at each point of generation 0's fault step (see the top).
class FaultPlan {
 public:
  FaultPlan(const Settings& settings, int first_rank, bool threads, LocalStop* stop)
      : settings_(settings), me_(first_rank), threads_(threads), stop_(stop) {}

  void at(int generation, std::int64_t step, std::string_view target, std::string_view where) {
    if (generation != 0 || step != settings_.fault_step || target != settings_.target) return;
    const bool victim = me_ == settings_.victim;
    if (!victim) {
      if (where == "before" && settings_.point == "inside") {
        (void)await_file(
            settings_, threads_ ? "rank" + std::to_string(settings_.victim) + ".at" : "signalled");
      }
      return;
    }
    if (where == "passed") {
      if (settings_.point == "inside" && !threads_) announce("passed", step);
      return;
    }
    // A thread cannot be inside a synchronous collective and leave it: it leaves at "inside"
    // with the step's buckets in flight (grads), or before the collective (loss).
    const std::string point = threads_ && settings_.point == "inside" && settings_.target == "loss"
                                  ? "before"
                                  : settings_.point;
    if (where != point) return;
    announce(point, step);
    fault::act_as_victim("elastic_worker", me_, point == "inside", settings_.fault != "exit",
                         threads_ ? stop_ : nullptr, settings_.ranks - 1,
                         std::chrono::seconds(120));
  }

 private:
  void announce(const std::string& state, std::int64_t step) {
    publish(settings_, "rank" + std::to_string(me_) + ".at",
            state + " " + std::to_string(step) + " " + settings_.target + " " +
                std::to_string(monotonic_ns()) + "\n");
  }

  const Settings& settings_;
  int me_;
  bool threads_;
  LocalStop* stop_;
};

/// --zero: what a survivor checks after each heal, at the step's start: the parameters and the full
/// optimizer state it holds are, bit for bit, those all ranks held at that step's start before
/// the loss (the shadow, taken every step: a test's cost), when both are of the same step.
struct ShadowCheck {
  std::int64_t steps = -1;
  std::vector<std::byte> params;
  std::vector<std::byte> state;
  int heals_seen = 0;
  int compared = 0;
  int differed = 0;

  template <class Elastic, class Zero>
  void at_step_start(Elastic& elastic, Zero& zero, std::span<const float> values) {
    const auto params_now = std::as_bytes(values);
    auto state_now = tandem::test::elastic::state_bytes(zero.state_dict());  // collective
    if (elastic.heals() != heals_seen) {
      heals_seen = elastic.heals();
      if (steps == elastic.steps_done()) {
        ++compared;
        if (state_now != state ||
            !std::equal(params_now.begin(), params_now.end(), params.begin(), params.end())) {
          ++differed;
          std::fprintf(stderr,
                       "elastic_worker: rank %d: after the heal at step %lld the state "
                       "differs from the one before the loss\n",
                       elastic.first_rank(), static_cast<long long>(steps));
        }
      }
    }
    steps = elastic.steps_done();
    params.assign(params_now.begin(), params_now.end());
    state = std::move(state_now);
  }
};

/// One epoch of ranks * steps * 16 samples under Elastic (steps per rank at the full size: more
/// after a loss, the epoch's rest re-split over the survivors in the rebuild callback); writes
/// its result file and the samples each applied step used, every member's. Returns whether the
/// loss fell.
/// --zero 1|2: the same under shard<Stage>, stepping an SGD with momentum through ElasticZero (the
/// next step's start all-gathers the parameters; stage 2 sends each rank's reduced gradients to
/// the rank that keeps its replica), with the ShadowCheck after each heal; the result's hash
/// covers the parameters and the full optimizer state.
template <class Comm, int Stage>
bool train(tandem::Elastic<Comm>& elastic, const Settings& settings, FaultPlan& plan) {
  using Plain = tandem::DistributedDataParallel<Comm, tandem::overlap, tandem::bucket_cap<4096>>;
  using Sharded = tandem::DistributedDataParallel<Comm, tandem::overlap, tandem::bucket_cap<4096>,
                                                  tandem::shard<std::max(Stage, 1)>>;
  using Ddp = std::conditional_t<Stage == 0, Plain, Sharded>;
  using Sgd = tandem::optim::SGD<float>;
  constexpr std::size_t local_batch = 16;
  const auto samples = static_cast<std::size_t>(settings.ranks * settings.steps) * local_batch;
  tandem::test::Mlp<float> model({8, 48, 48, 4}, /*seed=*/7);
  tandem::DistributedSampler sampler(samples, elastic.comm(), {.shuffle = true, .seed = 11});
  sampler.set_epoch(0);
  std::size_t taken = 0;  // positions of this rank's list (of the current split) applied
  std::vector<int> used(samples, 0);  // by every member, in the applied steps
  auto& params = model.params();
  tandem::ElasticZero<Sgd> zero(params, [&] { return Sgd(params, {.lr = 0.05, .momentum = 0.9}); });
  ShadowCheck shadow;
  std::optional<Ddp> ddp;
  ddp.emplace(elastic.comm(), params);
  if constexpr (Stage > 0) zero.attach(*ddp, elastic.members());
  elastic.on_heal([&] { ddp.reset(); },
                  [&](Comm& comm) {
                    ddp.emplace(comm, params);
                    if constexpr (Stage > 0) zero.attach(*ddp, elastic.members());
                    sampler.resplit(comm, taken);  // the epoch's rest over the new members
                    taken = 0;
                  });
  std::int64_t applied = 0;
  std::vector<double> losses;
  while (taken < sampler.size()) {
    const std::int64_t step = elastic.steps_done();
    double mean_loss = 0.0;
    std::size_t count = 0;
    elastic.step(
        [&](Comm& comm) {
          const int generation = elastic.generation();
          if constexpr (Stage > 0) {
            zero.gather(*ddp);
            const auto values = params.values();
            shadow.at_step_start(elastic, zero,
                                 std::span<const float>(values.data(), values.size()));
          }
          ddp->before_forward();
          model.params().zero_grad();
          plan.at(generation, step, "grads", "before");
          count = std::min(local_batch, sampler.size() - taken);
          std::vector<std::int64_t> mine;
          for (std::size_t k = taken; k < taken + count; ++k) mine.push_back(sampler[k]);
          const double loss = model.forward_backward(tandem::test::elastic::batch_of(mine),
                                                     1.0 / static_cast<double>(count),
                                                     [&](auto& param) { ddp->grad_ready(param); });
          plan.at(generation, step, "grads", "inside");
          ddp->finish_gradient_sync();
          plan.at(generation, step, "grads", "passed");
          plan.at(generation, step, "grads", "after");
          if constexpr (Stage > 0) zero.exchange(*ddp);
          std::vector<double> mean{loss};
          plan.at(generation, step, "loss", "before");
          plan.at(generation, step, "loss", "inside");
          comm.all_reduce(mean, tandem::ReduceOp::avg);
          plan.at(generation, step, "loss", "passed");
          plan.at(generation, step, "loss", "after");
          mean_loss = mean[0];
        },
        [&] {
          if constexpr (Stage > 0) {
            zero.step();
          } else {
            model.sgd_step(0.05f);
          }
          ++applied;
          // The samples of the step, every member's: members() is the group that reduced it.
          const int members = static_cast<int>(elastic.members().size());
          for (int m = 0; m < members; ++m) {
            auto theirs = sampler;
            theirs.resplit(members, m, 0);  // the same split, seen from member m
            for (std::size_t k = taken; k < taken + count; ++k) {
              ++used[static_cast<std::size_t>(theirs[k])];
            }
          }
          taken += count;
        });
    losses.push_back(mean_loss);
  }
  const auto values = model.params().values();
  auto hash = tandem::fnv1a(std::as_bytes(std::span(values.data(), values.size())));
  if constexpr (Stage > 0) {
    elastic.settle([&](Comm&) { zero.gather(*ddp); });  // the last step's parameters
    const auto state = tandem::test::elastic::state_bytes(zero.state_dict());  // collective
    hash = tandem::fnv1a(std::as_bytes(std::span(values.data(), values.size()))) ^
           (tandem::fnv1a(std::span<const std::byte>(state)) * 31);
  }
  std::string counts;
  for (int n : used) counts += std::to_string(n) + " ";
  publish(settings, "rank" + std::to_string(elastic.first_rank()) + ".samples", counts + "\n");
  publish(settings, "rank" + std::to_string(elastic.first_rank()) + ".result",
          std::to_string(elastic.steps_done()) + " " + std::to_string(applied) + " " +
              std::to_string(elastic.generation()) + " " +
              std::to_string(elastic.members().size()) + " " + std::to_string(hash) + " " +
              std::to_string(elastic.heals()) + " " + std::to_string(shadow.compared) + " " +
              std::to_string(
                  std::chrono::duration_cast<std::chrono::microseconds>(elastic.last_heal_time())
                      .count()) +
              "\n");
  // The first steps' mean loss against the last ones' (single batches are noisy).
  const auto mean_of = [&](std::size_t from, std::size_t to) {
    double total = 0.0;
    for (std::size_t i = from; i < to; ++i) total += losses[i];
    return total / static_cast<double>(to - from);
  };
  const std::size_t few = std::min<std::size_t>(4, losses.size() / 2);
  if (shadow.differed != 0) return false;
  return few == 0 || mean_of(losses.size() - few, losses.size()) < mean_of(0, few);
}

/// train at the ZeRO stage --zero names.
template <class Comm>
bool train_at_stage(tandem::Elastic<Comm>& elastic, const Settings& settings, FaultPlan& plan) {
  if (settings.zero == 1) return train<Comm, 1>(elastic, settings, plan);
  if (settings.zero == 2) return train<Comm, 2>(elastic, settings, plan);
  return train<Comm, 0>(elastic, settings, plan);
}

std::string store_url(const Settings& settings) {
  return settings.url.empty() ? "file://" + settings.dir + "/store" : settings.url;
}

int run_threads(const Settings& settings) {
  LocalStop stop;
  std::vector<int> codes(static_cast<std::size_t>(settings.ranks), 1);
  publish(settings, "rank0.pid", std::to_string(::getpid()) + "\n");
  tandem::AnyStore store(tandem::FileStore(settings.dir + "/store"));
  std::vector<std::thread> threads;
  for (int r = 0; r < settings.ranks; ++r) {
    threads.emplace_back([&, r] {
      FaultPlan plan(settings, r, /*threads=*/true, &stop);
      auto& code = codes[static_cast<std::size_t>(r)];
      try {
        tandem::LocalCommOptions options{std::chrono::milliseconds(settings.timeout_ms)};
        tandem::Elastic<tandem::LocalComm> elastic(
            tandem::World::single_node(r, settings.ranks), store, options,
            {.window = std::chrono::milliseconds(settings.window_ms)});
        code = train_at_stage(elastic, settings, plan) ? 0 : 1;
      } catch (const VictimExit&) {
        code = 0;  // the fault, not a failure
        return;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "elastic_worker: rank %d caught: %s\n", r, e.what());
      }
      {
        std::lock_guard lock(stop.mutex);
        ++stop.ended;
      }
      stop.changed.notify_all();
    });
  }
  for (auto& thread : threads) thread.join();
  for (int code : codes) {
    if (code != 0) return 1;
  }
  return 0;
}

template <class Comm>
int run_process(const Settings& settings) {
  const char* rank_text = std::getenv("RANK");
  const auto rank = tandem::parse_int(rank_text ? rank_text : "");
  const int me = rank ? static_cast<int>(*rank) : -1;
  publish(settings, "rank" + std::to_string(me) + ".pid", std::to_string(::getpid()) + "\n");
  for (int r = 0; r < settings.ranks; ++r) {
    if (!await_file(settings, "rank" + std::to_string(r) + ".pid")) return 2;
  }
  try {
    typename Comm::options_type options;
    options.timeout = std::chrono::milliseconds(settings.timeout_ms);
    tandem::Elastic<Comm> elastic(store_url(settings), options,
                                  {.window = std::chrono::milliseconds(settings.window_ms)});
    FaultPlan plan(settings, elastic.first_rank(), /*threads=*/false, nullptr);
    return train_at_stage(elastic, settings, plan) ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "elastic_worker: rank %d caught: %s\n", me, e.what());
    return 1;
  }
}

int usage() {
  std::fprintf(
      stderr,
      "usage: elastic_worker --backend local|gloo|shm|hierarchical --dir DIR [--ranks N]\n"
      "  [--steps S] [--timeout-ms T] [--window-ms W] [--fault-step S --point "
      "before|inside|after\n  --target grads|loss --victim V --fault exit|stop] [--zero 1|2]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  const std::map<std::string_view, std::string*> words{
      {"--backend", &settings.backend}, {"--dir", &settings.dir},     {"--point", &settings.point},
      {"--target", &settings.target},   {"--fault", &settings.fault}, {"--url", &settings.url}};
  const std::map<std::string_view, int*> numbers{{"--ranks", &settings.ranks},
                                                 {"--steps", &settings.steps},
                                                 {"--timeout-ms", &settings.timeout_ms},
                                                 {"--window-ms", &settings.window_ms},
                                                 {"--fault-step", &settings.fault_step},
                                                 {"--victim", &settings.victim},
                                                 {"--zero", &settings.zero}};
  const bool read = tandem::test::elastic::read_settings(argc, argv, words, numbers);
  if (!read || settings.zero < 0 || settings.zero > 2) return usage();
  if (settings.backend == "local") return run_threads(settings);
#if TANDEM_ELASTIC_WITH_GLOO
  if (settings.backend == "gloo") return run_process<tandem::GlooComm>(settings);
#endif
#if TANDEM_ELASTIC_WITH_SHM
  if (settings.backend == "shm") return run_process<tandem::ShmComm>(settings);
#endif
#if TANDEM_ELASTIC_WITH_SHM && TANDEM_ELASTIC_WITH_GLOO
  if (settings.backend == "hierarchical") {
    return run_process<tandem::HierarchicalComm<tandem::ShmComm, tandem::GlooComm>>(settings);
  }
#endif
  std::fprintf(stderr, "elastic_worker: backend '%s' is not built in\n", settings.backend.c_str());
  return 77;
}
