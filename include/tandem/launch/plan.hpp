// tandem/launch/plan.hpp - torchrun's flags as tandemrun takes them, checked and resolved into
// what one node's launcher will do (a LaunchPlan): sizes, addresses, streams, restarts, token.
//   auto plan = tandem::launch::resolve({.nproc_per_node = "2", .command = {"./train"}});
// Needs: POSIX (the machine facts of launch/detail/process.hpp). launcher.hpp runs the plan.
#pragma once

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "tandem/comm/flight_settings.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/launch/detail/process.hpp"

namespace tandem::launch {

// --- the flags -----------------------------------------------------------------------------------

/// Which of a worker's streams --redirects / --tee take: torchrun's 0 none, 1 stdout, 2 stderr,
/// 3 both.
enum class Std : int { none = 0, out = 1, err = 2, all = 3 };

inline bool takes_stdout(Std s) noexcept {
  return s == Std::out || s == Std::all;
}
inline bool takes_stderr(Std s) noexcept {
  return s == Std::err || s == Std::all;
}

/// A --redirects / --tee value: one Std for every local rank ("3"), or one per local rank listed
/// ("0:1,1:2"; ranks not listed get none).
struct StdStreams {
  Std all_ranks = Std::none;      ///< the streams of every local rank, unless per_rank lists them
  std::map<int, Std> per_rank{};  ///< used when not empty

