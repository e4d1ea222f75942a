// hello_allreduce: every rank contributes rank + 1, an all_reduce sums them, and each rank prints
// what it got; exits non-zero when a rank got a wrong sum (an error ends it through
// tandem::run_main, which writes torchrun's error file). One program, four ways to run it:
//   build/dev/examples/hello_allreduce --ranks 4                          threads (LocalComm)
//   build/dev/tools/tandemrun --nproc-per-node 4 build/dev/examples/hello_allreduce --backend gloo
//   mpirun -n 3 build/dev/examples/hello_allreduce --backend mpi           (as root: see README)
//   python3 -m torch.distributed.run --nproc_per_node 2 --no_python --redirects 9:1 --tee 9:1
//       build/dev/examples/hello_allreduce --backend gloo                   (one line: torchrun)
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/comm/local/local.hpp"
#include "tandem/core/env.hpp"
#include "tandem/launch/elastic.hpp"
#if TANDEM_EXAMPLE_WITH_GLOO
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"
#endif
#if TANDEM_EXAMPLE_WITH_MPI
#include "tandem/comm/mpi/mpi.hpp"
#endif

namespace {

std::mutex print_mutex;

/// The whole job of one rank, for any communicator. Returns whether its sum was right.
template <tandem::Communicator Comm>
bool say_hello(Comm& comm) {
  std::vector<float> value{static_cast<float>(comm.rank() + 1)};
  comm.all_reduce(value, tandem::ReduceOp::sum);
  const int n = comm.size();
  const float expected = static_cast<float>(n) * static_cast<float>(n + 1) / 2.0f;
  std::lock_guard lock(print_mutex);
  std::printf("rank %d of %d: sum = %g%s\n", comm.rank(), n, static_cast<double>(value[0]),
              value[0] == expected ? "" : "  (WRONG)");
  std::fflush(stdout);
  return value[0] == expected;
}

int usage() {
  std::fprintf(stderr,
               "usage: hello_allreduce [--backend local|gloo|mpi] [--ranks N | -n N]\n"
               "  --ranks: threads for the local backend (default 4); with gloo and mpi\n"
               "  the launcher (tandemrun, torchrun, mpirun) decides how many ranks run\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string backend = "local";
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
    } else if (arg == "--backend" && i + 1 < argc) {
      backend = argv[++i];
    } else {
      return usage();
    }
  }

  return tandem::run_main([&]() -> int {
    if (backend == "local") {
      std::atomic<int> wrong{0};  // every rank (thread) may add to it
      tandem::run_local(ranks, [&](tandem::LocalComm& comm) { wrong += !say_hello(comm); });
      return wrong == 0 ? 0 : 1;
    }
#if TANDEM_EXAMPLE_WITH_GLOO
    if (backend == "gloo") {
      // env:// : RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from tandemrun or torchrun.
      auto comm = tandem::init_process_group<tandem::GlooComm>();
      return say_hello(comm) ? 0 : 1;
    }
#endif
#if TANDEM_EXAMPLE_WITH_MPI
    if (backend == "mpi") {
      auto comm = tandem::MpiComm::world();
      return say_hello(comm) ? 0 : 1;
    }
#endif
    if (backend == "gloo" || backend == "mpi") {
      std::fprintf(stderr,
                   "hello_allreduce: this build has no %s backend (configure with "
                   "-DTANDEM_WITH_%s=ON)\n",
                   backend.c_str(), backend == "gloo" ? "GLOO" : "MPI");
      return 2;
    }
    return usage();
  });
}
