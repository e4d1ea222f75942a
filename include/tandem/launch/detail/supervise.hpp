// tandem/launch/detail/supervise.hpp - how a launcher watches its workers: their output, line by
// line behind "[rank N] ", their ends, the grace after the first failure, workers found stopped,
// the flight records of a job whose ranks wait long, and the signals and deadlines that stop them.
//   auto outcome = tandem::launch::detail::supervise(workers, {.monitor_interval = 100ms});
// Needs: POSIX and Linux (poll, /proc). Not a public header: launcher.hpp and spawn.hpp use it.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem/comm/flight_trace.hpp"
#include "tandem/core/error.hpp"
#include "tandem/launch/detail/process.hpp"
#include "tandem/launch/failures.hpp"

namespace tandem::launch {

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
  /// Since when it has been seen stopped (SIGSTOP, a debugger); unset while it runs.
  std::optional<std::chrono::system_clock::time_point> stopped_since;
};

struct SuperviseOptions {
  std::chrono::milliseconds monitor_interval{100};
  std::chrono::milliseconds grace{5000};
  SignalCatcher* signals = nullptr;  ///< when set, caught signals are forwarded to the workers
  std::optional<std::chrono::steady_clock::time_point> deadline;  ///< then: stop them all
  /// After the first failure, how long the others may go on failing on their own (writing their
  /// error files) before the launcher stops them; it ends early once every worker left is
  /// stopped (SIGSTOP) or has ended.
  std::chrono::milliseconds failure_grace{0};
  /// A worker ended by a signal is lost, not a failure: the others go on; a stopped one is ended
  /// (SIGKILL) once every other worker has finished (--elastic).
  bool survivors_go_on = false;
  /// --elastic with restarts: called for a lost worker while no worker has finished; starts its
  /// replacement into the same Worker (a new child and streams) and returns true, or returns
  /// false when no restart is left. Unset: lost workers are not replaced.
  std::function<bool(Worker&)> replace{};
  /// Where the launcher says what it sees (workers found stopped, a stalled job); -1: nowhere.
  int report_fd = -1;
  /// The workers' flight record directory, watched for long waits ("": not watched).
  std::string flight_dir{};
};

