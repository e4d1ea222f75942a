// tandem/rendezvous/tcp_protocol.hpp - the TcpStore's limits (TcpStoreLimits and their defaults)
// and its wire protocol: frames, requests, replies, and the parser the server runs on every
// request (bounded by the limits, so a hostile peer cannot make it allocate without end).
//   auto parsed = tandem::detail::tcp_store::parse_request(body, tandem::TcpStoreLimits{});
// Needs: the standard library. The server is in tcp_server.hpp, the client in tcp_store.hpp.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/rendezvous/store.hpp"

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
inline constexpr Timeout notice_interval = std::chrono::seconds(10);
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

/// Reads one request's fields against the limits. A field over its limit is skipped and the
/// first such is remembered (the request is refused once the body is known to be well formed);
/// a key count the body cannot hold makes the body malformed.
class RequestFields {
 public:
  RequestFields(std::string_view body, const TcpStoreLimits& limits) : in_(body), limits_(limits) {}

  [[nodiscard]] Reader& in() noexcept { return in_; }
  [[nodiscard]] const std::string& too_long() const noexcept { return too_long_; }
  [[nodiscard]] bool bad_count() const noexcept { return bad_count_; }
  /// The key count alone was over max_keys_per_request: refused without reading the keys.
  [[nodiscard]] bool count_refused() const noexcept { return count_refused_; }

  void field(std::string& out, std::size_t limit, const char* what) {
    const auto bytes = in_.view();
    if (!in_.good()) return;
    if (bytes.size() > limit) {
      if (too_long_.empty()) {
        too_long_ = std::string(what) + " of " + std::to_string(bytes.size()) +
                    " bytes exceeds the store's limit of " + std::to_string(limit) + " bytes";
      }
      return;
    }
    out.assign(bytes);
  }
  void key(std::string& out) { field(out, limits_.max_key_bytes, "a key"); }
  void value(std::string& out) { field(out, limits_.max_value_bytes, "a value"); }

  void key_list(std::vector<std::string>& keys) {
    const auto count = in_.u32();
    if (!in_.good()) return;
    if (count > limits_.max_keys_per_request) {
      too_long_ = std::to_string(count) + " keys in one request exceed the store's limit of " +
                  std::to_string(limits_.max_keys_per_request);
      count_refused_ = true;
      return;
    }
    if (count > in_.left() / 4) {  // each key takes at least its 4-byte length
      bad_count_ = true;
      return;
    }
    keys.reserve(count);
    for (std::uint32_t i = 0; i < count && in_.good(); ++i) {
      std::string one;
      key(one);
      keys.push_back(std::move(one));
    }
  }

 private:
  Reader in_;
  const TcpStoreLimits& limits_;
  std::string too_long_;
  bool bad_count_ = false;
  bool count_refused_ = false;
};

/// The fields of `request.op`, in the order the wire protocol (Op) lists them.
inline void read_fields(RequestFields& fields, Request& request) {
  switch (request.op) {
    case Op::set:
      fields.key(request.key);
      fields.value(request.value);
      break;
    case Op::get:
    case Op::add:
      fields.key(request.key);
      request.number = fields.in().u64();
      break;
    case Op::compare_set:
      fields.key(request.key);
      fields.value(request.value);
      fields.value(request.desired);
      break;
    case Op::wait:
      fields.key_list(request.keys);
      if (!fields.count_refused()) request.number = fields.in().u64();
      break;
    case Op::check:
      fields.key_list(request.keys);
      break;
    case Op::delete_key:
      fields.key(request.key);
      break;
    case Op::num_keys:
      break;
    case Op::hello:
      request.number = fields.in().u32();
      fields.field(request.value, tcp_store_defaults::max_token_bytes, "a token");
      break;
  }
}

/// Parses one request body against `limits`. Pure: no state, and nothing is allocated from a
/// length or count before it is checked against the body's size and the limits.
inline Parsed parse_request(std::string_view body, const TcpStoreLimits& limits) {
  Parsed parsed;
  const auto malformed = [&](std::string why) {
    parsed.error = "malformed request: " + std::move(why);
    parsed.fatal = true;
    return parsed;
  };
  const auto refused = [&](std::string why) {
    parsed.error = std::move(why);
    return parsed;
  };
  RequestFields fields(body, limits);
  const auto opcode = fields.in().u8();
  if (!fields.in().good() || opcode < static_cast<std::uint8_t>(Op::set) ||
      opcode > static_cast<std::uint8_t>(Op::hello)) {
    return malformed("unknown operation " + std::to_string(opcode));
  }
  Request request;
  request.op = static_cast<Op>(opcode);
  read_fields(fields, request);
  if (fields.count_refused()) return refused(fields.too_long());
  if (fields.bad_count()) return malformed("more keys than the message can hold");
  if (!fields.in().good()) return malformed("a field runs past the end of the message");
  if (!fields.in().at_end()) return malformed("bytes left after the last field");
  if (!fields.too_long().empty()) return refused(fields.too_long());
  parsed.request = std::move(request);
  return parsed;
}

}  // namespace detail::tcp_store

}  // namespace tandem
