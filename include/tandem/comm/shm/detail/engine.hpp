// tandem/comm/shm/detail/engine.hpp - detail::shm::Engine, one rank's side of a tandem::ShmComm
// group: the barrier that also exchanges and compares the ranks' calls, the waits (a short spin,
// a short poll that yields the CPU, then a futex sleep woken every 100 ms to look at the peers:
// detail/peers.hpp), the collectives over the staging slots, send and recv over byte rings
// (detail/ring.hpp; the members in detail/messages.hpp), the shared blocks
// (detail/in_block.hpp), and split.
//   auto engine = connect(store, prefix, rank, size, options);   engine->all_reduce(in, out, n,
//   op);
// Needs: Linux (through segment.hpp). Not a public header: shm.hpp uses it; connect() is
// declared here and defined in detail/connect.hpp. The design: docs/shm.md.
#pragma once

#include <sched.h>
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
#include "tandem/comm/shared_memory.hpp"
#include "tandem/comm/shm/detail/blocks.hpp"
#include "tandem/comm/shm/detail/peers.hpp"
#include "tandem/comm/shm/detail/ring.hpp"
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
/// ShmCommOptions::yield's default.
inline constexpr std::chrono::microseconds default_yield{50};
/// Above this many bytes per piece, groups of more than 2 ranks split the reduction: each rank
/// reduces 1/n of the piece, then all copy the n parts (two barriers instead of one).
inline constexpr std::size_t split_reduction_bytes = std::size_t{32} << 10;

class Engine;

/// Makes this rank's engine of a new group (defined in detail/connect.hpp, which includes this
/// header; split calls it).
inline std::unique_ptr<Engine> connect(AnyStore& store, const std::string& prefix, int rank,
                                       int size, const ShmCommOptions& options,
                                       const std::optional<Error>& unreadable = std::nullopt);

/// One rank's state of a group. Heap-allocated and owned by the ShmComm, so that `_async` tasks
/// may point at it while the ShmComm moves. Operations run one at a time (IssueOrder: on the
/// caller's thread after the worker has drained, or on the worker), so nothing here is locked.
class Engine : public IssueOrder, public Peers {
 public:
  /// `pids[r]` is the pid rank r published in the store where it shares this process's PID
  /// namespace, else 0 (watched until the rank writes its own in the segment).
  Engine(Segment segment, const Layout& layout, int rank, std::vector<std::int64_t> pids,
         AnyStore store, std::string name, ShmCommOptions options)
      : Peers(std::move(segment), layout, rank, std::move(pids)),
        store_(std::move(store)),
        name_(std::move(name)),
        options_(options),
        spin_(resolve_spin(options.spin, layout.size)),
        yield_(options.yield.count() >= 0 ? options.yield : default_yield),
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

  /// The rendezvous' last step: returns once every rank has mapped the segment.
  void join() {
    start("ShmComm rendezvous");
    arrive(nullptr);
  }

  // --- the algorithms: raw pointers and element counts (frontend.hpp) -------------------------

