// tandem/cuda/device.hpp - picks this process's GPU from its rank on the node and makes it current,
// honouring CUDA_VISIBLE_DEVICES and tandemrun --devices.
//   const auto world = tandem::World::from_env();  int gpu = tandem::cuda::select_device(world);
// Needs: the CUDA runtime; include from .cu translation units (nvcc).
#pragma once

#include "tandem/cuda/detail/nvcc_only.hpp"  // first: stops a non-nvcc build here

#include <cstdint>
#include <cstdlib>
#include <string>

#include <cuda_runtime.h>

#include "tandem/core/device_index.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/world.hpp"
#include "tandem/cuda/runtime.hpp"

namespace tandem::cuda {

/// Lets `device`'s default memory pool keep the memory that stream-ordered frees return instead
/// of handing it back to the driver at every synchronisation (its default threshold is 0), so a
/// training step's buffers are reused rather than mapped again each step. The memory stays
/// reserved for this process until it exits or the pool is trimmed (cudaMemPoolTrimTo).
inline void keep_freed_memory(int device) {
  int pools_supported = 0;
  check(cudaDeviceGetAttribute(&pools_supported, cudaDevAttrMemoryPoolsSupported, device),
        "cudaDeviceGetAttribute(MemoryPoolsSupported)");
  if (pools_supported == 0) {
    throw Error("keep_freed_memory",
                "device " + std::to_string(device) +
                    " has no stream-ordered memory pool (cudaMallocAsync), which tandem's device "
                    "memory needs");
  }
  cudaMemPool_t pool = nullptr;
  check(cudaDeviceGetDefaultMemPool(&pool, device), "cudaDeviceGetDefaultMemPool");
  std::uint64_t threshold = UINT64_MAX;
  check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
        "cudaMemPoolSetAttribute(ReleaseThreshold)");
}

/// Makes the GPU of `world.local_rank` current on the calling thread and returns its index among
/// the visible devices: local_rank % visible (see tandem::device_index_for). With tandemrun
/// --devices each process sees only its own GPU, which is then index 0. The current device is
/// per host thread: call it on each thread that launches work for this rank. Also applies
/// keep_freed_memory to the device. No visible GPU is a tandem::Error naming the rank and
/// CUDA_VISIBLE_DEVICES.
inline int select_device(const World& world) {
  const int visible = device_count();
  if (visible == 0) {
    const char* visible_devices = std::getenv("CUDA_VISIBLE_DEVICES");
    throw Error(world.rank, "select_device",
                "no CUDA device is visible to local rank " + std::to_string(world.local_rank) +
                    " (CUDA_VISIBLE_DEVICES=" +
                    (visible_devices ? "'" + std::string(visible_devices) + "'" : "unset") +
                    "; no driver, or no GPU)");
  }
  const int device = device_index_for(world.local_rank, visible, world.rank);
  check(cudaSetDevice(device), "cudaSetDevice", world.rank);
  keep_freed_memory(device);
  return device;
}

}  // namespace tandem::cuda
