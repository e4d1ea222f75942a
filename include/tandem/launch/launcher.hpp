// tandem/launch/launcher.hpp - what tandemrun does: torchrun's flags resolved into a plan, each
// worker's environment, and one node's workers supervised (output, failures, restarts, signals).
//   auto plan = tandem::launch::resolve({.nproc_per_node = "2", .command = {"./train"}});
//   return tandem::launch::run(plan);   // the launcher's exit code
// Needs: POSIX and Linux (fork/exec, poll, signalfd, prctl).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/launch/detail/process.hpp"
#include "tandem/launch/elastic.hpp"

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
  std::string nproc_per_node = "1";       ///< N, "cpu", "gpu" or "auto"
  std::string nnodes = "1";               ///< N or MIN:MAX with MIN == MAX
  std::string node_rank = "0";            ///< 0 .. nnodes-1
  std::string master_addr = "127.0.0.1";  ///< the address of node 0, where rank 0's store listens
  std::string master_port = "29500";      ///< the port of that store
  bool standalone = false;                ///< one node on 127.0.0.1 and a free port
  std::string max_restarts = "0";        ///< how often the whole group is restarted after a failure
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
  int nproc_per_node = 1;                 ///< worker processes on this node
  int nnodes = 1;                         ///< nodes in the job
  int node_rank = 0;                      ///< this node's index
  std::string master_addr = "127.0.0.1";  ///< the address of node 0, where the store listens
  int master_port = 29500;                ///< the port of that store
  int max_restarts = 0;                   ///< group restarts allowed after a failure
  std::chrono::milliseconds monitor_interval{100};  ///< how often the workers are polled
  /// After a failure (or a forwarded signal), how long workers have to end before SIGKILL.
  std::chrono::milliseconds grace{5000};
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

inline int parse_nnodes(std::string_view text) {
  constexpr std::string_view flag = "--nnodes";
  const auto colon = text.find(':');
  if (colon == std::string_view::npos) return parse_flag_int(flag, text, 1, 1 << 20);
  const int low = parse_flag_int(flag, text.substr(0, colon), 1, 1 << 20);
  const int high = parse_flag_int(flag, text.substr(colon + 1), 1, 1 << 20);
  if (low != high) {
    bad_flag(flag, "'" + std::string(text) +
                       "' is an elastic size; tandemrun supports fixed sizes only (N or N:N)");
  }
  return low;
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
  } else if (plan.nnodes == 1) {
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
  plan.nnodes = detail::parse_nnodes(options.nnodes);
  plan.node_rank = detail::parse_flag_int("--node-rank", options.node_rank, 0, plan.nnodes - 1);
  plan.master_addr = options.master_addr;
  if (plan.master_addr.empty()) detail::bad_flag("--master-addr", "must not be empty");
  plan.master_port = detail::parse_flag_int("--master-port", options.master_port, 0, 65535);
  plan.max_restarts = detail::parse_flag_int("--max-restarts", options.max_restarts, 0, 1 << 20);
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
  plan.run_id = options.run_id.empty() ? host.unique_id() : options.run_id;
  plan.store_token = detail::job_token(options, plan, host);
  plan.log_dir = options.log_dir;
  plan.set_omp_num_threads = !host.env("OMP_NUM_THREADS") && plan.nproc_per_node > 1;
  plan.error_files = !host.env("TORCHELASTIC_ERROR_FILE");
  plan.command = options.command;
  if (plan.command.empty() || plan.command.front().empty()) {
    detail::bad_flag("PROGRAM", "no program to run was given");
  }
  return plan;
}

// --- the environment -----------------------------------------------------------------------------

