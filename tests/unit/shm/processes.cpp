// ShmComm across processes this test starts itself (shm_worker, one per rank, meeting on
// 127.0.0.1 or in a FileStore this test reads): a rank that dies mid-way (the others raise an
// Error naming it, within seconds, long before the timeout), a rank stopped by SIGSTOP (named at
// the timeout), both also mid-way through each collective that runs from a shared block, jobs
// killed with SIGKILL (nothing of theirs is left in /dev/shm), and a segment that another job's
// live rank holds, in another PID namespace where this test may make one (never swept). The
// workers decide their own success; this test checks how each one ended.
#include <doctest/doctest.h>

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "support/temp_dir.hpp"
#include "support/worker_processes.hpp"
#include "tandem/launch/detail/process.hpp"
#include "tandem/rendezvous/file_store.hpp"
#include "tandem/rendezvous/store.hpp"

#ifndef TANDEM_SHM_WORKER
#error "TANDEM_SHM_WORKER must name the shm_worker executable"
#endif

namespace {

using namespace std::chrono_literals;
namespace launch = tandem::launch::detail;

/// Ranks 0 .. n-1 of a job of `world_size`, each running shm_worker `mode url`.
std::vector<launch::Child> start_workers(int n, int world_size, const std::string& mode,
                                         const std::string& url) {
  return tandem::test::start_workers(TANDEM_SHM_WORKER, n, world_size, mode, url);
}

using tandem::test::tcp_url;
using tandem::test::wait_all;

/// Whether the segment a store's `key` names ("NAME SLOT RING", as rank 0 announces it) is still
/// in /dev/shm.
bool segment_listed(tandem::AnyStore& store, const std::string& key) {
  const std::string record = store.get(key, 60s);
  const std::string name = record.substr(0, record.find(' '));  // "/tandem-shm-..."
  REQUIRE_MESSAGE(name.rfind("/tandem-shm-", 0) == 0, "not a segment's name: " << record);
  return ::access(("/dev/shm" + name).c_str(), F_OK) == 0;
}

/// The collectives that shm_worker runs in a shared block ("dead-in-block:all_reduce", ...).
constexpr const char* block_operations[] = {"all_reduce", "reduce_scatter", "all_gather"};

/// Neither the segment nor the first shared block of the job that met in `store` (a FileStore
/// this test holds open) is left in /dev/shm.
void check_nothing_left(tandem::AnyStore& store) {
  CHECK_FALSE(segment_listed(store, "tandem/backend/shm/1/segment"));
  CHECK_FALSE(segment_listed(store, "tandem/backend/shm/1/block/1"));
}

/// A rank 0 whose group never completes (shm_worker alone), meeting in the FileStore `file`,
/// which the caller holds open; returns once its segment exists.
launch::Child start_lonely(const std::string& file, tandem::AnyStore& store,
                           const std::vector<std::string>& prefix = {}) {
  std::vector<std::string> command = prefix;
  command.insert(command.end(), {TANDEM_SHM_WORKER, "alone", file});
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) env.emplace_back(*e);
  env.push_back("RANK=0");
  env.push_back("WORLD_SIZE=2");
  auto child = launch::exec_child(command, env, {});
  REQUIRE_MESSAGE(segment_listed(store, "shm/1/segment"), "the lonely rank made no segment");
  return child;
}

}  // namespace

TEST_CASE("ShmComm: a rank that dies mid-way gives every other rank an Error naming it") {
  for (int n : {2, 3}) {
    CAPTURE(n);
    auto children = start_workers(n, n, "dead-peer", tcp_url());
    tandem::test::check_only_last_rank_killed(wait_all(children));
  }
}

TEST_CASE("ShmComm: a rank of another PID namespace that dies is named by the others, promptly") {
  // Ranks of one job in two PID namespaces that share /dev/shm (containers of one pod, say): the
  // last rank's pid means another process here, or none, so only the lock it holds on the
  // segment says whether it lives. It kills itself mid-way; the others must name it within
  // seconds (shm_worker dead-peer), not at the 60 s timeout. (Where this test may not make a
  // PID namespace, the last rank shares ours, and the case is the one above.)
  std::vector<std::string> in_namespace;
  if (::system("unshare --pid --fork --kill-child true > /dev/null 2>&1") == 0) {
    // sh is the namespace's first process (which may not SIGKILL itself); the worker its child.
    in_namespace = {"unshare", "--pid", "--fork", "--kill-child",
                    "--",      "sh",    "-c",     "\"$0\" \"$@\"; exit $?"};
  } else {
    MESSAGE("no PID namespace here (unshare --pid --fork failed): the last rank shares ours");
  }
  const int n = 3;
  const std::string url = tcp_url();
  std::vector<launch::Child> children;
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> command = r == n - 1 ? in_namespace : std::vector<std::string>{};
    command.insert(command.end(), {TANDEM_SHM_WORKER, "dead-peer", url});
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      const std::string entry(*e);
      if (entry.rfind("RANK=", 0) != 0 && entry.rfind("WORLD_SIZE=", 0) != 0) env.push_back(entry);
    }
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(n));
    children.push_back(launch::exec_child(command, env, {}));
  }
  const auto statuses = wait_all(children);
  for (int r = 0; r < n - 1; ++r) {  // the survivors' checks passed (the victim ends by SIGKILL)
    CAPTURE(r);
    CHECK_MESSAGE(!statuses[static_cast<std::size_t>(r)].failed(),
                  statuses[static_cast<std::size_t>(r)].describe());
  }
}

