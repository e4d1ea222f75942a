// tandem/cuda.hpp - tandem's CUDA parts: runtime errors, streams and events, pinned and device
// memory with copies, the cuda_exec execution space, and device selection from the local rank.
//   #include <tandem/cuda.hpp>   // in a .cu file; link tandem::cuda
// Needs: the CUDA toolkit (nvcc, cudart, CUB). NcclComm is separate: <tandem/comm/nccl/nccl.hpp>,
// linking tandem::nccl, so that CUDA users who do not communicate need no NCCL.
#pragma once

#include "tandem/cuda/device.hpp"
#include "tandem/cuda/exec.hpp"
#include "tandem/cuda/memory.hpp"
#include "tandem/cuda/runtime.hpp"
#include "tandem/cuda/stream.hpp"
