// tandem/launch/elastic.hpp - what torch's @record does for a Python script, for a C++ main:
// an exception that ends the program is printed and written to torchrun's error file
// (TORCHELASTIC_ERROR_FILE), so that torchrun's failure summary shows tandem's message, the rank
// and the time instead of "<N/A>"; and the restart count torchrun gives each attempt.
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
#include <memory>
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