/// The variables the launcher sets for one worker, exactly torchrun's (plus CUDA_VISIBLE_DEVICES
/// with --devices, OMP_NUM_THREADS when the plan says so, TANDEM_STORE_TOKEN when the plan has a
/// job token). Everything else is inherited.
inline std::map<std::string, std::string> worker_variables(const LaunchPlan& plan, int local_rank,
                                                           int restart_count) {
  const auto text = [](auto value) { return std::to_string(value); };
  const int rank = plan.global_rank(local_rank);
  std::map<std::string, std::string> vars{
      {"RANK", text(rank)},
      {"LOCAL_RANK", text(local_rank)},
      {"WORLD_SIZE", text(plan.world_size())},
      {"LOCAL_WORLD_SIZE", text(plan.nproc_per_node)},
      {"GROUP_RANK", text(plan.node_rank)},
      {"GROUP_WORLD_SIZE", text(plan.nnodes)},
      {"ROLE_RANK", text(rank)},
      {"ROLE_NAME", plan.role},
      {"ROLE_WORLD_SIZE", text(plan.world_size())},
      {"MASTER_ADDR", plan.master_addr},
      {"MASTER_PORT", text(plan.master_port)},
      {"TORCHELASTIC_RESTART_COUNT", text(restart_count)},
      {"TORCHELASTIC_MAX_RESTARTS", text(plan.max_restarts)},
      {"TORCHELASTIC_RUN_ID", plan.run_id},
  };
  if (plan.set_omp_num_threads) vars["OMP_NUM_THREADS"] = "1";
  if (!plan.store_token.empty()) vars["TANDEM_STORE_TOKEN"] = plan.store_token;
  if (!plan.devices.empty()) {
    vars["CUDA_VISIBLE_DEVICES"] = text(plan.devices.at(static_cast<std::size_t>(local_rank)));
  }
  return vars;
}

/// The whole environment of a worker ("KEY=value"): `base` (the launcher's own, by default)
/// with worker_variables() put over it.
inline std::vector<std::string> worker_environment(const LaunchPlan& plan, int local_rank,
                                                   int restart_count,
                                                   char* const* base = ::environ) {
  const auto vars = worker_variables(plan, local_rank, restart_count);
  std::vector<std::string> environment;
  for (auto entry = base; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string_view item(*entry);
    const auto key = item.substr(0, item.find('='));
    if (!vars.contains(std::string(key))) environment.emplace_back(item);
  }
  for (const auto& [key, value] : vars) environment.push_back(key + "=" + value);
  return environment;
}

/// torchrun's note when it sets OMP_NUM_THREADS, printed once per launch (not per restart), and
/// only then.
inline constexpr std::string_view omp_note =
    "*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid "
    "your system being overloaded, please further tune the variable for optimal performance in "
    "your application as needed.\n"
    "*****************************************\n";

// --- failures ------------------------------------------------------------------------------------

/// One worker that failed: what torchrun's summary shows of it.
struct WorkerFailure {
  int rank = 0;                                ///< global rank
  int local_rank = 0;                          ///< rank on its node
  detail::ExitStatus status;                   ///< how it ended: an exit code or a signal
  pid_t pid = 0;                               ///< its process id
  std::string host;                            ///< the node it ran on
  std::chrono::system_clock::time_point time;  ///< when its failure was seen
  /// What it wrote to its TORCHELASTIC_ERROR_FILE (tandem::run_main, or Python's
  /// `record` decorator): "TYPE: WHAT"; empty when it wrote nothing.
  std::string message{};
};

/// How one attempt of a worker group ended (what run_attempt returns).
struct GroupOutcome {
  /// Every worker exited 0; one failed; a signal stopped the group; or the deadline passed.
  enum class Kind { succeeded, failed, interrupted, timed_out };
  Kind kind = Kind::succeeded;          ///< how the attempt ended
  std::vector<WorkerFailure> failures;  ///< root cause first
  int signal = 0;                       ///< the one forwarded, for interrupted
};

namespace detail {
inline std::string format_time(std::chrono::system_clock::time_point when) {
  const std::time_t seconds = std::chrono::system_clock::to_time_t(when);
  std::tm local{};
  ::localtime_r(&seconds, &local);
  std::array<char, 64> text{};
  const auto n = std::strftime(text.data(), text.size(), "%Y-%m-%d_%H:%M:%S", &local);
  return std::string(text.data(), n);
}

/// An error file's message as the summary shows it: tandem's own what() alone (it begins
/// "tandem: " and says everything), anything else ("RuntimeError: ...") whole; lines after the
/// first indented under the first.
inline std::string shown_message(std::string_view message) {
  const auto colon = message.find(": ");
  if (colon != std::string_view::npos && message.substr(colon + 2).starts_with("tandem: ")) {
    message.remove_prefix(colon + 2);
  }
  while (!message.empty() && (message.back() == '\n' || message.back() == '\r')) {
    message.remove_suffix(1);
  }
  std::string out;
  for (const char c : message) {
    out += c;
    if (c == '\n') out += "              ";
  }
  return out;
}
}  // namespace detail

