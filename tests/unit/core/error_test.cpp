#include <doctest/doctest.h>

#include <string>

#include "tandem/core/error.hpp"

TEST_CASE("Error names the rank, the operation and the cause") {
  const tandem::Error error(3, "all_reduce", "rank 1 did not arrive within 30 s");
  CHECK(std::string(error.what()) ==
        "tandem: rank 3: all_reduce: rank 1 did not arrive within 30 s");
  CHECK(error.rank() == 3);
  CHECK(error.operation() == "all_reduce");
  CHECK(error.cause() == "rank 1 did not arrive within 30 s");
}

TEST_CASE("Error without a rank leaves the rank out of the message") {
  const tandem::Error error("environment", "RANK='x' is not an integer");
  CHECK(std::string(error.what()) == "tandem: environment: RANK='x' is not an integer");
  CHECK(error.rank() == tandem::unknown_rank);
}

TEST_CASE("Error is caught as std::runtime_error") {
  CHECK_THROWS_AS(throw tandem::Error(0, "barrier", "timed out"), std::runtime_error);
}
