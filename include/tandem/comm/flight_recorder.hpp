// tandem/comm/flight_recorder.hpp - the flight recorder every communicator keeps: its last N
// operations (operation, sequence number, element type and count, peer or root, state, queued,
// started and ended times) in a ring of plain records, written to a small JSON file per process
// when an operation times out, the ranks disagree, a peer is lost, on SIGUSR1, or when an
// operation has waited long; a waiting rank says for whom it waits. No variable is needed.
//   comm.all_reduce(grads);                          // recorded, at a negligible cost
//   std::string path = tandem::dump_flight_records();   // now, on demand
//   // tandemrun --trace DIR merges every rank's dump (comm/flight_trace.hpp)
// Needs: POSIX (threads, a pipe, sigaction). Settings: comm/flight_settings.hpp; the design, the
// files and what each backend can name: docs/backends.md ("Flight recorder").
#pragma once

#include <cxxabi.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <typeinfo>
#include <utility>

#include "tandem/comm/detail/flight_dump.hpp"
#include "tandem/comm/detail/flight_monitor.hpp"
#include "tandem/comm/detail/flight_ring.hpp"
#include "tandem/comm/flight_settings.hpp"
#include "tandem/comm/flight_trace.hpp"
#include "tandem/core/timeout.hpp"

namespace tandem {

/// Writes the flight records of every communicator of this process now, and returns the file's
/// path ("" when no communicator records, or the file could not be written).
inline std::string dump_flight_records() {
  return detail::FlightRegistry::instance().dump(detail::FlightReason::request, "");
}

/// The directory this process writes its flight records to ("" until a communicator records).
[[nodiscard]] inline std::string flight_recorder_directory() {
  return detail::FlightRegistry::instance().directory();
}

namespace detail {

/// "tandem::HierarchicalComm<tandem::ShmComm, tandem::GlooComm>" -> "HierarchicalComm".
inline std::string short_type_name(const std::type_info& type) {
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> full(
      abi::__cxa_demangle(type.name(), nullptr, nullptr, &status), &std::free);
  std::string name = status == 0 && full ? full.get() : type.name();
  name = name.substr(0, name.find('<'));
  if (const auto colon = name.rfind("::"); colon != std::string::npos) name.erase(0, colon + 2);
  return name;
}

/// The `k`-th communicator of type Comm this process names as a root (0, 1, ...): the ranks of
/// a job make their communicators in the same order, so the names agree across processes.
template <class Comm>
std::string root_flight_name() {
  static const std::string label = short_type_name(typeid(Comm));
  static std::atomic<int> made{0};
  return label + "#" + std::to_string(made++);
}

/// One communicator's flight recorder as its front end holds it: the ring, made at the first
/// operation with the settings of that moment, and the name it records under (split names the
/// new group after its parent: "GlooComm#0/1.3", the first split, colour 3). Moves with the
/// communicator; an `_async` operation holds the ring until it has run.
class FlightHandle {
 public:
  FlightHandle() = default;
  FlightHandle(FlightHandle&&) noexcept = default;
  FlightHandle& operator=(FlightHandle&&) noexcept = default;

  /// The ring, made on first use (null when the recorder is off). `root_name()` names a
  /// communicator that is no split's; a bad setting in the environment raises here.
  template <class RootName>
  const std::shared_ptr<FlightRing>& ring(RootName&& root_name, int rank, int size,
                                          Timeout timeout) {
    if (!made_) {
      if (name_.empty()) name_ = root_name();
      const FlightRecorderSettings settings = flight_recorder_settings();
      made_ = true;
      if (settings.size > 0) {
        ring_ = std::make_shared<FlightRing>(name_, rank, size, settings.size, timeout);
        FlightRegistry::instance().add(ring_, settings);
      }
    }
    return ring_;
  }

  /// Whether the ring was made (it may be null: the recorder is off).
  [[nodiscard]] bool made() const noexcept { return made_; }
  /// The ring once made (null when the recorder is off).
  [[nodiscard]] const std::shared_ptr<FlightRing>& get() const noexcept { return ring_; }

  /// The name, settled now if it was not yet.
  template <class RootName>
  const std::string& name(RootName&& root_name) {
    if (name_.empty()) name_ = root_name();
    return name_;
  }

  /// The number of the next split of this communicator (from 1; the same on every rank).
  std::uint64_t next_split() noexcept { return ++splits_; }

  /// Names a group made by split, before its first operation.
  void name_as_split(const std::string& parent, std::uint64_t split, int color) {
    name_ = parent + "/" + std::to_string(split) + "." + std::to_string(color);
  }

 private:
  std::shared_ptr<FlightRing> ring_;
  std::string name_;
  bool made_ = false;
  std::uint64_t splits_ = 0;
};

}  // namespace detail
}  // namespace tandem
