// One rank of the multi-process ShmComm tests that shm_processes starts itself (RANK and
// WORLD_SIZE in the environment, the init URL on the command line). It decides its own success:
// exit code 0 when every check held, 1 otherwise (and why, on stderr).
//   shm_worker dead-peer URL   the last rank kills itself mid-way; the others must get an Error
//                              naming it within a second or two (the timeout is 60 s)
//   shm_worker stopped-peer URL  the last rank stops itself (SIGSTOP); the others must raise an
//                              Error naming it as stopped once their 1 s timeout has passed
//   shm_worker killed URL      every rank kills itself (SIGKILL) after a few collectives
//   shm_worker small URL       collectives larger than the slots on a group and on its halves,
//                              with the default options (where /dev/shm is small, ShmComm must
//                              size its segments to fit, or fail at the start saying why)
//   shm_worker dead-in-block URL  all_reduce after all_reduce of 4 MiB in a shared block; the
//                              last rank is killed (SIGKILL, by a thread of its own) at a moment
//                              of no particular step, mostly mid-collective; the others must get
//                              an Error naming it within a few seconds (the timeout is 60 s)
//   shm_worker stopped-in-block URL  the same, the last rank stopping itself (SIGSTOP); the others
//                              must raise an Error naming it as stopped once their 1 s timeout
//                              has passed
//   shm_worker alone FILE      rank 0 of a group whose rank 1 never comes (to be killed), meeting
//                              in the FileStore FILE (where the test reads the segment's name)
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "../../support/worker_main.hpp"  // the worker has no include path of its own
#include "tandem/comm/init.hpp"
#include "tandem/comm/shm/shm.hpp"

namespace {

using namespace std::chrono_literals;
using tandem::test::worker::exit_code;
using tandem::test::worker::expect;
using tandem::test::worker::mentions;

int run_dead_peer(const tandem::World& world, const std::string& url) {
  auto comm = tandem::init_process_group<tandem::ShmComm>(world, url, {.timeout = 60s});
  const int victim = comm.size() - 1;
  const auto seen = tandem::test::worker::survive_last_rank_death(comm, 1000000);
  expect(mentions(seen.error, "rank " + std::to_string(victim) + " died"),
         "the error names the dead rank: " + seen.error);
  // Noticed within a second (a sleeping rank looks every 100 ms); 5 s leaves room for a loaded
  // machine without hiding a wait for the 60 s timeout.
  expect(seen.waited < 5s, "the error came after " + std::to_string(seen.waited.count()) + " ms");
  tandem::test::worker::expect_unusable(comm);
  return exit_code();
}

int run_stopped_peer(const tandem::World& world, const std::string& url) {
  auto comm = tandem::init_process_group<tandem::ShmComm>(world, url, {.timeout = 1s});
  const int victim = comm.size() - 1;
  std::vector<float> data(1000, 1.0f);
  comm.all_reduce(data);
  comm.barrier();
  if (comm.rank() == victim) {
    ::raise(SIGSTOP);  // the parent kills it once the others have given up
    return 0;
  }
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  try {
    comm.all_reduce(data);
  } catch (const tandem::Error& e) {
    error = e.what();
  }
  const auto waited = std::chrono::steady_clock::now() - start;
  std::fprintf(stderr, "shm_worker rank %d: got: %s\n", comm.rank(), error.c_str());
  expect(mentions(error, "rank " + std::to_string(comm.rank()) + ":") &&
             mentions(error, "timed out after 1 s") &&
             mentions(error, "rank " + std::to_string(victim) + " is stopped"),
         "the error names this rank, the timeout and the stopped rank: " + error);
  expect(waited >= 900ms && waited < 10s, "the error came after the timeout, not long after");
  return exit_code();
}

/// All-reduces 4 MiB in a shared block until an Error; the last rank signals itself `signal`
/// from a thread after `after` (by then it is, most likely, between two barriers of one of them).
/// Returns the survivors' Error and how long after the signal's time it came.
struct InBlockFailure {
  std::string error;
  std::chrono::milliseconds waited{0};
};
InBlockFailure fail_in_block(tandem::ShmComm& comm, int signal, std::chrono::milliseconds after) {
  const int victim = comm.size() - 1;
  const std::size_t count = std::size_t{1} << 20;
  auto block = comm.allocate_shared(count * sizeof(float));
  expect(static_cast<bool>(block), "no shared block was made");
  std::span<float> data(reinterpret_cast<float*>(block.data), count);
  std::fill(data.begin(), data.end(), 1.0f);
  comm.all_reduce(data);
  expect(data[count - 1] == static_cast<float>(comm.size()), "the all_reduce before the fault");
  comm.barrier();
  const auto signal_at = std::chrono::steady_clock::now() + after;
  if (comm.rank() == victim) {
    std::thread([signal, signal_at] {
      std::this_thread::sleep_until(signal_at);  // a moment, not a synchronisation
      ::raise(signal);
    }).detach();
  }
  InBlockFailure seen;
  try {
    for (;;) comm.all_reduce(data);
  } catch (const tandem::Error& e) {
    seen.error = e.what();
  }
  seen.waited = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - signal_at);
  std::fprintf(stderr, "shm_worker rank %d: %lld ms after the signal got: %s\n", comm.rank(),
               static_cast<long long>(seen.waited.count()), seen.error.c_str());
  expect(mentions(seen.error, "rank " + std::to_string(comm.rank()) + ":") &&
             mentions(seen.error, "all_reduce"),
         "the error names this rank and the operation: " + seen.error);
  return seen;
}