/// torchrun's failure report: the root cause (the first worker seen failing) first, then any
/// other worker seen failing before the launcher stopped the rest.
inline std::string failure_summary(std::string_view program,
                                   const std::vector<WorkerFailure>& failures) {
  const std::string rule(60, '-');
  std::string out = std::string(60, '=') + "\n" + std::string(program) + " FAILED\n" + rule + "\n";
  const auto entry = [&](std::size_t index, const WorkerFailure& failure) {
    std::string cause = failure.status.signal != 0
                            ? "Signal " + std::to_string(failure.status.signal) + " (" +
                                  detail::signal_name(failure.status.signal) +
                                  ") received by PID " + std::to_string(failure.pid)
                            : "exited with code " + std::to_string(failure.status.code);
    if (!failure.message.empty()) cause = detail::shown_message(failure.message);
    out += "[" + std::to_string(index) + "]:\n";
    out += "  time      : " + detail::format_time(failure.time) + "\n";
    out += "  host      : " + failure.host + "\n";
    out += "  rank      : " + std::to_string(failure.rank) +
           " (local_rank: " + std::to_string(failure.local_rank) + ")\n";
    out += "  exitcode  : " + std::to_string(failure.status.torch_exitcode()) +
           " (pid: " + std::to_string(failure.pid) + ")\n";
    out += "  error     : " + cause + "\n";
  };
  if (!failures.empty()) {
    out += "Root Cause (first observed failure):\n";
    entry(0, failures.front());
  }
  if (failures.size() > 1) {
    out += rule + "\nOther Failures:\n";
    for (std::size_t i = 1; i < failures.size(); ++i) entry(i, failures[i]);
  }
  out += std::string(60, '=') + "\n";
  return out;
}

// --- supervision ---------------------------------------------------------------------------------

namespace detail {

/// One stream of one worker: read from its pipe, written to the console line by line behind a
/// "[rank N] " prefix, and/or to a log file as it comes.
class OutputStream {
 public:
  OutputStream() = default;
  OutputStream(Fd pipe, std::string prefix, int console_fd, Fd file)
      : pipe_(std::move(pipe)),
        prefix_(std::move(prefix)),
        console_fd_(console_fd),
        file_(std::move(file)) {
    set_nonblocking(pipe_.get());
  }

  [[nodiscard]] int fd() const noexcept { return pipe_.get(); }
  [[nodiscard]] bool open() const noexcept { return pipe_.valid(); }

  /// Reads what is there (at most `max_reads` times); closes the stream at end-of-file.
  void pump(int max_reads = 16) {
    std::array<char, 16384> chunk{};
    for (int i = 0; i < max_reads && pipe_; ++i) {
      const auto n = ::read(pipe_.get(), chunk.data(), chunk.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) {
        close();
        return;
      }
      deliver({chunk.data(), static_cast<std::size_t>(n)});
    }
  }

  /// Takes what is left in the pipe (the worker has ended), then closes it. A grandchild that
  /// kept the pipe open is not waited for.
  void drain() {
    pump(64);
    close();
  }

 private:
  void deliver(std::string_view bytes) {
    if (file_) write_all(file_.get(), bytes);
    if (console_fd_ < 0) return;
    pending_.append(bytes);
    std::string lines;
    std::size_t start = 0;
    for (auto end = pending_.find('\n'); end != std::string::npos;
         end = pending_.find('\n', start)) {
      lines += prefix_;
      lines.append(pending_, start, end + 1 - start);
      start = end + 1;
    }
    pending_.erase(0, start);
    // A worker that never ends its line must not grow the buffer without bound.
    if (pending_.size() > max_line) flush_partial(lines);
    if (!lines.empty()) write_all(console_fd_, lines);
  }

  void flush_partial(std::string& lines) {
    if (pending_.empty()) return;
    lines += prefix_ + pending_ + "\n";
    pending_.clear();
  }

  void close() {
    if (console_fd_ >= 0) {
      std::string rest;
      flush_partial(rest);
      if (!rest.empty()) write_all(console_fd_, rest);
    }
    pipe_.reset();
    file_.reset();
  }

  static constexpr std::size_t max_line = 1 << 16;
  Fd pipe_;
  std::string prefix_;
  int console_fd_ = -1;
  Fd file_;
  std::string pending_;
};

/// A worker: its process and, for tandemrun, its two output streams.
struct Worker {
  int rank = 0;
  int local_rank = 0;
  Child child;
  std::array<OutputStream, 2> streams;
  std::chrono::system_clock::time_point ended_at;
};

struct SuperviseOptions {
  std::chrono::milliseconds monitor_interval{100};
  std::chrono::milliseconds grace{5000};
  SignalCatcher* signals = nullptr;  ///< when set, caught signals are forwarded to the workers
  std::optional<std::chrono::steady_clock::time_point> deadline;  ///< then: stop them all
};

inline void signal_all(std::vector<Worker>& workers, int signal) {
  for (auto& worker : workers) worker.child.signal(signal);
}

/// The state of one supervise() call: what has happened to the group so far and when the
/// launcher escalates to SIGKILL.
class Supervisor {
 public:
  using clock = std::chrono::steady_clock;

