// tandem/core/timeout.hpp - the duration type every blocking call takes, its defaults, and a
// Deadline that turns "wait at most T" into "wait until then" across several waits.
//   tandem::Deadline deadline(tandem::default_timeout);
//   while (!ready()) { if (deadline.expired()) throw ...; }
// Needs: the standard library only.
#pragma once

#include <chrono>
#include <string>

namespace tandem {

/// The duration every blocking call of tandem takes; Timeout::max() waits forever.
using Timeout = std::chrono::milliseconds;

/// What a collective or a store waits for a peer before it raises tandem::Error (as in PyTorch).
inline constexpr Timeout default_timeout = std::chrono::minutes(30);

/// A point in time computed once from a timeout, so that a loop of waits shares one budget.
class Deadline {
 public:
  /// The clock deadlines are measured on: monotonic, unaffected by changes of the wall time.
  using clock = std::chrono::steady_clock;

  /// A deadline `timeout` from now (never, for Timeout::max()).
  explicit Deadline(Timeout timeout)
      : timeout_(timeout), at_(saturating_add(clock::now(), timeout)) {}

  /// The point in time at which the deadline expires.
  [[nodiscard]] clock::time_point at() const noexcept { return at_; }
  /// The timeout this deadline was made from.
  [[nodiscard]] Timeout timeout() const noexcept { return timeout_; }
  /// True once the deadline has passed.
  [[nodiscard]] bool expired() const noexcept { return clock::now() >= at_; }
  /// The time left until the deadline, or zero once it has passed.
  [[nodiscard]] Timeout remaining() const noexcept {
    auto left = std::chrono::duration_cast<Timeout>(at_ - clock::now());
    return left.count() > 0 ? left : Timeout::zero();
  }

 private:
  // A timeout of Timeout::max() means "forever"; adding it to now() must not overflow.
  static clock::time_point saturating_add(clock::time_point now, Timeout timeout) {
    if (timeout >= std::chrono::duration_cast<Timeout>(clock::time_point::max() - now)) {
      return clock::time_point::max();
    }
    return now + timeout;
  }

  Timeout timeout_;
  clock::time_point at_;
};

/// "250 ms", "30 s", "30 min": the unit a person reading an error message expects.
inline std::string describe(Timeout timeout) {
  const auto ms = timeout.count();
  if (ms % 60000 == 0 && ms >= 60000) return std::to_string(ms / 60000) + " min";
  if (ms % 1000 == 0 && ms >= 1000) return std::to_string(ms / 1000) + " s";
  return std::to_string(ms) + " ms";
}

}  // namespace tandem
