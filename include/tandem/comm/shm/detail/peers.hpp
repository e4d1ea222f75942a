// tandem/comm/shm/detail/peers.hpp - what one rank of a ShmComm group knows of the others through
// the segment: the state every rank publishes there (pid, PID namespace, whether it holds its lock,
// whether it left), whether an awaited peer died, left or is stopped, the first failure or the
// abort recorded for the whole group, and how this rank records its own failure and raises it.
//   if (const std::string cause = trouble(awaited); !cause.empty()) fail(cause);
// Needs: Linux (through segment.hpp). Not a public header: detail/engine.hpp's Engine derives
// from Peers.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tandem/comm/shm/detail/segment.hpp"
#include "tandem/core/detail/disagreement.hpp"
#include "tandem/core/error.hpp"

namespace tandem::detail::shm {

/// One rank's view of its group's segment and of the other ranks. The Engine publishes this
/// rank's state in its constructor; everything here may be called from any thread where it says
/// so, otherwise only by the thread running the Engine's operation.
class Peers {
 public:
  /// `pids[r]` is the pid rank r published in the store where it shares this process's PID
  /// namespace, else 0 (watched until the rank writes its own in the segment).
  Peers(Segment segment, const Layout& layout, int rank, std::vector<std::int64_t> pids)
      : segment_(std::move(segment)),
        layout_(layout),
        control_(&segment_.control()),
        ranks_(reinterpret_cast<RankState*>(segment_.base() + layout.ranks_at)),
        rank_(rank),
        size_(layout.size),
        pids_(std::move(pids)) {}
  Peers(const Peers&) = delete;
  Peers& operator=(const Peers&) = delete;
  ~Peers() = default;

  /// Ends the group for every rank with `cause` (see ShmComm::abort). Any thread, any time.
  void abort(const std::string& cause) noexcept {
    std::uint32_t unclaimed = 0;
    if (control_->abort_claim.compare_exchange_strong(unclaimed, 1)) {
      std::snprintf(control_->abort_reason, sizeof control_->abort_reason, "%s", cause.c_str());
      control_->aborted_by.store(static_cast<std::uint32_t>(rank_ + 1), std::memory_order_release);
    }
    notify();
  }

  /// The cause a rank gave abort(), once one has; nullopt otherwise. Any thread, any time.
  [[nodiscard]] std::optional<std::string> abort_cause() const {
    if (control_->aborted_by.load(std::memory_order_acquire) == 0) return std::nullopt;
    return std::string(control_->abort_reason,
                       strnlen(control_->abort_reason, sizeof control_->abort_reason));
  }

 protected:
  /// Wakes the ranks asleep on the futex word (a syscall only where one sleeps).
  void notify() noexcept {
    control_->epoch.fetch_add(1);
    if (control_->sleepers.load() != 0) futex_wake_all(control_->epoch);
  }

  /// The pid to watch for rank r: what it wrote in the segment, else what it told the store; 0
  /// where its pid means nothing here (another PID namespace: another container's process).
  [[nodiscard]] std::int64_t pid_of(int r) const {
    const std::int64_t written = ranks_[r].pid.load();
    if (written <= 0) return pids_[static_cast<std::size_t>(r)];
    return ranks_[r].pid_namespace.load() == pid_space_ ? written : 0;
  }

  /// Whether rank r's process has ended: it no longer holds its lock on the segment (seen in any
  /// PID namespace), or /proc says it is gone or a zombie (in this namespace).
  [[nodiscard]] bool gone(int r) const {
    if (ranks_[r].locked.load() != 0 && segment_.rank_holds_lock(r) == false) return true;
    const std::int64_t pid = pid_of(r);
    if (pid <= 0) return false;
    const char state = process_state(pid);
    return state == 'X' || state == 'Z';
  }

  /// The group's failure recorded in the segment (broken must be set): "rank 1 failed first
  /// (rank 1, barrier: ...)".
  [[nodiscard]] std::string recorded_failure() const {
    const std::uint32_t by = control_->broken.load(std::memory_order_acquire);
    return "rank " + std::to_string(by - 1) + " failed first (" +
           std::string(control_->reason, strnlen(control_->reason, sizeof control_->reason)) + ")";
  }

  /// The abort recorded in the segment (aborted_by must be set): "rank 1 aborted the group (its
  /// cause)".
  [[nodiscard]] std::string abort_failure() const {
    const std::uint32_t by = control_->aborted_by.load(std::memory_order_acquire);
    return "rank " + std::to_string(by - 1) + " aborted the group (" + abort_cause().value_or("") +
           ")";
  }

  /// Why waiting for `awaited` is hopeless, or "": a failure recorded by another rank, or awaited
  /// ranks whose communicator is destroyed or whose process is gone.
  [[nodiscard]] std::string trouble(const std::vector<int>& awaited) const {
    if (control_->broken.load(std::memory_order_acquire) != 0) return recorded_failure();
    if (control_->aborted_by.load(std::memory_order_acquire) != 0) return abort_failure();
    std::vector<int> dead;
    std::vector<int> left;
    for (const int r : awaited) {
      if (r == rank_) continue;
      if (ranks_[r].left.load() != 0) {
        left.push_back(r);
      } else if (gone(r)) {
        dead.push_back(r);
      }
    }
    if (!dead.empty()) {
      return rank_list(dead) + (dead.size() == 1 ? " died (its process is gone)"
                                                 : " died (their processes are gone)");
    }
    if (!left.empty()) {
      return rank_list(left) + " left the group (its ShmComm was destroyed) without joining " +
             operation_;
    }
    return {};
  }

  /// "; rank 2 is stopped (...)" for the awaited ranks stopped by a signal, else "".
  [[nodiscard]] std::string stopped(const std::vector<int>& awaited) const {
    std::vector<int> ranks;
    for (const int r : awaited) {
      if (r != rank_ && pid_of(r) > 0 && process_state(pid_of(r)) == 'T') ranks.push_back(r);
    }
    if (ranks.empty()) return {};
    return "; " + rank_list(ranks) + (ranks.size() == 1 ? " is" : " are") +
           " stopped (SIGSTOP: the process is alive but does not run)";
  }

  /// Records the first failure in the segment (so that every rank raises it), marks this
  /// communicator unusable and raises tandem::Error.
  [[noreturn]] void fail(const std::string& cause) {
    const std::string what = std::string(operation_) + ": " + cause;
    std::uint32_t unclaimed = 0;
    if (control_->claim.compare_exchange_strong(unclaimed, 1)) {
      std::snprintf(control_->reason, sizeof control_->reason, "rank %d, %s", rank_, what.c_str());
      control_->broken.store(static_cast<std::uint32_t>(rank_ + 1), std::memory_order_release);
    }
    notify();
    broken_ = what;
    throw Error(rank_, operation_, cause);
  }

  /// The control words and the bytes of the ring from `src` to `dst`.
  RingState& ring(int src, int dst) const noexcept {
    return *reinterpret_cast<RingState*>(segment_.base() + layout_.ring(src, dst));
  }
  std::byte* ring_data(int src, int dst) const noexcept {
    return segment_.base() + layout_.ring_data(src, dst);
  }

  Segment segment_;  // first: unmapped last
  Layout layout_;
  Control* control_;
  RankState* ranks_;
  int rank_;
  int size_;
  std::vector<std::int64_t> pids_;  ///< as published in the store at rendezvous (see the ctor)
  std::uint64_t pid_space_ = pid_space();
  const char* operation_ = "ShmComm";
  std::optional<std::string> broken_;
};

}  // namespace tandem::detail::shm
