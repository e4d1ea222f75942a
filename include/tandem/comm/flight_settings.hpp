// tandem/comm/flight_settings.hpp - the flight recorder's settings: how many operations each
// communicator remembers, how soon a waiting rank says so, and where the records are written.
//   tandem::set_flight_recorder({.size = 0});   // off, for communicators made from now on
//   tandem::set_flight_recorder({.size = 500, .notice_interval = std::chrono::seconds(30)});
// Needs: the standard library. Every communicator's flight recorder (comm/flight_recorder.hpp)
// reads these when it records its first operation; the environment is read then too.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"

namespace tandem {

/// The variable that sets how many operations each communicator remembers (0 turns it off).
inline constexpr std::string_view flight_recorder_size_variable = "TANDEM_FLIGHT_RECORDER_SIZE";
/// The variable that names the directory the records are written to (tandemrun sets it).
inline constexpr std::string_view flight_recorder_dir_variable = "TANDEM_FLIGHT_RECORDER_DIR";
/// The variable that sets, in whole seconds, when a waiting rank first says so (0: never); the
/// rendezvous reads it too (comm/init.hpp).
inline constexpr std::string_view wait_notice_variable = "TANDEM_WAIT_NOTICE_S";

/// How the flight recorder behaves. Defaults need no configuration.
struct FlightRecorderSettings {
  /// Operations each communicator remembers: the last `size`, in a ring of plain records
  /// (about 80 bytes each). 0 records nothing, prints no waiting notice and writes no record.
  std::size_t size = 2000;
  /// When an operation has waited this long its rank prints one line naming the peers it waits
  /// for, then again each time the wait doubles; zero never. Past half of it, the rank writes its
  /// record where its peers (and tandemrun) read it.
  Timeout notice_interval = std::chrono::seconds(10);
  /// Where the records go ("" : TANDEM_FLIGHT_RECORDER_DIR, else
  /// `$TMPDIR/tandem-flight-JOB`, see docs/backends.md).
  std::string directory{};
};

namespace detail {

/// The largest ring a variable may ask for (about 800 MB per communicator).
inline constexpr std::int64_t max_flight_recorder_size = 10'000'000;

/// The process's explicit choice, if it made one (set_flight_recorder).
struct FlightChoice {
  std::mutex mutex;
  std::optional<FlightRecorderSettings> chosen;
};

inline FlightChoice& flight_choice() {
  static auto* choice = new FlightChoice;  // never destroyed: communicators may outlive statics
  return *choice;
}

/// The settings from the environment alone; a bad value is a tandem::Error naming the variable.
inline FlightRecorderSettings flight_settings_from_env(const EnvLookup& env) {
  FlightRecorderSettings settings;
  if (const auto size =
          env_int_in(env, flight_recorder_size_variable, 0, max_flight_recorder_size)) {
    settings.size = static_cast<std::size_t>(*size);
  }
  if (const auto seconds = env_int_in(env, wait_notice_variable, 0, 24 * 3600)) {
    settings.notice_interval = std::chrono::seconds(*seconds);
  }
  if (const auto dir = env(flight_recorder_dir_variable); dir && !dir->empty()) {
    settings.directory = *dir;
  }
  return settings;
}

}  // namespace detail

/// The settings a communicator made now gets: those given to set_flight_recorder, else the
/// environment's (TANDEM_FLIGHT_RECORDER_SIZE, TANDEM_WAIT_NOTICE_S,
/// TANDEM_FLIGHT_RECORDER_DIR), else the defaults. A directory left empty is the environment's.
[[nodiscard]] inline FlightRecorderSettings flight_recorder_settings(
    const EnvLookup& env = process_env) {
  auto& choice = detail::flight_choice();
  {
    std::lock_guard lock(choice.mutex);
    if (choice.chosen) {
      FlightRecorderSettings settings = *choice.chosen;
      if (settings.directory.empty()) {
        if (const auto dir = env(flight_recorder_dir_variable); dir) settings.directory = *dir;
      }
      return settings;
    }
  }
  return detail::flight_settings_from_env(env);
}

/// Chooses the settings for the communicators made from now on (the environment no longer
/// counts, except for an empty directory); those already recording keep theirs.
inline void set_flight_recorder(FlightRecorderSettings settings) {
  if (settings.notice_interval < Timeout::zero()) {
    throw Error("set_flight_recorder", "the notice interval must not be negative");
  }
  if (settings.size > static_cast<std::size_t>(detail::max_flight_recorder_size)) {
    throw Error("set_flight_recorder", "a ring of " + std::to_string(settings.size) +
                                           " operations is over the limit of " +
                                           std::to_string(detail::max_flight_recorder_size));
  }
  auto& choice = detail::flight_choice();
  std::lock_guard lock(choice.mutex);
  choice.chosen = std::move(settings);
}

/// Forgets set_flight_recorder's choice: the environment decides again.
inline void reset_flight_recorder() {
  auto& choice = detail::flight_choice();
  std::lock_guard lock(choice.mutex);
  choice.chosen.reset();
}

}  // namespace tandem
