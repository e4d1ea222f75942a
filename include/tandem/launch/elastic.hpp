// tandem/launch/elastic.hpp - what torch's @record does for a Python script, for a C++ main:
// an exception that ends the program is printed and written to torchrun's error file
// (TORCHELASTIC_ERROR_FILE), so that torchrun's and tandemrun's failure summaries show tandem's
// message, the rank and the time instead of "<N/A>"; read_error_file() is the launcher's side;
// and the restart count torchrun gives each attempt.
//   int main(int argc, char** argv) {
//     return tandem::run_main([&] { ...; return 0; });   // 1 after an exception
//   }
// Needs: the standard library only (tandemrun sets the same variables as torchrun).
#pragma once

#include <cxxabi.h>

#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <typeinfo>
#include <utility>

#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"

namespace tandem {

/// Which attempt this is under a launcher that restarts failed jobs (torchrun or tandemrun with
/// --max-restarts): TORCHELASTIC_RESTART_COUNT, 0 for the first attempt or when it is unset.
[[nodiscard]] inline int restart_count(const EnvLookup& env = process_env) {
  const auto count = env_int_in(env, "TORCHELASTIC_RESTART_COUNT", 0, INT32_MAX);
  return count ? static_cast<int>(*count) : 0;
}

namespace detail {

/// `text` as a JSON string literal, quotes included.
inline std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (byte < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04x", byte);
          out += escaped;
        } else {
          out += c;  // UTF-8 passes through as it is
        }
    }
  }
  return out + "\"";
}

/// The readable name of the dynamic type of `e` ("tandem::Error", "std::bad_alloc").
inline std::string type_name(const std::exception& e) {
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> name(
      abi::__cxa_demangle(typeid(e).name(), nullptr, nullptr, &status), &std::free);
  return status == 0 && name ? std::string(name.get()) : std::string(typeid(e).name());
}

}  // namespace detail

/// The error file's text, in the layout torch.distributed.elastic writes and reads (1.13 and 2.x,
/// errors/error_handler.py): {"message": {"message": "TYPE: WHAT", "extraInfo": {"py_callstack":
/// TRACE, "timestamp": "SECONDS"}}}. torchrun's summary shows py_callstack as the "traceback".
[[nodiscard]] inline std::string error_file_json(std::string_view type, std::string_view what,
                                                 std::string_view trace,
                                                 std::int64_t unix_seconds) {
  return "{\"message\": {\"message\": " +
         detail::json_string(std::string(type) + ": " + std::string(what)) +
         ", \"extraInfo\": {\"py_callstack\": " + detail::json_string(trace) +
         ", \"timestamp\": " + detail::json_string(std::to_string(unix_seconds)) + "}}}\n";
}

/// Writes torchrun's error file for an exception of type `type` saying `what` when
/// TORCHELASTIC_ERROR_FILE is set; true when it wrote one. Never throws.
inline bool write_error_file(std::string_view type, std::string_view what,
                             const EnvLookup& env = process_env) noexcept {
  try {
    const auto path = env("TORCHELASTIC_ERROR_FILE");
    if (!path || path->empty()) return false;
    const auto now = std::chrono::duration_cast<std::chrono::seconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
    const std::string trace = std::string(what) + "\n(" + std::string(type) +
                              " thrown by a C++ program; no Python traceback)";
    std::ofstream file(*path, std::ios::binary | std::ios::trunc);
    file << error_file_json(type, what, trace, now);
    file.close();
    if (!file) {
      std::fprintf(stderr, "tandem: cannot write the error file %s\n", path->c_str());
      return false;
    }
    return true;
  } catch (...) {
    return false;
  }
}

namespace detail {

/// Just enough JSON to take strings out of nested objects (an error file's "message"): a
/// recursive-descent walk that skips every value it is not asked for. Malformed text, or nesting
/// deeper than max_depth, makes every call return nothing.
class JsonWalk {
 public:
  explicit JsonWalk(std::string_view text) : text_(text) {}

  /// The string member `key` of the object at the current position, or, when `inner` is given
  /// and that member is an object, the string member `inner` of it. Leaves the position anywhere.
  std::optional<std::string> member_string(std::string_view key, std::string_view inner = {}) {
    if (!consume('{')) return std::nullopt;
    if (consume('}')) return std::nullopt;
    for (;;) {
      auto name = string();
      if (!name || !consume(':')) return std::nullopt;
      skip_space();
      if (*name == key) {
        if (peek() == '"') return string();
        if (!inner.empty() && peek() == '{') return member_string(inner);
      }
      if (!skip_value(0)) return std::nullopt;
      if (consume('}')) return std::nullopt;
      if (!consume(',')) return std::nullopt;
    }
  }

