// Device and pinned memory, stream-ordered allocation, copies, memsets, pointer attributes and
// memory pools.
//
// Device memory is host memory that the runtime tracks by address range; only stream work should
// touch it. New and freed device memory holds 0xFF bytes (NaN as floats). Copies follow CUDA's
// "API synchronization behavior": from pageable memory to the device the source is staged before
// the call returns; to pageable memory the call returns once the copy is complete; with pinned
// memory and between devices the asynchronous forms return at once.
#include <cstdlib>
#include <cstring>
#include <optional>

#include "internal.hpp"

namespace cuda_sim {

void poison(void* pointer, std::size_t bytes) noexcept {
  if (pointer != nullptr && bytes != 0) std::memset(pointer, 0xFF, bytes);
}

}  // namespace cuda_sim

using namespace cuda_sim;

namespace {

constexpr std::size_t alignment = 256;  // what cudaMalloc guarantees

void* allocate_bytes(std::size_t size) noexcept {
  const std::size_t rounded = (size + alignment - 1) / alignment * alignment;
  if (rounded < size) return nullptr;
  return std::aligned_alloc(alignment, rounded);
}

std::uintptr_t address(const void* pointer) noexcept {
  return reinterpret_cast<std::uintptr_t>(pointer);
}

/// The allocation holding `pointer`, if the runtime made or registered one there.
std::optional<Allocation> find_containing(const void* pointer) {
  Runtime& rt = runtime();
  const std::lock_guard lock(rt.memory_mutex);
  auto it = rt.allocations.upper_bound(address(pointer));
  if (it == rt.allocations.begin()) return std::nullopt;
  --it;
  const Allocation& found = it->second;
  if (address(pointer) >= found.base + found.size) return std::nullopt;
  return found;
}

/// Removes and returns the allocation starting at `pointer` when it is of `kind`.
std::optional<Allocation> take(const void* pointer, MemoryKind kind) {
  Runtime& rt = runtime();
  const std::lock_guard lock(rt.memory_mutex);
  const auto it = rt.allocations.find(address(pointer));
  if (it == rt.allocations.end() || it->second.kind != kind) return std::nullopt;
  const Allocation found = it->second;
  rt.allocations.erase(it);
  return found;
}

void add(const Allocation& allocation) {
  Runtime& rt = runtime();
  const std::lock_guard lock(rt.memory_mutex);
  rt.allocations[allocation.base] = allocation;
}

/// Counts `size` bytes against the device's memory; false when they do not fit. Relaxed: the
/// count orders nothing.
bool reserve(Device& device, std::size_t size) {
  const std::size_t capacity = runtime().device_capacity.load(std::memory_order_relaxed);
  std::size_t used = device.device_bytes.load(std::memory_order_relaxed);
  do {
    if (size > capacity || used > capacity - size) return false;
  } while (
      !device.device_bytes.compare_exchange_weak(used, used + size, std::memory_order_relaxed));
  return true;
}

void release(Device& device, std::size_t size, bool stream_ordered) noexcept {
  device.device_bytes.fetch_sub(size, std::memory_order_relaxed);
  if (stream_ordered) device.pool_bytes.fetch_sub(size, std::memory_order_relaxed);
}

void free_device_memory(Device& device, void* pointer, std::size_t size, bool stream_ordered) {
  poison(pointer, size);
  std::free(pointer);
  release(device, size, stream_ordered);
}

Device& owner_of(const Allocation& allocation) {
  return runtime().devices[static_cast<std::size_t>(allocation.device)];
}

cudaError_t malloc_on(Device& device, void** pointer, std::size_t size, bool stream_ordered) {
  *pointer = nullptr;
  if (size == 0) return cudaSuccess;
  if (!reserve(device, size)) return cudaErrorMemoryAllocation;
  void* memory = allocate_bytes(size);
  if (memory == nullptr) {
    release(device, size, false);
    return cudaErrorMemoryAllocation;
  }
  if (stream_ordered) {
    const std::size_t in_pool = device.pool_bytes.fetch_add(size, std::memory_order_relaxed) + size;
    const std::lock_guard lock(device.pool.mutex);
    device.pool.used_high = std::max<std::uint64_t>(device.pool.used_high, in_pool);
  }
  add({address(memory), size, MemoryKind::device, device.ordinal, stream_ordered});
  *pointer = memory;
  return cudaSuccess;
}

cudaError_t malloc_async(void** pointer, std::size_t size, cudaStream_t handle, bool per_thread) {
  if (const cudaError_t status = admit()) return result(status);
  if (pointer == nullptr) return result(cudaErrorInvalidValue);
  Stream* stream = nullptr;
  if (const cudaError_t status = resolve(handle, stream, per_thread)) return result(status);
  if (const cudaError_t status = malloc_on(stream->device, pointer, size, true)) {
    return result(status);
  }
  if (*pointer == nullptr) return cudaSuccess;
  // Fresh memory is poisoned in stream order: work on a stream not ordered after this allocation
  // races with that write, as it would use the memory before it is allocated on a GPU.
  auto task = std::make_unique<Task>();
  task->work = [memory = *pointer, size](const TaskContext&) { poison(memory, size); };
  if (const cudaError_t status = enqueue(*stream, std::move(task))) {
    (void)take(*pointer, MemoryKind::device);
    free_device_memory(stream->device, *pointer, size, true);
    *pointer = nullptr;
    return result(status);
  }
  return cudaSuccess;
}

cudaError_t free_async(void* pointer, cudaStream_t handle, bool per_thread) {
  if (const cudaError_t status = admit()) return result(status);
  if (pointer == nullptr) return cudaSuccess;
  Stream* stream = nullptr;
  if (const cudaError_t status = resolve(handle, stream, per_thread)) return result(status);
  const std::optional<Allocation> freed = take(pointer, MemoryKind::device);
  if (!freed) return result(cudaErrorInvalidValue);
  auto task = std::make_unique<Task>();
  task->runs_after_fault = true;
  task->work = [freed = *freed](const TaskContext&) {
    free_device_memory(owner_of(freed), reinterpret_cast<void*>(freed.base), freed.size,
                       freed.stream_ordered);
  };
  if (const cudaError_t status = enqueue(*stream, std::move(task))) {
    add(*freed);
    return result(status);
  }
  return cudaSuccess;
}

enum class Space { pageable, pinned, device };

struct Side {
  Space space = Space::pageable;
  int device = -1;
};

/// Where [pointer, pointer + bytes) lies; cudaErrorInvalidValue when it starts in an allocation
/// and runs past its end, the owner's fault for memory of a failed device.
cudaError_t locate(const void* pointer, std::size_t bytes, Side& side) {
  const std::optional<Allocation> found = find_containing(pointer);
  if (!found) {
    side = {};
    return cudaSuccess;
  }
  if (bytes > found->base + found->size - address(pointer)) return cudaErrorInvalidValue;
  side.space = found->kind == MemoryKind::device ? Space::device : Space::pinned;
  side.device = found->device;
  return side.space == Space::device ? fault_of(owner_of(*found)) : cudaSuccess;
}

/// Whether an explicit direction matches the memory: a device side may be device or pinned
/// memory (a GPU reaches both), a host side may be any host memory.
bool direction_matches(cudaMemcpyKind kind, const Side& to, const Side& from) {
  const auto device_side = [](const Side& side) { return side.space != Space::pageable; };
  const auto host_side = [](const Side& side) { return side.space != Space::device; };
  switch (kind) {
    case cudaMemcpyHostToHost:
      return host_side(from) && host_side(to);
    case cudaMemcpyHostToDevice:
      return host_side(from) && device_side(to);
    case cudaMemcpyDeviceToHost:
      return device_side(from) && host_side(to);
    case cudaMemcpyDeviceToDevice:
      return device_side(from) && device_side(to);
    default:
      return true;  // cudaMemcpyDefault: the runtime knows each side
  }
}

/// cudaMemcpy (synchronous = true, on the default stream) and cudaMemcpyAsync.
cudaError_t copy(void* destination, const void* source, std::size_t bytes, cudaMemcpyKind kind,
                 cudaStream_t handle, bool per_thread, bool synchronous) {
  if (const cudaError_t status = admit()) return result(status);
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) {
    return result(cudaErrorInvalidMemcpyDirection);
  }
  Stream* stream = nullptr;
  if (const cudaError_t status = resolve(handle, stream, per_thread)) return result(status);
  if (bytes == 0) return cudaSuccess;
  if (destination == nullptr || source == nullptr) return result(cudaErrorInvalidValue);
  Side to;
  Side from;
  if (const cudaError_t status = locate(destination, bytes, to)) return result(status);
  if (const cudaError_t status = locate(source, bytes, from)) return result(status);
  if (!direction_matches(kind, to, from)) return result(cudaErrorInvalidValue);

