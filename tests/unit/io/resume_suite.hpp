// tests/unit/io/resume_suite.hpp - one rank's training run with everything a checkpoint must
// restore (parameters and a buffer, SGD momentum in two param groups, GradScaler, EMA, LR
// schedule, sampler position, a step counter, a per-rank RNG), and check_resume, which proves a
// resumed run ends bit for bit where an uninterrupted one does, on any communicator.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <random>
#include <span>
#include <vector>

#include "tandem/io/checkpoint.hpp"
#include "tandem/tandem.hpp"

namespace tandem::test::resume {

using tandem::optim::param_range;

// One rank's whole training run: a toy model whose gradients depend on the batch and on a
// per-rank random generator, trained with everything a checkpoint must restore.
template <class Comm>
struct Run {
  Comm& comm;
  tandem::Parameters<float> params;
  std::optional<tandem::optim::SGD<float>> opt;
  tandem::GradScaler<> scaler;
  std::optional<tandem::EMA<float>> ema;
  std::optional<decltype(tandem::lr::warmup_cosine(std::declval<tandem::optim::SGD<float>&>(), 2,
                                                   30, 0.1, 0.01))>
      schedule;
  tandem::DistributedSampler sampler;
  std::size_t batches_done = 0;
  std::int64_t step = 0;
  std::mt19937 generator;
  tandem::TrainingState state;

  explicit Run(Comm& c)
      : comm(c), sampler(45, c, {.seed = 7}), generator(static_cast<unsigned>(100 + c.rank())) {
    params.add("fc.weight", {4, 3});
    params.add("fc.bias", {4});
    params.add_buffer("bn.running_mean", {4});
    params.finalize();
    auto v = params.values();
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.1f * static_cast<float>(i % 5) - 0.2f;
    const std::vector<tandem::optim::ParamGroup<tandem::optim::SGDOptions>> groups{
        {param_range(0, 1), {.lr = 0.1, .momentum = 0.9}},
        {param_range(1, 2), {.lr = 0.2, .momentum = 0.9}}};
    opt.emplace(params, std::span(groups));
    ema.emplace(params, tandem::EMAOptions{.decay = 0.9});
    schedule.emplace(tandem::lr::warmup_cosine(*opt, 2, 30, 0.1, 0.01));
    state.model(params)
        .optimizer(*opt)
        .scaler(scaler)
        .ema(*ema, params)
        .scheduler(*schedule)
        .sampler(sampler, batches_done)
        .counter("step", step)
        .rng("noise", generator);
  }

  // Trains until `last_step` steps in all, continuing from wherever the state says.
  void train_until(std::int64_t last_step) {
    auto batches = sampler | tandem::views::batches(4);
    while (step < last_step) {
      if (batches_done == batches.size()) {
        sampler.set_epoch(sampler.epoch() + 1);
        batches_done = 0;
      }
      const auto batch = batches[batches_done];
      opt->zero_grad();
      comm.broadcast(params.buffer_values(), 0);    // as DDP's broadcast_buffers does
      const float loss_scale = scaler.scale(1.0f);  // the scaled backward of a loss of 1
      auto g = params.grads();
      auto v = params.values();
      for (std::size_t i = 0; i < g.size(); ++i) {
        float sum = 0;
        for (auto index : batch) sum += v[i] - 0.01f * static_cast<float>(index % 9);
        const float noise = static_cast<float>(generator() % 1000) * 1e-5f;
        g[i] = (sum + noise) * loss_scale;
      }
      comm.all_reduce(g, tandem::ReduceOp::avg);
      auto running = params["bn.running_mean"].value();
      for (std::size_t k = 0; k < running.size(); ++k) {
        running[k] = 0.9f * running[k] + 0.1f * static_cast<float>(batch[0] % 7 + k);
      }
      scaler.unscale_(*opt);
      scaler.step(*opt);
      scaler.update();
      schedule->step();
      ema->update();
      ++batches_done;
      ++step;
    }
  }
};

std::vector<float> copy_of(tandem::View<float, tandem::host> v) {
  return {v.data(), v.data() + v.size()};
}

struct Outcome {
  std::vector<float> values, buffers, shadow, momentum;
  double scale = 0;
  double lr = 0;
  std::int64_t step = 0;
  std::uint32_t next_random = 0;
  bool operator==(const Outcome&) const = default;
};

template <class Comm>
Outcome outcome(Run<Comm>& run) {
  Outcome o{copy_of(run.params.values()),
            copy_of(run.params.buffer_values()),
            copy_of(run.ema->shadow_values()),
            {},
            run.scaler.get_scale(),
            run.opt->lr(1),
            run.step,
            static_cast<std::uint32_t>(run.generator())};
  const auto dict = run.opt->state_dict();
  for (const auto& [index, param] : dict.state) {
    const auto& m = param.tensors.at("momentum_buffer");
    o.momentum.insert(o.momentum.end(), m.data(), m.data() + m.size());
  }
  return o;
}

/// Trains n ranks 17 steps straight, and again stopped at step 9 (mid-epoch), saved into `dir`,
/// rebuilt from nothing, loaded (or broadcast from rank 0) and trained to 17; each rank's end
/// state must be the same bit for bit. `run(n, fn(Comm&))` starts the ranks; a rank that runs
/// in another process (MPI) checks only its own outcome. Returns the number of ranks compared.
template <class Runner>
int check_resume(Runner run, int n, const std::filesystem::path& dir, bool broadcast) {
  std::vector<Outcome> straight(static_cast<std::size_t>(n)), resumed(static_cast<std::size_t>(n));
  std::vector<char> here(static_cast<std::size_t>(n), 0);
  run(n, [&](auto& comm) {
    Run run_straight(comm);
    run_straight.train_until(17);
    straight[static_cast<std::size_t>(comm.rank())] = outcome(run_straight);
    here[static_cast<std::size_t>(comm.rank())] = 1;
  });
  run(n, [&](auto& comm) {
    {
      Run first(comm);
      first.train_until(9);
      tandem::save_checkpoint(comm, dir, first.step, first.state);
    }
    Run second(comm);
    const auto latest = tandem::latest_checkpoint(dir);
    REQUIRE(latest.has_value());
    tandem::load_checkpoint(comm, *latest, second.state, {.broadcast = broadcast});
    CHECK(second.step == 9);
    CHECK(second.batches_done == 3);
    second.train_until(17);
    resumed[static_cast<std::size_t>(comm.rank())] = outcome(second);
  });
  int compared = 0;
  for (std::size_t r = 0; r < here.size(); ++r) {
    if (!here[r]) continue;
    ++compared;
    CAPTURE(r);
    CHECK(resumed[r].values == straight[r].values);
    CHECK(resumed[r].buffers == straight[r].buffers);
    CHECK(resumed[r].shadow == straight[r].shadow);
    CHECK(resumed[r].momentum == straight[r].momentum);
    CHECK(resumed[r].scale == straight[r].scale);
    CHECK(resumed[r].lr == straight[r].lr);
    CHECK(resumed[r].next_random == straight[r].next_random);  // each rank's own generator
  }
  return compared;
}

}  // namespace tandem::test::resume
