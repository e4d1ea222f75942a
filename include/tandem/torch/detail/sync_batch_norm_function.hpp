// tandem/torch/detail/sync_batch_norm_function.hpp - tandem::torch::SyncBatchNorm's training
// step across ranks as one libtorch autograd node (Function), the type-erased communicator it
// runs its collectives on (Group) and its libtorch passes (fused CPU kernels or unfused ops).
//   at::Tensor y = detail::sync_batch_norm::Function::apply(x, weight, bias, args);
// Needs: libtorch and a tandem Communicator; the per-channel core it shares with nn's
// SyncBatchNorm (wire format, merge, checks, commit): nn/detail/sync_statistics.hpp. Included by
// torch/sync_batch_norm.hpp, not by users. How and why: docs/libtorch.md, "SyncBatchNorm in
// detail".
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/error.hpp"
#include "tandem/nn/detail/sync_statistics.hpp"
#include "tandem/tensor/exec.hpp"
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

  /// The Error both SyncBatchNorms raise (sync_statistics.hpp), on this rank.
  [[noreturn]] void fail(const std::string& operation, const std::string& cause) const {
    tandem::detail::batch_norm::fail(rank_, operation, cause);
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

/// Whether libtorch's fused CPU batch-norm kernels serve `x` (docs/libtorch.md, Arithmetic):
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

/// Whether `t` is a contiguous CPU tensor of float or double, read and written through its
/// pointer by the host path below.
inline bool host_values(const at::Tensor& t) {
  return t.defined() && t.is_cpu() && t.is_contiguous() &&
         (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
}

/// out[i] = double(t[i]) for the t.numel() values of `t` (any tensor; a host_values one without
/// a libtorch op).
inline void read_doubles(const at::Tensor& t, double* out) {
  const auto n = static_cast<std::size_t>(t.numel());
  if (host_values(t) && t.scalar_type() == at::kFloat) {
    const float* in = t.data_ptr<float>();
    for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<double>(in[i]);
  } else if (host_values(t)) {
    const double* in = t.data_ptr<double>();
    for (std::size_t i = 0; i < n; ++i) out[i] = in[i];
  } else {
    at::from_blob(out, {t.numel()}, at::TensorOptions().dtype(at::kDouble)).copy_(t.reshape(-1));
  }
}

/// A new 1-D tensor like `like` (its dtype, on the CPU) holding `values` rounded once to that
/// dtype: what `values_tensor.to(like's dtype)` holds. `like` is host_values.
inline at::Tensor rounded(const std::vector<double>& values, const at::Tensor& like) {
  at::Tensor out = at::empty({static_cast<int64_t>(values.size())}, like.options());
  if (like.scalar_type() == at::kFloat) {
    float* to = out.data_ptr<float>();
    for (std::size_t i = 0; i < values.size(); ++i) to[i] = static_cast<float>(values[i]);
  } else {
    double* to = out.data_ptr<double>();
    for (std::size_t i = 0; i < values.size(); ++i) to[i] = values[i];
  }
  return out;
}

/// x * a + b per channel with a and b already in x's dtype (per_channel_affine's pass).
inline at::Tensor typed_affine(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b) {
  const int64_t channels = x.size(1);
  return std::get<0>(at::native_batch_norm(x, a, b, at::zeros({channels}, x.options()),
                                           at::ones({channels}, x.options()),
                                           /*training=*/false, /*momentum=*/0.0, /*eps=*/0.0));
}

/// What forward needs besides the differentiable tensors (not variables to autograd).
struct ForwardArgs {
  std::shared_ptr<const Group> group;
  at::Tensor running_mean;  // undefined: do not update (nor num_batches_tracked)
  at::Tensor running_var;
  at::Tensor num_batches_tracked;
  double eps = 1e-5;
  std::optional<double> momentum = 0.1;  // unset: the cumulative average
  bool affine = true;  // false: weight and bias are empty placeholders (libtorch 1.13's custom
                       // functions reject undefined tensor inputs)
};

/// The commit of a training step (sync_statistics.hpp's commit_step, on the host in double): the
/// running statistics from the merged mean and variance, then num_batches_tracked + 1, written
/// back into the module's tensors (on their device, in their dtype: each rounded once).
inline void commit_step(const ForwardArgs& args, const double* mean, const double* variance,
                        double total) {
  const auto channels = static_cast<std::size_t>(args.running_mean.numel());
  const at::Tensor& tracked_now = args.num_batches_tracked;
  if (host_values(args.running_mean) && host_values(args.running_var) &&
      args.running_mean.scalar_type() == args.running_var.scalar_type() && tracked_now.is_cpu() &&
      tracked_now.is_contiguous() && tracked_now.scalar_type() == at::kLong) {
    // In place, each value computed in double and rounded once to the buffers' dtype: the
    // bits of the copies below, without their libtorch ops.
    int64_t* tracked = tracked_now.data_ptr<int64_t>();
    if (args.running_mean.scalar_type() == at::kFloat) {
      tandem::detail::batch_norm::commit_step(
          on_host, channels, args.running_mean.data_ptr<float>(),
          args.running_var.data_ptr<float>(), tracked, mean, variance, args.momentum, total);
    } else {
      tandem::detail::batch_norm::commit_step(
          on_host, channels, args.running_mean.data_ptr<double>(),
          args.running_var.data_ptr<double>(), tracked, mean, variance, args.momentum, total);
    }
    return;
  }
  // Host copies in double (the tensors themselves when they are already that: then in place).
  const at::Tensor running_mean = args.running_mean.to(at::kCPU, at::kDouble).contiguous();
  const at::Tensor running_var = args.running_var.to(at::kCPU, at::kDouble).contiguous();
  const at::Tensor tracked = args.num_batches_tracked.to(at::kCPU, at::kLong).contiguous();
  tandem::detail::batch_norm::commit_step(
      on_host, channels, running_mean.data_ptr<double>(), running_var.data_ptr<double>(),
      tracked.data_ptr<int64_t>(), mean, variance, args.momentum, total);
  args.running_mean.copy_(running_mean);
  args.running_var.copy_(running_var);
  args.num_batches_tracked.copy_(tracked);
}

/// The merge of every rank's record (`records`: {world, 2C + 1} contiguous CPU doubles), its
/// check and, when the module tracks running statistics, the commit of the step (every
/// collective and check has passed by then). Returns {mean | variance | invstd} as a {3, C} CPU
/// double tensor, and the total count.
inline std::pair<at::Tensor, double> merge_and_commit(const Group& group, const ForwardArgs& args,
                                                      const tandem::detail::batch_norm::Wire& wire,
                                                      const at::Tensor& records) {
  const auto channels = static_cast<int64_t>(wire.channels);
  const at::Tensor merged = at::empty({3, channels}, records.options());
  double* statistics = merged.data_ptr<double>();
  double total = 0;
  for_each_index(
      on_host, wire.channels,
      tandem::detail::batch_norm::merge_statistics<double>{
          records.data_ptr<double>(), static_cast<std::size_t>(group.size()), wire, args.eps,
          statistics, statistics + channels, statistics + 2 * channels, &total});
  tandem::detail::batch_norm::check_values_per_channel(
      group.rank(), total, " across " + std::to_string(group.size()) + " ranks");
  if (args.running_mean.defined()) commit_step(args, statistics, statistics + channels, total);
  return {merged, total};
}

/// The synchronised batch norm as one autograd node: inputs (input, weight, bias, args).
struct Function : ::torch::autograd::Function<Function> {
  static at::Tensor forward(::torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& bias,
                            const ForwardArgs& args) {
    const Group& group = *args.group;
    const at::Tensor x = input.contiguous();
    const int64_t channels = x.size(1);  // at least 1 (SyncBatchNormImpl checks it)
    const auto dims = reduced_dims(x.dim());
    const auto on = x.options().dtype(at::kDouble);

    // This rank's record in the one wire format (sync_statistics.hpp): [mean | biased variance |
    // count]; zeros for an empty batch.
    const tandem::detail::batch_norm::Wire wire{static_cast<std::size_t>(channels)};
    const int64_t count = x.numel() / channels;
    const bool fused = fused_cpu(x);
    if (fused && (!args.affine || (host_values(weight) && host_values(bias)))) {
      return forward_on_host(ctx, x, weight, bias, args);
    }
    const at::Tensor mine = at::zeros({static_cast<int64_t>(wire.size())}, on);
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
      mine.narrow(0, static_cast<int64_t>(wire.mean(0)), channels).copy_(mean);
      mine.narrow(0, static_cast<int64_t>(wire.variance(0)), channels).copy_(var);
      mine.narrow(0, static_cast<int64_t>(wire.count()), 1).fill_(static_cast<double>(count));
    }
    const at::Tensor all = at::empty({group.size(), static_cast<int64_t>(wire.size())}, on);
    group.all_gather(mine, all);

    // The merge and its check on the host, as nn's SyncBatchNorm runs them (a few doubles a
    // rank; on a GPU the records come back once, where the total count must anyway).
    const auto [merged, total] = merge_and_commit(group, args, wire, all.to(at::kCPU).contiguous());
    const at::Tensor mean = merged[0].to(x.device());
    const at::Tensor invstd = merged[2].to(x.device());

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
    if (fused && (!affine || host_values(weight))) {
      return backward_on_host(ctx, x, weight, dy, mean, invstd, total, affine, group);
    }
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
      // [sum(dy) | sum(dy * (x - mean))], the wire format's gradient sums.
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

 private:
  /// A rank's training step on a fused_cpu input with host_values weight and bias: the same
  /// passes over x as above and the same arithmetic per channel (in double, each result rounded
  /// once to x's dtype where the ops above round it), but the per-channel work runs as plain
  /// loops over the few values of each channel instead of a dozen small libtorch ops, whose
  /// dispatch dominated the step of a small layer (issue 33).
  static at::Tensor forward_on_host(::torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                    const at::Tensor& weight, const at::Tensor& bias,
                                    const ForwardArgs& args) {
    const Group& group = *args.group;
    const int64_t channels = x.size(1);
    const auto c_count = static_cast<std::size_t>(channels);
    const tandem::detail::batch_norm::Wire wire{c_count};
    const auto on = x.options().dtype(at::kDouble);
    const at::Tensor mine = at::empty({static_cast<int64_t>(wire.size())}, on);
    double* record = mine.data_ptr<double>();
    const auto stats = at::batch_norm_update_stats(x, {}, {}, /*momentum=*/0.0);
    read_doubles(std::get<0>(stats), record + wire.mean(0));
    read_doubles(std::get<1>(stats), record + wire.variance(0));
    record[wire.count()] = static_cast<double>(x.numel() / channels);
    const at::Tensor all = at::empty({group.size(), static_cast<int64_t>(wire.size())}, on);
    group.all_gather(mine, all);

    const auto [merged, total] = merge_and_commit(group, args, wire, all);
    const double* statistics = merged.data_ptr<double>();

    // y = x * scale + (b - mean * scale), scale = invstd * w: forward's fused arithmetic.
    const double* mean = statistics;
    const double* invstd = statistics + 2 * channels;
    std::vector<double> w(c_count, 1.0), b(c_count, 0.0), scale(c_count), shift(c_count);
    if (args.affine) {
      read_doubles(weight, w.data());
      read_doubles(bias, b.data());
    }
    for (std::size_t c = 0; c < c_count; ++c) {
      scale[c] = args.affine ? invstd[c] * w[c] : invstd[c];
      shift[c] = args.affine ? b[c] - mean[c] * scale[c] : -(mean[c] * scale[c]);
    }
    at::Tensor output = typed_affine(x, rounded(scale, x), rounded(shift, x));

    ctx->save_for_backward({x, weight});
    ctx->saved_data["mean"] = merged[0];
    ctx->saved_data["invstd"] = merged[2];
    ctx->saved_data["total"] = total;
    ctx->saved_data["affine"] = args.affine;
    ctx->saved_data["group"] =
        c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(args.group));
    return output;
  }

  /// backward for forward_on_host's inputs (and any fused_cpu one with a host_values weight):
  /// the same sums from one pass over x and dy, one all_reduce of [sum(dy) | sum(dy * (x -
  /// mean))], and the per-channel factors of dx as plain loops.
  static ::torch::autograd::variable_list backward_on_host(
      ::torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
      const at::Tensor& dy, const at::Tensor& mean_values, const at::Tensor& invstd_values,
      double total, bool affine, const Group& group) {
    const int64_t channels = x.size(1);
    const auto c_count = static_cast<std::size_t>(channels);
    std::vector<double> mean(c_count), invstd(c_count);
    read_doubles(mean_values, mean.data());
    read_doubles(invstd_values, invstd.data());
    const at::Tensor ones = at::ones({channels}, x.options());
    const auto sums =
        at::native_batch_norm_backward(dy, x, ones, rounded(mean, x), ones, {}, {},
                                       /*train=*/false, /*eps=*/0.0, {false, true, true});
    const at::Tensor& local_dy_xmu = std::get<1>(sums);
    const at::Tensor& local_dy = std::get<2>(sums);

    at::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) {
      const at::Tensor combined = at::empty({2 * channels}, x.options().dtype(at::kDouble));
      double* sum = combined.data_ptr<double>();
      read_doubles(local_dy, sum);
      read_doubles(local_dy_xmu, sum + channels);
      group.all_reduce_sum(combined);
      std::vector<double> w(c_count, 1.0), a(c_count), b(c_count), scale(c_count);
      if (affine) read_doubles(weight, w.data());
      for (std::size_t c = 0; c < c_count; ++c) {
        const double mean_dy = sum[c] / total;
        const double projection = sum[c_count + c] * invstd[c] * invstd[c] / total;
        scale[c] = affine ? invstd[c] * w[c] : invstd[c];
        a[c] = -(projection * scale[c]);
        b[c] = (mean[c] * projection - mean_dy) * scale[c];
      }
      grad_input = typed_affine(x, rounded(a, x), rounded(b, x));
      grad_input.addcmul_(dy, per_channel(rounded(scale, x), x.dim()));
    }
    if (affine && ctx->needs_input_grad(1)) {
      std::vector<double> g(c_count);
      read_doubles(local_dy_xmu, g.data());
      for (std::size_t c = 0; c < c_count; ++c) g[c] *= invstd[c];
      grad_weight = rounded(g, weight);
    }
    if (affine && ctx->needs_input_grad(2)) {
      grad_bias = local_dy.to(weight.scalar_type());  // float to double is exact either way
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor()};
  }
};

}  // namespace detail::sync_batch_norm

}  // namespace tandem::torch