  Supervisor(std::vector<Worker>& workers, const SuperviseOptions& options)
      : workers_(workers), options_(options), host_(host_name()) {}

  [[nodiscard]] GroupOutcome& outcome() noexcept { return outcome_; }

  /// Reaps the workers that have ended (their output drained first, so that it comes before
  /// anything else); the group's first failures stop the rest. Returns whether all have ended.
  bool reap() {
    std::vector<WorkerFailure> failed_now;
    bool all_ended = true;
    for (auto& worker : workers_) {
      if (worker.child.ended()) continue;
      if (!worker.child.poll()) {
        all_ended = false;
        continue;
      }
      worker.ended_at = std::chrono::system_clock::now();
      for (auto& stream : worker.streams) stream.drain();
      if (worker.child.status().failed()) {
        failed_now.push_back({worker.rank, worker.local_rank, worker.child.status(),
                              worker.child.pid(), host_, worker.ended_at});
      }
    }
    if (!failed_now.empty() && !kill_at_) {
      // Only failures seen before the launcher stopped the group are the workers' own.
      outcome_.kind = GroupOutcome::Kind::failed;
      outcome_.failures = std::move(failed_now);
      stop_all(SIGTERM);
    }
    return all_ended;
  }

  /// The deadline stops the group; the grace period's end kills what is left.
  void enforce_deadlines() {
    const auto now = clock::now();
    if (options_.deadline && now >= *options_.deadline && !kill_at_) {
      outcome_.kind = GroupOutcome::Kind::timed_out;
      stop_all(SIGTERM);
    }
    if (kill_at_ && !killed_ && now >= *kill_at_) kill_all();
  }

  /// One poll() on the signal descriptor and the output pipes, at most monitor_interval (less
  /// when a deadline comes sooner); forwards caught signals and pumps the pipes that are ready.
  void wait_and_pump() {
    std::vector<pollfd> fds;
    std::vector<OutputStream*> readers;
    if (options_.signals != nullptr) fds.push_back({options_.signals->fd(), POLLIN, 0});
    for (auto& worker : workers_) {
      for (auto& stream : worker.streams) {
        if (!stream.open()) continue;
        fds.push_back({stream.fd(), POLLIN, 0});
        readers.push_back(&stream);
      }
    }
    const int ready = ::poll(fds.data(), fds.size(), static_cast<int>(poll_wait().count()));
    if (ready < 0 && errno != EINTR) throw Error("supervise", "poll: " + errno_text(errno));
    if (ready <= 0) return;

    const std::size_t first_stream = options_.signals != nullptr ? 1 : 0;
    if (options_.signals != nullptr && fds[0].revents != 0) forward_signals();
    for (std::size_t i = first_stream; i < fds.size(); ++i) {
      if (fds[i].revents != 0) readers[i - first_stream]->pump();
    }
  }

 private:
  void stop_all(int signal) {
    signal_all(workers_, signal);
    // A stopped worker (SIGSTOP, a debugger) acts on nothing but SIGKILL until it is continued.
    if (signal != SIGKILL) signal_all(workers_, SIGCONT);
    kill_at_ = clock::now() + options_.grace;
  }

  void kill_all() {
    signal_all(workers_, SIGKILL);
    killed_ = true;
  }

  [[nodiscard]] std::chrono::milliseconds poll_wait() const {
    auto wait = options_.monitor_interval;
    const auto until = [&](clock::time_point at) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(at - clock::now());
      wait = std::clamp(left, std::chrono::milliseconds(0), wait);
    };
    if (kill_at_ && !killed_) until(*kill_at_);
    if (options_.deadline && !kill_at_) until(*options_.deadline);
    return wait;
  }

  /// The first caught signal stops the group with that signal; a second one while the workers
  /// wind down kills them: no more patience.
  void forward_signals() {
    while (const auto signal = options_.signals->take()) {
      if (!kill_at_) {
        if (outcome_.kind == GroupOutcome::Kind::succeeded) {
          outcome_.kind = GroupOutcome::Kind::interrupted;
          outcome_.signal = *signal;
        }
        stop_all(*signal);
      } else if (!killed_) {
        kill_all();
      }
    }
  }

