// tandem/core/error.hpp - tandem::Error, the one exception type tandem throws. It names the rank,
// the operation and the cause, so a failure on rank 5 of 64 says where it happened.
//   throw tandem::Error(rank, "all_reduce", "rank 3 did not arrive within 30 s");
// Needs: the standard library only.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace tandem {

/// The rank of an error raised before a rank is known (parsing the environment, say).
inline constexpr int unknown_rank = -1;

/// What tandem throws: a std::runtime_error whose what() reads
/// "tandem: rank R: OPERATION: CAUSE" (the rank part left out when it is unknown).
class Error : public std::runtime_error {
 public:
  /// An error on rank `rank` in `operation` (an operation name such as "all_reduce"), because of
  /// `cause`. A cause that is another Error's what() loses its leading "tandem: ", so that the
  /// text says "tandem: " once however deeply errors are wrapped.
  Error(int rank, std::string operation, std::string cause)
      : Error(Composed{}, rank, std::move(operation), without_prefix(cause)) {}

  /// An error raised before a rank is known: rank() is unknown_rank.
  Error(std::string operation, std::string cause)
      : Error(unknown_rank, std::move(operation), std::move(cause)) {}

  /// The rank that raised the error, or unknown_rank.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// The operation that failed, such as "all_reduce" or "TcpStore::get".
  [[nodiscard]] const std::string& operation() const noexcept { return operation_; }
  /// Why it failed, in words.
  [[nodiscard]] const std::string& cause() const noexcept { return cause_; }

 private:
  static constexpr std::string_view prefix = "tandem: ";
  struct Composed {};

  Error(Composed, int rank, std::string operation, std::string cause)
      : std::runtime_error(compose(rank, operation, cause)),
        rank_(rank),
        operation_(std::move(operation)),
        cause_(std::move(cause)) {}

  static std::string without_prefix(std::string_view cause) {
    if (cause.substr(0, prefix.size()) == prefix) cause.remove_prefix(prefix.size());
    return std::string(cause);
  }

  static std::string compose(int rank, const std::string& operation, const std::string& cause) {
    std::string text(prefix);
    if (rank != unknown_rank) text += "rank " + std::to_string(rank) + ": ";
    text += operation;
    text += ": ";
    text += cause;
    return text;
  }

  int rank_;
  std::string operation_;
  std::string cause_;
};

}  // namespace tandem
