// heal_worker: one rank of a short data-parallel training under tandem::Elastic in which a rank is
// lost and tandemrun (--elastic --max-restarts) starts a replacement that joins the running group
// and receives the state from a live member over the communicator (Elastic::on_join with
// TrainingState::to_bytes / from_bytes). tests/elastic/heal_driver.py starts it under tandemrun
// and judges the results.
//
// The training: tests/support/mlp.hpp's perceptron, DDP overlapping small bucket all_reduces with
// the backward, SGD with momentum (optimizer state), an EMA of the weights, a random generator
// drawn once per step (an RNG stream), over one shuffled epoch that a DistributedSampler splits;
// the epoch's rest is re-split at each change of membership (members: resplit in the rebuild
// callback; the replacement: the sampler's position it receives). The victim (--victim, its
// first process only) kills itself with SIGKILL in generation 0 at step --fault-step: with the
// step's gradient buckets in flight, or (--save-every) while its checkpoint save is being
// written: a thread raises SIGKILL after --kill-permille thousandths of the time its previous
// save took (the saves write a 16 MiB ballast tensor, so that the write is long enough to be hit).
//
// With --startup, the victim is lost before its first step (docs/elastic.md, "Lost at start-up"):
// before-join kills it before it joins the job's store (a replacement then takes its place in
// generation 0), before-start once the group has formed, before Elastic::start builds DDP (the
// survivors heal from step 0). --backend hierarchical: HierarchicalComm<ShmComm, GlooComm> with
// the launcher's ranks cut into fake nodes of two.
//
// With --join-at S, the survivors of the loss wait at step S until the replacement has asked to
// join (its ticket in the store), so that it joins before they finish (else it would find the
// run over, which Elastic allows: finished()).
//
// With --grow-at S --grow N (a group that grows: tandemrun --nnodes MIN:MAX, a node started
// later, whose workers join with ranks beyond the first world), the members of the first world
// wait at step S until N join requests are in the store and the driver wrote DIR/grow.go, so
// that the new members join before the run ends.
//
// With --zero 1|2, ZeRO through tandem::ElasticZero (DDP's shard<1>/shard<2>, each rank keeping a
// replica of its ring neighbour's optimizer shard): the replacement's on_join state leaves out the
// optimizer (it receives the parameters and its shard in ElasticZero::attach in Elastic::start's
// rebuild, the members in theirs; the model still goes, for its buffers), and the EMA averages a
// step's parameters once they are whole, at the next step's all_gather (where it stands,
// ema_step, goes to a replacement). Not with --save-every or --startup.
//
// With --save-every N, the step's compute saves the state (save_checkpoint, every rank takes
// part, rank 0 writes) to DIR/ckpt/step-<S>.safetensors at each step S that N divides: inside the
// step, so a save that a loss interrupts is taken again by the healed group.
//
// Every rank that finishes writes DIR/rank<R>.result (R its first rank):
//   "steps applied generation size heals joins replacement state_hash heal_us join_us"
// (state_hash: FNV-1a of the parameters, the optimizer state and the EMA as TrainingState
// serializes them; applied: optimizer steps it took, a replacement counting from its join), and,
// on a rank that was a member from the start, DIR/rank<R>.samples (how often each sample of the
// epoch went into an applied step, counted for every member of the group that reduced the step).
// A replacement that came after the group had finished writes "finished" as its result.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "elastic/training.hpp"
#include "fault/handoff.hpp"
#include "fault/worker.hpp"
#include "support/mlp.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/hash.hpp"
#include "tandem/data/sampler.hpp"
#include "tandem/ddp/ddp.hpp"
#include "tandem/ddp/elastic_zero.hpp"
#include "tandem/elastic/elastic.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/io/training_state.hpp"
#include "tandem/optim/ema.hpp"
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

