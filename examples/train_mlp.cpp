// train_mlp: data-parallel training of a small MLP on a synthetic regression task, the whole
// tandem loop: a flat Parameters arena, DistributedDataParallel overlapping its all_reduce with
// the backward, AdamW with a warm-up + cosine learning rate, and an EMA of the weights evaluated
// at the end. Each rank trains on its own shard of every global batch (as DistributedSampler
// gives it); rank 0 prints the loss averaged over the ranks, and every rank prints a fingerprint
// of its final weights. Exits non-zero unless the loss fell tenfold and every rank ends with
// bitwise identical weights. An error ends it through tandem::run_main, which writes torchrun's
// error file. With --checkpoint-dir it saves every --checkpoint-every steps and resumes from the
// newest checkpoint there (torchrun --max-restarts); --fail-rank R --fail-step S makes rank R
// throw at step S of the first attempt (TORCHELASTIC_RESTART_COUNT=0), to show a failure.
// A checkpoint resumes at any world size: the samples already trained on are counted, and the
// next global batch starts after them (64 samples a step rounded up to the ranks: 66 on 3).
//   build/dev/tools/tandemrun --nproc-per-node 4 build/dev/examples/train_mlp     Gloo (default)
//   python3 -m torch.distributed.run --nproc_per_node 2 --no_python --redirects 9:1 --tee 9:1
//       build/dev/examples/train_mlp                                  (one line: under torchrun)
//   build/dev/examples/train_mlp --backend local --ranks 4                         threads
//   mpirun -n 2 build/dev/examples/train_mlp --backend mpi                         (as root:
//   README)
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/arena/parameters.hpp"
#include "tandem/comm/agree.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/hash.hpp"
#include "tandem/ddp/ddp.hpp"
#include "tandem/launch/elastic.hpp"
#include "tandem/optim/adamw.hpp"
#include "tandem/optim/ema.hpp"
#include "tandem/optim/lr_scheduler.hpp"
#if TANDEM_EXAMPLE_WITH_IO
#include "tandem/io/checkpoint.hpp"
#endif
#if TANDEM_EXAMPLE_WITH_GLOO
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"
#endif
#if TANDEM_EXAMPLE_WITH_MPI
#include "tandem/comm/mpi/mpi.hpp"
#endif

namespace {

constexpr std::size_t inputs = 8;
constexpr std::size_t hidden = 64;
constexpr std::size_t outputs = 2;
constexpr std::size_t global_batch = 64;

struct Settings {
  std::string backend;
  int ranks = 4;
  int steps = 300;
  std::string checkpoint_dir;  // empty: no checkpoints
  int checkpoint_every = 50;
  int fail_rank = -1;  // -1: no injected failure
  int fail_step = 0;
};

/// A deterministic value in [-1, 1) for (sample, feature): every rank sees the same data set.
float input_value(std::uint64_t sample, std::uint64_t feature) {
  std::uint64_t h = (sample * 0x9e3779b97f4a7c15ull) ^ (feature + 0x632be59bd9b4e019ull);
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return static_cast<float>(static_cast<double>(h >> 11) / 4503599627370496.0 - 1.0);
}

/// The function the model learns.
void target(const float* x, float* y) {
  float a = 0.0f;
  float b = 0.0f;
  for (std::size_t j = 0; j < inputs; ++j) {
    a += x[j] * static_cast<float>(j + 1) / 8.0f;
    b += x[j] * x[(j + 3) % inputs];
  }
  y[0] = std::sin(a);
  y[1] = 0.5f * std::cos(b);
}

/// Two tanh layers and a linear head over a Parameters arena; forward and backward by hand.
class Mlp {
 public:
  Mlp() {
    const std::size_t widths[] = {inputs, hidden, hidden, outputs};
    for (std::size_t l = 0; l < 3; ++l) {
      const auto in = static_cast<std::int64_t>(widths[l]);
      const auto out = static_cast<std::int64_t>(widths[l + 1]);
      layers_.push_back({&params_.add("fc" + std::to_string(l) + ".weight", {out, in}),
                         &params_.add("fc" + std::to_string(l) + ".bias", {out}), widths[l],
                         widths[l + 1]});
    }
    params_.finalize();
    // Any rank's values would do: DDP broadcasts rank 0's at construction.
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      auto w = layers_[l].weight->value();
      const float scale = 1.0f / std::sqrt(static_cast<float>(layers_[l].in));
      for (std::size_t i = 0; i < w.size(); ++i) w[i] = scale * input_value(1000 + l, i);
    }
  }

