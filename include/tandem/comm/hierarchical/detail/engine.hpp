// tandem/comm/hierarchical/detail/engine.hpp - detail::hierarchical::Engine<Intra, Inter>, one
// rank's side of a HierarchicalComm: its node's Intra group, the Inter groups (all ranks, and the
// leaders'), where every rank sits, the `_async` worker (IssueOrder), and how each operation runs
// over the two levels (all_reduce, reduce and broadcast through the node's leader).
//   auto engine = std::make_unique<Engine<ShmComm, GlooComm>>(...);   engine->all_reduce(...);
// Needs: the two levels' communicators (template arguments; this header includes neither). Not a
// public header: hierarchical.hpp uses it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/issue_order.hpp"
#include "tandem/comm/detail/reduction.hpp"
#include "tandem/comm/hierarchical/detail/failure.hpp"
#include "tandem/comm/hierarchical/options.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/shared_memory.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/tensor/memory.hpp"

namespace tandem::detail::hierarchical {

/// One rank's side of a HierarchicalComm: the two levels and where every rank sits. Heap-allocated
/// and owned by the communicator, so that `_async` tasks may point at it while it moves.
/// Operations run one at a time (IssueOrder), so nothing here is locked.
template <class Intra, class Inter>
class Engine : public IssueOrder {
 public:
  /// `node_of[r]` is rank r's node (0 .. nodes-1, in order of their first rank); the Intra group
  /// holds this rank's node, in rank order; `inter` (all ranks) is absent on one node. `relay`
  /// passes the first failure between nodes (inactive on one node).
  Engine(int rank, std::vector<int> node_of, Intra intra, std::optional<Inter> inter,
         Timeout timeout, FailureRelay relay = {})
      : rank_(rank),
        size_(static_cast<int>(node_of.size())),
        node_of_(std::move(node_of)),
        intra_(std::move(intra)),
        inter_(std::move(inter)),
        timeout_(timeout),
        relay_(std::move(relay)) {
    nodes_ = node_of_.empty() ? 0 : *std::max_element(node_of_.begin(), node_of_.end()) + 1;
    node_ = node_of_[static_cast<std::size_t>(rank_)];
    std::vector<int> seen(static_cast<std::size_t>(nodes_), 0);
    for (int r = 0; r < size_; ++r) {
      const int node = node_of_[static_cast<std::size_t>(r)];
      local_of_.push_back(seen[static_cast<std::size_t>(node)]++);
      if (node == node_) members_.push_back(r);
    }
    const int local = local_of_[static_cast<std::size_t>(rank_)];
    if (intra_->size() != static_cast<int>(members_.size()) || intra_->rank() != local) {
      throw Error(rank_, "HierarchicalComm",
                  "this node's group has rank " + std::to_string(intra_->rank()) + " of " +
                      std::to_string(intra_->size()) + ", but the node holds " +
                      std::to_string(members_.size()) + " ranks and this is its rank " +
                      std::to_string(local) + " (its ranks must be in the job's order)");
    }
    if (nodes_ > 1 && (!inter_ || inter_->size() != size_ || inter_->rank() != rank_)) {
      throw Error(rank_, "HierarchicalComm",
                  "the group between nodes must hold every rank in this group's order");
    }
    if (nodes_ == 1) {  // one node: everything is the node's group, which names its failures
      inter_.reset();
      relay_ = {};
    }
  }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine() { stop(); }  // runs what is still queued, while the levels exist

  /// The leaders' group (one rank per node, in node order), split from the group of all ranks.
  /// Collective over all ranks; nothing on one node. Its errors are the caller's to name (the
  /// rendezvous or the split that made this group).
  void make_leaders() {
    if (nodes_ < 2) return;
    leaders_ = inter_->split(is_leader() ? 0 : no_color, node_);
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] int nodes() const noexcept { return nodes_; }
  [[nodiscard]] int node() const noexcept { return node_; }
  [[nodiscard]] Timeout timeout() const noexcept { return timeout_; }

  /// The node's group's shared block (HierarchicalComm::allocate_shared).
  SharedBlock allocate_shared(std::size_t bytes) requires SharedMemoryComm<Intra> {
    SharedBlock block;
    guarded("allocate_shared", [&] { block = intra_->allocate_shared(bytes); });
    return block;
  }

