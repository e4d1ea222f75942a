// tandem/comm/gloo/detail/engine.hpp - detail::gloo_comm::Engine, one GlooComm's per-rank state:
// the Gloo context and its TCP device, the connections to every peer, the store it met in, the
// `_async` worker (IssueOrder) and the outbox of eager sends; how each collective, send and recv
// runs over Gloo, and how split makes a new group.
//   auto connected = connect(store, name, rank, size, device, timeout);
//   Engine engine(std::move(connected), device, store, name, options, checks_collectives);
// Needs: Gloo with its TCP transport (libgloo-dev) and POSIX. Not a public header: gloo.hpp uses
// it.
#pragma once

#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/gather.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/scatter.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include "tandem/comm/checked.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/check_switch.hpp"
#include "tandem/comm/detail/collective_args.hpp"
#include "tandem/comm/detail/collective_op.hpp"
#include "tandem/comm/detail/frontend.hpp"
#include "tandem/comm/detail/issue_order.hpp"
#include "tandem/comm/detail/reduction.hpp"
#include "tandem/comm/detail/split_members.hpp"
#include "tandem/comm/gloo/detail/connect.hpp"
#include "tandem/comm/gloo/detail/gloo_support.hpp"
#include "tandem/comm/gloo/detail/ring.hpp"
#include "tandem/comm/gloo/options.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::detail::gloo_comm {

using Op = CollectiveOp;

/// What one rank was called with, as exchanged before a collective.
using Call = CollectiveFingerprint;

/// Slots of point-to-point messages: a prefix byte gloo's collectives do not use, and the tag.
inline std::uint64_t header_slot(int tag) {
  return (std::uint64_t{0x70} << 56) | static_cast<std::uint32_t>(tag);
}
inline std::uint64_t payload_slot(int tag) {
  return (std::uint64_t{0x71} << 56) | static_cast<std::uint32_t>(tag);
}
/// The slot of one reduce_scatter's ring messages (0x72 is the fingerprint exchange's).
inline std::uint64_t reduce_scatter_slot(std::uint32_t tag) {
  return (std::uint64_t{0x73} << 56) | tag;
}

/// One rank's communicator state. Heap-allocated and owned by the GlooComm, so the worker's
/// tasks may point at it while the GlooComm moves. Operations run one at a time (IssueOrder: on
/// the caller's thread after the worker has drained, or on the worker); only the outbox thread
/// runs beside them, and it touches nothing but its messages and `broken_`.
class Engine : public IssueOrder {
 public:
  /// `checks_collectives`: options.check_collectives resolved (the same on every rank: see
  /// rendezvous).
  Engine(Connected connected, std::shared_ptr<::gloo::transport::Device> device, AnyStore store,
         std::string name, GlooCommOptions options, bool checks_collectives)
      : graveyard_(),
        exchange_calls_(),
        exchange_buffer_(),
        recv_header_buffer_(),
        device_(std::move(device)),
        context_(std::move(connected.context)),
        peers_(std::move(connected.peers)),
        store_(std::move(store)),
        name_(std::move(name)),
        options_(std::move(options)),
        checks_collectives_(checks_collectives),
        rank_(context_->rank),
        size_(context_->size),
        outbox_([this](const std::string& cause) { mark_broken(cause); }) {}
  ~Engine() {
    stop();  // runs what is still queued
    // The outbox (a member) waits for its sends next, each bounded by the timeout.
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] const GlooCommOptions& options() const noexcept { return options_; }
  [[nodiscard]] const AnyStore& store() const noexcept { return store_; }
  [[nodiscard]] bool checks_collectives() const noexcept { return checks_collectives_; }

  // --- the algorithms: raw pointers and element counts ---------------------------------------

  template <class T>
  void all_reduce(const T* in, T* out, std::size_t count, ReduceOp op) {
    run(Op::all_reduce, call<T>(Op::all_reduce, count, 0, op), [&] {
      copy_elements(in, count, out);
      if (count == 0 || size_ == 1) return divide_if_avg(out, count, op);
      ::gloo::AllreduceOptions opts(context_);
      opts.setOutput(out, count);
      opts.setReduceFunction(reducer<T>(op));
      opts.setTag(next_tag());
      opts.setTimeout(options_.timeout);
      ::gloo::allreduce(opts);
      divide_if_avg(out, count, op);
    });
  }

