// tandem/comm/shm/detail/engine.hpp - one rank's side of a tandem::ShmComm group: the barrier
// that also exchanges and compares the ranks' calls, the waits (a short spin, then a futex sleep
// woken every 100 ms to look at the peers), the collectives over the staging slots, the byte rings
// of send and recv, split, and connect(), which makes a group through the store.
// Not a public header: include tandem/comm/shm/shm.hpp (its top comment is the design).
// Needs: Linux (through segment.hpp).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/comm/checked.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/collective_args.hpp"
#include "tandem/comm/detail/collective_op.hpp"
#include "tandem/comm/detail/flight_monitor.hpp"
#include "tandem/comm/detail/issue_order.hpp"
#include "tandem/comm/detail/reduction.hpp"
#include "tandem/comm/detail/split_members.hpp"
#include "tandem/comm/shm/detail/segment.hpp"
#include "tandem/comm/shm/options.hpp"
#include "tandem/core/detail/disagreement.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem::detail::shm {

using Op = CollectiveOp;
using Call = CollectiveFingerprint;

/// How often a sleeping rank wakes to look at its peers (dead, gone, failed) and the deadline.
inline constexpr Timeout poll_interval = std::chrono::milliseconds(100);
/// Above this many bytes per piece, groups of more than 2 ranks split the reduction: each rank
/// reduces 1/n of the piece, then all copy the n parts (two barriers instead of one).
inline constexpr std::size_t split_reduction_bytes = std::size_t{32} << 10;

/// The header in front of every message in a ring.
struct Frame {
  std::int64_t tag = 0;
  std::uint64_t type = 0;
  std::uint64_t count = 0;
  std::uint64_t bytes = 0;
};

/// A message taken off a ring (or sent by this rank to itself), whole or still arriving.
struct Message {
  dtype type = dtype::float32;
  std::size_t count = 0;
  std::vector<std::byte> bytes;
  std::size_t received = 0;
  [[nodiscard]] bool complete() const noexcept { return received == bytes.size(); }
};

/// What this rank has taken off the ring from one peer: its messages by tag, in order.
struct Inbox {
  std::uint64_t head = 0;
  Frame frame{};
  std::size_t frame_received = 0;
  Message* arriving = nullptr;  ///< the back of one of the queues, until it is complete
  std::map<std::int64_t, std::deque<Message>> by_tag;
};

inline std::string this_host() {
  char host[256] = {};
  return ::gethostname(host, sizeof host - 1) == 0 ? std::string(host) : std::string("?");
}

inline void read_ring(const std::byte* ring, std::size_t ring_bytes, std::uint64_t position,
                      std::byte* to, std::size_t n) {
  const auto at = static_cast<std::size_t>(position % ring_bytes);
  const std::size_t first = std::min(n, ring_bytes - at);
  std::memcpy(to, ring + at, first);
  if (n > first) std::memcpy(to + first, ring, n - first);
}

inline void write_ring(std::byte* ring, std::size_t ring_bytes, std::uint64_t position,
                       const std::byte* from, std::size_t n) {
  const auto at = static_cast<std::size_t>(position % ring_bytes);
  const std::size_t first = std::min(n, ring_bytes - at);
  std::memcpy(ring + at, from, first);
  if (n > first) std::memcpy(ring, from + first, n - first);
}

class Engine;

/// Makes this rank's engine of a new group (defined below the engine).
inline std::unique_ptr<Engine> connect(AnyStore& store, const std::string& prefix, int rank,
                                       int size, const ShmCommOptions& options,
                                       const std::optional<Error>& unreadable = std::nullopt);

