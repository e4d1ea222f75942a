// tandem/torch/sync_batch_norm.hpp - tandem::torch::SyncBatchNorm, a libtorch module whose
// training statistics span every rank of a tandem communicator (torch.nn.SyncBatchNorm's
// numbers), and convert_sync_batchnorm, which swaps it in for BatchNorm1d/2d/3d.
//   tandem::torch::SyncBatchNorm bn(comm, 64);   auto y = bn(x);   // x: {N, 64, H, W}
//   tandem::torch::convert_sync_batchnorm(*model, comm);           // Sequential/List/Dict children
// Needs: libtorch (1.13 or 2.x) and a tandem Communicator.
// How it works, where it differs from PyTorch, what convert_sync_batchnorm cannot convert:
// docs/libtorch.md, "SyncBatchNorm in detail".
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/error.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"
#include "tandem/torch/tensor.hpp"

namespace tandem::torch {

namespace detail::sync_batch_norm {

/// The two collectives SyncBatchNorm needs, on 1-D contiguous double tensors, type-erased so that
/// the module is one type for every communicator. One std::function call per collective.
class Group {
 public:
  template <Communicator Comm>
  explicit Group(Comm& comm)
      : rank_(comm.rank()),
        size_(comm.size()),
        all_gather_([c = &comm](const at::Tensor& mine, const at::Tensor& all) {
          gather_on(*c, mine, all);
        }),
        all_reduce_sum_([c = &comm](const at::Tensor& values) { reduce_on(*c, values); }) {}

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  /// all[r * mine.numel() ...] = rank r's `mine`, for every rank r.
  void all_gather(const at::Tensor& mine, const at::Tensor& all) const { all_gather_(mine, all); }
  /// values = the sum of every rank's values, in place.
  void all_reduce_sum(const at::Tensor& values) const { all_reduce_sum_(values); }

  [[noreturn]] void fail(const std::string& operation, const std::string& cause) const {
    throw Error(rank_, "SyncBatchNorm::" + operation, cause);
  }

 private:
  /// A host communicator gets CPU copies (no copy for CPU tensors); a device one gets the
  /// tensors themselves, which must then be CUDA tensors.
  template <class Comm>
  static at::Tensor staged(const Comm& comm, const at::Tensor& t) {
    using Space = typename Comm::memory_space;
    if constexpr (host_accessible<Space>) {
      return t.to(at::kCPU).contiguous();
    } else {
      if (!t.is_cuda()) {
        throw Error(comm.rank(), "SyncBatchNorm",
                    "a device communicator needs CUDA inputs, got a tensor on " + t.device().str());
      }
      return t.contiguous();
    }
  }

  template <class Comm>
  static void gather_on(Comm& comm, const at::Tensor& mine, const at::Tensor& all) {
    using Space = typename Comm::memory_space;
    const at::Tensor in = staged(comm, mine);
    at::Tensor out = staged(comm, all);
    torch::detail::on_current_stream<Space>(comm, in, [&] {
      comm.all_gather(View<const double, Space>(in.data_ptr<double>(), in.numel()),
                      View<double, Space>(out.data_ptr<double>(), out.numel()));
    });
    if (!out.is_same(all)) all.copy_(out);
  }

  template <class Comm>
  static void reduce_on(Comm& comm, const at::Tensor& values) {
    using Space = typename Comm::memory_space;
    at::Tensor staged_values = staged(comm, values);
    torch::detail::on_current_stream<Space>(comm, staged_values, [&] {
      comm.all_reduce(View<double, Space>(staged_values.data_ptr<double>(), staged_values.numel()),
                      ReduceOp::sum);
    });
    if (!staged_values.is_same(values)) values.copy_(staged_values);
  }

