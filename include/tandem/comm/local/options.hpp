// tandem/comm/local/options.hpp - tandem::LocalCommOptions, how a group of LocalComm ranks behaves.
//   tandem::run_local(4, fn, tandem::LocalCommOptions{.timeout = std::chrono::seconds(60)});
// Needs: the standard library.
#pragma once

#include "tandem/core/timeout.hpp"

namespace tandem {

/// How a group of LocalComm ranks behaves.
struct LocalCommOptions {
  /// How long a blocking operation waits for the other ranks before it raises tandem::Error.
  Timeout timeout = default_timeout;
};

}  // namespace tandem
