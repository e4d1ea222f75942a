// tandem/comm/gloo.hpp - tandem::GlooComm, the Communicator whose ranks are processes that talk
// over TCP through Facebook's Gloo (the CPU backend of torch.distributed).
//   auto comm = tandem::init_process_group<tandem::GlooComm>();   // under tandemrun / torchrun
//   comm.all_reduce(grads, tandem::ReduceOp::avg);
// Needs: Gloo with its TCP transport (libgloo-dev; link tandem::gloo) and POSIX.
//
// Semantics are LocalComm's (see tandem/comm/local.hpp) where they apply: the same size checks
// and error texts before anything is sent, in-place rules, avg for floating-point types only,
// sync operations ordered after pending `_async` ones, `_async` operations run in issue order on
// a per-communicator worker thread. Reductions run in gloo's ring order (not rank order), and
// every rank gets the same bits.
//
// With options.check_agreement (the default), every collective first exchanges what each rank
// was called with (an extra small all_gather): ranks that disagree on the operation, element
// type, count, root or reduce op all raise a tandem::Error naming the ranks, and the group stays
// usable. Without it a mismatch is undefined (gloo may abort the process).
//
// Failures: every wait is bounded by options.timeout. A timeout, a peer that dies or any other
// transport error raises a tandem::Error naming the operation and this rank (and the rank whose
// process is gone, where it ran on this host); the communicator then closes its connections, so
// the other ranks fail promptly too, and every later call raises a tandem::Error at once.
//
// send is eager: it copies the data and returns; the copy is delivered once the receiver posts
// its recv, which must happen within the timeout. recv matches by (source, tag), first in first
// out, and checks the element type and count against the sender's.
#pragma once

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
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

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/gloo_support.hpp"
#include "tandem/comm/store.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// How a GlooComm connects and behaves.
struct GlooCommOptions {
  /// How long any wait (rendezvous, collective, send, recv) lasts before it raises tandem::Error.
  Timeout timeout = default_timeout;
  /// The network interface to listen on ("eth0", "lo"). Empty: `hostname`, else the
  /// GLOO_SOCKET_IFNAME variable (as in torch), else 127.0.0.1 for a single-node world and the
  /// address this host's name resolves to otherwise.
  std::string interface {};
  /// The host name or address to listen on, used when `interface` is empty.
  std::string hostname{};
  /// Exchange and compare every collective's arguments first (see the top of this header).
  bool check_agreement = true;
};

namespace detail::gloo_comm {

enum class Op : std::int64_t {
  all_reduce,
  reduce,
  broadcast,
  all_gather,
  gather,
  scatter,
  reduce_scatter,
  all_to_all,
  barrier,
  split,
};

constexpr const char* name(Op op) noexcept {
  switch (op) {
    case Op::all_reduce:
      return "all_reduce";
    case Op::reduce:
      return "reduce";
    case Op::broadcast:
      return "broadcast";
    case Op::all_gather:
      return "all_gather";
    case Op::gather:
      return "gather";
    case Op::scatter:
      return "scatter";
    case Op::reduce_scatter:
      return "reduce_scatter";
    case Op::all_to_all:
      return "all_to_all";
    case Op::barrier:
      return "barrier";
    case Op::split:
      return "split";
  }
  return "unknown";
}

constexpr bool is_typed(Op op) noexcept {
  return op != Op::barrier && op != Op::split;
}
constexpr bool has_root(Op op) noexcept {
  return op == Op::reduce || op == Op::broadcast || op == Op::gather || op == Op::scatter;
}
constexpr bool has_reduce_op(Op op) noexcept {
  return op == Op::all_reduce || op == Op::reduce || op == Op::reduce_scatter;
}

/// What one rank was called with, as exchanged before a collective (fixed-size integers).
struct Call {
  std::int64_t op = 0;
  std::int64_t type = 0;
  std::int64_t count = 0;  ///< the per-op count every rank must agree on
  std::int64_t root = 0;
  std::int64_t reduce_op = 0;
  std::int64_t color = 0;  ///< split only
  std::int64_t key = 0;    ///< split only
};
static_assert(sizeof(Call) == 7 * sizeof(std::int64_t));

inline std::string rank_list(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i) text += ", ";
    text += std::to_string(ranks[i]);
  }
  return text;
}

