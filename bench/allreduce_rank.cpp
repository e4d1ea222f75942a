// bench/allreduce_rank - one rank of the multi-process all_reduce (sum, float32) benchmark: tandem
// beside the raw engine it wraps, run interleaved in the same processes on the same buffer.
//   tandemrun --standalone --nproc-per-node 2 bench_allreduce_rank --mode gloo --store-dir DIR
//   mpirun -n 2 --bind-to none bench_allreduce_rank --mode mpi
//   tandemrun --standalone --nproc-per-node 2 bench_allreduce_rank --mode shm
// Needs: Gloo (tandem::gloo) for --mode gloo, an MPI (tandem::mpi) for --mode mpi, Linux
// (tandem::shm) for --mode shm.
//
// Method (bench/run_allreduce.sh runs it and writes bench/results/allreduce-cpu.md): for every
// size, each implementation is first checked (ranks hold rank + 1, the sum must arrive) and warmed
// up; then `runs` rounds, each timing `iters` iterations of every implementation in turn (the
// order rotates from round to round). An iteration is the implementation's own barrier, then
// steady_clock around one in-place all_reduce. Each iteration's time is the maximum over the ranks
// (the collective is done when its last rank is); a run's time is the median of its iterations,
// and the reported time is the median of the run medians, with spread = slowest / fastest run.
// Rank 0 prints, per implementation and size:
//   RESULT <impl> <bytes> <ranks> <median_us> <spread> <fastest_run_us> <slowest_run_us>
//   RUNS <impl> <bytes> <run_median_us>...
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// tandem_use_built defines these only for the components a build has.
#ifndef TANDEM_BENCH_GLOO
#define TANDEM_BENCH_GLOO 0
#endif
#ifndef TANDEM_BENCH_MPI
#define TANDEM_BENCH_MPI 0
#endif
#ifndef TANDEM_BENCH_SHM
#define TANDEM_BENCH_SHM 0
#endif

#if TANDEM_BENCH_GLOO
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#endif
#if TANDEM_BENCH_MPI
#include <mpi.h>
#endif

#if TANDEM_BENCH_GLOO
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"
#endif
#if TANDEM_BENCH_MPI
#include "tandem/comm/mpi/mpi.hpp"
#endif
#if TANDEM_BENCH_SHM
#include "tandem/comm/shm/shm.hpp"
#endif
#include "tandem/core/world.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

struct Settings {
  std::string mode;
  std::vector<std::string> impls;  // empty: every implementation of the mode
  std::vector<std::size_t> sizes{std::size_t{4} << 10, std::size_t{256} << 10, std::size_t{4} << 20,
                                 std::size_t{64} << 20};
  int runs = 5;
  int iters = 21;
  int warmup = 5;
  std::string store_dir = "/tmp";
  std::string mpi_thread = "multiple";
};

/// One way to all_reduce: its barrier and its in-place sum of `count` floats; `buffer`, where
/// set, gives the buffer of `count` floats it must run on (memory its communicator lent),
/// otherwise it runs on the buffer every implementation shares.
struct Impl {
  std::string name;
  std::function<void()> barrier;
  std::function<void(float*, std::size_t)> all_reduce;
  std::function<float*(std::size_t)> buffer = {};
  /// Where set, the implementation is a reference, not an all_reduce (memcpy): its check is
  /// this, on the buffer after one call, instead of the sum.
  std::function<bool(std::span<const float>)> verify = {};
  /// Where set, runs on the buffer before each timed call, outside the time (a backward pass
  /// writing the gradients: they are then in this rank's cache, not the reducer's).
  std::function<void(float*, std::size_t)> prepare = {};
};

/// What the timing loop needs from the job: who we are, and the maximum over ranks of a vector.
struct Job {
  int rank = 0;
  int size = 1;
  std::function<void(std::vector<double>&)> max_over_ranks;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : (values[mid - 1] + values[mid]) / 2.0;
}

std::vector<std::string> split_list(std::string_view text) {
  std::vector<std::string> items;
  while (!text.empty()) {
    const auto comma = text.find(',');
    items.emplace_back(text.substr(0, comma));
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
  }
  return items;
}

