// tests/unit/io/resize_job.hpp - one rank's job for the tests of a resume at another world
// size (resize_test.cpp on threads, resize_processes_test.cpp on processes): DDP or ZeRO stage 1
// or 2 over a small arena, SGD with momentum in two groups, an LR schedule, a DistributedSampler
// registered with its per-rank batch size and a per-rank generator; each sample it trains on
// counted.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "tandem/arena/parameters.hpp"
#include "tandem/data/batches.hpp"
#include "tandem/data/sampler.hpp"
#include "tandem/ddp/ddp.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/optim/lr_scheduler.hpp"
#include "tandem/optim/sgd.hpp"

namespace tandem::test::resize {

inline constexpr std::size_t samples = 60;  // 60 - 24 and 60 - 48 divide by 1, 2 and 3: no padding
inline constexpr std::size_t batch = 4;     // per rank: the global batch is 4 W

template <class Comm, int Stage>
struct DdpFor {  // small buckets, so that ZeRO cuts several unevenly
  using type = tandem::DistributedDataParallel<Comm, tandem::bucket_cap<40>, tandem::shard<Stage>>;
};
template <class Comm>
struct DdpFor<Comm, 0> {
  using type = tandem::DistributedDataParallel<Comm, tandem::bucket_cap<40>>;
};

inline tandem::Parameters<float>& built(tandem::Parameters<float>& params) {
  params.add("fc.weight", {5, 3});
  params.add("fc.bias", {5});
  params.add("head.weight", {7});
  params.finalize();
  auto v = params.values();
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.05f * static_cast<float>(i % 7) - 0.1f;
  return params;
}

inline std::string text_of(const std::mt19937& engine) {
  std::ostringstream out;
  out << engine;
  return out.str();
}

using StateDict = decltype(std::declval<tandem::optim::SGD<float>&>().state_dict());

// How often each sample came, over every rank of the jobs that shared an epoch.
struct Uses {
  std::mutex mutex;
  std::vector<int> count = std::vector<int>(samples, 0);
};

// One rank's job: everything a resume at another world size must carry.
template <class Comm, int Stage>
struct Job {
  Comm& comm;
  tandem::Parameters<float> params;
  typename DdpFor<Comm, Stage>::type ddp;
  tandem::optim::SGD<float> opt;
  tandem::lr::Scheduler<tandem::optim::SGD<float>> schedule;
  tandem::DistributedSampler sampler;
  std::size_t batches_done = 0;
  std::int64_t step = 0;
  std::mt19937 generator;
  tandem::TrainingState state;

  explicit Job(Comm& c)
      : comm(c),
        ddp(c, built(params)),
        opt(params, {{tandem::optim::params_with_prefix("fc."), {.lr = 0.1, .momentum = 0.9}},
                     {tandem::optim::params_with_prefix("head."), {.lr = 0.2, .momentum = 0.5}}}),
        schedule(tandem::lr::warmup_cosine(opt, 2, 40, 1.0, 0.1)),
        sampler(samples, c, {.shuffle = true, .seed = 17}),
        generator(static_cast<unsigned>(1000 + c.rank())) {
    if constexpr (Stage > 0) ddp.shard(opt);
    sampler.set_epoch(1);
    state.model(params)
        .optimizer(opt)
        .scheduler(schedule)
        .sampler(sampler, batches_done, batch)
        .counter("step", step)
        .rng("noise", generator);
  }

  // `steps` steps, or to the epoch's end when steps < 0; each sample taken is counted in `uses`.
  void train(int steps, Uses& uses) {
    auto batches = sampler | tandem::views::batches(batch);
    for (int s = 0; steps < 0 || s < steps; ++s) {
      if (batches_done == batches.size()) break;
      const auto indices = batches[batches_done];
      {
        std::lock_guard lock(uses.mutex);
        for (auto index : indices) ++uses.count[static_cast<std::size_t>(index)];
      }
      ddp.before_forward();
      auto v = params.values();
      auto g = params.grads();
      for (std::size_t i = 0; i < g.size(); ++i) {
        float sum = 0;
        for (auto index : indices) sum += std::sin(static_cast<float>(index) + 0.1f * float(i));
        const float noise = static_cast<float>(generator() % 1000) * 1e-5f;
        g[i] = 0.3f * v[i] + sum / float(batch) + noise;
      }
      for (auto& p : params) ddp.grad_ready(p);
      ddp.finish_gradient_sync();
      ddp.step(opt);
      schedule.step();
      opt.zero_grad();
      ++batches_done;
      ++step;
    }
  }
};

inline std::vector<float> values_of(tandem::Parameters<float>& params) {
  return {params.values().begin(), params.values().end()};
}

inline bool same_state(const StateDict& a, const StateDict& b) {
  if (a.state.size() != b.state.size() || a.param_groups.size() != b.param_groups.size()) {
    return false;
  }
  for (const auto& [index, param] : a.state) {
    const auto found = b.state.find(index);
    if (found == b.state.end() || param.scalars != found->second.scalars) return false;
    for (const auto& [name, tensor] : param.tensors) {
      const auto& other = found->second.tensors.at(name);
      if (!std::equal(tensor.data(), tensor.data() + tensor.size(), other.data(),
                      other.data() + other.size())) {
        return false;
      }
    }
  }
  for (std::size_t g = 0; g < a.param_groups.size(); ++g) {
    if (a.param_groups[g].options != b.param_groups[g].options ||
        a.param_groups[g].step != b.param_groups[g].step) {
      return false;
    }
  }
  return true;
}

}  // namespace tandem::test::resize
