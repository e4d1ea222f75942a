// tandem::device_index_for: the arithmetic behind tandem::cuda::select_device, for every way GPUs
// are handed to processes (all visible, one per process via tandemrun --devices, shared).
#include <doctest/doctest.h>

#include <string>

#include "tandem/core/device_index.hpp"
#include "tandem/core/error.hpp"

TEST_CASE("every GPU visible: local rank i uses GPU i") {
  for (int local_rank = 0; local_rank < 8; ++local_rank) {
    CHECK(tandem::device_index_for(local_rank, 8) == local_rank);
  }
}

TEST_CASE("one GPU visible per process (tandemrun --devices): always index 0") {
  for (int local_rank = 0; local_rank < 8; ++local_rank) {
    CHECK(tandem::device_index_for(local_rank, 1) == 0);
  }
}

TEST_CASE("more processes than GPUs share them round robin") {
  CHECK(tandem::device_index_for(0, 2) == 0);
  CHECK(tandem::device_index_for(1, 2) == 1);
  CHECK(tandem::device_index_for(2, 2) == 0);
  CHECK(tandem::device_index_for(3, 2) == 1);
  CHECK(tandem::device_index_for(7, 3) == 1);
}

TEST_CASE("no visible GPU or a negative local rank is an Error naming the rank") {
  try {
    (void)tandem::device_index_for(2, 0, 5);
    FAIL("no error without a device");
  } catch (const tandem::Error& error) {
    CHECK(error.rank() == 5);
    CHECK(error.operation() == "select_device");
    CHECK(std::string(error.what()).find("no CUDA device is visible") != std::string::npos);
  }
  CHECK_THROWS_AS((void)tandem::device_index_for(0, -1), tandem::Error);
  CHECK_THROWS_WITH_AS((void)tandem::device_index_for(-1, 4),
                       "tandem: select_device: local rank -1 is negative", tandem::Error);
}
