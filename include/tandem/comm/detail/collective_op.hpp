// tandem/comm/detail/collective_op.hpp - the collective operations every backend names, and the
// pieces of a mismatch Error's text (tandem/comm/checked.hpp composes them).
//   std::string what = tandem::detail::first_difference(calls);   // "" when the ranks agree
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
#include "tandem/core/detail/disagreement.hpp"
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

/// What the ranks' calls disagree on first, as the start of an Error's cause: "ranks called
/// different operations", "ranks disagree on the element type" (then the element count, the
/// root, the reduce op; each only where the operation has it); "" when they agree on all of it.
/// checked.hpp's fingerprint_disagreement adds every rank's whole call.
template <class Call>
std::string first_difference(const std::vector<Call>& calls) {
  auto differ = [&](auto get) { return !disagreement(field_values(calls, get), show_int).empty(); };
  if (differ([](const Call& c) { return static_cast<std::int64_t>(c.op); })) {
    return "ranks called different operations";
  }
  const auto op = static_cast<CollectiveOp>(calls.front().op);
  if (is_typed(op)) {
    if (differ([](const Call& c) { return static_cast<std::int64_t>(c.type); })) {
      return "ranks disagree on the element type";
    }
    if (differ([](const Call& c) { return static_cast<std::int64_t>(c.count); })) {
      return "ranks disagree on the element count";
    }
  }
  if (has_root(op) && differ([](const Call& c) { return static_cast<std::int64_t>(c.root); })) {
    return "ranks disagree on the root";
  }
  if (has_reduce_op(op) &&
      differ([](const Call& c) { return static_cast<std::int64_t>(c.reduce_op); })) {
    return "ranks disagree on the reduce op";
  }
  return {};
}

}  // namespace tandem::detail