int run_dead_in_block(const tandem::World& world, const std::string& url) {
  auto comm = tandem::init_process_group<tandem::ShmComm>(world, url, {.timeout = 60s});
  const int victim = comm.size() - 1;
  const auto seen = fail_in_block(comm, SIGKILL, 300ms);
  expect(mentions(seen.error, "rank " + std::to_string(victim) + " died"),
         "the error names the dead rank: " + seen.error);
  expect(seen.waited < 5s, "the error came " + std::to_string(seen.waited.count()) +
                               " ms after the death (the timeout is 60 s)");
  tandem::test::worker::expect_unusable(comm);
  return exit_code();
}

int run_stopped_in_block(const tandem::World& world, const std::string& url) {
  auto comm = tandem::init_process_group<tandem::ShmComm>(world, url, {.timeout = 1s});
  const int victim = comm.size() - 1;
  const auto seen = fail_in_block(comm, SIGSTOP, 300ms);
  expect(mentions(seen.error, "timed out after 1 s") &&
             mentions(seen.error, "rank " + std::to_string(victim) + " is stopped"),
         "the error names the timeout and the stopped rank: " + seen.error);
  expect(seen.waited < 10s, "the error came long after the timeout");
  return exit_code();
}

int run_killed(const tandem::World& world, const std::string& url) {
  auto comm = tandem::init_process_group<tandem::ShmComm>(world, url, {.timeout = 60s});
  auto half = comm.split(comm.rank() % 2, 0);               // a second segment
  auto block = comm.allocate_shared(std::size_t{1} << 20);  // and a shared block
  expect(static_cast<bool>(block), "no shared block was made");
  std::vector<double> data(1000, 1.0);
  comm.all_reduce(data);
  if (half) half->all_reduce(data);
  comm.barrier();
  ::raise(SIGKILL);
  return 1;  // not reached
}

int run_small(const tandem::World& world, const std::string& url) {
  auto comm = tandem::init_process_group<tandem::ShmComm>(world, url, {.timeout = 120s});
  const int n = comm.size();
  std::vector<float> data(std::size_t{1} << 20);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(i % 1000);
  comm.all_reduce(data);
  bool right = true;
  for (std::size_t i = 0; i < data.size(); ++i) {
    right = right && data[i] == static_cast<float>((i % 1000) * static_cast<std::size_t>(n));
  }
  expect(right, "all_reduce of 4 MiB summed wrong");
  auto half = comm.split(comm.rank() % 2, comm.rank());  // a second segment beside the first
  std::vector<std::int32_t> mine(70000, comm.rank()), all(70000 * std::size_t(half->size()));
  half->all_gather(std::span<const std::int32_t>(mine), std::span<std::int32_t>(all));
  for (int r = 0; r < half->size(); ++r) {
    expect(all[static_cast<std::size_t>(r) * 70000] == 2 * r + comm.rank() % 2 &&
               all[static_cast<std::size_t>(r) * 70000 + 69999] == 2 * r + comm.rank() % 2,
           "all_gather of the half put rank " + std::to_string(r) + "'s part wrong");
  }
  comm.barrier();
  return exit_code();
}

int run_alone(const tandem::World&, const std::string& file) {
  // Rank 0 of a group of 2 whose rank 1 never comes: rank 1's record is faked (its pid is the
  // parent's, alive), so rank 0 creates the segment and waits in the rendezvous for rank 1 to
  // map it - until the parent kills it. The parent holds the store open and reads the name there.
  tandem::AnyStore store(tandem::FileStore(file, {.timeout = 60s}));
  store.set("shm/1/member/1", "ok " + std::to_string(::getppid()) + " " +
                                  std::to_string(tandem::detail::shm::pid_space()) + " " +
                                  tandem::detail::shm::this_host());
  (void)tandem::ShmComm::rendezvous(tandem::World::single_node(0, 2), store, {.timeout = 60s});
  return 1;  // not reached: the parent kills it
}

}  // namespace

int main(int argc, char** argv) {
  return tandem::test::worker::run(argc, argv, "shm_worker",
                                   {{"dead-peer", run_dead_peer},
                                    {"stopped-peer", run_stopped_peer},
                                    {"dead-in-block", run_dead_in_block},
                                    {"stopped-in-block", run_stopped_in_block},
                                    {"killed", run_killed},
                                    {"small", run_small},
                                    {"alone", run_alone}});
}
