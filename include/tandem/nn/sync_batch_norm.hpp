// tandem/nn/sync_batch_norm.hpp - tandem::SyncBatchNorm: batch normalisation whose statistics
// span every rank of a communicator, computing what torch.nn.SyncBatchNorm computes.
//   tandem::SyncBatchNorm<tandem::LocalComm> bn(comm, 64);  bn.forward(x, y);  // x: {N, 64, H, W}
// Needs: the standard library and a Communicator; device memory needs tandem/cuda.hpp (nvcc).
// Inputs are contiguous (N, C, ...) tensors given as shaped Views (dimensions after C flattened).
// How it works, where it differs from PyTorch, its arithmetic and memory spaces: docs/ddp.md,
// "SyncBatchNorm in detail". Its per-channel kernels: nn/detail/batch_norm_kernels.hpp; the core
// it shares with tandem::torch::SyncBatchNorm (wire format, merge, checks, commit):
// nn/detail/sync_statistics.hpp.
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
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/error.hpp"
#include "tandem/nn/detail/batch_norm_kernels.hpp"
#include "tandem/tensor/detail/scalar_math.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// torch.nn.SyncBatchNorm's constructor arguments, with its defaults.
struct SyncBatchNormOptions {
  /// Added to the variance before its square root, as eps in PyTorch.
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

namespace detail::join {
struct access;  // tandem::Join's way to the hooks below (ddp/join.hpp)
}  // namespace detail::join

/// Batch normalisation over (N, C, ...) inputs whose statistics span every rank of `Comm` in
/// training mode; see the top of this header. T is float or double; Space is host or device (or
/// any memory space with an executor Exec and space_copy to the host: only Exec touches its
/// memory, apart from the few values read back). The module refers to the communicator it is
/// given, which must outlive it. Parameters and buffers live in the module's
/// own storage, or (second constructor) in a tandem::Parameters arena under PyTorch's names.
template <Communicator Comm, class T = float, memory_space Space = typename Comm::memory_space,
          class Exec = default_executor_t<Space>>
class SyncBatchNorm {
  static_assert(std::same_as<T, float> || std::same_as<T, double>,
                "tandem: SyncBatchNorm computes in float or double");
  static_assert(ExecutorFor<Exec, Space>,
                "tandem: SyncBatchNorm's executor must run where its memory space is "
                "(host_exec for host memory, cuda_exec for device memory)");
  static_assert(std::same_as<typename Comm::memory_space, Space> ||
                    host_accessible<typename Comm::memory_space>,
                "tandem: this communicator does not take SyncBatchNorm's tensors (a device "
                "communicator such as NcclComm takes device memory only; host communicators "
                "take device tensors by staging them through pinned memory)");
  static_assert(supports_element<Comm, double>,
                "tandem: SyncBatchNorm exchanges its statistics as double");

 public:
  /// The element type of the input, the output, the parameters and the buffers.
  using value_type = T;
  /// The memory space they live in (host, or a device space).
  using memory_space = Space;
  /// What statistics, sums and each element's arithmetic are computed in.
  using accumulate_type = double;
  /// The executor that runs every pass (see executor()).
  using executor_type = Exec;

  /// A module with its own storage: weight 1, bias 0, running_mean 0, running_var 1. On a device
  /// the constructor waits for that initialisation, so the parameters can be written at once
  /// from any stream (tandem::copy, say).
  SyncBatchNorm(Comm& comm, std::int64_t num_features, SyncBatchNormOptions options = {},
                Exec exec = {})
      : comm_(&comm),
        channels_(check_features(comm, num_features)),
        options_(options),
        exec_(std::move(exec)) {
    check_options();
    const std::size_t c = channels_;
    storage_ = Buffer<T, Space>(6 * c + 1);
    const Shape shape{num_features};
    T* base = storage_.data();
    if (options_.affine) {
      own_.weight = View<T, Space>(base, shape);
      own_.bias = View<T, Space>(base + c, shape);
      own_.grad_weight = View<T, Space>(base + 2 * c, shape);
      own_.grad_bias = View<T, Space>(base + 3 * c, shape);
    }
    if (options_.track_running_stats) {
      own_.running_mean = View<T, Space>(base + 4 * c, shape);
      own_.running_var = View<T, Space>(base + 5 * c, shape);
      own_.num_batches_tracked = View<T, Space>(base + 6 * c, Shape{});
    }
    reset_parameters();
    zero_grad();  // device memory does not start zeroed
    exec_.synchronize();
  }

