// tandem/comm/local.hpp - tandem::LocalComm, the communicator whose ranks are threads of one
// process sharing memory (for tests, examples and single-process multi-device work), and
// tandem::run_local, which starts the threads.
//   tandem::run_local(4, [](tandem::LocalComm& comm) {
//     std::vector<float> grads(1024, 1.0f);  comm.all_reduce(grads, tandem::ReduceOp::avg); });
// Needs: the standard library (threads).
//
// Semantics follow torch.distributed / NCCL. The data moves through shared memory with the work
// split across the ranks (each rank reduces its 1/n of an all_reduce), between generation-counted
// barriers; reductions run in rank order 0, 1, ..., n-1, so every rank gets bitwise identical
// results. At the first barrier of every collective the ranks exchange what they were called
// with: different operations, element types, counts, roots or reduce ops make every rank raise a
// tandem::Error naming the ranks that disagree (and the group stays usable). A rank that does not
// arrive within options().timeout, a rank whose LocalComm is destroyed, or (under run_local) a
// rank whose function throws, makes the others raise tandem::Error instead of hanging; after that
// the group is unusable.
//
// send is eager (it copies into the receiver's mailbox and returns); recv matches by (source,
// tag), first in first out, and checks the element type and count.
//
// `_async` operations run in issue order on a per-rank worker thread (started on first use) and
// complete the returned Work. The tensors must stay alive and untouched until the Work completes.
// A sync operation issued while `_async` ones are pending first waits for them. Destroying a
// LocalComm waits for its pending operations.
#pragma once

#include <unistd.h>
#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/local_group.hpp"
#include "tandem/comm/store.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

class LocalComm;

template <class Fn>
requires std::invocable<Fn&, LocalComm&>
void run_local(int n, Fn fn, LocalCommOptions options = {});

namespace detail::local {

/// One rank's view of a group: its rank, the shared group, and its async worker. Heap-allocated
/// and owned by the LocalComm, so the worker's tasks may point at it while the LocalComm moves.
class Rank {
 public:
  Rank(std::shared_ptr<Group> group, int rank) : group_(std::move(group)), rank_(rank) {}
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;
  ~Rank() {
    worker_.reset();  // runs what is still queued
    // Unwinding under run_local: the abort that follows tells the others why, so do not
    // report the plainer "rank r left" first.
    if (std::uncaught_exceptions() == 0 || !group_->family()->managed()) group_->leave(rank_);
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return group_->size(); }
  [[nodiscard]] const std::shared_ptr<Group>& group() const noexcept { return group_; }

  /// Runs `body` now, after every `_async` operation issued before.
  template <class Body>
  void now(Body&& body) {
    if (worker_) worker_->drain();
    body();
  }

  /// Queues `body` on the worker; the Work completes when it has run.
  template <class Body>
  Work later(Body body) {
    auto state = std::make_shared<WorkState>();
    if (!worker_) worker_ = std::make_unique<Worker>();
    worker_->post([state, body = std::move(body)]() mutable {
      try {
        body();
        state->complete();
      } catch (...) {
        state->fail(std::current_exception());
      }
    });
    return Work(state);
  }

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
    const std::less<const T*> before;
    if (total && before(in, out + total) && before(out, in + total)) {  // overlap: send a copy
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
  std::unique_ptr<Worker> worker_;  // started by the first `_async` operation
};

template <class In, class Out>
constexpr void check_pair() {
  using I = std::remove_cv_t<tensor_element_t<In>>;
  using O = tensor_element_t<Out>;
  static_assert(host_accessible<tensor_space_t<In>> && host_accessible<tensor_space_t<Out>>,
                "tandem::LocalComm: tensors must live in host memory");
  static_assert(!std::is_const_v<O>,
                "tandem::LocalComm: the output tensor must be mutable (it is const)");
  static_assert(std::same_as<I, std::remove_cv_t<O>>,
                "tandem::LocalComm: the input and output tensors of one call must have the same "
                "element type");
}

template <class T>
constexpr void check_one() {
  check_pair<T, T>();
}

template <class T>
using elem_t = std::remove_cv_t<tensor_element_t<T>>;

/// t.data() as the pointer an operation needs; null where a static_assert above has already
/// rejected the tensor (so the compiler reports that, not a conversion error).
template <class E, class T>
const E* in_ptr(T& t) noexcept {
  if constexpr (std::same_as<elem_t<T>, E>) {
    return t.data();
  } else {
    return nullptr;
  }
}
template <class E, class T>
E* out_ptr(T& t) noexcept {
  if constexpr (std::same_as<tensor_element_t<T>, E>) {
    return t.data();
  } else {
    return nullptr;
  }
}

}  // namespace detail::local

/// A communicator whose ranks are threads of one process. Models tandem::Communicator; see the
/// top of this header for its semantics. Make one per rank with LocalComm::create_group, or let
/// run_local start the threads.
class LocalComm {
 public:
  using communicator_concept = communicator_tag;
  using memory_space = host;
  using options_type = LocalCommOptions;

