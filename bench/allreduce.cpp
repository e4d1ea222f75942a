// bench/allreduce - all_reduce (sum, float32) through tandem::LocalComm, beside the peer that
// bounds it on one machine: a single-thread memcpy of the same bytes, measured in the same run.
// Reports the median time, algbw and busbw (nccl-tests' formulas) and busbw / memcpy bandwidth.
//   build/release/bench/bench_allreduce [--ranks 2] [--runs 5] [--iters 21]
// Needs: nothing beyond tandem; the Gloo and MPI columns come with those backends.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/comm/local.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

struct Settings {
  int ranks = 2;
  int runs = 5;
  int iters = 21;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

/// Median seconds of one memcpy of `bytes`, over runs x iters copies.
double memcpy_seconds(std::size_t bytes, const Settings& settings) {
  std::vector<char> from(bytes, 1), to(bytes, 0);
  std::vector<double> samples;
  for (int run = 0; run < settings.runs; ++run) {
    for (int i = 0; i < settings.iters; ++i) {
      const auto start = clock_type::now();
      std::memcpy(to.data(), from.data(), bytes);
      samples.push_back(std::chrono::duration<double>(clock_type::now() - start).count());
    }
  }
  if (to[bytes / 2] != 1) std::abort();  // keeps the copy from being optimised away
  return median(samples);
}

/// Median seconds of one all_reduce of `count` floats, timed on rank 0 between barriers, and the
/// spread (max/min of the per-run medians).
std::pair<double, double> local_allreduce_seconds(std::size_t count, const Settings& settings) {
  std::vector<double> run_medians;
  tandem::run_local(settings.ranks, [&](tandem::LocalComm& comm) {
    std::vector<float> data(count, 1.0f);
    comm.all_reduce(data, tandem::ReduceOp::sum);  // warm-up: first touch of pages and scratch
    for (int run = 0; run < settings.runs; ++run) {
      std::vector<double> samples;
      for (int i = 0; i < settings.iters; ++i) {
        comm.barrier();
        const auto start = clock_type::now();
        comm.all_reduce(data, tandem::ReduceOp::sum);
        samples.push_back(std::chrono::duration<double>(clock_type::now() - start).count());
      }
      if (comm.rank() == 0) run_medians.push_back(median(samples));
    }
  });
  const auto [low, high] = std::minmax_element(run_medians.begin(), run_medians.end());
  return {median(run_medians), *high / *low};
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view flag = argv[i];
    const int value = std::atoi(argv[i + 1]);
    if (flag == "--ranks")
      settings.ranks = value;
    else if (flag == "--runs")
      settings.runs = value;
    else if (flag == "--iters")
      settings.iters = value;
    else {
      std::fprintf(stderr, "usage: %s [--ranks N] [--runs N] [--iters N]\n", argv[0]);
      return 2;
    }
  }
  if (settings.ranks < 1 || settings.runs < 1 || settings.iters < 1) {
    std::fprintf(stderr, "--ranks, --runs and --iters must be at least 1\n");
    return 2;
  }

  const double n = settings.ranks;
  std::printf("all_reduce sum float32, %d ranks (threads), median of %d runs x %d iterations\n\n",
              settings.ranks, settings.runs, settings.iters);
  std::printf(
      "| size | tandem-local time | algbw GB/s | busbw GB/s | spread | memcpy GB/s | "
      "busbw / memcpy |\n|---|---|---|---|---|---|---|\n");
  for (std::size_t bytes : {std::size_t{4} << 10, std::size_t{256} << 10, std::size_t{4} << 20,
                            std::size_t{64} << 20}) {
    const auto [seconds, spread] = local_allreduce_seconds(bytes / sizeof(float), settings);
    const double copy = static_cast<double>(bytes) / memcpy_seconds(bytes, settings) / 1e9;
    const double algbw = static_cast<double>(bytes) / seconds / 1e9;
    const double busbw = algbw * 2.0 * (n - 1.0) / n;
    std::printf("| %zu KiB | %.1f us | %.2f | %.2f | %.2fx | %.2f | %.2f |\n", bytes >> 10,
                seconds * 1e6, algbw, busbw, spread, copy, busbw / copy);
  }
  return 0;
}
