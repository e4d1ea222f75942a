// Helpers shared by the store tests: a temporary directory, one fixture per store type whose
// make() returns a fresh handle on one shared store (a copy, a second FileStore on the same file,
// a second TcpStore client of the same server), and forked children that share a store.
#pragma once

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "tandem/rendezvous/file_store.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/rendezvous/tcp_store.hpp"

#include "support/temp_dir.hpp"

namespace tandem::test {

using namespace std::chrono_literals;

/// What a call that should succeed may take on a loaded machine.
inline constexpr Timeout generous = std::chrono::seconds(60);

struct HashFixture {
  HashStore base{generous};
  HashStore make() { return base; }
};

struct FileFixture {
  TempDir dir;
  std::filesystem::path file = dir.path() / "store";
  FileStore base{file, {.timeout = generous}};
  FileStore make() { return FileStore(file, {.timeout = generous}); }
};

struct TcpFixture {
  TcpStore base{{.port = 0, .is_server = true, .timeout = generous}};
  TcpStore make() { return TcpStore({.port = base.port(), .timeout = generous}); }
};

template <class Fixture>
struct PrefixOf {
  Fixture inner;
  auto make() { return PrefixStore("job", inner.make()); }
};

template <class Fixture>
struct AnyOf {
  Fixture inner;
  AnyStore make() { return AnyStore(inner.make()); }
};

/// Forks `count` children; child i runs child(i) and exits with what it returns (an exception:
/// 99), never coming back into the test (no doctest there: the exit status is the report).
/// Returns their pids (-1 where fork failed) for wait_children.
template <class Child>
std::vector<pid_t> fork_children(int count, Child child) {
  std::vector<pid_t> pids;
  for (int i = 0; i < count; ++i) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int status = 99;
      try {
        status = child(i);
      } catch (...) {
      }
      ::_exit(status);
    }
    pids.push_back(pid);
  }
  return pids;
}

/// Waits for each child; its exit code (128 + signal when killed; -1 when it never started).
inline std::vector<int> wait_children(const std::vector<pid_t>& pids) {
  std::vector<int> codes;
  for (const pid_t pid : pids) {
    int status = 0;
    if (pid < 0 || ::waitpid(pid, &status, 0) != pid) {
      codes.push_back(-1);
    } else {
      codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
    }
  }
  return codes;
}

}  // namespace tandem::test
