// tandemrun's blame (launch/failures.hpp): which rank a failure says it followed, the root cause
// first when the followers failed earlier, and the summary's "follows" lines and flight section.
#include <doctest/doctest.h>
#include <signal.h>

#include <chrono>
#include <string>
#include <vector>

#include "tandem/launch/failures.hpp"

namespace launch = tandem::launch;

namespace {

launch::WorkerFailure failed(int rank, int seconds_after, std::string message) {
  const auto t0 = std::chrono::system_clock::time_point(std::chrono::seconds(1'700'000'000));
  return {rank,
          rank,
          {1, 0},
          100 + rank,
          "node-a",
          t0 + std::chrono::seconds(seconds_after),
          std::move(message)};
}

}  // namespace

TEST_CASE("followed_rank reads the backends' words for a peer's failure") {
  using launch::followed_rank;
  CHECK(followed_rank("tandem: rank 1: all_reduce: gloo: Connection closed; rank 0 has died", 1) ==
        0);
  CHECK(followed_rank("tandem: rank 2: barrier: rank 0 failed: tandem: rank 0: x: y", 2) == 0);
  CHECK(followed_rank("tandem: rank 0: all_reduce: rank 3 left the group without joining", 0) == 3);
  CHECK(followed_rank("tandem: rank 0: all_reduce: timed out after 2 s waiting for rank 1 "
                      "(arrived: rank 0)",
                      0) == 1);
  CHECK(followed_rank("tandem: rank 0: x: ...; rank 1 is stopped (SIGSTOP: ...)", 0) == 1);
  CHECK(followed_rank("tandem: rank 2: save: another rank failed to save the checkpoint", 2) == -2);
  // Its own rank, or a rank named for something else, is no peer's failure.
  CHECK_FALSE(followed_rank("tandem: rank 1: save: rank 1 failed to open x", 1));
  CHECK_FALSE(
      followed_rank("tandem: rank 0: broadcast: ranks disagree on the root: rank 0 "
                    "called broadcast(1 x int64, root 0); rank 1 called ...",
                    0));
  CHECK_FALSE(followed_rank("tandem: rank 0: save_checkpoint: No space left on device", 0));
}

TEST_CASE("the root cause is the first own failure, even when its followers ended first") {
  std::vector<launch::WorkerFailure> failures{
      failed(1, 0, "tandem::Error: tandem: rank 1: save: rank 0 failed to save the checkpoint"),
      failed(2, 1, "tandem::Error: tandem: rank 2: save: another rank failed to save"),
      failed(0, 2, "tandem::Error: tandem: rank 0: save: No space left on device"),
  };
  launch::order_failures(failures);
  REQUIRE(failures.size() == 3);
  CHECK(failures[0].rank == 0);
  CHECK(failures[0].follows == -1);
  CHECK(failures[1].rank == 1);
  CHECK(failures[1].follows == 0);
  CHECK(failures[2].rank == 2);
  CHECK(failures[2].follows == -2);
  const launch::FlightSection flight{"/tmp/x/flight", {"rank 0 failed in all_reduce #3"}};
  const auto text = launch::failure_summary("./train", failures, &flight);
  const auto root = text.find("Root Cause");
  const auto other = text.find("Other Failures:");
  REQUIRE(root != std::string::npos);
  REQUIRE(other != std::string::npos);
  CHECK(text.substr(root, other - root).find("rank      : 0 (local_rank: 0)") != std::string::npos);
  CHECK(text.find("  follows   : rank 0 failed: tandem: rank 0: save: No space left on device\n") !=
        std::string::npos);
  CHECK(text.find("  follows   : another rank's failure\n") != std::string::npos);
  CHECK(text.find("Flight recorder (`tandemrun --trace /tmp/x/flight`):\n  rank 0 failed in "
                  "all_reduce #3\n") != std::string::npos);
}

TEST_CASE(
    "a stopped worker is the cause of the others' timeouts; with only followers, time rules") {
  auto stopped = failed(1, 0, "");
  stopped.stopped = true;
  stopped.status = {0, SIGTERM};
  std::vector<launch::WorkerFailure> failures{
      failed(0, 5, "tandem::Error: tandem: rank 0: all_reduce: timed out ...; rank 1 is stopped"),
      stopped,
  };
  launch::order_failures(failures);
  CHECK(failures[0].rank == 1);
  CHECK(failures[1].follows == 1);
  const auto text = launch::failure_summary("./train", failures);
  CHECK(text.find("stopped (SIGSTOP, SIGTSTP or a debugger)") != std::string::npos);
  CHECK(text.find("  follows   : rank 1, which was stopped") != std::string::npos);

  // Two ranks that each blame the other: neither failed on its own, so the first is first.
  std::vector<launch::WorkerFailure> circle{failed(0, 1, "x: rank 1 has died"),
                                            failed(1, 0, "x: rank 0 has died")};
  launch::order_failures(circle);
  CHECK(circle[0].rank == 1);
  CHECK(circle[1].rank == 0);
}
