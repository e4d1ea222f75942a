// tests/unit/optim/golden_model.hpp - the model of tests/reference/golden_optim.py as a tandem
// Parameters arena: its shapes, initial values and scripted gradients read from optim.txt.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "support/golden.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/optim/param_groups.hpp"

namespace tandem::test {

inline const Golden& optim_golden() {
  static const Golden golden("optim.txt");
  return golden;
}

inline constexpr int golden_steps = 20;
inline const char* const golden_names[] = {"layer2.weight", "layer2.bias", "layer3.weight",
                                           "layer3.bias"};

/// The golden model's parameters, registered in the golden order and set to its initial values
/// (rounded to T).
template <class T>
Parameters<T> golden_model() {
  const auto& shapes = optim_golden().values("model/shapes");
  Parameters<T> params;
  std::size_t at = 0;
  for (const char* name : golden_names) {
    const auto rank = static_cast<std::size_t>(shapes.at(at++));
    Shape shape = rank == 1 ? Shape{static_cast<std::int64_t>(shapes.at(at))}
                            : Shape{static_cast<std::int64_t>(shapes.at(at)),
                                    static_cast<std::int64_t>(shapes.at(at + 1))};
    at += rank;
    params.add(name, shape);
  }
  params.finalize();
  const auto& init = optim_golden().values("model/init");
  REQUIRE(init.size() == params.numel());
  for (std::size_t i = 0; i < init.size(); ++i) params.values()[i] = T(static_cast<float>(init[i]));
  return params;
}

/// Writes the scripted gradient of step `step` (0-based) into the arena, rounded to T.
template <class T>
void set_golden_grads(Parameters<T>& params, int step) {
  const auto& grads = optim_golden().values("model/grads");
  const std::size_t n = params.numel();
  for (std::size_t i = 0; i < n; ++i) {
    params.grads()[i] = T(static_cast<float>(grads.at(static_cast<std::size_t>(step) * n + i)));
  }
}

/// The two golden param groups (layer2, layer3) with per-group options.
template <class Options>
std::vector<optim::ParamGroup<Options>> golden_groups(const Options& layer2,
                                                      const Options& layer3) {
  return {{optim::params_with_prefix("layer2."), layer2},
          {optim::params_with_prefix("layer3."), layer3}};
}

/// How many of `actual` differ bitwise from expected[offset ...] (float32 values stored exactly
/// as doubles); reports the first difference.
template <class Range>
std::size_t count_bitwise_differences(const Range& actual, const std::vector<double>& expected,
                                      std::size_t offset, const std::string& what) {
  std::size_t differences = 0;
  std::size_t i = 0;
  for (const auto& value : actual) {
    const float got = static_cast<float>(value);
    const float want = static_cast<float>(expected.at(offset + i));
    if (std::memcmp(&got, &want, sizeof(float)) != 0) {
      if (differences == 0) {
        MESSAGE(what << ": first difference at element " << i << ": " << got << " vs PyTorch "
                     << want);
      }
      ++differences;
    }
    ++i;
  }
  return differences;
}

/// Checks an optimizer's state_dict() against PyTorch's final optimizer.state_dict() recorded
/// under `prefix` ("sgd/mixed"): the same tensors per parameter, bitwise, and the same "step".
template <class Dict>
void check_final_state(const Dict& dict, const std::string& prefix, std::size_t param_count) {
  const auto& golden = optim_golden();
  for (std::size_t i = 0; i < param_count; ++i) {
    const std::string head = prefix + "/state/" + std::to_string(i) + "/";
    std::set<std::string> want_tensors;
    for (const auto& key : golden.keys()) {
      if (key.starts_with(head) && key.substr(head.size()) != "step") {
        want_tensors.insert(key.substr(head.size()));
      }
    }
    CAPTURE(head);
    REQUIRE(dict.state.contains(i));
    const auto& state = dict.state.at(i);
    std::set<std::string> got_tensors;
    for (const auto& [key, tensor] : state.tensors) got_tensors.insert(key);
    CHECK(got_tensors == want_tensors);
    for (const auto& key : want_tensors) {
      if (!state.tensors.contains(key)) continue;
      CHECK(count_bitwise_differences(state.tensors.at(key), golden.values(head + key), 0,
                                      head + key) == 0);
    }
    if (golden.contains(head + "step")) {
      REQUIRE(state.scalars.contains("step"));
      CHECK(state.scalars.at("step") == golden.value(head + "step"));
    } else {
      CHECK_FALSE(state.scalars.contains("step"));
    }
  }
}

}  // namespace tandem::test
