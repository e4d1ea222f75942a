// tandem/data/cuda_delivery.hpp - tandem::cuda_delivery, the Loader's way to the GPU: batches are
// gathered into page-locked memory and copied to the device on the loader's own stream; the
// training stream waits on an event for each batch, so the host never blocks the training stream.
//   tandem::cuda::Stream train_stream;
//   tandem::Loader loader(data, sampler | tandem::views::batches(64), {.workers = 2},
//                         tandem::cuda_delivery(train_stream.get()));
//   for (const auto& batch : loader) { auto [x, y] = batch.views(); /* kernels on train_stream */ }
// tandem::pinned_delivery is PyTorch's pin_memory=True: batches in page-locked host memory.
// Needs: the CUDA runtime; include from .cu translation units (nvcc).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>

#include "tandem/cuda/memory.hpp"
#include "tandem/cuda/runtime.hpp"
#include "tandem/cuda/stream.hpp"
#include "tandem/data/loader.hpp"

namespace tandem {

/// Delivers a Loader's batches in device memory: staging in pinned memory, one host-to-device
/// copy per field on the loader's stream, and two events per slot of the prefetch ring (the
/// upload done; the training stream done with the slot's previous batch). The consumer's stream
/// is given at construction; batches must only be read by work on that stream (or work ordered
/// after it).
class cuda_delivery {
 public:
  using staging_space = pinned;  ///< batches are gathered in page-locked host memory
  using memory_space = device;   ///< and handed to the consumer in device memory

  /// The events of one slot. `consumed_recorded` says whether `consumed` was ever recorded.
  struct slot {
    std::unique_ptr<cuda::Event> uploaded;  ///< recorded on the copy stream after the upload
    std::unique_ptr<cuda::Event> consumed;  ///< recorded on the training stream at release
    bool upload_recorded = false;           ///< whether `uploaded` was ever recorded
    bool consumed_recorded = false;         ///< whether `consumed` was ever recorded
  };

  /// Batches for kernels on `training_stream` (the legacy default stream when null).
  explicit cuda_delivery(cudaStream_t training_stream = nullptr)
      : training_(training_stream), copies_(std::make_unique<cuda::Stream>()) {}

  /// A slot with two fresh events, neither recorded yet.
  slot make_slot() {
    return {std::make_unique<cuda::Event>(), std::make_unique<cuda::Event>(), false, false};
  }
  /// Pinned staging may be overwritten once the slot's previous upload has read it.
  void before_gather(slot& s) {
    if (s.upload_recorded) s.uploaded->synchronize();
  }
  /// The copy waits (on the device) for the training stream to be done with the slot's last batch.
  void upload(slot& s, void* to, const void* from, std::size_t bytes) {
    if (s.consumed_recorded) copies_->wait(*s.consumed);
    if (bytes == 0) return;
    cuda::check(cudaMemcpyAsync(to, from, bytes, cudaMemcpyHostToDevice, copies_->get()),
                "Loader: cudaMemcpyAsync to the device");
  }
  /// Records the end of the batch's copies, for before_gather() and hand_over() to wait on.
  void uploaded(slot& s) {
    s.uploaded->record(copies_->get());
    s.upload_recorded = true;
  }
  /// The training stream waits for the batch's copies: no host synchronisation.
  void hand_over(slot& s) {
    if (s.upload_recorded) {
      cuda::check(cudaStreamWaitEvent(training_, s.uploaded->get(), 0),
                  "Loader: cudaStreamWaitEvent");
    }
  }
  /// Marks, on the training stream, the point after which the slot's batch is no longer read;
  /// the slot's next upload waits for it.
  void release(slot& s) {
    s.consumed->record(training_);
    s.consumed_recorded = true;
  }
  /// Blocks the host until every copy started on the copy stream has finished.
  void synchronize() { copies_->synchronize(); }

  /// The consumer's stream, which batches are handed over to.
  [[nodiscard]] cudaStream_t training_stream() const noexcept { return training_; }
  /// The delivery's own stream, which the host-to-device copies run on.
  [[nodiscard]] cudaStream_t copy_stream() const noexcept { return copies_->get(); }

 private:
  cudaStream_t training_;
  std::unique_ptr<cuda::Stream> copies_;
};

static_assert(BatchDelivery<cuda_delivery>);

/// PyTorch's `pin_memory=True`: batches gathered into, and delivered in, page-locked host
/// memory, for code that copies them to the GPU itself (asynchronously, on its own streams).
using pinned_delivery = in_place_delivery<pinned>;
static_assert(BatchDelivery<pinned_delivery>);

}  // namespace tandem