/// "" when all ranks have the same value, otherwise "ranks 0, 2: float32; rank 1: int32".
template <class Value, class Show>
std::string disagreement(const std::vector<Value>& values, Show show) {
  std::vector<std::pair<Value, std::vector<int>>> distinct;
  for (std::size_t r = 0; r < values.size(); ++r) {
    auto found = std::find_if(distinct.begin(), distinct.end(),
                              [&](const auto& entry) { return entry.first == values[r]; });
    if (found == distinct.end()) {
      distinct.push_back({values[r], {static_cast<int>(r)}});
    } else {
      found->second.push_back(static_cast<int>(r));
    }
  }
  if (distinct.size() < 2) return {};
  std::string text;
  for (const auto& [value, ranks] : distinct) {
    if (!text.empty()) text += "; ";
    text += rank_list(ranks) + ": " + show(value);
  }
  return text;
}

/// The first way the ranks' calls disagree, or "" (LocalComm's texts).
inline std::string check_agreement(const std::vector<Call>& calls) {
  auto field = [&](std::int64_t Call::*member) {
    std::vector<std::int64_t> values;
    for (const auto& c : calls) values.push_back(c.*member);
    return values;
  };
  auto show_int = [](std::int64_t v) { return std::to_string(v); };
  auto show_op = [](std::int64_t v) { return std::string(name(static_cast<Op>(v))); };
  if (auto text = disagreement(field(&Call::op), show_op); !text.empty()) {
    return "ranks called different operations: " + text;
  }
  const auto op = static_cast<Op>(calls.front().op);
  if (is_typed(op)) {
    auto show_type = [](std::int64_t v) {
      return std::string(tandem::name(static_cast<dtype>(v)));
    };
    if (auto text = disagreement(field(&Call::type), show_type); !text.empty()) {
      return "ranks disagree on the element type: " + text;
    }
    if (auto text = disagreement(field(&Call::count), show_int); !text.empty()) {
      return "ranks disagree on the element count: " + text;
    }
  }
  if (has_root(op)) {
    if (auto text = disagreement(field(&Call::root), show_int); !text.empty()) {
      return "ranks disagree on the root: " + text;
    }
  }
  if (has_reduce_op(op)) {
    auto show_reduce = [](std::int64_t v) {
      return std::string(tandem::name(static_cast<ReduceOp>(v)));
    };
    if (auto text = disagreement(field(&Call::reduce_op), show_reduce); !text.empty()) {
      return "ranks disagree on the reduce op: " + text;
    }
  }
  return {};
}

/// gloo's "[path/file.cc:123] message" without the source location.
inline std::string gloo_message(const std::string& what) {
  if (!what.empty() && what.front() == '[') {
    if (const auto end = what.find("] "); end != std::string::npos) return what.substr(end + 2);
  }
  return what;
}

/// The transport device: see GlooCommOptions::interface for the order of choices.
inline std::shared_ptr<::gloo::transport::Device> make_device(const World& world,
                                                              const GlooCommOptions& options) {
  ::gloo::transport::tcp::attr attr;
  if (!options.interface.empty()) {
    attr.iface = options.interface;
  } else if (!options.hostname.empty()) {
    attr.hostname = options.hostname;
  } else if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME"); iface && *iface) {
    attr.iface = iface;
  } else if (world.nnodes <= 1) {
    attr.hostname = "127.0.0.1";
  } else {
    attr.hostname = this_host();
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (::getaddrinfo(attr.hostname.c_str(), nullptr, &hints, &found) != 0) {
      throw Error(world.rank, "GlooComm",
                  "this host's name '" + attr.hostname +
                      "' does not resolve to an address; set GlooCommOptions::interface or "
                      "GLOO_SOCKET_IFNAME");
    }
    ::freeaddrinfo(found);
  }
  try {
    return ::gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    const std::string where =
        attr.iface.empty() ? "host '" + attr.hostname + "'" : "interface '" + attr.iface + "'";
    throw Error(world.rank, "GlooComm",
                "cannot listen on " + where + ": " + gloo_message(e.what()));
  }
}

/// What one rendezvous produced: a connected gloo context and where its peers run.
struct Connected {
  std::shared_ptr<::gloo::Context> context;
  std::vector<Peer> peers;
};

/// Every member of one new context calls this with the same `prefix` (unique to that context in
/// `store`); it returns once all `size` ranks are connected to each other.
inline Connected connect(AnyStore& store, const std::string& prefix, int rank, int size,
                         const std::shared_ptr<::gloo::transport::Device>& device,
                         Timeout timeout) {
  AnyStore scoped(PrefixStore<AnyStore>(prefix, store));
  scoped.set("peer/" + std::to_string(rank), describe_self());
  auto context = std::make_shared<::gloo::rendezvous::Context>(rank, size);
  context->setTimeout(timeout);
  StoreAdapter adapter(scoped, timeout);
  auto dev = device;
  try {
    context->connectFullMesh(adapter, dev);
  } catch (const Error& e) {
    throw Error(rank, "GlooComm rendezvous", e.what());
  } catch (const std::exception& e) {
    throw Error(rank, "GlooComm rendezvous",
                "connecting " + std::to_string(size) + " ranks failed: " + gloo_message(e.what()));
  }
  Connected connected{context, {}};
  for (int r = 0; r < size; ++r) {
    connected.peers.push_back(parse_peer(scoped.get("peer/" + std::to_string(r), timeout)));
  }
  return connected;
}

