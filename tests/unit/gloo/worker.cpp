// One rank of the multi-process GlooComm tests that gloo_processes starts itself (RANK and
// WORLD_SIZE in the environment, the init URL on the command line). It decides its own success:
// exit code 0 when every check held, 1 otherwise (and why, on stderr).
//   gloo_worker init URL        init_process_group over URL, all_reduce, split, all_reduce
//   gloo_worker dead-peer URL   the last rank kills itself mid-way; the others must get an Error
#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "../../support/worker_main.hpp"  // the worker has no include path of its own
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"

namespace {

using namespace std::chrono_literals;
using tandem::test::worker::exit_code;
using tandem::test::worker::expect;

/// Whether "...; rank 3 has died" or "...; ranks 0, 3 have died" lists `rank`.
bool dead_list_names(const std::string& error, int rank) {
  const auto died = error.rfind(" died");
  const auto start = error.rfind("; rank", died);
  if (died == std::string::npos || start == std::string::npos) return false;
  std::string numbers = error.substr(start, died - start);
  for (char& c : numbers) {
    if (c < '0' || c > '9') c = ' ';
  }
  std::istringstream list(numbers);
  for (int r; list >> r;) {
    if (r == rank) return true;
  }
  return false;
}

int run_init(const tandem::World& world, const std::string& url) {
  auto comm = tandem::init_process_group<tandem::GlooComm>(world, url, {.timeout = 30s});
  const int n = comm.size();
  expect(comm.rank() == world.rank && n == world.world_size, "rank and size after init");
  std::vector<float> data(1000, static_cast<float>(comm.rank() + 1));
  comm.all_reduce(data);
  expect(data.front() == static_cast<float>(n * (n + 1) / 2) && data.back() == data.front(),
         "all_reduce after init gave " + std::to_string(data.front()));
  // A subgroup rendezvous through the same store.
  auto half = comm.split(comm.rank() % 2, 0);
  expect(half.has_value(), "split gave no group");
  if (half) {
    std::vector<std::int64_t> ranks{comm.rank()};
    half->all_reduce(ranks, tandem::ReduceOp::max);
    const int top = (n - 1) - ((n - 1) % 2 == comm.rank() % 2 ? 0 : 1);
    expect(ranks[0] == top, "split all_reduce(max) gave " + std::to_string(ranks[0]));
  }
  comm.barrier();
  return exit_code();
}

int run_dead_peer(const tandem::World& world, const std::string& url) {
  auto comm = tandem::init_process_group<tandem::GlooComm>(world, url, {.timeout = 5s});
  const int victim = comm.size() - 1;
  const auto seen = tandem::test::worker::survive_last_rank_death(comm, 100000);
  // Survivors that already finished may be listed too ("ranks 0, 3 have died"): look for the
  // victim among the numbers of the dead list.
  expect(dead_list_names(seen.error, victim), "the error names the dead rank: " + seen.error);
  expect(seen.waited < 30s, "the error came after " + std::to_string(seen.waited.count()) + " ms");
  tandem::test::worker::expect_unusable(comm);
  return exit_code();
}

}  // namespace

int main(int argc, char** argv) {
  return tandem::test::worker::run(argc, argv, "gloo_worker",
                                   {{"init", run_init}, {"dead-peer", run_dead_peer}});
}
