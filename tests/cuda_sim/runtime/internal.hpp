// The simulated CUDA runtime's insides, shared by its translation units (not a public header).
//
// How work moves, and why ThreadSanitizer sees only CUDA's own ordering:
// - A host thread appends a Task to a stream's queue (a linked list; host threads serialise on
//   the device's mutex) with a release store; the stream's worker thread takes it with an acquire
//   load. So everything the host did before queuing work happens before the work (as on a GPU),
//   and nothing flows back: the worker writes nothing that a queuing host thread reads with
//   acquire ordering. Waking a sleeping worker uses a futex (invisible to ThreadSanitizer) and
//   relaxed flags ordered by fences (ThreadSanitizer does not model fences).
// - When task n of a stream has run, the worker stores n into the stream's completion ring with
//   release ordering. Only a documented synchronisation point (stream, event and device
//   synchronisation, a query that succeeds, a copy that returns once complete) loads that slot
//   with acquire ordering: that load is the one edge from stream work back to the host. A query
//   that answers cudaErrorNotReady, and every check of "is it done yet", loads relaxed.
// - A stream waiting for another (an event, the legacy stream's implicit synchronisation) does
//   the same acquire load on its worker before running the task that waited.
// - Streams are never freed (a destroyed stream's worker drains its queue and ends), and the
//   runtime's global state is never destroyed, so work still queued at process exit cannot touch
//   freed state.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <vector>

namespace cuda_sim {

constexpr int max_devices = 64;
/// Completion slots per stream: a waiter for task n loads slot n % size, which holds n once task
/// n has run (or a later task of the same slot, which has run after it).
constexpr std::size_t completion_slots = 256;
/// Timing records per stream whose time stays readable (cudaEventElapsedTime).
constexpr std::size_t timing_cells = 1024;

struct Device;
struct Stream;

// Fences that order relaxed flags on the hardware (the futex protocols, the timing cells) while
// staying outside ThreadSanitizer's model, which has no fences: they must order without adding a
// synchronisation edge. (GCC also refuses std::atomic_thread_fence under -fsanitize=thread.)
#if defined(__x86_64__) || defined(__i386__)
inline void full_fence() noexcept {
  asm volatile("mfence" ::: "memory");
}
inline void acquire_fence() noexcept {
  asm volatile("" ::: "memory");
}  // x86 keeps load order
#else
inline void full_fence() noexcept {
  std::atomic_thread_fence(std::memory_order_seq_cst);
}
inline void acquire_fence() noexcept {
  std::atomic_thread_fence(std::memory_order_acquire);
}
#endif

/// A point in one stream's order: after its task `seq` (0 is the start: always reached).
struct Position {
  Stream* stream = nullptr;
  std::uint64_t seq = 0;
};

/// Where a timing marker leaves the time it ran (read by cudaEventElapsedTime).
struct TimingCell {
  std::atomic<std::uint64_t> tag{0};
  std::atomic<std::int64_t> nanoseconds{0};
};

/// What a task's work is told when it runs.
struct TaskContext {
  Stream& stream;
  cudaError_t device_error;  ///< cudaSuccess, or the device's sticky fault
};

/// One unit of stream work; `next` links the stream's queue.
struct Task {
  std::atomic<Task*> next{nullptr};
  std::uint64_t seq = 0;
  std::vector<Position> waits;  ///< run only once these have been reached
  std::function<void(const TaskContext&)> work;
  TimingCell* timing = nullptr;  ///< stamped when the task runs (timing events)
  std::uint64_t timing_tag = 0;
  bool runs_after_fault = false;  ///< frees and callbacks still run on a failed device
  bool last = false;              ///< the stream's destruction: its worker ends after it
};

enum class StreamKind { created, legacy, per_thread };

struct Stream {
  Stream(Device& owner, StreamKind stream_kind, unsigned stream_flags, int stream_priority,
         std::uint64_t stream_id);

  Device& device;
  const StreamKind kind;
  const unsigned flags;
  const int priority;
  const std::uint64_t id;  ///< creation number (stress mode's draws)

  /// Whether it orders with the legacy default stream (everything but cudaStreamNonBlocking).
  [[nodiscard]] bool blocking() const noexcept {
    return kind != StreamKind::created || (flags & cudaStreamNonBlocking) == 0;
  }

  // Host side, under device.mutex.
  Task* tail = nullptr;                  ///< the last task queued
  std::atomic<std::uint64_t> queued{0};  ///< its number (stored under the mutex)
  std::uint64_t legacy_reached = 0;      ///< blocking: the legacy task its work already waits for
  std::uint64_t reached_by_legacy = 0;   ///< blocking: its task the legacy stream already waits for
  bool destroyed = false;
  std::uint64_t timing_records = 0;
  std::unique_ptr<TimingCell[]> timing;  ///< made on the first timing record

  // Host to worker.
  std::atomic<std::uint32_t> pushed{0};
  std::atomic<std::uint32_t> worker_sleeping{0};

  // Worker to waiters.
  std::array<std::atomic<std::uint64_t>, completion_slots> completed{};
  std::atomic<std::uint32_t> completion_epoch{0};
  std::atomic<std::uint32_t> completion_waiters{0};

  Task* worker_head = nullptr;  ///< the worker's own: the task it ran last

