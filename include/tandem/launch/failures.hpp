// tandem/launch/failures.hpp - what tandemrun says when workers fail: each failed worker (exit
// code or signal, its error file's message), the root cause first - the first worker that failed
// on its own, not one that only followed another's failure - and torchrun's summary with the
// flight recorder's diagnosis under it.
//   launch::order_failures(outcome.failures);   // root cause first, followers after
//   std::fputs(launch::failure_summary("./train", outcome.failures, &flight).c_str(), stderr);
// Needs: POSIX (the process plumbing of launch/detail/process.hpp).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <ctime>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/launch/detail/process.hpp"

namespace tandem::launch {

/// One worker that failed: what torchrun's summary shows of it.
struct WorkerFailure {
  int rank = 0;                                ///< global rank
  int local_rank = 0;                          ///< rank on its node
  detail::ExitStatus status;                   ///< how it ended: an exit code or a signal
  pid_t pid = 0;                               ///< its process id
  std::string host;                            ///< the node it ran on
  std::chrono::system_clock::time_point time;  ///< when it failed (its error file, else seen)
  /// What it wrote to its TORCHELASTIC_ERROR_FILE (tandem::run_main, or Python's
  /// `record` decorator): "TYPE: WHAT"; empty when it wrote nothing.
  std::string message{};
  /// A worker the launcher found stopped (SIGSTOP, a debugger) while the others waited for it;
  /// the launcher ended it. `time` is when it was first seen stopped.
  bool stopped = false;
  /// Set by order_failures: the rank whose failure this one followed (its message says so:
  /// "rank 0 has died", "because rank 0 failed"), -2 for "another rank" it does not name,
  /// -1 when it failed on its own.
  int follows = -1;
};

/// How one attempt of a worker group ended (what run_attempt returns).
struct GroupOutcome {
  /// Every worker exited 0; one failed; a signal stopped the group; or the deadline passed.
  enum class Kind { succeeded, failed, interrupted, timed_out };
  Kind kind = Kind::succeeded;          ///< how the attempt ended
  std::vector<WorkerFailure> failures;  ///< root cause first (once order_failures has run)
  int signal = 0;                       ///< the one forwarded, for interrupted
  /// Workers that ended with a failure after the launcher had stopped the group (their
  /// failure is theirs only when they wrote an error file: run_attempt moves those over).
  std::vector<WorkerFailure> ended_after_stop{};
};

/// What the flight recorder adds to a summary: where the records are, and their diagnosis.
struct FlightSection {
  std::string directory;           ///< the attempt's flight record directory
  std::vector<std::string> lines;  ///< comm/flight_trace.hpp's flight_diagnosis
};

/// The rank whose failure `message` (of rank `own`) says it followed: the backends' words ("rank
/// 2 has died", "rank 2 failed", "rank 2 left the group", "rank 2 is stopped", "waiting for rank
/// 2") or any Error worded "because rank N failed"; -2 for "another rank" or "a peer" it does not
/// name; nullopt when it names no failed peer.
[[nodiscard]] inline std::optional<int> followed_rank(std::string_view message, int own) {
  static constexpr std::array<std::string_view, 10> after{
      "failed", "has died",   "died",        "have died",   "has already ended",
      "left",   "is stopped", "was stopped", "are stopped", "has been stopped"};
  for (std::size_t at = message.find("rank "); at != std::string_view::npos;
       at = message.find("rank ", at + 1)) {
    std::size_t end = at + 5;
    int rank = 0;
    bool digits = false;
    while (end < message.size() && message[end] >= '0' && message[end] <= '9' && rank < 1 << 24) {
      rank = rank * 10 + (message[end++] - '0');
      digits = true;
    }
    if (!digits || rank == own) continue;
    const bool waiting = at >= 12 && message.substr(at - 12, 12) == "waiting for ";
    const std::string_view rest =
        end + 1 < message.size() ? message.substr(end + 1) : std::string_view();
    const bool said = std::any_of(after.begin(), after.end(),
                                  [&](std::string_view verb) { return rest.starts_with(verb); });
    if (waiting || (end < message.size() && message[end] == ' ' && said)) return rank;
  }
  for (std::string_view vague : {"another rank", "other ranks", "a peer", "another process"}) {
    if (message.find(vague) != std::string_view::npos) return -2;
  }
  return std::nullopt;
}

/// Puts the root cause first: the workers that failed on their own (or were found stopped) in
/// the order they failed, then those whose failure followed another listed here (the ones that
/// say so), in order too; sets each one's `follows`. A worker that follows one not listed counts
/// as failing on its own.
inline void order_failures(std::vector<WorkerFailure>& failures) {
  const auto listed = [&](int rank) {
    return std::any_of(failures.begin(), failures.end(),
                       [&](const WorkerFailure& f) { return f.rank == rank; });
  };
  for (auto& failure : failures) {
    failure.follows = -1;
    if (failure.stopped) continue;
    const auto rank = followed_rank(failure.message, failure.rank);
    if (rank && (*rank == -2 || listed(*rank))) failure.follows = *rank;
  }
  const bool any_own = std::any_of(failures.begin(), failures.end(),
                                   [](const WorkerFailure& f) { return f.follows == -1; });
  std::stable_sort(failures.begin(), failures.end(),
                   [&](const WorkerFailure& a, const WorkerFailure& b) {
                     const bool a_own = !any_own || a.follows == -1;
                     const bool b_own = !any_own || b.follows == -1;
                     if (a_own != b_own) return a_own;
                     return a.time < b.time;
                   });
}

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

/// What a failure's summary says it was: the message, else the signal or the exit code.
inline std::string failure_cause(const WorkerFailure& failure) {
  if (failure.stopped) {
    return "stopped (SIGSTOP, SIGTSTP or a debugger) while the other ranks waited for it; "
           "tandemrun ended it (" +
           failure.status.describe() + ")";
  }
  if (!failure.message.empty()) return shown_message(failure.message);
  if (failure.status.signal != 0) {
    return "Signal " + std::to_string(failure.status.signal) + " (" +
           signal_name(failure.status.signal) + ") received by PID " + std::to_string(failure.pid);
  }
  return "exited with code " + std::to_string(failure.status.code);
}
}  // namespace detail