/// Slots of point-to-point messages: a prefix byte gloo's collectives do not use, and the tag.
inline std::uint64_t header_slot(int tag) {
  return (std::uint64_t{0x70} << 56) | static_cast<std::uint32_t>(tag);
}
inline std::uint64_t payload_slot(int tag) {
  return (std::uint64_t{0x71} << 56) | static_cast<std::uint32_t>(tag);
}

/// One rank's communicator state. Heap-allocated and owned by the GlooComm, so the worker's
/// tasks may point at it while the GlooComm moves. Operations run one at a time (on the caller's
/// thread after the worker has drained, or on the worker); only the outbox thread runs beside
/// them, and it touches nothing but its messages and `broken_`.
class Rank {
 public:
  Rank(Connected connected, std::shared_ptr<::gloo::transport::Device> device, AnyStore store,
       std::string name, GlooCommOptions options)
      : device_(std::move(device)),
        context_(std::move(connected.context)),
        peers_(std::move(connected.peers)),
        store_(std::move(store)),
        name_(std::move(name)),
        options_(std::move(options)),
        rank_(context_->rank),
        size_(context_->size),
        outbox_([this](const std::string& cause) { mark_broken(cause); }) {}
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;
  ~Rank() {
    worker_.reset();  // runs what is still queued
    // The outbox (a member) waits for its sends next, each bounded by the timeout.
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] const GlooCommOptions& options() const noexcept { return options_; }
  [[nodiscard]] const AnyStore& store() const noexcept { return store_; }

  /// Runs `body` now, after every `_async` operation issued before.
  template <class Body>
  void now(Body&& body) {
    if (worker_) worker_->drain();
    body();
  }

