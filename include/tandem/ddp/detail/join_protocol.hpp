// tandem/ddp/detail/join_protocol.hpp - what the ranks of a tandem::Join (ddp/join.hpp) tell each
// other at the start of every step, one int64 per rank all-gathered, and what every rank
// concludes from it (the same words on every rank); the journal of one step's collectives, which
// a rank that has run out of data replays.
//   auto verdict = tandem::detail::join::judge(statuses, step, ddp_count);
// Needs: the standard library.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tandem/core/detail/disagreement.hpp"

namespace tandem::detail::join {

/// Where a rank stands at a step's status exchange.
enum class State : std::uint8_t {
  active = 1,               ///< it has data: it runs the step
  joined = 2,               ///< out of data: it shadows the step (Join::finish)
  exhausted = 3,            ///< out of data under throw_on_early_termination
  left_with_exception = 4,  ///< its Join was destroyed while an exception propagated
  left = 5,                 ///< its Join was destroyed without finish()
};

/// One rank's word at a status exchange.
struct Status {
  State state = State::active;
  /// joined: it has shadowed a step already (it is not among the last ranks to join).
  bool shadowed = false;
  /// joined: it has run a step of its own, so it knows which collectives a step issues.
  bool has_journal = false;
  /// A hash of the Join's options and joinables, equal on every rank of a well-made Join.
  std::uint16_t config = 0;
  /// active: bit i set when DistributedDataParallel #i synchronises gradients in this step (no
  /// no_sync() guard); joined: the widest such set among the steps it ran, which it can shadow.
  std::uint32_t pattern = 0;

  bool operator==(const Status&) const = default;
};

/// The status as the int64 that travels: state in bits 0-3, shadowed bit 4, has_journal bit 5,
/// config bits 8-23, pattern bits 24-55 (always non-negative).
[[nodiscard]] inline std::int64_t encode(const Status& s) {
  const auto word =
      static_cast<std::uint64_t>(s.state) | (static_cast<std::uint64_t>(s.shadowed) << 4) |
      (static_cast<std::uint64_t>(s.has_journal) << 5) |
      (static_cast<std::uint64_t>(s.config) << 8) | (static_cast<std::uint64_t>(s.pattern) << 24);
  return static_cast<std::int64_t>(word);
}

[[nodiscard]] inline Status decode(std::int64_t word) {
  const auto w = static_cast<std::uint64_t>(word);
  Status s;
  s.state = static_cast<State>(w & 0xF);
  s.shadowed = ((w >> 4) & 1) != 0;
  s.has_journal = ((w >> 5) & 1) != 0;
  s.config = static_cast<std::uint16_t>((w >> 8) & 0xFFFF);
  s.pattern = static_cast<std::uint32_t>((w >> 24) & 0xFFFFFFFF);
  return s;
}

/// "DistributedDataParallel #0, #2" or "no DistributedDataParallel".
[[nodiscard]] inline std::string describe_pattern(std::uint32_t pattern) {
  if (pattern == 0) return "no DistributedDataParallel";
  std::string text = "DistributedDataParallel";
  const char* separator = " #";
  for (int i = 0; i < 32; ++i) {
    if ((pattern >> i) & 1u) {
      text += separator + std::to_string(i);
      separator = ", #";
    }
  }
  return text;
}

/// What every rank concludes from a status exchange.
struct Verdict {
  /// Every rank has run out of data: the Join ends (its final agreement follows).
  bool done = false;
  /// Not empty: every rank raises an Error with these words.
  std::string error;
  /// The DistributedDataParallel that synchronise gradients in this step (see Status::pattern).
  std::uint32_t pattern = 0;
  /// The rank the buffers come from: the lowest rank with data (done: the lowest of the last
  /// ranks to join, whose model the final agreement gives everyone).
  int root = 0;
  /// How many ranks have data in this step.
  int active = 0;
};

/// The verdict on one exchange (`statuses[r]` is rank r's word; `step` counts exchanges from 1).
/// Every rank computes it from the same words, so every rank raises the same Error or none does.
[[nodiscard]] inline Verdict judge(const std::vector<Status>& statuses, std::size_t step) {
  Verdict verdict;
  const std::string at = " (step " + std::to_string(step) + " of the Join)";
  std::vector<std::uint16_t> configs;
  std::vector<int> active, left, left_unwinding, exhausted, last_joiners;
  for (std::size_t r = 0; r < statuses.size(); ++r) {
    const Status& s = statuses[r];
    const int rank = static_cast<int>(r);
    configs.push_back(s.config);
    switch (s.state) {
      case State::active:
        active.push_back(rank);
        break;
      case State::joined:
        if (!s.shadowed) last_joiners.push_back(rank);
        break;
      case State::exhausted:
        exhausted.push_back(rank);
        last_joiners.push_back(rank);
        break;
      case State::left_with_exception:
        left_unwinding.push_back(rank);
        break;
      case State::left:
        left.push_back(rank);
        break;
    }
  }
  const std::string configs_differ =
      disagreement(configs, [](std::uint16_t c) { return "configuration " + std::to_string(c); });
  if (!configs_differ.empty()) {
    verdict.error = "the ranks made their Join with different joinables or options (" +
                    configs_differ + ")" + at;
    return verdict;
  }
  if (!left_unwinding.empty() || !left.empty()) {
    std::string text;
    if (!left_unwinding.empty()) {
      text = rank_list(left_unwinding) +
             " left the Join because of an exception there (see that rank's own error)";
    }
    if (!left.empty()) {
      text += std::string(text.empty() ? "" : "; ") + rank_list(left) +
              (left.size() == 1 ? " destroyed its Join" : " destroyed their Joins") +
              " without calling finish()";
    }
    verdict.error = text + at;
    return verdict;
  }
  if (!exhausted.empty() && !active.empty()) {
    verdict.error = "throw_on_early_termination: " + rank_list(exhausted) +
                    " ran out of inputs while " + rank_list(active) + " still had data" + at;
    return verdict;
  }
  if (active.empty()) {
    verdict.done = true;
    verdict.root = last_joiners.empty() ? 0 : last_joiners.front();
    return verdict;
  }
  std::vector<std::uint32_t> patterns;
  for (int r : active) patterns.push_back(statuses[static_cast<std::size_t>(r)].pattern);
  if (std::ranges::any_of(patterns, [&](std::uint32_t p) { return p != patterns.front(); })) {
    std::string text;
    for (const auto& [pattern, indices] : group_ranks(patterns)) {
      std::vector<int> ranks;
      for (int i : indices) ranks.push_back(active[static_cast<std::size_t>(i)]);
      text += (text.empty() ? "" : "; ") + rank_list(ranks) + ": " + describe_pattern(pattern);
    }
    verdict.error =
        "the ranks with data disagree on which DistributedDataParallel synchronise gradients in "
        "this step (a no_sync() guard open on some ranks only): " +
        text + at;
    return verdict;
  }
  verdict.pattern = patterns.front();
  std::vector<int> blind;
  for (std::size_t r = 0; r < statuses.size(); ++r) {
    const Status& s = statuses[r];
    if (s.state != State::joined) continue;
    if (!s.has_journal || (verdict.pattern & ~s.pattern) != 0) blind.push_back(static_cast<int>(r));
  }
  if (!blind.empty()) {
    verdict.error =
        rank_list(blind) + " ran out of data before running a step like this one (" +
        describe_pattern(verdict.pattern) +
        " synchronising gradients), so it cannot know which collectives to shadow: every rank "
        "must run at least one step of each kind (a whole gradient-accumulation cycle) before "
        "its data ends, or use throw_on_early_termination" +
        at;
    return verdict;
  }
  verdict.root = active.front();
  verdict.active = static_cast<int>(active.size());
  return verdict;
}

/// One collective a joinable issued in a step: joinable `owner` (its place in the Join's list)
/// did `kind` (the joinable's own numbering) with `argument` (a bucket index, say).
struct Event {
  std::uint32_t owner = 0;
  int kind = 0;
  std::size_t argument = 0;

