// tandem/comm/detail/flight_monitor.hpp - the process's side of the flight recorder: every live
// ring, the dumps (on a failure, once per kind of cause; on SIGUSR1; when an operation waits
// long), and the monitor thread that says when a rank has waited long and for whom.
//   FlightRegistry::instance().add(ring, settings);      // a communicator's first operation
//   FlightRegistry::instance().dump_on_failure(error);   // the front end, when an operation fails
//   flight_awaiting(missing);                              // a wait loop that knows who is missing
// Needs: POSIX (a pipe, sigaction, threads). Not a public header: comm/flight_recorder.hpp is.
//
// The monitor wakes a few times a second (more often for short notice intervals). Each ring's
// oldest started operation that has waited half the notice interval makes the process write its
// dump once (its peers and tandemrun read it: that is how Gloo and MPI ranks learn who is
// missing); one that has waited the interval, then twice, four times as long..., gets a notice.
// SIGUSR1 (where the program left it at its default) writes a pipe; the monitor writes the dump.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "tandem/comm/detail/flight_dump.hpp"
#include "tandem/comm/detail/flight_ring.hpp"
#include "tandem/comm/flight_settings.hpp"
#include "tandem/comm/flight_trace.hpp"
#include "tandem/core/timeout.hpp"

namespace tandem::detail {

/// The operation the calling thread is running, for wait loops deep inside a backend.
struct CurrentFlight {
  FlightRing* ring = nullptr;
  std::uint64_t ticket = 0;
};
inline thread_local CurrentFlight current_flight{};

/// Marks the operation this thread runs (restoring the outer one: a level inside another).
class FlightScope {
 public:
  FlightScope(FlightRing* ring, std::uint64_t ticket) noexcept : saved_(current_flight) {
    current_flight = {ring, ticket};
  }
  FlightScope(const FlightScope&) = delete;
  FlightScope& operator=(const FlightScope&) = delete;
  ~FlightScope() { current_flight = saved_; }

 private:
  CurrentFlight saved_;
};

/// A wait loop that knows which peers its operation waits for says so (a few times a second at
/// most); the waiting notice then names exactly them.
inline void flight_awaiting(const std::vector<int>& missing) {
  if (current_flight.ring != nullptr) {
    current_flight.ring->set_awaiting(current_flight.ticket, missing);
  }
}

/// Why a dump was written.
enum class FlightReason : std::uint8_t { timeout, mismatch, peer, error, signal, waiting, request };

inline const char* name(FlightReason reason) noexcept {
  switch (reason) {
    case FlightReason::timeout:
      return "timeout";
    case FlightReason::mismatch:
      return "mismatch";
    case FlightReason::peer:
      return "peer";
    case FlightReason::error:
      return "error";
    case FlightReason::signal:
      return "signal";
    case FlightReason::waiting:
      return "waiting";
    case FlightReason::request:
      return "request";
  }
  return "unknown";
}

/// The kind of an operation's failure, from its Error's words (the backends' texts).
inline FlightReason classify_failure(std::string_view cause) {
  const auto says = [&](std::initializer_list<std::string_view> words) {
    return std::any_of(words.begin(), words.end(),
                       [&](std::string_view w) { return cause.find(w) != std::string_view::npos; });
  };
  if (says({"timed out", "did not finish within", "no progress after", "did not complete within",
            "Timed out"})) {
    return FlightReason::timeout;
  }
  if (says({"disagree", "different operations", "different collectives", "different steps",
            "lost step"})) {
    return FlightReason::mismatch;
  }
  if (says({"died", "left the group", "stopped", "failed", "gone", "closed", "aborted", "unusable",
            "ended"})) {
    return FlightReason::peer;
  }
  return FlightReason::error;
}

/// SIGUSR1's pipe; the handler only writes one byte to it.
inline std::atomic<int> flight_signal_fd{-1};

extern "C" inline void tandem_flight_signal_handler(int) {
  const int saved = errno;
  const int fd = flight_signal_fd.load(std::memory_order_relaxed);
  if (fd >= 0) {
    const char byte = 's';
    [[maybe_unused]] const auto n = ::write(fd, &byte, 1);
  }
  errno = saved;
}

/// Writes `line` (and a newline) to stderr in one call, so that ranks' lines do not mix.
inline void flight_say(const std::string& line) noexcept {
  try {
    const std::string text = line + "\n";
    [[maybe_unused]] const auto n = ::write(STDERR_FILENO, text.data(), text.size());
  } catch (...) {
  }
}

/// "rank 2", or "rank 5 (rank 1 of GlooComm#0/1.0)" for a group that is not the job's.
inline std::string flight_rank_label(const FlightRing& ring) {
  const auto [rank, world] = launcher_rank();
  const bool root = ring.name().find('/') == std::string::npos;
  if (root && (rank < 0 || (rank == ring.rank() && world == ring.size()))) {
    return "rank " + std::to_string(ring.rank());
  }
  if (rank < 0) return "rank " + std::to_string(ring.rank()) + " of " + ring.name();
  return "rank " + std::to_string(rank) + " (rank " + std::to_string(ring.rank()) + " of " +
         ring.name() + ")";
}

/// Every live ring of the process, the dumps, and the monitor thread. One per process, never
/// destroyed (communicators may outlive static objects).
class FlightRegistry {
 public:
  static FlightRegistry& instance() {
    static auto* registry = new FlightRegistry;
    return *registry;
  }

