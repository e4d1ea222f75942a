// tandem/nn/sync_batch_norm.hpp - tandem::SyncBatchNorm: batch normalisation whose statistics
// span every rank of a communicator, computing what torch.nn.SyncBatchNorm computes.
//   tandem::SyncBatchNorm<tandem::LocalComm> bn(comm, 64);  bn.forward(x, y);  // x: {N, 64, H, W}
// Needs: the standard library and a Communicator over host memory (no device version yet).
//
// Inputs are contiguous (N, C, ...) tensors given as shaped Views; the dimensions after C are
// flattened. In training mode with more than one rank, forward computes each rank's per-channel
// mean, inverse standard deviation and count, all_gathers them (ranks with an empty batch send
// zeros and still take part), merges them with counts as torch's batch_norm_gather_stats kernel
// does, updates the running statistics (momentum, or the cumulative average when momentum is
// unset; running_var gets the unbiased variance) and normalises. backward all_reduces the
// per-channel [sum(dy), sum(dy * (x - mean))] and computes the input gradient; the weight and
// bias gradients are this rank's own (as in PyTorch: DDP averages them like any gradient) and
// accumulate (+=) like autograd's. Eval mode (with running statistics) and a world of one rank
// are plain batch norm with no communication. Every rank must call forward and backward together
// in training mode, as with any collective.
//
// Where it differs from PyTorch: the statistics travel as double (counts stay exact); the first
// synchronised forward checks once that every rank has the same num_features (a mismatch would
// otherwise be a mismatched all_gather, undefined on MPI and NCCL); fewer than 2 values per
// channel across all ranks is an Error on every rank (PyTorch raises only for one rank and
// otherwise stores a NaN running_var).
//
// Arithmetic: elements stay in T (float or double); every sum and per-channel statistic is kept
// in double, and each output element is computed in double and rounded once, so float results
// lie within an ulp or two of the exact values. The numeric passes are TANDEM_HD functors run
// through an executor, so that a device version needs device buffers and a segmented reduction
// rather than new arithmetic.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/error.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// torch.nn.SyncBatchNorm's constructor arguments, with its defaults.
struct SyncBatchNormOptions {
  double eps = 1e-5;
  /// The running statistics' update factor; std::nullopt: the cumulative moving average
  /// (factor 1 / num_batches_tracked), as momentum=None in PyTorch.
  std::optional<double> momentum = 0.1;
  /// Learnable per-channel weight (initially 1) and bias (initially 0).
  bool affine = true;
  /// Keep running_mean / running_var / num_batches_tracked and normalise with them in eval
  /// mode; without them, eval mode normalises with the batch's own statistics (no communication).
  bool track_running_stats = true;
};

namespace detail::batch_norm {

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

/// The sum of Term over the n-th plane of channel c; transform_reduce adds the planes up.
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

/// The ranges [a, a + n) and [b, b + m) share an element.
template <class T>
bool overlap(const T* a, std::size_t n, const T* b, std::size_t m) {
  if (n == 0 || m == 0) return false;
  return std::less<const T*>{}(a, b + m) && std::less<const T*>{}(b, a + n);
}

}  // namespace detail::batch_norm

/// Batch normalisation over (N, C, ...) inputs whose statistics span every rank of `Comm` in
/// training mode; see the top of this header. T is float or double. The module refers to the
/// communicator it is given, which must outlive it. Parameters and buffers live in the module's
/// own storage, or (second constructor) in a tandem::Parameters arena under PyTorch's names.
template <Communicator Comm, class T = float>
class SyncBatchNorm {
  static_assert(std::same_as<T, float> || std::same_as<T, double>,
                "tandem: SyncBatchNorm computes in float or double");
  static_assert(std::same_as<typename Comm::memory_space, host>,
                "tandem: SyncBatchNorm runs on host memory; a device version is not written yet");
  static_assert(supports_element<Comm, double>,
                "tandem: SyncBatchNorm exchanges its statistics as double");

 public:
  using value_type = T;
  using memory_space = host;
  /// What statistics, sums and each element's arithmetic are computed in.
  using accumulate_type = double;
  using executor_type = host_exec;