  tandem::Parameters<float>& params() { return params_; }

  /// Mean squared error over samples [first, first + count); with `ready`, also the gradient of
  /// loss * scale, added to the arena, calling ready(param) as each one is complete.
  template <class Ready>
  double step(std::uint64_t first, std::size_t count, double scale, Ready&& ready) {
    std::vector<std::vector<float>> a(layers_.size() + 1);
    a[0].resize(count * inputs);
    for (std::size_t s = 0; s < count; ++s) {
      for (std::size_t j = 0; j < inputs; ++j) a[0][s * inputs + j] = input_value(first + s, j);
    }
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      const auto& layer = layers_[l];
      auto w = layer.weight->value();
      auto b = layer.bias->value();
      a[l + 1].resize(count * layer.out);
      for (std::size_t s = 0; s < count; ++s) {
        for (std::size_t o = 0; o < layer.out; ++o) {
          float z = b[o];
          for (std::size_t i = 0; i < layer.in; ++i)
            z += w[o * layer.in + i] * a[l][s * layer.in + i];
          a[l + 1][s * layer.out + o] = l + 1 < layers_.size() ? std::tanh(z) : z;
        }
      }
    }
    double loss = 0.0;
    std::vector<float> delta(count * outputs);
    for (std::size_t s = 0; s < count; ++s) {
      float y[outputs];
      target(&a[0][s * inputs], y);
      for (std::size_t o = 0; o < outputs; ++o) {
        const float error = a.back()[s * outputs + o] - y[o];
        loss += 0.5 * static_cast<double>(error) * error;
        delta[s * outputs + o] = static_cast<float>(scale) * error;
      }
    }
    if constexpr (!std::is_same_v<std::decay_t<Ready>, std::nullptr_t>) {
      for (std::size_t l = layers_.size(); l-- > 0;) {  // last layer first, as autograd does
        const auto& layer = layers_[l];
        auto gw = layer.weight->grad();
        auto gb = layer.bias->grad();
        for (std::size_t s = 0; s < count; ++s) {
          for (std::size_t o = 0; o < layer.out; ++o) {
            const float d = delta[s * layer.out + o];
            gb[o] += d;
            for (std::size_t i = 0; i < layer.in; ++i)
              gw[o * layer.in + i] += d * a[l][s * layer.in + i];
          }
        }
        ready(*layer.weight);  // DDP may start this bucket's all_reduce now
        ready(*layer.bias);
        if (l == 0) break;
        auto w = layer.weight->value();
        std::vector<float> previous(count * layer.in, 0.0f);
        for (std::size_t s = 0; s < count; ++s) {
          for (std::size_t i = 0; i < layer.in; ++i) {
            float sum = 0.0f;
            for (std::size_t o = 0; o < layer.out; ++o)
              sum += w[o * layer.in + i] * delta[s * layer.out + o];
            const float activation = a[l][s * layer.in + i];
            previous[s * layer.in + i] = sum * (1.0f - activation * activation);
          }
        }
        delta = std::move(previous);
      }
    }
    return loss / static_cast<double>(count);
  }

 private:
  struct Layer {
    tandem::Parameters<float>::Parameter* weight;
    tandem::Parameters<float>::Parameter* bias;
    std::size_t in, out;
  };
  tandem::Parameters<float> params_;
  std::vector<Layer> layers_;
};

/// A hash of the weights' bytes, to check that every rank holds the same model.
std::int64_t fingerprint(tandem::View<float> values) {
  const std::uint64_t hash = tandem::fnv1a(std::as_bytes(std::span(values.data(), values.size())));
  return static_cast<std::int64_t>(hash >> 1);  // an int64 the collectives carry, never negative
}

