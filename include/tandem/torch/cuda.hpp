// tandem/torch/cuda.hpp - the libtorch bridge on CUDA: libtorch's current CUDA stream as tandem's
// executor, so that tandem::torch::DistributedDataParallel of a CUDA module, SyncBatchNorm and
// CUDA torch::Tensors on a device communicator (NcclComm) are ordered with libtorch's kernels.
//   #include <tandem/cuda.hpp>          // a .cu file compiled by nvcc
//   #include <tandem/comm/nccl.hpp>
//   #include <tandem/torch.hpp>
//   #include <tandem/torch/cuda.hpp>
//   model->to(torch::Device(torch::kCUDA, comm.device()));
//   tandem::torch::DistributedDataParallel ddp(comm, model);
//   tandem::optim::SGD opt(ddp.parameters(), {.lr = 0.1}, ddp.executor());
// Needs: libtorch built with CUDA (libtorch_cuda and libc10_cuda: PyTorch's wheel has them,
// Debian's libtorch-dev does not), the CUDA toolkit, nvcc; the tandem::torch and tandem::nccl
// CMake components.
//
// Why a header of its own: libtorch's current stream needs c10's CUDA headers and nvcc, which a
// CPU build of the bridge has neither of. The bridge asks CurrentStream<Space> (torch/tensor.hpp)
// for the executor of libtorch's work; this header answers for device memory: cuda_exec on
// libtorch's current stream of the tensor's or module's GPU (the legacy default stream unless a
// c10::cuda::CUDAStreamGuard set another). Everything else is tandem's stream-ordering contract
// (comm/stream_order.hpp) with that executor: the communicator orders each operation after the
// stream and hands its results back to it on the GPU, as PyTorch's ProcessGroupNCCL does, with no
// host wait and without changing the communicator's caller stream.
#pragma once

#include "tandem/cuda/detail/nvcc_only.hpp"  // first: stops a non-nvcc build here

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "tandem/cuda/exec.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/torch/ddp.hpp"
#include "tandem/torch/tensor.hpp"

namespace tandem::torch {

/// Device memory: cuda_exec on libtorch's current CUDA stream (see the top of this header).
template <>
struct CurrentStream<device> {
  /// What runs in libtorch's order: cuda_exec on its current stream.
  using executor = cuda_exec;

  /// cuda_exec on libtorch's current stream of `device` (a CUDA device).
  static executor of(const at::Device& device) {
    return cuda_exec{c10::cuda::getCurrentCUDAStream(device.index()).stream()};
  }
};

}  // namespace tandem::torch
