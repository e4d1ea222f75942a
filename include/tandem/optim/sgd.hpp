// tandem/optim/sgd.hpp - tandem::optim::SGD: PyTorch's SGD (momentum, dampening, nesterov,
// weight decay, maximize) over a Parameters arena, one fused pass per param group.
//   tandem::optim::SGD sgd(params, {.lr = 0.1, .momentum = 0.9});  sgd.step();  sgd.zero_grad();
// Needs: the standard library, tandem/arena/parameters.hpp; device parameters need tandem/cuda.hpp.
#pragma once

#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tandem/arena/parameters.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/error.hpp"
#include "tandem/optim/param_groups.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::optim {

/// SGD's hyperparameters, PyTorch's names and defaults (lr: torch 2.x's default 1e-3; torch 1.13
/// had none).
struct SGDOptions {
  /// The learning rate (step size); >= 0.
  double lr = 1e-3;
  /// The momentum factor; 0 keeps no momentum buffer.
  double momentum = 0;
  /// Scales down the gradient added to the momentum buffer, by (1 - dampening), after the first
  /// step.
  double dampening = 0;
  /// L2 penalty: weight_decay * p is added to the gradient (coupled, unlike AdamW's).
  double weight_decay = 0;
  /// Nesterov momentum: steps along gradient + momentum * buffer; needs momentum > 0 and no
  /// dampening.
  bool nesterov = false;
  /// Ascend the gradient instead of descending it.
  bool maximize = false;

  /// PyTorch's ValueError cases, as a tandem::Error: negative (or NaN) lr, momentum or
  /// weight_decay; nesterov without momentum or with dampening. Stricter than PyTorch, an
  /// infinite value is refused too: it would turn every parameter into inf or NaN at the first
  /// step.
  void validate(const char* optimizer = "optim::SGD") const {
    if (!(lr >= 0) || std::isinf(lr))
      throw Error(optimizer, "invalid learning rate: " + std::to_string(lr));
    if (!(momentum >= 0) || std::isinf(momentum)) {
      throw Error(optimizer, "invalid momentum value: " + std::to_string(momentum));
    }
    if (!(weight_decay >= 0) || std::isinf(weight_decay)) {
      throw Error(optimizer, "invalid weight_decay value: " + std::to_string(weight_decay));
    }
    if (nesterov && (momentum <= 0 || dampening != 0)) {
      throw Error(optimizer, "Nesterov momentum requires a momentum and zero dampening");
    }
  }
};

namespace detail {

/// Which momentum branch a pass takes; a template parameter so that each loop is branch-free.
enum class momentum_mode { none, first_step, running };

/// One SGD step over a group's slice, PyTorch's single-tensor update in M (float for float, half
/// and bfloat16 parameters; double for double) with its rounding: `add(x, alpha=a)` is a fused
/// multiply-add in PyTorch's CPU kernels, so it is one here.
///   d = maximize ? -g : g;  d += weight_decay * p  (when weight_decay != 0);
///   buf = first step ? d : momentum * buf + (1 - dampening) * d;
///   d = nesterov ? d + momentum * buf : buf;  p -= lr * d
template <class T, momentum_mode Mode>
struct sgd_update {
  using M = opmath_t<T>;
  T* param;
  const T* grad;
  M* momentum_buffer;  // unused without momentum
  M neg_lr;
  M momentum;
  M one_minus_dampening;
  M weight_decay;
  bool nesterov;
  bool maximize;

  TANDEM_HD void operator()(std::size_t i) const {
    const M p = static_cast<M>(param[i]);
    const M g = static_cast<M>(grad[i]);
    M d = maximize ? -g : g;
    d = weight_decay != M(0) ? fused_multiply_add(weight_decay, p, d) : d;
    if constexpr (Mode != momentum_mode::none) {
      M buf = d;
      if constexpr (Mode == momentum_mode::running) {
        buf = fused_multiply_add(one_minus_dampening, d, momentum_buffer[i] * momentum);
      }
      momentum_buffer[i] = buf;
      d = nesterov ? fused_multiply_add(momentum, buf, d) : buf;
    }
    param[i] = static_cast<T>(fused_multiply_add(neg_lr, d, p));
  }
};

}  // namespace detail