  const bool from_device = from.space == Space::device;
  const bool to_device = to.space == Space::device;
  bool wait_for_copy = false;
  std::shared_ptr<unsigned char[]> staged;
  if (!from_device && !to_device) {
    wait_for_copy = true;  // host to host: fully synchronous
  } else if (to_device && !from_device) {
    if (from.space == Space::pageable) {
      if (synchronous) {  // "a stream sync is performed before the copy is initiated"
        Position end;
        if (const cudaError_t status = end_of(*stream, end, false)) return result(status);
        stream->synchronize(end.seq);
      }
      // Staged before returning: the caller may reuse its buffer at once.
      staged.reset(new unsigned char[bytes]);
      std::memcpy(staged.get(), source, bytes);
      source = staged.get();
    } else {
      wait_for_copy = synchronous;
    }
  } else if (from_device && !to_device) {
    wait_for_copy = synchronous || to.space == Space::pageable;  // returns once complete
  }
  // (Device to device: never waits.)
  auto task = std::make_unique<Task>();
  // The staging copy moves into the task: the worker drops the only reference. (A reference
  // the host dropped after the worker would acquire the worker's release of the count.)
  task->work = [destination, source, bytes, staged = std::move(staged)](const TaskContext&) {
    std::memcpy(destination, source, bytes);
  };
  std::uint64_t seq = 0;
  if (const cudaError_t status = enqueue(*stream, std::move(task), &seq)) return result(status);
  if (wait_for_copy) stream->synchronize(seq);
  return result(fault_of(stream->device));
}

