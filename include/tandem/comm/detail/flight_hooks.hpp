// tandem/comm/detail/flight_hooks.hpp - how the collective front end records every operation in
// its communicator's flight recorder: a sync operation around its run, an `_async` one from its
// queueing through its run on the worker, one a backend hands on until its Work completes.
//   class CollectiveFrontend : public FlightHooks<CollectiveFrontend<D, S>> { ... };
//   this->recorded(call, [&] { engine.run(task); });     // in a Derived's own run_now
// Needs: the standard library. Not a public header: frontend.hpp is its user.
//
// What Frontend provides (FlightHooks is its friend): `FlightIdentity flight_identity() const`
// (rank, size, timeout) and `std::string flight_root_name() const`.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "tandem/comm/detail/flight_monitor.hpp"
#include "tandem/comm/detail/flight_ring.hpp"
#include "tandem/comm/detail/rank_threads.hpp"
#include "tandem/comm/flight_recorder.hpp"
#include "tandem/comm/work.hpp"
#include "tandem/core/timeout.hpp"

namespace tandem::detail {

/// Who a communicator is, for its flight recorder.
struct FlightIdentity {
  int rank = 0;
  int size = 1;
  Timeout timeout = Timeout::max();
};

template <class Frontend>
class FlightHooks {
 protected:
  FlightHooks() = default;

  /// Runs `body()` as the operation `call`: recorded as started now, then finished, or failed
  /// (the first failure of each kind writes the dump). For a Derived that hides run_now.
  template <class Body>
  void recorded(const FlightCall& call, Body&& body) {
    const auto& ring = flight_ring();
    if (!ring) return body();
    run_as(*ring, ring->record(call, false), body, true);
  }

  /// Queues `task(*engine)` with engine->later(): recorded as queued now, started and ended on
  /// the worker.
  template <class Engine, class Task>
  Work recorded_later(Engine* engine, const FlightCall& call, Task task) {
    std::shared_ptr<FlightRing> ring = flight_ring();
    if (!ring) return engine->later([engine, task] { task(*engine); });
    const auto ticket = ring->record(call, true);
    return run_as(
        *ring, ticket,
        [&] {
          return engine->later([engine, task, ring, ticket] {
            ring->start(ticket);
            run_as(
                *ring, ticket, [&] { task(*engine); }, true);
          });
        },
        false);
  }

  /// Records `call` as started, runs `launch()` (which hands the operation on and returns its
  /// Work) and ends the record when that Work completes. For a Derived that hides run_later.
  template <class Launch>
  Work recorded_work(const FlightCall& call, Launch&& launch) {
    const auto& ring = flight_ring();
    if (!ring) return launch();
    const auto ticket = ring->record(call, false);
    Work work = run_as(*ring, ticket, launch, false);
    if (!work.state()) {
      ring->end(ticket, false);
      return work;
    }
    work.state()->on_end([ring = ring, ticket](const std::exception_ptr& error) {
      ring->end(ticket, error != nullptr);
      if (error) FlightRegistry::instance().dump_on_failure(describe_exception(error));
    });
    return work;
  }

  /// The number of this communicator's next split (from 1; the same on every rank).
  std::uint64_t next_split() noexcept { return flight_.next_split(); }

  /// Names the group that split number `number` (colour `color`) made from this one.
  template <class Made>
  void name_split(std::optional<Made>& made, std::uint64_t number, int color) {
    if (!made) return;
    FlightHooks& child = *made;
    child.flight_.name_as_split(flight_.name([this] { return frontend().flight_root_name(); }),
                                number, color);
  }

 private:
  const Frontend& frontend() const { return static_cast<const Frontend&>(*this); }

  /// Runs `body()` as the operation `ticket` of `ring` on this thread and returns what it
  /// returns: a failure ends the operation as failed (the first of each kind writes the dump)
  /// and goes on; success ends it only where `end_on_success` (else the operation goes on
  /// elsewhere, and ends there).
  template <class Body>
  static decltype(auto) run_as(FlightRing& ring, std::uint64_t ticket, Body&& body,
                               bool end_on_success) {
    FlightScope scope(&ring, ticket);
    try {
      if constexpr (std::is_void_v<decltype(body())>) {
        body();
        if (end_on_success) ring.end(ticket, false);
      } else {
        auto result = body();
        if (end_on_success) ring.end(ticket, false);
        return result;
      }
    } catch (const std::exception& e) {
      ring.end(ticket, true);
      FlightRegistry::instance().dump_on_failure(e.what());
      throw;
    } catch (...) {
      ring.end(ticket, true);
      throw;
    }
  }

  const std::shared_ptr<FlightRing>& flight_ring() {
    if (flight_.made()) return flight_.get();
    const FlightIdentity who = frontend().flight_identity();
    return flight_.ring([this] { return frontend().flight_root_name(); }, who.rank, who.size,
                        who.timeout);
  }

  FlightHandle flight_;
};

}  // namespace tandem::detail
