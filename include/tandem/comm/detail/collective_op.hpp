// tandem/comm/detail/collective_op.hpp - the collective operations every backend names, and how
// the ranks' descriptions of one call are compared (the texts of a mismatch Error).
//   std::string text = tandem::detail::call_disagreement(calls);   // "" when the ranks agree
// Needs: the standard library. Not a public header: backends include it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem::detail {

enum class CollectiveOp : std::uint8_t {
  all_reduce,
  reduce,
  broadcast,
  all_gather,
  gather,
  scatter,
  reduce_scatter,
  all_to_all,
  barrier,
  split,
};

constexpr const char* name(CollectiveOp op) noexcept {
  switch (op) {
    case CollectiveOp::all_reduce:
      return "all_reduce";
    case CollectiveOp::reduce:
      return "reduce";
    case CollectiveOp::broadcast:
      return "broadcast";
    case CollectiveOp::all_gather:
      return "all_gather";
    case CollectiveOp::gather:
      return "gather";
    case CollectiveOp::scatter:
      return "scatter";
    case CollectiveOp::reduce_scatter:
      return "reduce_scatter";
    case CollectiveOp::all_to_all:
      return "all_to_all";
    case CollectiveOp::barrier:
      return "barrier";
    case CollectiveOp::split:
      return "split";
  }
  return "unknown";
}

constexpr bool is_typed(CollectiveOp op) noexcept {
  return op != CollectiveOp::barrier && op != CollectiveOp::split;
}
constexpr bool has_root(CollectiveOp op) noexcept {
  return op == CollectiveOp::reduce || op == CollectiveOp::broadcast ||
         op == CollectiveOp::gather || op == CollectiveOp::scatter;
}
constexpr bool has_reduce_op(CollectiveOp op) noexcept {
  return op == CollectiveOp::all_reduce || op == CollectiveOp::reduce ||
         op == CollectiveOp::reduce_scatter;
}

inline std::string rank_list(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i) text += ", ";
    text += std::to_string(ranks[i]);
  }
  return text;
}

/// "" when all ranks have the same value, otherwise "ranks 0, 2: float32; rank 1: int32".
template <class Value, class Show>
std::string disagreement(const std::vector<Value>& values, Show show) {
  std::vector<std::pair<Value, std::vector<int>>> distinct;
  for (std::size_t r = 0; r < values.size(); ++r) {
    auto found = std::find_if(distinct.begin(), distinct.end(),
                              [&](const auto& entry) { return entry.first == values[r]; });
    if (found == distinct.end()) {
      distinct.push_back({values[r], {static_cast<int>(r)}});
    } else {
      found->second.push_back(static_cast<int>(r));
    }
  }
  if (distinct.size() < 2) return {};
  std::string text;
  for (const auto& [value, ranks] : distinct) {
    if (!text.empty()) text += "; ";
    text += rank_list(ranks) + ": " + show(value);
  }
  return text;
}

/// One field of every rank's call, in rank order.
template <class Call, class Get>
auto field_values(const std::vector<Call>& calls, Get get) {
  std::vector<std::decay_t<decltype(get(calls.front()))>> values;
  values.reserve(calls.size());
  for (const auto& call : calls) values.push_back(get(call));
  return values;
}

inline constexpr auto show_int = [](auto value) { return std::to_string(value); };

// A Call describes what one rank was called with. Its fields op, type, count, root and reduce_op
// hold a CollectiveOp, dtype, count, root and ReduceOp, as those types or as integers.

/// "" when the ranks called the same operation, else the Error's cause.
template <class Call>
std::string operation_disagreement(const std::vector<Call>& calls) {
  const auto ops = field_values(calls, [](const Call& c) { return c.op; });
  auto show = [](auto v) { return std::string(name(static_cast<CollectiveOp>(v))); };
  if (auto text = disagreement(ops, show); !text.empty()) {
    return "ranks called different operations: " + text;
  }
  return {};
}

/// For calls of one operation: "" when the ranks agree on what that operation compares (element
/// type and count, root, reduce op), else the Error's cause.
template <class Call>
std::string argument_disagreement(const std::vector<Call>& calls) {
  const auto op = static_cast<CollectiveOp>(calls.front().op);
  if (is_typed(op)) {
    const auto types = field_values(calls, [](const Call& c) { return c.type; });
    auto show_type = [](auto v) { return std::string(tandem::name(static_cast<dtype>(v))); };
    if (auto text = disagreement(types, show_type); !text.empty()) {
      return "ranks disagree on the element type: " + text;
    }
    const auto counts = field_values(calls, [](const Call& c) { return c.count; });
    if (auto text = disagreement(counts, show_int); !text.empty()) {
      return "ranks disagree on the element count: " + text;
    }
  }
  if (has_root(op)) {
    const auto roots = field_values(calls, [](const Call& c) { return c.root; });
    if (auto text = disagreement(roots, show_int); !text.empty()) {
      return "ranks disagree on the root: " + text;
    }
  }
  if (has_reduce_op(op)) {
    const auto reduce_ops = field_values(calls, [](const Call& c) { return c.reduce_op; });
    auto show_reduce = [](auto v) { return std::string(tandem::name(static_cast<ReduceOp>(v))); };
    if (auto text = disagreement(reduce_ops, show_reduce); !text.empty()) {
      return "ranks disagree on the reduce op: " + text;
    }
  }
  return {};
}

/// The first way the ranks' calls disagree, or "".
template <class Call>
std::string call_disagreement(const std::vector<Call>& calls) {
  if (auto text = operation_disagreement(calls); !text.empty()) return text;
  return argument_disagreement(calls);
}

}  // namespace tandem::detail
