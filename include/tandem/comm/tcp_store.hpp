// tandem/comm/tcp_store.hpp - tandem::TcpStore, a Store served over TCP by one rank (the
// server, usually rank 0 on MASTER_ADDR:MASTER_PORT) to every rank of a job.
//   tandem::TcpStore server({.host = "0.0.0.0", .port = 29500, .is_server = true});
//   tandem::TcpStore client({.host = "node0", .port = 29500});   // on every other rank
//   client.set("rank3/addr", "10.0.0.4:40001");
// Needs: POSIX sockets (Linux).
#pragma once

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tandem/comm/detail/socket.hpp"
#include "tandem/comm/store.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/units.hpp"

namespace tandem {

/// What a TcpStore takes: where the server listens, whether this one is it, and how long to wait.
struct TcpStoreOptions {
  std::string host = "127.0.0.1";  ///< the server's address (the server listens on it)
  std::uint16_t port = 29500;      ///< 0 with is_server: an ephemeral port (see TcpStore::port())
  /// True: this TcpStore runs the server (rank 0), and is a client of it too.
  bool is_server = false;
  Timeout timeout = default_timeout;  ///< the default timeout of get(), wait() and connecting
  std::size_t max_message_bytes = std::size_t{64} << 20;  ///< longest frame either side accepts
};

namespace detail::tcp_store {

/// The wire protocol. Every message is a frame: a u32 little-endian length, then that many bytes
/// of body. A request body is an opcode byte and its fields; a reply body is a status byte and
/// its fields. Strings are a u32 length and the bytes, integers 8 bytes little-endian, timeouts
/// u64 milliseconds (relative, so that the ends need no common clock).
enum class Op : std::uint8_t {
  set = 1,          // key, value                  -> ok
  get = 2,          // key, timeout                -> ok value | timed_out
  add = 3,          // key, i64 delta              -> ok i64 | error message
  compare_set = 4,  // key, expected, desired      -> ok value
  wait = 5,         // u32 n, n keys, timeout      -> ok | timed_out u32 n, n missing keys
  check = 6,        // u32 n, n keys               -> ok u8
  delete_key = 7,   // key                         -> ok u8
  num_keys = 8,     //                             -> ok i64
};

enum class Status : std::uint8_t { ok = 0, timed_out = 1, error = 2 };

inline void put_string(std::string& out, std::string_view bytes) {
  append_u32(out, static_cast<std::uint32_t>(bytes.size()));
  out.append(bytes);
}

/// Reads the fields of one body; every read is bounds-checked (`good` turns false for good).
class Reader {
 public:
  explicit Reader(std::string_view body) : body_(body) {}
  [[nodiscard]] bool good() const noexcept { return good_; }
  [[nodiscard]] bool at_end() const noexcept { return good_ && pos_ == body_.size(); }

  std::uint8_t u8() {
    if (!need(1)) return 0;
    return static_cast<std::uint8_t>(body_[pos_++]);
  }
  std::uint32_t u32() {
    if (!need(4)) return 0;
    const auto v = load_u32(body_.data() + pos_);
    pos_ += 4;
    return v;
  }
  std::uint64_t u64() {
    if (!need(8)) return 0;
    const auto v = load_u64(body_.data() + pos_);
    pos_ += 8;
    return v;
  }
  std::string string() {
    const auto length = u32();
    if (!need(length)) return {};
    std::string out(body_.substr(pos_, length));
    pos_ += length;
    return out;
  }

 private:
  bool need(std::size_t n) {
    if (good_ && body_.size() - pos_ >= n) return true;
    good_ = false;
    return false;
  }
  std::string_view body_;
  std::size_t pos_ = 0;
  bool good_ = true;
};

inline std::uint64_t encode_timeout(Timeout timeout) {
  return timeout.count() < 0 ? 0 : static_cast<std::uint64_t>(timeout.count());
}
inline Timeout decode_timeout(std::uint64_t ms) {
  return Timeout(static_cast<Timeout::rep>(
      std::min<std::uint64_t>(ms, static_cast<std::uint64_t>(Timeout::max().count()))));
}

/// The server: one thread running a poll() loop over the listening socket, an eventfd that
/// stops it, and every connection. Blocked get/wait requests park their connection on waiter
/// lists of the keys they need, and are answered when the keys appear or at their deadline.
class Server {
 public:
  Server(const std::string& host, std::uint16_t port, std::size_t max_message_bytes)
      : max_message_bytes_(max_message_bytes) {
    auto [listener, actual] = listen_tcp(host, port, "TcpStore");
    listener_ = std::move(listener);
    port_ = actual;
    wake_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!wake_) throw Error("TcpStore", "eventfd: " + errno_text(errno));
    thread_ = std::thread([this] { run(); });
  }
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  ~Server() {
    const std::uint64_t one = 1;
    while (::write(wake_.get(), &one, sizeof one) < 0 && errno == EINTR) {
    }
    thread_.join();
  }

  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }

