// tandem/rendezvous/c10d_store.hpp - tandem::C10dStore, a client of PyTorch's c10d TCPStore server
// (the store torchrun's agent hosts on MASTER_PORT, or any torch.distributed.TCPStore): a tandem
// Store that speaks c10d's wire protocol, so that a tandem program joins a torchrun job unchanged.
//   tandem::C10dStore store({.host = "127.0.0.1", .port = 29500});   // protocol found by itself
//   store.set("tandem/addr", "10.0.0.4:40001");
//   std::string addr = store.get("tandem/addr");
// Needs: POSIX sockets (Linux).
//
// The protocol (from PyTorch's torch/csrc/distributed/c10d/TCPStore*.cpp). A request is an opcode
// byte and its fields; strings and byte values are a u64 length and the bytes; integers are 8
// bytes; all in the host's byte order (little-endian here). Replies: compare_set and get send a
// value, add/num_keys/delete_key an int64, check a byte (0 ready, 1 not ready), wait a byte (0)
// once every key exists; set sends nothing back. Keys go out with "/" in front, as PyTorch's
// client sends them, so tandem and Python see the same keys. Two opcode layouts exist:
//   legacy    (PyTorch 1.13 to 2.1): set 0, compare_set 1, get 2, add 3, check 4, wait 5,
//             num_keys 6, then delete_key 8 (1.13, 2.0: 7 is watch_key) or 7 (2.1);
//   validated (PyTorch 2.2 and later, classic and libuv servers): every connection first sends
//             VALIDATE (opcode 0) and the magic number 0x3C85F7CE; then set 1, compare_set 2,
//             get 3, add 4, check 5, wait 6, num_keys 7, delete_key 8.
// C10dProtocol::automatic tells them apart on a throw-away connection (see detail::c10d): it
// sends VALIDATE, the magic and four validated num_keys opcodes. A 2.2+ server answers four
// int64s. A legacy server reads the same bytes as "set" with a key length of about 5 * 10^17,
// fails to allocate it and closes the connection: no key is touched on either.
#pragma once

#include <algorithm>
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

#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/rendezvous/detail/socket.hpp"
#include "tandem/rendezvous/store.hpp"

