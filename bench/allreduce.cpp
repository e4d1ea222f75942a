// bench/allreduce - all_reduce (sum, float32) through tandem::LocalComm (threads as ranks), beside
// the peer that bounds it on one machine: a single-thread memcpy of the same bytes, interleaved
// with it in the same run. Prints a table (median time, algbw, busbw with nccl-tests' formulas,
// busbw / memcpy bandwidth) and, for bench/run_allreduce.sh, machine-readable lines:
//   RESULT <impl> <bytes> <ranks> <median_us> <spread> <fastest_run_us> <slowest_run_us>
//   RUNS <impl> <bytes> <run_median_us>...
//   build/release/bench/bench_allreduce [--ranks 2] [--runs 5] [--iters 21] [--warmup 5]
// Needs: nothing beyond tandem.
//
// Method (as bench/allreduce_rank.cpp): per iteration a barrier, then steady_clock around one
// in-place all_reduce on every rank; the iteration's time is the maximum over the ranks, a run's
// time the median of its iterations, the result the median of the run medians, spread = slowest
// run / fastest run. After each tandem-local run, rank 0 times a run of memcpy of the same bytes
// (one thread; the other ranks wait at a barrier), whose bandwidth is bytes / time.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/comm/local/local.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

struct Settings {
  int ranks = 2;
  int runs = 5;
  int iters = 21;
  int warmup = 5;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : (values[mid - 1] + values[mid]) / 2.0;
}

struct Summary {
  double median_us = 0;
  double spread = 0;
  double fastest_us = 0;
  double slowest_us = 0;
};

Summary summarise(const std::vector<double>& run_medians) {
  const auto [fastest, slowest] = std::minmax_element(run_medians.begin(), run_medians.end());
  return {median(run_medians), *slowest / *fastest, *fastest, *slowest};
}

/// The RESULT and RUNS lines of one implementation and size.
std::string result_lines(const char* impl, std::size_t bytes, int ranks,
                         const std::vector<double>& run_medians) {
  const Summary s = summarise(run_medians);
  char line[256];
  std::snprintf(line, sizeof line, "RESULT %s %zu %d %.3f %.4f %.3f %.3f\nRUNS %s %zu", impl, bytes,
                ranks, s.median_us, s.spread, s.fastest_us, s.slowest_us, impl, bytes);
  std::string text = line;
  for (const double r : run_medians) {
    std::snprintf(line, sizeof line, " %.3f", r);
    text += line;
  }
  return text + "\n";
}

/// One size: the run medians (microseconds) of tandem-local and of memcpy, interleaved.
struct Measured {
  std::vector<double> local;
  std::vector<double> copy;
};

