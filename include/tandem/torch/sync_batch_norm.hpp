// tandem/torch/sync_batch_norm.hpp - tandem::torch::SyncBatchNorm, a libtorch module whose
// training statistics span every rank of a tandem communicator (torch.nn.SyncBatchNorm's
// numbers), and convert_sync_batchnorm, which swaps it in for BatchNorm1d/2d/3d.
//   tandem::torch::SyncBatchNorm bn(comm, 64);   auto y = bn(x);   // x: {N, 64, H, W}
//   tandem::torch::convert_sync_batchnorm(*model, comm);           // Sequential/List/Dict children
// Needs: libtorch (1.13 or 2.x) and a tandem Communicator that outlives the module.
// How it works, where it differs from PyTorch, what convert_sync_batchnorm cannot convert:
// docs/libtorch.md, "SyncBatchNorm in detail".
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/error.hpp"
#include "tandem/nn/detail/sync_statistics.hpp"
#include "tandem/torch/detail/convert_sync_batchnorm.hpp"
#include "tandem/torch/detail/sync_batch_norm_function.hpp"

namespace tandem::torch {

/// torch.nn.SyncBatchNorm as a libtorch module over a tandem communicator. See the file comment.
/// Its per-channel core (wire format, merge across ranks, checks, the commit of a step) is nn's
/// SyncBatchNorm's: nn/detail/sync_statistics.hpp.
class SyncBatchNormImpl : public ::torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  /// A module on `comm` (kept by reference: it must outlive the module) with BatchNorm's options
  /// (an integer is num_features).
  template <Communicator Comm>
  SyncBatchNormImpl(Comm& comm, const ::torch::nn::BatchNormOptions& options)
      : SyncBatchNormImpl(std::make_shared<const detail::sync_batch_norm::Group>(comm), options) {}

  /// A module sharing another's communicator (what convert_sync_batchnorm uses).
  SyncBatchNormImpl(std::shared_ptr<const detail::sync_batch_norm::Group> group,
                    const ::torch::nn::BatchNormOptions& options)
      : options(options), group_(std::move(group)) {
    check_features();
    reset();
  }

  /// A module sharing a BatchNorm's tensors (not copies) and training flag: what
  /// convert_sync_batchnorm puts in its place.
  SyncBatchNormImpl(std::shared_ptr<const detail::sync_batch_norm::Group> group,
                    const detail::sync_batch_norm::BatchNormParts& parts)
      : options(parts.options), group_(std::move(group)) {
    check_features();
    const bool affine = options.affine() && parts.weight.defined();
    weight = register_parameter("weight", affine ? parts.weight : at::Tensor(),
                                affine && parts.weight.requires_grad());
    bias = register_parameter("bias", affine ? parts.bias : at::Tensor(),
                              affine && parts.bias.requires_grad());
    const bool running = options.track_running_stats() && parts.running_mean.defined();
    running_mean = register_buffer("running_mean", running ? parts.running_mean : at::Tensor());
    running_var = register_buffer("running_var", running ? parts.running_var : at::Tensor());
    num_batches_tracked =
        register_buffer("num_batches_tracked", running ? parts.num_batches_tracked : at::Tensor());
    train(parts.training);
  }

  /// (Re)registers the parameters and buffers as libtorch's BatchNorm does and resets them.
  void reset() override {
    const int64_t c = options.num_features();
    if (options.affine()) {
      weight = register_parameter("weight", ::torch::ones({c}));
      bias = register_parameter("bias", ::torch::zeros({c}));
    } else {
      weight = register_parameter("weight", at::Tensor(), /*requires_grad=*/false);
      bias = register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
    }
    if (options.track_running_stats()) {
      running_mean = register_buffer("running_mean", ::torch::zeros({c}));
      running_var = register_buffer("running_var", ::torch::ones({c}));
      num_batches_tracked =
          register_buffer("num_batches_tracked", ::torch::tensor(int64_t{0}, at::kLong));
    } else {
      running_mean = register_buffer("running_mean", at::Tensor());
      running_var = register_buffer("running_var", at::Tensor());
      num_batches_tracked = register_buffer("num_batches_tracked", at::Tensor());
    }
  }

  /// running_mean = 0, running_var = 1, num_batches_tracked = 0.
  void reset_running_stats() {
    if (!options.track_running_stats()) return;
    const ::torch::NoGradGuard no_grad;
    running_mean.zero_();
    running_var.fill_(1);
    num_batches_tracked.zero_();
  }

