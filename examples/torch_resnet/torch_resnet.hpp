// torch_resnet.hpp - the program of examples/torch_resnet, shared by its CPU build
// (torch_resnet.cpp: host communicators, float32) and its CUDA build (torch_resnet_cuda.cu:
// NcclComm, autocast fp16 + GradScaler): the settings, the model, the recipe and the training loop,
// which takes the difference as a Placement (where the module lives, whether it trains in mixed
// precision, the autocast guard).
//   return torch_resnet::train<torch_resnet::OnCpu>(comm, settings);   // see torch_resnet.cpp
// Needs: libtorch and the tandem torch, data and io components.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "common/elastic.hpp"
#include "common/run.hpp"
#include "tandem/amp/grad_scaler.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/comm/metrics.hpp"
#include "tandem/core/env.hpp"
#include "tandem/data/batches.hpp"
#include "tandem/data/loader.hpp"
#include "tandem/data/mnist.hpp"
#include "tandem/data/sampler.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/io/log.hpp"
#include "tandem/io/progress.hpp"
#include "tandem/io/safetensors.hpp"
#include "tandem/io/tensorboard.hpp"
#include "tandem/io/training_state.hpp"
#include "tandem/launch/elastic.hpp"
#include "tandem/optim/ema.hpp"
#include "tandem/optim/lr_scheduler.hpp"
#include "tandem/optim/sgd.hpp"
#include "tandem/torch.hpp"
#include "tandem/torch/elastic.hpp"

namespace torch_resnet {

namespace nn = torch::nn;

struct Settings : examples::RunSettings {
  double weight_decay = 5e-4;
  std::int64_t width = 24;
  std::string init;  // initial weights from a file (the benchmark: PyTorch's side wrote them)
  std::int64_t checkpoint_every = 0;  // steps; 0: at each epoch's end only
  double min_accuracy = 0;            // percent; below it the run fails
  bool sync_bn = true;
  bool elastic = false;       // survivors go on after a lost rank (tandem::Elastic)
  std::string elastic_store;  // where they meet (file:///PATH); "": from the launcher's run id
};

int usage() {
  std::fprintf(stderr,
               "usage: torch_resnet [--backend hierarchical|shm|gloo|mpi|local] [--ranks N]\n"
               "  [--epochs E] [--batch-size B] [--lr LR] [--weight-decay WD] [--width W]\n"
               "  [--seed S] [--data DIR] [--init FILE] [--checkpoint-dir DIR]\n"
               "  [--checkpoint-every N] [--resume] [--timeout SECONDS] [--workers W]\n"
               "  [--tensorboard DIR] [--max-steps N] [--min-accuracy PERCENT] [--no-sync-bn]\n"
               "  [--elastic [--elastic-store file:///PATH]] (under tandemrun --elastic)\n"
               "  [--crash-in-setup] (the tests: rank 1 dies in the set-up)\n"
               "  default backend: hierarchical under a launcher (WORLD_SIZE set: shared memory\n"
               "  within a node, Gloo between nodes), else local; plain Gloo: --backend gloo\n");
  return 2;
}

/// The settings the command line asks for; nullopt (main prints the usage and exits 2) for an
/// unknown flag, a missing value or a value out of range, each said on stderr with its reason.
std::optional<Settings> parse(int argc, char** argv) {
  Settings s;
  s.backend = examples::default_cpu_backend();
  constexpr const char* name = "torch_resnet";
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--resume") {
      s.resume = true;
      continue;
    }
    if (arg == "--no-sync-bn") {
      s.sync_bn = false;
      continue;
    }
    if (arg == "--elastic") {
      s.elastic = true;
      continue;
    }
    if (arg == "--crash-in-setup") {
      s.crash_in_setup = true;
      continue;
    }
    if (i + 1 >= argc) return examples::refuse(stderr, name, arg, "", "unknown, or no value");
    const char* value = argv[++i];
    bool said = false;  // a refusal below already gave its reason
    auto number = [&](std::int64_t low, std::int64_t high) -> std::optional<std::int64_t> {
      const auto v = tandem::parse_int(value);
      if (!v || *v < low || *v > high) {
        said = true;
        return examples::refuse(
            stderr, name, arg, value,
            "not a whole number from " + std::to_string(low) + " to " + std::to_string(high));
      }
      return *v;
    };
    // A finite number at least `low` (above it where `above`) and at most `high`.
    auto real = [&](double low, bool above, double high) -> std::optional<double> {
      const auto v = examples::parse_real(value);
      if (!v || *v < low || (above && *v == low) || *v > high) {
        said = true;
        return examples::refuse(stderr, name, arg, value,
                                std::string("not a finite number ") + (above ? "above " : "from ") +
                                    std::to_string(low) + " to " + std::to_string(high));
      }
      return v;
    };
    std::optional<std::int64_t> n;
    std::optional<double> x;
    if (arg == "--backend")
      s.backend = value;
    else if (arg == "--data")
      s.data = value;
    else if (arg == "--init")
      s.init = value;
    else if (arg == "--checkpoint-dir")
      s.checkpoint_dir = value;
    else if (arg == "--tensorboard")
      s.tensorboard = value;
    else if (arg == "--elastic-store" && std::string_view(value).starts_with("file:///"))
      s.elastic_store = value;
    else if (arg == "--elastic-store")
      return examples::refuse(stderr, name, arg, value,
                              "not file:///PATH (a store that outlives every rank)");
    else if (arg == "--lr" && (x = real(0, true, 1e6)))
      s.lr = *x;
    else if (arg == "--weight-decay" && (x = real(0, false, 1e6)))
      s.weight_decay = *x;
    else if (arg == "--min-accuracy" && (x = real(0, false, 100)))
      s.min_accuracy = *x;
    else if (arg == "--width" && (n = number(1, 1024)))
      s.width = *n;
    else if (arg == "--checkpoint-every" && (n = number(0, INT64_MAX)))
      s.checkpoint_every = *n;
    else if (!said && !examples::parse_run_number(arg, number, s))
      return said ? std::nullopt : examples::refuse(stderr, name, arg, value, "unknown flag");
    else if (said)
      return std::nullopt;
  }
  std::string problem = examples::path_problem(s);
  if (problem.empty() && !s.init.empty() && ::access(s.init.c_str(), R_OK) != 0) {
    problem = "--init '" + s.init + "': cannot read it: " + std::strerror(errno);
  }
  if (!problem.empty()) {
    std::fprintf(stderr, "%s: %s\n", name, problem.c_str());
    return std::nullopt;
  }
  return s;
}

