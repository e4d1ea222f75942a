// tandem/core/device_index.hpp - which of the GPUs a process can see it should use, given its rank
// on the node: the arithmetic behind tandem::cuda::select_device, usable and testable without CUDA.
//   int device = tandem::device_index_for(world.local_rank, visible_devices);  // 5 of 4 GPUs: 1
// Needs: the standard library only.
#pragma once

#include <string>

#include "tandem/core/error.hpp"

namespace tandem {

/// The index, among the `visible_devices` GPUs this process can see, that local rank `local_rank`
/// uses: local_rank % visible_devices. That covers each way GPUs are handed out:
/// - every GPU visible to every process (torchrun's convention; CUDA_VISIBLE_DEVICES unset or the
///   same for all): local rank i uses GPU i;
/// - one GPU visible per process (tandemrun --devices, which sets CUDA_VISIBLE_DEVICES to one
///   entry per local rank, or a scheduler binding a GPU to each task): always index 0;
/// - more processes than GPUs (several ranks sharing a GPU): round robin, 4 ranks on 2 GPUs use
///   0, 1, 0, 1.
/// No visible GPU, or a negative local rank, is a tandem::Error naming `rank` when given.
[[nodiscard]] inline int device_index_for(int local_rank, int visible_devices,
                                          int rank = unknown_rank) {
  if (visible_devices < 1) {
    throw Error(rank, "select_device",
                "no CUDA device is visible to this process (" + std::to_string(visible_devices) +
                    " devices; check CUDA_VISIBLE_DEVICES and the driver)");
  }
  if (local_rank < 0) {
    throw Error(rank, "select_device", "local rank " + std::to_string(local_rank) + " is negative");
  }
  return local_rank % visible_devices;
}

}  // namespace tandem
