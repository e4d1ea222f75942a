// The libtorch bridge on CUDA: tandem::torch::DistributedDataParallel of a CUDA module over
// NcclComm, one thread per GPU of this process (run_local_nccl: world size 1 on a one-GPU
// machine, where NCCL refuses a second rank). Checked: NcclComm takes CUDA torch tensors
// directly (comm.all_reduce(t)); after backward() the module's gradients are views into the
// device arena and equal one process's gradients over the whole batch (gradient_check.hpp's
// tolerance), with overlap and with sync_at_end, under no_sync accumulation and with an unused
// branch; buffers broadcast; tandem's SGD on ddp.executor() moves the module's parameters; a
// forward under another current stream, a CPU module and a module on another GPU are Errors
// naming the cause; a checkpoint of the module (device arena and the int64 buffers on the GPU)
// saves and loads back. Built where libtorch has CUDA; without a GPU it prints "SKIPPED: ..."
// and exits 77 (its own main, hence NO_MAIN).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/torch.h>

#include "gradient_check.hpp"
#include "tandem/comm/nccl/nccl.hpp"
#include "tandem/cuda.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/optim/sgd.hpp"
#include "tandem/torch.hpp"
#include "tandem/torch/cuda.hpp"

namespace {

using namespace torch_ddp_check;

int gpus() {
  return tandem::cuda::device_count();
}

at::Device gpu_of(const tandem::NcclComm& comm) {
  return {at::kCUDA, static_cast<c10::DeviceIndex>(comm.device())};
}

/// The reference gradients on the CPU, then DDP's on each rank's GPU, compared on the CPU.
template <class... Policies>
void check_gradients(int micro, const SpareUse& spare, const char* what) {
  const int n = gpus();
  const Data data;
  Net reference = net_from(7);
  const auto want = reference_grads(reference, data, n, micro, spare);
  std::vector<Net> nets;  // libtorch's generator is global: draw on this thread only
  for (int r = 0; r < n; ++r) nets.push_back(net_from(7));
  tandem::run_local_nccl(n, [&](tandem::NcclComm& comm) {
    const auto device = gpu_of(comm);
    const c10::cuda::CUDAGuard on_gpu(device.index());
    Net net = nets[static_cast<std::size_t>(comm.rank())];
    net->use_spare = spare(comm.rank());
    net->to(device);
    Data mine = data;  // the same tensors, copied to this rank's GPU below
    mine.x = data.x.to(device);
    mine.y = data.y.to(device);
    const auto got = ddp_grads<Policies...>(comm, net, mine, micro);
    std::vector<::torch::Tensor> on_cpu;
    for (const auto& g : got) on_cpu.push_back(g.cpu());
    check_close(on_cpu, want, std::string(what) + ", rank " + std::to_string(comm.rank()));
  });
}

}  // namespace

TEST_CASE("gradients after backward equal one process's over the whole batch") {
  check_gradients<>(1, nowhere, "overlap");
  check_gradients<tandem::sync_at_end>(1, nowhere, "sync_at_end");
  check_gradients<>(3, nowhere, "no_sync, 3 micro-batches");
  check_gradients<tandem::bucket_cap<64>>(
      1, [](int r) { return r == 0; }, "unused branch");
}

TEST_CASE("parameters and gradients are views into the device arena; SGD moves them") {
  Net net = net_from(3);
  tandem::run_local_nccl(1, [&](tandem::NcclComm& comm) {
    const c10::cuda::CUDAGuard on_gpu(gpu_of(comm).index());
    net->to(gpu_of(comm));
    tandem::torch::DistributedDataParallel ddp(comm, net);
    auto& arena = ddp.parameters();
    const auto* values = arena.values().data();
    const auto* grads = arena.grads().data();
    const Data data;
    ::torch::nn::functional::cross_entropy(ddp.forward(data.x.to(gpu_of(comm))),
                                           data.y.to(gpu_of(comm)))
        .backward();
    const auto before = net->fc1->weight.detach().clone();
    const auto grad = net->fc1->weight.grad().detach().clone();
    const auto* data_at = static_cast<const float*>(net->fc1->weight.data_ptr());
    const auto* grad_at = static_cast<const float*>(net->fc1->weight.grad().data_ptr());
    DOCTEST_CHECK(data_at >= values);
    DOCTEST_CHECK(data_at < values + arena.numel());
    DOCTEST_CHECK(grad_at >= grads);
    DOCTEST_CHECK(grad_at < grads + arena.numel());
    tandem::optim::SGD opt(arena, {.lr = 0.5f}, ddp.executor());
    opt.step();
    const auto moved = net->fc1->weight.detach();
    DOCTEST_CHECK(::torch::allclose(moved.cpu(), (before - 0.5f * grad).cpu(), 1e-6, 1e-7));
  });
}