  // --- the algorithms: raw pointers and element counts (frontend.hpp) -------------------------

  template <class T>
  void all_reduce(const T* in, T* out, std::size_t count, ReduceOp op) {
    guarded("all_reduce", [&] {
      if (one_node()) return intra_->all_reduce(span(in, count), span(out, count), op);
      copy_elements(in, count, out);
      const ReduceOp partial = op == ReduceOp::avg ? ReduceOp::sum : op;
      level_ = Level::node;
      intra_->reduce(span(out, count), 0, partial);
      if (is_leader()) {
        level_ = Level::leaders;
        leaders_->all_reduce(span(out, count), partial);
        if (op == ReduceOp::avg) divide(out, count, size_);
      }
      level_ = Level::node;
      intra_->broadcast(span(out, count), 0);
    });
  }

  template <class T>
  void reduce(T* buffer, std::size_t count, int root, ReduceOp op) {
    guarded("reduce", [&] {
      const int root_local = local_of_[static_cast<std::size_t>(root)];
      if (one_node()) return intra_->reduce(span(buffer, count), root_local, op);
      const int root_node = node_of_[static_cast<std::size_t>(root)];
      const ReduceOp partial = op == ReduceOp::avg ? ReduceOp::sum : op;
      // The leader reduces into a copy: its own buffer changes only where it is the root.
      std::vector<T> node_sum;
      if (is_leader()) node_sum.assign(buffer, buffer + count);
      T* mine = is_leader() ? node_sum.data() : buffer;
      level_ = Level::node;
      intra_->reduce(span(mine, count), 0, partial);
      if (is_leader()) {
        level_ = Level::leaders;
        leaders_->reduce(span(mine, count), root_node, partial);
        if (node_ == root_node && op == ReduceOp::avg) divide(mine, count, size_);
      }
      if (node_ != root_node) return;
      level_ = Level::node;
      if (root_local == 0) {
        copy_elements(mine, count, buffer);
      } else if (is_leader()) {
        intra_->send(std::span<const T>(mine, count), root_local, 0);
      } else if (rank_ == root) {
        intra_->recv(span(buffer, count), 0, 0);
      }
    });
  }

  template <class T>
  void broadcast(T* buffer, std::size_t count, int root) {
    guarded("broadcast", [&] {
      const int root_local = local_of_[static_cast<std::size_t>(root)];
      if (one_node()) return intra_->broadcast(span(buffer, count), root_local);
      const int root_node = node_of_[static_cast<std::size_t>(root)];
      level_ = Level::node;
      if (node_ == root_node) intra_->broadcast(span(buffer, count), root_local);
      if (is_leader()) {
        level_ = Level::leaders;
        leaders_->broadcast(span(buffer, count), root_node);
      }
      level_ = Level::node;
      if (node_ != root_node) intra_->broadcast(span(buffer, count), 0);
    });
  }

  template <class T>
  void all_gather(const T* in, T* out, std::size_t count) {
    const auto n = static_cast<std::size_t>(size_);
    flat("all_gather", [&](auto& c) { c.all_gather(span(in, count), span(out, n * count)); });
  }

  template <class T>
  void gather(const T* in, T* out, std::size_t count, int root) {
    const std::size_t total = rank_ == root ? static_cast<std::size_t>(size_) * count : 0;
    flat("gather", [&](auto& c) { c.gather(span(in, count), span(out, total), root); });
  }

  template <class T>
  void scatter(const T* in, T* out, std::size_t count, int root) {
    const std::size_t total = rank_ == root ? static_cast<std::size_t>(size_) * count : 0;
    flat("scatter", [&](auto& c) { c.scatter(span(in, total), span(out, count), root); });
  }

  template <class T>
  void reduce_scatter(const T* in, T* out, std::size_t count, ReduceOp op) {
    const auto n = static_cast<std::size_t>(size_);
    flat("reduce_scatter",
         [&](auto& c) { c.reduce_scatter(span(in, n * count), span(out, count), op); });
  }

  template <class T>
  void all_to_all(const T* in, T* out, std::size_t total) {
    flat("all_to_all", [&](auto& c) { c.all_to_all(span(in, total), span(out, total)); });
  }

