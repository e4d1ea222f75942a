// Built against tandem as a user would: four ranks as threads average a vector.
#include <tandem/tandem.hpp>

#include <atomic>
#include <cstdio>
#include <vector>

int main() {
  std::atomic<int> wrong{0};  // the ranks are threads
  tandem::run_local(4, [&](tandem::LocalComm& comm) {
    std::vector<float> values(100, static_cast<float>(comm.rank()));
    comm.all_reduce(values, tandem::ReduceOp::avg);
    for (float v : values) {
      if (v != 1.5f) ++wrong;  // (0 + 1 + 2 + 3) / 4, exact in float
    }
  });
  std::printf("consumer: %s\n", wrong == 0 ? "ok" : "WRONG");
  return wrong == 0 ? 0 : 1;
}
