// Precision policies (apex O0..O3) and the O2 compute copy: one cast pass with
// round-to-nearest-even, gradients cast back to the fp32 master, no copy when none is needed.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "tandem/tensor/precision.hpp"

namespace amp = tandem::amp;
using tandem::bfloat16;
using tandem::half;

// The policies' four types, as apex defines the levels.
static_assert(std::is_same_v<amp::O0::master_type, float> &&
              std::is_same_v<amp::O0::compute_type, float> && !amp::O0::loss_scaling &&
              !amp::O0::keeps_master_copy);
static_assert(std::is_same_v<amp::O1<>::master_type, float> &&
              std::is_same_v<amp::O1<>::compute_type, half> &&
              std::is_same_v<amp::O1<>::grad_type, float> && amp::O1<>::loss_scaling &&
              !amp::O1<>::keeps_master_copy == false);
static_assert(std::is_same_v<amp::O2<>::master_type, float> &&
              std::is_same_v<amp::O2<>::compute_type, half> &&
              std::is_same_v<amp::O2<>::grad_type, half> &&
              std::is_same_v<amp::O2<>::reduce_type, half> && amp::O2<>::loss_scaling &&
              amp::O2<>::keeps_master_copy);
static_assert(std::is_same_v<amp::O2<bfloat16>::compute_type, bfloat16> &&
              !amp::O2<bfloat16>::loss_scaling);  // bfloat16 has fp32's range
static_assert(std::is_same_v<amp::O3<>::master_type, half> && !amp::O3<>::loss_scaling &&
              !amp::O3<>::keeps_master_copy);
static_assert(amp::PrecisionPolicy<amp::O0> && amp::PrecisionPolicy<amp::O2<bfloat16>>);
static_assert(!amp::PrecisionPolicy<float>);

TEST_CASE("cast rounds fp32 to half and bfloat16 to nearest even in one pass") {
  const std::vector<float> master = {
      0.0f,     -0.0f, 1.0f,    0.1f,  -3.14159f, 65504.0f,
      65520.0f, 1e-8f, 6.1e-5f, 1e30f, -1e30f,    std::numeric_limits<float>::infinity()};
  std::vector<half> halves(master.size());
  std::vector<bfloat16> bfloats(master.size());
  amp::cast(tandem::on_host, tandem::View<const float>(master), tandem::View<half>(halves));
  amp::cast(tandem::on_host, tandem::View<const float>(master), tandem::View<bfloat16>(bfloats));
  for (std::size_t i = 0; i < master.size(); ++i) {
    CAPTURE(master[i]);
    CHECK(halves[i].bits == half(master[i]).bits);
    CHECK(bfloats[i].bits == bfloat16(master[i]).bits);
  }
  CHECK(halves[6].bits == 0x7c00u);  // 65520 rounds up to half's infinity
  CHECK(static_cast<float>(halves[3]) == doctest::Approx(0.1f).epsilon(1e-3));

  std::vector<float> back(master.size());
  amp::cast(tandem::on_host, tandem::View<half>(halves), tandem::View<float>(back));
  CHECK(back[2] == 1.0f);
  CHECK(back[5] == 65504.0f);

  std::vector<half> short_output(3);
  CHECK_THROWS_AS(amp::cast(tandem::on_host, tandem::View<const float>(master),
                            tandem::View<half>(short_output)),
                  tandem::Error);
}

TEST_CASE("The vectorisable fp32 -> half conversion gives tandem::half's bits") {
  // Checked on all 2^32 patterns once by hand; here every 65521st pattern, and every value near
  // half's subnormal, normal and overflow boundaries.
  std::vector<std::uint32_t> patterns;
  for (std::uint64_t b = 0; b <= 0xffffffffu; b += 65521)
    patterns.push_back(static_cast<std::uint32_t>(b));
  for (std::uint32_t edge :
       {0x33000000u, 0x38800000u, 0x477ff000u, 0x47800000u, 0x7f800000u, 0x7fc00000u}) {
    for (std::uint32_t d = 0; d < 4096; ++d) {
      patterns.push_back(edge - 2048 + d);
      patterns.push_back((edge - 2048 + d) | 0x80000000u);
    }
  }
  int mismatches = 0;
  for (std::uint32_t bits : patterns) {
    const float value = tandem::detail::bits_float(bits);
    if (amp::detail::float_to_half_bits_select(value) != half(value).bits) ++mismatches;
  }
  CHECK(mismatches == 0);
}

