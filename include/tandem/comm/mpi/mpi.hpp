// tandem/comm/mpi/mpi.hpp - tandem::MpiComm, the Communicator over MPI: one process per rank,
// started by mpirun (or srun), every collective and point to point, sync and `_async`, and split.
//   auto comm = tandem::MpiComm::world();        // MPI_COMM_WORLD's ranks, in a private copy
//   comm.all_reduce(grads, tandem::ReduceOp::avg);
// Needs: an MPI (C API, MPI-3; tested with OpenMPI 4.1); link tandem::mpi.
//
// MPI itself: the first MpiComm initialises MPI (MPI_Init_thread asking for MPI_THREAD_MULTIPLE)
// unless the program already did, and MPI is finalised at exit only if MpiComm initialised it.
// Every MpiComm owns its MPI communicator (a duplicate of the one it was made from, or split's
// result; freed by its destructor), so the program's own MPI traffic never matches tandem's, and
// reports MPI's errors as tandem::Error (MPI_ERRORS_RETURN) naming the rank, the operation and
// MPI's error string.
//
// Semantics follow torch.distributed, as LocalComm's do, with MPI's rules where they differ:
// - Size, root, peer and tag checks and avg on integers raise tandem::Error (LocalComm's texts)
//   before anything is sent.
// - Mismatch check (tandem/comm/checked.hpp), on by default: before each collective (and split)
//   the ranks all-gather a 64-byte fingerprint (operation, element type, count, root, reduce op,
//   sequence number) on the thread that then makes the call, so that ranks that disagree all
//   raise a tandem::Error naming what differs and each rank's call, and nothing is sent; the
//   communicator stays usable. bench/results/check-cost.md measures the cost (one small
//   MPI_Allgather). TANDEM_CHECK_COLLECTIVES=0 or options.check_agreement = false turns it off;
//   a mismatch is then erroneous MPI (it may hang, fail or mix data). Every rank must make the
//   same choice: making the communicator compares them (an Error on every rank otherwise).
//   Where MPI calls are serialized, an `_async` collective compares on the calling thread before
//   its request starts, so it returns once every rank has called it.
// - half and bfloat16 reduce with MPI ops of their own, computing in float and rounding once per
//   combination of two ranks' elements; avg is sum, then division by size().
// - send may block until the receiver has posted a matching recv (MPI standard mode); recv checks
//   that the message held exactly t.size() elements (a longer one is MPI_ERR_TRUNCATE). Element
//   types are not checked across ranks.
// - Every collective, sync or `_async`, is MPI's blocking call (MPI_Allreduce, MPI_Bcast, ...),
//   as in PyTorch's ProcessGroupMPI: MPI never matches a blocking collective with a non-blocking
//   one, and this way ranks may call one collective in different forms (rank 0 all_reduce, rank
//   1 all_reduce_async) and it still matches. A sync collective (and split) first waits for the
//   pending `_async` collectives, then makes its call on the calling thread. An `_async`
//   collective is queued to the communicator's worker thread (started on first use), which
//   makes the calls one at a time in call order, then runs what follows (avg's division) and
//   completes the Work; meanwhile the calling thread goes on (computing, or sending). The
//   tensors must stay alive and untouched until the Work completes.
// - Point to point: send and recv are MPI_Send and MPI_Recv on the calling thread; send_async
//   and recv_async are MPI_Isend and MPI_Irecv, started at once, and a progress thread (started
//   on first use) tests them and completes their Work. Both forms match each other. Sync
//   send/recv do not wait for anything, so that a pending recv_async cannot dead-lock a later
//   sync operation, and sync collectives do not wait for pending point-to-point operations.
// - options().timeout: a blocking MPI call on the calling thread (sync collectives, send, recv,
//   split, the fingerprint exchange) cannot be timed out or cancelled, so a watchdog thread per
//   communicator ends the job when one lasts longer than the timeout: it prints the
//   tandem::Error (rank, operation, time, timeout) to stderr and calls MPI_Abort on
//   MPI_COMM_WORLD with exit code 124 (below MPI_THREAD_SERIALIZED, where that thread may not
//   call MPI, it ends this process with code 124 and mpirun ends the others). An `_async`
//   operation not complete within the timeout of its call fails its Work with a tandem::Error,
//   and so do the `_async` collectives queued behind it; the communicator becomes unusable
//   (every later call raises tandem::Error). MPI cannot cancel an operation: the worker stays
//   blocked in the collective, and MPI may still write its buffers, until the other ranks join
//   it or the job ends - end the job (MPI_Abort). A sync collective waits at most the timeout
//   for the pending `_async` ones.
// - Destroying an MpiComm waits for its pending `_async` operations, at most options().timeout
//   for the collectives and as long again for point to point, then frees its MPI communicator.
//   Where a collective is still inside MPI then (a rank never joined it), its Work fails and its
//   worker thread is detached and left blocked in MPI, never joined: it frees the communicator
//   itself if MPI ever returns; until then its communicator and state are leaked and MPI is not
//   finalised at exit (finalising under a thread inside MPI is erroneous; mpirun then reports
//   the missing MPI_Finalize, which names the real problem).
//   Point-to-point requests still pending are abandoned (leaked, never freed).
// - Thread level: with MPI_THREAD_MULTIPLE the worker, the progress thread and the calling
//   thread call MPI at the same time. With MPI_THREAD_SERIALIZED (a program that initialised MPI
//   so) all MPI calls of the process take turns on one mutex, so no thread may block inside MPI:
//   every operation, sync or `_async`, is MPI's non-blocking call - sync ones polled with
//   MPI_Test on the calling thread, `_async` ones completed by the progress thread - and forms
//   still mix freely across ranks, at the speed of MPI's non-blocking collectives. Below that
//   (SINGLE, FUNNELED) no other thread may call MPI: `_async` operations are the blocking calls,
//   complete before they return, on the calling thread (so a recv_async waits for its message).
// - CPU use: Open MPI spins while a blocking call waits. Where the ranks on this node times two
//   (the caller and the `_async` worker, both waiting inside MPI) exceed its CPUs, or mpirun bound
//   a rank to one core, the MPI that MpiComm initialises yields the CPU while it waits
//   (OMPI_MCA_mpi_yield_when_idle=1, set only when unset: yours wins); otherwise a rank spinning
//   for a peer without a CPU holds its own for a whole time slice (milliseconds per collective on
//   a busy machine). The worker runs as SCHED_BATCH on Linux, so that queueing a collective does
//   not hand the caller's CPU to it (a free CPU still runs it at once).
// - One MpiComm is used by one thread at a time (several MpiComms may be used concurrently where
//   MPI provides MPI_THREAD_MULTIPLE or SERIALIZED).
#pragma once

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <mpi.h>

