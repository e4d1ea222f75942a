// tandem/comm/mpi/detail/mpi_runtime.hpp - MPI's process-wide state behind MpiComm: initialisation
// and finalisation, the thread level, datatypes and reduce ops of the element types, MPI errors.
//   auto& runtime = tandem::detail::mpi::Runtime::instance();   // MPI_Init_thread on first use
// Needs: an MPI (C API, MPI-3).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>

#include <mpi.h>
#ifdef __linux__
#include <sched.h>
#endif

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/reduction.hpp"
#include "tandem/core/error.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem::detail::mpi {

/// MPI_Error_string's text for `code`, e.g. "MPI_ERR_TRUNCATE: message truncated".
inline std::string error_string(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS || length <= 0) {
    return "MPI error code " + std::to_string(code);
  }
  return std::string(text, static_cast<std::size_t>(length));
}

inline Error error(int rank, const char* operation, int code) {
  return Error(rank, operation, "MPI reported " + error_string(code));
}

/// The MPI_User_function of a commutative op on 16-bit floats: each element of inout becomes
/// in op inout (reduction.hpp's combine_elements: computed in float, rounded once).
template <class T, ReduceOp Op>
void reduce_float16(void* in, void* inout, int* length, MPI_Datatype*) {
  const auto* a = static_cast<const unsigned char*>(in);
  auto* b = static_cast<unsigned char*>(inout);
  for (int i = 0; i < *length; ++i) {
    const auto offset = static_cast<std::size_t>(i) * 2;
    std::uint16_t x = 0;
    std::uint16_t y = 0;
    std::memcpy(&x, a + offset, 2);
    std::memcpy(&y, b + offset, 2);
    const std::uint16_t result = combine_elements<Op>(T::from_bits(x), T::from_bits(y)).bits;
    std::memcpy(b + offset, &result, 2);
  }
}

/// Polls with growing pauses: yields first (an operation on shared memory completes in
/// microseconds), then sleeps up to 1 ms (a long one must not keep a core busy).
class Backoff {
 public:
  [[nodiscard]] std::chrono::microseconds next() noexcept {
    if (rounds_ < 64) {
      ++rounds_;
      return std::chrono::microseconds(0);
    }
    const int shift = rounds_ - 64 < 7 ? rounds_ - 64 : 7;
    ++rounds_;
    return std::chrono::microseconds(8 << shift);  // 8 us .. 1024 us
  }
  void pause() {
    const auto wait = next();
    if (wait.count() == 0) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(wait);
    }
  }
  void reset() noexcept { rounds_ = 0; }

 private:
  int rounds_ = 0;
};