  /// A module with its own storage: weight 1, bias 0, running_mean 0, running_var 1.
  SyncBatchNorm(Comm& comm, std::int64_t num_features, SyncBatchNormOptions options = {})
      : comm_(&comm), channels_(check_features(comm, num_features)), options_(options) {
    check_options();
    const std::size_t c = channels_;
    storage_ = Buffer<T, host>(6 * c + 1);
    const Shape shape{num_features};
    T* base = storage_.data();
    if (options_.affine) {
      own_.weight = View<T, host>(base, shape);
      own_.bias = View<T, host>(base + c, shape);
      own_.grad_weight = View<T, host>(base + 2 * c, shape);
      own_.grad_bias = View<T, host>(base + 3 * c, shape);
    }
    if (options_.track_running_stats) {
      own_.running_mean = View<T, host>(base + 4 * c, shape);
      own_.running_var = View<T, host>(base + 5 * c, shape);
      own_.num_batches_tracked = View<T, host>(base + 6 * c, Shape{});
    }
    reset_parameters();
  }

  /// A module whose parameters live in `arena` (a tandem::Parameters<T, host> before finalize):
  /// registers PREFIX + "weight" and "bias" (trained, when affine) and "running_mean",
  /// "running_var" and "num_batches_tracked" (buffers, the last one BufferKind::integral, when
  /// tracking running statistics). The arena's storage starts zeroed: call reset_parameters()
  /// after Parameters::finalize() unless you load values into it. Using the module before
  /// finalize() is an Error.
  template <class Arena>
  requires requires(Arena& arena, std::string name, Shape shape) {
    requires std::same_as<typename Arena::value_type, T>;
    requires std::same_as<typename Arena::memory_space, host>;
    { arena.add(name, shape).value() } -> std::same_as<View<T, host>>;
    { arena.add(name, shape).grad() } -> std::same_as<View<T, host>>;
    arena.add_buffer(name, shape, arena.add(name, shape).kind());
  }
  SyncBatchNorm(Comm& comm, Arena& arena, const std::string& prefix, std::int64_t num_features,
                SyncBatchNormOptions options = {})
      : comm_(&comm), channels_(check_features(comm, num_features)), options_(options) {
    check_options();
    using Parameter = std::remove_cvref_t<decltype(arena.add(prefix, Shape{}))>;
    using Kind = decltype(std::declval<const Parameter&>().kind());
    const Shape shape{num_features};
    const Parameter* weight = nullptr;
    const Parameter* bias = nullptr;
    const Parameter* mean = nullptr;
    const Parameter* var = nullptr;
    const Parameter* tracked = nullptr;
    if (options_.affine) {
      weight = &arena.add(prefix + "weight", shape);
      bias = &arena.add(prefix + "bias", shape);
    }
    if (options_.track_running_stats) {
      mean = &arena.add_buffer(prefix + "running_mean", shape, Kind::floating);
      var = &arena.add_buffer(prefix + "running_var", shape, Kind::floating);
      tracked = &arena.add_buffer(prefix + "num_batches_tracked", Shape{}, Kind::integral);
    }
    // Parameter references stay valid for the arena's life; their storage exists only after
    // finalize(), so the views are looked up on every use.
    bind_ = [weight, bias, mean, var, tracked] {
      Slots slots;
      if (weight) {
        slots.weight = weight->value();
        slots.bias = bias->value();
        slots.grad_weight = weight->grad();
        slots.grad_bias = bias->grad();
      }
      if (mean) {
        slots.running_mean = mean->value();
        slots.running_var = var->value();
        slots.num_batches_tracked = tracked->value();
      }
      return slots;
    };
  }

  SyncBatchNorm(SyncBatchNorm&&) noexcept = default;
  SyncBatchNorm& operator=(SyncBatchNorm&&) noexcept = default;
  SyncBatchNorm(const SyncBatchNorm&) = delete;
  SyncBatchNorm& operator=(const SyncBatchNorm&) = delete;
  ~SyncBatchNorm() = default;

  /// Training mode (the default) normalises with the batch's statistics across ranks.
  void train(bool on = true) noexcept { training_ = on; }
  void eval() noexcept { training_ = false; }
  [[nodiscard]] bool training() const noexcept { return training_; }