#include "tandem/comm/checked.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/check_switch.hpp"
#include "tandem/comm/detail/collective_args.hpp"
#include "tandem/comm/detail/frontend.hpp"
#include "tandem/comm/detail/reduction.hpp"
#include "tandem/comm/detail/staging.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/mpi/detail/mpi_engine.hpp"
#include "tandem/comm/mpi/detail/mpi_runtime.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// What MpiComm::world, duplicate and init_process_group<MpiComm> take.
struct MpiCommOptions {
  /// How long an `_async` operation may stay pending (queued or inside MPI) before its Work
  /// fails and the communicator becomes unusable; also how long a sync collective waits for the
  /// pending `_async` ones and the destructor for all pending ones. A sync operation's own
  /// blocking MPI call that lasts longer ends the job (the watchdog: see tandem/comm/mpi/mpi.hpp).
  Timeout timeout = default_timeout;
  /// Exchange and compare every collective's fingerprint first (tandem/comm/checked.hpp).
  /// Unset: TANDEM_CHECK_COLLECTIVES, else on. `= false` or `= true` wins over the variable.
  CollectiveCheck check_agreement{};
};

namespace detail::mpi {

/// A copy of `count` elements at `data` that lives as long as the closures holding it.
template <class T>
std::shared_ptr<std::vector<T>> scratch_copy(const T* data, std::size_t count) {
  return std::make_shared<std::vector<T>>(data, data + count);
}

/// One communicator's engine: the MPI handle, the collective worker and the progress thread.
/// Heap-allocated and owned by the MpiComm, so their threads may point at it while it moves.
class Engine {
 public:
  /// `checks_collectives`: options.check_agreement resolved (the same on every rank: see
  /// duplicate()).
  Engine(Runtime& runtime, MPI_Comm comm, MpiCommOptions options, bool checks_collectives)
      : runtime_(runtime), comm_(comm), options_(options), checks_collectives_(checks_collectives) {
    runtime_.attach();
    {
      auto lock = runtime_.lock();
      MPI_Comm_rank(comm_, &rank_);
      MPI_Comm_size(comm_, &size_);
      void* value = nullptr;
      int found = 0;
      MPI_Comm_get_attr(comm_, MPI_TAG_UB, &value, &found);
      if (found && value) tag_upper_bound_ = *static_cast<int*>(value);
    }
    watchdog_ = std::make_unique<BlockingWatchdog>(runtime_, rank_, options_.timeout);
  }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine() {
    // Both wait for their pending operations, at most the timeout each. A worker left inside a
    // blocking collective (detached) frees the communicator and releases the runtime itself.
    const bool worker_left = worker_ && !worker_->stop();
    worker_.reset();
    progress_.reset();
    watchdog_.reset();
    if (worker_left) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      auto lock = runtime_.lock();
      MPI_Comm_free(&comm_);
    }
    runtime_.detach();
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] MPI_Comm comm() const noexcept { return comm_; }
  [[nodiscard]] const MpiCommOptions& options() const noexcept { return options_; }
  [[nodiscard]] Runtime& runtime() const noexcept { return runtime_; }
  [[nodiscard]] int tag_upper_bound() const noexcept { return tag_upper_bound_; }
  [[nodiscard]] bool checks_collectives() const noexcept { return checks_collectives_; }