/// The process's MPI: initialised by the first MpiComm (unless the user did it), finalised at exit
/// (only if initialised here). It also owns the reduce ops of half and bfloat16, and the mutex
/// that serialises MPI calls when the thread level is below MPI_THREAD_MULTIPLE.
class Runtime {
 public:
  /// MPI may be initialised once per process and must be finalised once, after its last call.
  /// A function-local static is the one object with that lifetime: built by the first MpiComm
  /// (thread-safely), destroyed at exit after every object whose construction finished later -
  /// main's MpiComms and MpiComms with static storage alike. That makes it the unavoidable
  /// singleton here.
  static Runtime& instance() {
    static Runtime runtime;
    return runtime;
  }

  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  ~Runtime() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!owns_mpi_ || finalized) return;
    // A communicator still alive at exit (leaked, or std::exit from inside main), or a
    // collective worker it left blocked in MPI, may have a thread inside MPI: finalising under
    // it could crash or hang. mpirun then reports the missing MPI_Finalize, which names the real
    // problem.
    if (live_.load() != 0) return;
    for (MPI_Op& op : half_ops_) MPI_Op_free(&op);
    for (MPI_Op& op : bfloat16_ops_) MPI_Op_free(&op);
    MPI_Finalize();
  }

  /// The thread level MPI provides (MPI_THREAD_SINGLE .. MPI_THREAD_MULTIPLE).
  [[nodiscard]] int thread_level() const noexcept { return level_; }
  /// Whether this runtime initialised MPI (and so finalises it at exit).
  [[nodiscard]] bool owns_mpi() const noexcept { return owns_mpi_; }
  /// Below MPI_THREAD_MULTIPLE, threads take turns: every MPI call holds lock().
  [[nodiscard]] bool serialized() const noexcept { return level_ < MPI_THREAD_MULTIPLE; }
  /// Below MPI_THREAD_SERIALIZED only the calling thread may use MPI: no progress thread, and an
  /// `_async` operation runs to completion before it returns.
  [[nodiscard]] bool eager() const noexcept { return level_ < MPI_THREAD_SERIALIZED; }

  /// Held around each MPI call where serialized(); an empty lock otherwise.
  [[nodiscard]] std::unique_lock<std::mutex> lock() {
    return serialized() ? std::unique_lock<std::mutex>(mutex_) : std::unique_lock<std::mutex>();
  }

  template <class T>
  [[nodiscard]] MPI_Op float16_op(ReduceOp op) const noexcept {
    const auto& ops = std::is_same_v<T, half> ? half_ops_ : bfloat16_ops_;
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg:
        return ops[0];
      case ReduceOp::prod:
        return ops[1];
      case ReduceOp::min:
        return ops[2];
      case ReduceOp::max:
        return ops[3];
    }
    return ops[0];
  }

  /// Each communicator state attaches while it (or a worker thread it left in MPI) may call MPI.
  void attach() noexcept { ++live_; }
  void detach() noexcept { --live_; }
  /// How many are attached now.
  [[nodiscard]] int live() const noexcept { return live_.load(); }

 private:
  Runtime() {
    int initialized = 0;
    int finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (finalized) throw Error("MpiComm", "MPI has already been finalised in this process");
    if (initialized) {
      MPI_Query_thread(&level_);
    } else {
      prefer_yield_when_oversubscribed();
      const int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &level_);
      if (code != MPI_SUCCESS) {
        throw Error("MpiComm", "MPI_Init_thread failed: " + error_string(code));
      }
      owns_mpi_ = true;
    }
    create_ops<half>(half_ops_);
    create_ops<bfloat16>(bfloat16_ops_);
  }

  /// Open MPI busy-polls inside every blocking call and yields the CPU while it waits only
  /// where mpirun counted more processes than slots. MpiComm's `_async` worker is a second thread
  /// per process waiting inside MPI, beside the caller's, so ranks x 2 threads may exceed the
  /// CPUs although ranks do not; then a rank spinning for a peer that has no CPU keeps its own
  /// for a whole time slice. On a loaded 2-CPU VM a 1 MiB all_reduce of 2 ranks took 12-16 ms
  /// instead of 0.2 ms that way, a 4 KiB one on the worker 16 ms instead of 10 us. So, for an Open
  /// MPI initialised here: yield when idle where local ranks x 2 exceed the node's CPUs or this
  /// process may run on one CPU only (mpirun's default binding to a core) - unless the user
  /// chose: a set OMPI_MCA_mpi_yield_when_idle (mpirun --mca sets it too) wins. Called before
  /// MPI_Init_thread, before tandem starts threads (setenv is not thread-safe).
  static void prefer_yield_when_oversubscribed() {
#ifdef OPEN_MPI
    if (std::getenv("OMPI_MCA_mpi_yield_when_idle") != nullptr) return;
    const char* local_size = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    const long ranks = local_size != nullptr ? std::strtol(local_size, nullptr, 10) : 1;
    const long cpus = static_cast<long>(std::thread::hardware_concurrency());
    bool crowded = cpus > 0 && 2 * std::max(ranks, 1L) > cpus;
#ifdef __linux__
    // mpirun binds each rank to one core by default: its two threads then share that core.
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0 && CPU_COUNT(&allowed) < 2) {
      crowded = true;
    }
#endif
    if (crowded) {
      ::setenv("OMPI_MCA_mpi_yield_when_idle", "1", 0);
    }
#endif
  }

  template <class T>
  static void create_ops(MPI_Op (&ops)[4]) {
    MPI_Op_create(&reduce_float16<T, ReduceOp::sum>, 1, &ops[0]);
    MPI_Op_create(&reduce_float16<T, ReduceOp::prod>, 1, &ops[1]);
    MPI_Op_create(&reduce_float16<T, ReduceOp::min>, 1, &ops[2]);
    MPI_Op_create(&reduce_float16<T, ReduceOp::max>, 1, &ops[3]);
  }

  int level_ = MPI_THREAD_SINGLE;
  bool owns_mpi_ = false;
  std::mutex mutex_;
  std::atomic<int> live_{0};
  MPI_Op half_ops_[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  MPI_Op bfloat16_ops_[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
};

/// The MPI datatype of element type T; half and bfloat16 travel as 16-bit words.
template <class T>
MPI_Datatype datatype() noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return MPI_FLOAT;
  } else if constexpr (std::is_same_v<T, double>) {
    return MPI_DOUBLE;
  } else if constexpr (std::is_same_v<T, std::int32_t>) {
    return MPI_INT32_T;
  } else if constexpr (std::is_same_v<T, std::int64_t>) {
    return MPI_INT64_T;
  } else if constexpr (std::is_same_v<T, std::uint8_t>) {
    return MPI_UINT8_T;
  } else {
    static_assert(is_float16<T>, "tandem::MpiComm: not an element type");
    return MPI_UINT16_T;
  }
}

/// The MPI op of `op` for T; avg reduces with sum (the caller divides afterwards).
template <class T>
MPI_Op reduce_op(const Runtime& runtime, ReduceOp op) noexcept {
  if constexpr (is_float16<T>) {
    return runtime.float16_op<T>(op);
  } else {
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg:
        return MPI_SUM;
      case ReduceOp::prod:
        return MPI_PROD;
      case ReduceOp::min:
        return MPI_MIN;
      case ReduceOp::max:
        return MPI_MAX;
    }
    return MPI_SUM;
  }
}

}  // namespace tandem::detail::mpi
