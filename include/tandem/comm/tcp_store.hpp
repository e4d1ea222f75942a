// tandem/comm/tcp_store.hpp - tandem::TcpStore, a Store served over TCP by one rank (the
// server, usually rank 0 on MASTER_ADDR:MASTER_PORT) to every rank of a job.
//   tandem::TcpStore server({.host = "10.0.0.1", .port = 29500, .is_server = true});  // rank 0
//   tandem::TcpStore client({.host = "10.0.0.1", .port = 29500});   // on every other rank
//   client.set("rank3/addr", "10.0.0.4:40001");
// Needs: POSIX sockets (Linux).
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
#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/units.hpp"

namespace tandem {

/// The TcpStore's default limits (see TcpStoreLimits and TcpStoreOptions).
namespace tcp_store_defaults {
/// Longest key: 64 KiB.
inline constexpr std::size_t max_key_bytes = std::size_t{64} << 10;
/// Longest value: 64 MiB.
inline constexpr std::size_t max_value_bytes = std::size_t{64} << 20;
/// Longest frame either side accepts: room for compare_set's two values and a key.
inline constexpr std::size_t max_message_bytes = 2 * max_value_bytes + (std::size_t{1} << 20);
/// Most keys one wait() or check() may name.
inline constexpr std::size_t max_keys_per_request = std::size_t{1} << 20;
/// Most bytes the server holds in keys and values (each key also counts entry_overhead_bytes).
inline constexpr std::size_t max_store_bytes = std::size_t{1} << 30;
/// What each key costs against max_store_bytes beyond its key and value bytes.
inline constexpr std::size_t entry_overhead_bytes = 64;
/// Most connections the server keeps open at once; more are closed as they arrive.
inline constexpr std::size_t max_connections = std::size_t{1} << 14;
/// Most connections that have not yet presented their token; past it the oldest is dropped.
inline constexpr std::size_t max_unauthenticated = 64;
/// How long a new connection has to present its token.
inline constexpr Timeout hello_timeout = std::chrono::seconds(30);
/// Longest job token.
inline constexpr std::size_t max_token_bytes = 1024;
/// How often a client still trying to reach the server says so on stderr.
inline constexpr Timeout notice_interval = std::chrono::seconds(30);
}  // namespace tcp_store_defaults

/// What the TcpStore server accepts; a request beyond a limit gets an error reply (its client
/// raises tandem::Error naming the limit), and the server's memory stays bounded: at most
/// max_store_bytes of keys and values, and per connection about two max_message_bytes of
/// buffers (a connection without its token yet: a few KiB).
struct TcpStoreLimits {
  std::size_t max_key_bytes = tcp_store_defaults::max_key_bytes;      ///< longest key
  std::size_t max_value_bytes = tcp_store_defaults::max_value_bytes;  ///< longest value
  /// Most keys in one wait() or check().
  std::size_t max_keys_per_request = tcp_store_defaults::max_keys_per_request;
  /// Most bytes of keys and values held (plus entry_overhead_bytes a key); a set of a new key
  /// past it is refused ("the store is full").
  std::size_t max_store_bytes = tcp_store_defaults::max_store_bytes;
  std::size_t max_connections = tcp_store_defaults::max_connections;  ///< open at once
  /// Connections that have not presented their token yet, at once; past it the oldest is dropped.
  std::size_t max_unauthenticated = tcp_store_defaults::max_unauthenticated;
  Timeout hello_timeout = tcp_store_defaults::hello_timeout;  ///< to present the token
};

/// What a TcpStore takes: where the server listens, whether this one is it, and how long to wait.
struct TcpStoreOptions {
  /// The server's address: the server listens on this address only (bind to it, not to every
  /// interface), and clients connect to it. "0.0.0.0" or "::" listen everywhere, if you must.
  std::string host = "127.0.0.1";
  std::uint16_t port = 29500;  ///< 0 with is_server: an ephemeral port (see TcpStore::port())
  /// True: this TcpStore runs the server (rank 0), and is a client of it too.
  bool is_server = false;
  Timeout timeout = default_timeout;  ///< the default timeout of get(), wait() and connecting
  /// Longest frame either side accepts.
  std::size_t max_message_bytes = tcp_store_defaults::max_message_bytes;
  /// The job token: the server refuses a client that does not present it, before the client
  /// reads or writes any key. Empty: TANDEM_STORE_TOKEN from the environment if set (tandemrun
  /// sets it), else none (the server accepts any client). At most max_token_bytes bytes.
  std::string token{};
  TcpStoreLimits limits{};  ///< what the server accepts (is_server only)
  /// How the "waiting for the store" notice names this process; empty: "rank $RANK" when RANK
  /// is set, else "process <pid>".
  std::string client_name{};
  /// How often a client that cannot reach the server yet says so on stderr ("tandem: rank 1
  /// waiting for the store at 10.0.0.1:29500 (30 s of 1800 s)"); zero: never.
  Timeout notice_interval = tcp_store_defaults::notice_interval;
};

namespace detail::tcp_store {

/// The wire protocol. Every message is a frame: a u32 little-endian length, then that many bytes
/// of body. A request body is an opcode byte and its fields; a reply body is a status byte and
/// its fields. Strings are a u32 length and the bytes, integers 8 bytes little-endian, timeouts
/// u64 milliseconds (relative, so that the ends need no common clock). A connection starts with
/// hello; the server answers nothing else first.
enum class Op : std::uint8_t {
  set = 1,          // key, value                  -> ok
  get = 2,          // key, timeout                -> ok value | timed_out
  add = 3,          // key, i64 delta              -> ok i64 | error message
  compare_set = 4,  // key, expected, desired      -> ok value
  wait = 5,         // u32 n, n keys, timeout      -> ok | timed_out u32 n, n missing keys
  check = 6,        // u32 n, n keys               -> ok u8
  delete_key = 7,   // key                         -> ok u8
  num_keys = 8,     //                             -> ok i64
  hello = 9,        // u32 magic, token            -> ok u32 magic | closing message
};

/// Any request may also be answered `error message` (refused, the connection goes on) or
/// `closing message` (refused, and the server closes the connection).
enum class Status : std::uint8_t { ok = 0, timed_out = 1, error = 2, closing = 3 };

/// "TDM1": the hello of tandem's protocol, version 1.
inline constexpr std::uint32_t magic = 0x314d4454u;
/// Longest hello frame: opcode, magic, token.
inline constexpr std::size_t max_hello_bytes = 1 + 4 + 4 + tcp_store_defaults::max_token_bytes;
/// Longest error text sent in a reply.
inline constexpr std::size_t max_error_bytes = 4096;

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
  [[nodiscard]] std::size_t left() const noexcept { return good_ ? body_.size() - pos_ : 0; }

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
  /// A string's bytes, in place: nothing is allocated from the length read.
  std::string_view view() {
    const auto length = u32();
    if (!need(length)) return {};
    const auto out = body_.substr(pos_, length);
    pos_ += length;
    return out;
  }
  std::string string() { return std::string(view()); }

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

/// The first frame of `buffer`: `need_more` until it is whole, `too_long` when its length is 0
/// or over `max_body` (the stream cannot go on). Nothing is allocated.
struct Frame {
  enum class Kind { need_more, ready, too_long } kind = Kind::need_more;
  std::string_view body;     ///< ready: the body
  std::size_t consumed = 0;  ///< ready: header and body
  std::uint32_t length = 0;  ///< the length read, once 4 bytes are there
};

inline Frame next_frame(std::string_view buffer, std::size_t max_body) {
  Frame frame;
  if (buffer.size() < 4) return frame;
  frame.length = load_u32(buffer.data());
  if (frame.length == 0 || frame.length > max_body) {
    frame.kind = Frame::Kind::too_long;
    return frame;
  }
  if (buffer.size() - 4 < frame.length) return frame;
  frame.kind = Frame::Kind::ready;
  frame.body = buffer.substr(4, frame.length);
  frame.consumed = 4 + static_cast<std::size_t>(frame.length);
  return frame;
}

/// One request as parsed from a frame body.
struct Request {
  Op op = Op::num_keys;
  std::string key;                // set, get, add, compare_set, delete_key
  std::string value;              // set: the value; compare_set: expected; hello: the token
  std::string desired;            // compare_set
  std::vector<std::string> keys;  // wait, check
  std::uint64_t number = 0;       // get, wait: timeout ms; add: delta; hello: magic
};

/// What parse_request makes of a body: a request, or why not. `fatal` when the body is malformed
/// (the server then closes the connection); a request over a limit is not fatal.
struct Parsed {
  std::optional<Request> request;
  std::string error;
  bool fatal = false;
};

/// Parses one request body against `limits`. Pure: no state, and nothing is allocated from a
/// length or count before it is checked against the body's size and the limits.
inline Parsed parse_request(std::string_view body, const TcpStoreLimits& limits) {
  Parsed parsed;
  const auto malformed = [&](std::string why) {
    parsed.request.reset();
    parsed.error = "malformed request: " + std::move(why);
    parsed.fatal = true;
    return parsed;
  };
  const auto refused = [&](std::string why) {
    parsed.request.reset();
    parsed.error = std::move(why);
    return parsed;
  };
  Reader in(body);
  Request request;
  const auto opcode = in.u8();
  if (!in.good() || opcode < static_cast<std::uint8_t>(Op::set) ||
      opcode > static_cast<std::uint8_t>(Op::hello)) {
    return malformed("unknown operation " + std::to_string(opcode));
  }
  request.op = static_cast<Op>(opcode);
  std::string too_long;    // the first field over its limit: refused once the body is known good
  bool bad_count = false;  // a key count the body cannot hold
  bool count_refused = false;  // a key count over max_keys_per_request
  const auto field = [&](std::string& out, std::size_t limit, const char* what) {
    const auto bytes = in.view();
    if (!in.good()) return;
    if (bytes.size() > limit) {
      if (too_long.empty()) {
        too_long = std::string(what) + " of " + std::to_string(bytes.size()) +
                   " bytes exceeds the store's limit of " + std::to_string(limit) + " bytes";
      }
      return;
    }
    out.assign(bytes);
  };
  const auto key_list = [&] {
    const auto count = in.u32();
    if (!in.good()) return;
    if (count > limits.max_keys_per_request) {
      too_long = std::to_string(count) + " keys in one request exceed the store's limit of " +
                 std::to_string(limits.max_keys_per_request);
      count_refused = true;  // the keys are not read: refused from the count alone
      return;
    }
    if (count > in.left() / 4) {  // each key takes at least its 4-byte length
      bad_count = true;
      return;
    }
    request.keys.reserve(count);
    for (std::uint32_t i = 0; i < count && in.good(); ++i) {
      std::string key;
      field(key, limits.max_key_bytes, "a key");
      request.keys.push_back(std::move(key));
    }
  };
  switch (request.op) {
    case Op::set:
      field(request.key, limits.max_key_bytes, "a key");
      field(request.value, limits.max_value_bytes, "a value");
      break;
    case Op::get:
      field(request.key, limits.max_key_bytes, "a key");
      request.number = in.u64();
      break;
    case Op::add:
      field(request.key, limits.max_key_bytes, "a key");
      request.number = in.u64();
      break;
    case Op::compare_set:
      field(request.key, limits.max_key_bytes, "a key");
      field(request.value, limits.max_value_bytes, "a value");
      field(request.desired, limits.max_value_bytes, "a value");
      break;
    case Op::wait:
      key_list();
      if (count_refused) return refused(too_long);
      request.number = in.u64();
      break;
    case Op::check:
      key_list();
      if (count_refused) return refused(too_long);
      break;
    case Op::delete_key:
      field(request.key, limits.max_key_bytes, "a key");
      break;
    case Op::num_keys:
      break;
    case Op::hello:
      request.number = in.u32();
      field(request.value, tcp_store_defaults::max_token_bytes, "a token");
      break;
  }
  if (bad_count) return malformed("more keys than the message can hold");
  if (!in.good()) return malformed("a field runs past the end of the message");
  if (!in.at_end()) return malformed("bytes left after the last field");
  if (!too_long.empty()) return refused(too_long);
  parsed.request = std::move(request);
  return parsed;
}

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
    case Op::add: {
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
    case Op::compare_set: {
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

}  // namespace detail::tcp_store

/// A Store served over TCP. With is_server, the constructor starts the server (a thread with a
/// poll() loop serving every connection) on host:port and this object is also a client of it;
/// without, it connects to host:port, retrying with back-off (10 ms doubling to 1 s) until the
/// timeout, then raises tandem::Error "could not reach HOST:PORT within T: <cause>"; while it
/// retries it says so on stderr every notice_interval.
/// Every connection first presents the job token (TcpStoreOptions::token, or TANDEM_STORE_TOKEN);
/// a server with a token closes a connection that presents another, before it reads or writes
/// any key, and that client raises tandem::Error "the store at HOST:PORT refused this client's
/// token". A request over the server's limits (TcpStoreLimits) raises tandem::Error naming it.
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
    if (options_.token.empty()) options_.token = process_env("TANDEM_STORE_TOKEN").value_or("");
    if (options_.token.size() > tcp_store_defaults::max_token_bytes) {
      throw Error("TcpStore", "the job token has " + std::to_string(options_.token.size()) +
                                  " bytes; at most " +
                                  std::to_string(tcp_store_defaults::max_token_bytes) +
                                  " are allowed");
    }
    if (options_.client_name.empty()) {
      const auto rank = process_env("RANK");
      options_.client_name =
          rank && parse_int(*rank) ? "rank " + *rank : "process " + std::to_string(::getpid());
    }
    if (options_.is_server) {
      server_ = std::make_unique<detail::tcp_store::Server>(
          options_.host, options_.port,
          detail::tcp_store::ServerConfig{options_.max_message_bytes, options_.limits,
                                          options_.token});
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
  /// For the server: the address its socket listens on, as the system reports it
  /// ("127.0.0.1:29500", "[::1]:29500"); empty for a client.
  [[nodiscard]] std::string listen_address() const {
    return server_ ? server_->bound_address() : std::string();
  }

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
    in.u8();
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
      const auto count = in.u32();
      // No more keys than the reply can hold, whatever the count says.
      if (count > in.left() / 4) expect_end(detail::tcp_store::Reader(" "), "wait");
      std::vector<std::string> missing;
      missing.reserve(count);
      for (std::uint32_t i = 0; i < count; ++i) missing.push_back(in.string());
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

  /// "30 s" (whole seconds from 1 s on), for the waiting notice.
  static std::string seconds(Timeout t) {
    if (t >= std::chrono::seconds(1)) {
      return std::to_string(std::chrono::duration_cast<std::chrono::seconds>(t).count()) + " s";
    }
    return std::to_string(t.count()) + " ms";
  }

  void connect_locked(Timeout timeout) {
    detail::ConnectNotice notice;
    notice.interval =
        options_.notice_interval > Timeout::zero() ? options_.notice_interval : Timeout::max();
    notice.say = [&](Timeout waited) {
      const std::string line = "tandem: " + options_.client_name + " waiting for the store at " +
                               endpoint() + " (" + seconds(waited) + " of " +
                               (timeout == Timeout::max() ? "no limit" : seconds(timeout)) + ")\n";
      std::fputs(line.c_str(), stderr);
      std::fflush(stderr);
    };
    const Deadline deadline(timeout);
    auto fd = detail::connect_tcp(options_.host, options_.port, timeout, "TcpStore", &notice);
    hello(fd, deadline);
    client_->fd = std::move(fd);
  }

  /// Presents the token; the server answers ok, or refuses and closes.
  void hello(const detail::Fd& fd, const Deadline& deadline) {
    std::string body = request(Op::hello);
    detail::append_u32(body, detail::tcp_store::magic);
    detail::tcp_store::put_string(body, options_.token);
    std::string reply;
    const auto failed = exchange(fd, body, deadline, reply);
    const std::string where = "the store at " + endpoint();
    if (failed) {
      throw Error("TcpStore", where + " did not answer this client's hello (" + *failed +
                                  "); is it a tandem TcpStore of the same version?");
    }
    detail::tcp_store::Reader in(reply);
    const auto status = static_cast<Status>(in.u8());
    if (status == Status::ok && in.u32() == detail::tcp_store::magic && in.at_end()) return;
    if (status == Status::closing || status == Status::error) {
      const auto cause = in.string();
      if (cause.find("token") != std::string::npos) {
        throw Error("TcpStore",
                    where + " refused this client's token (" +
                        (options_.token.empty() ? std::string("this client has none")
                                                : std::string("this client's differs")) +
                        "): give every rank the same TANDEM_STORE_TOKEN (tandemrun "
                        "--rdzv-token)");
      }
      throw Error("TcpStore", where + " refused this client: " + cause);
    }
    throw Error("TcpStore", where + " answered the hello with a malformed reply");
  }

  /// Sends one request frame and reads the reply body; the failure, described, or nullopt.
  std::optional<std::string> exchange(const detail::Fd& fd, const std::string& body,
                                      const Deadline& deadline, std::string& reply) const {
    std::string frame;
    frame.reserve(4 + body.size());
    detail::append_u32(frame, static_cast<std::uint32_t>(body.size()));
    frame += body;
    if (auto r = detail::send_all(fd.get(), frame.data(), frame.size(), deadline); !r.ok()) {
      return "cannot send to " + endpoint() + ": " + r.describe();
    }
    char header[4];
    if (auto r = detail::recv_all(fd.get(), header, 4, deadline); !r.ok()) {
      return "no reply from " + endpoint() + ": " + r.describe();
    }
    const auto length = detail::load_u32(header);
    if (length == 0 || length > options_.max_message_bytes) {
      return "a reply of " + std::to_string(length) + " bytes from " + endpoint();
    }
    reply.assign(length, '\0');
    if (auto r = detail::recv_all(fd.get(), reply.data(), length, deadline); !r.ok()) {
      return "no reply from " + endpoint() + ": " + r.describe();
    }
    return std::nullopt;
  }

  /// Sends one request frame and returns the reply body; any failure drops the connection
  /// (so that the stream is never out of step) and raises an Error, as does a refusal.
  std::string call(const char* op, const std::string& body, Timeout wait) {
    if (body.size() > options_.max_message_bytes) {
      throw Error(std::string("TcpStore.") + op,
                  "request of " + std::to_string(body.size()) + " bytes exceeds max_message_bytes");
    }
    std::lock_guard lock(client_->mutex);
    if (!client_->fd) connect_locked(options_.timeout);
    const Deadline deadline(wait);
    std::string reply;
    if (const auto failed = exchange(client_->fd, body, deadline, reply)) {
      client_->fd.reset();
      throw Error(std::string("TcpStore.") + op, *failed);
    }
    const auto status = static_cast<Status>(reply.front());
    if (status == Status::error || status == Status::closing) {
      if (status == Status::closing) client_->fd.reset();
      detail::tcp_store::Reader in(reply);
      in.u8();
      const auto cause = in.string();
      throw Error(std::string("TcpStore.") + op,
                  in.at_end() ? cause : "malformed reply from " + endpoint());
    }
    return reply;
  }

  TcpStoreOptions options_;
  std::unique_ptr<detail::tcp_store::Server> server_;  // destroyed after client_
  std::unique_ptr<Client> client_;
};

static_assert(Store<TcpStore>);

}  // namespace tandem
