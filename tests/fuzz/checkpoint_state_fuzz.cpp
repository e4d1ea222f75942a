// The checkpoint loader's metadata path on hostile text: a checkpoint whose tensors are those a
// real training state saved, but whose `tandem.state` metadata (the JSON of the optimizer's
// param groups, state and step counts, the GradScaler, LR schedule, sampler position, a counter
// and a random generator) is the fuzz input. TrainingState::load_from must restore it or throw
// tandem::Error; never anything else, and never touch memory outside what it restores; what it
// restores is in range (a positive finite loss scale, a sampler position inside its epoch, finite
// non-negative learning rates).
// The model and EMA parts are left out: they read tensors only (the safetensors target covers
// those), and Parameters::buffers() does not compile with clang 14 over libstdc++ 12
// (std::ranges::subrange of a deque iterator).
//
// fuzz-needs: tandem::io
// fuzz-max-len: 4096
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz/fuzz_check.hpp"
#include "tandem/amp/grad_scaler.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/data/sampler.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/optim/lr_scheduler.hpp"
#include "tandem/optim/sgd.hpp"

namespace {

using tandem::optim::param_range;

// What a checkpoint restores, as tests/unit/io/resume_suite.hpp trains it (no model, no EMA).
struct Training {
  tandem::Parameters<float> params;
  std::optional<tandem::optim::SGD<float>> opt;
  tandem::GradScaler<> scaler;
  std::optional<decltype(tandem::lr::warmup_cosine(std::declval<tandem::optim::SGD<float>&>(), 2,
                                                   30, 0.1, 0.01))>
      schedule;
  tandem::DistributedSampler sampler{45, 1, 0, {.seed = 7}};
  std::size_t batches_done = 0;
  std::int64_t step = 0;
  std::minstd_rand generator{100};  // a small state keeps the JSON under max_len
  tandem::TrainingState state;

  Training() {
    params.add("fc.weight", {4, 3});
    params.add("fc.bias", {4});
    params.add_buffer("bn.running_mean", {4});
    params.finalize();
    const std::vector<tandem::optim::ParamGroup<tandem::optim::SGDOptions>> groups{
        {param_range(0, 1), {.lr = 0.1, .momentum = 0.9}},
        {param_range(1, 2), {.lr = 0.2, .momentum = 0.9}}};
    opt.emplace(params, std::span(groups));
    schedule.emplace(tandem::lr::warmup_cosine(*opt, 2, 30, 0.1, 0.01));
    state.optimizer(*opt)
        .scaler(scaler)
        .scheduler(*schedule)
        .sampler(sampler, batches_done)
        .counter("step", step)
        .rng("noise", generator);
  }
};

tandem::CheckpointRanks one_rank() {
  return {0, 1, [](const std::string& mine) { return std::vector<std::string>{mine}; }};
}

// The tensors a trained state saves (momentum included, after one step), written once.
const tandem::SafetensorsWriter& saved_tensors() {
  static const tandem::SafetensorsWriter writer = [] {
    Training t;
    auto g = t.params.grads();
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.01f * static_cast<float>(i);
    t.opt->step();
    tandem::SafetensorsWriter out;
    t.state.save_to(out, one_rank());
    return out;
  }();
  return writer;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  tandem::SafetensorsWriter file = saved_tensors();
  file.metadata(tandem::TrainingState::metadata_key, std::string(text));
  std::vector<std::byte> bytes;
  try {
    bytes = file.serialize();
  } catch (const nlohmann::json::exception&) {
    return 0;  // not UTF-8: no safetensors file can hold it, so no loader ever sees it
  }
  const auto parsed = tandem::SafetensorsFile::parse(bytes, "fuzz.safetensors");
  Training t;
  try {
    t.state.load_from(parsed, one_rank());
  } catch (const tandem::Error&) {
    return 0;
  }
  // Restored values are in range for what they restore (the loader checks them; nothing the
  // file says reaches these objects unchecked).
  FUZZ_CHECK(t.scaler.get_scale() > 0 && std::isfinite(t.scaler.get_scale()));
  FUZZ_CHECK(t.batches_done <= t.sampler.size());
  for (std::size_t g = 0; g < 2; ++g) FUZZ_CHECK(std::isfinite(t.opt->lr(g)) && t.opt->lr(g) >= 0);
  FUZZ_CHECK(t.schedule->last_epoch() >= -1);
  // Restored: saving it again gives a checkpoint that loads, and that saves to the same state.
  tandem::SafetensorsWriter again;
  t.state.save_to(again, one_rank());
  const auto again_bytes = again.serialize();
  const auto reparsed = tandem::SafetensorsFile::parse(again_bytes, "fuzz-again.safetensors");
  Training u;
  u.state.load_from(reparsed, one_rank());  // an Error here escapes: the round trip broke
  tandem::SafetensorsWriter third;
  u.state.save_to(third, one_rank());
  const auto third_bytes = third.serialize();
  FUZZ_CHECK(third_bytes == again_bytes);
  return 0;
}