  /// A module whose parameters live in `arena` (a tandem::Parameters<T, Space> before finalize):
  /// registers PREFIX + "weight" and "bias" (trained, when affine) and "running_mean",
  /// "running_var" and "num_batches_tracked" (buffers, the last one BufferKind::integral, when
  /// tracking running statistics). The arena's storage starts zeroed on the host (on a device,
  /// unset): call reset_parameters() after Parameters::finalize() unless you load values into
  /// it. Using the module before finalize() is an Error.
  template <class Arena>
  requires requires(Arena& arena, std::string name, Shape shape) {
    requires std::same_as<typename Arena::value_type, T>;
    requires std::same_as<typename Arena::memory_space, Space>;
    { arena.add(name, shape).value() } -> std::same_as<View<T, Space>>;
    { arena.add(name, shape).grad() } -> std::same_as<View<T, Space>>;
    arena.add_buffer(name, shape, arena.add(name, shape).kind());
  }
  SyncBatchNorm(Comm& comm, Arena& arena, const std::string& prefix, std::int64_t num_features,
                SyncBatchNormOptions options = {}, Exec exec = {})
      : comm_(&comm),
        channels_(check_features(comm, num_features)),
        options_(options),
        exec_(std::move(exec)) {
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

  /// Moves the module; its views stay valid (the storage does not move).
  SyncBatchNorm(SyncBatchNorm&&) noexcept = default;
  /// Moves the module; its views stay valid (the storage does not move).
  SyncBatchNorm& operator=(SyncBatchNorm&&) noexcept = default;
  SyncBatchNorm(const SyncBatchNorm&) = delete;
  SyncBatchNorm& operator=(const SyncBatchNorm&) = delete;
  ~SyncBatchNorm() = default;

  /// Training mode (the default) normalises with the batch's statistics across ranks.
  void train(bool on = true) noexcept { training_ = on; }
  /// Evaluation mode: normalises with the running statistics, like train(false).
  void eval() noexcept { training_ = false; }
  /// True in training mode.
  [[nodiscard]] bool training() const noexcept { return training_; }

  /// Number of channels, C.
  [[nodiscard]] std::int64_t num_features() const noexcept {
    return static_cast<std::int64_t>(channels_);
  }
  /// The options it was made with.
  [[nodiscard]] const SyncBatchNormOptions& options() const noexcept { return options_; }
  /// The communicator the statistics are reduced over.
  [[nodiscard]] Comm& communicator() const noexcept { return *comm_; }
  /// Where every pass runs (on a device: its stream).
  [[nodiscard]] const Exec& executor() const noexcept { return exec_; }

  /// Normalises `input` (shape (N, C, ...), N may be 0) into `output` (the same shape, not
  /// overlapping the input). Collective in training mode on more than one rank. A forward that
  /// throws (a failed collective, too few values) leaves the running statistics and
  /// num_batches_tracked as they were, and nothing for backward.
  void forward(View<const T, Space> input, View<T, Space> output) {
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
      for_each_index(exec_, channels_,
                     detail::batch_norm::running_statistics<T, double>{
                         slots.running_mean.data(), slots.running_var.data(), options_.eps,
                         mean_.data(), invstd_.data()});
    } else {
      auto variance = scratch<double>(channels_);
      if (mode == Mode::sync && join_record_) join_record_(join_forward, 0);
      count = mode == Mode::sync ? gather_statistics(input.data(), layout, variance.data())
                                 : local_statistics(input.data(), layout, variance.data());
      detail::batch_norm::check_values_per_channel(
          comm_->rank(), count,
          mode == Mode::sync ? " across " + std::to_string(comm_->size()) + " ranks"
                             : " in input of shape " + input.shape().to_string());
      // The commit (sync_statistics.hpp): every collective and check of this step has passed.
      if (update_running) {
        detail::batch_norm::commit_step(exec_, channels_, slots.running_mean.data(),
                                        slots.running_var.data(), slots.num_batches_tracked.data(),
                                        mean_.data(), variance.data(), options_.momentum, count);
      }
    }

    auto coefficients = scratch<double>(2 * channels_);  // [scale | shift]
    double* scale = coefficients.data();
    double* shift = coefficients.data() + channels_;
    for_each_index(exec_, channels_,
                   detail::batch_norm::affine_coefficients<T, double>{
                       invstd_.data(), slots.weight.data(), slots.bias.data(), scale, shift});
    for_each_index(exec_, layout.planes(),
                   detail::batch_norm::normalize<T, double>{input.data(), output.data(),
                                                            mean_.data(), scale, shift, layout});
    saved_shape_ = input.shape();
    saved_mode_ = mode;
    total_count_ = count;
  }

