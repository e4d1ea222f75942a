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
#include <climits>
#include <cstdint>
#include <cstdio>
#include <optional>
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
/// seconds (default 10, as for a collective; 0: never).
inline Timeout wait_notice_interval(const EnvLookup& env = process_env) {
  const auto seconds = env_int_in(env, "TANDEM_WAIT_NOTICE_S", 0, 24 * 3600);
  if (!seconds) return std::chrono::seconds(10);
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
  options.server_hint =
      "rank 0 hosts it: not started yet, or started with another MASTER_ADDR or "
      "MASTER_PORT?";
  return AnyStore(TcpStore(options));
}

namespace detail {

/// Where a joining rank announces itself: `join_prefix + rank` holds its JoinRecord.
inline constexpr std::string_view join_prefix = "tandem/init/rank/";
/// Set by a rank that finds the job misconfigured (two processes with one RANK, world sizes that
/// differ): the ranks still waiting raise its text at once instead of waiting out the timeout.
inline constexpr std::string_view conflict_key = "tandem/init/conflict";
/// How often a waiting rank looks for a conflict (and, at its notice interval, says what it waits
/// for).
inline constexpr Timeout conflict_poll = std::chrono::seconds(1);

/// What a rank says about itself when it joins: "host:pid#n node local", unique to one join (two
/// threads of one process claiming one rank must differ).
struct JoinRecord {
  std::string token;    ///< host:pid#n
  std::string host;     ///< the host it runs on
  std::string pid;      ///< its process id
  int node_rank = -1;   ///< its node (World::node_rank); -1: not said
  int local_rank = -1;  ///< its rank on the node; -1: not said

  /// A fresh record for this process, rank `world`.
  static JoinRecord mine(const World& world) {
    static std::atomic<std::uint64_t> joins{0};
    char name[256] = {};
    if (::gethostname(name, sizeof name - 1) != 0) name[0] = '?';
    JoinRecord record;
    record.host = name;
    record.pid = std::to_string(::getpid());
    record.token = record.host + ":" + record.pid + "#" + std::to_string(joins++);
    record.node_rank = world.node_rank;
    record.local_rank = world.local_rank;
    return record;
  }

  /// Reads what text() wrote (anything else gives what it can: the token, no place).
  static JoinRecord parse(std::string_view text) {
    JoinRecord record;
    const auto space = text.find(' ');
    record.token = std::string(text.substr(0, space));
    const auto colon = record.token.rfind(':');
    const auto hash = record.token.rfind('#');
    record.host = record.token.substr(0, colon);
    if (colon != std::string::npos && hash != std::string::npos && hash > colon) {
      record.pid = record.token.substr(colon + 1, hash - colon - 1);
    }
    if (space != std::string_view::npos) {
      const std::string_view rest = text.substr(space + 1);
      const auto second = rest.find(' ');
      const auto node = parse_int(rest.substr(0, second));
      const auto local =
          second == std::string_view::npos ? std::nullopt : parse_int(rest.substr(second + 1));
      if (node && local && *node >= 0 && *local >= 0 && *node <= INT32_MAX && *local <= INT32_MAX) {
        record.node_rank = static_cast<int>(*node);
        record.local_rank = static_cast<int>(*local);
      }
    }
    return record;
  }

  [[nodiscard]] std::string text() const {
    return token + " " + std::to_string(node_rank) + " " + std::to_string(local_rank);
  }

  /// "pid 1234 on host vm (node 0, local rank 1)".
  [[nodiscard]] std::string describe() const {
    std::string said = (pid.empty() ? token : "pid " + pid + " on host " + host);
    if (node_rank >= 0) {
      said += " (node " + std::to_string(node_rank) + ", local rank " + std::to_string(local_rank) +
              ")";
    }
    return said;
  }
};

inline std::string join_ranks(const std::vector<int>& ranks) {
  std::string text;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i == 8) return text + ", ... (" + std::to_string(ranks.size()) + " in all)";
    text += (i ? ", " : "") + std::to_string(ranks[i]);
  }
  return text;
}

