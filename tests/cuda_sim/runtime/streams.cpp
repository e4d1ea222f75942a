// Streams, their workers, events, host functions and device synchronisation (internal.hpp says
// how work and completion move between host threads and workers).
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <ctime>
#include <exception>
#include <thread>

#include "internal.hpp"

namespace cuda_sim {
namespace {

// A futex is invisible to ThreadSanitizer: waking a thread orders nothing, as it must not.
void futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t expected) noexcept {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
}

void futex_wake(std::atomic<std::uint32_t>& word, int count) noexcept {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE_PRIVATE, count, nullptr,
          nullptr, 0);
}

std::int64_t now_nanoseconds() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::uint64_t mix(std::uint64_t x) noexcept {  // splitmix64's finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Stress mode: a delay of 0-300 us before each task, the same for a seed, stream and task.
void stress_delay(const Stream& stream, std::uint64_t seq) noexcept {
  const Runtime& rt = runtime();
  if (!rt.stress.load(std::memory_order_relaxed)) return;
  const std::uint64_t seed = rt.stress_seed.load(std::memory_order_relaxed);
  const std::uint64_t draw = mix(seed ^ mix(stream.id ^ mix(seq)));
  const long microseconds = static_cast<long>(draw % 301);
  if (microseconds == 0) return;
  timespec delay{0, microseconds * 1000};
  while (nanosleep(&delay, &delay) != 0) {
  }
}

void execute(Stream& stream, Task& task) {
  for (const Position& wait : task.waits) wait.stream->synchronize(wait.seq);
  stress_delay(stream, task.seq);
  const cudaError_t fault = fault_of(stream.device);
  if (task.work && (fault == cudaSuccess || task.runs_after_fault)) {
    try {
      task.work(TaskContext{stream, fault});
    } catch (const std::exception& error) {
      std::fprintf(stderr, "cuda_sim: stream work on device %d threw: %s\n", stream.device.ordinal,
                   error.what());
      stream.device.fault.store(cudaErrorLaunchFailure, std::memory_order_relaxed);
    } catch (...) {
      std::fprintf(stderr, "cuda_sim: stream work on device %d threw\n", stream.device.ordinal);
      stream.device.fault.store(cudaErrorLaunchFailure, std::memory_order_relaxed);
    }
  }
  task.work = nullptr;  // what it held (a staging copy) goes now, not when the next task comes
  task.waits.clear();
  if (task.timing) {
    task.timing->nanoseconds.store(now_nanoseconds(), std::memory_order_relaxed);
    task.timing->tag.store(task.timing_tag, std::memory_order_relaxed);
  }
  stream.device.tasks_run.fetch_add(1, std::memory_order_relaxed);
}

void publish_completion(Stream& stream, std::uint64_t seq) noexcept {
  stream.completed[seq % completion_slots].store(seq, std::memory_order_release);
  stream.completion_epoch.fetch_add(1, std::memory_order_relaxed);
  full_fence();  // against Stream::wait's fence
  if (stream.completion_waiters.load(std::memory_order_relaxed) != 0) {
    futex_wake(stream.completion_epoch, INT_MAX);
  }
}

/// Sleeps until a host thread has queued something after `head`.
void sleep_until_queued(Stream& stream, const Task& head) noexcept {
  const std::uint32_t seen = stream.pushed.load(std::memory_order_acquire);
  if (head.next.load(std::memory_order_acquire) != nullptr) return;
  stream.worker_sleeping.store(1, std::memory_order_relaxed);
  full_fence();  // against wake_worker's fence
  if (stream.pushed.load(std::memory_order_relaxed) == seen) futex_wait(stream.pushed, seen);
  stream.worker_sleeping.store(0, std::memory_order_relaxed);
}

void wake_worker(Stream& stream) noexcept {
  stream.pushed.fetch_add(1, std::memory_order_release);
  full_fence();
  if (stream.worker_sleeping.load(std::memory_order_relaxed) != 0) futex_wake(stream.pushed, 1);
}

void run_worker(Stream* stream) {
  ThreadState& state = this_thread();
  state.worker_of = stream;
  state.device = stream->device.ordinal;
  Task* head = stream->worker_head;
  for (;;) {
    Task* task = head->next.load(std::memory_order_acquire);
    if (task == nullptr) {
      sleep_until_queued(*stream, *head);
      continue;
    }
    delete head;  // the host appends only after the last task, which is never `head` here
    head = task;
    stream->worker_head = task;
    execute(*stream, *task);
    const bool last = task->last;
    publish_completion(*stream, task->seq);
    if (last) break;
  }
  runtime().workers.fetch_sub(1, std::memory_order_relaxed);
}

/// A new stream with its worker; under device.mutex. nullptr when no thread can be started.
Stream* make_stream_locked(Device& device, StreamKind kind, unsigned flags, int priority) {
  Runtime& rt = runtime();
  auto stream =
      std::make_unique<Stream>(device, kind, flags, priority, rt.streams_made.fetch_add(1) + 1);
  stream->tail = new Task{};
  stream->worker_head = stream->tail;
  rt.workers.fetch_add(1, std::memory_order_relaxed);
  try {
    std::thread(run_worker, stream.get()).detach();
  } catch (const std::exception&) {
    rt.workers.fetch_sub(1, std::memory_order_relaxed);
    delete stream->tail;
    return nullptr;
  }
  Stream* made = stream.release();  // never freed: its worker and waiters may outlive it
  device.streams.push_back(made);
  if (kind != StreamKind::legacy && made->blocking()) device.blocking_streams.push_back(made);
  return made;
}

Stream* legacy_locked(Device& device) {
  if (device.legacy == nullptr) {
    device.legacy = make_stream_locked(device, StreamKind::legacy, cudaStreamDefault, 0);
  }
  return device.legacy;
}

Stream* per_thread_locked(Device& device) {
  Stream*& stream = this_thread().per_thread[static_cast<std::size_t>(device.ordinal)];
  if (stream == nullptr) {
    stream = make_stream_locked(device, StreamKind::per_thread, cudaStreamDefault, 0);
  }
  return stream;
}

/// CUDA's implicit synchronisation: the legacy stream waits for the blocking streams' work queued
/// so far, and a blocking stream waits for the legacy stream's. Under device.mutex.
void add_implicit_waits(Stream& stream, std::vector<Position>& waits) {
  Device& device = stream.device;
  if (stream.kind == StreamKind::legacy) {
    auto& blocking = device.blocking_streams;
    for (auto it = blocking.begin(); it != blocking.end();) {
      Stream* other = *it;
      const std::uint64_t end = other->queued.load(std::memory_order_relaxed);
      if (end > other->reached_by_legacy) {
        waits.push_back({other, end});
        other->reached_by_legacy = end;
      }
      it = other->destroyed ? blocking.erase(it) : it + 1;  // its last task is waited for now
    }
  } else if (stream.blocking() && device.legacy != nullptr) {
    const std::uint64_t end = device.legacy->queued.load(std::memory_order_relaxed);
    if (end > stream.legacy_reached) {
      waits.push_back({device.legacy, end});
      stream.legacy_reached = end;
    }
  }
}

std::uint64_t enqueue_locked(Stream& stream, std::unique_ptr<Task> task) {
  add_implicit_waits(stream, task->waits);
  const std::uint64_t seq = stream.queued.load(std::memory_order_relaxed) + 1;
  task->seq = seq;
  Task* node = task.release();
  stream.tail->next.store(node, std::memory_order_release);
  stream.tail = node;
  stream.queued.store(seq, std::memory_order_release);
  wake_worker(stream);
  return seq;
}

void destroy_locked(Stream& stream) {
  stream.destroyed = true;
  auto last = std::make_unique<Task>();
  last->last = true;
  last->runs_after_fault = true;
  enqueue_locked(stream, std::move(last));
}

}  // namespace

