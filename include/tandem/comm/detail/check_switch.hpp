// tandem/comm/detail/check_switch.hpp - the agreement on the collective-check switch that every
// checking backend makes once, when a communicator is made: each rank resolves its options'
// check_collectives (against TANDEM_CHECK_COLLECTIVES), the ranks exchange one small number each,
// and every rank raises the same Error where they differ.
//   bool on = tandem::detail::agree_on_check_switch(rank, "MyComm", options.check_collectives,
//       /*backend_default=*/true, [&](int mine) { return all_gather_one_int(mine); });
// Needs: the standard library. Not a public header: backends include it.
//
// Why every rank must agree: a rank that checks waits for fingerprints the others never send,
// so a disagreement would hang at the first collective instead of failing here.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "tandem/comm/checked.hpp"
#include "tandem/core/detail/disagreement.hpp"
#include "tandem/core/error.hpp"

namespace tandem::detail {

/// What each rank sends in the agreement.
inline constexpr int check_switch_off = 0;
inline constexpr int check_switch_on = 1;
inline constexpr int check_switch_unreadable = -1;  // its TANDEM_CHECK_COLLECTIVES was bad

/// Resolves `option` (else TANDEM_CHECK_COLLECTIVES, else `backend_default`) and compares it
/// across the ranks: `exchange(mine)` sends this rank's check_switch_* value and returns every
/// rank's, in rank order. A rank whose variable is unreadable still calls exchange (the others
/// wait for it), then raises its own Error; exchange may return nothing for it. The others raise
/// an Error naming it; where the ranks differ, every rank raises one naming each side.
/// `operation` names the call in those Errors.
template <class Exchange>
bool agree_on_check_switch(int rank, const char* operation, const CollectiveCheck& option,
                           bool backend_default, Exchange&& exchange) {
  std::optional<Error> unreadable;
  bool on = backend_default;
  try {
    on = option.resolve(backend_default);
  } catch (const Error& e) {
    unreadable = e;
  }
  const int mine = unreadable ? check_switch_unreadable : (on ? check_switch_on : check_switch_off);
  const std::vector<int> all = exchange(mine);
  if (unreadable) throw *unreadable;
  std::vector<int> bad;
  std::vector<bool> checking;
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r] == check_switch_unreadable) bad.push_back(static_cast<int>(r));
    checking.push_back(all[r] == check_switch_on);
  }
  if (!bad.empty()) {
    throw Error(rank, operation,
                rank_list(bad) + " could not read " + std::string(check_collectives_variable) +
                    " (see that rank's Error)");
  }
  if (auto text = switch_disagreement(checking); !text.empty()) throw Error(rank, operation, text);
  return on;
}

}  // namespace tandem::detail
