// fashion_mnist: the flagship. Fashion-MNIST trained across ranks the way a PyTorch user's
// script does it: World from the environment, init_process_group, an MLP 784-256-BatchNorm-
// ReLU-10 (SyncBatchNorm) in one Parameters arena wrapped in DDP with overlap, the
// DistributedSampler with set_epoch and the Loader, SGD with two param groups (the head at twice
// the learning rate), warm-up + cosine LR, an EMA evaluated at each epoch's end, distributed
// evaluation over the test set (every sample once), rank-0 progress and TensorBoard, a checkpoint
// every epoch and --resume. Matrix products through OpenBLAS. Rank 0's last line states the test
// accuracy. What this program shares with its GPU variant (fashion_mnist_cuda.cu) - flags, the
// initialisation, the param groups, the schedule, the EMA - is in recipe.hpp.
//   build/dev/tools/tandemrun --nproc-per-node 2 build/dev/examples/fashion_mnist
//                              shared memory (the default: HierarchicalComm<ShmComm, GlooComm>)
//   build/dev/tools/tandemrun --nproc-per-node 2 build/dev/examples/fashion_mnist --backend gloo
//                                                                  plain Gloo
//   build/dev/tools/tandemrun --nproc-per-node 2 build/dev/examples/fashion_mnist --backend shm
//                                                  ShmComm alone (one host only)
//   build/dev/examples/fashion_mnist --backend local --ranks 2                        threads
//   mpirun -n 2 build/dev/examples/fashion_mnist --backend mpi                        MPI
// Flags: --epochs E --batch-size B (per rank) --lr LR --seed S --data DIR --checkpoint-dir DIR
//        --resume --timeout SECONDS --workers W --tensorboard DIR --max-steps N --wide
//        --plain (the benchmark's recipe: one constant learning rate for all, no EMA)
//        --zero 1|2 (ZeRO: the SGD momentum sharded across ranks; 2 also reduce-scatters the
//        gradients; docs/zero.md)
//        --async-save (with --checkpoint-dir: each checkpoint written by a thread of rank 0 while
//        training goes on, tandem::AsyncCheckpoints)
//        --elastic [--elastic-store file:///PATH] (under `tandemrun --elastic`: a lost rank does
//        not end the run; the survivors heal through tandem::Elastic and go on with the epoch's
//        rest re-split over them; under `tandemrun --elastic --max-restarts N` a restarted
//        worker joins the running group, its state sent by a member; shm, gloo, hierarchical;
//        with --zero through tandem::ElasticZero; README.md here)
//        --await-replacement SECONDS (with --elastic: the survivors wait in the heal up to
//        SECONDS for the lost ranks' replacements, so the world size does not change)
//        --crash-in-setup (the tests, with --elastic: rank 1 kills itself in the set-up, which
//        runs in tandem::Elastic::start(); the survivors heal there)
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "common/elastic.hpp"
#include "common/elastic_run.hpp"
#include "common/run.hpp"
#include "recipe.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/comm/metrics.hpp"
#include "tandem/core/env.hpp"
#include "tandem/data/batches.hpp"
#include "tandem/data/loader.hpp"
#include "tandem/data/mnist.hpp"
#include "tandem/data/sampler.hpp"
#include "tandem/ddp/ddp.hpp"
#include "tandem/ddp/elastic_zero.hpp"
#include "tandem/io/async_checkpoint.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/io/log.hpp"
#include "tandem/io/progress.hpp"
#include "tandem/io/tensorboard.hpp"
#include "tandem/launch/elastic.hpp"
#include "tandem/nn/sync_batch_norm.hpp"
#include "tandem/optim/ema.hpp"
#include "tandem/optim/lr_scheduler.hpp"
#include "tandem/optim/sgd.hpp"
#if TANDEM_EXAMPLE_WITH_GLOO
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"
#endif
#if TANDEM_EXAMPLE_WITH_MPI
#include "tandem/comm/mpi/mpi.hpp"
#endif