  LocalComm(LocalComm&&) noexcept = default;
  LocalComm& operator=(LocalComm&&) noexcept = default;
  ~LocalComm() = default;

  /// One LocalComm per rank of a new group of `n` ranks; move each into its own thread.
  [[nodiscard]] static std::vector<LocalComm> create_group(int n, LocalCommOptions options = {}) {
    return make_group(n, options, false);
  }

  /// What init_process_group<LocalComm>(world, url) calls: each rank is a thread of this process
  /// with its own World; rank 0 makes the group and the others find it through the store. Ranks
  /// in different processes are an Error (GlooComm and MpiComm are for those).
  [[nodiscard]] static LocalComm rendezvous(const World& world, AnyStore& store,
                                            const LocalCommOptions& options) {
    const std::string process = std::to_string(::getpid());
    if (world.rank == 0) {
      const auto id = pending_groups().publish(make_group(world.world_size, options, false));
      store.set("local/group", process + ":" + std::to_string(id));
    }
    const std::string published = store.get("local/group", options.timeout);
    const auto colon = published.find(':');
    const std::string owner = published.substr(0, colon);
    if (owner != process) {
      throw Error(world.rank, "init_process_group",
                  "LocalComm ranks must be threads of one process: rank 0 is process " + owner +
                      ", this rank is process " + process +
                      "; use GlooComm or MpiComm across processes");
    }
    return pending_groups().take(std::stoull(published.substr(colon + 1)), world.rank);
  }

  [[nodiscard]] int rank() const { return self().rank(); }
  [[nodiscard]] int size() const { return self().size(); }
  [[nodiscard]] const LocalCommOptions& options() const { return self().group()->options(); }

  // --- all_reduce -----------------------------------------------------------------------------

  /// In place: every rank's `t` becomes the reduction of all ranks' `t`.
  template <Tensor T>
  void all_reduce(T&& t, ReduceOp op = ReduceOp::sum) {
    all_reduce(t, t, op);
  }
  template <Tensor In, Tensor Out>
  void all_reduce(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    using E = detail::local::elem_t<Out>;
    const auto [i, o, count] = prepare_all_reduce(in, out, op);
    self().now([&, i = i, o = o, count = count] { self().all_reduce<E>(i, o, count, op); });
  }
  template <Tensor T>
  Work all_reduce_async(T&& t, ReduceOp op = ReduceOp::sum) {
    return all_reduce_async(t, t, op);
  }
  template <Tensor In, Tensor Out>
  Work all_reduce_async(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    using E = detail::local::elem_t<Out>;
    const auto [i, o, count] = prepare_all_reduce(in, out, op);
    auto* me = &self();
    return me->later([me, i = i, o = o, count = count, op] { me->all_reduce<E>(i, o, count, op); });
  }

  // --- reduce (result on root only) -------------------------------------------------------------

  template <Tensor T>
  void reduce(T&& t, int root, ReduceOp op = ReduceOp::sum) {
    using E = detail::local::elem_t<T>;
    E* data = prepare_rooted(t, root, op, "reduce");
    self().now([&] { self().reduce<E>(data, t.size(), root, op); });
  }
  template <Tensor T>
  Work reduce_async(T&& t, int root, ReduceOp op = ReduceOp::sum) {
    using E = detail::local::elem_t<T>;
    E* data = prepare_rooted(t, root, op, "reduce");
    auto* me = &self();
    const std::size_t count = t.size();
    return me->later([=] { me->reduce<E>(data, count, root, op); });
  }