Stream::Stream(Device& owner, StreamKind stream_kind, unsigned stream_flags, int stream_priority,
               std::uint64_t stream_id)
    : device(owner),
      kind(stream_kind),
      flags(stream_flags),
      priority(stream_priority),
      id(stream_id) {}

bool Stream::reached(std::uint64_t seq) const noexcept {
  return seq == 0 || completed[seq % completion_slots].load(std::memory_order_relaxed) >= seq;
}

void Stream::wait(std::uint64_t seq) noexcept {
  if (reached(seq)) return;
  completion_waiters.fetch_add(1, std::memory_order_relaxed);
  for (;;) {
    full_fence();  // against publish_completion's fence
    const std::uint32_t epoch = completion_epoch.load(std::memory_order_relaxed);
    if (reached(seq)) break;
    futex_wait(completion_epoch, epoch);
  }
  completion_waiters.fetch_sub(1, std::memory_order_relaxed);
}

void Stream::acquire(std::uint64_t seq) const noexcept {
  if (seq != 0) (void)completed[seq % completion_slots].load(std::memory_order_acquire);
}

void Stream::synchronize(std::uint64_t seq) noexcept {
  wait(seq);
  acquire(seq);
}

ThreadState::~ThreadState() {
  if (forked_child) return;
  for (Stream* stream : per_thread) {  // the thread's default streams end with it
    if (stream == nullptr) continue;
    const std::lock_guard lock(stream->device.mutex);
    destroy_locked(*stream);
  }
}

