// tandem/comm/local/detail/engine.hpp - detail::local::Engine, one LocalComm rank's view of its
// group: its rank, the shared Group (detail/local_group.hpp: the barriers, the exchange of calls
// and the mailboxes), its `_async` worker (IssueOrder), and how each collective, send and recv
// runs over the group's shared memory.
//   auto engine = std::make_unique<Engine>(group, rank);   engine->all_reduce(...);
// Needs: the standard library (threads). Not a public header: local.hpp uses it.
#pragma once

#include <unistd.h>
#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tandem/comm/checked.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/issue_order.hpp"
#include "tandem/comm/detail/reduction.hpp"
#include "tandem/comm/local/detail/local_group.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::detail::local {

/// One rank's view of a group: its rank, the shared group, and its async worker (IssueOrder).
/// Heap-allocated and owned by the LocalComm, so the worker's tasks may point at it while the
/// LocalComm moves.
class Engine : public IssueOrder {
 public:
  Engine(std::shared_ptr<Group> group, int rank) : group_(std::move(group)), rank_(rank) {}
  ~Engine() {
    stop();  // runs what is still queued
    // Unwinding under run_local: the abort that follows tells the others why, so do not
    // report the plainer "rank r left" first.
    if (std::uncaught_exceptions() == 0 || !group_->family()->managed()) group_->leave(rank_);
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return group_->size(); }
  [[nodiscard]] const std::shared_ptr<Group>& group() const noexcept { return group_; }

  // --- the algorithms: raw pointers, element counts, called on the rank's thread or worker ---

  template <class T>
  void all_reduce(const T* in, T* out, std::size_t count, ReduceOp op) {
    Deadline deadline(group_->options().timeout);
    const auto round = start({Op::all_reduce, 0, dtype_of<T>, count, 0, op, in, out}, deadline);
    const auto n = static_cast<std::size_t>(size());
    const auto me = static_cast<std::size_t>(rank_);
    // 1. this rank reduces its chunk of every input into its own output
    reduce_range(out, inputs<T>(*round, 0), chunk(count, me), chunk(count, me + 1), op);
    step(Op::all_reduce, 1, deadline);
    // 2. it copies the other ranks' reduced chunks from their outputs
    for (std::size_t s = 0; s < n; ++s) {
      if (s == me) continue;
      const auto begin = chunk(count, s);
      copy_elements(output<T>(*round, s) + begin, chunk(count, s + 1) - begin, out + begin);
    }
    step(Op::all_reduce, 2, deadline);  // nobody returns while others still read its output
  }

  template <class T>
  void reduce(T* buffer, std::size_t count, int root, ReduceOp op) {
    Deadline deadline(group_->options().timeout);
    const auto round =
        start({Op::reduce, 0, dtype_of<T>, count, root, op, buffer, buffer}, deadline);
    const auto me = static_cast<std::size_t>(rank_);
    // Chunk `me` of the root's buffer is read and written by this rank only.
    reduce_range(output<T>(*round, static_cast<std::size_t>(root)), inputs<T>(*round, 0),
                 chunk(count, me), chunk(count, me + 1), op);
    step(Op::reduce, 1, deadline);
  }

  template <class T>
  void broadcast(T* buffer, std::size_t count, int root) {
    Deadline deadline(group_->options().timeout);
    const auto round = start(
        {Op::broadcast, 0, dtype_of<T>, count, root, ReduceOp::sum, buffer, buffer}, deadline);
    copy_elements(output<T>(*round, static_cast<std::size_t>(root)), count, buffer);
    step(Op::broadcast, 1, deadline);
  }

  template <class T>
  void all_gather(const T* in, T* out, std::size_t count) {
    Deadline deadline(group_->options().timeout);
    const auto round =
        start({Op::all_gather, 0, dtype_of<T>, count, 0, ReduceOp::sum, in, out}, deadline);
    for (std::size_t s = 0; s < static_cast<std::size_t>(size()); ++s) {
      copy_elements(input<T>(*round, s), count, out + s * count);
    }
    step(Op::all_gather, 1, deadline);
  }

  template <class T>
  void gather(const T* in, T* out, std::size_t count, int root) {
    Deadline deadline(group_->options().timeout);
    const auto round =
        start({Op::gather, 0, dtype_of<T>, count, root, ReduceOp::sum, in, out}, deadline);
    // Every rank writes its own slot of the root's output.
    T* slot =
        output<T>(*round, static_cast<std::size_t>(root)) + static_cast<std::size_t>(rank_) * count;
    copy_elements(in, count, slot);
    step(Op::gather, 1, deadline);
  }