/// Stochastic gradient descent with PyTorch's semantics and numbers (torch.optim.SGD, its
/// single-tensor form). Param groups are contiguous runs of the arena; the momentum buffers are
/// flat, one per group, in the state type (float for half/bfloat16 parameters).
template <element_type T, memory_space Space = host, class E = default_executor_t<Space>>
requires ExecutorFor<E, Space>
class SGD : public detail::GroupedOptimizer<SGDOptions, T, Space, E> {
  using Base = detail::GroupedOptimizer<SGDOptions, T, Space, E>;
  using typename Base::Group;

 public:
  using typename Base::state_dict_type;
  using typename Base::state_type;

  /// Every trained parameter in one group.
  SGD(Parameters<T, Space>& params, SGDOptions options, E exec = E{})
      : SGD(params, {ParamGroup<SGDOptions>{all_params(), options}}, std::move(exec)) {}

  /// One group per entry; groups may not overlap. Parameters in no group are not updated.
  SGD(Parameters<T, Space>& params, std::initializer_list<ParamGroup<SGDOptions>> groups,
      E exec = E{})
      : SGD(params, std::span<const ParamGroup<SGDOptions>>(groups.begin(), groups.size()),
            std::move(exec)) {}

  /// The same with groups made at run time (a std::vector converts).
  SGD(Parameters<T, Space>& params, std::span<const ParamGroup<SGDOptions>> groups, E exec = E{})
      : Base("optim::SGD", params, groups, std::move(exec)), buffers_(this->groups_.size()) {}

  /// One update of every group: one fused pass each (asynchronous on a device executor).
  void step() {
    for (std::size_t g = 0; g < this->groups_.size(); ++g) {
      Group& group = this->groups_[g];
      const SGDOptions& o = group.options;
      o.validate(this->name_);
      MomentumBuffer& buffer = buffers_[g];
      const bool uses_momentum = o.momentum != 0;
      const bool first_step = uses_momentum && !buffer.started;
      if (uses_momentum && buffer.values.size() != group.state_size) {
        buffer.values = Buffer<state_type, Space>(group.state_size);
      }
      M* data = uses_momentum ? buffer.values.data() : nullptr;
      if (!uses_momentum) {
        launch<detail::momentum_mode::none>(group, data);
      } else if (first_step) {
        launch<detail::momentum_mode::first_step>(group, data);
      } else {
        launch<detail::momentum_mode::running>(group, data);
      }
      buffer.started = buffer.started || uses_momentum;
      ++group.step;
    }
  }

  /// Bytes of optimizer state held (the momentum buffers): under sharding, this rank's part.
  [[nodiscard]] std::size_t state_bytes() const noexcept {
    std::size_t elements = 0;
    for (const auto& buffer : buffers_) elements += buffer.values.size();
    return elements * sizeof(state_type);
  }

  /// PyTorch's layout: state[i] has "momentum_buffer" once group i's momentum has started (an
  /// empty entry after a step without momentum, as PyTorch's None); param_groups carry "lr",
  /// "momentum", "dampening", "weight_decay", "nesterov", "maximize". Waits for the copies.
  /// Sharded (DistributedDataParallel::shard): a collective that gathers the full state.
  [[nodiscard]] state_dict_type state_dict() const {
    const auto options_of = [](const SGDOptions& o) -> std::map<std::string, double> {
      return {{"lr", o.lr},
              {"momentum", o.momentum},
              {"dampening", o.dampening},
              {"weight_decay", o.weight_decay},
              {"nesterov", o.nesterov ? 1.0 : 0.0},
              {"maximize", o.maximize ? 1.0 : 0.0}};
    };
    return this->collect_state_dict(
        options_of, [this](const Group& group, std::size_t g, state_dict_type& dict) {
          if (!buffers_[g].started) {  // an empty entry per parameter, as PyTorch's None
            for (std::size_t p = group.params.first; p < group.params.last; ++p) {
              (void)dict.state[Base::state_index(group, p)];
            }
            return;
          }
          Buffer<state_type, Space> scratch;
          const M* flat = this->full_state(group, buffers_[g].values, scratch);
          for (std::size_t p = group.params.first; p < group.params.last; ++p) {
            dict.state[Base::state_index(group, p)].tensors.emplace(
                "momentum_buffer", this->export_state(group, p, flat));
          }
        });
  }