 private:
  static constexpr int max_depth = 64;

  void skip_space() {
    while (at_ < text_.size() &&
           (text_[at_] == ' ' || text_[at_] == '\n' || text_[at_] == '\r' || text_[at_] == '\t')) {
      ++at_;
    }
  }
  char peek() const { return at_ < text_.size() ? text_[at_] : '\0'; }
  bool consume(char c) {
    skip_space();
    if (peek() != c) return false;
    ++at_;
    return true;
  }

  std::optional<unsigned> hex4() {
    if (text_.size() - at_ < 4) return std::nullopt;
    unsigned value = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[at_++];
      value <<= 4;
      if (c >= '0' && c <= '9')
        value |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f')
        value |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        value |= static_cast<unsigned>(c - 'A' + 10);
      else
        return std::nullopt;
    }
    return value;
  }

  static void append_utf8(std::string& out, unsigned code) {
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xC0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else if (code < 0x10000) {
      out += static_cast<char>(0xE0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (code >> 18));
      out += static_cast<char>(0x80 | ((code >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    }
  }

  std::optional<std::string> string() {
    if (!consume('"')) return std::nullopt;
    std::string out;
    while (at_ < text_.size()) {
      const char c = text_[at_++];
      if (c == '"') return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_ >= text_.size()) return std::nullopt;
      switch (const char escaped = text_[at_++]) {
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'u': {
          auto code = hex4();
          if (!code) return std::nullopt;
          // A surrogate pair (how Python's json writes characters beyond the BMP).
          if (*code >= 0xD800 && *code < 0xDC00 && text_.substr(at_, 2) == "\\u") {
            at_ += 2;
            const auto low = hex4();
            if (!low || *low < 0xDC00 || *low >= 0xE000) return std::nullopt;
            code = 0x10000 + ((*code - 0xD800) << 10) + (*low - 0xDC00);
          }
          append_utf8(out, *code);
          break;
        }
        default:
          out += escaped;  // '"', '\\' and '/'
      }
    }
    return std::nullopt;
  }

  bool skip_value(int depth) {
    if (depth > max_depth) return false;
    skip_space();
    const char c = peek();
    if (c == '"') return string().has_value();
    if (c == '{' || c == '[') {
      const char close = c == '{' ? '}' : ']';
      ++at_;
      if (consume(close)) return true;
      for (;;) {
        if (c == '{' && (!string() || !consume(':'))) return false;
        if (!skip_value(depth + 1)) return false;
        if (consume(close)) return true;
        if (!consume(',')) return false;
      }
    }
    // A number, true, false or null: up to the next delimiter.
    const auto start = at_;
    while (at_ < text_.size() &&
           std::string_view(",}] \n\r\t").find(text_[at_]) == std::string_view::npos) {
      ++at_;
    }
    return at_ > start;
  }

  std::string_view text_;
  std::size_t at_ = 0;
};

}  // namespace detail

/// The message of a torchrun error file (what write_error_file or Python's `record` decorator
/// wrote): message.message, or message itself when it is a string ("TYPE: WHAT"). Nothing when the
/// file is missing, empty or in another layout. Never throws.
[[nodiscard]] inline std::optional<std::string> read_error_file(const std::string& path) noexcept {
  try {
    std::ifstream file(path, std::ios::binary);
    if (!file) return std::nullopt;
    const std::string text((std::istreambuf_iterator<char>(file)),
                           std::istreambuf_iterator<char>());
    return detail::JsonWalk(text).member_string("message", "message");
  } catch (...) {
    return std::nullopt;
  }
}

/// Runs a program's body, the C++ analogue of torch's `@record`: returns what the body returns (0
/// for a body returning void); when an exception escapes, prints it on stderr, writes the
/// error file torchrun asked for (TORCHELASTIC_ERROR_FILE) and returns 1.
template <class Body>
requires std::invocable<Body&>
int run_main(Body&& body, const EnvLookup& env = process_env) {
  auto fail = [&](const std::string& type, const std::string& what) {
    std::fprintf(stderr, "%s\n", what.c_str());
    std::fflush(stderr);
    write_error_file(type, what, env);
    return 1;
  };
  try {
    if constexpr (std::is_void_v<std::invoke_result_t<Body&>>) {
      body();
      return 0;
    } else {
      return static_cast<int>(body());
    }
  } catch (const Error& error) {
    return fail("tandem::Error", error.what());
  } catch (const std::exception& e) {
    const std::string type = detail::type_name(e);
    return fail(type, "tandem: uncaught " + type + ": " + e.what());
  } catch (...) {
    return fail("unknown exception", "tandem: uncaught exception of unknown type");
  }
}

}  // namespace tandem
