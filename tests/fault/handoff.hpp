// tests/fault/handoff.hpp - how a fault-injection worker (fault_worker, tests/elastic's
// elastic_worker) and its driver hand off: files the worker writes whole into the trial's
// directory (a temporary and a rename, so the driver never reads half of one), the monotonic
// clock both read, waiting for a file or for the driver's signal, and what a victim rank that is
// a thread does instead of dying (VictimExit, LocalStop).
//   tandem::test::fault::publish("fault_worker", dir, "rank1.at", "before 3 grad 123\n");
//   if (!tandem::test::fault::await_file(dir, "rank0.pid", std::chrono::seconds(300))) ...
// Needs: POSIX (clock_gettime, access, getpid) and the standard library.
#pragma once

#include <time.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>

namespace tandem::test::fault {

/// CLOCK_MONOTONIC in nanoseconds: the clock the drivers compare the workers' times on.
inline std::int64_t monotonic_ns() {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<std::int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
}

/// Writes `text` to dir/name through a temporary file (named after the process and the file, so
/// that threads of one process never share one) and a rename; says so on stderr, naming
/// `program`, when it cannot.
inline void publish(const char* program, const std::string& dir, const std::string& name,
                    const std::string& text) {
  const std::string path = dir + "/" + name;
  const std::string temporary = path + ".tmp" + std::to_string(::getpid()) + "." + name;
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << text;
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    std::fprintf(stderr, "%s: cannot write %s\n", program, path.c_str());
  }
}

/// Waits for dir/name to exist (a file another process writes), polling; false when it has not
/// after `limit` (a hang elsewhere: the caller goes on, and the trial fails where it should).
inline bool await_file(const std::string& dir, const std::string& name,
                       std::chrono::seconds limit) {
  const std::string path = dir + "/" + name;
  const auto until = std::chrono::steady_clock::now() + limit;
  while (::access(path.c_str(), F_OK) != 0) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

/// A victim process waits here for the driver's signal (SIGKILL or SIGSTOP); one that has not
/// come after a minute is a driver bug: exit 3, naming `program` and the rank.
[[noreturn]] inline void await_signal(const char* program, int rank) {
  for (int i = 0; i < 6000; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::fprintf(stderr, "%s: rank %d: the driver never sent its signal\n", program, rank);
  std::_Exit(3);
}

/// Thrown by a victim that is a thread and "exits": it leaves its rank function at once.
struct VictimExit {};

/// The process-wide hand-off between a victim thread that "stops" and the survivors it outlives:
/// it blocks until `ended` (survivors done) reaches the count it waits for.
struct LocalStop {
  std::mutex mutex;
  std::condition_variable changed;
  int ended = 0;
};

/// What a victim does once it has reached its point and announced it. A process: at `inside` it
/// returns (the collective follows, and the driver's signal comes during it), elsewhere it waits
/// for the signal. A thread (`local` its process's hand-off; null for a process) that "exits"
/// (stop false) throws VictimExit at once; one that "stops" blocks until `survivors` others have
/// ended (at most `limit`: a hang elsewhere), then throws it.
inline void act_as_victim(const char* program, int rank, bool inside, bool stop, LocalStop* local,
                          int survivors, std::chrono::seconds limit) {
  if (local == nullptr) {
    if (!inside) await_signal(program, rank);
    return;
  }
  if (stop) {
    std::unique_lock lock(local->mutex);
    local->changed.wait_for(lock, limit, [&] { return local->ended >= survivors; });
  }
  throw VictimExit{};
}

}  // namespace tandem::test::fault
