// tandem/comm/metrics.hpp - values across ranks on any communicator: the reduce_tensor every
// PyTorch DDP script writes (reduce_mean, reduce_sum of a scalar or a tensor), gathering per-rank
// results of unequal length for distributed evaluation, so that a test set split by the evaluation
// sampler counts every sample once, and one rank's vector of any length on every rank.
//   float loss = tandem::reduce_mean(comm, local_loss);            // the same on every rank
//   auto [correct, seen] = tandem::reduce_sum(comm, std::array{hits, count});
//   std::vector<std::int64_t> all = tandem::all_gather_unequal(comm, my_predictions);
//   tandem::broadcast_vector(comm, bytes, 0);                      // rank 0's bytes everywhere
// Needs: a Communicator (any backend; on a device communicator such as NcclComm the host values
// travel through a small device buffer).
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/host_values.hpp"
#include "tandem/core/error.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem {

/// The sum of `value` over the communicator's ranks, on every rank.
template <Communicator Comm, class T>
requires std::is_arithmetic_v<T>
[[nodiscard]] T reduce_sum(Comm& comm, T value) {
  std::array<T, 1> buffer{value};
  detail::host_all_reduce(comm, std::span<T>(buffer), ReduceOp::sum);
  return buffer[0];
}

/// Element-wise sums over the ranks of a fixed-size array (counts of correct answers and of
/// samples, say), on every rank.
template <Communicator Comm, class T, std::size_t N>
requires std::is_arithmetic_v<T>
[[nodiscard]] std::array<T, N> reduce_sum(Comm& comm, std::array<T, N> values) {
  detail::host_all_reduce(comm, std::span<T>(values), ReduceOp::sum);
  return values;
}

/// The mean of `value` over the ranks, on every rank: sum in T, divided by the rank count (the
/// reduce_tensor of PyTorch's DDP examples). Integers are averaged in double.
template <Communicator Comm, class T>
requires std::is_arithmetic_v<T>
[[nodiscard]] auto reduce_mean(Comm& comm, T value) {
  if constexpr (std::is_floating_point_v<T>) {
    return static_cast<T>(reduce_sum(comm, value) / static_cast<T>(comm.size()));
  } else {
    return static_cast<double>(reduce_sum(comm, static_cast<double>(value))) / comm.size();
  }
}

/// In place: the tensor becomes its element-wise mean over the ranks (floating types).
template <Communicator Comm, Tensor T>
void reduce_mean_(Comm& comm, T&& tensor) {
  static_assert(!std::is_integral_v<tensor_element_t<std::remove_cvref_t<T>>>,
                "tandem::reduce_mean_: an integer mean would truncate; use reduce_sum");
  comm.all_reduce(tensor, ReduceOp::avg);
}

/// Every rank's `local` values, one vector per rank in rank order, on every rank; ranks may hold
/// different counts. Two collectives: the counts, then the values padded to the largest count.
template <Communicator Comm, class T>
[[nodiscard]] std::vector<std::vector<T>> all_gather_per_rank(Comm& comm,
                                                              std::span<const T> local) {
  const auto ranks = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> my_count{static_cast<std::int64_t>(local.size())};
  std::vector<std::int64_t> counts(ranks);
  detail::host_all_gather(comm, std::span<const std::int64_t>(my_count),
                          std::span<std::int64_t>(counts));
  const auto largest = static_cast<std::size_t>(*std::max_element(counts.begin(), counts.end()));
  std::vector<T> padded(largest, T{});
  std::copy(local.begin(), local.end(), padded.begin());
  std::vector<T> everything(largest * ranks);
  if (largest != 0) {
    detail::host_all_gather(comm, std::span<const T>(padded), std::span<T>(everything));
  }
  std::vector<std::vector<T>> out(ranks);
  for (std::size_t r = 0; r < ranks; ++r) {
    const auto begin = everything.begin() + static_cast<std::ptrdiff_t>(r * largest);
    out[r].assign(begin, begin + static_cast<std::ptrdiff_t>(counts[r]));
  }
  return out;
}

/// Every rank's `local` values, concatenated in rank order, on every rank; ranks may hold
/// different counts (as the evaluation sampler gives them).
template <Communicator Comm, class T>
[[nodiscard]] std::vector<T> all_gather_unequal(Comm& comm, std::span<const T> local) {
  std::vector<T> out;
  for (auto& part : all_gather_per_rank(comm, local))
    out.insert(out.end(), part.begin(), part.end());
  return out;
}

/// all_gather_unequal of a vector's elements.
template <Communicator Comm, class T>
[[nodiscard]] std::vector<T> all_gather_unequal(Comm& comm, const std::vector<T>& local) {
  return all_gather_unequal(comm, std::span<const T>(local));
}

/// `root`'s `values`, however many, on every rank: each rank's vector takes root's length and
/// contents (two broadcasts: the length, then the values). Collective: every rank calls it.
template <Communicator Comm, element_type T>
void broadcast_vector(Comm& comm, std::vector<T>& values, int root) {
  std::array<std::int64_t, 1> length{static_cast<std::int64_t>(values.size())};
  detail::host_broadcast(comm, std::span<std::int64_t>(length), root);
  values.resize(static_cast<std::size_t>(length[0]));
  detail::host_broadcast(comm, std::span<T>(values), root);
}

}  // namespace tandem
