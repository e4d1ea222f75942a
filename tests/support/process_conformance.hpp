// tests/support/process_conformance.hpp - what the conformance programs of process backends
// (gloo_conformance, shm_conformance) share: a new group of the job's ranks, the mismatched-recv,
// skipped-collective and bad TANDEM_CHECK_COLLECTIVES cases, and their main(), which makes the
// job's communicator (job<Comm>()) before the cases run.
//   TEST_CASE("...") { tandem::test::check_mismatched_recv(tandem::test::job<GlooComm>()); }
//   int main(int argc, char** argv) {
//     return tandem::test::run_process_conformance(argc, argv, "gloo_conformance", [] {
//       return tandem::init_process_group<GlooComm>("env://");
//     });
//   }
// Needs: doctest (its implementation in the including program), collective_suite.hpp's mentions.
#pragma once

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "support/collective_suite.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/world.hpp"

namespace tandem::test {

/// Each rank sends 5 floats to the next and receives into 4: an Error naming this rank, recv,
/// the sender and both sizes. Then the pair still carries a message of another type.
template <class Comm>
void check_mismatched_recv(Comm& c) {
  const int me = c.rank();
  const int n = c.size();
  const int next = (me + 1) % n;
  const int prev = (me + n - 1) % n;
  std::vector<float> five(5, 1.0f);
  c.send(five, next, 7);
  std::vector<float> four(4);
  try {
    c.recv(four, prev, 7);
    FAIL("a recv of 4 elements accepted a message of 5");
  } catch (const tandem::Error& e) {
    CHECK(mentions(e.what(), "rank " + std::to_string(me) + ":", "recv",
                   "rank " + std::to_string(prev), "5 float32", "4 float32"));
  }
  std::vector<std::int32_t> ints(3, me);
  c.send(ints, next, 8);
  std::vector<std::int32_t> got(3, -1);
  c.recv(got, prev, 8);
  CHECK(got == std::vector<std::int32_t>(3, prev));
  c.barrier();
}

/// A new group of `world`'s ranks, met in its store, with `options`.
template <class Comm>
Comm regroup(Comm& world, const typename Comm::options_type& options) {
  auto store = world.store();
  return Comm::rendezvous(World::single_node(world.rank(), world.size()), store, options);
}

/// What a backend's error says when a rank skips a collective.
struct SkippedCollective {
  /// Besides its own timeout, what a rank may report instead (when another gave up first).
  const char* other_cause;
  /// Whether the error names the rank that skipped.
  bool names_skipper;
  std::chrono::seconds within;
};

/// Rank size/2 skips an all_reduce in `quick`, a group of `world`'s ranks with a 1 s timeout: each
/// other rank raises an Error naming itself and the operation, within `expected.within`, and the
/// group refuses later calls at once.
template <class Comm>
void check_skipped_collective(Comm& world, Comm& quick, const SkippedCollective& expected) {
  const int me = world.rank();
  const int skipper = world.size() / 2;
  if (me != skipper) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<float> data(16);
    try {
      quick.all_reduce(data);
      FAIL("rank " << me << " completed an all_reduce that rank " << skipper << " skipped");
    } catch (const Error& e) {
      const std::string text = e.what();
      CHECK_MESSAGE(mentions(text, "rank " + std::to_string(me) + ":", "all_reduce"), text);
      if (expected.names_skipper) {
        CHECK_MESSAGE(mentions(text, "rank " + std::to_string(skipper)), text);
      }
      CHECK_MESSAGE((mentions(text, "timed out after 1 s") || mentions(text, expected.other_cause)),
                    text);
    }
    CHECK(std::chrono::steady_clock::now() - start < expected.within);
    try {
      quick.barrier();
      FAIL("a failed communicator ran a barrier");
    } catch (const Error& e) {
      CHECK_MESSAGE(mentions(e.what(), "barrier", "unusable"), e.what());
    }
  }
  world.barrier();  // the skipper stays (its group open) until the others have given up
}

/// One rank sets TANDEM_CHECK_COLLECTIVES=yes: a new group with `options` fails on every rank,
/// that one naming the bad value, the others naming that rank.
template <class Comm>
void check_bad_check_variable(Comm& world, const typename Comm::options_type& options) {
  const int me = world.rank();
  const int odd = world.size() - 1;
  if (me == odd) ::setenv("TANDEM_CHECK_COLLECTIVES", "yes", 1);
  try {
    (void)regroup(world, options);
    FAIL("a group was made with TANDEM_CHECK_COLLECTIVES=yes on rank " << odd);
  } catch (const Error& e) {
    if (me == odd) {
      CHECK_MESSAGE(mentions(e.what(), "TANDEM_CHECK_COLLECTIVES='yes'"), e.what());
    } else {
      CHECK_MESSAGE(
          mentions(e.what(), "rank " + std::to_string(me) + ":",
                   "rank " + std::to_string(odd) + " could not read", "TANDEM_CHECK_COLLECTIVES"),
          e.what());
    }
  }
  if (me == odd) ::unsetenv("TANDEM_CHECK_COLLECTIVES");
  world.barrier();
}

/// The job's communicator, made by run_process_conformance before the cases run.
template <class Comm>
inline std::optional<Comm> job_comm;

template <class Comm>
Comm& job() {
  REQUIRE(job_comm<Comm>.has_value());
  return *job_comm<Comm>;
}

/// main() of a program run once per rank by tandemrun: makes the job's communicator (`make()`,
/// then job<Comm>()), runs the doctest cases, then a final barrier, so that no rank leaves
/// (closing its connections or segment) while others still work. Returns doctest's result, 1 on
/// a failure outside the cases.
template <class Make>
int run_process_conformance(int argc, char** argv, const char* program, Make&& make) {
  using Comm = std::invoke_result_t<Make&>;
  auto& world = job_comm<Comm>;
  doctest::Context context(argc, argv);
  try {
    world.emplace(make());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return 1;
  }
  int result = context.run();
  try {
    world->barrier();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: final barrier: %s\n", program, e.what());
    result = result ? result : 1;
  }
  world.reset();
  return result;
}

}  // namespace tandem::test