  template <class T>
  void send(const T* data, std::size_t count, int peer, int tag) {
    flat("send", [&](auto& c) { c.send(span(data, count), peer, tag); });
  }

  template <class T>
  void recv(T* data, std::size_t count, int peer, int tag) {
    flat("recv", [&](auto& c) { c.recv(span(data, count), peer, tag); });
  }

  void barrier() {
    flat("barrier", [&](auto& c) { c.barrier(); });
  }

  /// This rank's engine of its new group; null for no_color.
  std::unique_ptr<Engine> split(int color, int key) {
    std::unique_ptr<Engine> made;
    guarded("split", [&] {
      if (one_node()) {
        level_ = Level::node;
        auto intra = intra_->split(color, key);
        if (!intra) return;
        made = std::make_unique<Engine>(intra->rank(),
                                        std::vector<int>(static_cast<std::size_t>(intra->size())),
                                        std::move(*intra), std::nullopt, timeout_);
        ++splits_;
        return;
      }
      level_ = Level::all;
      const std::uint64_t sequence = ++splits_;  // the same on every rank: split is collective
      auto inter = inter_->split(color, key);
      // The new group's node of every rank, as the node's first rank here, in the new order.
      std::int32_t node_id = 0;
      std::vector<std::int32_t> node_ids;
      if (inter) {
        node_id = members_.front();
        node_ids.resize(static_cast<std::size_t>(inter->size()));
        inter->all_gather(std::span<const std::int32_t>(&node_id, 1), node_ids);
      }
      level_ = Level::node;
      auto intra = intra_->split(inter ? color : no_color, inter ? inter->rank() : 0);
      if (!inter) return;
      auto node_of = numbered_by_first_appearance(node_ids);
      const bool one_node =
          std::all_of(node_of.begin(), node_of.end(), [](int n) { return n == 0; });
      auto relay = relay_.split(sequence, color, inter->size(), one_node);
      made = std::make_unique<Engine>(inter->rank(), std::move(node_of), std::move(*intra),
                                      std::move(inter), timeout_, std::move(relay));
      level_ = Level::all;  // the new leaders' group is split from the new group of all ranks
      made->make_leaders();
    });
    return made;
  }

 private:
  template <class T>
  static std::span<T> span(T* data, std::size_t count) noexcept {
    return std::span<T>(data, count);
  }

  [[nodiscard]] bool one_node() const noexcept { return nodes_ == 1; }
  [[nodiscard]] bool is_leader() const noexcept { return members_.front() == rank_; }

  /// An operation that is the same over every rank: the node's group on one node, else the
  /// group of all ranks.
  template <class Body>
  void flat(const char* operation, Body&& body) {
    guarded(operation, [&] {
      if (one_node()) return body(*intra_);
      level_ = Level::all;
      body(*inter_);
    });
  }

  /// Runs body (which sets `level_` as it goes); a failure at either level is raised again naming
  /// this rank and the level, after this rank has closed both levels (see the top of the header).
  template <class Body>
  void guarded(const char* operation, Body&& body) {
    if (broken_) {
      throw Error(rank_, operation,
                  "this communicator is unusable after an earlier failure (" + *broken_ + ")");
    }
    level_ = Level::node;
    try {
      body();
    } catch (const Error& e) {
      fail(operation, e.cause());
    } catch (const std::exception& e) {
      fail(operation, e.what());
    }
  }

  /// This rank's view of a level's failure, its ranks renumbered as this group's: "in node 1's
  /// group (ranks 2, 3): rank 3 died (its process is gone)".
  [[nodiscard]] std::string seen_here(const std::string& level_cause) const {
    if (level_ == Level::node) {
      return "in " + level_name() + ": " + renumbered(level_cause, members_);
    }
    if (level_ == Level::leaders)
      return "in " + level_name() + ": " + renumbered(level_cause, leaders());
    return "in " + level_name() + ": " + level_cause;  // numbered as this group already
  }

  /// "node 1's group (ranks 2, 3)", "the leaders' group between nodes (ranks 0, 2)", "the group
  /// of all ranks": the level the running operation is at.
  [[nodiscard]] std::string level_name() const {
    if (level_ == Level::node) {
      return "node " + std::to_string(node_) + "'s group (" + members_text(members_) + ")";
    }
    if (level_ == Level::leaders) {
      return "the leaders' group between nodes (" + members_text(leaders()) + ")";
    }
    return "the group of all ranks";
  }

