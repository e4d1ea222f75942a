// tandem::half and tandem::bfloat16 under nvcc: bit-exact conversions to and from CUDA's __half and
// __nv_bfloat16 and agreement with CUDA's own rounding (host code: runs without a GPU), then the
// same conversions computed in a kernel compared with the host (skipped with exit code 77 when no
// GPU is present). Its own main, so that it can exit 77; a failed check exits 1. On the simulated
// CUDA runtime (cuda-sim) the host checks run, compiled by the host compiler against
// cuda_fp16.h's host conversions; the kernel is a GPU's alone.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

#include "tandem/cuda/exec.hpp"
#include "tandem/tensor/dtype.hpp"

namespace {

int failures = 0;

/// Records a failed check; prints the first few.
void check(bool ok, const char* what, std::uint32_t input, std::uint32_t got, std::uint32_t want) {
  if (ok) return;
  if (failures++ < 10) {
    std::printf("FAILED: %s: input 0x%08x gave 0x%08x, want 0x%08x\n", what, input, got, want);
  }
}

std::uint32_t float_bits(float value) {
  return tandem::detail::float_bits(value);
}
float bits_float(std::uint32_t bits) {
  return tandem::detail::bits_float(bits);
}

bool half_is_nan(std::uint16_t h) {
  return (h & 0x7fffu) > 0x7c00u;
}
bool bfloat16_is_nan(std::uint16_t b) {
  return (b & 0x7fffu) > 0x7f80u;
}

/// The floats to convert: every 4099th bit pattern, and every half and bfloat16 midpoint with its
/// neighbours (the values where rounding decides).
std::vector<std::uint32_t> sample_floats() {
  std::vector<std::uint32_t> values;
  for (std::uint64_t bits = 0; bits <= 0xffffffffu; bits += 4099) {
    values.push_back(static_cast<std::uint32_t>(bits));
  }
  for (std::uint32_t h = 0; h < 0x7c00u; ++h) {
    const double low = static_cast<float>(tandem::half::from_bits(static_cast<std::uint16_t>(h)));
    const double high =
        h + 1 == 0x7c00u
            ? 65536.0
            : static_cast<float>(tandem::half::from_bits(static_cast<std::uint16_t>(h + 1)));
    const std::uint32_t mid = float_bits(static_cast<float>((low + high) / 2));
    for (std::uint32_t bits : {mid - 1, mid, mid + 1}) {
      values.push_back(bits);
      values.push_back(bits | 0x80000000u);
    }
  }
  for (std::uint32_t b = 0; b < 0x7f80u; ++b) {  // bfloat16 midpoints: b << 16 | 0x8000
    const std::uint32_t mid = b << 16 | 0x8000u;
    for (std::uint32_t bits : {mid - 1, mid, mid + 1}) {
      values.push_back(bits);
      values.push_back(bits | 0x80000000u);
    }
  }
  return values;
}

void host_checks(const std::vector<std::uint32_t>& floats) {
  // Every 16-bit pattern: tandem <-> CUDA type conversions keep the bits, and widening to float
  // agrees with CUDA's (NaN: both NaN).
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const auto raw = static_cast<std::uint16_t>(bits);

    const tandem::half h = tandem::half::from_bits(raw);
    const auto cuda_h = static_cast<__half>(h);
    check(__half_as_ushort(cuda_h) == raw, "half -> __half", bits, __half_as_ushort(cuda_h), raw);
    const tandem::half back_h = __ushort_as_half(raw);
    check(back_h.bits == raw, "__half -> half", bits, back_h.bits, raw);
    const float hf = h;
    const float cuda_hf = __half2float(cuda_h);
    check(half_is_nan(raw) ? std::isnan(hf) && std::isnan(cuda_hf)
                           : float_bits(hf) == float_bits(cuda_hf),
          "half -> float vs __half2float", bits, float_bits(hf), float_bits(cuda_hf));

    const tandem::bfloat16 b = tandem::bfloat16::from_bits(raw);
    const auto cuda_b = static_cast<__nv_bfloat16>(b);
    check(__bfloat16_as_ushort(cuda_b) == raw, "bfloat16 -> __nv_bfloat16", bits,
          __bfloat16_as_ushort(cuda_b), raw);
    const tandem::bfloat16 back_b = __ushort_as_bfloat16(raw);
    check(back_b.bits == raw, "__nv_bfloat16 -> bfloat16", bits, back_b.bits, raw);
    const float bf = b;
    const float cuda_bf = __bfloat162float(cuda_b);
    check(bfloat16_is_nan(raw) ? std::isnan(bf) && std::isnan(cuda_bf)
                               : float_bits(bf) == float_bits(cuda_bf),
          "bfloat16 -> float vs __bfloat162float", bits, float_bits(bf), float_bits(cuda_bf));
  }

