// The host passes' run-time dispatched kernels (AVX2+FMA AdamW, AVX2+FMA EMA lerp, F16C
// fp32 -> half cast) give the same bits as the portable scalar code they replace, on random
// numbers over the whole float range and on the edge cases (zeros, subnormals, inf, NaN).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <doctest/doctest.h>

#include "tandem/optim/adamw.hpp"
#include "tandem/optim/ema.hpp"
#include "tandem/tensor/host_cpu.hpp"
#include "tandem/tensor/precision.hpp"

namespace {

using tandem::half;

std::uint32_t bits_of(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

float float_of(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

/// n floats: mostly random bit patterns of moderate magnitude, with special values mixed in.
std::vector<float> mixed_floats(std::size_t n, std::uint32_t seed, bool any_bits = false) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> moderate(-4.0f, 4.0f);
  const float specials[] = {0.0f,
                            -0.0f,
                            1e-40f,
                            -1e-40f,
                            1e-30f,
                            INFINITY,
                            -INFINITY,
                            NAN,
                            float_of(0xffc00001u),
                            float_of(0x7f800001u),
                            65504.0f,
                            3.4e38f};
  std::vector<float> values(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t pick = rng() % 16;
    if (pick == 0) {
      values[i] = specials[rng() % std::size(specials)];
    } else if (pick < 4 || any_bits) {
      values[i] = float_of(static_cast<std::uint32_t>(rng()));
    } else {
      values[i] = moderate(rng);
    }
  }
  return values;
}

/// Elements whose bits differ; two NaNs count as equal whatever their sign and payload, which
/// x86 takes from whichever operand comes first and an unoptimised build orders differently
/// (PyTorch promises no NaN payload either).
std::size_t bit_mismatches(const std::vector<float>& a, const std::vector<float>& b) {
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const bool both_nan = std::isnan(a[i]) && std::isnan(b[i]);
    mismatches += !both_nan && bits_of(a[i]) != bits_of(b[i]) ? 1 : 0;
  }
  return mismatches;
}

bool has_avx2_fma() {
  return tandem::cpu_has(tandem::cpu_feature::avx2_fma);
}

/// One AdamW step by the dispatched kernel (what AdamW::step runs on the host) and by the
/// portable scalar loop (std::fma from the C library: exactly rounded), on the same state.
template <bool Amsgrad>
void check_adamw_kernel(bool maximize, std::uint32_t seed) {
  using update = tandem::optim::detail::adamw_update<float, Amsgrad>;
  const std::size_t n = 4099;  // not a multiple of 8: the scalar tail runs too
  std::vector<float> param = mixed_floats(n, seed);
  const std::vector<float> grad = mixed_floats(n, seed + 1);
  std::vector<float> exp_avg = mixed_floats(n, seed + 2);
  std::vector<float> exp_avg_sq = mixed_floats(n, seed + 3);  // negative ones give NaN roots
  std::vector<float> max_exp_avg_sq = mixed_floats(n, seed + 4);
  auto param2 = param, exp_avg2 = exp_avg, exp_avg_sq2 = exp_avg_sq, max2 = max_exp_avg_sq;
  auto make = [&](float* p, float* m, float* v, float* vmax) {
    return update{p,    grad.data(), m,      v,       vmax,  0.9999f,   0.9f,
                  0.1f, 0.999f,      0.001f, 0.0316f, 1e-8f, -0.00123f, maximize};
  };
  const auto kernel = make(param.data(), exp_avg.data(), exp_avg_sq.data(), max_exp_avg_sq.data());
  const auto scalar = make(param2.data(), exp_avg2.data(), exp_avg_sq2.data(), max2.data());
#if defined(TANDEM_HOST_X86_KERNELS)
  REQUIRE(has_avx2_fma());
  tandem::optim::detail::adamw_avx2_fma(kernel, n);
#else
  tandem::for_each_index(tandem::on_host, n, kernel);
#endif
  tandem::for_each_index(tandem::on_host, n, scalar);
  CHECK(bit_mismatches(param, param2) == 0);
  CHECK(bit_mismatches(exp_avg, exp_avg2) == 0);
  CHECK(bit_mismatches(exp_avg_sq, exp_avg_sq2) == 0);
  CHECK(bit_mismatches(max_exp_avg_sq, max2) == 0);
}

/// torch.lerp as ATen computes it, with the C library's exactly rounded fmaf.
float reference_lerp(float start, float end, float weight) {
  const float difference = end - start;
  return std::fabs(weight) < 0.5f ? std::fma(weight, difference, start)
                                  : std::fma(weight - 1.0f, difference, end);
}

}  // namespace