  bool operator==(const Event&) const = default;
};

/// The journals of the steps a rank ran, one per pattern (the first step of each kind): what it
/// replays once it has joined, and what every later step of that kind must repeat.
class Journals {
 public:
  /// Keeps `events` as the journal of `pattern` if it is the first of its kind; otherwise
  /// returns the index of the first event where it differs from the kept one (or the shorter
  /// length), or npos when they agree.
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);
  std::size_t keep(std::uint32_t pattern, const std::vector<Event>& events) {
    if (const auto* kept = find(pattern)) {
      const auto [a, b] = std::ranges::mismatch(*kept, events);
      if (a == kept->end() && b == events.end()) return npos;
      return static_cast<std::size_t>(a - kept->begin());
    }
    kept_.emplace_back(pattern, events);
    if (widest_ == npos || std::popcount(pattern) > std::popcount(kept_[widest_].first)) {
      widest_ = kept_.size() - 1;
    }
    return npos;
  }

  /// The journal of `pattern`, or null.
  [[nodiscard]] const std::vector<Event>* find(std::uint32_t pattern) const {
    for (const auto& [p, events] : kept_) {
      if (p == pattern) return &events;
    }
    return nullptr;
  }
  /// Whether any step was kept.
  [[nodiscard]] bool any() const noexcept { return widest_ != npos; }
  /// The pattern with the most DistributedDataParallel synchronising (the first kept of those).
  [[nodiscard]] std::uint32_t widest() const noexcept { return any() ? kept_[widest_].first : 0; }
  /// Its journal (any() must hold).
  [[nodiscard]] const std::vector<Event>& widest_events() const { return kept_[widest_].second; }

 private:
  std::vector<std::pair<std::uint32_t, std::vector<Event>>> kept_;
  std::size_t widest_ = npos;
};

}  // namespace tandem::detail::join
