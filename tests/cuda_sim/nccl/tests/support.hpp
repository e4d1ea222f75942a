// What the simulated NCCL's tests share: NCCL and CUDA calls that throw with the library's text,
// device buffers, rank threads (each on its own device) and waiting without hanging.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace simtest {

inline std::string nccl_text(ncclResult_t result) {
  return std::string(ncclGetErrorString(result)) + ": " + ncclGetLastError(nullptr);
}

#define SIM_NCCL(call)                                                                           \
  do {                                                                                           \
    const ncclResult_t sim_result_ = (call);                                                     \
    if (sim_result_ != ncclSuccess) {                                                            \
      throw std::runtime_error(std::string(#call) + " -> " + ::simtest::nccl_text(sim_result_)); \
    }                                                                                            \
  } while (0)

#define SIM_CUDA(call)                                                                         \
  do {                                                                                         \
    const cudaError_t sim_status_ = (call);                                                    \
    if (sim_status_ != cudaSuccess) {                                                          \
      throw std::runtime_error(std::string(#call) + " -> " + cudaGetErrorString(sim_status_)); \
    }                                                                                          \
  } while (0)

/// Throws (from any thread) unless `condition`; run_ranks reports it.
inline void expect(bool condition, const std::string& what) {
  if (!condition) throw std::runtime_error(what);
}

/// The same, the message made only on failure: checks of every element of a large buffer would
/// otherwise spend most of their time (under ThreadSanitizer, most of a test's) building strings.
template <class Describe>
requires std::is_invocable_r_v<std::string, Describe>
void expect(bool condition, Describe&& what) {
  if (!condition) throw std::runtime_error(what());
}

/// Generous: the machine may be loaded; nothing here should take more than a few seconds.
inline constexpr auto patience = std::chrono::seconds(120);

/// Polls `done` until it is true; throws after `patience`.
template <class Done>
void wait_for(Done done, const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + patience;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("timed out: " + what);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

/// Polls ncclCommGetAsyncError until `until(state)`; returns that state.
template <class Until>
ncclResult_t wait_state(ncclComm_t comm, Until until, const std::string& what) {
  ncclResult_t state = ncclInProgress;
  wait_for(
      [&] {
        SIM_NCCL(ncclCommGetAsyncError(comm, &state));
        return until(state);
      },
      what);
  return state;
}

/// Polls a nonblocking communicator until its pending call has settled; returns its state.
inline ncclResult_t settle(ncclComm_t comm) {
  return wait_state(
      comm, [](ncclResult_t state) { return state != ncclInProgress; },
      "a nonblocking communicator to settle");
}

/// Device memory of `bytes` on the current device.
class Buffer {
 public:
  explicit Buffer(std::size_t bytes) : bytes_(bytes) {
    SIM_CUDA(cudaMalloc(&data_, bytes == 0 ? 1 : bytes));
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { (void)cudaFree(data_); }
  [[nodiscard]] void* get() const { return data_; }
  [[nodiscard]] std::byte* bytes() const { return static_cast<std::byte*>(data_); }
  [[nodiscard]] std::size_t size() const { return bytes_; }

  /// Copies host bytes in through `stream` and waits.
  void upload(const void* from, std::size_t bytes, cudaStream_t stream, std::size_t at = 0) {
    SIM_CUDA(cudaMemcpyAsync(this->bytes() + at, from, bytes, cudaMemcpyHostToDevice, stream));
    SIM_CUDA(cudaStreamSynchronize(stream));
  }
  /// Copies the buffer out through `stream` (after the work queued on it) and waits.
  std::vector<std::byte> download(cudaStream_t stream) const {
    std::vector<std::byte> host(bytes_);
    SIM_CUDA(cudaMemcpyAsync(host.data(), data_, bytes_, cudaMemcpyDeviceToHost, stream));
    SIM_CUDA(cudaStreamSynchronize(stream));
    return host;
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

/// A stream of the current device, destroyed at scope end.
class Stream {
 public:
  Stream() { SIM_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() {
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
  }
  operator cudaStream_t() const { return stream_; }  // NOLINT: a handle

 private:
  cudaStream_t stream_ = nullptr;
};

/// Runs fn(rank) on n threads, thread r with device r current; rethrows the first failure
/// (naming its rank) once all have returned.
template <class Fn>
void run_ranks(int n, Fn fn) {
  std::mutex mutex;
  std::string failure;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        SIM_CUDA(cudaSetDevice(r));
        fn(r);
      } catch (const std::exception& e) {
        std::lock_guard lock(mutex);
        if (failure.empty()) failure = "rank " + std::to_string(r) + ": " + e.what();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  if (!failure.empty()) throw std::runtime_error(failure);
}

/// A fresh unique id.
inline ncclUniqueId unique_id() {
  ncclUniqueId id{};
  SIM_NCCL(ncclGetUniqueId(&id));
  return id;
}

/// run_ranks over a fresh blocking communicator of n ranks: fn(comm, stream, rank) with a stream
/// of the rank's device, then the communicator is destroyed.
template <class Fn>
void with_communicator(int n, Fn fn) {
  const ncclUniqueId id = unique_id();
  run_ranks(n, [&](int rank) {
    ncclComm_t comm = nullptr;
    SIM_NCCL(ncclCommInitRank(&comm, n, id, rank));
    {
      Stream stream;
      fn(comm, stream, rank);
    }
    SIM_NCCL(ncclCommDestroy(comm));
  });
}

/// A nonblocking config (NCCL_CONFIG_INITIALIZER, blocking = 0).
inline ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

/// The shared-memory name the simulator gives the communicator of `id` (its contract: the
/// name comes from the id's random bytes), as a path under /dev/shm.
inline std::string shm_path(const ncclUniqueId& id) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string path = "/dev/shm/tandem-nccl-sim-";
  for (int i = 8; i < 24; ++i) {
    const auto byte = static_cast<unsigned char>(id.internal[i]);
    path += digits[byte >> 4];
    path += digits[byte & 15];
  }
  return path;
}

}  // namespace simtest