  // Narrowing: tandem's round-to-nearest-even agrees with CUDA's _rn conversions (NaN: both NaN).
  for (std::uint32_t bits : floats) {
    const float value = bits_float(bits);
    const std::uint16_t h = tandem::half(value).bits;
    const std::uint16_t cuda_h = __half_as_ushort(__float2half_rn(value));
    check(std::isnan(value) ? half_is_nan(h) && half_is_nan(cuda_h) : h == cuda_h,
          "float -> half vs __float2half_rn", bits, h, cuda_h);
    const std::uint16_t b = tandem::bfloat16(value).bits;
    const std::uint16_t cuda_b = __bfloat16_as_ushort(__float2bfloat16_rn(value));
    check(std::isnan(value) ? bfloat16_is_nan(b) && bfloat16_is_nan(cuda_b) : b == cuda_b,
          "float -> bfloat16 vs __float2bfloat16_rn", bits, b, cuda_b);
  }

  // Arithmetic and comparison on tandem types go through float under nvcc as under g++: these
  // expressions were ambiguous while the conversions to __half / __nv_bfloat16 were implicit.
  const tandem::half one(1.0f), three(3.0f);
  const tandem::bfloat16 two(2.0f), four(4.0f);
  check(one + three == 4.0f && three * one == 3.0f && one < three && one != three,
        "half arithmetic in float", 0, 0, 0);
  check(two + four == 6.0f && four / two == 2.0f && four > two && one + two == 3.0f,
        "bfloat16 arithmetic in float", 0, 0, 0);
  check(one == __float2half_rn(1.0f) && two == __float2bfloat16_rn(2.0f),
        "comparison with CUDA types", 0, 0, 0);
  const __half sum = __hadd(static_cast<__half>(one), static_cast<__half>(three));
  check(tandem::half(sum).bits == 0x4400u, "explicit conversion for CUDA intrinsics", 0,
        tandem::half(sum).bits, 0x4400u);
}

#if !defined(TANDEM_CUDA_SIM)
/// One index per element: widen each 16-bit pattern, narrow each sampled float, with tandem's
/// TANDEM_HD code compiled for the device, and with CUDA's intrinsics for comparison.
struct Convert {
  const std::uint32_t* floats;
  std::uint32_t float_count;
  std::uint32_t* half_widened;
  std::uint32_t* bfloat16_widened;
  std::uint16_t* half_narrowed;
  std::uint16_t* bfloat16_narrowed;
  std::uint16_t* cuda_half_narrowed;
  std::uint16_t* cuda_bfloat16_narrowed;

  TANDEM_HD void operator()(std::size_t index) const {
    const auto i = static_cast<std::uint32_t>(index);
    if (i <= 0xffffu) {
      const auto raw = static_cast<std::uint16_t>(i);
      half_widened[i] = tandem::detail::float_bits(tandem::half::from_bits(raw));
      bfloat16_widened[i] = tandem::detail::float_bits(tandem::bfloat16::from_bits(raw));
    }
    if (i < float_count) {
      const float value = tandem::detail::bits_float(floats[i]);
      half_narrowed[i] = tandem::half(value).bits;
      bfloat16_narrowed[i] = tandem::bfloat16(value).bits;
      cuda_half_narrowed[i] = __half_as_ushort(__float2half_rn(value));
      cuda_bfloat16_narrowed[i] = __bfloat16_as_ushort(__float2bfloat16_rn(value));
    }
  }
};