  [[nodiscard]] std::int64_t num_features() const noexcept {
    return static_cast<std::int64_t>(channels_);
  }
  [[nodiscard]] const SyncBatchNormOptions& options() const noexcept { return options_; }
  [[nodiscard]] Comm& communicator() const noexcept { return *comm_; }

  /// Normalises `input` (shape (N, C, ...), N may be 0) into `output` (the same shape, not
  /// overlapping the input). Collective in training mode on more than one rank.
  void forward(View<const T, host> input, View<T, host> output) {
    const Slots slots = this->slots();
    const auto layout = check_input("forward", input.shape());
    if (!(output.shape() == input.shape())) {
      fail("forward", "output shape " + output.shape().to_string() + " differs from input shape " +
                          input.shape().to_string());
    }
    if (detail::batch_norm::overlap<T>(input.data(), input.size(), output.data(), output.size())) {
      fail("forward", "output overlaps the input, which backward needs unchanged");
    }

    const bool batch_statistics = training_ || !options_.track_running_stats;
    const bool update_running = training_ && options_.track_running_stats;
    Mode mode = Mode::running;
    if (batch_statistics) mode = training_ && comm_->size() > 1 ? Mode::sync : Mode::local;

    saved_mode_ = Mode::none;  // a failure below leaves nothing for backward
    double count = 0;
    if (mode == Mode::running) {
      for (std::size_t c = 0; c < channels_; ++c) {
        mean_[c] = static_cast<double>(slots.running_mean[c]);
        invstd_[c] = 1.0 / std::sqrt(static_cast<double>(slots.running_var[c]) + options_.eps);
      }
    } else {
      Buffer<double, host> variance(channels_);
      count = mode == Mode::sync ? gather_statistics(input.data(), layout, variance)
                                 : local_statistics(input.data(), layout, variance);
      if (count < 2) {
        fail("forward",
             "expected more than 1 value per channel when training, got " +
                 std::to_string(static_cast<std::int64_t>(count)) +
                 (mode == Mode::sync ? " across " + std::to_string(comm_->size()) + " ranks"
                                     : " in input of shape " + input.shape().to_string()));
      }
      for (std::size_t c = 0; c < channels_; ++c) {
        invstd_[c] = 1.0 / std::sqrt(variance[c] + options_.eps);
      }
      if (update_running) update_running_statistics(slots, variance, count);
    }

    Buffer<double, host> scale(channels_);
    Buffer<double, host> shift(channels_);
    for (std::size_t c = 0; c < channels_; ++c) {
      scale[c] = invstd_[c] * (options_.affine ? static_cast<double>(slots.weight[c]) : 1.0);
      shift[c] = options_.affine ? static_cast<double>(slots.bias[c]) : 0.0;
    }
    for_each_index(
        executor_type{}, layout.planes(),
        detail::batch_norm::normalize<T, double>{input.data(), output.data(), mean_.data(),
                                                 scale.data(), shift.data(), layout});
    saved_shape_ = input.shape();
    saved_mode_ = mode;
    total_count_ = count;
  }

