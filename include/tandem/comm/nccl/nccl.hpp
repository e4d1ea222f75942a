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
// (options.stream, the calling thread's default stream unless set; use_stream changes it), after
// every operation issued before it, and after the streams order_after(s) marked since the
// previous operation, and:
// - a sync operation returns once it is queued: work queued later on the caller's stream sees
//   its result (stream order, as in PyTorch). It runs on the caller's stream itself, so no event
//   crosses between streams (options.sync_on_caller_stream = false runs it on the
//   communicator's stream, with an event each way). The host does not wait, and nothing
//   synchronises the whole device. synchronize() waits on the host.
// - an `_async` operation runs on the communicator's own stream (so that it overlaps the
//   caller's later work), leaves the caller's stream alone and returns a tandem::Work that the
//   host can wait on (work.wait()) or a stream (work.wait(stream), on the GPU); wait_stream(s)
//   makes a stream wait for every operation issued so far.
// order_after(s) and wait_stream(s) are what tandem's stream-ordering contract
// (comm/stream_order.hpp: tandem::order_after(comm, exec), tandem::hand_back) is built on: code
// whose work runs on another stream than the caller's (DDP, SyncBatchNorm, GradScaler on
// cuda_exec{s}) orders the communicator after it and hands results back to it on the GPU,
// without a host wait and without changing the caller stream for the communicator's other users.
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
// Mismatched collectives: with options.check_collectives (or TANDEM_CHECK_COLLECTIVES=1) every
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
#include "tandem/comm/nccl/detail/engine.hpp"
#include "tandem/comm/nccl/detail/nccl_support.hpp"
#include "tandem/comm/nccl/options.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/cuda/runtime.hpp"
#include "tandem/cuda/stream.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/memory.hpp"

namespace tandem {

class NcclComm;
class NcclGroup;

/// See its definition at the end of this header.
template <class Fn>
requires std::invocable<Fn&, NcclComm&>
void run_local_nccl(int n, Fn fn, NcclCommOptions options = {});

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
  /// does not wait (tandem::hand_back(comm, cuda_exec{stream}) calls it).
  void wait_stream(cudaStream_t stream) { self().wait_stream(stream); }
  /// The next operation, and so every later one, waits on the GPU for the work queued on
  /// `stream` so far (an event recorded there now); the host does not wait, and the caller
  /// stream is unchanged (tandem::order_after(comm, cuda_exec{stream}) calls it). Nothing to do
  /// for caller_stream() itself, which every operation follows anyway.
  void order_after(cudaStream_t stream) { self().order_after(stream); }
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
  /// Whether every collective is compared across ranks first (options().check_collectives,
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
/// NcclCommOptions::check_collectives and NcclComm::checks_collectives()).
template <>
inline constexpr bool can_check_collectives<NcclComm> = true;

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
