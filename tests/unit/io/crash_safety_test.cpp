// Crash safety: a writer saving checkpoints in a loop is killed with SIGKILL at random moments,
// 20 times; each time the newest checkpoint left behind loads and verifies, and holds the values
// of one whole save (never a mix of two). Also: reading a checkpoint into device memory goes
// through pinned staging (the fake device space).
#include "unit/nn/fake_device_space.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "support/temp_dir.hpp"
#include "tandem/comm/local.hpp"
#include "tandem/ddp/parameters.hpp"
#include "tandem/io/checkpoint.hpp"

namespace {

// Saves forever: step s has every value equal to s, 1 Mi floats, so a save takes a while.
[[noreturn]] void save_forever(const std::filesystem::path& dir) {
  tandem::run_local(1, [&](tandem::LocalComm& comm) {
    tandem::Parameters<float> params;
    params.add("w", {1024, 1024});
    params.finalize();
    std::int64_t step = 0;
    tandem::TrainingState state;
    state.model(params).counter("step", step);
    for (step = 1;; ++step) {
      auto v = params.values();
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(step);
      tandem::save_checkpoint(comm, dir, step, state, {.keep_last = 2});
    }
  });
  std::_Exit(0);
}

}  // namespace

TEST_CASE("SIGKILL during saves never leaves an unreadable newest checkpoint") {
  tandem::test::TempDir dir;
  std::mt19937 random(12345);
  int verified = 0;
  for (int trial = 0; trial < 20; ++trial) {
    CAPTURE(trial);
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) save_forever(dir.path());
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + random() % 80));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    REQUIRE(WIFSIGNALED(status));
    const auto latest = tandem::latest_checkpoint(dir.path(), {}, nullptr);
    if (!latest) continue;  // killed before the first save finished
    const auto file = tandem::SafetensorsFile::map(*latest);
    file.verify_checksum();
    const auto values = file.values<float>("w");
    const auto step =
        std::stoll(nlohmann::json::parse(file.metadata().at("tandem.state")).at("step").dump());
    CHECK(values.front() == static_cast<float>(step));
    CHECK(values.back() == static_cast<float>(step));
    CHECK(std::all_of(values.begin(), values.end(), [&](float v) { return v == values.front(); }));
    // The newest listed file is the valid one: a kill never leaves a damaged checkpoint file
    // (only a temporary file, which is not a checkpoint).
    CHECK(tandem::list_checkpoints(dir.path()).front().second == *latest);
    ++verified;
  }
  CHECK(verified >= 15);
  // The next whole save sweeps away the temporary files killed saves left.
  tandem::run_local(1, [&](tandem::LocalComm& comm) {
    tandem::Parameters<float> params;
    params.add("w", {4});
    params.finalize();
    tandem::TrainingState state;
    state.model(params);
    tandem::save_checkpoint(comm, dir.path(), 1000000, state, {.keep_last = 2});
  });
  int temporaries = 0, checkpoints = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    const auto name = entry.path().filename().string();
    temporaries += name.find(".tmp-") != std::string::npos;
    checkpoints += name.ends_with(".safetensors");
  }
  CHECK(temporaries == 0);
  CHECK(checkpoints == 2);
}

TEST_CASE("a checkpoint loads into device memory through pinned staging") {
  tandem::test::TempDir dir;
  const auto path = dir / "host.safetensors";
  std::vector<float> weights{1, 2, 3, 4, 5, 6};
  tandem::SafetensorsWriter writer;
  writer.add("w", weights, {2, 3});
  writer.write(path);
  const auto file = tandem::SafetensorsFile::open(path);
  std::vector<float> storage(6, 0.0f);
  tandem::View<float, tandem::test::fake_device> on_device(storage.data(), storage.size());
  const int to_device = tandem::test::staging_counters.to_device.load();
  file.read_into("w", on_device);
  CHECK(tandem::test::staging_counters.to_device.load() == to_device + 1);
  CHECK(storage == weights);
  // And out of device memory into a file.
  tandem::SafetensorsWriter from_device;
  from_device.add("w", on_device, {3, 2});
  CHECK(tandem::SafetensorsFile::parse(from_device.serialize(), "x").values<float>("w") == weights);
}
