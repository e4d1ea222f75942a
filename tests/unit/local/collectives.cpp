// The collective conformance suite on LocalComm, world sizes 1 through 8.
#include <doctest/doctest.h>

#include <chrono>
#include <utility>

#include "support/collective_suite.hpp"
#include "tandem/comm/local.hpp"

namespace {

struct LocalRunner {
  template <class Fn>
  void operator()(int world_size, Fn&& fn) {
    tandem::run_local(world_size, [&](tandem::LocalComm& comm) { fn(comm); });
  }
  template <class Fn>
  void timed(int world_size, tandem::Timeout timeout, Fn&& fn) {
    tandem::run_local(world_size, [&](tandem::LocalComm& comm) { fn(comm); }, {.timeout = timeout});
  }
};

}  // namespace

static_assert(tandem::detects_mismatched_collectives<tandem::LocalComm>);

TEST_CASE("LocalComm: the conformance suite at world sizes 1 to 8") {
  LocalRunner run;
  for (int n = 1; n <= 8; ++n) {
    CAPTURE(n);
    tandem::test::check_conformance<tandem::LocalComm>(run, n, {}, {{0, 1, 13}});
  }
}

TEST_CASE("LocalComm: a rank that skips a collective makes the others time out, naming it") {
  LocalRunner run;
  for (int n : {2, 5}) {
    CAPTURE(n);
    tandem::test::check_timeout(run, n);
  }
}

TEST_CASE("LocalComm: a rank that throws wakes the others and run_local rethrows its error") {
  LocalRunner run;
  for (int n : {2, 4}) {
    CAPTURE(n);
    tandem::test::check_abort(run, n);
  }
}