/// Ranks hold rank + 1: every element must come back as 1 + 2 + ... + size.
void check(Impl& impl, const Job& job, std::span<float> data) {
  std::fill(data.begin(), data.end(), static_cast<float>(job.rank + 1));
  impl.barrier();
  impl.all_reduce(data.data(), data.size());
  if (impl.verify) {
    if (impl.verify(data)) return;
    std::fprintf(stderr, "rank %d: %s: the buffer does not hold what it should\n", job.rank,
                 impl.name.c_str());
    std::exit(1);
  }
  const float expected = static_cast<float>(job.size * (job.size + 1) / 2);
  for (std::size_t i = 0; i < data.size(); ++i) {
    if (data[i] != expected) {
      std::fprintf(stderr, "rank %d: %s: element %zu is %g, expected %g\n", job.rank,
                   impl.name.c_str(), i, static_cast<double>(data[i]),
                   static_cast<double>(expected));
      std::exit(1);
    }
  }
}

void measure(std::vector<Impl>& impls, const Job& job, const Settings& settings) {
  for (const std::size_t bytes : settings.sizes) {
    const std::size_t count = bytes / sizeof(float);
    std::vector<float> shared(count);  // one buffer for every implementation: same pages
    auto buffer_of = [&](Impl& impl) {
      return std::span<float>(impl.buffer ? impl.buffer(count) : shared.data(), count);
    };
    for (auto& impl : impls) {
      const std::span<float> data = buffer_of(impl);
      check(impl, job, data);
      std::fill(data.begin(), data.end(), 0.0f);  // sums of zeros stay finite however many runs
      for (int i = 0; i < settings.warmup; ++i) {
        impl.barrier();
        impl.all_reduce(data.data(), count);
      }
    }
    std::vector<std::vector<double>> run_medians(impls.size());
    std::vector<double> samples(static_cast<std::size_t>(settings.iters));
    for (int run = 0; run < settings.runs; ++run) {
      for (std::size_t k = 0; k < impls.size(); ++k) {
        const std::size_t which = (static_cast<std::size_t>(run) + k) % impls.size();
        Impl& impl = impls[which];
        float* const data = buffer_of(impl).data();
        for (auto& sample : samples) {
          if (impl.prepare) impl.prepare(data, count);
          impl.barrier();
          const auto start = clock_type::now();
          impl.all_reduce(data, count);
          sample = std::chrono::duration<double, std::micro>(clock_type::now() - start).count();
        }
        job.max_over_ranks(samples);
        run_medians[which].push_back(median(samples));
      }
    }
    if (job.rank != 0) continue;
    for (std::size_t k = 0; k < impls.size(); ++k) {
      const auto& runs = run_medians[k];
      const auto [fastest, slowest] = std::minmax_element(runs.begin(), runs.end());
      std::printf("RESULT %s %zu %d %.3f %.4f %.3f %.3f\n", impls[k].name.c_str(), bytes, job.size,
                  median(runs), *slowest / *fastest, *fastest, *slowest);
      std::printf("RUNS %s %zu", impls[k].name.c_str(), bytes);
      for (const double r : runs) std::printf(" %.3f", r);
      std::printf("\n");
    }
    std::fflush(stdout);
  }
}

/// The implementations asked for, in the order asked; exits naming an unknown one.
std::vector<Impl> select(std::vector<Impl> all, const std::vector<std::string>& wanted) {
  if (wanted.empty()) return all;
  std::vector<Impl> chosen;
  for (const auto& name : wanted) {
    auto found =
        std::find_if(all.begin(), all.end(), [&](const Impl& i) { return i.name == name; });
    if (found == all.end()) {
      std::fprintf(stderr, "unknown implementation '%s' for this mode; known:", name.c_str());
      for (const auto& i : all) std::fprintf(stderr, " %s", i.name.c_str());
      std::fprintf(stderr, "\n");
      std::exit(2);
    }
    chosen.push_back(*found);
  }
  return chosen;
}

