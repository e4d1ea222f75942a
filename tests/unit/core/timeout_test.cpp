#include <doctest/doctest.h>

#include <chrono>
#include <thread>

#include "tandem/core/timeout.hpp"

using namespace std::chrono_literals;

TEST_CASE("describe prints a timeout in the unit a person expects") {
  CHECK(tandem::describe(250ms) == "250 ms");
  CHECK(tandem::describe(1500ms) == "1500 ms");
  CHECK(tandem::describe(30s) == "30 s");
  CHECK(tandem::describe(30min) == "30 min");
  CHECK(tandem::describe(90s) == "90 s");
  CHECK(tandem::describe(tandem::default_timeout) == "30 min");
}

TEST_CASE("a Deadline expires after its timeout and not before") {
  const tandem::Deadline deadline(50ms);
  CHECK(deadline.timeout() == 50ms);
  CHECK(deadline.remaining() <= 50ms);
  std::this_thread::sleep_until(deadline.at() + 1ms);
  CHECK(deadline.expired());
  CHECK(deadline.remaining() == tandem::Timeout::zero());
}

TEST_CASE("a Deadline of Timeout::max() never expires and does not overflow") {
  const tandem::Deadline forever(tandem::Timeout::max());
  CHECK_FALSE(forever.expired());
  CHECK(forever.at() > std::chrono::steady_clock::now() + std::chrono::hours(24 * 365));
}
