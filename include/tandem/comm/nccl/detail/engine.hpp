// tandem/comm/nccl/detail/engine.hpp - detail::nccl::Engine, one NcclComm rank: NCCL's collectives
// and point to point issued on the caller's or the communicator's stream in issue order, the
// `_async` Works and their events, NcclGroup's bookkeeping, and split. What never lets it hang
// is its base WatchedComm (watchdog.hpp), the collective check its base FingerprintCheck.
//   auto engine = std::make_shared<tandem::detail::nccl::Engine>(comm, device, options);
// Needs: CUDA and NCCL. Not a public header: nccl.hpp uses it.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tandem/comm/checked.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/nccl/detail/fingerprint_check.hpp"
#include "tandem/comm/nccl/detail/nccl_runtime.hpp"
#include "tandem/comm/nccl/detail/nccl_support.hpp"
#include "tandem/comm/nccl/detail/watchdog.hpp"
#include "tandem/comm/nccl/options.hpp"
#include "tandem/comm/work.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/cuda/runtime.hpp"
#include "tandem/cuda/stream.hpp"

namespace tandem::detail::nccl {

/// One rank's communicator. Heap-allocated and owned by the NcclComm, so that run_local_nccl's
/// abort and `_async` bookkeeping may point at it while the NcclComm moves. One thread issues
/// operations at a time (NCCL communicators are not thread-safe); the watchdog thread runs
/// beside it (WatchedComm).
class Engine : public WatchedComm, public FingerprintCheck<Engine> {
 public:
  Engine(ncclComm_t comm, int device, NcclCommOptions options)
      : WatchedComm(comm, device, options), caller_(options.stream) {
    try {
      DeviceGuard guard(device_);
      check(ncclCommUserRank(comm_, &rank_), unknown_rank, "ncclCommUserRank", comm_, false);
      check(ncclCommCount(comm_, &size_), rank_, "ncclCommCount", comm_, false);
      stream_.emplace(options_.stream_priority);
      newest_stream_ = stream_->get();
      start_.emplace();
      cuda::check(cudaMalloc(&scratch_, sizeof(std::int32_t)), "cudaMalloc", rank_);
      start_watchdog();
    } catch (...) {
      (void)ncclCommAbort(comm_);
      if (scratch_) (void)cudaFree(scratch_);
      throw;
    }
  }

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  ~Engine() {
    stop_watchdog();
    close();
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] const NcclCommOptions& options() const noexcept { return options_; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_->get(); }
  [[nodiscard]] cudaStream_t caller_stream() const noexcept { return caller_; }
  void use_stream(cudaStream_t stream) noexcept { caller_ = stream; }

  /// Work queued on `stream` from now on waits for every operation issued so far; the host does
  /// not wait. Nothing to do where the newest operation went to `stream` itself (a sync one on
  /// the caller stream): stream order covers it, and issue order the operations before it.
  void wait_stream(cudaStream_t stream) {
    {
      std::lock_guard lock(mutex_);
      if (!failure_ && !pending_.empty() && newest_stream_ == stream) return;
    }
    WatchedComm::wait_stream(stream);
  }

  /// The next operation (and so every later one: they run in issue order) waits on the GPU for
  /// the work queued on `stream` so far: an event recorded there now, which the stream of that
  /// operation waits for when it is issued. The host does not wait and the caller stream stays
  /// as it is. Nothing to do for the caller stream itself: every operation follows it.
  void order_after(cudaStream_t stream) {
    if (stream == caller_) return;
    DeviceGuard guard(device_);
    {
      std::lock_guard lock(mutex_);
      throw_if_failed("order_after");
    }
    for (std::size_t i = 0; i < prerequisites_pending_; ++i) {
      if (prerequisites_[i].first == stream) {  // a newer mark of the same stream covers the old
        cuda::check(cudaEventRecord(prerequisites_[i].second, stream), "cudaEventRecord", rank_);
        return;
      }
    }
    if (prerequisites_pending_ == prerequisites_.size()) {
      cudaEvent_t event = nullptr;
      cuda::check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                  "cudaEventCreateWithFlags", rank_);
      prerequisites_.emplace_back(nullptr, event);
    }
    auto& mark = prerequisites_[prerequisites_pending_];
    cuda::check(cudaEventRecord(mark.second, stream), "cudaEventRecord", rank_);
    mark.first = stream;
    ++prerequisites_pending_;
  }
  [[nodiscard]] ncclComm_t native() const noexcept { return comm_; }