 private:
  struct Pending {
    Op op = Op::get;
    std::vector<std::string> keys;
    Deadline deadline{Timeout::zero()};
  };

  struct Connection {
    Fd fd;
    std::string in;   // bytes received, not yet a whole frame (or waiting behind a pending one)
    std::string out;  // reply bytes not yet sent
    std::optional<Pending> pending;
    bool closing = false;
  };

  using Id = std::uint64_t;

  void run() {
    std::vector<pollfd> fds;
    std::vector<Id> ids;
    for (;;) {
      fds.clear();
      ids.clear();
      fds.push_back({wake_.get(), POLLIN, 0});
      fds.push_back({listener_.get(), POLLIN, 0});
      for (auto& [id, conn] : connections_) {
        short events = conn->pending ? POLLRDHUP : static_cast<short>(POLLIN | POLLRDHUP);
        if (!conn->out.empty()) events |= POLLOUT;
        fds.push_back({conn->fd.get(), events, 0});
        ids.push_back(id);
      }
      const int n = ::poll(fds.data(), fds.size(), next_timeout());
      if (n < 0 && errno != EINTR) return;  // cannot happen with valid arguments
      if (n > 0 && (fds[0].revents & POLLIN)) return;
      if (n > 0 && (fds[1].revents & POLLIN)) accept_all();
      for (std::size_t i = 0; n > 0 && i < ids.size(); ++i) {
        const short revents = fds[i + 2].revents;
        if (revents == 0) continue;
        const auto it = connections_.find(ids[i]);
        if (it == connections_.end()) continue;
        Connection& conn = *it->second;
        if (revents & (POLLERR | POLLNVAL)) {
          conn.closing = true;
        } else if (conn.pending) {
          // Not reading while a request waits: a hang-up means the client left mid-request.
          if (revents & (POLLRDHUP | POLLHUP)) conn.closing = true;
        } else if (revents & (POLLIN | POLLRDHUP | POLLHUP)) {
          receive(ids[i], conn);  // reads up to the end of the stream, then marks it closing
        }
        if (!conn.closing && (revents & POLLOUT)) flush(conn);
      }
      expire_waiters();
      close_marked();
    }
  }

  int next_timeout() const {
    std::optional<Deadline::clock::time_point> first;
    for (const auto& [id, conn] : connections_) {
      if (conn->pending && (!first || conn->pending->deadline.at() < *first)) {
        first = conn->pending->deadline.at();
      }
    }
    if (!first) return -1;
    if (*first == Deadline::clock::time_point::max()) return -1;
    const auto left = *first - Deadline::clock::now();
    if (left <= Deadline::clock::duration::zero()) return 0;
    return static_cast<int>(std::min<std::int64_t>(
        std::chrono::ceil<std::chrono::milliseconds>(left).count(), 24 * 3600 * 1000));
  }

