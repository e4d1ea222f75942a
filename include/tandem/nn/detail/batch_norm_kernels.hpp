// tandem/nn/detail/batch_norm_kernels.hpp - tandem::SyncBatchNorm's per-channel and per-plane
// kernels on its tensors: this rank's moments, the affine coefficients, normalisation and the
// input gradient; TANDEM_HD functors run through an executor, the same code on the host and on a
// GPU. What both SyncBatchNorms share (wire format, merge, checks, running update): in
// sync_statistics.hpp, which this header brings.
//   for_each_index(exec, planes, detail::batch_norm::normalize<T, double>{...});
// Needs: tandem/tensor; included by nn/sync_batch_norm.hpp, not by users.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "tandem/core/config.hpp"
#include "tandem/nn/detail/sync_statistics.hpp"
#include "tandem/tensor/detail/scalar_math.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::detail::batch_norm {

/// A contiguous (N, C, inner...) tensor as N * C planes of `inner` contiguous elements: plane
/// p = n * C + c starts at element p * inner and belongs to channel c. The functors below work a
/// plane at a time, so the innermost loops are contiguous and free of index divisions.
struct Layout {
  std::size_t batch = 0;
  std::size_t channels = 0;
  std::size_t inner = 1;

  /// Elements per channel.
  [[nodiscard]] TANDEM_HD std::size_t count() const { return batch * inner; }
  [[nodiscard]] TANDEM_HD std::size_t planes() const { return batch * channels; }
  [[nodiscard]] TANDEM_HD std::size_t numel() const { return batch * channels * inner; }
  [[nodiscard]] TANDEM_HD std::size_t plane_start(std::size_t n, std::size_t c) const {
    return (n * channels + c) * inner;
  }
};

/// term(start) + ... + term(start + count - 1) in four interleaved partial sums: the additions
/// overlap instead of waiting on each other, and the order is still fixed (deterministic).
template <class Acc, class Term>
TANDEM_HD Acc interleaved_sum(std::size_t start, std::size_t count, const Term& term) {
  Acc partial[4] = {Acc{}, Acc{}, Acc{}, Acc{}};
  std::size_t i = start;
  const std::size_t end = start + count;
  for (; i + 4 <= end; i += 4) {
    partial[0] += term(i);
    partial[1] += term(i + 1);
    partial[2] += term(i + 2);
    partial[3] += term(i + 3);
  }
  for (; i < end; ++i) partial[0] += term(i);
  return (partial[0] + partial[1]) + (partial[2] + partial[3]);
}

/// x[i], as Acc.
template <class T, class Acc>
struct value_term {
  const T* x;
  TANDEM_HD Acc operator()(std::size_t i) const { return static_cast<Acc>(x[i]); }
};

/// (x[i] - mean)^2.
template <class T, class Acc>
struct squared_deviation_term {
  const T* x;
  Acc mean;
  TANDEM_HD Acc operator()(std::size_t i) const {
    const Acc d = static_cast<Acc>(x[i]) - mean;
    return d * d;
  }
};

/// Two sums carried through one pass.
template <class Acc>
struct sum_pair {
  Acc first{};
  Acc second{};
  TANDEM_HD sum_pair& operator+=(const sum_pair& other) {
    first += other.first;
    second += other.second;
    return *this;
  }
  TANDEM_HD friend sum_pair operator+(sum_pair a, const sum_pair& b) { return a += b; }
};

/// {dy[i], dy[i] * (x[i] - mean)}: backward's two sums in one pass.
template <class T, class Acc>
struct gradient_terms {
  const T* grad_output;
  const T* x;
  Acc mean;
  TANDEM_HD sum_pair<Acc> operator()(std::size_t i) const {
    const Acc dy = static_cast<Acc>(grad_output[i]);
    return {dy, dy * (static_cast<Acc>(x[i]) - mean)};
  }
};

/// The sum of Term over the n-th plane of channel c; the per-channel passes add the planes up.
template <class Acc, class Term>
struct plane_sum {
  Term term;
  Layout layout;
  std::size_t c;
  TANDEM_HD Acc operator()(std::size_t n) const {
    return interleaved_sum<Acc>(layout.plane_start(n, c), layout.inner, term);
  }
};

/// Plane p of y = (x - mean) * scale + shift, with scale = invstd * weight and shift = bias.
template <class T, class Acc>
struct normalize {
  const T* x;
  T* y;
  const Acc* mean;
  const Acc* scale;
  const Acc* shift;
  Layout layout;
  TANDEM_HD void operator()(std::size_t p) const {
    const std::size_t c = p % layout.channels;
    const Acc m = mean[c];
    const Acc k = scale[c];
    const Acc b = shift[c];
    for (std::size_t i = p * layout.inner; i < (p + 1) * layout.inner; ++i) {
      y[i] = static_cast<T>((static_cast<Acc>(x[i]) - m) * k + b);
    }
  }
};

/// Plane p of dx = (dy - grad_mean - (x - mean) * projection) * scale: torch's
/// batch_norm_backward_elemt with grad_mean = sum(dy) / n, projection = sum(dy * (x - mean)) /
/// n * invstd^2 and scale = invstd * weight (grad_mean = projection = 0 when the statistics are
/// constants, as in eval mode).
template <class T, class Acc>
struct input_gradient {
  const T* grad_output;
  const T* x;
  T* grad_input;
  const Acc* mean;
  const Acc* grad_mean;
  const Acc* projection;
  const Acc* scale;
  Layout layout;
  TANDEM_HD void operator()(std::size_t p) const {
    const std::size_t c = p % layout.channels;
    const Acc m = mean[c];
    const Acc g = grad_mean[c];
    const Acc q = projection[c];
    const Acc k = scale[c];
    for (std::size_t i = p * layout.inner; i < (p + 1) * layout.inner; ++i) {
      const Acc centred = static_cast<Acc>(x[i]) - m;
      grad_input[i] = static_cast<T>((static_cast<Acc>(grad_output[i]) - g - centred * q) * k);
    }
  }
};

