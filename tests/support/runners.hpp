// tests/support/runners.hpp - the Runners the suites take: run(n, fn) calls fn(comm) on every
// rank of a group of n ranks and returns when all have ended.
//   tandem::test::LocalRunner run;  tandem::test::check_conformance<tandem::LocalComm>(run, 4, m);
// LocalRunner: n threads of this process on LocalComm. GlooThreadRunner (where TANDEM_TEST_GLOO
// is defined): n threads, each with its own GlooComm, meeting in a HashStore. ProcessRunner: this
// process is one rank of a group that exists already. SplitRunner: this process is one rank of a
// job, and run(n, fn) splits ranks 0 .. n-1 off it. Needs: doctest, tandem/comm/local (and
// tandem/comm/gloo with TANDEM_TEST_GLOO).
#pragma once

#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <thread>
#include <vector>

#include "tandem/comm/local/local.hpp"
#if defined(TANDEM_TEST_GLOO)
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/store.hpp"
#endif

namespace tandem::test {

/// n threads of this process, each with a LocalComm of the group. A hang fails in a minute.
struct LocalRunner {
  tandem::LocalCommOptions options{.timeout = std::chrono::seconds(60)};

  template <class Fn>
  void operator()(int n, Fn&& fn) {
    tandem::run_local(
        n, [&](tandem::LocalComm& comm) { fn(comm); }, options);
  }
  /// The same with another timeout (the suites' timeout checks).
  template <class Fn>
  void timed(int n, tandem::Timeout timeout, Fn&& fn) {
    tandem::LocalCommOptions timed_options = options;
    timed_options.timeout = timeout;
    tandem::run_local(
        n, [&](tandem::LocalComm& comm) { fn(comm); }, timed_options);
  }
};

/// This process is one rank of `comm`, made before the tests run (by tandemrun, mpirun or a
/// parent test): run(n, fn) checks that n is the group's size and calls fn on this rank.
template <class Comm>
struct ProcessRunner {
  Comm* comm;

  template <class Fn>
  void operator()(int world_size, Fn&& fn) {
    REQUIRE(world_size == comm->size());
    fn(*comm);
  }
};

/// This process is one rank of `job` (a job tandemrun or mpirun started): run(n, fn) calls fn on
/// a group of the job's ranks 0 .. n-1 split off it, while the other ranks go on to the job's
/// barrier. A rank that throws ends its process (the launcher then ends the job) instead of
/// leaving the others inside a collective.
template <class Comm>
struct SplitRunner {
  Comm* job;

  template <class Fn>
  void operator()(int n, Fn&& fn) {
    const int me = job->rank();
    try {
      auto group = job->split(me < n ? 0 : tandem::no_color, me);
      if (group) fn(*group);
      job->barrier();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s; exiting\n", me, e.what());
      std::fflush(stderr);
      std::_Exit(1);
    }
  }
};

#if defined(TANDEM_TEST_GLOO)
/// Each rank a thread of this process with its own GlooComm, meeting the others in a HashStore.
struct GlooThreadRunner {
  template <class Fn>
  void operator()(int n, Fn&& fn) {
    tandem::HashStore store(std::chrono::seconds(30));  // a fresh store per group: no stale keys
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
    {
      std::vector<std::jthread> ranks;
      for (int r = 0; r < n; ++r) {
        ranks.emplace_back([&, r] {
          try {
            tandem::AnyStore any(store);
            tandem::GlooCommOptions options;
            options.timeout = std::chrono::seconds(30);
            auto comm =
                tandem::GlooComm::rendezvous(tandem::World::single_node(r, n), any, options);
            fn(comm);
          } catch (...) {
            errors[static_cast<std::size_t>(r)] = std::current_exception();
          }
        });
      }
    }
    for (auto& error : errors) {
      if (error) std::rethrow_exception(error);
    }
  }
};
#endif

}  // namespace tandem::test
