// SGD and AdamW on device memory with tandem::cuda_exec: the same fused passes as on the host,
// so after 20 golden steps (tests/reference/optim.txt) the device parameters and state equal the
// host's bitwise (fmaf, IEEE division and sqrtf on both) and PyTorch's. Compiles wherever nvcc
// is; exits 77 ("SKIPPED") without a GPU. Its own main, so that it can exit 77.
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "support/golden.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/cuda.hpp"
#include "tandem/optim/adamw.hpp"
#include "tandem/optim/optimizer.hpp"
#include "tandem/optim/sgd.hpp"

namespace {

using tandem::cuda_exec;
using tandem::device;
using tandem::host;
namespace optim = tandem::optim;

static_assert(tandem::Optimizer<optim::SGD<float, device, cuda_exec>>);
static_assert(tandem::Optimizer<optim::AdamW<float, device, cuda_exec>>);
static_assert(tandem::Optimizer<optim::SGD<tandem::half, device>>);
static_assert(tandem::Optimizer<optim::AdamW<tandem::bfloat16, device>>);
static_assert(std::is_same_v<optim::AdamW<float, device>::executor_type, cuda_exec>);

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok && failures++ < 20) std::printf("FAILED: %s\n", what.c_str());
}

const tandem::test::Golden& golden() {
  static const tandem::test::Golden file("optim.txt");
  return file;
}

template <class T, class Space>
tandem::Parameters<T, Space> model() {
  tandem::Parameters<T, Space> params;
  params.add("layer2.weight", {5, 7});
  params.add("layer2.bias", {5});
  params.add("layer3.weight", {3, 5});
  params.add("layer3.bias", {3});
  if constexpr (std::is_same_v<Space, device>) {
    params.finalize(cuda_exec{});
  } else {
    params.finalize();
  }
  return params;
}

template <class T>
std::vector<T> rounded(const std::vector<double>& values, std::size_t offset, std::size_t n) {
  std::vector<T> out;
  for (std::size_t i = 0; i < n; ++i) out.push_back(T(static_cast<float>(values.at(offset + i))));
  return out;
}

template <class T>
std::vector<std::remove_const_t<T>> to_host(tandem::View<T, device> view) {
  std::vector<std::remove_const_t<T>> out(view.size());
  tandem::copy(out, view);
  return out;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// Runs an optimizer (SGD or AdamW) with a golden case's options on host and device parameters of
/// type T and compares parameters and state after 20 steps.
template <class HostOptimizer, class DeviceOptimizer, class Options, class T>
void compare(const std::string& name, const std::vector<optim::ParamGroup<Options>>& groups) {
  auto host_params = model<T, host>();
  auto device_params = model<T, device>();
  const auto init = rounded<T>(golden().values("model/init"), 0, host_params.numel());
  std::copy(init.begin(), init.end(), host_params.values().begin());
  tandem::copy(device_params.values(), init);
  HostOptimizer on_host(host_params, groups);
  DeviceOptimizer on_device(device_params, groups, cuda_exec{});
  const auto& grads = golden().values("model/grads");
  for (std::size_t step = 0; step < 20; ++step) {
    const auto g = rounded<T>(grads, step * host_params.numel(), host_params.numel());
    std::copy(g.begin(), g.end(), host_params.grads().begin());
    tandem::copy(device_params.grads(), g);
    on_host.step();
    on_device.step();
  }
  on_device.executor().synchronize();
  const std::vector<T> host_values(host_params.values().begin(), host_params.values().end());
  check(same_bits(to_host(device_params.values()), host_values), name + ": parameters");
  if constexpr (std::is_same_v<T, float>) {
    const auto& trajectory = golden().values(name + "/params");
    check(same_bits(host_values,
                    rounded<float>(trajectory, 19 * host_params.numel(), host_params.numel())),
          name + ": host parameters vs PyTorch");
  }
  // state_dict on the device holds device tensors; load_state_dict takes them back.
  const auto host_state = on_host.state_dict();
  const auto device_state = on_device.state_dict();
  for (const auto& [index, state] : host_state.state) {
    for (const auto& [key, tensor] : state.tensors) {
      const auto& other = device_state.state.at(index).tensors.at(key);
      check(same_bits(to_host(other.view()), std::vector<float>(tensor.begin(), tensor.end())),
            name + ": state " + std::to_string(index) + "/" + key);
    }
  }
  on_device.load_state_dict(device_state);
  on_device.zero_grad();
  on_device.executor().synchronize();
  for (T value : to_host(device_params.grads())) {
    check(static_cast<float>(value) == 0, name + ": zero_grad");
  }
}

template <class T>
void compare_all(const char* type) {
  const std::string suffix = std::string(" (") + type + ")";
  compare<optim::SGD<T, host>, optim::SGD<T, device, cuda_exec>, optim::SGDOptions, T>(
      "sgd/mixed", {{optim::params_with_prefix("layer2."),
                     {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-4, .nesterov = true}},
                    {optim::params_with_prefix("layer3."),
                     {.lr = 0.2, .momentum = 0.5, .dampening = 0.3, .weight_decay = 5e-3}}});
  compare<optim::AdamW<T, host>, optim::AdamW<T, device, cuda_exec>, optim::AdamWOptions, T>(
      "adamw/mixed", {{optim::params_with_prefix("layer2."),
                       {.lr = 0.01, .betas = {0.8, 0.99}, .eps = 1e-6, .weight_decay = 0.1}},
                      {optim::params_with_prefix("layer3."),
                       {.lr = 0.02, .weight_decay = 0.0, .amsgrad = true, .maximize = true}}});
  std::printf("%s: %s\n", suffix.c_str(), failures == 0 ? "passed" : "FAILED");
}

}  // namespace

int main() {
  if (tandem::cuda::device_count() == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  try {
    compare_all<float>("float");
    compare_all<tandem::half>("half");
    compare_all<tandem::bfloat16>("bfloat16");
  } catch (const std::exception& error) {
    std::printf("FAILED: %s\n", error.what());
    return 1;
  }
  return failures == 0 ? 0 : 1;
}
