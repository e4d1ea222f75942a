// The simulated NCCL adds no ordering between stream work and the host beyond CUDA's: a host read
// of a collective's result made without synchronising with its stream is a data race that
// ThreadSanitizer reports, even after further NCCL calls on the communicator (an all-reduce, its
// state, its size) that a real GPU would not synchronise either; after cudaStreamSynchronize it
// is none.
//   cuda_sim_nccl_race_demo read-after-more-calls     # ThreadSanitizer: data race
//   cuda_sim_nccl_race_demo read-after-synchronize    # clean
// Two ranks (threads). The host learns that the stream work has run through a relaxed atomic,
// which orders nothing. Without ThreadSanitizer the racy case says "race_demo skipped".
#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "support.hpp"

using namespace simtest;

namespace {

std::atomic<bool> ran[2] = {false, false};  // relaxed only: the work ran; orders nothing

void CUDART_CB mark_ran(void* flag) {
  static_cast<std::atomic<bool>*>(flag)->store(true, std::memory_order_relaxed);
}

float rank_view(bool synchronize) {
  float seen[2] = {0, 0};
  with_communicator(2, [&](ncclComm_t comm, cudaStream_t stream, int rank) {
    Buffer result(4), other(4);
    const float mine = static_cast<float>(rank + 1);
    result.upload(&mine, 4, stream);
    other.upload(&mine, 4, stream);
    SIM_NCCL(ncclAllReduce(result.get(), result.get(), 1, ncclFloat32, ncclSum, comm, stream));
    SIM_CUDA(cudaLaunchHostFunc(stream, mark_ran, &ran[rank]));
    while (!ran[rank].load(std::memory_order_relaxed)) std::this_thread::yield();
    // More calls on the communicator: none of them synchronises the host with the stream.
    SIM_NCCL(ncclAllReduce(other.get(), other.get(), 1, ncclFloat32, ncclSum, comm, stream));
    ncclResult_t state = ncclSuccess;
    int count = 0;
    SIM_NCCL(ncclCommGetAsyncError(comm, &state));
    SIM_NCCL(ncclCommCount(comm, &count));
    if (synchronize) SIM_CUDA(cudaStreamSynchronize(stream));
    std::memcpy(&seen[rank], result.get(), 4);  // device memory is host memory here
    SIM_CUDA(cudaStreamSynchronize(stream));
  });
  return seen[0] + seen[1];
}

}  // namespace

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "";
  try {
    if (which == "read-after-more-calls") {
#if !defined(__SANITIZE_THREAD__)
      std::puts("race_demo skipped: built without ThreadSanitizer, which is what reports it");
      return 0;
#else
      (void)rank_view(false);
      return 0;
#endif
    }
    if (which == "read-after-synchronize") {
      const float sum = rank_view(true);
      expect(sum == 6.0f, "both ranks read the all-reduce's 3 after synchronising");
      std::puts("read after synchronising: no race, the result is there");
      return 0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "usage: %s read-after-more-calls|read-after-synchronize\n", argv[0]);
  return 2;
}
