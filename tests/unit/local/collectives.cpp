// The collective conformance suite on LocalComm, world sizes 1 through 8.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <utility>
#include <vector>

#include "support/collective_suite.hpp"
#include "support/runners.hpp"
#include "tandem/comm/local/local.hpp"

using tandem::test::LocalRunner;

static_assert(tandem::can_check_collectives<tandem::LocalComm>);

TEST_CASE("LocalComm: the suite's runner gives each of n ranks one communicator of size n") {
  // The suite's assertions run inside the ranks; this checks the premise they rest on.
  LocalRunner run;
  for (int n : {1, 3, 8}) {
    std::vector<std::atomic<int>> seen(static_cast<std::size_t>(n));
    std::atomic<int> wrong_size{0};
    run(n, [&](tandem::LocalComm& comm) {
      if (comm.size() != n) ++wrong_size;
      ++seen[static_cast<std::size_t>(comm.rank())];
    });
    CHECK(wrong_size == 0);
    for (auto& count : seen) CHECK(count == 1);
  }
}

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
