// tandem/io/log.hpp - logging in a job of many ranks: tandem::log0 prints on rank 0 only,
// tandem::log_rank on every rank with a "[rank N] " prefix; each line is written whole, so lines
// of different ranks or threads never interleave mid-line.
//   tandem::log0(comm) << "epoch " << epoch << " loss " << loss;
//   tandem::log_rank(comm) << "loaded " << n << " samples";
// Needs: the standard library (and a Communicator, a World or a rank number).
#pragma once

#include <cstdio>
#include <sstream>
#include <string>
#include <utility>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/world.hpp"

namespace tandem {

/// One line being composed; written to its stream, with a newline, when it goes out of scope
/// (nothing when `enabled` is false, and then nothing is formatted either).
class LogLine {
 public:
  /// A line for `stream` starting with `prefix`, or a line that is dropped when not `enabled`.
  LogLine(bool enabled, std::string prefix, std::FILE* stream = stdout)
      : enabled_(enabled), stream_(stream) {
    if (enabled_) text_ << prefix;
  }
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;
  ~LogLine() {
    if (!enabled_) return;
    std::string line = std::move(text_).str();
    line.push_back('\n');
    std::fwrite(line.data(), 1, line.size(), stream_);  // one write: whole lines only
    std::fflush(stream_);
  }

  /// Appends `value` as an std::ostream would print it.
  template <class T>
  LogLine& operator<<(const T& value) {
    if (enabled_) text_ << value;
    return *this;
  }

 private:
  bool enabled_;
  std::FILE* stream_;
  std::ostringstream text_;
};

namespace detail {
inline int rank_of(int rank) noexcept {
  return rank;
}
inline int rank_of(const World& world) noexcept {
  return world.rank;
}
template <Communicator Comm>
int rank_of(const Comm& comm) {
  return comm.rank();
}
}  // namespace detail

/// A line printed by rank 0 only (of a communicator, a World, or a rank number).
template <class Who>
[[nodiscard]] LogLine log0(const Who& who, std::FILE* stream = stdout) {
  return LogLine(detail::rank_of(who) == 0, "", stream);
}

/// A line printed by every rank, prefixed "[rank N] ".
template <class Who>
[[nodiscard]] LogLine log_rank(const Who& who, std::FILE* stream = stdout) {
  const int rank = detail::rank_of(who);
  return LogLine(true, "[rank " + std::to_string(rank) + "] ", stream);
}

}  // namespace tandem