  // --- what CollectiveFrontend calls ----------------------------------------------------------

  template <class Body>
  void now(Body&& body) {
    body();
  }

  /// Issues body's operation now (NCCL queues it on the GPU) and returns the Work that the
  /// watchdog completes once it has finished there.
  template <class Body>
  Work later(Body body) {
    auto state = std::make_shared<WorkState>();
    next_work_ = state;
    try {
      body();
    } catch (...) {
      next_work_.reset();
      throw;
    }
    if (next_work_) {  // nothing to move (no elements): done already
      next_work_.reset();
      state->complete();
    } else if (group_depth_ == 0) {
      // An event right behind the operation on our stream, owned by the Work: work.wait(stream)
      // makes another stream wait on the GPU. (Inside a group the operation is launched only at
      // ncclGroupEnd, so such a Work falls back to a host wait.)
      DeviceGuard guard(device_);
      auto end = std::make_shared<cuda::Event>();
      end->record(stream_->get());
      state->set_stream_waiter([end, rank = rank_](void* stream) {
        cuda::check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), end->get(), 0),
                    "cudaStreamWaitEvent", rank);
      });
    }
    return Work(state);
  }

  template <class E>
  void all_reduce(const E* in, E* out, std::size_t count, ReduceOp op) {
    check_call<E>(detail::CollectiveOp::all_reduce, count, 0, op);
    issue("all_reduce", count, [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclAllReduce(in, out, count, data_type<E>(), reduce_op(op), comm, stream);
    });
  }

  /// In place on every rank; a non-root rank's buffer is left as it was (NCCL writes recvbuff
  /// on the root only, and gets none elsewhere).
  template <class E>
  void reduce(E* buffer, std::size_t count, int root, ReduceOp op) {
    check_call<E>(detail::CollectiveOp::reduce, count, root, op);
    E* out = rank_ == root ? buffer : nullptr;
    issue("reduce", count, [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclReduce(buffer, out, count, data_type<E>(), reduce_op(op), root, comm, stream);
    });
  }

  template <class E>
  void broadcast(E* buffer, std::size_t count, int root) {
    check_call<E>(detail::CollectiveOp::broadcast, count, root);
    issue("broadcast", count, [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclBroadcast(buffer, buffer, count, data_type<E>(), root, comm, stream);
    });
  }

  template <class E>
  void all_gather(const E* in, E* out, std::size_t count) {
    check_call<E>(detail::CollectiveOp::all_gather, count);
    issue("all_gather", count, [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclAllGather(in, out, count, data_type<E>(), comm, stream);
    });
  }

  template <class E>
  void reduce_scatter(const E* in, E* out, std::size_t count, ReduceOp op) {
    check_call<E>(detail::CollectiveOp::reduce_scatter, count, 0, op);
    issue("reduce_scatter", count, [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclReduceScatter(in, out, count, data_type<E>(), reduce_op(op), comm, stream);
    });
  }

  template <class E>
  void gather(const E* in, E* out, std::size_t count, int root) {
    check_call<E>(detail::CollectiveOp::gather, count, root);
    issue("gather", count, [&](ncclComm_t comm, cudaStream_t stream) -> ncclResult_t {
      if constexpr (native_rooted_collectives) {
        return ncclGather(in, out, count, data_type<E>(), root, comm, stream);
      } else {
        return grouped_calls([&] {
          ncclResult_t r = ncclSend(in, count, data_type<E>(), root, comm, stream);
          if (r != ncclSuccess || rank_ != root) return r;
          for (int peer = 0; peer < size_ && r == ncclSuccess; ++peer) {
            r = ncclRecv(out + static_cast<std::size_t>(peer) * count, count, data_type<E>(), peer,
                         comm, stream);
          }
          return r;
        });
      }
    });
  }

  template <class E>
  void scatter(const E* in, E* out, std::size_t count, int root) {
    check_call<E>(detail::CollectiveOp::scatter, count, root);
    issue("scatter", count, [&](ncclComm_t comm, cudaStream_t stream) -> ncclResult_t {
      if constexpr (native_rooted_collectives) {
        return ncclScatter(in, out, count, data_type<E>(), root, comm, stream);
      } else {
        return grouped_calls([&] {
          ncclResult_t r = ncclSuccess;
          if (rank_ == root) {
            for (int peer = 0; peer < size_ && r == ncclSuccess; ++peer) {
              r = ncclSend(in + static_cast<std::size_t>(peer) * count, count, data_type<E>(), peer,
                           comm, stream);
            }
          }
          if (r != ncclSuccess) return r;
          return ncclRecv(out, count, data_type<E>(), root, comm, stream);
        });
      }
    });
  }

  /// `total` elements in each of in and out, size() slots of total / size(). NCCL's all-to-all
  /// is not in place: overlapping buffers go through a copy of in made on the stream.
  template <class E>
  void all_to_all(const E* in, E* out, std::size_t total) {
    check_call<E>(detail::CollectiveOp::all_to_all, total);
    const std::size_t count = total / static_cast<std::size_t>(size_);
    issue("all_to_all", total, [&](ncclComm_t comm, cudaStream_t stream) -> ncclResult_t {
      const E* source = in;
      const auto in_at = reinterpret_cast<std::uintptr_t>(in);
      const auto out_at = reinterpret_cast<std::uintptr_t>(out);
      const std::uintptr_t bytes = total * sizeof(E);
      const bool overlap = in_at < out_at + bytes && out_at < in_at + bytes;
      if (overlap) source = stage_copy(in, total, stream);
      if constexpr (native_rooted_collectives) {
        return ncclAlltoAll(source, out, count, data_type<E>(), comm, stream);
      } else {
        return grouped_calls([&] {
          ncclResult_t r = ncclSuccess;
          for (int peer = 0; peer < size_ && r == ncclSuccess; ++peer) {
            const auto slot = static_cast<std::size_t>(peer) * count;
            r = ncclSend(source + slot, count, data_type<E>(), peer, comm, stream);
            if (r == ncclSuccess)
              r = ncclRecv(out + slot, count, data_type<E>(), peer, comm, stream);
          }
          return r;
        });
      }
    });
  }

  template <class E>
  void send(const E* data, std::size_t count, int peer, int tag) {
    check_tag(rank_, tag, 0, "NCCL's range (it has no tags)", "send");
    issue("send", count, [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclSend(data, count, data_type<E>(), peer, comm, stream);
    });
  }

  template <class E>
  void recv(E* data, std::size_t count, int peer, int tag) {
    check_tag(rank_, tag, 0, "NCCL's range (it has no tags)", "recv");
    issue("recv", count, [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclRecv(data, count, data_type<E>(), peer, comm, stream);
    });
  }

  /// An all_reduce of one integer; the sync form also waits on the host, as a barrier must.
  void barrier() {
    check_call<std::int32_t>(detail::CollectiveOp::barrier, 0);
    const bool async = next_work_ != nullptr;
    auto* scratch = static_cast<std::int32_t*>(scratch_);
    const cudaEvent_t end = issue("barrier", 1, [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclAllReduce(scratch, scratch, 1, ncclInt32, ncclSum, comm, stream);
    });
    if (!async && end) wait_on_host(end, "barrier");
  }

  /// split's collective part: ncclCommSplit on the nonblocking parent, following NCCL's rules
  /// for such communicators (the notes on nonblocking communicators in nccl_support.hpp). Returns
  /// null for no_color. The parent finishes its operations first (NCCL: none may be outstanding).
  std::unique_ptr<Engine> split(int color, int key) {
    if (group_depth_ > 0) throw Error(rank_, "split", "split cannot run inside an NcclGroup");
    check_call<std::int32_t>(detail::CollectiveOp::split, 0);
    synchronize();
    DeviceGuard guard(device_);
    std::unique_lock lock(mutex_);
    throw_if_failed("split");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // NCCL's split job writes the child's handle into *slot from its own thread when it ends
    // (null for no_color), which may be after ncclCommSplit has returned ncclSuccess. The slot is
    // freed only once the parent has reported ncclSuccess (NCCL has then joined that thread);
    // on every other path it is leaked (one pointer), never freed under a running job.
    auto* slot = new ncclComm_t(nullptr);
    const Deadline deadline(options_.timeout);
    ncclResult_t state = ncclCommSplit(comm_, split_color(color), key, slot, &config);
    // Success from ncclCommSplit only means "queued": the parent reports ncclInProgress until its
    // job has finished, for a no_color rank too. Poll it (lock released between polls, so that
    // the watchdog or an abort from another rank's thread can step in); touch nothing else.
    if (state == ncclSuccess || state == ncclInProgress) {
      state = settle_locked(lock, comm_, ncclInProgress, deadline);
    }
    if (state == ncclSuccess && !failure_) {
      const ncclComm_t made = *slot;
      delete slot;
      if (!made) return nullptr;
      // The child is usable once it too reports anything but ncclInProgress.
      ncclResult_t own = ncclInProgress;
      if (ncclCommGetAsyncError(made, &own) != ncclSuccess) own = ncclInternalError;
      own = settle_locked(lock, made, own, deadline);
      if (own == ncclSuccess && !failure_) {
        lock.unlock();
        auto child = std::make_unique<Engine>(made, device_, options_);
        child->checks_collectives_ = checks_collectives_;  // every rank of the parent agreed on it
        return child;
      }
      const std::string why = "the new communicator failed: " + error_text(own, made);
      (void)ncclCommAbort(made);
      if (failure_) throw_if_failed("split");
      abort_locked("split", ++sequence_, why);
      throw *failure_;
    }
    // Failed, timed out or aborted meanwhile. Aborting the parent stops NCCL's split job and joins
    // its thread; only then is the slot final, and a child it holds is aborted too (NCCL's rule).
    const bool aborted_elsewhere = failure_.has_value();
    if (!aborted_elsewhere) {
      abort_locked("split", ++sequence_,
                   state == ncclInProgress
                       ? "ncclCommSplit did not finish within " + describe(options_.timeout) +
                             " (a rank of the group did not call split)"
                       : error_text(state, comm_));
    }
    if (const ncclComm_t made = *slot) (void)ncclCommAbort(made);
    if (aborted_elsewhere) throw_if_failed("split");
    throw *failure_;
  }

  // --- groups (NcclGroup drives these) --------------------------------------------------------

  void group_enter() {
    std::lock_guard lock(mutex_);
    throw_if_failed("NcclGroup");
    if (group_depth_++ == 0) {
      group_operations_ = 0;
      group_has_sync_ = false;
      group_first_.clear();
    }
  }

  /// After ncclGroupEnd returned `state`: waits for NCCL to have launched the group, then hands
  /// the buffers back to the caller's stream. Errors are recorded (and thrown when `raise`).
  void group_leave(ncclResult_t state, const Deadline& deadline, bool raise) {
    DeviceGuard guard(device_);
    std::unique_lock lock(mutex_);
    if (--group_depth_ > 0) return;
    const std::string name = group_operations_ == 1
                                 ? group_first_
                                 : "NcclGroup of " + std::to_string(group_operations_) +
                                       " operations (first: " + group_first_ + ")";
    std::vector<std::shared_ptr<WorkState>> works = std::move(group_works_);
    group_works_.clear();
    std::uint64_t sequence = sequence_;
    try {
      if (!failure_ && comm_) {
        if (state == ncclInProgress) state = settle_locked(lock, comm_, state, deadline);
        if (state != ncclSuccess && !failure_) {
          abort_locked(name, sequence, settle_failure(state));
        }
      }
      if (failure_) throw *failure_;
      if (deferred_abort_) {
        auto cause = std::move(*deferred_abort_);
        deferred_abort_.reset();
        abort_locked(cause.first, cause.second.first, cause.second.second);
        throw *failure_;
      }
      if (group_operations_ > 0) {
        finish_issue("NcclGroup", name, sequence, std::move(works), group_has_sync_,
                     stream_->get());
      }
      release_staging(stream_->get());
    } catch (...) {
      auto error = std::current_exception();
      for (auto& work : works) {
        if (work) work->fail(error);
      }
      release_staging(stream_->get());
      if (raise) throw;
    }
  }

 private:
  friend class FingerprintCheck<Engine>;

  /// The stream handoff and bookkeeping every operation shares; returns the end event (null for
  /// an operation with nothing to move, or one inside a group).
  template <class Enqueue>
  cudaEvent_t issue(const char* operation, std::size_t count, Enqueue enqueue,
                    bool after_caller = true) {
    std::shared_ptr<WorkState> work = std::move(next_work_);
    next_work_.reset();
    if (count == 0) {  // every rank agrees on the count, so every rank skips it
      if (work) work->complete();
      return nullptr;
    }
    DeviceGuard guard(device_);
    std::unique_lock lock(mutex_);
    throw_if_failed(operation);
    const std::uint64_t sequence = ++sequence_;
    // A sync operation outside a group may run on the caller's stream itself: the caller would
    // wait for it anyway, and no event crosses between streams (the per-call cost that matters
    // for small all_reduces). Everything else runs on the communicator's stream after the
    // caller's work so far.
    // (A collective check, after_caller false, waits only for the operations before it.)
    const bool direct =
        after_caller && work == nullptr && group_depth_ == 0 && options_.sync_on_caller_stream;
    const cudaStream_t stream = direct ? caller_ : stream_->get();
    if (!direct && after_caller) {
      cuda::check(cudaEventRecord(start_->get(), caller_), "cudaEventRecord", rank_);
      cuda::check(cudaStreamWaitEvent(stream, start_->get(), 0), "cudaStreamWaitEvent", rank_);
    }
    if (after_caller) follow_prerequisites(stream);
    follow_newest(stream);
    ncclResult_t state = enqueue(comm_, stream);
    if (group_depth_ > 0) {
      if (state != ncclSuccess && state != ncclInProgress) {
        throw Error(rank_, nccl::describe_operation(operation, sequence), error_text(state, comm_));
      }
      if (group_operations_++ == 0) group_first_ = nccl::describe_operation(operation, sequence);
      if (work) {
        group_works_.push_back(std::move(work));
      } else {
        group_has_sync_ = true;
      }
      return nullptr;
    }
    if (state == ncclInProgress)
      state = settle_locked(lock, comm_, state, Deadline(options_.timeout));
    if (state != ncclSuccess) {
      release_staging(stream);
      const std::string name = nccl::describe_operation(operation, sequence);
      if (failure_) throw *failure_;
      if (state == ncclInvalidArgument || state == ncclInvalidUsage) {
        throw Error(rank_, name, error_text(state, comm_));  // nothing was queued: still usable
      }
      abort_locked(name, sequence, settle_failure(state));
      throw *failure_;
    }
    release_staging(stream);
    std::vector<std::shared_ptr<WorkState>> works;
    const bool caller_waits = work == nullptr && !direct && after_caller;
    if (work) works.push_back(std::move(work));
    return finish_issue(operation, {}, sequence, std::move(works), caller_waits, stream);
  }

  /// The streams order_after() marked since the last operation: `stream` waits for their marks.
  /// (A wait uses the record made before it, so the events are recorded again for later marks.)
  void follow_prerequisites(cudaStream_t stream) {
    for (std::size_t i = 0; i < prerequisites_pending_; ++i) {
      cuda::check(cudaStreamWaitEvent(stream, prerequisites_[i].second, 0), "cudaStreamWaitEvent",
                  rank_);
    }
    prerequisites_pending_ = 0;
  }

  /// NCCL runs a communicator's operations in issue order: one about to be queued on `stream`
  /// waits for the newest one still in flight when that one went to another stream (the
  /// caller's stream changed, or a sync operation on the caller's stream follows `_async` ones).
  /// Operations on one stream, and the communicator's stream after start_, are ordered already.
  void follow_newest(cudaStream_t stream) {
    if (pending_.empty() || newest_stream_ == stream) return;
    if (stream == stream_->get() && newest_stream_ == caller_) return;  // start_ covers it
    cuda::check(cudaStreamWaitEvent(stream, pending_.back().end, 0), "cudaStreamWaitEvent", rank_);
  }

  /// Records the end of an issued operation on our stream, makes the caller's stream wait for it
  /// where a sync operation is part of it, and hands it to the watchdog.
  cudaEvent_t finish_issue(const char* operation, std::string group, std::uint64_t sequence,
                           std::vector<std::shared_ptr<WorkState>> works, bool caller_waits,
                           cudaStream_t stream) {
    const cudaEvent_t end = take_event();
    cuda::check(cudaEventRecord(end, stream), "cudaEventRecord", rank_);
    newest_stream_ = stream;
    const bool async = !works.empty();
    if (caller_waits) {
      cuda::check(cudaStreamWaitEvent(caller_, end, 0), "cudaStreamWaitEvent", rank_);
    }
    if (async) ++async_pending_;
    pending_.push_back(Pending{sequence, operation, std::move(group), Deadline::clock::now(), end,
                               std::move(works)});
    if (async) wake_.notify_all();
    return end;
  }

  /// A copy of `total` elements of `in` on the stream, freed (stream-ordered) once the operation
  /// using it has been queued.
  template <class E>
  const E* stage_copy(const E* in, std::size_t total, cudaStream_t stream) {
    void* copy = nullptr;
    cuda::check(cudaMallocAsync(&copy, total * sizeof(E), stream), "cudaMallocAsync", rank_);
    staging_.push_back(copy);
    cuda::check(cudaMemcpyAsync(copy, in, total * sizeof(E), cudaMemcpyDeviceToDevice, stream),
                "cudaMemcpyAsync", rank_);
    return static_cast<const E*>(copy);
  }

  /// Frees the staging copies after the operations reading them were queued (inside a group,
  /// only after ncclGroupEnd has launched them).
  void release_staging(cudaStream_t stream) noexcept {
    if (group_depth_ > 0) return;
    for (void* copy : staging_) (void)cudaFreeAsync(copy, stream);
    staging_.clear();
  }

  /// The end of a communicator: NCCL's orderly ncclCommFinalize (it flushes what is in flight),
  /// bounded by the timeout, then ncclCommDestroy; ncclCommAbort where that fails.
  void close() noexcept {
    try {
      DeviceGuard guard(device_);
      std::unique_lock lock(mutex_);
      if (comm_) {
        const Deadline deadline(options_.timeout);
        ncclResult_t state = ncclCommFinalize(comm_);
        if (state == ncclInProgress) state = settle_locked(lock, comm_, state, deadline);
        if (state == ncclSuccess) {
          (void)ncclCommDestroy(comm_);
        } else {
          (void)ncclCommAbort(comm_);
        }
        comm_ = nullptr;
      }
      const auto error = std::make_exception_ptr(
          failure_ ? *failure_ : Error(rank_, "NcclComm", "the communicator was destroyed"));
      for (auto& pending : pending_) {
        const bool finished = cudaEventQuery(pending.end) == cudaSuccess;
        for (auto& work : pending.works) {
          if (finished) {
            work->complete();
          } else {
            work->fail(error);
          }
        }
        free_events_.push_back(pending.end);
      }
      pending_.clear();
      for (void* copy : staging_) (void)cudaFreeAsync(copy, stream_->get());
      staging_.clear();
      if (stream_) (void)cudaStreamSynchronize(stream_->get());
      for (cudaEvent_t event : free_events_) (void)cudaEventDestroy(event);
      free_events_.clear();
      for (auto& mark : prerequisites_) (void)cudaEventDestroy(mark.second);
      prerequisites_.clear();
      if (scratch_) (void)cudaFree(scratch_);
      scratch_ = nullptr;
      free_check_buffers();
    } catch (...) {
      // A destructor must not throw; what could fail here is the device itself.
    }
  }

  int size_ = 0;
  cudaStream_t caller_ = cudaStreamPerThread;
  std::optional<cuda::Stream> stream_;
  std::optional<cuda::Event> start_;      ///< re-recorded per operation: a wait copies its state
  cudaStream_t newest_stream_ = nullptr;  ///< where the newest operation was queued
  void* scratch_ = nullptr;               ///< barrier's integer

  std::shared_ptr<WorkState> next_work_;  ///< set by later() for the operation it issues
  /// order_after()'s marks: (stream, event); the first prerequisites_pending_ await an operation.
  std::vector<std::pair<cudaStream_t, cudaEvent_t>> prerequisites_;
  std::size_t prerequisites_pending_ = 0;
  std::vector<void*> staging_;

  // Groups (the issuing thread only; their depth is WatchedComm's group_depth_).
  std::size_t group_operations_ = 0;
  bool group_has_sync_ = false;
  std::string group_first_;
  std::vector<std::shared_ptr<WorkState>> group_works_;
};

}  // namespace tandem::detail::nccl