/// One rank's whole job, for any communicator. Returns whether training did what it should.
template <tandem::Communicator Comm>
bool train(Comm& comm, const Settings& settings) {
  // The same run on every rank, or an Error on every rank naming the flag and who has what.
  tandem::agree(comm, {{"--steps", settings.steps},
                       {"--checkpoint-every", settings.checkpoint_every},
                       {"--fail-rank", settings.fail_rank},
                       {"--fail-step", settings.fail_step}});
  const auto n = static_cast<std::size_t>(comm.size());
  const auto rank = static_cast<std::size_t>(comm.rank());
  // 64 samples a step, or the next multiple of the world size (66 on 3 ranks).
  const std::size_t local_batch = (global_batch + n - 1) / n;
  const std::size_t batch = local_batch * n;

  Mlp model;
  tandem::DistributedDataParallel<Comm, tandem::overlap, tandem::bucket_cap<16 * 1024>> ddp(
      comm, model.params());
  tandem::optim::AdamW optimizer(model.params(), {.lr = 1e-2, .weight_decay = 1e-4});
  auto schedule = tandem::lr::warmup_cosine(optimizer, 20, settings.steps, 1e-2, 1e-4);
  tandem::EMA ema(model.params(), {.decay = 0.995, .use_warmup = true});

  const std::uint64_t held_out = 1u << 30;  // samples never trained on
  const double initial = model.step(held_out, 256, 1.0, nullptr);
  double last_mean = 0.0;
  int first_step = 0;
  std::uint64_t samples_seen = 0;  // of the synthetic stream, by every rank: world-size free
#if TANDEM_EXAMPLE_WITH_IO
  tandem::TrainingState state;
  state.model(model.params()).optimizer(optimizer).scheduler(schedule).ema(ema, model.params());
  state.counter("step", first_step).counter("samples", samples_seen);
  if (!settings.checkpoint_dir.empty()) {
    // Before the first step: rank 0 takes the directory (another job using it is refused) and
    // checks it can write there; the newest checkpoint, the same on every rank, is loaded.
    if (auto last =
            tandem::open_checkpoints(comm, settings.checkpoint_dir, state, {.resume = true})) {
      if (rank == 0) {
        std::printf("attempt %d resumed from %s at step %d\n", tandem::restart_count(),
                    last->filename().c_str(), first_step);
        std::fflush(stdout);
      }
    }
  }
#else
  if (!settings.checkpoint_dir.empty()) {
    throw tandem::Error(comm.rank(), "train_mlp", "this build has no checkpoints (tandem::io)");
  }
#endif
  for (int step = first_step; step < settings.steps; ++step) {
    if (comm.rank() == settings.fail_rank && step == settings.fail_step &&
        tandem::restart_count() == 0) {
      throw tandem::Error(comm.rank(), "train_mlp",
                          "injected failure at step " + std::to_string(step) + " (--fail-step)");
    }
    ddp.before_forward();
    optimizer.zero_grad();
    const std::uint64_t first = samples_seen + rank * local_batch;
    samples_seen += batch;
    // Each rank's loss is its shard's mean; DDP averages the gradients over the ranks, which
    // gives the gradient of the global batch's mean.
    double loss = model.step(first, local_batch, 1.0 / static_cast<double>(local_batch),
                             [&](auto& param) { ddp.grad_ready(param); });
    ddp.finish_gradient_sync();
    optimizer.step();
    schedule.step();
    ema.update();

    std::vector<double> mean{loss};
    comm.all_reduce(mean, tandem::ReduceOp::avg);
    last_mean = mean[0];
    if (rank == 0 && (step % 50 == 0 || step + 1 == settings.steps)) {
      std::printf("step %4d  loss %.5f  lr %.2e\n", step, mean[0], optimizer.lr(0));
      std::fflush(stdout);
    }
#if TANDEM_EXAMPLE_WITH_IO
    if (!settings.checkpoint_dir.empty() && (step + 1) % settings.checkpoint_every == 0) {
      first_step = step + 1;  // where a resumed run starts
      tandem::save_checkpoint(comm, settings.checkpoint_dir, first_step, state);
    }
#endif
  }

  const double trained = model.step(held_out, 256, 1.0, nullptr);
  double averaged = 0.0;
  {
    auto guard = ema.applied();  // the EMA weights, for this scope only
    averaged = model.step(held_out, 256, 1.0, nullptr);
  }
  std::vector<std::int64_t> mine{fingerprint(model.params().values())};
  std::printf("rank %zu weights fingerprint %016llx\n", rank,
              static_cast<unsigned long long>(mine[0]));
  std::fflush(stdout);
  std::vector<std::int64_t> all(n);
  comm.all_gather(mine, all);
  bool identical = true;
  for (auto value : all) identical = identical && value == all[0];
  if (rank == 0) {
    std::printf("held-out loss: %.5f at the start, %.5f trained, %.5f with the EMA weights\n",
                initial, trained, averaged);
    std::printf("weights on all %zu ranks %s\n", n, identical ? "identical" : "DIFFER");
  }
  return identical && trained < initial / 10.0 && std::isfinite(last_mean);
}