cudaError_t resolve(cudaStream_t handle, Stream*& stream, bool null_is_per_thread) noexcept {
  if (handle == nullptr) handle = null_is_per_thread ? cudaStreamPerThread : cudaStreamLegacy;
  if (handle == cudaStreamLegacy || handle == cudaStreamPerThread) {
    Device* device = nullptr;
    if (const cudaError_t status = current_device(device)) return status;
    if (const cudaError_t fault = fault_of(*device)) return fault;
    const std::lock_guard lock(device->mutex);
    stream = handle == cudaStreamLegacy ? legacy_locked(*device) : per_thread_locked(*device);
    return stream != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
  }
  Runtime& rt = runtime();
  {
    const std::lock_guard lock(rt.handles_mutex);
    if (rt.live_streams.count(reinterpret_cast<const Stream*>(handle)) == 0) {
      return cudaErrorInvalidResourceHandle;
    }
  }
  stream = reinterpret_cast<Stream*>(handle);
  return fault_of(stream->device);
}

cudaError_t enqueue(Stream& stream, std::unique_ptr<Task> task, std::uint64_t* seq) {
  const std::lock_guard lock(stream.device.mutex);
  if (stream.destroyed) return cudaErrorInvalidResourceHandle;
  const std::uint64_t queued = enqueue_locked(stream, std::move(task));
  if (seq != nullptr) *seq = queued;
  return cudaSuccess;
}

cudaError_t end_of(Stream& stream, Position& position, bool record) {
  const std::lock_guard lock(stream.device.mutex);
  if (stream.destroyed) return cudaErrorInvalidResourceHandle;
  std::vector<Position> waits;
  if (record || stream.kind == StreamKind::legacy) add_implicit_waits(stream, waits);
  if (!waits.empty()) {
    auto marker = std::make_unique<Task>();
    marker->waits = std::move(waits);
    enqueue_locked(stream, std::move(marker));
  }
  position = {&stream, stream.queued.load(std::memory_order_relaxed)};
  return cudaSuccess;
}

void synchronize_device(Device& device) {
  std::vector<Position> ends;
  {
    const std::lock_guard lock(device.mutex);
    ends.reserve(device.streams.size());
    for (Stream* stream : device.streams) {
      ends.push_back({stream, stream->queued.load(std::memory_order_relaxed)});
    }
  }
  for (const Position& end : ends) end.stream->synchronize(end.seq);
}

/// A CUDA event: where it was last recorded. Touched by host threads only.
struct Event {
  Event(int owner, unsigned event_flags) : device(owner), flags(event_flags) {}
  const int device;
  const unsigned flags;
  std::mutex mutex;
  bool recorded = false;
  Position position;
  TimingCell* timing = nullptr;
  std::uint64_t timing_tag = 0;

  [[nodiscard]] bool timed() const noexcept { return (flags & cudaEventDisableTiming) == 0; }
};

}  // namespace cuda_sim

// ---------------------------------------------------------------------------------------------
// The CUDA runtime's stream, event and host-function calls.

using namespace cuda_sim;