  template <class T>
  void reduce(T* buffer, std::size_t count, int root, ReduceOp op) {
    run(Op::reduce, call<T>(Op::reduce, count, root, op), [&] {
      if (count == 0 || size_ == 1) return divide_if_avg(buffer, count, op);
      // gloo uses the output as scratch space: off the root, keep the caller's data intact.
      std::vector<T> scratch(rank_ == root ? 0 : count);
      ::gloo::ReduceOptions opts(context_);
      if (rank_ == root) {
        opts.setOutput(buffer, count);
      } else {
        opts.setInput(buffer, count);
        opts.setOutput(scratch.data(), count);
      }
      opts.setRoot(root);
      opts.setReduceFunction(reducer<T>(op));
      opts.setTag(next_tag());
      opts.setTimeout(options_.timeout);
      ::gloo::reduce(opts);
      if (rank_ == root) divide_if_avg(buffer, count, op);
    });
  }

  template <class T>
  void broadcast(T* buffer, std::size_t count, int root) {
    run(Op::broadcast, call<T>(Op::broadcast, count, root), [&] {
      if (count == 0 || size_ == 1) return;
      ::gloo::BroadcastOptions opts(context_);
      opts.setOutput(buffer, count);
      opts.setRoot(root);
      opts.setTag(next_tag());
      opts.setTimeout(options_.timeout);
      ::gloo::broadcast(opts);
    });
  }

  template <class T>
  void all_gather(const T* in, T* out, std::size_t count) {
    run(Op::all_gather, call<T>(Op::all_gather, count), [&] {
      const auto n = static_cast<std::size_t>(size_);
      T* mine = out + static_cast<std::size_t>(rank_) * count;
      if (count == 0) return;
      copy_elements(stable_input(in, count, out, n * count), count, mine);
      if (size_ == 1) return;
      ::gloo::AllgatherOptions opts(context_);
      opts.setOutput(out, n * count);  // no input: gloo takes this rank's slot as it stands
      opts.setTag(next_tag());
      opts.setTimeout(options_.timeout);
      ::gloo::allgather(opts);
    });
  }

  template <class T>
  void gather(const T* in, T* out, std::size_t count, int root) {
    run(Op::gather, call<T>(Op::gather, count, root), [&] {
      const auto n = static_cast<std::size_t>(size_);
      if (count == 0) return;
      if (size_ == 1) return copy_elements(in, count, out);
      std::vector<T> copy;
      if (rank_ == root && overlap(in, count, static_cast<const T*>(out), n * count)) {
        copy.assign(in, in + count);
        in = copy.data();
      }
      ::gloo::GatherOptions opts(context_);
      opts.setInput(const_cast<T*>(in), count);  // gloo only reads it
      if (rank_ == root) opts.setOutput(out, n * count);
      opts.setRoot(root);
      opts.setTag(next_tag());
      opts.setTimeout(options_.timeout);
      ::gloo::gather(opts);
    });
  }

  template <class T>
  void scatter(const T* in, T* out, std::size_t count, int root) {
    run(Op::scatter, call<T>(Op::scatter, count, root), [&] {
      const auto n = static_cast<std::size_t>(size_);
      if (count == 0) return;
      if (size_ == 1) return copy_elements(in, count, out);
      std::vector<T> copy;
      if (rank_ == root && overlap(in, n * count, static_cast<const T*>(out), count)) {
        copy.assign(in, in + n * count);
        in = copy.data();
      }
      ::gloo::ScatterOptions opts(context_);
      if (rank_ == root) {
        std::vector<T*> slots;
        for (std::size_t s = 0; s < n; ++s) slots.push_back(const_cast<T*>(in) + s * count);
        opts.setInputs(slots, count);  // gloo only reads them
      }
      opts.setOutput(out, count);
      opts.setRoot(root);
      opts.setTag(next_tag());
      opts.setTimeout(options_.timeout);
      ::gloo::scatter(opts);
    });
  }

  template <class T>
  void reduce_scatter(const T* in, T* out, std::size_t count, ReduceOp op) {
    run(Op::reduce_scatter, call<T>(Op::reduce_scatter, count, 0, op), [&] {
      if (count == 0) return;
      if (size_ == 1) {
        copy_elements(in, count, out);
      } else {
        const RingCall ring{reduce_scatter_slot(next_tag()), options_.timeout};
        ring_reduce_scatter(
            *context_, in, out, count, op, ring, ring_scratch_,
            [&](auto&& wait, std::shared_ptr<void> keep) { quiescing(wait, std::move(keep)); });
      }
      divide_if_avg(out, count, op);
    });
  }