TEST_CASE("cpu_has answers as the CPU does") {
#if defined(__x86_64__) && defined(__GNUC__)
  CHECK(tandem::cpu_has(tandem::cpu_feature::sse42) == (__builtin_cpu_supports("sse4.2") != 0));
  CHECK(tandem::cpu_has(tandem::cpu_feature::avx2) == (__builtin_cpu_supports("avx2") != 0));
  CHECK(tandem::cpu_has(tandem::cpu_feature::avx2_fma) ==
        (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")));
  if (tandem::cpu_has(tandem::cpu_feature::f16c)) CHECK(__builtin_cpu_supports("avx"));
#else
  CHECK_FALSE(tandem::cpu_has(tandem::cpu_feature::avx2_fma));
#endif
}

TEST_CASE("AdamW's AVX2 kernel gives the scalar update's bits, amsgrad and maximize included") {
  if (!has_avx2_fma()) {
    MESSAGE("no AVX2+FMA on this CPU: only the portable loop runs");
  }
  check_adamw_kernel<false>(false, 11);
  check_adamw_kernel<false>(true, 21);
  check_adamw_kernel<true>(false, 31);
  check_adamw_kernel<true>(true, 41);
}

TEST_CASE("AdamW::step on the host matches the portable scalar pass bit for bit") {
  tandem::Parameters<float> params;
  params.add("w", tandem::Shape{1000});
  params.add("b", tandem::Shape{37});
  params.finalize();
  const std::vector<float> start = mixed_floats(params.numel(), 5);
  std::vector<float> param(start), exp_avg(params.numel()), exp_avg_sq(params.numel());
  std::copy(start.begin(), start.end(), params.values().data());
  tandem::optim::AdamW adamw(params, {.lr = 1e-2, .weight_decay = 0.1});
  for (int step = 1; step <= 3; ++step) {
    const std::vector<float> grad = mixed_floats(params.numel(), 100 + step);
    std::copy(grad.begin(), grad.end(), params.grads().data());
    adamw.step();
    const double bias_correction1 = 1 - std::pow(0.9, step);
    const double bias_correction2 = 1 - std::pow(0.999, step);
    tandem::for_each_index(
        tandem::on_host, params.numel(),
        tandem::optim::detail::adamw_update<float, false>{
            param.data(), grad.data(), exp_avg.data(), exp_avg_sq.data(), nullptr,
            static_cast<float>(1 - 1e-2 * 0.1), 0.9f, static_cast<float>(1 - 0.9), 0.999f,
            static_cast<float>(1 - 0.999), static_cast<float>(std::sqrt(bias_correction2)), 1e-8f,
            static_cast<float>(-1e-2 / bias_correction1), false});
    const std::vector<float> got(params.values().data(), params.values().data() + params.numel());
    CHECK(bit_mismatches(got, param) == 0);
  }
}

TEST_CASE("EMA's update gives torch.lerp's exactly rounded fused multiply-add bits") {
  const std::size_t n = 10007;
  const std::vector<float> live = mixed_floats(n, 7);
  for (const float weight : {0.001f, 1.0f - 0.999f, 0.25f, 0.5f, 0.75f, 1.0f, 0.0f}) {
    std::vector<float> shadow = mixed_floats(n, 8);
    std::vector<float> expected(n);
    for (std::size_t i = 0; i < n; ++i) expected[i] = reference_lerp(shadow[i], live[i], weight);
    tandem::detail::ema::run_lerp<tandem::detail::ema::lerp_into, float>(
        tandem::on_host, n, shadow.data(), live.data(), weight);
    if (has_avx2_fma()) {
      CHECK(bit_mismatches(shadow, expected) == 0);
    } else {  // the portable double-rounded path may differ by one ulp in rare ties only
      CHECK(bit_mismatches(shadow, expected) <= 2);
    }
  }
}

TEST_CASE("The fp32 -> half cast gives tandem::half's bits on a sample of all 2^32 inputs") {
  // Checked on all 2^32 patterns once (bench/results/step.md); here every 65521st pattern and
  // every value near half's subnormal, normal, overflow and NaN boundaries, with odd lengths.
  std::vector<float> inputs;
  for (std::uint64_t b = 0; b <= 0xffffffffu; b += 65521) {
    inputs.push_back(float_of(static_cast<std::uint32_t>(b)));
  }
  for (std::uint32_t edge : {0x33000000u, 0x33800000u, 0x38800000u, 0x477ff000u, 0x47800000u,
                             0x7f800000u, 0x7fc00000u}) {
    for (std::uint32_t d = 0; d < 4096; ++d) {
      inputs.push_back(float_of(edge - 2048 + d));
      inputs.push_back(float_of((edge - 2048 + d) | 0x80000000u));
    }
  }
  const std::vector<float> random = mixed_floats(9999, 3, true);
  inputs.insert(inputs.end(), random.begin(), random.end());
  for (const std::size_t length : {inputs.size(), std::size_t{7}, std::size_t{13}}) {
    std::vector<half> out(length);
    tandem::amp::cast(tandem::on_host, tandem::View<const float>(inputs.data(), length),
                      tandem::View<half>(out.data(), length));
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < length; ++i) {
      mismatches += out[i].bits != half(inputs[i]).bits ? 1 : 0;
    }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("A cast large enough for streaming stores gives the same bits, at any alignment") {
  const std::size_t n = (std::size_t{1} << 23) + 13;  // amp::detail::f16c_streaming_threshold
  std::vector<float> inputs(n);
  std::mt19937 rng(17);
  for (float& value : inputs) value = float_of(static_cast<std::uint32_t>(rng()));
  std::vector<half> out(n + 1);
  for (const std::size_t offset : {std::size_t{0}, std::size_t{1}}) {
    tandem::amp::cast(tandem::on_host, tandem::View<const float>(inputs.data(), n),
                      tandem::View<half>(out.data() + offset, n));
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < n; ++i) {
      mismatches += out[offset + i].bits != half(inputs[i]).bits ? 1 : 0;
    }
    CHECK(mismatches == 0);
  }
}
