// Device and pinned memory, copies and memsets against CUDA's "API synchronization behavior",
// stream-ordered allocation, pointer attributes and memory pools.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "sim_test.hpp"

using sim_test::Gate;
using sim_test::launch;
using sim_test::ScopedStream;

namespace {

/// Device memory for `count` ints on the current device, freed with the test.
class DeviceInts {
 public:
  explicit DeviceInts(std::size_t count) : count_(count) {
    SIM_REQUIRE(cudaMalloc(reinterpret_cast<void**>(&data_), count * sizeof(int)));
  }
  DeviceInts(const DeviceInts&) = delete;
  DeviceInts& operator=(const DeviceInts&) = delete;
  ~DeviceInts() { (void)cudaFree(data_); }
  [[nodiscard]] int* data() const { return data_; }
  [[nodiscard]] std::size_t bytes() const { return count_ * sizeof(int); }

 private:
  std::size_t count_;
  int* data_ = nullptr;
};

/// Pinned memory for `count` ints, freed with the test.
class PinnedInts {
 public:
  explicit PinnedInts(std::size_t count) {
    SIM_REQUIRE(cudaMallocHost(reinterpret_cast<void**>(&data_), count * sizeof(int)));
  }
  PinnedInts(const PinnedInts&) = delete;
  PinnedInts& operator=(const PinnedInts&) = delete;
  ~PinnedInts() { (void)cudaFreeHost(data_); }
  [[nodiscard]] int* data() const { return data_; }

 private:
  int* data_ = nullptr;
};

std::vector<int> read_back(const int* device, std::size_t count) {
  std::vector<int> host(count);
  SIM_REQUIRE(cudaMemcpy(host.data(), device, count * sizeof(int), cudaMemcpyDeviceToHost));
  return host;
}

}  // namespace

