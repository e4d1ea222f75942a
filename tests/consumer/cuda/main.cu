// Compiles tandem's CUDA parts the way a user's .cu file does; on a machine without a GPU it
// says so and exits 77 (skipped).
#include <tandem/comm/nccl/nccl.hpp>
#include <tandem/cuda.hpp>

#include <cstdio>

static_assert(tandem::Communicator<tandem::NcclComm>);
static_assert(tandem::Executor<tandem::cuda_exec>);

namespace {
struct Twice {
  float* data;
  TANDEM_HD void operator()(std::size_t i) const { data[i] *= 2.0f; }
};
}  // namespace

int main() {
  if (tandem::cuda::device_count() == 0) {
    std::puts("SKIPPED: no CUDA device; the consumer project compiled and linked");
    return 77;
  }
  tandem::cuda::Stream stream;
  tandem::Buffer<float, tandem::device> values(1024);
  tandem::for_each_index(tandem::cuda_exec{stream.get()}, values.size(), Twice{values.data()});
  stream.synchronize();
  std::puts("consumer: ok");
  return 0;
}