#if TANDEM_BENCH_GLOO
/// Under tandemrun (or torchrun): tandem-gloo with default options, tandem-gloo-nocheck
/// (check_collectives = false) and raw-gloo: gloo::allreduce on its own context, built as a plain
/// gloo program would (FileStore rendezvous, TCP device on the same interface as GlooComm's),
/// with the options GlooComm sets: one output buffer (in place), a sum reduce function, a tag,
/// the same timeout, gloo's default algorithm.
int run_gloo(const Settings& settings) {
  const tandem::World world = tandem::World::from_env();
  auto comm = tandem::init_process_group<tandem::GlooComm>();
  tandem::GlooCommOptions nocheck_options;
  nocheck_options.check_collectives = false;
  auto store = comm.store();
  auto nocheck = tandem::GlooComm::rendezvous(world, store, nocheck_options);

  ::gloo::transport::tcp::attr attr;
  if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME"); iface && *iface) {
    attr.iface = iface;
  } else {
    attr.hostname = "127.0.0.1";
  }
  auto device = ::gloo::transport::tcp::CreateDevice(attr);
  ::gloo::rendezvous::FileStore file_store(settings.store_dir);
  const char* run_id = std::getenv("TORCHELASTIC_RUN_ID");
  const char* port = std::getenv("MASTER_PORT");
  ::gloo::rendezvous::PrefixStore prefixed(
      std::string("bench-allreduce-") + (run_id ? run_id : "none") + "-" + (port ? port : "0"),
      file_store);
  auto context = std::make_shared<::gloo::rendezvous::Context>(world.rank, world.world_size);
  context->setTimeout(tandem::default_timeout);
  context->connectFullMesh(prefixed, device);
  std::uint32_t raw_tag = 0;
  using Function = void (*)(void*, const void*, const void*, std::size_t);

  std::vector<Impl> all;
  all.push_back({"tandem-gloo", [&] { comm.barrier(); },
                 [&](float* p, std::size_t n) {
                   comm.all_reduce(std::span<float>(p, n), tandem::ReduceOp::sum);
                 }});
  all.push_back({"tandem-gloo-nocheck", [&] { nocheck.barrier(); },
                 [&](float* p, std::size_t n) {
                   nocheck.all_reduce(std::span<float>(p, n), tandem::ReduceOp::sum);
                 }});
  all.push_back({"raw-gloo",
                 [&] {
                   ::gloo::BarrierOptions opts(context);
                   opts.setTag(raw_tag++);
                   opts.setTimeout(tandem::default_timeout);
                   ::gloo::barrier(opts);
                 },
                 [&](float* p, std::size_t n) {
                   ::gloo::AllreduceOptions opts(context);
                   opts.setOutput(p, n);
                   opts.setReduceFunction(static_cast<Function>(&::gloo::sum<float>));
                   opts.setTag(raw_tag++);
                   opts.setTimeout(tandem::default_timeout);
                   ::gloo::allreduce(opts);
                 }});
  auto impls = select(std::move(all), settings.impls);
  Job job{world.rank, world.world_size,
          [&](std::vector<double>& v) { comm.all_reduce(v, tandem::ReduceOp::max); }};
  measure(impls, job, settings);
  comm.barrier();
  return 0;
}
#endif

#if TANDEM_BENCH_MPI
/// Under mpirun: tandem-mpi (MpiComm::world(), sync all_reduce in place) and raw-mpi
/// (MPI_Allreduce with MPI_IN_PLACE on a duplicate of MPI_COMM_WORLD), in the same processes, so
/// both run at the thread level MpiComm asks for (MPI_THREAD_MULTIPLE). With --mpi-thread single
/// the program calls MPI_Init itself first (a plain MPI program's thread level).
int run_mpi(const Settings& settings) {
  const bool own_init = settings.mpi_thread == "single";
  if (own_init) MPI_Init(nullptr, nullptr);
  {
    auto comm = tandem::MpiComm::world();
    MPI_Comm raw = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);
    int rank = 0;
    int size = 1;
    MPI_Comm_rank(raw, &rank);
    MPI_Comm_size(raw, &size);
    const std::string suffix = own_init ? "-single" : "";

    std::vector<Impl> all;
    all.push_back({"tandem-mpi" + suffix, [&] { comm.barrier(); },
                   [&](float* p, std::size_t n) {
                     comm.all_reduce(std::span<float>(p, n), tandem::ReduceOp::sum);
                   }});
    all.push_back({"raw-mpi" + suffix, [&] { MPI_Barrier(raw); },
                   [&](float* p, std::size_t n) {
                     MPI_Allreduce(MPI_IN_PLACE, p, static_cast<int>(n), MPI_FLOAT, MPI_SUM, raw);
                   }});
    // Under MPI_THREAD_SINGLE MpiComm polls (see tandem/comm/mpi/mpi.hpp): only raw-mpi by default.
    std::vector<std::string> wanted;
    for (const auto& name : settings.impls) wanted.push_back(name + suffix);
    if (own_init && wanted.empty()) wanted.push_back("raw-mpi" + suffix);
    auto impls = select(std::move(all), wanted);
    Job job{rank, size, [&](std::vector<double>& v) {
              MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_DOUBLE, MPI_MAX,
                            raw);
            }};
    measure(impls, job, settings);
    MPI_Comm_free(&raw);
  }
  if (own_init) MPI_Finalize();
  return 0;
}
#endif

