// tests/support/child_process.hpp - for tests whose executable is also the worker it starts: the
// path of this executable, and running a command with extra environment variables under a time
// limit (its whole process group is killed when the limit passes).
//   CHECK(tandem::test::run_process({TANDEMRUN, "--nproc-per-node", "2", self_path(), "worker"},
//                                   {}, std::chrono::seconds(120)) == 0);
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace tandem::test {

inline std::string self_path() {
  char path[4096] = {};
  const ssize_t length = ::readlink("/proc/self/exe", path, sizeof path - 1);
  return length > 0 ? std::string(path, static_cast<std::size_t>(length)) : std::string();
}

/// Starts argv (argv[0] a path) with `env` added, in a process group of its own, and returns its
/// pid without waiting (for a test that signals it; run_process waits).
inline pid_t start_process(const std::vector<std::string>& argv,
                           const std::vector<std::pair<std::string, std::string>>& env) {
  const pid_t child = ::fork();
  if (child == 0) {
    ::setpgid(0, 0);
    for (const auto& [name, value] : env) ::setenv(name.c_str(), value.c_str(), 1);
    std::vector<char*> args;
    for (const auto& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::_Exit(127);
  }
  return child;
}

/// Runs argv (argv[0] a path) with `env` added; its exit code (128 + signal when killed), or -1
/// once `limit` has passed.
inline int run_process(const std::vector<std::string>& argv,
                       const std::vector<std::pair<std::string, std::string>>& env,
                       std::chrono::seconds limit) {
  const pid_t child = start_process(argv, env);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    int status = 0;
    if (::waitpid(child, &status, WNOHANG) == child) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(-child, SIGKILL);
      ::waitpid(child, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace tandem::test
