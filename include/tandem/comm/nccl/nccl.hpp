// tandem/comm/nccl/nccl.hpp - tandem::NcclComm, the Communicator whose ranks are GPUs (one per
// rank) talking through NVIDIA's NCCL, and run_local_nccl: one thread per GPU of this process.
//   tandem::cuda::select_device(world);   // this rank's GPU becomes current
//   auto comm = tandem::init_process_group<tandem::NcclComm>(world, "env://");
//   comm.all_reduce(grads_on_device, tandem::ReduceOp::avg);   // a View<float, tandem::device>
// Needs: CUDA and NCCL 2.18 or newer (link tandem::nccl); a .cu translation unit (nvcc).
//
// Tensors live in device memory (memory_space = tandem::device); host tensors are a compile
// error. Every element type travels as itself (half and bfloat16 natively), ReduceOp::avg is
// NCCL's ncclAvg, and argument checks and their error texts are the other backends' (one front
// end, detail::CollectiveFrontend).
//
// Streams. Each operation is ordered after the work queued so far on the caller's stream
// (options.stream, the calling thread's default stream unless set; use_stream changes it), and
// after every operation issued before it, and:
// - a sync operation returns once it is queued: work queued later on the caller's stream sees
//   its result (stream order, as in PyTorch). It runs on the caller's stream itself, so no event
//   crosses between streams (options.sync_on_caller_stream = false runs it on the
//   communicator's stream, with an event each way). The host does not wait, and nothing
//   synchronises the whole device. synchronize() waits on the host.
// - an `_async` operation runs on the communicator's own stream (so that it overlaps the
//   caller's later work), leaves the caller's stream alone and returns a tandem::Work that the
//   host can wait on (work.wait()) or a stream (work.wait(stream), on the GPU); wait_stream(s)
//   makes a stream wait for every operation issued so far.
// The tensors of an operation must stay alive and untouched until it has finished on the GPU.
//
// Point to point: NCCL has no tags. Messages between two ranks match in the order they were
// issued, so tag must be 0 (anything else is an Error rather than a silently ignored tag). A
// send waits on the GPU for the matching recv, and one stream runs one operation at a time:
// sends and receives that must progress together (every rank sending before it receives, a send
// to oneself) go in one NcclGroup, as NCCL requires.
//
// Other details: an operation on 0 elements does nothing (every rank agrees on the count); a
// non-root rank's reduce buffer is left as it was; an all_to_all whose buffers overlap reads a
// stream-ordered copy of its input (NCCL's is not in place); barrier is a one-integer
// all_reduce that the sync form also waits for on the host.
//
// Groups: `{ tandem::NcclGroup group(comm); comm.all_reduce(a); comm.broadcast(b, 0); }` issues
// the operations as one ncclGroupStart/ncclGroupEnd; they finish together.
//
// Mismatched collectives: with options.check_agreement (or TANDEM_CHECK_COLLECTIVES=1) every
// collective first all-gathers each rank's fingerprint (comm/checked.hpp) on the communicator's
// stream and compares them on the host, so ranks that disagree raise the same Error before the
// collective is queued. The host waits for that all-gather (after the operations already
// queued), so the check is off unless asked for. Operations inside an NcclGroup, send and recv
// are not checked. The ranks compare the switch itself when the communicator is made.
//
// Never hang. The communicator is created in NCCL's nonblocking mode; every NCCL call that
// reports ncclInProgress is polled within options.timeout. A watchdog thread per communicator
// checks ncclCommGetAsyncError and each operation's age; on an error or an operation older than
// options.timeout (10 min by default) it aborts the communicator (ncclCommAbort) without waiting
// for the caller. The operations in flight then fail (their Work rethrows) and every later call
// raises a tandem::Error naming this rank, the operation, its sequence number and NCCL's text.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tandem/comm/checked.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/check_switch.hpp"
#include "tandem/comm/detail/frontend.hpp"
#include "tandem/comm/detail/rank_threads.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/nccl/detail/nccl_support.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/cuda/runtime.hpp"
#include "tandem/cuda/stream.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/memory.hpp"

