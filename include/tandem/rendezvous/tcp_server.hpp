// tandem/rendezvous/tcp_server.hpp - the TcpStore's server: the table of keys and values within
// TcpStoreLimits, what each request does to it (execute, apart from the sockets so it can be
// tested alone), and the poll() loop that serves every connection. TcpStore with is_server runs
// one; nothing else needs to name it.
//   tandem::detail::tcp_store::Server server("127.0.0.1", 0, {});   // server.port()
// Needs: POSIX sockets and eventfd (Linux).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/rendezvous/detail/socket.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/rendezvous/tcp_protocol.hpp"

namespace tandem::detail::tcp_store {

/// Compares two tokens in time that depends on `expected`'s length only.
inline bool same_token(std::string_view expected, std::string_view given) noexcept {
  unsigned difference = expected.size() == given.size() ? 0u : 1u;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const auto a = static_cast<unsigned char>(expected[i]);
    const auto b = i < given.size() ? static_cast<unsigned char>(given[i]) : 0u;
    difference |= a ^ b;
    // Keep the compiler from turning the loop into an early exit.
    asm volatile("" : "+r"(difference));
  }
  return difference == 0;
}

/// A key for an error message: quoted, cut at 100 bytes.
inline std::string quote_key(std::string_view key) {
  if (key.size() <= 100) return "'" + std::string(key) + "'";
  return "'" + std::string(key.substr(0, 100)) + "...' (" + std::to_string(key.size()) + " bytes)";
}

/// The server's keys and values, with their size accounted against max_store_bytes.
class Table {
 public:
  explicit Table(std::size_t max_bytes) : max_bytes_(max_bytes) {}

  [[nodiscard]] const std::string* find(std::string_view key) const {
    const auto it = map_.find(key);
    return it == map_.end() ? nullptr : &it->second;
  }
  [[nodiscard]] bool contains(std::string_view key) const { return map_.contains(key); }
  [[nodiscard]] std::size_t size() const noexcept { return map_.size(); }
  /// Bytes held: keys, values and entry_overhead_bytes a key.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

  /// Stores `value` under `key`; an error text (and no change) when that would pass the limit.
  std::optional<std::string> put(const std::string& key, std::string value) {
    const auto it = map_.find(key);
    const std::size_t old_cost = it == map_.end() ? 0 : cost(key, it->second);
    const std::size_t new_cost = cost(key, value);
    if (new_cost > old_cost && new_cost - old_cost > max_bytes_ - bytes_) {
      return "the store is full: storing key " + quote_key(key) + " (" + std::to_string(new_cost) +
             " bytes) would pass its limit of " + std::to_string(max_bytes_) + " bytes (" +
             std::to_string(bytes_) + " held)";
    }
    bytes_ = bytes_ - old_cost + new_cost;
    if (it == map_.end()) {
      map_.emplace(key, std::move(value));
    } else {
      it->second = std::move(value);
    }
    return std::nullopt;
  }

  bool erase(std::string_view key) {
    const auto it = map_.find(key);
    if (it == map_.end()) return false;
    bytes_ -= cost(it->first, it->second);
    map_.erase(it);
    return true;
  }

 private:
  static std::size_t cost(std::string_view key, std::string_view value) noexcept {
    return key.size() + value.size() + tcp_store_defaults::entry_overhead_bytes;
  }
  std::size_t max_bytes_;
  std::size_t bytes_ = 0;
  std::map<std::string, std::string, std::less<>> map_;
};

/// What execute() did with a request.
struct Outcome {
  enum class Kind { reply, park, close } kind = Kind::reply;
  Status status = Status::ok;
  std::string fields;                ///< reply, close: the reply's fields
  std::optional<std::string> added;  ///< a key that now exists (waiters may be woken)
};

inline Outcome error_outcome(Status status, std::string_view message) {
  Outcome outcome;
  outcome.kind = status == Status::closing ? Outcome::Kind::close : Outcome::Kind::reply;
  outcome.status = status;
  put_string(outcome.fields, message.substr(0, max_error_bytes));
  return outcome;
}

/// add: the counter under the key moved by the request's delta (a value that is not a decimal
/// integer, or an overflow, is refused).
inline Outcome execute_add(Table& table, const Request& request) {
  Outcome outcome;
  std::int64_t value = 0;
  try {
    value = added_value("TcpStore", request.key, table.find(request.key),
                        static_cast<std::int64_t>(request.number));
  } catch (const Error& error) {
    return error_outcome(Status::error, error.cause());
  }
  if (auto full = table.put(request.key, std::to_string(value))) {
    return error_outcome(Status::error, *full);
  }
  append_u64(outcome.fields, static_cast<std::uint64_t>(value));
  outcome.added = request.key;
  return outcome;
}