  template <class T>
  void all_to_all(const T* in, T* out, std::size_t total) {
    run(Op::all_to_all, call<T>(Op::all_to_all, total), [&] {
      if (total == 0) return;
      if (size_ == 1) return copy_elements(in, total, out);
      std::vector<T> copy;
      if (overlap(in, total, static_cast<const T*>(out), total)) {
        copy.assign(in, in + total);
        in = copy.data();
      }
      ::gloo::AlltoallOptions opts(context_);
      opts.setInput(const_cast<T*>(in), total);  // gloo only reads it
      opts.setOutput(out, total);
      opts.setTag(next_tag());
      opts.setTimeout(options_.timeout);
      ::gloo::alltoall(opts);
    });
  }

  void barrier() {
    run(Op::barrier, make_fingerprint(Op::barrier, ++sequence_, dtype::float32, 0), [&] {
      if (size_ == 1 || checks_collectives_) return;  // the exchange was a barrier
      ::gloo::BarrierOptions opts(context_);
      opts.setTag(next_tag());
      opts.setTimeout(options_.timeout);
      ::gloo::barrier(opts);
    });
  }

  /// The communicator state of this rank's new group; null for no_color.
  std::unique_ptr<Engine> split(int color, int key) {
    Call mine = make_fingerprint(Op::split, ++sequence_, dtype::float32, 0);
    mine.color = color;
    mine.key = key;
    std::vector<Call> calls;
    guarded("split", [&] { calls = exchange(mine); });
    if (auto text = fingerprint_disagreement(calls); !text.empty()) {
      throw Error(rank_, "split", text);
    }
    const std::uint64_t sequence = ++splits_;  // the same on every rank: split is collective
    if (color == no_color) return nullptr;
    const auto group = split_members(calls, rank_);
    const std::string name =
        name_ + "/split" + std::to_string(sequence) + "/color" + std::to_string(color);
    check_usable("split");
    auto connected = connect(store_, name, group.rank, static_cast<int>(group.members.size()),
                             device_, options_.timeout);
    return std::make_unique<Engine>(std::move(connected), device_, store_, name, options_,
                                    checks_collectives_);
  }

  template <class T>
  void send(const T* data, std::size_t count, int peer, int tag) {
    guarded("send", [&] {
      auto message = std::make_unique<OutgoingMessage>();
      message->header = {static_cast<std::uint64_t>(dtype_of<T>), count};
      message->payload.resize(count * sizeof(T));
      if (count) std::memcpy(message->payload.data(), data, count * sizeof(T));
      if (peer == rank_) {  // gloo has no connection to this rank itself
        to_self_[tag].push_back(std::move(message));
        return;
      }
      message->peer = peer;
      message->tag = tag;
      message->deadline = Deadline(options_.timeout);
      message->header_buffer =
          context_->createUnboundBuffer(&message->header, sizeof(MessageHeader));
      message->header_buffer->send(peer, header_slot(tag));
      if (count) {
        message->payload_buffer =
            context_->createUnboundBuffer(message->payload.data(), message->payload.size());
        message->payload_buffer->send(peer, payload_slot(tag));
      }
      outbox_.post(std::move(message));
    });
  }

  template <class T>
  void recv(T* data, std::size_t count, int peer, int tag) {
    MessageHeader header;
    std::vector<std::byte> mismatched;
    guarded("recv", [&] {
      if (peer == rank_) {
        auto found = to_self_.find(tag);
        if (found == to_self_.end() || found->second.empty()) {
          throw recv_from_self_unsent(rank_, tag);
        }
        auto message = std::move(found->second.front());
        found->second.pop_front();
        if (found->second.empty()) to_self_.erase(found);
        header = message->header;
        if (matches<T>(header, count)) {
          if (count) std::memcpy(data, message->payload.data(), count * sizeof(T));
        }
        return;
      }
      // One header buffer for the communicator's life (see exchange() for why).
      if (!recv_header_buffer_) {
        recv_header_buffer_ = context_->createUnboundBuffer(&recv_header_, sizeof(MessageHeader));
      }
      recv_header_buffer_->recv(peer, header_slot(tag));
      quiescing([&] { (void)recv_header_buffer_->waitRecv(options_.timeout); });
      header = recv_header_;
      if (header.count == 0) return;
      // A mismatched payload is still taken off the connection, so the pair stays in step.
      void* target = data;
      std::size_t bytes = count * sizeof(T);
      if (!matches<T>(header, count)) {
        if (header.type > static_cast<std::uint64_t>(dtype::uint8)) {
          throw std::runtime_error("corrupt message header from rank " + std::to_string(peer));
        }
        mismatched.resize(header.count * size_of(static_cast<dtype>(header.type)));
        target = mismatched.data();
        bytes = mismatched.size();
      }
      std::shared_ptr<::gloo::transport::UnboundBuffer> payload_buffer =
          context_->createUnboundBuffer(target, bytes);
      payload_buffer->recv(peer, payload_slot(tag));
      quiescing([&] { (void)payload_buffer->waitRecv(options_.timeout); }, payload_buffer);
    });
    if (!matches<T>(header, count)) {
      throw recv_mismatch(rank_, peer, tag, static_cast<dtype>(header.type), header.count,
                          dtype_of<T>, count);
    }
  }

