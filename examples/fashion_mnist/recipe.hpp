// examples/fashion_mnist/recipe.hpp - what the CPU example (fashion_mnist.cpp) and the GPU one
// (fashion_mnist_cuda.cu) share, so that both train the same model with the same recipe: the
// settings and their flags, nn.Linear's initialisation, SGD's two learning rates (the head at
// twice the rate), the warm-up + cosine schedule, and the EMA's settings.
//   auto settings = fashion_mnist::parse(argc, argv, fashion_mnist::program::cpu);
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "common/run.hpp"
#include "tandem/core/env.hpp"
#include "tandem/data/mnist.hpp"
#include "tandem/optim/ema.hpp"
#include "tandem/optim/lr_scheduler.hpp"
#include "tandem/optim/sgd.hpp"

namespace fashion_mnist {

/// Which of the two programs parses the flags: the GPU one takes --precision and --resident and
/// the nccl backend, and defaults to nccl.
enum class program { cpu, gpu };

struct Settings : examples::RunSettings {
  bool wide = false;
  bool plain = false;  // the benchmark's recipe: one constant lr, no EMA
  int zero = 0;  // CPU only: ZeRO stage (DistributedDataParallel's shard<1>, shard<2>), 0: none
  bool elastic = false;       // CPU only: survivors go on after a lost rank (tandem::Elastic)
  std::string elastic_store;  // CPU only: where they meet (file:///PATH); "": from the run id
  int await_replacement = 0;  // CPU only: seconds the survivors wait in a heal for replacements
  bool async_save = false;    // CPU only: checkpoints written in the background (AsyncCheckpoints)
  // GPU only:
  std::string precision = "fp16";  // compute copies of the weights: fp16 (O2), bf16 (O2), fp32
  bool resident = false;           // the whole data set on the GPU, no Loader
};

constexpr std::size_t pixels = 784;
constexpr std::size_t classes = 10;

/// The hidden layer's width: 256, or 1024 with --wide.
inline std::size_t hidden_width(const Settings& settings) {
  return settings.wide ? 1024 : 256;
}

/// The two Linear layers' initial values, PyTorch's nn.Linear default: U(-1/sqrt(in), 1/sqrt(in))
/// for weights and biases, drawn in this order from one generator seeded `seed`.
struct LinearInit {
  std::vector<float> fc1_weight, fc1_bias, fc2_weight, fc2_bias;
};

inline LinearInit linear_init(std::size_t hidden, std::uint64_t seed) {
  std::mt19937_64 random(seed);
  auto draw = [&](std::size_t count, std::size_t fan_in) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    std::uniform_real_distribution<double> uniform(-bound, bound);
    std::vector<float> values(count);
    for (auto& x : values) x = static_cast<float>(uniform(random));
    return values;
  };
  LinearInit init;
  init.fc1_weight = draw(hidden * pixels, pixels);
  init.fc1_bias = draw(hidden, pixels);
  init.fc2_weight = draw(classes * hidden, hidden);
  init.fc2_bias = draw(classes, hidden);
  return init;
}

/// SGD's param groups: fc1 and bn1 at the learning rate, the head (fc2) at twice it (at it with
/// --plain), momentum 0.9 for all. The arena must hold fc1., bn1. and fc2. in that order.
inline std::vector<tandem::optim::ParamGroup<tandem::optim::SGDOptions>> sgd_groups(
    const Settings& settings) {
  using tandem::optim::params_with_prefix;
  return {{params_with_prefix("fc1."), {.lr = settings.lr, .momentum = 0.9}},
          {params_with_prefix("bn1."), {.lr = settings.lr, .momentum = 0.9}},
          {params_with_prefix("fc2."),
           {.lr = (settings.plain ? 1 : 2) * settings.lr, .momentum = 0.9}}};
}

/// A factor on each group's lr: warm-up (a tenth of the run, at most 100 steps) then cosine down
/// to 1 %; with --plain one constant factor.
template <class Optimizer>
auto lr_schedule(Optimizer& optimizer, const Settings& settings, std::int64_t total_steps) {
  return settings.plain
             ? tandem::lr::lambda(optimizer, [](std::int64_t) { return 1.0; })
             : tandem::lr::warmup_cosine(optimizer, std::min<std::int64_t>(100, total_steps / 10),
                                         total_steps, 1.0, 0.01);
}

/// The EMA of the weights evaluated at each epoch's end (not with --plain).
inline tandem::EMAOptions ema_options() {
  return {.decay = 0.999, .use_warmup = true};
}

