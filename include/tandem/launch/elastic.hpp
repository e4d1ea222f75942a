// tandem/launch/elastic.hpp - what torch's @record does for a Python script, for a C++ main:
// an exception that ends the program is printed and written to torchrun's error file
// (TORCHELASTIC_ERROR_FILE), so that torchrun's and tandemrun's failure summaries show tandem's
// message, the rank and the time instead of "<N/A>"; read_error_file() is the launcher's side;
// and the restart count torchrun gives each attempt.
//   int main(int argc, char** argv) {
//     return tandem::run_main([&] { ...; return 0; });   // 1 after an exception
//   }
// Needs: the standard library only (tandemrun sets the same variables as torchrun); the JSON of
// the error file is core/detail/json.hpp's.
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

#include "tandem/core/detail/json.hpp"
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

/// The message of a torchrun error file (what write_error_file or Python's `record` decorator
/// wrote): message.message, or message itself when it is a string ("TYPE: WHAT"). Nothing when the
/// file is missing, empty or in another layout. Never throws.
[[nodiscard]] inline std::optional<std::string> read_error_file(const std::string& path) noexcept {
  try {
    std::ifstream file(path, std::ios::binary);
    if (!file) return std::nullopt;
    const std::string text((std::istreambuf_iterator<char>(file)),
                           std::istreambuf_iterator<char>());
    const auto document = detail::parse_json(text);
    const detail::JsonValue* message = document ? document->find("message") : nullptr;
    if (message && message->kind == detail::JsonValue::Kind::object) {
      message = message->find("message");
    }
    if (!message) return std::nullopt;
    return message->as_string();
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
