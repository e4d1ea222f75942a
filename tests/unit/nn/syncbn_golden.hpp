// tests/unit/nn/syncbn_golden.hpp - reads one case of tests/reference/syncbn.txt (written by
// golden_syncbn.py with PyTorch) and checks one rank's SyncBatchNorm against it, on any
// Communicator (LocalComm threads here, Gloo processes in gloo_sync_batch_norm.cpp) and in any
// memory space (device tensors in sync_batch_norm_device.cu, which includes tandem/cuda.hpp).
//
// Tolerances. tandem keeps every sum and statistic in double and rounds each stored value once
// to T; the golden values are the exact results in float64 (torch's sync_batch_norm math,
// verified against F.batch_norm with autograd). For float, a value therefore differs from the
// golden one by its final rounding (half an ulp) plus double-precision noise, so we allow
// 2 * eps * |want| (2 to 4 ulps) plus eps * scale, where scale is the largest magnitude in that
// record (values near zero come from cancellation, whose error is relative to the terms);
// running statistics are rounded to float at every step, so they get 4 * eps * |want|. For
// double, the summation order differs from torch's pairwise sums; we allow 16 eps relative to
// the same terms, still far below any arithmetic mistake (the golden script's own self-check
// catches a running variance off by 1e-7 relative).
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "support/collective_suite.hpp"
#include "support/golden.hpp"
#include "tandem/nn/sync_batch_norm.hpp"

namespace tandem::test::syncbn {

inline const tandem::test::Golden& golden() {
  static const tandem::test::Golden file("syncbn.txt");
  return file;
}

inline Shape make_shape(const std::vector<double>& extents) {
  std::vector<std::int64_t> e(extents.begin(), extents.end());
  switch (e.size()) {
    case 2:
      return Shape{e[0], e[1]};
    case 3:
      return Shape{e[0], e[1], e[2]};
    case 4:
      return Shape{e[0], e[1], e[2], e[3]};
    case 5:
      return Shape{e[0], e[1], e[2], e[3], e[4]};
    default:
      throw std::runtime_error("syncbn.txt: unexpected rank " + std::to_string(e.size()));
  }
}

/// One case of syncbn.txt: its configuration and shapes.
struct GoldenCase {
  std::string name;
  int world = 0;
  std::int64_t channels = 0;
  SyncBatchNormOptions options;
  int steps = 0;
  std::vector<Shape> shapes;

  explicit GoldenCase(std::string case_name) : name(std::move(case_name)) {
    const auto& config = golden().values(name + "/config");
    world = static_cast<int>(config.at(0));
    channels = static_cast<std::int64_t>(config.at(1));
    options.affine = config.at(2) != 0;
    options.momentum = config.at(3) < 0 ? std::nullopt : std::optional<double>(config.at(3));
    options.eps = config.at(4);
    steps = static_cast<int>(config.at(5));
    for (int r = 0; r < world; ++r) {
      shapes.push_back(make_shape(golden().values(name + "/r" + std::to_string(r) + "/shape")));
    }
  }

  [[nodiscard]] const std::vector<double>& at(const std::string& key) const {
    return golden().values(name + "/" + key);
  }
};

template <class T>
Buffer<T> filled(Shape shape, const std::vector<double>& values) {
  Buffer<T> buffer(shape);
  if (buffer.size() != values.size()) {
    throw std::runtime_error("syncbn.txt: " + std::to_string(values.size()) + " values for shape " +
                             shape.to_string());
  }
  for (std::size_t i = 0; i < values.size(); ++i) buffer[i] = static_cast<T>(values[i]);
  return buffer;
}

/// Compares got with PyTorch's want under the tolerance explained at the top of this file;
/// returns how many values it compared (each one that differs is a failure).
template <class T>
std::size_t expect_close(Failures& failures, const std::string& what, View<const T> got,
                         const std::vector<double>& want, double relative_units = 2.0) {
  if (got.size() != want.size()) {
    failures.add(what, ": ", got.size(), " values, golden has ", want.size());
    return 0;
  }
  constexpr double eps = std::numeric_limits<T>::epsilon();
  const double units = std::same_as<T, float> ? 1.0 : 16.0;
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double tolerance = units * eps * (relative_units * std::abs(want[i]) + scale);
    const double error = std::abs(static_cast<double>(got[i]) - want[i]);
    if (!(error <= tolerance)) {
      failures.add(what, "[", i, "] = ", static_cast<double>(got[i]), ", PyTorch ", want[i],
                   " (error ", error, " > ", tolerance, ")");
      return want.size();
    }
  }
  return want.size();
}

