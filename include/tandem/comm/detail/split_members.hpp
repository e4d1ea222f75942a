// tandem/comm/detail/split_members.hpp - who forms a rank's new group in split, and its rank
// there, from every rank's split fingerprint (colour and key): what the backends that build
// split's groups themselves (GlooComm, ShmComm) compute alike.
//   const auto group = tandem::detail::split_members(calls, rank);   // group.members, group.rank
// Needs: the standard library. Not a public header: backends include it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <tuple>
#include <vector>

#include "tandem/comm/checked.hpp"

namespace tandem::detail {

/// One rank's new group in a split: the old ranks in it, in their new order, and its new rank.
struct SplitGroup {
  std::vector<int> members;
  int rank = -1;
};

/// The group of rank `me`: the ranks whose call (calls[r], in old rank order) has its colour,
/// ordered by key, then by old rank (as MPI_Comm_split orders them).
inline SplitGroup split_members(const std::vector<CollectiveFingerprint>& calls, int me) {
  SplitGroup group;
  const auto color = calls[static_cast<std::size_t>(me)].color;
  for (std::size_t r = 0; r < calls.size(); ++r) {
    if (calls[r].color == color) group.members.push_back(static_cast<int>(r));
  }
  std::stable_sort(group.members.begin(), group.members.end(), [&](int a, int b) {
    return std::tie(calls[static_cast<std::size_t>(a)].key, a) <
           std::tie(calls[static_cast<std::size_t>(b)].key, b);
  });
  group.rank = static_cast<int>(std::find(group.members.begin(), group.members.end(), me) -
                                group.members.begin());
  return group;
}

}  // namespace tandem::detail
