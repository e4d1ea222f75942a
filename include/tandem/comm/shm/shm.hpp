// tandem/comm/shm/shm.hpp - tandem::ShmComm, the Communicator whose ranks are processes of one
// host that meet in shared memory instead of over TCP (as NCCL, oneCCL and MPI do within a node).
//   auto comm = tandem::init_process_group<tandem::ShmComm>();   // under tandemrun / torchrun
//   comm.all_reduce(grads, tandem::ReduceOp::avg);
// Needs: Linux (POSIX shared memory, futex, /proc); link tandem::shm.
//
// Design (docs/shm.md has the reasons and the numbers):
// - Rendezvous through the job's store, as GlooComm's: every rank publishes its host, pid and PID
//   namespace; rank 0 creates one segment per communicator (shm_open of a fresh name - 128 random
//   bits, no pid: /dev/shm may be shared with other containers and PID namespaces - then
//   ftruncate, fallocate, so that a full /dev/shm is an Error and not a SIGBUS, and mmap) and
//   announces the name and its sizes in the store; the others map it; the last rank to map it
//   unlinks the name. From then on nothing of the job is in /dev/shm, whatever happens to its
//   processes (SIGKILL included). Each rank holds an open file description lock on its byte of
//   the segment while it lives; a creator killed before the unlink leaves one name, which the next
//   segment created on the host removes where no lock is held on it (never a live one of any job).
// - The segment is sized to half of what /dev/shm has free (statvfs, capped by
//   TANDEM_SHM_FREE_BYTES): the slots and the rings halve (down to 16 KiB and 1 KiB) until it
//   fits; where even that does not, every rank raises at the start saying what it needs, what is
//   free and what to change.
// - The segment: a control block (the futex word, the failure and abort records), one record per
//   rank (its pid and PID namespace, its lock, its barrier arrivals, its calls), a byte ring per
//   ordered pair of ranks (send and recv; 64 KiB where there is room), and two staging slots of
//   options.slot_bytes (or less, as above) per rank.
// - A collective runs in rounds: each rank writes its piece of the input into its slot (the root
//   writes every rank's, for scatter), arrives at a barrier, then reads what it needs from the
//   others' slots. Reductions use LocalComm's code (comm/detail/reduction.hpp) over the slots in
//   rank order, so every rank gets the same bits - the bits LocalComm gives. By default every
//   rank reduces the whole piece (one barrier a round); above 32 KiB a piece in groups of more
//   than two ranks, each reduces 1/n of it into its own slot and all copy the n parts after a
//   second barrier. A tensor larger than a slot goes through in pieces of slot_bytes. Rounds
//   alternate between a slot's two halves: a rank writes a half again only after the barrier of
//   the round between, which no rank passes before it has read that half, so an operation needs
//   no barrier at its end.
// - Shared blocks (allocate_shared, the SharedMemoryComm concept; DistributedDataParallel puts
//   its gradients in one): a POSIX object per allocation, made as the segment is, a part per
//   rank. An in-place all_reduce of more than 64 KiB of a tensor in a block, at the same offset
//   on every rank, needs no copy in and no copy out: between two barriers each rank reduces its
//   1/n share from every part and writes the result into every part, then takes the chunks of
//   the peers' shares they have not claimed yet (a chunk of any part is touched by the rank
//   that claimed it only). Ranks whose tensors lie in different places all raise the same Error
//   (detail/in_block.hpp).
// - The barrier: each rank counts its arrivals in its record. A waiter polls for a while
//   (options.spin: 50 us where the machine has 4 CPUs per rank, else none), then polls giving
//   its CPU away with sched_yield (options.yield: 50 us), then sleeps on the futex word (FUTEX_WAIT
//   on shared memory), which every arrival, message or failure bumps (and wakes, where a rank
//   sleeps).
// - The collective check, always on, as LocalComm's (it costs a 64-byte write and compare per
//   operation, and without it a mismatch would read past a slot's data): each rank publishes its
//   call's fingerprint (tandem/comm/checked.hpp) with its first arrival, and every rank compares
//   all of them after that barrier, before reading anything. Ranks that disagree all raise the
//   same tandem::Error and the group stays usable. TANDEM_CHECK_COLLECTIVES is read (a bad value
//   is an Error here as on every backend) but 0 does not turn the check off.
// - Faults: a sleeping rank wakes at least every 100 ms to look at the ranks it waits for. One
//   whose process is gone (its lock is free; in this PID namespace also kill(pid, 0), or a zombie
//   in /proc) or whose ShmComm was destroyed,
//   or a failure another rank recorded in the segment, raises a tandem::Error naming that rank;
//   so does a rank that does not arrive within options.timeout (saying so where its process is
//   stopped by SIGSTOP). The first failure is recorded for the others; the group is unusable
//   after it, and every later call raises at once. No rank copies out of a round whose barrier
//   did not complete, so a half-written buffer is never taken as a result.
// - send is eager while the 64 KiB ring to the receiver has room; beyond that it waits until the
//   receiver takes earlier bytes, which it does in every call it makes on this communicator
//   (recv, any collective), bounded by the timeout. recv matches by (source, tag), first in
//   first out, and checks the element type and count against the sender's.
// - `_async` operations run in issue order on a per-communicator worker thread (IssueOrder, as
//   on LocalComm and GlooComm); a sync operation waits for the pending ones first. The tensors
//   must stay alive and untouched until the Work completes.
// - split and new_group make a group with a segment of its own, through the same store.
// - Every rank of a group runs on one host: rendezvous compares the ranks' host names and raises
//   a tandem::Error otherwise. Across nodes use HierarchicalComm<ShmComm, GlooComm>
//   (tandem/comm/hierarchical/hierarchical.hpp: ShmComm within each node, Gloo between the
//   nodes' leaders), or GlooComm or MpiComm alone.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "tandem/comm/checked.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/frontend.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/shared_memory.hpp"
#include "tandem/comm/shm/detail/connect.hpp"
#include "tandem/comm/shm/detail/engine.hpp"
#include "tandem/comm/shm/detail/in_block.hpp"
#include "tandem/comm/shm/detail/messages.hpp"
#include "tandem/comm/shm/options.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/tensor/memory.hpp"