  int rank_;
  int size_;
  std::function<void(const at::Tensor&, const at::Tensor&)> all_gather_;
  std::function<void(const at::Tensor&)> all_reduce_sum_;
};

/// Carries the Group from forward to backward through the autograd context (saved_data holds
/// IValues; a capsule holds any C++ object).
struct GroupCapsule : ::torch::CustomClassHolder {
  explicit GroupCapsule(std::shared_ptr<const Group> g) : group(std::move(g)) {}
  std::shared_ptr<const Group> group;
};

/// {1, C, 1, ...} for broadcasting a per-channel vector over an input of `dims` dimensions.
inline at::Tensor per_channel(const at::Tensor& values, int64_t dims) {
  std::vector<int64_t> shape(static_cast<std::size_t>(dims), 1);
  shape[1] = values.numel();
  return values.reshape(shape);
}

/// Every dimension but the channel one.
inline std::vector<int64_t> reduced_dims(int64_t dims) {
  std::vector<int64_t> result{0};
  for (int64_t d = 2; d < dims; ++d) result.push_back(d);
  return result;
}

/// Whether libtorch's fused CPU batch-norm kernels serve `x` (see the file comment, Arithmetic):
/// a non-empty float or double CPU input whose (n, c) planes hold more than one value. Other
/// inputs (CUDA, half and bfloat16, (N, C) without spatial dimensions, empty batches) take the
/// unfused ops.
inline bool fused_cpu(const at::Tensor& x) {
  if (!x.is_cpu() || x.numel() == 0) return false;
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble) return false;
  return x.numel() / (x.size(0) * x.size(1)) > 1;
}

/// x * a + b with per-channel double a and b (each rounded once to x's dtype), in one pass: an
/// eval-mode native_batch_norm with mean 0, variance 1 and eps 0, whose 1 / sqrt(1 + 0) is exactly
/// 1, so that its per-channel factors are a and b themselves. x is contiguous (fused_cpu).
inline at::Tensor per_channel_affine(const at::Tensor& x, const at::Tensor& a,
                                     const at::Tensor& b) {
  const auto type = x.scalar_type();
  const int64_t channels = x.size(1);
  return std::get<0>(at::native_batch_norm(x, a.to(type), b.to(type),
                                           at::zeros({channels}, x.options()),
                                           at::ones({channels}, x.options()),
                                           /*training=*/false, /*momentum=*/0.0, /*eps=*/0.0));
}

/// What forward needs besides the differentiable tensors (not variables to autograd).
struct ForwardArgs {
  std::shared_ptr<const Group> group;
  at::Tensor running_mean;  // undefined: do not update
  at::Tensor running_var;
  double eps = 1e-5;
  double factor = 0.1;  // running = (1 - factor) * running + factor * batch
  bool affine = true;   // false: weight and bias are empty placeholders (libtorch 1.13's custom
                        // functions reject undefined tensor inputs)
};

/// A BatchNorm's options and tensors, for a SyncBatchNorm that takes its place.
struct BatchNormParts {
  ::torch::nn::BatchNormOptions options{1};
  at::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
  bool training = true;
};

/// The synchronised batch norm as one autograd node: inputs (input, weight, bias, args).
struct Function : ::torch::autograd::Function<Function> {
  static at::Tensor forward(::torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& bias,
                            const ForwardArgs& args) {
    const Group& group = *args.group;
    const at::Tensor x = input.contiguous();
    const int64_t channels = x.size(1);
    const auto dims = reduced_dims(x.dim());
    const auto on = x.options().dtype(at::kDouble);

    // This rank's record [mean (C) | biased var (C) | count]; zeros for an empty batch.
    const int64_t count = channels > 0 ? x.numel() / channels : 0;
    const bool fused = fused_cpu(x);
    at::Tensor mine;
    if (count > 0) {
      at::Tensor mean, var;
      if (fused) {
        // Two passes, double sums (var_mean's CPU reduction over {0, 2, ...} is several times
        // slower); no running statistics to update here.
        std::tie(mean, var) = at::batch_norm_update_stats(x, {}, {}, /*momentum=*/0.0);
      } else {
        const bool low_precision = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
        std::tie(var, mean) = at::var_mean(low_precision ? x.to(at::kFloat) : x,
                                           at::IntArrayRef(dims), /*unbiased=*/false,
                                           /*keepdim=*/false);
      }
      mine = at::cat({mean.to(at::kDouble), var.to(at::kDouble),
                      at::full({1}, static_cast<double>(count), on)});
    } else {
      mine = at::zeros({2 * channels + 1}, on);
    }
    const at::Tensor all = at::empty({group.size(), 2 * channels + 1}, on);
    group.all_gather(mine, all);

    // Merge: mean = sum(n_r m_r) / n, var = sum(n_r (v_r + (m_r - mean)^2)) / n; empty ranks
    // weigh nothing.
    const at::Tensor counts = all.select(1, 2 * channels).unsqueeze(1);  // {world, 1}
    const at::Tensor means = all.narrow(1, 0, channels);
    const at::Tensor vars = all.narrow(1, channels, channels);
    const double total = counts.sum().item<double>();
    if (total < 2) {
      group.fail("forward", "expected more than 1 value per channel when training, got " +
                                std::to_string(static_cast<int64_t>(total)) + " across " +
                                std::to_string(group.size()) + " ranks");
    }
    const at::Tensor mean = (counts * means).sum(0) / total;
    const at::Tensor deviation = means - mean;
    const at::Tensor var = (counts * (vars + deviation * deviation)).sum(0) / total;
    const at::Tensor invstd = (var + args.eps).rsqrt();

    if (args.running_mean.defined()) {
      const double f = args.factor;
      const double unbiased = total / (total - 1);
      args.running_mean.copy_(args.running_mean.to(at::kDouble) * (1 - f) +
                              mean.to(args.running_mean.device()) * f);
      args.running_var.copy_(args.running_var.to(at::kDouble) * (1 - f) +
                             var.to(args.running_var.device()) * (f * unbiased));
    }

    // y = (x - mean) * (invstd * w) + b, coefficients rounded once to x's dtype; fused:
    // y = x * scale + (b - mean * scale), one pass.
    const at::Tensor scale = args.affine ? invstd * weight.to(at::kDouble) : invstd;
    at::Tensor output;
    if (fused) {
      const at::Tensor shift = args.affine ? bias.to(at::kDouble) - mean * scale : -(mean * scale);
      output = per_channel_affine(x, scale, shift);
    } else {
      output = (x - per_channel(mean.to(x.scalar_type()), x.dim())) *
               per_channel(scale.to(x.scalar_type()), x.dim());
      if (args.affine) output.add_(per_channel(bias.to(x.scalar_type()), x.dim()));
    }

    ctx->save_for_backward({x, weight});
    ctx->saved_data["mean"] = mean;
    ctx->saved_data["invstd"] = invstd;
    ctx->saved_data["total"] = total;
    ctx->saved_data["affine"] = args.affine;
    ctx->saved_data["group"] =
        c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(args.group));
    return output;
  }

