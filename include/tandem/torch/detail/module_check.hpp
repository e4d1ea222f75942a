// tandem/torch/detail/module_check.hpp - what torch::DistributedDataParallel checks of a module
// before it wraps it: the ranks' parameters and buffers described as entries and compared (an
// Error on every rank naming the first difference), and libtorch's sizes as a tandem Shape.
//   detail::require_same_entries(comm, detail::module_entries(params, buffers), operation);
// Needs: libtorch (ATen) and a Communicator; included by tandem/torch/ddp.hpp, not by users.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "tandem/arena/parameters.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/host_values.hpp"
#include "tandem/core/detail/disagreement.hpp"
#include "tandem/core/error.hpp"
#include "tandem/torch/tensor.hpp"

namespace tandem::torch::detail {

/// A tandem::Shape of libtorch's sizes (at most Shape::max_rank of them).
inline Shape shape_of(at::IntArrayRef sizes, const std::string& name, int rank) {
  const auto d = sizes;
  switch (sizes.size()) {
    case 0:
      return Shape{};
    case 1:
      return Shape{d[0]};
    case 2:
      return Shape{d[0], d[1]};
    case 3:
      return Shape{d[0], d[1], d[2]};
    case 4:
      return Shape{d[0], d[1], d[2], d[3]};
    case 5:
      return Shape{d[0], d[1], d[2], d[3], d[4]};
    case 6:
      return Shape{d[0], d[1], d[2], d[3], d[4], d[5]};
    case 7:
      return Shape{d[0], d[1], d[2], d[3], d[4], d[5], d[6]};
    case 8:
      return Shape{d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]};
    default:
      throw Error(rank, "torch::DistributedDataParallel",
                  "'" + name + "' has " + std::to_string(sizes.size()) +
                      " dimensions; tandem's arena holds at most " +
                      std::to_string(Shape::max_rank));
  }
}

/// "[4, 3]", for messages and descriptions.
inline std::string sizes_text(at::IntArrayRef sizes) {
  std::string text = "[";
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(sizes[i]);
  }
  return text + "]";
}

/// The entries the ranks compare, from a module's named_parameters() and named_buffers():
/// "parameter 'name' [sizes] dtype [frozen] on device", then "buffer 'name' [sizes] dtype on
/// device", in the module's order.
template <class Named>
std::vector<std::string> module_entries(const Named& params, const Named& buffers) {
  std::vector<std::string> entries;
  for (const auto& item : params) {
    const auto& t = item.value();
    entries.push_back("parameter '" + item.key() + "' " + sizes_text(t.sizes()) + " " +
                      dtype_name(t.scalar_type()) + (t.requires_grad() ? "" : " frozen") + " on " +
                      t.device().str());
  }
  for (const auto& item : buffers) {
    const auto& t = item.value();
    entries.push_back("buffer '" + item.key() + "' " + sizes_text(t.sizes()) + " " +
                      dtype_name(t.scalar_type()) + " on " + t.device().str());
  }
  return entries;
}

/// Collective: an Error on every rank unless all ranks hold the same `entries`; it names the
/// first entry in which they differ and which ranks have what (the comparison DDP's registration
/// check makes too: core/detail/disagreement.hpp). The values travel through the communicator's
/// memory (host values: comm/detail/host_values.hpp).
template <Communicator Comm>
void require_same_entries(Comm& comm, const std::vector<std::string>& entries,
                          const char* operation) {
  const auto n = static_cast<std::size_t>(comm.size());
  const auto gather = [&comm, n]<class V>(std::vector<V> mine) {
    std::vector<V> all(mine.size() * n);
    tandem::detail::host_all_gather(comm, std::span<const V>(mine), std::span<V>(all));
    return all;
  };
  const auto difference = tandem::detail::find_entries_difference(entries, n, gather);
  if (!difference) return;
  const std::string cause =
      "the ranks' modules differ; first difference at entry " + std::to_string(difference->first) +
      ": " +
      tandem::detail::describe_groups(
          difference->seen, [](const std::string& entry) { return entry; }, " has ", " have ");
  throw Error(comm.rank(), operation, cause);
}

}  // namespace tandem::torch::detail