/// One rank's state of a group. Heap-allocated and owned by the ShmComm, so that `_async` tasks
/// may point at it while the ShmComm moves. Operations run one at a time (IssueOrder: on the
/// caller's thread after the worker has drained, or on the worker), so nothing here is locked.
class Engine : public IssueOrder {
 public:
  /// `pids[r]` is the pid rank r published in the store where it shares this process's PID
  /// namespace, else 0 (watched until the rank writes its own in the segment).
  Engine(Segment segment, const Layout& layout, int rank, std::vector<std::int64_t> pids,
         AnyStore store, std::string name, ShmCommOptions options)
      : segment_(std::move(segment)),
        layout_(layout),
        control_(&segment_.control()),
        ranks_(reinterpret_cast<RankState*>(segment_.base() + layout.ranks_at)),
        rank_(rank),
        size_(layout.size),
        pids_(std::move(pids)),
        store_(std::move(store)),
        name_(std::move(name)),
        options_(options),
        spin_(resolve_spin(options.spin, layout.size)),
        inboxes_(static_cast<std::size_t>(layout.size)),
        sent_(static_cast<std::size_t>(layout.size), 0) {
    ranks_[rank_].pid_namespace.store(pid_space_);
    ranks_[rank_].pid.store(::getpid());
    ranks_[rank_].locked.store(segment_.locked() ? 1 : 0);
    // The last rank to map the segment removes its name: from here on, nothing of this group
    // is left in /dev/shm whatever happens to its processes.
    if (control_->mapped.fetch_add(1) + 1 == static_cast<std::uint32_t>(size_)) segment_.unlink();
  }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine() {
    stop();  // runs what is still queued
    ranks_[rank_].left.store(1);
    notify();
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] const ShmCommOptions& options() const noexcept { return options_; }
  [[nodiscard]] const AnyStore& store() const noexcept { return store_; }

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

  /// The rendezvous' last step: returns once every rank has mapped the segment.
  void join() {
    start("ShmComm rendezvous");
    arrive(nullptr);
  }

  // --- the algorithms: raw pointers and element counts (frontend.hpp) -------------------------

  template <class T>
  void all_reduce(const T* in, T* out, std::size_t count, ReduceOp op) {
    start("all_reduce");
    std::vector<T> copy;
    in = stable(in, count, out, count, out, copy);
    const bool split = size_ > 2 && count * sizeof(T) > split_reduction_bytes;
    rounds(make_fingerprint<T>(Op::all_reduce, 0, count, 0, op), count, slot_elements<T>(1),
           [&](std::size_t first, std::size_t length, const Call* call) {
             copy_elements(in + first, length, slot<T>(rank_));
             arrive(call);
             if (!split) return reduce_range(out + first, slots<T>(0), 0, length, op);
             reduce_share<T>(length, op);
             for (int r = 0; r < size_; ++r) copy_share(r, length, out + first);
           });
  }

  template <class T>
  void reduce(T* buffer, std::size_t count, int root, ReduceOp op) {
    start("reduce");
    const bool split = size_ > 2 && count * sizeof(T) > split_reduction_bytes;
    rounds(make_fingerprint<T>(Op::reduce, 0, count, root, op), count, slot_elements<T>(1),
           [&](std::size_t first, std::size_t length, const Call* call) {
             copy_elements(buffer + first, length, slot<T>(rank_));
             arrive(call);
             if (!split) {
               if (rank_ == root) reduce_range(buffer + first, slots<T>(0), 0, length, op);
               return;
             }
             reduce_share<T>(length, op);
             if (rank_ != root) return;
             for (int r = 0; r < size_; ++r) copy_share(r, length, buffer + first);
           });
  }

  template <class T>
  void broadcast(T* buffer, std::size_t count, int root) {
    start("broadcast");
    rounds(make_fingerprint<T>(Op::broadcast, 0, count, root), count, slot_elements<T>(1),
           [&](std::size_t first, std::size_t length, const Call* call) {
             if (rank_ == root) copy_elements(buffer + first, length, slot<T>(root));
             arrive(call);
             if (rank_ != root) copy_elements(slot<T>(root), length, buffer + first);
           });
  }

  template <class T>
  void all_gather(const T* in, T* out, std::size_t count) {
    start("all_gather");
    const auto n = static_cast<std::size_t>(size_);
    std::vector<T> copy;
    in = stable(in, count, out, n * count, out + static_cast<std::size_t>(rank_) * count, copy);
    rounds(make_fingerprint<T>(Op::all_gather, 0, count), count, slot_elements<T>(1),
           [&](std::size_t first, std::size_t length, const Call* call) {
             copy_elements(in + first, length, slot<T>(rank_));
             arrive(call);
             for (std::size_t r = 0; r < n; ++r) {
               copy_elements(slot<T>(static_cast<int>(r)), length, out + r * count + first);
             }
           });
  }