  static ::torch::autograd::variable_list backward(::torch::autograd::AutogradContext* ctx,
                                                   ::torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor mean = ctx->saved_data["mean"].toTensor();
    const at::Tensor invstd = ctx->saved_data["invstd"].toTensor();
    const double total = ctx->saved_data["total"].toDouble();
    const bool affine = ctx->saved_data["affine"].toBool();
    const auto capsule = ctx->saved_data["group"].toCapsule();
    const Group& group = *static_cast<const GroupCapsule*>(capsule.get())->group;

    const at::Tensor dy = grads[0].contiguous();
    const auto type = x.scalar_type();
    const int64_t channels = x.size(1);
    const bool fused = fused_cpu(x);
    // Per-channel sums, returned in double; an empty batch sums to zeros.
    at::Tensor sum_dy, sum_dy_xmu, xmu;
    if (fused) {
      // An eval-mode backward with mean = the global mean, variance 1 and eps 0 (1 / sqrt(1 + 0)
      // is exactly 1): its grad_weight is sum(dy * (x - mean)) and its grad_bias sum(dy), from
      // one pass over x and dy.
      const at::Tensor ones = at::ones({channels}, x.options());
      const auto sums =
          at::native_batch_norm_backward(dy, x, ones, mean.to(type), ones, {}, {},
                                         /*train=*/false, /*eps=*/0.0, {false, true, true});
      sum_dy_xmu = std::get<1>(sums).to(at::kDouble);
      sum_dy = std::get<2>(sums).to(at::kDouble);
    } else {
      const std::vector<int64_t> reduced = reduced_dims(x.dim());
      const auto dims = at::IntArrayRef(reduced);
      xmu = x - per_channel(mean.to(type), x.dim());
      sum_dy = dy.sum(dims, /*keepdim=*/false, at::kDouble);
      sum_dy_xmu = (dy * xmu).sum(dims, /*keepdim=*/false, at::kDouble);
    }

    at::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) {
      const at::Tensor combined = at::cat({sum_dy, sum_dy_xmu});
      group.all_reduce_sum(combined);
      const at::Tensor mean_dy = combined.narrow(0, 0, channels) / total;
      const at::Tensor projection =
          combined.narrow(0, channels, channels) * invstd * invstd / total;
      const at::Tensor scale = affine ? invstd * weight.to(at::kDouble) : invstd;
      if (fused) {
        // dx = dy * scale + x * (-projection * scale) + (mean * projection - mean_dy) * scale:
        // one affine pass over x, then one addcmul with dy.
        grad_input =
            per_channel_affine(x, -(projection * scale), (mean * projection - mean_dy) * scale);
        grad_input.addcmul_(dy, per_channel(scale.to(type), x.dim()));
      } else {
        grad_input = (dy - per_channel(mean_dy.to(type), x.dim()) -
                      xmu * per_channel(projection.to(type), x.dim())) *
                     per_channel(scale.to(type), x.dim());
      }
    }
    if (affine && ctx->needs_input_grad(1)) {
      grad_weight = (sum_dy_xmu * invstd).to(weight.scalar_type());
    }
    if (affine && ctx->needs_input_grad(2)) {
      grad_bias = sum_dy.to(weight.scalar_type());
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor()};
  }
};

}  // namespace detail::sync_batch_norm

