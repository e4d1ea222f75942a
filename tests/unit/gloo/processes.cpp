// GlooComm across processes this test starts itself (gloo_worker, one per rank, on 127.0.0.1):
// init_process_group over tcp:// and file://, and a rank that dies mid-way. The workers decide
// their own success (exit code); this test checks how each one ended, within a generous deadline.
#include <doctest/doctest.h>

#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "support/temp_dir.hpp"
#include "support/worker_processes.hpp"
#include "tandem/launch/detail/process.hpp"

#ifndef TANDEM_GLOO_WORKER
#error "TANDEM_GLOO_WORKER must name the gloo_worker executable"
#endif

namespace {

using namespace std::chrono_literals;
namespace launch = tandem::launch::detail;

/// Starts `n` workers running `mode url`, waits for all (at most `deadline`), returns how each
/// ended; any still running at the deadline is killed and reported as such.
std::vector<launch::ExitStatus> run_workers(int n, const std::string& mode, const std::string& url,
                                            std::chrono::seconds deadline = 90s) {
  auto children = tandem::test::start_workers(TANDEM_GLOO_WORKER, n, n, mode, url);
  return tandem::test::wait_all(children, deadline);
}

using tandem::test::tcp_url;

}  // namespace

TEST_CASE("GlooComm: init_process_group over tcp:// connects, reduces and splits") {
  for (int n : {2, 3}) {
    CAPTURE(n);
    for (const auto& status : run_workers(n, "init", tcp_url())) {
      CHECK_MESSAGE(!status.failed(), status.describe());
    }
  }
}

TEST_CASE("GlooComm: init_process_group over file:// connects, reduces and splits") {
  tandem::test::TempDir dir;
  const std::string url = "file://" + (dir.path() / "store").string();
  for (const auto& status : run_workers(3, "init", url)) {
    CHECK_MESSAGE(!status.failed(), status.describe());
  }
}

TEST_CASE("GlooComm: a rank that dies mid-way gives every other rank an Error, not a hang") {
  for (int n : {2, 4}) {
    CAPTURE(n);
    tandem::test::check_only_last_rank_killed(run_workers(n, "dead-peer", tcp_url()));
  }
}
