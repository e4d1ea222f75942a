// What the flight recorder costs per operation: the ring alone (record, then end, on one thread),
// and a real collective with it on and off - LocalComm, 2 ranks as threads, all_reduce of one
// float (the smallest collective, where a fixed cost shows most), on two groups made side by side
// (one with the default ring, one with size 0), interleaved round by round on the same threads.
//   bench_flight_recorder [rounds] [iterations per round]
// Every all_reduce result is checked; a wrong one, or a ring that did not record, exits 1.
// Prints RESULT lines: the median over rounds of each round's mean time per operation.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tandem/comm/flight_recorder.hpp"
#include "tandem/comm/local/local.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

double ns_per(clock_type::duration elapsed, int iterations) {
  return std::chrono::duration<double, std::nano>(elapsed).count() / iterations;
}

/// Two ranks (threads) each run `iterations` all_reduces on their comm of `group`; returns rank
/// 0's mean time per all_reduce, or a negative value when a result was wrong.
double all_reduces(std::vector<tandem::LocalComm>& group, int iterations) {
  double rank0 = 0;
  bool wrong[2] = {false, false};
  auto body = [&](int rank) {
    std::vector<float> x(1);
    const auto start = clock_type::now();
    for (int i = 0; i < iterations; ++i) {
      x[0] = 1.0f;
      group[static_cast<std::size_t>(rank)].all_reduce(x);
      if (x[0] != 2.0f) wrong[rank] = true;
    }
    if (rank == 0) rank0 = ns_per(clock_type::now() - start, iterations);
  };
  std::thread other(body, 1);
  body(0);
  other.join();
  return wrong[0] || wrong[1] ? -1.0 : rank0;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 21;
  const int iterations = argc > 2 ? std::atoi(argv[2]) : 2000;
  if (rounds < 1 || iterations < 1) {
    std::fprintf(stderr, "usage: bench_flight_recorder [rounds] [iterations per round]\n");
    return 2;
  }

  // 1. The ring alone.
  tandem::detail::FlightRing ring("bench#0", 0, 2, 2000, tandem::default_timeout);
  const tandem::detail::FlightCall call{"all_reduce", true, true, tandem::dtype::float32, 1, -1};
  std::vector<double> ring_ns;
  for (int r = 0; r < rounds; ++r) {
    const auto start = clock_type::now();
    for (int i = 0; i < iterations * 10; ++i) ring.end(ring.record(call, false), false);
    ring_ns.push_back(ns_per(clock_type::now() - start, iterations * 10));
  }
  const auto held = ring.entries();
  if (held.size() != 2000 || held.back().sequence != static_cast<std::uint64_t>(rounds) *
                                                         static_cast<std::uint64_t>(iterations) *
                                                         10) {
    std::fprintf(stderr, "bench_flight_recorder: the ring did not record every operation\n");
    return 1;
  }

  // 2. all_reduce with the recorder on and off (the settings count at a group's first operation):
  //    one rank (the operation is the front end's path alone, so the recorder's share shows with
  //    little noise), then two ranks as threads.
  std::string dir = (std::filesystem::temp_directory_path() / "bench-flight-XXXXXX").string();
  if (::mkdtemp(dir.data()) == nullptr) return 1;
  tandem::set_flight_recorder(
      {.size = 2000, .notice_interval = std::chrono::seconds(10), .directory = dir});
  auto on = tandem::LocalComm::create_group(2);
  auto solo_on = tandem::LocalComm::create_group(1);
  std::vector<float> one{1.0f};
  solo_on[0].all_reduce(one);
  if (all_reduces(on, 10) < 0) return 1;
  tandem::set_flight_recorder({.size = 0});
  auto off = tandem::LocalComm::create_group(2);
  auto solo_off = tandem::LocalComm::create_group(1);
  solo_off[0].all_reduce(one);
  if (all_reduces(off, 10) < 0) return 1;
  tandem::reset_flight_recorder();
  std::vector<double> solo_on_ns;
  std::vector<double> solo_off_ns;
  for (int r = 0; r < rounds; ++r) {
    for (int side = 0; side < 2; ++side) {
      const bool recording = (side == 0) == (r % 2 == 0);
      auto& comm = recording ? solo_on[0] : solo_off[0];
      const auto start = clock_type::now();
      for (int i = 0; i < iterations * 10; ++i) {
        one[0] = 1.0f;
        comm.all_reduce(one);
      }
      (recording ? solo_on_ns : solo_off_ns)
          .push_back(ns_per(clock_type::now() - start, iterations * 10));
      if (one[0] != 1.0f) {
        std::fprintf(stderr, "bench_flight_recorder: a wrong all_reduce result\n");
        return 1;
      }
    }
  }
  std::vector<double> on_ns;
  std::vector<double> off_ns;
  for (int r = 0; r < rounds; ++r) {
    const bool on_first = r % 2 == 0;  // alternate the order: neither side always goes first
    for (int side = 0; side < 2; ++side) {
      const bool recording = (side == 0) == on_first;
      const double t = all_reduces(recording ? on : off, iterations);
      if (t < 0) {
        std::fprintf(stderr, "bench_flight_recorder: a wrong all_reduce result\n");
        return 1;
      }
      (recording ? on_ns : off_ns).push_back(t);
    }
  }
  const bool dumped = !tandem::dump_flight_records().empty();
  std::filesystem::remove_all(dir);
  if (!dumped) {
    std::fprintf(stderr, "bench_flight_recorder: the recording group wrote no record\n");
    return 1;
  }

  const double ring_median = median(ring_ns);
  const double on_median = median(on_ns);
  const double off_median = median(off_ns);
  std::printf("RESULT ring record+end: %.1f ns per operation\n", ring_median);
  const double solo_on_median = median(solo_on_ns);
  const double solo_off_median = median(solo_off_ns);
  std::printf("RESULT LocalComm 1 rank all_reduce 4 B, recorder on: %.1f ns\n", solo_on_median);
  std::printf("RESULT LocalComm 1 rank all_reduce 4 B, recorder off: %.1f ns\n", solo_off_median);
  std::printf("RESULT added per operation (1 rank): %.1f ns\n", solo_on_median - solo_off_median);
  std::printf("RESULT LocalComm 2 ranks all_reduce 4 B, recorder on: %.1f ns\n", on_median);
  std::printf("RESULT LocalComm 2 ranks all_reduce 4 B, recorder off: %.1f ns\n", off_median);
  std::printf("RESULT added per operation (2 ranks): %.1f ns (%.2fx)\n", on_median - off_median,
              on_median / off_median);
  return 0;
}