/// data[i] = value.
template <class T>
struct fill {
  T* data;
  T value;
  TANDEM_HD void operator()(std::size_t i) const { data[i] = value; }
};

/// Channel c's mean, biased variance and inverse standard deviation over this rank's batch: two
/// passes (the mean, then the squared deviations from it), planes in order. An empty batch gives
/// zeros, which is what an empty rank's all_gather record holds (sync_statistics.hpp's Wire).
/// Index 0 also writes the count per channel into *count_out when it is set; variance and invstd
/// may be null.
template <class T, class Acc>
struct channel_moments {
  const T* x;
  Layout layout;
  Acc eps;
  Acc* mean;
  Acc* variance;
  Acc* invstd;
  Acc* count_out;
  TANDEM_HD void operator()(std::size_t c) const {
    const auto count = static_cast<Acc>(layout.count());
    if (c == 0 && count_out != nullptr) *count_out = count;
    if (layout.count() == 0) {
      mean[c] = Acc{};
      if (variance != nullptr) variance[c] = Acc{};
      if (invstd != nullptr) invstd[c] = Acc{};
      return;
    }
    const plane_sum<Acc, value_term<T, Acc>> values{{x}, layout, c};
    Acc sum{};
    for (std::size_t n = 0; n < layout.batch; ++n) sum = sum + values(n);
    const Acc m = sum / count;
    const plane_sum<Acc, squared_deviation_term<T, Acc>> deviations{{x, m}, layout, c};
    Acc squares{};
    for (std::size_t n = 0; n < layout.batch; ++n) squares = squares + deviations(n);
    const Acc v = squares / count;
    mean[c] = m;
    if (variance != nullptr) variance[c] = v;
    if (invstd != nullptr) invstd[c] = Acc{1} / square_root(static_cast<double>(v + eps));
  }
};

/// Channel c's statistics taken from the running ones (eval mode).
template <class T, class Acc>
struct running_statistics {
  const T* running_mean;
  const T* running_var;
  Acc eps;
  Acc* mean;
  Acc* invstd;
  TANDEM_HD void operator()(std::size_t c) const {
    mean[c] = static_cast<Acc>(running_mean[c]);
    invstd[c] = Acc{1} / square_root(static_cast<double>(static_cast<Acc>(running_var[c]) + eps));
  }
};

/// normalize's per-channel scale = invstd * weight and shift = bias (weight and bias are null
/// without affine: scale invstd, shift 0).
template <class T, class Acc>
struct affine_coefficients {
  const Acc* invstd;
  const T* weight;
  const T* bias;
  Acc* scale;
  Acc* shift;
  TANDEM_HD void operator()(std::size_t c) const {
    scale[c] = invstd[c] * (weight != nullptr ? static_cast<Acc>(weight[c]) : Acc{1});
    shift[c] = bias != nullptr ? static_cast<Acc>(bias[c]) : Acc{};
  }
};

/// Channel c's [sum(dy) | sum(dy * (x - mean))] over this rank's batch, planes in order, into
/// sums[c] and sums[C + c].
template <class T, class Acc>
struct channel_gradient_sums {
  const T* grad_output;
  const T* x;
  const Acc* mean;
  Layout layout;
  Acc* sums;
  TANDEM_HD void operator()(std::size_t c) const {
    using pair = sum_pair<Acc>;
    const plane_sum<pair, gradient_terms<T, Acc>> terms{{grad_output, x, mean[c]}, layout, c};
    pair total{};
    for (std::size_t n = 0; n < layout.batch; ++n) total = total + terms(n);
    sums[c] = total.first;
    sums[layout.channels + c] = total.second;
  }
};

/// Channel c's part of backward: adds this rank's weight and bias gradients (torch's
/// batch_norm_backward_reduce: grad_weight += sum(dy * (x - mean)) * invstd, grad_bias +=
/// sum(dy); both null without affine) and writes input_gradient's grad_mean, projection and scale
/// from the sums of every rank (`global`; grad_mean = projection = 0 when the statistics were
/// constants, as in eval mode).
template <class T, class Acc>
struct backward_coefficients {
  const Acc* local;
  const Acc* global;
  const Acc* invstd;
  const T* weight;
  T* grad_weight;
  T* grad_bias;
  std::size_t channels;
  bool batch_statistics;
  Acc total;
  Acc* grad_mean;
  Acc* projection;
  Acc* scale;
  TANDEM_HD void operator()(std::size_t c) const {
    if (grad_weight != nullptr) {
      grad_weight[c] =
          static_cast<T>(static_cast<Acc>(grad_weight[c]) + local[channels + c] * invstd[c]);
      grad_bias[c] = static_cast<T>(static_cast<Acc>(grad_bias[c]) + local[c]);
    }
    grad_mean[c] = batch_statistics ? global[c] / total : Acc{};
    projection[c] = batch_statistics ? global[channels + c] / total * invstd[c] * invstd[c] : Acc{};
    scale[c] = invstd[c] * (weight != nullptr ? static_cast<Acc>(weight[c]) : Acc{1});
  }
};

/// The ranges [a, a + n) and [b, b + m) share an element (compares addresses only).
template <class T>
bool overlap(const T* a, std::size_t n, const T* b, std::size_t m) {
  if (n == 0 || m == 0) return false;
  return std::less<const T*>{}(a, b + m) && std::less<const T*>{}(b, a + n);
}

}  // namespace tandem::detail::batch_norm
