// tandem/comm/communicator.hpp - the Communicator concept every backend models (LocalComm,
// GlooComm, MpiComm, NcclComm), ReduceOp, new_group; tandem::Work (comm/work.hpp) and the
// stream-ordering contract, order_after and hand_back (comm/stream_order.hpp), come with it.
//   template <tandem::Communicator C> void average(C& comm, std::vector<float>& grads) {
//     comm.all_reduce(grads, tandem::ReduceOp::avg); }
// Needs: the standard library.
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "tandem/comm/stream_order.hpp"
#include "tandem/comm/work.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// How a reduction combines the ranks' elements. avg is sum / world size, for floating-point
/// element types only (an integer average would silently truncate).
enum class ReduceOp { sum, avg, prod, min, max };

/// The operation's name as torch.distributed spells it ("sum", "avg", ...), for messages.
constexpr const char* name(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::prod:
      return "prod";
    case ReduceOp::min:
      return "min";
    case ReduceOp::max:
      return "max";
  }
  return "unknown";
}

/// The colour that leaves a rank out of every group made by split (MPI_UNDEFINED's role).
inline constexpr int no_color = -1;

/// A backend opts in as a communicator with `using communicator_concept = communicator_tag;`.
struct communicator_tag {};

/// True for a type that opted in with `using communicator_concept = communicator_tag;`.
template <class C>
inline constexpr bool enable_communicator = requires {
  typename C::communicator_concept;
  requires std::same_as<typename C::communicator_concept, communicator_tag>;
};

/// A Communicator: a group of ranks that run collectives together. Requirements:
/// 1. it opts in (enable_communicator) and is movable;
/// 2. `memory_space` names the space of the tensors it moves;
/// 3. rank() and size() give this rank and the group's size;
/// 4. every operation below, sync and `_async` (returning Work), for tensors of its space:
///    all_reduce(t, op), all_reduce(in, out, op), reduce(t, root, op), broadcast(t, root),
///    all_gather(in, out), gather(in, out, root), scatter(in, out, root),
///    reduce_scatter(in, out, op), all_to_all(in, out), send(t, peer, tag), recv(t, peer, tag),
///    barrier();
/// 5. split(color, key) makes the subgroup of ranks with the same colour (nullopt for no_color).
/// Counts are the tensors' size() in elements; out of all_gather and gather, in of scatter,
/// reduce_scatter and all_to_all hold size() ranks' worth of elements, in rank order.
template <class C>
concept Communicator = enable_communicator<C> && std::movable<C> &&
    memory_space<typename C::memory_space> &&
    requires(C& c, const C& cc, View<float, typename C::memory_space> out,
             View<const float, typename C::memory_space> in) {
  { cc.rank() } -> std::same_as<int>;
  { cc.size() } -> std::same_as<int>;
  c.all_reduce(out, ReduceOp::sum);
  c.all_reduce(in, out, ReduceOp::sum);
  c.reduce(out, 0, ReduceOp::sum);
  c.broadcast(out, 0);
  c.all_gather(in, out);
  c.gather(in, out, 0);
  c.scatter(in, out, 0);
  c.reduce_scatter(in, out, ReduceOp::sum);
  c.all_to_all(in, out);
  c.send(in, 0, 0);
  c.recv(out, 0, 0);
  c.barrier();
  { c.all_reduce_async(out, ReduceOp::sum) } -> std::same_as<Work>;
  { c.all_reduce_async(in, out, ReduceOp::sum) } -> std::same_as<Work>;
  { c.reduce_async(out, 0, ReduceOp::sum) } -> std::same_as<Work>;
  { c.broadcast_async(out, 0) } -> std::same_as<Work>;
  { c.all_gather_async(in, out) } -> std::same_as<Work>;
  { c.gather_async(in, out, 0) } -> std::same_as<Work>;
  { c.scatter_async(in, out, 0) } -> std::same_as<Work>;
  { c.reduce_scatter_async(in, out, ReduceOp::sum) } -> std::same_as<Work>;
  { c.all_to_all_async(in, out) } -> std::same_as<Work>;
  { c.send_async(in, 0, 0) } -> std::same_as<Work>;
  { c.recv_async(out, 0, 0) } -> std::same_as<Work>;
  { c.barrier_async() } -> std::same_as<Work>;
  { c.split(0, 0) } -> std::same_as<std::optional<C>>;
};

/// Capability trait: whether backend Comm moves and reduces elements of type T. A backend that
/// cannot specialises it to false, so that code (and the conformance suite) learns it at compile
/// time instead of from a runtime error.
template <class Comm, class T>
inline constexpr bool supports_element = element_type<T>;

/// Capability trait: whether Comm can turn ranks that disagree on a collective (operation,
/// element type, count, root, reduce op, or a skipped collective) into a tandem::Error on every
/// rank (tandem/comm/checked.hpp). Where the backend's check can be switched off
/// (TANDEM_CHECK_COLLECTIVES=0, or its options' check_collectives = false), a communicator says
/// whether it checks at run time: `comm.checks_collectives()`. Where it is false, or the check is
/// off, such a program is undefined - it may hang or corrupt memory - as in MPI and NCCL.
template <class Comm>
inline constexpr bool can_check_collectives = false;

/// The subgroup of `ranks` (in that order: ranks[i] becomes rank i of the group). Collective:
/// every rank of `comm` calls it with the same list; ranks not in it get nullopt.
template <Communicator C>
[[nodiscard]] std::optional<C> new_group(C& comm, std::span<const int> ranks) {
  std::vector<int> seen(static_cast<std::size_t>(comm.size()), 0);
  for (int r : ranks) {
    if (r < 0 || r >= comm.size()) {
      throw Error(comm.rank(), "new_group",
                  "rank " + std::to_string(r) + " is not in a group of " +
                      std::to_string(comm.size()) + " ranks");
    }
    if (seen[static_cast<std::size_t>(r)]++) {
      throw Error(comm.rank(), "new_group", "rank " + std::to_string(r) + " is listed twice");
    }
  }
  const auto position = std::find(ranks.begin(), ranks.end(), comm.rank());
  if (position == ranks.end()) {
    (void)comm.split(no_color, 0);
    return std::nullopt;
  }
  return comm.split(0, static_cast<int>(position - ranks.begin()));
}

/// new_group with the ranks listed in braces: `tandem::new_group(comm, {0, 2})`.
template <Communicator C>
[[nodiscard]] std::optional<C> new_group(C& comm, std::initializer_list<int> ranks) {
  return new_group(comm, std::span<const int>(ranks.begin(), ranks.size()));
}

}  // namespace tandem
