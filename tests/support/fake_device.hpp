// tests/support/fake_device.hpp - a memory space that host code may not touch, backed by ordinary
// memory, with pinned allocation and the copies between them counted. It lets the CPU tests check
// that Gloo and MPI stage device tensors through pinned memory, where no GPU is present.
//   tandem::View<float, tandem::test::fake_device> grads(storage.data(), storage.size());
//   comm.all_reduce(grads);  // copied to pinned, reduced there, copied back
// Only one test translation unit per program may include it (it specialises tandem's templates).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstring>
#include <new>

#include "tandem/tensor/memory.hpp"

namespace tandem::test {

struct fake_device {
  static constexpr const char* name = "fake_device";
};

struct StagingCounters {
  std::atomic<int> to_pinned{0};
  std::atomic<int> to_device{0};
  std::atomic<int> pinned_live{0};
  std::atomic<int> pinned_allocations{0};
};
inline StagingCounters staging_counters;

}  // namespace tandem::test

template <>
inline constexpr bool tandem::enable_memory_space<tandem::test::fake_device> = true;

template <>
struct tandem::space_allocator<tandem::pinned> {
  template <class T>
  static T* allocate(std::size_t count) {
    ++test::staging_counters.pinned_live;
    ++test::staging_counters.pinned_allocations;
    return static_cast<T*>(::operator new(count ? count * sizeof(T) : 1));
  }
  template <class T>
  static void deallocate(T* pointer, std::size_t /*count*/) noexcept {
    if (!pointer) return;
    --test::staging_counters.pinned_live;
    ::operator delete(pointer);
  }
};

template <>
struct tandem::space_copy<tandem::pinned, tandem::test::fake_device> {
  static void copy(void* dst, const void* src, std::size_t bytes) {
    ++test::staging_counters.to_pinned;
    std::memcpy(dst, src, bytes);
  }
};
template <>
struct tandem::space_copy<tandem::test::fake_device, tandem::pinned> {
  static void copy(void* dst, const void* src, std::size_t bytes) {
    ++test::staging_counters.to_device;
    std::memcpy(dst, src, bytes);
  }
};