  /// Gradients for the last forward: writes d loss / d input into grad_input and adds this
  /// rank's d loss / d weight and d loss / d bias to grad_weight() and grad_bias() (when affine).
  /// `input` is the last forward's input, unchanged; grad_output and grad_input have its shape
  /// (grad_input may be grad_output itself). Collective when that forward was.
  void backward(View<const T, host> input, View<const T, host> grad_output,
                View<T, host> grad_input) {
    const Slots slots = this->slots();
    if (saved_mode_ == Mode::none) {
      fail("backward", "no forward to differentiate (a failed forward leaves none)");
    }
    const auto layout = check_input("backward", input.shape());
    if (!(input.shape() == saved_shape_)) {
      fail("backward", "input shape " + input.shape().to_string() +
                           " differs from the last forward's " + saved_shape_.to_string());
    }
    if (!(grad_output.shape() == input.shape()) || !(grad_input.shape() == input.shape())) {
      fail("backward", "grad_output " + grad_output.shape().to_string() + " and grad_input " +
                           grad_input.shape().to_string() + " must have the input's shape " +
                           input.shape().to_string());
    }

    // [sum(dy) | sum(dy * (x - mean))] per channel: this rank's, then (sync) every rank's.
    Buffer<double, host> sums(2 * channels_);
    const executor_type exec{};
    for (std::size_t c = 0; c < channels_ && layout.count() > 0; ++c) {
      using pair = detail::batch_norm::sum_pair<double>;
      const pair both =
          transform_reduce(exec, layout.batch, pair{},
                           detail::batch_norm::plane_sum<pair, gradient_terms>{
                               {grad_output.data(), input.data(), mean_[c]}, layout, c},
                           plus_combine{});
      sums[c] = both.first;
      sums[channels_ + c] = both.second;
    }
    // The collective first, so that a failed one leaves the gradients as they were.
    Buffer<double, host> global(2 * channels_);
    if (saved_mode_ == Mode::sync) {
      comm_->all_reduce(std::as_const(sums).view(), global.view(), ReduceOp::sum);
    } else {
      std::copy(sums.begin(), sums.end(), global.begin());
    }
    if (options_.affine) {
      // This rank's own gradients, as torch's batch_norm_backward_reduce gives them.
      for (std::size_t c = 0; c < channels_; ++c) {
        slots.grad_weight[c] = static_cast<T>(static_cast<double>(slots.grad_weight[c]) +
                                              sums[channels_ + c] * invstd_[c]);
        slots.grad_bias[c] = static_cast<T>(static_cast<double>(slots.grad_bias[c]) + sums[c]);
      }
    }

    Buffer<double, host> grad_mean(channels_);
    Buffer<double, host> projection(channels_);
    Buffer<double, host> scale(channels_);
    for (std::size_t c = 0; c < channels_; ++c) {
      if (saved_mode_ != Mode::running) {
        grad_mean[c] = global[c] / total_count_;
        projection[c] = global[channels_ + c] / total_count_ * invstd_[c] * invstd_[c];
      }
      scale[c] = invstd_[c] * (options_.affine ? static_cast<double>(slots.weight[c]) : 1.0);
    }
    for_each_index(exec, layout.planes(),
                   detail::batch_norm::input_gradient<T, double>{
                       grad_output.data(), input.data(), grad_input.data(), mean_.data(),
                       grad_mean.data(), projection.data(), scale.data(), layout});
  }

  /// Sets grad_weight and grad_bias to zero (a Parameters arena's zero_grad() does it too).
  void zero_grad() {
    const Slots slots = this->slots();
    std::fill(slots.grad_weight.begin(), slots.grad_weight.end(), T{});
    std::fill(slots.grad_bias.begin(), slots.grad_bias.end(), T{});
  }

  /// weight = 1, bias = 0 and reset_running_stats(), as PyTorch's reset_parameters().
  void reset_parameters() {
    const Slots slots = this->slots();
    std::fill(slots.weight.begin(), slots.weight.end(), T{1});
    std::fill(slots.bias.begin(), slots.bias.end(), T{});
    reset_running_stats();
  }

  /// running_mean = 0, running_var = 1, num_batches_tracked = 0.
  void reset_running_stats() {
    const Slots slots = this->slots();
    std::fill(slots.running_mean.begin(), slots.running_mean.end(), T{});
    std::fill(slots.running_var.begin(), slots.running_var.end(), T{1});
    std::fill(slots.num_batches_tracked.begin(), slots.num_batches_tracked.end(), T{});
  }

  /// The parameters, their gradients and the buffers, shaped {C} (num_batches_tracked: {}).
  /// An Error naming the option when affine or track_running_stats is off.
  [[nodiscard]] View<T, host> weight() const { return need_affine("weight").weight; }
  [[nodiscard]] View<T, host> bias() const { return need_affine("bias").bias; }
  [[nodiscard]] View<T, host> grad_weight() const { return need_affine("grad_weight").grad_weight; }
  [[nodiscard]] View<T, host> grad_bias() const { return need_affine("grad_bias").grad_bias; }
  [[nodiscard]] View<T, host> running_mean() const {
    return need_running("running_mean").running_mean;
  }
  [[nodiscard]] View<T, host> running_var() const {
    return need_running("running_var").running_var;
  }
  [[nodiscard]] std::int64_t num_batches_tracked() const {
    return static_cast<std::int64_t>(need_running("num_batches_tracked").num_batches_tracked[0]);
  }

