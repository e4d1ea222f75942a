// bench/nccl - what NcclComm adds to a raw ncclAllReduce at world size 1 (one GPU), sizes 4 B to
// 256 MiB, float32 sum in place. Both run side by side in one process on the same GPU,
// interleaved size by size and trial by trial: the raw call on a stream of its own, NcclComm's
// sync all_reduce on the caller's stream (impl=tandem, the default), and NcclComm with
// sync_on_caller_stream = false (impl=tandem_handoff: an event to the communicator's stream and
// one back per call, as PyTorch's ProcessGroupNCCL does). All are out of place, from a buffer of
// ones into a zeroed one, and each timing fails unless its output holds the ones (the calls
// really ran). Per size and implementation it prints the median over trials of
//   time_us   GPU time per call (CUDA events around `iters` back-to-back calls),
//   host_us   host time per call to issue them (what the calling thread spends),
//   algbw, busbw  nccl-tests' formulas: algbw = bytes / time; all_reduce busbw = algbw * 2(n-1)/n
//                 (0 at n = 1, printed so that multi-GPU runs compare directly with nccl-tests),
// then the differences (tandem - raw, tandem_handoff - raw). Output: RESULT lines (key=value).
//   bench_nccl [--max-bytes N] [--trials N] [--scale X]
// Exits 77 with a message where there is no GPU.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tandem/comm/nccl/nccl.hpp"
#include "tandem/cuda/runtime.hpp"
#include "tandem/cuda/stream.hpp"

namespace {

struct Sample {
  double gpu_us = 0;   ///< per call
  double host_us = 0;  ///< per call
};

struct Options {
  std::size_t max_bytes = std::size_t{256} << 20;
  int trials = 7;
  double scale = 1.0;
};

void check_nccl(ncclResult_t result, const char* what) {
  if (result != ncclSuccess) {
    throw tandem::Error(what, std::string(ncclGetErrorString(result)));
  }
}

/// Calls per timing: many for small sizes (where overhead shows), few for large ones.
int iterations_for(std::size_t bytes, double scale) {
  int iters = 2000;
  if (bytes >= (std::size_t{1} << 20)) iters = 200;
  if (bytes >= (std::size_t{16} << 20)) iters = 40;
  if (bytes >= (std::size_t{128} << 20)) iters = 10;
  return std::max(2, static_cast<int>(iters * scale));
}

/// Times `iters` calls of issue() queued on `stream`: GPU time between two events, host time
/// to issue them.
template <class Issue>
Sample time_calls(cudaStream_t stream, int iters, Issue issue) {
  tandem::cuda::Event start(tandem::cuda::Event::timing::on);
  tandem::cuda::Event stop(tandem::cuda::Event::timing::on);
  tandem::cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  start.record(stream);
  const auto host_start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) issue();
  const auto host_end = std::chrono::steady_clock::now();
  stop.record(stream);
  stop.synchronize();
  Sample sample;
  sample.gpu_us = 1000.0 * stop.elapsed_ms_since(start) / iters;
  sample.host_us = std::chrono::duration<double, std::micro>(host_end - host_start).count() / iters;
  return sample;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
}

