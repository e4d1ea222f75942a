// tests/support/worker_main.hpp - for the worker programs a test starts once per rank itself
// (gloo_worker, shm_worker; the parent side is worker_processes.hpp): checks that count failures
// and say why on stderr, the rank and size from RANK and WORLD_SIZE, a main() that runs the mode
// named on its command line, and the survivors' side of a rank that kills itself mid-way.
//   int run_init(const tandem::World& world, const std::string& url) { ...; return exit_code(); }
//   int main(int argc, char** argv) {
//     return tandem::test::worker::run(argc, argv, "gloo_worker", {{"init", run_init}});
//   }
// Needs: tandem/core (World, Error). No doctest: a worker decides its own exit code.
#pragma once

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/core/world.hpp"

namespace tandem::test::worker {

inline const char* program = "worker";
inline int failures = 0;
inline int my_rank = -1;

inline void expect(bool ok, const std::string& what) {
  if (ok) return;
  ++failures;
  std::fprintf(stderr, "%s rank %d: FAILED: %s\n", program, my_rank, what.c_str());
}

/// What main returns: 0 when every check held.
inline int exit_code() {
  return failures ? 1 : 0;
}

inline bool mentions(const std::string& text, std::string_view part) {
  return text.find(part) != std::string::npos;
}

inline World world_from_env() {
  const char* rank = std::getenv("RANK");
  const char* size = std::getenv("WORLD_SIZE");
  if (!rank || !size) throw Error(program, "RANK and WORLD_SIZE must be set");
  return World::single_node(std::atoi(rank), std::atoi(size));
}

struct Mode {
  std::string_view name;
  int (*run)(const World& world, const std::string& url);
};

/// main() of a worker run as `program MODE URL`: runs the mode of that name; 2 for a bad command
/// line, 1 when something threw.
inline int run(int argc, char** argv, const char* name, std::initializer_list<Mode> modes) {
  program = name;
  if (argc != 3) {
    std::string names;
    for (const Mode& mode : modes) names += (names.empty() ? "" : "|") + std::string(mode.name);
    std::fprintf(stderr, "usage: %s %s URL\n", program, names.c_str());
    return 2;
  }
  const std::string wanted = argv[1];
  const std::string url = argv[2];
  try {
    const auto world = world_from_env();
    my_rank = world.rank;
    for (const Mode& mode : modes) {
      if (mode.name == wanted) return mode.run(world, url);
    }
    std::fprintf(stderr, "%s: unknown mode '%s'\n", program, wanted.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s rank %d: %s\n", program, my_rank, e.what());
    return 1;
  }
}

/// What a survivor saw after the last rank died.
struct DeathSeen {
  std::string error;  // empty when no call failed
  std::chrono::milliseconds waited;
};

/// Every rank all_reduces once and meets at a barrier; then the last rank kills itself (SIGKILL)
/// and the others all_reduce until a call fails (at most `tries` calls). Checks that it failed
/// naming this rank and the operation; the caller checks what the error says of the dead rank.
template <class Comm>
DeathSeen survive_last_rank_death(Comm& comm, int tries) {
  const int victim = comm.size() - 1;
  std::vector<float> data(1 << 16, 1.0f);
  comm.all_reduce(data);
  expect(data[0] == static_cast<float>(comm.size()), "the all_reduce before the death");
  comm.barrier();
  if (comm.rank() == victim) ::raise(SIGKILL);

  const auto start = std::chrono::steady_clock::now();
  DeathSeen seen;
  try {
    for (int i = 0; i < tries && seen.error.empty(); ++i) comm.all_reduce(data);
  } catch (const Error& e) {
    seen.error = e.what();
  }
  seen.waited = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start);
  std::fprintf(stderr, "%s rank %d: after %lld ms got: %s\n", program, comm.rank(),
               static_cast<long long>(seen.waited.count()), seen.error.c_str());
  expect(!seen.error.empty(), "no error after rank " + std::to_string(victim) + " died");
  expect(mentions(seen.error, "rank " + std::to_string(comm.rank()) + ":") &&
             mentions(seen.error, "all_reduce"),
         "the error names this rank and the operation: " + seen.error);
  return seen;
}

/// A failed communicator refuses later calls at once, saying why.
template <class Comm>
void expect_unusable(Comm& comm) {
  try {
    comm.barrier();
    expect(false, "a barrier on the failed communicator succeeded");
  } catch (const Error& e) {
    expect(mentions(e.what(), "barrier") && mentions(e.what(), "unusable"),
           std::string("the later call's error: ") + e.what());
  }
}

}  // namespace tandem::test::worker
