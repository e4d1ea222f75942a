// Crash safety: a writer saving checkpoints in a loop is killed with SIGKILL at random moments,
// 20 times; each time the newest checkpoint left behind loads and verifies, and holds the values
// of one whole save (never a mix of two). Also: reading a checkpoint into device memory goes
// through pinned staging (the fake device space).
#include "support/fake_device_space.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "support/temp_dir.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/io/checkpoint.hpp"

// One namespace per file: io_checkpoints builds this room's checkpoint tests as one unity
// translation unit (CI time), where the files' anonymous namespaces and using-directives meet.
namespace io_crash_safety_test {

namespace {

// The model a writer saves: 1 Mi floats, every value equal to the step, so that a save takes a
// while and a file mixing two saves would show.
struct Saver {
  tandem::Parameters<float> params;
  std::int64_t step = 0;
  tandem::TrainingState state;
  Saver() {
    params.add("w", {1024, 1024});
    params.finalize();
    state.model(params).counter("step", step);
  }
  void save(tandem::LocalComm& comm, const std::filesystem::path& dir) {
    auto v = params.values();
    std::fill(v.begin(), v.end(), static_cast<float>(step));
    tandem::save_checkpoint(comm, dir, step, state, {.keep_last = 2});
  }
};

[[noreturn]] void save_forever(const std::filesystem::path& dir) {
  tandem::run_local(1, [&](tandem::LocalComm& comm) {
    Saver saver;
    for (saver.step = 1;; ++saver.step) saver.save(comm, dir);
  });
  std::_Exit(0);
}

}  // namespace

TEST_CASE("SIGKILL during saves never leaves an unreadable newest checkpoint") {
  tandem::test::TempDir dir;
  // How long one save takes here (sanitizers make it many times slower): kills are spread over
  // about two saves' time after the writer's first checkpoint exists.
  auto save_time = std::chrono::steady_clock::duration::zero();
  tandem::run_local(1, [&](tandem::LocalComm& comm) {
    Saver saver;
    const auto start = std::chrono::steady_clock::now();
    saver.save(comm, dir.path() / "timing");
    save_time = std::chrono::steady_clock::now() - start;
  });
  std::mt19937 random(12345);
  int verified = 0;
  std::filesystem::path last;
  for (int trial = 0; trial < 20; ++trial) {
    CAPTURE(trial);
    last = dir.path() / ("trial-" + std::to_string(trial));
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) save_forever(last);
    const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (tandem::list_checkpoints(last).empty() && std::chrono::steady_clock::now() < limit) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::this_thread::sleep_for(save_time * static_cast<int>(random() % 2000) / 1000);
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    REQUIRE(WIFSIGNALED(status));
    const auto latest = tandem::latest_checkpoint(last, {}, nullptr);
    REQUIRE(latest.has_value());
    const auto file = tandem::SafetensorsFile::map(*latest);
    file.verify_checksum();
    const auto values = file.values<float>("w");
    const auto step =
        nlohmann::json::parse(file.metadata().at("tandem.state")).at("step").get<std::int64_t>();
    CHECK(values.front() == static_cast<float>(step));
    CHECK(std::all_of(values.begin(), values.end(), [&](float v) { return v == values.front(); }));
    // The newest listed file is the valid one: a kill never leaves a damaged checkpoint file
    // (only a temporary file, which is not a checkpoint).
    CHECK(tandem::list_checkpoints(last).front().second == *latest);
    ++verified;
  }
  CHECK(verified == 20);
  // The next job resumes there: claiming the directory (the killed writer's lock is gone with
  // it) sweeps away the temporary file its save left.
  tandem::run_local(1, [&](tandem::LocalComm& comm) {
    Saver saver;
    REQUIRE(tandem::open_checkpoints(comm, last, saver.state, {.resume = true}).has_value());
    saver.step = 1000000;
    saver.save(comm, last);
  });
  int temporaries = 0, checkpoints = 0;
  for (const auto& entry : std::filesystem::directory_iterator(last)) {
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

}  // namespace io_crash_safety_test