namespace {

cudaError_t resolve_event(cudaEvent_t handle, Event*& event) {
  Runtime& rt = runtime();
  const std::lock_guard lock(rt.handles_mutex);
  if (handle == nullptr || rt.live_events.count(reinterpret_cast<const Event*>(handle)) == 0) {
    return cudaErrorInvalidResourceHandle;
  }
  event = reinterpret_cast<Event*>(handle);
  return cudaSuccess;
}

struct EventState {
  bool recorded = false;
  Position position;
  TimingCell* timing = nullptr;
  std::uint64_t timing_tag = 0;
};

EventState snapshot(Event& event) {
  const std::lock_guard lock(event.mutex);
  return {event.recorded, event.position, event.timing, event.timing_tag};
}

cudaError_t create_stream(cudaStream_t* handle, unsigned flags, int priority) {
  if (const cudaError_t status = admit()) return result(status);
  if (handle == nullptr || (flags & ~static_cast<unsigned>(cudaStreamNonBlocking)) != 0) {
    return result(cudaErrorInvalidValue);
  }
  Device* device = nullptr;
  if (const cudaError_t status = current_device(device)) return result(status);
  if (const cudaError_t fault = fault_of(*device)) return result(fault);
  priority = std::clamp(priority, -5, 0);  // CUDA clamps to cudaDeviceGetStreamPriorityRange
  Stream* stream = nullptr;
  {
    const std::lock_guard lock(device->mutex);
    stream = make_stream_locked(*device, StreamKind::created, flags, priority);
  }
  if (stream == nullptr) return result(cudaErrorMemoryAllocation);
  Runtime& rt = runtime();
  {
    const std::lock_guard lock(rt.handles_mutex);
    rt.live_streams.insert(stream);
  }
  *handle = reinterpret_cast<cudaStream_t>(stream);
  return cudaSuccess;
}

cudaError_t stream_synchronize(cudaStream_t handle, bool per_thread) {
  if (const cudaError_t status = admit()) return result(status);
  Stream* stream = nullptr;
  if (const cudaError_t status = resolve(handle, stream, per_thread)) return result(status);
  Position end;
  if (const cudaError_t status = end_of(*stream, end, false)) return result(status);
  stream->synchronize(end.seq);
  return result(fault_of(stream->device));
}

cudaError_t stream_query(cudaStream_t handle, bool per_thread) {
  if (const cudaError_t status = admit()) return result(status);
  Stream* stream = nullptr;
  if (const cudaError_t status = resolve(handle, stream, per_thread)) return result(status);
  Position end;
  if (const cudaError_t status = end_of(*stream, end, false)) return result(status);
  if (!stream->reached(end.seq)) return cudaErrorNotReady;
  stream->acquire(end.seq);
  return result(fault_of(stream->device));
}

template <class Value, class Read>
cudaError_t stream_property(cudaStream_t handle, Value* value, bool per_thread, Read read) {
  if (const cudaError_t status = admit()) return result(status);
  if (value == nullptr) return result(cudaErrorInvalidValue);
  Stream* stream = nullptr;
  if (const cudaError_t status = resolve(handle, stream, per_thread)) return result(status);
  *value = read(*stream);
  return cudaSuccess;
}

cudaError_t stream_wait_event(cudaStream_t handle, cudaEvent_t event_handle, unsigned flags,
                              bool per_thread) {
  if (const cudaError_t status = admit()) return result(status);
  Stream* stream = nullptr;
  if (const cudaError_t status = resolve(handle, stream, per_thread)) return result(status);
  Event* event = nullptr;
  if (const cudaError_t status = resolve_event(event_handle, event)) return result(status);
  if (flags != cudaEventWaitDefault && flags != cudaEventWaitExternal) {
    return result(cudaErrorInvalidValue);
  }
  const EventState state = snapshot(*event);
  if (!state.recorded) return cudaSuccess;  // never recorded: nothing to wait for
  if (const cudaError_t fault = fault_of(state.position.stream->device)) return result(fault);
  auto task = std::make_unique<Task>();
  task->waits.push_back(state.position);
  return result(enqueue(*stream, std::move(task)));
}

cudaError_t launch_host_func(cudaStream_t handle, cudaHostFn_t function, void* user_data,
                             bool per_thread) {
  if (const cudaError_t status = admit()) return result(status);
  Stream* stream = nullptr;
  if (const cudaError_t status = resolve(handle, stream, per_thread)) return result(status);
  if (function == nullptr) return result(cudaErrorInvalidValue);
  auto task = std::make_unique<Task>();
  task->work = [function, user_data](const TaskContext&) { function(user_data); };
  return result(enqueue(*stream, std::move(task)));
}

cudaError_t add_callback(cudaStream_t handle, cudaStreamCallback_t callback, void* user_data,
                         unsigned flags, bool per_thread) {
  if (const cudaError_t status = admit()) return result(status);
  Stream* stream = nullptr;
  if (const cudaError_t status = resolve(handle, stream, per_thread)) return result(status);
  if (callback == nullptr || flags != 0) return result(cudaErrorInvalidValue);
  auto task = std::make_unique<Task>();
  task->runs_after_fault = true;  // a callback is told the device's error instead
  task->work = [callback, handle, user_data](const TaskContext& context) {
    callback(handle, context.device_error, user_data);
  };
  return result(enqueue(*stream, std::move(task)));
}

cudaError_t event_record(cudaEvent_t event_handle, cudaStream_t handle, unsigned flags,
                         bool per_thread) {
  if (const cudaError_t status = admit()) return result(status);
  Event* event = nullptr;
  if (const cudaError_t status = resolve_event(event_handle, event)) return result(status);
  Stream* stream = nullptr;
  if (const cudaError_t status = resolve(handle, stream, per_thread)) return result(status);
  if (flags != cudaEventRecordDefault && flags != cudaEventRecordExternal) {
    return result(cudaErrorInvalidValue);
  }
  if (event->device != stream->device.ordinal) return result(cudaErrorInvalidResourceHandle);
  EventState state;
  state.recorded = true;
  if (event->timed()) {  // a marker task takes the time when the stream reaches it
    const std::lock_guard lock(stream->device.mutex);
    if (stream->destroyed) return result(cudaErrorInvalidResourceHandle);
    if (!stream->timing) stream->timing = std::make_unique<TimingCell[]>(timing_cells);
    state.timing_tag = ++stream->timing_records;
    state.timing = &stream->timing[state.timing_tag % timing_cells];
    auto marker = std::make_unique<Task>();
    marker->timing = state.timing;
    marker->timing_tag = state.timing_tag;
    state.position = {stream, enqueue_locked(*stream, std::move(marker))};
  } else if (const cudaError_t status = end_of(*stream, state.position, true)) {
    return result(status);
  }
  const std::lock_guard lock(event->mutex);
  event->recorded = true;
  event->position = state.position;
  event->timing = state.timing;
  event->timing_tag = state.timing_tag;
  return cudaSuccess;
}

/// The event's last record, for a query or a synchronisation: `state.recorded` is false for an
/// event never recorded; the error is the recorded stream's device's fault, if any.
cudaError_t last_record(cudaEvent_t event_handle, EventState& state) {
  if (const cudaError_t status = admit()) return status;
  Event* event = nullptr;
  if (const cudaError_t status = resolve_event(event_handle, event)) return status;
  state = snapshot(*event);
  return state.recorded ? fault_of(state.position.stream->device) : cudaSuccess;
}

cudaError_t event_query(cudaEvent_t event_handle) {
  EventState state;
  if (const cudaError_t status = last_record(event_handle, state)) return result(status);
  if (!state.recorded) return cudaSuccess;
  const Position& end = state.position;
  if (!end.stream->reached(end.seq)) return cudaErrorNotReady;
  end.stream->acquire(end.seq);
  return cudaSuccess;
}

cudaError_t event_synchronize(cudaEvent_t event_handle) {
  EventState state;
  if (const cudaError_t status = last_record(event_handle, state)) return result(status);
  if (!state.recorded) return cudaSuccess;
  state.position.stream->synchronize(state.position.seq);
  return result(fault_of(state.position.stream->device));
}

cudaError_t elapsed_time(float* milliseconds, cudaEvent_t start_handle, cudaEvent_t end_handle) {
  if (const cudaError_t status = admit()) return result(status);
  if (milliseconds == nullptr) return result(cudaErrorInvalidValue);
  Event* start = nullptr;
  Event* end = nullptr;
  if (const cudaError_t status = resolve_event(start_handle, start)) return result(status);
  if (const cudaError_t status = resolve_event(end_handle, end)) return result(status);
  if (!start->timed() || !end->timed()) return result(cudaErrorInvalidResourceHandle);
  const EventState first = snapshot(*start);
  const EventState last = snapshot(*end);
  if (!first.recorded || !last.recorded) return result(cudaErrorInvalidResourceHandle);
  for (const EventState* state : {&first, &last}) {
    if (const cudaError_t fault = fault_of(state->position.stream->device)) return result(fault);
  }
  if (!first.position.stream->reached(first.position.seq) ||
      !last.position.stream->reached(last.position.seq)) {
    return result(cudaErrorNotReady);
  }
  // Orders the time cells' loads after the completion loads without a synchronisation edge
  // (ThreadSanitizer ignores fences): timing is not one of CUDA's synchronisation points.
  acquire_fence();
  if (first.timing->tag.load(std::memory_order_relaxed) != first.timing_tag ||
      last.timing->tag.load(std::memory_order_relaxed) != last.timing_tag) {
    std::fprintf(stderr,
                 "cuda_sim: cudaEventElapsedTime: the record's time was overwritten (more than "
                 "%zu timing records on its stream since)\n",
                 timing_cells);
    return result(cudaErrorInvalidResourceHandle);
  }
  const std::int64_t nanoseconds = last.timing->nanoseconds.load(std::memory_order_relaxed) -
                                   first.timing->nanoseconds.load(std::memory_order_relaxed);
  *milliseconds = static_cast<float>(static_cast<double>(nanoseconds) / 1e6);
  return cudaSuccess;
}

}  // namespace