// The model. Its module tree (and so its state_dict names) is bench/torch_resnet/torch_resnet.py's:
// every BatchNorm is a child of a Sequential, where convert_sync_batchnorm can replace it.

nn::Conv2d conv(std::int64_t in, std::int64_t out, std::int64_t kernel, std::int64_t stride) {
  return nn::Conv2d(
      nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false));
}

/// out = relu(body(x) + shortcut(x)); body = conv3x3-BN-ReLU-conv3x3-BN, shortcut = conv1x1-BN
/// where the shape changes, else the identity (an empty Sequential).
struct BlockImpl : nn::Module {
  BlockImpl(std::int64_t in, std::int64_t out, std::int64_t stride)
      : body(register_module(
            "body", nn::Sequential(conv(in, out, 3, stride), nn::BatchNorm2d(out), nn::ReLU(),
                                   conv(out, out, 3, 1), nn::BatchNorm2d(out)))),
        shortcut(register_module("shortcut", nn::Sequential())) {
    if (stride != 1 || in != out) {
      shortcut->push_back(conv(in, out, 1, stride));
      shortcut->push_back(nn::BatchNorm2d(out));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::relu(body->forward(x) + (shortcut->is_empty() ? x : shortcut->forward(x)));
  }
  nn::Sequential body, shortcut;
};
TORCH_MODULE(Block);

/// stem (conv3x3 stride 2: 28 -> 14 pixels), layer1..3 (one block each: w, 2w, 4w channels at 14,
/// 7, 4 pixels), global average pooling, fc.
struct NetImpl : nn::Module {
  explicit NetImpl(std::int64_t w)
      : stem(register_module("stem",
                             nn::Sequential(conv(1, w, 3, 2), nn::BatchNorm2d(w), nn::ReLU()))),
        layer1(register_module("layer1", nn::Sequential(Block(w, w, 1)))),
        layer2(register_module("layer2", nn::Sequential(Block(w, 2 * w, 2)))),
        layer3(register_module("layer3", nn::Sequential(Block(2 * w, 4 * w, 2)))),
        fc(register_module("fc", nn::Linear(4 * w, 10))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = layer3->forward(layer2->forward(layer1->forward(stem->forward(x))));
    return fc->forward(torch::flatten(torch::adaptive_avg_pool2d(x, {1, 1}), 1));
  }
  nn::Sequential stem, layer1, layer2, layer3;
  nn::Linear fc;
};
TORCH_MODULE(Net);

/// Loads every parameter and buffer of `net` from a safetensors file written under the names of
/// its state_dict (strict: a missing name, a wrong dtype or size is an Error).
void load_initial_weights(Net& net, const std::string& file) {
  const auto weights = tandem::SafetensorsFile::map(file);
  torch::NoGradGuard no_grad;
  auto load = [&](const std::string& name, torch::Tensor& t) {
    if (t.scalar_type() == torch::kInt64)
      weights.read_into(name, std::span(t.data_ptr<std::int64_t>(), std::size_t(t.numel())));
    else
      weights.read_into(name, std::span(t.data_ptr<float>(), std::size_t(t.numel())));
  };
  for (auto& item : net->named_parameters()) load(item.key(), item.value());
  for (auto& item : net->named_buffers()) load(item.key(), item.value());
}

/// SGD's param groups: runs of the arena alternately with and without weight decay (decay for
/// conv and linear weights, none for BatchNorm's affine parameters and biases, by rank: PyTorch's
/// usual split). A group is a contiguous run of the arena, so the two kinds come as runs.
template <class Params>
std::vector<tandem::optim::ParamGroup<tandem::optim::SGDOptions>> sgd_groups(
    const Params& params, const Settings& settings) {
  std::vector<tandem::optim::ParamGroup<tandem::optim::SGDOptions>> groups;
  std::size_t first = 0;
  bool first_decays = false;
  auto close = [&](std::size_t last) {
    if (last == first) return;
    groups.push_back({tandem::optim::param_range(first, last),
                      {.lr = settings.lr,
                       .momentum = 0.9,
                       .weight_decay = first_decays ? settings.weight_decay : 0.0}});
  };
  for (const auto& parameter : params) {
    const bool decays = parameter.shape().rank() > 1;
    if (parameter.index() == 0) first_decays = decays;
    if (decays != first_decays) {
      close(parameter.index());
      first = parameter.index();
      first_decays = decays;
    }
  }
  close(params.size());
  return groups;
}

/// A Loader batch's images {n, 1, 28, 28} and labels {n} as libtorch tensors on `device`: views
/// of the batch's memory on the CPU, copies on a GPU.
template <class Batch>
std::pair<torch::Tensor, torch::Tensor> batch_tensors(const Batch& batch,
                                                      const torch::Device& device) {
  auto [images, labels] = batch.views();
  const auto count = static_cast<std::int64_t>(batch.size());
  return {torch::from_blob(images.data(), {count, 1, 28, 28}, torch::kFloat32).to(device),
          torch::from_blob(labels.data(), {count}, torch::kInt64).to(device)};
}

/// Accuracy over the test set split by the evaluation sampler: every sample counted once.
/// Through ddp.forward, which in eval mode runs no collective and points the module's tensors at
/// the arena's active values (the EMA's while it is applied).
template <class Comm, class Ddp>
double evaluate(Comm& comm, Net& net, Ddp& ddp, const tandem::FashionMNIST& test) {
  net->eval();
  torch::NoGradGuard no_grad;
  auto sampler = tandem::DistributedSampler::evaluation(test.size(), comm);
  tandem::Loader loader(test, sampler | tandem::views::batches(500), {.workers = 0});
  std::int64_t hits = 0;
  for (const auto& batch : loader) {
    const auto [x, y] = batch_tensors(batch, ddp.device());
    hits += ddp.forward(x).argmax(1).eq(y).sum().template item<std::int64_t>();
  }
  net->train();
  const auto totals =
      tandem::reduce_sum(comm, std::array<std::int64_t, 2>{hits, std::int64_t(sampler.size())});
  return double(totals[0]) / double(totals[1]);
}

/// The CPU build's Placement: CPU tensors in float32 (see train()).
struct OnCpu {
  static constexpr bool mixed_precision = false;
  template <class Comm>
  static torch::Device device(const Comm& /*comm*/) {
    return torch::kCPU;
  }
  /// No autocast: a guard that does nothing.
  static int autocast() { return 0; }
};

/// Under --elastic: a group of its own, one rank, to wrap the module in DDP with (its constructor
/// is collective, and the set-up's collectives run in Elastic::start(), under the heal's
/// protection; on a replacement nothing collective may run with the members before the state
/// arrives); nullopt in the plain run.
template <class Comm, class Group>
std::optional<Comm> solo_group(Group& /*group*/) {
  if constexpr (tandem::ProcessGroupBackend<Comm> && !examples::is_fixed_group<Group>) {
    tandem::AnyStore store(tandem::HashStore{});
    return Comm::rendezvous(tandem::World::single_node(0, 1), store, {});
  }
  return std::nullopt;
}

/// One rank's whole run in `group`: an examples::FixedGroup (the plain run, train() below) or a
/// tandem::Elastic (--elastic: a lost rank's survivors heal and go on, the epoch's rest re-split
/// over them; under tandemrun --max-restarts a replacement joins and receives the state). Every
/// collective runs in a step's compute; apply is local. Returns the final test
/// accuracy. Placement says where: device(comm) is where the module and batches live,
/// mixed_precision whether the forward runs under autocast (autocast() returns its guard) with a
/// GradScaler (OnCpu: no; torch_resnet_cuda.cu: fp16).
template <class Placement, class Group>
double train_in(Group& group, const Settings& settings) {
  using Comm = std::remove_reference_t<decltype(group.comm())>;
  Comm& first = group.comm();
  const auto agree_on_flags = [&](Comm& comm) {
    examples::agree_on_flags(comm, settings,
                             {{"--weight-decay", settings.weight_decay},
                              {"--width", settings.width},
                              {"--checkpoint-every", settings.checkpoint_every},
                              {"--no-sync-bn", !settings.sync_bn},
                              {"--elastic", settings.elastic}});
  };
  // The plain run agrees here. Under --elastic nothing here is collective until
  // examples::start() below: the set-up's collectives (the flags' agreement, DDP's broadcast,
  // the resume, the TensorBoard directory) run in the rebuild Elastic::start() runs under the
  // heal's protection, so that a rank lost there heals (examples::SetUp); `first` gives the
  // sampler and the SyncBatchNorms their first split, which the rebuild makes anew.
  if constexpr (examples::is_fixed_group<Group>) agree_on_flags(first);
  const tandem::FashionMNIST train_set(tandem::split::train, settings.data);
  const tandem::FashionMNIST test_set(tandem::split::test, settings.data);

  torch::manual_seed(settings.seed);  // the same initial weights on every rank (DDP checks them)
  Net net(settings.width);
  if (!settings.init.empty()) load_initial_weights(net, settings.init);
  net->to(Placement::device(first));  // before wrapping: DDP takes the module where it lives
  if (settings.sync_bn) {
    const auto replaced = tandem::torch::convert_sync_batchnorm(*net, first);
    tandem::log0(first) << "SyncBatchNorm in place of " << replaced.converted.size()
                        << " BatchNorm2d modules";
  }
  // Under --elastic DDP wraps the module over a group of its own and leaves it once the state is
  // registered: the arena (what the optimizer, EMA and state are made over) exists, the state a
  // replacement receives goes there, and rebuild's rebind() moves DDP onto the running group.
  std::optional<Comm> solo = solo_group<Comm>(group);
  tandem::torch::DistributedDataParallel<Comm, tandem::overlap> ddp(solo ? *solo : first, net);
  auto& params = ddp.parameters();
  const auto device = ddp.device();

  const auto groups = sgd_groups(params, settings);
  // ddp.executor(): tandem's passes in libtorch's stream order (CUDA); host_exec on the CPU.
  tandem::optim::SGD optimizer(params, std::span(groups), ddp.executor());
  tandem::DistributedSampler sampler(train_set.size(), first,
                                     {.shuffle = true, .seed = settings.seed});
  auto batches = sampler | tandem::views::batches(settings.batch_size);
  // The schedule's length, from the world size the job first formed with (on a replacement too).
  auto first_split = sampler;
  first_split.resplit(examples::first_world_size(group), 0, 0);
  const auto steps_per_epoch = static_cast<std::int64_t>(
      (first_split.size() + settings.batch_size - 1) / settings.batch_size);
  const std::int64_t total_steps = steps_per_epoch * settings.epochs;
  auto schedule = tandem::lr::warmup_cosine(
      optimizer, std::min<std::int64_t>(100, total_steps / 10), total_steps, 1.0, 0.01);
  tandem::EMA ema(params, {.decay = 0.999, .use_warmup = true}, ddp.executor());
  using Scaler = tandem::GradScaler<typename decltype(ddp)::arena_space>;
  Scaler scaler(tandem::GradScalerOptions{.enabled = Placement::mixed_precision});
  tandem::Loader loader(train_set, batches, {.workers = settings.workers});

  std::int64_t step = 0;
  std::size_t batches_done = 0;
  // The module's state_dict keys (num_batches_tracked included): Python loads the parameters with
  // model.load_state_dict(..., strict=False) from a checkpoint, strict from a model-only file.
  tandem::TrainingState state;
  tandem::torch::model(state, ddp)
      .optimizer(optimizer)
      .ema(ema, params)
      .scheduler(schedule)
      .sampler(sampler, batches_done, settings.batch_size)
      .counter("step", step);
  if constexpr (Placement::mixed_precision) state.scaler(scaler);
  if (solo) {
    ddp.release();
    solo.reset();
  }
  // Opened in the set-up; a replacement admitted after it writes no TensorBoard events (its
  // rank 0 was another).
  std::optional<tandem::TensorBoardWriter> board;
  // A heal (--elastic): the Loader stops (its workers read the sampler), the bridge's DDP leaves
  // the old group and reduces over the new one (its arena, and so the optimizer, EMA and
  // checkpoint state, stay), the SyncBatchNorms move onto it, the epoch's samples not yet trained
  // on are dealt out over it, and the step's next compute restarts the Loader on the new list.
  examples::HealingBatches batches_of(loader);
  examples::HealLog heal_log;  // rank 0's line after a step during which the group healed
  // Where the group is besides the training state, sent to a replacement with it, so that it
  // takes up the loop at the members' point: the epochs evaluated (and the last evaluation's
  // results, bit for bit), the epochs checkpointed and the step of the last checkpoint in an epoch.
  examples::EpochEnds ends;
  std::int64_t saved_step = step;  // a resumed run has its checkpoint (set in the set-up)
  // The set-up's collectives after DDP's (under --elastic they may run again over a healed group,
  // a rank lost in them: the resume then loads the checkpoint again).
  const auto set_up = [&](Comm& comm) {
    examples::resume_and_open_board(group, comm, settings, state, loader, batches_done, step,
                                    board);
    saved_step = step;
  };
  examples::SetUp set_up_state;
  auto checkpoint = [&](std::int64_t* epochs_saved, std::int64_t epoch) {
    if (settings.checkpoint_dir.empty()) return;
    heal_log.step(
        group, step, "checkpoint",
        [&](Comm& comm) { tandem::save_checkpoint(comm, settings.checkpoint_dir, step, state); },
        [&] {
          saved_step = step;
          if (epochs_saved) *epochs_saved = epoch + 1;
        });
  };
  group.on_heal(
      [&] {
        ddp.release();
        batches_of.stop();
      },
      [&](Comm& comm) {
        const bool setting_up = set_up_state.due(comm);  // the first time, or a rank lost in it
        if (setting_up) agree_on_flags(comm);
        if (settings.sync_bn) tandem::torch::rebind_sync_batchnorm(*net, comm);
        ddp.rebind(comm);  // rank 0's values and buffers everywhere
        sampler.resplit(comm, std::min(sampler.size(), batches_done * settings.batch_size));
        batches_done = 0;
        if (setting_up) {
          set_up(comm);
          set_up_state.finish();
        }
      });
  tandem::TrainingState joined = examples::joined_state(state, ends, set_up_state);
  joined.counter("saved_step", saved_step);
  examples::send_on_join(group, joined);
  // The members rebuild over the grown group once the state is sent: so does the replacement,
  // in start() (its sampler already continues the sender's split: the re-split from nothing
  // taken keeps it), running the set-up with them where they had not finished it.
  examples::start(group, set_up);
  if (!board) board.emplace(".", false);  // a replacement admitted after the set-up
  heal_log.started(group);                // a rank lost in the set-up: rank 0 says so

  double accuracy = ends.accuracy();
  double mean_loss = 0;
  double trained_seconds = 0;  // training only: the evaluations are not counted
  const bool limited = settings.max_steps >= 0;
  using clock = std::chrono::steady_clock;
  net->train();
  for (auto epoch = static_cast<int>(sampler.epoch()); epoch < settings.epochs; ++epoch) {
    examples::begin_epoch(sampler, epoch, batches_done);
    const auto epoch_start = clock::now();
    examples::HealingProgress progress;
    (void)progress.of(group, epoch, batches.size() - batches_done);
    batches_of.start(batches_done, group.generation());
    while (batches_done < batches.size()) {
      // A replacement admitted after the --max-steps step goes on to the epoch's end.
      if (limited && step >= settings.max_steps && group.replacement()) break;
      // Between epochs' ends (the end of an epoch is saved after its evaluation): after the step
      // just taken, where a replacement admitted at its end takes part too.
      if (settings.checkpoint_every > 0 && step > saved_step &&
          step % settings.checkpoint_every == 0)
        checkpoint(nullptr, epoch);
      examples::crash_if_asked(settings, step, group);
      bool stepped = true;
      heal_log.step(
          group, step, "training",
          [&](Comm& comm) {
            const auto& batch = batches_of.current(batches_done, group.generation());
            const auto [x, y] = batch_tensors(batch, device);
            torch::Tensor loss;
            {
              [[maybe_unused]] const auto autocast = Placement::autocast();
              loss = torch::nn::functional::cross_entropy(ddp.forward(x), y);
            }
            optimizer.zero_grad();
            if constexpr (Placement::mixed_precision) {
              (loss * scaler.scale(1.0f)).backward();  // averaged over the ranks when it returns
            } else {
              loss.backward();  // the gradients are averaged over the ranks when it returns
            }
            if ((step + 1) % 50 == 0 || batches_done + 1 == batches.size())
              mean_loss = tandem::reduce_mean(comm, loss.template item<double>());
            if constexpr (Placement::mixed_precision) {
              stepped = ddp.step(scaler, optimizer);  // unscale + inf check (collective), the step
              scaler.update();
            }
          },
          [&] {  // local only (a survivor may apply a step committed elsewhere during a heal)
            if constexpr (!Placement::mixed_precision) optimizer.step();
            (void)stepped;
            schedule.step();
            ema.update();
            ++batches_done;
            ++step;
            batches_of.next(group.generation());
          });
      if (step % 50 == 0 || batches_done == batches.size())
        board->add_scalar("train/loss", mean_loss, step);
      // The step just taken counts in a bar made after a heal.
      progress.of(group, epoch, batches.size() - batches_done + 1)
          .update({{"loss", mean_loss}, {"lr", optimizer.lr(0)}});
      if (limited && step >= settings.max_steps) break;  // saved after the evaluation
    }
    progress.of(group, epoch, 0).finish();
    trained_seconds += std::chrono::duration<double>(clock::now() - epoch_start).count();
    double ema_accuracy = ends.ema_accuracy();
    if (ends.evaluated <= epoch) {  // not yet on a replacement admitted after it
      heal_log.step(
          group, step, "evaluation",
          [&](Comm& comm) {
            accuracy = evaluate(comm, net, ddp, test_set);
            auto applied = ema.applied();  // the module's tensors hold the average until it ends
            ema_accuracy = evaluate(comm, net, ddp, test_set);
          },
          [&] { ends.evaluated_epoch(epoch, accuracy, ema_accuracy); });
    }
    examples::end_epoch(group.comm(), *board,
                        {epoch, step, accuracy, ema_accuracy, trained_seconds}, sampler,
                        batches_done, batches.size());
    if (ends.saved <= epoch) checkpoint(&ends.saved, epoch);
    if (limited && step >= settings.max_steps) break;
  }
  examples::log_final_accuracy(group.comm(), accuracy, step);
  if (group.heals() > 0) {
    tandem::log0(group.comm()) << "healed " << group.heals() << " time(s): " << group.comm().size()
                               << " ranks went on";
  }
  if (group.joins() > 0) {
    tandem::log0(group.comm()) << group.joins() << " replacement(s) joined: " << group.comm().size()
                               << " ranks at the end";
  }
  return accuracy;
}

/// One rank's whole run over `comm`, a group that never changes (see train_in).
template <class Placement, tandem::Communicator Comm>
double train(Comm& comm, const Settings& settings) {
  examples::FixedGroup group(comm);
  return train_in<Placement>(group, settings);
}

}  // namespace torch_resnet
