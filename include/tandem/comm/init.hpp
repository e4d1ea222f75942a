// tandem/comm/init.hpp - init_process_group: ranks meet through a store (rank 0 hosts a TcpStore
// for env:// and tcp://, a shared file for file://), check they agree, then start a backend.
//   auto comm = tandem::init_process_group<tandem::LocalComm>(world, "tcp://127.0.0.1:29500");
//   auto comm = tandem::init_process_group<Backend>();   // env:// with torchrun's variables
// Needs: POSIX sockets and files (Linux).
#pragma once

#include <unistd.h>
#include <atomic>
#include <concepts>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/file_store.hpp"
#include "tandem/comm/init_method.hpp"
#include "tandem/comm/store.hpp"
#include "tandem/comm/tcp_store.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"

namespace tandem {

/// A backend that init_process_group can start:
/// 1. it is a Communicator;
/// 2. `options_type` holds its settings, among them a `timeout`, which the rendezvous uses too;
/// 3. `B::rendezvous(world, store, options)` builds this rank's communicator once every rank has
///    joined `store` (a namespace of its own in the job's store; keep a copy to use it later).
template <class B>
concept ProcessGroupBackend = Communicator<B> &&
    requires(const World& world, AnyStore& store, const typename B::options_type& options) {
  { options.timeout } -> std::convertible_to<Timeout>;
  { B::rendezvous(world, store, options) } -> std::same_as<B>;
};

/// Opens the job's store for this rank: rank 0 hosts a TcpStore server for env:// and tcp://
/// and every rank connects to it; for file:// every rank opens the file.
inline AnyStore open_store(const InitMethod& method, const World& world, Timeout timeout) {
  if (method.scheme == InitMethod::Scheme::file) {
    return AnyStore(FileStore(method.path, FileStoreOptions{.timeout = timeout}));
  }
  TcpStoreOptions options;
  options.host = method.host;
  options.port = method.port;
  options.is_server = world.rank == 0;
  options.timeout = timeout;
  return AnyStore(TcpStore(options));
}

namespace detail {

/// host:pid#n, unique to one join: two threads of one process claiming one rank must differ.
inline std::string join_token() {
  static std::atomic<std::uint64_t> joins{0};
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '?';
  return std::string(host) + ":" + std::to_string(::getpid()) + "#" + std::to_string(joins++);
}

inline std::string join_ranks(const std::vector<int>& ranks) {
  std::string text;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i == 8) return text + ", ... (" + std::to_string(ranks.size()) + " in all)";
    text += (i ? ", " : "") + std::to_string(ranks[i]);
  }
  return text;
}

/// Waits until every rank has set `prefix + r`; the Error lists the ranks that did not.
inline void wait_for_ranks(AnyStore& store, const World& world, const std::string& prefix,
                           Timeout timeout, const std::string& url, std::string_view what) {
  std::vector<std::string> keys;
  for (int r = 0; r < world.world_size; ++r) keys.push_back(prefix + std::to_string(r));
  std::vector<int> missing;
  try {
    store.wait(keys, timeout);
    return;
  } catch (const Error& waiting) {
    try {
      for (int r = 0; r < world.world_size; ++r) {
        if (!store.check(std::span(&keys[static_cast<std::size_t>(r)], 1))) missing.push_back(r);
      }
    } catch (const Error& checking) {
      // The store itself is gone: on env:// and tcp:// its host, rank 0, has failed or given up.
      throw Error(world.rank, "init_process_group",
                  "lost the store at " + url +
                      " while waiting for the other ranks (on env:// and tcp:// rank 0 hosts "
                      "it; it has probably failed or timed out): " +
                      checking.cause());
    }
    if (missing.empty()) throw;
  }
  throw Error(world.rank, "init_process_group",
              "rank(s) " + join_ranks(missing) + " did not " + std::string(what) + " " + url +
                  " within " + describe(timeout));
}

}  // namespace detail

/// Every rank announces itself under "tandem/init/" and waits for the others. Two processes
/// claiming one rank, or ranks that disagree on the world size, are Errors on the rank that
/// notices; a rank missing at the timeout is named in the Error of every rank that waited.
inline void join_store(AnyStore& store, const World& world, Timeout timeout,
                       const std::string& url) {
  const std::string size = std::to_string(world.world_size);
  const std::string agreed = store.compare_set("tandem/init/world_size", "", size);
  if (agreed != size) {
    throw Error(world.rank, "init_process_group",
                "this rank has world_size=" + size + " but ranks that joined " + url +
                    " earlier have world_size=" + agreed);
  }
  const std::string token = detail::join_token();
  const std::string key = "tandem/init/rank/" + std::to_string(world.rank);
  const std::string holder = store.compare_set(key, "", token);
  if (holder != token) {
    throw Error(world.rank, "init_process_group",
                "rank " + std::to_string(world.rank) + " joined " + url +
                    " twice: it is already held by " + holder +
                    " (two processes with one RANK, or a file:// store reused by a live job)");
  }
  detail::wait_for_ranks(store, world, "tandem/init/rank/", timeout, url, "join");
}

/// Starts backend B for `world`, meeting the other ranks at `url` (env://, tcp://HOST:PORT or
/// file:///PATH; see parse_init_method). Rank 0 keeps the store alive until every rank has
/// finished the backend's rendezvous, so no rank loses the store half-way.
template <ProcessGroupBackend B>
[[nodiscard]] B init_process_group(const World& world, std::string_view url = "env://",
                                   const typename B::options_type& options = {},
                                   const EnvLookup& env = process_env) {
  const InitMethod method = parse_init_method(url, env);
  const World resolved = resolve_world(method, world, env);
  AnyStore store = open_store(method, resolved, options.timeout);
  join_store(store, resolved, options.timeout, method.url);
  AnyStore backend_store(PrefixStore<AnyStore>("tandem/backend", store));
  B comm = B::rendezvous(resolved, backend_store, options);
  store.set("tandem/init/ready/" + std::to_string(resolved.rank), "1");
  if (resolved.rank == 0) {
    detail::wait_for_ranks(store, resolved, "tandem/init/ready/", options.timeout, method.url,
                           "finish the rendezvous at");
  }
  return comm;
}

/// As above, with the World taken from the launcher's variables (torchrun, tandemrun, Slurm,
/// OpenMPI, MPICH) or from ?rank=R&world_size=N in the URL.
template <ProcessGroupBackend B>
[[nodiscard]] B init_process_group(std::string_view url = "env://",
                                   const typename B::options_type& options = {},
                                   const EnvLookup& env = process_env) {
  const InitMethod method = parse_init_method(url, env);
  return init_process_group<B>(resolve_world(method, std::nullopt, env), url, options, env);
}

}  // namespace tandem
