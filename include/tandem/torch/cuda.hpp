// tandem/torch/cuda.hpp - the libtorch bridge on CUDA: tandem::torch::DistributedDataParallel of
// a CUDA module over a device communicator (NcclComm), bound to libtorch's current CUDA stream.
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
// Why a header of its own: binding to libtorch's stream needs c10's CUDA headers and nvcc, which
// a CPU build of the bridge has neither of. ddp.hpp asks StreamOrder<Space> for the executor of
// the arena's passes and for a check before each forward and gradient hook; this header answers
// for device memory. bind() reads libtorch's current stream on the module's GPU (the legacy
// default stream unless a c10::cuda::CUDAStreamGuard set another), sets the communicator to
// order its operations after it (comm.use_stream) and returns cuda_exec on it; check() makes a
// forward or a gradient hook under another current stream an Error, since the communicator and
// the executor would then read gradients that libtorch's kernels are still writing.
#pragma once

#include "tandem/cuda/detail/nvcc_only.hpp"  // first: stops a non-nvcc build here

#include <string>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "tandem/core/error.hpp"
#include "tandem/cuda/exec.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/torch/ddp.hpp"

namespace tandem::torch {

/// Device memory: the arena's passes run on libtorch's current CUDA stream, and the communicator
/// orders its operations after that stream (see the top of this header).
template <>
struct StreamOrder<device> {
  /// What runs the arena's passes: cuda_exec on libtorch's stream.
  using executor = cuda_exec;

  /// libtorch's current stream on `module_device`.
  static cudaStream_t current(const at::Device& module_device) {
    return c10::cuda::getCurrentCUDAStream(module_device.index()).stream();
  }

  /// cuda_exec on libtorch's current stream; `comm` orders its operations after that stream
  /// (a communicator without use_stream, such as a test double, is left alone).
  template <class Comm>
  static executor bind(Comm& comm, const at::Device& module_device) {
    const cudaStream_t stream = current(module_device);
    if constexpr (requires { comm.use_stream(stream); }) comm.use_stream(stream);
    return cuda_exec{stream};
  }

  /// An Error naming `where` unless libtorch's current stream is still the one bound.
  static void check(const executor& exec, const at::Device& module_device, int rank,
                    const char* where) {
    if (current(module_device) == exec.stream) return;
    throw Error(rank, where,
                "libtorch's current CUDA stream on " + module_device.str() +
                    " is not the one DistributedDataParallel was constructed under; the "
                    "communicator and the arena's passes are ordered after that stream only: "
                    "construct the wrapper under the same c10::cuda::CUDAStreamGuard as the "
                    "training loop (or none for both)");
  }
};

}  // namespace tandem::torch
