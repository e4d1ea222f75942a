// tandem/optim/optimizer.hpp - the Optimizer concept: what GradScaler, schedulers and training
// loops need of an optimizer (step, zero_grad, the gradients it reads, its executor, its state).
//   template <tandem::Optimizer O> void train_step(O& opt) { opt.step(); opt.zero_grad(); }
// Needs: the standard library, tandem/tensor.
#pragma once

#include <concepts>
#include <type_traits>

#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// An optimizer over a flat parameter arena, as tandem's training tools use it:
/// 1. `typename O::value_type` is the parameter (and gradient) element type and
///    `typename O::memory_space` the memory space they live in;
/// 2. `opt.step()` applies one update to every parameter it owns;
/// 3. `opt.zero_grad()` zeroes those parameters' gradients;
/// 4. `opt.grads()` is a View<value_type, memory_space> over every gradient the optimizer reads
///    (GradScaler unscales and inf-checks exactly this view);
/// 5. `opt.executor()` is the Executor the optimizer runs its passes on, able to touch
///    memory_space;
/// 6. `opt.load_state_dict(opt.state_dict())` round-trips its state.
template <class O>
concept Optimizer = requires {
  typename O::value_type;
  typename O::memory_space;
}
&&memory_space<typename O::memory_space>&& requires(O& opt) {
  opt.step();
  opt.zero_grad();
  { opt.grads() } -> std::convertible_to<View<typename O::value_type, typename O::memory_space>>;
  { opt.executor() } -> ExecutorFor<typename O::memory_space>;
  opt.load_state_dict(opt.state_dict());
};

}  // namespace tandem