/// torch.nn.SyncBatchNorm as a libtorch module over a tandem communicator. See the file comment.
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

  /// Normalises an (N, C, ...) input. Training mode on more than one rank is collective.
  at::Tensor forward(const at::Tensor& input) {
    if (input.dim() < 2) {
      group_->fail("forward", "expected an (N, C, ...) input of at least 2 dimensions, got " +
                                  std::to_string(input.dim()));
    }
    if (input.size(1) != options.num_features()) {
      group_->fail("forward", "input has " + std::to_string(input.size(1)) +
                                  " channels, this SyncBatchNorm has " +
                                  std::to_string(options.num_features()));
    }
    double factor = options.momentum().has_value() ? options.momentum().value() : 0.0;
    if (is_training() && options.track_running_stats()) {
      const ::torch::NoGradGuard no_grad;
      num_batches_tracked.add_(1);
      if (!options.momentum().has_value()) {
        factor = 1.0 / static_cast<double>(num_batches_tracked.item<int64_t>());
      }
    }
    const bool batch_statistics = is_training() || !options.track_running_stats();
    if (!is_training() || group_->size() == 1) {
      // Running statistics, or this rank's batch alone (eval without running stats, one rank).
      return ::torch::batch_norm(input, weight, bias, running_mean, running_var, batch_statistics,
                                 factor, options.eps(), /*cudnn_enabled=*/true);
    }
    agree_on_channels(input);
    detail::sync_batch_norm::ForwardArgs args;
    args.group = group_;
    if (options.track_running_stats()) {
      args.running_mean = running_mean;
      args.running_var = running_var;
    }
    args.eps = options.eps();
    args.factor = factor;
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
    const at::Tensor counts = all.to(at::kCPU);
    for (int r = 0; r < group_->size(); ++r) {
      const auto theirs = static_cast<int64_t>(counts[r].item<double>());
      if (theirs != options.num_features()) {
        group_->fail("forward", "ranks disagree on the number of channels: rank " +
                                    std::to_string(r) + " has " + std::to_string(theirs) +
                                    ", rank " + std::to_string(group_->rank()) +
                                    " (this one) has " + std::to_string(options.num_features()));
      }
    }
    agreed_ = true;
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

namespace detail::sync_batch_norm {

template <class Impl>
bool parts_of(const std::shared_ptr<::torch::nn::Module>& module, BatchNormParts& parts) {
  const auto bn = std::dynamic_pointer_cast<Impl>(module);
  if (!bn) return false;
  parts.options = bn->options;
  parts.weight = bn->weight;
  parts.bias = bn->bias;
  parts.running_mean = bn->running_mean;
  parts.running_var = bn->running_var;
  parts.num_batches_tracked = bn->num_batches_tracked;
  parts.training = bn->is_training();
  return true;
}

inline bool batch_norm_parts(const std::shared_ptr<::torch::nn::Module>& module,
                             BatchNormParts& parts) {
  return parts_of<::torch::nn::BatchNorm1dImpl>(module, parts) ||
         parts_of<::torch::nn::BatchNorm2dImpl>(module, parts) ||
         parts_of<::torch::nn::BatchNorm3dImpl>(module, parts);
}

enum class Parent { sequential, module_list, module_dict, other };

inline Parent kind_of(::torch::nn::Module& module) {
  if (dynamic_cast<::torch::nn::SequentialImpl*>(&module)) return Parent::sequential;
  if (dynamic_cast<::torch::nn::ModuleListImpl*>(&module)) return Parent::module_list;
  if (dynamic_cast<::torch::nn::ModuleDictImpl*>(&module)) return Parent::module_dict;
  return Parent::other;
}

/// Walks `parent`'s subtree. With `group` null it only collects the member-held BatchNorms
/// (a dry run, so that an error leaves the model unchanged); otherwise it replaces.
inline void convert(::torch::nn::Module& parent, const std::string& prefix,
                    const std::shared_ptr<const Group>& group, bool skip_member_held,
                    ConvertedBatchNorms& result) {
  const Parent kind = kind_of(parent);
  // A copy of the registry: each child's handle count is 1 (the registry) + 1 (this copy) + one
  // per container slot (Sequential's AnyModule, ModuleList's vector, ModuleDict's dict) + one per
  // struct member or other holder.
  const auto children = parent.named_children();
  std::size_t index = 0;
  for (const auto& item : children) {
    const std::string name = prefix.empty() ? item.key() : prefix + "." + item.key();
    const std::shared_ptr<::torch::nn::Module>& child = item.value();
    const std::size_t position = index++;
    BatchNormParts parts;
    if (!batch_norm_parts(child, parts)) {
      convert(*child, name, group, skip_member_held, result);
      continue;
    }
    const long container_slot = kind == Parent::other ? 0 : 1;
    const bool member_held = child.use_count() > 2 + container_slot;
    if (kind == Parent::other && member_held) {
      result.skipped.push_back(name);
      continue;
    }
    if (!group) continue;  // dry run
    auto sync = std::make_shared<SyncBatchNormImpl>(group, parts);
    switch (kind) {
      case Parent::sequential: {
        auto& sequential = dynamic_cast<::torch::nn::SequentialImpl&>(parent);
        // Sequential's forward runs its AnyModule list, registered in the same order.
        auto slot = sequential.begin() + static_cast<std::ptrdiff_t>(position);
        if (slot->ptr() != child) {
          throw Error(group->rank(), "convert_sync_batchnorm",
                      "Sequential " + prefix + ": child order differs from its module list");
        }
        *slot = ::torch::nn::AnyModule(sync);
        parent.replace_module(item.key(), sync);
        break;
      }
      case Parent::module_list: {
        auto& list = dynamic_cast<::torch::nn::ModuleListImpl&>(parent);
        auto slot = list.begin() + static_cast<std::ptrdiff_t>(position);
        if (*slot != child) {
          throw Error(group->rank(), "convert_sync_batchnorm",
                      "ModuleList " + prefix + ": child order differs from its module list");
        }
        *slot = sync;
        parent.replace_module(item.key(), sync);
        break;
      }
      case Parent::module_dict:
        dynamic_cast<::torch::nn::ModuleDictImpl&>(parent).update(
            std::vector<std::pair<std::string, std::shared_ptr<::torch::nn::Module>>>{
                {item.key(), sync}});
        break;
      case Parent::other:
        parent.replace_module(item.key(), sync);  // only the registry held it
        break;
    }
    result.converted.push_back(name);
  }
}

}  // namespace detail::sync_batch_norm

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
  sbn::convert(module, "", nullptr, skip, dry);
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
  sbn::convert(module, "", std::make_shared<const sbn::Group>(comm), skip, result);
  return result;
}

}  // namespace tandem::torch
