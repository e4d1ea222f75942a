// tandem::SyncBatchNorm on GlooComm, one process per rank (started by tandemrun with 3 ranks):
// PyTorch's golden numbers for 3 ranks (batches 4, 0, 2) on the whole world and for 2 ranks
// (batches 3 and 1; 0 and 5) on the subgroup {0, 1}; and the same with the module's tensors in
// fake device memory (fake_device_space.hpp), which GlooComm stages through pinned memory as it
// does real device tensors. Tolerances: see syncbn_golden.hpp.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <optional>

#include "support/fake_device_space.hpp"  // first: it specialises templates the headers below use

#include "syncbn_golden.hpp"
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"

namespace {

using namespace std::chrono_literals;

std::optional<tandem::GlooComm> world_comm;  // made in main, before the tests run

}  // namespace

TEST_CASE_TEMPLATE("GlooComm: SyncBatchNorm matches PyTorch on 3 ranks and on a 2-rank subgroup", T,
                   float, double) {
  REQUIRE(world_comm.has_value());
  REQUIRE(world_comm->size() == 3);
  tandem::test::Failures failures;
  tandem::test::syncbn::check_golden_rank<T>(*world_comm, "r3", failures);
  auto pair = tandem::new_group(*world_comm, {0, 1});
  if (pair) {
    tandem::test::syncbn::check_golden_rank<T>(*pair, "r2", failures);
    tandem::test::syncbn::check_golden_rank<T>(*pair, "r2empty", failures);
  }
  failures.report();
}

TEST_CASE("GlooComm: SyncBatchNorm on device tensors (staged) matches PyTorch") {
  REQUIRE(world_comm.has_value());
  REQUIRE(world_comm->size() == 3);
  using tandem::test::fake_device;
  using tandem::test::fake_device_exec;
  tandem::test::Failures failures;
  tandem::test::syncbn::check_golden_rank<float, fake_device>(*world_comm, "r3", failures,
                                                              fake_device_exec{});
  auto pair = tandem::new_group(*world_comm, {0, 1});
  if (pair) {
    tandem::test::syncbn::check_golden_rank<float, fake_device>(*pair, "r2empty", failures,
                                                                fake_device_exec{});
  }
  failures.report();
  CHECK(tandem::test::staging_counters.pinned_live.load() == 0);
}

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  try {
    world_comm.emplace(tandem::init_process_group<tandem::GlooComm>("env://", {.timeout = 60s}));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gloo_sync_batch_norm: %s\n", e.what());
    return 1;
  }
  int result = context.run();
  try {
    world_comm->barrier();  // nobody leaves (closing its connections) while others still work
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gloo_sync_batch_norm: final barrier: %s\n", e.what());
    result = result ? result : 1;
  }
  world_comm.reset();
  return result;
}
