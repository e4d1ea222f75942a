// tandem/data/sampler.hpp - tandem::DistributedSampler, PyTorch's DistributedSampler as a C++20
// random-access range of std::int64_t sample indices, its evaluation mode, and the re-split of an
// epoch's remaining samples over a new set of ranks (a resume at another world size, a rank lost).
//   tandem::DistributedSampler sampler(dataset.size(), comm, {.shuffle = true, .seed = 42});
//   for (int epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);
//     for (auto batch : sampler | tandem::views::batches(64)) { /* indices of one batch */ }
//   }
//   sampler.resplit(new_size, new_rank, samples_done);  // the epoch's rest over new ranks
// Needs: the standard library (tandem/data/batches.hpp for views::batches).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <ranges>
#include <string>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/world.hpp"
#include "tandem/data/detail/indexed_iterator.hpp"

namespace tandem {

/// How a DistributedSampler orders and cuts the data set, as PyTorch's keyword arguments
/// (`{.shuffle = false, .seed = 7, .drop_last = true}`).
struct SamplerOptions {
  bool shuffle = true;     ///< a fresh permutation every epoch, seeded `seed + epoch`
  std::uint64_t seed = 0;  ///< the same on every rank, or ranks draw different permutations
  bool drop_last = false;  ///< cut the tail to a multiple of the ranks instead of padding it
};

namespace detail {

/// torch.randperm(n) from a CPU generator seeded `seed` (torch.Generator().manual_seed(seed)):
/// PyTorch's generator is an mt19937 seeded with the low 32 bits of the seed. Below
/// UINT32_MAX / 20 elements PyTorch draws 32 bits per swap in a forward Fisher-Yates; from there
/// on (PyTorch 2.x, aten's randperm_cpu) it runs the inside-out variant with 64-bit draws, the
/// high word drawn first.
inline std::vector<std::int64_t> torch_randperm(std::int64_t n, std::uint64_t seed) {
  std::vector<std::int64_t> permutation(static_cast<std::size_t>(n));
  std::mt19937 generator(static_cast<std::uint32_t>(seed));
  constexpr std::int64_t wide_draws_from = std::numeric_limits<std::uint32_t>::max() / 20;
  if (n < wide_draws_from) {
    std::iota(permutation.begin(), permutation.end(), std::int64_t{0});
    for (std::int64_t i = 0; i + 1 < n; ++i) {
      const auto z = static_cast<std::int64_t>(generator() % static_cast<std::uint64_t>(n - i));
      std::swap(permutation[static_cast<std::size_t>(i)],
                permutation[static_cast<std::size_t>(i + z)]);
    }
    return permutation;
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint64_t high = generator();
    const std::uint64_t low = generator();
    const auto z =
        static_cast<std::size_t>(((high << 32) | low) % static_cast<std::uint64_t>(i + 1));
    permutation[static_cast<std::size_t>(i)] = permutation[z];
    permutation[z] = i;
  }
  return permutation;
}

}  // namespace detail

/// Where an epoch stands, the same at any world size: the epoch and how many positions of its
/// global order (the permutation of the data set, or 0 .. n-1 unshuffled) the ranks have taken,
/// from the start. DistributedSampler::progress makes one; continue_from goes on from one with
/// whatever ranks the sampler has. TrainingState saves it in checkpoints.
struct SamplerProgress {
  std::uint64_t epoch = 0;   ///< the epoch (its order is seeded seed + epoch)
  std::size_t consumed = 0;  ///< positions of the epoch's order taken, 0 .. the data set's size
  /// Whether two progresses are the same epoch and position.
  bool operator==(const SamplerProgress&) const = default;
};

/// PyTorch's torch.utils.data.DistributedSampler as a random-access, sized range of sample
/// indices (std::int64_t) for one rank. Training mode (the constructors) is exactly PyTorch's:
/// every rank gets num_samples() indices, the list padded by repeating its start (or cut, with
/// drop_last) to total_size(), rank r taking positions r, r + R, r + 2R, ... of it.
/// Evaluation mode (`DistributedSampler::evaluation`) is what PyTorch lacks: every sample exactly
/// once across the ranks, in order, no padding, so that metrics summed over the ranks count each
/// sample once; rank sizes differ by at most one.
/// Re-split (continue_from, resplit): the epoch's positions not yet taken, from `offset()` on,
/// are dealt out the same way over the new ranks (rank r taking offset + r, offset + r + R, ...,
/// padded by wrapping around to the start of the epoch's order, or cut with drop_last), so that
/// over the epoch every sample is used once, plus at most R - 1 repeated to pad the last split
/// (or less up to R - 1 left out of it with drop_last). With offset 0 this is PyTorch's split.
/// Copies share the permutation (cheap); set_epoch() on one copy does not change the others.
class DistributedSampler {
 public:
  /// A random-access iterator over this rank's indices; it refers to its sampler, which must
  /// outlive it (as for any container).
  using iterator = detail::indexed_iterator<DistributedSampler, std::int64_t>;