template <class T>
struct DeviceArray {
  T* pointer = nullptr;
  explicit DeviceArray(std::size_t count) {
    if (cudaMalloc(&pointer, count * sizeof(T)) != cudaSuccess) pointer = nullptr;
  }
  ~DeviceArray() { cudaFree(pointer); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  std::vector<T> to_host(std::size_t count) const {
    std::vector<T> result(count);
    cudaMemcpy(result.data(), pointer, count * sizeof(T), cudaMemcpyDeviceToHost);
    return result;
  }
};

bool cuda_ok(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return true;
  std::printf("FAILED: %s: %s\n", what, cudaGetErrorString(status));
  ++failures;
  return false;
}

void device_checks(const std::vector<std::uint32_t>& floats) {
  const auto count = static_cast<std::uint32_t>(floats.size());
  DeviceArray<std::uint32_t> input(count), half_widened(0x10000), bfloat16_widened(0x10000);
  DeviceArray<std::uint16_t> half_narrowed(count), bfloat16_narrowed(count);
  DeviceArray<std::uint16_t> cuda_half_narrowed(count), cuda_bfloat16_narrowed(count);
  if (!cuda_ok(cudaMemcpy(input.pointer, floats.data(), count * sizeof(std::uint32_t),
                          cudaMemcpyHostToDevice),
               "cudaMemcpy to device")) {
    return;
  }
  const std::uint32_t total = count > 0x10000u ? count : 0x10000u;
  try {
    tandem::for_each_index(
        tandem::cuda_exec{}, total,
        Convert{input.pointer, count, half_widened.pointer, bfloat16_widened.pointer,
                half_narrowed.pointer, bfloat16_narrowed.pointer, cuda_half_narrowed.pointer,
                cuda_bfloat16_narrowed.pointer});
  } catch (const std::exception& e) {
    std::printf("FAILED: kernel launch: %s\n", e.what());
    ++failures;
    return;
  }
  if (!cuda_ok(cudaDeviceSynchronize(), "kernel run")) return;

  const auto hw = half_widened.to_host(0x10000);
  const auto bw = bfloat16_widened.to_host(0x10000);
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const auto raw = static_cast<std::uint16_t>(bits);
    const std::uint32_t want_h = float_bits(tandem::half::from_bits(raw));
    check(hw[bits] == want_h, "device half -> float", bits, hw[bits], want_h);
    const std::uint32_t want_b = float_bits(tandem::bfloat16::from_bits(raw));
    check(bw[bits] == want_b, "device bfloat16 -> float", bits, bw[bits], want_b);
  }
  const auto hn = half_narrowed.to_host(count);
  const auto bn = bfloat16_narrowed.to_host(count);
  const auto chn = cuda_half_narrowed.to_host(count);
  const auto cbn = cuda_bfloat16_narrowed.to_host(count);
  for (std::uint32_t i = 0; i < count; ++i) {
    const float value = bits_float(floats[i]);
    const std::uint16_t want_h = tandem::half(value).bits;
    check(hn[i] == want_h, "device float -> half vs host", floats[i], hn[i], want_h);
    const std::uint16_t want_b = tandem::bfloat16(value).bits;
    check(bn[i] == want_b, "device float -> bfloat16 vs host", floats[i], bn[i], want_b);
    check(std::isnan(value) ? half_is_nan(chn[i]) && half_is_nan(hn[i]) : chn[i] == hn[i],
          "device float -> half vs __float2half_rn", floats[i], hn[i], chn[i]);
    check(std::isnan(value) ? bfloat16_is_nan(cbn[i]) && bfloat16_is_nan(bn[i]) : cbn[i] == bn[i],
          "device float -> bfloat16 vs __float2bfloat16_rn", floats[i], bn[i], cbn[i]);
  }
}

#endif  // !TANDEM_CUDA_SIM

}  // namespace

int main() {
  const std::vector<std::uint32_t> floats = sample_floats();
  host_checks(floats);
  std::printf("host checks: %s (%zu floats, 65536 patterns per type)\n",
              failures == 0 ? "passed" : "FAILED", floats.size());
  if (failures != 0) return 1;

  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (cudaGetDeviceCount: %s)\n",
                status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
    return 77;
  }
#if defined(TANDEM_CUDA_SIM)
  // The simulated runtime would run Convert on the host: the host checks above, once more. What
  // the device checks test is the GPU's own conversion instructions.
  std::printf(
      "device checks: not run on the simulated CUDA runtime (they test a GPU's "
      "conversion instructions)\n");
#else
  device_checks(floats);
  std::printf("device checks: %s\n", failures == 0 ? "passed" : "FAILED");
#endif
  return failures == 0 ? 0 : 1;
}