/// "rank 2" or "ranks 2, 5".
inline std::string rank_or_ranks(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + join_ranks(ranks);
}

/// The JoinRecord rank `r` left in `store`, if it has joined.
inline std::optional<JoinRecord> joined_record(AnyStore& store, int r) {
  const std::vector<std::string> key{std::string(join_prefix) + std::to_string(r)};
  if (!store.check(key)) return std::nullopt;
  return JoinRecord::parse(store.get(key.front()));
}

/// Where ranks that have not joined were expected, as far as the World and the ranks that did
/// join tell: launchers place ranks in blocks of local_world_size per node, so a missing rank's
/// node is found by its block, and the node's host by a rank of that block that joined.
/// "expected on host vm as local rank 2", "expected on node 1 as local ranks 0, 1, where no rank
/// has joined yet (is that node's launcher running?)"; several nodes are joined by "; ".
inline std::string expected_places(AnyStore& store, const World& world,
                                   const std::vector<int>& missing) {
  const int per_node = std::max(world.local_world_size, 1);
  std::string text;
  std::size_t i = 0;
  for (int nodes_shown = 0; i < missing.size() && nodes_shown < 4; ++nodes_shown) {
    const int node = missing[i] / per_node;
    std::vector<int> ranks;
    std::vector<int> locals;
    for (; i < missing.size() && missing[i] / per_node == node; ++i) {
      ranks.push_back(missing[i]);
      locals.push_back(missing[i] % per_node);
    }
    std::string host;
    const int end = std::min((node + 1) * per_node, world.world_size);
    for (int r = node * per_node; r < end && host.empty(); ++r) {
      if (std::find(ranks.begin(), ranks.end(), r) != ranks.end()) continue;
      if (const auto record = joined_record(store, r); record && record->node_rank == node) {
        host = record->host;
      }
    }
    if (!text.empty()) text += "; " + rank_or_ranks(ranks) + " ";
    const std::string local =
        (locals.size() == 1 ? "local rank " : "local ranks ") + join_ranks(locals);
    if (!host.empty()) {
      text += "expected on host " + host +
              (world.nnodes > 1 ? " (node " + std::to_string(node) + ")" : std::string()) + " as " +
              local;
    } else {
      text += "expected on node " + std::to_string(node) + " as " + local +
              ", where no rank has joined yet" +
              (world.nnodes > 1 ? " (is that node's launcher running?)" : "");
    }
  }
  if (i < missing.size()) text += "; and ranks of further nodes";
  return text;
}

/// Where ranks that joined but have not yet reached `prefix` are: "rank 1 is pid 1234 on host
/// vm (node 0, local rank 1)"; at most four.
inline std::string joined_places(AnyStore& store, const std::vector<int>& missing) {
  std::string text;
  for (std::size_t i = 0; i < missing.size() && i < 4; ++i) {
    if (const auto record = joined_record(store, missing[i])) {
      text += (text.empty() ? "" : "; ") + std::string("rank ") + std::to_string(missing[i]) +
              " is " + record->describe();
    }
  }
  return text;
}

/// "tandem: rank 0 waiting for rank 2 of 3 to join (expected on host vm as local rank 2: not
/// started, or started with another MASTER_ADDR, MASTER_PORT or run id?) (30 s of 1800 s)":
/// what a rank waiting at the rendezvous prints on stderr. `where`: what is known of the
/// missing ranks (empty: nothing).
inline std::string waiting_notice(int rank, const std::vector<int>& missing, int world_size,
                                  std::string_view what, std::string_view where, Timeout waited,
                                  Timeout timeout) {
  const auto seconds = [](Timeout t) {
    return std::to_string(std::chrono::duration_cast<std::chrono::seconds>(t).count()) + " s";
  };
  std::string text = "tandem: rank " + std::to_string(rank) + " waiting for " +
                     rank_or_ranks(missing) + " of " + std::to_string(world_size);
  if (!what.empty()) text += " to " + std::string(what);
  if (!where.empty()) text += " (" + std::string(where) + ")";
  text += " (" + seconds(waited) + " of " +
          (timeout == Timeout::max() ? std::string("no limit") : seconds(timeout)) + ")";
  return text;
}

