// The CUDA execution space on a GPU: cuda_exec's kernels and CUB reductions for every element type
// against host_exec running the same functors; streams and events; pinned and device Buffers;
// synchronous and stream-ordered copies between every pair of spaces; device selection (with
// CUDA_VISIBLE_DEVICES as tandemrun --devices sets it, checked in child processes).
// The host-side checks (test suite "host") run everywhere; without a GPU the rest is skipped:
// the program prints "SKIPPED: no CUDA device ..." and exits 77. Its own main, hence NO_MAIN.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/core/world.hpp"
#include "tandem/cuda.hpp"
#include "tandem/tensor/tensor.hpp"

namespace {

using tandem::Buffer;
using tandem::cuda_exec;
using tandem::device;
using tandem::host;
using tandem::pinned;
using tandem::View;

// CUDA's headers declare a global `half` (and `nv_bfloat16`): name tandem's in full.
using tandem_half = tandem::half;
using tandem_bfloat16 = tandem::bfloat16;

static_assert(tandem::Executor<cuda_exec>);
static_assert(tandem::ExecutorFor<cuda_exec, device>);
static_assert(!tandem::ExecutorFor<cuda_exec, host>);
static_assert(!tandem::ExecutorFor<cuda_exec, pinned>);
static_assert(std::same_as<tandem::default_executor_t<device>, cuda_exec>);
static_assert(std::same_as<tandem::default_executor_t<pinned>, tandem::host_exec>);
static_assert(tandem::TensorIn<Buffer<float, device>, device>);
static_assert(tandem::TensorIn<Buffer<tandem_half, pinned>, pinned>);
static_assert(std::is_constructible_v<Buffer<float, device>, std::size_t, cuda_exec>);
static_assert(!std::is_constructible_v<Buffer<float, device>, std::size_t, tandem::host_exec>);
static_assert(!std::is_constructible_v<Buffer<float, host>, std::size_t, cuda_exec>);

// --- functors, written once for host_exec and cuda_exec ----------------------------------------

/// The type arithmetic on T happens in (and sums accumulate in).
template <class T>
using wide_t = std::conditional_t<std::is_same_v<T, double>, double,
                                  std::conditional_t<std::is_integral_v<T>, std::int64_t, float>>;

template <class T>
TANDEM_HD wide_t<T> widen(T value) {
  return static_cast<wide_t<T>>(value);
}

/// Small whole numbers: exact in every element type, and sums of up to 2^21 of them stay below
/// 2^24, so float sums are exact in any order (CUB's tree and the host's loop agree bit for bit).
template <class T>
T sample(std::size_t i, std::size_t salt) {
  return static_cast<T>(static_cast<wide_t<T>>((i * 5 + salt) % 8));
}

/// y[i] += 2 x[i]: reads and writes y, so an index visited twice or never shows.
template <class T>
struct AddTwice {
  const T* x;
  T* y;
  TANDEM_HD void operator()(std::size_t i) const {
    y[i] = static_cast<T>(widen(y[i]) + 2 * widen(x[i]));
  }
};

template <class T>
struct Widened {
  const T* x;
  TANDEM_HD wide_t<T> operator()(std::size_t i) const { return widen(x[i]); }
};

template <class T>
struct Element {
  const T* x;
  TANDEM_HD T operator()(std::size_t i) const { return x[i]; }
};

template <class T>
struct Iota {
  T* out;
  T offset;
  TANDEM_HD void operator()(std::size_t i) const { out[i] = static_cast<T>(i) + offset; }
};

template <class T>
struct Fill {
  T* out;
  T value;
  TANDEM_HD void operator()(std::size_t i) const { out[i] = value; }
};

/// Adds one after a dependent busy loop, so that a consumer that does not wait would see old data.
/// (The loop's result decides nothing in practice, but the compiler cannot know that.) On the
/// simulated runtime, where one host thread runs every index in turn, a hundredth of the loop
/// already keeps the stream busy for a while.
struct SlowIncrement {
  int* data;
  TANDEM_HD void operator()(std::size_t i) const {
#if defined(__CUDA_ARCH__)
    constexpr int rounds = 20000;
#else
    constexpr int rounds = 200;
#endif
    unsigned spin = static_cast<unsigned>(i);
    for (int k = 0; k < rounds; ++k) spin = spin * 1664525u + 1013904223u;
    data[i] += (spin == 12345u && data[i] == -1000000) ? 2 : 1;
  }
};

/// Must never run: used where n == 0.
struct Never {
  int* p;
  TANDEM_HD void operator()(std::size_t i) const { p[i] = 1; }
};

struct ThreeIPlusOne {
  int* out;
  TANDEM_HD void operator()(std::size_t i) const { out[i] = static_cast<int>(3 * i + 1); }
};

// --- helpers that read device memory without the code under test -------------------------------

void raw_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) FAIL(what << ": " << cudaGetErrorString(status));
}