TEST_CASE("The device cast's blocks of four give cast_element's bits, aligned or not") {
  // The GPU path of amp::cast (four floats in, four halves out per thread) run on the host: the
  // same functor, so the same bits; misaligned buffers and tails fall back to single elements.
  std::vector<float> source(1 << 12);
  std::uint32_t state = 12345;
  for (auto& x : source) {
    state = state * 1664525u + 1013904223u;
    x = tandem::detail::bits_float(state);  // every kind of float: NaN, inf, subnormal, normal
  }
  for (std::size_t offset_in : {0, 1, 3}) {
    for (std::size_t offset_out : {0, 2}) {
      for (std::size_t n : {0, 1, 3, 4, 7, 1000, 4000}) {
        INFO("offsets " << offset_in << ", " << offset_out << ", n " << n);
        std::vector<half> blocks(n + 8), single(n + 8);
        amp::detail::cast_float_half_blocks(tandem::on_host, source.data() + offset_in,
                                            blocks.data() + offset_out, n);
        tandem::for_each_index(tandem::on_host, n,
                               amp::detail::cast_element<float, half>{source.data() + offset_in,
                                                                      single.data() + offset_out});
        int mismatches = 0;
        for (std::size_t i = 0; i < n; ++i) {
          mismatches += blocks[offset_out + i].bits != single[offset_out + i].bits;
        }
        CHECK(mismatches == 0);
      }
    }
  }
}

TEST_CASE("O2 keeps a half compute copy refreshed from the fp32 master weights") {
  std::vector<float> master = {1.0f, 0.5f, 1.0f / 3.0f, -2.0f};
  std::vector<float> master_grads(4, 0.0f);
  amp::ComputeWeights<amp::O2<>> weights(master.size());
  weights.refresh(tandem::on_host, tandem::View<float>(master));
  REQUIRE(weights.values().size() == 4);
  CHECK(weights.values().data() != nullptr);
  for (std::size_t i = 0; i < master.size(); ++i) {
    CHECK(weights.values()[i].bits == half(master[i]).bits);
  }

  // An optimizer step changes the master weights; the copy is stale until the next refresh.
  master[1] = 0.75f;
  CHECK(static_cast<float>(weights.values()[1]) == 0.5f);
  weights.refresh(tandem::on_host, tandem::View<float>(master));
  CHECK(static_cast<float>(weights.values()[1]) == 0.75f);

  // Backward writes half gradients; the optimizer reads them as fp32.
  weights.grads()[0] = half(0.125f);
  weights.grads()[3] = half(-8.0f);
  weights.grads_to_master(tandem::on_host, tandem::View<float>(master_grads));
  CHECK(master_grads == std::vector<float>{0.125f, 0.0f, 0.0f, -8.0f});

  std::vector<float> wrong(3);
  CHECK_THROWS_AS(weights.refresh(tandem::on_host, tandem::View<float>(wrong)), tandem::Error);
}

TEST_CASE("Without a master copy the compute weights are the master weights, uncopied") {
  std::vector<float> master = {1.0f, 2.0f};
  std::vector<float> grads = {0.0f, 0.0f};
  amp::ComputeWeights<amp::O0> weights(2);
  weights.refresh(tandem::on_host, tandem::View<float>(master));
  weights.grads_to_master(tandem::on_host, tandem::View<float>(grads));
  CHECK(weights.values().data() == master.data());
  CHECK(weights.grads().data() == grads.data());

  std::vector<half> pure_half = {half(1.0f), half(2.0f)};
  amp::ComputeWeights<amp::O3<>> o3(2);
  o3.refresh(tandem::on_host, tandem::View<half>(pure_half));
  CHECK(o3.values().data() == pure_half.data());
}
