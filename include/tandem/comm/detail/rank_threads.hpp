// tandem/comm/detail/rank_threads.hpp - what run_local and run_local_nccl share: one thread per
// rank, the first failure kept with its rank (the others told at once), all threads joined, and
// that failure rethrown as a tandem::Error naming the rank.
//   detail::run_rank_threads(n, "run_local", [&](int r) { fn(comms[r]); },
//                            [&](int r, const std::string& what) { /* abort the others */ });
// Needs: the standard library. Not a public header: backends include it.
#pragma once

#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tandem/core/error.hpp"

namespace tandem::detail {

/// The text of any exception: what() for a std::exception.
inline std::string describe_exception(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

/// The first failure among the ranks, safe to record from any of their threads.
class FirstFailure {
 public:
  /// Records `error` of `rank` unless a failure came first; returns whether it was the first.
  bool record(int rank, std::exception_ptr error) {
    std::lock_guard lock(mutex_);
    if (error_) return false;
    error_ = std::move(error);
    rank_ = rank;
    return true;
  }

  /// The rank that failed first, if one has.
  [[nodiscard]] std::optional<int> rank() const {
    std::lock_guard lock(mutex_);
    if (!error_) return std::nullopt;
    return rank_;
  }

  /// After the threads are joined: rethrows the first failure, as it is when it is a
  /// tandem::Error of that rank, else as a tandem::Error naming the rank.
  void rethrow(const char* operation) const {
    if (!error_) return;
    try {
      std::rethrow_exception(error_);
    } catch (const Error& e) {
      if (e.rank() == rank_) throw;
      throw Error(rank_, operation, e.what());
    } catch (...) {
      throw Error(rank_, operation, describe_exception(error_));
    }
  }

 private:
  mutable std::mutex mutex_;
  std::exception_ptr error_;
  int rank_ = -1;
};

/// Runs body(r) for r in [0, n), each on its own thread, and joins them. When a rank fails (its
/// body throws, or its thread cannot start), on_failure(rank, text) runs on that thread so the
/// backend can wake the others; after the join the first failure is rethrown (FirstFailure).
template <class Body, class OnFailure>
void run_rank_threads(int n, const char* operation, FirstFailure& failures, Body&& body,
                      OnFailure&& on_failure) {
  auto fail = [&](int rank, std::exception_ptr error) {
    const std::string what = describe_exception(error);
    failures.record(rank, std::move(error));
    on_failure(rank, what);
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    try {
      threads.emplace_back([&, r] {
        try {
          body(r);
        } catch (...) {
          fail(r, std::current_exception());
        }
      });
    } catch (...) {
      fail(r, std::current_exception());
      break;
    }
  }
  for (auto& thread : threads) thread.join();
  failures.rethrow(operation);
}

}  // namespace tandem::detail
