// tandem/comm/detail/flight_ring.hpp - the flight recorder's ring: the last N operations of one
// communicator as plain records (operation, sequence number, element type and count, peer or
// root, state, queued/started/ended times), written without allocating, read as a snapshot.
//   FlightRing ring("GlooComm#0", rank, size, 2000, timeout);
//   auto ticket = ring.record(call, /*async=*/false);  ...;  ring.end(ticket, /*failed=*/false);
// Needs: the standard library. Not a public header: comm/flight_recorder.hpp is.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tandem/core/timeout.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem::detail {

/// What the front end knows of an operation when it is issued: its name (a string literal),
/// whether every rank takes part (false for send and recv), its elements and its peer or root.
struct FlightCall {
  const char* operation = "";
  bool collective = true;
  bool typed = false;  ///< false for barrier and split
  dtype type = dtype::float32;
  std::size_t count = 0;  ///< elements, as the Communicator concept counts them
  int peer = -1;          ///< the root of a rooted collective, the peer of send/recv; else -1
};

/// Where an operation is: queued (`_async`, behind earlier ones), started, finished or failed.
enum class FlightState : std::uint8_t { queued, started, finished, failed };

inline const char* name(FlightState state) noexcept {
  switch (state) {
    case FlightState::queued:
      return "queued";
    case FlightState::started:
      return "started";
    case FlightState::finished:
      return "finished";
    case FlightState::failed:
      return "failed";
  }
  return "unknown";
}

/// Nanoseconds on the steady clock (the one every time in a ring is read from).
inline std::int64_t flight_now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// One operation, as recorded. Plain data: copied out whole by a snapshot.
struct FlightEntry {
  std::uint64_t ticket = 0;    ///< this ring's operations counted from 1 (0: an empty slot)
  std::uint64_t sequence = 0;  ///< collectives counted from 1; send/recv counted apart, from 1
  const char* operation = "";
  std::int64_t queued_ns = 0;   ///< steady clock; an operation run at once is queued as it starts
  std::int64_t started_ns = 0;  ///< 0 while queued
  std::int64_t ended_ns = 0;    ///< 0 until it finished or failed
  std::uint64_t count = 0;
  std::int32_t peer = -1;
  dtype type = dtype::float32;
  bool typed = false;
  bool collective = true;
  bool async = false;
  FlightState state = FlightState::queued;
  std::uint8_t notices = 0;  ///< waiting notices printed for it (the monitor's bookkeeping)
};