/// `host_values` in memory space Space (a synchronous copy; host: the same values).
template <class T, class Space>
Buffer<T, Space> in_space(const Buffer<T>& host_values) {
  Buffer<T, Space> placed(host_values.shape());
  space_copy<Space, host>::copy(placed.data(), host_values.data(), host_values.size_bytes());
  return placed;
}

/// A host copy of `values` from memory space Space (synchronous; device memory must have been
/// written by finished work, so synchronise the executor first).
template <class T, class Space>
Buffer<T> host_copy(View<const T, Space> values) {
  Buffer<T> copy(values.shape());
  space_copy<host, Space>::copy(copy.data(), values.data(), values.size_bytes());
  return copy;
}

/// Writes golden `values` into `to` (a module's parameter view in Space).
template <class T, class Space>
void assign(View<T, Space> to, const std::vector<double>& values) {
  const auto placed = in_space<T, Space>(filled<T>(to.shape(), values));
  space_copy<Space, Space>::copy(to.data(), placed.data(), placed.size_bytes());
}

/// Rank comm.rank() of golden case `name` (comm.size() must be the case's world): every
/// training step, then eval mode, with tensors in Space and the module running on `exec`.
/// Collective: every rank of comm calls it. Returns how many values this rank compared with
/// PyTorch's (what differs is in `failures`).
template <class T, class Space = host, class Comm, class Exec = default_executor_t<Space>>
std::size_t check_golden_rank(Comm& comm, const std::string& name, Failures& failures,
                              Exec exec = {}) {
  const GoldenCase gc(name);
  if (comm.size() != gc.world) {
    throw std::runtime_error(name + " is a case for " + std::to_string(gc.world) + " ranks, not " +
                             std::to_string(comm.size()));
  }
  const int r = comm.rank();
  const std::string rank = "r" + std::to_string(r);
  const Shape shape = gc.shapes[static_cast<std::size_t>(r)];
  SyncBatchNorm<Comm, T, Space, Exec> bn(comm, gc.channels, gc.options, exec);
  if (gc.options.affine) {
    assign(bn.weight(), gc.at("weight"));
    assign(bn.bias(), gc.at("bias"));
  }
  // Device results are read on the legacy default stream: wait for the module's stream first.
  auto result = [&](View<const T, Space> values) {
    bn.executor().synchronize();
    return host_copy<T, Space>(values);
  };
  std::size_t compared = 0;
  auto check_step = [&](const std::string& prefix) {
    const std::string where = name + "/" + prefix;
    const auto input = in_space<T, Space>(filled<T>(shape, gc.at(prefix + "/input")));
    const auto grad_output = in_space<T, Space>(filled<T>(shape, gc.at(prefix + "/grad_output")));
    Buffer<T, Space> output(shape);
    Buffer<T, Space> grad_input(shape);
    if (gc.options.affine) bn.zero_grad();
    bn.forward(input.view(), output.view());
    compared += expect_close<T>(failures, where + "/output", result(output.view()).view(),
                                gc.at(prefix + "/output"));
    bn.backward(input.view(), grad_output.view(), grad_input.view());
    compared += expect_close<T>(failures, where + "/grad_input", result(grad_input.view()).view(),
                                gc.at(prefix + "/grad_input"));
    if (gc.options.affine) {
      compared += expect_close<T>(failures, where + "/grad_weight", result(bn.grad_weight()).view(),
                                  gc.at(prefix + "/grad_weight"));
      compared += expect_close<T>(failures, where + "/grad_bias", result(bn.grad_bias()).view(),
                                  gc.at(prefix + "/grad_bias"));
    }
  };
  for (int s = 0; s < gc.steps; ++s) {
    const std::string step = "s" + std::to_string(s);
    check_step(step + "/" + rank);
    compared +=
        expect_close<T>(failures, name + "/" + step + "/running_mean (" + rank + ")",
                        result(bn.running_mean()).view(), gc.at(step + "/running_mean"), 4.0);
    compared += expect_close<T>(failures, name + "/" + step + "/running_var (" + rank + ")",
                                result(bn.running_var()).view(), gc.at(step + "/running_var"), 4.0);
    failures.expect(bn.num_batches_tracked() == s + 1, name, " step ", s, ": num_batches_tracked ",
                    bn.num_batches_tracked());
    ++compared;
  }
  bn.eval();
  check_step("eval/" + rank);
  return compared;
}

}  // namespace tandem::test::syncbn
