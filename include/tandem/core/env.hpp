// tandem/core/env.hpp - reading environment variables with errors that name the variable.
// An EnvLookup lets tests (and embedders) supply their own environment instead of the process's.
//   auto port = tandem::env_int(tandem::process_env, "MASTER_PORT");   // std::optional<int64_t>
// Needs: the standard library only.
#pragma once

#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

#include "tandem/core/error.hpp"

namespace tandem {

/// Maps a variable name to its value, or nullopt when it is not set.
using EnvLookup = std::function<std::optional<std::string>(std::string_view name)>;

/// The process environment (std::getenv).
inline std::optional<std::string> process_env(std::string_view name) {
  const std::string key(name);
  if (const char* value = std::getenv(key.c_str())) return std::string(value);
  return std::nullopt;
}

/// Parses a whole string as a base-10 integer; nullopt when any character is not part of it.
inline std::optional<std::int64_t> parse_int(std::string_view text) {
  std::int64_t value = 0;
  const char* first = text.data();
  const char* last = text.data() + text.size();
  if (first != last && *first == '+') {
    ++first;  // "+3" is a number to a person, not to from_chars
    if (first != last && *first == '-') return std::nullopt;  // but "+-3" is not
  }
  const auto [end, ec] = std::from_chars(first, last, value);
  if (ec != std::errc() || end != last || first == last) return std::nullopt;
  return value;
}

/// The variable as an integer, nullopt when unset; a value that is not an integer is an Error
/// naming the variable ("tandem: environment: RANK='abc' is not an integer").
inline std::optional<std::int64_t> env_int(const EnvLookup& env, std::string_view name) {
  const auto text = env(name);
  if (!text) return std::nullopt;
  const auto value = parse_int(*text);
  if (!value) {
    throw Error("environment", std::string(name) + "='" + *text + "' is not an integer");
  }
  return value;
}

/// As env_int, and the value must lie in [low, high].
inline std::optional<std::int64_t> env_int_in(const EnvLookup& env, std::string_view name,
                                              std::int64_t low, std::int64_t high) {
  const auto value = env_int(env, name);
  if (value && (*value < low || *value > high)) {
    throw Error("environment", std::string(name) + "=" + std::to_string(*value) +
                                   " is out of range [" + std::to_string(low) + ", " +
                                   std::to_string(high) + "]");
  }
  return value;
}

}  // namespace tandem
