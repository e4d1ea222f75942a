// tandem/comm/detail/frontend.hpp - the public operations of the Communicator concept written
// once, for the backends whose engine runs typed algorithms on raw pointers: each operation
// checks its arguments (collective_args.hpp), then runs the algorithm now (sync) or later
// (`_async`, returning tandem::Work). Static dispatch only (CRTP): no virtual call on the way.
//   class MyComm : public tandem::detail::CollectiveFrontend<MyComm, tandem::host> { ... };
// Needs: the standard library. Not a public header: backends include it.
// A host frontend (Space host) also takes device tensors: it stages them through pinned memory
// (detail/staging.hpp), so device code runs on Gloo or LocalComm unchanged. Every operation also
// takes DynamicTensors (tensor/dynamic.hpp: a torch::Tensor, with tandem/torch.hpp), seen
// through typed views once their dtype, layout and device are checked.
//
// What Derived provides (the base is its friend):
// - `Engine& self() const`: its engine, at a stable address (heap-allocated, so that `_async`
//   tasks may point at it while Derived moves); it raises tandem::Error when Derived was moved
//   from.
// - `std::optional<Derived> split_group(int color, int key)`: split's collective part (the colour
//   has been checked, and pending `_async` operations have run).
// Every operation is recorded in the communicator's flight recorder (comm/flight_recorder.hpp):
// run_now and run_later below, or recorded()/recorded_work() for a Derived that hides them.
// A Derived may name its root groups itself (`std::string flight_name() const`).
//
// What the engine provides:
// - rank(), size(); now(body) runs body after the pending `_async` operations, later(body) queues
//   it and returns its Work (detail::IssueOrder has both);
// - the algorithms, for each element type E: all_reduce<E>(const E* in, E* out, count, op),
//   reduce<E>(E* buffer, count, root, op), broadcast<E>(E* buffer, count, root),
//   all_gather<E>(in, out, count), gather<E>(in, out, count, root),
//   scatter<E>(in, out, count, root), reduce_scatter<E>(in, out, count, op),
//   all_to_all<E>(in, out, total), send<E>(const E* data, count, peer, tag),
//   recv<E>(E* data, count, peer, tag), barrier(). Counts are elements per rank as the
//   Communicator concept defines them (all_to_all's is the total).
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/collective_args.hpp"
#include "tandem/comm/detail/flight_hooks.hpp"
#include "tandem/comm/detail/staging.hpp"
#include "tandem/tensor/dynamic.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::detail {

/// An (in, out) pair in which at least one is a DynamicTensor and neither is anything else.
template <class In, class Out>
concept DynamicPair = AnyTensor<In> && AnyTensor<Out> &&(DynamicTensor<In> || DynamicTensor<Out>);

template <class Derived, class Space>
class CollectiveFrontend : public FlightHooks<CollectiveFrontend<Derived, Space>> {
 public:
  using communicator_concept = communicator_tag;
  using memory_space = Space;

  [[nodiscard]] int rank() const { return engine().rank(); }
  [[nodiscard]] int size() const { return engine().size(); }

  // --- all_reduce -----------------------------------------------------------------------------

  /// In place: every rank's `t` becomes the reduction of all ranks' `t`.
  template <Tensor T>
  void all_reduce(T&& t, ReduceOp op = ReduceOp::sum) {
    all_reduce(t, t, op);
  }
  template <Tensor In, Tensor Out>
  void all_reduce(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    if constexpr (needs_staging<Space, In, Out>) {
      staged(in, out, [&](auto& i, auto& o) { all_reduce(i, o, op); });
    } else {
      derived().run_now(typed_call("all_reduce", out, -1, true),
                        [&] { return derived().all_reduce_task(in, out, op); });
    }
  }
  template <Tensor T>
  Work all_reduce_async(T&& t, ReduceOp op = ReduceOp::sum) {
    return all_reduce_async(t, t, op);
  }
  template <Tensor In, Tensor Out>
  Work all_reduce_async(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    if constexpr (needs_staging<Space, In, Out>) {
      return staged_async(in, out, [&](auto& i, auto& o) { return all_reduce_async(i, o, op); });
    } else {
      return derived().run_later(typed_call("all_reduce", out, -1, true),
                                 [&] { return derived().all_reduce_task(in, out, op); });
    }
  }