template <class T>
std::vector<T> read_device(const T* data, std::size_t count) {
  std::vector<T> result(count);
  if (count != 0) {
    raw_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    raw_check(cudaMemcpy(result.data(), data, count * sizeof(T), cudaMemcpyDeviceToHost),
              "cudaMemcpy to host");
  }
  return result;
}

template <class T>
void write_device(T* data, const std::vector<T>& values) {
  if (values.empty()) return;
  raw_check(cudaMemcpy(data, values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice),
            "cudaMemcpy to device");
  raw_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

/// Bit-for-bit equality, reporting the first difference.
template <class T>
void check_same_bits(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      FAIL(what << ": element " << i << " of " << got.size() << " differs: got "
                << static_cast<double>(widen(got[i])) << ", want "
                << static_cast<double>(widen(want[i])));
    }
  }
}

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

constexpr std::array<std::size_t, 4> sizes = {0, 1, 257, (std::size_t{1} << 20) + 3};

}  // namespace

// ================================================================================================
// Host side: runs with or without a GPU (nothing here reaches the device).
// ================================================================================================
TEST_SUITE("host") {
  TEST_CASE("n == 0 touches no device: no launch, and reductions return init") {
    tandem::for_each_index(cuda_exec{}, 0, Never{nullptr});
    CHECK(tandem::transform_reduce(cuda_exec{}, 0, 42, Element<int>{nullptr},
                                   tandem::plus_combine{}) == 42);
    CHECK(same_bits(tandem::transform_reduce(cuda_exec{}, 0, tandem_half(1.5f),
                                             Element<tandem_half>{nullptr}, tandem::max_combine{}),
                    tandem_half(1.5f)));
  }

  TEST_CASE("copies check sizes before touching memory, and empty copies do nothing") {
    std::vector<float> four(4);
    View<float, device> three(nullptr, 3);
    CHECK_THROWS_WITH_AS(tandem::copy(three, four),
                         "tandem: tandem::copy: the destination holds 3 elements, the source 4",
                         tandem::Error);
    CHECK_THROWS_AS(tandem::copy(four, View<const float, device>(nullptr, 3), cudaStream_t{}),
                    tandem::Error);
    CHECK_THROWS_AS(tandem::copy(three, four, cuda_exec{}), tandem::Error);
    tandem::copy(View<float, device>(nullptr, 0), std::vector<float>{});
    tandem::copy(std::vector<float>{}, View<const float, device>(nullptr, 0), cuda_exec{});
  }

  TEST_CASE("empty device and pinned Buffers allocate nothing") {
    Buffer<float, device> none(0);
    CHECK(none.data() == nullptr);
    CHECK(none.empty());
    Buffer<double, device> ordered(0, cuda_exec{});
    CHECK(ordered.data() == nullptr);
    Buffer<tandem_half, pinned> pinned_none(0);
    CHECK(pinned_none.data() == nullptr);
    Buffer<float, device> moved(std::move(none));
    CHECK(moved.data() == nullptr);
  }

  TEST_CASE("host-accessible space_copy pairs are plain copies") {
    std::vector<int> from{1, 2, 3}, to(3);
    tandem::space_copy<pinned, host>::copy(to.data(), from.data(), 3 * sizeof(int));
    CHECK(to == from);
  }
}

