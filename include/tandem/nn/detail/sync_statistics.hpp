// tandem/nn/detail/sync_statistics.hpp - the per-channel core that both SyncBatchNorms share
// (tandem::SyncBatchNorm in nn/, tandem::torch::SyncBatchNorm in torch/): the one wire format of
// a rank's statistics, their merge across ranks, the checks and their Errors, and the commit of a
// training step (running statistics, then num_batches_tracked). TANDEM_HD functors run through
// any executor (host, GPU); the checks run on the host.
//   for_each_index(exec, C, detail::batch_norm::merge_statistics<double>{all, world, wire, ...});
// Needs: tandem/tensor and core/error.hpp; no Communicator (each face runs its own collectives).
// One step's order, on both faces: check the input; gather every rank's record; merge; check the
// values per channel; commit. A step that throws before its commit (a collective that fails, a
// check) leaves the running statistics and num_batches_tracked exactly as they were.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "tandem/core/config.hpp"
#include "tandem/core/error.hpp"
#include "tandem/tensor/detail/scalar_math.hpp"
#include "tandem/tensor/exec.hpp"

namespace tandem::detail::batch_norm {

/// The one wire format: each rank all_gathers a record of 2C + 1 doubles, [mean (C) | biased
/// variance (C) | count], its count per channel (a rank with an empty batch sends zeros and
/// still takes part). The variance travels as itself, not as 1 / sqrt(var + eps): exact, and the
/// merge has no square root to undo. backward all_reduces 2C doubles, [sum(dy) (C) |
/// sum(dy * (x - mean)) (C)].
struct Wire {
  std::size_t channels = 0;

