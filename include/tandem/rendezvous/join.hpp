// tandem/rendezvous/join.hpp - how the ranks of a job meet in a store before a backend starts:
// open_store picks the store an init method names (rank 0 hosts a TcpStore for env:// and tcp://,
// a shared file for file://, torchrun's c10d store under its agent), join_store has every rank
// announce itself and wait for the others, naming the ranks that never came.
//   tandem::AnyStore store = tandem::open_store(tandem::parse_init_method(url), world, timeout);
//   tandem::join_store(store, world, timeout, url);
// Needs: POSIX sockets and files (Linux).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/c10d_store.hpp"
#include "tandem/rendezvous/file_store.hpp"
#include "tandem/rendezvous/init_method.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/rendezvous/tcp_store.hpp"

namespace tandem {

namespace detail {

/// How often a waiting rank (or a client connecting to the TcpStore) says so: TANDEM_WAIT_NOTICE_S
/// seconds (default 30; 0: never).
inline Timeout wait_notice_interval(const EnvLookup& env = process_env) {
  const auto seconds = env_int_in(env, "TANDEM_WAIT_NOTICE_S", 0, 24 * 3600);
  if (!seconds) return std::chrono::seconds(30);
  if (*seconds == 0) return Timeout::max();
  return std::chrono::seconds(*seconds);
}

}  // namespace detail

/// True when torchrun's agent hosts the job's store on MASTER_ADDR:MASTER_PORT
/// (TORCHELASTIC_USE_AGENT_STORE=True): the ranks are then its clients, and none hosts one.
inline bool use_agent_store(const EnvLookup& env = process_env) {
  const auto value = env("TORCHELASTIC_USE_AGENT_STORE");
  return value && *value == "True";
}

/// The protocol C10dStore speaks: TANDEM_C10D_PROTOCOL=auto (default), legacy (PyTorch
/// 1.13-2.1) or validated (2.2 and later).
inline C10dProtocol c10d_protocol_from_env(const EnvLookup& env = process_env) {
  const auto value = env("TANDEM_C10D_PROTOCOL");
  if (!value || value->empty() || *value == "auto") return C10dProtocol::automatic;
  if (*value == "legacy") return C10dProtocol::legacy;
  if (*value == "validated") return C10dProtocol::validated;
  throw Error("environment",
              "TANDEM_C10D_PROTOCOL='" + *value + "' is not auto, legacy or validated");
}

/// The namespace of tandem's keys in torchrun's agent store, "tandem/attempt_N" for restart N:
/// apart from torchrun's keys, and fresh on every restart (the agent keeps its store across
/// restarts, so the keys of a failed attempt are still there).
inline std::string agent_store_prefix(const EnvLookup& env = process_env) {
  const auto restart = env_int_in(env, "TORCHELASTIC_RESTART_COUNT", 0, INT32_MAX);
  if (!restart) {
    throw Error("init_process_group",
                "TORCHELASTIC_USE_AGENT_STORE=True but TORCHELASTIC_RESTART_COUNT is not set "
                "(torchrun sets both)");
  }
  return "tandem/attempt_" + std::to_string(*restart);
}

/// Opens the job's store for this rank: rank 0 hosts a TcpStore server for env:// and tcp://
/// and every rank connects to it; for file:// every rank opens the file. Under torchrun
/// (env:// with TORCHELASTIC_USE_AGENT_STORE=True) every rank is a client of the agent's c10d
/// store, inside agent_store_prefix().
inline AnyStore open_store(const InitMethod& method, const World& world, Timeout timeout,
                           const EnvLookup& env = process_env) {
  if (method.scheme == InitMethod::Scheme::file) {
    return AnyStore(FileStore(method.path, FileStoreOptions{.timeout = timeout}));
  }
  if (method.scheme == InitMethod::Scheme::env && use_agent_store(env)) {
    const std::string prefix = agent_store_prefix(env);
    C10dStore agent({.host = method.host,
                     .port = method.port,
                     .timeout = timeout,
                     .protocol = c10d_protocol_from_env(env)});
    return AnyStore(PrefixStore<C10dStore>(prefix, std::move(agent)));
  }
  TcpStoreOptions options;
  options.host = method.host;
  options.port = method.port;
  options.is_server = world.rank == 0;
  options.timeout = timeout;
  options.notice_interval = detail::wait_notice_interval(env);
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

/// "tandem: rank 0 waiting for 1 of 2 ranks (30 s of 1800 s)": what a rank waiting at the
/// rendezvous prints on stderr.
inline std::string waiting_notice(int rank, std::size_t missing, int world_size, Timeout waited,
                                  Timeout timeout, std::string_view what) {
  const auto seconds = [](Timeout t) {
    return std::to_string(std::chrono::duration_cast<std::chrono::seconds>(t).count()) + " s";
  };
  std::string text = "tandem: rank " + std::to_string(rank) + " waiting for " +
                     std::to_string(missing) + " of " + std::to_string(world_size) + " ranks";
  if (!what.empty()) text += " to " + std::string(what);
  text += " (" + seconds(waited) + " of " +
          (timeout == Timeout::max() ? std::string("no limit") : seconds(timeout)) + ")";
  return text;
}

/// Waits until every rank has set `prefix + r`; the Error lists the ranks that did not. Every
/// `notice` of waiting it prints waiting_notice() on stderr.
inline void wait_for_ranks(AnyStore& store, const World& world, const std::string& prefix,
                           Timeout timeout, const std::string& url, std::string_view what,
                           Timeout notice = std::chrono::seconds(30),
                           std::string_view notice_what = {}) {
  std::vector<std::string> keys;
  for (int r = 0; r < world.world_size; ++r) keys.push_back(prefix + std::to_string(r));
  const Deadline deadline(timeout);
  const auto started = Deadline::clock::now();
  std::vector<int> missing;
  for (;;) {
    const Timeout slice = std::min(notice, deadline.remaining());
    const auto slice_started = Deadline::clock::now();
    try {
      store.wait(keys, slice);
      return;
    } catch (const Error&) {
      // Timed out, or the store is gone: the checks below tell which.
    }
    missing.clear();
    try {
      for (int r = 0; r < world.world_size; ++r) {
        if (!store.check(std::span(&keys[static_cast<std::size_t>(r)], 1))) missing.push_back(r);
      }
    } catch (const Error& checking) {
      // The store itself is gone: on env:// and tcp:// its host, rank 0, has failed or given up.
      throw Error(world.rank, "init_process_group",
                  "lost the store at " + url +
                      " while waiting for the other ranks (on env:// and tcp:// rank 0 hosts "
                      "it, under torchrun its agent; it has probably failed or timed out): " +
                      checking.cause());
    }
    if (missing.empty()) return;
    if (deadline.expired()) break;
    // A wait that failed early (not a timeout) must not turn this loop into a busy one.
    const auto spent = Deadline::clock::now() - slice_started;
    if (spent < slice) {
      std::this_thread::sleep_for(std::min<Timeout>(
          std::chrono::duration_cast<Timeout>(slice - spent), deadline.remaining()));
      if (deadline.expired()) break;
      continue;
    }
    if (slice < notice) continue;  // cut short by the deadline: no notice, the error comes next
    const auto waited = std::chrono::duration_cast<Timeout>(Deadline::clock::now() - started);
    std::fprintf(
        stderr, "%s\n",
        waiting_notice(world.rank, missing.size(), world.world_size, waited, timeout, notice_what)
            .c_str());
    std::fflush(stderr);
  }
  throw Error(world.rank, "init_process_group",
              "rank(s) " + join_ranks(missing) + " did not " + std::string(what) + " " + url +
                  " within " + describe(timeout));
}

}  // namespace detail

/// Every rank announces itself under "tandem/init/" and waits for the others. Two processes
/// claiming one rank, or ranks that disagree on the world size, are Errors on the rank that
/// notices; a rank missing at the timeout is named in the Error of every rank that waited.
inline void join_store(AnyStore& store, const World& world, Timeout timeout, const std::string& url,
                       Timeout notice = std::chrono::seconds(30)) {
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
  // PyTorch's classic TCPStore server (1.13, and 2.x without libuv) does not wake waiters on
  // a key that compare_set created; a set of the same value does. The key is this rank's now.
  store.set(key, token);
  detail::wait_for_ranks(store, world, "tandem/init/rank/", timeout, url, "join", notice);
}

}  // namespace tandem
