// tandem/comm/checked.hpp - the collective check every backend shares: the fixed-size
// fingerprint of one collective call, the comparison of all ranks' fingerprints (the text of the
// Error every rank raises), and the TANDEM_CHECK_COLLECTIVES switch.
//   tandem::GlooCommOptions options;  options.check_collectives = false;   // or leave it unset:
//   // TANDEM_CHECK_COLLECTIVES=0|1 decides, else the backend's default
//   auto fp = tandem::detail::make_fingerprint<float>(tandem::detail::CollectiveOp::all_reduce,
//                                                     sequence, count, 0, tandem::ReduceOp::sum);
//   std::string cause = tandem::detail::fingerprint_disagreement(all_ranks_fingerprints);
// Needs: the standard library.
//
// A backend that checks exchanges one CollectiveFingerprint per rank before each collective (by
// whatever transport it has: a small all-gather, the store, shared memory), and every rank
// compares the same list, so every rank raises the same Error - or none does, and the collective
// runs. A rank that skipped a collective shows up as ranks calling different operations at the
// next one (or, where the skipped and the next call look alike, as a timeout at the last one).
//
// The switch must agree across ranks, or one rank would wait for a fingerprint the others never
// send: each backend compares it at rendezvous (switch_disagreement gives the Error's text).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/collective_op.hpp"
#include "tandem/core/detail/disagreement.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem {

/// The environment variable that switches the check: "0" off, "1" on, unset for the backend's
/// default; any other value is a tandem::Error.
inline constexpr std::string_view check_collectives_variable = "TANDEM_CHECK_COLLECTIVES";

/// Whether a communicator compares every collective's fingerprint across ranks before running
/// it. Unset (the default) defers to TANDEM_CHECK_COLLECTIVES, then to the backend's default; a
/// bool (`options.check_collectives = false`) is an explicit choice that wins over the variable.
/// It has no conversion to bool on purpose: what it means is only known once resolved.
class CollectiveCheck {
 public:
  /// How the check was chosen.
  enum class Setting : std::uint8_t {
    from_environment,  ///< TANDEM_CHECK_COLLECTIVES, else the backend's default
    on,                ///< always compare
    off,               ///< never compare (a mismatch is undefined: a hang, an abort, mixed data)
  };

  /// Defers to the environment, then to the backend's default.
  constexpr CollectiveCheck() noexcept = default;
  /// An explicit choice: true compares, false does not, whatever the environment says.
  constexpr CollectiveCheck(
      bool on) noexcept  // NOLINT(google-explicit-constructor): reads as a flag
      : setting_(on ? Setting::on : Setting::off) {}
  /// Only a bool is a choice: `check = 1` or `check = "0"` would not say what was meant.
  template <class T>
  requires(!std::same_as<T, bool>) CollectiveCheck(T)
  = delete;

  /// Defers to the environment (the default).
  [[nodiscard]] static constexpr CollectiveCheck from_environment() noexcept { return {}; }

  /// How it was chosen.
  [[nodiscard]] constexpr Setting setting() const noexcept { return setting_; }

  /// Whether to compare: the explicit choice, else TANDEM_CHECK_COLLECTIVES in `env`, else
  /// `backend_default`. A bad value of the variable is a tandem::Error naming it.
  [[nodiscard]] bool resolve(bool backend_default, const EnvLookup& env = process_env) const;

  /// Same setting.
  friend constexpr bool operator==(CollectiveCheck, CollectiveCheck) noexcept = default;

 private:
  Setting setting_ = Setting::from_environment;
};

/// TANDEM_CHECK_COLLECTIVES in `env`: nullopt when unset, true for "1", false for "0"; anything
/// else (also "", "yes", " 1") is a tandem::Error naming the variable and the value.
inline std::optional<bool> check_collectives_from_environment(const EnvLookup& env = process_env) {
  const auto value = env(check_collectives_variable);
  if (!value) return std::nullopt;
  if (*value == "1") return true;
  if (*value == "0") return false;
  throw Error("environment", std::string(check_collectives_variable) + "='" + *value +
                                 "' is not 0 (no collective checks) or 1 (check every collective)");
}

inline bool CollectiveCheck::resolve(bool backend_default, const EnvLookup& env) const {
  switch (setting_) {
    case Setting::on:
      return true;
    case Setting::off:
      return false;
    case Setting::from_environment:
      break;
  }
  return check_collectives_from_environment(env).value_or(backend_default);
}

namespace detail {

/// What one rank was called with, as exchanged before a collective: eight 64-bit integers, the
/// same layout on every rank (send it as bytes, or as 8 int64 elements). Fields a collective
/// does not use are zero, so that equal calls have equal fingerprints.
struct CollectiveFingerprint {
  std::int64_t sequence = 0;   ///< this communicator's collectives counted from 1, per rank
  std::int64_t op = 0;         ///< a CollectiveOp
  std::int64_t type = 0;       ///< a dtype (typed operations only)
  std::int64_t count = 0;      ///< the per-op count every rank must agree on
  std::int64_t root = 0;       ///< rooted operations only
  std::int64_t reduce_op = 0;  ///< a ReduceOp (reducing operations only)
  std::int64_t color = 0;      ///< split only
  std::int64_t key = 0;        ///< split only

