// bench/ddp_overlap - how much of DistributedDataParallel's communication the `overlap` policy
// hides behind the backward pass, on 2 ranks, for LocalComm, GlooComm and MpiComm.
//   ddp_overlap local [options]                      (2 threads of this process)
//   tandemrun --standalone --nproc-per-node 2 ddp_overlap gloo [options]
//   mpirun -n 2 --bind-to none ddp_overlap mpi [options]
// Options: --layers L (8) --layer-elements E (262144 floats) --ratio R (1.5: compute per step
// is calibrated to R x the communication time) --rounds N (31) --bucket-mib M (1: bucket_cap).
//
// The synthetic model: L layers of E float parameters. Its backward visits the layers from last
// to first; for each it computes the layer's gradient with real arithmetic (a chain of
// multiply-adds per element, `work` steps long, written to the layer's slice of the flat gradient
// buffer) and then marks the layer ready. Measured, interleaved round by round (each timing is the
// slowest rank's, between barriers):
//   compute   the backward alone (no DistributedDataParallel involved);
//   comm      marking everything ready and finish_gradient_sync() with no compute: the
//             communication alone (sync_at_end, same buckets);
//   overlap   backward + grad_ready per layer + finish_gradient_sync(), policy overlap;
//   sync_end  the same with policy sync_at_end.
// Exposed communication = step - compute, as a fraction of comm, computed within each round and
// reported as the median over rounds (the times printed are medians too). Prints RESULT lines.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tandem/comm/local/local.hpp"
#include "tandem/ddp/ddp.hpp"
#if TANDEM_BENCH_GLOO
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"
#endif
#if TANDEM_BENCH_MPI
#include "tandem/comm/mpi/mpi.hpp"
#endif

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string backend;
  std::size_t layers = 8;
  std::size_t layer_elements = 262144;
  double ratio = 1.5;
  int rounds = 31;
  std::size_t bucket_mib = 1;
  bool sleep = false;  // --compute sleep: the backward sleeps instead of computing
};

/// One layer's gradient: `work` vectorisable multiply-add sweeps over it, seeded by the values.
void layer_backward(const float* values, float* grads, std::size_t n, int work) {
  for (std::size_t i = 0; i < n; ++i) grads[i] = values[i];
  for (int k = 0; k < work; ++k) {
    for (std::size_t i = 0; i < n; ++i) grads[i] = grads[i] * 0.9999f + 0.0001f;
  }
}