/// cudaMemset (synchronous = true, on the default stream) and cudaMemsetAsync.
cudaError_t fill(void* destination, int value, std::size_t bytes, cudaStream_t handle,
                 bool per_thread, bool synchronous) {
  if (const cudaError_t status = admit()) return result(status);
  Stream* stream = nullptr;
  if (const cudaError_t status = resolve(handle, stream, per_thread)) return result(status);
  if (bytes == 0) return cudaSuccess;
  if (destination == nullptr) return result(cudaErrorInvalidValue);
  Side to;
  if (const cudaError_t status = locate(destination, bytes, to)) return result(status);
  if (to.space == Space::pageable) return result(cudaErrorInvalidValue);
  auto task = std::make_unique<Task>();
  task->work = [destination, value, bytes](const TaskContext&) {
    std::memset(destination, value, bytes);
  };
  std::uint64_t seq = 0;
  if (const cudaError_t status = enqueue(*stream, std::move(task), &seq)) return result(status);
  // cudaMemset is asynchronous except into pinned memory; cudaMemsetAsync always is.
  if (synchronous && to.space == Space::pinned) stream->synchronize(seq);
  return result(fault_of(stream->device));
}

cudaError_t peer_copy(void* destination, int destination_device, const void* source,
                      int source_device, std::size_t bytes, cudaStream_t handle, bool per_thread,
                      bool synchronous) {
  if (device_at(destination_device) == nullptr || device_at(source_device) == nullptr) {
    return result(cudaErrorInvalidDevice);
  }
  return copy(destination, source, bytes, cudaMemcpyDeviceToDevice, handle, per_thread,
              synchronous);
}

Pool* pool_of(cudaMemPool_t handle, Device** owner = nullptr) {
  for (Device& device : runtime().devices) {
    if (reinterpret_cast<cudaMemPool_t>(&device.pool) == handle) {
      if (owner != nullptr) *owner = &device;
      return &device.pool;
    }
  }
  return nullptr;
}

}  // namespace