  /// The streams of local rank `local_rank`.
  [[nodiscard]] Std for_rank(int local_rank) const {
    if (per_rank.empty()) return all_ranks;
    const auto found = per_rank.find(local_rank);
    return found == per_rank.end() ? Std::none : found->second;
  }
  /// True when some rank has some stream redirected (or teed).
  [[nodiscard]] bool any() const {
    if (per_rank.empty()) return all_ranks != Std::none;
    return std::any_of(per_rank.begin(), per_rank.end(),
                       [](const auto& entry) { return entry.second != Std::none; });
  }
};

/// The flags as typed (every value a string, so that a bad one is reported by resolve() with the
/// flag's name). Defaults are torchrun's.
struct LaunchOptions {
  std::string nproc_per_node = "1";  ///< N, "cpu", "gpu" or "auto"
  std::string nnodes = "1";          ///< N, or MIN:MAX (MIN < MAX only with --elastic)
  /// HOST:PORT where the launchers of an elastic --nnodes MIN:MAX job meet (node 0's hosts a
  /// store there): a node started later takes a free node slot there and joins the running job.
  /// Empty: the job runs MIN nodes and no node joins it later.
  std::string rdzv_endpoint{};
  std::string node_rank = "0";            ///< 0 .. nnodes-1
  std::string master_addr = "127.0.0.1";  ///< the address of node 0, where rank 0's store listens
  std::string master_port = "29500";      ///< the port of that store
  bool standalone = false;                ///< one node on 127.0.0.1 and a free port
  std::string max_restarts = "0";  ///< how often the whole group is restarted after a failure
  bool elastic = false;  ///< a worker ended by a signal is lost and the others go on (--elastic)
  std::string monitor_interval = "0.1";  ///< seconds
  /// Which streams go to log files only: 0 none, 1 stdout, 2 stderr, 3 both (per rank: "0:1,1:2").
  std::string redirects = "0";
  std::string tee = "0";  ///< which streams go to log files and the console too
  std::string log_dir{};  ///< empty: a new temporary directory, made only when a file is written
  std::string role = "default";  ///< the workers' ROLE_NAME
  std::string run_id{};          ///< empty: a unique id
  std::string devices{};  ///< "2,3,5": CUDA_VISIBLE_DEVICES of local rank i is the i-th entry
  /// The job token the workers' TcpStore demands of every client (TANDEM_STORE_TOKEN); empty:
  /// rdzv_token_file, else TANDEM_STORE_TOKEN as inherited, else (one node) a fresh random one.
  std::string rdzv_token{};
  std::string rdzv_token_file{};       ///< a file holding the job token (not shown by `ps`)
  std::vector<std::string> command{};  ///< PROGRAM ARGS...
};

/// What this node's launcher will do, every value checked.
struct LaunchPlan {
  int nproc_per_node = 1;  ///< worker processes on this node
  int nnodes = 1;          ///< nodes in the job
  /// --nnodes MIN:MAX with --elastic: MAX (nnodes is MIN, the nodes tandemrun runs); else nnodes.
  int max_nnodes = 1;
  int node_rank = 0;  ///< this node's index
  /// The launchers meet at rdzv_host:rdzv_port for node slots (--rdzv-endpoint with --elastic
  /// and --nnodes MIN:MAX): node 0's launcher hosts a store there, and a node started later
  /// takes a free slot in it (launch/nodes.hpp); every worker learns the largest world
  /// (TANDEM_ELASTIC_MAX_WORLD_SIZE).
  bool node_slots = false;
  std::string rdzv_host{};  ///< where the launchers meet (node_slots)
  int rdzv_port = 0;        ///< the port of that store
  /// This node came to a running job (it took a slot beyond the first nnodes): its workers join
  /// the running group at a step boundary (TANDEM_ELASTIC_JOIN=1), with ranks beyond the first
  /// world.
  bool joins_running_job = false;
  std::string master_addr = "127.0.0.1";  ///< the address of node 0, where the store listens
  int master_port = 29500;                ///< the port of that store
  int max_restarts = 0;                   ///< group restarts allowed after a failure
  /// A worker ended by a signal (SIGKILL, an OOM kill), or stopped once every other worker has
  /// finished, is lost, not a failure: the others go on (tandem::Elastic, docs/elastic.md).
  bool elastic = false;
  std::chrono::milliseconds monitor_interval{100};  ///< how often the workers are polled
  /// After a failure (or a forwarded signal), how long workers have to end before SIGKILL.
  std::chrono::milliseconds grace{5000};
  /// After the first failure, how long the other workers may go on (failing on their own, writing
  /// their error files) before they are stopped; less when every one left is stopped or ended.
  std::chrono::milliseconds failure_grace{2000};
  /// The workers' flight record directory as the launcher's environment names it
  /// (TANDEM_FLIGHT_RECORDER_DIR); empty: tandemrun makes one per attempt.
  std::string flight_dir{};
  StdStreams redirects{};            ///< streams that go to log files only
  StdStreams tee{};                  ///< streams that go to log files and the console
  std::string log_dir{};             ///< where the log files go (made when the first is written)
  std::string role = "default";      ///< the workers' ROLE_NAME
  std::string run_id{};              ///< the job's id, in TORCHELASTIC_RUN_ID
  std::vector<int> devices{};        ///< empty: CUDA_VISIBLE_DEVICES is passed on as it is
  bool set_omp_num_threads = false;  ///< OMP_NUM_THREADS=1 for workers (torchrun's default)
  /// Each worker gets its own TORCHELASTIC_ERROR_FILE, read after a failure (torchrun's way);
  /// false when the launcher's environment sets one, which the workers then inherit.
  bool error_files = true;
  /// The job token given to the workers as TANDEM_STORE_TOKEN (empty: none is set).
  std::string store_token{};
  std::vector<std::string> command{};  ///< the program and its arguments