  template <class T>
  void scatter(const T* in, T* out, std::size_t count, int root) {
    Deadline deadline(group_->options().timeout);
    const auto round =
        start({Op::scatter, 0, dtype_of<T>, count, root, ReduceOp::sum, in, out}, deadline);
    copy_elements(
        input<T>(*round, static_cast<std::size_t>(root)) + static_cast<std::size_t>(rank_) * count,
        count, out);
    step(Op::scatter, 1, deadline);
  }

  template <class T>
  void reduce_scatter(const T* in, T* out, std::size_t count, ReduceOp op) {
    Deadline deadline(group_->options().timeout);
    const auto round = start({Op::reduce_scatter, 0, dtype_of<T>, count, 0, op, in, out}, deadline);
    // Slot `rank` of every input is read by this rank only (in place, out is that slot).
    reduce_range(out, inputs<T>(*round, static_cast<std::size_t>(rank_) * count), 0, count, op);
    step(Op::reduce_scatter, 1, deadline);
  }

  template <class T>
  void all_to_all(const T* in, T* out, std::size_t total) {
    Deadline deadline(group_->options().timeout);
    std::vector<T> copy;
    if (overlap(in, total, static_cast<const T*>(out), total)) {  // send a copy
      copy.assign(in, in + total);
      in = copy.data();
    }
    const auto round =
        start({Op::all_to_all, 0, dtype_of<T>, total, 0, ReduceOp::sum, in, out}, deadline);
    const auto n = static_cast<std::size_t>(size());
    const auto count = total / n;
    for (std::size_t s = 0; s < n; ++s) {
      copy_elements(input<T>(*round, s) + static_cast<std::size_t>(rank_) * count, count,
                    out + s * count);
    }
    step(Op::all_to_all, 1, deadline);
  }

  void barrier() {
    Deadline deadline(group_->options().timeout);
    (void)start({Op::barrier}, deadline);
  }

  /// The new group of this rank and its rank there; null for no_color.
  std::pair<std::shared_ptr<Group>, int> split(int color, int key) {
    Deadline deadline(group_->options().timeout);
    Desc desc{Op::split};
    desc.color = color;
    desc.key = key;
    const auto round = start(desc, deadline);
    const auto me = static_cast<std::size_t>(rank_);
    return {round->split_groups[me], round->split_ranks[me]};
  }

  template <class T>
  void send(const T* data, std::size_t count, int peer, int tag) {
    group_->post(rank_, peer, tag, dtype_of<T>, data, count);
  }

  template <class T>
  void recv(T* data, std::size_t count, int peer, int tag) {
    group_->take(peer, rank_, tag, dtype_of<T>, data, count, Deadline(group_->options().timeout));
  }

 private:
  std::shared_ptr<const Round> start(const Desc& desc, const Deadline& deadline) {
    return group_->arrive(rank_, desc, deadline);
  }
  void step(Op op, int phase, const Deadline& deadline) {
    Desc desc{op};
    desc.phase = phase;
    (void)group_->arrive(rank_, desc, deadline);
  }

  /// First element of chunk i of n equal-as-possible chunks of `count` elements.
  [[nodiscard]] std::size_t chunk(std::size_t count, std::size_t i) const noexcept {
    return count * i / static_cast<std::size_t>(size());
  }

  template <class T>
  static const T* input(const Round& round, std::size_t r) {
    return static_cast<const T*>(round.descs[r].in);
  }
  template <class T>
  static T* output(const Round& round, std::size_t r) {
    return static_cast<T*>(round.descs[r].out);
  }
  /// Every rank's input, offset by `offset` elements, in rank order.
  template <class T>
  static std::vector<const T*> inputs(const Round& round, std::size_t offset) {
    std::vector<const T*> pointers;
    pointers.reserve(round.descs.size());
    for (std::size_t r = 0; r < round.descs.size(); ++r) {
      const T* base = input<T>(round, r);
      pointers.push_back(base ? base + offset : base);
    }
    return pointers;
  }

  std::shared_ptr<Group> group_;
  int rank_;
};

}  // namespace tandem::detail::local
