// The job of 2 nodes x 2 processes that the launcher tests describe, as LaunchOptions, both where
// they check the environment it resolves to and where they compare it with a real launch.
#pragma once

#include <string>
#include <utility>

#include "tandem/launch/launcher.hpp"

namespace tandem::test {

/// 2 nodes x 2 processes of role "trainer", meeting at addr:port under run_id; the node rank
/// and the command are the caller's.
inline launch::LaunchOptions two_node_job(std::string addr, std::string port,
                                          std::string max_restarts, std::string run_id) {
  launch::LaunchOptions options;
  options.nnodes = "2";
  options.nproc_per_node = "2";
  options.master_addr = std::move(addr);
  options.master_port = std::move(port);
  options.max_restarts = std::move(max_restarts);
  options.role = "trainer";
  options.run_id = std::move(run_id);
  return options;
}

}  // namespace tandem::test