  /// Doubles per rank in forward's all_gather.
  [[nodiscard]] TANDEM_HD std::size_t size() const { return 2 * channels + 1; }
  /// Where channel c's mean sits in a record.
  [[nodiscard]] TANDEM_HD std::size_t mean(std::size_t c) const { return c; }
  /// Where channel c's biased variance sits in a record.
  [[nodiscard]] TANDEM_HD std::size_t variance(std::size_t c) const { return channels + c; }
  /// Where the count per channel sits in a record.
  [[nodiscard]] TANDEM_HD std::size_t count() const { return 2 * channels; }
  /// Doubles in backward's all_reduce: [sum(dy) | sum(dy * (x - mean))].
  [[nodiscard]] TANDEM_HD std::size_t gradient_size() const { return 2 * channels; }
};

/// torch's batch_norm_gather_stats for channel c: Welford's parallel merge of every rank's
/// record (Wire), one rank at a time in rank order, skipping empty ranks. Writes the merged mean,
/// the biased variance and its inverse standard deviation; index 0 also writes the total count
/// into *total.
template <class Acc>
struct merge_statistics {
  const Acc* records;
  std::size_t world;
  Wire wire;
  Acc eps;
  Acc* mean;
  Acc* variance;
  Acc* invstd;
  Acc* total;
  TANDEM_HD void operator()(std::size_t c) const {
    Acc merged{};
    Acc m2{};  // sum of squared deviations
    Acc n{};
    for (std::size_t r = 0; r < world; ++r) {
      const Acc* theirs = records + r * wire.size();
      const Acc rank_count = theirs[wire.count()];
      if (!(rank_count >= Acc{1})) continue;
      const Acc rank_mean = theirs[wire.mean(c)];
      const Acc rank_m2 = theirs[wire.variance(c)] * rank_count;
      const Acc factor = Acc{1} / (n + rank_count);
      const Acc delta = merged - rank_mean;
      m2 += rank_m2 + delta * delta * n * rank_count * factor;
      merged = n * factor * merged + rank_count * factor * rank_mean;
      n += rank_count;
    }
    const Acc v = n > Acc{} ? m2 / n : Acc{};
    mean[c] = merged;
    variance[c] = v;
    invstd[c] = Acc{1} / square_root(static_cast<double>(v + eps));
    if (c == 0) *total = n;
  }
};

/// The running statistics' update factor: the momentum, or 1 / (num_batches_tracked + 1) for
/// the cumulative average (momentum unset), num_batches_tracked counting the batches before
/// this one.
template <class Acc>
TANDEM_HD Acc running_factor(Acc momentum, bool cumulative, Acc batches_before) {
  return cumulative ? Acc{1} / (batches_before + Acc{1}) : momentum;
}

/// Channel c's running statistics: (1 - factor) * running + factor * batch, running_var taking
/// the unbiased variance (count / (count - 1) times the biased one, count across every rank).
/// count_batch increments num_batches_tracked afterwards, in a pass of its own, so that no
/// channel reads it while it changes.
template <class T, class Acc, class Counter = T>
struct update_running {
  T* running_mean;
  T* running_var;
  const Counter* tracked;
  const Acc* mean;
  const Acc* variance;
  Acc momentum;
  bool cumulative;
  Acc count;
  TANDEM_HD void operator()(std::size_t c) const {
    const Acc factor = running_factor(momentum, cumulative, static_cast<Acc>(tracked[0]));
    const Acc unbiased = count / (count - Acc{1});
    running_mean[c] =
        static_cast<T>((Acc{1} - factor) * static_cast<Acc>(running_mean[c]) + factor * mean[c]);
    running_var[c] = static_cast<T>((Acc{1} - factor) * static_cast<Acc>(running_var[c]) +
                                    factor * variance[c] * unbiased);
  }
};

/// num_batches_tracked += 1 (one index).
template <class Counter, class Acc>
struct count_batch {
  Counter* tracked;
  TANDEM_HD void operator()(std::size_t) const {
    tracked[0] = static_cast<Counter>(static_cast<Acc>(tracked[0]) + Acc{1});
  }
};

/// The commit of a training step, its last part, on `exec`: the running statistics from the
/// merged mean and biased variance (count values per channel), then num_batches_tracked + 1.
/// Called only once every collective and check of the step has succeeded.
template <class Exec, class T, class Counter>
void commit_step(const Exec& exec, std::size_t channels, T* running_mean, T* running_var,
                 Counter* tracked, const double* mean, const double* variance,
                 std::optional<double> momentum, double count) {
  for_each_index(
      exec, channels,
      update_running<T, double, Counter>{running_mean, running_var, tracked, mean, variance,
                                         momentum.value_or(0.0), !momentum.has_value(), count});
  for_each_index(exec, 1, count_batch<Counter, double>{tracked});
}

/// The Error both faces raise: "SyncBatchNorm::<operation>" on `rank`, naming the cause.
[[noreturn]] inline void fail(int rank, const std::string& operation, const std::string& cause) {
  throw Error(rank, "SyncBatchNorm::" + operation, cause);
}

/// An input of shape `shape` (its text, as "[2, 3, 4]") must be (N, C, ...) with this module's
/// C = `channels`: an Error naming `operation` and the cause otherwise. `dims` is its number of
/// dimensions and `input_channels` its extent 1 (read only when dims >= 2); `hint` ends the first
/// message.
inline void check_input(int rank, const std::string& operation, std::size_t dims,
                        std::int64_t input_channels, std::size_t channels, const std::string& shape,
                        const std::string& hint = "") {
  if (dims < 2) {
    fail(rank, operation,
         "expected an (N, C, ...) input of at least 2 dimensions, got shape " + shape + hint);
  }
  if (input_channels != static_cast<std::int64_t>(channels)) {
    fail(rank, operation,
         "input of shape " + shape + " has " + std::to_string(input_channels) +
             " channels, this SyncBatchNorm has " + std::to_string(channels));
  }
}

/// After the first synchronised forward's all_gather of every rank's num_features (as doubles,
/// `counts[r]` for rank r): an Error naming the first rank that differs from this one, since the
/// statistics' all_gather would otherwise be a mismatched collective (undefined on MPI and NCCL).
inline void check_channels_agree(int rank, const double* counts, std::size_t world,
                                 std::size_t channels) {
  for (std::size_t r = 0; r < world; ++r) {
    if (counts[r] != static_cast<double>(channels)) {
      fail(rank, "forward",
           "ranks disagree on the number of channels: rank " + std::to_string(r) + " has " +
               std::to_string(static_cast<std::int64_t>(counts[r])) + ", rank " +
               std::to_string(rank) + " (this one) has " + std::to_string(channels));
    }
  }
}

/// Batch statistics need at least 2 values per channel (one has no variance, and running_var
/// would take 0 / 0): an Error otherwise, on every rank alike. `where` completes the message
/// (" across 2 ranks", " in input of shape [1, 3]").
inline void check_values_per_channel(int rank, double count, const std::string& where) {
  if (!(count >= 2)) {
    fail(rank, "forward",
         "expected more than 1 value per channel when training, got " +
             std::to_string(static_cast<std::int64_t>(count)) + where);
  }
}

}  // namespace tandem::detail::batch_norm