  template <class T>
  void gather(const T* in, T* out, std::size_t count, int root) {
    start("gather");
    const auto n = static_cast<std::size_t>(size_);
    std::vector<T> copy;
    in = stable(in, count, out, rank_ == root ? n * count : 0, nullptr, copy);
    rounds(make_fingerprint<T>(Op::gather, 0, count, root), count, slot_elements<T>(1),
           [&](std::size_t first, std::size_t length, const Call* call) {
             copy_elements(in + first, length, slot<T>(rank_));
             arrive(call);
             if (rank_ != root) return;
             for (std::size_t r = 0; r < n; ++r) {
               copy_elements(slot<T>(static_cast<int>(r)), length, out + r * count + first);
             }
           });
  }

  template <class T>
  void scatter(const T* in, T* out, std::size_t count, int root) {
    start("scatter");
    const auto n = static_cast<std::size_t>(size_);
    std::vector<T> copy;
    in = stable(in, rank_ == root ? n * count : 0, out, count, nullptr, copy);
    rounds(make_fingerprint<T>(Op::scatter, 0, count, root), count, slot_elements<T>(1),
           [&](std::size_t first, std::size_t length, const Call* call) {
             if (rank_ == root) {  // the root fills every rank's slot
               for (std::size_t r = 0; r < n; ++r) {
                 copy_elements(in + r * count + first, length, slot<T>(static_cast<int>(r)));
               }
             }
             arrive(call);
             copy_elements(slot<T>(rank_), length, out + first);
           });
  }

  template <class T>
  void reduce_scatter(const T* in, T* out, std::size_t count, ReduceOp op) {
    start("reduce_scatter");
    const auto n = static_cast<std::size_t>(size_);
    const auto me = static_cast<std::size_t>(rank_);
    std::vector<T> copy;
    in = stable(in, n * count, out, count, out - me * count, copy);
    rounds(make_fingerprint<T>(Op::reduce_scatter, 0, count, 0, op), count, slot_elements<T>(n),
           [&](std::size_t first, std::size_t length, const Call* call) {
             for (std::size_t r = 0; r < n; ++r) {
               copy_elements(in + r * count + first, length, slot<T>(rank_) + r * length);
             }
             arrive(call);
             reduce_range(out + first, slots<T>(me * length), 0, length, op);
           });
  }

  template <class T>
  void all_to_all(const T* in, T* out, std::size_t total) {
    start("all_to_all");
    const auto n = static_cast<std::size_t>(size_);
    const auto me = static_cast<std::size_t>(rank_);
    const std::size_t count = total / n;
    std::vector<T> copy;
    in = stable(in, total, out, total, nullptr, copy);
    rounds(make_fingerprint<T>(Op::all_to_all, 0, total), count, slot_elements<T>(n),
           [&](std::size_t first, std::size_t length, const Call* call) {
             for (std::size_t r = 0; r < n; ++r) {
               copy_elements(in + r * count + first, length, slot<T>(rank_) + r * length);
             }
             arrive(call);
             for (std::size_t r = 0; r < n; ++r) {
               copy_elements(slot<T>(static_cast<int>(r)) + me * length, length,
                             out + r * count + first);
             }
           });
  }

  void barrier() {
    start("barrier");
    rounds(make_fingerprint(Op::barrier, 0, dtype::float32, 0), 0, 1,
           [&](std::size_t, std::size_t, const Call* call) { arrive(call); });
  }

  /// This rank's engine of its new group; null for no_color.
  std::unique_ptr<Engine> split(int color, int key) {
    start("split");
    Call mine = make_fingerprint(Op::split, 0, dtype::float32, 0);
    mine.color = color;
    mine.key = key;
    std::vector<Call> calls;
    rounds(mine, 0, 1, [&](std::size_t, std::size_t, const Call* call) {
      arrive(call);
      for (int r = 0; r < size_; ++r) calls.push_back(ranks_[r].calls[half_]);
    });
    const std::uint64_t sequence = ++splits_;  // the same on every rank: split is collective
    if (color == no_color) return nullptr;
    const auto group = split_members(calls, rank_);
    const std::string name =
        name_ + "/split" + std::to_string(sequence) + "/color" + std::to_string(color);
    return connect(store_, name, group.rank, static_cast<int>(group.members.size()), options_);
  }

