// tests/unit/amp/fake_optimizer.hpp - the smallest tandem::Optimizer for GradScaler's tests: it
// owns a flat gradient block and counts its steps, so tests see exactly what GradScaler did.
#pragma once

#include <cstddef>
#include <map>
#include <string>

#include "tandem/optim/optimizer.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::test {

template <class T = float>
class CountingOptimizer {
 public:
  using value_type = T;
  using memory_space = host;

  explicit CountingOptimizer(std::size_t size) : grads_(size) {}

  void step() { ++steps; }
  void zero_grad() {
    for (auto& g : grads_) g = T{};
  }
  [[nodiscard]] View<T, host> grads() { return grads_.view(); }
  [[nodiscard]] host_exec executor() const { return {}; }
  [[nodiscard]] std::map<std::string, double> state_dict() const {
    return {{"steps", static_cast<double>(steps)}};
  }
  void load_state_dict(const std::map<std::string, double>& state) {
    steps = static_cast<int>(state.at("steps"));
  }

  int steps = 0;

 private:
  Buffer<T, host> grads_;
};

static_assert(Optimizer<CountingOptimizer<float>>);
static_assert(Optimizer<CountingOptimizer<half>>);

}  // namespace tandem::test
