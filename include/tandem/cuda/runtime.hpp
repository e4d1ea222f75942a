// tandem/cuda/runtime.hpp - CUDA runtime errors as tandem::Error, and whether a GPU is present.
//   tandem::cuda::check(cudaMemsetAsync(p, 0, bytes, stream), "zero_grad");
//   if (tandem::cuda::device_count() == 0) { /* no GPU here: skip */ }
// Needs: the CUDA runtime; include from .cu translation units (nvcc).
#pragma once

#include "tandem/cuda/detail/nvcc_only.hpp"  // first: stops a non-nvcc build here

#include <cuda_runtime.h>

#include <string>

#include "tandem/core/error.hpp"

namespace tandem::cuda {

/// Throws a tandem::Error naming the operation and CUDA's own text when status is an error. The
/// thread's last-error slot is cleared first, so a later launch's cudaGetLastError does not report
/// this failure again as its own (sticky errors, such as a kernel fault, stay regardless).
inline void check(cudaError_t status, const char* operation, int rank = unknown_rank) {
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();
  throw Error(rank, operation,
              std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status));
}

/// GPUs this process can see (after CUDA_VISIBLE_DEVICES); 0 when there is no GPU or no driver,
/// which is how tests decide to skip rather than fail.
[[nodiscard]] inline int device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error for later calls
    return 0;
  }
  return count;
}

/// The calling thread's current device.
[[nodiscard]] inline int current_device() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

}  // namespace tandem::cuda