  template <class T>
  void send(const T* data, std::size_t count, int peer, int tag) {
    start("send");
    const std::size_t bytes = count * sizeof(T);
    if (peer == rank_) {  // no ring to itself: a queue of its own
      Message message{dtype_of<T>, count, std::vector<std::byte>(bytes), bytes};
      if (bytes) std::memcpy(message.bytes.data(), data, bytes);
      to_self_[tag].push_back(std::move(message));
      return;
    }
    const Frame frame{tag, static_cast<std::uint64_t>(dtype_of<T>), count, bytes};
    put(peer, tag, reinterpret_cast<const std::byte*>(&frame), sizeof frame);
    put(peer, tag, reinterpret_cast<const std::byte*>(data), bytes);
  }

  template <class T>
  void recv(T* data, std::size_t count, int peer, int tag) {
    start("recv");
    Message message;
    if (peer == rank_) {
      auto found = to_self_.find(tag);
      if (found == to_self_.end() || found->second.empty()) {
        throw recv_from_self_unsent(rank_, tag);
      }
      message = std::move(found->second.front());
      found->second.pop_front();
    } else {
      auto& queue = inboxes_[static_cast<std::size_t>(peer)].by_tag[tag];
      wait([&] { return !queue.empty() && queue.front().complete(); },
           [&] { return std::vector<int>{peer}; },
           [&] {
             return "timed out after " + describe(options_.timeout) + " waiting for rank " +
                    std::to_string(peer) + " to send with tag " + std::to_string(tag);
           });
      message = std::move(queue.front());
      queue.pop_front();
    }
    if (message.type != dtype_of<T> || message.count != count) {
      throw recv_mismatch(rank_, peer, tag, message.type, message.count, dtype_of<T>, count);
    }
    if (count) std::memcpy(data, message.bytes.data(), message.bytes.size());
  }

 private:
  static std::chrono::microseconds resolve_spin(std::chrono::microseconds asked, int ranks) {
    if (asked.count() >= 0) return asked;
    // Polling pays only where every rank surely has a CPU of its own: where ranks share one,
    // the poller burns the time slice its peer needs to arrive (measured on 2 loaded cores: 112
    // us for a 4 KiB all_reduce with a 50 us poll, 9 us without).
    const unsigned cpus = std::thread::hardware_concurrency();
    return cpus >= 4 * static_cast<unsigned>(ranks) ? std::chrono::microseconds(50)
                                                    : std::chrono::microseconds(0);
  }

  /// Every operation starts here: a failed group refuses it; the deadline starts.
  void start(const char* operation) {
    if (!broken_ && control_->aborted_by.load(std::memory_order_acquire) != 0) {
      broken_ = abort_failure();  // no call of any rank runs after an abort()
    }
    if (broken_) {
      throw Error(rank_, operation,
                  "this communicator is unusable after an earlier failure (" + *broken_ + ")");
    }
    operation_ = operation;
    deadline_ = Deadline(options_.timeout);
  }

  // --- rounds and slots -------------------------------------------------------------------------

  /// Runs round(first, length, call) over [first, first + length) pieces of [0, count), at most
  /// `per` elements each (one round for count 0). Rounds alternate between the two halves of
  /// every slot: a rank writes a half again two rounds later, after the barrier of the round
  /// between, which no rank passes before it has finished reading that half. `call` is given to
  /// the first round only: its barrier compares the ranks' calls before anything is read.
  template <class Round>
  void rounds(const Call& call, std::size_t count, std::size_t per, Round&& round) {
    std::size_t first = 0;
    const Call* check = &call;
    do {
      const std::size_t length = std::min(per, count - first);
      half_ = static_cast<std::size_t>(rounds_++ % 2);
      round(first, length, check);
      check = nullptr;
      first += length;
    } while (first < count);
  }