#if TANDEM_BENCH_SHM
/// Under tandemrun: tandem-shm, ShmComm's in-place all_reduce with its default options (the ranks
/// of one host meeting in shared memory) on a buffer of the program's, tandem-shm-segment, the
/// same on a buffer in the group's shared memory (ShmComm::allocate_shared: each rank reduces
/// its share from the peers' buffers, no copy in; how DistributedDataParallel's gradients are
/// reduced), tandem-shm-segment-spin (the same on a group whose waiters poll 50 us before they
/// sleep), memcpy-in-run (rank 0 copies the bytes with one thread while the others wait: the
/// single-thread memcpy reference, interleaved in the same run) and tandem-shm-nospin,
/// tandem-shm with options.spin and options.yield = 0 (waiters sleep on the futex at once, as
/// before the yield existed). bench_allreduce has
/// tandem-local (threads) and memcpy in a process of their own.
int run_shm(const Settings& settings) {
  const tandem::World world = tandem::World::from_env();
  auto comm = tandem::init_process_group<tandem::ShmComm>();
  auto store = comm.store();
  auto sleeper = tandem::ShmComm::rendezvous(
      world, store, {.spin = std::chrono::microseconds(0), .yield = std::chrono::microseconds(0)});
  // One block for every size, allocated (collectively) only where tandem-shm-segment runs.
  const bool segment_wanted = settings.impls.empty() ||
                              std::find(settings.impls.begin(), settings.impls.end(),
                                        "tandem-shm-segment") != settings.impls.end() ||
                              std::find(settings.impls.begin(), settings.impls.end(),
                                        "tandem-shm-segment-written") != settings.impls.end();
  // tandem-shm-segment-spin: the same on a group whose waiters poll for 50 us before they sleep
  // (ShmComm's default only where there are 4 CPUs per rank).
  auto spinner = tandem::ShmComm::rendezvous(world, store, {.spin = std::chrono::microseconds(50)});
  tandem::SharedBlock spin_block;
  if (settings.impls.empty() || std::find(settings.impls.begin(), settings.impls.end(),
                                          "tandem-shm-segment-spin") != settings.impls.end()) {
    spin_block =
        spinner.allocate_shared(*std::max_element(settings.sizes.begin(), settings.sizes.end()));
  }
  tandem::SharedBlock block;
  if (segment_wanted) {
    const std::size_t largest = *std::max_element(settings.sizes.begin(), settings.sizes.end());
    block = comm.allocate_shared(largest);
    if (!block) {
      std::fprintf(stderr,
                   "rank %d: tandem-shm-segment: /dev/shm has no room for %zu bytes per "
                   "rank\n",
                   world.rank, largest);
      return 1;
    }
  }
  std::vector<Impl> all;
  all.push_back({"tandem-shm", [&] { comm.barrier(); },
                 [&](float* p, std::size_t n) {
                   comm.all_reduce(std::span<float>(p, n), tandem::ReduceOp::sum);
                 }});
  all.push_back({"tandem-shm-segment", [&] { comm.barrier(); },
                 [&](float* p, std::size_t n) {
                   comm.all_reduce(std::span<float>(p, n), tandem::ReduceOp::sum);
                 },
                 [&](std::size_t) { return reinterpret_cast<float*>(block.data); }});
  // The same, where each rank writes its whole tensor before each call (untimed), as a backward
  // pass writes the gradients: the reducer then reads the peers' shares from their caches.
  all.push_back({"tandem-shm-segment-written",
                 [&] { comm.barrier(); },
                 [&](float* p, std::size_t n) {
                   comm.all_reduce(std::span<float>(p, n), tandem::ReduceOp::sum);
                 },
                 [&](std::size_t) { return reinterpret_cast<float*>(block.data); },
                 {},
                 [](float* p, std::size_t n) { std::fill(p, p + n, 0.0f); }});
  all.push_back({"tandem-shm-segment-spin", [&] { spinner.barrier(); },
                 [&](float* p, std::size_t n) {
                   spinner.all_reduce(std::span<float>(p, n), tandem::ReduceOp::sum);
                 },
                 [&](std::size_t) { return reinterpret_cast<float*>(spin_block.data); }});
  // The reference in the same run: rank 0 copies the bytes with one thread (memcpy from a
  // buffer of its own), the other ranks wait at the barrier; the time is rank 0's.
  std::vector<float> source;
  all.push_back({"memcpy-in-run",
                 [&] { comm.barrier(); },
                 [&](float* p, std::size_t n) {
                   if (world.rank != 0) return;
                   if (source.size() < n) source.assign(n, 3.0f);
                   std::memcpy(p, source.data(), n * sizeof(float));
                 },
                 {},
                 [&](std::span<const float> data) {
                   return world.rank != 0 ||
                          std::all_of(data.begin(), data.end(), [](float x) { return x == 3.0f; });
                 }});
  all.push_back({"tandem-shm-nospin", [&] { sleeper.barrier(); },
                 [&](float* p, std::size_t n) {
                   sleeper.all_reduce(std::span<float>(p, n), tandem::ReduceOp::sum);
                 }});
  auto impls = select(std::move(all), settings.impls);
  Job job{world.rank, world.world_size,
          [&](std::vector<double>& v) { comm.all_reduce(v, tandem::ReduceOp::max); }};
  measure(impls, job, settings);
  comm.barrier();
  return 0;
}
#endif

