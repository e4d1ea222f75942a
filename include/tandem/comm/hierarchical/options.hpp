// tandem/comm/hierarchical/options.hpp - tandem::HierarchicalCommOptions, what
// init_process_group<HierarchicalComm<Intra, Inter>> and its rendezvous take: one timeout for both
// levels and each level's own options.
//   HierarchicalCommOptions<ShmCommOptions, GlooCommOptions> options{.inter = {.interface = "lo"}};
// Needs: the standard library.
#pragma once

#include "tandem/core/timeout.hpp"

namespace tandem {

/// How a HierarchicalComm behaves: `timeout` bounds every wait on both levels (it replaces the
/// timeouts in `intra` and `inter`); the rest of each level's options pass through.
template <class IntraOptions, class InterOptions>
struct HierarchicalCommOptions {
  /// How long any wait (rendezvous, collective, send, recv) lasts before it raises tandem::Error.
  Timeout timeout = default_timeout;
  /// The options of each node's group (ShmComm: ShmCommOptions).
  IntraOptions intra{};
  /// The options of the groups between nodes (GlooComm: GlooCommOptions).
  InterOptions inter{};
};

}  // namespace tandem
