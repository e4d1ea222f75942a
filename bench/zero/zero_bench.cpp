// bench/zero - ZeRO's cost and saving: per-rank resident memory and step time of
// DistributedDataParallel with AdamW, plain (stage 0) and with shard<1> / shard<2>.
//   zero_bench local --ranks N [options]                        (N threads, LocalComm)
//   tandemrun --standalone --nproc-per-node N zero_bench gloo|shm [options]   (N processes)
//   mpirun -n N --bind-to none zero_bench mpi [options]                       (N processes)
// Options: --stage 0|1|2 (0: plain DDP) --params P (124e6 float parameters) --steps S (10 timed)
// --warmup W (2) --bucket-mib 25|4|1 (bucket_cap; 25 as PyTorch's DDP) --prefetch 0|1 (with a
// stage: the prefetch_parameters policy) --forward 0|1 (a forward pass before the backward).
// One stage per run: a process's VmHWM (peak resident memory) would otherwise be the largest
// stage's. run_zero.sh runs every stage, world size and engine beside PyTorch's
// ZeroRedundancyOptimizer and writes bench/results/zero.md.
//
// The model: P float parameters in 12 tensors (the last takes the remainder). Its synthetic
// backward writes each tensor's gradient, g = 1e-3 * w + c (c differs by rank and step), one
// element-wise pass like the PyTorch peer's, and marks it ready, last tensor first. With
// --forward 1 a forward pass reads each tensor first, in registration order (the sum of its
// values, checked), waiting for each tensor's all_gather first under prefetch_parameters. One
// step: before_forward, [forward,] backward, finish_gradient_sync, ddp.step(opt) (AdamW; the
// all_gather of the parameters under sharding, left in flight under prefetch_parameters),
// opt.zero_grad(). A step's time is the time between the ends of two barriers that start
// consecutive steps, so a gather left in flight past the step counts in it; the median over the
// timed steps of the slowest rank's is printed (step_ms), and the fastest of them
// (fastest_step_ms: on a machine shared with other work, the step least disturbed by it). Memory:
// VmRSS and VmHWM from /proc/self/status at the end, per process (threads share one process: the
// per-rank figure is the process's / N), and the optimizer state the arena holds on each rank
// (opt.state_bytes(), exact). The run fails (exit 1, no RESULT line) unless the work happened:
// every rank took W + S optimizer steps, the parameters moved from their initial values, and all
// ranks hold the same parameters at the end.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "tandem/arena/parameters.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/ddp/ddp.hpp"
#include "tandem/optim/adamw.hpp"
#if TANDEM_BENCH_GLOO
#include "tandem/comm/gloo/gloo.hpp"
#endif
#if TANDEM_BENCH_SHM
#include "tandem/comm/shm/shm.hpp"
#endif
#if TANDEM_BENCH_GLOO || TANDEM_BENCH_SHM
#include "tandem/comm/init.hpp"
#endif
#if TANDEM_BENCH_MPI
#include "tandem/comm/mpi/mpi.hpp"
#endif

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string backend;
  int ranks = 2;  // local only; processes take WORLD_SIZE
  int stage = 0;
  std::size_t params = 124'000'000;
  int steps = 10;
  int warmup = 2;
  std::size_t bucket_mib = 25;
  bool prefetch = false;
  bool forward = false;
};

/// VmRSS and VmHWM of this process in bytes (/proc/self/status gives kB).
std::pair<double, double> resident_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  double rss = 0;
  double hwm = 0;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) rss = std::atof(line.c_str() + 6) * 1024;
    if (line.rfind("VmHWM:", 0) == 0) hwm = std::atof(line.c_str() + 6) * 1024;
  }
  return {rss, hwm};
}

template <class Comm>
std::vector<double> reduced(Comm& comm, std::vector<double> values, tandem::ReduceOp op) {
  comm.all_reduce(tandem::View<double>(values.data(), values.size()), op);
  return values;
}

double checksum(tandem::View<float> values) {
  double sum = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    sum += static_cast<double>(values[i]) * static_cast<double>(1 + i % 7);
  }
  return sum;
}

constexpr double mib = 1024.0 * 1024.0;