  // --- broadcast --------------------------------------------------------------------------------

  template <Tensor T>
  void broadcast(T&& t, int root) {
    using E = detail::local::elem_t<T>;
    E* data = prepare_rooted(t, root, ReduceOp::sum, "broadcast");
    self().now([&] { self().broadcast<E>(data, t.size(), root); });
  }
  template <Tensor T>
  Work broadcast_async(T&& t, int root) {
    using E = detail::local::elem_t<T>;
    E* data = prepare_rooted(t, root, ReduceOp::sum, "broadcast");
    auto* me = &self();
    const std::size_t count = t.size();
    return me->later([=] { me->broadcast<E>(data, count, root); });
  }

  // --- all_gather: out holds size() * in.size() elements, rank r's at r * in.size() -----------

  template <Tensor In, Tensor Out>
  void all_gather(In&& in, Out&& out) {
    using E = detail::local::elem_t<Out>;
    const auto [i, o, count] = prepare_gather_like(in, out, "all_gather", true);
    self().now([&, i = i, o = o, count = count] { self().all_gather<E>(i, o, count); });
  }
  template <Tensor In, Tensor Out>
  Work all_gather_async(In&& in, Out&& out) {
    using E = detail::local::elem_t<Out>;
    const auto [i, o, count] = prepare_gather_like(in, out, "all_gather", true);
    auto* me = &self();
    return me->later([me, i = i, o = o, count = count] { me->all_gather<E>(i, o, count); });
  }

  // --- gather: out (size() * in.size() elements) is used on the root only -------------------

  template <Tensor In, Tensor Out>
  void gather(In&& in, Out&& out, int root) {
    using E = detail::local::elem_t<Out>;
    check_root(root, "gather");
    const auto [i, o, count] = prepare_gather_like(in, out, "gather", rank() == root);
    self().now([&, i = i, o = o, count = count] { self().gather<E>(i, o, count, root); });
  }
  template <Tensor In, Tensor Out>
  Work gather_async(In&& in, Out&& out, int root) {
    using E = detail::local::elem_t<Out>;
    check_root(root, "gather");
    const auto [i, o, count] = prepare_gather_like(in, out, "gather", rank() == root);
    auto* me = &self();
    return me->later([me, i = i, o = o, count = count, root] { me->gather<E>(i, o, count, root); });
  }

  // --- scatter: in (size() * out.size() elements) is used on the root only ------------------

  template <Tensor In, Tensor Out>
  void scatter(In&& in, Out&& out, int root) {
    using E = detail::local::elem_t<Out>;
    check_root(root, "scatter");
    const auto [i, o, count] = prepare_scatter_like(in, out, "scatter", rank() == root);
    self().now([&, i = i, o = o, count = count] { self().scatter<E>(i, o, count, root); });
  }
  template <Tensor In, Tensor Out>
  Work scatter_async(In&& in, Out&& out, int root) {
    using E = detail::local::elem_t<Out>;
    check_root(root, "scatter");
    const auto [i, o, count] = prepare_scatter_like(in, out, "scatter", rank() == root);
    auto* me = &self();
    return me->later(
        [me, i = i, o = o, count = count, root] { me->scatter<E>(i, o, count, root); });
  }

  // --- reduce_scatter: in holds size() * out.size() elements --------------------------------

  template <Tensor In, Tensor Out>
  void reduce_scatter(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    using E = detail::local::elem_t<Out>;
    check_reduce_op<E>(op, "reduce_scatter");
    const auto [i, o, count] = prepare_scatter_like(in, out, "reduce_scatter", true);
    self().now([&, i = i, o = o, count = count] { self().reduce_scatter<E>(i, o, count, op); });
  }
  template <Tensor In, Tensor Out>
  Work reduce_scatter_async(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    using E = detail::local::elem_t<Out>;
    check_reduce_op<E>(op, "reduce_scatter");
    const auto [i, o, count] = prepare_scatter_like(in, out, "reduce_scatter", true);
    auto* me = &self();
    return me->later(
        [me, i = i, o = o, count = count, op] { me->reduce_scatter<E>(i, o, count, op); });
  }

