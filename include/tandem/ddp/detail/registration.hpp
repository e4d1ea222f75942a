// tandem/ddp/detail/registration.hpp - DistributedDataParallel's registration check: what a rank
// registered (element type, each parameter's name and shape, each buffer's name, shape and kind)
// as entries, and the collective that compares them across ranks.
//   detail::ddp::verify_registration(comm, on_host, detail::ddp::registration_of(params));
// Needs: what ddp/ddp.hpp needs; included by it, not by users.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "tandem/arena/parameters.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/stream_order.hpp"
#include "tandem/core/detail/disagreement.hpp"
#include "tandem/core/error.hpp"
#include "tandem/ddp/detail/arena_access.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem::detail::ddp {

/// The entries the ranks compare: "element type T", then "parameter 'name' [shape]" for each
/// trained parameter and "buffer 'name' [shape] kind" for each buffer, in registration order.
template <class T, class Space>
std::vector<std::string> registration_of(Parameters<T, Space>& params) {
  std::vector<std::string> entries{std::string("element type ") + dtype_traits<T>::name};
  for (auto& p : params) entries.push_back("parameter '" + p.name() + "' " + p.shape().to_string());
  for (auto& b : params.buffers()) {
    entries.push_back("buffer '" + b.name() + "' " + b.shape().to_string() + " " + name(b.kind()));
  }
  return entries;
}

/// all_gather of control arrays written through `exec`, ordered after their writes and handed
/// back to `exec` for the reads (on the host: nothing to order).
template <Communicator Comm, class ControlExec, class In, class Out>
void control_all_gather(Comm& comm, const ControlExec& exec, In mine, Out all) {
  tandem::order_after(comm, exec);
  comm.all_gather(mine, all);
  tandem::hand_back(comm, exec);
}

/// Collective: every rank's registration `entries` compared (core/detail/disagreement.hpp), their
/// few integers in the communicator's memory, written and read through `exec`; on a difference,
/// the first differing entry and which ranks have what, in an Error raised on every rank.
template <Communicator Comm, class ControlExec>
void verify_registration(Comm& comm, const ControlExec& exec,
                         const std::vector<std::string>& entries) {
  const auto n = static_cast<std::size_t>(comm.size());
  const auto gather = [&]<class V>(std::vector<V> mine) {
    using Array = ControlArray<V, typename Comm::memory_space, ControlExec>;
    Array in(exec, mine.size());
    Array all(exec, mine.size() * n);
    for (std::size_t i = 0; i < mine.size(); ++i) in.set(i, mine[i]);
    control_all_gather(comm, exec, in.view(), all.view());
    std::vector<V> out(mine.size() * n);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = all.get(i);
    return out;
  };
  const auto difference = find_entries_difference(entries, n, gather);
  if (!difference) return;
  std::string cause =
      "ranks registered different parameters; first difference at entry " +
      std::to_string(difference->first) + " (entry 0 is the element type): " +
      describe_groups(
          difference->seen, [](const std::string& entry) { return entry; }, " has ", " have ");
  cause += " (entries registered:";
  for (std::size_t r = 0; r < difference->counts.size(); ++r) {
    cause += std::string(r ? "," : "") + " rank " + std::to_string(r) + " " +
             std::to_string(difference->counts[r]);
  }
  throw Error(comm.rank(), "DistributedDataParallel", cause + ")");
}

}  // namespace tandem::detail::ddp
