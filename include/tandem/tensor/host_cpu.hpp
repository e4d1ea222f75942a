// tandem/tensor/host_cpu.hpp - what the host executor knows of the CPU it runs on, in one place:
// which vector instructions it has (asked once per process), how many cores this rank may use,
// and the two ways a host pass goes faster than host_exec's plain loop (several threads; a loop
// compiled for AVX2 with FMA, chosen at run time so the build needs no -mavx2 or -mfma).
//   if (tandem::cpu_has(tandem::cpu_feature::avx2_fma)) { ... }
//   tandem::detail::cpu::parallel_ranges(tandem::rank_cores(), 1 << 16, n, body);
//   tandem::detail::cpu::for_range_fma(pass, 0, n);  // where cpu_has(cpu_feature::avx2_fma)
// Needs: the standard library (CPUID on x86-64 with GCC or clang; elsewhere every feature is
// absent and the plain loops run).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
/// x86-64 with GCC or clang: the features are asked of the CPU.
#define TANDEM_X86_DISPATCH 1
#endif

#if defined(TANDEM_X86_DISPATCH) && !defined(__CUDACC__)
/// Host code outside nvcc's translation units has kernels written with x86 intrinsics for
/// instructions the build does not assume (gnu::target), run where cpu_has() says so.
#define TANDEM_HOST_X86_KERNELS 1
#endif

#if defined(TANDEM_HOST_X86_KERNELS) && !defined(__FMA__)
/// A build without -mfma gets host loops cloned for AVX2 with FMA: without them every fused
/// multiply-add is a call into the C library.
#define TANDEM_HOST_FMA_CLONE 1
#endif

namespace tandem {

/// The instruction-set extensions tandem's host passes dispatch on.
enum class cpu_feature {
  sse42,     ///< SSE 4.2's CRC32 instruction (CRC-32C of checkpoints)
  avx2,      ///< AVX2 (MNIST's pixel normalisation)
  avx2_fma,  ///< AVX2 and FMA together (the optimizers', EMA's and FusedStep's clones)
  f16c,      ///< AVX and F16C (float to half eight at a time)
};

/// Whether this CPU (and OS) has `feature`; asked once per process (CPUID traps to the
/// hypervisor in a VM). Always false off x86-64.
[[nodiscard]] inline bool cpu_has([[maybe_unused]] cpu_feature feature) noexcept {
#if defined(TANDEM_X86_DISPATCH)
  struct Features {
    bool sse42 = __builtin_cpu_supports("sse4.2");
    bool avx2 = __builtin_cpu_supports("avx2");
    bool avx2_fma = avx2 && __builtin_cpu_supports("fma");
    // F16C is CPUID leaf 1, ECX bit 29, read directly: clang's __builtin_cpu_supports has no
    // "f16c"; its instructions need AVX's registers, so AVX (with the OS's support) too.
    bool f16c = [] {
      unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
      return __builtin_cpu_supports("avx") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 &&
             (ecx & (1u << 29)) != 0;
    }();
  };
  static const Features features;
  switch (feature) {
    case cpu_feature::sse42:
      return features.sse42;
    case cpu_feature::avx2:
      return features.avx2;
    case cpu_feature::avx2_fma:
      return features.avx2_fma;
    case cpu_feature::f16c:
      return features.f16c;
  }
#endif
  return false;
}

/// This rank's share of the machine's cores: the CPUs this process may run on, when it has been
/// pinned to fewer than the machine has (taskset, numactl, a launcher's binding); otherwise the
/// machine's cores divided by LOCAL_WORLD_SIZE (set by tandemrun and torchrun; 1 when unset or
/// not a positive number). At least 1.
inline int rank_cores() {
  const int machine = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  int allowed = machine;
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) allowed = std::max(1, CPU_COUNT(&set));
#endif
  if (allowed < machine) return allowed;
  int local_ranks = 1;
  if (const char* text = std::getenv("LOCAL_WORLD_SIZE")) {
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    if (end != text && *end == '\0' && value > 0 && value <= machine) {
      local_ranks = static_cast<int>(value);
    }
  }
  return std::max(1, machine / local_ranks);
}

namespace detail::cpu {

/// Runs body(begin, end) over [0, n) split into up to `threads` ranges (multiples of 64
/// elements, so that no two threads write one cache line), on this thread and threads started
/// for the call; no more threads than there are blocks of `min_per_thread` elements (a thread
/// costs tens of microseconds to start). body must not throw.
template <class Body>
void parallel_ranges(int threads, std::size_t min_per_thread, std::size_t n, const Body& body) {
  const std::size_t useful = std::max<std::size_t>(1, n / std::max<std::size_t>(1, min_per_thread));
  const auto count = static_cast<std::size_t>(
      std::min<std::size_t>(static_cast<std::size_t>(std::max(1, threads)), useful));
  if (count <= 1) {
    body(std::size_t{0}, n);
    return;
  }
  const std::size_t chunk = ((n + count - 1) / count + 63) / 64 * 64;
  std::vector<std::thread> pool;
  pool.reserve(count - 1);
  for (std::size_t k = 1; k < count; ++k) {
    const std::size_t begin = std::min(n, k * chunk);
    const std::size_t end = std::min(n, begin + chunk);
    if (begin < end) pool.emplace_back([&body, begin, end] { body(begin, end); });
  }
  body(std::size_t{0}, std::min(n, chunk));
  for (auto& thread : pool) thread.join();
}

#if defined(TANDEM_HOST_FMA_CLONE)
/// f(i) for i in [begin, end), compiled for AVX2 with FMA: std::fma (and a lerp's fused
/// multiply-add) inlined into f becomes one instruction, and the loop vectorises. Call it only
/// where cpu_has(cpu_feature::avx2_fma).
template <class F>
[[gnu::target("avx2,fma")]] void for_range_fma(const F& f, std::size_t begin, std::size_t end) {
  for (std::size_t i = begin; i < end; ++i) f(i);
}
#endif

}  // namespace detail::cpu

}  // namespace tandem
