// Checkpoints: a run stopped mid-epoch, saved, rebuilt from nothing and loaded ends bit for bit
// where an uninterrupted run ends (parameters, buffers, SGD momentum in two param groups,
// GradScaler, EMA, LR schedule, sampler position, step, each rank's RNG), on LocalComm; keeping
// the last K; the newest damaged checkpoint skipped; rank 0 broadcasting.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "support/temp_dir.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/tandem.hpp"

namespace {

using tandem::optim::param_range;

// One rank's whole training run: a toy model whose gradients depend on the batch and on a
// per-rank random generator, trained with everything a checkpoint must restore.
struct Run {
  tandem::LocalComm& comm;
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

  explicit Run(tandem::LocalComm& c)
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

Outcome outcome(Run& run) {
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

}  // namespace

TEST_CASE("a resumed run ends bit for bit where an uninterrupted one does") {
  tandem::test::TempDir dir;
  for (bool broadcast : {false, true}) {
    CAPTURE(broadcast);
    std::vector<Outcome> straight(2), resumed(2);
    tandem::run_local(2, [&](tandem::LocalComm& comm) {
      Run run(comm);
      run.train_until(17);  // 6 batches an epoch per rank: stops mid-epoch 3
      straight[static_cast<std::size_t>(comm.rank())] = outcome(run);
    });
    tandem::run_local(2, [&](tandem::LocalComm& comm) {
      {
        Run first(comm);
        first.train_until(9);
        tandem::save_checkpoint(comm, dir.path(), first.step, first.state);
      }
      Run second(comm);  // fresh objects, different from the saved ones until loaded
      const auto latest = tandem::latest_checkpoint(dir.path());
      REQUIRE(latest.has_value());
      tandem::load_checkpoint(comm, *latest, second.state, {.broadcast = broadcast});
      CHECK(second.step == 9);
      CHECK(second.batches_done == 3);
      second.train_until(17);
      resumed[static_cast<std::size_t>(comm.rank())] = outcome(second);
    });
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      CHECK(resumed[r].values == straight[r].values);
      CHECK(resumed[r].buffers == straight[r].buffers);
      CHECK(resumed[r].shadow == straight[r].shadow);
      CHECK(resumed[r].momentum == straight[r].momentum);
      CHECK(resumed[r].scale == straight[r].scale);
      CHECK(resumed[r].lr == straight[r].lr);
      CHECK(resumed[r].next_random == straight[r].next_random);  // each rank's own generator
    }
    CHECK(straight[0].next_random != straight[1].next_random);
    std::filesystem::remove_all(dir.path() / "");
    std::filesystem::create_directories(dir.path());
  }
}

TEST_CASE("the file holds the model under its own names, readable as plain safetensors") {
  tandem::test::TempDir dir;
  tandem::run_local(1, [&](tandem::LocalComm& comm) {
    Run run(comm);
    run.train_until(3);
    tandem::save_checkpoint(comm, dir / "one.safetensors", run.state);
  });
  const auto file = tandem::SafetensorsFile::open(dir / "one.safetensors");
  CHECK(file.entry("fc.weight").shape == std::vector<std::int64_t>{4, 3});
  CHECK(file.entry("bn.running_mean").shape == std::vector<std::int64_t>{4});
  CHECK(file.contains("optimizer.state.0.momentum_buffer"));
  CHECK(file.contains("ema.fc.bias"));
  CHECK(file.has_checksum());
  CHECK(file.metadata().contains("tandem.state"));
}

TEST_CASE("keep the last K; a damaged newest checkpoint is reported and skipped") {
  tandem::test::TempDir dir;
  tandem::run_local(2, [&](tandem::LocalComm& comm) {
    Run run(comm);
    for (std::int64_t s = 1; s <= 5; ++s) {
      run.train_until(s);
      tandem::save_checkpoint(comm, dir.path(), s, run.state, {.keep_last = 3});
    }
  });
  auto all = tandem::list_checkpoints(dir.path());
  REQUIRE(all.size() == 3);
  CHECK(all[0].first == 5);
  CHECK(all[2].first == 3);
  // Damage the newest: a flipped data byte (the header still parses) and a truncation.
  {
    std::fstream f(all[0].second, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-2, std::ios::end);
    f.put('\x7f');
  }
  std::filesystem::resize_file(all[1].second, std::filesystem::file_size(all[1].second) / 2);
  tandem::test::TempDir logs;
  std::FILE* report = std::fopen((logs / "report.txt").c_str(), "w+");
  REQUIRE(report != nullptr);
  const auto latest = tandem::latest_checkpoint(dir.path(), {}, report);
  std::rewind(report);
  char line[1024];
  int skipped = 0;
  while (std::fgets(line, sizeof line, report))
    skipped += std::strstr(line, "skipping damaged") != nullptr;
  std::fclose(report);
  REQUIRE(latest.has_value());
  CHECK(*latest == all[2].second);
  CHECK(skipped == 2);
  // Loading a damaged file is an Error on every rank, not a crash.
  tandem::run_local(2, [&](tandem::LocalComm& comm) {
    Run run(comm);
    CHECK_THROWS_AS(tandem::load_checkpoint(comm, all[0].second, run.state), tandem::Error);
    tandem::load_checkpoint(comm, *latest, run.state);
    CHECK(run.step == 3);
  });
}
