// tests/support/fake_device_space.hpp - support/fake_device.hpp's memory space made complete for
// SyncBatchNorm: an allocator (fresh memory filled with NaN bytes, as device memory starts unset),
// copies to and from the host, and fake_device_exec, an executor that runs TANDEM_HD functors on
// the host as cuda_exec runs them on a GPU (indices in reverse order, functors that cuda_exec
// could not copy into a kernel refused, host waits counted).
//   tandem::SyncBatchNorm<tandem::LocalComm, float, tandem::test::fake_device,
//                         tandem::test::fake_device_exec> bn(comm, 8);
// Only one translation unit per program may include it (it specialises tandem's templates), and
// before anything that instantiates them.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstring>
#include <new>
#include <type_traits>

#include "support/fake_device.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/memory.hpp"

namespace tandem::test {

/// Runs functors where fake_device memory lives, as cuda_exec would on a GPU: each index once,
/// in an order the caller must not rely on (reverse here), and counts the host's waits (in all,
/// and on the calling thread: one rank of a LocalComm group) and its passes over memory.
struct fake_device_exec {
  using memory_space = fake_device;

  /// The fake stream its work is queued on, as cuda_exec's stream (a stream-ordered
  /// communicator compares it with its caller stream).
  int stream = 0;

  template <class F>
  void for_each_index(std::size_t n, F&& f) const {
    static_assert(std::is_trivially_copyable_v<std::decay_t<F>>,
                  "cuda_exec copies functors into kernels: they must be trivially copyable");
    ++passes_here;
    for (std::size_t i = n; i-- > 0;) f(i);
  }
  template <class T, class Map, class Combine>
  [[nodiscard]] T transform_reduce(std::size_t n, T init, Map&& map, Combine&& combine) const {
    ++host_waits;
    ++host_waits_here;
    ++passes_here;
    T accumulator = init;
    for (std::size_t i = 0; i < n; ++i) accumulator = combine(accumulator, map(i));
    return accumulator;
  }
  template <class T, class Map, class Combine>
  void transform_reduce_into(T* out, std::size_t n, T init, Map&& map, Combine&& combine) const {
    ++passes_here;
    T accumulator = init;
    for (std::size_t i = 0; i < n; ++i) accumulator = combine(accumulator, map(i));
    *out = accumulator;
  }
  void synchronize() const noexcept {
    ++host_waits;
    ++host_waits_here;
  }

  static inline std::atomic<int> host_waits{0};
  /// host_waits of the calling thread only.
  static inline thread_local int host_waits_here = 0;
  /// Kernels the calling thread launched (element-wise passes and reductions).
  static inline thread_local int passes_here = 0;
};

/// Host reads of fake device memory (space_copy to the host).
inline std::atomic<int> reads_back{0};

}  // namespace tandem::test

template <>
inline constexpr bool tandem::enable_executor<tandem::test::fake_device_exec> = true;

/// Fake device memory: ordinary memory, filled with NaN bytes as a reminder that it starts unset.
template <>
struct tandem::space_allocator<tandem::test::fake_device> {
  template <class T>
  static T* allocate(std::size_t count) {
    if (count == 0) return nullptr;
    void* pointer = ::operator new(count * sizeof(T));
    std::memset(pointer, 0xff, count * sizeof(T));
    return static_cast<T*>(pointer);
  }
  template <class T>
  static void deallocate(T* pointer, std::size_t /*count*/) noexcept {
    ::operator delete(pointer);
  }
};

template <>
struct tandem::space_copy<tandem::host, tandem::test::fake_device> {
  static void copy(void* dst, const void* src, std::size_t bytes) {
    ++test::reads_back;
    if (bytes) std::memcpy(dst, src, bytes);
  }
};
template <>
struct tandem::space_copy<tandem::test::fake_device, tandem::host> {
  static void copy(void* dst, const void* src, std::size_t bytes) {
    if (bytes) std::memcpy(dst, src, bytes);
  }
};
template <>
struct tandem::space_copy<tandem::test::fake_device, tandem::test::fake_device> {
  static void copy(void* dst, const void* src, std::size_t bytes) {
    if (bytes) std::memcpy(dst, src, bytes);
  }
};