  std::vector<Worker>& workers_;
  const SuperviseOptions& options_;
  std::string host_;
  GroupOutcome outcome_;
  std::optional<clock::time_point> kill_at_;
  bool killed_ = false;
};

/// Watches a started group until every worker has ended: a monitor_interval poll() on the
/// output pipes and the signal descriptor, waitpid(WNOHANG) on each worker. The first failure
/// (or a caught signal, or the deadline) stops the rest: SIGTERM (or the signal), then SIGKILL
/// after the grace period.
inline GroupOutcome supervise(std::vector<Worker>& workers, const SuperviseOptions& options) {
  Supervisor supervisor(workers, options);
  while (!supervisor.reap()) {
    supervisor.enforce_deadlines();
    supervisor.wait_and_pump();
  }
  return std::move(supervisor.outcome());
}

inline void make_directories(const std::string& path) {
  std::string prefix;
  for (auto part : split(path, '/')) {
    prefix += std::string(part) + "/";
    if (part.empty()) continue;
    if (::mkdir(prefix.c_str(), 0755) < 0 && errno != EEXIST) {
      throw Error("log-dir", "cannot create " + prefix + ": " + errno_text(errno));
    }
  }
}

inline Fd open_log(const std::string& path) {
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd) throw Error("log-dir", "cannot open " + path + ": " + errno_text(errno));
  return fd;
}

}  // namespace detail

/// Where the launcher writes; tests may point the console elsewhere.
struct RunOptions {
  bool forward_signals = true;      ///< catch SIGINT/SIGTERM/SIGHUP/SIGQUIT and pass them on
  int console_out = STDOUT_FILENO;  ///< where the launcher's own output goes
  int console_err = STDERR_FILENO;  ///< where the launcher's own errors go
};

/// Where the logs of one attempt of one local rank go (torchrun's layout).
inline std::string attempt_log_dir(const std::string& log_dir, const std::string& run_id,
                                   int restart_count, int local_rank) {
  return log_dir + "/" + run_id + "/attempt_" + std::to_string(restart_count) + "/" +
         std::to_string(local_rank);
}

/// Where local rank `local_rank` of attempt `restart_count` writes its error file, under
/// `error_dir` (torchrun's layout: the log directory's attempt folders); empty when `error_dir` is.
inline std::string error_file_path(const std::string& error_dir, const std::string& run_id,
                                   int restart_count, int local_rank) {
  if (error_dir.empty()) return {};
  return attempt_log_dir(error_dir, run_id, restart_count, local_rank) + "/error.json";
}

/// Starts one attempt's workers and supervises them until all have ended. With `error_dir`,
/// each worker gets TORCHELASTIC_ERROR_FILE=error_file_path(...) and a failed worker's message
/// is read from it.
inline GroupOutcome run_attempt(const LaunchPlan& plan, int restart_count,
                                const std::string& log_dir, detail::SignalCatcher* signals,
                                const RunOptions& options, const std::string& error_dir = {}) {
  std::vector<detail::Worker> workers;
  workers.reserve(static_cast<std::size_t>(plan.nproc_per_node));
  for (int local_rank = 0; local_rank < plan.nproc_per_node; ++local_rank) {
    auto& worker = workers.emplace_back();
    worker.rank = plan.global_rank(local_rank);
    worker.local_rank = local_rank;
    const std::string prefix = "[rank " + std::to_string(worker.rank) + "] ";
    const Std redirected = plan.redirects.for_rank(local_rank);
    const Std teed = plan.tee.for_rank(local_rank);
    const std::string dir = attempt_log_dir(log_dir, plan.run_id, restart_count, local_rank);
    std::array<detail::Pipe, 2> pipes{detail::make_pipe("launch"), detail::make_pipe("launch")};
    for (int s = 0; s < 2; ++s) {
      const bool out = s == 0;
      const bool to_file = out ? takes_stdout(redirected) || takes_stdout(teed)
                               : takes_stderr(redirected) || takes_stderr(teed);
      const bool to_console = out ? !takes_stdout(redirected) || takes_stdout(teed)
                                  : !takes_stderr(redirected) || takes_stderr(teed);
      detail::Fd file;
      if (to_file) {
        detail::make_directories(dir);
        file = detail::open_log(dir + (out ? "/stdout.log" : "/stderr.log"));
      }
      const auto s_index = static_cast<std::size_t>(s);
      worker.streams[s_index] = detail::OutputStream(
          std::move(pipes[s_index].read), prefix,
          to_console ? (out ? options.console_out : options.console_err) : -1, std::move(file));
    }
    const detail::ChildSetup setup{pipes[0].write.get(), pipes[1].write.get(),
                                   signals != nullptr ? &signals->original_mask() : nullptr};
    auto environment = worker_environment(plan, local_rank, restart_count);
    if (const auto error_file = error_file_path(error_dir, plan.run_id, restart_count, local_rank);
        !error_file.empty()) {
      detail::make_directories(std::filesystem::path(error_file).parent_path().string());
      std::error_code ignored;
      std::filesystem::remove(error_file, ignored);  // a file of an earlier run is not this one's
      environment.push_back("TORCHELASTIC_ERROR_FILE=" + error_file);
    }
    worker.child = detail::exec_child(plan.command, environment, setup);
  }
  auto outcome =
      detail::supervise(workers, {plan.monitor_interval, plan.grace, signals, std::nullopt});
  for (auto& failure : outcome.failures) {
    const auto path = error_file_path(error_dir, plan.run_id, restart_count, failure.local_rank);
    if (path.empty()) continue;
    if (auto message = read_error_file(path)) failure.message = std::move(*message);
  }
  return outcome;
}

