// AsyncCheckpoints (io/async_checkpoint.hpp) on LocalComm ranks: the file holds the snapshot
// taken at save() although training changed the state while it was written, byte for byte the
// file save_checkpoint writes of that state; one save in flight at a time and the last K kept; a
// write that fails in the background (a file size limit: EFBIG) is reported by the next check()
// on every rank with its cause, leaves no file or temporary behind, and the next save works; the
// destructor waits for the write in flight.
#include <doctest/doctest.h>

#include <sys/resource.h>

#include <csignal>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "misuse_support.hpp"
#include "support/temp_dir.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/io/async_checkpoint.hpp"
#include "tandem/io/checkpoint.hpp"

// One namespace per file: io_checkpoints builds this room's checkpoint tests as one unity
// translation unit (CI time), where the files' anonymous namespaces and using-directives meet.
namespace io_async_checkpoint_test {

namespace {

using tandem::test::misuse::contains;
using tandem::test::misuse::errors_of_ranks;
using tandem::test::misuse::read_text;

// One rank's state: `numel` parameters, a step counter and a per-rank generator.
struct Model {
  tandem::Parameters<float> params;
  std::int64_t step = 0;
  std::mt19937 generator;
  tandem::TrainingState state;

  Model(int rank, std::int64_t numel) : generator(static_cast<unsigned>(7 + rank)) {
    params.add("w", {numel});
    params.finalize();
    set(0.5f);
    state.model(params).counter("step", step).rng("noise", generator);
  }
  void set(float value) {
    for (auto& v : params.values()) v = value;
  }
  // A training step: the state changes.
  void train() {
    for (auto& v : params.values()) v += 0.25f;
    generator.discard(3);
    ++step;
  }
};

std::string bytes_of(const std::filesystem::path& path) {
  return read_text(path);
}

std::size_t temporaries(const std::filesystem::path& dir) {
  std::size_t count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    count += entry.path().filename().string().find(".tmp-") != std::string::npos;
  }
  return count;
}

}  // namespace

TEST_CASE("an asynchronous save writes the snapshot taken at save() while training goes on") {
  tandem::test::TempDir dir;
  tandem::run_local(2, [&](tandem::LocalComm& comm) {
    Model model(comm.rank(), 1000);
    model.train();
    tandem::save_checkpoint(comm, dir.path() / "sync", model.step, model.state);
    tandem::AsyncCheckpoints checkpoints(comm, dir.path() / "async");
    const auto path = checkpoints.save(model.step, model.state);
    CHECK(checkpoints.in_flight());
    for (int s = 0; s < 5; ++s) {  // training goes on while the file is written
      model.train();
      checkpoints.check();
    }
    checkpoints.wait();
    CHECK_FALSE(checkpoints.in_flight());
    CHECK(path == dir.path() / "async" / "checkpoint-000000000001.safetensors");
    // The same bytes as a synchronous save of the snapshot's state.
    CHECK(bytes_of(path) == bytes_of(dir.path() / "sync" / path.filename()));
    Model loaded(comm.rank(), 1000);
    tandem::load_checkpoint(comm, path, loaded.state);
    CHECK(loaded.step == 1);
    CHECK(loaded.params.values()[999] == 0.75f);
  });
}

TEST_CASE("one asynchronous save in flight at a time, the last K kept") {
  tandem::test::TempDir dir;
  tandem::run_local(3, [&](tandem::LocalComm& comm) {
    Model model(comm.rank(), 100);
    {
      tandem::AsyncCheckpoints checkpoints(comm, dir.path(), {.keep_last = 2});
      for (int s = 0; s < 5; ++s) {
        model.train();
        checkpoints.save(model.step, model.state);  // waits for the previous one first
        CHECK(checkpoints.in_flight());
      }
    }  // the destructor waits for the last write
    comm.barrier();
    const auto kept = tandem::list_checkpoints(dir.path());
    REQUIRE(kept.size() == 2);
    CHECK(kept[0].first == 5);
    CHECK(kept[1].first == 4);
    Model loaded(comm.rank(), 100);
    tandem::load_checkpoint(comm, kept[0].second, loaded.state);
    CHECK(loaded.step == 5);
    CHECK(loaded.generator == model.generator);
  });
  CHECK(temporaries(dir.path()) == 0);
}

TEST_CASE("a background write that fails is reported by the next check, with its cause") {
  tandem::test::TempDir dir;
  const auto ckpt = dir.path() / "ckpt";
  // A file size limit on this process for the test's length (no fork: ThreadSanitizer refuses
  // threads after one): the 4 KB probe passes, the 400 KB checkpoint cannot be written.
  rlimit before{};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &before) == 0);
  const auto old_handler = ::signal(SIGXFSZ, SIG_IGN);
  rlimit limited = before;
  limited.rlim_cur = 64 * 1024;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &limited) == 0);
  std::vector<int> checks(2, 0);
  const auto errors = errors_of_ranks(2, [&](tandem::LocalComm& comm) {
    Model model(comm.rank(), 100 * 1024);
    tandem::AsyncCheckpoints checkpoints(comm, ckpt);
    model.train();
    checkpoints.save(7, model.state);  // the snapshot succeeds; its write will fail
    try {
      while (checkpoints.in_flight()) {  // steps go on until one reports the failure
        model.train();
        ++checks[static_cast<std::size_t>(comm.rank())];
        checkpoints.check();
      }
    } catch (const tandem::Error&) {
      // The next save works: a small state fits the limit.
      Model small(comm.rank(), 10);
      checkpoints.save(8, small.state);
      checkpoints.wait();
      throw;
    }
  });
  ::setrlimit(RLIMIT_FSIZE, &before);
  ::signal(SIGXFSZ, old_handler);
  CAPTURE(errors[0]);
  CAPTURE(errors[1]);
  CHECK(errors[0].starts_with("tandem: rank 0: save_checkpoint step 7 ("));
  CHECK(contains(errors[0], "in the background): safetensors"));
  CHECK(contains(errors[0], "cannot write: File too large"));
  CHECK_FALSE(contains(errors[0], "failed to save"));
  CHECK(errors[1].starts_with("tandem: rank 1: save_checkpoint step 7 ("));
  CHECK(contains(errors[1], "rank 0 failed to save checkpoint step 7: safetensors"));
  CHECK(contains(errors[1], "cannot write: File too large"));
  CHECK(checks[0] == checks[1]);  // both ranks learn it at the same step
  CHECK(temporaries(ckpt) == 0);  // atomic: nothing half-written left
  const auto kept = tandem::list_checkpoints(ckpt);
  REQUIRE(kept.size() == 1);  // step 7 never appeared; 8 did
  CHECK(kept[0].first == 8);
}

}  // namespace io_async_checkpoint_test