namespace tandem {

/// Which layout of c10d's TCPStore protocol a C10dStore speaks (see the header comment).
enum class C10dProtocol {
  automatic,  ///< found out on connecting
  legacy,     ///< PyTorch 1.13 to 2.1: no handshake, set = 0
  validated,  ///< PyTorch 2.2 and later: VALIDATE handshake, set = 1
};

/// "automatic", "legacy", "validated".
[[nodiscard]] inline const char* to_string(C10dProtocol protocol) noexcept {
  switch (protocol) {
    case C10dProtocol::automatic:
      return "automatic";
    case C10dProtocol::legacy:
      return "legacy (PyTorch 1.13-2.1)";
    case C10dProtocol::validated:
      return "validated (PyTorch 2.2+)";
  }
  return "?";
}

/// Where the c10d server is, how long to wait, and which protocol to speak.
struct C10dStoreOptions {
  std::string host = "127.0.0.1";     ///< the server's address (MASTER_ADDR under torchrun)
  std::uint16_t port = 29500;         ///< the server's port (MASTER_PORT under torchrun)
  Timeout timeout = default_timeout;  ///< default timeout of get(), wait() and connecting
  C10dProtocol protocol = C10dProtocol::automatic;  ///< automatic: found on connecting
};

namespace detail::c10d {

/// What validated servers check in the first request of every connection.
inline constexpr std::uint32_t validation_magic = 0x3C85F7CEu;

/// The operations tandem sends, mapped to each layout's opcode by opcode().
enum class Op {
  validate,
  set,
  compare_set,
  get,
  add,
  check,
  wait,
  num_keys,
  watch_key,
  delete_key
};

inline std::uint8_t opcode(C10dProtocol protocol, Op op, bool legacy_has_watch_key = true) {
  if (protocol == C10dProtocol::validated) {
    switch (op) {
      case Op::validate:
        return 0;
      case Op::set:
        return 1;
      case Op::compare_set:
        return 2;
      case Op::get:
        return 3;
      case Op::add:
        return 4;
      case Op::check:
        return 5;
      case Op::wait:
        return 6;
      case Op::num_keys:
        return 7;
      case Op::delete_key:
        return 8;
      case Op::watch_key:
        break;
    }
    throw Error("C10dStore", "internal: no such opcode in the validated protocol");
  }
  switch (op) {
    case Op::set:
      return 0;
    case Op::compare_set:
      return 1;
    case Op::get:
      return 2;
    case Op::add:
      return 3;
    case Op::check:
      return 4;
    case Op::wait:
      return 5;
    case Op::num_keys:
      return 6;
    case Op::watch_key:
      return 7;
    case Op::delete_key:
      return legacy_has_watch_key ? 8 : 7;
    case Op::validate:
      break;
  }
  throw Error("C10dStore", "internal: no such opcode in the legacy protocol");
}

inline void put_bytes(std::string& out, std::string_view bytes) {
  detail::append_u64(out, bytes.size());
  out.append(bytes);
}

/// PyTorch's TCPStore client puts "/" before every key; so does C10dStore, so that a key set by
/// tandem is the key a Python TCPStore client reads.
inline constexpr std::string_view key_prefix = "/";

inline void put_key(std::string& out, std::string_view key) {
  detail::append_u64(out, key_prefix.size() + key.size());
  out.append(key_prefix);
  out.append(key);
}

/// The probe of C10dProtocol::automatic: VALIDATE, the magic, four validated num_keys.
inline std::string probe_request() {
  std::string out(1, static_cast<char>(opcode(C10dProtocol::validated, Op::validate)));
  detail::append_u32(out, validation_magic);
  out.append(4, static_cast<char>(opcode(C10dProtocol::validated, Op::num_keys)));
  return out;
}

/// The largest value or key tandem sends: libuv servers (PyTorch 2.4+) refuse payloads above
/// 8 MiB and keys above 8 KiB by closing the connection.
inline constexpr std::size_t max_value_bytes = std::size_t{8} << 20;
inline constexpr std::size_t max_key_bytes = std::size_t{8} << 10;

}  // namespace detail::c10d

/// A Store on a c10d TCPStore server (PyTorch's, e.g. torchrun's agent store). A client only: it
/// never hosts. Copies share one connection (and its lock); every call is bounded by a timeout.
/// A connection that failed or timed out mid-request is dropped and opened again on the next
/// call (the server forgets a dropped connection's pending wait), so the stream never gets out
/// of step. Keys are at most 8 KiB and values 8 MiB (the limits of PyTorch's libuv server).
/// add() on a value that is not an integer makes the server drop the connection: an Error here.
class C10dStore {
 public:
  /// Opts in as a tandem::Store.
  using store_concept = store_tag;

  /// Connects to the server (retrying until options.timeout) and settles the protocol.
  explicit C10dStore(C10dStoreOptions options) : state_(std::make_shared<State>()) {
    state_->options = std::move(options);
    std::lock_guard lock(state_->mutex);
    if (state_->options.protocol == C10dProtocol::automatic) {
      state_->options.protocol = detect(state_->options.timeout);
    }
    connect_locked(Deadline(state_->options.timeout));
    if (state_->options.protocol == C10dProtocol::legacy) {
      // No handshake to fail: a num_keys round trip shows that the server speaks this layout.
      num_keys_locked(Deadline(state_->options.timeout));
    }
  }

  /// The protocol in use (never `automatic` once constructed).
  [[nodiscard]] C10dProtocol protocol() const { return state_->options.protocol; }
  /// "host:port" of the server.
  [[nodiscard]] std::string endpoint() const {
    return state_->options.host + ":" + std::to_string(state_->options.port);
  }

  /// Stores `value` under `key`, replacing what was there (Store requirement 2).
  void set(const std::string& key, std::string_view value) {
    check_sizes("set", key, value);
    std::string body = request(Op::set);
    detail::c10d::put_key(body, key);
    detail::c10d::put_bytes(body, value);
    std::lock_guard lock(state_->mutex);
    send_locked("set", body, Deadline(state_->options.timeout));
  }

