// CommitLosingComm: a LocalComm whose barrier (Elastic's commit point when no on_join is
// registered) raises on one rank after it ended, as if that rank had lost the barrier's end while
// the others passed it: Elastic's rarest path made to happen (elastic_catch_up, elastic_zero). The
// order it needs, without timing: the loser raises only once `others_applied.count` ranks have
// applied the step, and the test's leaver leaves only once the loser has raised.
//   tandem::test::elastic::lose_barrier_end_at = r == 1 ? 2 : -1;  // rank 1, its 3rd barrier
//   tandem::Elastic<tandem::test::elastic::CommitLosingComm> elastic(world, store, options);
// Needs: tandem/comm/local/local.hpp, tandem/comm/init.hpp (ProcessGroupBackend).
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <utility>

#include "tandem/comm/init.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/core/error.hpp"

namespace tandem::test::elastic {

/// Which rank's barrier raises once it has ended, at which of its barrier calls (-1: none).
inline thread_local int lose_barrier_end_at = -1;
inline thread_local int barriers_seen = 0;

/// The ranks that have applied the step the loser loses, and whether the loser has raised.
struct Applied {
  std::mutex mutex;
  std::condition_variable changed;
  int count = 0;             // ranks other than the loser that have applied the step
  int expected = 2;          // how many the loser waits for
  bool loser_threw = false;  // the loser has raised

  /// A rank other than the loser applied the step.
  void note_applied() {
    const std::lock_guard lock(mutex);
    ++count;
    changed.notify_all();
  }
  /// The leaver's wait (at most 60 s) for the loser to have raised.
  void await_loser() {
    std::unique_lock lock(mutex);
    changed.wait_for(lock, std::chrono::seconds(60), [this] { return loser_threw; });
  }
};
inline Applied others_applied;

/// LocalComm whose barrier can raise after it ended (as if this rank had lost the barrier's end).
class CommitLosingComm : public tandem::LocalComm {
 public:
  using options_type = tandem::LocalCommOptions;

  explicit CommitLosingComm(tandem::LocalComm comm) : LocalComm(std::move(comm)) {}

  static CommitLosingComm rendezvous(const tandem::World& world, tandem::AnyStore& store,
                                     const options_type& options) {
    return CommitLosingComm(LocalComm::rendezvous(world, store, options));
  }

  void barrier() {
    const int call = barriers_seen++;
    LocalComm::barrier();
    if (call == lose_barrier_end_at) {
      std::unique_lock lock(others_applied.mutex);
      others_applied.changed.wait_for(lock, std::chrono::seconds(60), [] {
        return others_applied.count == others_applied.expected;
      });
      others_applied.loser_threw = true;
      others_applied.changed.notify_all();
      throw tandem::Error(rank(), "barrier", "injected: this rank lost the barrier's end");
    }
  }

  std::optional<CommitLosingComm> split(int color, int key) {
    auto made = LocalComm::split(color, key);
    if (!made) return std::nullopt;
    return CommitLosingComm(std::move(*made));
  }
};

static_assert(tandem::ProcessGroupBackend<CommitLosingComm>);

}  // namespace tandem::test::elastic