/// One run of options.stage under DistributedDataParallel<Comm, overlap, bucket_cap<Bucket>,
/// Policies...>; rank 0 prints the RESULT line. Returns false when the work did not happen.
template <class Comm, std::size_t Bucket, class... Policies>
bool run(Comm& comm, const Options& options, bool threads) {
  constexpr std::size_t tensors = 12;
  const std::size_t each = options.params / tensors;
  tandem::Parameters<float> params;
  std::vector<tandem::Parameters<float>::Parameter*> layer;
  for (std::size_t l = 0; l < tensors; ++l) {
    const std::size_t n = l + 1 < tensors ? each : options.params - each * (tensors - 1);
    layer.push_back(
        &params.add("layer" + std::to_string(l) + ".weight", {static_cast<std::int64_t>(n)}));
  }
  params.finalize();
  auto values = params.values();
  for (std::size_t i = 0; i < values.size(); ++i) {
    values[i] = static_cast<float>(i % 1000) * 1e-3f - 0.5f;
  }
  const double initial = checksum(values);

  tandem::DistributedDataParallel<Comm, tandem::overlap, tandem::bucket_cap<Bucket>, Policies...>
      ddp(comm, params);
  tandem::optim::AdamW<float> opt(params, {.lr = 1e-3, .weight_decay = 0.01});
  ddp.shard(opt);  // plain DDP: nothing

  constexpr bool prefetches = decltype(ddp)::config::prefetches;
  std::vector<double> times;
  double forward_sum = 0;  // what the forward read, so that it cannot be left out
  comm.barrier();
  auto start = Clock::now();
  for (int s = 0; s < options.warmup + options.steps; ++s) {
    const float c = 1e-4f * static_cast<float>(1 + comm.rank() + s % 5);
    ddp.before_forward();
    if (options.forward) {
      for (auto* p : layer) {
        if constexpr (prefetches) ddp.wait_parameters(*p);
        const float* w = p->value().data();
        float sum = 0;
        for (std::size_t i = 0; i < p->value().size(); ++i) sum += w[i];
        forward_sum += static_cast<double>(sum);
      }
    }
    for (auto it = layer.rbegin(); it != layer.rend(); ++it) {
      if constexpr (prefetches) ddp.wait_parameters(**it);
      float* g = (*it)->grad().data();
      const float* w = (*it)->value().data();
      const std::size_t n = (*it)->grad().size();
      for (std::size_t i = 0; i < n; ++i) g[i] = 1e-3f * w[i] + c;
      ddp.grad_ready(**it);
    }
    ddp.finish_gradient_sync();
    ddp.step(opt);
    opt.zero_grad();
    comm.barrier();  // after the gather left in flight, in the communicator's issue order
    const auto end = Clock::now();
    if (s >= options.warmup) times.push_back(std::chrono::duration<double>(end - start).count());
    start = end;
  }
  ddp.wait_parameters();  // (the barrier has seen it end; this also ends it on this side)
  times = reduced(comm, times, tandem::ReduceOp::max);  // each step's slowest rank
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];

  // The work happened: steps taken, parameters moved, the same on every rank.
  const double final_sum = checksum(params.values());
  const auto steps_taken = static_cast<double>(opt.group_steps(0));
  const auto low = reduced(comm, {final_sum, steps_taken}, tandem::ReduceOp::min);
  const auto high = reduced(comm, {final_sum, steps_taken}, tandem::ReduceOp::max);
  const double expected_steps = options.warmup + options.steps;
  const bool moved = std::fabs(final_sum - initial) > 1e-6 * std::max(1.0, std::fabs(initial));
  const bool same = low[0] == high[0];
  const bool stepped = low[1] == expected_steps && high[1] == expected_steps;
  const bool read = !options.forward || std::isfinite(forward_sum);
  if (!(moved && same && stepped && read)) {
    if (comm.rank() == 0) {
      std::fprintf(stderr,
                   "zero_bench: FAILED, the work did not happen: parameters moved %d, equal on "
                   "every rank %d, optimizer steps %.0f..%.0f of %.0f\n",
                   moved, same, low[1], high[1], expected_steps);
    }
    return false;
  }

  // Memory: optimizer state from the arena; resident memory from /proc.
  const auto state = reduced(comm, {static_cast<double>(opt.state_bytes())}, tandem::ReduceOp::max);
  auto [rss, hwm] = resident_bytes();
  double rss_rank = rss;
  double hwm_rank = hwm;
  if (threads) {  // one process: its figures / N (only rank 0's read is used)
    rss_rank = rss / comm.size();
    hwm_rank = hwm / comm.size();
  }
  const auto max_mem = reduced(comm, {rss_rank, hwm_rank}, tandem::ReduceOp::max);
  if (comm.rank() == 0) {
    std::printf(
        "RESULT impl=tandem backend=%s ranks=%d stage=%d params=%zu buckets=%zu steps=%d "
        "step_ms=%.3f state_mib_per_rank=%.2f rss_mib_per_rank=%.1f hwm_mib_per_rank=%.1f "
        "per_rank=%s prefetch=%d forward=%d fastest_step_ms=%.3f\n",
        options.backend.c_str(), comm.size(), options.stage, params.numel(), ddp.buckets().size(),
        options.steps, median * 1e3, state[0] / mib, max_mem[0] / mib, max_mem[1] / mib,
        threads ? "process/N" : "max-over-processes", prefetches ? 1 : 0, options.forward ? 1 : 0,
        times.front() * 1e3);
    std::fflush(stdout);
  }
  return true;
}

