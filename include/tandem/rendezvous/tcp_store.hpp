// tandem/rendezvous/tcp_store.hpp - tandem::TcpStore, a Store served over TCP by one rank (the
// server, usually rank 0 on MASTER_ADDR:MASTER_PORT) to every rank of a job.
//   tandem::TcpStore server({.host = "10.0.0.1", .port = 29500, .is_server = true});  // rank 0
//   tandem::TcpStore client({.host = "10.0.0.1", .port = 29500});   // on every other rank
//   client.set("rank3/addr", "10.0.0.4:40001");
// Needs: POSIX sockets (Linux). The limits and wire protocol are in tcp_protocol.hpp, the server
// in tcp_server.hpp; this header is the client, and the one to include.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/rendezvous/detail/socket.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/rendezvous/tcp_protocol.hpp"
#include "tandem/rendezvous/tcp_server.hpp"

namespace tandem {

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
  /// What that notice, and the Error of a client that never reaches the server, add about it
  /// (open_store: "rank 0 hosts it: not started yet, or started with another MASTER_ADDR or
  /// MASTER_PORT?"); empty: nothing.
  std::string server_hint{};
};

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
      const std::string line =
          "tandem: " + options_.client_name + " waiting for the store at " + endpoint() +
          (options_.server_hint.empty() ? std::string() : " (" + options_.server_hint + ")") +
          " (" + seconds(waited) + " of " +
          (timeout == Timeout::max() ? "no limit" : seconds(timeout)) + ")\n";
      std::fputs(line.c_str(), stderr);
      std::fflush(stderr);
    };
    const Deadline deadline(timeout);
    detail::Fd fd;
    try {
      fd = detail::connect_tcp(options_.host, options_.port, timeout, "TcpStore", &notice);
    } catch (const Error& e) {
      if (options_.server_hint.empty()) throw;
      throw Error(e.operation(), e.cause() + " (" + options_.server_hint + ")");
    }
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