  // --- all_to_all: in and out hold size() * k elements; slot s of in goes to rank s ---------

  template <Tensor In, Tensor Out>
  void all_to_all(In&& in, Out&& out) {
    using E = detail::local::elem_t<Out>;
    const auto [i, o, count] = prepare_all_to_all(in, out);
    self().now([&, i = i, o = o, count = count] { self().all_to_all<E>(i, o, count); });
  }
  template <Tensor In, Tensor Out>
  Work all_to_all_async(In&& in, Out&& out) {
    using E = detail::local::elem_t<Out>;
    const auto [i, o, count] = prepare_all_to_all(in, out);
    auto* me = &self();
    return me->later([me, i = i, o = o, count = count] { me->all_to_all<E>(i, o, count); });
  }

  // --- point to point ---------------------------------------------------------------------------

  /// Copies `t` to `peer`'s mailbox for `tag` and returns (eager); recv on `peer` takes it.
  template <Tensor T>
  void send(T&& t, int peer, int tag = 0) {
    using E = detail::local::elem_t<T>;
    check_peer<T>(peer, "send");
    const E* data = detail::local::in_ptr<E>(t);
    self().now([&] { self().send<E>(data, t.size(), peer, tag); });
  }
  template <Tensor T>
  Work send_async(T&& t, int peer, int tag = 0) {
    using E = detail::local::elem_t<T>;
    check_peer<T>(peer, "send");
    const E* data = detail::local::in_ptr<E>(t);
    auto* me = &self();
    const std::size_t count = t.size();
    return me->later([=] { me->send<E>(data, count, peer, tag); });
  }
  /// Waits for the oldest message from `peer` with `tag`; its type and count must match `t`.
  template <Tensor T>
  void recv(T&& t, int peer, int tag = 0) {
    using E = detail::local::elem_t<T>;
    detail::local::check_one<T>();
    check_peer<T>(peer, "recv");
    E* data = detail::local::out_ptr<E>(t);
    self().now([&] { self().recv<E>(data, t.size(), peer, tag); });
  }
  template <Tensor T>
  Work recv_async(T&& t, int peer, int tag = 0) {
    using E = detail::local::elem_t<T>;
    detail::local::check_one<T>();
    check_peer<T>(peer, "recv");
    E* data = detail::local::out_ptr<E>(t);
    auto* me = &self();
    const std::size_t count = t.size();
    return me->later([=] { me->recv<E>(data, count, peer, tag); });
  }

  // --- barrier and split --------------------------------------------------------------------

  void barrier() {
    self().now([&] { self().barrier(); });
  }
  Work barrier_async() {
    auto* me = &self();
    return me->later([me] { me->barrier(); });
  }

  /// Collective: ranks with the same `color` form a new group, ordered by (key, rank here);
  /// no_color gives nullopt. The new group has this group's options.
  [[nodiscard]] std::optional<LocalComm> split(int color, int key = 0) {
    if (color < 0 && color != no_color) {
      throw Error(rank(), "split",
                  "color " + std::to_string(color) + " is negative (use tandem::no_color)");
    }
    std::pair<std::shared_ptr<detail::local::Group>, int> made;
    self().now([&] { made = self().split(color, key); });
    if (!made.first) return std::nullopt;
    return LocalComm(std::move(made.first), made.second);
  }

 private:
  template <class Fn>
  requires std::invocable<Fn&, LocalComm&>
  friend void run_local(int n, Fn fn, LocalCommOptions options);

  LocalComm(std::shared_ptr<detail::local::Group> group, int rank)
      : self_(std::make_unique<detail::local::Rank>(std::move(group), rank)) {}

  static std::vector<LocalComm> make_group(int n, LocalCommOptions options, bool managed) {
    if (n < 1) {
      throw Error("LocalComm::create_group",
                  "a group needs at least one rank, not " + std::to_string(n));
    }
    auto family = std::make_shared<detail::local::Family>(managed);
    auto group = std::make_shared<detail::local::Group>(n, options, family);
    family->add(group);
    std::vector<LocalComm> comms;
    comms.reserve(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) comms.push_back(LocalComm(group, r));
    return comms;
  }