// ================================================================================================
// Device side: needs a GPU (skipped, exit 77, without one).
// ================================================================================================
TEST_SUITE("gpu") {
  TEST_CASE_TEMPLATE("cuda_exec runs element-wise functors exactly like host_exec", T, float,
                     double, tandem_half, tandem_bfloat16, std::int32_t, std::int64_t,
                     std::uint8_t) {
    for (std::size_t n : sizes) {
      CAPTURE(n);
      std::vector<T> x(n), y(n);
      for (std::size_t i = 0; i < n; ++i) {
        x[i] = sample<T>(i, 1);
        y[i] = sample<T>(i, 6);
      }
      Buffer<T, device> dx(n), dy(n);
      write_device(dx.data(), x);
      write_device(dy.data(), y);

      tandem::for_each_index(cuda_exec{}, n, AddTwice<T>{dx.data(), dy.data()});
      tandem::for_each_index(tandem::on_host, n, AddTwice<T>{x.data(), y.data()});
      check_same_bits(read_device(dy.data(), n), y, "y += 2x");
      check_same_bits(read_device(dx.data(), n), x, "x unchanged");
    }
  }

  TEST_CASE_TEMPLATE("cuda_exec reductions agree with host_exec", T, float, double, tandem_half,
                     tandem_bfloat16, std::int32_t, std::int64_t, std::uint8_t) {
    using W = wide_t<T>;
    tandem::cuda::Stream stream;
    const cuda_exec on_stream{stream};
    for (std::size_t n : sizes) {
      CAPTURE(n);
      std::vector<T> x(n);
      for (std::size_t i = 0; i < n; ++i) x[i] = sample<T>(i, 3);
      Buffer<T, device> dx(n);
      write_device(dx.data(), x);

      // Sums in the wide type, from a non-zero init (init is combined exactly once).
      const W host_sum = tandem::transform_reduce(tandem::on_host, n, W(5), Widened<T>{x.data()},
                                                  tandem::plus_combine{});
      const W device_sum = tandem::transform_reduce(cuda_exec{}, n, W(5), Widened<T>{dx.data()},
                                                    tandem::plus_combine{});
      CHECK(same_bits(device_sum, host_sum));

      // Max in T itself: CUB accumulating half and bfloat16.
      const T host_max = tandem::transform_reduce(tandem::on_host, n, T(0.0f), Element<T>{x.data()},
                                                  tandem::max_combine{});
      const T device_max = tandem::transform_reduce(on_stream, n, T(0.0f), Element<T>{dx.data()},
                                                    tandem::max_combine{});
      CHECK(same_bits(device_max, host_max));

      // Into device memory on a non-blocking stream, without waiting; n == 0 stores init.
      Buffer<T, device> minimum(1, on_stream);
      Buffer<W, device> sum(1, on_stream);
      tandem::transform_reduce_into(on_stream, minimum.data(), n, T(100.0f), Element<T>{dx.data()},
                                    tandem::min_combine{});
      tandem::transform_reduce_into(on_stream, sum.data(), n, W(0), Widened<T>{dx.data()},
                                    tandem::plus_combine{});
      stream.synchronize();
      const T host_min = tandem::transform_reduce(tandem::on_host, n, T(100.0f),
                                                  Element<T>{x.data()}, tandem::min_combine{});
      CHECK(same_bits(read_device(minimum.data(), 1)[0], host_min));
      CHECK(same_bits(read_device(sum.data(), 1)[0], static_cast<W>(host_sum - W(5))));
    }
  }

  TEST_CASE("work queued on one stream runs in order without host waits") {
    tandem::cuda::Stream stream;
    const cuda_exec exec{stream};
    const std::size_t n = 100003;
    Buffer<int, device> values(n, exec);  // ordered on the stream: usable there at once
    CHECK(values.allocation().stream == static_cast<void*>(stream.get()));
    Buffer<int, pinned> staging(n);
    for (std::size_t i = 0; i < n; ++i) staging[i] = static_cast<int>(i);
    tandem::copy(values, staging, exec);
    tandem::for_each_index(exec, n, SlowIncrement{values.data()});
    tandem::copy(staging, values, stream.get());
    const long long total =
        tandem::transform_reduce(exec, n, 0LL, Widened<int>{values.data()}, tandem::plus_combine{});
    CHECK(total == static_cast<long long>(n) * static_cast<long long>(n + 1) / 2);
    for (std::size_t i = 0; i < n; i += 997) CHECK(staging[i] == static_cast<int>(i) + 1);
  }

  TEST_CASE("an Event hands a buffer from one stream to another") {
    tandem::cuda::Stream producer, consumer;
    const std::size_t n = 1 << 16;
    Buffer<int, device> values(n);  // Buffer(n): usable on every stream once constructed
    tandem::cuda::Event ready;
    tandem::for_each_index(cuda_exec{producer}, n, Fill<int>{values.data(), 1});
    tandem::for_each_index(cuda_exec{producer}, n, SlowIncrement{values.data()});
    ready.record(producer);
    consumer.wait(ready);
    const long long total = tandem::transform_reduce(
        cuda_exec{consumer}, n, 0LL, Widened<int>{values.data()}, tandem::plus_combine{});
    CHECK(total == 2LL * static_cast<long long>(n));
    CHECK(ready.query());
    producer.synchronize();
    CHECK(producer.query());
  }

  TEST_CASE("Stream and Event own their handles and time work") {
    tandem::cuda::Stream first;
    cudaStream_t handle = first.get();
    CHECK(handle != nullptr);
    tandem::cuda::Stream second(std::move(first));
    CHECK(first.get() == nullptr);
    CHECK(second.get() == handle);
    unsigned flags = 0;
    raw_check(cudaStreamGetFlags(second, &flags), "cudaStreamGetFlags");
    CHECK(flags == cudaStreamNonBlocking);

    tandem::cuda::Event start(tandem::cuda::Event::timing::on);
    tandem::cuda::Event stop(tandem::cuda::Event::timing::on);
    Buffer<int, device> values(4096, cuda_exec{second});
    start.record(second);
    tandem::for_each_index(cuda_exec{second}, values.size(), Fill<int>{values.data(), 3});
    stop.record(second);
    stop.synchronize();
    CHECK(stop.query());
    CHECK(stop.elapsed_ms_since(start) >= 0.0f);
    second.synchronize();

    // An Event without timing cannot be timed: that is an Error, not a garbage number.
    tandem::cuda::Event untimed;
    untimed.record(second);
    untimed.synchronize();
    CHECK_THROWS_AS((void)untimed.elapsed_ms_since(start), tandem::Error);
  }

  TEST_CASE("device and pinned Buffers: allocation, where it is ordered, moves, errors") {
    const int current = tandem::cuda::current_device();
    Buffer<float, device> plain(1000);
    CHECK(plain.data() != nullptr);
    CHECK(plain.allocation().stream == static_cast<void*>(cudaStreamLegacy));
    CHECK(plain.allocation().device == current);
    cudaPointerAttributes attributes{};
    raw_check(cudaPointerGetAttributes(&attributes, plain.data()), "cudaPointerGetAttributes");
    CHECK(attributes.type == cudaMemoryTypeDevice);
    CHECK(attributes.device == current);

    Buffer<float, device> per_thread(1000, cuda_exec{});  // freed on the legacy stream
    CHECK(per_thread.allocation().stream == static_cast<void*>(cudaStreamLegacy));
    tandem::for_each_index(cuda_exec{}, per_thread.size(), Iota<float>{per_thread.data(), 1.0f});
    Buffer<float, device> moved(std::move(per_thread));
    CHECK(per_thread.data() == nullptr);
    CHECK(read_device(moved.data(), 3) == std::vector<float>{1.0f, 2.0f, 3.0f});
    plain = std::move(moved);
    CHECK(read_device(plain.data(), 1)[0] == 1.0f);

    Buffer<double, pinned> staging(tandem::Shape{10, 10});
    raw_check(cudaPointerGetAttributes(&attributes, staging.data()), "cudaPointerGetAttributes");
    CHECK(attributes.type == cudaMemoryTypeHost);
    for (std::size_t i = 0; i < staging.size(); ++i) staging[i] = static_cast<double>(i);
    CHECK(staging.view().shape() == tandem::Shape{10, 10});
    CHECK(staging[99] == 99.0);

    // Far more than any GPU has: a tandem::Error naming the size, and later launches unaffected.
    const std::size_t too_many = std::size_t{1} << 45;
    const std::string too_many_bytes = std::to_string(too_many * sizeof(float)) + " bytes";
    const auto allocate_too_much = [&] { Buffer<float, device> huge(too_many); };
    CHECK_THROWS_WITH_AS(allocate_too_much(), doctest::Contains(too_many_bytes.c_str()),
                         tandem::Error);
    Buffer<int, device> after(8);
    tandem::for_each_index(cuda_exec{}, after.size(), Fill<int>{after.data(), 7});
    CHECK(read_device(after.data(), 8) == std::vector<int>(8, 7));
  }
}

