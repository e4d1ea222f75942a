// hello_allreduce: N ranks as threads of one process; each contributes rank + 1, an all_reduce
// sums them, and every rank prints what it got. Exits non-zero when a rank got a wrong sum.
// Run: build/dev/examples/hello_allreduce --ranks 4      (or -n 4; default 4 ranks)
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string_view>
#include <vector>

#include "tandem/comm/local.hpp"
#include "tandem/core/env.hpp"

int main(int argc, char** argv) {
  int ranks = 4;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if ((arg == "--ranks" || arg == "-n") && i + 1 < argc) {
      const auto value = tandem::parse_int(argv[++i]);
      if (!value || *value < 1 || *value > 1024) {
        std::fprintf(stderr, "hello_allreduce: --ranks needs a number from 1 to 1024\n");
        return 2;
      }
      ranks = static_cast<int>(*value);
    } else {
      std::fprintf(stderr, "usage: hello_allreduce [--ranks N | -n N]\n");
      return 2;
    }
  }

  const float expected = static_cast<float>(ranks) * static_cast<float>(ranks + 1) / 2.0f;
  std::mutex print;
  int wrong = 0;
  try {
    tandem::run_local(ranks, [&](tandem::LocalComm& comm) {
      std::vector<float> value{static_cast<float>(comm.rank() + 1)};
      comm.all_reduce(value, tandem::ReduceOp::sum);
      std::lock_guard lock(print);
      std::printf("rank %d of %d: sum = %g%s\n", comm.rank(), comm.size(),
                  static_cast<double>(value[0]), value[0] == expected ? "" : "  (WRONG)");
      if (value[0] != expected) ++wrong;
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hello_allreduce: %s\n", e.what());
    return 1;
  }
  if (wrong) {
    std::fprintf(stderr, "hello_allreduce: %d rank(s) got a wrong sum (expected %g)\n", wrong,
                 static_cast<double>(expected));
    return 1;
  }
  std::printf("all %d ranks agree: %g\n", ranks, static_cast<double>(expected));
  return 0;
}