  /// Whether task `seq` has run. Relaxed: tells nothing about its effects.
  [[nodiscard]] bool reached(std::uint64_t seq) const noexcept;
  /// Blocks until task `seq` has run, without ordering anything after it.
  void wait(std::uint64_t seq) noexcept;
  /// The synchronisation edge: after it, the calling thread sees everything task `seq` (and the
  /// work before it) did. Call only once reached(seq), and only at a documented sync point.
  void acquire(std::uint64_t seq) const noexcept;
  /// wait(seq) then acquire(seq).
  void synchronize(std::uint64_t seq) noexcept;
};

/// A device's stream-ordered memory pool: only its attributes are kept (memory is not cached).
struct Pool {
  std::mutex mutex;
  std::uint64_t release_threshold = 0;
  int reuse_follow_event_dependencies = 1;
  int reuse_allow_opportunistic = 1;
  int reuse_allow_internal_dependencies = 1;
  std::uint64_t used_high = 0;
};

struct Device {
  int ordinal = 0;   ///< its number in this process (cudaSetDevice)
  int physical = 0;  ///< its number among TANDEM_CUDA_SIM_DEVICES (UUID, PCI bus)

  std::mutex mutex;  ///< orders every queue operation on its streams (host threads only)
  Stream* legacy = nullptr;
  std::vector<Stream*> streams;           ///< every stream ever made on it (device sync)
  std::vector<Stream*> blocking_streams;  ///< those the legacy stream still orders with

  std::atomic<int> fault{cudaSuccess};
  std::atomic<unsigned> flags{0};               ///< cudaSetDeviceFlags
  std::atomic<std::uint64_t> peers_enabled{0};  ///< bit d: cudaDeviceEnablePeerAccess(d)
  std::atomic<std::size_t> device_bytes{0};
  std::atomic<std::size_t> pool_bytes{0};  ///< of which stream-ordered
  std::atomic<std::uint64_t> tasks_run{0};
  Pool pool;
};

enum class MemoryKind { device, pinned, registered };

struct Allocation {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  MemoryKind kind = MemoryKind::device;
  int device = 0;  ///< owner (device memory), or the device current when it was pinned
  bool stream_ordered = false;
  unsigned flags = 0;  ///< cudaHostAlloc's or cudaHostRegister's
};

struct Event;

struct Runtime {
  Runtime();

  std::array<Device, max_devices> devices;
  std::atomic<int> visible{0};
  std::atomic<std::size_t> device_capacity{std::size_t{16} << 30};

  std::mutex handles_mutex;  ///< host threads only
  std::unordered_set<const Stream*> live_streams;
  std::unordered_set<const Event*> live_events;

  std::mutex memory_mutex;  ///< host threads only
  std::map<std::uintptr_t, Allocation> allocations;
  std::atomic<std::size_t> pinned_bytes{0};

  std::atomic<bool> stress{false};
  std::atomic<std::uint64_t> stress_seed{0};
  std::atomic<std::uint64_t> streams_made{0};
  std::atomic<int> workers{0};
};

/// The process's runtime, made on first use and never destroyed.
Runtime& runtime();

/// What CUDA keeps per host thread.
struct ThreadState {
  int device = 0;
  cudaError_t last_error = cudaSuccess;
  Stream* worker_of = nullptr;  ///< set on a stream's worker thread
  std::array<Stream*, max_devices> per_thread{};
  ThreadState() = default;
  ThreadState(const ThreadState&) = delete;
  ThreadState& operator=(const ThreadState&) = delete;
  ~ThreadState();
};

ThreadState& this_thread();

/// Set in a child forked after the runtime started: every call fails there.
extern bool forked_child;

// ---- Calls' common steps (runtime.cpp) ----

/// cudaSuccess when a CUDA call may run on this thread: not in a forked child, and not inside
/// stream work unless `allowed_in_work`.
cudaError_t admit(bool allowed_in_work = false) noexcept;
/// Returns `status`, recording it as this thread's last error when it is one.
cudaError_t result(cudaError_t status) noexcept;
/// The device numbered `ordinal`, or nullptr when not shown.
Device* device_at(int ordinal) noexcept;
/// The calling thread's current device (cudaErrorInvalidDevice when no longer shown).
cudaError_t current_device(Device*& device) noexcept;
/// The device's sticky fault, or cudaSuccess.
inline cudaError_t fault_of(const Device& device) noexcept {
  return static_cast<cudaError_t>(device.fault.load(std::memory_order_relaxed));
}

// ---- Streams (streams.cpp) ----

/// The stream a handle names (0 and cudaStreamLegacy: the current device's legacy stream, or its
/// per-thread stream when `null_is_per_thread`; cudaStreamPerThread: this thread's). Checks the
/// stream's device for a fault.
cudaError_t resolve(cudaStream_t handle, Stream*& stream, bool null_is_per_thread) noexcept;
/// Queues work on `stream` (with its implicit waits); its number. Never runs it here.
cudaError_t enqueue(Stream& stream, std::unique_ptr<Task> task, std::uint64_t* seq = nullptr);
/// The stream's current end, for a synchronisation (`record` false) or an event record. The
/// legacy stream's end always includes the blocking streams' earlier work (synchronising or
/// recording it is an action on it); a blocking stream's record includes the legacy stream's
/// earlier work. A marker task is queued when such an implicit wait adds something.
cudaError_t end_of(Stream& stream, Position& position, bool record);
/// Blocks until every stream of `device` has run what was queued before, then synchronises.
void synchronize_device(Device& device);
/// Fills `bytes` at `pointer` with 0xFF: freed and fresh device memory reads as NaN.
void poison(void* pointer, std::size_t bytes) noexcept;

}  // namespace cuda_sim