  /// The next collective's fingerprint where this communicator checks collectives.
  std::optional<CollectiveFingerprint> fingerprint(CollectiveOp op, dtype type, std::size_t count,
                                                   int root = 0,
                                                   ReduceOp reduce_op = ReduceOp::sum) {
    if (!checks_collectives_) return std::nullopt;
    return make_fingerprint(op, ++sequence_, type, count, root, reduce_op);
  }

  /// Compares `mine` with every rank's on this thread, under the watchdog; raises the mismatch.
  void compare(const char* operation, const CollectiveFingerprint& mine) {
    std::string mismatch;
    watchdog_->begin(operation);
    const int code =
        compare_fingerprints(runtime_, comm_, size_, mine, runtime_.serialized(), mismatch);
    watchdog_->end();
    if (code != MPI_SUCCESS) throw error(rank_, operation, code);
    if (!mismatch.empty()) throw Error(rank_, operation, mismatch);
  }

  /// Raises tandem::Error if an `_async` operation timed out earlier.
  void check_usable(const char* operation) const {
    std::optional<std::string> cause;
    if (worker_) cause = worker_->broken();
    if (!cause && progress_) cause = progress_->broken();
    if (cause) throw Error(rank_, operation, "this communicator is unusable: " + *cause);
  }

  /// Waits for the pending `_async` collectives (a sync collective must not overtake them).
  void drain(const char* operation) {
    const bool drained = (!worker_ || worker_->wait_idle(options_.timeout)) &&
                         (!progress_ || progress_->wait_for_collectives(options_.timeout));
    check_usable(operation);
    if (!drained) {
      throw Error(
          rank_, operation,
          "earlier `_async` collectives did not complete within " + describe(options_.timeout));
    }
  }

  /// Runs `call` to completion on this thread (a sync collective has drained first): MPI's
  /// blocking form, or where MPI calls are serialized its non-blocking form and polling.
  void run(Call& call) {
    check_usable(call.operation);
    if (call.fingerprint) compare(call.operation, *call.fingerprint);
    MPI_Status status{};
    watchdog_->begin(call.operation);
    const int code = runtime_.serialized() ? start_and_wait(call, status) : call.blocking(&status);
    watchdog_->end();
    if (code != MPI_SUCCESS) throw error(rank_, call.operation, code);
    if (call.finish) call.finish(status);
  }

  /// Hands `call` on; its Work completes when MPI has: a collective to the worker (blocking
  /// form) where MPI provides MPI_THREAD_MULTIPLE, anything else started here (non-blocking
  /// form) and completed by the progress thread; below MPI_THREAD_SERIALIZED, run here at once.
  Work launch(Call call) {
    check_usable(call.operation);
    auto state = std::make_shared<WorkState>();
    if (runtime_.eager()) {
      try {
        run(call);
        state->complete();
      } catch (...) {
        state->fail(std::current_exception());
      }
      return Work(state);
    }
    if (call.collective && !runtime_.serialized()) {
      if (!worker_) {
        worker_ = std::make_unique<Worker>(runtime_, comm_, rank_, size_, options_.timeout);
      }
      worker_->add(std::move(call), state);
      return Work(state);
    }
    if (call.fingerprint) {
      // Serialized: the comparison, polled here, must come before the request starts; a
      // mismatch fails the Work on every rank and nothing is started.
      try {
        compare(call.operation, *call.fingerprint);
      } catch (...) {
        state->fail(std::current_exception());
        return Work(state);
      }
    }
    // The progress thread first: once the request is started, nothing may throw before it is handed
    // over.
    if (!progress_) progress_ = std::make_unique<Progress>(runtime_, rank_, options_.timeout);
    auto pending = std::make_unique<Pending>(std::move(call), state, Deadline(options_.timeout));
    int code = MPI_SUCCESS;
    {
      auto lock = runtime_.lock();
      code = pending->call.start(&pending->request);
    }
    if (code != MPI_SUCCESS) {
      state->fail(std::make_exception_ptr(error(rank_, pending->call.operation, code)));
      return Work(state);
    }
    progress_->add(std::move(pending));
    return Work(state);
  }