/// compare_set, by torch's rules (compare_set_outcome).
inline Outcome execute_compare_set(Table& table, const Request& request) {
  Outcome outcome;
  auto result = compare_set_outcome(table.find(request.key), request.value, request.desired);
  if (result.store) {
    if (auto full = table.put(request.key, std::move(*result.store))) {
      return error_outcome(Status::error, *full);
    }
    outcome.added = request.key;
  }
  put_string(outcome.fields, result.result);
  return outcome;
}

/// Runs one request (not hello) on `table`: everything the server does but the sockets and
/// the parking of a get/wait whose keys are missing (Outcome::Kind::park).
inline Outcome execute(Table& table, const Request& request) {
  Outcome outcome;
  switch (request.op) {
    case Op::set:
      if (auto full = table.put(request.key, request.value)) {
        return error_outcome(Status::error, *full);
      }
      outcome.added = request.key;
      return outcome;
    case Op::get:
      if (const auto* value = table.find(request.key)) {
        put_string(outcome.fields, *value);
      } else {
        outcome.kind = Outcome::Kind::park;
      }
      return outcome;
    case Op::add:
      return execute_add(table, request);
    case Op::compare_set:
      return execute_compare_set(table, request);
    case Op::wait:
      for (const auto& key : request.keys) {
        if (!table.contains(key)) {
          outcome.kind = Outcome::Kind::park;
          break;
        }
      }
      return outcome;
    case Op::check: {
      const bool all = std::all_of(request.keys.begin(), request.keys.end(),
                                   [&](const std::string& key) { return table.contains(key); });
      outcome.fields.push_back(static_cast<char>(all ? 1 : 0));
      return outcome;
    }
    case Op::delete_key:
      outcome.fields.push_back(static_cast<char>(table.erase(request.key) ? 1 : 0));
      return outcome;
    case Op::num_keys:
      append_u64(outcome.fields, static_cast<std::uint64_t>(table.size()));
      return outcome;
    case Op::hello:
      return error_outcome(Status::closing, "hello twice on one connection");
  }
  return error_outcome(Status::closing, "unknown operation");
}

/// The server's answer to the first frame of a connection: ok (and the connection may go on) or
/// an Outcome::Kind::close with the reason.
inline Outcome check_hello(const Parsed& parsed, std::string_view token) {
  if (!parsed.request || parsed.request->op != Op::hello || parsed.request->number != magic) {
    return error_outcome(Status::closing,
                         "this is tandem's TcpStore; a connection must start with its hello");
  }
  if (!token.empty() && !same_token(token, parsed.request->value)) {
    return error_outcome(Status::closing, "the store refused this client's token");
  }
  Outcome outcome;
  append_u32(outcome.fields, magic);
  return outcome;
}

/// What the server is told: its limits and the job token (empty: none).
struct ServerConfig {
  std::size_t max_message_bytes = tcp_store_defaults::max_message_bytes;
  TcpStoreLimits limits{};
  std::string token{};
};

