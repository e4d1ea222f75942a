// tandem/rendezvous/init_method.hpp - parses the init_method URL of init_process_group (env://,
// tcp://HOST:PORT, file:///PATH, each with optional ?rank=R&world_size=N) and settles the World.
//   auto method = tandem::parse_init_method("tcp://10.0.0.1:29500?world_size=8");
//   tandem::World world = tandem::resolve_world(method, std::nullopt);
// Needs: the standard library.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/world.hpp"

namespace tandem {

/// Where the ranks of a job meet: a TCP store hosted by rank 0, or a shared file.
struct InitMethod {
  /// How the ranks meet: env:// (MASTER_ADDR and MASTER_PORT), tcp://host:port, or file:///path.
  enum class Scheme { env, tcp, file };

  /// Which of the three the URL named.
  Scheme scheme = Scheme::env;
  std::string host;               ///< env, tcp: the address rank 0 listens on and the others reach
  std::uint16_t port = 0;         ///< env, tcp
  std::string path;               ///< file: an absolute path
  std::optional<int> rank;        ///< from ?rank=
  std::optional<int> world_size;  ///< from ?world_size=
  std::string url;                ///< as given, for messages
};

namespace detail {

[[noreturn]] inline void bad_init_method(std::string_view url, const std::string& why) {
  throw Error("init_process_group", "init_method '" + std::string(url) + "': " + why);
}

inline std::uint16_t parse_port(std::string_view url, std::string_view text,
                                std::string_view what) {
  const auto port = parse_int(text);
  if (!port || *port < 1 || *port > 65535) {
    bad_init_method(
        url, std::string(what) + " '" + std::string(text) + "' is not a port number (1-65535)");
  }
  return static_cast<std::uint16_t>(*port);
}

/// "host:port" or "[v6 address]:port".
inline void parse_host_port(std::string_view url, std::string_view authority, InitMethod& method) {
  std::string_view host;
  std::string_view port;
  if (authority.starts_with('[')) {
    const auto close = authority.find(']');
    if (close == std::string_view::npos) bad_init_method(url, "'[' without ']' in the host");
    host = authority.substr(1, close - 1);
    const auto rest = authority.substr(close + 1);
    if (!rest.starts_with(':')) bad_init_method(url, "no port: expected tcp://[ADDRESS]:PORT");
    port = rest.substr(1);
  } else {
    const auto colon = authority.rfind(':');
    if (colon == std::string_view::npos) bad_init_method(url, "no port: expected tcp://HOST:PORT");
    host = authority.substr(0, colon);
    port = authority.substr(colon + 1);
  }
  if (host.empty()) bad_init_method(url, "no host: expected tcp://HOST:PORT");
  method.host = std::string(host);
  method.port = parse_port(url, port, "port");
}

inline void parse_query(std::string_view url, std::string_view query, InitMethod& method) {
  while (!query.empty()) {
    const auto amp = query.find('&');
    const auto item = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view{} : query.substr(amp + 1);
    if (item.empty()) continue;
    const auto eq = item.find('=');
    if (eq == std::string_view::npos)
      bad_init_method(url, "query parameter '" + std::string(item) + "' has no value");
    const auto key = item.substr(0, eq);
    const auto text = item.substr(eq + 1);
    std::optional<int>* slot = nullptr;
    if (key == "rank") slot = &method.rank;
    if (key == "world_size") slot = &method.world_size;
    if (!slot) {
      bad_init_method(
          url, "unknown query parameter '" + std::string(key) + "' (known: rank, world_size)");
    }
    const auto value = parse_int(text);
    if (!value || *value < 0 || *value > INT32_MAX) {
      bad_init_method(
          url, std::string(key) + "='" + std::string(text) + "' is not a non-negative integer");
    }
    *slot = static_cast<int>(*value);
  }
}

}  // namespace detail

/// Parses an init_method. env:// takes MASTER_ADDR and MASTER_PORT from `env`; a missing piece is
/// an Error naming the variable or query parameter that would supply it.
inline InitMethod parse_init_method(std::string_view url, const EnvLookup& env = process_env) {
  InitMethod method;
  method.url = std::string(url);
  const auto question = url.find('?');
  const auto base = url.substr(0, question);
  if (question != std::string_view::npos)
    detail::parse_query(url, url.substr(question + 1), method);

  if (base == "env://" || base == "env:") {
    method.scheme = InitMethod::Scheme::env;
    const auto addr = env("MASTER_ADDR");
    if (!addr || addr->empty()) {
      detail::bad_init_method(url,
                              "MASTER_ADDR is not set (tandemrun and torchrun set it; or use "
                              "tcp://HOST:PORT)");
    }
    const auto port = env("MASTER_PORT");
    if (!port) {
      detail::bad_init_method(url,
                              "MASTER_PORT is not set (tandemrun and torchrun set it; or use "
                              "tcp://HOST:PORT)");
    }
    method.host = *addr;
    method.port = detail::parse_port(url, *port, "MASTER_PORT");
  } else if (base.starts_with("tcp://")) {
    method.scheme = InitMethod::Scheme::tcp;
    auto authority = base.substr(6);
    if (authority.ends_with('/')) authority.remove_suffix(1);
    detail::parse_host_port(url, authority, method);
  } else if (base.starts_with("file://")) {
    method.scheme = InitMethod::Scheme::file;
    method.path = std::string(base.substr(7));
    if (method.path.empty() || method.path.front() != '/') {
      detail::bad_init_method(url, "the path must be absolute: file:///PATH (three slashes)");
    }
  } else {
    detail::bad_init_method(url, "unknown scheme; use env://, tcp://HOST:PORT or file:///PATH");
  }
  return method;
}

/// The World of this rank: `given` if there is one, else the launcher's variables
/// (World::from_env), else ?rank= and ?world_size= (one node). Query parameters present beside a
/// World or launcher variables must agree with them; a rank or world size that no source supplies
/// is an Error saying where to supply it.
inline World resolve_world(const InitMethod& method, const std::optional<World>& given,
                           const EnvLookup& env = process_env) {
  auto agree = [&](const World& world, std::string_view source) {
    auto check = [&](const std::optional<int>& query, int value, std::string_view name) {
      if (query && *query != value) {
        detail::bad_init_method(method.url, "?" + std::string(name) + "=" + std::to_string(*query) +
                                                " disagrees with " + std::string(source) + " (" +
                                                std::string(name) + "=" + std::to_string(value) +
                                                ")");
      }
    };
    check(method.rank, world.rank, "rank");
    check(method.world_size, world.world_size, "world_size");
    return world;
  };

  if (given) {
    given->validate();
    return agree(*given, "the World passed in");
  }
  if (World::launched(env)) return agree(World::from_env(env), "the launcher's variables");

  if (!method.rank) {
    detail::bad_init_method(method.url,
                            "rank is unknown: set RANK (tandemrun and torchrun do), "
                            "add ?rank=R, or pass a World");
  }
  if (!method.world_size) {
    detail::bad_init_method(method.url,
                            "world size is unknown: set WORLD_SIZE (tandemrun and "
                            "torchrun do), add ?world_size=N, or pass a World");
  }
  try {
    return World::single_node(*method.rank, *method.world_size);
  } catch (const Error& error) {
    detail::bad_init_method(method.url, error.cause());
  }
}

}  // namespace tandem