  /// A blocking MPI call (MPI_Comm_split, MPI_Comm_dup), holding the lock where serialized.
  template <class Fn>
  void call_locked(const char* operation, Fn&& fn) {
    int code = MPI_SUCCESS;
    {
      auto lock = runtime_.lock();
      code = fn();
    }
    if (code != MPI_SUCCESS) throw error(rank_, operation, code);
  }

 private:
  /// A blocking call in its non-blocking form. Where MPI calls are serialized, the request is
  /// tested without holding the MPI lock in between, so that other threads (the progress thread
  /// among them) get their turns.
  int start_and_wait(Call& call, MPI_Status& status) {
    MPI_Request request = MPI_REQUEST_NULL;
    int code = MPI_SUCCESS;
    {
      auto lock = runtime_.lock();
      code = call.start(&request);
    }
    if (code == MPI_SUCCESS && !runtime_.serialized()) return MPI_Wait(&request, &status);
    Backoff backoff;
    while (code == MPI_SUCCESS) {
      int flag = 0;
      {
        auto lock = runtime_.lock();
        code = MPI_Test(&request, &flag, &status);
      }
      if (flag) break;
      backoff.pause();
    }
    return code;
  }

  Runtime& runtime_;
  MPI_Comm comm_;
  MpiCommOptions options_;
  bool checks_collectives_;
  std::uint64_t sequence_ = 0;  // collectives made, split included (one thread issues them)
  int rank_ = 0;
  int size_ = 1;
  int tag_upper_bound_ = 32767;         // MPI's guaranteed minimum, where the attribute is missing
  std::unique_ptr<Worker> worker_;      // started by the first `_async` collective
  std::unique_ptr<Progress> progress_;  // started by the first non-blocking `_async` operation
  std::unique_ptr<BlockingWatchdog> watchdog_;  // watches run()'s blocking calls
};

}  // namespace detail::mpi

/// The Communicator over MPI; see the top of this header for its semantics. Make one with
/// MpiComm::world() (every process of the job) or MpiComm::duplicate(comm), subgroups with split.
class MpiComm : public detail::CollectiveFrontend<MpiComm, host> {
 public:
  /// What init_process_group<MpiComm>, world() and duplicate() take.
  using options_type = MpiCommOptions;

  /// Moves the communicator; the moved-from MpiComm may only be destroyed or assigned.
  MpiComm(MpiComm&&) noexcept = default;
  /// Moves the communicator; the moved-from MpiComm may only be destroyed or assigned.
  MpiComm& operator=(MpiComm&&) noexcept = default;
  ~MpiComm() = default;

  /// Every process of the job (a duplicate of MPI_COMM_WORLD). Initialises MPI on first use.
  /// Collective over MPI_COMM_WORLD.
  [[nodiscard]] static MpiComm world(MpiCommOptions options = {}) {
    return duplicate(MPI_COMM_WORLD, options);
  }

  /// A private duplicate of the program's communicator `comm` (collective over it). MPI must be
  /// initialised already, or `comm` would not exist.
  [[nodiscard]] static MpiComm duplicate(MPI_Comm comm, MpiCommOptions options = {}) {
    auto& runtime = detail::mpi::Runtime::instance();
    MPI_Comm copy = MPI_COMM_NULL;
    int code = MPI_SUCCESS;
    {
      auto lock = runtime.lock();
      code = MPI_Comm_dup(comm, &copy);
      if (code == MPI_SUCCESS) code = MPI_Comm_set_errhandler(copy, MPI_ERRORS_RETURN);
    }
    if (code != MPI_SUCCESS) {
      if (copy != MPI_COMM_NULL) MPI_Comm_free(&copy);
      throw Error("MpiComm", "MPI_Comm_dup failed: " + detail::mpi::error_string(code));
    }
    bool checks_collectives = true;
    try {
      checks_collectives = agree_on_check(runtime, copy, options);
    } catch (...) {
      auto lock = runtime.lock();
      MPI_Comm_free(&copy);
      throw;
    }
    return MpiComm(
        std::make_unique<detail::mpi::Engine>(runtime, copy, options, checks_collectives));
  }

