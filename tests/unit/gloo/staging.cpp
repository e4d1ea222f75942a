// GlooComm with device tensors (a fake device space, so no GPU is needed), one process per rank
// started by tandemrun: staged through pinned memory in sync and `_async` forms; see
// support/staging_checks.hpp.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>

#include "support/staging_checks.hpp"
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"

namespace {
std::optional<tandem::GlooComm> world_comm;  // made in main, before the tests run
}  // namespace

TEST_CASE("GlooComm stages device tensors through pinned memory") {
  REQUIRE(world_comm.has_value());
  const std::string failures = tandem::test::check_device_staging(*world_comm);
  CHECK_MESSAGE(failures.empty(), failures);
}

int main(int argc, char** argv) {
  using namespace std::chrono_literals;
  doctest::Context context(argc, argv);
  try {
    world_comm.emplace(tandem::init_process_group<tandem::GlooComm>("env://", {.timeout = 60s}));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gloo_staging: %s\n", e.what());
    return 1;
  }
  int result = context.run();
  try {
    world_comm->barrier();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gloo_staging: final barrier: %s\n", e.what());
    result = result ? result : 1;
  }
  world_comm.reset();
  return result;
}