  /// Groups made by rendezvous on rank 0, waiting for their other ranks' threads to collect
  /// their communicators. Process-wide because the ranks meet only through a store.
  class PendingGroups {
   public:
    std::uint64_t publish(std::vector<LocalComm> comms) {
      std::lock_guard lock(mutex_);
      const auto id = next_id_++;
      groups_.emplace(id, std::move(comms));
      return id;
    }
    LocalComm take(std::uint64_t id, int rank) {
      std::lock_guard lock(mutex_);
      const auto it = groups_.find(id);
      auto* slot = it == groups_.end() || rank >= static_cast<int>(it->second.size())
                       ? nullptr
                       : &it->second[static_cast<std::size_t>(rank)];
      if (!slot || !slot->self_) {
        throw Error(rank, "init_process_group",
                    "no LocalComm is waiting for this rank (did two ranks claim it?)");
      }
      LocalComm mine = std::move(*slot);
      if (std::all_of(it->second.begin(), it->second.end(),
                      [](const LocalComm& c) { return !c.self_; })) {
        groups_.erase(it);
      }
      return mine;
    }

   private:
    std::mutex mutex_;
    std::uint64_t next_id_ = 0;
    std::map<std::uint64_t, std::vector<LocalComm>> groups_;
  };

  static PendingGroups& pending_groups() {
    static PendingGroups groups;
    return groups;
  }

  detail::local::Rank& self() const {
    if (!self_) throw Error("LocalComm", "this communicator was moved from");
    return *self_;
  }

  [[nodiscard]] Error error(const char* op, const std::string& cause) const {
    return Error(rank(), op, cause);
  }

  void check_root(int root, const char* op) const {
    if (root < 0 || root >= size()) {
      throw error(op, "root " + std::to_string(root) + " is not a rank of this group of " +
                          std::to_string(size()) + " ranks");
    }
  }

  template <class E>
  void check_reduce_op(ReduceOp op, const char* name) const {
    if (op == ReduceOp::avg && !dtype_traits<E>::is_floating) {
      throw error(name, std::string("avg needs a floating-point element type, not ") +
                            dtype_traits<E>::name);
    }
  }

  template <class In, class Out>
  struct Prepared {
    const detail::local::elem_t<Out>* in;
    detail::local::elem_t<Out>* out;
    std::size_t count;
  };

  template <class In, class Out>
  Prepared<In, Out> prepare_all_reduce(In& in, Out& out, ReduceOp op) const {
    detail::local::check_pair<In, Out>();
    check_reduce_op<detail::local::elem_t<Out>>(op, "all_reduce");
    if (static_cast<std::size_t>(in.size()) != static_cast<std::size_t>(out.size())) {
      throw error("all_reduce", "in has " + std::to_string(in.size()) + " elements and out " +
                                    std::to_string(out.size()) + "; they must be equal");
    }
    return {detail::local::in_ptr<detail::local::elem_t<Out>>(in),
            detail::local::out_ptr<detail::local::elem_t<Out>>(out),
            static_cast<std::size_t>(out.size())};
  }

  template <class T>
  detail::local::elem_t<T>* prepare_rooted(T& t, int root, ReduceOp op, const char* name) const {
    detail::local::check_one<T>();
    check_root(root, name);
    check_reduce_op<detail::local::elem_t<T>>(op, name);
    return detail::local::out_ptr<detail::local::elem_t<T>>(t);
  }

  /// all_gather and gather: out holds size() * in.size() elements (checked where `uses_out`).
  template <class In, class Out>
  Prepared<In, Out> prepare_gather_like(In& in, Out& out, const char* name, bool uses_out) const {
    detail::local::check_pair<In, Out>();
    const auto count = static_cast<std::size_t>(in.size());
    const auto expected = count * static_cast<std::size_t>(size());
    if (uses_out && static_cast<std::size_t>(out.size()) != expected) {
      throw error(name, "out has " + std::to_string(out.size()) + " elements, but size() * " +
                            "in.size() = " + std::to_string(size()) + " * " +
                            std::to_string(count) + " = " + std::to_string(expected));
    }
    return {detail::local::in_ptr<detail::local::elem_t<Out>>(in),
            detail::local::out_ptr<detail::local::elem_t<Out>>(out), count};
  }

