// tandem/torch/detail/grad_hooks.hpp - how torch::DistributedDataParallel hears that autograd
// finished a parameter's gradient: a post hook on the parameter's gradient accumulator.
//   accumulator->add_post_hook(std::make_unique<detail::GradReadyHook<Owner>>(owner, index));
// Needs: libtorch's autograd; included by tandem/torch/ddp.hpp, not by users.
#pragma once

#include <cstddef>
#include <utility>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace tandem::torch::detail {

/// The owning handle to a gradient accumulator: std::shared_ptr in libtorch 1.13,
/// c10::intrusive_ptr in 2.15 (PyTorch's wheel); both give -> and a test for null.
using AccumulatorPtr = decltype(::torch::autograd::impl::grad_accumulator(
    std::declval<const ::torch::autograd::Variable&>()));

/// Calls owner->on_grad_ready(index) after autograd accumulated a parameter's gradient.
template <class Owner>
struct GradReadyHook final : ::torch::autograd::FunctionPostHook {
  GradReadyHook(Owner* o, std::size_t i) : owner(o), index(i) {}
  ::torch::autograd::variable_list operator()(
      const ::torch::autograd::variable_list& grad_inputs,
      const ::torch::autograd::variable_list& /*grad_outputs*/) override {
    owner->on_grad_ready(index);
    return grad_inputs;
  }
  Owner* owner;
  std::size_t index;
};

}  // namespace tandem::torch::detail