  /// For init_process_group<MpiComm>: MPI has its own rendezvous (mpirun), so this checks that
  /// `world` is MPI_COMM_WORLD's view of this process and returns world(options).
  [[nodiscard]] static MpiComm rendezvous(const World& world, AnyStore&,
                                          const MpiCommOptions& options) {
    (void)detail::mpi::Runtime::instance();
    int rank = 0;
    int size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (world.rank != rank || world.world_size != size) {
      throw Error(world.rank, "MpiComm::rendezvous",
                  "the World says rank " + std::to_string(world.rank) + " of " +
                      std::to_string(world.world_size) + ", but MPI_COMM_WORLD has this process " +
                      "as rank " + std::to_string(rank) + " of " + std::to_string(size) +
                      " (start every rank with one mpirun)");
    }
    return MpiComm::world(options);
  }

  /// The thread level MPI provides in this process (MPI_THREAD_SINGLE .. MPI_THREAD_MULTIPLE).
  [[nodiscard]] static int thread_level() {
    return detail::mpi::Runtime::instance().thread_level();
  }

  /// The options this communicator was made with.
  [[nodiscard]] const MpiCommOptions& options() const { return self().options(); }
  /// The MPI communicator underneath (owned by this MpiComm), for calls tandem does not make.
  [[nodiscard]] MPI_Comm native() const { return self().comm(); }
  /// Whether every collective is checked first (options().check_agreement, resolved against
  /// TANDEM_CHECK_COLLECTIVES when the communicator was made; the same on every rank).
  [[nodiscard]] bool checks_collectives() const { return self().checks_collectives(); }

  // The operations (all_reduce .. barrier, sync and `_async`) are the front end's
  // (comm/detail/frontend.hpp); MpiComm gives it the hooks below: run_now and run_later (the
  // watchdog, the drain before a sync collective, the thread level's forms) and the tasks (MPI
  // calls built and checked on the calling thread).

  /// split hides the front end's: it drains and compares under MPI's own rules.
  /// Collective: ranks with the same `color` form a new group, ordered by (key, rank here);
  /// no_color gives nullopt. The new group has this group's options.
  [[nodiscard]] std::optional<MpiComm> split(int color, int key = 0) {
    detail::check_color(rank(), color);
    auto& me = self();
    me.drain("split");
    if (auto mine = me.fingerprint(detail::CollectiveOp::split, dtype::float32, 0)) {
      me.compare("split", *mine);
    }
    MPI_Comm made = MPI_COMM_NULL;
    me.call_locked("split", [&] {
      return MPI_Comm_split(me.comm(), color == no_color ? MPI_UNDEFINED : color, key, &made);
    });
    if (made == MPI_COMM_NULL) return std::nullopt;
    int code = MPI_SUCCESS;
    {
      auto lock = me.runtime().lock();
      code = MPI_Comm_set_errhandler(made, MPI_ERRORS_RETURN);
    }
    auto state = std::make_unique<detail::mpi::Engine>(me.runtime(), made, me.options(),
                                                       me.checks_collectives());
    if (code != MPI_SUCCESS) throw detail::mpi::error(rank(), "split", code);
    return MpiComm(std::move(state));
  }

 private:
  friend class detail::CollectiveFrontend<MpiComm, host>;
  using Call = detail::mpi::Call;

  explicit MpiComm(std::unique_ptr<detail::mpi::Engine> state) : self_(std::move(state)) {}

  /// Resolves options.check_agreement and compares it with every rank's (one MPI_Allgather on
  /// `comm`; detail/check_switch.hpp says why and what each rank raises).
  static bool agree_on_check(detail::mpi::Runtime& runtime, MPI_Comm comm,
                             const MpiCommOptions& options) {
    int rank = 0;
    int size = 0;
    {
      auto lock = runtime.lock();
      MPI_Comm_rank(comm, &rank);
      MPI_Comm_size(comm, &size);
    }
    return detail::agree_on_check_switch(
        rank, "MpiComm", options.check_agreement, true, [&](int mine) {
          std::vector<int> all(static_cast<std::size_t>(size));
          int code = MPI_SUCCESS;
          {
            auto lock = runtime.lock();
            code = MPI_Allgather(&mine, 1, MPI_INT, all.data(), 1, MPI_INT, comm);
          }
          if (code != MPI_SUCCESS) throw detail::mpi::error(rank, "MpiComm", code);
          return all;
        });
  }

  /// `call` with the fingerprint it is checked by, where this communicator checks collectives.
  Call checked(Call call, detail::CollectiveOp op, dtype type, std::size_t count, int root = 0,
               ReduceOp reduce_op = ReduceOp::sum) const {
    call.fingerprint = self().fingerprint(op, type, count, root, reduce_op);
    return call;
  }

