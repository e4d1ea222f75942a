// tandem/comm/local/local.hpp - tandem::LocalComm, the communicator whose ranks are threads of one
// process sharing memory (for tests, examples and single-process multi-device work), and
// tandem::run_local, which starts the threads.
//   tandem::run_local(4, [](tandem::LocalComm& comm) {
//     std::vector<float> grads(1024, 1.0f);  comm.all_reduce(grads, tandem::ReduceOp::avg); });
// Needs: the standard library (threads).
//
// Semantics follow torch.distributed / NCCL. The data moves through shared memory with the work
// split across the ranks (each rank reduces its 1/n of an all_reduce), between generation-counted
// barriers; reductions run in rank order 0, 1, ..., n-1, so every rank gets bitwise identical
// results. At the first barrier of every collective the ranks exchange what they were called
// with: different operations, element types, counts, roots or reduce ops make every rank raise a
// tandem::Error naming the ranks that disagree and each one's call (and the group stays usable).
// This check is always on: it costs nothing (the ranks must see each other's arguments anyway,
// to read each other's memory), and without it a mismatch would read past the end of a buffer.
// TANDEM_CHECK_COLLECTIVES (tandem/comm/checked.hpp) is still read, so that a bad value is an
// Error here as on every backend, but 0 does not turn LocalComm's check off. A rank that does not
// arrive within options().timeout, a rank whose LocalComm is destroyed, or (under run_local) a
// rank whose function throws, makes the others raise tandem::Error instead of hanging; after that
// the group is unusable.
//
// send is eager (it copies into the receiver's mailbox and returns); recv matches by (source,
// tag), first in first out, and checks the element type and count.
//
// `_async` operations run in issue order on a per-rank worker thread (started on first use) and
// complete the returned Work. The tensors must stay alive and untouched until the Work completes.
// A sync operation issued while `_async` ones are pending first waits for them. Destroying a
// LocalComm waits for its pending operations.
#pragma once

#include <unistd.h>
#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tandem/comm/checked.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/frontend.hpp"
#include "tandem/comm/detail/issue_order.hpp"
#include "tandem/comm/detail/rank_threads.hpp"
#include "tandem/comm/detail/reduction.hpp"
#include "tandem/comm/local/detail/engine.hpp"
#include "tandem/comm/local/detail/local_group.hpp"
#include "tandem/comm/local/options.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

class LocalComm;

template <class Fn>
requires std::invocable<Fn&, LocalComm&>
void run_local(int n, Fn fn, LocalCommOptions options = {});

/// A communicator whose ranks are threads of one process. Models tandem::Communicator; see the
/// top of this header for its semantics. Make one per rank with LocalComm::create_group, or let
/// run_local start the threads. Its public operations (and memory_space, host) come from
/// detail::CollectiveFrontend.
class LocalComm : public detail::CollectiveFrontend<LocalComm, host> {
 public:
  /// What init_process_group<LocalComm>, create_group and run_local take.
  using options_type = LocalCommOptions;

  /// Moves this rank's membership; the moved-from LocalComm may only be destroyed or assigned.
  LocalComm(LocalComm&&) noexcept = default;
  /// Moves this rank's membership; the moved-from LocalComm may only be destroyed or assigned.
  LocalComm& operator=(LocalComm&&) noexcept = default;
  ~LocalComm() = default;

  /// One LocalComm per rank of a new group of `n` ranks; move each into its own thread.
  [[nodiscard]] static std::vector<LocalComm> create_group(int n, LocalCommOptions options = {}) {
    return make_group(n, options, false);
  }

  /// What init_process_group<LocalComm>(world, url) calls: each rank is a thread of this process
  /// with its own World; rank 0 makes the group and the others find it through the store. Ranks
  /// in different processes are an Error (GlooComm and MpiComm are for those).
  [[nodiscard]] static LocalComm rendezvous(const World& world, AnyStore& store,
                                            const LocalCommOptions& options) {
    const std::string process = std::to_string(::getpid());
    if (world.rank == 0) {
      const auto id = pending_groups().publish(make_group(world.world_size, options, false));
      store.set("local/group", process + ":" + std::to_string(id));
    }
    const std::string published = store.get("local/group", options.timeout);
    const auto colon = published.find(':');
    const std::string owner = published.substr(0, colon);
    if (owner != process) {
      throw Error(world.rank, "init_process_group",
                  "LocalComm ranks must be threads of one process: rank 0 is process " + owner +
                      ", this rank is process " + process +
                      "; use GlooComm or MpiComm across processes");
    }
    return pending_groups().take(std::stoull(published.substr(colon + 1)), world.rank);
  }