  /// `n` samples split over `num_replicas` ranks, this being `rank`. Throws tandem::Error
  /// naming the bad argument (num_replicas < 1, rank outside [0, num_replicas), n == 0).
  DistributedSampler(std::size_t n, int num_replicas, int rank, SamplerOptions options = {})
      : DistributedSampler(n, num_replicas, rank, options, false) {}

  /// This process's rank and the world's size.
  DistributedSampler(std::size_t n, const World& world, SamplerOptions options = {})
      : DistributedSampler(n, world.world_size, world.rank, options) {}

  /// The communicator's rank and size (a subgroup's, for a sampler over a subgroup).
  template <Communicator Comm>
  DistributedSampler(std::size_t n, const Comm& comm, SamplerOptions options = {})
      : DistributedSampler(n, comm.size(), comm.rank(), options) {}

  /// Evaluation mode: rank r takes samples r, r + R, ... below n, each sample on exactly one
  /// rank, in data-set order (no shuffle, no padding, no dropping). A rank may get none.
  static DistributedSampler evaluation(std::size_t n, int num_replicas, int rank) {
    return DistributedSampler(n, num_replicas, rank, {.shuffle = false}, true);
  }
  /// Evaluation mode over this process's rank and the world's size.
  static DistributedSampler evaluation(std::size_t n, const World& world) {
    return evaluation(n, world.world_size, world.rank);
  }
  /// Evaluation mode over the communicator's rank and size (a subgroup's, say).
  template <Communicator Comm>
  static DistributedSampler evaluation(std::size_t n, const Comm& comm) {
    return evaluation(n, comm.size(), comm.rank());
  }

  /// Chooses the epoch whose permutation (seeded seed + epoch) the range yields, like PyTorch's
  /// set_epoch: call it at the start of every epoch, or every epoch repeats the first's order.
  /// A new epoch starts at its first position (offset 0); the epoch already set is left as it
  /// is, so a run resumed inside an epoch may call it again for that epoch.
  void set_epoch(std::uint64_t epoch) {
    if (epoch == epoch_) return;
    epoch_ = epoch;
    offset_ = 0;
    cut();
    reshuffle();
  }
  /// The epoch last set (0 until set_epoch() is called).
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }

  /// Positions of the epoch's order taken before this split began: 0 unless continue_from or
  /// resplit moved it.
  [[nodiscard]] std::size_t offset() const noexcept { return offset_; }

  /// Where the epoch stands once every rank has taken `samples_done` indices of its list (the
  /// same on every rank: ranks step together): offset() + samples_done * num_replicas(), at most
  /// the data set's size (padding takes nothing new). tandem::Error when samples_done > size().
  [[nodiscard]] SamplerProgress progress(std::size_t samples_done) const {
    if (samples_done > num_samples_) {
      throw Error(rank_, "DistributedSampler::progress",
                  std::to_string(samples_done) + " samples done of this rank's " +
                      std::to_string(num_samples_));
    }
    const std::size_t taken = samples_done * static_cast<std::size_t>(num_replicas_);
    return {epoch_, std::min(n_, offset_ + taken)};
  }

  /// Goes on from `progress` with this sampler's ranks: its epoch's order from position
  /// progress.consumed on is split anew over num_replicas() (see the class comment), and the
  /// range yields this rank's share of it. Every rank of the new split calls it with the same
  /// progress. tandem::Error when consumed exceeds the data set, or in evaluation mode.
  void continue_from(const SamplerProgress& progress) {
    refuse_evaluation("DistributedSampler::continue_from");
    if (progress.consumed > n_) {
      throw Error(rank_, "DistributedSampler::continue_from",
                  std::to_string(progress.consumed) + " positions consumed of a data set of " +
                      std::to_string(n_));
    }
    const bool new_order = progress.epoch != epoch_;
    epoch_ = progress.epoch;
    offset_ = progress.consumed;
    cut();
    if (new_order) reshuffle();
  }

  /// The live re-split, one call: every rank of the new membership (`num_replicas` ranks, this
  /// one `rank`) calls it with the indices each rank of the old membership took of its list this
  /// epoch (`samples_done`, the same on every old rank), and the range then yields this rank's
  /// share of the epoch's samples not yet taken. A rank that joins without this sampler's
  /// history calls continue_from with the progress a member sends it. Not while a Loader is in
  /// an epoch over this sampler (leave the loop first); the Loader's next epoch sees the new
  /// split. tandem::Error naming the bad argument.
  void resplit(int num_replicas, int rank, std::size_t samples_done) {
    refuse_evaluation("DistributedSampler::resplit");
    const SamplerProgress where = progress(samples_done);
    check_ranks(num_replicas, rank, "DistributedSampler::resplit");
    num_replicas_ = num_replicas;
    rank_ = rank;
    continue_from(where);
  }
  /// resplit over the communicator's rank and size (the new membership's).
  template <Communicator Comm>
  void resplit(const Comm& comm, std::size_t samples_done) {
    resplit(comm.size(), comm.rank(), samples_done);
  }