namespace {

using fashion_mnist::classes;
using fashion_mnist::pixels;
using fashion_mnist::Settings;

/// An arena whose add() and add_buffer() return the entry already registered under the name: a
/// SyncBatchNorm made over it binds to the tensors it had (how Mlp::rebind makes it anew).
struct Registered {
  using value_type = float;
  using memory_space = tandem::Parameters<float>::memory_space;
  using Parameter = tandem::Parameters<float>::Parameter;
  tandem::Parameters<float>& arena;
  Parameter& add(const std::string& name, const tandem::Shape& /*shape*/) { return arena[name]; }
  Parameter& add_buffer(const std::string& name, const tandem::Shape& /*shape*/,
                        tandem::BufferKind /*kind*/) {
    return arena[name];
  }
};

/// The model: fc1 -> SyncBatchNorm -> ReLU -> fc2, its forward and backward written out, the
/// products through OpenBLAS. Names are those of the PyTorch module
/// nn.Sequential-like {fc1: Linear(784, H), bn1: BatchNorm1d(H), fc2: Linear(H, 10)}.
template <class Comm>
class Mlp {
 public:
  Mlp(Comm& comm, std::size_t hidden, std::uint64_t seed) : hidden_(hidden) {
    const auto h = static_cast<std::int64_t>(hidden);
    fc1_w_ = &params_.add("fc1.weight", {h, static_cast<std::int64_t>(pixels)});
    fc1_b_ = &params_.add("fc1.bias", {h});
    bn_.emplace(comm, params_, "bn1.", h);
    fc2_w_ = &params_.add("fc2.weight", {static_cast<std::int64_t>(classes), h});
    fc2_b_ = &params_.add("fc2.bias", {static_cast<std::int64_t>(classes)});
    params_.finalize();
    bn_->reset_parameters();
    // PyTorch's nn.Linear default (recipe.hpp), the same numbers as fashion_mnist_cuda's.
    const auto init = fashion_mnist::linear_init(hidden, seed);
    std::copy(init.fc1_weight.begin(), init.fc1_weight.end(), fc1_w_->value().data());
    std::copy(init.fc1_bias.begin(), init.fc1_bias.end(), fc1_b_->value().data());
    std::copy(init.fc2_weight.begin(), init.fc2_weight.end(), fc2_w_->value().data());
    std::copy(init.fc2_bias.begin(), init.fc2_bias.end(), fc2_b_->value().data());
  }

  tandem::Parameters<float>& params() { return params_; }
  tandem::SyncBatchNorm<Comm>& batch_norm() { return *bn_; }

  /// The SyncBatchNorm over `comm` (a heal's new group, --elastic), on the parameters and
  /// running statistics it already has in the arena.
  void rebind(Comm& comm) {
    Registered registered{params_};
    bn_.reset();
    bn_.emplace(comm, registered, "bn1.", static_cast<std::int64_t>(hidden_));
  }