TEST_CASE("device memory: new memory reads as NaN, copies round-trip, usage is counted") {
  const std::size_t before = cuda_sim_device_bytes_outstanding(0);
  float* device = nullptr;
  SIM_REQUIRE(cudaMalloc(reinterpret_cast<void**>(&device), 64 * sizeof(float)));
  CHECK(reinterpret_cast<std::uintptr_t>(device) % 256 == 0);
  CHECK(cuda_sim_device_bytes_outstanding(0) == before + 64 * sizeof(float));
  std::vector<float> host(64, 1.0f);
  SIM_REQUIRE(cudaMemcpy(host.data(), device, 64 * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK(std::isnan(host[0]));
  CHECK(std::isnan(host[63]));
  std::vector<float> values(64);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i);
  SIM_REQUIRE(cudaMemcpy(device, values.data(), 64 * sizeof(float), cudaMemcpyDefault));
  SIM_REQUIRE(cudaMemcpy(host.data(), device, 64 * sizeof(float), cudaMemcpyDefault));
  CHECK(host == values);
  SIM_REQUIRE(cudaFree(device));
  CHECK(cuda_sim_device_bytes_outstanding(0) == before);
  CHECK(cudaFree(device) == cudaErrorInvalidValue);  // twice
  SIM_REQUIRE(cudaFree(nullptr));
  (void)cudaGetLastError();
}

TEST_CASE("more device memory than the device has is cudaErrorMemoryAllocation") {
  void* pointer = reinterpret_cast<void*>(1);
  CHECK(cudaMalloc(&pointer, std::size_t{1} << 47) == cudaErrorMemoryAllocation);
  CHECK(pointer == nullptr);
  CHECK(cudaGetLastError() == cudaErrorMemoryAllocation);
  CHECK(cudaGetLastError() == cudaSuccess);
  size_t free = 0, total = 0;
  SIM_REQUIRE(cudaMemGetInfo(&free, &total));
  CHECK(free <= total);
}

TEST_CASE("cudaMemcpyAsync from pageable memory stages it before returning") {
  ScopedStream stream;
  DeviceInts device(256);
  Gate gate;
  gate.hold(stream);
  std::vector<int> source(256, 1);
  SIM_REQUIRE(cudaMemcpyAsync(device.data(), source.data(), device.bytes(), cudaMemcpyHostToDevice,
                              stream));
  std::fill(source.begin(), source.end(), 2);  // the copy has not run: it must use the staged 1s
  gate.open();
  SIM_REQUIRE(cudaStreamSynchronize(stream));
  CHECK(read_back(device.data(), 256) == std::vector<int>(256, 1));
}

TEST_CASE("cudaMemcpyAsync to pageable memory returns once the copy is complete") {
  ScopedStream stream;
  DeviceInts device(128);
  auto fill = [&] { std::fill(device.data(), device.data() + 128, 5); };
  launch(stream, fill);  // "kernel" writing device memory
  std::vector<int> host(128, 0);
  SIM_REQUIRE(
      cudaMemcpyAsync(host.data(), device.data(), device.bytes(), cudaMemcpyDeviceToHost, stream));
  CHECK(host == std::vector<int>(128, 5));  // no synchronisation needed (nor reported racy)
}

TEST_CASE("cudaMemcpyAsync with pinned memory is fully asynchronous") {
  ScopedStream stream;
  DeviceInts device(64);
  PinnedInts pinned(64);
  std::fill(pinned.data(), pinned.data() + 64, 3);
  Gate gate;
  gate.hold(stream);
  SIM_REQUIRE(
      cudaMemcpyAsync(device.data(), pinned.data(), device.bytes(), cudaMemcpyDefault, stream));
  std::fill(pinned.data(), pinned.data() + 64, 4);  // before the copy runs: it reads these
  gate.open();  // (a release: the writes above are ordered before the copy)
  SIM_REQUIRE(cudaStreamSynchronize(stream));
  CHECK(read_back(device.data(), 64) == std::vector<int>(64, 4));

  std::fill(pinned.data(), pinned.data() + 64, 8);
  Gate second;
  second.hold(stream);
  SIM_REQUIRE(cudaMemcpyAsync(pinned.data(), device.data(), device.bytes(), cudaMemcpyDeviceToHost,
                              stream));
  CHECK(pinned.data()[0] == 8);  // returned while the stream is held: not copied yet
  second.open();
  SIM_REQUIRE(cudaStreamSynchronize(stream));
  CHECK(pinned.data()[0] == 4);
}

TEST_CASE("cudaMemcpy: device to device does not wait; to the host it returns complete") {
  DeviceInts first(32), second(32);
  std::vector<int> values(32, 9);
  SIM_REQUIRE(cudaMemcpy(first.data(), values.data(), first.bytes(), cudaMemcpyHostToDevice));
  Gate gate;
  gate.hold(cudaStreamLegacy);
  SIM_REQUIRE(cudaMemcpy(second.data(), first.data(), first.bytes(), cudaMemcpyDeviceToDevice));
  SIM_REQUIRE(cudaMemset(first.data(), 0, first.bytes()));  // into device memory: asynchronous
  CHECK(cudaStreamQuery(cudaStreamLegacy) == cudaErrorNotReady);  // both calls returned held
  gate.open();
  CHECK(read_back(second.data(), 32) == values);  // returns complete
  CHECK(read_back(first.data(), 32) == std::vector<int>(32, 0));
}

TEST_CASE("cudaMemset into pinned memory is synchronous; into pageable memory an error") {
  PinnedInts pinned(16);
  SIM_REQUIRE(cudaMemset(pinned.data(), 0, 16 * sizeof(int)));
  CHECK(pinned.data()[15] == 0);  // complete on return, without synchronising
  std::vector<int> pageable(16);
  CHECK(cudaMemset(pageable.data(), 0, 16 * sizeof(int)) == cudaErrorInvalidValue);
  ScopedStream stream;
  DeviceInts device(16);
  SIM_REQUIRE(cudaMemsetAsync(device.data(), 0x01, device.bytes(), stream));
  SIM_REQUIRE(cudaStreamSynchronize(stream));
  CHECK(read_back(device.data(), 16) == std::vector<int>(16, 0x01010101));
  (void)cudaGetLastError();
}

TEST_CASE("copies check their direction, their range and their arguments") {
  DeviceInts device(8);
  std::vector<int> host(8), other(8);
  CHECK(cudaMemcpy(other.data(), host.data(), 32, cudaMemcpyHostToDevice) ==
        cudaErrorInvalidValue);  // the destination is not device memory
  CHECK(cudaMemcpy(host.data(), device.data(), 32, cudaMemcpyHostToDevice) ==
        cudaErrorInvalidValue);  // the source is device memory
  CHECK(cudaMemcpy(device.data(), host.data(), 64, cudaMemcpyHostToDevice) ==
        cudaErrorInvalidValue);  // past the allocation's end
  CHECK(cudaMemcpy(device.data(), host.data(), 32, static_cast<cudaMemcpyKind>(7)) ==
        cudaErrorInvalidMemcpyDirection);
  CHECK(cudaMemcpy(nullptr, host.data(), 32, cudaMemcpyDefault) == cudaErrorInvalidValue);
  SIM_REQUIRE(cudaMemcpy(nullptr, nullptr, 0, cudaMemcpyDefault));  // nothing to copy
  SIM_REQUIRE(cudaMemcpy(other.data(), host.data(), 32, cudaMemcpyHostToHost));
  (void)cudaGetLastError();
}

TEST_CASE("stream-ordered allocation: poisoned in order, freed when the stream gets there") {
  ScopedStream stream;
  const std::size_t before = cuda_sim_device_bytes_outstanding(0);
  float* data = nullptr;
  SIM_REQUIRE(cudaMallocAsync(reinterpret_cast<void**>(&data), 1024, stream));
  float first = 0;
  SIM_REQUIRE(cudaMemcpyAsync(&first, data, sizeof first, cudaMemcpyDeviceToHost, stream));
  CHECK(std::isnan(first));
  cudaMemPool_t pool = nullptr;
  SIM_REQUIRE(cudaDeviceGetDefaultMemPool(&pool, 0));
  std::uint64_t used = 0;
  SIM_REQUIRE(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
  CHECK(used >= 1024);
  Gate gate;
  gate.hold(stream);
  SIM_REQUIRE(cudaFreeAsync(data, stream));
  CHECK(cuda_sim_device_bytes_outstanding(0) == before + 1024);  // the stream has not got there
  gate.open();
  SIM_REQUIRE(cudaStreamSynchronize(stream));
  CHECK(cuda_sim_device_bytes_outstanding(0) == before);
  CHECK(cudaFreeAsync(data, stream) == cudaErrorInvalidValue);  // already freed
  (void)cudaGetLastError();
}

TEST_CASE("the default memory pool keeps its attributes") {
  cudaMemPool_t pool = nullptr;
  SIM_REQUIRE(cudaDeviceGetDefaultMemPool(&pool, 0));
  std::uint64_t threshold = UINT64_MAX;
  SIM_REQUIRE(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  std::uint64_t read = 0;
  SIM_REQUIRE(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &read));
  CHECK(read == UINT64_MAX);
  std::uint64_t used = 5;
  CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used) ==
        cudaErrorInvalidValue);  // read-only
  CHECK(cudaDeviceGetDefaultMemPool(&pool, 999) == cudaErrorInvalidDevice);
  int supported = 0;
  SIM_REQUIRE(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, 0));
  CHECK(supported == 1);
  (void)cudaGetLastError();
}