  /// A sync operation: after the pending `_async` collectives where it is one, so that its
  /// checks and copies see their results.
  template <class Build>
  void run_now(const char* op, bool collective, Build build) {
    auto& me = self();
    me.check_usable(op);
    if (collective) me.drain(op);
    auto call = build();
    me.run(call);
  }

  /// An `_async` operation: checked and built here, handed to MPI by the engine's launch.
  template <class Build>
  Work run_later(const char* /*op*/, bool /*collective*/, Build build) {
    return self().launch(build());
  }

  detail::mpi::Engine& self() const {
    if (!self_) throw Error("MpiComm", "this communicator was moved from");
    return *self_;
  }

  [[nodiscard]] Error error(const char* op, const std::string& cause) const {
    return Error(rank(), op, cause);
  }

  [[nodiscard]] int to_int(std::size_t count, const char* op) const {
    if (count > static_cast<std::size_t>(INT_MAX)) {
      throw error(op, std::to_string(count) + " elements per rank exceed MPI's limit of " +
                          std::to_string(INT_MAX) + " in one call");
    }
    return static_cast<int>(count);
  }

  void check_tag(int tag, const char* op) const {
    detail::check_tag(rank(), tag, tag_upper_bound(), "MPI's range", op);
  }

  [[nodiscard]] int tag_upper_bound() const { return self().tag_upper_bound(); }

  /// The avg division after a sum, where `op` asks for it.
  template <class E>
  std::function<void(const MPI_Status&)> average(ReduceOp op, E* data, std::size_t count) const {
    if (op != ReduceOp::avg || count == 0) return {};
    const int ranks = size();
    return [data, count, ranks](const MPI_Status&) { detail::divide(data, count, ranks); };
  }

  // --- the calls: checks here, on the calling thread, before anything is sent ------------------

  template <class In, class Out>
  Call all_reduce_task(In& in, Out& out, ReduceOp op) const {
    using E = detail::elem_t<Out>;
    const auto args = detail::all_reduce_args<host>(rank(), in, out, op);
    const auto count = args.count;
    const int n = to_int(count, "all_reduce");
    const E* source = args.in;
    E* target = args.out;
    const void* sendbuf = source;
    if (source == target) {
      sendbuf = MPI_IN_PLACE;
    } else if (detail::overlap(source, count, target, count)) {
      std::memmove(target, source, count * sizeof(E));
      sendbuf = MPI_IN_PLACE;
    }
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Op mpi_op = detail::mpi::reduce_op<E>(self().runtime(), op);
    const MPI_Comm comm = native();
    return checked(
        Call{"all_reduce", true,
             [=](MPI_Status*) { return MPI_Allreduce(sendbuf, target, n, type, mpi_op, comm); },
             [=](MPI_Request* r) {
               return MPI_Iallreduce(sendbuf, target, n, type, mpi_op, comm, r);
             },
             average(op, target, count)},
        detail::CollectiveOp::all_reduce, dtype_of<E>, count, 0, op);
  }

  template <class T>
  Call reduce_task(T& t, int root, ReduceOp op) const {
    using E = detail::elem_t<T>;
    E* data = detail::rooted_args<host>(rank(), size(), t, root, op, "reduce");
    const auto count = static_cast<std::size_t>(t.size());
    const int n = to_int(count, "reduce");
    const bool is_root = rank() == root;
    const void* sendbuf = is_root ? MPI_IN_PLACE : static_cast<const void*>(data);
    void* recvbuf = is_root ? data : nullptr;
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Op mpi_op = detail::mpi::reduce_op<E>(self().runtime(), op);
    const MPI_Comm comm = native();
    return checked(
        Call{"reduce", true,
             [=](MPI_Status*) { return MPI_Reduce(sendbuf, recvbuf, n, type, mpi_op, root, comm); },
             [=](MPI_Request* r) {
               return MPI_Ireduce(sendbuf, recvbuf, n, type, mpi_op, root, comm, r);
             },
             is_root ? average(op, data, count) : nullptr},
        detail::CollectiveOp::reduce, dtype_of<E>, count, root, op);
  }

  template <class T>
  Call broadcast_task(T& t, int root) const {
    using E = detail::elem_t<T>;
    E* data = detail::rooted_args<host>(rank(), size(), t, root, ReduceOp::sum, "broadcast");
    const int n = to_int(static_cast<std::size_t>(t.size()), "broadcast");
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Comm comm = native();
    return checked(
        Call{"broadcast", true, [=](MPI_Status*) { return MPI_Bcast(data, n, type, root, comm); },
             [=](MPI_Request* r) { return MPI_Ibcast(data, n, type, root, comm, r); }, nullptr},
        detail::CollectiveOp::broadcast, dtype_of<E>, static_cast<std::size_t>(t.size()), root);
  }