struct Settings {
  std::string backend = "shm";
  std::string dir = ".";
  int ranks = 3;
  int steps = 16;
  int timeout_ms = 10000;
  int window_ms = 10000;
  int await_ms = 0;
  int fault_step = -1;
  int victim = 1;
  int save_every = 0;
  int kill_permille = 0;
  int join_at = -1;  // members wait at this step, after a heal, until the replacement asked
  int grow_at = -1;  // the first members wait here until `grow` new ones asked (and grow.go)
  int grow = 0;
  int zero = 0;  // ZeRO stage (ElasticZero), 0: plain DDP
  // The victim is lost before its first step instead (--fault-step is then unused):
  // "before-join" (before it joins the job's store, once the others have) or "before-start"
  // (in the group, before Elastic::start builds DDP).
  std::string startup;
};

void publish(const Settings& settings, const std::string& name, const std::string& text) {
  fault::publish("heal_worker", settings.dir, name, text);
}

/// Kills this process with SIGKILL after `delay` from now, from another thread (the caller goes
/// on into the work the kill should land in).
void kill_after(std::chrono::microseconds delay) {
  std::thread([delay] {
    std::this_thread::sleep_for(delay);
    ::kill(::getpid(), SIGKILL);
  }).detach();
}

/// DDP with overlapping small buckets, and with Stage > 0 the shard<Stage> policy.
template <class Comm, int Stage>
struct DdpFor {
  using type = tandem::DistributedDataParallel<Comm, tandem::overlap, tandem::bucket_cap<4096>,
                                               tandem::shard<Stage>>;
};
template <class Comm>
struct DdpFor<Comm, 0> {
  using type = tandem::DistributedDataParallel<Comm, tandem::overlap, tandem::bucket_cap<4096>>;
};

