// tests/support/worker_processes.hpp - for tests that start a backend's worker program once per
// rank themselves (gloo_processes, shm_processes): start them with RANK and WORLD_SIZE, wait for
// all under a deadline, check how a job whose last rank killed itself ended, and a tcp:// address
// on 127.0.0.1.
//   using namespace tandem::test;
//   auto children = start_workers(WORKER, 3, 3, "dead-peer", tcp_url());
//   check_only_last_rank_killed(wait_all(children));
// Needs: doctest, tandem/launch (exec_child, Child, free_port).
#pragma once

#include <doctest/doctest.h>

#include <signal.h>

#include <chrono>
#include <cstddef>
#include <string>
#include <thread>
#include <vector>

#include "tandem/launch/detail/process.hpp"

extern "C" char** environ;

namespace tandem::test {

/// Starts ranks 0 .. n-1 of a job of `world_size` running `worker mode url`, each with this
/// process's environment but RANK and WORLD_SIZE its own.
inline std::vector<launch::detail::Child> start_workers(const std::string& worker, int n,
                                                        int world_size, const std::string& mode,
                                                        const std::string& url) {
  std::vector<launch::detail::Child> children;
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      const std::string entry(*e);
      if (entry.rfind("RANK=", 0) == 0 || entry.rfind("WORLD_SIZE=", 0) == 0) continue;
      env.push_back(entry);
    }
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(world_size));
    children.push_back(launch::detail::exec_child({worker, mode, url}, env, {}));
  }
  return children;
}

/// Waits for every child (at most `deadline`; then kills them and fails); how each ended.
inline std::vector<launch::detail::ExitStatus> wait_all(
    std::vector<launch::detail::Child>& children,
    std::chrono::seconds deadline = std::chrono::seconds(90)) {
  const auto end = std::chrono::steady_clock::now() + deadline;
  for (;;) {
    bool all = true;
    for (auto& child : children) all = child.poll() && all;
    if (all) break;
    if (std::chrono::steady_clock::now() > end) {
      FAIL_CHECK("workers still running after " << deadline.count() << " s: killing them");
      for (auto& child : children) child.signal(SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::vector<launch::detail::ExitStatus> statuses;
  for (auto& child : children) statuses.push_back(child.status());
  return statuses;
}

/// How a job whose last rank kills itself (SIGKILL) should end: that rank killed, every other
/// rank passed.
inline void check_only_last_rank_killed(const std::vector<launch::detail::ExitStatus>& statuses) {
  const auto last = statuses.size() - 1;
  for (std::size_t r = 0; r < statuses.size(); ++r) {
    CAPTURE(r);
    if (r == last) {
      CHECK_MESSAGE(statuses[r].signal == SIGKILL, statuses[r].describe());
    } else {
      CHECK_MESSAGE(!statuses[r].failed(), statuses[r].describe());
    }
  }
}

/// A tcp:// init method on 127.0.0.1 at a port free now.
inline std::string tcp_url() {
  return "tcp://127.0.0.1:" + std::to_string(launch::detail::free_port());
}

}  // namespace tandem::test
