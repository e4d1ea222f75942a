// torch_resnet: a libtorch model trained across ranks with tandem, the way a PyTorch user's script
// does it. A small ResNet for Fashion-MNIST (a stride-2 stem and three residual blocks of widths
// w, 2w, 4w, BatchNorm after every convolution, global average pooling, a linear head; w = 24:
// 174 k parameters) written with torch::nn; tandem::torch::DistributedDataParallel with overlap
// (autograd's hooks start each bucket's all_reduce during backward), SyncBatchNorm through
// convert_sync_batchnorm, the DistributedSampler with set_epoch and the Loader, tandem's SGD with
// momentum in two kinds of param group (weight decay on conv and linear weights, none on BatchNorm
// and biases), warm-up + cosine, an EMA of the weights evaluated at each epoch's end, distributed
// evaluation (the correct counts summed over ranks), rank-0 progress and TensorBoard, a checkpoint
// every epoch (and every --checkpoint-every steps) and --resume. Rank 0's last line states the
// test accuracy; --min-accuracy makes the run fail unless it trained.
//   build/release/tools/tandemrun --standalone --nproc-per-node 2
//       build/release/examples/torch_resnet/torch_resnet --epochs 3   (one line) shared memory
//       (the default CPU backend: HierarchicalComm<ShmComm, GlooComm>; --backend gloo: plain Gloo)
//   build/release/examples/torch_resnet/torch_resnet --backend local --ranks 2   threads
//   mpirun -n 2 build/release/examples/torch_resnet/torch_resnet --backend mpi     MPI
// Flags: --epochs E --batch-size B (per rank) --lr LR --weight-decay WD --width W --seed S
//        --data DIR --init FILE (initial weights, safetensors under state_dict names)
//        --checkpoint-dir DIR --checkpoint-every N --resume --timeout SECONDS --workers W
//        --tensorboard DIR --max-steps N --min-accuracy PERCENT --no-sync-bn (BatchNorm per rank,
//        what PyTorch's DDP does on a CPU) --ranks N (local)
//        --elastic [--elastic-store file:///PATH] (under `tandemrun --elastic`: a lost rank does
//        not end the run; the survivors heal through tandem::Elastic, the bridge's DDP and the
//        SyncBatchNorms move onto the new group, and the epoch's rest is re-split over them;
//        under --max-restarts a lost worker's replacement joins the group and receives the
//        state; the set-up's collectives run in tandem::Elastic::start(), so a rank lost there
//        heals too; README.md, docs/libtorch.md "Elastic training")
//        --crash-in-setup (the tests, with --elastic: rank 1 kills itself in the set-up)
// One epoch (60 k images, batch 64 per rank) takes about a minute on 2 ranks of a 2-core machine:
// each rank runs libtorch on one thread (torch::set_num_threads(1)): the ranks are the
// parallelism. bench/torch_resnet runs it beside PyTorch DDP (bench/results/torch-resnet.md).
// The program itself is torch_resnet.hpp; torch_resnet_cuda.cu is its CUDA build (libtorch with
// CUDA, NcclComm, autocast fp16 + GradScaler), built where libtorch has CUDA.
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>

#include <torch/torch.h>

#include "common/elastic.hpp"
#include "common/elastic_run.hpp"
#include "common/run.hpp"
#include "torch_resnet.hpp"
#if TANDEM_EXAMPLE_WITH_GLOO
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"
#endif
#if TANDEM_EXAMPLE_WITH_MPI
#include "tandem/comm/mpi/mpi.hpp"
#endif

int main(int argc, char** argv) {
  const auto settings = torch_resnet::parse(argc, argv);
  if (!settings) return torch_resnet::usage();
  torch::set_num_threads(1);  // one core per rank: the ranks are the parallelism
  const auto timeout = std::chrono::seconds(settings->timeout_seconds);
  std::optional<std::string> store;
  if (settings->elastic) {
    if (const auto problem = examples::elastic_problem(settings->backend); !problem.empty()) {
      std::fprintf(stderr, "torch_resnet: %s\n", problem.c_str());
      return torch_resnet::usage();
    }
    store = examples::elastic_store_url(settings->elastic_store);
    if (!store) {
      std::fprintf(stderr,
                   "torch_resnet: --elastic needs a launcher (tandemrun --elastic sets "
                   "TORCHELASTIC_RUN_ID, which names the store) or --elastic-store file:///PATH\n");
      return torch_resnet::usage();
    }
  }
  // run_main prints an exception that ends the run and writes torchrun's error file.
  return tandem::run_main([&]() -> int {
    const auto result =
        store ? examples::run_elastic_backend(settings->backend, *store, timeout,
                                              [&](auto& elastic) {
                                                return torch_resnet::train_in<torch_resnet::OnCpu>(
                                                    elastic, *settings);
                                              })
              : examples::run_cpu_backend(
                    settings->backend, settings->ranks, timeout, [&](auto& comm) {
                      return torch_resnet::train<torch_resnet::OnCpu>(comm, *settings);
                    });
    if (!result) {
      std::fprintf(stderr, "torch_resnet: backend '%s' is not built in\n",
                   settings->backend.c_str());
      return torch_resnet::usage();
    }
    const double accuracy = *result;
    if (!std::isfinite(accuracy)) return 1;
    if (100 * accuracy < settings->min_accuracy) {
      std::fprintf(stderr, "torch_resnet: test accuracy %.2f %% is below --min-accuracy %.2f\n",
                   100 * accuracy, settings->min_accuracy);
      return 1;
    }
    return 0;
  });
}