template <class Comm, int Stage>
int train(tandem::Elastic<Comm>& elastic, const Settings& settings) {
  using Ddp = typename DdpFor<Comm, Stage>::type;
  using Sgd = tandem::optim::SGD<float>;
  constexpr std::size_t local_batch = 16;
  const auto samples = static_cast<std::size_t>(settings.ranks * settings.steps) * local_batch;
  const bool victim = elastic.first_rank() == settings.victim && !elastic.replacement();

  // The state a replacement receives, registered once. Model, optimizer, EMA, the RNG, the
  // sampler and the counters exist before on_join; DDP (collective) after it.
  tandem::test::Mlp<float> model({8, 48, 48, 4}, /*seed=*/7);
  auto& params = model.params();
  const auto make_sgd = [&] { return Sgd(params, {.lr = 0.05, .momentum = 0.9}); };
  std::optional<Sgd> sgd;                        // plain DDP's
  std::optional<tandem::ElasticZero<Sgd>> zero;  // --zero: the shard and the replica
  if constexpr (Stage == 0) {
    sgd.emplace(make_sgd());
  } else {
    zero.emplace(params, make_sgd);
  }
  tandem::EMA ema(params, {.decay = 0.9});
  std::int64_t ema_step = 0;  // --zero: the steps the EMA has averaged
  // Drawn once per applied step; a replacement at a rank above 0 gets a stream derived from the
  // sender's (TrainingState::rng's rule), the others keep theirs.
  std::mt19937_64 noise(1234);
  tandem::DistributedSampler sampler(samples, elastic.comm(), {.shuffle = true, .seed = 11});
  sampler.set_epoch(0);
  std::size_t taken = 0;  // positions of this rank's list (of the current split) applied
  std::int64_t applied = 0;
  tandem::Parameters<float> ballast;  // a 16 MiB tensor in the checkpoints, to kill a save in
  if (settings.save_every > 0) ballast.add("ballast", {std::size_t{4} << 20});
  ballast.finalize();
  std::optional<Ddp> ddp;
  tandem::TrainingState state;  // --zero: without the optimizer
  state.model(params);
  if constexpr (Stage == 0) {
    state.optimizer(*sgd);
  } else {
    state.counter("ema_step", ema_step);
  }
  state.ema(ema, params).sampler(sampler, taken, 1);
  state.rng("noise", noise);
  tandem::TrainingState saved = state;  // a checkpoint's: the state and the ballast
  saved.model(ballast, "ballast.");
  tandem::TrainingState compared;  // what every rank must hold alike
  compared.model(params);
  if constexpr (Stage == 0) {
    compared.optimizer(*sgd);
  } else {
    compared.optimizer(*zero);  // gathered from the shards: collective
  }
  compared.ema(ema, params);
  // --zero: the all_gather of the parameters the last step updated, then the EMA's update for it
  // (once: a compute taken again after a heal does not count it twice).
  const auto gather = [&] {
    if constexpr (Stage != 0) {
      zero->gather(*ddp);
      if (ema_step < elastic.steps_done()) ema.update();
      ema_step = elastic.steps_done();
    }
  };

  elastic.on_heal([&] { ddp.reset(); },
                  [&](Comm& comm) {
                    ddp.emplace(comm, params);
                    // --zero: the parameters and the optimizer state put together from the
                    // survivors' shards and replicas (a replacement receives them here)
                    if constexpr (Stage != 0) zero->attach(*ddp, elastic.members());
                    sampler.resplit(comm, taken);  // the epoch's rest over the new members
                    taken = 0;
                  });
  elastic.on_join(
      [&] { return state.to_bytes(); },
      [&](std::span<const std::byte> bytes) { state.from_bytes(bytes, elastic.comm().rank()); });
  if (victim && settings.startup == "before-start") ::kill(::getpid(), SIGKILL);
  elastic.start();  // DDP through the rebuild callback: a loss in its broadcast heals too

  std::vector<int> used(samples, 0);  // by every member, in the applied steps
  const std::filesystem::path checkpoints = std::filesystem::path(settings.dir) / "ckpt";
  if (settings.save_every > 0) std::filesystem::create_directories(checkpoints);
  std::chrono::microseconds last_save{0};
  while (taken < sampler.size()) {
    const std::int64_t step = elastic.steps_done();
    std::size_t count = 0;
    elastic.step(
        [&](Comm& comm) {
          const bool fault = victim && elastic.generation() == 0 && step == settings.fault_step;
          if (step == settings.join_at && elastic.heals() > 0 && elastic.joins() == 0) {
            // The survivors must not finish before the replacement asks (on a loaded machine its
            // start-up can outlast the rest of this short run): wait for its ticket in the store
            // (white-box: Elastic's prefix ends in "/").
            tandem::FileStore store(settings.dir + "/store");
            const std::vector<std::string> asked{"tandem/elastic//join/1"};
            while (!store.check(asked)) std::this_thread::sleep_for(std::chrono::milliseconds(2));
          }
          // A new member admitted before step S waits for the others in the step's collective.
          if (step == settings.grow_at && !elastic.replacement()) {
            tandem::FileStore store(settings.dir + "/store");  // white-box, as above
            std::vector<std::string> asked;
            for (int t = 1; t <= settings.grow; ++t) {
              asked.push_back("tandem/elastic//join/" + std::to_string(t));
            }
            const auto go = std::filesystem::path(settings.dir) / "grow.go";
            while (!store.check(asked) || !std::filesystem::exists(go)) {
              std::this_thread::sleep_for(std::chrono::milliseconds(2));
            }
          }
          gather();  // --zero: the parameters whole before anything reads them
          if (settings.save_every > 0 && step % settings.save_every == 0) {
            // The kill lands at a drawn fraction of the time this rank's last save took: late
            // fractions fall in the file's write (after the gather and the serialization).
            if (fault) kill_after(last_save * settings.kill_permille / 1000);
            const auto started = std::chrono::steady_clock::now();
            tandem::save_checkpoint(
                comm, checkpoints / ("step-" + std::to_string(step) + ".safetensors"), saved);
            last_save = std::chrono::duration_cast<std::chrono::microseconds>(
                std::chrono::steady_clock::now() - started);
          }
          ddp->before_forward();
          params.zero_grad();
          count = std::min(local_batch, sampler.size() - taken);
          std::vector<std::int64_t> mine;
          for (std::size_t k = taken; k < taken + count; ++k) mine.push_back(sampler[k]);
          (void)model.forward_backward(tandem::test::elastic::batch_of(mine),
                                       1.0 / static_cast<double>(count),
                                       [&](auto& param) { ddp->grad_ready(param); });
          if (fault && settings.save_every == 0) ::kill(::getpid(), SIGKILL);  // buckets in flight
          ddp->finish_gradient_sync();
          if constexpr (Stage != 0) zero->exchange(*ddp);  // shard<2>: the replica's gradients
        },
        [&] {
          if constexpr (Stage == 0) {
            sgd->step();
            ema.update();
          } else {
            zero->step();  // the EMA at the next gather, once the parameters are whole
          }
          (void)noise();
          ++applied;
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
  }
  elastic.settle([&](Comm&) { gather(); });  // --zero: the last step's parameters
  // The checkpoints: every file under its final name must be whole (a save a kill interrupted
  // leaves at most its temporary file); the new group's rank 0 says which steps it found.
  if (settings.save_every > 0 && elastic.comm().rank() == 0) {
    std::string found;
    for (const auto& entry : std::filesystem::directory_iterator(checkpoints)) {
      const auto name = entry.path().filename().string();
      if (!name.ends_with(".safetensors")) {  // a save a kill interrupted left it
        found += " TEMP:" + name;
        continue;
      }
      try {
        const auto file = tandem::SafetensorsFile::open(entry.path());
        file.verify_checksum();
        (void)file.entry("ballast.ballast");  // the checkpoint holds what was saved
        found += " " + name;
      } catch (const std::exception& e) {
        found += " BAD:" + name;
        std::fprintf(stderr, "heal_worker: checkpoint %s: %s\n", name.c_str(), e.what());
      }
    }
    publish(settings, "checkpoints", found + "\n");
  }
  const auto bytes = compared.to_bytes();
  // Every tensor but the perceptron's buffers (its running mean and forward count, which each
  // rank updates in its own forward, and a redone step's forward updates again; DDP broadcasts
  // rank 0's at the next step), and the optimizer's and EMA's JSON.
  const auto file = tandem::SafetensorsFile::parse(bytes, "compared");
  std::uint64_t hash = tandem::fnv1a(file.metadata().at(tandem::TrainingState::metadata_key));
  for (const auto& entry : file.tensors()) {
    const bool buffer = entry.name.find("running_mean") != std::string::npos ||
                        entry.name.find("num_batches_tracked") != std::string::npos;
    if (!buffer) hash = tandem::fnv1a(file.bytes(entry), hash);
  }
  const std::string me = "rank" + std::to_string(elastic.first_rank());
  if (!elastic.replacement()) {
    std::string counts;
    for (int n : used) counts += std::to_string(n) + " ";
    publish(settings, me + ".samples", counts + "\n");
  }
  const auto us = [](auto duration) {
    return std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(duration).count());
  };
  publish(settings, me + ".result",
          std::to_string(elastic.steps_done()) + " " + std::to_string(applied) + " " +
              std::to_string(elastic.generation()) + " " +
              std::to_string(elastic.members().size()) + " " + std::to_string(elastic.heals()) +
              " " + std::to_string(elastic.joins()) + " " + (elastic.replacement() ? "1" : "0") +
              " " + std::to_string(hash) + " " + us(elastic.last_heal_time()) + " " +
              us(elastic.last_join_time()) + "\n");
  return 0;
}

/// The victim of --startup before-join: waits until every other rank has joined the job's
/// store (white-box: join_store's keys), then kills itself, having joined nothing.
void lose_before_joining(const Settings& settings) {
  tandem::FileStore store(settings.dir + "/store");
  std::vector<std::string> others;
  for (int r = 0; r < settings.ranks; ++r) {
    if (r != settings.victim) others.push_back("tandem/init/rank/" + std::to_string(r));
  }
  while (!store.check(others)) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ::kill(::getpid(), SIGKILL);
}

/// The launcher's World; for HierarchicalComm cut into fake nodes of two ranks (rank r on node
/// r / 2), as tests/unit/hierarchical does on one host.
tandem::World launched_world(const Settings& settings) {
  tandem::World world = tandem::World::from_env();
  if (settings.backend != "hierarchical") return world;
  const int n = world.world_size;
  const int node = world.rank / 2;
  return tandem::World{world.rank, n, world.rank % 2, std::min(2, n - 2 * node), node, (n + 1) / 2};
}

template <class Comm>
int run_process(const Settings& settings) {
  const char* rank_text = std::getenv("RANK");
  const auto rank = tandem::parse_int(rank_text ? rank_text : "");
  const int me = rank ? static_cast<int>(*rank) : -1;
  const char* join = std::getenv("TANDEM_ELASTIC_JOIN");
  const bool first_process = join == nullptr || std::string_view(join) != "1";
  if (settings.startup == "before-join" && me == settings.victim && first_process) {
    lose_before_joining(settings);
  }
  try {
    typename Comm::options_type options;
    options.timeout = std::chrono::milliseconds(settings.timeout_ms);
    tandem::Elastic<Comm> elastic(
        launched_world(settings), "file://" + settings.dir + "/store", options,
        {.window = std::chrono::milliseconds(settings.window_ms),
         .await_replacement = std::chrono::milliseconds(settings.await_ms)});
    if (elastic.finished()) {
      publish(settings, "rank" + std::to_string(me) + ".result", "finished\n");
      return 0;
    }
    switch (settings.zero) {
      case 1:
        return train<Comm, 1>(elastic, settings);
      case 2:
        return train<Comm, 2>(elastic, settings);
      default:
        return train<Comm, 0>(elastic, settings);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "heal_worker: rank %d caught: %s\n", me, e.what());
    return 1;
  }
}

int usage() {
  std::fprintf(stderr,
               "usage: heal_worker --backend shm|gloo|hierarchical --dir DIR [--ranks N]\n"
               "  [--steps S] [--timeout-ms T] [--window-ms W] [--await-ms A]\n"
               "  [--fault-step S --victim V] [--startup before-join|before-start --victim V]\n"
               "  [--save-every N --kill-permille P] [--join-at S] [--grow-at S --grow N]\n"
               "  [--zero 1|2 (not with --save-every or --startup)]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  const std::map<std::string_view, std::string*> words{
      {"--backend", &settings.backend}, {"--dir", &settings.dir}, {"--startup", &settings.startup}};
  const std::map<std::string_view, int*> numbers{{"--ranks", &settings.ranks},
                                                 {"--steps", &settings.steps},
                                                 {"--timeout-ms", &settings.timeout_ms},
                                                 {"--window-ms", &settings.window_ms},
                                                 {"--await-ms", &settings.await_ms},
                                                 {"--fault-step", &settings.fault_step},
                                                 {"--victim", &settings.victim},
                                                 {"--save-every", &settings.save_every},
                                                 {"--kill-permille", &settings.kill_permille},
                                                 {"--join-at", &settings.join_at},
                                                 {"--grow-at", &settings.grow_at},
                                                 {"--grow", &settings.grow},
                                                 {"--zero", &settings.zero}};
  const bool read = tandem::test::elastic::read_settings(argc, argv, words, numbers);
  if (!read || settings.zero < 0 || settings.zero > 2) return usage();
  if (settings.zero != 0 && (settings.save_every > 0 || !settings.startup.empty())) return usage();
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
  std::fprintf(stderr, "heal_worker: backend '%s' is not built in\n", settings.backend.c_str());
  return 77;
}