/// The server: one thread running a poll() loop over the listening socket, an eventfd that
/// stops it, and every connection. Blocked get/wait requests park their connection on waiter
/// lists of the keys they need, and are answered when the keys appear or at their deadline.
class Server {
 public:
  Server(const std::string& host, std::uint16_t port, ServerConfig config)
      : config_(std::move(config)), table_(config_.limits.max_store_bytes) {
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

  /// The address the listening socket is bound to, "127.0.0.1:29500" or "[::1]:29500".
  [[nodiscard]] std::string bound_address() const {
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (::getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&bound), &len) < 0) return {};
    char text[INET6_ADDRSTRLEN] = {};
    if (bound.ss_family == AF_INET) {
      const auto* v4 = reinterpret_cast<const sockaddr_in*>(&bound);
      ::inet_ntop(AF_INET, &v4->sin_addr, text, sizeof text);
      return std::string(text) + ":" + std::to_string(ntohs(v4->sin_port));
    }
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&bound);
    ::inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof text);
    return "[" + std::string(text) + "]:" + std::to_string(ntohs(v6->sin6_port));
  }

 private:
  using clock = Deadline::clock;

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
    bool authenticated = false;  // its hello was accepted
    bool ending = false;         // refused: reads nothing more, closes once `out` is sent
    bool closing = false;
    clock::time_point hello_by;  // when it must have said hello
  };

  using Id = std::uint64_t;

  /// A connection takes no more requests while this much of its replies is unsent.
  [[nodiscard]] std::size_t out_limit() const noexcept { return config_.max_message_bytes; }

  [[nodiscard]] bool reads(const Connection& conn) const noexcept {
    return !conn.pending && !conn.ending && !conn.closing && conn.out.size() < out_limit();
  }

  void run() {
    std::vector<pollfd> fds;
    std::vector<Id> ids;
    for (;;) {
      fds.clear();
      ids.clear();
      fds.push_back({wake_.get(), POLLIN, 0});
      const bool listening = clock::now() >= listener_paused_until_;
      fds.push_back({listening ? listener_.get() : -1, POLLIN, 0});
      for (auto& [id, conn] : connections_) {
        short events = reads(*conn) ? static_cast<short>(POLLIN | POLLRDHUP) : POLLRDHUP;
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
        } else if (!reads(conn)) {
          // Not reading: a hang-up means the client left (mid-request, or not reading replies).
          if (revents & (POLLRDHUP | POLLHUP)) conn.closing = true;
        } else if (revents & (POLLIN | POLLRDHUP | POLLHUP)) {
          receive(ids[i], conn);  // reads up to the end of the stream, then marks it closing
        }
        if (!conn.closing && (revents & POLLOUT)) flush(ids[i], conn);
      }
      expire_waiters();
      expire_hellos();
      close_marked();
    }
  }

  int next_timeout() const {
    std::optional<clock::time_point> first;
    const auto consider = [&](clock::time_point at) {
      if (!first || at < *first) first = at;
    };
    for (const auto& [id, conn] : connections_) {
      if (conn->pending) consider(conn->pending->deadline.at());
      if (!conn->authenticated) consider(conn->hello_by);
    }
    if (clock::now() < listener_paused_until_) consider(listener_paused_until_);
    if (!first) return -1;
    if (*first == clock::time_point::max()) return -1;
    const auto left = *first - clock::now();
    if (left <= clock::duration::zero()) return 0;
    return static_cast<int>(std::min<std::int64_t>(
        std::chrono::ceil<std::chrono::milliseconds>(left).count(), 24 * 3600 * 1000));
  }

  void accept_all() {
    for (;;) {
      Fd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!fd) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of descriptors: the pending connection stays queued, and polling the listener
          // now would spin. Look again a little later.
          listener_paused_until_ = clock::now() + std::chrono::milliseconds(100);
        }
        return;  // EAGAIN: all taken
      }
      if (connections_.size() >= config_.limits.max_connections) {
        // Refused: a reply in place of its hello's (a fresh socket takes it at once), closed.
        std::string reply;
        const auto outcome =
            error_outcome(Status::closing, "the store has " + std::to_string(connections_.size()) +
                                               " connections open, its limit (max_connections)");
        append_u32(reply, static_cast<std::uint32_t>(1 + outcome.fields.size()));
        reply.push_back(static_cast<char>(outcome.status));
        reply += outcome.fields;
        (void)::send(fd.get(), reply.data(), reply.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        continue;
      }
      std::size_t unauthenticated = 0;
      auto oldest = connections_.end();
      for (auto it = connections_.begin(); it != connections_.end(); ++it) {
        if (it->second->authenticated || it->second->closing) continue;
        ++unauthenticated;
        if (oldest == connections_.end() || it->first < oldest->first) oldest = it;
      }
      if (unauthenticated >= config_.limits.max_unauthenticated && oldest != connections_.end()) {
        oldest->second->closing = true;  // the oldest silent one makes room
      }
      set_nodelay(fd.get());
      auto conn = std::make_unique<Connection>();
      conn->fd = std::move(fd);
      conn->hello_by = Deadline(config_.limits.hello_timeout).at();
      connections_.emplace(next_id_++, std::move(conn));
    }
  }

  void receive(Id id, Connection& conn) {
    char buffer[64 * 1024];
    // At most 1 MiB per wake-up, so that one fast sender cannot hold the loop. Each chunk is
    // processed before the next is read: `in` holds at most one unfinished frame and a chunk.
    for (int round = 0; round < 16 && reads(conn); ++round) {
      const ssize_t n = ::recv(conn.fd.get(), buffer, sizeof buffer, MSG_DONTWAIT);
      if (n > 0) {
        conn.in.append(buffer, static_cast<std::size_t>(n));
        process(id, conn);
        if (static_cast<std::size_t>(n) < sizeof buffer) break;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      conn.closing = true;  // EOF (even mid-frame) or an error
      return;
    }
  }

  /// Handles the whole frames buffered, stopping at a request that has to wait, at a refusal,
  /// or while too much of the replies is unsent.
  void process(Id id, Connection& conn) {
    std::size_t used = 0;
    while (reads(conn)) {
      const auto limit = conn.authenticated ? config_.max_message_bytes : max_hello_bytes;
      const auto frame = next_frame(std::string_view(conn.in).substr(used), limit);
      if (frame.kind == Frame::Kind::need_more) break;
      if (frame.kind == Frame::Kind::too_long) {
        // Its body is not read: the stream cannot go on.
        respond(conn,
                error_outcome(Status::closing, "a message of " + std::to_string(frame.length) +
                                                   " bytes is outside the store's limit of 1 to " +
                                                   std::to_string(limit) + " bytes"));
        break;
      }
      used += frame.consumed;
      handle(id, conn, frame.body);
    }
    conn.in.erase(0, used);
    if (!conn.closing) flush(id, conn);
  }

  /// Queues an outcome's reply; a close outcome ends the connection once the reply is sent.
  static void respond(Connection& conn, const Outcome& outcome) {
    append_u32(conn.out, static_cast<std::uint32_t>(1 + outcome.fields.size()));
    conn.out.push_back(static_cast<char>(outcome.status));
    conn.out.append(outcome.fields);
    if (outcome.kind == Outcome::Kind::close) conn.ending = true;
  }

  void flush(Id id, Connection& conn) {
    const bool was_full = conn.out.size() >= out_limit();
    while (!conn.out.empty()) {
      const ssize_t n =
          ::send(conn.fd.get(), conn.out.data(), conn.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        conn.out.erase(0, static_cast<std::size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      conn.closing = true;  // EPIPE, ECONNRESET: the client is gone
      return;
    }
    if (conn.ending && conn.out.empty()) conn.closing = true;
    // Requests held back while the replies piled up.
    if (was_full && reads(conn) && !conn.in.empty()) process(id, conn);
  }

  /// One request frame.
  void handle(Id id, Connection& conn, std::string_view body) {
    const auto parsed = parse_request(body, config_.limits);
    if (!conn.authenticated) {
      const auto outcome = check_hello(parsed, config_.token);
      respond(conn, outcome);
      conn.authenticated = outcome.kind == Outcome::Kind::reply;
      return;
    }
    if (!parsed.request) {
      respond(conn, error_outcome(parsed.fatal ? Status::closing : Status::error, parsed.error));
      return;
    }
    const Request& request = *parsed.request;
    auto outcome = execute(table_, request);
    if (outcome.kind == Outcome::Kind::park) {
      park(id, conn, request);
      return;
    }
    respond(conn, outcome);
    if (outcome.added) key_added(*outcome.added);
  }

  std::vector<std::string> missing(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    for (const auto& key : keys) {
      if (!table_.contains(key)) out.push_back(key);
    }
    return out;
  }

  /// Parks a get/wait whose keys are missing until they are all there.
  void park(Id id, Connection& conn, const Request& request) {
    Pending pending{request.op, {}, Deadline(decode_timeout(request.number))};
    if (request.op == Op::get) {
      pending.keys.push_back(request.key);
    } else {
      pending.keys = request.keys;
    }
    for (const auto& key : pending.keys) waiters_[key].insert(id);
    conn.pending = std::move(pending);
  }

  /// Replies to a get/wait whose keys are all present.
  void answer(Connection& conn, const Pending& pending) {
    Outcome outcome;
    if (pending.op == Op::get) put_string(outcome.fields, *table_.find(pending.keys.front()));
    respond(conn, outcome);
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
      Outcome outcome;
      outcome.status = Status::timed_out;
      if (pending.op == Op::wait) {
        const auto keys = missing(pending.keys);
        append_u32(outcome.fields, static_cast<std::uint32_t>(keys.size()));
        for (const auto& key : keys) put_string(outcome.fields, key);
      }
      respond(conn, outcome);
      process(id, conn);
    }
  }

  /// Drops connections that did not say hello in time.
  void expire_hellos() {
    const auto now = clock::now();
    for (auto& [id, conn] : connections_) {
      if (!conn->authenticated && !conn->ending && now >= conn->hello_by) conn->closing = true;
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

  ServerConfig config_;
  Table table_;
  Fd listener_;
  Fd wake_;
  std::uint16_t port_ = 0;
  clock::time_point listener_paused_until_{};
  std::unordered_map<Id, std::unique_ptr<Connection>> connections_;
  std::map<std::string, std::set<Id>, std::less<>> waiters_;
  Id next_id_ = 0;
  std::thread thread_;  // last: started once everything above exists
};

}  // namespace tandem::detail::tcp_store