  /// Indices this rank yields per epoch (PyTorch's num_samples); after a re-split, of the
  /// epoch's rest.
  [[nodiscard]] std::size_t num_samples() const noexcept { return num_samples_; }
  /// Indices all ranks yield per epoch, padding included (PyTorch's total_size; after a
  /// re-split, of the epoch's rest); in evaluation mode, the data set's size.
  [[nodiscard]] std::size_t total_size() const noexcept { return total_size_; }
  /// The range's length: num_samples().
  [[nodiscard]] std::size_t size() const noexcept { return num_samples_; }
  /// The data set's size.
  [[nodiscard]] std::size_t dataset_size() const noexcept { return n_; }
  /// The number of ranks the data set is split over.
  [[nodiscard]] int num_replicas() const noexcept { return num_replicas_; }
  /// The rank whose share this sampler yields.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// The options it was made with (evaluation mode: no shuffle).
  [[nodiscard]] const SamplerOptions& options() const noexcept { return options_; }
  /// Whether it was made by evaluation(): each sample once across the ranks, no padding.
  [[nodiscard]] bool is_evaluation() const noexcept { return evaluation_; }

  /// The index at position k of this rank's list (k < size()).
  [[nodiscard]] std::int64_t operator[](std::size_t k) const noexcept {
    const std::size_t global =
        (offset_ + static_cast<std::size_t>(rank_) + k * static_cast<std::size_t>(num_replicas_)) %
        n_;
    return permutation_ ? (*permutation_)[global] : static_cast<std::int64_t>(global);
  }

  /// The first of this rank's indices, for the current epoch.
  [[nodiscard]] iterator begin() const noexcept;
  /// Past the last of this rank's indices.
  [[nodiscard]] iterator end() const noexcept;

 private:
  DistributedSampler(std::size_t n, int num_replicas, int rank, SamplerOptions options,
                     bool evaluation)
      : n_(n),
        num_replicas_(num_replicas),
        rank_(rank),
        options_(options),
        evaluation_(evaluation) {
    check_ranks(num_replicas, rank, "DistributedSampler");
    if (n == 0) throw Error(rank, "DistributedSampler", "the data set is empty (n = 0)");
    if (n > static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max() / 2)) {
      throw Error(rank, "DistributedSampler", "n = " + std::to_string(n) + " is too large");
    }
    cut();
    reshuffle();
  }

  static void check_ranks(int num_replicas, int rank, const char* operation) {
    if (num_replicas < 1) {
      throw Error(rank, operation,
                  "num_replicas = " + std::to_string(num_replicas) + " must be at least 1");
    }
    if (rank < 0 || rank >= num_replicas) {
      throw Error(rank, operation,
                  "rank = " + std::to_string(rank) + " must be in [0, " +
                      std::to_string(num_replicas) + ")");
    }
  }

  void refuse_evaluation(const char* operation) const {
    if (evaluation_) {
      throw Error(rank_, operation,
                  "an evaluation sampler is not re-split: make one for the new ranks");
    }
  }

  // This rank's share of the positions from offset_ on: PyTorch's sizes over the m positions
  // left (with offset 0, exactly PyTorch's num_samples and total_size).
  void cut() {
    const auto replicas = static_cast<std::size_t>(num_replicas_);
    const auto r = static_cast<std::size_t>(rank_);
    const std::size_t m = n_ - offset_;
    if (evaluation_) {
      num_samples_ = r < n_ ? (n_ - r + replicas - 1) / replicas : 0;
      total_size_ = n_;
    } else if (options_.drop_last && m % replicas != 0) {
      // PyTorch: ceil((m - R) / R), which is 0 when m < R.
      num_samples_ = m < replicas ? 0 : (m - replicas + replicas - 1) / replicas;
      total_size_ = num_samples_ * replicas;
    } else {
      num_samples_ = (m + replicas - 1) / replicas;
      total_size_ = num_samples_ * replicas;
    }
  }

  void reshuffle() {
    if (!options_.shuffle) return;
    permutation_ = std::make_shared<const std::vector<std::int64_t>>(
        detail::torch_randperm(static_cast<std::int64_t>(n_), options_.seed + epoch_));
  }

  std::size_t n_ = 0;
  int num_replicas_ = 1;
  int rank_ = 0;
  SamplerOptions options_;
  bool evaluation_ = false;
  std::uint64_t epoch_ = 0;
  std::size_t offset_ = 0;  // positions of the epoch's order taken before this split
  std::size_t num_samples_ = 0;
  std::size_t total_size_ = 0;
  // Padding repeats the epoch order's start, so position p of the padded list is the
  // permutation's p mod n: the padded list is never stored.
  std::shared_ptr<const std::vector<std::int64_t>> permutation_;
};

inline DistributedSampler::iterator DistributedSampler::begin() const noexcept {
  return {this, 0};
}
inline DistributedSampler::iterator DistributedSampler::end() const noexcept {
  return {this, num_samples_};
}

static_assert(std::ranges::random_access_range<DistributedSampler>);
static_assert(std::ranges::sized_range<DistributedSampler>);
static_assert(std::same_as<std::ranges::range_value_t<DistributedSampler>, std::int64_t>);

}  // namespace tandem