Measured measure(std::size_t bytes, const Settings& settings) {
  const std::size_t count = bytes / sizeof(float);
  const auto ranks = static_cast<std::size_t>(settings.ranks);
  const auto iters = static_cast<std::size_t>(settings.iters);
  Measured measured;
  // samples[rank * iters + i]: written by each rank's thread, read by rank 0 after a barrier.
  std::vector<double> samples(ranks * iters);
  tandem::run_local(settings.ranks, [&](tandem::LocalComm& comm) {
    const auto rank = static_cast<std::size_t>(comm.rank());
    std::vector<float> data(count, static_cast<float>(rank + 1));
    comm.all_reduce(data, tandem::ReduceOp::sum);
    const float expected = static_cast<float>(settings.ranks * (settings.ranks + 1) / 2);
    if (std::any_of(data.begin(), data.end(), [&](float v) { return v != expected; })) {
      std::fprintf(stderr, "rank %zu: tandem-local: wrong sum\n", rank);
      std::abort();
    }
    std::fill(data.begin(), data.end(), 0.0f);  // sums of zeros stay finite however many runs
    for (int i = 0; i < settings.warmup; ++i) {
      comm.barrier();
      comm.all_reduce(data, tandem::ReduceOp::sum);
    }
    std::vector<char> from, to;
    if (rank == 0) {
      from.assign(bytes, 1);
      to.assign(bytes, 0);
      for (int i = 0; i < settings.warmup; ++i) std::memcpy(to.data(), from.data(), bytes);
    }
    std::vector<double> per_iteration(iters);
    for (int run = 0; run < settings.runs; ++run) {
      for (std::size_t i = 0; i < iters; ++i) {
        comm.barrier();
        const auto start = clock_type::now();
        comm.all_reduce(data, tandem::ReduceOp::sum);
        samples[rank * iters + i] =
            std::chrono::duration<double, std::micro>(clock_type::now() - start).count();
      }
      comm.barrier();  // every rank's samples are written
      if (rank == 0) {
        for (std::size_t i = 0; i < iters; ++i) {
          per_iteration[i] = 0;
          for (std::size_t r = 0; r < ranks; ++r) {
            per_iteration[i] = std::max(per_iteration[i], samples[r * iters + i]);
          }
        }
        measured.local.push_back(median(per_iteration));
        for (std::size_t i = 0; i < iters; ++i) {
          const auto start = clock_type::now();
          std::memcpy(to.data(), from.data(), bytes);
          per_iteration[i] =
              std::chrono::duration<double, std::micro>(clock_type::now() - start).count();
        }
        if (to[bytes / 2] != 1) std::abort();  // keeps the copies from being optimised away
        measured.copy.push_back(median(per_iteration));
      }
      comm.barrier();  // rank 0 has read the samples and copied
    }
  });
  return measured;
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view flag = argv[i];
    const int value = std::atoi(argv[i + 1]);
    if (flag == "--ranks") {
      settings.ranks = value;
    } else if (flag == "--runs") {
      settings.runs = value;
    } else if (flag == "--iters") {
      settings.iters = value;
    } else if (flag == "--warmup") {
      settings.warmup = value;
    } else {
      std::fprintf(stderr, "usage: %s [--ranks N] [--runs N] [--iters N] [--warmup N]\n", argv[0]);
      return 2;
    }
  }
  if (settings.ranks < 1 || settings.runs < 1 || settings.iters < 1 || settings.warmup < 0) {
    std::fprintf(stderr, "--ranks, --runs and --iters must be at least 1, --warmup at least 0\n");
    return 2;
  }

  const double n = settings.ranks;
  std::printf("all_reduce sum float32, %d ranks (threads), median of %d runs x %d iterations\n\n",
              settings.ranks, settings.runs, settings.iters);
  std::printf(
      "| size | tandem-local time | algbw GB/s | busbw GB/s | spread | memcpy GB/s | "
      "busbw / memcpy |\n|---|---|---|---|---|---|---|\n");
  std::vector<std::string> lines;
  for (std::size_t bytes : {std::size_t{4} << 10, std::size_t{256} << 10, std::size_t{4} << 20,
                            std::size_t{64} << 20}) {
    const Measured m = measure(bytes, settings);
    const Summary local = summarise(m.local);
    const Summary copy = summarise(m.copy);
    const double copy_bw = static_cast<double>(bytes) / copy.median_us / 1e3;
    const double algbw = static_cast<double>(bytes) / local.median_us / 1e3;
    const double busbw = algbw * 2.0 * (n - 1.0) / n;
    std::printf("| %zu KiB | %.1f us | %.2f | %.2f | %.2fx | %.2f | %.2f |\n", bytes >> 10,
                local.median_us, algbw, busbw, local.spread, copy_bw, busbw / copy_bw);
    std::fflush(stdout);
    lines.push_back(result_lines("tandem-local", bytes, settings.ranks, m.local));
    lines.push_back(result_lines("memcpy", bytes, 1, m.copy));
  }
  std::printf("\n");
  for (const auto& text : lines) std::fputs(text.c_str(), stdout);
  return 0;
}