  /// A ring starts recording (the communicator's first operation); the monitor starts with the
  /// process's first ring.
  void add(const std::shared_ptr<FlightRing>& ring, const FlightRecorderSettings& settings) {
    std::lock_guard lock(mutex_);
    std::erase_if(rings_, [](const Registered& r) { return r.ring.expired(); });
    rings_.push_back({ring, settings.notice_interval, 0});
    if (started_unix_ns_ == 0) {
      started_unix_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
    }
    dir_ = flight_directory(settings);
    if (monitor_pid_ != ::getpid()) start_monitor_locked();
  }

  /// Writes every live ring to this process's dump file; returns its path ("" when it could not).
  /// Never throws; a failing write is said once on stderr.
  std::string dump(FlightReason reason, std::string_view cause) noexcept {
    try {
      std::vector<std::shared_ptr<FlightRing>> rings;
      std::string dir;
      {
        std::lock_guard lock(mutex_);
        for (const auto& r : rings_) {
          if (auto ring = r.ring.lock()) rings.push_back(std::move(ring));
        }
        dir = dir_;
      }
      if (rings.empty() || dir.empty()) return {};
      std::lock_guard writing(dump_mutex_);
      const std::string path = flight_dump_path(dir);
      if (make_flight_directory(dir) &&
          write_file_whole(path, flight_dump_json(name(reason), cause, rings))) {
        return path;
      }
      if (!write_failed_.exchange(true)) {
        flight_say("tandem: cannot write the flight record to " + path + ": " +
                   std::string(std::strerror(errno)));
      }
    } catch (...) {
    }
    return {};
  }

  /// An operation failed with `cause`: the first failure of each kind (timeout, mismatch, lost
  /// peer, other) writes the dump. Never throws.
  void dump_on_failure(std::string_view cause) noexcept {
    const FlightReason reason = classify_failure(cause);
    const unsigned bit = 1u << static_cast<unsigned>(reason);
    if (dumped_.fetch_or(bit) & bit) return;
    const std::string path = dump(reason, cause);
    if (!path.empty()) flight_say("tandem: flight record written to " + path);
  }

  /// The directory dumps go to ("" before the first ring).
  [[nodiscard]] std::string directory() const {
    std::lock_guard lock(mutex_);
    return dir_;
  }

 private:
  struct Registered {
    std::weak_ptr<FlightRing> ring;
    Timeout notice;
    std::uint64_t dumped_ticket;  ///< the operation whose long wait was dumped
  };
  struct Due {
    std::shared_ptr<FlightRing> ring;
    FlightEntry entry;
    Timeout notice;
  };

  // A child forked while another thread held a lock here would find it held forever; and the
  // parent's communicators, pipe and monitor thread are not the child's.
  FlightRegistry() {
    ::pthread_atfork([] { instance().before_fork(); }, [] { instance().after_fork(false); },
                     [] { instance().after_fork(true); });
  }
  void before_fork() {
    mutex_.lock();
    dump_mutex_.lock();
  }
  void after_fork(bool child) {
    if (child) {
      rings_.clear();
      monitor_pid_ = 0;
      signal_read_ = -1;
      flight_signal_fd.store(-1);
      dumped_.store(0);
      announced_.store(false);
    }
    dump_mutex_.unlock();
    mutex_.unlock();
  }

