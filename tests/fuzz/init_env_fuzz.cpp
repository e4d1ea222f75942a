// init_method URLs and the launcher environment on hostile text: parse_int, World::from_env,
// parse_init_method and resolve_world either succeed with a result that keeps their promises
// (a World that validates, a port in 1-65535, an absolute file path, ranks as given) or throw
// tandem::Error; never anything else, and never more memory or time than the text is worth.
// The input's first line is the URL; every later line NAME=VALUE sets a variable of the
// environment the functions see (tests/fuzz/init_env.dict lists the names they read).
//
// fuzz-max-len: 2048
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "fuzz/fuzz_check.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/init_method.hpp"

namespace {

// What parse_int must answer: an optional sign, then only decimal digits, within int64.
std::optional<std::int64_t> integer_model(std::string_view text) {
  bool negative = false;
  if (!text.empty() && (text[0] == '+' || text[0] == '-')) {
    negative = text[0] == '-';
    text.remove_prefix(1);
  }
  if (text.empty()) return std::nullopt;
  const std::uint64_t limit = negative ? std::uint64_t{1} << 63 : (std::uint64_t{1} << 63) - 1;
  std::uint64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    const auto digit = static_cast<std::uint64_t>(c - '0');
    if (value > (limit - digit) / 10) return std::nullopt;
    value = value * 10 + digit;
  }
  // -2^63 has no positive counterpart: negate in unsigned arithmetic, then convert.
  return negative ? static_cast<std::int64_t>(~value + 1) : static_cast<std::int64_t>(value);
}

void check_world(const tandem::World& w) {
  w.validate();  // an Error here escapes: a World from_env returned must be valid
  FUZZ_CHECK(0 <= w.rank && w.rank < w.world_size);
  FUZZ_CHECK(0 <= w.local_rank && w.local_rank < w.local_world_size);
  FUZZ_CHECK(0 <= w.node_rank && w.node_rank < w.nnodes && w.nnodes <= w.world_size);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto newline = text.find('\n');
  const std::string_view url = text.substr(0, newline);
  std::map<std::string, std::string, std::less<>> variables;
  std::string_view rest = newline == std::string_view::npos ? "" : text.substr(newline + 1);
  while (!rest.empty()) {
    const auto end = rest.find('\n');
    const auto line = rest.substr(0, end);
    rest = end == std::string_view::npos ? "" : rest.substr(end + 1);
    const auto eq = line.find('=');
    if (eq != std::string_view::npos) {
      variables.insert_or_assign(std::string(line.substr(0, eq)), std::string(line.substr(eq + 1)));
    }
  }
  const tandem::EnvLookup env = [&](std::string_view name) -> std::optional<std::string> {
    const auto found = variables.find(name);
    if (found == variables.end()) return std::nullopt;
    return found->second;
  };

  for (const auto& [name, value] : variables) {
    FUZZ_CHECK(tandem::parse_int(value) == integer_model(value));
  }
  FUZZ_CHECK(tandem::parse_int(url) == integer_model(url));

  try {
    const tandem::World world = tandem::World::from_env(env);
    check_world(world);
    if (!tandem::World::launched(env)) FUZZ_CHECK(world.world_size == 1 && world.rank == 0);
    if (variables.contains("RANK")) FUZZ_CHECK(tandem::parse_int(variables["RANK"]) == world.rank);
  } catch (const tandem::Error&) {
  }

  std::optional<tandem::InitMethod> method;
  try {
    method = tandem::parse_init_method(url, env);
  } catch (const tandem::Error&) {
    return 0;
  }
  FUZZ_CHECK(method->url == url);
  switch (method->scheme) {
    case tandem::InitMethod::Scheme::env:
    case tandem::InitMethod::Scheme::tcp:
      FUZZ_CHECK(!method->host.empty());
      FUZZ_CHECK(method->port >= 1);
      break;
    case tandem::InitMethod::Scheme::file:
      FUZZ_CHECK(!method->path.empty() && method->path.front() == '/');
      break;
  }
  if (method->rank) FUZZ_CHECK(*method->rank >= 0);
  if (method->world_size) FUZZ_CHECK(*method->world_size >= 0);

  try {
    const tandem::World world = tandem::resolve_world(*method, std::nullopt, env);
    check_world(world);
    if (method->rank) FUZZ_CHECK(world.rank == *method->rank);
    if (method->world_size) FUZZ_CHECK(world.world_size == *method->world_size);
    // The same World passed in must be accepted as it is.
    const tandem::World again = tandem::resolve_world(*method, world, env);
    FUZZ_CHECK(again.rank == world.rank && again.world_size == world.world_size);
  } catch (const tandem::Error&) {
  }
  return 0;
}
