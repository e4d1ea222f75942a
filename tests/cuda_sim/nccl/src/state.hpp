// One rank of a simulated NCCL communicator (CommState), the handles NCCL's API passes around,
// NCCL's error texts, and the waiting every blocking part of the simulator shares.
#pragma once

#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "segment.hpp"

/// nccl.h's opaque communicator: an identity only, never freed, so that a stale handle is
/// recognised (ncclInvalidArgument) instead of read after free.
struct ncclComm {
  std::uint64_t serial = 0;
};

namespace simnccl {

/// Sets the text ncclGetLastError returns (one per process, as NCCL's); printed to stderr when
/// NCCL_DEBUG is WARN, INFO or TRACE.
void set_last_error(const std::string& text);

/// The text set_last_error set last.
std::string copy_last_error();

/// set_last_error(text), then returns code.
ncclResult_t fail(ncclResult_t code, const std::string& text);

/// TANDEM_CUDA_SIM_STRESS: nonblocking calls then report ncclInProgress at random.
bool stress_mode() noexcept;
/// A random number (stress mode's decisions).
std::uint64_t stress_draw() noexcept;

/// The name of the shared segment of the communicator `id` names, or empty for an id that
/// ncclGetUniqueId did not make.
std::string segment_name(const ncclUniqueId& id);
/// The id of the child a split makes: the same on every rank of the parent that passes color.
ncclUniqueId child_id(const ncclUniqueId& parent, std::uint64_t split, int color);

/// One rank of a communicator. Its owners are host threads (std::shared_ptr, made by make())
/// and the launches queued on streams (hold() and release(), a count of their own): stream work
/// never touches a std::shared_ptr's count, which would order its earlier work before the host's
/// next copy of the pointer and so hide, from ThreadSanitizer, a host read of results it has not
/// synchronised with. The last owner out deletes it.
class CommState {
 public:
  static std::shared_ptr<CommState> make(const ncclUniqueId& id, int rank, int nranks, int device,
                                         bool blocking);
  CommState(const CommState&) = delete;
  CommState& operator=(const CommState&) = delete;

  /// A launch's hold (taken on the host when it is queued, given back by its stream work).
  void hold() noexcept { holds_.fetch_add(1, std::memory_order_relaxed); }
  static void release(CommState* comm) noexcept;

  const ncclUniqueId id;
  const std::string name;
  const int rank;
  const int nranks;
  const int device;
  const bool blocking;
  ncclComm_t handle = nullptr;  ///< set when registered

  // --- the shared segment (set by the init job) -----------------------------------------------
  void set_segment(std::shared_ptr<Segment> segment);
  [[nodiscard]] std::shared_ptr<Segment> segment() const;
  /// Whether every rank has joined (the segment is complete and its name removed).
  std::atomic<bool> joined{false};
  /// This rank owns its record in the segment (it claimed it).
  std::atomic<bool> claimed{false};

  // --- errors -----------------------------------------------------------------------------------
  /// The text of this communicator's newest failure (and the process's last error), then code.
  ncclResult_t fail(ncclResult_t code, const std::string& text);
  /// Makes code the communicator's asynchronous error (the first one stays).
  void set_error(ncclResult_t code) noexcept;
  [[nodiscard]] ncclResult_t error() const noexcept {
    return static_cast<ncclResult_t>(error_.load(std::memory_order_acquire));
  }
  [[nodiscard]] std::string error_text() const;

  /// What ncclCommGetAsyncError reports: an error, ncclInProgress while an init, split,
  /// finalize or (stress mode) a delayed launch is under way, else ncclSuccess. Joins a finished
  /// background job.
  ncclResult_t async_state();

  // --- the background job of a nonblocking init or split --------------------------------------
  void start_job(std::function<ncclResult_t()> body);
  /// Waits for the job (after an abort it ends promptly) and joins it.
  void join_job();