  /// The value under `key`, waiting at most timeout() for the key to exist (requirement 3).
  [[nodiscard]] std::string get(const std::string& key) { return get(key, timeout()); }

  /// The value under `key`, waiting at most `timeout` for the key to exist.
  [[nodiscard]] std::string get(const std::string& key, Timeout timeout) {
    check_sizes("get", key, {});
    std::lock_guard lock(state_->mutex);
    if (!wait_locked("get", std::span(&key, 1), timeout)) {
      throw detail::get_timeout_error("C10dStore", key, timeout);
    }
    std::string body = request(Op::get);
    detail::c10d::put_key(body, key);
    const Deadline deadline(state_->options.timeout);
    send_locked("get", body, deadline);
    return receive_bytes_locked("get", deadline);
  }

  /// Atomically adds `delta` to the decimal counter under `key` (missing: 0); the new value
  /// (requirement 4). Overflow is not checked: the server adds as int64.
  std::int64_t add(const std::string& key, std::int64_t delta) {
    check_sizes("add", key, {});
    std::string body = request(Op::add);
    detail::c10d::put_key(body, key);
    detail::append_u64(body, static_cast<std::uint64_t>(delta));
    std::lock_guard lock(state_->mutex);
    const Deadline deadline(state_->options.timeout);
    send_locked("add", body, deadline);
    try {
      return static_cast<std::int64_t>(receive_u64_locked("add", deadline));
    } catch (const Error& error) {
      throw Error("C10dStore.add", error.cause() +
                                       " (the server drops a client whose add() meets "
                                       "a value that is not an integer: is '" +
                                       key + "' one?)");
    }
  }

  /// Sets `key` to `desired` when it holds `expected` (or is missing and `expected` is empty), as
  /// torch does; returns the value it holds then (requirement 5). PyTorch's classic server (1.13,
  /// and 2.x without libuv) does not wake a wait() on a key that compare_set creates: set the
  /// key again after it if another rank waits for it.
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired) {
    check_sizes("compare_set", key, expected);
    check_sizes("compare_set", key, desired);
    std::string body = request(Op::compare_set);
    detail::c10d::put_key(body, key);
    detail::c10d::put_bytes(body, expected);
    detail::c10d::put_bytes(body, desired);
    std::lock_guard lock(state_->mutex);
    const Deadline deadline(state_->options.timeout);
    send_locked("compare_set", body, deadline);
    return receive_bytes_locked("compare_set", deadline);
  }

  /// Blocks until every key exists, at most timeout() (requirement 6).
  void wait(std::span<const std::string> keys) { wait(keys, timeout()); }

  /// Blocks until every key exists, at most `timeout`; past it, an Error listing the keys still
  /// missing.
  void wait(std::span<const std::string> keys, Timeout timeout) {
    for (const auto& key : keys) check_sizes("wait", key, {});
    std::lock_guard lock(state_->mutex);
    if (wait_locked("wait", keys, timeout)) return;
    std::vector<std::string> missing;
    for (const auto& key : keys) {
      if (!check_locked(std::span(&key, 1))) missing.push_back(key);
    }
    if (missing.empty()) return;  // they arrived just after the timeout
    throw detail::wait_timeout_error("C10dStore", missing, timeout);
  }

  /// True when every key exists; never blocks but for the round trip (requirement 7).
  [[nodiscard]] bool check(std::span<const std::string> keys) {
    for (const auto& key : keys) check_sizes("check", key, {});
    std::lock_guard lock(state_->mutex);
    return check_locked(keys);
  }

  /// Removes `key`; says whether it was there (requirement 8). On a legacy server the first call
  /// finds out whether delete_key is opcode 8 (1.13, 2.0) or 7 (2.1), on a throw-away connection.
  bool delete_key(const std::string& key) {
    check_sizes("delete_key", key, {});
    std::lock_guard lock(state_->mutex);
    const Deadline deadline(state_->options.timeout);
    if (protocol() == C10dProtocol::legacy && !state_->legacy_has_watch_key) {
      state_->legacy_has_watch_key = legacy_watch_key_probe(deadline);
    }
    std::string body(1, static_cast<char>(detail::c10d::opcode(protocol(), Op::delete_key,
                                                               *state_->legacy_has_watch_key)));
    detail::c10d::put_key(body, key);
    send_locked("delete_key", body, deadline);
    return receive_u64_locked("delete_key", deadline) == 1;
  }

