// Must NOT compile: NcclComm moves device tensors only, and a host container is rejected at
// compile time with the front end's message (tests/cuda/nccl/CMakeLists.txt checks the text).
#include <vector>

#include "tandem/comm/nccl/nccl.hpp"

void average(tandem::NcclComm& comm, std::vector<float>& grads) {
  comm.all_reduce(grads, tandem::ReduceOp::avg);
}

int main() {
  return 0;
}