namespace tandem {

/// How an NcclComm is made and behaves.
struct NcclCommOptions {
  /// How long one operation may take from being issued to finishing on the GPU before the
  /// watchdog aborts the communicator; also bounds the rendezvous, NCCL's initialisation and
  /// every host wait. PyTorch's NCCL default.
  Timeout timeout = std::chrono::minutes(10);
  /// The caller's stream (see the top of this header). cudaStreamPerThread: the default stream
  /// of whichever thread issues the operation.
  cudaStream_t stream = cudaStreamPerThread;
  /// The GPU of this rank; -1: the device current on the thread that makes the communicator.
  int device = -1;
  /// How often the watchdog looks at NCCL's error state and the operations' ages while no
  /// `_async` Work waits (with one waiting, it looks every 50 microseconds, so that
  /// Work::wait() returns promptly).
  std::chrono::milliseconds watchdog_interval{100};
  /// Priority of the communicator's stream (lower runs first; cudaDeviceGetStreamPriorityRange).
  int stream_priority = 0;
  /// Where a sync operation (outside an NcclGroup) runs. true: on the caller's stream itself,
  /// which it would wait for anyway, so that nothing is handed between streams (one event
  /// for the watchdog is the whole per-call cost). false: on the communicator's stream, with
  /// an event each way, as the `_async` forms and PyTorch's ProcessGroupNCCL do.
  bool sync_on_caller_stream = true;
  /// Whether every collective's fingerprint (operation, element type, count, root, reduce op,
  /// how many came before) is compared across ranks before it runs, so that a mismatch is an
  /// Error naming both sides instead of a hang or mixed data. Unset: TANDEM_CHECK_COLLECTIVES,
  /// else off - on NCCL each check is an all-gather the host waits for, which stalls the
  /// caller's pipelining (see the top of this header).
  CollectiveCheck check_agreement{};
};

class NcclComm;
class NcclGroup;

/// See its definition at the end of this header.
template <class Fn>
requires std::invocable<Fn&, NcclComm&>
void run_local_nccl(int n, Fn fn, NcclCommOptions options = {});

namespace detail::nccl {

/// Makes `device` current for a scope and puts the previous one back.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : target_(device) {
    cuda::check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != target_) cuda::check(cudaSetDevice(target_), "cudaSetDevice");
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (previous_ != target_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  int target_ = 0;
};

/// An operation issued on the communicator's stream and not yet seen finished by the watchdog.
struct Pending {
  std::uint64_t sequence = 0;
  const char* operation = "";  ///< a literal: no allocation per operation
  std::string group;           ///< a group's description (empty for a single operation)
  Deadline::clock::time_point issued{};
  cudaEvent_t end = nullptr;
  std::vector<std::shared_ptr<WorkState>> works;  ///< the `_async` Works it completes

  [[nodiscard]] std::string name() const {
    return group.empty() ? describe_operation(operation, sequence) : group;
  }
};

/// Polls a nonblocking NCCL communicator until its pending call has settled. Returns its final
/// state (ncclSuccess or an error); ncclInProgress past the deadline is reported as such.
inline ncclResult_t settle(ncclComm_t comm, ncclResult_t state, const Deadline& deadline,
                           const std::atomic<bool>* stop = nullptr) {
  int spins = 0;
  while (state == ncclInProgress) {
    if (deadline.expired() || (stop && stop->load())) return ncclInProgress;
    if (++spins < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(spins < 1024 ? 20 : 1000));
    }
    ncclResult_t query = ncclCommGetAsyncError(comm, &state);
    if (query != ncclSuccess) state = query;
  }
  return state;
}

/// Makes this rank's NCCL communicator: nonblocking ncclCommInitRankConfig, polled until every
/// rank has joined or options.timeout has passed (then aborted: a rank that never joins is an
/// Error, not a hang). The device must be current.
inline ncclComm_t init_rank(const ncclUniqueId& id, int rank, int size, Timeout timeout,
                            const std::atomic<bool>* stop = nullptr) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  // NCCL's background initialisation may still write the handle after a timeout: it gets a slot
  // on the heap that is freed only once NCCL is done with it (leaked on the failure paths).
  auto slot = std::make_unique<ncclComm_t>(nullptr);
  const Deadline deadline(timeout);
  ncclResult_t state = ncclCommInitRankConfig(slot.get(), size, id, rank, &config);
  const ncclComm_t comm = *slot;
  // NCCL sets *slot before returning; its job writes it again when it ends. Poll the new
  // communicator until it has settled (ncclCommGetAsyncError then has joined the job's thread).
  if (comm && (state == ncclSuccess || state == ncclInProgress)) {
    state = settle(comm, ncclInProgress, deadline, stop);
  }
  if (state == ncclSuccess) return *slot;
  (void)slot.release();
  std::string why = error_text(state, comm);
  if (state == ncclInProgress) {
    why = stop && stop->load()
              ? "stopped while waiting for the other ranks (another rank failed)"
              : "not every one of the " + std::to_string(size) + " ranks joined within " +
                    describe(timeout) + " (a rank that never started, or another unique id)";
  }
  if (comm) (void)ncclCommAbort(comm);
  throw Error(rank, "NcclComm init", why);
}