  /// The options this group was made with.
  [[nodiscard]] const LocalCommOptions& options() const { return self().group()->options(); }

 private:
  friend class detail::CollectiveFrontend<LocalComm, host>;
  template <class Fn>
  requires std::invocable<Fn&, LocalComm&>
  friend void run_local(int n, Fn fn, LocalCommOptions options);

  LocalComm(std::shared_ptr<detail::local::Group> group, int rank)
      : self_(std::make_unique<detail::local::Engine>(std::move(group), rank)) {}

  static std::vector<LocalComm> make_group(int n, LocalCommOptions options, bool managed) {
    if (n < 1) {
      throw Error("LocalComm::create_group",
                  "a group needs at least one rank, not " + std::to_string(n));
    }
    // Always on (see the top of this header); a bad value of the switch is an Error everywhere.
    (void)check_collectives_from_environment();
    auto family = std::make_shared<detail::local::Family>(managed);
    auto group = std::make_shared<detail::local::Group>(n, options, family);
    family->add(group);
    std::vector<LocalComm> comms;
    comms.reserve(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) comms.push_back(LocalComm(group, r));
    return comms;
  }

  /// Groups made by rendezvous on rank 0, waiting for their other ranks' threads to collect
  /// their communicators. Process-wide because the ranks meet only through a store.
  class PendingGroups {
   public:
    std::uint64_t publish(std::vector<LocalComm> comms) {
      std::lock_guard lock(mutex_);
      const auto id = next_id_++;
      groups_.emplace(id, std::move(comms));
      return id;
    }
    LocalComm take(std::uint64_t id, int rank) {
      std::lock_guard lock(mutex_);
      const auto it = groups_.find(id);
      auto* slot = it == groups_.end() || rank >= static_cast<int>(it->second.size())
                       ? nullptr
                       : &it->second[static_cast<std::size_t>(rank)];
      if (!slot || !slot->self_) {
        throw Error(rank, "init_process_group",
                    "no LocalComm is waiting for this rank (did two ranks claim it?)");
      }
      LocalComm mine = std::move(*slot);
      if (std::all_of(it->second.begin(), it->second.end(),
                      [](const LocalComm& c) { return !c.self_; })) {
        groups_.erase(it);
      }
      return mine;
    }

   private:
    std::mutex mutex_;
    std::uint64_t next_id_ = 0;
    std::map<std::uint64_t, std::vector<LocalComm>> groups_;
  };

  static PendingGroups& pending_groups() {
    static PendingGroups groups;
    return groups;
  }

  detail::local::Engine& self() const {
    if (!self_) throw Error("LocalComm", "this communicator was moved from");
    return *self_;
  }

  /// Its ranks are threads of this process: the group's own number tells the groups apart.
  [[nodiscard]] std::string flight_name() const {
    return "LocalComm#" + std::to_string(self().group()->serial());
  }

  /// split's collective part (see CollectiveFrontend::split).
  std::optional<LocalComm> split_group(int color, int key) {
    auto [group, rank] = self().split(color, key);
    if (!group) return std::nullopt;
    return LocalComm(std::move(group), rank);
  }

  std::unique_ptr<detail::local::Engine> self_;
};

static_assert(Communicator<LocalComm>);

/// Every rank sees the others' arguments in shared memory, so disagreements are always caught
/// (whatever TANDEM_CHECK_COLLECTIVES says).
template <>
inline constexpr bool can_check_collectives<LocalComm> = true;

/// Runs fn(comm) on `n` threads, rank i's LocalComm on thread i, and joins them. `fn` is called
/// concurrently from all threads. When a rank's fn throws, the ranks blocked in an operation are
/// woken with tandem::Error("rank i failed: ..."); after the join, the first failure is rethrown
/// as a tandem::Error naming its rank (a tandem::Error from that rank as it is).
template <class Fn>
requires std::invocable<Fn&, LocalComm&>
void run_local(int n, Fn fn, LocalCommOptions options) {
  auto comms = LocalComm::make_group(n, options, true);
  const auto family = comms.front().self().group()->family();
  detail::FirstFailure failures;
  detail::run_rank_threads(
      n, "run_local", failures,
      [&](int r) {
        LocalComm own = std::move(comms[static_cast<std::size_t>(r)]);  // destroyed on this thread
        fn(own);
      },
      [&](int r, const std::string& what) {
        family->abort("rank " + std::to_string(r) + " failed: " + what);
      });
}

}  // namespace tandem
