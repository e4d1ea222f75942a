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

TEST_CASE("an Error wrapping another Error's message says \"tandem: \" once") {
  const tandem::Error inner("safetensors ckpt.safetensors", "the header is not valid JSON");
  const tandem::Error outer(0, "load_checkpoint ckpt.safetensors", inner.what());
  CHECK(std::string(outer.what()) ==
        "tandem: rank 0: load_checkpoint ckpt.safetensors: safetensors ckpt.safetensors: the "
        "header is not valid JSON");
  CHECK(outer.cause() == "safetensors ckpt.safetensors: the header is not valid JSON");
  // Twice wrapped, still once; a cause that merely mentions tandem later is left alone.
  const tandem::Error twice(1, "spawn", outer.what());
  CHECK(std::string(twice.what()) ==
        "tandem: rank 1: spawn: rank 0: load_checkpoint ckpt.safetensors: safetensors "
        "ckpt.safetensors: the header is not valid JSON");
  const tandem::Error mention("init", "the store says tandem: busy");
  CHECK(std::string(mention.what()) == "tandem: init: the store says tandem: busy");
}
