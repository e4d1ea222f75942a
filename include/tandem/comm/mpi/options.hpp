// tandem/comm/mpi/options.hpp - tandem::MpiCommOptions, what MpiComm::world, duplicate and
// init_process_group<MpiComm> take.
//   auto comm = tandem::MpiComm::world({.timeout = std::chrono::minutes(5)});
// Needs: the standard library.
#pragma once

#include "tandem/comm/checked.hpp"
#include "tandem/core/timeout.hpp"

namespace tandem {

/// What MpiComm::world, duplicate and init_process_group<MpiComm> take.
struct MpiCommOptions {
  /// How long an `_async` operation may stay pending (queued or inside MPI) before its Work
  /// fails and the communicator becomes unusable; also how long a sync collective waits for the
  /// pending `_async` ones and the destructor for all pending ones. A sync operation's own
  /// blocking MPI call that lasts longer ends the job (the watchdog: docs/backends.md,
  /// "MpiComm in detail").
  Timeout timeout = default_timeout;
  /// Exchange and compare every collective's fingerprint first (tandem/comm/checked.hpp).
  /// Unset: TANDEM_CHECK_COLLECTIVES, else on. `= false` or `= true` wins over the variable.
  CollectiveCheck check_collectives{};
};

}  // namespace tandem