extern "C" {

cudaError_t cudaMalloc(void** devPtr, size_t size) {
  if (const cudaError_t status = admit()) return result(status);
  if (devPtr == nullptr) return result(cudaErrorInvalidValue);
  Device* device = nullptr;
  if (const cudaError_t status = current_device(device)) return result(status);
  if (const cudaError_t fault = fault_of(*device)) return result(fault);
  if (const cudaError_t status = malloc_on(*device, devPtr, size, false)) return result(status);
  poison(*devPtr, size);  // as uninitialised device memory: NaN, not zeros
  return cudaSuccess;
}

cudaError_t cudaFree(void* devPtr) {
  if (const cudaError_t status = admit()) return result(status);
  if (devPtr == nullptr) return cudaSuccess;
  const std::optional<Allocation> freed = take(devPtr, MemoryKind::device);
  if (!freed) return result(cudaErrorInvalidValue);
  Device& device = owner_of(*freed);
  // cudaFree synchronises the device, except for stream-ordered memory: its last users must have
  // finished already (else their work races with the poisoning below).
  if (!freed->stream_ordered) synchronize_device(device);
  free_device_memory(device, devPtr, freed->size, freed->stream_ordered);
  return result(fault_of(device));
}

cudaError_t cudaMallocAsync(void** devPtr, size_t size, cudaStream_t hStream) {
  return malloc_async(devPtr, size, hStream, false);
}
cudaError_t cudaMallocAsync_ptsz(void** devPtr, size_t size, cudaStream_t hStream) {
  return malloc_async(devPtr, size, hStream, true);
}

cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t hStream) {
  return free_async(devPtr, hStream, false);
}
cudaError_t cudaFreeAsync_ptsz(void* devPtr, cudaStream_t hStream) {
  return free_async(devPtr, hStream, true);
}

cudaError_t cudaHostAlloc(void** pHost, size_t size, unsigned int flags) {
  if (const cudaError_t status = admit()) return result(status);
  constexpr unsigned known =
      cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined;
  if (pHost == nullptr || (flags & ~known) != 0) return result(cudaErrorInvalidValue);
  Device* device = nullptr;
  if (const cudaError_t status = current_device(device)) return result(status);
  if (const cudaError_t fault = fault_of(*device)) return result(fault);
  *pHost = nullptr;
  if (size == 0) return cudaSuccess;
  void* memory = allocate_bytes(size);
  if (memory == nullptr) return result(cudaErrorMemoryAllocation);
  poison(memory, size);
  add({address(memory), size, MemoryKind::pinned, device->ordinal, false, flags});
  runtime().pinned_bytes.fetch_add(size, std::memory_order_relaxed);
  *pHost = memory;
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t size) {
  return cudaHostAlloc(ptr, size, 0);
}

cudaError_t cudaFreeHost(void* ptr) {
  if (const cudaError_t status = admit()) return result(status);
  if (ptr == nullptr) return cudaSuccess;
  const std::optional<Allocation> freed = take(ptr, MemoryKind::pinned);
  if (!freed) return result(cudaErrorInvalidValue);
  // Not stream-ordered and not synchronising: copies still using it race with this.
  poison(ptr, freed->size);
  std::free(ptr);
  runtime().pinned_bytes.fetch_sub(freed->size, std::memory_order_relaxed);
  return cudaSuccess;
}

cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned int flags) {
  if (const cudaError_t status = admit()) return result(status);
  constexpr unsigned known = cudaHostRegisterPortable | cudaHostRegisterMapped |
                             cudaHostRegisterIoMemory | cudaHostRegisterReadOnly;
  if (ptr == nullptr || size == 0 || (flags & ~known) != 0) return result(cudaErrorInvalidValue);
  Device* device = nullptr;
  if (const cudaError_t status = current_device(device)) return result(status);
  if (const cudaError_t fault = fault_of(*device)) return result(fault);
  Runtime& rt = runtime();
  const std::lock_guard lock(rt.memory_mutex);
  const std::uintptr_t base = address(ptr);
  auto next = rt.allocations.lower_bound(base);
  const bool overlaps_next = next != rt.allocations.end() && next->first < base + size;
  const bool overlaps_previous = next != rt.allocations.begin() &&
                                 std::prev(next)->second.base + std::prev(next)->second.size > base;
  if (overlaps_next || overlaps_previous) return result(cudaErrorHostMemoryAlreadyRegistered);
  rt.allocations[base] = {base, size, MemoryKind::registered, device->ordinal, false, flags};
  return cudaSuccess;
}