  /// Logits of `count` images (count x 784) into logits_ (count x 10).
  void forward(const float* x, std::size_t count) {
    resize(count);
    // h1 = x W1^T + b1
    for (std::size_t s = 0; s < count; ++s)
      std::copy_n(fc1_b_->value().data(), hidden_, &h1_[s * hidden_]);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(count), int(hidden_), int(pixels),
                1.0f, x, int(pixels), fc1_w_->value().data(), int(pixels), 1.0f, h1_.data(),
                int(hidden_));
    bn_->forward(view(h1_, count), view(bn_out_, count));
    for (std::size_t i = 0; i < count * hidden_; ++i) relu_[i] = std::max(bn_out_[i], 0.0f);
    for (std::size_t s = 0; s < count; ++s)
      std::copy_n(fc2_b_->value().data(), classes, &logits_[s * classes]);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(count), int(classes), int(hidden_),
                1.0f, relu_.data(), int(hidden_), fc2_w_->value().data(), int(hidden_), 1.0f,
                logits_.data(), int(classes));
  }

  /// Mean cross-entropy of the last forward against `labels`; with `ready`, its gradients
  /// (scaled by `scale`) added into the arena, each handed to ready(param) when complete.
  template <class Ready>
  double loss_and_backward(const float* x, const std::int64_t* labels, std::size_t count,
                           Ready&& ready) {
    double loss = 0;
    std::vector<float>& d = dlogits_;
    for (std::size_t s = 0; s < count; ++s) {
      const float* z = &logits_[s * classes];
      const float top = *std::max_element(z, z + classes);
      double sum = 0;
      for (std::size_t k = 0; k < classes; ++k) sum += std::exp(double(z[k] - top));
      const auto label = static_cast<std::size_t>(labels[s]);
      loss += std::log(sum) - double(z[label] - top);
      for (std::size_t k = 0; k < classes; ++k) {
        const double p = std::exp(double(z[k] - top)) / sum;
        d[s * classes + k] = static_cast<float>((p - (k == label ? 1.0 : 0.0)) / double(count));
      }
    }
    // fc2: dW2 += d^T relu, db2 += sum d, then d relu = d W2
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(classes), int(hidden_), int(count),
                1.0f, d.data(), int(classes), relu_.data(), int(hidden_), 1.0f,
                fc2_w_->grad().data(), int(hidden_));
    auto gb2 = fc2_b_->grad();
    for (std::size_t s = 0; s < count; ++s)
      for (std::size_t k = 0; k < classes; ++k) gb2[k] += d[s * classes + k];
    ready(*fc2_w_);
    ready(*fc2_b_);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(count), int(hidden_), int(classes),
                1.0f, d.data(), int(classes), fc2_w_->value().data(), int(hidden_), 0.0f,
                drelu_.data(), int(hidden_));
    for (std::size_t i = 0; i < count * hidden_; ++i) drelu_[i] = bn_out_[i] > 0 ? drelu_[i] : 0.0f;
    // bn1 (collective across ranks), then fc1: dW1 += dh1^T x, db1 += sum dh1
    bn_->backward(view(h1_, count), view(drelu_, count), view(dh1_, count));
    ready(params_["bn1.weight"]);
    ready(params_["bn1.bias"]);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(hidden_), int(pixels), int(count),
                1.0f, dh1_.data(), int(hidden_), x, int(pixels), 1.0f, fc1_w_->grad().data(),
                int(pixels));
    auto gb1 = fc1_b_->grad();
    for (std::size_t s = 0; s < count; ++s)
      for (std::size_t j = 0; j < hidden_; ++j) gb1[j] += dh1_[s * hidden_ + j];
    ready(*fc1_w_);
    ready(*fc1_b_);
    return loss / double(count);
  }

  /// Correct predictions of the last forward.
  std::int64_t correct(const std::int64_t* labels, std::size_t count) const {
    std::int64_t hits = 0;
    for (std::size_t s = 0; s < count; ++s) {
      const float* z = &logits_[s * classes];
      hits += std::max_element(z, z + classes) - z == labels[s];
    }
    return hits;
  }

 private:
  tandem::View<float> view(std::vector<float>& v, std::size_t count) {
    return tandem::View<float>(v.data(), tandem::Shape{std::int64_t(count), std::int64_t(hidden_)});
  }
  void resize(std::size_t count) {
    for (auto* v : {&h1_, &bn_out_, &relu_, &drelu_, &dh1_}) v->resize(count * hidden_);
    logits_.resize(count * classes);
    dlogits_.resize(count * classes);
  }

  std::size_t hidden_;
  tandem::Parameters<float> params_;
  tandem::Parameters<float>::Parameter *fc1_w_, *fc1_b_, *fc2_w_, *fc2_b_;
  std::optional<tandem::SyncBatchNorm<Comm>> bn_;
  std::vector<float> h1_, bn_out_, relu_, logits_, dlogits_, drelu_, dh1_;
};

/// Accuracy over the test set split by the evaluation sampler: every sample counted once.
template <class Comm>
double evaluate(Comm& comm, Mlp<Comm>& model, const tandem::FashionMNIST& test) {
  model.batch_norm().eval();
  auto sampler = tandem::DistributedSampler::evaluation(test.size(), comm);
  tandem::Loader loader(test, sampler | tandem::views::batches(500), {.workers = 0});
  std::int64_t hits = 0;
  for (const auto& batch : loader) {
    auto [images, labels] = batch.views();
    model.forward(images.data(), batch.size());
    hits += model.correct(labels.data(), batch.size());
  }
  model.batch_norm().train();
  const auto totals =
      tandem::reduce_sum(comm, std::array<std::int64_t, 2>{hits, std::int64_t(sampler.size())});
  return double(totals[0]) / double(totals[1]);
}