  /// The most ranks the job may grow to: max_nnodes * nproc_per_node.
  [[nodiscard]] int max_world_size() const noexcept { return max_nnodes * nproc_per_node; }
  /// Ranks in the job: nnodes * nproc_per_node.
  [[nodiscard]] int world_size() const noexcept { return nnodes * nproc_per_node; }
  /// The global rank of local rank `local_rank` on this node.
  [[nodiscard]] int global_rank(int local_rank) const noexcept {
    return node_rank * nproc_per_node + local_rank;
  }
  /// True when some stream of some rank goes to a log file.
  [[nodiscard]] bool writes_logs() const { return redirects.any() || tee.any(); }
};

/// What resolve() asks of the machine; tests replace the parts they pin down.
struct HostFacts {
  std::function<int()> cpu_count = detail::cpu_count;  ///< processes when --nproc-per-node is "cpu"
  std::function<int()> gpu_count = detail::cuda_device_count;  ///< processes when it is "gpu"
  EnvLookup env = process_env;  ///< the environment the launcher reads
  std::function<std::uint16_t()> free_port =
      detail::free_port;  ///< a free TCP port, for --standalone
  std::function<std::string()> unique_id =
      detail::unique_id;  ///< a unique run id, when none is given
  /// A fresh random job token, for a single-node job given none.
  std::function<std::string()> random_token = detail::random_token;
  /// The token in a --rdzv-token-file.
  std::function<std::string(const std::string&)> read_token_file = detail::read_token_file;
};

namespace detail {

[[noreturn]] inline void bad_flag(std::string_view flag, const std::string& cause) {
  throw Error(std::string(flag), cause);
}

inline int parse_flag_int(std::string_view flag, std::string_view text, std::int64_t low,
                          std::int64_t high) {
  const auto value = parse_int(text);
  if (!value) bad_flag(flag, "'" + std::string(text) + "' is not an integer");
  if (*value < low || *value > high) {
    bad_flag(flag, std::to_string(*value) + " is out of range [" + std::to_string(low) + ", " +
                       std::to_string(high) + "]");
  }
  return static_cast<int>(*value);
}

inline std::vector<std::string_view> split(std::string_view text, char separator) {
  std::vector<std::string_view> parts;
  for (;;) {
    const auto at = text.find(separator);
    parts.push_back(text.substr(0, at));
    if (at == std::string_view::npos) return parts;
    text.remove_prefix(at + 1);
  }
}

inline Std parse_std(std::string_view flag, std::string_view text) {
  const auto value = parse_int(text);
  if (!value || *value < 0 || *value > 3) {
    bad_flag(flag,
             "'" + std::string(text) + "' is not 0 (none), 1 (stdout), 2 (stderr) or 3 (both)");
  }
  return static_cast<Std>(*value);
}

inline int parse_nproc(std::string_view text, const HostFacts& host) {
  constexpr std::string_view flag = "--nproc-per-node";
  int count = 0;
  if (text == "cpu") {
    count = host.cpu_count();
  } else if (text == "gpu") {
    count = host.gpu_count();
    if (count < 1) bad_flag(flag, "'gpu' asks for one worker per GPU, but no GPU was found");
  } else if (text == "auto") {
    count = host.gpu_count();
    if (count < 1) count = host.cpu_count();
  } else if (!parse_int(text)) {
    bad_flag(flag, "'" + std::string(text) + "' is not a number, 'cpu', 'gpu' or 'auto'");
  } else {
    count = parse_flag_int(flag, text, 1, 1 << 20);
  }
  return std::max(count, 1);
}

/// --nnodes N or MIN:MAX as (MIN, MAX). MIN < MAX is torchrun's elastic size: accepted with
/// --elastic (tandemrun then starts the job with MIN nodes, which the first rank count is made
/// of; with --rdzv-endpoint, nodes started later join it up to MAX), refused without it.
inline std::pair<int, int> parse_nnodes(std::string_view text, bool elastic) {
  constexpr std::string_view flag = "--nnodes";
  const auto colon = text.find(':');
  if (colon == std::string_view::npos) {
    const int n = parse_flag_int(flag, text, 1, 1 << 20);
    return {n, n};
  }
  const int low = parse_flag_int(flag, text.substr(0, colon), 1, 1 << 20);
  const int high = parse_flag_int(flag, text.substr(colon + 1), 1, 1 << 20);
  if (low != high && !elastic) {
    bad_flag(flag, "'" + std::string(text) +
                       "' is an elastic size; tandemrun supports fixed sizes only (N or N:N)");
  }
  if (low > high) bad_flag(flag, "'" + std::string(text) + "': MIN is above MAX");
  return {low, high};
}

inline std::chrono::milliseconds parse_seconds(std::string_view flag, std::string_view text) {
  const std::string copy(text);
  char* end = nullptr;
  errno = 0;
  const double seconds = std::strtod(copy.c_str(), &end);
  if (copy.empty() || end != copy.c_str() + copy.size() || errno != 0 || !std::isfinite(seconds)) {
    bad_flag(flag, "'" + copy + "' is not a number of seconds");
  }
  if (seconds < 0.001 || seconds > 3600) {
    bad_flag(flag, "'" + copy + "' seconds is out of range [0.001, 3600]");
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(seconds * 1000)));
}

inline std::vector<int> parse_devices(std::string_view text) {
  std::vector<int> devices;
  for (auto item : split(text, ',')) {
    const auto value = parse_int(item);
    if (!value || *value < 0 || *value > 1 << 20) {
      bad_flag("--devices", "'" + std::string(text) +
                                "' is not a comma-separated list of GPU indices like 2,3,5");
    }
    devices.push_back(static_cast<int>(*value));
  }
  return devices;
}

/// --rdzv-endpoint HOST:PORT as (HOST, PORT); "[::1]:PORT" for an IPv6 address.
inline std::pair<std::string, int> parse_endpoint(std::string_view text) {
  constexpr std::string_view flag = "--rdzv-endpoint";
  const auto colon = text.rfind(':');
  if (colon == std::string_view::npos || colon == 0) {
    bad_flag(flag, "'" + std::string(text) + "' is not HOST:PORT");
  }
  std::string host(text.substr(0, colon));
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  return {host, parse_flag_int(flag, text.substr(colon + 1), 1, 65535)};
}

/// The job token: --rdzv-token, --rdzv-token-file, TANDEM_STORE_TOKEN, or for a single node a
/// fresh random one (every worker is this launcher's, so no one else needs it); several nodes
/// share only a token they are given.
inline std::string job_token(const LaunchOptions& options, const LaunchPlan& plan,
                             const HostFacts& host) {
  if (!options.rdzv_token.empty() && !options.rdzv_token_file.empty()) {
    bad_flag("--rdzv-token", "give --rdzv-token or --rdzv-token-file, not both");
  }
  std::string token;
  std::string_view source = "--rdzv-token";
  if (!options.rdzv_token.empty()) {
    token = options.rdzv_token;
  } else if (!options.rdzv_token_file.empty()) {
    token = host.read_token_file(options.rdzv_token_file);
    source = "--rdzv-token-file";
  } else if (auto inherited = host.env("TANDEM_STORE_TOKEN"); inherited && !inherited->empty()) {
    token = *inherited;
    source = "TANDEM_STORE_TOKEN";
  } else if (plan.nnodes == 1 && !plan.node_slots) {  // no other launcher needs it
    token = host.random_token();
  }
  if (token.size() > max_token_bytes) {
    bad_flag(source, "the token has " + std::to_string(token.size()) + " bytes; at most " +
                         std::to_string(max_token_bytes) + " are allowed");
  }
  return token;
}

}  // namespace detail