  // --- reduce (result on root only) -------------------------------------------------------------

  template <Tensor T>
  void reduce(T&& t, int root, ReduceOp op = ReduceOp::sum) {
    if constexpr (needs_staging<Space, T>) {
      staged_one(t, rank() == root ? Direction::read_write : Direction::read,
                 [&](auto& h) { reduce(h, root, op); });
    } else {
      derived().run_now(typed_call("reduce", t, root, true),
                        [&] { return derived().reduce_task(t, root, op); });
    }
  }
  template <Tensor T>
  Work reduce_async(T&& t, int root, ReduceOp op = ReduceOp::sum) {
    if constexpr (needs_staging<Space, T>) {
      return staged_one_async(t, rank() == root ? Direction::read_write : Direction::read,
                              [&](auto& h) { return reduce_async(h, root, op); });
    } else {
      return derived().run_later(typed_call("reduce", t, root, true),
                                 [&] { return derived().reduce_task(t, root, op); });
    }
  }

  // --- broadcast --------------------------------------------------------------------------------

  template <Tensor T>
  void broadcast(T&& t, int root) {
    if constexpr (needs_staging<Space, T>) {
      staged_one(t, rank() == root ? Direction::read : Direction::write,
                 [&](auto& h) { broadcast(h, root); });
    } else {
      derived().run_now(typed_call("broadcast", t, root, true),
                        [&] { return derived().broadcast_task(t, root); });
    }
  }
  template <Tensor T>
  Work broadcast_async(T&& t, int root) {
    if constexpr (needs_staging<Space, T>) {
      return staged_one_async(t, rank() == root ? Direction::read : Direction::write,
                              [&](auto& h) { return broadcast_async(h, root); });
    } else {
      return derived().run_later(typed_call("broadcast", t, root, true),
                                 [&] { return derived().broadcast_task(t, root); });
    }
  }

  // --- all_gather: out holds size() * in.size() elements, rank r's at r * in.size() -----------

  template <Tensor In, Tensor Out>
  void all_gather(In&& in, Out&& out) {
    if constexpr (needs_staging<Space, In, Out>) {
      staged(in, out, [&](auto& i, auto& o) { all_gather(i, o); });
    } else {
      derived().run_now(typed_call("all_gather", in, -1, true),
                        [&] { return derived().all_gather_task(in, out); });
    }
  }
  template <Tensor In, Tensor Out>
  Work all_gather_async(In&& in, Out&& out) {
    if constexpr (needs_staging<Space, In, Out>) {
      return staged_async(in, out, [&](auto& i, auto& o) { return all_gather_async(i, o); });
    } else {
      return derived().run_later(typed_call("all_gather", in, -1, true),
                                 [&] { return derived().all_gather_task(in, out); });
    }
  }

  // --- gather: out (size() * in.size() elements) is used on the root only -------------------

  template <Tensor In, Tensor Out>
  void gather(In&& in, Out&& out, int root) {
    if constexpr (needs_staging<Space, In, Out>) {
      staged(in, out, [&](auto& i, auto& o) { gather(i, o, root); });
    } else {
      derived().run_now(typed_call("gather", in, root, true),
                        [&] { return derived().gather_task(in, out, root); });
    }
  }
  template <Tensor In, Tensor Out>
  Work gather_async(In&& in, Out&& out, int root) {
    if constexpr (needs_staging<Space, In, Out>) {
      return staged_async(in, out, [&](auto& i, auto& o) { return gather_async(i, o, root); });
    } else {
      return derived().run_later(typed_call("gather", in, root, true),
                                 [&] { return derived().gather_task(in, out, root); });
    }
  }

  // --- scatter: in (size() * out.size() elements) is used on the root only ------------------

  template <Tensor In, Tensor Out>
  void scatter(In&& in, Out&& out, int root) {
    if constexpr (needs_staging<Space, In, Out>) {
      staged(in, out, [&](auto& i, auto& o) { scatter(i, o, root); });
    } else {
      derived().run_now(typed_call("scatter", out, root, true),
                        [&] { return derived().scatter_task(in, out, root); });
    }
  }
  template <Tensor In, Tensor Out>
  Work scatter_async(In&& in, Out&& out, int root) {
    if constexpr (needs_staging<Space, In, Out>) {
      return staged_async(in, out, [&](auto& i, auto& o) { return scatter_async(i, o, root); });
    } else {
      return derived().run_later(typed_call("scatter", out, root, true),
                                 [&] { return derived().scatter_task(in, out, root); });
    }
  }