/// DDP with overlap, and with --zero Stage the shard<Stage> policy.
template <class Comm, int Stage>
struct DdpFor {
  using type = tandem::DistributedDataParallel<Comm, tandem::overlap, tandem::shard<Stage>>;
};
template <class Comm>
struct DdpFor<Comm, 0> {
  using type = tandem::DistributedDataParallel<Comm, tandem::overlap>;
};

/// One rank's whole run under ZeRO stage Stage (0: plain DDP) in `group`: an
/// examples::FixedGroup (the plain run) or a tandem::Elastic (--elastic: a lost rank's survivors
/// heal and go on, the epoch's rest re-split over them; under ZeRO through tandem::ElasticZero,
/// which keeps a replica of the ring neighbour's optimizer shard). Every collective runs in a
/// step's compute; apply is local. Returns the final test accuracy.
template <int Stage, class Group>
double train(Group& group, const Settings& settings) {
  using Comm = std::remove_reference_t<decltype(group.comm())>;
  using Sgd = tandem::optim::SGD<float>;
  // --elastic --zero: ElasticZero steps the shard and the replica in apply and all-gathers the
  // parameters at the start of the next compute (or of the evaluation's), not in the step.
  constexpr bool elastic_zero = Stage != 0 && !examples::is_fixed_group<Group>;
  // The set-up's collectives (the flags' agreement, DDP, ZeRO's first attach, the resume, the
  // TensorBoard directory, the async saver) run in set_up below, through examples::start: under
  // --elastic in the rebuild Elastic::start() runs under the heal's protection, so that a rank
  // lost there heals (examples::SetUp). Until then nothing here is collective: `first` gives
  // the sampler and SyncBatchNorm their first split, which the rebuild makes anew after a heal.
  Comm& first = group.comm();
  const tandem::FashionMNIST train_set(tandem::split::train, settings.data);
  const tandem::FashionMNIST test_set(tandem::split::test, settings.data);
  examples::check_data_fits(train_set, pixels, classes, settings.data);  // or labels index past
  examples::check_data_fits(test_set, pixels, classes, settings.data);   // the model's outputs
  Mlp<Comm> model(first, fashion_mnist::hidden_width(settings), settings.seed);
  std::optional<typename DdpFor<Comm, Stage>::type> ddp;  // made in the set-up

  const auto groups = fashion_mnist::sgd_groups(settings);
  const auto make_optimizer = [&] { return Sgd(model.params(), std::span(groups)); };
  std::optional<Sgd> own_optimizer;              // the run's, except under --elastic --zero
  std::optional<tandem::ElasticZero<Sgd>> zero;  // --elastic --zero: the shard and a replica
  if constexpr (elastic_zero) {
    zero.emplace(model.params(), make_optimizer);  // attached in the set-up, after DDP
  } else {
    own_optimizer.emplace(make_optimizer());
  }
  Sgd& optimizer = zero ? zero->optimizer() : *own_optimizer;  // the same object across heals
  tandem::DistributedSampler sampler(train_set.size(), first,
                                     {.shuffle = true, .seed = settings.seed});
  auto batches = sampler | tandem::views::batches(settings.batch_size);
  // The schedule's length, from the world size the job first formed with (on a replacement too).
  auto first_split = sampler;
  first_split.resplit(examples::first_world_size(group), 0, 0);
  const auto steps_per_epoch = static_cast<std::int64_t>(
      (first_split.size() + settings.batch_size - 1) / settings.batch_size);
  const std::int64_t total_steps = steps_per_epoch * settings.epochs;
  auto schedule = fashion_mnist::lr_schedule(optimizer, settings, total_steps);
  tandem::EMA ema(model.params(), fashion_mnist::ema_options());
  tandem::Loader loader(train_set, batches, {.workers = settings.workers});

  std::int64_t step = 0;
  std::size_t batches_done = 0;
  std::mt19937 generator(static_cast<unsigned>(settings.seed + 1000 * first.rank()));
  // What a checkpoint holds besides the model and the optimizer (loaded after them).
  const auto add_progress = [&](tandem::TrainingState& to) {
    to.ema(ema, model.params())
        .scheduler(schedule)
        .sampler(sampler, batches_done, settings.batch_size)
        .counter("step", step)
        .rng("generator", generator);
  };
  tandem::TrainingState state;
  state.model(model.params());
  if constexpr (elastic_zero) {
    state.optimizer(*zero);  // saved gathered, loaded into the shard and the replica
  } else {
    state.optimizer(optimizer);
  }
  add_progress(state);
  // --elastic --zero: the steps the EMA has taken. It averages the parameters a step updated once
  // they are whole, at the next gather; a compute done again after a heal does not count twice.
  std::int64_t ema_step = step;
  const auto gather = [&] {
    if constexpr (elastic_zero) {
      zero->gather(*ddp);
      if (!settings.plain && ema_step < step) ema.update();
      ema_step = step;
    }
  };
  // Opened in the set-up; a replacement admitted after it writes no TensorBoard events (its
  // rank 0 was another).
  std::optional<tandem::TensorBoardWriter> board;
  // A heal (--elastic): the Loader stops (its workers read the sampler), DDP and SyncBatchNorm
  // are made over the new group, the epoch's samples not yet trained on are dealt out over it
  // (batches_done full batches of this rank's list were taken; the new list starts at 0), and the
  // step's next compute restarts the Loader on the new list.
  // --async-save: rank 0 writes each checkpoint in the background while training goes on.
  std::optional<tandem::AsyncCheckpoints<Comm>> async_saves;
  const bool saves_async = settings.async_save && !settings.checkpoint_dir.empty();
  examples::HealingBatches batches_of(loader);
  examples::HealLog heal_log;  // rank 0's line after a step during which the group healed
  // DDP over `comm` (rank 0's values and buffers everywhere), and what is bound to it: under
  // --elastic --zero ElasticZero's attach (after a heal: the parameters and the full optimizer
  // state put together from the survivors' shards and replicas, re-sharded over the new group),
  // under --zero the momentum for this rank's parts only (before a resume).
  const auto make_ddp = [&](Comm& comm) {
    ddp.emplace(comm, model.params());
    if constexpr (elastic_zero) {
      zero->attach(*ddp, group.members());  // keeps the learning rates the LR schedule set
    } else if constexpr (Stage != 0) {
      ddp->shard(*own_optimizer);
    }
  };
  // Every collective before the first step. Under --elastic it may run again over a healed group
  // (a rank lost in it): each part then starts afresh (the resume loads the checkpoint again).
  examples::SetUp set_up_state;
  const auto set_up = [&](Comm& comm) {
    examples::agree_on_flags(comm, settings,
                             {{"--wide", settings.wide},
                              {"--plain", settings.plain},
                              {"--zero", settings.zero},
                              {"--elastic", settings.elastic},
                              {"--async-save", settings.async_save}});
    make_ddp(comm);
    examples::resume_and_open_board(group, comm, settings, state, loader, batches_done, step,
                                    board);
    ema_step = step;
    if (saves_async) async_saves.emplace(comm, settings.checkpoint_dir);
  };
  group.on_heal(
      [&] {
        ddp.reset();
        batches_of.stop();
        // Rank 0's write in flight ends first (a failure of it goes to stderr).
        if (async_saves) async_saves.reset();
      },
      [&](Comm& comm) {
        const bool setting_up = set_up_state.due(comm);  // the first time, or a rank lost in it
        model.rebind(comm);
        sampler.resplit(comm, std::min(sampler.size(), batches_done * settings.batch_size));
        batches_done = 0;
        if (setting_up) {
          set_up(comm);
          set_up_state.finish();
          return;
        }
        if (saves_async) async_saves.emplace(comm, settings.checkpoint_dir);
        make_ddp(comm);
      });
  // A replacement (tandemrun --elastic --max-restarts): a member sends it the training state at
  // the step boundary where it is admitted, with where in the epoch's end the group is (the
  // epoch's evaluation, its checkpoint, the last save's wait done), so that it takes up the loop
  // at the members' point. Then DDP over the grown group (start(): the members rebuild theirs;
  // where they had not finished the set-up, the replacement runs it with them). Under
  // --elastic --zero the state leaves out the optimizer: the members' rebuild attaches
  // ElasticZero, whose collectives send the replacement the parameters and its shard of the
  // optimizer state, and the replacement attaches in the same order, after its DDP. The model
  // goes for its buffers (BatchNorm's running statistics, which DDP broadcasts from rank 0: the
  // replacement may be rank 0; attach overwrites the parameters), and where the EMA stands
  // (ema_step), which the next gather() goes on from.
  examples::EpochEnds ends;
  std::int64_t waited = 0;  // 1 once the last async save was waited for
  tandem::TrainingState without_optimizer;
  if constexpr (elastic_zero)
    add_progress(without_optimizer.model(model.params()).counter("ema_step", ema_step));
  tandem::TrainingState joined =
      examples::joined_state(elastic_zero ? without_optimizer : state, ends, set_up_state);
  joined.counter("waited", waited);
  examples::send_on_join(group, joined);
  examples::start(group, set_up);
  if (!board) board.emplace(".", false);  // a replacement admitted after the set-up
  heal_log.started(group);                // a rank lost in the set-up: rank 0 says so

  double accuracy = ends.accuracy();
  double ema_accuracy = ends.ema_accuracy();
  double mean_loss = 0;
  double trained_seconds = 0;  // training only: the evaluations are not counted
  using clock = std::chrono::steady_clock;
  for (auto epoch = static_cast<int>(sampler.epoch()); epoch < settings.epochs; ++epoch) {
    examples::begin_epoch(sampler, epoch, batches_done);
    const auto epoch_start = clock::now();
    examples::HealingProgress progress;
    (void)progress.of(group, epoch, batches.size() - batches_done);
    batches_of.start(batches_done, group.generation());
    while (batches_done < batches.size()) {
      // A replacement admitted after the --max-steps step goes on to the epoch's end.
      if (settings.max_steps >= 0 && step >= settings.max_steps && group.replacement()) break;
      examples::crash_if_asked(settings, step, group);
      heal_log.step(
          group, step, "training",
          [&](Comm& comm) {
            gather();  // --elastic --zero: the last step's parameters, before the forward
            const auto& batch = batches_of.current(batches_done, group.generation());
            auto [images, labels] = batch.views();
            ddp->before_forward();
            optimizer.zero_grad();
            model.forward(images.data(), batch.size());
            const double loss =
                model.loss_and_backward(images.data(), labels.data(), batch.size(),
                                        [&](auto& param) { ddp->grad_ready(param); });
            ddp->finish_gradient_sync();
            if constexpr (elastic_zero) zero->exchange(*ddp);  // shard<2>: the replica's gradients
            if ((step + 1) % 50 == 0 || batches_done + 1 == batches.size())
              mean_loss = tandem::reduce_mean(comm, loss);  // the same on every rank
            if constexpr (Stage != 0 && !elastic_zero) ddp->step(optimizer);  // the all_gather
          },
          [&] {  // local only (a survivor may apply a step committed elsewhere during a heal)
            if constexpr (elastic_zero) {
              zero->step();  // the shard and the replica; their parameters gathered next compute
            } else if constexpr (Stage == 0) {
              optimizer.step();
            }
            schedule.step();
            if (!settings.plain && !elastic_zero) ema.update();  // else at the next gather
            ++batches_done;
            ++step;
            batches_of.next(group.generation());
          });
      if (step % 50 == 0 || batches_done == batches.size())
        board->add_scalar("train/loss", mean_loss, step);
      // The step just taken counts in a bar made after a heal.
      progress.of(group, epoch, batches.size() - batches_done + 1)
          .update({{"loss", mean_loss}, {"lr", optimizer.lr(0)}});
      if (settings.max_steps >= 0 && step >= settings.max_steps) break;
    }
    progress.of(group, epoch, 0).finish();
    trained_seconds += std::chrono::duration<double>(clock::now() - epoch_start).count();
    if (ends.evaluated <= epoch) {  // not yet on a replacement admitted after it
      heal_log.step(
          group, step, "evaluation",
          [&](Comm& comm) {
            gather();
            accuracy = evaluate(comm, model, test_set);
            ema_accuracy = accuracy;
            if (!settings.plain) {
              auto applied = ema.applied();
              ema_accuracy = evaluate(comm, model, test_set);
            }
          },
          [&] { ends.evaluated_epoch(epoch, accuracy, ema_accuracy); });
    }
    examples::end_epoch(group.comm(), *board,
                        {epoch, step, accuracy, ema_accuracy, trained_seconds}, sampler,
                        batches_done, batches.size());
    if (!settings.checkpoint_dir.empty() && ends.saved <= epoch) {
      heal_log.step(
          group, step, "checkpoint",
          [&](Comm& comm) {
            gather();  // nothing after the evaluation's
            if (async_saves)
              async_saves->save(step, state);  // returns once the snapshot is taken
            else
              tandem::save_checkpoint(comm, settings.checkpoint_dir, step, state);
          },
          [&] { ends.saved = epoch + 1; });
    }
    if (settings.max_steps >= 0 && step >= settings.max_steps) break;
  }
  if (async_saves && waited == 0)  // the last file on disk
    heal_log.step(
        group, step, "checkpoint", [&](Comm&) { async_saves->wait(); }, [&] { waited = 1; });
  if (settings.elastic)
    examples::check_same_parameters(group, model.params(), [&](Comm&) { gather(); });
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

}  // namespace