/// A process's state letter in /proc (R, S, D, T stopped, t traced, Z, X); '?' when unreadable.
inline char process_state(pid_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return '?';
  std::array<char, 512> text{};
  const auto n = ::read(fd.get(), text.data(), text.size() - 1);
  if (n <= 0) return '?';
  const std::string_view stat(text.data(), static_cast<std::size_t>(n));
  const auto close = stat.rfind(')');
  return close != std::string_view::npos && close + 2 < stat.size() ? stat[close + 2] : '?';
}

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
      if (!worker.child.status().failed()) {
        finished_ = true;
      } else if (options_.survivors_go_on && worker.child.status().signal != 0 && !kill_at_) {
        const std::string lost = "rank " + std::to_string(worker.rank) + " was lost (" +
                                 worker.child.status().describe() + ")";
        WorkerFailure failure{
            worker.rank, worker.local_rank, worker.child.status(), worker.child.pid(),
            host_,       worker.ended_at};
        if (!finished_ && options_.replace && options_.replace(worker)) {
          report(lost + "; the others go on and a replacement joins them (--elastic)");
          all_ended = false;
          continue;
        }
        report(lost + "; the others go on (--elastic)");
        lost_.push_back(std::move(failure));
      } else {
        failed_now.push_back({worker.rank, worker.local_rank, worker.child.status(),
                              worker.child.pid(), host_, worker.ended_at});
      }
    }
    if (all_ended && !finished_ && outcome_.failures.empty() && failed_now.empty() &&
        !lost_.empty()) {
      failed_now = std::move(lost_);  // every worker was lost: none went on
      lost_.clear();
    }
    if (!failed_now.empty() && kill_at_) {
      // Ended after the launcher stopped the group: its own failure only if it says so (an
      // error file written before the stop: run_attempt looks).
      for (auto& failure : failed_now) outcome_.ended_after_stop.push_back(std::move(failure));
    }
    if (!failed_now.empty() && !kill_at_) {
      // Only failures seen before the launcher stopped the group are the workers' own.
      outcome_.kind = GroupOutcome::Kind::failed;
      for (auto& failure : failed_now) outcome_.failures.push_back(std::move(failure));
      if (!failed_at_) failed_at_ = clock::now();
      if (options_.failure_grace.count() <= 0) stop_all(SIGTERM);
    }
    for (auto& failure : outcome_.failures) {
      // A stopped worker the launcher ended: how it ended, once it has.
      if (!failure.stopped) continue;
      for (const auto& worker : workers_) {
        if (worker.rank == failure.rank && worker.child.ended())
          failure.status = worker.child.status();
      }
    }
    return all_ended;
  }

  /// The deadline stops the group; so does the end of the grace after a failure (early when
  /// waiting can change nothing); the grace period's end kills what is left.
  void enforce_deadlines() {
    const auto now = clock::now();
    if (options_.deadline && now >= *options_.deadline && !kill_at_) {
      outcome_.kind = GroupOutcome::Kind::timed_out;
      stop_all(SIGTERM);
    }
    if (failed_at_ && !kill_at_ &&
        (now >= *failed_at_ + options_.failure_grace || only_stopped_left())) {
      blame_stopped();
      stop_all(SIGTERM);
    }
    if (kill_at_ && !killed_ && now >= *kill_at_) kill_all();
    if (options_.survivors_go_on && finished_ && !failed_at_ && !kill_at_ && !stopped_ended_ &&
        only_stopped_left()) {
      stopped_ended_ = true;
      for (auto& worker : workers_) {  // nobody is left to wait for them
        if (worker.child.ended()) continue;
        report("rank " + std::to_string(worker.rank) +
               " is stopped and the others have finished: ending it (--elastic)");
        worker.child.signal(SIGKILL);
      }
    }
  }

  /// Once a second: workers found stopped (or running again) are reported, and the flight
  /// records of a job whose ranks wait long are merged into one diagnosis.
  void watch() {
    const auto now = clock::now();
    if (now < next_watch_) return;
    next_watch_ = now + std::chrono::seconds(1);
    for (auto& worker : workers_) {
      if (worker.child.ended()) continue;
      const char state = process_state(worker.child.pid());
      const bool stopped = state == 'T' || state == 't';
      if (stopped && !worker.stopped_since) {
        worker.stopped_since = std::chrono::system_clock::now();
        report("rank " + std::to_string(worker.rank) + " (pid " +
               std::to_string(worker.child.pid()) +
               ") is stopped (SIGSTOP, SIGTSTP or a debugger): the other ranks wait for it until "
               "their timeout");
      } else if (!stopped && state != '?' && worker.stopped_since) {
        worker.stopped_since.reset();
        report("rank " + std::to_string(worker.rank) + " (pid " +
               std::to_string(worker.child.pid()) + ") runs again");
      }
    }
    watch_flight_records(now);
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
  void report(const std::string& text) const {
    if (options_.report_fd >= 0) write_all(options_.report_fd, "tandemrun: " + text + "\n");
  }

  /// Whether every worker not yet ended is stopped (SIGSTOP): then no grace helps.
  [[nodiscard]] bool only_stopped_left() const {
    bool any = false;
    for (const auto& worker : workers_) {
      if (worker.child.ended()) continue;
      const char state = process_state(worker.child.pid());
      if (state != 'T' && state != 't') return false;
      any = true;
    }
    return any;
  }

  /// The workers stopped when the others failed are part of the failure: they are what the
  /// others waited for.
  void blame_stopped() {
    for (const auto& worker : workers_) {
      if (worker.child.ended()) continue;
      const char state = process_state(worker.child.pid());
      if (state != 'T' && state != 't') continue;
      WorkerFailure failure{
          worker.rank,  worker.local_rank,
          {0, SIGTERM}, worker.child.pid(),
          host_,        worker.stopped_since.value_or(std::chrono::system_clock::now())};
      failure.stopped = true;
      outcome_.failures.push_back(std::move(failure));
    }
  }

  /// A new or rewritten dump for a long wait ("waiting") is merged with the others once they
  /// have settled (a second without a change, at most five), and the diagnosis is reported.
  void watch_flight_records(clock::time_point now) {
    if (options_.flight_dir.empty()) return;
    std::vector<std::pair<std::string, std::int64_t>> seen;
    if (DIR* listing = ::opendir(options_.flight_dir.c_str())) {
      while (const dirent* item = ::readdir(listing)) {
        const std::string name(item->d_name);
        if (!name.starts_with("flight-") || !name.ends_with(".json")) continue;
        struct stat info {};
        const std::string path = options_.flight_dir + "/" + name;
        if (::stat(path.c_str(), &info) == 0) {
          seen.emplace_back(name, info.st_mtim.tv_sec * 1'000'000'000LL + info.st_mtim.tv_nsec);
        }
      }
      ::closedir(listing);
    }
    std::sort(seen.begin(), seen.end());
    if (seen != flight_files_) {
      flight_files_ = std::move(seen);
      flight_changed_ = now;
      if (!flight_pending_) flight_pending_ = now;
      return;
    }
    if (!flight_pending_ || (now - flight_changed_ < std::chrono::seconds(1) &&
                             now - *flight_pending_ < std::chrono::seconds(5))) {
      return;
    }
    flight_pending_.reset();
    auto set = read_flight_dumps(options_.flight_dir);
    std::erase_if(set.files,
                  [&](const FlightTraceFile& file) { return file.time_ns < started_ns_; });
    bool new_wait = false;
    for (const auto& file : set.files) {
      if (file.reason == "waiting" && file.time_ns > flight_reported_ns_) new_wait = true;
      flight_reported_ns_ = std::max(flight_reported_ns_, file.time_ns);
    }
    if (!new_wait) return;
    const auto lines = flight_diagnosis(set.files, wall_ns());
    if (lines.empty()) return;
    report("ranks wait long; their flight records (`tandemrun --trace " + options_.flight_dir +
           "`) say:");
    for (const auto& line : lines) report("  " + line);
  }

  static std::int64_t wall_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }

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
    if (failed_at_ && !kill_at_) until(*failed_at_ + options_.failure_grace);
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
  std::optional<clock::time_point> failed_at_;  ///< the first failure: the grace starts
  bool finished_ = false;                       ///< a worker exited 0
  bool stopped_ended_ = false;                  ///< --elastic: the stopped ones were ended
  std::vector<WorkerFailure> lost_;             ///< --elastic: workers a signal ended
  clock::time_point next_watch_ = clock::now() + std::chrono::seconds(1);
  std::vector<std::pair<std::string, std::int64_t>> flight_files_;  ///< names and mtimes seen
  clock::time_point flight_changed_{};
  std::optional<clock::time_point> flight_pending_;  ///< a change not yet reported
  std::int64_t flight_reported_ns_ = 0;              ///< the newest dump time reported
  std::int64_t started_ns_ = wall_ns();              ///< older records are another job's
};

/// Watches a started group until every worker has ended: a monitor_interval poll() on the
/// output pipes and the signal descriptor, waitpid(WNOHANG) on each worker, and once a second
/// their /proc state and flight records. The first failure (after failure_grace), a caught
/// signal or the deadline stops the rest: SIGTERM (or the signal), then SIGKILL after the grace
/// period.
inline GroupOutcome supervise(std::vector<Worker>& workers, const SuperviseOptions& options) {
  Supervisor supervisor(workers, options);
  while (!supervisor.reap()) {
    supervisor.enforce_deadlines();
    supervisor.watch();
    supervisor.wait_and_pump();
  }
  return std::move(supervisor.outcome());
}

}  // namespace detail

}  // namespace tandem::launch