extern "C" {

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return create_stream(stream, cudaStreamDefault, 0);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  return create_stream(stream, flags, 0);
}

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned int flags, int priority) {
  return create_stream(stream, flags, priority);
}

cudaError_t cudaDeviceGetStreamPriorityRange(int* leastPriority, int* greatestPriority) {
  if (const cudaError_t status = admit()) return result(status);
  if (leastPriority != nullptr) *leastPriority = 0;
  if (greatestPriority != nullptr) *greatestPriority = -5;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t handle) {
  if (const cudaError_t status = admit()) return result(status);
  if (handle == nullptr || handle == cudaStreamLegacy || handle == cudaStreamPerThread) {
    return result(cudaErrorInvalidResourceHandle);
  }
  Runtime& rt = runtime();
  auto* stream = reinterpret_cast<Stream*>(handle);
  {
    const std::lock_guard lock(rt.handles_mutex);
    if (rt.live_streams.erase(stream) == 0) return result(cudaErrorInvalidResourceHandle);
  }
  {
    const std::lock_guard lock(stream->device.mutex);
    destroy_locked(*stream);  // its worker finishes what is queued, then ends
  }
  return result(fault_of(stream->device));
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  return stream_synchronize(stream, false);
}
cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t stream) {
  return stream_synchronize(stream, true);
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  return stream_query(stream, false);
}
cudaError_t cudaStreamQuery_ptsz(cudaStream_t stream) {
  return stream_query(stream, true);
}