int usage(const char* program) {
  std::fprintf(
      stderr,
      "usage: %s --modes | --mode gloo|mpi|shm [--impls a,b] [--sizes BYTES,...] [--runs N] "
      "[--iters N] [--warmup N] [--store-dir DIR] [--mpi-thread multiple|single]\n",
      program);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string_view(argv[1]) == "--modes") {  // what this build can run
    std::printf("%s%s%s\n", TANDEM_BENCH_GLOO ? "gloo " : "", TANDEM_BENCH_MPI ? "mpi " : "",
                TANDEM_BENCH_SHM ? "shm" : "");
    return 0;
  }
  Settings settings;
  for (int i = 1; i < argc; i += 2) {
    const std::string_view flag = argv[i];
    if (i + 1 >= argc) return usage(argv[0]);
    const std::string value = argv[i + 1];
    if (flag == "--mode") {
      settings.mode = value;
    } else if (flag == "--impls") {
      settings.impls = split_list(value);
    } else if (flag == "--sizes") {
      settings.sizes.clear();
      for (const auto& s : split_list(value)) settings.sizes.push_back(std::stoull(s));
    } else if (flag == "--runs") {
      settings.runs = std::stoi(value);
    } else if (flag == "--iters") {
      settings.iters = std::stoi(value);
    } else if (flag == "--warmup") {
      settings.warmup = std::stoi(value);
    } else if (flag == "--store-dir") {
      settings.store_dir = value;
    } else if (flag == "--mpi-thread") {
      settings.mpi_thread = value;
    } else {
      return usage(argv[0]);
    }
  }
  if (settings.runs < 1 || settings.iters < 1 || settings.warmup < 0) return usage(argv[0]);
  try {
#if TANDEM_BENCH_GLOO
    if (settings.mode == "gloo") return run_gloo(settings);
#endif
#if TANDEM_BENCH_MPI
    if (settings.mode == "mpi") return run_mpi(settings);
#endif
#if TANDEM_BENCH_SHM
    if (settings.mode == "shm") return run_shm(settings);
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_allreduce_rank: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "mode '%s' is not built in (gloo: %d, mpi: %d)\n", settings.mode.c_str(),
               TANDEM_BENCH_GLOO, TANDEM_BENCH_MPI);
  return usage(argv[0]);
}