TEST_CASE("NcclComm takes CUDA torch tensors directly; a CPU tensor is an Error") {
  const int n = gpus();
  tandem::run_local_nccl(n, [&](tandem::NcclComm& comm) {
    const auto device = gpu_of(comm);
    const c10::cuda::CUDAGuard on_gpu(device.index());
    auto t = ::torch::full({4}, float(comm.rank() + 1), ::torch::TensorOptions().device(device));
    comm.all_reduce(t);
    DOCTEST_CHECK(t.cpu().eq(float(n * (n + 1) / 2)).all().item<bool>());
    auto halves = ::torch::full({3}, 2.0f, ::torch::TensorOptions().device(device)).to(at::kHalf);
    comm.broadcast(halves, 0);
    DOCTEST_CHECK(halves.cpu().to(at::kFloat).eq(2.0f).all().item<bool>());
    DOCTEST_CHECK_THROWS_WITH_AS(comm.all_reduce(::torch::ones({2})),
                                 doctest::Contains("a CPU tensor is not in device memory"),
                                 tandem::Error);
  });
}

TEST_CASE("misuse: another current stream, a CPU module, a module on another GPU") {
  tandem::run_local_nccl(1, [&](tandem::NcclComm& comm) {
    const auto device = gpu_of(comm);
    const c10::cuda::CUDAGuard on_gpu(device.index());
    {
      Net net = net_from(3);
      DOCTEST_CHECK_THROWS_WITH_AS(tandem::torch::DistributedDataParallel(comm, net),
                                   doctest::Contains("is on cpu"), tandem::Error);
    }
    Net net = net_from(3);
    net->to(device);
    tandem::torch::DistributedDataParallel ddp(comm, net);
    const Data data;
    const auto side = c10::cuda::getStreamFromPool(false, device.index());
    const c10::cuda::CUDAStreamGuard on_side(side);
    DOCTEST_CHECK_THROWS_WITH_AS(ddp.forward(data.x.to(device)),
                                 doctest::Contains("current CUDA stream"), tandem::Error);
  });
  if (gpus() >= 2) {
    tandem::run_local_nccl(1, [&](tandem::NcclComm& comm) {
      Net net = net_from(3);
      net->to(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(comm.device() == 0 ? 1 : 0)));
      DOCTEST_CHECK_THROWS_WITH_AS(tandem::torch::DistributedDataParallel(comm, net),
                                   doctest::Contains("the communicator's GPU"), tandem::Error);
    });
  }
}

TEST_CASE("a checkpoint of a CUDA module saves and loads back, int64 buffers included") {
  const auto dir =
      std::filesystem::temp_directory_path() / ("tandem-torch-cuda-" + std::to_string(::getpid()));
  tandem::run_local_nccl(1, [&](tandem::NcclComm& comm) {
    const auto device = gpu_of(comm);
    const c10::cuda::CUDAGuard on_gpu(device.index());
    Net net = net_from(5);
    net->to(device);
    tandem::torch::DistributedDataParallel ddp(comm, net);
    const Data data;
    ::torch::nn::functional::cross_entropy(ddp.forward(data.x.to(device)), data.y.to(device))
        .backward();  // moves the running statistics and num_batches_tracked
    tandem::TrainingState saved;
    tandem::torch::model(saved, ddp);
    const auto path = tandem::save_checkpoint(comm, dir, 1, saved);
    const auto weight = net->fc2->weight.detach().cpu().clone();
    const auto tracked = net->bn->num_batches_tracked.detach().cpu().clone();
    {
      const ::torch::NoGradGuard no_grad;
      net->fc2->weight.zero_();
      net->bn->num_batches_tracked.fill_(99);
    }
    tandem::TrainingState loaded;
    tandem::torch::model(loaded, ddp);
    tandem::load_checkpoint(comm, path, loaded);
    DOCTEST_CHECK(::torch::equal(net->fc2->weight.detach().cpu(), weight));
    DOCTEST_CHECK(::torch::equal(net->bn->num_batches_tracked.detach().cpu(), tracked));
  });
  std::filesystem::remove_all(dir);
}

int main(int argc, char** argv) {
  if (gpus() == 0) {
    std::printf(
        "SKIPPED: no CUDA device; the libtorch bridge's CUDA path (NcclComm, device arena) was "
        "compiled but not run\n");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