  // --- reduce_scatter: in holds size() * out.size() elements --------------------------------

  template <Tensor In, Tensor Out>
  void reduce_scatter(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    if constexpr (needs_staging<Space, In, Out>) {
      staged(in, out, [&](auto& i, auto& o) { reduce_scatter(i, o, op); });
    } else {
      derived().run_now(typed_call("reduce_scatter", out, -1, true),
                        [&] { return derived().reduce_scatter_task(in, out, op); });
    }
  }
  template <Tensor In, Tensor Out>
  Work reduce_scatter_async(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    if constexpr (needs_staging<Space, In, Out>) {
      return staged_async(in, out,
                          [&](auto& i, auto& o) { return reduce_scatter_async(i, o, op); });
    } else {
      return derived().run_later(typed_call("reduce_scatter", out, -1, true),
                                 [&] { return derived().reduce_scatter_task(in, out, op); });
    }
  }

  // --- all_to_all: in and out hold size() * k elements; slot s of in goes to rank s ---------

  template <Tensor In, Tensor Out>
  void all_to_all(In&& in, Out&& out) {
    if constexpr (needs_staging<Space, In, Out>) {
      staged(in, out, [&](auto& i, auto& o) { all_to_all(i, o); });
    } else {
      derived().run_now(typed_call("all_to_all", in, -1, true),
                        [&] { return derived().all_to_all_task(in, out); });
    }
  }
  template <Tensor In, Tensor Out>
  Work all_to_all_async(In&& in, Out&& out) {
    if constexpr (needs_staging<Space, In, Out>) {
      return staged_async(in, out, [&](auto& i, auto& o) { return all_to_all_async(i, o); });
    } else {
      return derived().run_later(typed_call("all_to_all", in, -1, true),
                                 [&] { return derived().all_to_all_task(in, out); });
    }
  }

  // --- point to point (see the backend's header for when send returns) -----------------------

  template <Tensor T>
  void send(T&& t, int peer, int tag = 0) {
    if constexpr (needs_staging<Space, T>) {
      staged_one(t, Direction::read, [&](auto& h) { send(h, peer, tag); });
    } else {
      derived().run_now(typed_call("send", t, peer, false),
                        [&] { return derived().send_task(t, peer, tag); });
    }
  }
  template <Tensor T>
  Work send_async(T&& t, int peer, int tag = 0) {
    if constexpr (needs_staging<Space, T>) {
      return staged_one_async(t, Direction::read,
                              [&](auto& h) { return send_async(h, peer, tag); });
    } else {
      return derived().run_later(typed_call("send", t, peer, false),
                                 [&] { return derived().send_task(t, peer, tag); });
    }
  }
  /// Waits for the oldest message from `peer` with `tag`; its type and count must match `t`.
  template <Tensor T>
  void recv(T&& t, int peer, int tag = 0) {
    if constexpr (needs_staging<Space, T>) {
      staged_one(t, Direction::write, [&](auto& h) { recv(h, peer, tag); });
    } else {
      derived().run_now(typed_call("recv", t, peer, false),
                        [&] { return derived().recv_task(t, peer, tag); });
    }
  }
  template <Tensor T>
  Work recv_async(T&& t, int peer, int tag = 0) {
    if constexpr (needs_staging<Space, T>) {
      return staged_one_async(t, Direction::write,
                              [&](auto& h) { return recv_async(h, peer, tag); });
    } else {
      return derived().run_later(typed_call("recv", t, peer, false),
                                 [&] { return derived().recv_task(t, peer, tag); });
    }
  }

  // --- DynamicTensors (a torch::Tensor): the same operations on typed views ------------------
  // A dynamic argument is seen with its own element type, or that of the other argument of an
  // (in, out) pair; an Error names the operation and the cause when it cannot be (a dtype tandem
  // does not move or that differs from the other argument's, not dense and contiguous, not in
  // this communicator's memory). Where the tensor's library keeps a stream order of its own
  // (dynamic_tensor_traits<T>::ordered: a CUDA torch::Tensor, libtorch's current stream), the
  // operation runs in it (visit_ordered, pair_ordered below).

