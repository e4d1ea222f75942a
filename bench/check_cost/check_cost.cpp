// What MpiComm's mismatch check costs: all_reduce (float32 sum, in place, sync) on one MpiComm
// with the check on and one with it off, interleaved in the same processes on the same buffer,
// beside the check's own traffic alone (one MPI_Allgather of a 64-byte fingerprint a rank) and
// raw MPI_Allreduce. Run under mpirun (2 ranks on one node for the README's figures):
//   mpirun -n 2 bench_check_cost [rounds]
// Every result is checked (ranks hold rank + 1; the sum must arrive everywhere) before and after
// timing; a wrong sum exits 1. Prints one RESULT line per implementation and size (median over
// rounds of the per-round median; an iteration's time is the maximum over the ranks).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <mpi.h>

#include "tandem/comm/checked.hpp"
#include "tandem/comm/mpi/mpi.hpp"

namespace {

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

struct Implementation {
  std::string name;
  std::function<void(std::vector<float>&)> run;  // one all_reduce (or the check's exchange)
  bool reduces = true;                           // whether the buffer must hold the sum after
  std::vector<double> round_medians{};
};

bool check_sum(const std::vector<float>& data, int ranks, const std::string& name) {
  const float expected = static_cast<float>(ranks * (ranks + 1) / 2);
  for (float x : data) {
    if (x != expected) {
      std::fprintf(stderr, "%s: all_reduce gave %g, expected %g\n", name.c_str(), double(x),
                   double(expected));
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 11;
  auto on = tandem::MpiComm::world({.check_collectives = true});
  auto off = tandem::MpiComm::world({.check_collectives = false});
  MPI_Comm raw = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  const int rank = on.rank();
  const int ranks = on.size();
  if (!on.checks_collectives() || off.checks_collectives()) {
    std::fprintf(stderr, "the check is not switched as asked\n");
    return 1;
  }

  std::uint64_t sequence = 0;
  std::vector<Implementation> impls;
  impls.push_back({"tandem-mpi, check on", [&](std::vector<float>& d) { on.all_reduce(d); }});
  impls.push_back({"tandem-mpi, check off", [&](std::vector<float>& d) { off.all_reduce(d); }});
  impls.push_back({"raw MPI_Allreduce", [&](std::vector<float>& d) {
                     MPI_Allreduce(MPI_IN_PLACE, d.data(), static_cast<int>(d.size()), MPI_FLOAT,
                                   MPI_SUM, raw);
                   }});
  impls.push_back(
      {"the check alone (MPI_Allgather of 64 B)",
       [&](std::vector<float>& d) {
         const auto mine = tandem::detail::make_fingerprint<float>(
             tandem::detail::CollectiveOp::all_reduce, ++sequence, d.size());
         std::vector<tandem::detail::CollectiveFingerprint> all(static_cast<std::size_t>(ranks));
         MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all.data(), sizeof mine, MPI_BYTE, raw);
         if (!tandem::detail::fingerprint_disagreement(all).empty()) std::abort();
       },
       false});

  bool ok = true;
  for (const std::size_t count :
       {std::size_t{1}, std::size_t{1024}, std::size_t{65536}, std::size_t{1048576}}) {
    const int iterations = count >= 1048576 ? 15 : count >= 65536 ? 41 : 201;
    std::vector<float> data(count);
    for (auto& impl : impls) impl.round_medians.clear();
    // Correctness first, and warm-up.
    for (auto& impl : impls) {
      for (int i = 0; i < 5; ++i) {
        std::fill(data.begin(), data.end(), static_cast<float>(rank + 1));
        impl.run(data);
        if (impl.reduces) ok = ok && check_sum(data, ranks, impl.name);
      }
    }
    std::vector<double> times(static_cast<std::size_t>(iterations));
    for (int round = 0; round < rounds; ++round) {
      for (std::size_t k = 0; k < impls.size(); ++k) {
        auto& impl = impls[(k + static_cast<std::size_t>(round)) % impls.size()];
        for (int i = 0; i < iterations; ++i) {
          std::fill(data.begin(), data.end(), static_cast<float>(rank + 1));
          MPI_Barrier(raw);
          const auto start = std::chrono::steady_clock::now();
          impl.run(data);
          const auto stop = std::chrono::steady_clock::now();
          times[static_cast<std::size_t>(i)] =
              std::chrono::duration<double, std::micro>(stop - start).count();
          if (impl.reduces && i + 1 == iterations) ok = ok && check_sum(data, ranks, impl.name);
        }
        MPI_Allreduce(MPI_IN_PLACE, times.data(), iterations, MPI_DOUBLE, MPI_MAX, raw);
        impl.round_medians.push_back(median(times));
      }
    }
    if (rank == 0) {
      const double off_us = median(impls[1].round_medians);
      for (const auto& impl : impls) {
        const double us = median(impl.round_medians);
        const auto [low, high] =
            std::minmax_element(impl.round_medians.begin(), impl.round_medians.end());
        std::printf(
            "RESULT ranks=%d bytes=%zu impl=\"%s\" median_us=%.2f vs_check_off=%.3f "
            "spread=%.2fx range_us=%.2f-%.2f\n",
            ranks, count * sizeof(float), impl.name.c_str(), us, us / off_us, *high / *low, *low,
            *high);
      }
      std::fflush(stdout);
    }
  }
  int all_ok = ok ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &all_ok, 1, MPI_INT, MPI_MIN, raw);
  MPI_Comm_free(&raw);
  if (!all_ok) {
    if (rank == 0) std::fprintf(stderr, "a result was wrong: these timings mean nothing\n");
    return 1;
  }
  return 0;
}
