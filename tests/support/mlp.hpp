// tests/support/mlp.hpp - a small real model for tests and examples: a multi-layer perceptron
// (tanh hidden layers, linear output, squared-error loss) whose forward and backward are written
// by hand over a tandem::Parameters arena, plus deterministic data.
//   tandem::test::Mlp<float> model({6, 12, 3}, /*seed=*/1);
//   model.forward_backward(x, y, batch, 1.0 / batch, [&](auto& p) { ddp.grad_ready(p); });
// Needs: tandem/arena/parameters.hpp.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tandem/arena/parameters.hpp"
#include "tandem/core/error.hpp"

namespace tandem::test {

/// A deterministic value in [-1, 1) from a few integers (a hash, so no generator state).
inline float hashed_unit(std::uint64_t a, std::uint64_t b, std::uint64_t c, std::uint64_t d) {
  std::uint64_t h = 0x9e3779b97f4a7c15ull;
  for (std::uint64_t v : {a, b, c, d}) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 31;
  }
  return static_cast<float>(static_cast<double>(h >> 11) / 4503599627370496.0 - 1.0);
}

/// Samples [first, first + count) of step `step` of a data stream: inputs in [-1, 1) and targets
/// that a smooth function of the inputs gives (so the model has something to learn).
struct Batch {
  std::vector<float> x;  // count x inputs, row-major
  std::vector<float> y;  // count x outputs
  std::size_t count = 0;
};

inline Batch make_batch(std::uint64_t seed, std::size_t step, std::size_t first, std::size_t count,
                        std::size_t inputs, std::size_t outputs) {
  Batch batch;
  batch.count = count;
  batch.x.resize(count * inputs);
  batch.y.resize(count * outputs);
  for (std::size_t s = 0; s < count; ++s) {
    float total = 0.0f;
    for (std::size_t j = 0; j < inputs; ++j) {
      const float v = hashed_unit(seed, step, first + s, j);
      batch.x[s * inputs + j] = v;
      total += v * static_cast<float>(j + 1);
    }
    for (std::size_t o = 0; o < outputs; ++o) {
      batch.y[s * outputs + o] = std::sin(total * 0.3f + static_cast<float>(o));
    }
  }
  return batch;
}

/// The perceptron. Parameters, in registration order: fc0.weight [w1, w0], fc0.bias [w1], ...,
/// then buffers head.running_mean [outputs] (a running mean of the outputs, updated by forward)
/// and head.num_batches_tracked (integral). Arithmetic is in float whatever T is.
template <class T = float>
class Mlp {
 public:
  /// widths = {inputs, hidden..., outputs}; values drawn from `seed`, scaled by 1/sqrt(fan-in).
  explicit Mlp(std::vector<std::size_t> widths, std::uint64_t seed = 1)
      : widths_(std::move(widths)) {
    if (widths_.size() < 2) throw Error("Mlp", "needs at least an input and an output width");
    const std::size_t layers = widths_.size() - 1;
    for (std::size_t l = 0; l < layers; ++l) {
      const auto in = static_cast<std::int64_t>(widths_[l]);
      const auto out = static_cast<std::int64_t>(widths_[l + 1]);
      weights_.push_back(&params_.add("fc" + std::to_string(l) + ".weight", {out, in}));
      biases_.push_back(&params_.add("fc" + std::to_string(l) + ".bias", {out}));
    }
    running_mean_ =
        &params_.add_buffer("head.running_mean", {static_cast<std::int64_t>(widths_.back())});
    batches_tracked_ = &params_.add_buffer("head.num_batches_tracked", {}, BufferKind::integral);
    params_.finalize();
    for (std::size_t l = 0; l < layers; ++l) {
      const float scale = 1.0f / std::sqrt(static_cast<float>(widths_[l]));
      auto w = weights_[l]->value();
      for (std::size_t i = 0; i < w.size(); ++i) w[i] = T(scale * hashed_unit(seed, l, 0, i));
      auto b = biases_[l]->value();
      for (std::size_t i = 0; i < b.size(); ++i) b[i] = T(0.1f * hashed_unit(seed, l, 1, i));
    }
  }

  [[nodiscard]] Parameters<T>& params() noexcept { return params_; }
  [[nodiscard]] std::size_t inputs() const noexcept { return widths_.front(); }
  [[nodiscard]] std::size_t outputs() const noexcept { return widths_.back(); }
  [[nodiscard]] std::size_t layers() const noexcept { return widths_.size() - 1; }