  /// Gradients for the last forward: writes d loss / d input into grad_input and adds this
  /// rank's d loss / d weight and d loss / d bias to grad_weight() and grad_bias() (when affine).
  /// `input` is the last forward's input, unchanged; grad_output and grad_input have its shape
  /// (grad_input may be grad_output itself). Collective when that forward was.
  void backward(View<const T, Space> input, View<const T, Space> grad_output,
                View<T, Space> grad_input) {
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
    auto sums = scratch<double>(2 * channels_);
    for_each_index(exec_, channels_,
                   detail::batch_norm::channel_gradient_sums<T, double>{
                       grad_output.data(), input.data(), mean_.data(), layout, sums.data()});
    // The collective first, so that a failed one leaves the gradients as they were.
    Buffer<double, Space> reduced;
    const double* global = sums.data();
    if (saved_mode_ == Mode::sync) {
      if (join_record_) join_record_(join_backward, 0);
      reduced = scratch<double>(2 * channels_);
      collective(
          [&] { comm_->all_reduce(std::as_const(sums).view(), reduced.view(), ReduceOp::sum); });
      global = reduced.data();
    }

    auto coefficients = scratch<double>(3 * channels_);  // [grad_mean | projection | scale]
    double* grad_mean = coefficients.data();
    double* projection = coefficients.data() + channels_;
    double* scale = coefficients.data() + 2 * channels_;
    for_each_index(exec_, channels_,
                   detail::batch_norm::backward_coefficients<T, double>{
                       sums.data(), global, invstd_.data(), slots.weight.data(),
                       slots.grad_weight.data(), slots.grad_bias.data(), channels_,
                       saved_mode_ != Mode::running, total_count_, grad_mean, projection, scale});
    for_each_index(exec_, layout.planes(),
                   detail::batch_norm::input_gradient<T, double>{
                       grad_output.data(), input.data(), grad_input.data(), mean_.data(), grad_mean,
                       projection, scale, layout});
  }

  /// Sets grad_weight and grad_bias to zero (a Parameters arena's zero_grad() does it too).
  void zero_grad() {
    const Slots slots = this->slots();
    fill(slots.grad_weight, T{});
    fill(slots.grad_bias, T{});
  }

  /// weight = 1, bias = 0 and reset_running_stats(), as PyTorch's reset_parameters().
  void reset_parameters() {
    const Slots slots = this->slots();
    fill(slots.weight, T{1});
    fill(slots.bias, T{});
    reset_running_stats();
  }

  /// running_mean = 0, running_var = 1, num_batches_tracked = 0.
  void reset_running_stats() {
    const Slots slots = this->slots();
    fill(slots.running_mean, T{});
    fill(slots.running_var, T{1});
    fill(slots.num_batches_tracked, T{});
  }

