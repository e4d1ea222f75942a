// Code compiled for the per-thread default stream (nvcc --default-stream per-thread, or this
// macro): cuda_runtime.h renames the stream calls to their _ptsz/_ptds forms, which the simulator
// provides and which read stream 0 as the calling thread's per-thread default stream.
#define CUDA_API_PER_THREAD_DEFAULT_STREAM 1

#include <vector>

#include "sim_test.hpp"

TEST_CASE("per-thread default stream builds: stream 0 is the thread's per-thread stream") {
  unsigned long long zero = 0, per_thread = 0, legacy = 0;
  SIM_REQUIRE(cudaStreamGetId(nullptr, &zero));  // cudaStreamGetId_ptsz
  SIM_REQUIRE(cudaStreamGetId(cudaStreamPerThread, &per_thread));
  SIM_REQUIRE(cudaStreamGetId(cudaStreamLegacy, &legacy));
  CHECK(zero == per_thread);
  CHECK(zero != legacy);

  // (sim_test::Gate's inline functions are compiled without the macro elsewhere: not used here.)
  std::atomic<bool> open{false}, ran{false};
  auto hold = [&] { (void)sim_test::eventually([&] { return open.load(); }); };
  auto work = [&] { ran.store(true); };
  sim_test::launch(cudaStreamPerThread, hold);
  sim_test::launch(nullptr, work);  // cudaLaunchHostFunc_ptsz on stream 0: behind `hold`
  CHECK(cudaStreamQuery(nullptr) == cudaErrorNotReady);
  CHECK_FALSE(ran.load());
  open.store(true);
  SIM_REQUIRE(cudaStreamSynchronize(nullptr));
  CHECK(ran.load());

  int* device = nullptr;
  SIM_REQUIRE(cudaMallocAsync(reinterpret_cast<void**>(&device), 16 * sizeof(int), nullptr));
  SIM_REQUIRE(cudaMemsetAsync(device, 0, 16 * sizeof(int), nullptr));
  const std::vector<int> values(16, 11);
  SIM_REQUIRE(cudaMemcpy(device, values.data(), 16 * sizeof(int), cudaMemcpyHostToDevice));
  std::vector<int> back(16);
  SIM_REQUIRE(
      cudaMemcpyAsync(back.data(), device, 16 * sizeof(int), cudaMemcpyDeviceToHost, nullptr));
  CHECK(back == values);
  cudaEvent_t event = nullptr;
  SIM_REQUIRE(cudaEventCreate(&event));
  SIM_REQUIRE(cudaEventRecord(event, nullptr));
  SIM_REQUIRE(cudaStreamWaitEvent(nullptr, event, 0));
  SIM_REQUIRE(cudaFreeAsync(device, nullptr));
  SIM_REQUIRE(cudaEventSynchronize(event));
  SIM_REQUIRE(cudaEventDestroy(event));
  SIM_REQUIRE(cudaStreamSynchronize(nullptr));
}