  /// scatter and reduce_scatter: in holds size() * out.size() elements (checked where `uses_in`).
  template <class In, class Out>
  Prepared<In, Out> prepare_scatter_like(In& in, Out& out, const char* name, bool uses_in) const {
    detail::local::check_pair<In, Out>();
    const auto count = static_cast<std::size_t>(out.size());
    const auto expected = count * static_cast<std::size_t>(size());
    if (uses_in && static_cast<std::size_t>(in.size()) != expected) {
      throw error(name, "in has " + std::to_string(in.size()) + " elements, but size() * " +
                            "out.size() = " + std::to_string(size()) + " * " +
                            std::to_string(count) + " = " + std::to_string(expected));
    }
    return {detail::local::in_ptr<detail::local::elem_t<Out>>(in),
            detail::local::out_ptr<detail::local::elem_t<Out>>(out), count};
  }

  template <class In, class Out>
  Prepared<In, Out> prepare_all_to_all(In& in, Out& out) const {
    detail::local::check_pair<In, Out>();
    const auto total = static_cast<std::size_t>(in.size());
    if (static_cast<std::size_t>(out.size()) != total ||
        total % static_cast<std::size_t>(size()) != 0) {
      throw error("all_to_all",
                  "in has " + std::to_string(in.size()) + " elements and out " +
                      std::to_string(out.size()) +
                      "; both must be the same multiple of size() = " + std::to_string(size()));
    }
    return {detail::local::in_ptr<detail::local::elem_t<Out>>(in),
            detail::local::out_ptr<detail::local::elem_t<Out>>(out), total};
  }

  template <class T>
  void check_peer(int peer, const char* name) const {
    static_assert(host_accessible<tensor_space_t<T>>,
                  "tandem::LocalComm: tensors must live in host memory");
    if (peer < 0 || peer >= size()) {
      throw error(name, "peer " + std::to_string(peer) + " is not a rank of this group of " +
                            std::to_string(size()) + " ranks");
    }
  }

  std::unique_ptr<detail::local::Rank> self_;
};

static_assert(Communicator<LocalComm>);

/// Every rank sees the others' arguments in shared memory, so disagreements are always caught.
template <>
inline constexpr bool detects_mismatched_collectives<LocalComm> = true;

namespace detail::local {

inline std::string describe_exception(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

}  // namespace detail::local

/// Runs fn(comm) on `n` threads, rank i's LocalComm on thread i, and joins them. `fn` is called
/// concurrently from all threads. When a rank's fn throws, the ranks blocked in an operation are
/// woken with tandem::Error("rank i failed: ..."); after the join, the first failure is rethrown
/// as a tandem::Error naming its rank (a tandem::Error from that rank as it is).
template <class Fn>
requires std::invocable<Fn&, LocalComm&>
void run_local(int n, Fn fn, LocalCommOptions options) {
  auto comms = LocalComm::make_group(n, options, true);
  const auto family = comms.front().self().group()->family();

  std::mutex mutex;
  std::exception_ptr first_error;
  int first_rank = -1;
  auto fail = [&](int rank, std::exception_ptr error) {
    const auto what = detail::local::describe_exception(error);
    {
      std::lock_guard lock(mutex);
      if (!first_error) {
        first_error = error;
        first_rank = rank;
      }
    }
    family->abort("rank " + std::to_string(rank) + " failed: " + what);
  };

  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    try {
      threads.emplace_back(
          [&fn, &fail, r, comm = std::move(comms[static_cast<std::size_t>(r)])]() mutable {
            LocalComm own = std::move(comm);  // destroyed on this thread: waits, then leaves
            try {
              fn(own);
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

  if (!first_error) return;
  try {
    std::rethrow_exception(first_error);
  } catch (const Error& e) {
    if (e.rank() == first_rank) throw;
    throw Error(first_rank, "run_local", e.what());
  } catch (...) {
    throw Error(first_rank, "run_local", detail::local::describe_exception(first_error));
  }
}

}  // namespace tandem