cudaError_t cudaStreamGetFlags(cudaStream_t stream, unsigned int* flags) {
  return stream_property(stream, flags, false, [](const Stream& s) { return s.flags; });
}
cudaError_t cudaStreamGetFlags_ptsz(cudaStream_t stream, unsigned int* flags) {
  return stream_property(stream, flags, true, [](const Stream& s) { return s.flags; });
}

cudaError_t cudaStreamGetPriority(cudaStream_t stream, int* priority) {
  return stream_property(stream, priority, false, [](const Stream& s) { return s.priority; });
}
cudaError_t cudaStreamGetPriority_ptsz(cudaStream_t stream, int* priority) {
  return stream_property(stream, priority, true, [](const Stream& s) { return s.priority; });
}

cudaError_t cudaStreamGetDevice(cudaStream_t stream, int* device) {
  return stream_property(stream, device, false, [](const Stream& s) { return s.device.ordinal; });
}
cudaError_t cudaStreamGetDevice_ptsz(cudaStream_t stream, int* device) {
  return stream_property(stream, device, true, [](const Stream& s) { return s.device.ordinal; });
}

cudaError_t cudaStreamGetId(cudaStream_t stream, unsigned long long* id) {
  return stream_property(stream, id, false,
                         [](const Stream& s) { return static_cast<unsigned long long>(s.id); });
}
cudaError_t cudaStreamGetId_ptsz(cudaStream_t stream, unsigned long long* id) {
  return stream_property(stream, id, true,
                         [](const Stream& s) { return static_cast<unsigned long long>(s.id); });
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  return stream_property(stream, status, false,
                         [](const Stream&) { return cudaStreamCaptureStatusNone; });
}
cudaError_t cudaStreamIsCapturing_ptsz(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  return stream_property(stream, status, true,
                         [](const Stream&) { return cudaStreamCaptureStatusNone; });
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  return stream_wait_event(stream, event, flags, false);
}
cudaError_t cudaStreamWaitEvent_ptsz(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  return stream_wait_event(stream, event, flags, true);
}

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* userData) {
  return launch_host_func(stream, fn, userData, false);
}
cudaError_t cudaLaunchHostFunc_ptsz(cudaStream_t stream, cudaHostFn_t fn, void* userData) {
  return launch_host_func(stream, fn, userData, true);
}