  void start_monitor_locked() {
    int ends[2] = {-1, -1};
    if (::pipe2(ends, O_CLOEXEC | O_NONBLOCK) == 0) {
      signal_read_ = ends[0];
      flight_signal_fd.store(ends[1]);
      struct sigaction current {};
      if (::sigaction(SIGUSR1, nullptr, &current) == 0 && current.sa_handler == SIG_DFL &&
          !(current.sa_flags & SA_SIGINFO)) {
        struct sigaction handler {};
        handler.sa_handler = tandem_flight_signal_handler;
        sigemptyset(&handler.sa_mask);
        handler.sa_flags = SA_RESTART;
        ::sigaction(SIGUSR1, &handler, nullptr);
      }
    }
    monitor_pid_ = ::getpid();
    try {
      std::thread([this] { monitor(); }).detach();
    } catch (...) {
      monitor_pid_ = 0;  // no thread: no notices, and the next ring tries again
    }
  }

  /// How often the monitor looks: a quarter of the shortest notice interval, 20-250 ms.
  std::chrono::milliseconds tick_locked() const {
    Timeout shortest = std::chrono::milliseconds(1000);
    for (const auto& r : rings_) {
      if (r.notice > Timeout::zero()) shortest = std::min(shortest, r.notice);
    }
    return std::clamp<std::chrono::milliseconds>(shortest / 4, std::chrono::milliseconds(20),
                                                 std::chrono::milliseconds(250));
  }

  void monitor() {
    for (;;) {
      std::chrono::milliseconds tick{250};
      int fd = -1;
      {
        std::lock_guard lock(mutex_);
        tick = tick_locked();
        fd = signal_read_;
      }
      pollfd watch{fd, POLLIN, 0};
      const int ready = ::poll(&watch, fd >= 0 ? 1 : 0, static_cast<int>(tick.count()));
      if (ready > 0 && (watch.revents & POLLIN)) {
        char bytes[64];
        while (::read(fd, bytes, sizeof bytes) > 0) {
        }
        const std::string path = dump(FlightReason::signal, "SIGUSR1");
        if (!path.empty()) flight_say("tandem: SIGUSR1: flight record written to " + path);
      }
      try {
        look();
      } catch (...) {
        // A notice that cannot be composed (out of memory) is not worth ending the process.
      }
    }
  }

  /// One look at every ring's oldest started operation.
  void look() {
    const std::int64_t now = flight_now_ns();
    std::vector<Due> due;
    bool dump_waiting = false;
    {
      std::lock_guard lock(mutex_);
      std::erase_if(rings_, [](const Registered& r) { return r.ring.expired(); });
      for (auto& r : rings_) {
        if (r.notice <= Timeout::zero()) continue;
        auto ring = r.ring.lock();
        if (!ring) continue;
        for (const FlightEntry& e : ring->open_entries()) {
          if (e.state != FlightState::started) continue;
          const std::int64_t waited = now - e.started_ns;
          const std::int64_t notice =
              std::chrono::duration_cast<std::chrono::nanoseconds>(r.notice).count();
          if (waited >= notice / 2 && r.dumped_ticket != e.ticket) {
            r.dumped_ticket = e.ticket;
            dump_waiting = true;
          }
          const int doublings = std::min<int>(e.notices, 20);
          if (waited >= notice * (std::int64_t{1} << doublings)) due.push_back({ring, e, r.notice});
          break;  // the oldest started operation is the one that waits; the rest queue behind it
        }
      }
    }
    if (dump_waiting) {
      const std::string path = dump(FlightReason::waiting, "");
      if (!path.empty() && !announced_.exchange(true)) {
        std::string dir = path.substr(0, path.rfind('/'));
        flight_say("tandem: a long wait: flight record written to " + path +
                   " (`tandemrun --trace " + dir + "` merges every rank's)");
      }
    }
    for (const auto& d : due) {
      flight_say(notice_text(*d.ring, d.entry, now));
      d.ring->count_notice(d.entry.ticket);
    }
  }