  /// Queues `body` on the worker; the Work completes when it has run.
  template <class Body>
  Work later(Body body) {
    auto state = std::make_shared<WorkState>();
    if (!worker_) worker_ = std::make_unique<Worker>();
    worker_->post([state, body = std::move(body)]() mutable {
      try {
        body();
        state->complete();
      } catch (...) {
        state->fail(std::current_exception());
      }
    });
    return Work(state);
  }

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
      const auto n = static_cast<std::size_t>(size_);
      if (count == 0) return;
      // gloo has no reduce_scatter for unbound buffers: all_reduce a copy, keep this rank's slot.
      std::vector<T> all(in, in + n * count);
      if (size_ > 1) {
        ::gloo::AllreduceOptions opts(context_);
        opts.setOutput(all.data(), all.size());
        opts.setReduceFunction(reducer<T>(op));
        opts.setTag(next_tag());
        opts.setTimeout(options_.timeout);
        ::gloo::allreduce(opts);
      }
      T* mine = all.data() + static_cast<std::size_t>(rank_) * count;
      divide_if_avg(mine, count, op);
      copy_elements(static_cast<const T*>(mine), count, out);
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
    Call c;
    c.op = static_cast<std::int64_t>(Op::barrier);
    run(Op::barrier, c, [&] {
      if (size_ == 1 || options_.check_agreement) return;  // the exchange was a barrier
      ::gloo::BarrierOptions opts(context_);
      opts.setTag(next_tag());
      opts.setTimeout(options_.timeout);
      ::gloo::barrier(opts);
    });
  }

  /// The communicator state of this rank's new group; null for no_color.
  std::unique_ptr<Rank> split(int color, int key) {
    Call mine;
    mine.op = static_cast<std::int64_t>(Op::split);
    mine.color = color;
    mine.key = key;
    std::vector<Call> calls;
    guarded("split", [&] { calls = exchange(mine); });
    if (auto text = check_agreement(calls); !text.empty()) throw Error(rank_, "split", text);
    const std::uint64_t sequence = ++splits_;  // the same on every rank: split is collective
    if (color == no_color) return nullptr;
    std::vector<int> members;
    for (int r = 0; r < size_; ++r) {
      if (calls[static_cast<std::size_t>(r)].color == color) members.push_back(r);
    }
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
      return std::tie(calls[static_cast<std::size_t>(a)].key, a) <
             std::tie(calls[static_cast<std::size_t>(b)].key, b);
    });
    const int new_rank =
        static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    const std::string name =
        name_ + "/split" + std::to_string(sequence) + "/color" + std::to_string(color);
    check_usable("split");
    auto connected = connect(store_, name, new_rank, static_cast<int>(members.size()), device_,
                             options_.timeout);
    return std::make_unique<Rank>(std::move(connected), device_, store_, name, options_);
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
          throw Error(rank_, "recv",
                      "no message from this rank itself with tag " + std::to_string(tag) +
                          " was sent before (it would wait forever)");
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
      auto header_buffer = context_->createUnboundBuffer(&header, sizeof header);
      header_buffer->recv(peer, header_slot(tag));
      quiescing([&] { (void)header_buffer->waitRecv(options_.timeout); });
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
      auto payload_buffer = context_->createUnboundBuffer(target, bytes);
      payload_buffer->recv(peer, payload_slot(tag));
      quiescing([&] { (void)payload_buffer->waitRecv(options_.timeout); });
    });
    if (!matches<T>(header, count)) {
      throw Error(rank_, "recv",
                  "rank " + std::to_string(peer) + " sent " + std::to_string(header.count) + " " +
                      tandem::name(static_cast<dtype>(header.type)) + " elements with tag " +
                      std::to_string(tag) + ", but this rank receives " + std::to_string(count) +
                      " " + tandem::name(dtype_of<T>) + " elements");
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

  template <class T>
  static Call call(Op op, std::size_t count, int root = 0, ReduceOp reduce_op = ReduceOp::sum) {
    Call c;
    c.op = static_cast<std::int64_t>(op);
    c.type = static_cast<std::int64_t>(dtype_of<T>);
    c.count = static_cast<std::int64_t>(count);
    c.root = root;
    c.reduce_op = static_cast<std::int64_t>(reduce_op);
    return c;
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
  /// round trip, where a ring all_gather would take 2 (n - 1)). Also a full barrier.
  std::vector<Call> exchange(const Call& mine) {
    std::vector<Call> calls(static_cast<std::size_t>(size_));
    calls[static_cast<std::size_t>(rank_)] = mine;
    if (size_ == 1) return calls;
    auto buffer = context_->createUnboundBuffer(calls.data(), calls.size() * sizeof(Call));
    const std::uint64_t slot = (std::uint64_t{0x72} << 56) | next_tag();
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      buffer->send(r, slot, static_cast<std::size_t>(rank_) * sizeof(Call), sizeof(Call));
      buffer->recv(r, slot, static_cast<std::size_t>(r) * sizeof(Call), sizeof(Call));
    }
    quiescing([&] {
      for (int r = 1; r < size_; ++r) {
        (void)buffer->waitSend(options_.timeout);
        (void)buffer->waitRecv(options_.timeout);
      }
    });
    return calls;
  }

  /// Runs `wait`; should it fail, closes the connections before the exception unwinds the
  /// caller's gloo buffers: after a failure gloo's device thread may still be completing other
  /// transfers into them, and a closed connection (its pair's lock taken) has no handler running.
  template <class Wait>
  void quiescing(Wait&& wait) {
    try {
      wait();
    } catch (...) {
      try {
        context_->closeConnections();
      } catch (...) {
        // Best effort: the caller reports the first failure.
      }
      throw;
    }
  }

  /// Checks the ranks agree (when asked to), then runs the collective's body.
  template <class Body>
  void run(Op op, const Call& mine, Body&& body) {
    const char* op_name = name(op);
    std::string disagree;
    guarded(op_name, [&] {
      if (options_.check_agreement) disagree = check_agreement(exchange(mine));
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
    // A killed process closes its sockets before it is gone: give it a moment to finish dying.
    std::vector<int> dead = dead_peers(peers_, rank_);
    for (int tries = 0; dead.empty() && tries < 50 && what.find("imed out") == std::string::npos;
         ++tries) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      dead = dead_peers(peers_, rank_);
    }
    if (!dead.empty()) {
      cause += "; " + rank_list(dead) + (dead.size() == 1 ? " has" : " have") +
               " died (the process is gone)";
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

  std::shared_ptr<::gloo::transport::Device> device_;
  std::shared_ptr<::gloo::Context> context_;
  std::vector<Peer> peers_;
  AnyStore store_;
  std::string name_;  ///< this context's prefix in the store; splits extend it
  GlooCommOptions options_;
  int rank_;
  int size_;
  std::uint32_t tag_ = 0;
  std::uint64_t splits_ = 0;
  std::vector<std::byte> scratch_;
  std::map<int, std::deque<std::unique_ptr<OutgoingMessage>>> to_self_;

  std::mutex mutex_;
  std::optional<std::string> broken_;  ///< guarded by mutex_ (the outbox thread sets it too)

  Outbox outbox_;                   // after the context: destroyed (and joined) before it
  std::unique_ptr<Worker> worker_;  // started by the first `_async` operation
};

template <class In, class Out>
constexpr void check_pair() {
  using I = std::remove_cv_t<tensor_element_t<In>>;
  using O = tensor_element_t<Out>;
  static_assert(host_accessible<tensor_space_t<In>> && host_accessible<tensor_space_t<Out>>,
                "tandem::GlooComm: tensors must live in host memory");
  static_assert(!std::is_const_v<O>,
                "tandem::GlooComm: the output tensor must be mutable (it is const)");
  static_assert(std::same_as<I, std::remove_cv_t<O>>,
                "tandem::GlooComm: the input and output tensors of one call must have the same "
                "element type");
}

template <class T>
constexpr void check_one() {
  check_pair<T, T>();
}

template <class T>
using elem_t = std::remove_cv_t<tensor_element_t<T>>;

/// t.data() as the pointer an operation needs; null where a static_assert above has already
/// rejected the tensor (so the compiler reports that, not a conversion error).
template <class E, class T>
const E* in_ptr(T& t) noexcept {
  if constexpr (std::same_as<elem_t<T>, E>) {
    return t.data();
  } else {
    return nullptr;
  }
}
template <class E, class T>
E* out_ptr(T& t) noexcept {
  if constexpr (std::same_as<tensor_element_t<T>, E>) {
    return t.data();
  } else {
    return nullptr;
  }
}

}  // namespace detail::gloo_comm

/// A communicator whose ranks are processes connected by Gloo over TCP. Models
/// tandem::Communicator and tandem::ProcessGroupBackend; see the top of this header.
class GlooComm {
 public:
  using communicator_concept = communicator_tag;
  using memory_space = host;
  using options_type = GlooCommOptions;

  GlooComm(GlooComm&&) noexcept = default;
  GlooComm& operator=(GlooComm&&) noexcept = default;
  ~GlooComm() = default;

  /// Connects this rank with the others of `world`, meeting them in `store` (every rank passes
  /// the same store; init_process_group gives one of its own). Collective. A copy of the store
  /// is kept for split. Each call on one store makes a new group (its keys never collide).
  [[nodiscard]] static GlooComm rendezvous(const World& world, AnyStore& store,
                                           const GlooCommOptions& options = {}) {
    world.validate();
    // Ranks call rendezvous on a store the same number of times, so this count names the group.
    const std::int64_t generation =
        store.add("gloo/rendezvous/rank" + std::to_string(world.rank), 1);
    const std::string name = "gloo/" + std::to_string(generation);
    auto device = detail::gloo_comm::make_device(world, options);
    auto connected = detail::gloo_comm::connect(store, name, world.rank, world.world_size, device,
                                                options.timeout);
    return GlooComm(std::make_unique<detail::gloo_comm::Rank>(std::move(connected), device, store,
                                                              name, options));
  }

  [[nodiscard]] int rank() const { return self().rank(); }
  [[nodiscard]] int size() const { return self().size(); }
  [[nodiscard]] const GlooCommOptions& options() const { return self().options(); }
  /// The store this group met in (shared: copies see the same keys).
  [[nodiscard]] AnyStore store() const { return self().store(); }

  // --- all_reduce -----------------------------------------------------------------------------

  /// In place: every rank's `t` becomes the reduction of all ranks' `t`.
  template <Tensor T>
  void all_reduce(T&& t, ReduceOp op = ReduceOp::sum) {
    all_reduce(t, t, op);
  }
  template <Tensor In, Tensor Out>
  void all_reduce(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    using E = detail::gloo_comm::elem_t<Out>;
    const auto [i, o, count] = prepare_all_reduce(in, out, op);
    self().now([&, i = i, o = o, count = count] { self().all_reduce<E>(i, o, count, op); });
  }
  template <Tensor T>
  Work all_reduce_async(T&& t, ReduceOp op = ReduceOp::sum) {
    return all_reduce_async(t, t, op);
  }
  template <Tensor In, Tensor Out>
  Work all_reduce_async(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    using E = detail::gloo_comm::elem_t<Out>;
    const auto [i, o, count] = prepare_all_reduce(in, out, op);
    auto* me = &self();
    return me->later([me, i = i, o = o, count = count, op] { me->all_reduce<E>(i, o, count, op); });
  }

  // --- reduce (result on root only) -------------------------------------------------------------

  template <Tensor T>
  void reduce(T&& t, int root, ReduceOp op = ReduceOp::sum) {
    using E = detail::gloo_comm::elem_t<T>;
    E* data = prepare_rooted(t, root, op, "reduce");
    self().now([&] { self().reduce<E>(data, t.size(), root, op); });
  }
  template <Tensor T>
  Work reduce_async(T&& t, int root, ReduceOp op = ReduceOp::sum) {
    using E = detail::gloo_comm::elem_t<T>;
    E* data = prepare_rooted(t, root, op, "reduce");
    auto* me = &self();
    const std::size_t count = t.size();
    return me->later([=] { me->reduce<E>(data, count, root, op); });
  }

  // --- broadcast --------------------------------------------------------------------------------

  template <Tensor T>
  void broadcast(T&& t, int root) {
    using E = detail::gloo_comm::elem_t<T>;
    E* data = prepare_rooted(t, root, ReduceOp::sum, "broadcast");
    self().now([&] { self().broadcast<E>(data, t.size(), root); });
  }
  template <Tensor T>
  Work broadcast_async(T&& t, int root) {
    using E = detail::gloo_comm::elem_t<T>;
    E* data = prepare_rooted(t, root, ReduceOp::sum, "broadcast");
    auto* me = &self();
    const std::size_t count = t.size();
    return me->later([=] { me->broadcast<E>(data, count, root); });
  }

  // --- all_gather: out holds size() * in.size() elements, rank r's at r * in.size() -----------

  template <Tensor In, Tensor Out>
  void all_gather(In&& in, Out&& out) {
    using E = detail::gloo_comm::elem_t<Out>;
    const auto [i, o, count] = prepare_gather_like(in, out, "all_gather", true);
    self().now([&, i = i, o = o, count = count] { self().all_gather<E>(i, o, count); });
  }
  template <Tensor In, Tensor Out>
  Work all_gather_async(In&& in, Out&& out) {
    using E = detail::gloo_comm::elem_t<Out>;
    const auto [i, o, count] = prepare_gather_like(in, out, "all_gather", true);
    auto* me = &self();
    return me->later([me, i = i, o = o, count = count] { me->all_gather<E>(i, o, count); });
  }

  // --- gather: out (size() * in.size() elements) is used on the root only -------------------

  template <Tensor In, Tensor Out>
  void gather(In&& in, Out&& out, int root) {
    using E = detail::gloo_comm::elem_t<Out>;
    check_root(root, "gather");
    const auto [i, o, count] = prepare_gather_like(in, out, "gather", rank() == root);
    self().now([&, i = i, o = o, count = count] { self().gather<E>(i, o, count, root); });
  }
  template <Tensor In, Tensor Out>
  Work gather_async(In&& in, Out&& out, int root) {
    using E = detail::gloo_comm::elem_t<Out>;
    check_root(root, "gather");
    const auto [i, o, count] = prepare_gather_like(in, out, "gather", rank() == root);
    auto* me = &self();
    return me->later([me, i = i, o = o, count = count, root] { me->gather<E>(i, o, count, root); });
  }

  // --- scatter: in (size() * out.size() elements) is used on the root only ------------------

  template <Tensor In, Tensor Out>
  void scatter(In&& in, Out&& out, int root) {
    using E = detail::gloo_comm::elem_t<Out>;
    check_root(root, "scatter");
    const auto [i, o, count] = prepare_scatter_like(in, out, "scatter", rank() == root);
    self().now([&, i = i, o = o, count = count] { self().scatter<E>(i, o, count, root); });
  }
  template <Tensor In, Tensor Out>
  Work scatter_async(In&& in, Out&& out, int root) {
    using E = detail::gloo_comm::elem_t<Out>;
    check_root(root, "scatter");
    const auto [i, o, count] = prepare_scatter_like(in, out, "scatter", rank() == root);
    auto* me = &self();
    return me->later(
        [me, i = i, o = o, count = count, root] { me->scatter<E>(i, o, count, root); });
  }

  // --- reduce_scatter: in holds size() * out.size() elements --------------------------------

  template <Tensor In, Tensor Out>
  void reduce_scatter(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    using E = detail::gloo_comm::elem_t<Out>;
    check_reduce_op<E>(op, "reduce_scatter");
    const auto [i, o, count] = prepare_scatter_like(in, out, "reduce_scatter", true);
    self().now([&, i = i, o = o, count = count] { self().reduce_scatter<E>(i, o, count, op); });
  }
  template <Tensor In, Tensor Out>
  Work reduce_scatter_async(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    using E = detail::gloo_comm::elem_t<Out>;
    check_reduce_op<E>(op, "reduce_scatter");
    const auto [i, o, count] = prepare_scatter_like(in, out, "reduce_scatter", true);
    auto* me = &self();
    return me->later(
        [me, i = i, o = o, count = count, op] { me->reduce_scatter<E>(i, o, count, op); });
  }

  // --- all_to_all: in and out hold size() * k elements; slot s of in goes to rank s ---------

  template <Tensor In, Tensor Out>
  void all_to_all(In&& in, Out&& out) {
    using E = detail::gloo_comm::elem_t<Out>;
    const auto [i, o, count] = prepare_all_to_all(in, out);
    self().now([&, i = i, o = o, count = count] { self().all_to_all<E>(i, o, count); });
  }
  template <Tensor In, Tensor Out>
  Work all_to_all_async(In&& in, Out&& out) {
    using E = detail::gloo_comm::elem_t<Out>;
    const auto [i, o, count] = prepare_all_to_all(in, out);
    auto* me = &self();
    return me->later([me, i = i, o = o, count = count] { me->all_to_all<E>(i, o, count); });
  }

  // --- point to point ---------------------------------------------------------------------------

  /// Copies `t` and returns (eager); the copy reaches `peer` once it posts the matching recv.
  template <Tensor T>
  void send(T&& t, int peer, int tag = 0) {
    using E = detail::gloo_comm::elem_t<T>;
    check_peer<T>(peer, "send");
    const E* data = detail::gloo_comm::in_ptr<E>(t);
    self().now([&] { self().send<E>(data, t.size(), peer, tag); });
  }
  template <Tensor T>
  Work send_async(T&& t, int peer, int tag = 0) {
    using E = detail::gloo_comm::elem_t<T>;
    check_peer<T>(peer, "send");
    const E* data = detail::gloo_comm::in_ptr<E>(t);
    auto* me = &self();
    const std::size_t count = t.size();
    return me->later([=] { me->send<E>(data, count, peer, tag); });
  }
  /// Waits for the oldest message from `peer` with `tag`; its type and count must match `t`.
  template <Tensor T>
  void recv(T&& t, int peer, int tag = 0) {
    using E = detail::gloo_comm::elem_t<T>;
    detail::gloo_comm::check_one<T>();
    check_peer<T>(peer, "recv");
    E* data = detail::gloo_comm::out_ptr<E>(t);
    self().now([&] { self().recv<E>(data, t.size(), peer, tag); });
  }
  template <Tensor T>
  Work recv_async(T&& t, int peer, int tag = 0) {
    using E = detail::gloo_comm::elem_t<T>;
    detail::gloo_comm::check_one<T>();
    check_peer<T>(peer, "recv");
    E* data = detail::gloo_comm::out_ptr<E>(t);
    auto* me = &self();
    const std::size_t count = t.size();
    return me->later([=] { me->recv<E>(data, count, peer, tag); });
  }

  // --- barrier and split --------------------------------------------------------------------

  void barrier() {
    self().now([&] { self().barrier(); });
  }
  Work barrier_async() {
    auto* me = &self();
    return me->later([me] { me->barrier(); });
  }

  /// Collective: ranks with the same `color` form a new group, ordered by (key, rank here);
  /// no_color gives nullopt (but still takes part). The new group has this group's options and
  /// its own gloo connections.
  [[nodiscard]] std::optional<GlooComm> split(int color, int key = 0) {
    if (color < 0 && color != no_color) {
      throw Error(rank(), "split",
                  "color " + std::to_string(color) + " is negative (use tandem::no_color)");
    }
    std::unique_ptr<detail::gloo_comm::Rank> made;
    self().now([&] { made = self().split(color, key); });
    if (!made) return std::nullopt;
    return GlooComm(std::move(made));
  }

 private:
  explicit GlooComm(std::unique_ptr<detail::gloo_comm::Rank> self) : self_(std::move(self)) {}

  detail::gloo_comm::Rank& self() const {
    if (!self_) throw Error("GlooComm", "this communicator was moved from");
    return *self_;
  }

  [[nodiscard]] Error error(const char* op, const std::string& cause) const {
    return Error(rank(), op, cause);
  }

  void check_root(int root, const char* op) const {
    if (root < 0 || root >= size()) {
      throw error(op, "root " + std::to_string(root) + " is not a rank of this group of " +
                          std::to_string(size()) + " ranks");
    }
  }

  template <class E>
  void check_reduce_op(ReduceOp op, const char* name) const {
    if (op == ReduceOp::avg && !dtype_traits<E>::is_floating) {
      throw error(name, std::string("avg needs a floating-point element type, not ") +
                            dtype_traits<E>::name);
    }
  }

  template <class In, class Out>
  struct Prepared {
    const detail::gloo_comm::elem_t<Out>* in;
    detail::gloo_comm::elem_t<Out>* out;
    std::size_t count;
  };

  template <class In, class Out>
  Prepared<In, Out> prepare_all_reduce(In& in, Out& out, ReduceOp op) const {
    detail::gloo_comm::check_pair<In, Out>();
    check_reduce_op<detail::gloo_comm::elem_t<Out>>(op, "all_reduce");
    if (static_cast<std::size_t>(in.size()) != static_cast<std::size_t>(out.size())) {
      throw error("all_reduce", "in has " + std::to_string(in.size()) + " elements and out " +
                                    std::to_string(out.size()) + "; they must be equal");
    }
    return {detail::gloo_comm::in_ptr<detail::gloo_comm::elem_t<Out>>(in),
            detail::gloo_comm::out_ptr<detail::gloo_comm::elem_t<Out>>(out),
            static_cast<std::size_t>(out.size())};
  }

  template <class T>
  detail::gloo_comm::elem_t<T>* prepare_rooted(T& t, int root, ReduceOp op,
                                               const char* name) const {
    detail::gloo_comm::check_one<T>();
    check_root(root, name);
    check_reduce_op<detail::gloo_comm::elem_t<T>>(op, name);
    return detail::gloo_comm::out_ptr<detail::gloo_comm::elem_t<T>>(t);
  }

  /// all_gather and gather: out holds size() * in.size() elements (checked where `uses_out`).
  template <class In, class Out>
  Prepared<In, Out> prepare_gather_like(In& in, Out& out, const char* name, bool uses_out) const {
    detail::gloo_comm::check_pair<In, Out>();
    const auto count = static_cast<std::size_t>(in.size());
    const auto expected = count * static_cast<std::size_t>(size());
    if (uses_out && static_cast<std::size_t>(out.size()) != expected) {
      throw error(name, "out has " + std::to_string(out.size()) + " elements, but size() * " +
                            "in.size() = " + std::to_string(size()) + " * " +
                            std::to_string(count) + " = " + std::to_string(expected));
    }
    return {detail::gloo_comm::in_ptr<detail::gloo_comm::elem_t<Out>>(in),
            detail::gloo_comm::out_ptr<detail::gloo_comm::elem_t<Out>>(out), count};
  }

  /// scatter and reduce_scatter: in holds size() * out.size() elements (checked where `uses_in`).
  template <class In, class Out>
  Prepared<In, Out> prepare_scatter_like(In& in, Out& out, const char* name, bool uses_in) const {
    detail::gloo_comm::check_pair<In, Out>();
    const auto count = static_cast<std::size_t>(out.size());
    const auto expected = count * static_cast<std::size_t>(size());
    if (uses_in && static_cast<std::size_t>(in.size()) != expected) {
      throw error(name, "in has " + std::to_string(in.size()) + " elements, but size() * " +
                            "out.size() = " + std::to_string(size()) + " * " +
                            std::to_string(count) + " = " + std::to_string(expected));
    }
    return {detail::gloo_comm::in_ptr<detail::gloo_comm::elem_t<Out>>(in),
            detail::gloo_comm::out_ptr<detail::gloo_comm::elem_t<Out>>(out), count};
  }

  template <class In, class Out>
  Prepared<In, Out> prepare_all_to_all(In& in, Out& out) const {
    detail::gloo_comm::check_pair<In, Out>();
    const auto total = static_cast<std::size_t>(in.size());
    if (static_cast<std::size_t>(out.size()) != total ||
        total % static_cast<std::size_t>(size()) != 0) {
      throw error("all_to_all",
                  "in has " + std::to_string(in.size()) + " elements and out " +
                      std::to_string(out.size()) +
                      "; both must be the same multiple of size() = " + std::to_string(size()));
    }
    return {detail::gloo_comm::in_ptr<detail::gloo_comm::elem_t<Out>>(in),
            detail::gloo_comm::out_ptr<detail::gloo_comm::elem_t<Out>>(out), total};
  }

  template <class T>
  void check_peer(int peer, const char* name) const {
    static_assert(host_accessible<tensor_space_t<T>>,
                  "tandem::GlooComm: tensors must live in host memory");
    if (peer < 0 || peer >= size()) {
      throw error(name, "peer " + std::to_string(peer) + " is not a rank of this group of " +
                            std::to_string(size()) + " ranks");
    }
  }

  std::unique_ptr<detail::gloo_comm::Rank> self_;
};

static_assert(Communicator<GlooComm>);

/// With GlooCommOptions::check_agreement (the default) the ranks compare their calls first.
template <>
inline constexpr bool detects_mismatched_collectives<GlooComm> = true;

}  // namespace tandem