  /// Forward and backward over `batch.count` samples of loss = scale * sum_s 0.5 |f(x_s) - y_s|^2.
  /// Adds the gradient to the arena's gradients (so micro-batches accumulate) and calls
  /// ready(Parameter&) for each parameter as soon as its gradient is complete, last layer first:
  /// fc{L-1}.weight, fc{L-1}.bias, ..., fc0.weight, fc0.bias. Returns the loss.
  template <class Ready>
  double forward_backward(const Batch& batch, double scale, Ready&& ready) {
    const std::size_t n = batch.count;
    const std::size_t layers = this->layers();
    // activations[l] holds the input of layer l (n x widths_[l]); activations[layers] the output.
    std::vector<std::vector<float>> activations(layers + 1);
    activations[0] = batch.x;
    for (std::size_t l = 0; l < layers; ++l) {
      const std::size_t in = widths_[l];
      const std::size_t out = widths_[l + 1];
      auto w = weights_[l]->value();
      auto b = biases_[l]->value();
      auto& a = activations[l];
      auto& z = activations[l + 1];
      z.assign(n * out, 0.0f);
      for (std::size_t s = 0; s < n; ++s) {
        for (std::size_t o = 0; o < out; ++o) {
          float sum = static_cast<float>(b[o]);
          for (std::size_t i = 0; i < in; ++i) {
            sum += static_cast<float>(w[o * in + i]) * a[s * in + i];
          }
          z[s * out + o] = l + 1 < layers ? std::tanh(sum) : sum;
        }
      }
    }

    const std::size_t outputs = this->outputs();
    const auto& prediction = activations[layers];
    double loss = 0.0;
    std::vector<float> delta(n * outputs);
    for (std::size_t k = 0; k < n * outputs; ++k) {
      const float error = prediction[k] - batch.y[k];
      loss += 0.5 * static_cast<double>(error) * static_cast<double>(error);
      delta[k] = static_cast<float>(scale) * error;
    }
    update_running_mean(prediction, n);

    for (std::size_t l = layers; l-- > 0;) {
      const std::size_t in = widths_[l];
      const std::size_t out = widths_[l + 1];
      const auto& a = activations[l];
      // This layer's gradients, summed over samples in order, then added to the arena.
      std::vector<float> dw(out * in, 0.0f);
      std::vector<float> db(out, 0.0f);
      for (std::size_t s = 0; s < n; ++s) {
        for (std::size_t o = 0; o < out; ++o) {
          const float d = delta[s * out + o];
          db[o] += d;
          for (std::size_t i = 0; i < in; ++i) dw[o * in + i] += d * a[s * in + i];
        }
      }
      accumulate(weights_[l]->grad(), dw);
      ready(*weights_[l]);
      accumulate(biases_[l]->grad(), db);
      ready(*biases_[l]);
      if (l == 0) break;
      // delta of the previous layer: (W^T delta) * tanh'(z) = (W^T delta) * (1 - a^2).
      auto w = weights_[l]->value();
      std::vector<float> previous(n * in, 0.0f);
      for (std::size_t s = 0; s < n; ++s) {
        for (std::size_t i = 0; i < in; ++i) {
          float sum = 0.0f;
          for (std::size_t o = 0; o < out; ++o) {
            sum += static_cast<float>(w[o * in + i]) * delta[s * out + o];
          }
          const float activation = a[s * in + i];
          previous[s * in + i] = sum * (1.0f - activation * activation);
        }
      }
      delta = std::move(previous);
    }
    return loss * scale;
  }

  double forward_backward(const Batch& batch, double scale) {
    return forward_backward(batch, scale, [](auto&) {});
  }

  /// Plain SGD over the whole arena in one pass: value -= lr * grad.
  void sgd_step(float lr) {
    auto v = params_.values();
    auto g = params_.grads();
    for (std::size_t i = 0; i < v.size(); ++i) {
      v[i] = T(static_cast<float>(v[i]) - lr * static_cast<float>(g[i]));
    }
  }

 private:
  static void accumulate(View<T> grad, const std::vector<float>& add) {
    for (std::size_t i = 0; i < grad.size(); ++i) {
      grad[i] = T(static_cast<float>(grad[i]) + add[i]);
    }
  }

  void update_running_mean(const std::vector<float>& prediction, std::size_t n) {
    if (n == 0) return;
    auto mean = running_mean_->value();
    const std::size_t outputs = this->outputs();
    for (std::size_t o = 0; o < outputs; ++o) {
      float sum = 0.0f;
      for (std::size_t s = 0; s < n; ++s) sum += prediction[s * outputs + o];
      const float batch_mean = sum / static_cast<float>(n);
      mean[o] = T(0.9f * static_cast<float>(mean[o]) + 0.1f * batch_mean);
    }
    auto count = batches_tracked_->value();
    count[0] = T(static_cast<float>(count[0]) + 1.0f);
  }

  std::vector<std::size_t> widths_;
  Parameters<T> params_;
  std::vector<typename Parameters<T>::Parameter*> weights_;
  std::vector<typename Parameters<T>::Parameter*> biases_;
  typename Parameters<T>::Parameter* running_mean_ = nullptr;
  typename Parameters<T>::Parameter* batches_tracked_ = nullptr;
};

}  // namespace tandem::test