  /// weight = 1, bias = 0 and reset_running_stats().
  void reset_parameters() {
    reset_running_stats();
    if (!options.affine()) return;
    const ::torch::NoGradGuard no_grad;
    weight.fill_(1);
    bias.zero_();
  }

  /// Normalises an (N, C, ...) input. Training mode on more than one rank is collective. A
  /// forward that throws (a failed collective, too few values) leaves the running statistics
  /// and num_batches_tracked as they were.
  at::Tensor forward(const at::Tensor& input) {
    tandem::detail::batch_norm::check_input(
        group_->rank(), "forward", static_cast<std::size_t>(input.dim()),
        input.dim() < 2 ? 0 : input.size(1), static_cast<std::size_t>(options.num_features()),
        shape_string(input));
    const bool batch_statistics = is_training() || !options.track_running_stats();
    const bool update_running = is_training() && options.track_running_stats();
    if (!is_training() || group_->size() == 1) {
      // Running statistics, or this rank's batch alone (eval without running stats, one rank):
      // libtorch's batch_norm, after the check both SyncBatchNorms make.
      if (batch_statistics) {
        tandem::detail::batch_norm::check_values_per_channel(
            group_->rank(), static_cast<double>(input.numel() / options.num_features()),
            " in input of shape " + shape_string(input));
      }
      double factor = momentum().value_or(0.0);
      if (update_running && !momentum()) {
        factor = tandem::detail::batch_norm::running_factor(
            0.0, true, static_cast<double>(num_batches_tracked.item<int64_t>()));
      }
      at::Tensor output =
          ::torch::batch_norm(input, weight, bias, running_mean, running_var, batch_statistics,
                              factor, options.eps(), /*cudnn_enabled=*/true);
      if (update_running) {
        const ::torch::NoGradGuard no_grad;
        num_batches_tracked.add_(1);
      }
      return output;
    }
    agree_on_channels(input);
    detail::sync_batch_norm::ForwardArgs args;
    args.group = group_;
    if (options.track_running_stats()) {
      args.running_mean = running_mean;
      args.running_var = running_var;
      args.num_batches_tracked = num_batches_tracked;
    }
    args.eps = options.eps();
    args.momentum = momentum();
    args.affine = weight.defined();
    if (!args.affine) {
      const at::Tensor none = at::empty({0}, input.options());
      return detail::sync_batch_norm::Function::apply(input, none, none, args);
    }
    return detail::sync_batch_norm::Function::apply(input, weight, bias, args);
  }

  /// "tandem::torch::SyncBatchNorm(64, eps=1e-05, momentum=0.1, affine=true, ...)".
  void pretty_print(std::ostream& stream) const override {
    stream << std::boolalpha << "tandem::torch::SyncBatchNorm(" << options.num_features()
           << ", eps=" << options.eps() << ", momentum=";
    if (options.momentum().has_value()) {
      stream << options.momentum().value();
    } else {
      stream << "None";
    }
    stream << ", affine=" << options.affine()
           << ", track_running_stats=" << options.track_running_stats()
           << ", world_size=" << group_->size() << ")";
  }

  /// The communicator's rank count (1: no communication).
  [[nodiscard]] int world_size() const noexcept { return group_->size(); }
  /// The type-erased communicator, shared by modules made from one another.
  [[nodiscard]] const std::shared_ptr<const detail::sync_batch_norm::Group>& group() const {
    return group_;
  }

  ::torch::nn::BatchNormOptions options;  ///< as torch::nn::BatchNorm's (affine, momentum, ...)
  at::Tensor weight;                      ///< the scale (affine only), registered as "weight"
  at::Tensor bias;                        ///< the shift (affine only), registered as "bias"
  at::Tensor running_mean;                ///< buffer (track_running_stats only)
  at::Tensor running_var;                 ///< buffer (track_running_stats only)
  at::Tensor num_batches_tracked;         ///< int64 buffer (track_running_stats only)