int main(int argc, char** argv) {
  const auto settings = fashion_mnist::parse(argc, argv, fashion_mnist::program::cpu);
  if (!settings) return fashion_mnist::usage(fashion_mnist::program::cpu);
  openblas_set_num_threads(1);  // one core per rank: the ranks are the parallelism
  const auto timeout = std::chrono::seconds(settings->timeout_seconds);
  std::optional<std::string> store;
  if (settings->elastic) {
    if (const auto problem = examples::elastic_problem(settings->backend); !problem.empty()) {
      std::fprintf(stderr, "fashion_mnist: %s\n", problem.c_str());
      return fashion_mnist::usage(fashion_mnist::program::cpu);
    }
    store = examples::elastic_store_url(settings->elastic_store);
    if (!store) {
      std::fprintf(stderr,
                   "fashion_mnist: --elastic needs a launcher (tandemrun --elastic sets "
                   "TORCHELASTIC_RUN_ID, which names the store) or --elastic-store file:///PATH\n");
      return fashion_mnist::usage(fashion_mnist::program::cpu);
    }
  }
  // run_main prints an exception that ends the run and writes torchrun's error file.
  return tandem::run_main([&]() -> int {
    // train at the ZeRO stage --zero names, in `group`.
    const auto train_at_stage = [&](auto& group) {
      switch (settings->zero) {
        case 1:
          return train<1>(group, *settings);
        case 2:
          return train<2>(group, *settings);
        default:
          return train<0>(group, *settings);
      }
    };
    const auto accuracy =
        store ? examples::run_elastic_backend(
                    settings->backend, *store, timeout, train_at_stage,
                    {.await_replacement = std::chrono::seconds(settings->await_replacement)})
              : examples::run_cpu_backend(settings->backend, settings->ranks, timeout,
                                          [&](auto& comm) {
                                            examples::FixedGroup group(comm);
                                            return train_at_stage(group);
                                          });
    if (!accuracy) {
      std::fprintf(stderr, "fashion_mnist: backend '%s' is not built in\n",
                   settings->backend.c_str());
      return fashion_mnist::usage(fashion_mnist::program::cpu);
    }
    return std::isfinite(*accuracy) ? 0 : 1;
  });
}
