// tandem/data/sampler.hpp - tandem::DistributedSampler, PyTorch's DistributedSampler as a C++20
// random-access range of std::int64_t sample indices, and its evaluation mode.
//   tandem::DistributedSampler sampler(dataset.size(), comm, {.shuffle = true, .seed = 42});
//   for (int epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);
//     for (auto batch : sampler | tandem::views::batches(64)) { /* indices of one batch */ }
//   }
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

/// PyTorch's torch.utils.data.DistributedSampler as a random-access, sized range of sample
/// indices (std::int64_t) for one rank. Training mode (the constructors) is exactly PyTorch's:
/// every rank gets num_samples() indices, the list padded by repeating its start (or cut, with
/// drop_last) to total_size(), rank r taking positions r, r + R, r + 2R, ... of it.
/// Evaluation mode (`DistributedSampler::evaluation`) is what PyTorch lacks: every sample exactly
/// once across the ranks, in order, no padding, so that metrics summed over the ranks count each
/// sample once; rank sizes differ by at most one.
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
  void set_epoch(std::uint64_t epoch) {
    if (epoch == epoch_) return;
    epoch_ = epoch;
    reshuffle();
  }
  /// The epoch last set (0 until set_epoch() is called).
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }

  /// Indices this rank yields per epoch (PyTorch's num_samples).
  [[nodiscard]] std::size_t num_samples() const noexcept { return num_samples_; }
  /// Indices all ranks yield per epoch, padding included (PyTorch's total_size); in
  /// evaluation mode, the data set's size.
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
        (static_cast<std::size_t>(rank_) + k * static_cast<std::size_t>(num_replicas_)) % n_;
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
    if (num_replicas < 1) {
      throw Error(rank, "DistributedSampler",
                  "num_replicas = " + std::to_string(num_replicas) + " must be at least 1");
    }
    if (rank < 0 || rank >= num_replicas) {
      throw Error(rank, "DistributedSampler",
                  "rank = " + std::to_string(rank) + " must be in [0, " +
                      std::to_string(num_replicas) + ")");
    }
    if (n == 0) throw Error(rank, "DistributedSampler", "the data set is empty (n = 0)");
    if (n > static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max() / 2)) {
      throw Error(rank, "DistributedSampler", "n = " + std::to_string(n) + " is too large");
    }
    const auto replicas = static_cast<std::size_t>(num_replicas);
    const auto r = static_cast<std::size_t>(rank);
    if (evaluation_) {
      num_samples_ = r < n ? (n - r + replicas - 1) / replicas : 0;
      total_size_ = n;
    } else if (options_.drop_last && n % replicas != 0) {
      // PyTorch: ceil((n - R) / R), which is 0 when n < R.
      num_samples_ = n < replicas ? 0 : (n - replicas + replicas - 1) / replicas;
      total_size_ = num_samples_ * replicas;
    } else {
      num_samples_ = (n + replicas - 1) / replicas;
      total_size_ = num_samples_ * replicas;
    }
    reshuffle();
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
  std::size_t num_samples_ = 0;
  std::size_t total_size_ = 0;
  // Padding repeats the list's start, so position p of the padded list is the permutation's
  // p mod n: the padded list is never stored.
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