  /// Raises the Error every call on a failed communicator gets.
  void check_usable(const char* op) {
    std::lock_guard lock(mutex_);
    if (broken_) {
      throw Error(rank_, op,
                  "this communicator is unusable after an earlier failure (" + *broken_ + ")");
    }
  }

 private:
  template <class T>
  static bool matches(const MessageHeader& header, std::size_t count) {
    return header.type == static_cast<std::uint64_t>(dtype_of<T>) && header.count == count;
  }

  /// The next collective's fingerprint (its sequence number counts every collective).
  template <class T>
  Call call(Op op, std::size_t count, int root = 0, ReduceOp reduce_op = ReduceOp::sum) {
    return make_fingerprint<T>(op, ++sequence_, count, root, reduce_op);
  }

  template <class T>
  void divide_if_avg(T* data, std::size_t count, ReduceOp op) const {
    if (op == ReduceOp::avg) divide(data, count, size_);
  }

  /// `in`, or a private copy of it where it overlaps `out` other than as this rank's own slot.
  template <class T>
  const T* stable_input(const T* in, std::size_t count, T* out, std::size_t total) {
    const T* mine = out + static_cast<std::size_t>(rank_) * count;
    if (in == mine || !overlap(in, count, static_cast<const T*>(out), total)) return in;
    scratch_.resize(count * sizeof(T));
    std::memcpy(scratch_.data(), in, count * sizeof(T));
    return reinterpret_cast<const T*>(scratch_.data());
  }

  std::uint32_t next_tag() noexcept { return tag_++; }

