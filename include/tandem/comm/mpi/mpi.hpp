// tandem/comm/mpi/mpi.hpp - tandem::MpiComm, the Communicator over MPI: one process per rank,
// started by mpirun (or srun), every collective and point to point, sync and `_async`, and split.
//   auto comm = tandem::MpiComm::world();        // MPI_COMM_WORLD's ranks, in a private copy
//   comm.all_reduce(grads, tandem::ReduceOp::avg);
// Needs: an MPI (C API, MPI-3; tested with OpenMPI 4.1); link tandem::mpi. How it initialises MPI,
// its semantics, timeouts and the watchdog, threads and CPU use: docs/backends.md, "MpiComm in
// detail".
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
#include "tandem/comm/mpi/detail/calls.hpp"
#include "tandem/comm/mpi/detail/engine.hpp"
#include "tandem/comm/mpi/detail/mpi_runtime.hpp"
#include "tandem/comm/mpi/detail/worker.hpp"
#include "tandem/comm/mpi/options.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// The Communicator over MPI; docs/backends.md ("MpiComm in detail") has its semantics. Make one
/// with MpiComm::world() (every process of the job) or MpiComm::duplicate(comm), subgroups with
/// split.
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
  /// Whether every collective is checked first (options().check_collectives, resolved against
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
    const auto number = this->next_split();
    MPI_Comm made = MPI_COMM_NULL;
    this->recorded(detail::FlightCall{"split"}, [&] {
      if (auto mine = me.fingerprint(detail::CollectiveOp::split, dtype::float32, 0)) {
        me.compare("split", *mine);
      }
      me.call_locked("split", [&] {
        return MPI_Comm_split(me.comm(), color == no_color ? MPI_UNDEFINED : color, key, &made);
      });
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
    std::optional<MpiComm> group(MpiComm(std::move(state)));
    this->name_split(group, number, color);
    return group;
  }

 private:
  friend class detail::CollectiveFrontend<MpiComm, host>;
  using Call = detail::mpi::Call;

  explicit MpiComm(std::unique_ptr<detail::mpi::Engine> state) : self_(std::move(state)) {}

  /// Resolves options.check_collectives and compares it with every rank's (one MPI_Allgather on
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
        rank, "MpiComm", options.check_collectives, true, [&](int mine) {
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

  /// A sync operation: after the pending `_async` collectives where it is one, so that its
  /// checks and copies see their results.
  template <class Build>
  void run_now(const detail::FlightCall& flight, Build build) {
    auto& me = self();
    me.check_usable(flight.operation);
    if (flight.collective) me.drain(flight.operation);
    auto call = build();
    this->recorded(flight, [&] { me.run(call); });
  }

  /// An `_async` operation: checked and built here, handed to MPI by the engine's launch; its
  /// flight record ends with its Work.
  template <class Build>
  Work run_later(const detail::FlightCall& flight, Build build) {
    auto call = build();
    return this->recorded_work(flight, [&] { return self().launch(std::move(call)); });
  }

  detail::mpi::Engine& self() const {
    if (!self_) throw Error("MpiComm", "this communicator was moved from");
    return *self_;
  }

  /// The MPI calls of the operations, built and checked on the calling thread (the front end's
  /// X_task hooks; detail/calls.hpp).
  [[nodiscard]] detail::mpi::Calls calls() const { return detail::mpi::Calls(self()); }

  template <class In, class Out>
  Call all_reduce_task(In& in, Out& out, ReduceOp op) const {
    return calls().all_reduce_task(in, out, op);
  }
  template <class T>
  Call reduce_task(T& t, int root, ReduceOp op) const {
    return calls().reduce_task(t, root, op);
  }
  template <class T>
  Call broadcast_task(T& t, int root) const {
    return calls().broadcast_task(t, root);
  }
  template <class In, class Out>
  Call all_gather_task(In& in, Out& out) const {
    return calls().all_gather_task(in, out);
  }
  template <class In, class Out>
  Call gather_task(In& in, Out& out, int root) const {
    return calls().gather_task(in, out, root);
  }
  template <class In, class Out>
  Call scatter_task(In& in, Out& out, int root) const {
    return calls().scatter_task(in, out, root);
  }
  template <class In, class Out>
  Call reduce_scatter_task(In& in, Out& out, ReduceOp op) const {
    return calls().reduce_scatter_task(in, out, op);
  }
  template <class In, class Out>
  Call all_to_all_task(In& in, Out& out) const {
    return calls().all_to_all_task(in, out);
  }
  template <class T>
  Call send_task(T& t, int peer, int tag) const {
    return calls().send_task(t, peer, tag);
  }
  template <class T>
  Call recv_task(T& t, int peer, int tag) const {
    return calls().recv_task(t, peer, tag);
  }
  Call barrier_task() const { return calls().barrier_task(); }

  std::unique_ptr<detail::mpi::Engine> self_;
};

static_assert(Communicator<MpiComm>);

/// MpiComm compares every collective's fingerprints first unless switched off (see
/// MpiComm::checks_collectives()).
template <>
inline constexpr bool can_check_collectives<MpiComm> = true;

}  // namespace tandem