 private:
  /// Once per module: every rank's num_features must agree, or the statistics' all_gather would
  /// be a mismatched collective.
  void agree_on_channels(const at::Tensor& input) {
    if (agreed_) return;
    const auto on = input.options().dtype(at::kDouble);
    const at::Tensor mine = at::full({1}, static_cast<double>(options.num_features()), on);
    const at::Tensor all = at::empty({group_->size()}, on);
    group_->all_gather(mine, all);
    const at::Tensor counts = all.to(at::kCPU).contiguous();
    tandem::detail::batch_norm::check_channels_agree(
        group_->rank(), counts.data_ptr<double>(), static_cast<std::size_t>(group_->size()),
        static_cast<std::size_t>(options.num_features()));
    agreed_ = true;
  }

  /// The momentum, unset for the cumulative average (c10::optional in libtorch 1.13).
  [[nodiscard]] std::optional<double> momentum() const {
    if (!options.momentum().has_value()) return std::nullopt;
    return options.momentum().value();
  }

  /// "[2, 3, 4]", as nn's SyncBatchNorm writes a shape.
  static std::string shape_string(const at::Tensor& t) {
    std::string text = "[";
    for (int64_t d = 0; d < t.dim(); ++d) {
      text += (d == 0 ? "" : ", ") + std::to_string(t.size(d));
    }
    return text + "]";
  }

  void check_features() const {
    if (options.num_features() < 1) {
      group_->fail("SyncBatchNorm", "num_features must be at least 1, not " +
                                        std::to_string(options.num_features()));
    }
  }

  std::shared_ptr<const detail::sync_batch_norm::Group> group_;
  bool agreed_ = false;
};

/// The module holder (`SyncBatchNorm bn(comm, 64); bn(x); bn->weight`), libtorch's idiom.
/// (TORCH_MODULE spelled out: the macro names `torch::nn`, which tandem::torch would capture.)
class SyncBatchNorm : public ::torch::nn::ModuleHolder<SyncBatchNormImpl> {
 public:
  using ::torch::nn::ModuleHolder<SyncBatchNormImpl>::ModuleHolder;
  using Impl = SyncBatchNormImpl;  ///< the module type the holder owns
};

/// What convert_sync_batchnorm does with a BatchNorm that a struct member also holds.
enum class MemberHeldBatchNorm {
  error,  ///< change nothing and throw a tandem::Error naming them (the default)
  skip,   ///< convert the others; list these in ConvertedBatchNorms::skipped
};

/// convert_sync_batchnorm's options.
struct ConvertSyncBatchNormOptions {
  MemberHeldBatchNorm member_held = MemberHeldBatchNorm::error;  ///< error, or skip them
};

/// The dotted names (as named_modules() spells them) that convert_sync_batchnorm replaced, and
/// those it left as plain BatchNorm because a struct member holds them.
struct ConvertedBatchNorms {
  std::vector<std::string> converted;  ///< now SyncBatchNorm
  std::vector<std::string> skipped;    ///< left as BatchNorm (MemberHeldBatchNorm::skip)
};

/// Replaces every BatchNorm1d/2d/3d under `module` that libtorch lets us rewire with a
/// SyncBatchNorm on `comm` sharing its tensors (see the file comment); returns the names.
/// BatchNorms that a struct member holds: a tandem::Error naming them, nothing changed (or, with
/// MemberHeldBatchNorm::skip, listed in `skipped`). `module` itself is never replaced.
template <Communicator Comm>
ConvertedBatchNorms convert_sync_batchnorm(::torch::nn::Module& module, Comm& comm,
                                           ConvertSyncBatchNormOptions options = {}) {
  namespace sbn = detail::sync_batch_norm;
  const bool skip = options.member_held == MemberHeldBatchNorm::skip;
  ConvertedBatchNorms dry;
  sbn::convert<SyncBatchNormImpl>(module, "", std::shared_ptr<const sbn::Group>(), skip, dry);
  if (!dry.skipped.empty() && !skip) {
    std::string names;
    for (const auto& name : dry.skipped) names += (names.empty() ? "" : ", ") + name;
    throw Error(comm.rank(), "convert_sync_batchnorm",
                "BatchNorm module(s) " + names +
                    " are held by struct members, which libtorch cannot rewire from outside "
                    "(forward would keep calling the old module); construct "
                    "tandem::torch::SyncBatchNorm(comm, options) in those members instead, or "
                    "pass {.member_held = tandem::torch::MemberHeldBatchNorm::skip}");
  }
  ConvertedBatchNorms result;
  sbn::convert<SyncBatchNormImpl>(module, "", std::make_shared<const sbn::Group>(comm), skip,
                                  result);
  return result;
}

}  // namespace tandem::torch