/// One rank's communicator. Heap-allocated and owned by the NcclComm, so that run_local_nccl's
/// abort and `_async` bookkeeping may point at it while the NcclComm moves. One thread issues
/// operations at a time (NCCL communicators are not thread-safe); the watchdog thread runs
/// beside it, and mutex_ keeps the two from calling NCCL on the communicator at once.
class Engine {
 public:
  Engine(ncclComm_t comm, int device, NcclCommOptions options)
      : comm_(comm), device_(device), options_(options), caller_(options.stream) {
    try {
      DeviceGuard guard(device_);
      check(ncclCommUserRank(comm_, &rank_), unknown_rank, "ncclCommUserRank", comm_, false);
      check(ncclCommCount(comm_, &size_), rank_, "ncclCommCount", comm_, false);
      stream_.emplace(options_.stream_priority);
      newest_stream_ = stream_->get();
      start_.emplace();
      cuda::check(cudaMalloc(&scratch_, sizeof(std::int32_t)), "cudaMalloc", rank_);
      watchdog_ = std::thread([this] { watch(); });
    } catch (...) {
      (void)ncclCommAbort(comm_);
      if (scratch_) (void)cudaFree(scratch_);
      throw;
    }
  }

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  ~Engine() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    close();
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] const NcclCommOptions& options() const noexcept { return options_; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_->get(); }
  [[nodiscard]] cudaStream_t caller_stream() const noexcept { return caller_; }
  void use_stream(cudaStream_t stream) noexcept { caller_ = stream; }
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
        return grouped([&] {
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
        return grouped([&] {
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
        return grouped([&] {
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

  // --- collective checks ------------------------------------------------------------------

  /// Resolves options.check_agreement and compares it across the ranks (one all-gather, always:
  /// ranks that differ would otherwise hang at the first check). create() calls it once the
  /// communicator is whole; split's children inherit the parent's.
  void agree_on_checks() {
    checks_collectives_ = detail::agree_on_check_switch(
        rank_, "NcclComm", options_.check_agreement, false, [&](int mine) {
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

  // --- beyond the Communicator concept ----------------------------------------------------

  /// Blocks the host until every operation issued so far has finished on the GPU (or raises the
  /// Error that aborted the communicator).
  void synchronize() {
    DeviceGuard guard(device_);
    cudaEvent_t newest = nullptr;
    {
      std::lock_guard lock(mutex_);
      throw_if_failed("synchronize");
      if (pending_.empty()) return;  // the watchdog has seen every operation finish
      // issue() orders the operations across streams, so the newest one's end covers them all.
      // Its event is recycled only by take_event(), on the issuing thread: this one.
      newest = pending_.back().end;
    }
    wait_on_host(newest, "synchronize");
  }

  /// Work queued on `stream` from now on waits for every operation issued so far.
  void wait_stream(cudaStream_t stream) {
    DeviceGuard guard(device_);
    std::lock_guard lock(mutex_);
    throw_if_failed("wait_stream");
    if (pending_.empty()) return;  // every operation has finished
    cuda::check(cudaStreamWaitEvent(stream, pending_.back().end, 0), "cudaStreamWaitEvent", rank_);
  }

  /// Aborts the communicator from any thread (run_local_nccl does, when a rank fails): the
  /// operations in flight fail, and later calls raise an Error with `cause`.
  void abort(const std::string& cause) {
    std::lock_guard lock(mutex_);
    if (failure_) return;
    abort_locked("abort", sequence_, cause);
  }

  /// Whether an abort has begun (set before ncclCommAbort runs); lock-free, any thread.
  [[nodiscard]] bool aborted() const noexcept { return aborted_.load(std::memory_order_acquire); }

  /// The Error the communicator was aborted with, if it was.
  [[nodiscard]] std::optional<Error> failure() const {
    std::lock_guard lock(mutex_);
    return failure_;
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

  /// With checks on: this rank's fingerprint for the collective about to be issued, compared
  /// with every rank's; a mismatch is the same Error on every rank, before anything is queued.
  template <class E>
  void check_call(detail::CollectiveOp op, std::size_t count, int root = 0,
                  ReduceOp reduce = ReduceOp::sum) {
    if (!checks_collectives_ || group_depth_ > 0) return;
    const auto mine = detail::make_fingerprint<E>(op, ++checked_calls_, count, root, reduce);
    const auto all = gather_fingerprints(mine, "collective check");
    if (auto text = detail::fingerprint_disagreement(all); !text.empty()) {
      throw Error(rank_, detail::name(op), text);
    }
  }

  /// Every rank's fingerprint (in rank order): an ncclAllGather on the communicator's stream,
  /// after the operations issued so far but not after the caller's other work, waited for on
  /// the host within the timeout (the watchdog aborts it past that, like any operation).
  std::vector<detail::CollectiveFingerprint> gather_fingerprints(
      const detail::CollectiveFingerprint& mine, const char* what) {
    using Fingerprint = detail::CollectiveFingerprint;
    constexpr std::size_t words = sizeof(Fingerprint) / sizeof(std::int64_t);
    const auto ranks = static_cast<std::size_t>(size_);
    if (!check_host_) {
      DeviceGuard guard(device_);
      void* host = nullptr;
      cuda::check(cudaMallocHost(&host, ranks * sizeof(Fingerprint)), "cudaMallocHost", rank_);
      check_host_ = static_cast<Fingerprint*>(host);
      void* device = nullptr;
      cuda::check(cudaMalloc(&device, ranks * sizeof(Fingerprint)), "cudaMalloc", rank_);
      check_device_ = static_cast<Fingerprint*>(device);
    }
    Fingerprint* const host = check_host_;
    Fingerprint* const device = check_device_;
    const auto slot = static_cast<std::size_t>(rank_);
    host[slot] = mine;
    // The check is an operation of its own: it must not complete the Work of an _async
    // operation being issued.
    std::shared_ptr<WorkState> saved = std::move(next_work_);
    next_work_.reset();
    const auto restore = [&] { next_work_ = std::move(saved); };
    try {
      const cudaEvent_t end = issue(
          what, words,
          [&](ncclComm_t comm, cudaStream_t stream) {
            cuda::check(cudaMemcpyAsync(device + slot, host + slot, sizeof(Fingerprint),
                                        cudaMemcpyHostToDevice, stream),
                        "cudaMemcpyAsync", rank_);
            return ncclAllGather(device + slot, device, words, ncclInt64, comm, stream);
          },
          /*after_caller=*/false);
      if (end) wait_on_host(end, what);
      DeviceGuard guard(device_);
      const cudaStream_t stream = stream_->get();
      cuda::check(cudaMemcpyAsync(host, device, ranks * sizeof(Fingerprint), cudaMemcpyDeviceToHost,
                                  stream),
                  "cudaMemcpyAsync", rank_);
      // Nothing is queued behind the all-gather (this thread issues): this waits for the copy.
      cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize", rank_);
    } catch (...) {
      restore();
      throw;
    }
    restore();
    return std::vector<Fingerprint>(host, host + ranks);
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

  /// The grouped send/recv of NCCL versions without gather, scatter and all-to-all of their own.
  template <class Calls>
  ncclResult_t grouped(Calls calls) {
    ncclResult_t state = ncclGroupStart();
    if (state != ncclSuccess) return state;
    const ncclResult_t inner = calls();
    state = ncclGroupEnd();
    return inner != ncclSuccess ? inner : state;
  }

  /// settle() with mutex_ released between polls, so the watchdog (or an abort) can step in.
  ncclResult_t settle_locked(std::unique_lock<std::mutex>& lock, ncclComm_t comm,
                             ncclResult_t state, const Deadline& deadline) {
    int spins = 0;
    while (state == ncclInProgress && !failure_) {
      if (deadline.expired()) return ncclInProgress;
      lock.unlock();
      if (++spins < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(spins < 1024 ? 20 : 1000));
      }
      lock.lock();
      if (failure_) break;
      ncclResult_t query = ncclCommGetAsyncError(comm, &state);
      if (query != ncclSuccess) state = query;
    }
    return failure_ ? ncclInternalError : state;
  }

  std::string settle_failure(ncclResult_t state) const {
    if (state == ncclInProgress) {
      return "NCCL did not finish queueing it within " + describe(options_.timeout);
    }
    return error_text(state, comm_);
  }

  void throw_if_failed(const std::string& operation) const {
    if (!failure_) return;
    throw Error(rank_, operation,
                "the communicator was aborted earlier (" + std::string(failure_->what()) + ")");
  }

  /// Records why, aborts NCCL's communicator (its kernels stop, so the streams drain) and fails
  /// every operation in flight. Inside a group the abort waits for the group to end: the
  /// thread's group still refers to the communicator.
  void abort_locked(const std::string& operation, std::uint64_t sequence,
                    const std::string& cause) {
    if (failure_) return;
    if (group_depth_ > 0 && !deferred_abort_) {
      deferred_abort_.emplace(operation, std::make_pair(sequence, cause));
      return;
    }
    const std::string name = operation.find("sequence number") == std::string::npos
                                 ? nccl::describe_operation(operation, sequence)
                                 : operation;
    failure_.emplace(rank_, name, cause);
    aborted_.store(true, std::memory_order_release);
    if (comm_) (void)ncclCommAbort(comm_);
    comm_ = nullptr;
    const auto error = std::make_exception_ptr(*failure_);
    for (auto& pending : pending_) {
      for (auto& work : pending.works) work->fail(error);
      free_events_.push_back(pending.end);
    }
    pending_.clear();
    async_pending_ = 0;
  }

  /// Waits on the host for `event`, polling so that an abort by the watchdog (or a timeout the
  /// watchdog has not seen yet) ends the wait with an Error.
  void wait_on_host(cudaEvent_t event, const char* operation) {
    const Deadline deadline(options_.timeout + options_.watchdog_interval * 2);
    int spins = 0;
    for (;;) {
      const cudaError_t status = cudaEventQuery(event);
      if (status == cudaSuccess) return;
      if (status != cudaErrorNotReady) cuda::check(status, operation, rank_);
      {
        std::lock_guard lock(mutex_);
        throw_if_failed(operation);
      }
      if (deadline.expired()) {
        abort(std::string(operation) + " waited " + describe(options_.timeout) +
              " on the host without the operations finishing");
        std::lock_guard lock(mutex_);
        throw_if_failed(operation);
      }
      if (++spins < 256) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  cudaEvent_t take_event() {
    if (!free_events_.empty()) {
      const cudaEvent_t event = free_events_.back();
      free_events_.pop_back();
      return event;
    }
    cudaEvent_t event = nullptr;
    cuda::check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                "cudaEventCreateWithFlags", rank_);
    return event;
  }

  // --- the watchdog -------------------------------------------------------------------------

  void watch() {
    std::unique_lock lock(mutex_);
    while (!stopping_) {
      const auto interval =
          async_pending_ > 0
              ? std::chrono::microseconds(50)
              : std::chrono::duration_cast<std::chrono::microseconds>(options_.watchdog_interval);
      wake_.wait_for(lock, interval);
      if (stopping_) break;
      if (!failure_ && comm_) inspect();
    }
  }

  /// One look: NCCL's asynchronous error state, then the operations in issue order (they finish
  /// in that order: issue() chains them across streams).
  void inspect() {
    ncclResult_t state = ncclSuccess;
    if (const ncclResult_t query = ncclCommGetAsyncError(comm_, &state); query != ncclSuccess) {
      state = query;
    }
    if (state != ncclSuccess && state != ncclInProgress) {
      const auto [name, sequence] = oldest();
      abort_locked(name, sequence,
                   "NCCL reported an asynchronous error: " + error_text(state, comm_));
      return;
    }
    const auto now = Deadline::clock::now();
    while (!pending_.empty()) {
      Pending& oldest_op = pending_.front();
      const cudaError_t status = cudaEventQuery(oldest_op.end);
      if (status == cudaErrorNotReady) {
        if (now - oldest_op.issued > options_.timeout) {
          abort_locked(oldest_op.name(), oldest_op.sequence,
                       "did not finish within " + describe(options_.timeout) +
                           " (a rank that never called it, or called another collective); "
                           "NCCL's state: " +
                           error_text(state, comm_));
        }
        return;
      }
      if (status != cudaSuccess) {
        abort_locked(oldest_op.name(), oldest_op.sequence,
                     std::string("CUDA reported ") + cudaGetErrorName(status) + ": " +
                         cudaGetErrorString(status));
        return;
      }
      for (auto& work : oldest_op.works) work->complete();
      if (!oldest_op.works.empty()) --async_pending_;
      free_events_.push_back(oldest_op.end);
      pending_.pop_front();
    }
  }

  std::pair<std::string, std::uint64_t> oldest() const {
    if (pending_.empty()) return {"no operation in flight", sequence_};
    return {pending_.front().name(), pending_.front().sequence};
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
      if (scratch_) (void)cudaFree(scratch_);
      scratch_ = nullptr;
      if (check_host_) (void)cudaFreeHost(check_host_);
      if (check_device_) (void)cudaFree(check_device_);
      check_host_ = nullptr;
      check_device_ = nullptr;
    } catch (...) {
      // A destructor must not throw; what could fail here is the device itself.
    }
  }

  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int size_ = 0;
  int device_ = 0;
  NcclCommOptions options_;
  cudaStream_t caller_ = cudaStreamPerThread;
  std::optional<cuda::Stream> stream_;
  std::optional<cuda::Event> start_;      ///< re-recorded per operation: a wait copies its state
  cudaStream_t newest_stream_ = nullptr;  ///< where the newest operation was queued
  bool checks_collectives_ = false;       ///< compare fingerprints before each collective
  std::uint64_t checked_calls_ = 0;       ///< collectives checked so far (the fingerprint's count)
  detail::CollectiveFingerprint* check_host_ = nullptr;    ///< pinned: every rank's fingerprint
  detail::CollectiveFingerprint* check_device_ = nullptr;  ///< the all-gather's buffer
  void* scratch_ = nullptr;                                ///< barrier's integer

  std::shared_ptr<WorkState> next_work_;  ///< set by later() for the operation it issues
  std::vector<void*> staging_;

  // Groups (the issuing thread only).
  int group_depth_ = 0;
  std::size_t group_operations_ = 0;
  bool group_has_sync_ = false;
  std::string group_first_;
  std::vector<std::shared_ptr<WorkState>> group_works_;

  // Shared with the watchdog: guarded by mutex_.
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::uint64_t sequence_ = 0;
  std::deque<Pending> pending_;
  std::size_t async_pending_ = 0;
  std::vector<cudaEvent_t> free_events_;
  std::optional<Error> failure_;
  std::atomic<bool> aborted_{false};  ///< failure_ is set: readable without mutex_
  std::optional<std::pair<std::string, std::pair<std::uint64_t, std::string>>> deferred_abort_;

  std::thread watchdog_;  // last: starts once everything above exists
};

}  // namespace detail::nccl

/// A communicator of GPUs over NCCL, one GPU per rank. Models tandem::Communicator and
/// tandem::ProcessGroupBackend; see the top of this header. Its public operations (and
/// memory_space, device) come from detail::CollectiveFrontend.
class NcclComm : public detail::CollectiveFrontend<NcclComm, device> {
 public:
  /// The settings init_process_group<NcclComm> passes to rendezvous().
  using options_type = NcclCommOptions;

  /// Moves the communicator; the source is left empty, and any call on it throws.
  NcclComm(NcclComm&&) noexcept = default;
  /// Moves the communicator; the source is left empty, and any call on it throws.
  NcclComm& operator=(NcclComm&&) noexcept = default;
  ~NcclComm() = default;

  /// For init_process_group<NcclComm>: rank 0 makes the ncclUniqueId and publishes it in
  /// `store`; every rank then joins the NCCL communicator. Collective. The GPU is
  /// options.device, or the current device (select it first, e.g. from world.local_rank).
  [[nodiscard]] static NcclComm rendezvous(const World& world, AnyStore& store,
                                           const NcclCommOptions& options = {}) {
    world.validate();
    // Ranks call rendezvous on a store the same number of times, so this count names the group.
    const std::int64_t generation =
        store.add("nccl/rendezvous/rank" + std::to_string(world.rank), 1);
    const std::string key = "nccl/" + std::to_string(generation) + "/unique_id";
    if (world.rank == 0) store.set(key, detail::nccl::encode_unique_id(unique_id()));
    const auto id = detail::nccl::decode_unique_id(store.get(key, options.timeout), world.rank);
    return create(id, world.rank, world.world_size, options);
  }

  /// A fresh ncclUniqueId (made on one rank, handed to the others by any means).
  [[nodiscard]] static ncclUniqueId unique_id() {
    ncclUniqueId id{};
    detail::nccl::check(ncclGetUniqueId(&id), unknown_rank, "ncclGetUniqueId", nullptr, false);
    return id;
  }

  /// Joins rank `rank` of `size` to the communicator named by `id`. Collective: every rank calls
  /// it within options.timeout, each from its own thread or process and on its own GPU.
  [[nodiscard]] static NcclComm create(const ncclUniqueId& id, int rank, int size,
                                       const NcclCommOptions& options = {}) {
    return create(id, rank, size, options, nullptr);
  }

  /// The settings it was created with (device as given: -1 when it took the current device).
  [[nodiscard]] const NcclCommOptions& options() const { return self().options(); }
  /// This rank's GPU.
  [[nodiscard]] int device() const { return self().device(); }
  /// The communicator's own stream, where its operations run.
  [[nodiscard]] cudaStream_t stream() const { return self().stream(); }
  /// The caller's stream the operations are ordered with (see the top of this header).
  [[nodiscard]] cudaStream_t caller_stream() const { return self().caller_stream(); }
  /// Orders later operations with `stream` instead (for the thread that issues them).
  void use_stream(cudaStream_t stream) { self().use_stream(stream); }
  /// Work queued on `stream` from now on waits for every operation issued so far; the host
  /// does not wait.
  void wait_stream(cudaStream_t stream) { self().wait_stream(stream); }
  /// Blocks the host until every operation issued so far has finished (within the timeout).
  void synchronize() { self().synchronize(); }
  /// Aborts the communicator now, from any thread: operations in flight fail, later calls raise
  /// tandem::Error with `cause`.
  void abort(const std::string& cause = "aborted by the program") { self().abort(cause); }
  /// The Error that aborted the communicator, if one did.
  [[nodiscard]] std::optional<Error> failure() const { return self().failure(); }
  /// Whether the communicator has been aborted (or an abort is under way). Unlike failure() it
  /// takes no lock, so it answers at once even while NCCL's abort is still running.
  [[nodiscard]] bool aborted() const { return self().aborted(); }
  /// NCCL's communicator, for calls tandem does not make (null once aborted).
  [[nodiscard]] ncclComm_t native() const { return self().native(); }
  /// Whether every collective is compared across ranks first (options().check_agreement,
  /// resolved against TANDEM_CHECK_COLLECTIVES when the communicator was made; the same on
  /// every rank).
  [[nodiscard]] bool checks_collectives() const { return self().checks_collectives(); }

 private:
  friend class detail::CollectiveFrontend<NcclComm, tandem::device>;
  friend class NcclGroup;
  template <class Fn>
  requires std::invocable<Fn&, NcclComm&>
  friend void run_local_nccl(int n, Fn fn, NcclCommOptions options);

  explicit NcclComm(std::shared_ptr<detail::nccl::Engine> self) : self_(std::move(self)) {}

  /// create(), giving up early once `stop` is set (run_local_nccl: another rank failed).
  static NcclComm create(const ncclUniqueId& id, int rank, int size, const NcclCommOptions& options,
                         const std::atomic<bool>* stop) {
    if (size < 1 || rank < 0 || rank >= size) {
      throw Error(rank, "NcclComm",
                  "rank " + std::to_string(rank) + " is not in a group of " + std::to_string(size) +
                      " ranks");
    }
    int device = options.device;
    if (device < 0) device = cuda::current_device();
    detail::nccl::DeviceGuard guard(device);
    ncclComm_t comm = detail::nccl::init_rank(id, rank, size, options.timeout, stop);
    auto made = std::make_shared<detail::nccl::Engine>(comm, device, options);
    made->agree_on_checks();
    return NcclComm(std::move(made));
  }

  detail::nccl::Engine& self() const {
    if (!self_) throw Error("NcclComm", "this communicator was moved from");
    return *self_;
  }

  /// split's collective part (see CollectiveFrontend::split).
  std::optional<NcclComm> split_group(int color, int key) {
    auto made = self().split(color, key);
    if (!made) return std::nullopt;
    return NcclComm(std::shared_ptr<detail::nccl::Engine>(std::move(made)));
  }

  std::shared_ptr<detail::nccl::Engine> self_;
};

static_assert(Communicator<NcclComm>);

/// NcclComm can compare every collective across ranks (off unless asked for: see
/// NcclCommOptions::check_agreement and NcclComm::checks_collectives()).
template <>
inline constexpr bool detects_mismatched_collectives<NcclComm> = true;

/// Each NcclComm operation waits on the GPU for the work queued on caller_stream() before it.
template <>
inline constexpr bool orders_after_caller_stream<NcclComm> = true;

/// Several operations on one or more communicators issued as one NCCL group (ncclGroupStart at
/// construction, ncclGroupEnd at end() or destruction): they are launched together and finish
/// together, and sends and receives inside progress concurrently. The communicators' threads
/// issue nothing else meanwhile (an NCCL group belongs to the thread that opened it).
///   { tandem::NcclGroup group(comm); comm.send(a, peer); comm.recv(b, peer); }
class NcclGroup {
 public:
  /// Opens a group on one communicator.
  explicit NcclGroup(NcclComm& comm) : NcclGroup({&comm}) {}
  /// Opens one group over several communicators (e.g. one thread driving several GPUs); if
  /// entering one fails, those already entered are left again and the error is rethrown.
  explicit NcclGroup(std::initializer_list<NcclComm*> comms) {
    for (NcclComm* comm : comms) ranks_.push_back(&comm->self());
    std::size_t entered = 0;
    try {
      for (auto* rank : ranks_) {
        rank->group_enter();
        ++entered;
      }
      detail::nccl::check(ncclGroupStart(), ranks_.front()->rank(), "ncclGroupStart", nullptr,
                          false);
    } catch (...) {
      for (std::size_t i = 0; i < entered; ++i) {
        ranks_[i]->group_leave(ncclSuccess, Deadline(Timeout::zero()), false);
      }
      throw;
    }
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  /// Ends the group now; a failure is raised here (from the destructor it is only recorded,
  /// and the communicator's next call raises it).
  void end() { finish(true); }

  ~NcclGroup() {
    if (!ended_) finish(false);
  }

 private:
  void finish(bool raise) {
    if (ended_) return;
    ended_ = true;
    const ncclResult_t state = ncclGroupEnd();
    std::exception_ptr first;
    for (auto* rank : ranks_) {
      try {
        rank->group_leave(state, Deadline(rank->options().timeout), true);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first && raise) std::rethrow_exception(first);
  }

  std::vector<detail::nccl::Engine*> ranks_;
  bool ended_ = false;
};

/// Runs fn(comm) on `n` threads, one per GPU: thread i drives GPU i (of those this process
/// sees) as rank i of one NcclComm group, and they are joined. When a rank's fn throws, the
/// other ranks' communicators are aborted (their operations in flight and later calls raise
/// tandem::Error naming the failed rank); after the join, the first failure is rethrown as a
/// tandem::Error naming its rank. Needs n GPUs (NCCL runs one rank per GPU). options apply to
/// every rank, except device (rank i's is GPU i) and stream (each thread's default stream).
template <class Fn>
requires std::invocable<Fn&, NcclComm&>
void run_local_nccl(int n, Fn fn, NcclCommOptions options) {
  const int gpus = cuda::device_count();
  if (n < 1 || n > gpus) {
    throw Error("run_local_nccl", "needs one GPU per rank: " + std::to_string(n) +
                                      " ranks asked for, " + std::to_string(gpus) +
                                      " GPUs visible");
  }
  if (options.stream != cudaStreamPerThread) {
    // One stream cannot be every rank's: each GPU has streams of its own.
    throw Error("run_local_nccl",
                "options.stream must be cudaStreamPerThread here (each rank's thread has its own); "
                "call comm.use_stream(s) inside fn for a stream of that rank's GPU");
  }
  const ncclUniqueId id = NcclComm::unique_id();
  std::atomic<bool> stop{false};
  detail::FirstFailure failures;
  std::mutex ranks_mutex;
  std::vector<std::weak_ptr<detail::nccl::Engine>> ranks(static_cast<std::size_t>(n));
  detail::run_rank_threads(
      n, "run_local_nccl", failures,
      [&](int r) {
        NcclCommOptions own = options;
        own.device = r;
        cuda::check(cudaSetDevice(r), "cudaSetDevice", r);
        NcclComm comm = NcclComm::create(id, r, n, own, &stop);
        {
          // A rank that failed before this one registered cannot have aborted it: do it here.
          std::lock_guard lock(ranks_mutex);
          ranks[static_cast<std::size_t>(r)] = comm.self_;
        }
        if (auto failed = failures.rank()) {
          comm.abort("rank " + std::to_string(*failed) + " failed");
        }
        fn(comm);
      },
      [&](int rank, const std::string& what) {
        stop = true;  // ranks still creating their communicators give up
        std::vector<std::shared_ptr<detail::nccl::Engine>> others;
        {
          std::lock_guard lock(ranks_mutex);
          for (int r = 0; r < n; ++r) {
            if (r == rank) continue;
            if (auto other = ranks[static_cast<std::size_t>(r)].lock()) others.push_back(other);
          }
        }
        for (auto& other : others)
          other->abort("rank " + std::to_string(rank) + " failed: " + what);
      });
}

}  // namespace tandem
