// Helpers of the launcher tests: a temporary directory, running a program with its output in
// files, and waiting (boundedly) for a file to appear.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "support/temp_dir.hpp"

namespace tandem::test {

inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

/// "KEY=value" lines as a map.
inline std::map<std::string, std::string> read_key_values(const std::string& path) {
  std::map<std::string, std::string> values;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) values[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return values;
}

/// Starts `args` with stdout and stderr going to the given files.
inline pid_t start(const std::vector<std::string>& args, const std::string& out,
                   const std::string& err) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<char*> argv;
  std::vector<std::string> copies = args;
  for (auto& arg : copies) argv.push_back(arg.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), ::environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw std::runtime_error("posix_spawn failed for " + args.front());
  return pid;
}

/// The wait status of `pid`, or throws after `limit` (killing it): a test must not hang.
inline int wait_for(pid_t pid, std::chrono::seconds limit = std::chrono::seconds(45)) {
  const auto until = std::chrono::steady_clock::now() + limit;
  for (;;) {
    int status = 0;
    const pid_t got = ::waitpid(pid, &status, WNOHANG);
    if (got == pid) return status;
    if (got < 0) throw std::runtime_error("waitpid failed");
    if (std::chrono::steady_clock::now() > until) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      throw std::runtime_error("the process did not end in time");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

struct Result {
  int exit_code = -1;  ///< -1 when killed by a signal
  std::string out;
  std::string err;
};

/// Runs `args` to the end and returns its exit code and output.
inline Result run(const std::vector<std::string>& args) {
  TempDir dir;
  const pid_t pid = start(args, dir / "out", dir / "err");
  const int status = wait_for(pid);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_file(dir / "out"),
          read_file(dir / "err")};
}

/// Waits (at most `limit`) for a file to exist.
inline bool wait_for_file(const std::string& path,
                          std::chrono::seconds limit = std::chrono::seconds(30)) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!std::filesystem::exists(path)) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

}  // namespace tandem::test
