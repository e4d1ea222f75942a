// tests/unit/io/misuse_support.hpp - what the checkpoint misuse tests share: each rank's Error
// text from a LocalComm job, a child process (for a job of its own, a resource limit or a mount
// namespace), a small tmpfs of the child's own (a full disk, a read-only one) where the machine
// lets a process make one, and a file's text.
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tandem/comm/local/local.hpp"
#include "tandem/core/error.hpp"

namespace tandem::test::misuse {

/// Runs fn(comm) on n LocalComm ranks; each rank's tandem::Error text ("" where none was thrown).
template <class F>
std::vector<std::string> errors_of_ranks(int n, F&& fn) {
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  tandem::run_local(
      n,
      [&](tandem::LocalComm& comm) {
        try {
          fn(comm);
        } catch (const tandem::Error& error) {
          errors[static_cast<std::size_t>(comm.rank())] = error.what();
        }
      },
      tandem::LocalCommOptions{std::chrono::seconds(60)});
  return errors;
}

/// Runs fn() (returning an exit code) in a child process; its exit code, 128 + signal if killed.
template <class F>
int in_child(F&& fn) {
  std::fflush(nullptr);
  const pid_t child = ::fork();
  if (child == 0) {
    int code = 1;
    try {
      code = fn();
    } catch (const std::exception& error) {
      std::fprintf(stderr, "child: %s\n", error.what());
    }
    std::fflush(nullptr);
    std::_Exit(code);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

inline bool write_text(const char* path, const std::string& text) {
  const int fd = ::open(path, O_WRONLY);
  if (fd < 0) return false;
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  return ok;
}

/// In a child process: a mount namespace of its own (a user namespace first where this process
/// may not make one alone), so that a tmpfs mounted there is the child's only. False where the
/// machine refuses both.
inline bool private_mounts() {
  if (::unshare(CLONE_NEWNS) != 0) {
    const auto uid = ::getuid();
    const auto gid = ::getgid();
    if (::unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) return false;
    write_text("/proc/self/setgroups", "deny");
    if (!write_text("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1") ||
        !write_text("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1")) {
      return false;
    }
  }
  return ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0;
}

/// In a child with private_mounts(): a tmpfs of `options` ("size=64k") at `directory`.
inline bool mount_tmpfs(const std::filesystem::path& directory, const char* options,
                        unsigned long flags = 0) {
  std::filesystem::create_directories(directory);
  return ::mount("tmpfs", directory.c_str(), "tmpfs", flags, options) == 0;
}

/// The exit code of a child that could not set up what its test needs.
inline constexpr int cannot_set_up = 77;

inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

inline void write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace tandem::test::misuse
