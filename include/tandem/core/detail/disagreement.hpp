// tandem/core/detail/disagreement.hpp - the words of an Error about ranks that disagree: the ranks
// grouped by the value each has, "rank 1" or "ranks 0, 2" before each group's value.
//   disagreement(types, show)                    // "ranks 0, 2: float32; rank 1: int32"
//   describe_groups(texts, show, " has ", " have ")  // "rank 0 has A; ranks 1, 2 have B"
//   find_entries_difference(entries, ranks, gather)  // where ranks' lists first differ
// Needs: the standard library. Used by the collective checks (comm/), DDP's registration check,
// the bridge's module check (torch/) and tandem::agree (comm/agree.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
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

/// Where ranks' lists of entries that must be alike (DDP's registration, the bridge's module)
/// first differ, and what each rank has there.
struct EntriesDifference {
  /// The first differing entry (past the shortest list when the common entries agree).
  std::size_t first = 0;
  /// Each rank's text of that entry ("nothing (fewer entries)" past its list).
  std::vector<std::string> seen;
  /// Each rank's number of entries.
  std::vector<std::size_t> counts;
};

/// Collective: compares every rank's `entries` with at most three all_gathers (the whole list's
/// hash and length; then each common entry's hash; then every rank's text of the first differing
/// entry, up to 240 bytes). `gather(std::vector<V>)` is the caller's all_gather of one vector per
/// rank (std::int64_t and std::uint8_t), returning them in rank order. Empty when every rank holds
/// the same entries.
template <class Gather>
std::optional<EntriesDifference> find_entries_difference(const std::vector<std::string>& entries,
                                                         std::size_t ranks, const Gather& gather) {
  std::uint64_t whole = fnv1a_offset_basis;
  for (const auto& entry : entries) whole = fnv1a(entry + "\n", whole);
  const std::vector<std::int64_t> all = gather(std::vector<std::int64_t>{
      static_cast<std::int64_t>(whole), static_cast<std::int64_t>(entries.size())});
  EntriesDifference difference;
  bool same = true;
  for (std::size_t r = 0; r < ranks; ++r) {
    same = same && all[2 * r] == all[0] && all[2 * r + 1] == all[1];
    difference.counts.push_back(static_cast<std::size_t>(all[2 * r + 1]));
  }
  if (same) return std::nullopt;

  const std::size_t common = std::min(
      entries.size(), *std::min_element(difference.counts.begin(), difference.counts.end()));
  std::vector<std::int64_t> hashes(common);
  for (std::size_t i = 0; i < common; ++i) hashes[i] = static_cast<std::int64_t>(fnv1a(entries[i]));
  std::vector<std::int64_t> all_hashes;
  if (common > 0) all_hashes = gather(std::move(hashes));
  difference.first = common;
  for (std::size_t i = 0; i < common && difference.first == common; ++i) {
    for (std::size_t r = 1; r < ranks; ++r) {
      if (all_hashes[r * common + i] != all_hashes[i]) difference.first = i;
    }
  }

  constexpr std::size_t text_bytes = 240;
  const std::string own = difference.first < entries.size()
                              ? entries[difference.first]
                              : std::string("nothing (fewer entries)");
  std::vector<std::uint8_t> text(text_bytes, 0);
  std::copy_n(own.begin(), std::min(own.size(), text_bytes - 1), text.begin());
  const std::vector<std::uint8_t> texts = gather(std::move(text));
  for (std::size_t r = 0; r < ranks; ++r) {
    const auto* first = texts.data() + r * text_bytes;
    difference.seen.emplace_back(first, std::find(first, first + text_bytes, std::uint8_t{0}));
  }
  return difference;
}

}  // namespace tandem::detail