TEST_CASE("cudaPointerGetAttributes: device, pinned, registered and unregistered memory") {
  SIM_REQUIRE(cudaSetDevice(2));
  DeviceInts device(16);
  PinnedInts pinned(16);
  SIM_REQUIRE(cudaSetDevice(0));
  cudaPointerAttributes attributes{};
  SIM_REQUIRE(cudaPointerGetAttributes(&attributes, device.data() + 3));
  CHECK(attributes.type == cudaMemoryTypeDevice);
  CHECK(attributes.device == 2);
  CHECK(attributes.devicePointer == device.data() + 3);
  CHECK(attributes.hostPointer == nullptr);
  SIM_REQUIRE(cudaPointerGetAttributes(&attributes, pinned.data()));
  CHECK(attributes.type == cudaMemoryTypeHost);
  CHECK(attributes.device == 2);  // current when it was pinned
  CHECK(attributes.hostPointer == pinned.data());
  CHECK(attributes.devicePointer == pinned.data());
  int local = 0;
  SIM_REQUIRE(cudaPointerGetAttributes(&attributes, &local));
  CHECK(attributes.type == cudaMemoryTypeUnregistered);
  CHECK(attributes.device == cudaInvalidDeviceId);
  CHECK(attributes.devicePointer == nullptr);
  SIM_REQUIRE(cudaPointerGetAttributes(&attributes, device.data() + 16));  // one past the end
  CHECK(attributes.type == cudaMemoryTypeUnregistered);
  std::vector<int> registered(64);
  SIM_REQUIRE(cudaHostRegister(registered.data(), registered.size() * sizeof(int), 0));
  SIM_REQUIRE(cudaPointerGetAttributes(&attributes, registered.data() + 10));
  CHECK(attributes.type == cudaMemoryTypeHost);
  CHECK(cudaHostRegister(registered.data() + 1, 4, 0) == cudaErrorHostMemoryAlreadyRegistered);
  void* mapped = nullptr;
  SIM_REQUIRE(cudaHostGetDevicePointer(&mapped, registered.data(), 0));
  CHECK(mapped == registered.data());
  SIM_REQUIRE(cudaHostUnregister(registered.data()));
  CHECK(cudaHostUnregister(registered.data()) == cudaErrorHostMemoryNotRegistered);
  CHECK(cudaHostGetDevicePointer(&mapped, &local, 0) == cudaErrorInvalidValue);
  CHECK(cudaPointerGetAttributes(nullptr, &local) == cudaErrorInvalidValue);
  (void)cudaGetLastError();
}

