// tandem/optim/state_dict.hpp - tandem::optim::StateDict: an optimizer's state in PyTorch's shape
// (optimizer.state_dict()), which SGD and AdamW save and load and tandem's checkpoints write.
//   auto dict = sgd.state_dict();   dict.param_groups[0].options["lr"]; sgd.load_state_dict(dict);
// Needs: the standard library, tandem/tensor (the state's buffers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::optim {

/// An optimizer's state in PyTorch's shape (optimizer.state_dict()):
/// - `state[i]`: parameter i's state, i numbering the parameters group after group as PyTorch
///   does (with groups in registration order, i is the registration index); `tensors` holds
///   "momentum_buffer" (SGD) or "exp_avg", "exp_avg_sq", "max_exp_avg_sq" (AdamW), shaped like
///   the parameter and in the optimizer's memory space; `scalars` holds "step" (AdamW);
/// - `param_groups[g]`: the group's hyperparameters under PyTorch's keys ("lr", "momentum",
///   "dampening", "weight_decay", "nesterov", "maximize"; "betas" are "beta1" and "beta2",
///   booleans 0 or 1), `params`, the indices of its parameters, and `step`, the steps the group
///   has taken (every parameter of a group steps together).
/// A parameter has no entry in `state` before its first step, as in PyTorch.
template <class State = float, memory_space Space = host>
struct StateDict {
  /// One parameter's state, by PyTorch's key names.
  struct ParamState {
    /// Scalar state ("step" for AdamW).
    std::map<std::string, double> scalars;
    /// Tensor state, shaped like the parameter ("momentum_buffer"; "exp_avg", ...).
    std::map<std::string, Buffer<State, Space>> tensors;
  };
  /// One param group's hyperparameters and members.
  struct GroupState {
    /// Hyperparameters under PyTorch's keys; booleans as 0 or 1.
    std::map<std::string, double> options;
    /// The indices (into `state`) of the group's parameters.
    std::vector<std::size_t> params;
    /// The steps the group has taken.
    std::int64_t step = 0;
  };

  /// Per-parameter state by parameter index; absent before the parameter's first step.
  std::map<std::size_t, ParamState> state;
  /// One entry per param group, in the optimizer's order.
  std::vector<GroupState> param_groups;
};

}  // namespace tandem::optim