  /// The parameters, their gradients and the buffers, shaped {C} (num_batches_tracked: {}), in
  /// Space. An Error naming the option when affine or track_running_stats is off.
  [[nodiscard]] View<T, Space> weight() const { return need_affine("weight").weight; }
  /// The bias, shaped {C}.
  [[nodiscard]] View<T, Space> bias() const { return need_affine("bias").bias; }
  /// The weight's gradient, shaped {C}.
  [[nodiscard]] View<T, Space> grad_weight() const {
    return need_affine("grad_weight").grad_weight;
  }
  /// The bias's gradient, shaped {C}.
  [[nodiscard]] View<T, Space> grad_bias() const { return need_affine("grad_bias").grad_bias; }
  /// The running mean, shaped {C}.
  [[nodiscard]] View<T, Space> running_mean() const {
    return need_running("running_mean").running_mean;
  }
  /// The running variance, shaped {C}.
  [[nodiscard]] View<T, Space> running_var() const {
    return need_running("running_var").running_var;
  }
  /// On a device this waits for the executor's stream and reads the counter back.
  [[nodiscard]] std::int64_t num_batches_tracked() const {
    const Slots slots = need_running("num_batches_tracked");
    return static_cast<std::int64_t>(read_back(slots.num_batches_tracked.data(), 1)[0]);
  }

 private:
  /// How the last forward normalised: nothing to differentiate yet, with statistics across
  /// ranks, with this rank's batch alone, or with the running statistics.
  enum class Mode { none, sync, local, running };

  /// Views of the parameters and buffers; empty (null data, which the passes test) when the
  /// option that keeps them is off.
  struct Slots {
    View<T, Space> weight, bias, grad_weight, grad_bias;
    View<T, Space> running_mean, running_var, num_batches_tracked;
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
    detail::batch_norm::fail(comm_->rank(), operation, cause);
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

  /// Scratch memory for one call, ordered on the executor (on a device: allocated and freed in
  /// the order of its stream).
  template <class U>
  Buffer<U, Space> scratch(std::size_t count) const {
    return Buffer<U, Space>(count, exec_);
  }

  /// Every element of `view` = value, on the executor.
  void fill(View<T, Space> view, T value) const {
    for_each_index(exec_, view.size(), detail::batch_norm::fill<T>{view.data(), value});
  }

  /// The few values the host must see (counts): on a device, waits for the executor's stream
  /// and copies them back.
  template <class U>
  std::vector<U> read_back(const U* data, std::size_t count) const {
    std::vector<U> values(count);
    if constexpr (host_accessible<Space>) {
      std::copy_n(data, count, values.begin());
    } else {
      exec_.synchronize();
      space_copy<host, Space>::copy(values.data(), data, count * sizeof(U));
    }
    return values;
  }

  /// Runs one collective on Space tensors written by the executor, through the stream-ordering
  /// contract (comm/stream_order.hpp): the communicator after the executor's work, its results
  /// handed back to the executor. NcclComm on cuda_exec: no host wait, whichever streams; a host
  /// communicator staging device tensors: the executor's stream is synchronised first (the host
  /// copies), and what it writes back is in place when it returns.
  template <class Operation>
  void collective(Operation&& operation) {
    tandem::order_after(*comm_, exec_);
    operation();
    tandem::hand_back(*comm_, exec_);
  }

  detail::batch_norm::Layout check_input(const char* operation, const Shape& shape) const {
    detail::batch_norm::check_input(comm_->rank(), operation, shape.rank(),
                                    shape.rank() < 2 ? 0 : shape[1], channels_, shape.to_string(),
                                    " (pass a shaped View)");
    detail::batch_norm::Layout layout;
    layout.batch = static_cast<std::size_t>(shape[0]);
    layout.channels = channels_;
    for (std::size_t d = 2; d < shape.rank(); ++d)
      layout.inner *= static_cast<std::size_t>(shape[d]);
    return layout;
  }

  /// This rank's per-channel mean (into mean_), biased variance and inverse standard deviation
  /// (into invstd_); returns the count per channel (the host knows it from the shape).
  double local_statistics(const T* x, const detail::batch_norm::Layout& layout, double* variance) {
    if (layout.count() == 0) return 0;
    for_each_index(exec_, channels_,
                   detail::batch_norm::channel_moments<T, double>{
                       x, layout, options_.eps, mean_.data(), variance, invstd_.data(), nullptr});
    return static_cast<double>(layout.count());
  }