/// torchrun's failure report: the root cause first, then any other worker that failed before the
/// launcher stopped the rest (order_failures puts them so; one that followed another's failure
/// says whose); then, with `flight`, the flight recorder's diagnosis and where its records are.
inline std::string failure_summary(std::string_view program,
                                   const std::vector<WorkerFailure>& failures,
                                   const FlightSection* flight = nullptr) {
  const std::string rule(60, '-');
  // Appended piece by piece: GCC 12 at -O1 takes `std::string(60, '=') + "\n"` for an
  // out-of-bounds copy (-Warray-bounds).
  std::string out(60, '=');
  out.append("\n").append(program).append(" FAILED\n").append(rule).append("\n");
  const auto entry = [&](std::size_t index, const WorkerFailure& failure) {
    out += "[" + std::to_string(index) + "]:\n";
    out += "  time      : " + detail::format_time(failure.time) + "\n";
    out += "  host      : " + failure.host + "\n";
    out += "  rank      : " + std::to_string(failure.rank) +
           " (local_rank: " + std::to_string(failure.local_rank) + ")\n";
    out += "  exitcode  : " + std::to_string(failure.status.torch_exitcode()) +
           " (pid: " + std::to_string(failure.pid) + ")\n";
    out += "  error     : " + detail::failure_cause(failure) + "\n";
    if (failure.follows == -2) out += "  follows   : another rank's failure\n";
    if (failure.follows < 0) return;
    const auto first = std::find_if(failures.begin(), failures.end(), [&](const WorkerFailure& f) {
      return f.rank == failure.follows;
    });
    const std::string followed = "rank " + std::to_string(failure.follows);
    if (first != failures.end() && first->stopped) {
      out += "  follows   : " + followed + ", which was stopped (SIGSTOP, SIGTSTP or a debugger)\n";
      return;
    }
    std::string cause = first == failures.end() ? "" : detail::failure_cause(*first);
    cause = cause.substr(0, cause.find('\n'));
    out += "  follows   : " + followed + " failed" + (cause.empty() ? "" : ": " + cause) + "\n";
  };
  if (!failures.empty()) {
    out += "Root Cause (first observed failure):\n";
    entry(0, failures.front());
  }
  if (failures.size() > 1) {
    out += rule + "\nOther Failures:\n";
    for (std::size_t i = 1; i < failures.size(); ++i) entry(i, failures[i]);
  }
  if (flight != nullptr && !flight->directory.empty()) {
    out += rule + "\nFlight recorder (`tandemrun --trace " + flight->directory + "`):\n";
    if (flight->lines.empty()) out += "  no rank wrote a flight record\n";
    for (const auto& line : flight->lines) out += "  " + line + "\n";
  }
  out.append(60, '=').append("\n");
  return out;
}

}  // namespace tandem::launch
