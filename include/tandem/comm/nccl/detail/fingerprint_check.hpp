// tandem/comm/nccl/detail/fingerprint_check.hpp - NcclComm's collective check: each rank's
// fingerprint of the collective about to be issued, all-gathered on the communicator's stream and
// compared on the host (an Error on every rank before anything is queued), and the agreement on
// the check switch when the communicator is made.
//   class Engine : public FingerprintCheck<Engine> { ... check_call<E>(op, count, root, reduce); };
// Needs: CUDA and NCCL. Not a public header: the engine (engine.hpp) derives from it.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "tandem/comm/checked.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/check_switch.hpp"
#include "tandem/comm/nccl/detail/nccl_runtime.hpp"
#include "tandem/comm/work.hpp"
#include "tandem/core/error.hpp"
#include "tandem/cuda/runtime.hpp"

namespace tandem::detail::nccl {

/// The collective check of Derived, the engine (CRTP): Derived gives issue(), wait_on_host(),
/// its stream and next_work_ to its friend FingerprintCheck<Derived>.
template <class Derived>
class FingerprintCheck {
 public:
  /// Resolves options.check_collectives and compares it across the ranks (one all-gather, always:
  /// ranks that differ would otherwise hang at the first check). create() calls it once the
  /// communicator is whole; split's children inherit the parent's.
  void agree_on_checks() {
    checks_collectives_ = detail::agree_on_check_switch(
        self().rank(), "NcclComm", self().options().check_collectives, false, [&](int mine) {
          detail::CollectiveFingerprint fingerprint;
          fingerprint.op = static_cast<std::int64_t>(detail::CollectiveOp::barrier);
          fingerprint.count = mine;
          std::vector<int> all;
          for (const auto& each :
               gather_fingerprints(fingerprint, "the collective-check agreement")) {
            all.push_back(static_cast<int>(each.count));
          }
          return all;
        });
  }

  /// Whether every collective is compared across ranks first.
  [[nodiscard]] bool checks_collectives() const noexcept { return checks_collectives_; }

 protected:
  FingerprintCheck() = default;
  ~FingerprintCheck() = default;

  /// With checks on: this rank's fingerprint for the collective about to be issued, compared
  /// with every rank's; a mismatch is the same Error on every rank, before anything is queued.
  template <class E>
  void check_call(detail::CollectiveOp op, std::size_t count, int root = 0,
                  ReduceOp reduce = ReduceOp::sum) {
    if (!checks_collectives_ || self().group_depth_ > 0) return;
    const auto mine = detail::make_fingerprint<E>(op, ++checked_calls_, count, root, reduce);
    const auto all = gather_fingerprints(mine, "collective check");
    if (auto text = detail::fingerprint_disagreement(all); !text.empty()) {
      throw Error(self().rank_, detail::name(op), text);
    }
  }

  /// Every rank's fingerprint (in rank order): an ncclAllGather on the communicator's stream,
  /// after the operations issued so far but not after the caller's other work, waited for on
  /// the host within the timeout (the watchdog aborts it past that, like any operation).
  std::vector<detail::CollectiveFingerprint> gather_fingerprints(
      const detail::CollectiveFingerprint& mine, const char* what) {
    using Fingerprint = detail::CollectiveFingerprint;
    Derived& engine = self();
    constexpr std::size_t words = sizeof(Fingerprint) / sizeof(std::int64_t);
    const auto ranks = static_cast<std::size_t>(engine.size_);
    if (!check_host_) {
      DeviceGuard guard(engine.device_);
      void* host = nullptr;
      cuda::check(cudaMallocHost(&host, ranks * sizeof(Fingerprint)), "cudaMallocHost",
                  engine.rank_);
      check_host_ = static_cast<Fingerprint*>(host);
      void* device = nullptr;
      cuda::check(cudaMalloc(&device, ranks * sizeof(Fingerprint)), "cudaMalloc", engine.rank_);
      check_device_ = static_cast<Fingerprint*>(device);
    }
    Fingerprint* const host = check_host_;
    Fingerprint* const device = check_device_;
    const auto slot = static_cast<std::size_t>(engine.rank_);
    host[slot] = mine;
    // The check is an operation of its own: it must not complete the Work of an _async
    // operation being issued.
    std::shared_ptr<WorkState> saved = std::move(engine.next_work_);
    engine.next_work_.reset();
    const auto restore = [&] { engine.next_work_ = std::move(saved); };
    try {
      const cudaEvent_t end = engine.issue(
          what, words,
          [&](ncclComm_t comm, cudaStream_t stream) {
            cuda::check(cudaMemcpyAsync(device + slot, host + slot, sizeof(Fingerprint),
                                        cudaMemcpyHostToDevice, stream),
                        "cudaMemcpyAsync", engine.rank_);
            return ncclAllGather(device + slot, device, words, ncclInt64, comm, stream);
          },
          /*after_caller=*/false);
      if (end) engine.wait_on_host(end, what);
      DeviceGuard guard(engine.device_);
      const cudaStream_t stream = engine.stream_->get();
      cuda::check(cudaMemcpyAsync(host, device, ranks * sizeof(Fingerprint), cudaMemcpyDeviceToHost,
                                  stream),
                  "cudaMemcpyAsync", engine.rank_);
      // Nothing is queued behind the all-gather (this thread issues): this waits for the copy.
      cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize", engine.rank_);
    } catch (...) {
      restore();
      throw;
    }
    restore();
    return std::vector<Fingerprint>(host, host + ranks);
  }

  /// Frees the check's buffers (the engine's close(), once its stream has drained).
  void free_check_buffers() noexcept {
    if (check_host_) (void)cudaFreeHost(check_host_);
    if (check_device_) (void)cudaFree(check_device_);
    check_host_ = nullptr;
    check_device_ = nullptr;
  }

  bool checks_collectives_ = false;  ///< compare fingerprints before each collective
  std::uint64_t checked_calls_ = 0;  ///< collectives checked so far (the fingerprint's count)
  detail::CollectiveFingerprint* check_host_ = nullptr;    ///< pinned: every rank's fingerprint
  detail::CollectiveFingerprint* check_device_ = nullptr;  ///< the all-gather's buffer

 private:
  Derived& self() noexcept { return static_cast<Derived&>(*this); }
};

}  // namespace tandem::detail::nccl
