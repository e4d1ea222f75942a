// torch_resnet_cuda: the CUDA build of examples/torch_resnet (the same program, torch_resnet.hpp):
// the module and batches on each rank's GPU, tandem::torch::DistributedDataParallel over NcclComm
// (buckets on libtorch's stream, overlapping the backward), SyncBatchNorm over NCCL, the forward
// under autocast fp16 and tandem's GradScaler on the device arena (a step with an inf or NaN
// gradient is skipped on every rank), SGD and EMA on the GPU, the same checkpoints.
//   build/release/tools/tandemrun --standalone --nproc-per-node 2
//       build/release/examples/torch_resnet/torch_resnet_cuda --epochs 3   (one line) 2 GPUs
//   build/release/examples/torch_resnet/torch_resnet_cuda --epochs 1      one GPU, one rank
// Flags: torch_resnet's (--backend is nccl, the only one here; --ranks is not used).
// Built where libtorch has CUDA (PyTorch's wheel: CMAKE_PREFIX_PATH from
// python3 -c 'import torch; print(torch.utils.cmake_prefix_path)'); exits 77 (skipped) without a
// GPU. NCCL refuses two ranks on one GPU: on a one-GPU machine run one rank.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "tandem/comm/init.hpp"
#include "tandem/comm/nccl/nccl.hpp"
#include "tandem/core/world.hpp"
#include "tandem/cuda.hpp"
#include "tandem/torch/cuda.hpp"
#include "torch_resnet.hpp"

namespace {

/// train()'s Placement for CUDA: the communicator's GPU, autocast fp16 with a GradScaler.
struct OnCuda {
  static constexpr bool mixed_precision = true;
  static torch::Device device(const tandem::NcclComm& comm) {
    return {torch::kCUDA, static_cast<c10::DeviceIndex>(comm.device())};
  }
  /// Autocast to fp16 on CUDA for the guard's life (torch.autocast("cuda")), its cast cache
  /// cleared at the end as PyTorch's context manager does.
  struct Autocast {
    Autocast() {
      at::autocast::set_autocast_dtype(at::kCUDA, at::kHalf);
      at::autocast::set_autocast_enabled(at::kCUDA, true);
    }
    Autocast(const Autocast&) = delete;
    Autocast& operator=(const Autocast&) = delete;
    ~Autocast() {
      at::autocast::set_autocast_enabled(at::kCUDA, false);
      at::autocast::clear_cache();
    }
  };
  static Autocast autocast() { return {}; }
};

}  // namespace

int main(int argc, char** argv) {
  const auto settings = torch_resnet::parse(argc, argv);
  if (!settings) return torch_resnet::usage();
  if (settings->backend != "nccl" && settings->backend != examples::default_cpu_backend()) {
    std::fprintf(stderr, "torch_resnet_cuda: backend '%s': this build trains over NCCL only\n",
                 settings->backend.c_str());
    return torch_resnet::usage();
  }
  if (settings->elastic) {
    std::fprintf(
        stderr,
        "torch_resnet_cuda: --elastic: NcclComm cannot heal in this slice (docs/elastic.md, "
        "Backends); use tandemrun --max-restarts with --checkpoint-dir and --resume\n");
    return torch_resnet::usage();
  }
  if (tandem::cuda::device_count() == 0) {
    std::printf("torch_resnet_cuda: SKIPPED: no CUDA device here (no driver, or no GPU)\n");
    return 77;
  }
  const auto timeout = std::chrono::seconds(settings->timeout_seconds);
  return tandem::run_main([&]() -> int {
    const auto world = tandem::World::from_env();
    const int gpu = tandem::cuda::select_device(world);
    tandem::NcclCommOptions options;
    options.timeout = timeout;
    options.device = gpu;
    // Without a launcher (one rank) no rendezvous is needed: a fresh id makes the group.
    auto comm = std::getenv("WORLD_SIZE")
                    ? tandem::init_process_group<tandem::NcclComm>(world, "env://", options)
                    : tandem::NcclComm::create(tandem::NcclComm::unique_id(), 0, 1, options);
    const double accuracy = torch_resnet::train<OnCuda>(comm, *settings);
    comm.synchronize();
    if (!std::isfinite(accuracy)) return 1;
    if (100 * accuracy < settings->min_accuracy) {
      std::fprintf(stderr,
                   "torch_resnet_cuda: test accuracy %.2f %% is below --min-accuracy %.2f\n",
                   100 * accuracy, settings->min_accuracy);
      return 1;
    }
    return 0;
  });
}