  /// Every rank's statistics merged: mean_, the biased variance across ranks and invstd_;
  /// returns the total count per channel, read back from Space. Each rank sends its record in
  /// the one wire format (sync_statistics.hpp: [mean | biased variance | count], zeros for an
  /// empty batch); the merge goes in rank order, skipping empty ranks.
  double gather_statistics(const T* x, const detail::batch_norm::Layout& layout, double* variance) {
    agree_on_channels();
    const detail::batch_norm::Wire wire{channels_};
    const auto world = static_cast<std::size_t>(comm_->size());
    auto mine = scratch<double>(wire.size());
    double* record = mine.data();
    for_each_index(exec_, channels_,
                   detail::batch_norm::channel_moments<T, double>{
                       x, layout, options_.eps, record + wire.mean(0), record + wire.variance(0),
                       nullptr, record + wire.count()});
    auto all = scratch<double>(world * wire.size());
    collective([&] { comm_->all_gather(std::as_const(mine).view(), all.view()); });
    auto total = scratch<double>(1);
    for_each_index(exec_, channels_,
                   detail::batch_norm::merge_statistics<double>{
                       all.data(), world, wire, options_.eps, mean_.data(), variance,
                       invstd_.data(), total.data()});
    return read_back(std::as_const(total).data(), 1)[0];
  }

  /// Once per module: every rank's num_features must agree, or the all_gather above would be
  /// a mismatched collective (undefined on MPI and NCCL). Later calls cost nothing. On a device
  /// the world's counts are read back (world doubles).
  void agree_on_channels() {
    if (agreed_) return;
    const auto world = static_cast<std::size_t>(comm_->size());
    const auto mine_count = static_cast<double>(channels_);
    auto mine = scratch<double>(1);
    for_each_index(exec_, 1, detail::batch_norm::fill<double>{mine.data(), mine_count});
    auto all = scratch<double>(world);
    collective([&] { comm_->all_gather(std::as_const(mine).view(), all.view()); });
    const std::vector<double> counts = read_back(std::as_const(all).data(), world);
    detail::batch_norm::check_channels_agree(comm_->rank(), counts.data(), world, channels_);
    agreed_ = true;
  }

  // --- tandem::Join (ddp/join.hpp), through detail::join::access -------------------------------
  friend struct detail::join::access;
  /// What join_record_ is told: each synchronised forward and backward, as it starts.
  enum join_event : int { join_forward, join_backward };
  /// A rank that has run out of data shadows one of them: a training forward (or its backward)
  /// of an empty batch, which sends zeros and a count of 0 and takes the others' statistics.
  void join_shadow(int event, std::size_t /*argument*/) {
    const Shape empty{0, static_cast<std::int64_t>(channels_)};
    if (event == join_backward) {
      backward(View<const T, Space>(nullptr, empty), View<const T, Space>(nullptr, empty),
               View<T, Space>(nullptr, empty));
      return;
    }
    const bool was_training = std::exchange(training_, true);
    try {
      forward(View<const T, Space>(nullptr, empty), View<T, Space>(nullptr, empty));
    } catch (...) {
      training_ = was_training;
      throw;
    }
    training_ = was_training;
  }
  std::function<void(int, std::size_t)> join_record_;  // set while a tandem::Join holds it

  Comm* comm_;
  std::size_t channels_;
  SyncBatchNormOptions options_;
  Exec exec_;
  bool training_ = true;
  bool agreed_ = false;

  Buffer<T, Space> storage_;  // own storage: weight, bias, their grads, running stats, counter
  Slots own_;
  std::function<Slots()> bind_;  // set for a module in a Parameters arena

  // What backward needs from the last forward (torch saves the same). Usable on every stream.
  Mode saved_mode_ = Mode::none;
  Shape saved_shape_;
  Buffer<double, Space> mean_ = Buffer<double, Space>(channels_);
  Buffer<double, Space> invstd_ = Buffer<double, Space>(channels_);
  double total_count_ = 0;
};

}  // namespace tandem