  /// Number of keys in the store, torchrun's own keys included (requirement 9).
  [[nodiscard]] std::int64_t num_keys() {
    std::lock_guard lock(state_->mutex);
    return num_keys_locked(Deadline(state_->options.timeout));
  }

  /// The default timeout of get() and wait().
  [[nodiscard]] Timeout timeout() const { return state_->options.timeout; }
  /// Changes the default timeout of get() and wait() (for every copy).
  void set_timeout(Timeout timeout) { state_->options.timeout = timeout; }

 private:
  using Op = detail::c10d::Op;

  struct State {
    std::mutex mutex;
    C10dStoreOptions options;
    detail::Fd fd;
    std::optional<bool> legacy_has_watch_key;
  };

  std::string request(Op op) const {
    return std::string(1, static_cast<char>(detail::c10d::opcode(protocol(), op)));
  }

  static void check_sizes(const char* op, const std::string& key, std::string_view value) {
    if (key.size() + detail::c10d::key_prefix.size() > detail::c10d::max_key_bytes) {
      throw Error(std::string("C10dStore.") + op,
                  "key of " + std::to_string(key.size()) + " bytes (c10d servers take 8 KiB)");
    }
    if (value.size() > detail::c10d::max_value_bytes) {
      throw Error(std::string("C10dStore.") + op,
                  "value of " + std::to_string(value.size()) + " bytes (c10d servers take 8 MiB)");
    }
  }

  Error failure(const char* op, const std::string& what, const detail::IoResult& result) {
    state_->fd.reset();  // never reuse a stream that may be out of step
    return Error(std::string("C10dStore.") + op,
                 what + " " + endpoint() + ": " + result.describe());
  }

  detail::Fd open(const Deadline& deadline) const {
    return detail::connect_tcp(state_->options.host, state_->options.port, deadline.remaining(),
                               "C10dStore");
  }

  void connect_locked(const Deadline& deadline) {
    state_->fd = open(deadline);
    if (protocol() == C10dProtocol::validated) {
      std::string hello(1, static_cast<char>(detail::c10d::opcode(protocol(), Op::validate)));
      detail::append_u32(hello, detail::c10d::validation_magic);
      if (auto r = detail::send_all(state_->fd.get(), hello.data(), hello.size(), deadline);
          !r.ok()) {
        throw failure("connect", "cannot validate with", r);
      }
    }
  }

  void send_locked(const char* op, const std::string& body, const Deadline& deadline) {
    if (!state_->fd) connect_locked(deadline);
    if (auto r = detail::send_all(state_->fd.get(), body.data(), body.size(), deadline); !r.ok()) {
      throw failure(op, "cannot send to", r);
    }
  }

  void receive_locked(const char* op, void* data, std::size_t size, const Deadline& deadline) {
    if (auto r = detail::recv_all(state_->fd.get(), data, size, deadline); !r.ok()) {
      throw failure(op, "no reply from", r);
    }
  }

  std::uint64_t receive_u64_locked(const char* op, const Deadline& deadline) {
    char bytes[8];
    receive_locked(op, bytes, sizeof bytes, deadline);
    return detail::load_u64(bytes);
  }

  std::uint8_t receive_u8_locked(const char* op, const Deadline& deadline) {
    char byte = 0;
    receive_locked(op, &byte, 1, deadline);
    return static_cast<std::uint8_t>(byte);
  }

  std::string receive_bytes_locked(const char* op, const Deadline& deadline) {
    const auto length = receive_u64_locked(op, deadline);
    if (length > detail::c10d::max_value_bytes) {
      state_->fd.reset();
      throw Error(std::string("C10dStore.") + op,
                  "a reply of " + std::to_string(length) + " bytes from " + endpoint());
    }
    std::string value(static_cast<std::size_t>(length), '\0');
    if (length > 0) receive_locked(op, value.data(), value.size(), deadline);
    return value;
  }