  friend bool operator==(const CollectiveFingerprint&, const CollectiveFingerprint&) = default;
};
static_assert(sizeof(CollectiveFingerprint) == 8 * sizeof(std::int64_t));
static_assert(std::is_trivially_copyable_v<CollectiveFingerprint>);
static_assert(std::is_standard_layout_v<CollectiveFingerprint>);

/// The fingerprint of a collective on elements of `type` (ignored where `op` is untyped);
/// `root` and `reduce_op` count only where `op` has them.
inline CollectiveFingerprint make_fingerprint(CollectiveOp op, std::uint64_t sequence, dtype type,
                                              std::size_t count, int root = 0,
                                              ReduceOp reduce_op = ReduceOp::sum) {
  CollectiveFingerprint fp;
  fp.sequence = static_cast<std::int64_t>(sequence);
  fp.op = static_cast<std::int64_t>(op);
  if (is_typed(op)) {
    fp.type = static_cast<std::int64_t>(type);
    fp.count = static_cast<std::int64_t>(count);
  }
  if (has_root(op)) fp.root = root;
  if (has_reduce_op(op)) fp.reduce_op = static_cast<std::int64_t>(reduce_op);
  return fp;
}

/// make_fingerprint for elements of type T.
template <class T>
CollectiveFingerprint make_fingerprint(CollectiveOp op, std::uint64_t sequence, std::size_t count,
                                       int root = 0, ReduceOp reduce_op = ReduceOp::sum) {
  return make_fingerprint(op, sequence, dtype_of<T>, count, root, reduce_op);
}

/// A fingerprint read from another rank names a known operation, element type and reduce op
/// (else it is corrupt, or from a different tandem).
inline bool plausible(const CollectiveFingerprint& fp) {
  return fp.op >= 0 && fp.op <= static_cast<std::int64_t>(CollectiveOp::split) && fp.type >= 0 &&
         fp.type <= static_cast<std::int64_t>(dtype::uint8) && fp.reduce_op >= 0 &&
         fp.reduce_op <= static_cast<std::int64_t>(ReduceOp::max);
}

/// One call in words: "all_reduce(7 x float32, sum)", "broadcast(5 x int32, root 0)",
/// "barrier()", "split()" (its colour and key may differ across ranks); with `numbered`, "#12 "
/// first.
inline std::string describe_call(const CollectiveFingerprint& fp, bool numbered = false) {
  std::string text = numbered ? "#" + std::to_string(fp.sequence) + " " : std::string();
  if (!plausible(fp)) return text + "an unreadable call";
  const auto op = static_cast<CollectiveOp>(fp.op);
  text += name(op);
  text += '(';
  std::string args;
  if (is_typed(op)) {
    args = std::to_string(fp.count) + " x " + tandem::name(static_cast<dtype>(fp.type));
  }
  if (has_root(op))
    args += (args.empty() ? "" : ", ") + std::string("root ") + std::to_string(fp.root);
  if (has_reduce_op(op)) {
    args +=
        (args.empty() ? "" : ", ") + std::string(tandem::name(static_cast<ReduceOp>(fp.reduce_op)));
  }
  return text + args + ')';
}

/// "" when every rank's fingerprint (in rank order) describes the same call; otherwise the
/// cause of the Error every rank raises: what differs first (operation, element type, count,
/// root, reduce op, or how many collectives the ranks have made), then every rank's whole call:
/// "ranks disagree on the element count: ranks 0, 2 called all_reduce(7 x float32, sum); rank 1
/// called all_reduce(8 x float32, sum)". split's colour and key may differ: they are its point.
/// This is all a backend needs: any transport that gathers the fingerprints may call it.
inline std::string fingerprint_disagreement(std::span<const CollectiveFingerprint> fps) {
  if (fps.size() < 2) return {};
  const std::vector<CollectiveFingerprint> calls(fps.begin(), fps.end());
  for (const auto& fp : calls) {
    if (!plausible(fp)) {
      return "a rank sent an unreadable call description (is every rank the same program?)";
    }
  }
  std::string cause = first_difference(calls);
  bool numbered = false;
  if (cause.empty()) {
    const auto sequences =
        field_values(calls, [](const CollectiveFingerprint& c) { return c.sequence; });
    if (disagreement(sequences, show_int).empty()) return {};
    cause =
        "ranks are at different collectives of this communicator (one skipped a collective, or "
        "made one the others did not)";
    numbered = true;
  }
  std::vector<std::string> described;
  described.reserve(calls.size());
  for (const auto& fp : calls) described.push_back(describe_call(fp, numbered));
  return cause + ": " +
         describe_groups(
             described, [](const std::string& call) { return call; }, " called ", " called ");
}

/// "" when every rank (in rank order) resolved the check the same way; otherwise the cause of
/// the Error each rank raises at rendezvous, naming the ranks on each side.
inline std::string switch_disagreement(const std::vector<bool>& checking) {
  const std::string text =
      disagreement(checking, [](bool on) { return std::string(on ? "on" : "off"); });
  if (text.empty()) return {};
  return "ranks disagree on whether to check collectives (" +
         std::string(check_collectives_variable) + " or the options' check_collectives): " + text +
         "; a rank that checks would wait for fingerprints the others never send";
}

}  // namespace detail
}  // namespace tandem
