// Devices, the current device per host thread, CUDA's last-error rules, sticky faults
// (cuda_sim_inject_fault), CUDA_VISIBLE_DEVICES and fork.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "sim_test.hpp"

using sim_test::Gate;
using sim_test::launch;
using sim_test::ScopedStream;

namespace {

/// Clears a device's injected fault when the test ends, however it ends.
struct FaultCleared {
  int device;
  ~FaultCleared() { (void)cuda_sim_clear_fault(device); }
};

/// Restores the device count and current device when the test ends.
struct DevicesRestored {
  int count = cuda_sim_device_count();
  ~DevicesRestored() {
    (void)cuda_sim_set_device_count(count);
    (void)cudaSetDevice(0);
    (void)cudaGetLastError();
  }
};

}  // namespace

TEST_CASE("TANDEM_CUDA_SIM_DEVICES devices, current per host thread") {
  const DevicesRestored restore;
  int count = 0;
  SIM_REQUIRE(cudaGetDeviceCount(&count));
  CHECK(count == 4);  // CTest sets TANDEM_CUDA_SIM_DEVICES=4
  SIM_REQUIRE(cudaSetDevice(3));
  int device = -1;
  int other_device = -1;
  std::thread other([&] { CHECK(cudaGetDevice(&other_device) == cudaSuccess); });
  other.join();
  SIM_REQUIRE(cudaGetDevice(&device));
  CHECK(device == 3);
  CHECK(other_device == 0);  // a new thread starts on device 0
  CHECK(cudaSetDevice(4) == cudaErrorInvalidDevice);
  CHECK(cudaSetDevice(-1) == cudaErrorInvalidDevice);
  SIM_REQUIRE(cudaGetDevice(&device));
  CHECK(device == 3);  // a failed cudaSetDevice changes nothing

  unsigned long long legacy_three = 0, legacy_zero = 0;
  SIM_REQUIRE(cudaStreamGetId(cudaStreamLegacy, &legacy_three));
  cudaStream_t stream = nullptr;
  SIM_REQUIRE(cudaStreamCreate(&stream));
  SIM_REQUIRE(cudaSetDevice(0));
  SIM_REQUIRE(cudaStreamGetId(cudaStreamLegacy, &legacy_zero));
  CHECK(legacy_three != legacy_zero);  // each device has its own legacy stream
  int stream_device = -1;
  SIM_REQUIRE(cudaStreamGetDevice(stream, &stream_device));
  CHECK(stream_device == 3);
  SIM_REQUIRE(cudaStreamDestroy(stream));

  SIM_REQUIRE(cuda_sim_set_device_count(2));
  SIM_REQUIRE(cudaGetDeviceCount(&count));
  CHECK(count == 2);
  CHECK(cudaSetDevice(3) == cudaErrorInvalidDevice);
  SIM_REQUIRE(cuda_sim_set_device_count(0));
  CHECK(cudaGetDeviceCount(&count) == cudaErrorNoDevice);
  CHECK(count == 0);
  CHECK(cuda_sim_set_device_count(CUDA_SIM_MAX_DEVICES + 1) == cudaErrorInvalidValue);
}

TEST_CASE("device properties and attributes agree, each device with its own UUID") {
  cudaDeviceProp zero{}, one{};
  SIM_REQUIRE(cudaGetDeviceProperties(&zero, 0));
  SIM_REQUIRE(cudaGetDeviceProperties(&one, 1));
  CHECK(std::memcmp(zero.uuid.bytes, one.uuid.bytes, sizeof zero.uuid.bytes) != 0);
  CHECK(zero.pciBusID != one.pciBusID);
  CHECK(std::string(zero.name).find("cuda_sim") != std::string::npos);
  int value = 0;
  SIM_REQUIRE(cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, 0));
  CHECK(value == zero.multiProcessorCount);
  CHECK(value > 0);
  SIM_REQUIRE(cudaDeviceGetAttribute(&value, cudaDevAttrMaxThreadsPerMultiProcessor, 0));
  CHECK(value == zero.maxThreadsPerMultiProcessor);
  SIM_REQUIRE(cudaDeviceGetAttribute(&value, cudaDevAttrComputeCapabilityMajor, 1));
  CHECK(value == one.major);
  CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrWarpSize, 9) == cudaErrorInvalidDevice);
  CHECK(cudaDeviceGetAttribute(&value, static_cast<cudaDeviceAttr>(100000), 0) ==
        cudaErrorInvalidValue);
  CHECK(cudaGetDeviceProperties(nullptr, 0) == cudaErrorInvalidValue);
  (void)cudaGetLastError();
}