  // --- abort, leave ---------------------------------------------------------------------------
  std::atomic<bool> aborted{false};
  /// Stops everything this rank waits for (ncclCommAbort), then leaves.
  void abort();
  /// Tells the other ranks that this one takes no further part (aborted, destroyed or failed).
  void leave();

  // --- the order of this rank's launches (NCCL runs a communicator's work in issue order) ----
  // The host only takes tickets (an atomic of its own); stream work passes the turn on under
  // turn_mutex_, which the host locks only to finalize, destroy or abort.
  std::uint64_t take_ticket() noexcept { return issued_.fetch_add(1, std::memory_order_relaxed); }
  /// Waits until every launch before `ticket` has finished; false once aborted.
  bool wait_turn(std::uint64_t ticket);
  void finish_turn(std::uint64_t ticket);
  /// Whether every launch issued so far has finished.
  [[nodiscard]] bool flushed();
  /// Blocks until flushed(); false once aborted.
  bool wait_flushed();

  std::atomic<int> delayed{0};  ///< stress mode: launches not yet handed to their stream
  std::atomic<bool> finalize_called{false};

  // Touched only by the launch whose turn it is (turns order them).
  std::uint64_t round = 0;  ///< collective rounds this rank has posted

  // Touched only by the thread issuing calls (NCCL communicators are not thread-safe).
  std::uint64_t splits = 0;

 private:
  mutable std::mutex segment_mutex_;
  std::shared_ptr<Segment> segment_;

  std::atomic<int> error_{ncclSuccess};
  mutable std::mutex text_mutex_;
  std::string text_;

  std::mutex job_mutex_;
  std::thread job_;
  bool job_active_ = false;
  std::atomic<bool> job_done_{false};
  ncclResult_t job_result_ = ncclSuccess;

  std::atomic<bool> left_{false};

  std::mutex turn_mutex_;
  std::condition_variable turn_cv_;
  std::atomic<std::uint64_t> issued_{0};
  std::uint64_t completed_ = 0;
  std::set<std::uint64_t> finished_early_;

  std::atomic<std::int64_t> holds_{1};  ///< the host's std::shared_ptr (one), and each launch's

  CommState(const ncclUniqueId& id, int rank, int nranks, int device, bool blocking);
  ~CommState();
};

// --- handles ------------------------------------------------------------------------------------

ncclComm_t register_comm(const std::shared_ptr<CommState>& comm);
/// The live communicator behind a handle, or null (null handle, destroyed, aborted).
std::shared_ptr<CommState> find_comm(ncclComm_t handle);
void unregister_comm(ncclComm_t handle);

/// "comm argument is NULL" or "comm ... is not a live communicator" for a handle find_comm
/// refused, as ncclInvalidArgument.
ncclResult_t bad_comm(ncclComm_t handle, const char* api);

/// NCCL's ncclCommEnsureReady: ncclInvalidArgument while a nonblocking call is unsettled, the
/// communicator's error if it has one.
ncclResult_t ensure_ready(CommState& comm, const char* api);

// --- waiting ------------------------------------------------------------------------------------

/// How a waiting loop sleeps: a few yields, then the segment's doorbell (or a short sleep when
/// it waits on several segments), and every 100 ms a look at the peers (check_due).
class Patience {
 public:
  Patience(const Segment* segment, Bell bell) : segment_(segment), bell_(bell) {}
  [[nodiscard]] std::uint32_t mark() const noexcept { return segment_ ? segment_->bell(bell_) : 0; }
  void progressed() noexcept { idle_ = 0; }
  void idle(std::uint32_t mark);
  /// True once every 100 ms of waiting.
  bool check_due();

 private:
  const Segment* segment_;
  Bell bell_;
  int idle_ = 0;
  std::chrono::steady_clock::time_point last_check_ = std::chrono::steady_clock::now();
};

/// "" while rank q of the segment takes part; otherwise why not (it left, or its process died).
std::string peer_gone(const Segment& segment, int q);

}  // namespace simnccl