  /// Restores hyperparameters, step counts and momentum buffers; an Error (and nothing changed)
  /// when the dict does not fit these groups, an option is missing or invalid, or only some of a
  /// group's parameters have a momentum buffer.
  void load_state_dict(const state_dict_type& dict) {
    const std::string operation = std::string(this->name_) + "::load_state_dict";
    this->check_layout(dict);
    std::vector<SGDOptions> options(this->groups_.size());
    std::vector<bool> started(this->groups_.size());
    for (std::size_t g = 0; g < this->groups_.size(); ++g) {
      const auto& in = dict.param_groups[g].options;
      const char* op = operation.c_str();
      options[g] = {detail::option(in, "lr", op),
                    detail::option(in, "momentum", op),
                    detail::option(in, "dampening", op),
                    detail::option(in, "weight_decay", op),
                    detail::option(in, "nesterov", op) != 0,
                    detail::option(in, "maximize", op) != 0};
      options[g].validate(op);
      const Group& group = this->groups_[g];
      started[g] = this->group_has_state(dict, g, "a momentum_buffer", [](const auto& entry) {
        return entry.tensors.contains("momentum_buffer");
      });
      for (std::size_t p = group.params.first; p < group.params.last && started[g]; ++p) {
        this->require_state(group, p, dict.state.at(Base::state_index(group, p)),
                            "momentum_buffer");
      }
    }
    for (std::size_t g = 0; g < this->groups_.size(); ++g) {
      Group& group = this->groups_[g];
      group.options = options[g];
      group.step = dict.param_groups[g].step;
      buffers_[g].started = started[g];
      if (!started[g]) continue;
      if (buffers_[g].values.size() != group.state_size) {
        buffers_[g].values = Buffer<state_type, Space>(group.state_size);
      }
      Buffer<state_type, Space> scratch;
      M* flat = this->import_target(group, buffers_[g].values, scratch);
      for (std::size_t p = group.params.first; p < group.params.last; ++p) {
        this->import_state(group, p,
                           dict.state.at(Base::state_index(group, p)).tensors.at("momentum_buffer"),
                           "momentum_buffer", flat);
      }
      this->exec_.synchronize();
      this->keep_owned(group, scratch, buffers_[g].values);
    }
    this->exec_.synchronize();  // the dict may go away as soon as this returns
  }

 private:
  using M = state_type;

  template <detail::momentum_mode Mode>
  void launch(const Group& group, M* momentum_buffer) {
    const SGDOptions& o = group.options;
    for (const auto& piece : group.pieces) {  // the whole group, or its owned parts (ZeRO)
      detail::run_pass(
          this->exec_, piece.size,
          detail::sgd_update<T, Mode>{
              this->values_.data() + piece.offset, this->grads_.data() + piece.offset,
              momentum_buffer != nullptr ? momentum_buffer + piece.state_offset : nullptr,
              static_cast<M>(-o.lr), static_cast<M>(o.momentum), static_cast<M>(1 - o.dampening),
              static_cast<M>(o.weight_decay), o.nesterov, o.maximize});
    }
  }

  struct MomentumBuffer {
    Buffer<state_type, Space> values;  // allocated when momentum is first used
    bool started = false;              // PyTorch's "momentum_buffer is not None"
  };

  std::vector<MomentumBuffer> buffers_;
};

}  // namespace tandem::optim