  template <DynamicTensor T>
  void all_reduce(T&& t, ReduceOp op = ReduceOp::sum) {
    visit_ordered(t, "all_reduce", [&](auto v) { all_reduce(v, v, op); });
  }
  template <class In, class Out>
  requires DynamicPair<In, Out>
  void all_reduce(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    pair_ordered(in, out, "all_reduce", [&](auto i, auto o) { all_reduce(i, o, op); });
  }
  template <DynamicTensor T>
  Work all_reduce_async(T&& t, ReduceOp op = ReduceOp::sum) {
    return visit_ordered(t, "all_reduce_async", [&](auto v) { return all_reduce_async(v, v, op); });
  }
  template <class In, class Out>
  requires DynamicPair<In, Out> Work all_reduce_async(In&& in, Out&& out,
                                                      ReduceOp op = ReduceOp::sum) {
    return pair_ordered(in, out, "all_reduce_async",
                        [&](auto i, auto o) { return all_reduce_async(i, o, op); });
  }
  template <DynamicTensor T>
  void reduce(T&& t, int root, ReduceOp op = ReduceOp::sum) {
    visit_ordered(t, "reduce", [&](auto v) { reduce(v, root, op); });
  }
  template <DynamicTensor T>
  Work reduce_async(T&& t, int root, ReduceOp op = ReduceOp::sum) {
    return visit_ordered(t, "reduce_async", [&](auto v) { return reduce_async(v, root, op); });
  }
  template <DynamicTensor T>
  void broadcast(T&& t, int root) {
    visit_ordered(t, "broadcast", [&](auto v) { broadcast(v, root); });
  }
  template <DynamicTensor T>
  Work broadcast_async(T&& t, int root) {
    return visit_ordered(t, "broadcast_async", [&](auto v) { return broadcast_async(v, root); });
  }
  template <class In, class Out>
  requires DynamicPair<In, Out>
  void all_gather(In&& in, Out&& out) {
    pair_ordered(in, out, "all_gather", [&](auto i, auto o) { all_gather(i, o); });
  }
  template <class In, class Out>
  requires DynamicPair<In, Out> Work all_gather_async(In&& in, Out&& out) {
    return pair_ordered(in, out, "all_gather_async",
                        [&](auto i, auto o) { return all_gather_async(i, o); });
  }
  template <class In, class Out>
  requires DynamicPair<In, Out>
  void gather(In&& in, Out&& out, int root) {
    pair_ordered(in, out, "gather", [&](auto i, auto o) { gather(i, o, root); });
  }
  template <class In, class Out>
  requires DynamicPair<In, Out> Work gather_async(In&& in, Out&& out, int root) {
    return pair_ordered(in, out, "gather_async",
                        [&](auto i, auto o) { return gather_async(i, o, root); });
  }
  template <class In, class Out>
  requires DynamicPair<In, Out>
  void scatter(In&& in, Out&& out, int root) {
    pair_ordered(in, out, "scatter", [&](auto i, auto o) { scatter(i, o, root); });
  }
  template <class In, class Out>
  requires DynamicPair<In, Out> Work scatter_async(In&& in, Out&& out, int root) {
    return pair_ordered(in, out, "scatter_async",
                        [&](auto i, auto o) { return scatter_async(i, o, root); });
  }
  template <class In, class Out>
  requires DynamicPair<In, Out>
  void reduce_scatter(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    pair_ordered(in, out, "reduce_scatter", [&](auto i, auto o) { reduce_scatter(i, o, op); });
  }
  template <class In, class Out>
  requires DynamicPair<In, Out> Work reduce_scatter_async(In&& in, Out&& out,
                                                          ReduceOp op = ReduceOp::sum) {
    return pair_ordered(in, out, "reduce_scatter_async",
                        [&](auto i, auto o) { return reduce_scatter_async(i, o, op); });
  }
  template <class In, class Out>
  requires DynamicPair<In, Out>
  void all_to_all(In&& in, Out&& out) {
    pair_ordered(in, out, "all_to_all", [&](auto i, auto o) { all_to_all(i, o); });
  }
  template <class In, class Out>
  requires DynamicPair<In, Out> Work all_to_all_async(In&& in, Out&& out) {
    return pair_ordered(in, out, "all_to_all_async",
                        [&](auto i, auto o) { return all_to_all_async(i, o); });
  }
  template <DynamicTensor T>
  void send(T&& t, int peer, int tag = 0) {
    visit_ordered(t, "send", [&](auto v) { send(v, peer, tag); });
  }
  template <DynamicTensor T>
  Work send_async(T&& t, int peer, int tag = 0) {
    return visit_ordered(t, "send_async", [&](auto v) { return send_async(v, peer, tag); });
  }
  template <DynamicTensor T>
  void recv(T&& t, int peer, int tag = 0) {
    visit_ordered(t, "recv", [&](auto v) { recv(v, peer, tag); });
  }
  template <DynamicTensor T>
  Work recv_async(T&& t, int peer, int tag = 0) {
    return visit_ordered(t, "recv_async", [&](auto v) { return recv_async(v, peer, tag); });
  }