namespace detail {

/// A directory of the launcher's own, removed with everything in it when the launch ends.
class TemporaryDirectory {
 public:
  TemporaryDirectory() = default;
  explicit TemporaryDirectory(std::string prefix) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/" +
                          std::move(prefix) + "XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      throw Error("tandemrun", "cannot create a temporary directory: " + errno_text(errno));
    }
    path_ = std::move(pattern);
  }
  TemporaryDirectory(const TemporaryDirectory&) = delete;
  TemporaryDirectory& operator=(const TemporaryDirectory&) = delete;
  ~TemporaryDirectory() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
};

}  // namespace detail

/// Runs the plan to the end, restarting the whole group up to max_restarts times after a
/// failure. Returns the launcher's exit code: 0 when every worker exited 0; 1 after a failure
/// with no restarts left (the summary is printed); 128+N after a caught signal N was forwarded.
inline int run(const LaunchPlan& plan, const RunOptions& options = {}) {
  const auto say = [&](const std::string& text) {
    detail::write_all(options.console_err, "tandemrun: " + text + "\n");
  };
  if (plan.set_omp_num_threads) detail::write_all(options.console_err, omp_note);
  std::string log_dir = plan.log_dir;
  if (plan.writes_logs() && log_dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/tandemrun_XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      throw Error("log-dir", "cannot create a temporary directory: " + detail::errno_text(errno));
    }
    log_dir = pattern;
    say("log directory set to: " + log_dir);
  }

  // The workers' error files go beside their logs when there is a log directory (kept, as
  // torchrun keeps them), otherwise into a directory of this launch's own, removed at its end.
  std::optional<detail::TemporaryDirectory> private_errors;
  std::string error_dir;
  if (plan.error_files) {
    if (log_dir.empty()) private_errors.emplace("tandemrun_errors_");
    error_dir = log_dir.empty() ? private_errors->path() : log_dir;
  }

  std::optional<detail::SignalCatcher> signals;
  if (options.forward_signals) signals.emplace();
  for (int restart = 0;; ++restart) {
    auto outcome =
        run_attempt(plan, restart, log_dir, signals ? &*signals : nullptr, options, error_dir);
    using Kind = GroupOutcome::Kind;
    if (outcome.kind == Kind::succeeded) return 0;
    if (outcome.kind == Kind::interrupted) {
      say("received " + detail::signal_name(outcome.signal) +
          ", forwarded it to the workers; they have ended");
      return 128 + outcome.signal;
    }
    if (restart < plan.max_restarts) {
      const auto& root = outcome.failures.front();
      say("rank " + std::to_string(root.rank) + " failed (" + root.status.describe() +
          (root.message.empty() ? "" : ": " + detail::shown_message(root.message)) +
          "); restarting the workers (restart " + std::to_string(restart + 1) + " of " +
          std::to_string(plan.max_restarts) + ")");
      continue;
    }
    detail::write_all(options.console_err, failure_summary(plan.command.front(), outcome.failures));
    return 1;
  }
}

}  // namespace tandem::launch