void report(const char* impl, std::size_t bytes, int ranks, int iters, double gpu_us,
            double host_us) {
  const double algbw = gpu_us > 0 ? static_cast<double>(bytes) / (gpu_us * 1e3) : 0;  // GB/s
  const double busbw = algbw * 2.0 * (ranks - 1) / ranks;
  std::printf(
      "RESULT bench=nccl_all_reduce impl=%s ranks=%d size_bytes=%zu iters=%d time_us=%.3f "
      "host_us=%.3f algbw_GBps=%.3f busbw_GBps=%.3f\n",
      impl, ranks, bytes, iters, gpu_us, host_us, algbw, busbw);
}

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--max-bytes") {
      options.max_bytes = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (flag == "--trials") {
      options.trials = std::max(1, std::atoi(argv[i + 1]));
    } else if (flag == "--scale") {
      options.scale = std::atof(argv[i + 1]);
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      std::exit(2);
    }
  }
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse(argc, argv);
  if (tandem::cuda::device_count() == 0) {
    std::printf("SKIPPED: no CUDA device (bench_nccl measures NCCL on a GPU)\n");
    return 77;
  }
  try {
    tandem::cuda::check(cudaSetDevice(0), "cudaSetDevice");
    int version = 0;
    check_nccl(ncclGetVersion(&version), "ncclGetVersion");
    cudaDeviceProp properties{};
    tandem::cuda::check(cudaGetDeviceProperties(&properties, 0), "cudaGetDeviceProperties");
    std::printf("# device: %s, NCCL %s, world size 1\n", properties.name,
                tandem::detail::nccl::version_text(version).c_str());

    // Raw NCCL: a blocking communicator (NCCL's default) on a stream of its own.
    ncclComm_t raw = nullptr;
    ncclUniqueId raw_id{};
    check_nccl(ncclGetUniqueId(&raw_id), "ncclGetUniqueId");
    check_nccl(ncclCommInitRank(&raw, 1, raw_id, 0), "ncclCommInitRank");
    tandem::cuda::Stream raw_stream;

    // tandem: NcclComm ordered on a caller stream of its own; once as it comes, once with the
    // event handoff to its own stream that sync operations made before (and PyTorch makes).
    tandem::NcclComm comm = tandem::NcclComm::create(tandem::NcclComm::unique_id(), 0, 1);
    tandem::cuda::Stream caller;
    comm.use_stream(caller.get());
    tandem::NcclCommOptions handoff_options;
    handoff_options.sync_on_caller_stream = false;
    tandem::NcclComm handoff =
        tandem::NcclComm::create(tandem::NcclComm::unique_id(), 0, 1, handoff_options);
    tandem::cuda::Stream handoff_caller;
    handoff.use_stream(handoff_caller.get());

    float* buffer = nullptr;
    float* output = nullptr;
    tandem::cuda::check(cudaMalloc(&buffer, options.max_bytes), "cudaMalloc");
    tandem::cuda::check(cudaMalloc(&output, options.max_bytes), "cudaMalloc");
    {
      const std::vector<float> ones(options.max_bytes / sizeof(float), 1.0f);
      tandem::cuda::check(
          cudaMemcpy(buffer, ones.data(), options.max_bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    }
    // The output of the timed calls: zeroed before, all ones after (first and last element).
    const auto clear_output = [&](std::size_t bytes) {
      tandem::cuda::check(cudaMemset(output, 0, bytes), "cudaMemset");
      tandem::cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    };
    const auto expect_output = [&](const char* impl, std::size_t bytes) {
      tandem::cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      float first = 0, last = 0;
      tandem::cuda::check(cudaMemcpy(&first, output, sizeof(float), cudaMemcpyDeviceToHost),
                          "cudaMemcpy");
      tandem::cuda::check(cudaMemcpy(&last, output + bytes / sizeof(float) - 1, sizeof(float),
                                     cudaMemcpyDeviceToHost),
                          "cudaMemcpy");
      if (first != 1.0f || last != 1.0f) {
        throw tandem::Error("bench_nccl", std::string(impl) + " at " + std::to_string(bytes) +
                                              " bytes did not write its output: the timed calls "
                                              "did not run");
      }
    };

    for (std::size_t bytes = 4; bytes <= options.max_bytes; bytes *= 4) {
      const std::size_t count = bytes / sizeof(float);
      const int iters = iterations_for(bytes, options.scale);
      const tandem::View<const float, tandem::device> in(buffer, count);
      const tandem::View<float, tandem::device> out(output, count);
      auto raw_call = [&] {
        check_nccl(
            ncclAllReduce(buffer, output, count, ncclFloat32, ncclSum, raw, raw_stream.get()),
            "ncclAllReduce");
      };
      auto tandem_call = [&] { comm.all_reduce(in, out, tandem::ReduceOp::sum); };
      auto handoff_call = [&] { handoff.all_reduce(in, out, tandem::ReduceOp::sum); };
      // Warm up (NCCL sets up its channels on first use).
      (void)time_calls(raw_stream.get(), 5, raw_call);
      (void)time_calls(caller.get(), 5, tandem_call);
      (void)time_calls(handoff_caller.get(), 5, handoff_call);
      struct Series {
        const char* impl;
        cudaStream_t stream;
        std::function<void()> call;
        std::vector<double> gpu, host;
      };
      std::vector<Series> series{{"raw_nccl", raw_stream.get(), raw_call, {}, {}},
                                 {"tandem", caller.get(), tandem_call, {}, {}},
                                 {"tandem_handoff", handoff_caller.get(), handoff_call, {}, {}}};
      for (int trial = 0; trial < options.trials; ++trial) {
        for (Series& s : series) {
          clear_output(bytes);
          const Sample sample = time_calls(s.stream, iters, s.call);
          expect_output(s.impl, bytes);
          s.gpu.push_back(sample.gpu_us);
          s.host.push_back(sample.host_us);
        }
      }
      const double rg = median(series[0].gpu), rh = median(series[0].host);
      for (Series& s : series) report(s.impl, bytes, 1, iters, median(s.gpu), median(s.host));
      for (std::size_t i = 1; i < series.size(); ++i) {
        std::printf(
            "RESULT bench=nccl_all_reduce impl=overhead of=%s ranks=1 size_bytes=%zu "
            "added_time_us=%.3f added_host_us=%.3f\n",
            series[i].impl, bytes, median(series[i].gpu) - rg, median(series[i].host) - rh);
      }
      std::fflush(stdout);
    }
    comm.synchronize();
    handoff.synchronize();
    tandem::cuda::check(cudaFree(buffer), "cudaFree");
    tandem::cuda::check(cudaFree(output), "cudaFree");
    check_nccl(ncclCommDestroy(raw), "ncclCommDestroy");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_nccl: %s\n", e.what());
    return 1;
  }
  return 0;
}