  // --- barrier and split --------------------------------------------------------------------

  void barrier() {
    derived().run_now(FlightCall{"barrier"}, [&] { return derived().barrier_task(); });
  }
  Work barrier_async() {
    return derived().run_later(FlightCall{"barrier"}, [&] { return derived().barrier_task(); });
  }

  /// Collective: ranks with the same `color` form a new group, ordered by (key, rank here);
  /// no_color gives nullopt (the rank still takes part). The new group has this group's options.
  [[nodiscard]] std::optional<Derived> split(int color, int key = 0) {
    check_color(rank(), color);
    std::optional<Derived> made;
    const auto number = this->next_split();
    engine().now([&] {
      this->recorded(FlightCall{"split"}, [&] { made = derived().split_group(color, key); });
    });
    this->name_split(made, number, color);
    return made;
  }

 protected:
  CollectiveFrontend() = default;

 private:
  /// run() in the stream order of dynamic tensor `t`'s library, where its traits have one
  /// (dynamic_tensor_traits<T>::ordered<Space>(comm, t, run)); otherwise run() as it is.
  template <class T, class Run>
  decltype(auto) dynamic_ordered(const T& t, Run&& run) {
    using traits = dynamic_tensor_traits<std::remove_cvref_t<T>>;
    if constexpr (requires { traits::template ordered<Space>(derived(), t, run); }) {
      return traits::template ordered<Space>(derived(), t, run);
    } else {
      return run();
    }
  }
  /// f(typed view of t), in t's stream order.
  template <class T, class F>
  decltype(auto) visit_ordered(const T& t, const char* operation, F&& f) {
    return dynamic_ordered(
        t, [&]() -> decltype(auto) { return visit_dynamic<Space>(t, operation, rank(), f); });
  }
  /// f(typed in, typed out), in the stream order of the pair's (first) dynamic tensor.
  template <class In, class Out, class F>
  decltype(auto) pair_ordered(In& in, Out& out, const char* operation, F&& f) {
    auto run = [&]() -> decltype(auto) {
      return with_typed_pair<Space>(in, out, operation, rank(), f);
    };
    if constexpr (DynamicTensor<In>) {
      return dynamic_ordered(in, run);
    } else {
      return dynamic_ordered(out, run);
    }
  }

  friend class FlightHooks<CollectiveFrontend>;

  decltype(auto) engine() const { return static_cast<const Derived&>(*this).self(); }
  Derived& derived() { return static_cast<Derived&>(*this); }

  /// What the flight recorder keeps of a typed operation on `t` (its elements and type).
  template <class T>
  static FlightCall typed_call(const char* operation, const T& t, int peer, bool collective) {
    return {operation, collective, true, dtype_of<elem_t<T>>, t.size(), peer};
  }

  /// What the flight recorder asks of this communicator (FlightHooks).
  [[nodiscard]] FlightIdentity flight_identity() const {
    if constexpr (requires(const Derived& d) { Timeout(d.options().timeout); }) {
      return {rank(), size(), Timeout(static_cast<const Derived&>(*this).options().timeout)};
    } else if constexpr (requires { Timeout(engine().timeout()); }) {
      return {rank(), size(), Timeout(engine().timeout())};
    } else {
      return {rank(), size(), Timeout::max()};
    }
  }
  /// A communicator that is no split's is named by the Derived (flight_name()) or by its type
  /// and the order in which this process names them ("GlooComm#0").
  [[nodiscard]] std::string flight_root_name() const {
    if constexpr (requires(const Derived& d) { d.flight_name(); }) {
      return static_cast<const Derived&>(*this).flight_name();
    } else {
      return root_flight_name<Derived>();
    }
  }