namespace {

/// A Buffer in any space filled with 3 i + 1 (device memory by a kernel, not by tandem::copy).
template <class Space>
Buffer<int, Space> filled(std::size_t n) {
  Buffer<int, Space> buffer(n);
  if constexpr (tandem::host_accessible<Space>) {
    for (std::size_t i = 0; i < n; ++i) buffer[i] = static_cast<int>(3 * i + 1);
  } else {
    // Per-thread default stream, no wait: synchronous copies must still see it.
    tandem::for_each_index(cuda_exec{}, n, ThreeIPlusOne{buffer.data()});
  }
  return buffer;
}

template <class Space>
std::vector<int> contents(const Buffer<int, Space>& buffer) {
  if constexpr (tandem::host_accessible<Space>) {
    return std::vector<int>(buffer.begin(), buffer.end());
  } else {
    return read_device(buffer.data(), buffer.size());
  }
}

template <class To, class From>
void check_copies(tandem::cuda::Stream& stream) {
  CAPTURE(To::name);
  CAPTURE(From::name);
  const std::size_t n = 12345;
  std::vector<int> want(n);
  for (std::size_t i = 0; i < n; ++i) want[i] = static_cast<int>(3 * i + 1);

  {  // synchronous: in place on return, after the filling kernel without any explicit wait
    Buffer<int, From> source = filled<From>(n);
    Buffer<int, To> destination(n);
    tandem::copy(destination, source);
    CHECK(contents(destination) == want);
  }
  {  // on a stream: the filling kernel is on the per-thread stream, so join it first
    Buffer<int, From> source = filled<From>(n);
    cuda_exec{}.synchronize();
    Buffer<int, To> destination(n);
    tandem::copy(destination.view(), std::as_const(source).view(), stream.get());
    stream.synchronize();
    CHECK(contents(destination) == want);
  }
  {  // the staging hook the CPU communicators use: raw bytes, synchronous
    Buffer<int, From> source = filled<From>(n);
    Buffer<int, To> destination(n);
    tandem::space_copy<To, From>::copy(destination.data(), source.data(), n * sizeof(int));
    CHECK(contents(destination) == want);
  }
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("copies between every pair of host, pinned and device memory") {
    tandem::cuda::Stream stream;
    check_copies<host, host>(stream);
    check_copies<host, pinned>(stream);
    check_copies<host, device>(stream);
    check_copies<pinned, host>(stream);
    check_copies<pinned, pinned>(stream);
    check_copies<pinned, device>(stream);
    check_copies<device, host>(stream);
    check_copies<device, pinned>(stream);
    check_copies<device, device>(stream);
  }

  TEST_CASE("copies take any tensors: vectors, views, subviews") {
    std::vector<float> values(100);
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i);
    Buffer<float, device> on_device(100);
    tandem::copy(on_device, values);
    std::vector<float> back(50);
    tandem::copy(back, std::as_const(on_device).view().subview(50, 50));
    CHECK(back[0] == 50.0f);
    CHECK(back[49] == 99.0f);
    tandem::cuda::Stream stream;
    std::vector<float> again(100);
    tandem::copy(again, on_device, cuda_exec{stream});
    stream.synchronize();
    CHECK(again == values);
  }