  /// The peers `e` waits for, and those that have arrived, from the backend's word where it gave
  /// one, else from this process's rings and the other processes' dumps.
  std::string notice_text(const FlightRing& ring, const FlightEntry& e, std::int64_t now) {
    std::vector<int> missing;
    std::vector<int> arrived;
    std::vector<std::string> where(static_cast<std::size_t>(ring.size()));
    if (!e.collective) {
      if (e.peer >= 0) missing.push_back(e.peer);
    } else if (auto [said, awaited] = ring.awaiting(e.ticket); said) {
      missing = std::move(awaited);
      for (int r = 0; r < ring.size(); ++r) {
        if (r != ring.rank() && std::find(missing.begin(), missing.end(), r) == missing.end()) {
          arrived.push_back(r);
        }
      }
    } else {
      const auto view = peer_view();  // the members point into it
      const auto members = group_members(view, ring.name(), ring.size());
      for (int r = 0; r < ring.size(); ++r) {
        if (r == ring.rank()) continue;
        const FlightTraceComm* peer =
            members.empty() ? nullptr : members[static_cast<std::size_t>(r)];
        const TracePosition at = peer ? trace_position(*peer) : TracePosition{};
        if (at.open && at.open->sequence == e.sequence) {
          arrived.push_back(r);
          continue;
        }
        missing.push_back(r);
        if (at.open) where[static_cast<std::size_t>(r)] = "in " + entry_text(*at.open);
      }
    }
    const std::int64_t waited = now - e.started_ns;
    FlightTraceEntry shown;
    shown.operation = e.operation;
    shown.sequence = e.sequence;
    shown.collective = e.collective;
    shown.peer = e.peer;
    if (e.typed) {
      shown.dtype = tandem::name(e.type);
      shown.bytes = e.count * size_of(e.type);
    }
    std::string text = "tandem: " + flight_rank_label(ring) + " has waited " + age_text(waited) +
                       " in " + entry_text(shown);
    if (!missing.empty()) {
      text += " for " + ranks_text(missing);
      for (const int r : missing) {
        const auto& w = where[static_cast<std::size_t>(r)];
        if (!w.empty()) text += " (rank " + std::to_string(r) + " is " + w + ")";
      }
    }
    if (missing.empty() && e.collective && ring.size() > 1 &&
        static_cast<int>(arrived.size()) == ring.size() - 1) {
      text += " (every rank has arrived: the operation itself is slow)";
    } else if (!arrived.empty()) {
      text += " (" + ranks_text(arrived) + (arrived.size() == 1 ? " has" : " have") + " arrived)";
    }
    if (ring.timeout() != Timeout::max()) {
      const std::int64_t left =
          std::chrono::duration_cast<std::chrono::nanoseconds>(ring.timeout()).count() - waited;
      text += "; timeout in " + age_text(left);
    }
    return text;
  }

  /// This process's rings and the other processes' dumps, as a reader sees them.
  std::vector<FlightTraceFile> peer_view() {
    std::vector<std::shared_ptr<FlightRing>> rings;
    std::string dir;
    std::int64_t since = 0;
    {
      std::lock_guard lock(mutex_);
      for (const auto& r : rings_) {
        if (auto ring = r.ring.lock()) rings.push_back(std::move(ring));
      }
      dir = dir_;
      since = started_unix_ns_;
    }
    std::vector<FlightTraceFile> files;
    const std::string host = flight_host();
    for (auto& file : read_flight_dumps(dir).files) {
      if (file.host == host) {
        if (file.pid == ::getpid()) continue;  // this process: its rings, as they are now
        // A default directory outlives jobs: a dump older than this process's first ring, of
        // a process of this host that is gone, is an earlier job's.
        const bool gone = ::kill(static_cast<pid_t>(file.pid), 0) != 0 && errno == ESRCH;
        if (gone && file.time_ns < since) continue;
      }
      files.push_back(std::move(file));
    }
    if (auto mine = parse_flight_dump(flight_dump_json("waiting", "", rings))) {
      files.push_back(std::move(*mine));
    }
    return files;
  }

  mutable std::mutex mutex_;  // rings_, dir_, signal_read_, monitor_pid_
  std::mutex dump_mutex_;     // one dump at a time: they share one temporary file name
  std::vector<Registered> rings_;
  std::string dir_;
  int signal_read_ = -1;
  pid_t monitor_pid_ = 0;
  std::int64_t started_unix_ns_ = 0;  ///< when the first ring was added (Unix nanoseconds)
  std::atomic<unsigned> dumped_{0};
  std::atomic<bool> announced_{false};
  std::atomic<bool> write_failed_{false};
};

}  // namespace tandem::detail