TEST_CASE("ShmComm: a stopped rank makes the others fail at the timeout, naming it as stopped") {
  const int n = 3;
  auto children = start_workers(n, n, "stopped-peer", tcp_url());
  // The survivors end on their own (1 s timeout); the stopped rank never does: kill it then.
  const auto end = std::chrono::steady_clock::now() + 60s;
  auto survivors_done = [&] {
    bool done = true;
    for (int r = 0; r < n - 1; ++r) done = children[static_cast<std::size_t>(r)].poll() && done;
    return done;
  };
  while (!survivors_done() && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(10ms);
  }
  children.back().signal(SIGKILL);
  const auto statuses = wait_all(children);
  for (int r = 0; r < n - 1; ++r) {
    CAPTURE(r);
    CHECK_MESSAGE(!statuses[static_cast<std::size_t>(r)].failed(),
                  statuses[static_cast<std::size_t>(r)].describe());
  }
}

TEST_CASE("ShmComm: a rank killed mid-way through collectives in a shared block is named") {
  tandem::test::TempDir dir;
  for (const char* operation : block_operations) {
    for (int n : {2, 3}) {
      CAPTURE(operation);
      CAPTURE(n);
      const std::string file = dir.str() + "/" + operation + std::to_string(n);
      tandem::AnyStore store(tandem::FileStore(file, {.timeout = 60s}));
      auto children =
          start_workers(n, n, std::string("dead-in-block:") + operation, "file://" + file);
      tandem::test::check_only_last_rank_killed(wait_all(children));
      check_nothing_left(store);
    }
  }
}

TEST_CASE("ShmComm: a rank stopped mid-way through collectives in a shared block is named") {
  tandem::test::TempDir dir;
  const int n = 2;
  for (const char* operation : block_operations) {
    CAPTURE(operation);
    const std::string file = dir.str() + "/" + operation;
    tandem::AnyStore store(tandem::FileStore(file, {.timeout = 60s}));
    auto children =
        start_workers(n, n, std::string("stopped-in-block:") + operation, "file://" + file);
    const auto end = std::chrono::steady_clock::now() + 60s;
    while (!children.front().poll() && std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(10ms);
    }
    children.back().signal(SIGKILL);
    const auto statuses = wait_all(children);
    CHECK_MESSAGE(!statuses.front().failed(), statuses.front().describe());
    check_nothing_left(store);
  }
}

TEST_CASE("ShmComm: a job killed with SIGKILL leaves nothing in /dev/shm") {
  // A creator killed before its group had mapped the segment leaves its name behind ...
  tandem::test::TempDir dir;
  const std::string lonely_file = dir.str() + "/lonely";
  tandem::AnyStore lonely_store(tandem::FileStore(lonely_file, {.timeout = 60s}));
  std::vector<launch::Child> lonely;
  lonely.push_back(start_lonely(lonely_file, lonely_store));
  lonely.front().signal(SIGKILL);
  (void)wait_all(lonely);
  CHECK(segment_listed(lonely_store, "shm/1/segment"));

  // ... which the next job's segments sweep away; that job, killed after its collectives, leaves
  // nothing either (each segment's name is gone once its ranks have mapped it). Its store is a
  // file this test holds open, to read the names of its segments from.
  const std::string job_file = dir.str() + "/job";
  tandem::AnyStore job_store(tandem::FileStore(job_file, {.timeout = 60s}));
  auto children = start_workers(3, 3, "killed", "file://" + job_file);
  const auto statuses = wait_all(children);
  for (std::size_t r = 0; r < children.size(); ++r) {
    CAPTURE(r);
    CHECK_MESSAGE(statuses[r].signal == SIGKILL, statuses[r].describe());
  }
  for (const char* group : {"", "/split1/color0", "/split1/color1"}) {
    CAPTURE(group);
    CHECK_FALSE(
        segment_listed(job_store, "tandem/backend/shm/1" + std::string(group) + "/segment"));
  }
  CHECK_FALSE(segment_listed(job_store, "tandem/backend/shm/1/block/1"));  // a shared block
  CHECK_FALSE(segment_listed(lonely_store, "shm/1/segment"));
}

TEST_CASE("ShmComm: a segment another job still holds is never swept, whatever its PID namespace") {
  // A lonely rank 0 stays alive, holding its segment, while another job makes (and sweeps
  // before) its own: the segment stays. Then it is killed, and the next job sweeps it. Where
  // this test may make PID namespaces, the lonely rank runs in one of its own, where its pid
  // means another process (or none) here: only its lock on the segment says it lives.
  tandem::test::TempDir dir;
  std::vector<std::string> in_namespace;
  if (::system("unshare --pid --fork --kill-child true > /dev/null 2>&1") == 0) {
    in_namespace = {"unshare", "--pid", "--fork", "--kill-child", "--"};
  } else {
    MESSAGE("no PID namespace here (unshare --pid --fork failed): the lonely rank shares ours");
  }
  const std::string lonely_file = dir.str() + "/lonely";
  tandem::AnyStore lonely_store(tandem::FileStore(lonely_file, {.timeout = 60s}));
  std::vector<launch::Child> lonely;
  lonely.push_back(start_lonely(lonely_file, lonely_store, in_namespace));

  auto first = start_workers(2, 2, "killed", tcp_url());
  (void)wait_all(first);
  CHECK_MESSAGE(segment_listed(lonely_store, "shm/1/segment"),
                "another job's sweep removed a segment that a live rank holds");

  lonely.front().signal(SIGKILL);  // unshare --kill-child: the worker ends with it
  (void)wait_all(lonely);
  auto second = start_workers(2, 2, "killed", tcp_url());
  (void)wait_all(second);
  CHECK_FALSE(segment_listed(lonely_store, "shm/1/segment"));
}
