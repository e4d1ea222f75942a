// ShmComm across processes this test starts itself (shm_worker, one per rank, tcp:// on
// 127.0.0.1): a rank that dies mid-way (the others raise an Error naming it, within seconds, long
// before the timeout), a rank stopped by SIGSTOP (named at the timeout), and jobs killed with
// SIGKILL (nothing of theirs is left in /dev/shm). The workers decide their own success; this test
// checks how each one ended.
#include <doctest/doctest.h>

#include <dirent.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "support/worker_processes.hpp"
#include "tandem/launch/detail/process.hpp"

#ifndef TANDEM_SHM_WORKER
#error "TANDEM_SHM_WORKER must name the shm_worker executable"
#endif

namespace {

using namespace std::chrono_literals;
namespace launch = tandem::launch::detail;

/// Ranks 0 .. n-1 of a job of `world_size`, each running shm_worker `mode url`.
std::vector<launch::Child> start_workers(int n, int world_size, const std::string& mode,
                                         const std::string& url) {
  return tandem::test::start_workers(TANDEM_SHM_WORKER, n, world_size, mode, url);
}

using tandem::test::tcp_url;
using tandem::test::wait_all;

/// The names in /dev/shm of segments created by process `pid`.
std::vector<std::string> segments_of(pid_t pid) {
  const std::string prefix = "tandem-shm-" + std::to_string(pid) + "-";
  std::vector<std::string> found;
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (const dirent* entry = ::readdir(dir)) {
      if (std::string(entry->d_name).rfind(prefix, 0) == 0) found.push_back(entry->d_name);
    }
    ::closedir(dir);
  }
  return found;
}

}  // namespace

TEST_CASE("ShmComm: a rank that dies mid-way gives every other rank an Error naming it") {
  for (int n : {2, 3}) {
    CAPTURE(n);
    auto children = start_workers(n, n, "dead-peer", tcp_url());
    tandem::test::check_only_last_rank_killed(wait_all(children));
  }
}

TEST_CASE("ShmComm: a stopped rank makes the others fail at the timeout, naming it as stopped") {
  const int n = 3;
  auto children = start_workers(n, n, "stopped-peer", tcp_url());
  // The survivors end on their own (1 s timeout); the stopped rank never does: kill it then.
  const auto end = std::chrono::steady_clock::now() + 60s;
  auto survivors_done = [&] {
    bool done = true;
    for (int r = 0; r < n - 1; ++r) done = children[static_cast<std::size_t>(r)].poll() && done;
    return done;
  };
  while (!survivors_done() && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(10ms);
  }
  children.back().signal(SIGKILL);
  const auto statuses = wait_all(children);
  for (int r = 0; r < n - 1; ++r) {
    CAPTURE(r);
    CHECK_MESSAGE(!statuses[static_cast<std::size_t>(r)].failed(),
                  statuses[static_cast<std::size_t>(r)].describe());
  }
}

TEST_CASE("ShmComm: a job killed with SIGKILL leaves nothing in /dev/shm") {
  // A creator killed before its group had mapped the segment leaves its name behind ...
  auto lonely = start_workers(1, 2, "alone", "-");
  const auto lonely_pid = lonely.front().pid();
  const auto end = std::chrono::steady_clock::now() + 30s;
  while (segments_of(lonely_pid).empty() && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(10ms);
  }
  REQUIRE_MESSAGE(!segments_of(lonely_pid).empty(), "the lonely rank made no segment");
  lonely.front().signal(SIGKILL);
  (void)wait_all(lonely);
  CHECK(segments_of(lonely_pid).size() == 1);

  // ... which the next job's segments sweep away; that job, killed after its collectives, leaves
  // nothing either (each segment's name is gone once its ranks have mapped it).
  auto children = start_workers(3, 3, "killed", tcp_url());
  const auto statuses = wait_all(children);
  for (std::size_t r = 0; r < children.size(); ++r) {
    CAPTURE(r);
    CHECK_MESSAGE(statuses[r].signal == SIGKILL, statuses[r].describe());
    CHECK(segments_of(children[r].pid()).empty());
  }
  CHECK(segments_of(lonely_pid).empty());
}
