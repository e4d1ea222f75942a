// tandem/tensor/exec.hpp - execution spaces: run an element-wise or reduction functor over n
// indices, as a plain loop on the host or (with tandem/cuda.hpp) as a kernel on a CUDA stream.
//   struct Scale { float* x; float s; TANDEM_HD void operator()(std::size_t i) const { x[i] *= s; }
//   }; tandem::for_each_index(tandem::on_host, n, Scale{data, 0.5f});
// Needs: the standard library; tandem::cuda_exec and its algorithms come with tandem/cuda.hpp.
#pragma once

#include <concepts>
#include <cstddef>
#include <type_traits>
#include <utility>

#include "tandem/core/config.hpp"
#include "tandem/tensor/memory.hpp"

namespace tandem {

/// Runs functors on the calling thread. The loops are plain so the compiler can vectorise them.
struct host_exec {
  using memory_space = host;  ///< the memory its functors may touch (pinned too: host_accessible)

  /// Calls f(i) for every i in [0, n), in order.
  template <class F>
  void for_each_index(std::size_t n, F&& f) const {
    for (std::size_t i = 0; i < n; ++i) f(i);
  }

  /// combine(...combine(init, map(0)), ..., map(n - 1)), left to right: deterministic, and the
  /// same order as a sequential loop in the reference code we compare against.
  template <class T, class Map, class Combine>
  [[nodiscard]] T transform_reduce(std::size_t n, T init, Map&& map, Combine&& combine) const {
    T accumulator = init;
    for (std::size_t i = 0; i < n; ++i) accumulator = combine(accumulator, map(i));
    return accumulator;
  }

  /// The same reduction, written to *out (memory the executor's space can write: here the host).
  /// A device executor keeps the result on the device; a host one simply stores it.
  template <class T, class Map, class Combine>
  void transform_reduce_into(T* out, std::size_t n, T init, Map&& map, Combine&& combine) const {
    *out = transform_reduce(n, init, std::forward<Map>(map), std::forward<Combine>(combine));
  }

  /// Work on the host is finished when the call returns.
  void synchronize() const noexcept {}
};

/// The host executor, for call sites: `for_each_index(on_host, n, f)`.
inline constexpr host_exec on_host{};

/// A type opts in as an executor by specialising this to true (tandem/cuda.hpp does, for
/// cuda_exec).
template <class E>
inline constexpr bool enable_executor = false;
/// \cond
template <>
inline constexpr bool enable_executor<host_exec> = true;
/// \endcond

/// An execution space: runs functors where the memory of its memory_space can be touched.
template <class E>
concept Executor = enable_executor<std::remove_cvref_t<E>> &&
    memory_space<typename std::remove_cvref_t<E>::memory_space> && requires(const E& exec) {
  exec.synchronize();
};

/// Whether executor E may touch memory in space S: the host executor reads host and pinned
/// memory; a device executor reads device memory (and pinned, which kernels can map, is not
/// assumed).
template <class E, class S>
concept ExecutorFor = Executor<E> &&
    (std::same_as<typename std::remove_cvref_t<E>::memory_space, S> ||
     (std::same_as<typename std::remove_cvref_t<E>::memory_space, host> && host_accessible<S>));

/// The executor that a memory space's data is processed with by default. Device memory's comes
/// with tandem/cuda.hpp; without it, naming it is a readable compile error.
template <memory_space S>
struct default_executor {
  static_assert(sizeof(S) == 0,
                "tandem: device memory is processed by tandem::cuda_exec; "
                "#include <tandem/cuda.hpp> in a .cu file");
};
/// \cond
template <>
struct default_executor<host> {
  using type = host_exec;
};
template <>
struct default_executor<pinned> {
  using type = host_exec;
};
/// \endcond
/// default_executor<S>::type: host_exec for host and pinned memory, cuda_exec for device memory.
template <memory_space S>
using default_executor_t = typename default_executor<S>::type;

/// Calls f(i) for every i in [0, n) on exec. Under nvcc f must be callable on the device: a
/// struct with a TANDEM_HD operator() (lambdas need --extended-lambda, which tandem does not
/// require). Order is unspecified on devices; write each index's own elements only.
template <Executor E, class F>
void for_each_index(const E& exec, std::size_t n, F&& f) {
  exec.for_each_index(n, std::forward<F>(f));
}

/// Reduces map(0..n-1) with combine starting from init and returns the result to the host
/// (a device executor synchronises its stream for this one value).
template <Executor E, class T, class Map, class Combine>
[[nodiscard]] T transform_reduce(const E& exec, std::size_t n, T init, Map&& map,
                                 Combine&& combine) {
  return exec.transform_reduce(n, init, std::forward<Map>(map), std::forward<Combine>(combine));
}

/// Reduces into *out in the executor's memory without waiting for the result: the way an inf
/// flag stays on the device.
template <Executor E, class T, class Map, class Combine>
void transform_reduce_into(const E& exec, T* out, std::size_t n, T init, Map&& map,
                           Combine&& combine) {
  exec.transform_reduce_into(out, n, init, std::forward<Map>(map), std::forward<Combine>(combine));
}

/// Combiners that compile for host and device alike: a + b.
struct plus_combine {
  /// a + b.
  template <class T>
  TANDEM_HD constexpr T operator()(T a, T b) const noexcept {
    return a + b;
  }
};
/// The larger of two values (the first when neither is larger).
struct max_combine {
  /// b when a < b, else a.
  template <class T>
  TANDEM_HD constexpr T operator()(T a, T b) const noexcept {
    return a < b ? b : a;
  }
};
/// The smaller of two values (the first when neither is smaller).
struct min_combine {
  /// b when b < a, else a.
  template <class T>
  TANDEM_HD constexpr T operator()(T a, T b) const noexcept {
    return b < a ? b : a;
  }
};

}  // namespace tandem
