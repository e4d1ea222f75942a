// libFuzzer target: the TcpStore server's handling of one connection's bytes, without sockets.
// The input is what a client sends: frames are split off (next_frame), the first must be a
// hello with the token "fuzz", the rest are parsed (parse_request) and run on a table
// (execute), exactly as the server does. Checked: no crash, no read past the input, limits held,
// the table's byte count exact, and every request that parses re-encodes to its own bytes.
// Build and run by hand (tests/fuzz/run.sh does it for every target):
//   clang++ -std=c++20 -fsanitize=fuzzer,address,undefined -Iinclude -Itests/fuzz
//     tests/fuzz/tcp_store_frame_fuzz.cpp -o /tmp/tcp_store_frame_fuzz && /tmp/tcp_store_frame_fuzz
//     tests/fuzz/corpus/tcp_store_frame
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>

#include "fuzz_check.hpp"
#include "tandem/rendezvous/tcp_store.hpp"

namespace {

namespace wire = tandem::detail::tcp_store;

/// The body a client would send for `request` (the encoding TcpStore's methods use).
std::string encode(const wire::Request& request) {
  std::string body(1, static_cast<char>(request.op));
  const auto keys = [&] {
    tandem::detail::append_u32(body, static_cast<std::uint32_t>(request.keys.size()));
    for (const auto& key : request.keys) wire::put_string(body, key);
  };
  switch (request.op) {
    case wire::Op::set:
      wire::put_string(body, request.key);
      wire::put_string(body, request.value);
      break;
    case wire::Op::get:
    case wire::Op::add:
      wire::put_string(body, request.key);
      tandem::detail::append_u64(body, request.number);
      break;
    case wire::Op::compare_set:
      wire::put_string(body, request.key);
      wire::put_string(body, request.value);
      wire::put_string(body, request.desired);
      break;
    case wire::Op::wait:
      keys();
      tandem::detail::append_u64(body, request.number);
      break;
    case wire::Op::check:
      keys();
      break;
    case wire::Op::delete_key:
      wire::put_string(body, request.key);
      break;
    case wire::Op::num_keys:
      break;
    case wire::Op::hello:
      tandem::detail::append_u32(body, static_cast<std::uint32_t>(request.number));
      wire::put_string(body, request.value);
      break;
  }
  return body;
}

std::size_t table_bytes(const wire::Table& table, std::size_t keys_and_values) {
  return keys_and_values + table.size() * tandem::tcp_store_defaults::entry_overhead_bytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  tandem::TcpStoreLimits limits;
  limits.max_key_bytes = 64;
  limits.max_value_bytes = 512;
  limits.max_keys_per_request = 16;
  limits.max_store_bytes = 4096;
  constexpr std::size_t max_message_bytes = 2048;

  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  wire::Table table(limits.max_store_bytes);
  std::size_t keys_and_values = 0;  // tracked here to check the table's own count
  std::map<std::string, std::string, std::less<>> model;
  bool authenticated = false;
  for (;;) {
    const auto limit = authenticated ? max_message_bytes : wire::max_hello_bytes;
    const auto frame = wire::next_frame(bytes, limit);
    if (frame.kind == wire::Frame::Kind::need_more) break;
    if (frame.kind == wire::Frame::Kind::too_long) {
      FUZZ_CHECK(frame.length == 0 || frame.length > limit);
      break;  // the server replies "closing" and closes
    }
    FUZZ_CHECK(frame.consumed == 4 + frame.body.size() && frame.consumed <= bytes.size());
    FUZZ_CHECK(frame.body.size() == frame.length && frame.body.data() == bytes.data() + 4);
    bytes.remove_prefix(frame.consumed);

    const auto parsed = wire::parse_request(frame.body, limits);
    FUZZ_CHECK(parsed.request.has_value() == parsed.error.empty());
    FUZZ_CHECK(!parsed.fatal || !parsed.request);
    if (parsed.request) {
      const auto& request = *parsed.request;
      FUZZ_CHECK(encode(request) == frame.body);  // nothing invented, nothing dropped
      FUZZ_CHECK(request.key.size() <= limits.max_key_bytes);
      FUZZ_CHECK(request.value.size() <= std::max(limits.max_value_bytes, std::size_t{1024}));
      FUZZ_CHECK(request.desired.size() <= limits.max_value_bytes);
      FUZZ_CHECK(request.keys.size() <= limits.max_keys_per_request);
    }
    if (!authenticated) {
      const auto outcome = wire::check_hello(parsed, "fuzz");
      if (outcome.kind == wire::Outcome::Kind::close) {
        FUZZ_CHECK(outcome.status == wire::Status::closing);
        break;  // refused: nothing after it is read
      }
      FUZZ_CHECK(parsed.request && parsed.request->op == wire::Op::hello &&
                 parsed.request->value == "fuzz");
      authenticated = true;
      continue;
    }
    if (!parsed.request) {
      if (parsed.fatal) break;
      continue;
    }
    const auto& request = *parsed.request;
    const auto outcome = wire::execute(table, request);
    FUZZ_CHECK(outcome.fields.size() <= max_message_bytes + limits.max_value_bytes);
    // Mirror what was stored, to check the table's accounting and contents.
    for (const auto* key : {&request.key}) {
      const auto* now = table.find(*key);
      const auto before = model.find(*key);
      if (before != model.end()) keys_and_values -= before->first.size() + before->second.size();
      if (now != nullptr) {
        model.insert_or_assign(*key, *now);
        keys_and_values += key->size() + now->size();
      } else if (before != model.end()) {
        model.erase(before);
      }
    }
    FUZZ_CHECK(table.size() == model.size());
    FUZZ_CHECK(table.bytes() == table_bytes(table, keys_and_values));
    FUZZ_CHECK(table.bytes() <= limits.max_store_bytes);
    if (outcome.kind == wire::Outcome::Kind::close) break;
  }
  return 0;
}