/// The last `capacity` operations of one communicator. Thread-safe (the issuing thread, an
/// `_async` worker and the monitor share it) through one mutex held for a few stores: no
/// allocation and two clock reads per operation (three for an `_async` one).
class FlightRing {
 public:
  FlightRing(std::string name, int rank, int size, std::size_t capacity, Timeout timeout)
      : name_(std::move(name)),
        rank_(rank),
        size_(size),
        timeout_(timeout),
        slots_(std::max<std::size_t>(capacity, 1)) {}
  FlightRing(const FlightRing&) = delete;
  FlightRing& operator=(const FlightRing&) = delete;

  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] Timeout timeout() const noexcept { return timeout_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return slots_.size(); }

  /// Records an operation as issued: queued when `async`, else started now. Returns its ticket.
  std::uint64_t record(const FlightCall& call, bool async) {
    const std::int64_t now = flight_now_ns();
    std::lock_guard lock(mutex_);
    const std::uint64_t ticket = ++issued_;
    FlightEntry& e = slots_[ticket % slots_.size()];
    if (e.ticket != 0 && (e.state == FlightState::queued || e.state == FlightState::started)) {
      --open_;  // overwritten while open: more operations in flight than the ring holds
    }
    e = FlightEntry{};
    e.ticket = ticket;
    e.sequence = call.collective ? ++collectives_ : ++point_to_point_;
    e.operation = call.operation;
    e.queued_ns = now;
    e.started_ns = async ? 0 : now;
    e.count = call.count;
    e.peer = call.peer;
    e.type = call.type;
    e.typed = call.typed;
    e.collective = call.collective;
    e.async = async;
    e.state = async ? FlightState::queued : FlightState::started;
    ++open_;
    return ticket;
  }

  /// A queued operation starts (on the `_async` worker).
  void start(std::uint64_t ticket) {
    const std::int64_t now = flight_now_ns();
    std::lock_guard lock(mutex_);
    if (FlightEntry* e = find(ticket); e && e->state == FlightState::queued) {
      e->started_ns = now;
      e->state = FlightState::started;
    }
  }

  /// An operation ends, successfully or not.
  void end(std::uint64_t ticket, bool failed) {
    const std::int64_t now = flight_now_ns();
    std::lock_guard lock(mutex_);
    FlightEntry* e = find(ticket);
    if (!e || e->state == FlightState::finished || e->state == FlightState::failed) return;
    if (e->started_ns == 0) e->started_ns = now;
    e->ended_ns = now;
    e->state = failed ? FlightState::failed : FlightState::finished;
    --open_;
    if (awaiting_ticket_ == ticket) awaiting_.clear();
  }

  /// Every recorded operation still in the ring, oldest first.
  [[nodiscard]] std::vector<FlightEntry> entries() const {
    std::lock_guard lock(mutex_);
    std::vector<FlightEntry> out;
    const std::uint64_t held = std::min<std::uint64_t>(issued_, slots_.size());
    out.reserve(static_cast<std::size_t>(held));
    for (std::uint64_t t = issued_ - held + 1; t <= issued_; ++t) {
      out.push_back(slots_[t % slots_.size()]);
    }
    return out;
  }

  /// The operations not yet ended (queued or started), oldest first; cheap when there are none.
  [[nodiscard]] std::vector<FlightEntry> open_entries() const {
    std::lock_guard lock(mutex_);
    std::vector<FlightEntry> out;
    if (open_ == 0) return out;
    const std::uint64_t held = std::min<std::uint64_t>(issued_, slots_.size());
    for (std::uint64_t t = issued_ - held + 1; t <= issued_ && out.size() < open_; ++t) {
      const FlightEntry& e = slots_[t % slots_.size()];
      if (e.state == FlightState::queued || e.state == FlightState::started) out.push_back(e);
    }
    return out;
  }

  /// The monitor counts the notices it printed for an operation (0 when it has ended).
  std::uint8_t count_notice(std::uint64_t ticket) {
    std::lock_guard lock(mutex_);
    FlightEntry* e = find(ticket);
    if (!e) return 0;
    return ++e->notices;
  }

  /// A backend that knows which peers an operation waits for says so from its wait loop.
  void set_awaiting(std::uint64_t ticket, const std::vector<int>& missing) {
    std::lock_guard lock(mutex_);
    if (!find(ticket)) return;
    awaiting_ticket_ = ticket;
    awaiting_ = missing;  // the wait loop calls this a few times a second at most
  }

  /// The peers the backend said `ticket` waits for; empty when it did not say.
  [[nodiscard]] std::pair<bool, std::vector<int>> awaiting(std::uint64_t ticket) const {
    std::lock_guard lock(mutex_);
    if (awaiting_ticket_ != ticket) return {false, {}};
    return {true, awaiting_};
  }

 private:
  FlightEntry* find(std::uint64_t ticket) {
    FlightEntry& e = slots_[ticket % slots_.size()];
    return e.ticket == ticket ? &e : nullptr;
  }

  const std::string name_;
  const int rank_;
  const int size_;
  const Timeout timeout_;
  mutable std::mutex mutex_;
  std::vector<FlightEntry> slots_;
  std::uint64_t issued_ = 0;
  std::uint64_t collectives_ = 0;
  std::uint64_t point_to_point_ = 0;
  std::size_t open_ = 0;
  std::uint64_t awaiting_ticket_ = 0;
  std::vector<int> awaiting_;
};

}  // namespace tandem::detail