  /// The send buffer of a gather into `out` whose slot `slot` is this rank's: MPI_IN_PLACE when
  /// `in` is that slot, a copy when `in` overlaps `out` elsewhere (kept alive in `keep`).
  template <class E>
  static const void* gather_source(const E* in, std::size_t count, E* out, std::size_t total,
                                   std::size_t slot, std::shared_ptr<std::vector<E>>& keep) {
    if (in == out + slot * count) return MPI_IN_PLACE;
    if (!detail::overlap(in, count, static_cast<const E*>(out), total)) return in;
    keep = detail::mpi::scratch_copy(in, count);
    return keep->data();
  }

  template <class In, class Out>
  Call all_gather_task(In& in, Out& out) const {
    using E = detail::elem_t<Out>;
    const auto args = detail::all_gather_args<host>(rank(), size(), in, out);
    const auto count = args.count;
    const int n = to_int(count, "all_gather");
    E* target = args.out;
    std::shared_ptr<std::vector<E>> keep;
    const void* sendbuf =
        gather_source(args.in, count, target, static_cast<std::size_t>(out.size()),
                      static_cast<std::size_t>(rank()), keep);
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Comm comm = native();
    return checked(
        Call{"all_gather", true,
             [=](MPI_Status*) { return MPI_Allgather(sendbuf, n, type, target, n, type, comm); },
             [=](MPI_Request* r) {
               return MPI_Iallgather(sendbuf, n, type, target, n, type, comm, r);
             },
             [keep](const MPI_Status&) {}},
        detail::CollectiveOp::all_gather, dtype_of<E>, count);
  }

  template <class In, class Out>
  Call gather_task(In& in, Out& out, int root) const {
    using E = detail::elem_t<Out>;
    const auto args = detail::gather_args<host>(rank(), size(), in, out, root);
    const bool is_root = rank() == root;
    const auto count = args.count;
    const int n = to_int(count, "gather");
    const E* source = args.in;
    E* target = is_root ? args.out : nullptr;
    std::shared_ptr<std::vector<E>> keep;
    const void* sendbuf =
        is_root ? gather_source(source, count, target, static_cast<std::size_t>(out.size()),
                                static_cast<std::size_t>(root), keep)
                : source;
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Comm comm = native();
    return checked(
        Call{"gather", true,
             [=](MPI_Status*) { return MPI_Gather(sendbuf, n, type, target, n, type, root, comm); },
             [=](MPI_Request* r) {
               return MPI_Igather(sendbuf, n, type, target, n, type, root, comm, r);
             },
             [keep](const MPI_Status&) {}},
        detail::CollectiveOp::gather, dtype_of<E>, count, root);
  }

  template <class In, class Out>
  Call scatter_task(In& in, Out& out, int root) const {
    using E = detail::elem_t<Out>;
    const auto args = detail::scatter_args<host>(rank(), size(), in, out, root);
    const bool is_root = rank() == root;
    const auto count = args.count;
    const int n = to_int(count, "scatter");
    const E* source = is_root ? args.in : nullptr;
    E* target = args.out;
    void* recvbuf = target;
    std::shared_ptr<std::vector<E>> keep;
    if (is_root) {
      const auto total = static_cast<std::size_t>(in.size());
      if (target == source + static_cast<std::size_t>(root) * count) {
        recvbuf = MPI_IN_PLACE;
      } else if (detail::overlap(static_cast<const E*>(target), count, source, total)) {
        keep = detail::mpi::scratch_copy(source, total);
        source = keep->data();
      }
    }
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Comm comm = native();
    return checked(Call{"scatter", true,
                        [=](MPI_Status*) {
                          return MPI_Scatter(source, n, type, recvbuf, n, type, root, comm);
                        },
                        [=](MPI_Request* r) {
                          return MPI_Iscatter(source, n, type, recvbuf, n, type, root, comm, r);
                        },
                        [keep](const MPI_Status&) {}},
                   detail::CollectiveOp::scatter, dtype_of<E>, count, root);
  }

