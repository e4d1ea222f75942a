// tandem/comm/gloo/options.hpp - tandem::GlooCommOptions, what GlooComm::rendezvous and
// init_process_group<GlooComm> take: the timeout, the interface to listen on, the collective check.
//   auto comm = tandem::init_process_group<tandem::GlooComm>(world, "env://", {.interface = "lo"});
// Needs: the standard library.
#pragma once

#include <string>

#include "tandem/comm/checked.hpp"
#include "tandem/core/timeout.hpp"

namespace tandem {

/// How a GlooComm connects and behaves.
struct GlooCommOptions {
  /// How long any wait (rendezvous, collective, send, recv) lasts before it raises tandem::Error.
  Timeout timeout = default_timeout;
  /// The network interface to listen on ("eth0", "lo"). Empty: `hostname`, else the
  /// GLOO_SOCKET_IFNAME variable (as in torch), else 127.0.0.1 for a single-node world and the
  /// address this host's name resolves to otherwise.
  std::string interface {};
  /// The host name or address to listen on, used when `interface` is empty.
  std::string hostname{};
  /// Exchange and compare every collective's fingerprint first (docs/backends.md,
  /// "Mismatched collectives").
  /// Unset: TANDEM_CHECK_COLLECTIVES, else on. `= false` or `= true` wins over the variable.
  CollectiveCheck check_collectives{};
};

}  // namespace tandem
