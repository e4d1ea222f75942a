// tandem/tensor/memory.hpp - memory spaces as types (host, pinned, device), which space code on
// the host may touch, and the allocator each space uses for tandem::Buffer.
//   static_assert(tandem::host_accessible<tandem::pinned>);
//   auto* p = tandem::space_allocator<tandem::host>::allocate<float>(1024);
// Needs: the standard library; pinned and device allocation, and copies to or from device memory,
// need tandem/cuda.hpp (CUDA).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstring>
#include <new>
#include <type_traits>

namespace tandem {

/// Ordinary pageable host memory.
struct host {
  static constexpr const char* name = "host";  ///< for messages
};
/// Page-locked host memory: host code reads it, and the GPU copies from it asynchronously.
struct pinned {
  static constexpr const char* name = "pinned";  ///< for messages
};
/// GPU global memory: only kernels and copies touch it.
struct device {
  static constexpr const char* name = "device";  ///< for messages
};

/// A type opts in as a memory space by specialising this to true.
template <class S>
inline constexpr bool enable_memory_space = false;
/// \cond
template <>
inline constexpr bool enable_memory_space<host> = true;
template <>
inline constexpr bool enable_memory_space<pinned> = true;
template <>
inline constexpr bool enable_memory_space<device> = true;
/// \endcond

/// A memory space: an opted-in type with a printable name.
template <class S>
concept memory_space = enable_memory_space<S> && requires {
  { S::name } -> std::convertible_to<const char*>;
};

/// Whether code running on the host may dereference a pointer into space S.
template <memory_space S>
inline constexpr bool host_accessible = std::same_as<S, host> || std::same_as<S, pinned>;

/// Allocates and frees raw storage in one space. The primary template is a readable compile
/// error: pinned and device memory come with the CUDA headers, which specialise it.
template <memory_space S>
struct space_allocator {
  static_assert(sizeof(S) == 0,
                "tandem: no allocator for this memory space in this translation unit; "
                "pinned and device memory need #include <tandem/cuda.hpp> in a .cu file");
};

/// Host memory: aligned operator new and delete.
template <>
struct space_allocator<host> {
  /// Large enough for any SIMD load and a cache line, so vectorised loops never split one.
  static constexpr std::size_t alignment = 64;

  /// Room for `count` elements of T, uninitialised and aligned to `alignment`; nullptr for 0.
  template <class T>
  static T* allocate(std::size_t count) {
    if (count == 0) return nullptr;
    if (count > static_cast<std::size_t>(-1) / sizeof(T)) throw std::bad_array_new_length();
    return static_cast<T*>(::operator new (count * sizeof(T), std::align_val_t{alignment}));
  }

  /// Frees what allocate<T> returned (nullptr is fine).
  template <class T>
  static void deallocate(T* pointer, std::size_t /*count*/) noexcept {
    if (pointer) ::operator delete (pointer, std::align_val_t{alignment});
  }
};

/// What tandem::Buffer keeps about one allocation besides its pointer and size, so that the free
/// matches the allocation: nothing for host and pinned memory; for device memory the stream the
/// allocation is ordered on (a cudaStream_t, held here without naming CUDA) and its device. The
/// space's allocator fills it in (allocate<T>(count, state) or allocate<T>(count, exec, state))
/// and reads it back (deallocate(pointer, count, state)); an allocator without those overloads
/// is called without it. It is fixed here, not by the allocator, so that naming Buffer<T, device>
/// needs no CUDA.
template <memory_space S>
struct allocation_state {};
/// Device memory: the stream and the GPU its allocation is ordered on.
template <>
struct allocation_state<device> {
  void* stream = nullptr;  ///< the cudaStream_t that the allocation and its free are ordered on
  int device = -1;         ///< the GPU it was made on
};

/// Copies `bytes` bytes from space From to space To, synchronously: the data is in place when
/// copy() returns. The primary template is a readable compile error: copies to or from device
/// memory come with the CUDA headers, which specialise it. Host-accessible pairs (host, pinned)
/// are a memcpy; pinned memory that an asynchronous GPU copy is still writing must be waited for
/// (its stream or event synchronised) first.
template <memory_space To, memory_space From>
struct space_copy {
  static_assert(sizeof(To) == 0,
                "tandem: no copy between these memory spaces in this translation unit; "
                "copies to or from device memory need #include <tandem/cuda.hpp> in a .cu file");
};

template <memory_space To, memory_space From>
requires(host_accessible<To>&& host_accessible<From>) struct space_copy<To, From> {
  /// memcpy of `bytes` bytes.
  static void copy(void* destination, const void* source, std::size_t bytes) noexcept {
    if (bytes != 0) std::memcpy(destination, source, bytes);
  }
};

}  // namespace tandem