/// What to check when ranks never join: said by the notices and the timeout's Error.
inline constexpr std::string_view not_joined_hint =
    "not started, or started with another MASTER_ADDR, MASTER_PORT or run id?";

/// What a waiting rank knows of the ranks in `missing`: where they were expected (joining), or
/// where they are (ranks that joined and have not reached `prefix` yet).
inline std::string missing_places(AnyStore& store, const World& world, const std::string& prefix,
                                  const std::vector<int>& missing) {
  if (prefix == join_prefix) {
    return expected_places(store, world, missing) + ": " + std::string(not_joined_hint);
  }
  return joined_places(store, missing);
}

/// Waits until every rank has set `prefix + r`; the Error lists the ranks that did not, and
/// where they were expected. Every `notice` of waiting it prints waiting_notice() on stderr. A
/// conflict another rank recorded (conflict_key) ends the wait at once with its text.
inline void wait_for_ranks(AnyStore& store, const World& world, const std::string& prefix,
                           Timeout timeout, const std::string& url, std::string_view what,
                           Timeout notice = std::chrono::seconds(10),
                           std::string_view notice_what = {}) {
  std::vector<std::string> keys;
  for (int r = 0; r < world.world_size; ++r) keys.push_back(prefix + std::to_string(r));
  const std::vector<std::string> conflict{std::string(conflict_key)};
  const Deadline deadline(timeout);
  const Deadline::clock::time_point started = Deadline::clock::now();
  Deadline next_notice(notice);
  std::vector<int> missing;
  for (;;) {
    const Timeout slice = std::min({conflict_poll, deadline.remaining(), next_notice.remaining()});
    const auto slice_started = Deadline::clock::now();
    try {
      store.wait(keys, slice);
      return;
    } catch (const Error&) {
      // Timed out, or the store is gone: the checks below tell which.
    }
    // The store itself gone: on env:// and tcp:// its host, rank 0, has failed or given up.
    const auto lost = [&](const Error& checking) {
      return Error(world.rank, "init_process_group",
                   "lost the store at " + url +
                       " while waiting for the other ranks (on env:// and tcp:// rank 0 hosts "
                       "it, under torchrun its agent; it has probably failed or timed out): " +
                       checking.cause());
    };
    // Every slice looks for a conflict; who is missing, only when it is to be said (one look
    // per rank: with thousands of ranks every second, the store's host would do nothing else).
    const bool say = deadline.expired() || next_notice.expired();
    std::optional<std::string> conflicting;
    missing.clear();
    try {
      if (store.check(conflict)) conflicting = store.get(conflict.front());
      for (int r = 0; r < world.world_size && say && !conflicting; ++r) {
        if (!store.check(std::span(&keys[static_cast<std::size_t>(r)], 1))) missing.push_back(r);
      }
    } catch (const Error& checking) {
      throw lost(checking);
    }
    if (conflicting) throw Error(world.rank, "init_process_group", *conflicting);
    if (say && missing.empty()) return;
    const auto places = [&] {
      try {
        return missing_places(store, world, prefix, missing);
      } catch (const Error& checking) {
        throw lost(checking);
      }
    };
    if (say && deadline.expired()) {
      const std::string where = places();
      throw Error(world.rank, "init_process_group",
                  "rank(s) " + join_ranks(missing) + " did not " + std::string(what) + " " + url +
                      " within " + describe(timeout) + (where.empty() ? "" : " (" + where + ")") +
                      "; check that WORLD_SIZE=" + std::to_string(world.world_size) +
                      " is the number of processes started (the launch command's --nnodes "
                      "times --nproc-per-node) and that every process has the same MASTER_ADDR "
                      "and MASTER_PORT");
    }
    if (say) {
      const auto waited = std::chrono::duration_cast<Timeout>(Deadline::clock::now() - started);
      std::fprintf(stderr, "%s\n",
                   waiting_notice(world.rank, missing, world.world_size, notice_what, places(),
                                  waited, timeout)
                       .c_str());
      std::fflush(stderr);
      next_notice = Deadline(notice);
      continue;
    }
    // A wait that failed early (not a timeout) must not turn this loop into a busy one.
    const auto spent = Deadline::clock::now() - slice_started;
    if (spent < slice) {
      std::this_thread::sleep_for(
          std::min<Timeout>(std::chrono::duration_cast<Timeout>(slice - spent),
                            std::min(deadline.remaining(), next_notice.remaining())));
    }
  }
}