template <class Comm>
double slowest(Comm& comm, double seconds) {
  std::vector<double> value{seconds};
  comm.all_reduce(value, tandem::ReduceOp::max);
  return value[0];
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class Comm, std::size_t BucketBytes>
void run(Comm& comm, const Options& options) {
  const std::size_t layers = options.layers;
  const std::size_t e = options.layer_elements;
  tandem::Parameters<float> params;
  std::vector<tandem::Parameters<float>::Parameter*> layer;
  for (std::size_t l = 0; l < layers; ++l) {
    layer.push_back(
        &params.add("layer" + std::to_string(l) + ".weight", {static_cast<std::int64_t>(e)}));
  }
  params.finalize();
  for (std::size_t i = 0; i < params.numel(); ++i) {
    params.values()[i] = static_cast<float>(i % 1000) * 1e-3f;
  }
  tandem::DistributedDataParallel<Comm, tandem::overlap, tandem::bucket_cap<BucketBytes>> overlap(
      comm, params);
  tandem::DistributedDataParallel<Comm, tandem::sync_at_end, tandem::bucket_cap<BucketBytes>>
      at_end(comm, params);

  int work = 1;  // arithmetic sweeps per layer, or microseconds of sleep per layer
  auto backward = [&](auto&& ready) {
    for (std::size_t l = layers; l-- > 0;) {
      if (options.sleep) {
        std::this_thread::sleep_for(std::chrono::microseconds(work));
      } else {
        layer_backward(layer[l]->value().data(), layer[l]->grad().data(), e, work);
      }
      ready(*layer[l]);
    }
  };
  auto timed = [&](auto&& body) {
    comm.barrier();
    const auto start = Clock::now();
    body();
    return slowest(comm, std::chrono::duration<double>(Clock::now() - start).count());
  };
  auto comm_alone = [&] {
    return timed([&] {
      for (auto* p : layer) at_end.grad_ready(*p);
      at_end.finish_gradient_sync();
    });
  };
  auto compute_alone = [&] { return timed([&] { backward([](auto&) {}); }); };
  auto step = [&](auto& ddp) {
    return timed([&] {
      backward([&](auto& p) { ddp.grad_ready(p); });
      ddp.finish_gradient_sync();
    });
  };

  // Calibration: the communication time, then `work` such that compute = ratio x comm. Rank 0's
  // value is used everywhere (timed() already returns the slowest rank's time).
  for (int i = 0; i < 3; ++i) (void)comm_alone();
  std::vector<double> samples;
  for (int i = 0; i < 7; ++i) samples.push_back(comm_alone());
  const double comm_estimate = median(samples);
  // compute(work) = fixed + slope * work (memory traffic + arithmetic), fitted at two points.
  auto compute_at = [&](int w) {
    work = w;
    std::vector<double> times;
    for (int i = 0; i < 5; ++i) times.push_back(compute_alone());
    return median(times);
  };
  const int low_work = options.sleep ? 100 : 1;
  const int high_work = options.sleep ? 1000 : 16;
  const double low = compute_at(low_work);
  const double high = compute_at(high_work);
  const double slope = std::max(1e-12, (high - low) / (high_work - low_work));
  const double fixed = std::max(0.0, low - low_work * slope);
  std::vector<double> chosen{std::max(1.0, (options.ratio * comm_estimate - fixed) / slope)};
  comm.broadcast(chosen, 0);
  work = static_cast<int>(chosen[0]);
  if (comm.rank() == 0) {
    std::fprintf(stderr,
                 "calibration: comm %.3f ms, compute %.3f ms at work %d, %.3f ms at %d: work %d\n",
                 comm_estimate * 1e3, low * 1e3, low_work, high * 1e3, high_work, work);
  }

  for (int i = 0; i < 2; ++i) {
    (void)step(overlap);
    (void)step(at_end);
  }
  std::vector<double> t_compute, t_comm, t_overlap, t_end;
  for (int r = 0; r < options.rounds; ++r) {
    // Rotate the order so no variant always runs right after another.
    for (int k = 0; k < 4; ++k) {
      switch ((k + r) % 4) {
        case 0:
          t_compute.push_back(compute_alone());
          break;
        case 1:
          t_comm.push_back(comm_alone());
          break;
        case 2:
          t_overlap.push_back(step(overlap));
          break;
        default:
          t_end.push_back(step(at_end));
          break;
      }
    }
  }
  // The exposed fraction per round, from the four timings of that round (the load of a shared
  // machine drifts between rounds more than within one), then its median.
  std::vector<double> exposed_overlap_rounds, exposed_end_rounds;
  for (int r = 0; r < options.rounds; ++r) {
    const auto i = static_cast<std::size_t>(r);
    exposed_overlap_rounds.push_back((t_overlap[i] - t_compute[i]) / t_comm[i]);
    exposed_end_rounds.push_back((t_end[i] - t_compute[i]) / t_comm[i]);
  }
  if (comm.rank() != 0) return;
  const double compute = median(t_compute);
  const double communication = median(t_comm);
  const double with_overlap = median(t_overlap);
  const double with_end = median(t_end);
  std::printf(
      "RESULT backend=%s compute=%s ranks=%d layers=%zu layer_mib=%.2f buckets=%zu work=%d "
      "rounds=%d "
      "compute_ms=%.3f comm_ms=%.3f overlap_ms=%.3f sync_at_end_ms=%.3f "
      "exposed_overlap=%.3f exposed_sync_at_end=%.3f\n",
      options.backend.c_str(), options.sleep ? "sleep" : "arithmetic", comm.size(), layers,
      static_cast<double>(e * sizeof(float)) / (1 << 20), overlap.buckets().size(), work,
      options.rounds, compute * 1e3, communication * 1e3, with_overlap * 1e3, with_end * 1e3,
      median(exposed_overlap_rounds), median(exposed_end_rounds));
  std::fflush(stdout);
}

template <class Comm>
void dispatch(Comm& comm, const Options& options) {
  switch (options.bucket_mib) {
    case 4:
      run<Comm, std::size_t{4} << 20>(comm, options);
      break;
    case 25:
      run<Comm, std::size_t{25} << 20>(comm, options);
      break;
    default:
      run<Comm, std::size_t{1} << 20>(comm, options);
      break;
  }
}

Options parse(int argc, char** argv) {
  Options options;
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: ddp_overlap local|gloo|mpi [--layers L] [--layer-elements E] "
                 "[--ratio R] [--rounds N] [--bucket-mib 1|4|25] [--compute arithmetic|sleep]\n");
    std::exit(2);
  }
  options.backend = argv[1];
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* value = argv[i + 1];
    if (flag == "--layers") {
      options.layers = std::strtoul(value, nullptr, 10);
    } else if (flag == "--layer-elements") {
      options.layer_elements = std::strtoul(value, nullptr, 10);
    } else if (flag == "--ratio") {
      options.ratio = std::strtod(value, nullptr);
    } else if (flag == "--rounds") {
      options.rounds = std::atoi(value);
    } else if (flag == "--compute") {
      options.sleep = std::string(value) == "sleep";
    } else if (flag == "--bucket-mib") {
      options.bucket_mib = std::strtoul(value, nullptr, 10);
    } else {
      std::fprintf(stderr, "unknown option %s\n", flag.c_str());
      std::exit(2);
    }
  }
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse(argc, argv);
  try {
    if (options.backend == "local") {
      tandem::run_local(2, [&](tandem::LocalComm& comm) { dispatch(comm, options); });
#if TANDEM_BENCH_GLOO
    } else if (options.backend == "gloo") {
      auto comm = tandem::init_process_group<tandem::GlooComm>();
      dispatch(comm, options);
#endif
#if TANDEM_BENCH_MPI
    } else if (options.backend == "mpi") {
      auto comm = tandem::MpiComm::world();
      dispatch(comm, options);
#endif
    } else {
      std::fprintf(stderr, "backend %s is not built in\n", options.backend.c_str());
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_overlap: %s\n", e.what());
    return 1;
  }
  return 0;
}