template <class Comm, std::size_t Bucket>
bool by_stage(Comm& comm, const Options& options, bool threads) {
  switch (options.stage) {
    case 1:
      if (options.prefetch) {
        return run<Comm, Bucket, tandem::shard<1>, tandem::prefetch_parameters>(comm, options,
                                                                                threads);
      }
      return run<Comm, Bucket, tandem::shard<1>>(comm, options, threads);
    case 2:
      if (options.prefetch) {
        return run<Comm, Bucket, tandem::shard<2>, tandem::prefetch_parameters>(comm, options,
                                                                                threads);
      }
      return run<Comm, Bucket, tandem::shard<2>>(comm, options, threads);
    default:
      return run<Comm, Bucket>(comm, options, threads);
  }
}

template <class Comm>
bool dispatch(Comm& comm, const Options& options, bool threads) {
  switch (options.bucket_mib) {
    case 1:
      return by_stage<Comm, std::size_t{1} << 20>(comm, options, threads);
    case 4:
      return by_stage<Comm, std::size_t{4} << 20>(comm, options, threads);
    default:
      return by_stage<Comm, std::size_t{25} << 20>(comm, options, threads);
  }
}

/// The command line; a flag is followed by its value, numbers like 124e6 accepted.
Options parse(int argc, char** argv) {
  const char* usage =
      "usage: zero_bench local|gloo|shm|mpi [--ranks N] [--stage 0|1|2] [--params P] "
      "[--steps S] [--warmup W] [--bucket-mib 25|4|1] [--prefetch 0|1] [--forward 0|1]\n";
  Options options;
  double ranks = options.ranks, stage = options.stage, params = static_cast<double>(options.params),
         steps = options.steps, warmup = options.warmup,
         bucket_mib = static_cast<double>(options.bucket_mib), prefetch = 0, forward = 0;
  const std::map<std::string, double*> numbers{
      {"--ranks", &ranks},       {"--stage", &stage},    {"--params", &params},
      {"--steps", &steps},       {"--warmup", &warmup},  {"--bucket-mib", &bucket_mib},
      {"--prefetch", &prefetch}, {"--forward", &forward}};
  bool ok = argc >= 2 && argc % 2 == 0;
  for (int i = 2; ok && i + 1 < argc; i += 2) {
    const auto found = numbers.find(argv[i]);
    ok = found != numbers.end();
    if (ok) *found->second = std::strtod(argv[i + 1], nullptr);
  }
  ok = ok && stage >= 0 && stage <= 2 && steps >= 1 && warmup >= 0 && params >= 12 && ranks >= 1;
  if (!ok) {
    std::fputs(usage, stderr);
    std::exit(2);
  }
  options.backend = argv[1];
  options.ranks = static_cast<int>(ranks);
  options.stage = static_cast<int>(stage);
  options.params = static_cast<std::size_t>(params);
  options.steps = static_cast<int>(steps);
  options.warmup = static_cast<int>(warmup);
  options.bucket_mib = static_cast<std::size_t>(bucket_mib);
  options.prefetch = prefetch != 0;
  options.forward = forward != 0;
  return options;
}

#if TANDEM_BENCH_GLOO || TANDEM_BENCH_SHM
/// This process's rank of the launcher's job (env://) over Comm.
template <class Comm>
bool run_process(const Options& options) {
  typename Comm::options_type comm_options;
  comm_options.timeout = std::chrono::seconds(600);
  auto comm = tandem::init_process_group<Comm>("env://", comm_options);
  const bool ok = dispatch(comm, options, false);
  comm.barrier();
  return ok;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse(argc, argv);
  try {
    bool ok = false;
    if (options.backend == "local") {
      std::vector<char> done(static_cast<std::size_t>(options.ranks), 0);
      tandem::run_local(
          options.ranks,
          [&](tandem::LocalComm& comm) {
            done[static_cast<std::size_t>(comm.rank())] = dispatch(comm, options, true) ? 1 : 0;
          },
          tandem::LocalCommOptions{std::chrono::seconds(600)});
      ok = std::all_of(done.begin(), done.end(), [](char d) { return d != 0; });
#if TANDEM_BENCH_GLOO
    } else if (options.backend == "gloo") {
      ok = run_process<tandem::GlooComm>(options);
#endif
#if TANDEM_BENCH_SHM
    } else if (options.backend == "shm") {
      ok = run_process<tandem::ShmComm>(options);
#endif
#if TANDEM_BENCH_MPI
    } else if (options.backend == "mpi") {
      auto comm = tandem::MpiComm::world();
      ok = dispatch(comm, options, false);
      comm.barrier();
#endif
    } else {
      std::fprintf(stderr, "zero_bench: backend %s is not built in\n", options.backend.c_str());
      return 2;
    }
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zero_bench: %s\n", e.what());
    return 1;
  }
}