/// Parses a --redirects / --tee value ("3" or "0:1,1:2"); a bad one is a tandem::Error naming
/// `flag`.
inline StdStreams parse_std_streams(std::string_view flag, std::string_view text) {
  StdStreams streams;
  if (text.find(':') == std::string_view::npos) {
    streams.all_ranks = detail::parse_std(flag, text);
    return streams;
  }
  for (auto item : detail::split(text, ',')) {
    const auto colon = item.find(':');
    if (colon == std::string_view::npos) {
      detail::bad_flag(flag, "'" + std::string(item) + "' in '" + std::string(text) +
                                 "' is not LOCAL_RANK:VALUE");
    }
    const int rank = detail::parse_flag_int(flag, item.substr(0, colon), 0, 1 << 20);
    streams.per_rank[rank] = detail::parse_std(flag, item.substr(colon + 1));
  }
  return streams;
}

/// Checks every flag and settles what the machine decides (cpu/gpu counts, a free port, a run
/// id). A bad value is a tandem::Error whose operation is the flag ("--nnodes") and whose cause
/// says what is wrong.
inline LaunchPlan resolve(const LaunchOptions& options, const HostFacts& host = {}) {
  LaunchPlan plan;
  std::tie(plan.nnodes, plan.max_nnodes) = detail::parse_nnodes(options.nnodes, options.elastic);
  plan.node_rank = detail::parse_flag_int("--node-rank", options.node_rank, 0, plan.nnodes - 1);
  plan.master_addr = options.master_addr;
  if (plan.master_addr.empty()) detail::bad_flag("--master-addr", "must not be empty");
  plan.master_port = detail::parse_flag_int("--master-port", options.master_port, 0, 65535);
  plan.max_restarts = detail::parse_flag_int("--max-restarts", options.max_restarts, 0, 1 << 20);
  plan.elastic = options.elastic;
  plan.monitor_interval = detail::parse_seconds("--monitor-interval", options.monitor_interval);
  plan.redirects = parse_std_streams("--redirects", options.redirects);
  plan.tee = parse_std_streams("--tee", options.tee);
  plan.role = options.role;
  if (plan.role.empty()) detail::bad_flag("--role", "must not be empty");
  if (!options.devices.empty()) plan.devices = detail::parse_devices(options.devices);

  // With --devices, "gpu" and "auto" count the devices listed rather than the machine's.
  HostFacts counting = host;
  if (!plan.devices.empty()) {
    counting.gpu_count = [n = static_cast<int>(plan.devices.size())] { return n; };
  }
  plan.nproc_per_node = detail::parse_nproc(options.nproc_per_node, counting);
  if (!plan.devices.empty() && static_cast<int>(plan.devices.size()) < plan.nproc_per_node) {
    detail::bad_flag("--devices", "lists " + std::to_string(plan.devices.size()) +
                                      " device(s) for " + std::to_string(plan.nproc_per_node) +
                                      " processes per node");
  }

  if (options.standalone) {
    if (plan.nnodes != 1) {
      detail::bad_flag("--standalone",
                       "runs a single node, but --nnodes is " + std::to_string(plan.nnodes));
    }
    plan.master_addr = "127.0.0.1";
    plan.master_port = 0;
  }
  if (plan.master_port == 0) {
    if (plan.nnodes != 1) {
      detail::bad_flag("--master-port", "0 (a free port) works on a single node only");
    }
    plan.master_port = host.free_port();
  }
  if (!options.rdzv_endpoint.empty()) {
    if (!plan.elastic || plan.max_nnodes == plan.nnodes) {
      detail::bad_flag("--rdzv-endpoint",
                       "is where nodes started later join a running job: it needs --elastic and "
                       "--nnodes MIN:MAX with MIN < MAX");
    }
    std::tie(plan.rdzv_host, plan.rdzv_port) = detail::parse_endpoint(options.rdzv_endpoint);
    if (plan.rdzv_host == plan.master_addr && plan.rdzv_port == plan.master_port) {
      detail::bad_flag("--rdzv-endpoint",
                       options.rdzv_endpoint +
                           " is MASTER_ADDR:MASTER_PORT, where rank 0's store listens: give the "
                           "launchers another port");
    }
    plan.node_slots = true;
  }
  plan.run_id = options.run_id.empty() ? host.unique_id() : options.run_id;
  plan.store_token = detail::job_token(options, plan, host);
  plan.log_dir = options.log_dir;
  plan.set_omp_num_threads = !host.env("OMP_NUM_THREADS") && plan.nproc_per_node > 1;
  plan.error_files = !host.env("TORCHELASTIC_ERROR_FILE");
  if (const auto dir = host.env(flight_recorder_dir_variable)) plan.flight_dir = *dir;
  plan.command = options.command;
  if (plan.command.empty() || plan.command.front().empty()) {
    detail::bad_flag("PROGRAM", "no program to run was given");
  }
  return plan;
}

}  // namespace tandem::launch