  TEST_CASE("select_device: local rank modulo the visible devices, and the pool keeps memory") {
    const int visible = tandem::cuda::device_count();
    for (int local_rank = 0; local_rank < 2 * visible + 1; ++local_rank) {
      tandem::World world{local_rank, 2 * visible + 1, local_rank, 2 * visible + 1, 0, 1};
      CHECK(tandem::cuda::select_device(world) == local_rank % visible);
      CHECK(tandem::cuda::current_device() == local_rank % visible);
      cudaMemPool_t pool = nullptr;
      raw_check(cudaDeviceGetDefaultMemPool(&pool, local_rank % visible), "default pool");
      std::uint64_t threshold = 0;
      raw_check(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
                "cudaMemPoolGetAttribute");
      CHECK(threshold == UINT64_MAX);
    }
    raw_check(cudaSetDevice(0), "cudaSetDevice");
  }

  TEST_CASE("select_device under tandemrun --devices: each process sees one GPU, its own") {
    // tandemrun --devices 2,3,5 gives local rank i CUDA_VISIBLE_DEVICES=<i-th entry>. Here local
    // rank d gets the d-th device this process sees, in a child process (visibility is fixed when
    // CUDA starts). Entries are named as this process's own CUDA_VISIBLE_DEVICES names them, so
    // the test also holds when it runs restricted to some GPUs.
    const int visible = tandem::cuda::device_count();
    std::vector<std::string> entries;
    if (const char* inherited = std::getenv("CUDA_VISIBLE_DEVICES")) {
      std::string list = inherited;
      for (std::size_t start = 0; start <= list.size();) {
        const std::size_t comma = std::min(list.find(',', start), list.size());
        entries.push_back(list.substr(start, comma - start));
        start = comma + 1;
      }
    }
    const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
    for (int d = 0; d < visible; ++d) {
      CAPTURE(d);
      const std::string entry =
          std::getenv("CUDA_VISIBLE_DEVICES") ? entries.at(d) : std::to_string(d);
      cudaDeviceProp properties{};
      raw_check(cudaGetDeviceProperties(&properties, d), "cudaGetDeviceProperties");
      std::string want = "0 ";
      for (int b = 0; b < 16; ++b) {
        char hex[3];
        std::snprintf(hex, sizeof hex, "%02x",
                      static_cast<unsigned char>(properties.uuid.bytes[b]));
        want += hex;
      }
      const std::string command =
          "CUDA_VISIBLE_DEVICES='" + entry + "' RANK=" + std::to_string(d) +
          " WORLD_SIZE=" + std::to_string(visible) + " LOCAL_RANK=" + std::to_string(d) +
          " LOCAL_WORLD_SIZE=" + std::to_string(visible) + " '" + self + "' --select-device-child";
      FILE* child = popen(command.c_str(), "r");
      REQUIRE(child != nullptr);
      char line[256] = {};
      const bool read = std::fgets(line, sizeof line, child) != nullptr;
      const int status = pclose(child);
      REQUIRE(read);
      CHECK(status == 0);
      CHECK(std::string(line) == want + "\n");
    }
  }
}

namespace {

/// The child of the test above: selects its device from the environment, prints its index and
/// UUID.
int select_device_child() {
  try {
    const int device = tandem::cuda::select_device(tandem::World::from_env());
    cudaDeviceProp properties{};
    if (cudaGetDeviceProperties(&properties, device) != cudaSuccess) return 2;
    std::printf("%d ", device);
    for (int b = 0; b < 16; ++b) {
      std::printf("%02x", static_cast<unsigned char>(properties.uuid.bytes[b]));
    }
    std::printf("\n");
    return 0;
  } catch (const std::exception& error) {
    std::printf("error: %s\n", error.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "--select-device-child") == 0) {
    return select_device_child();
  }
  doctest::Context context(argc, argv);
  const int devices = tandem::cuda::device_count();
  if (devices == 0) context.setOption("test-suite", "host");
  const int failed = context.run();
  if (context.shouldExit() || failed != 0) return failed;
  if (devices == 0) {
    std::printf(
        "SKIPPED: no CUDA device (cudaGetDeviceCount found none); the host-side checks passed, "
        "the kernel, stream, memory, copy and device-selection checks need a GPU\n");
    return 77;
  }
  return 0;
}