  template <class T>
  [[nodiscard]] T* slot(int r) const noexcept {
    return reinterpret_cast<T*>(segment_.base() + layout_.slot(r, half_));
  }
  /// Every rank's slot at `offset` elements, in rank order (the sources of a reduction).
  template <class T>
  [[nodiscard]] std::vector<const T*> slots(std::size_t offset) const {
    std::vector<const T*> all;
    all.reserve(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) all.push_back(slot<T>(r) + offset);
    return all;
  }
  /// Elements of T that fit a slot as `parts` equal parts.
  template <class T>
  [[nodiscard]] std::size_t slot_elements(std::size_t parts) const noexcept {
    return layout_.slot_bytes / (parts * sizeof(T));
  }
  /// Rank r's share [begin, end) of a piece of `length` elements.
  [[nodiscard]] std::pair<std::size_t, std::size_t> share(int r, std::size_t length) const {
    const auto n = static_cast<std::size_t>(size_);
    return {length * static_cast<std::size_t>(r) / n, length * static_cast<std::size_t>(r + 1) / n};
  }
  /// This rank reduces its share of the piece, from every slot into its own; then a barrier.
  template <class T>
  void reduce_share(std::size_t length, ReduceOp op) {
    const auto [begin, end] = share(rank_, length);
    reduce_range(slot<T>(rank_), slots<T>(0), begin, end, op);
    arrive(nullptr);
  }
  /// Copies rank r's reduced share of the piece from its slot to `out`.
  template <class T>
  void copy_share(int r, std::size_t length, T* out) const {
    const auto [begin, end] = share(r, length);
    copy_elements(static_cast<const T*>(slot<T>(r)) + begin, end - begin, out + begin);
  }

  /// `in`, or a private copy of it where it overlaps `out` other than as `allowed`.
  template <class T>
  static const T* stable(const T* in, std::size_t in_count, std::type_identity_t<const T*> out,
                         std::size_t out_count, std::type_identity_t<const T*> allowed,
                         std::vector<T>& copy) {
    if (in == allowed || !overlap(in, in_count, out, out_count)) return in;
    copy.assign(in, in + in_count);
    return copy.data();
  }

  // --- the barrier ----------------------------------------------------------------------------

  /// Arrives at the next barrier and waits for every rank. With `call` (an operation's first
  /// round), this rank's call is published with its arrival and every rank's is compared after:
  /// ranks that disagree all raise the same tandem::Error, and the group stays usable (every
  /// rank has made the same rounds and barriers).
  void arrive(const Call* call) {
    RankState& mine = ranks_[rank_];
    if (call) mine.calls[half_] = *call;
    const std::uint64_t target = ++barriers_;
    mine.arrivals.store(target, std::memory_order_release);
    notify();
    wait([&] { return all_arrived(target); }, [&] { return missing(target); },
         [&] {
           std::vector<int> here;
           for (int r = 0; r < size_; ++r) {
             if (ranks_[r].arrivals.load() >= target) here.push_back(r);
           }
           return "timed out after " + describe(options_.timeout) + " waiting for " +
                  rank_list(missing(target)) + " (arrived: " + rank_list(here) + ")";
         });
    if (call) check_calls(*call);
  }

  [[nodiscard]] bool all_arrived(std::uint64_t target) const noexcept {
    for (int r = 0; r < size_; ++r) {
      if (ranks_[r].arrivals.load(std::memory_order_acquire) < target) return false;
    }
    return true;
  }

  [[nodiscard]] std::vector<int> missing(std::uint64_t target) const {
    std::vector<int> absent;
    for (int r = 0; r < size_; ++r) {
      if (ranks_[r].arrivals.load(std::memory_order_acquire) < target) absent.push_back(r);
    }
    return absent;
  }

  void check_calls(const Call& mine) const {
    bool same = true;
    for (int r = 0; r < size_ && same; ++r) {
      same = std::memcmp(&ranks_[r].calls[half_], &mine, sizeof mine) == 0;
    }
    if (same) return;
    std::vector<Call> calls;
    for (int r = 0; r < size_; ++r) calls.push_back(ranks_[r].calls[half_]);
    if (auto text = fingerprint_disagreement(calls); !text.empty()) {
      throw Error(rank_, operation_, text);
    }
  }

  // --- waiting ------------------------------------------------------------------------------

  /// Wakes the ranks asleep on the futex word (a syscall only where one sleeps).
  void notify() noexcept {
    control_->epoch.fetch_add(1);
    if (control_->sleepers.load() != 0) futex_wake_all(control_->epoch);
  }

