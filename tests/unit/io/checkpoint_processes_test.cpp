// Checkpoint failures across processes (GlooComm over TCP on 127.0.0.1): the test starts its own
// executable once per rank as a worker, so that every rank's Error is seen whole (no launcher
// stops a rank before it reports). Rank 0 alone failing to save (its file size limited) is rank
// 0's Error with its cause, and rank 1's Error names rank 0 and carries the cause; ranks whose
// directories hold different newest checkpoints refuse to resume, naming the ranks and values.
//   io_checkpoint_processes                       the tests
//   io_checkpoint_processes MODE URL              one rank (RANK, WORLD_SIZE, TANDEM_TEST_DIR)
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "misuse_support.hpp"
#include "support/child_process.hpp"
#include "support/temp_dir.hpp"
#include "support/worker_processes.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/io/checkpoint.hpp"

namespace fs = std::filesystem;
using namespace tandem::test::misuse;

namespace {

// One rank: `mode` over Gloo at `url`; its Error text (or "no error") into DIR/rank<R>.txt.
int worker(const std::string& mode, const std::string& url) {
  const int rank = std::atoi(std::getenv("RANK"));
  const int size = std::atoi(std::getenv("WORLD_SIZE"));
  const fs::path dir = std::getenv("TANDEM_TEST_DIR");
  std::string outcome = "no error";
  try {
    if (mode == "save-fails" && rank == 0) {
      ::signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead
      const rlimit limit{64 * 1024, 64 * 1024};
      ::setrlimit(RLIMIT_FSIZE, &limit);
    }
    auto comm = tandem::init_process_group<tandem::GlooComm>(
        tandem::World::single_node(rank, size), url, {.timeout = std::chrono::seconds(60)});
    tandem::Parameters<float> params;
    params.add("w", {256 * 1024});  // 1 MB: past rank 0's limit
    params.finalize();
    std::int64_t step = 0;
    tandem::TrainingState state;
    state.model(params).counter("step", step);
    if (mode == "save-fails") {
      tandem::open_checkpoints(comm, dir / "ckpt", state);
      step = 200;
      tandem::save_checkpoint(comm, dir / "ckpt", step, state);
    } else if (mode == "resume-disagree") {
      // Each rank's "node-local" directory: rank 0's holds a checkpoint, rank 1's none.
      const auto own = dir / ("node" + std::to_string(rank));
      (void)tandem::open_checkpoints(comm, own, state, {.resume = true});
    }
  } catch (const std::exception& error) {
    outcome = error.what();
  }
  write_file(dir / ("rank" + std::to_string(rank) + ".txt"), outcome);
  return outcome == "no error" ? 0 : 1;
}

// Runs two worker processes of `mode` with TANDEM_TEST_DIR=dir; each rank's outcome.
std::vector<std::string> run_workers(const std::string& mode, const fs::path& dir) {
  ::setenv("TANDEM_TEST_DIR", dir.c_str(), 1);
  ::setenv("GLOO_SOCKET_IFNAME", "lo", 0);
  auto children =
      tandem::test::start_workers(tandem::test::self_path(), 2, 2, mode, tandem::test::tcp_url());
  const auto statuses = tandem::test::wait_all(children, std::chrono::seconds(120));
  std::vector<std::string> outcomes;
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK_MESSAGE(statuses[static_cast<std::size_t>(r)].failed(),
                  statuses[static_cast<std::size_t>(r)].describe());
    outcomes.push_back(read_text(dir / ("rank" + std::to_string(r) + ".txt")));
  }
  return outcomes;
}

}  // namespace

TEST_CASE("rank 0 alone failing to save: its own Error and cause; rank 1 names rank 0") {
  tandem::test::TempDir dir;
  const auto outcomes = run_workers("save-fails", dir.path());
  CAPTURE(outcomes[0]);
  CAPTURE(outcomes[1]);
  CHECK(outcomes[0].starts_with("tandem: rank 0: save_checkpoint step 200 ("));
  CHECK(contains(outcomes[0], "cannot write: File too large"));
  CHECK_FALSE(contains(outcomes[0], "failed to save"));
  CHECK(outcomes[1].starts_with("tandem: rank 1: save_checkpoint step 200 ("));
  CHECK(contains(outcomes[1], "rank 0 failed to save checkpoint step 200: "));
  CHECK(contains(outcomes[1], "cannot write: File too large"));
  CHECK(tandem::list_checkpoints(dir.path() / "ckpt").empty());
}

TEST_CASE("ranks whose directories hold different newest checkpoints refuse to resume") {
  tandem::test::TempDir dir;
  // Saved by a job of its own (a process that has ended, so that its lock is gone).
  REQUIRE(in_child([&] {
            tandem::run_local(1, [&](tandem::LocalComm& comm) {
              std::int64_t step = 3;
              tandem::TrainingState state;
              state.counter("step", step);
              tandem::save_checkpoint(comm, dir.path() / "node0", step, state);
            });
            return 0;
          }) == 0);
  fs::create_directories(dir.path() / "node1");
  const auto outcomes = run_workers("resume-disagree", dir.path());
  const auto newest = tandem::checkpoint_path(dir.path() / "node0", 3);
  for (int r = 0; r < 2; ++r) {
    const auto& outcome = outcomes[static_cast<std::size_t>(r)];
    CAPTURE(outcome);
    CHECK(outcome.starts_with("tandem: rank " + std::to_string(r) + ": latest_checkpoint "));
    CHECK(contains(outcome, "the ranks found different newest checkpoints: rank 0: " +
                                newest.string() + "; rank 1: none"));
  }
}

int main(int argc, char** argv) {
  // A worker (start_workers runs `SELF MODE URL` with RANK and WORLD_SIZE set).
  if (argc == 3 && std::getenv("RANK") &&
      (std::string_view(argv[1]) == "save-fails" ||
       std::string_view(argv[1]) == "resume-disagree")) {
    return worker(argv[1], argv[2]);
  }
  doctest::Context context(argc, argv);
  return context.run();
}