  void accept_all() {
    for (;;) {
      Fd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!fd) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;  // EAGAIN, or out of descriptors: try again on the next wake-up
      }
      set_nodelay(fd.get());
      auto conn = std::make_unique<Connection>();
      conn->fd = std::move(fd);
      connections_.emplace(next_id_++, std::move(conn));
    }
  }

  void receive(Id id, Connection& conn) {
    char buffer[64 * 1024];
    // At most 1 MiB per wake-up, so that one fast sender cannot hold the loop.
    for (int round = 0; round < 16; ++round) {
      const ssize_t n = ::recv(conn.fd.get(), buffer, sizeof buffer, MSG_DONTWAIT);
      if (n > 0) {
        conn.in.append(buffer, static_cast<std::size_t>(n));
        if (conn.in.size() >= 4 && load_u32(conn.in.data()) > max_message_bytes_) {
          conn.closing = true;  // oversize frame: drop the connection before buffering it
          return;
        }
        if (static_cast<std::size_t>(n) < sizeof buffer) break;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      conn.closing = true;  // EOF (even mid-frame) or an error
      return;
    }
    process(id, conn);
  }

  /// Handles the whole frames buffered, stopping at a request that has to wait.
  void process(Id id, Connection& conn) {
    std::size_t used = 0;
    while (!conn.closing && !conn.pending && conn.in.size() - used >= 4) {
      const std::uint32_t length = load_u32(conn.in.data() + used);
      if (length == 0 || length > max_message_bytes_) {
        conn.closing = true;
        break;
      }
      if (conn.in.size() - used - 4 < length) break;
      const std::string_view body(conn.in.data() + used + 4, length);
      used += 4 + static_cast<std::size_t>(length);
      if (!handle(id, conn, body)) conn.closing = true;
    }
    conn.in.erase(0, used);
    if (!conn.closing) flush(conn);
  }

  static void reply(Connection& conn, Status status, std::string_view fields = {}) {
    append_u32(conn.out, static_cast<std::uint32_t>(1 + fields.size()));
    conn.out.push_back(static_cast<char>(status));
    conn.out.append(fields);
  }

  void flush(Connection& conn) {
    while (!conn.out.empty()) {
      const ssize_t n =
          ::send(conn.fd.get(), conn.out.data(), conn.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        conn.out.erase(0, static_cast<std::size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      conn.closing = true;  // EPIPE, ECONNRESET: the client is gone
      return;
    }
  }

  /// One request; false when it is malformed (the connection is then closed).
  bool handle(Id id, Connection& conn, std::string_view body) {
    Reader in(body);
    const auto op = static_cast<Op>(in.u8());
    std::string fields;
    switch (op) {
      case Op::set: {
        auto key = in.string();
        auto value = in.string();
        if (!in.at_end()) return false;
        map_.insert_or_assign(key, std::move(value));
        reply(conn, Status::ok);
        key_added(key);
        return true;
      }
      case Op::get: {
        auto key = in.string();
        const auto timeout = decode_timeout(in.u64());
        if (!in.at_end()) return false;
        park(id, conn, Op::get, {std::move(key)}, timeout);
        return true;
      }
      case Op::add: {
        auto key = in.string();
        const auto delta = static_cast<std::int64_t>(in.u64());
        if (!in.at_end()) return false;
        const auto it = map_.find(key);
        try {
          const auto value =
              added_value("TcpStore", key, it == map_.end() ? nullptr : &it->second, delta);
          map_.insert_or_assign(key, std::to_string(value));
          append_u64(fields, static_cast<std::uint64_t>(value));
          reply(conn, Status::ok, fields);
        } catch (const Error& error) {
          put_string(fields, error.cause());
          reply(conn, Status::error, fields);
          return true;
        }
        key_added(key);
        return true;
      }
      case Op::compare_set: {
        auto key = in.string();
        const auto expected = in.string();
        const auto desired = in.string();
        if (!in.at_end()) return false;
        const auto it = map_.find(key);
        auto outcome =
            compare_set_outcome(it == map_.end() ? nullptr : &it->second, expected, desired);
        if (outcome.store) map_.insert_or_assign(key, std::move(*outcome.store));
        put_string(fields, outcome.result);
        reply(conn, Status::ok, fields);
        if (outcome.store) key_added(key);
        return true;
      }
      case Op::wait: {
        auto keys = read_keys(in);
        const auto timeout = decode_timeout(in.u64());
        if (!in.at_end()) return false;
        park(id, conn, Op::wait, std::move(keys), timeout);
        return true;
      }
      case Op::check: {
        const auto keys = read_keys(in);
        if (!in.at_end()) return false;
        const bool all = std::all_of(keys.begin(), keys.end(),
                                     [&](const std::string& key) { return map_.contains(key); });
        fields.push_back(static_cast<char>(all ? 1 : 0));
        reply(conn, Status::ok, fields);
        return true;
      }
      case Op::delete_key: {
        const auto key = in.string();
        if (!in.at_end()) return false;
        fields.push_back(static_cast<char>(map_.erase(key) > 0 ? 1 : 0));
        reply(conn, Status::ok, fields);
        return true;
      }
      case Op::num_keys: {
        if (!in.at_end()) return false;
        append_u64(fields, static_cast<std::uint64_t>(map_.size()));
        reply(conn, Status::ok, fields);
        return true;
      }
    }
    return false;  // unknown opcode
  }

  static std::vector<std::string> read_keys(Reader& in) {
    const auto count = in.u32();
    std::vector<std::string> keys;
    // Each key takes at least 4 bytes, so a count the body cannot hold fails on the way.
    for (std::uint32_t i = 0; i < count && in.good(); ++i) keys.push_back(in.string());
    return keys;
  }

  std::vector<std::string> missing(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    for (const auto& key : keys) {
      if (!map_.contains(key)) out.push_back(key);
    }
    return out;
  }

  /// Answers a get/wait now if its keys are there, else parks the connection until they are.
  void park(Id id, Connection& conn, Op op, std::vector<std::string> keys, Timeout timeout) {
    Pending pending{op, std::move(keys), Deadline(timeout)};
    if (missing(pending.keys).empty()) {
      answer(conn, pending);
      return;
    }
    for (const auto& key : pending.keys) waiters_[key].insert(id);
    conn.pending = std::move(pending);
  }

  /// Replies to a get/wait whose keys are all present.
  void answer(Connection& conn, const Pending& pending) {
    std::string fields;
    if (pending.op == Op::get) put_string(fields, map_.at(pending.keys.front()));
    reply(conn, Status::ok, fields);
  }

  void unpark(Id id, Connection& conn) {
    for (const auto& key : conn.pending->keys) {
      if (const auto it = waiters_.find(key); it != waiters_.end()) {
        it->second.erase(id);
        if (it->second.empty()) waiters_.erase(it);
      }
    }
    conn.pending.reset();
  }

  /// A key now exists: wakes the connections waiting for it whose keys are all there.
  void key_added(const std::string& key) {
    const auto it = waiters_.find(key);
    if (it == waiters_.end()) return;
    const std::vector<Id> ids(it->second.begin(), it->second.end());
    for (const Id id : ids) {
      const auto c = connections_.find(id);
      if (c == connections_.end() || !c->second->pending) continue;
      Connection& conn = *c->second;
      if (!missing(conn.pending->keys).empty()) continue;
      const Pending pending = *conn.pending;
      unpark(id, conn);
      answer(conn, pending);
      process(id, conn);  // requests that queued behind it
    }
  }

  void expire_waiters() {
    std::vector<Id> expired;
    for (auto& [id, conn] : connections_) {
      if (conn->pending && conn->pending->deadline.expired()) expired.push_back(id);
    }
    for (const Id id : expired) {
      Connection& conn = *connections_.at(id);
      const Pending pending = *conn.pending;
      unpark(id, conn);
      std::string fields;
      if (pending.op == Op::wait) {
        const auto keys = missing(pending.keys);
        append_u32(fields, static_cast<std::uint32_t>(keys.size()));
        for (const auto& key : keys) put_string(fields, key);
      }
      reply(conn, Status::timed_out, fields);
      process(id, conn);
    }
  }

  void close_marked() {
    for (auto it = connections_.begin(); it != connections_.end();) {
      if (it->second->closing) {
        if (it->second->pending) unpark(it->first, *it->second);
        it = connections_.erase(it);
      } else {
        ++it;
      }
    }
  }

  std::size_t max_message_bytes_;
  Fd listener_;
  Fd wake_;
  std::uint16_t port_ = 0;
  std::map<std::string, std::string, std::less<>> map_;
  std::unordered_map<Id, std::unique_ptr<Connection>> connections_;
  std::map<std::string, std::set<Id>, std::less<>> waiters_;
  Id next_id_ = 0;
  std::thread thread_;  // last: started once everything above exists
};

}  // namespace detail::tcp_store

/// A Store served over TCP. With is_server, the constructor starts the server (a thread with a
/// poll() loop serving every connection) on host:port and this object is also a client of it;
/// without, it connects to host:port, retrying with back-off (10 ms doubling to 1 s) until the
/// timeout, then raises tandem::Error "could not reach HOST:PORT within T: <cause>".
/// One connection per object, shared by its threads under a mutex: a get/wait that blocks holds
/// the connection, so a thread that must not wait behind it should use a TcpStore of its own.
/// Blocking get/wait wait on the server (which answers "timed out" at the deadline sent with the
/// request); should the server not answer by then (plus a grace of 5 s), the client raises
/// tandem::Error and the next call reconnects. A lost connection is an Error for the call that
/// finds it, and the next call reconnects. Move-only. Destroying the server's TcpStore stops the
/// server; clients still connected then see their calls fail.
class TcpStore {
 public:
  /// Opts in as a tandem::Store.
  using store_concept = store_tag;

  /// The server (is_server) listens, then every TcpStore connects, retrying until the timeout.
  explicit TcpStore(TcpStoreOptions options = {})
      : options_(std::move(options)), client_(std::make_unique<Client>()) {
    if (options_.is_server) {
      server_ = std::make_unique<detail::tcp_store::Server>(options_.host, options_.port,
                                                            options_.max_message_bytes);
      options_.port = server_->port();
    }
    std::lock_guard lock(client_->mutex);
    connect_locked(options_.timeout);
  }

  /// Moves the connection (and the server, if it is one).
  TcpStore(TcpStore&&) noexcept = default;
  /// Moves the connection (and the server, if it is one).
  TcpStore& operator=(TcpStore&&) noexcept = default;
  ~TcpStore() {
    if (client_) {
      std::lock_guard lock(client_->mutex);
      client_->fd.reset();  // before the server stops
    }
  }

  /// The port served or connected to (the one the system chose, for a server asked for port 0).
  [[nodiscard]] std::uint16_t port() const noexcept { return options_.port; }
  /// The server's address.
  [[nodiscard]] const std::string& host() const noexcept { return options_.host; }
  /// True when this TcpStore runs the server.
  [[nodiscard]] bool is_server() const noexcept { return server_ != nullptr; }

  /// Stores `value` under `key`, replacing what was there (Store requirement 2).
  void set(const std::string& key, std::string_view value) {
    std::string body = request(Op::set);
    detail::tcp_store::put_string(body, key);
    detail::tcp_store::put_string(body, value);
    call("set", body, options_.timeout);
  }

  /// The value under `key`, waiting at most timeout() for the key to exist (requirement 3).
  [[nodiscard]] std::string get(const std::string& key) { return get(key, options_.timeout); }

  /// The value under `key`, waiting at most `timeout` for the key to exist.
  [[nodiscard]] std::string get(const std::string& key, Timeout timeout) {
    std::string body = request(Op::get);
    detail::tcp_store::put_string(body, key);
    detail::append_u64(body, detail::tcp_store::encode_timeout(timeout));
    const auto reply = call("get", body, with_grace(timeout));
    detail::tcp_store::Reader in(reply);
    if (static_cast<Status>(in.u8()) == Status::timed_out) {
      throw detail::get_timeout_error("TcpStore", key, timeout);
    }
    auto value = in.string();
    expect_end(in, "get");
    return value;
  }

  /// Atomically adds `delta` to the decimal counter under `key` (missing: 0); the new value
  /// (requirement 4).
  std::int64_t add(const std::string& key, std::int64_t delta) {
    std::string body = request(Op::add);
    detail::tcp_store::put_string(body, key);
    detail::append_u64(body, static_cast<std::uint64_t>(delta));
    const auto reply = call("add", body, options_.timeout);
    detail::tcp_store::Reader in(reply);
    if (static_cast<Status>(in.u8()) == Status::error) throw Error("TcpStore.add", in.string());
    const auto value = static_cast<std::int64_t>(in.u64());
    expect_end(in, "add");
    return value;
  }

  /// Sets `key` to `desired` when it holds `expected` (or is missing and `expected` is empty), as
  /// torch does; returns the value it holds then (requirement 5).
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired) {
    std::string body = request(Op::compare_set);
    detail::tcp_store::put_string(body, key);
    detail::tcp_store::put_string(body, expected);
    detail::tcp_store::put_string(body, desired);
    const auto reply = call("compare_set", body, options_.timeout);
    detail::tcp_store::Reader in(reply);
    in.u8();
    auto value = in.string();
    expect_end(in, "compare_set");
    return value;
  }

  /// Blocks until every key exists, at most timeout() (requirement 6).
  void wait(std::span<const std::string> keys) { wait(keys, options_.timeout); }

  /// Blocks until every key exists, at most `timeout`.
  void wait(std::span<const std::string> keys, Timeout timeout) {
    std::string body = request(Op::wait);
    put_keys(body, keys);
    detail::append_u64(body, detail::tcp_store::encode_timeout(timeout));
    const auto reply = call("wait", body, with_grace(timeout));
    detail::tcp_store::Reader in(reply);
    if (static_cast<Status>(in.u8()) == Status::timed_out) {
      std::vector<std::string> missing(in.u32());
      for (auto& key : missing) key = in.string();
      expect_end(in, "wait");
      throw detail::wait_timeout_error("TcpStore", missing, timeout);
    }
    expect_end(in, "wait");
  }

  /// True when every key exists; never blocks (requirement 7).
  [[nodiscard]] bool check(std::span<const std::string> keys) {
    std::string body = request(Op::check);
    put_keys(body, keys);
    const auto reply = call("check", body, options_.timeout);
    detail::tcp_store::Reader in(reply);
    in.u8();
    const bool all = in.u8() != 0;
    expect_end(in, "check");
    return all;
  }

  /// Removes `key`; says whether it was there (requirement 8).
  bool delete_key(const std::string& key) {
    std::string body = request(Op::delete_key);
    detail::tcp_store::put_string(body, key);
    const auto reply = call("delete_key", body, options_.timeout);
    detail::tcp_store::Reader in(reply);
    in.u8();
    const bool deleted = in.u8() != 0;
    expect_end(in, "delete_key");
    return deleted;
  }

  /// Number of keys in the store (requirement 9).
  [[nodiscard]] std::int64_t num_keys() {
    const auto reply = call("num_keys", request(Op::num_keys), options_.timeout);
    detail::tcp_store::Reader in(reply);
    in.u8();
    const auto count = static_cast<std::int64_t>(in.u64());
    expect_end(in, "num_keys");
    return count;
  }

  /// The default timeout of get() and wait().
  [[nodiscard]] Timeout timeout() const { return options_.timeout; }
  /// Not to race with other calls on the same object.
  void set_timeout(Timeout timeout) { options_.timeout = timeout; }

 private:
  using Op = detail::tcp_store::Op;
  using Status = detail::tcp_store::Status;

  /// How long past a get/wait timeout the client waits for the server's "timed out" answer.
  static constexpr Timeout grace = std::chrono::seconds(5);

  static Timeout with_grace(Timeout timeout) {
    return timeout >= Timeout::max() - grace ? Timeout::max() : timeout + grace;
  }

  struct Client {
    std::mutex mutex;
    detail::Fd fd;
  };

  static std::string request(Op op) { return std::string(1, static_cast<char>(op)); }

  static void put_keys(std::string& body, std::span<const std::string> keys) {
    detail::append_u32(body, static_cast<std::uint32_t>(keys.size()));
    for (const auto& key : keys) detail::tcp_store::put_string(body, key);
  }

  std::string endpoint() const { return options_.host + ":" + std::to_string(options_.port); }

  void expect_end(const detail::tcp_store::Reader& in, const char* op) const {
    if (!in.at_end()) {
      throw Error(std::string("TcpStore.") + op, "malformed reply from " + endpoint());
    }
  }

  void connect_locked(Timeout timeout) {
    client_->fd = detail::connect_tcp(options_.host, options_.port, timeout, "TcpStore");
  }

  /// Sends one request frame and returns the reply body; any failure drops the connection
  /// (so that the stream is never out of step) and raises an Error.
  std::string call(const char* op, const std::string& body, Timeout wait) {
    if (body.size() > options_.max_message_bytes) {
      throw Error(std::string("TcpStore.") + op,
                  "request of " + std::to_string(body.size()) + " bytes exceeds max_message_bytes");
    }
    std::lock_guard lock(client_->mutex);
    if (!client_->fd) connect_locked(options_.timeout);
    const Deadline deadline(wait);
    auto fail = [&](const std::string& what, const detail::IoResult& r) {
      client_->fd.reset();
      return Error(std::string("TcpStore.") + op, what + " " + endpoint() + ": " + r.describe());
    };
    std::string frame;
    frame.reserve(4 + body.size());
    detail::append_u32(frame, static_cast<std::uint32_t>(body.size()));
    frame += body;
    if (auto r = detail::send_all(client_->fd.get(), frame.data(), frame.size(), deadline);
        !r.ok()) {
      throw fail("cannot send to", r);
    }
    char header[4];
    if (auto r = detail::recv_all(client_->fd.get(), header, 4, deadline); !r.ok()) {
      throw fail("no reply from", r);
    }
    const auto length = detail::load_u32(header);
    if (length == 0 || length > options_.max_message_bytes) {
      client_->fd.reset();
      throw Error(std::string("TcpStore.") + op,
                  "reply of " + std::to_string(length) + " bytes from " + endpoint());
    }
    std::string reply(length, '\0');
    if (auto r = detail::recv_all(client_->fd.get(), reply.data(), length, deadline); !r.ok()) {
      throw fail("no reply from", r);
    }
    return reply;
  }

  TcpStoreOptions options_;
  std::unique_ptr<detail::tcp_store::Server> server_;  // destroyed after client_
  std::unique_ptr<Client> client_;
};

static_assert(Store<TcpStore>);

}  // namespace tandem