inline int usage(program which) {
  if (which == program::cpu) {
    std::fprintf(stderr,
                 "usage: fashion_mnist [--backend hierarchical|shm|gloo|mpi|local] [--ranks N]\n"
                 "  [--epochs E] [--batch-size B] [--lr LR] [--seed S] [--data DIR]\n"
                 "  [--checkpoint-dir DIR] [--resume] [--timeout SECONDS] [--workers W]\n"
                 "  [--tensorboard DIR] [--max-steps N] [--wide] [--plain] [--zero 1|2]\n"
                 "  [--elastic [--elastic-store file:///PATH] [--await-replacement SECONDS]]\n"
                 "  (under tandemrun --elastic) [--crash-in-setup] (the tests: rank 1 dies in\n"
                 "  the set-up)\n"
                 "  [--async-save] (with --checkpoint-dir: saves written in the background)\n"
                 "  default backend: hierarchical under a launcher (WORLD_SIZE set: shared memory\n"
                 "  within a node, Gloo between nodes), else local; plain Gloo: --backend gloo\n");
  } else {
    std::fprintf(stderr,
                 "usage: fashion_mnist_cuda [--backend nccl|gloo|local] [--ranks N] [--epochs E]\n"
                 "  [--batch-size B] [--lr LR] [--seed S] [--data DIR] [--checkpoint-dir DIR]\n"
                 "  [--resume] [--timeout SECONDS] [--workers W] [--tensorboard DIR]\n"
                 "  [--max-steps N] [--wide] [--plain] [--precision fp16|bf16|fp32] [--resident]\n"
                 "  default backend: nccl (one GPU per rank); gloo and local move device tensors\n"
                 "  through pinned host memory, and let several ranks share one GPU\n");
  }
  return 2;
}

/// The settings the command line asks for; nullopt (the caller prints the usage and exits 2) for
/// an unknown flag, a flag without its value, or a value out of range, each refusal said on
/// `errors` with its reason ("fashion_mnist: --lr 'inf': not a finite number above 0"); null
/// `errors` says nothing.
inline std::optional<Settings> parse(int argc, char** argv, program which,
                                     std::FILE* errors = stderr) {
  Settings s;
  if (which == program::cpu)
    s.backend = examples::default_cpu_backend();
  else
    s.backend = "nccl";
  const bool gpu = which == program::gpu;
  const char* name = gpu ? "fashion_mnist_cuda" : "fashion_mnist";
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    const bool has_value = i + 1 < argc;
    auto number = [&](std::int64_t low, std::int64_t high) -> std::optional<std::int64_t> {
      const char* text = argv[++i];
      const auto v = tandem::parse_int(text);
      if (!v || *v < low || *v > high) {
        return examples::refuse(
            errors, name, arg, text,
            "not a whole number from " + std::to_string(low) + " to " + std::to_string(high));
      }
      return *v;
    };
    if (arg == "--resume")
      s.resume = true;
    else if (arg == "--plain")
      s.plain = true;
    else if (arg == "--wide")
      s.wide = true;
    else if (gpu && arg == "--resident")
      s.resident = true;
    else if (!gpu && arg == "--elastic")
      s.elastic = true;
    else if (!gpu && arg == "--async-save")
      s.async_save = true;
    else if (!gpu && arg == "--crash-in-setup")
      s.crash_in_setup = true;
    else if (!has_value)
      return examples::refuse(errors, name, arg, "", "unknown, or its value is missing");
    else if (arg == "--backend")
      s.backend = argv[++i];
    else if (arg == "--data")
      s.data = argv[++i];
    else if (arg == "--checkpoint-dir")
      s.checkpoint_dir = argv[++i];
    else if (arg == "--tensorboard")
      s.tensorboard = argv[++i];
    else if (!gpu && arg == "--elastic-store") {
      s.elastic_store = argv[++i];
      if (!s.elastic_store.starts_with("file:///"))
        return examples::refuse(errors, name, arg, s.elastic_store,
                                "not file:///PATH (a store that outlives every rank)");
    } else if (!gpu && arg == "--await-replacement") {
      const auto seconds = number(0, 3600);
      if (!seconds) return std::nullopt;
      s.await_replacement = static_cast<int>(*seconds);
    } else if (!gpu && arg == "--zero") {
      const auto stage = number(0, 2);
      if (!stage) return std::nullopt;
      s.zero = static_cast<int>(*stage);
    } else if (gpu && arg == "--precision") {
      s.precision = argv[++i];
      if (s.precision != "fp16" && s.precision != "bf16" && s.precision != "fp32")
        return examples::refuse(errors, name, arg, s.precision, "not fp16, bf16 or fp32");
    } else if (arg == "--lr") {
      const auto lr = examples::parse_real(argv[++i]);
      if (!lr || !(*lr > 0)) {
        return examples::refuse(errors, name, arg, argv[i], "not a finite number above 0");
      }
      s.lr = *lr;
    } else if (const int at = i; !examples::parse_run_number(arg, number, s)) {
      // number() said why where it read a value; an unknown flag is said here.
      return i == at ? examples::refuse(errors, name, arg, argv[i + 1], "unknown flag")
                     : std::nullopt;
    }
  }
  if (s.await_replacement > 0 && !s.elastic) {
    return examples::refuse(errors, name, "--await-replacement",
                            std::to_string(s.await_replacement), "needs --elastic");
  }
  if (const auto problem = examples::path_problem(s); !problem.empty()) {
    if (errors) std::fprintf(errors, "%s: %s\n", name, problem.c_str());
    return std::nullopt;
  }
  return s;
}

}  // namespace fashion_mnist