  /// Returns once ready() holds, taking messages off the rings meanwhile (so that a peer blocked
  /// on a full ring goes on). Polls for spin_, then sleeps on the futex word, waking at least
  /// every poll_interval to look at the ranks awaited(): one that died or left, or a failure
  /// another rank recorded, raises a tandem::Error; so does the deadline, with timeout_cause().
  template <class Ready, class Awaited, class Cause>
  void wait(Ready&& ready, Awaited&& awaited, Cause&& timeout_cause) {
    auto done = [&] {
      pump_all();
      return ready();
    };
    if (done()) return;
    using clock = std::chrono::steady_clock;
    if (spin_.count() > 0) {
      const auto until = clock::now() + spin_;
      for (unsigned i = 1;; ++i) {
        cpu_relax();
        if (done()) return;
        if (i % 64 == 0 && clock::now() >= until) break;
      }
    }
    auto next_look = clock::now() + poll_interval;
    for (;;) {
      control_->sleepers.fetch_add(1);
      const std::uint32_t seen = control_->epoch.load();
      const bool finished = done();
      if (!finished)
        futex_wait(control_->epoch, seen, std::min(poll_interval, deadline_.remaining()));
      control_->sleepers.fetch_sub(1);
      if (finished || done()) return;
      if (clock::now() >= next_look) {
        next_look = clock::now() + poll_interval;
        const std::vector<int> waiting_for = awaited();
        flight_awaiting(waiting_for);  // the flight recorder's waiting notice names them
        if (const std::string cause = trouble(waiting_for); !cause.empty()) {
          if (done()) return;  // it arrived, then ended: not a failure
          fail(cause);
        }
      }
      if (deadline_.expired()) {
        if (done()) return;
        fail(timeout_cause() + stopped(awaited()));
      }
    }
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

  // --- send and recv: one byte ring per ordered pair ------------------------------------------

  RingState& ring(int src, int dst) const noexcept {
    return *reinterpret_cast<RingState*>(segment_.base() + layout_.ring(src, dst));
  }
  std::byte* ring_data(int src, int dst) const noexcept {
    return segment_.base() + layout_.ring_data(src, dst);
  }

  /// Writes `n` bytes to the ring to `peer`, waiting for room where it is full.
  void put(int peer, int tag, const std::byte* from, std::size_t n) {
    RingState& state = ring(rank_, peer);
    std::byte* data = ring_data(rank_, peer);
    std::uint64_t& tail = sent_[static_cast<std::size_t>(peer)];
    auto room = [&] {
      return layout_.ring_bytes -
             static_cast<std::size_t>(tail - state.head.load(std::memory_order_acquire));
    };
    while (n > 0) {
      wait([&] { return room() > 0; }, [&] { return std::vector<int>{peer}; },
           [&] {
             return "timed out after " + describe(options_.timeout) + " waiting for rank " +
                    std::to_string(peer) + " to take this rank's earlier messages (tag " +
                    std::to_string(tag) + "; the ring to it is full)";
           });
      const std::size_t take = std::min(n, room());
      write_ring(data, layout_.ring_bytes, tail, from, take);
      tail += take;
      state.tail.store(tail, std::memory_order_release);
      notify();
      from += take;
      n -= take;
    }
  }

  void pump_all() {
    for (int r = 0; r < size_; ++r) {
      if (r != rank_) pump(r);
    }
  }

  /// Takes what `src` has written to this rank so far into its inbox.
  void pump(int src) {
    RingState& state = ring(src, rank_);
    Inbox& in = inboxes_[static_cast<std::size_t>(src)];
    const std::uint64_t tail = state.tail.load(std::memory_order_acquire);
    if (tail == in.head) return;
    const std::byte* data = ring_data(src, rank_);
    while (in.head < tail) {
      const auto available = static_cast<std::size_t>(tail - in.head);
      if (!in.arriving) {
        const std::size_t take = std::min(available, sizeof(Frame) - in.frame_received);
        read_ring(data, layout_.ring_bytes, in.head,
                  reinterpret_cast<std::byte*>(&in.frame) + in.frame_received, take);
        in.head += take;
        in.frame_received += take;
        if (in.frame_received < sizeof(Frame)) break;
        in.frame_received = 0;
        begin_message(src, in);
      } else {
        Message& message = *in.arriving;
        const std::size_t take = std::min(available, message.bytes.size() - message.received);
        read_ring(data, layout_.ring_bytes, in.head, message.bytes.data() + message.received, take);
        in.head += take;
        message.received += take;
        if (message.complete()) in.arriving = nullptr;
      }
    }
    state.head.store(in.head, std::memory_order_release);
    notify();
  }

  void begin_message(int src, Inbox& in) {
    const Frame& frame = in.frame;
    if (frame.type > static_cast<std::uint64_t>(dtype::uint8) ||
        frame.bytes != frame.count * size_of(static_cast<dtype>(frame.type))) {
      fail("rank " + std::to_string(src) + " sent a corrupt message header");
    }
    auto& queue = in.by_tag[frame.tag];
    queue.push_back(Message{static_cast<dtype>(frame.type), static_cast<std::size_t>(frame.count),
                            std::vector<std::byte>(static_cast<std::size_t>(frame.bytes)), 0});
    in.arriving = queue.back().complete() ? nullptr : &queue.back();
  }

  Segment segment_;  // first: unmapped last
  Layout layout_;
  Control* control_;
  RankState* ranks_;
  int rank_;
  int size_;
  std::vector<std::int64_t> pids_;  ///< as published in the store at rendezvous (see the ctor)
  std::uint64_t pid_space_ = pid_space();
  AnyStore store_;
  std::string name_;  ///< this group's prefix in the store; splits extend it
  ShmCommOptions options_;
  std::chrono::microseconds spin_;

  std::uint64_t barriers_ = 0;  ///< barriers this rank has arrived at
  std::uint64_t rounds_ = 0;    ///< rounds made (each uses the slot half rounds_ % 2)
  std::size_t half_ = 0;        ///< the slot half of the current round
  std::uint64_t splits_ = 0;
  const char* operation_ = "ShmComm";
  Deadline deadline_{Timeout::zero()};
  std::optional<std::string> broken_;

  std::vector<Inbox> inboxes_;       ///< per source rank
  std::vector<std::uint64_t> sent_;  ///< per destination: bytes written to its ring
  std::map<std::int64_t, std::deque<Message>> to_self_;
};

/// Rank 0's segment for a group of `size` ranks: the layout with slots of `slot_bytes` and rings
/// of default_ring_bytes where it takes at most half of what /dev/shm has free (the rest is for
/// the job's other groups and other jobs), else shrunk to fit (fit_layout; the whole of what is
/// free where half will not do). Where the reservation still fails (another job took the space
/// meanwhile), the budget halves and it tries again. Where the smallest layout does not fit,
/// the Error says what it needs, what is free and what to change - before training starts.
inline Segment make_segment(int size, std::size_t slot_bytes, std::optional<Layout>& layout) {
  constexpr const char* operation = "ShmComm rendezvous";
  const std::size_t free = shm_free_bytes();
  std::size_t budget = free / 2;
  for (;;) {
    layout = fit_layout(size, slot_bytes, budget);
    if (!layout && budget == free / 2) layout = fit_layout(size, slot_bytes, free / 16 * 15);
    if (!layout) break;
    bool no_room = false;
    Segment made = Segment::create(0, *layout, operation, &no_room);
    if (!no_room) return made;
    budget = std::min(budget, layout->total) / 2;
  }
  const Layout least(size, smallest_slot_for(size), smallest_ring_bytes);
  const Layout asked(size, slot_bytes, default_ring_bytes);
  throw Error(
      0, operation,
      "a group of " + std::to_string(size) + " ranks needs at least " + mebibytes(least.total) +
          " of /dev/shm (slots of " + std::to_string(least.slot_bytes >> 10) + " KiB, rings of " +
          std::to_string(least.ring_bytes >> 10) + " KiB; " + mebibytes(asked.total) +
          " as asked), and /dev/shm has " + mebibytes(free) + " free" +
          (process_env(free_bytes_variable) ? " (as " + std::string(free_bytes_variable) + " says)"
                                            : std::string()) +
          ": give the container more shared memory (docker run --shm-size=1g; "
          "Kubernetes: a memory-backed emptyDir on /dev/shm), free some of it (ls "
          "/dev/shm), or use another backend across these ranks (GlooComm or MpiComm; "
          "the examples' --backend gloo)");
}

/// Every member of a new group calls this with the same `prefix` (unique to the group in
/// `store`): the ranks publish their host and pid, rank 0 creates the segment and announces its
/// name, the others map it, and the last to map it unlinks the name. Returns once all have
/// mapped it. `unreadable`: this rank's TANDEM_CHECK_COLLECTIVES could not be read (it still
/// publishes, so that the others raise at once instead of waiting for it).
inline std::unique_ptr<Engine> connect(AnyStore& store, const std::string& prefix, int rank,
                                       int size, const ShmCommOptions& options,
                                       const std::optional<Error>& unreadable) {
  constexpr const char* operation = "ShmComm rendezvous";
  AnyStore scoped(PrefixStore<AnyStore>(prefix, store));
  // "ok PID PID-NAMESPACE HOST": a pid is watched only by ranks of its PID namespace.
  const std::uint64_t my_space = pid_space();
  scoped.set("member/" + std::to_string(rank), std::string(unreadable ? "unreadable " : "ok ") +
                                                   std::to_string(::getpid()) + " " +
                                                   std::to_string(my_space) + " " + this_host());
  std::vector<std::string> hosts;
  std::vector<std::int64_t> pids;
  std::vector<int> bad;
  for (int r = 0; r < size; ++r) {
    const std::string record = scoped.get("member/" + std::to_string(r), options.timeout);
    std::vector<std::string> fields;
    std::size_t at = 0;
    while (fields.size() < 3 && at <= record.size()) {
      const auto space = record.find(' ', at);
      fields.push_back(record.substr(at, space == std::string::npos ? space : space - at));
      at = space == std::string::npos ? record.size() + 1 : space + 1;
    }
    if (fields.front() != "ok") bad.push_back(r);
    const bool here = fields.size() == 3 && fields[2] == std::to_string(my_space);
    pids.push_back(here ? std::atoll(fields[1].c_str()) : 0);
    hosts.push_back(at <= record.size() ? record.substr(at) : std::string());
  }
  if (unreadable) throw *unreadable;
  if (!bad.empty()) {
    throw Error(rank, operation,
                rank_list(bad) + " could not read " + std::string(check_collectives_variable) +
                    " (see that rank's Error)");
  }
  if (auto where = disagreement(hosts, [](const std::string& host) { return host; });
      !where.empty()) {
    throw Error(rank, operation,
                "ShmComm joins the processes of one host, but these ranks run on several (" +
                    where + "); use GlooComm or MpiComm across hosts");
  }
  if (options.slot_bytes < static_cast<std::size_t>(size) * sizeof(std::int64_t)) {
    throw Error(rank, operation,
                "ShmCommOptions::slot_bytes = " + std::to_string(options.slot_bytes) +
                    " is too small for " + std::to_string(size) + " ranks (at least " +
                    std::to_string(size * 8) + ")");
  }
  // Rank 0 sizes the segment to what /dev/shm has free (see make_segment) and announces its
  // name and sizes.
  std::optional<Layout> layout;
  std::optional<Segment> segment;
  if (rank == 0) {
    try {
      segment.emplace(make_segment(size, options.slot_bytes, layout));
    } catch (const Error& e) {
      scoped.set("segment", std::string("!") + e.what());  // the others raise it too
      throw;
    }
    scoped.set("segment", segment->name() + " " + std::to_string(layout->slot_bytes) + " " +
                              std::to_string(layout->ring_bytes));
  } else {
    const std::string record = scoped.get("segment", options.timeout);
    if (!record.empty() && record.front() == '!') {
      throw Error(rank, operation,
                  "rank 0 could not make the group's segment: " + record.substr(1));
    }
    const auto ring_at = record.rfind(' ');
    const auto slot_at = record.rfind(' ', ring_at - 1);
    layout.emplace(size, static_cast<std::size_t>(std::atoll(record.c_str() + slot_at + 1)),
                   static_cast<std::size_t>(std::atoll(record.c_str() + ring_at + 1)));
    segment.emplace(Segment::open(rank, record.substr(0, slot_at), *layout, operation));
  }
  auto engine = std::make_unique<Engine>(std::move(*segment), *layout, rank, std::move(pids), store,
                                         prefix, options);
  engine->join();
  return engine;
}

}  // namespace tandem::detail::shm