TEST_CASE("last error: per thread; cudaGetLastError clears it, cudaPeekAtLastError keeps it") {
  (void)cudaGetLastError();
  CHECK(cudaSetDevice(999) == cudaErrorInvalidDevice);
  int device = -1;
  SIM_REQUIRE(cudaGetDevice(&device));  // a later success does not clear it
  CHECK(cudaPeekAtLastError() == cudaErrorInvalidDevice);
  CHECK(cudaPeekAtLastError() == cudaErrorInvalidDevice);
  cudaError_t other_thread = cudaErrorUnknown;
  std::thread other([&] { other_thread = cudaGetLastError(); });
  other.join();
  CHECK(other_thread == cudaSuccess);
  CHECK(cudaGetLastError() == cudaErrorInvalidDevice);
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("error names and strings") {
  CHECK(std::string(cudaGetErrorName(cudaErrorNotReady)) == "cudaErrorNotReady");
  CHECK(std::string(cudaGetErrorName(cudaSuccess)) == "cudaSuccess");
  CHECK(std::string(cudaGetErrorName(cudaErrorIllegalAddress)) == "cudaErrorIllegalAddress");
  CHECK(std::string(cudaGetErrorString(cudaErrorInvalidValue)) == "invalid argument");
  CHECK(std::string(cudaGetErrorString(cudaErrorStreamCaptureMerge)) ==
        "cudaErrorStreamCaptureMerge");
  CHECK(std::string(cudaGetErrorString(static_cast<cudaError_t>(12345))) ==
        "unrecognized error code");
}

TEST_CASE("an injected fault is sticky on its device and leaves the others alone") {
  const FaultCleared cleared{1};
  SIM_REQUIRE(cudaSetDevice(1));
  ScopedStream stream;
  Gate gate;
  gate.hold(stream);
  std::atomic<bool> ran{false};
  auto work = [&] { ran.store(true); };
  launch(stream, work);  // queued before the fault: skipped
  struct Seen {
    std::atomic<int> status{-1};
  } seen;
  SIM_REQUIRE(cudaStreamAddCallback(
      stream,
      [](cudaStream_t, cudaError_t status, void* data) {
        static_cast<Seen*>(data)->status.store(status);
      },
      &seen, 0));
  SIM_REQUIRE(cuda_sim_inject_fault(1, cudaErrorIllegalAddress));
  gate.open();
  CHECK(cudaStreamSynchronize(stream) == cudaErrorIllegalAddress);  // at once, as CUDA does
  // The callback still runs, and is told; the host function queued before it is skipped.
  CHECK(sim_test::eventually([&] { return seen.status.load() != -1; }));
  CHECK(seen.status.load() == cudaErrorIllegalAddress);
  CHECK_FALSE(ran.load());
  void* pointer = nullptr;
  CHECK(cudaMalloc(&pointer, 16) == cudaErrorIllegalAddress);
  CHECK(cudaLaunchHostFunc(
            stream, [](void*) {}, nullptr) == cudaErrorIllegalAddress);
  CHECK(cudaDeviceSynchronize() == cudaErrorIllegalAddress);
  CHECK(cudaGetLastError() == cudaErrorIllegalAddress);
  CHECK(cudaGetLastError() == cudaErrorIllegalAddress);  // sticky: not cleared
  CHECK(cudaPeekAtLastError() == cudaErrorIllegalAddress);

  SIM_REQUIRE(cudaSetDevice(0));  // another device works on
  (void)cudaGetLastError();       // (the last error recorded above)
  CHECK(cudaGetLastError() == cudaSuccess);
  SIM_REQUIRE(cudaMalloc(&pointer, 16));
  SIM_REQUIRE(cudaFree(pointer));
  SIM_REQUIRE(cudaDeviceSynchronize());

  SIM_REQUIRE(cuda_sim_clear_fault(1));
  SIM_REQUIRE(cudaSetDevice(1));
  SIM_REQUIRE(cudaStreamSynchronize(stream));
  CHECK(cuda_sim_inject_fault(99, cudaErrorIllegalAddress) == cudaErrorInvalidDevice);
  CHECK(cuda_sim_inject_fault(1, cudaSuccess) == cudaErrorInvalidValue);
  SIM_REQUIRE(cudaSetDevice(0));
  (void)cudaGetLastError();
}

TEST_CASE("work that throws fails its device as a kernel fault would") {
  const FaultCleared cleared{2};
  SIM_REQUIRE(cudaSetDevice(2));
  ScopedStream stream;
  auto throws = [] { throw std::runtime_error("deliberate failure in stream work"); };
  launch(stream, throws);
  CHECK(cudaStreamSynchronize(stream) == cudaErrorLaunchFailure);
  SIM_REQUIRE(cudaSetDevice(0));
  (void)cudaGetLastError();
}

TEST_CASE("a child forked after the runtime started gets cudaErrorInitializationError") {
  ScopedStream stream;  // workers are running
  SIM_REQUIRE(cudaStreamSynchronize(stream));
  std::fflush(nullptr);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    int count = 0;
    void* pointer = nullptr;
    const bool refused = cudaGetDeviceCount(&count) == cudaErrorInitializationError &&
                         cudaMalloc(&pointer, 16) == cudaErrorInitializationError &&
                         cudaStreamSynchronize(nullptr) == cudaErrorInitializationError &&
                         cudaGetLastError() == cudaErrorInitializationError;
    _exit(refused ? 0 : 1);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("a process exec-ed after fork starts a fresh runtime") {
  char path[] = "/tmp/cuda_sim_exec_XXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  close(fd);
  std::fflush(nullptr);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    setenv("CUDA_SIM_TEST_EXEC_CHILD", path, 1);
    execl("/proc/self/exe", "/proc/self/exe", "--test-case=*exec-ed child's runtime*",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  std::ifstream result(path);
  std::string line;
  std::getline(result, line);
  CHECK(line == "ok");
  std::remove(path);
}

TEST_CASE("the exec-ed child's runtime works" *
          doctest::skip(std::getenv("CUDA_SIM_TEST_EXEC_CHILD") == nullptr)) {
  void* pointer = nullptr;
  SIM_REQUIRE(cudaMalloc(&pointer, 64));
  SIM_REQUIRE(cudaMemset(pointer, 0, 64));
  SIM_REQUIRE(cudaDeviceSynchronize());
  SIM_REQUIRE(cudaFree(pointer));
  std::ofstream(std::getenv("CUDA_SIM_TEST_EXEC_CHILD")) << "ok\n";
}

TEST_CASE("CUDA_VISIBLE_DEVICES picks and orders the devices, up to its first invalid entry" *
          doctest::skip(std::getenv("CUDA_SIM_TEST_VISIBLE") == nullptr)) {
  // Run by CTest with TANDEM_CUDA_SIM_DEVICES=4 CUDA_VISIBLE_DEVICES=2,0,7,1.
  int count = 0;
  SIM_REQUIRE(cudaGetDeviceCount(&count));
  CHECK(count == 2);  // 7 is not a device: the list ends there
  cudaDeviceProp first{}, second{};
  SIM_REQUIRE(cudaGetDeviceProperties(&first, 0));
  SIM_REQUIRE(cudaGetDeviceProperties(&second, 1));
  CHECK(static_cast<int>(first.uuid.bytes[15]) == 2);
  CHECK(static_cast<int>(second.uuid.bytes[15]) == 0);
  CHECK(std::string(first.name).find("device 2") != std::string::npos);
}

TEST_CASE("peer access and device flags") {
  int can = -1;
  SIM_REQUIRE(cudaDeviceCanAccessPeer(&can, 0, 1));
  CHECK(can == 1);
  SIM_REQUIRE(cudaDeviceCanAccessPeer(&can, 1, 1));
  CHECK(can == 0);
  SIM_REQUIRE(cudaDeviceEnablePeerAccess(1, 0));
  CHECK(cudaDeviceEnablePeerAccess(1, 0) == cudaErrorPeerAccessAlreadyEnabled);
  CHECK(cudaDeviceEnablePeerAccess(0, 0) == cudaErrorInvalidDevice);  // itself
  SIM_REQUIRE(cudaDeviceDisablePeerAccess(1));
  CHECK(cudaDeviceDisablePeerAccess(1) == cudaErrorPeerAccessNotEnabled);
  SIM_REQUIRE(cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync));
  unsigned flags = 0;
  SIM_REQUIRE(cudaGetDeviceFlags(&flags));
  CHECK((flags & cudaDeviceScheduleMask) == cudaDeviceScheduleBlockingSync);
  CHECK(cudaSetDeviceFlags(0x100) == cudaErrorInvalidValue);
  SIM_REQUIRE(cudaSetDeviceFlags(cudaDeviceScheduleAuto));
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusActive;
  SIM_REQUIRE(cudaStreamIsCapturing(cudaStreamLegacy, &capture));
  CHECK(capture == cudaStreamCaptureStatusNone);
  (void)cudaGetLastError();
}