  // The hooks a Derived may hide with its own (same name and signature): run_now, run_later
  // and any X_task. `call` names the operation for the flight recorder (`collective` is false
  // for send and recv); `build()` checks the arguments and returns the task.

  /// Runs `task(engine)` on this thread, after the pending `_async` operations.
  template <class Build>
  void run_now(const FlightCall& call, Build build) {
    auto task = build();
    auto& e = engine();
    e.now([&] { this->recorded(call, [&] { task(e); }); });
  }

  /// Queues `task(engine)`; the tensors must stay alive and untouched until the Work completes.
  template <class Build>
  Work run_later(const FlightCall& call, Build build) {
    auto task = build();
    return this->recorded_later(&engine(), call, std::move(task));
  }

  static auto barrier_task() {
    return [](auto& engine) { engine.barrier(); };
  }

  // The tasks: the arguments checked here, on the calling thread, before anything runs.

  template <class In, class Out>
  auto all_reduce_task(In& in, Out& out, ReduceOp op) const {
    using E = elem_t<Out>;
    const auto a = all_reduce_args<Space>(rank(), in, out, op);
    return [a, op](auto& engine) { engine.template all_reduce<E>(a.in, a.out, a.count, op); };
  }

  template <class T>
  auto reduce_task(T& t, int root, ReduceOp op) const {
    using E = elem_t<T>;
    E* data = rooted_args<Space>(rank(), size(), t, root, op, "reduce");
    const std::size_t count = t.size();
    return [=](auto& engine) { engine.template reduce<E>(data, count, root, op); };
  }

  template <class T>
  auto broadcast_task(T& t, int root) const {
    using E = elem_t<T>;
    E* data = rooted_args<Space>(rank(), size(), t, root, ReduceOp::sum, "broadcast");
    const std::size_t count = t.size();
    return [=](auto& engine) { engine.template broadcast<E>(data, count, root); };
  }

  template <class In, class Out>
  auto all_gather_task(In& in, Out& out) const {
    using E = elem_t<Out>;
    const auto a = all_gather_args<Space>(rank(), size(), in, out);
    return [a](auto& engine) { engine.template all_gather<E>(a.in, a.out, a.count); };
  }

  template <class In, class Out>
  auto gather_task(In& in, Out& out, int root) const {
    using E = elem_t<Out>;
    const auto a = gather_args<Space>(rank(), size(), in, out, root);
    return [a, root](auto& engine) { engine.template gather<E>(a.in, a.out, a.count, root); };
  }

  template <class In, class Out>
  auto scatter_task(In& in, Out& out, int root) const {
    using E = elem_t<Out>;
    const auto a = scatter_args<Space>(rank(), size(), in, out, root);
    return [a, root](auto& engine) { engine.template scatter<E>(a.in, a.out, a.count, root); };
  }

  template <class In, class Out>
  auto reduce_scatter_task(In& in, Out& out, ReduceOp op) const {
    using E = elem_t<Out>;
    const auto a = reduce_scatter_args<Space>(rank(), size(), in, out, op);
    return [a, op](auto& engine) { engine.template reduce_scatter<E>(a.in, a.out, a.count, op); };
  }

  template <class In, class Out>
  auto all_to_all_task(In& in, Out& out) const {
    using E = elem_t<Out>;
    const auto a = all_to_all_args<Space>(rank(), size(), in, out);
    return [a](auto& engine) { engine.template all_to_all<E>(a.in, a.out, a.count); };
  }

  template <class T>
  auto send_task(T& t, int peer, int tag) const {
    using E = elem_t<T>;
    const E* data = send_args<Space>(rank(), size(), t, peer);
    const std::size_t count = t.size();
    return [=](auto& engine) { engine.template send<E>(data, count, peer, tag); };
  }

  template <class T>
  auto recv_task(T& t, int peer, int tag) const {
    using E = elem_t<T>;
    E* data = recv_args<Space>(rank(), size(), t, peer);
    const std::size_t count = t.size();
    return [=](auto& engine) { engine.template recv<E>(data, count, peer, tag); };
  }
};

}  // namespace tandem::detail