  /// Sends wait for `keys`; true once the server says they all exist, false at `timeout` (the
  /// connection is then dropped, which cancels the wait on the server).
  bool wait_locked(const char* op, std::span<const std::string> keys, Timeout timeout) {
    std::string body = request(Op::wait);
    detail::append_u64(body, keys.size());
    for (const auto& key : keys) detail::c10d::put_key(body, key);
    send_locked(op, body, Deadline(state_->options.timeout));
    const Deadline deadline(timeout);
    std::uint8_t answer = 0;
    char byte = 0;
    const auto r = detail::recv_all(state_->fd.get(), &byte, 1, deadline);
    if (r.status == detail::IoStatus::timed_out) {
      state_->fd.reset();
      return false;
    }
    if (!r.ok()) throw failure(op, "no reply from", r);
    answer = static_cast<std::uint8_t>(byte);
    if (answer != 0) {
      state_->fd.reset();
      throw Error(std::string("C10dStore.") + op,
                  "unexpected answer " + std::to_string(answer) + " to wait from " + endpoint());
    }
    return true;
  }

  bool check_locked(std::span<const std::string> keys) {
    std::string body = request(Op::check);
    detail::append_u64(body, keys.size());
    for (const auto& key : keys) detail::c10d::put_key(body, key);
    const Deadline deadline(state_->options.timeout);
    send_locked("check", body, deadline);
    const auto answer = receive_u8_locked("check", deadline);
    if (answer > 1) {
      state_->fd.reset();
      throw Error("C10dStore.check",
                  "unexpected answer " + std::to_string(answer) + " from " + endpoint());
    }
    return answer == 0;
  }

  std::int64_t num_keys_locked(const Deadline& deadline) {
    send_locked("num_keys", request(Op::num_keys), deadline);
    return static_cast<std::int64_t>(receive_u64_locked("num_keys", deadline));
  }

  /// The probe of the header comment, on its own connection.
  C10dProtocol detect(Timeout timeout) const {
    const Deadline deadline(timeout);
    detail::Fd probe = open(deadline);
    const std::string bytes = detail::c10d::probe_request();
    if (auto r = detail::send_all(probe.get(), bytes.data(), bytes.size(), deadline); !r.ok()) {
      throw Error("C10dStore", "cannot probe " + endpoint() + ": " + r.describe());
    }
    // Both kinds of server answer at once (four int64s, or a closed connection); one that says
    // nothing for a minute speaks something else.
    char reply[32];
    const auto r = detail::recv_all(
        probe.get(), reply, sizeof reply,
        Deadline(std::min<Timeout>(deadline.remaining(), std::chrono::minutes(1))));
    if (r.ok()) return C10dProtocol::validated;
    if (r.status == detail::IoStatus::closed) return C10dProtocol::legacy;
    throw Error("C10dStore",
                "the server at " + endpoint() +
                    " answered neither as a PyTorch 1.13-2.1 nor as a 2.2+ c10d TCPStore (" +
                    r.describe() + "); set the protocol (TANDEM_C10D_PROTOCOL=legacy|validated)");
  }

  /// Legacy servers: opcode 7 on a key nobody uses is watch_key on 1.13 and 2.0 (one byte back,
  /// 3 = callback registered) and delete_key on 2.1 (an int64 back, 0 = nothing deleted).
  bool legacy_watch_key_probe(const Deadline& deadline) const {
    detail::Fd probe = open(deadline);
    std::string body(1, static_cast<char>(detail::c10d::opcode(protocol(), Op::watch_key)));
    detail::c10d::put_bytes(body, "tandem/probe/watch_key/never-set");
    char first = 0;
    if (auto r = detail::send_all(probe.get(), body.data(), body.size(), deadline); !r.ok()) {
      throw Error("C10dStore.delete_key", "cannot probe " + endpoint() + ": " + r.describe());
    }
    if (auto r = detail::recv_all(probe.get(), &first, 1, deadline); !r.ok()) {
      throw Error("C10dStore.delete_key", "cannot probe " + endpoint() + ": " + r.describe());
    }
    return first == 3;
  }

  std::shared_ptr<State> state_;
};

static_assert(Store<C10dStore>);

}  // namespace tandem
