// tests/support/process_conformance.hpp - what the conformance programs of process backends
// (gloo_conformance, shm_conformance) share: the mismatched-recv case and their main().
//   TEST_CASE("...") { tandem::test::check_mismatched_recv(comm()); }
//   int main(int argc, char** argv) {
//     return tandem::test::run_process_conformance(argc, argv, "gloo_conformance", world_comm,
//                                                  [] { return tandem::init_process_group<...>();
//                                                  });
//   }
// Needs: doctest (its implementation in the including program), collective_suite.hpp's mentions.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "support/collective_suite.hpp"
#include "tandem/core/error.hpp"

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

/// main() of a program run once per rank by tandemrun: makes the job's communicator in `world`
/// (`make()`), runs the doctest cases, then a final barrier, so that no rank leaves (closing its
/// connections or segment) while others still work. Returns doctest's result, 1 on a failure
/// outside the cases.
template <class Comm, class Make>
int run_process_conformance(int argc, char** argv, const char* program, std::optional<Comm>& world,
                            Make&& make) {
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