cudaError_t cudaStreamAddCallback(cudaStream_t stream, cudaStreamCallback_t callback,
                                  void* userData, unsigned int flags) {
  return add_callback(stream, callback, userData, flags, false);
}
cudaError_t cudaStreamAddCallback_ptsz(cudaStream_t stream, cudaStreamCallback_t callback,
                                       void* userData, unsigned int flags) {
  return add_callback(stream, callback, userData, flags, true);
}

cudaError_t cudaDeviceSynchronize(void) {
  if (const cudaError_t status = admit()) return result(status);
  Device* device = nullptr;
  if (const cudaError_t status = current_device(device)) return result(status);
  if (const cudaError_t fault = fault_of(*device)) return result(fault);  // at once
  synchronize_device(*device);
  return result(fault_of(*device));
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (const cudaError_t status = admit()) return result(status);
  constexpr unsigned known = cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
  if (event == nullptr || (flags & ~known) != 0 ||
      ((flags & cudaEventInterprocess) != 0 && (flags & cudaEventDisableTiming) == 0)) {
    return result(cudaErrorInvalidValue);
  }
  Device* device = nullptr;
  if (const cudaError_t status = current_device(device)) return result(status);
  if (const cudaError_t fault = fault_of(*device)) return result(fault);
  auto* made = new Event(device->ordinal, flags);
  Runtime& rt = runtime();
  {
    const std::lock_guard lock(rt.handles_mutex);
    rt.live_events.insert(made);
  }
  *event = reinterpret_cast<cudaEvent_t>(made);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t handle) {
  if (const cudaError_t status = admit()) return result(status);
  Runtime& rt = runtime();
  auto* event = reinterpret_cast<Event*>(handle);
  {
    const std::lock_guard lock(rt.handles_mutex);
    if (handle == nullptr || rt.live_events.erase(event) == 0) {
      return result(cudaErrorInvalidResourceHandle);
    }
  }
  // Only host threads touch an Event (a marker stamps its stream's time cell): it can go now.
  const Device* device = device_at(event->device);
  const cudaError_t fault = device != nullptr ? fault_of(*device) : cudaSuccess;
  delete event;
  return result(fault);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  return event_record(event, stream, cudaEventRecordDefault, false);
}
cudaError_t cudaEventRecord_ptsz(cudaEvent_t event, cudaStream_t stream) {
  return event_record(event, stream, cudaEventRecordDefault, true);
}
cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned int flags) {
  return event_record(event, stream, flags, false);
}
cudaError_t cudaEventRecordWithFlags_ptsz(cudaEvent_t event, cudaStream_t stream,
                                          unsigned int flags) {
  return event_record(event, stream, flags, true);
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  return event_query(event);
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  return event_synchronize(event);
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  return elapsed_time(ms, start, end);
}

}  // extern "C"
