// A checkpoint resumed at another world size (issue 32): a job of DDP, ZeRO stage 1 or 2, SGD
// with momentum in two groups, an LR schedule, a DistributedSampler registered with its batch
// size and a per-rank random generator saves mid-epoch at W ranks and resumes at W' (2 -> 1,
// 2 -> 3, 4 -> 2, and 2 -> 2 against a run never stopped): the parameters, the optimizer state
// and the learning rate are what was saved, every sample of the epoch is used exactly once
// across the two jobs (counted), the epoch's remaining steps are those of the per-rank batch at
// W' ranks, and the generators follow the documented rule (rank r takes saved stream r; a rank
// beyond the saved ones a stream derived deterministically). LocalComm threads; built with Gloo
// (TANDEM_TEST_GLOO), the same on GlooComm threads.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

#include "resize_job.hpp"
#include "support/runners.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/data/batches.hpp"
#include "tandem/data/sampler.hpp"
#include "tandem/ddp/ddp.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/optim/lr_scheduler.hpp"
#include "tandem/optim/sgd.hpp"

// One namespace per file: io_checkpoints builds this room's checkpoint tests as one unity
// translation unit (CI time), where the files' anonymous namespaces and using-directives meet.
namespace io_resize_test {

namespace {

using namespace tandem::test::resize;

// What the saving job left: rank 0's parameters, the gathered optimizer state, the learning
// rates, and every rank's generator.
struct Saved {
  std::vector<float> params;
  StateDict state;
  std::vector<std::string> generators;
};

// What the resumed job holds when it ends the epoch.
struct Resumed {
  std::vector<float> params;
  std::int64_t step = 0;
  std::vector<std::string> generators;  // each rank's, right after the load
};

template <int Stage, class Runner>
Saved save_at(Runner& run, int size, int steps, const std::filesystem::path& dir, Uses& uses) {
  Saved saved;
  saved.generators.resize(static_cast<std::size_t>(size));
  std::mutex mutex;
  run(size, [&](auto& comm) {
    Job<std::remove_reference_t<decltype(comm)>, Stage> job(comm);
    job.train(steps, uses);
    tandem::save_checkpoint(comm, dir, job.step, job.state);
    auto dict = job.opt.state_dict();  // a collective under ZeRO
    std::lock_guard lock(mutex);
    saved.generators[static_cast<std::size_t>(comm.rank())] = text_of(job.generator);
    if (comm.rank() == 0) {
      saved.params = values_of(job.params);
      saved.state = std::move(dict);
    }
  });
  return saved;
}

// Resumes at `size` ranks from the newest checkpoint in `dir`, checks what was loaded against
// `saved`, and trains to the epoch's end (or `steps` steps).
template <int Stage, class Runner>
Resumed resume_at(Runner& run, int size, const std::filesystem::path& dir, const Saved& saved,
                  Uses& uses, int steps = -1) {
  Resumed resumed;
  resumed.generators.resize(static_cast<std::size_t>(size));
  std::mutex mutex;
  run(size, [&](auto& comm) {
    Job<std::remove_reference_t<decltype(comm)>, Stage> job(comm);
    const auto latest = tandem::latest_checkpoint(comm, dir);
    REQUIRE(latest.has_value());
    tandem::load_checkpoint(comm, *latest, job.state);
    const auto dict = job.opt.state_dict();
    {
      std::lock_guard lock(mutex);
      CHECK(values_of(job.params) == saved.params);
      CHECK(same_state(dict, saved.state));
      CHECK(job.batches_done == 0);  // the first batch of the new split
      resumed.generators[static_cast<std::size_t>(comm.rank())] = text_of(job.generator);
    }
    job.train(steps, uses);
    std::lock_guard lock(mutex);
    if (comm.rank() == 0) {
      resumed.params = values_of(job.params);
      resumed.step = job.step;
    }
  });
  return resumed;
}

std::filesystem::path fresh_directory(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("tandem-resize-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir;
}

template <int Stage, class Runner>
void check_resize(Runner run, const std::string& label) {
  struct Change {
    int from, to, steps;
  };
  for (const auto& [from, to, steps] : {Change{2, 1, 3}, Change{2, 3, 3}, Change{4, 2, 3}}) {
    CAPTURE(label);
    CAPTURE(from);
    CAPTURE(to);
    const auto dir = fresh_directory(label);
    Uses uses;
    const auto saved = save_at<Stage>(run, from, steps, dir, uses);
    const auto resumed = resume_at<Stage>(run, to, dir, saved, uses);
    // Every sample of the epoch exactly once, across the two jobs.
    CHECK(std::count(uses.count.begin(), uses.count.end(), 1) == std::ptrdiff_t(samples));
    // The per-rank batch stays 4: the epoch's rest takes ceil(rest / (4 W')) steps at W'.
    const std::size_t rest = samples - static_cast<std::size_t>(from * steps) * batch;
    const auto global = batch * static_cast<std::size_t>(to);
    CHECK(resumed.step == steps + std::int64_t((rest + global - 1) / global));
    // Generators: rank r < W takes saved stream r; the others a derived stream, the same on
    // every resume and none of the saved ones.
    for (int r = 0; r < to; ++r) {
      const auto& mine = resumed.generators[static_cast<std::size_t>(r)];
      if (r < from) {
        CHECK(mine == saved.generators[static_cast<std::size_t>(r)]);
      } else {
        CHECK(std::find(saved.generators.begin(), saved.generators.end(), mine) ==
              saved.generators.end());
        CHECK(std::count(resumed.generators.begin(), resumed.generators.end(), mine) == 1);
      }
    }
    if (to > from) {
      Uses again;
      const auto twice = resume_at<Stage>(run, to, dir, saved, again);
      CHECK(twice.generators == resumed.generators);
      CHECK(twice.params == resumed.params);
    }
    std::filesystem::remove_all(dir);
  }
}

template <int Stage, class Runner>
void check_same_size_exact(Runner run, const std::string& label) {
  // 2 -> 2: the three-argument sampler resumes bit for bit where a run never stopped is.
  const auto dir = fresh_directory(label + "-same");
  Uses straight_uses, uses;
  std::vector<float> straight;
  std::mutex mutex;
  run(2, [&](auto& comm) {
    Job<std::remove_reference_t<decltype(comm)>, Stage> job(comm);
    job.train(-1, straight_uses);
    std::lock_guard lock(mutex);
    if (comm.rank() == 0) straight = values_of(job.params);
  });
  const auto saved = save_at<Stage>(run, 2, 3, dir, uses);
  const auto resumed = resume_at<Stage>(run, 2, dir, saved, uses);
  CHECK(resumed.params == straight);
  CHECK(resumed.step == 8);  // 60 samples, 8 a step
  CHECK(uses.count == straight_uses.count);
  std::filesystem::remove_all(dir);
}

}  // namespace

TEST_CASE("DDP resumes at 1, 3 and 2 ranks from checkpoints saved at 2 and 4") {
  check_resize<0>(tandem::test::LocalRunner{}, "ddp");
  check_same_size_exact<0>(tandem::test::LocalRunner{}, "ddp");
}

TEST_CASE("ZeRO stage 1 resumes at 1, 3 and 2 ranks from checkpoints saved at 2 and 4") {
  check_resize<1>(tandem::test::LocalRunner{}, "zero1");
  check_same_size_exact<1>(tandem::test::LocalRunner{}, "zero1");
}

TEST_CASE("ZeRO stage 2 resumes at 1, 3 and 2 ranks from checkpoints saved at 2 and 4") {
  check_resize<2>(tandem::test::LocalRunner{}, "zero2");
  check_same_size_exact<2>(tandem::test::LocalRunner{}, "zero2");
}

#if defined(TANDEM_TEST_GLOO)
TEST_CASE("the same on GlooComm threads: DDP and ZeRO stage 2") {
  check_resize<0>(tandem::test::GlooThreadRunner{}, "gloo-ddp");
  check_resize<2>(tandem::test::GlooThreadRunner{}, "gloo-zero2");
}
#endif

TEST_CASE("the two-argument sampler resumes at its own world size only, and says why") {
  const auto dir = fresh_directory("two-argument");
  tandem::run_local(2, [&](tandem::LocalComm& comm) {
    tandem::DistributedSampler sampler(samples, comm, {.seed = 3});
    std::size_t batches_done = 2;
    tandem::TrainingState state;
    state.sampler(sampler, batches_done);
    tandem::save_checkpoint(comm, dir, 2, state);
  });
  tandem::run_local(3, [&](tandem::LocalComm& comm) {
    tandem::DistributedSampler sampler(samples, comm, {.seed = 3});
    std::size_t batches_done = 0;
    tandem::TrainingState state;
    state.sampler(sampler, batches_done);
    CHECK_THROWS_WITH_AS(
        tandem::load_checkpoint(comm, dir / "checkpoint-000000000002.safetensors", state),
        doctest::Contains(".sampler(sampler, batches_done, batch_size)"), tandem::Error);
  });
  // The three-argument form reads it: 2 batches of 4 on 2 ranks took 16 positions.
  tandem::run_local(3, [&](tandem::LocalComm& comm) {
    tandem::DistributedSampler sampler(samples, comm, {.seed = 3});
    std::size_t batches_done = 5;
    tandem::TrainingState state;
    state.sampler(sampler, batches_done, 4);
    tandem::load_checkpoint(comm, dir / "checkpoint-000000000002.safetensors", state);
    CHECK(sampler.offset() == 16);
    CHECK(batches_done == 0);
  });
  std::filesystem::remove_all(dir);
}

TEST_CASE("a saved sampler position outside its epoch is refused, naming the field") {
  const tandem::CheckpointRanks one{
      0, 1, [](const std::string& mine) { return std::vector<std::string>{mine}; }};
  nlohmann::json good;
  {
    tandem::DistributedSampler sampler(samples, 2, 0, {.seed = 3});
    std::size_t batches_done = 3;
    tandem::TrainingState state;
    state.sampler(sampler, batches_done, batch);
    tandem::SafetensorsWriter writer;
    state.save_to(writer, one);
    const auto bytes = writer.serialize();
    good = nlohmann::json::parse(tandem::SafetensorsFile::parse(bytes, "x")
                                     .metadata()
                                     .at(tandem::TrainingState::metadata_key));
  }
  CHECK(good["sampler"]["consumed"] == 24);  // 3 batches of 4 on each of 2 ranks
  const auto load = [&](const nlohmann::json& meta) -> std::string {
    tandem::SafetensorsWriter writer;
    writer.metadata(tandem::TrainingState::metadata_key, meta.dump());
    const auto bytes = writer.serialize();
    tandem::DistributedSampler sampler(samples, 3, 1, {.seed = 3});
    std::size_t batches_done = 7;
    tandem::TrainingState state;
    state.sampler(sampler, batches_done, batch);
    try {
      state.load_from(tandem::SafetensorsFile::parse(bytes, "made.safetensors"), one);
    } catch (const tandem::Error& error) {
      return error.what();
    }
    CHECK(sampler.offset() == 24);
    CHECK(batches_done == 0);
    return "";
  };
  CHECK(load(good).empty());
  auto beyond = good;
  beyond["sampler"]["consumed"] = samples + 1;
  CHECK(load(beyond).find("'sampler.consumed' is 61, outside the epoch's positions 0 .. 60") !=
        std::string::npos);
  auto before = good;
  before["sampler"]["offset"] = 30;
  CHECK(load(before).find("'sampler.consumed' is 24, outside the epoch's positions 30") !=
        std::string::npos);
  auto negative = good;
  negative["sampler"]["consumed"] = -1;
  CHECK(load(negative).find("'sampler.consumed' is -1, out of range") != std::string::npos);
  auto nobody = good;
  nobody["sampler"]["num_replicas"] = 0;
  CHECK(load(nobody).find("at least 1 rank") != std::string::npos);
  CHECK_THROWS_WITH_AS(
      [] {
        tandem::DistributedSampler sampler(samples, 1, 0);
        std::size_t batches_done = 0;
        tandem::TrainingState state;
        state.sampler(sampler, batches_done, 0);
      }(),
      doctest::Contains("batch_size = 0"), tandem::Error);
}

}  // namespace io_resize_test