 private:
  /// How the last forward normalised: nothing to differentiate yet, with statistics across
  /// ranks, with this rank's batch alone, or with the running statistics.
  enum class Mode { none, sync, local, running };

  using value_term = detail::batch_norm::value_term<T, double>;
  using deviation_term = detail::batch_norm::squared_deviation_term<T, double>;
  using gradient_terms = detail::batch_norm::gradient_terms<T, double>;

  /// Views of the parameters and buffers; empty when the option that keeps them is off.
  struct Slots {
    View<T, host> weight, bias, grad_weight, grad_bias;
    View<T, host> running_mean, running_var, num_batches_tracked;
  };

  static std::size_t check_features(const Comm& comm, std::int64_t num_features) {
    if (num_features < 1) {
      throw Error(comm.rank(), "SyncBatchNorm::SyncBatchNorm",
                  "num_features must be at least 1, not " + std::to_string(num_features));
    }
    return static_cast<std::size_t>(num_features);
  }

  void check_options() const {
    if (!(options_.eps > 0.0) || !std::isfinite(options_.eps)) {
      fail("SyncBatchNorm", "eps must be positive and finite, not " + std::to_string(options_.eps));
    }
    if (options_.momentum && !std::isfinite(*options_.momentum)) {
      fail("SyncBatchNorm", "momentum must be finite (std::nullopt for the cumulative average)");
    }
  }

  [[noreturn]] void fail(const char* operation, const std::string& cause) const {
    throw Error(comm_->rank(), std::string("SyncBatchNorm::") + operation, cause);
  }

  Slots slots() const { return bind_ ? bind_() : own_; }

  Slots need_affine(const char* what) const {
    if (!options_.affine) fail(what, "affine is off: there is no weight, bias or their gradient");
    return slots();
  }
  Slots need_running(const char* what) const {
    if (!options_.track_running_stats) {
      fail(what, "track_running_stats is off: there are no running statistics");
    }
    return slots();
  }

  detail::batch_norm::Layout check_input(const char* operation, const Shape& shape) const {
    if (shape.rank() < 2) {
      fail(operation, "expected an (N, C, ...) input of at least 2 dimensions, got shape " +
                          shape.to_string() + " (pass a shaped View)");
    }
    if (static_cast<std::size_t>(shape[1]) != channels_) {
      fail(operation, "input of shape " + shape.to_string() + " has " + std::to_string(shape[1]) +
                          " channels, this SyncBatchNorm has " + std::to_string(channels_));
    }
    detail::batch_norm::Layout layout;
    layout.batch = static_cast<std::size_t>(shape[0]);
    layout.channels = channels_;
    for (std::size_t d = 2; d < shape.rank(); ++d)
      layout.inner *= static_cast<std::size_t>(shape[d]);
    return layout;
  }

  /// This rank's per-channel mean (into mean_) and biased variance; returns the count per channel.
  double local_statistics(const T* x, const detail::batch_norm::Layout& layout,
                          Buffer<double, host>& variance) {
    const executor_type exec{};
    if (layout.count() == 0) return 0;
    const auto count = static_cast<double>(layout.count());
    for (std::size_t c = 0; c < channels_; ++c) {
      // Two passes in double: the mean, then the squared deviations from it.
      mean_[c] = transform_reduce(exec, layout.batch, 0.0,
                                  detail::batch_norm::plane_sum<double, value_term>{{x}, layout, c},
                                  plus_combine{}) /
                 count;
      variance[c] = transform_reduce(exec, layout.batch, 0.0,
                                     detail::batch_norm::plane_sum<double, deviation_term>{
                                         {x, mean_[c]}, layout, c},
                                     plus_combine{}) /
                    count;
    }
    return count;
  }