  template <class T>
  void all_reduce(const T* in, T* out, std::size_t count, ReduceOp op) {
    start("all_reduce");
    const std::size_t bytes = count * sizeof(T);
    if (in == out && bytes > in_block_most_slot_bytes && size_ > 1) {
      if (auto where = blocks_.find(out, bytes, rank_)) {
        return all_reduce_in_block<T>(count, op, *where);
      }
    }
    std::vector<T> copy;
    in = stable(in, count, out, count, out, copy);
    const bool split = size_ > 2 && bytes > split_reduction_bytes;
    rounds(make_fingerprint<T>(Op::all_reduce, 0, count, 0, op), count, slot_elements<T>(1),
           [&](std::size_t first, std::size_t length, const Call* call) {
             copy_elements(in + first, length, slot<T>(rank_));
             if (call) ranks_[rank_].places[half_] = Place{};
             arrive(call);
             if (call) check_places(Place{});
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
    if (n * count * sizeof(T) > in_block_most_slot_bytes && size_ > 1 &&
        !overlap(in, count, static_cast<const T*>(out), n * count)) {
      if (auto where = blocks_.find(in, count * sizeof(T), rank_)) {
        return all_gather_from_block<T>(out, count, *where);
      }
    }
    std::vector<T> copy;
    in = stable(in, count, out, n * count, out + static_cast<std::size_t>(rank_) * count, copy);
    rounds(make_fingerprint<T>(Op::all_gather, 0, count), count, slot_elements<T>(1),
           [&](std::size_t first, std::size_t length, const Call* call) {
             copy_elements(in + first, length, slot<T>(rank_));
             if (call) ranks_[rank_].places[half_] = Place{};
             arrive(call);
             if (call) check_places(Place{});
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
    if (in + me * count == out && n * count * sizeof(T) > in_block_most_slot_bytes && size_ > 1) {
      if (auto where = blocks_.find(in, n * count * sizeof(T), rank_)) {
        return reduce_scatter_in_block<T>(count, op, *where);
      }
    }
    std::vector<T> copy;
    in = stable(in, n * count, out, count, out - me * count, copy);
    rounds(make_fingerprint<T>(Op::reduce_scatter, 0, count, 0, op), count, slot_elements<T>(n),
           [&](std::size_t first, std::size_t length, const Call* call) {
             for (std::size_t r = 0; r < n; ++r) {
               copy_elements(in + r * count + first, length, slot<T>(rank_) + r * length);
             }
             if (call) ranks_[rank_].places[half_] = Place{};
             arrive(call);
             if (call) check_places(Place{});
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

  /// This rank's part of a new shared block of `bytes` bytes (collective: every rank asks for
  /// the same); an empty block where /dev/shm has no room for one (detail/in_block.hpp).
  SharedBlock allocate_shared(std::size_t bytes);

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

  /// Looks at done() for `how_long`, calling pause() before each look; whether it came true.
  template <class Done, class Pause>
  static bool poll_for(std::chrono::microseconds how_long, Done&& done, Pause&& pause) {
    if (how_long.count() <= 0) return false;
    const auto until = std::chrono::steady_clock::now() + how_long;
    for (unsigned i = 1;; ++i) {
      pause();
      if (done()) return true;
      if (i % 8 == 0 && std::chrono::steady_clock::now() >= until) return false;
    }
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
    if (poll_for(spin_, done, cpu_relax)) return;
    // A peer that shares this CPU gets it at once, and this rank sees it arrive without a futex
    // wake-up, which waits for the scheduler (4 KiB at 4 ranks on 2 CPUs: 42 us -> 14).
    if (poll_for(yield_, done, [] { sched_yield(); })) return;
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

  // --- send and recv: one byte ring per ordered pair ------------------------------------------

  /// Writes `n` bytes to the ring to `peer`, waiting for room where it is full.
  void put(int peer, int tag, const std::byte* from, std::size_t n);
  /// Takes what every peer has written to this rank so far into its inboxes.
  void pump_all();
  /// Takes what `src` has written to this rank so far into its inbox.
  void pump(int src);
  void begin_message(int src, Inbox& in);

  // --- tensors in a shared block (detail/in_block.hpp) ----------------------------------------

  /// The frame of every collective in a shared block: two barriers, the calls and places
  /// compared after the first, `run` over the chunks of `total` elements' shares between them.
  template <class T, class Run>
  void in_block(const Call& call, const Place& mine, std::size_t total, bool claims, Run&& run);
  /// all_reduce in place of `count` elements that lie in a shared block on every rank.
  template <class T>
  void all_reduce_in_block(std::size_t count, ReduceOp op, const InBlock& where);
  /// reduce_scatter in place (out is this rank's slice of in), in a shared block on every rank.
  template <class T>
  void reduce_scatter_in_block(std::size_t count, ReduceOp op, const InBlock& where);
  /// all_gather of an `in` that lies in a shared block on every rank into an `out` apart from it.
  template <class T>
  void all_gather_from_block(T* out, std::size_t count, const InBlock& where);
  /// After the first barrier of an all_reduce, reduce_scatter or all_gather: every rank's tensor
  /// lies in the same place (the same block and offset, or no block), else every rank raises the
  /// same tandem::Error.
  void check_places(const Place& mine) const;

  AnyStore store_;
  std::string name_;  ///< this group's prefix in the store; splits extend it
  ShmCommOptions options_;
  std::chrono::microseconds spin_;
  std::chrono::microseconds yield_;

  std::uint64_t barriers_ = 0;  ///< barriers this rank has arrived at
  std::uint64_t rounds_ = 0;    ///< rounds made (each uses the slot half rounds_ % 2)
  std::size_t half_ = 0;        ///< the slot half of the current round
  std::uint64_t splits_ = 0;
  Deadline deadline_{Timeout::zero()};

  std::vector<Inbox> inboxes_;       ///< per source rank
  std::vector<std::uint64_t> sent_;  ///< per destination: bytes written to its ring
  std::map<std::int64_t, std::deque<Message>> to_self_;
  Blocks blocks_;  ///< this group's shared blocks (allocate_shared)
};

}  // namespace tandem::detail::shm
