// tandem/core/detail/disagreement.hpp - the words of an Error about ranks that disagree: the ranks
// grouped by the value each has, "rank 1" or "ranks 0, 2" before each group's value.
//   disagreement(types, show)                    // "ranks 0, 2: float32; rank 1: int32"
//   describe_groups(texts, show, " has ", " have ")  // "rank 0 has A; ranks 1, 2 have B"
// Needs: the standard library. Used by the collective checks (comm/), DDP's registration check,
// the bridge's module check (torch/) and tandem::agree (comm/agree.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem/core/hash.hpp"

namespace tandem::detail {

// The fingerprint ranks compare first lives in core/hash.hpp; detail code names it as before.
using tandem::fnv1a;

/// "rank 3" or "ranks 0, 2".
inline std::string rank_list(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i) text += ", ";
    text += std::to_string(ranks[i]);
  }
  return text;
}

/// The ranks grouped by their value (values[r] is rank r's), in order of each group's first rank.
template <class Value>
std::vector<std::pair<Value, std::vector<int>>> group_ranks(const std::vector<Value>& values) {
  std::vector<std::pair<Value, std::vector<int>>> groups;
  for (std::size_t r = 0; r < values.size(); ++r) {
    auto found = std::find_if(groups.begin(), groups.end(),
                              [&](const auto& group) { return group.first == values[r]; });
    if (found == groups.end()) {
      groups.push_back({values[r], {static_cast<int>(r)}});
    } else {
      found->second.push_back(static_cast<int>(r));
    }
  }
  return groups;
}

/// Every group as rank_list + `one` (a single rank) or `many` + show(value), joined by "; ".
template <class Value, class Show>
std::string describe_groups(const std::vector<Value>& values, Show show,
                            std::string_view one = ": ", std::string_view many = ": ") {
  std::string text;
  for (const auto& [value, ranks] : group_ranks(values)) {
    if (!text.empty()) text += "; ";
    text += rank_list(ranks);
    text += ranks.size() == 1 ? one : many;
    text += show(value);
  }
  return text;
}

/// "" when all ranks have the same value, otherwise describe_groups: "ranks 0, 2: float32; rank
/// 1: int32".
template <class Value, class Show>
std::string disagreement(const std::vector<Value>& values, Show show) {
  if (group_ranks(values).size() < 2) return {};
  return describe_groups(values, show);
}

}  // namespace tandem::detail