  /// Every rank's statistics merged: mean_ and the biased variance across ranks; returns the
  /// total count per channel. Each rank sends [mean (C) | invstd (C) | count] as torch does, an
  /// empty batch sending zeros, and merges in rank order skipping empty ranks.
  double gather_statistics(const T* x, const detail::batch_norm::Layout& layout,
                           Buffer<double, host>& variance) {
    agree_on_channels();
    const std::size_t c_count = channels_;
    const std::size_t record = 2 * c_count + 1;
    const auto world = static_cast<std::size_t>(comm_->size());
    Buffer<double, host> mine(record);
    const double count = local_statistics(x, layout, variance);
    if (count > 0) {
      for (std::size_t c = 0; c < c_count; ++c) {
        mine[c] = mean_[c];
        mine[c_count + c] = 1.0 / std::sqrt(variance[c] + options_.eps);
      }
      mine[2 * c_count] = count;
    }
    Buffer<double, host> all(world * record);
    comm_->all_gather(std::as_const(mine).view(), all.view());

    // batch_norm_reduce_statistics_kernel: Welford's parallel merge, one rank at a time.
    double total = 0;
    for (std::size_t c = 0; c < c_count; ++c) {
      double mean = 0;
      double m2 = 0;  // sum of squared deviations
      double n = 0;
      for (std::size_t r = 0; r < world; ++r) {
        const double* theirs = all.data() + r * record;
        const double rank_count = theirs[2 * c_count];
        if (!(rank_count >= 1)) continue;
        const double rank_mean = theirs[c];
        const double rank_std = 1.0 / theirs[c_count + c];
        const double rank_m2 = (rank_std * rank_std - options_.eps) * rank_count;
        const double factor = 1.0 / (n + rank_count);
        const double delta = mean - rank_mean;
        m2 += rank_m2 + delta * delta * n * rank_count * factor;
        mean = n * factor * mean + rank_count * factor * rank_mean;
        n += rank_count;
      }
      mean_[c] = mean;
      // var = 1/invstd^2 - eps can come back a hair below zero for a constant channel.
      variance[c] = n > 0 ? std::max(0.0, m2 / n) : 0.0;
      total = n;
    }
    return total;
  }

  /// Once per module: every rank's num_features must agree, or the all_gather above would be
  /// a mismatched collective (undefined on MPI and NCCL). Later calls cost nothing.
  void agree_on_channels() {
    if (agreed_) return;
    const auto world = static_cast<std::size_t>(comm_->size());
    Buffer<double, host> mine(1);
    mine[0] = static_cast<double>(channels_);
    Buffer<double, host> all(world);
    comm_->all_gather(std::as_const(mine).view(), all.view());
    for (std::size_t r = 0; r < world; ++r) {
      if (all[r] != mine[0]) {
        fail("forward", "ranks disagree on the number of channels: rank " + std::to_string(r) +
                            " has " + std::to_string(static_cast<std::int64_t>(all[r])) +
                            ", rank " + std::to_string(comm_->rank()) + " (this one) has " +
                            std::to_string(channels_));
      }
    }
    agreed_ = true;
  }

  void update_running_statistics(const Slots& slots, const Buffer<double, host>& variance,
                                 double count) {
    const auto tracked = static_cast<double>(slots.num_batches_tracked[0]) + 1.0;
    const double factor = options_.momentum ? *options_.momentum : 1.0 / tracked;
    const double unbiased = count / (count - 1.0);
    for (std::size_t c = 0; c < channels_; ++c) {
      slots.running_mean[c] = static_cast<T>(
          (1.0 - factor) * static_cast<double>(slots.running_mean[c]) + factor * mean_[c]);
      slots.running_var[c] =
          static_cast<T>((1.0 - factor) * static_cast<double>(slots.running_var[c]) +
                         factor * variance[c] * unbiased);
    }
    slots.num_batches_tracked[0] = static_cast<T>(tracked);
  }

  Comm* comm_;
  std::size_t channels_;
  SyncBatchNormOptions options_;
  bool training_ = true;
  bool agreed_ = false;

  Buffer<T, host> storage_;  // own storage: weight, bias, their grads, running stats, counter
  Slots own_;
  std::function<Slots()> bind_;  // set for a module in a Parameters arena

  // What backward needs from the last forward (torch saves the same).
  Mode saved_mode_ = Mode::none;
  Shape saved_shape_;
  Buffer<double, host> mean_ = Buffer<double, host>(channels_);
  Buffer<double, host> invstd_ = Buffer<double, host>(channels_);
  double total_count_ = 0;
};

}  // namespace tandem
