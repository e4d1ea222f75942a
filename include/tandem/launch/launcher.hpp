// tandem/launch/launcher.hpp - what tandemrun does: torchrun's flags resolved into a plan
// (plan.hpp), each worker's environment, and one node's workers supervised (output, failures,
// restarts, signals, stopped workers, flight records; detail/supervise.hpp, failures.hpp).
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

#include "tandem/comm/flight_settings.hpp"
#include "tandem/comm/flight_trace.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/launch/detail/process.hpp"
#include "tandem/launch/detail/supervise.hpp"
#include "tandem/launch/elastic.hpp"
#include "tandem/launch/failures.hpp"
#include "tandem/launch/nodes.hpp"
#include "tandem/launch/plan.hpp"

namespace tandem::launch {

// --- the environment -----------------------------------------------------------------------------

/// The variables the launcher sets for one worker, exactly torchrun's (plus CUDA_VISIBLE_DEVICES
/// with --devices, OMP_NUM_THREADS when the plan says so, TANDEM_STORE_TOKEN when the plan has a
/// job token, TANDEM_ELASTIC_MAX_WORLD_SIZE for a job that grows). Everything else is inherited.
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
  // A job that grows: every member admits new ranks up to the largest world (tandem::Elastic).
  if (plan.node_slots) vars["TANDEM_ELASTIC_MAX_WORLD_SIZE"] = text(plan.max_world_size());
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

namespace detail {

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
/// (and the time it wrote it) is read from it; the failures come root cause first
/// (order_failures). With `flight_dir`, the workers write their flight records there
/// (TANDEM_FLIGHT_RECORDER_DIR), and the launcher reports a job whose ranks wait long. With
/// plan.elastic and `restarts_left`, a lost worker is replaced while restarts are left (each
/// takes one) and no worker has finished: the new process gets TANDEM_ELASTIC_JOIN=1 and joins
/// the running group (tandem::Elastic).
inline GroupOutcome run_attempt(const LaunchPlan& plan, int restart_count,
                                const std::string& log_dir, detail::SignalCatcher* signals,
                                const RunOptions& options, const std::string& error_dir = {},
                                const std::string& flight_dir = {}, int* restarts_left = nullptr) {
  if (!flight_dir.empty()) detail::make_directories(flight_dir);
  std::vector<detail::Worker> workers;
  workers.reserve(static_cast<std::size_t>(plan.nproc_per_node));
  // Starts `worker`'s process: the first of its local rank (replacement 0), or a replacement for
  // one that was lost (--elastic): its logs go into replacement_K beside the first's, and it
  // learns that it joins a running group (TANDEM_ELASTIC_JOIN=1), as every worker of a node that
  // came to a running job does.
  const auto start = [&](detail::Worker& worker, int replacement) {
    const int local_rank = worker.local_rank;
    const std::string prefix = "[rank " + std::to_string(worker.rank) + "] ";
    const Std redirected = plan.redirects.for_rank(local_rank);
    const Std teed = plan.tee.for_rank(local_rank);
    std::string dir = attempt_log_dir(log_dir, plan.run_id, restart_count, local_rank);
    if (replacement > 0) dir += "/replacement_" + std::to_string(replacement);
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
    if (replacement > 0 || plan.joins_running_job) {
      environment.emplace_back("TANDEM_ELASTIC_JOIN=1");
    }
    if (const auto error_file = error_file_path(error_dir, plan.run_id, restart_count, local_rank);
        !error_file.empty()) {
      detail::make_directories(std::filesystem::path(error_file).parent_path().string());
      std::error_code ignored;
      std::filesystem::remove(error_file, ignored);  // a file of an earlier run is not this one's
      environment.push_back("TORCHELASTIC_ERROR_FILE=" + error_file);
    }
    if (!flight_dir.empty()) {
      const std::string key = std::string(flight_recorder_dir_variable) + "=";
      std::erase_if(environment, [&](const std::string& entry) { return entry.starts_with(key); });
      environment.push_back(key + flight_dir);
    }
    worker.child = detail::exec_child(plan.command, environment, setup);
  };
  for (int local_rank = 0; local_rank < plan.nproc_per_node; ++local_rank) {
    auto& worker = workers.emplace_back();
    worker.rank = plan.global_rank(local_rank);
    worker.local_rank = local_rank;
    start(worker, 0);
  }
  std::map<int, int> replacements;  // by local rank
  detail::SuperviseOptions supervise{plan.monitor_interval, plan.grace, signals, std::nullopt};
  supervise.failure_grace = plan.failure_grace;
  supervise.survivors_go_on = plan.elastic;
  if (plan.elastic && restarts_left != nullptr) {
    supervise.replace = [&](detail::Worker& worker) {
      if (*restarts_left <= 0) return false;
      --*restarts_left;
      worker.stopped_since.reset();
      start(worker, ++replacements[worker.local_rank]);
      return true;
    };
  }
  supervise.report_fd = options.console_err;
  supervise.flight_dir = flight_dir.empty() ? plan.flight_dir : flight_dir;
  auto outcome = detail::supervise(workers, supervise);
  // A worker stopped by the launcher that had written its error: it failed on its own, only too
  // slowly to be seen first (its cause must not vanish from the summary).
  for (auto& late : outcome.ended_after_stop) {
    const auto path = error_file_path(error_dir, plan.run_id, restart_count, late.local_rank);
    if (outcome.kind == GroupOutcome::Kind::failed && !path.empty() && read_error_file(path)) {
      outcome.failures.push_back(std::move(late));
    }
  }
  outcome.ended_after_stop.clear();
  for (auto& failure : outcome.failures) {
    const auto path = error_file_path(error_dir, plan.run_id, restart_count, failure.local_rank);
    if (path.empty()) continue;
    if (auto message = read_error_file(path)) {
      failure.message = std::move(*message);
      // When it failed: when it wrote its error, which may be well before it ended.
      struct stat info {};
      if (::stat(path.c_str(), &info) == 0) {
        const auto written = std::chrono::system_clock::time_point(
            std::chrono::duration_cast<std::chrono::system_clock::duration>(
                std::chrono::seconds(info.st_mtim.tv_sec) +
                std::chrono::nanoseconds(info.st_mtim.tv_nsec)));
        failure.time = std::min(failure.time, written);
      }
    }
  }
  order_failures(outcome.failures);
  return outcome;
}

/// What the flight recorder says of an attempt whose records are in `dir`, written since
/// `since_ns` (Unix nanoseconds: a directory the launcher's environment names may hold older
/// jobs' records); nothing when no rank wrote one.
inline std::optional<FlightSection> flight_section(const std::string& dir, std::int64_t since_ns) {
  if (dir.empty()) return std::nullopt;
  auto set = read_flight_dumps(dir);
  std::erase_if(set.files, [&](const FlightTraceFile& file) { return file.time_ns < since_ns; });
  if (set.files.empty()) return std::nullopt;
  const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  return FlightSection{dir, flight_diagnosis(set.files, now)};
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
  /// Keeps the directory after all (its path is handed to the user).
  void keep() noexcept { path_.clear(); }

 private:
  std::string path_;
};

}  // namespace detail

/// Runs the plan to the end, restarting the whole group up to max_restarts times after a
/// failure (with --elastic, each lost worker replaced takes one of those restarts too). Returns the
/// launcher's exit code: 0 when every worker exited 0; 1 after a failure with no restarts left (the
/// summary is printed); 128+N after a caught signal N was forwarded.
inline int run(const LaunchPlan& plan, const RunOptions& options = {}) {
  const auto say = [&](const std::string& text) {
    detail::write_all(options.console_err, "tandemrun: " + text + "\n");
  };
  if (plan.set_omp_num_threads) detail::write_all(options.console_err, omp_note);
  if (plan.joins_running_job) {
    say("joined the job at " + plan.rdzv_host + ":" + std::to_string(plan.rdzv_port) + " as node " +
        std::to_string(plan.node_rank) + ": ranks " + std::to_string(plan.global_rank(0)) + "-" +
        std::to_string(plan.global_rank(plan.nproc_per_node - 1)) +
        " join its running group (--elastic)");
  } else if (plan.node_slots) {
    say(nnodes_text(plan.nnodes, plan.max_nnodes) + ": running " + std::to_string(plan.nnodes) +
        " node(s); nodes started later join the running job through " + plan.rdzv_host + ":" +
        std::to_string(plan.rdzv_port) + " (--rdzv-endpoint), up to " +
        std::to_string(plan.max_nnodes));
  } else if (plan.max_nnodes > plan.nnodes) {
    say(nnodes_text(plan.nnodes, plan.max_nnodes) + ": running " + std::to_string(plan.nnodes) +
        " node(s); nodes started later can join the running job only with --rdzv-endpoint "
        "HOST:PORT, where the launchers meet");
  }
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

  // The workers' flight records go beside their logs, or into a directory of this launch's own
  // that is kept only when an attempt fails or is interrupted with records in it; a directory
  // the launcher's environment names is the workers' own (they inherit it).
  std::optional<detail::TemporaryDirectory> private_flight;
  if (plan.flight_dir.empty() && log_dir.empty()) private_flight.emplace("tandemrun_flight_");
  const auto flight_dir = [&](int restart) -> std::string {
    if (!plan.flight_dir.empty()) return {};
    const std::string attempt = "/attempt_" + std::to_string(restart) + "/flight";
    return log_dir.empty() ? private_flight->path() + attempt
                           : log_dir + "/" + plan.run_id + attempt;
  };
  std::int64_t attempt_started = 0;
  const auto flight_records = [&](int restart) {
    auto section = flight_section(plan.flight_dir.empty() ? flight_dir(restart) : plan.flight_dir,
                                  attempt_started);
    if (section && private_flight) private_flight->keep();
    return section;
  };

  std::optional<detail::SignalCatcher> signals;
  if (options.forward_signals) signals.emplace();
  // With --elastic, replacing a lost worker takes a restart as restarting the group does.
  int restarts_left = plan.max_restarts;
  for (int restart = 0;; ++restart) {
    attempt_started = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
    auto outcome = run_attempt(plan, restart, log_dir, signals ? &*signals : nullptr, options,
                               error_dir, flight_dir(restart), &restarts_left);
    using Kind = GroupOutcome::Kind;
    if (outcome.kind == Kind::succeeded) return 0;
    if (outcome.kind == Kind::interrupted) {
      say("received " + detail::signal_name(outcome.signal) +
          ", forwarded it to the workers; they have ended");
      if (const auto section = flight_records(restart)) {
        say("the workers' flight records are in " + section->directory +
            " (`tandemrun --trace DIR` reads them)");
      }
      return 128 + outcome.signal;
    }
    if (restarts_left > 0) {
      --restarts_left;
      const auto& root = outcome.failures.front();
      say("rank " + std::to_string(root.rank) + " failed (" + root.status.describe() +
          (root.message.empty() ? "" : ": " + detail::shown_message(root.message)) +
          "); restarting the workers (restart " +
          std::to_string(plan.max_restarts - restarts_left) + " of " +
          std::to_string(plan.max_restarts) + ")");
      continue;
    }
    const auto section = flight_records(restart);
    detail::write_all(options.console_err, failure_summary(plan.command.front(), outcome.failures,
                                                           section ? &*section : nullptr));
    return 1;
  }
}

}  // namespace tandem::launch