int usage() {
  std::fprintf(
      stderr,
      "usage: train_mlp [--backend local|gloo|mpi] [--ranks N] [--steps S]\n"
      "                 [--checkpoint-dir DIR [--checkpoint-every K]]\n"
      "                 [--fail-rank R --fail-step S]\n"
      "  default backend: gloo when started by a launcher (WORLD_SIZE is set), else local\n"
      "  --checkpoint-dir: save every K steps (default 50), resume from the newest there\n"
      "  --fail-rank/--fail-step: rank R throws at step S on the first attempt only\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  settings.backend = std::getenv("WORLD_SIZE") ? "gloo" : "local";
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if ((arg == "--backend" || arg == "--checkpoint-dir") && i + 1 < argc) {
      (arg == "--backend" ? settings.backend : settings.checkpoint_dir) = argv[++i];
    } else if ((arg == "--ranks" || arg == "--steps" || arg == "--checkpoint-every" ||
                arg == "--fail-rank" || arg == "--fail-step") &&
               i + 1 < argc) {
      const auto value = tandem::parse_int(argv[++i]);
      if (!value || *value < 0 || *value > 100000) {
        std::fprintf(stderr, "train_mlp: %s '%s': not a whole number from 0 to 100000\n",
                     argv[i - 1], argv[i]);
        return usage();
      }
      int& slot = arg == "--ranks"              ? settings.ranks
                  : arg == "--steps"            ? settings.steps
                  : arg == "--checkpoint-every" ? settings.checkpoint_every
                  : arg == "--fail-rank"        ? settings.fail_rank
                                                : settings.fail_step;
      slot = static_cast<int>(*value);
      if ((arg == "--ranks" || arg == "--steps" || arg == "--checkpoint-every") && slot < 1) {
        std::fprintf(stderr, "train_mlp: %s '%s': must be at least 1\n", argv[i - 1], argv[i]);
        return usage();
      }
    } else {
      std::fprintf(stderr, "train_mlp: %s: unknown flag, or its value is missing\n", argv[i]);
      return usage();
    }
  }
  // run_main prints an exception that ends the program and writes torchrun's error file.
  return tandem::run_main([&]() -> int {
    if (settings.backend == "local") {
      std::vector<char> ok(static_cast<std::size_t>(settings.ranks), 0);
      tandem::run_local(settings.ranks, [&](tandem::LocalComm& comm) {
        ok[static_cast<std::size_t>(comm.rank())] = train(comm, settings);
      });
      for (char each : ok) {
        if (!each) return 1;
      }
      return 0;
    }
#if TANDEM_EXAMPLE_WITH_GLOO
    if (settings.backend == "gloo") {
      auto comm = tandem::init_process_group<tandem::GlooComm>("env://");
      const bool ok = train(comm, settings);
      comm.barrier();
      return ok ? 0 : 1;
    }
#endif
#if TANDEM_EXAMPLE_WITH_MPI
    if (settings.backend == "mpi") {
      auto comm = tandem::MpiComm::world();
      return train(comm, settings) ? 0 : 1;
    }
#endif
    std::fprintf(stderr, "train_mlp: backend '%s' is not built in\n", settings.backend.c_str());
    return usage();
  });
}