  template <class In, class Out>
  Call reduce_scatter_task(In& in, Out& out, ReduceOp op) const {
    using E = detail::elem_t<Out>;
    const auto args = detail::reduce_scatter_args<host>(rank(), size(), in, out, op);
    const auto count = args.count;
    const int n = to_int(count, "reduce_scatter");
    const E* source = args.in;
    E* target = args.out;
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Op mpi_op = detail::mpi::reduce_op<E>(self().runtime(), op);
    const MPI_Comm comm = native();
    const int ranks = size();
    const bool average = op == ReduceOp::avg;
    // MPI's in-place form leaves the result at the start of the buffer, not in this rank's slot:
    // an output inside the input goes through scratch instead.
    std::shared_ptr<std::vector<E>> keep;
    E* result = target;
    if (detail::overlap(static_cast<const E*>(target), count, source,
                        static_cast<std::size_t>(in.size()))) {
      keep = std::make_shared<std::vector<E>>(count);
      result = keep->data();
    }
    return checked(Call{"reduce_scatter", true,
                        [=](MPI_Status*) {
                          return MPI_Reduce_scatter_block(source, result, n, type, mpi_op, comm);
                        },
                        [=](MPI_Request* r) {
                          return MPI_Ireduce_scatter_block(source, result, n, type, mpi_op, comm,
                                                           r);
                        },
                        [=](const MPI_Status&) {
                          if (keep) std::memcpy(target, keep->data(), count * sizeof(E));
                          if (average) detail::divide(target, count, ranks);
                        }},
                   detail::CollectiveOp::reduce_scatter, dtype_of<E>, count, 0, op);
  }

  template <class In, class Out>
  Call all_to_all_task(In& in, Out& out) const {
    using E = detail::elem_t<Out>;
    const auto args = detail::all_to_all_args<host>(rank(), size(), in, out);
    const auto total = args.count;
    const int n = to_int(total / static_cast<std::size_t>(size()), "all_to_all");
    const E* source = args.in;
    E* target = args.out;
    // In place (or overlapping) through a copy of the input: simpler and safer than relying on
    // each MPI's in-place all-to-all.
    std::shared_ptr<std::vector<E>> keep;
    if (detail::overlap(source, total, static_cast<const E*>(target), total)) {
      keep = detail::mpi::scratch_copy(source, total);
      source = keep->data();
    }
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Comm comm = native();
    return checked(
        Call{"all_to_all", true,
             [=](MPI_Status*) { return MPI_Alltoall(source, n, type, target, n, type, comm); },
             [=](MPI_Request* r) {
               return MPI_Ialltoall(source, n, type, target, n, type, comm, r);
             },
             [keep](const MPI_Status&) {}},
        detail::CollectiveOp::all_to_all, dtype_of<E>, total);
  }

  template <class T>
  Call send_task(T& t, int peer, int tag) const {
    using E = detail::elem_t<T>;
    const E* data = detail::send_args<host>(rank(), size(), t, peer);
    check_tag(tag, "send");
    const int n = to_int(static_cast<std::size_t>(t.size()), "send");
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Comm comm = native();
    return {"send", false, [=](MPI_Status*) { return MPI_Send(data, n, type, peer, tag, comm); },
            [=](MPI_Request* r) { return MPI_Isend(data, n, type, peer, tag, comm, r); }, nullptr};
  }

  template <class T>
  Call recv_task(T& t, int peer, int tag) const {
    using E = detail::elem_t<T>;
    E* data = detail::recv_args<host>(rank(), size(), t, peer);
    check_tag(tag, "recv");
    const int n = to_int(static_cast<std::size_t>(t.size()), "recv");
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Comm comm = native();
    const int me = rank();
    return {"recv", false,
            [=](MPI_Status* status) { return MPI_Recv(data, n, type, peer, tag, comm, status); },
            [=](MPI_Request* r) { return MPI_Irecv(data, n, type, peer, tag, comm, r); },
            [=](const MPI_Status& status) {
              int got = 0;
              MPI_Get_count(&status, type, &got);
              if (got != n) {
                throw Error(me, "recv",
                            "expected " + std::to_string(n) + " " + dtype_traits<E>::name +
                                " elements from rank " + std::to_string(peer) + " with tag " +
                                std::to_string(tag) + ", but the message held " +
                                std::to_string(got));
              }
            }};
  }

  Call barrier_task() const {
    const MPI_Comm comm = native();
    return checked(Call{"barrier", true, [=](MPI_Status*) { return MPI_Barrier(comm); },
                        [=](MPI_Request* r) { return MPI_Ibarrier(comm, r); }, nullptr},
                   detail::CollectiveOp::barrier, dtype::float32, 0);
  }

  std::unique_ptr<detail::mpi::Engine> self_;
};

static_assert(Communicator<MpiComm>);

/// MpiComm compares every collective's fingerprints first unless switched off (see
/// MpiComm::checks_collectives()).
template <>
inline constexpr bool detects_mismatched_collectives<MpiComm> = true;

}  // namespace tandem
