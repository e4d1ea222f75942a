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

#include "resume_suite.hpp"
#include "support/temp_dir.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/tandem.hpp"

// One namespace per file: io_checkpoints builds this room's checkpoint tests as one unity
// translation unit (CI time), where the files' anonymous namespaces and using-directives meet.
namespace io_checkpoint_test {

using tandem::test::resume::Run;

// TrainingState::sampler takes what it saves and checks through a concept (io/ includes no data/
// header): the sampler of data/ models it, a type without an epoch does not.
static_assert(tandem::ResumableSampler<tandem::DistributedSampler>);
static_assert(!tandem::ResumableSampler<std::vector<std::int64_t>>);

TEST_CASE("a resumed run ends bit for bit where an uninterrupted one does") {
  for (bool broadcast : {false, true}) {
    CAPTURE(broadcast);
    tandem::test::TempDir dir;
    CHECK(tandem::test::resume::check_resume(
              [](int n, auto&& fn) {
                tandem::run_local(n, [&](tandem::LocalComm& comm) { fn(comm); });
              },
              2, dir.path(), broadcast) == 2);
  }
}

TEST_CASE("the file holds the model under its own names, readable as plain safetensors") {
  tandem::test::TempDir dir;
  tandem::run_local(1, [&](tandem::LocalComm& comm) {
    Run<tandem::LocalComm> run(comm);
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
    Run<tandem::LocalComm> run(comm);
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
    Run<tandem::LocalComm> run(comm);
    CHECK_THROWS_AS(tandem::load_checkpoint(comm, all[0].second, run.state), tandem::Error);
    tandem::load_checkpoint(comm, *latest, run.state);
    CHECK(run.step == 3);
  });
}

TEST_CASE("latest_checkpoint: no checkpoint is a first run; every one damaged is an Error") {
  tandem::test::TempDir dir;
  // Nothing there (or no directory at all): empty, so the run starts from scratch.
  CHECK_FALSE(tandem::latest_checkpoint(dir.path(), {}, nullptr).has_value());
  CHECK_FALSE(tandem::latest_checkpoint(dir / "missing", {}, nullptr).has_value());
  tandem::run_local(1, [&](tandem::LocalComm& comm) {
    Run<tandem::LocalComm> run(comm);
    for (std::int64_t s = 1; s <= 2; ++s) {
      run.train_until(s);
      tandem::save_checkpoint(comm, dir.path(), s, run.state);
    }
  });
  const auto all = tandem::list_checkpoints(dir.path());
  REQUIRE(all.size() == 2);
  // Both damaged: a flipped data byte in the newest, a truncation of the older.
  {
    std::fstream f(all[0].second, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-2, std::ios::end);
    f.put('\x7f');
  }
  std::filesystem::resize_file(all[1].second, std::filesystem::file_size(all[1].second) / 2);
  try {
    (void)tandem::latest_checkpoint(dir.path(), {}, nullptr);
    FAIL("latest_checkpoint returned although every checkpoint is damaged");
  } catch (const tandem::Error& error) {
    const std::string what = error.what();
    CAPTURE(what);
    CHECK(error.operation() == "latest_checkpoint " + dir.str());
    CHECK(what.find("all 2 checkpoint(s) are damaged") != std::string::npos);
    CHECK(what.find("refusing to start from scratch") != std::string::npos);
    CHECK(what.find(all[0].second.filename().string()) != std::string::npos);  // the newest
    CHECK(what.find("tandem: ", 1) == std::string::npos);                      // said once
  }
  // Files that are not checkpoints (a killed save's temporary file) do not count.
  std::filesystem::remove(all[0].second);
  std::filesystem::remove(all[1].second);
  std::ofstream(dir / ".checkpoint-000000000003.safetensors.tmp-1") << "partial";
  CHECK_FALSE(tandem::latest_checkpoint(dir.path(), {}, nullptr).has_value());
}

// Found by fuzzing: integer fields were read with nlohmann's get<I>, which casts a float (undefined
// behaviour out of range) and wraps a negative number into an unsigned type.
TEST_CASE("an integer field that is a float, negative for its type or too large is an Error") {
  tandem::test::TempDir dir;
  const auto path = dir / "counter.safetensors";
  tandem::run_local(1, [&](tandem::LocalComm& comm) {
    std::uint64_t step = 1234567;
    tandem::TrainingState state;
    state.counter("step", step);
    tandem::save_checkpoint(comm, path, state);
  });
  std::string original;
  {
    std::ifstream in(path, std::ios::binary);
    original.assign(std::istreambuf_iterator<char>(in), {});
  }
  const auto at = original.find("1234567");
  REQUIRE(at != std::string::npos);
  // Same length, so the header's length prefix stays right; the data checksum is unaffected.
  for (const auto& [replacement, expected] : std::vector<std::pair<std::string, std::string>>{
           {"1.2e+99", "'step' is 1.2e+99, not an integer"},
           {"-123456", "'step' is -123456, out of range for its type"},
           {"1234567", ""}}) {
    CAPTURE(replacement);
    std::string changed = original;
    changed.replace(at, replacement.size(), replacement);
    {
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out << changed;
    }
    tandem::run_local(1, [&](tandem::LocalComm& comm) {
      std::uint64_t step = 0;
      tandem::TrainingState state;
      state.counter("step", step);
      if (expected.empty()) {
        tandem::load_checkpoint(comm, path, state);
        CHECK(step == 1234567);
        return;
      }
      try {
        tandem::load_checkpoint(comm, path, state);
        FAIL("loaded " << step);
      } catch (const tandem::Error& e) {
        CHECK(std::string(e.what()).find(expected) != std::string::npos);
      }
    });
  }
}

TEST_CASE("list_checkpoints passes over names whose step is not a number that fits") {
  tandem::test::TempDir dir;
  for (const char* name :
       {"checkpoint-000000000007.safetensors", "checkpoint-99999999999999999999999.safetensors",
        "checkpoint-12abc.safetensors", "checkpoint--5.safetensors", "checkpoint-.safetensors"}) {
    std::ofstream(dir / name) << "x";
  }
  const auto all = tandem::list_checkpoints(dir.path());
  REQUIRE(all.size() == 1);
  CHECK(all[0].first == 7);
}

}  // namespace io_checkpoint_test