TEST_CASE("pinned memory: counted, freed only by cudaFreeHost") {
  const std::size_t before = cuda_sim_pinned_bytes_outstanding();
  void* pinned = nullptr;
  SIM_REQUIRE(cudaHostAlloc(&pinned, 100, cudaHostAllocPortable | cudaHostAllocMapped));
  CHECK(cuda_sim_pinned_bytes_outstanding() == before + 100);
  unsigned flags = 0;
  SIM_REQUIRE(cudaHostGetFlags(&flags, static_cast<char*>(pinned) + 10));
  CHECK(flags == (cudaHostAllocPortable | cudaHostAllocMapped));
  CHECK(cudaFree(pinned) == cudaErrorInvalidValue);
  CHECK(cudaHostAlloc(&pinned, 100, 0x80) == cudaErrorInvalidValue);
  SIM_REQUIRE(cudaFreeHost(pinned));
  CHECK(cuda_sim_pinned_bytes_outstanding() == before);
  CHECK(cudaFreeHost(pinned) == cudaErrorInvalidValue);
  (void)cudaGetLastError();
}

TEST_CASE("copies between devices, and on another device's stream") {
  REQUIRE(cuda_sim_device_count() >= 2);
  DeviceInts on_zero(16);
  SIM_REQUIRE(cudaSetDevice(1));
  int* on_one = nullptr;
  SIM_REQUIRE(cudaMalloc(reinterpret_cast<void**>(&on_one), 16 * sizeof(int)));
  SIM_REQUIRE(cudaSetDevice(0));
  const std::vector<int> values(16, 42);
  SIM_REQUIRE(cudaMemcpy(on_zero.data(), values.data(), on_zero.bytes(), cudaMemcpyDefault));
  SIM_REQUIRE(cudaMemcpyPeer(on_one, 1, on_zero.data(), 0, on_zero.bytes()));
  SIM_REQUIRE(cudaDeviceSynchronize());
  CHECK(read_back(on_one, 16) == values);
  CHECK(cudaMemcpyPeer(on_one, 99, on_zero.data(), 0, 4) == cudaErrorInvalidDevice);
  SIM_REQUIRE(cudaFree(on_one));
  (void)cudaGetLastError();
}