  [[nodiscard]] std::vector<int> leaders() const {
    std::vector<int> first_ranks;
    for (int r = 0; r < size_; ++r) {
      if (local_of_[static_cast<std::size_t>(r)] == 0) first_ranks.push_back(r);
    }
    return first_ranks;
  }

  /// Raises the failure of `operation` at the current level after closing both levels. Across
  /// nodes the Error names the group's first failure: what this rank saw, where it is the first
  /// to fail, else what the first rank recorded (in the store, or passed on by a peer of this
  /// node) - a rank whose leader gave up must name the rank that was lost, not the leader.
  [[noreturn]] void fail(const char* operation, const std::string& level_cause) {
    const std::string here = seen_here(level_cause);
    if (!relay_.active()) {
      close(here);
      throw Error(rank_, operation, here);
    }
    const Deadline deadline(relay_.limit());
    const std::string mine = "rank " + std::to_string(rank_) +
                             " saw this communicator's first failure (" + operation + ": " + here +
                             ")";
    // A rank that saw the failure itself (a dead, stopped or departed peer in its node, or a
    // stopped one anywhere) passes it to its node at once and records it. A rank that timed out
    // first gives the ranks that saw why the time to record it (they time out about as soon).
    // A level between nodes that a peer closed needs no wait: a peer that closes after a failure
    // has recorded it before, and one that left or died without a failure left none to read.
    const bool stopped = here.find("stopped (SIGSTOP") != std::string::npos;
    const bool timed_out = here.find("timed out") != std::string::npos;
    const bool strong = stopped || (level_ == Level::node && !timed_out);
    const bool defer = timed_out && !stopped;
    std::optional<std::string> passed = passed_on();
    std::optional<std::string> recorded;
    if (!passed) {
      if (strong) abort_node(mine);
      recorded = relay_.first(mine, defer, deadline, [&] {
        if (!strong) passed = passed_on();
        return passed.has_value();
      });
    }
    const std::string first = passed ? *passed : recorded.value_or(mine);
    const std::string cause =
        first == mine ? here : first + ", which ended " + level_name() + " here";
    abort_node(first);  // where this rank has not yet passed one on
    close(cause);
    // The store answered: stay until the others have read it (its host may be this rank).
    if (passed || recorded) relay_.ended(Deadline(relay_.limit()));
    throw Error(rank_, operation, cause);
  }

  /// The failure a peer of this node passed on (Intra::abort_cause, where Intra has one).
  [[nodiscard]] std::optional<std::string> passed_on() const {
    if constexpr (requires(const Intra& c) { c.abort_cause(); }) {
      if (intra_) return intra_->abort_cause();
    }
    return std::nullopt;
  }

  /// Ends this node's group with `cause`, which its ranks then name (Intra::abort, where Intra
  /// has one; the group keeps the first cause it was given).
  void abort_node(const std::string& cause) {
    if constexpr (requires(Intra & c, const std::string& why) { c.abort(why); }) {
      if (intra_) intra_->abort(cause);
    }
  }

  /// Marks this communicator unusable and ends both levels: the peers that wait for this rank at
  /// either level then see it leave and fail at once.
  void close(const std::string& cause) noexcept {
    broken_ = cause;
    leaders_.reset();
    inter_.reset();
    intra_.reset();
  }

  int rank_;
  int size_;
  std::vector<int> node_of_;   ///< per rank of this group: its node
  std::vector<int> local_of_;  ///< per rank of this group: its rank within its node
  std::vector<int> members_;   ///< this node's ranks, in order (the first is the leader)
  int nodes_ = 1;
  int node_ = 0;
  std::optional<Intra> intra_;
  std::optional<Inter> inter_;    ///< every rank; absent on one node
  std::optional<Inter> leaders_;  ///< the first rank of every node; on leaders only
  Timeout timeout_;
  FailureRelay relay_;
  std::uint64_t splits_ = 0;  ///< splits made (each names its new group's relay)
  /// Where the running operation is, for messages: a node's group, the leaders', or all ranks'.
  enum class Level { node, leaders, all };
  Level level_ = Level::node;
  std::optional<std::string> broken_;
};

}  // namespace tandem::detail::hierarchical
