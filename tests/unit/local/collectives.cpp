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

TEST_CASE("LocalComm: every collective, element type and op at world sizes 1 to 8") {
  LocalRunner run;
  for (int n = 1; n <= 8; ++n) {
    CAPTURE(n);
    tandem::test::check_all_collectives(run, n);
  }
}

TEST_CASE("LocalComm: collectives on subgroups made by split and new_group") {
  LocalRunner run;
  for (int n : {1, 2, 3, 5, 8}) {
    CAPTURE(n);
    tandem::test::check_subgroups(run, n);
  }
}

TEST_CASE("LocalComm: size mismatches and avg on integers are errors before anything is sent") {
  LocalRunner run;
  for (int n : {1, 3}) {
    CAPTURE(n);
    tandem::test::check_local_errors(run, n);
  }
}

TEST_CASE("LocalComm: ranks that disagree on a collective all raise an error naming them") {
  LocalRunner run;
  for (int n : {2, 4}) {
    CAPTURE(n);
    tandem::test::check_mismatch_errors(run, n);
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
