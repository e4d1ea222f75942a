// DistributedDataParallel on device arenas over NcclComm (one thread per GPU of this process,
// through run_local_nccl): the broadcast at construction, average and sum, unused parameters,
// float and half gradients, compress<half>, overlap and sync_at_end. Without a GPU it prints why
// and exits 77 (skipped); it still proves that DDP compiles for Space = device under nvcc.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "tandem/comm/nccl.hpp"
#include "tandem/cuda.hpp"
#include "tandem/ddp/ddp.hpp"

namespace {

std::mutex failures_mutex;
std::vector<std::string> failures;

void expect(bool ok, const std::string& what) {
  if (ok) return;
  std::lock_guard lock(failures_mutex);
  failures.push_back(what);
}

/// data[i] = base + step * (i % 7), in T.
template <class T>
struct fill_pattern {
  T* data;
  float base;
  float step;
  TANDEM_HD void operator()(std::size_t i) const {
    data[i] = T(base + step * static_cast<float>(i % 7));
  }
};

template <class T>
std::vector<float> to_host(tandem::View<T, tandem::device> view) {
  std::vector<T> raw(view.size());
  tandem::cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  tandem::cuda::check(
      cudaMemcpy(raw.data(), view.data(), view.size_bytes(), cudaMemcpyDeviceToHost), "cudaMemcpy");
  std::vector<float> out(raw.size());
  for (std::size_t i = 0; i < raw.size(); ++i) out[i] = static_cast<float>(raw[i]);
  return out;
}

/// One step on every rank: parameter "a" marked ready, "b" left unused (garbage that must count
/// as zero). Gradients are rank-dependent small integers, exact in every element type.
template <class T, class... Policies>
void check_step(tandem::NcclComm& comm, const char* label) {
  using config = tandem::detail::ddp_config<Policies...>;
  const tandem::cuda_exec exec{};
  const int me = comm.rank();
  const int n = comm.size();
  tandem::Parameters<T, tandem::device> params;
  auto& a = params.add("a", {1000});
  auto& b = params.add("b", {37});
  auto& stats = params.add_buffer("stats", {5});
  params.finalize(exec);
  tandem::for_each_index(exec, params.numel(),
                         fill_pattern<T>{params.values().data(), static_cast<float>(me), 1.0f});
  tandem::for_each_index(exec, stats.size(),
                         fill_pattern<T>{stats.value().data(), 10.0f * me, 0.5f});
  exec.synchronize();

  tandem::DistributedDataParallel<tandem::NcclComm, Policies...> ddp(comm, params, exec);
  const auto values = to_host(params.values());
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (values[i] != static_cast<float>(i % 7)) {
      expect(false, std::string(label) + ": values were not broadcast from rank 0");
      break;
    }
  }
  ddp.before_forward();
  const auto buffers = to_host(stats.value());
  expect(buffers[1] == 0.5f, std::string(label) + ": buffers were not broadcast from rank 0");

  const float unit = static_cast<float>(n);  // so that the mean is an integer
  tandem::for_each_index(exec, a.size(), fill_pattern<T>{a.grad().data(), unit * (me + 1), unit});
  tandem::for_each_index(exec, b.size(), fill_pattern<T>{b.grad().data(), 1000.0f, 0.0f});
  ddp.grad_ready(a);
  ddp.finish_gradient_sync();
  const auto ga = to_host(a.grad());
  const auto gb = to_host(b.grad());
  for (std::size_t i = 0; i < ga.size(); ++i) {
    float want = 0.0f;
    for (int r = 0; r < n; ++r) want += unit * (r + 1) + unit * static_cast<float>(i % 7);
    if (config::averaged) want /= static_cast<float>(n);
    if (ga[i] != want) {
      expect(false, std::string(label) + ": a[" + std::to_string(i) +
                        "] = " + std::to_string(ga[i]) + ", expected " + std::to_string(want));
      break;
    }
  }
  expect(std::all_of(gb.begin(), gb.end(), [](float v) { return v == 0.0f; }),
         std::string(label) + ": the unused parameter was not reduced as zeros");
}

}  // namespace

int main() {
  const int devices = tandem::cuda::device_count();
  if (devices == 0) {
    std::printf("SKIPPED: no CUDA device (DDP on device arenas compiled, not run)\n");
    return 77;
  }
  const int n = std::min(devices, 4);
  try {
    tandem::run_local_nccl(n, [](tandem::NcclComm& comm) {
      check_step<float>(comm, "float, overlap, average");
      check_step<float, tandem::sync_at_end, tandem::sum>(comm, "float, sync_at_end, sum");
      check_step<tandem::half, tandem::bucket_cap<64>>(comm, "half, 64-byte buckets");
      check_step<tandem::bfloat16, tandem::sync_at_end>(comm, "bfloat16, sync_at_end");
      check_step<float, tandem::compress<tandem::half>, tandem::bucket_cap<256>>(
          comm, "float, compress<half>");
      check_step<double, tandem::compress<tandem::bfloat16>>(comm, "double, compress<bfloat16>");
    });
  } catch (const std::exception& e) {
    std::printf("FAILED: %s\n", e.what());
    return 1;
  }
  for (const auto& failure : failures) std::printf("FAILED: %s\n", failure.c_str());
  std::printf("%s: %d rank(s), %zu failure(s)\n", failures.empty() ? "PASSED" : "FAILED", n,
              failures.size());
  return failures.empty() ? 0 : 1;
}