/// Records a misconfiguration every waiting rank must raise (see conflict_key); best effort.
inline void record_conflict(AnyStore& store, const std::string& text) {
  try {
    (void)store.compare_set(std::string(conflict_key), "", text);
  } catch (const Error&) {  // the rank that found it raises it anyway
  }
}

/// What to check when processes disagree on the job's layout.
inline constexpr std::string_view layout_hint =
    "check the launch command (--nnodes, and --nproc-per-node and --node-rank on every node) "
    "and any RANK or WORLD_SIZE set by hand";

}  // namespace detail

/// Every rank announces itself under "tandem/init/" and waits for the others. Two processes
/// claiming one rank, or ranks that disagree on the world size, are Errors on the rank that
/// notices and on every rank still waiting; a rank missing at the timeout is named in the Error
/// of every rank that waited, with where it was expected. Every `notice` a waiting rank says on
/// stderr which ranks it waits for.
inline void join_store(AnyStore& store, const World& world, Timeout timeout, const std::string& url,
                       Timeout notice = std::chrono::seconds(10)) {
  const detail::JoinRecord me = detail::JoinRecord::mine(world);
  const std::string size = std::to_string(world.world_size);
  const std::string agreed = store.compare_set("tandem/init/world_size", "", size);
  if (agreed != size) {
    detail::record_conflict(
        store, "processes disagree on the world size: rank " + std::to_string(world.rank) + " (" +
                   me.describe() + ") has WORLD_SIZE=" + size + ", the ranks that joined " + url +
                   " first have WORLD_SIZE=" + agreed + "; " + std::string(detail::layout_hint));
    throw Error(world.rank, "init_process_group",
                "this rank has world_size=" + size + " but ranks that joined " + url +
                    " earlier have world_size=" + agreed +
                    "; every process of a job needs the same WORLD_SIZE: " +
                    std::string(detail::layout_hint));
  }
  const std::string key = std::string(detail::join_prefix) + std::to_string(world.rank);
  const std::string holder = store.compare_set(key, "", me.text());
  if (holder != me.text()) {
    const std::string other = detail::JoinRecord::parse(holder).describe();
    detail::record_conflict(
        store, "rank " + std::to_string(world.rank) + " was claimed by two processes at " + url +
                   " (" + other + ", then " + me.describe() + "): more processes than WORLD_SIZE=" +
                   size + ", or two with one RANK; " + std::string(detail::layout_hint));
    throw Error(
        world.rank, "init_process_group",
        "rank " + std::to_string(world.rank) + " joined " + url + " twice: it is already held by " +
            other + " (two processes with one RANK - more processes than WORLD_SIZE=" + size +
            "? - or a file:// store reused by a live job); " + std::string(detail::layout_hint));
  }
  // PyTorch's classic TCPStore server (1.13, and 2.x without libuv) does not wake waiters on
  // a key that compare_set created; a set of the same value does. The key is this rank's now.
  store.set(key, me.text());
  detail::wait_for_ranks(store, world, key.substr(0, detail::join_prefix.size()), timeout, url,
                         "join", notice, "join");
}

}  // namespace tandem