cudaError_t cudaHostUnregister(void* ptr) {
  if (const cudaError_t status = admit()) return result(status);
  if (!take(ptr, MemoryKind::registered)) return result(cudaErrorHostMemoryNotRegistered);
  return cudaSuccess;
}

cudaError_t cudaHostGetDevicePointer(void** pDevice, void* pHost, unsigned int flags) {
  if (const cudaError_t status = admit()) return result(status);
  if (pDevice == nullptr || flags != 0) return result(cudaErrorInvalidValue);
  const std::optional<Allocation> found = find_containing(pHost);
  if (!found || found->kind == MemoryKind::device) return result(cudaErrorInvalidValue);
  *pDevice = pHost;  // unified addressing: pinned memory has the same address on the device
  return cudaSuccess;
}

cudaError_t cudaHostGetFlags(unsigned int* pFlags, void* pHost) {
  if (const cudaError_t status = admit()) return result(status);
  if (pFlags == nullptr) return result(cudaErrorInvalidValue);
  const std::optional<Allocation> found = find_containing(pHost);
  if (!found || found->kind == MemoryKind::device) return result(cudaErrorInvalidValue);
  *pFlags = found->flags;
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) {
  if (const cudaError_t status = admit()) return result(status);
  if (attributes == nullptr) return result(cudaErrorInvalidValue);
  *attributes = cudaPointerAttributes{};
  const std::optional<Allocation> found = find_containing(ptr);
  if (!found) {  // since CUDA 11: not an error, just memory CUDA does not know
    attributes->type = cudaMemoryTypeUnregistered;
    attributes->device = cudaInvalidDeviceId;
    attributes->hostPointer = const_cast<void*>(ptr);
    return cudaSuccess;
  }
  attributes->device = found->device;
  attributes->devicePointer = const_cast<void*>(ptr);
  if (found->kind == MemoryKind::device) {
    attributes->type = cudaMemoryTypeDevice;
    return result(fault_of(owner_of(*found)));
  }
  attributes->type = cudaMemoryTypeHost;
  attributes->hostPointer = const_cast<void*>(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  if (const cudaError_t status = admit()) return result(status);
  if (free == nullptr || total == nullptr) return result(cudaErrorInvalidValue);
  Device* device = nullptr;
  if (const cudaError_t status = current_device(device)) return result(status);
  if (const cudaError_t fault = fault_of(*device)) return result(fault);
  *total = runtime().device_capacity.load(std::memory_order_relaxed);
  const std::size_t used = device->device_bytes.load(std::memory_order_relaxed);
  *free = used < *total ? *total - used : 0;
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  return copy(dst, src, count, kind, nullptr, false, true);
}
cudaError_t cudaMemcpy_ptds(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  return copy(dst, src, count, kind, nullptr, true, true);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  return copy(dst, src, count, kind, stream, false, false);
}
cudaError_t cudaMemcpyAsync_ptsz(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                                 cudaStream_t stream) {
  return copy(dst, src, count, kind, stream, true, false);
}

cudaError_t cudaMemcpyPeer(void* dst, int dstDevice, const void* src, int srcDevice, size_t count) {
  return peer_copy(dst, dstDevice, src, srcDevice, count, nullptr, false, true);
}
cudaError_t cudaMemcpyPeerAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                                size_t count, cudaStream_t stream) {
  return peer_copy(dst, dstDevice, src, srcDevice, count, stream, false, false);
}
cudaError_t cudaMemcpyPeerAsync_ptsz(void* dst, int dstDevice, const void* src, int srcDevice,
                                     size_t count, cudaStream_t stream) {
  return peer_copy(dst, dstDevice, src, srcDevice, count, stream, true, false);
}

cudaError_t cudaMemset(void* devPtr, int value, size_t count) {
  return fill(devPtr, value, count, nullptr, false, true);
}
cudaError_t cudaMemset_ptds(void* devPtr, int value, size_t count) {
  return fill(devPtr, value, count, nullptr, true, true);
}

cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream) {
  return fill(devPtr, value, count, stream, false, false);
}
cudaError_t cudaMemsetAsync_ptsz(void* devPtr, int value, size_t count, cudaStream_t stream) {
  return fill(devPtr, value, count, stream, true, false);
}

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* memPool, int device) {
  if (const cudaError_t status = admit()) return result(status);
  if (memPool == nullptr) return result(cudaErrorInvalidValue);
  Device* shown = device_at(device);
  if (shown == nullptr) return result(cudaErrorInvalidDevice);
  *memPool = reinterpret_cast<cudaMemPool_t>(&shown->pool);
  return cudaSuccess;
}

cudaError_t cudaDeviceGetMemPool(cudaMemPool_t* memPool, int device) {
  return cudaDeviceGetDefaultMemPool(memPool, device);
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t memPool, cudaMemPoolAttr attr, void* value) {
  if (const cudaError_t status = admit()) return result(status);
  Pool* pool = pool_of(memPool);
  if (pool == nullptr || value == nullptr) return result(cudaErrorInvalidValue);
  const std::lock_guard lock(pool->mutex);
  switch (attr) {
    case cudaMemPoolReuseFollowEventDependencies:
      pool->reuse_follow_event_dependencies = *static_cast<int*>(value);
      return cudaSuccess;
    case cudaMemPoolReuseAllowOpportunistic:
      pool->reuse_allow_opportunistic = *static_cast<int*>(value);
      return cudaSuccess;
    case cudaMemPoolReuseAllowInternalDependencies:
      pool->reuse_allow_internal_dependencies = *static_cast<int*>(value);
      return cudaSuccess;
    case cudaMemPoolAttrReleaseThreshold:
      pool->release_threshold = *static_cast<std::uint64_t*>(value);
      return cudaSuccess;
    case cudaMemPoolAttrReservedMemHigh:
    case cudaMemPoolAttrUsedMemHigh:  // may only be reset, to 0
      if (*static_cast<std::uint64_t*>(value) != 0) return result(cudaErrorInvalidValue);
      pool->used_high = 0;
      return cudaSuccess;
    default:
      return result(cudaErrorInvalidValue);
  }
}

cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t memPool, cudaMemPoolAttr attr, void* value) {
  if (const cudaError_t status = admit()) return result(status);
  Device* device = nullptr;
  Pool* pool = pool_of(memPool, &device);
  if (pool == nullptr || value == nullptr) return result(cudaErrorInvalidValue);
  const std::lock_guard lock(pool->mutex);
  const std::uint64_t in_use = device->pool_bytes.load(std::memory_order_relaxed);
  switch (attr) {
    case cudaMemPoolReuseFollowEventDependencies:
      *static_cast<int*>(value) = pool->reuse_follow_event_dependencies;
      return cudaSuccess;
    case cudaMemPoolReuseAllowOpportunistic:
      *static_cast<int*>(value) = pool->reuse_allow_opportunistic;
      return cudaSuccess;
    case cudaMemPoolReuseAllowInternalDependencies:
      *static_cast<int*>(value) = pool->reuse_allow_internal_dependencies;
      return cudaSuccess;
    case cudaMemPoolAttrReleaseThreshold:
      *static_cast<std::uint64_t*>(value) = pool->release_threshold;
      return cudaSuccess;
    case cudaMemPoolAttrReservedMemCurrent:  // freed memory is not kept: reserved is what is used
    case cudaMemPoolAttrUsedMemCurrent:
      *static_cast<std::uint64_t*>(value) = in_use;
      return cudaSuccess;
    case cudaMemPoolAttrReservedMemHigh:
    case cudaMemPoolAttrUsedMemHigh:
      *static_cast<std::uint64_t*>(value) = std::max<std::uint64_t>(pool->used_high, in_use);
      return cudaSuccess;
    default:
      return result(cudaErrorInvalidValue);
  }
}

cudaError_t cudaMemPoolTrimTo(cudaMemPool_t memPool, size_t /*minBytesToKeep*/) {
  if (const cudaError_t status = admit()) return result(status);
  return result(pool_of(memPool) != nullptr ? cudaSuccess : cudaErrorInvalidValue);
}

}  // extern "C"
