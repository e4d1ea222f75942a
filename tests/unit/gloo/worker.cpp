// One rank of the multi-process GlooComm tests that gloo_processes starts itself (RANK and
// WORLD_SIZE in the environment, the init URL on the command line). It decides its own success:
// exit code 0 when every check held, 1 otherwise (and why, on stderr).
//   gloo_worker init URL        init_process_group over URL, all_reduce, split, all_reduce
//   gloo_worker dead-peer URL   the last rank kills itself mid-way; the others must get an Error
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"

namespace {

using namespace std::chrono_literals;

int failures = 0;
int my_rank = -1;

void expect(bool ok, const std::string& what) {
  if (ok) return;
  ++failures;
  std::fprintf(stderr, "gloo_worker rank %d: FAILED: %s\n", my_rank, what.c_str());
}

bool mentions(const std::string& text, std::string_view part) {
  return text.find(part) != std::string::npos;
}

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

tandem::World world_from_env() {
  const char* rank = std::getenv("RANK");
  const char* size = std::getenv("WORLD_SIZE");
  if (!rank || !size) throw tandem::Error("gloo_worker", "RANK and WORLD_SIZE must be set");
  return tandem::World::single_node(std::atoi(rank), std::atoi(size));
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
  return failures ? 1 : 0;
}

int run_dead_peer(const tandem::World& world, const std::string& url) {
  auto comm = tandem::init_process_group<tandem::GlooComm>(world, url, {.timeout = 5s});
  const int victim = comm.size() - 1;
  std::vector<float> data(1 << 16, 1.0f);
  comm.all_reduce(data);
  expect(data[0] == static_cast<float>(comm.size()), "the all_reduce before the death");
  comm.barrier();
  if (comm.rank() == victim) ::raise(SIGKILL);

  const auto start = std::chrono::steady_clock::now();
  std::string error;
  try {
    for (int i = 0; i < 100000 && error.empty(); ++i) comm.all_reduce(data);
  } catch (const tandem::Error& e) {
    error = e.what();
  }
  const auto waited = std::chrono::steady_clock::now() - start;
  std::fprintf(stderr, "gloo_worker rank %d: got: %s\n", comm.rank(), error.c_str());
  expect(!error.empty(), "no error after rank " + std::to_string(victim) + " died");
  expect(
      mentions(error, "rank " + std::to_string(comm.rank()) + ":") && mentions(error, "all_reduce"),
      "the error names this rank and the operation: " + error);
  // Survivors that already finished may be listed too ("ranks 0, 3 have died"): look for the
  // victim among the numbers of the dead list.
  expect(dead_list_names(error, victim), "the error names the dead rank: " + error);
  expect(waited < 30s,
         "the error came after " +
             std::to_string(std::chrono::duration_cast<std::chrono::seconds>(waited).count()) +
             " s");
  // Later calls fail at once, saying why.
  try {
    comm.barrier();
    expect(false, "a barrier on the failed communicator succeeded");
  } catch (const tandem::Error& e) {
    expect(mentions(e.what(), "barrier") && mentions(e.what(), "unusable"),
           std::string("the later call's error: ") + e.what());
  }
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: gloo_worker init|dead-peer URL\n");
    return 2;
  }
  const std::string mode = argv[1];
  const std::string url = argv[2];
  try {
    const auto world = world_from_env();
    my_rank = world.rank;
    if (mode == "init") return run_init(world, url);
    if (mode == "dead-peer") return run_dead_peer(world, url);
    std::fprintf(stderr, "gloo_worker: unknown mode '%s'\n", mode.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gloo_worker rank %d: %s\n", my_rank, e.what());
    return 1;
  }
}