namespace tandem {

/// A communicator whose ranks are processes of one host meeting in shared memory. Models
/// tandem::Communicator and tandem::ProcessGroupBackend; see the top of this header. Its public
/// operations (and memory_space, host) come from detail::CollectiveFrontend; split's new group
/// has a segment of its own.
class ShmComm : public detail::CollectiveFrontend<ShmComm, host> {
 public:
  /// What init_process_group<ShmComm> and rendezvous take besides the World and the store.
  using options_type = ShmCommOptions;

  /// Moves the group's mapping; the moved-from ShmComm may only be destroyed or assigned.
  ShmComm(ShmComm&&) noexcept = default;
  /// Moves the group's mapping; the moved-from ShmComm may only be destroyed or assigned.
  ShmComm& operator=(ShmComm&&) noexcept = default;
  ~ShmComm() = default;

  /// Joins this rank with the others of `world`, meeting them in `store` (every rank passes the
  /// same store; init_process_group gives one of its own). Collective. A copy of the store is
  /// kept for split. Each call on one store makes a new group. Every rank must run on this host.
  [[nodiscard]] static ShmComm rendezvous(const World& world, AnyStore& store,
                                          const ShmCommOptions& options = {}) {
    world.validate();
    constexpr const char* operation = "ShmComm rendezvous";
    if (world.nnodes > 1 && world.local_world_size != world.world_size) {
      throw Error(world.rank, operation,
                  "this job spans " + std::to_string(world.nnodes) +
                      " nodes, and ShmComm joins the processes of one: use GlooComm or MpiComm "
                      "across nodes");
    }
    // A bad value is an Error on every rank (see the top of this header).
    std::optional<Error> unreadable;
    try {
      (void)check_collectives_from_environment();
    } catch (const Error& e) {
      unreadable = e;
    }
    // Ranks call rendezvous on a store the same number of times, so this count names the group.
    const std::int64_t generation =
        store.add("shm/rendezvous/rank" + std::to_string(world.rank), 1);
    return ShmComm(detail::shm::connect(store, "shm/" + std::to_string(generation), world.rank,
                                        world.world_size, options, unreadable));
  }

  /// The options this group was made with.
  [[nodiscard]] const ShmCommOptions& options() const { return self().options(); }
  /// The store this group met in (shared: copies see the same keys).
  [[nodiscard]] AnyStore store() const { return self().store(); }
  /// Ends the group: every rank's current or next call raises a tandem::Error that says "rank R
  /// aborted the group (`cause`)" (or the group's own failure, where one came first), and so do
  /// this rank's later calls; every rank's abort_cause() gives `cause` (the first one, where
  /// several ranks abort). For a program (or a communicator built on this one, as
  /// HierarchicalComm) that has learnt of a failure elsewhere and passes it on. Any thread, any
  /// time; never blocks.
  void abort(const std::string& cause) { self().abort(cause); }
  /// The cause a rank of this group gave abort(), once one has (else nullopt).
  [[nodiscard]] std::optional<std::string> abort_cause() const { return self().abort_cause(); }
  /// Collective: this rank's part of a new block of `bytes` bytes in shared memory (every rank
  /// asks for the same), zeroed, which the peers read directly: an in-place all_reduce of a
  /// tensor of more than 64 KiB that lies in it on every rank, at the same offset, reduces
  /// straight from the peers' parts, without the copy into the slots (DistributedDataParallel
  /// puts the arena's gradients there). An empty block where /dev/shm has no room (the block of
  /// every rank takes at most half of what is free). The memory stays mapped while any copy of
  /// the block's `keep` lives (models SharedMemoryComm).
  [[nodiscard]] SharedBlock allocate_shared(std::size_t bytes) {
    SharedBlock block;
    self().now([&] { block = self().allocate_shared(bytes); });
    return block;
  }
  /// Always true: every collective's calls are compared (see the top of this header).
  [[nodiscard]] bool checks_collectives() const {
    (void)self();
    return true;
  }

 private:
  friend class detail::CollectiveFrontend<ShmComm, host>;

  explicit ShmComm(std::unique_ptr<detail::shm::Engine> self) : self_(std::move(self)) {}

  detail::shm::Engine& self() const {
    if (!self_) throw Error("ShmComm", "this communicator was moved from");
    return *self_;
  }

  /// split's collective part (see CollectiveFrontend::split).
  std::optional<ShmComm> split_group(int color, int key) {
    auto made = self().split(color, key);
    if (!made) return std::nullopt;
    return ShmComm(std::move(made));
  }

  std::unique_ptr<detail::shm::Engine> self_;
};

static_assert(Communicator<ShmComm>);
static_assert(ProcessGroupBackend<ShmComm>);
static_assert(SharedMemoryComm<ShmComm>);

/// Every rank compares the others' calls in shared memory, so disagreements are always caught.
template <>
inline constexpr bool can_check_collectives<ShmComm> = true;

}  // namespace tandem