  /// Every rank's call, in rank order: each rank sends its call to every other directly (one
  /// round trip, where a ring all_gather would take 2 (n - 1)); also a full barrier. The buffer
  /// lives as long as the communicator: gloo's device thread may still be finishing its
  /// completion handler on a buffer after the wait returned, so freeing one per call races.
  std::vector<Call> exchange(const Call& mine) {
    if (size_ == 1) return {mine};
    if (!exchange_buffer_) {
      exchange_calls_.resize(static_cast<std::size_t>(size_));
      exchange_buffer_ = context_->createUnboundBuffer(exchange_calls_.data(),
                                                       exchange_calls_.size() * sizeof(Call));
    }
    exchange_calls_[static_cast<std::size_t>(rank_)] = mine;
    const std::uint64_t slot = (std::uint64_t{0x72} << 56) | next_tag();
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      exchange_buffer_->send(r, slot, static_cast<std::size_t>(rank_) * sizeof(Call), sizeof(Call));
      exchange_buffer_->recv(r, slot, static_cast<std::size_t>(r) * sizeof(Call), sizeof(Call));
    }
    quiescing([&] {
      for (int r = 1; r < size_; ++r) {
        (void)exchange_buffer_->waitSend(options_.timeout);
        (void)exchange_buffer_->waitRecv(options_.timeout);
      }
    });
    return exchange_calls_;
  }

  /// Keeps `keep` (gloo buffers and the memory they point at) alive until this communicator
  /// ends: after a failure gloo's device thread may still be completing a transfer into them.
  void bury(std::shared_ptr<void> keep) { graveyard_.push_back(std::move(keep)); }

  /// Runs `wait`; should it fail, closes the connections before the exception unwinds the
  /// caller's gloo buffers: after a failure gloo's device thread may still be completing other
  /// transfers into them, and a closed connection (its pair's lock taken) has no handler running.
  /// `keep` (optional) holds buffers that must outlive a failure: they are buried, not freed.
  template <class Wait>
  void quiescing(Wait&& wait, std::shared_ptr<void> keep = nullptr) {
    try {
      wait();
    } catch (...) {
      try {
        context_->closeConnections();
      } catch (...) {
        // Best effort: the caller reports the first failure.
      }
      if (keep) bury(std::move(keep));
      throw;
    }
  }

  /// Checks the ranks agree (when asked to), then runs the collective's body. The check must
  /// come first: gloo aborts the process when the ranks' sizes disagree inside a collective.
  template <class Body>
  void run(Op op, const Call& mine, Body&& body) {
    const char* op_name = name(op);
    std::string disagree;
    guarded(op_name, [&] {
      if (checks_collectives_) disagree = fingerprint_disagreement(exchange(mine));
      if (disagree.empty()) body();
    });
    if (!disagree.empty()) throw Error(rank_, op_name, disagree);
  }

  /// Runs `body`, turning gloo's exceptions into a tandem::Error that names the operation and
  /// this rank, and failing the communicator (see the top of gloo.hpp).
  template <class Body>
  void guarded(const char* op, Body&& body) {
    check_usable(op);
    try {
      body();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw fail(op, gloo_message(e.what()));
    }
  }

  Error fail(const char* op, const std::string& what) {
    std::string cause;
    if (what.find("Timed out") != std::string::npos || what.find("timeout") != std::string::npos) {
      cause = "timed out after " + describe(options_.timeout) +
              " waiting for the other ranks (gloo: " + what + ")";
    } else {
      cause = "gloo: " + what;
    }
    const bool timed_out = what.find("imed out") != std::string::npos;
    // A stopped peer (alive, not running) is the likely cause of a timeout, and of a closed
    // connection from a peer that gave up on it first; a peer gone by then may only have given
    // up itself, so it is called dead only when nothing else explains the failure.
    const std::vector<int> stopped = stopped_peers(peers_, rank_);
    const bool other_cause = timed_out || !stopped.empty();
    // A killed process closes its sockets before it is gone: give it a moment to finish dying.
    std::vector<int> dead = dead_peers(peers_, rank_);
    for (int tries = 0; dead.empty() && tries < 50 && !other_cause; ++tries) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      dead = dead_peers(peers_, rank_);
    }
    if (!stopped.empty()) {
      cause += "; " + rank_list(stopped) + (stopped.size() == 1 ? " is" : " are") +
               " stopped (SIGSTOP: the process is alive but does not run)";
    }
    if (!dead.empty()) {
      cause +=
          "; " + rank_list(dead) + (dead.size() == 1 ? " has" : " have") +
          (other_cause ? " already ended (the process is gone)" : " died (the process is gone)");
    }
    mark_broken(std::string(op) + ": " + cause);
    return Error(rank_, op, cause);
  }

  /// The first failure wins; the connections close, so the other ranks fail promptly too.
  void mark_broken(const std::string& cause) {
    {
      std::lock_guard lock(mutex_);
      if (broken_) return;
      broken_ = cause;
    }
    outbox_.abort();
    try {
      context_->closeConnections();
    } catch (...) {
      // Closing is best effort: the communicator is unusable either way.
    }
  }

  std::vector<std::shared_ptr<void>> graveyard_;  ///< see bury(); freed after the context
  std::vector<Call> exchange_calls_;              ///< see exchange(); freed after the context
  std::unique_ptr<::gloo::transport::UnboundBuffer> exchange_buffer_;
  RingScratch ring_scratch_;     ///< see reduce_scatter(); freed after the context
  MessageHeader recv_header_{};  ///< see recv(); freed after the context
  std::unique_ptr<::gloo::transport::UnboundBuffer> recv_header_buffer_;
  std::shared_ptr<::gloo::transport::Device> device_;
  std::shared_ptr<::gloo::Context> context_;
  std::vector<Peer> peers_;
  AnyStore store_;
  std::string name_;  ///< this context's prefix in the store; splits extend it
  GlooCommOptions options_;
  bool checks_collectives_;
  std::uint64_t sequence_ = 0;  ///< collectives made, split included
  int rank_;
  int size_;
  std::uint32_t tag_ = 0;
  std::uint64_t splits_ = 0;
  std::vector<std::byte> scratch_;
  std::map<int, std::deque<std::unique_ptr<OutgoingMessage>>> to_self_;

  std::mutex mutex_;
  std::optional<std::string> broken_;  ///< guarded by mutex_ (the outbox thread sets it too)

  Outbox outbox_;  // after the context: destroyed (and joined) before it
};

}  // namespace tandem::detail::gloo_comm
