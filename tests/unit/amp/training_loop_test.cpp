// The README's mixed-precision loop, run for real: apex O2 (fp32 master weights in the arena, a
// half compute copy refreshed by one cast pass), GradScaler with tandem's SGD, EMA. A tiny linear
// regression whose scaled half gradients overflow at the default scale of 2^16: the scaler must
// skip those steps, back off until they fit, and then train; the EMA must follow the weights.
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "tandem/amp/grad_scaler.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/optim/ema.hpp"
#include "tandem/optim/sgd.hpp"
#include "tandem/tensor/precision.hpp"

namespace {

constexpr std::size_t features = 4;
constexpr std::size_t samples = 8;

struct Data {
  std::vector<float> x;  // samples x features
  std::vector<float> y;
};

Data make_data() {
  const float true_w[features] = {1.5f, -2.0f, 0.5f, 3.0f};
  const float true_b = 0.25f;
  Data data;
  std::uint32_t seed = 12345;
  for (std::size_t s = 0; s < samples; ++s) {
    float target = true_b;
    for (std::size_t f = 0; f < features; ++f) {
      // A fixed pseudo-random design in [-2, 2) (sines of a linear sequence would be collinear).
      seed = seed * 1664525u + 1013904223u;
      const float x = static_cast<float>(seed >> 8) / 16777216.0f * 4.0f - 2.0f;
      data.x.push_back(x);
      target += true_w[f] * x;
    }
    data.y.push_back(target);
  }
  return data;
}

/// Forward in the compute precision (half weights, float arithmetic): mean squared error / 2.
float forward(tandem::View<tandem::half> w, const Data& data, std::vector<float>& residual) {
  float loss = 0;
  residual.assign(samples, 0.0f);
  for (std::size_t s = 0; s < samples; ++s) {
    float prediction = static_cast<float>(w[features]);  // the bias
    for (std::size_t f = 0; f < features; ++f) {
      prediction += static_cast<float>(w[f]) * data.x[s * features + f];
    }
    residual[s] = prediction - data.y[s];
    loss += 0.5f * residual[s] * residual[s] / samples;
  }
  return loss;
}

/// Backward of `loss_scale * loss` into half gradients: large scales overflow half to inf.
void backward(float loss_scale, const std::vector<float>& residual, const Data& data,
              tandem::View<tandem::half> grads) {
  for (std::size_t f = 0; f <= features; ++f) {
    float g = 0;
    for (std::size_t s = 0; s < samples; ++s) {
      g += residual[s] * (f == features ? 1.0f : data.x[s * features + f]) / samples;
    }
    grads[f] = tandem::half(loss_scale * g);
  }
}

}  // namespace

TEST_CASE("O2 + GradScaler + SGD + EMA: overflowing steps are skipped, then it trains") {
  const Data data = make_data();
  tandem::Parameters<float> params;
  params.add("w", {features});
  params.add("b", {1});
  params.finalize();

  using Policy = tandem::amp::O2<>;  // fp32 master weights, half compute copy
  static_assert(Policy::loss_scaling);
  tandem::amp::ComputeWeights<Policy> weights(params.numel());
  tandem::optim::SGD opt(params, tandem::optim::SGDOptions{.lr = 0.05, .momentum = 0.5});
  tandem::GradScaler scaler;  // init_scale 2^16: the first gradients overflow half
  tandem::EMA ema(params, tandem::EMAOptions{.decay = 0.9});

  std::vector<float> residual;
  float first_loss = 0;
  float last_loss = 0;
  int skipped = 0;
  for (int step = 0; step < 300; ++step) {
    weights.refresh(tandem::on_host, params.values());  // one fp32 -> half cast pass
    const float loss = forward(weights.values(), data, residual);
    if (step == 0) first_loss = loss;
    last_loss = loss;
    backward(scaler.scale(1.0f), residual, data, weights.grads());  // d(scale * loss)
    weights.grads_to_master(tandem::on_host, params.grads());       // half -> fp32
    if (!scaler.step(opt)) ++skipped;  // unscale + inf check, then SGD unless inf/NaN
    scaler.update();
    ema.update();
    opt.zero_grad();
  }

  CHECK(skipped >= 1);                  // 2^16 * gradient overflowed half at first
  CHECK(scaler.get_scale() < 65536.0);  // backed off
  CHECK(last_loss < first_loss * 1e-3f);
  const auto w = params.values();
  CHECK(w[0] == doctest::Approx(1.5).epsilon(0.02));
  CHECK(w[3] == doctest::Approx(3.0).epsilon(0.02));
  {
    auto guard = ema.applied();  // evaluate with the averaged weights
    CHECK(ema.values()[3] == doctest::Approx(3.0).epsilon(0.05));
  }
  CHECK_FALSE(ema.shadow_applied());
}
