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
//   shm_worker dead-in-block:OP URL  OP (all_reduce, reduce_scatter or all_gather) on 4 MiB in a
//                              shared block, call after call, once shown to take the block's
//                              path; the last rank is killed (SIGKILL, by a thread of its own)
//                              at a moment of no particular step, mostly mid-collective; the
//                              others must get an Error naming it within a few seconds (the
//                              timeout is 60 s)
//   shm_worker stopped-in-block:OP URL  the same, the last rank stopping itself (SIGSTOP); the
//                              others must raise an Error naming it as stopped once their 2 s
//                              timeout has passed
//   shm_worker alone FILE      rank 0 of a group whose rank 1 never comes (to be killed), meeting
//                              in the FileStore FILE (where the test reads the segment's name)
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../../support/worker_main.hpp"  // the worker has no include path of its own
#include "tandem/comm/detail/collective_op.hpp"
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

// The collectives ShmComm runs straight from a shared block: all_reduce, reduce_scatter and
// all_gather (shm_worker's modes name them after the colon, as their errors do).
using tandem::detail::CollectiveOp;
using tandem::detail::name;

/// `op` on 4 MiB in a shared block: in place (all_reduce, reduce_scatter) or, for the all_gather,
/// into an output outside the block (as ZeRO's): sizes far above in_block_most_slot_bytes, so
/// that ShmComm runs it from the block - expect_block_path shows it does.
class BlockCollective {
 public:
  BlockCollective(tandem::ShmComm& comm, CollectiveOp op)
      : comm_(comm),
        op_(op),
        n_(static_cast<std::size_t>(comm.size())),
        me_(static_cast<std::size_t>(comm.rank())),
        block_(comm.allocate_shared(count * sizeof(float))),
        gathered_(n_ * slice()) {
    expect(static_cast<bool>(block_), "no shared block was made");
  }

  /// Whether the group lent a block (not where /dev/shm has no room for one).
  [[nodiscard]] bool made() const { return static_cast<bool>(block_); }

  /// Every rank's input (all of the block's elements that it uses) set to rank + 1.
  void fill() {
    const auto value = static_cast<float>(me_ + 1);
    std::fill_n(data(), op_ == CollectiveOp::all_gather ? slice() : n_ * slice(), value);
  }

  /// One call, on `data` (the block, or a copy of its input outside it).
  void run(float* data) {
    switch (op_) {
      case CollectiveOp::all_reduce:
        return comm_.all_reduce(std::span<float>(data, n_ * slice()));
      case CollectiveOp::reduce_scatter:
        return comm_.reduce_scatter(std::span<float>(data, n_ * slice()),
                                    std::span<float>(data + me_ * slice(), slice()));
      case CollectiveOp::all_gather:
        return comm_.all_gather(std::span<const float>(data, slice()), std::span<float>(gathered_));
      default:
        throw std::logic_error(std::string(name(op_)) + " does not run from a shared block");
    }
  }
  void run() { run(data()); }

  /// After one call on inputs fill() made: whether its results are right.
  [[nodiscard]] bool right() const {
    const float sum = static_cast<float>(n_ * (n_ + 1) / 2);
    switch (op_) {
      case CollectiveOp::all_reduce:
        return data()[0] == sum && data()[n_ * slice() - 1] == sum;
      case CollectiveOp::reduce_scatter:
        return data()[me_ * slice()] == sum && data()[(me_ + 1) * slice() - 1] == sum;
      case CollectiveOp::all_gather:
        for (std::size_t r = 0; r < n_; ++r) {
          const auto value = static_cast<float>(r + 1);
          if (gathered_[r * slice()] != value || gathered_[(r + 1) * slice() - 1] != value) {
            return false;
          }
        }
        return true;
      default:
        return false;
    }
  }

  /// Shows that this size takes the block's path: the last rank passes a copy of its input
  /// outside the block, the others theirs in it, so that the ranks disagree on where the tensor
  /// lies - an Error that names each rank's place, which is "shared block ..." only where the
  /// call went to the block (the slots' path records every tensor as outside the blocks); a
  /// disagreement leaves the group usable.
  void expect_block_path() {
    const bool last = me_ + 1 == n_;
    std::vector<float> outside(data(), data() + n_ * slice());
    std::string error;
    try {
      run(last ? outside.data() : data());
    } catch (const tandem::Error& e) {
      error = e.what();
    }
    const std::string in_block = "shared block " + std::to_string(block_id) + " at byte 0";
    expect(mentions(error, "ranks disagree on where the tensor lies") &&
               mentions(error, in_block) && mentions(error, name(op_)),
           std::string("the probe's error shows no ") + name(op_) + " in the block: " + error);
  }

  static constexpr std::size_t count = std::size_t{1} << 20;  // floats in the block's part
  static constexpr std::uint64_t block_id = 1;                // the job's first block

 private:
  [[nodiscard]] std::size_t slice() const { return count / n_; }
  [[nodiscard]] float* data() const { return reinterpret_cast<float*>(block_.data); }

  tandem::ShmComm& comm_;
  CollectiveOp op_;
  std::size_t n_;
  std::size_t me_;
  tandem::SharedBlock block_;
  std::vector<float> gathered_;
};

/// Runs `op` in a shared block until an Error; the last rank signals itself `signal` from a
/// thread after `after` (by then it is, most likely, between two barriers of one of them).
/// Returns the survivors' Error and how long after the signal's time it came.
struct InBlockFailure {
  std::string error;
  std::chrono::milliseconds waited{0};
};
InBlockFailure fail_in_block(tandem::ShmComm& comm, CollectiveOp op, int signal,
                             std::chrono::milliseconds after) {
  const int victim = comm.size() - 1;
  BlockCollective collective(comm, op);
  if (!collective.made()) return {};  // the caller's checks fail on the empty error
  collective.expect_block_path();
  collective.fill();
  collective.run();
  expect(collective.right(), std::string("the ") + name(op) + " before the fault");
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
    for (;;) collective.run();
  } catch (const tandem::Error& e) {
    seen.error = e.what();
  }
  seen.waited = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - signal_at);
  std::fprintf(stderr, "shm_worker rank %d: %s: %lld ms after the signal got: %s\n", comm.rank(),
               name(op), static_cast<long long>(seen.waited.count()), seen.error.c_str());
  expect(mentions(seen.error, "rank " + std::to_string(comm.rank()) + ":") &&
             mentions(seen.error, name(op)),
         "the error names this rank and the operation: " + seen.error);
  return seen;
}

template <CollectiveOp op>
int run_dead_in_block(const tandem::World& world, const std::string& url) {
  auto comm = tandem::init_process_group<tandem::ShmComm>(world, url, {.timeout = 60s});
  const int victim = comm.size() - 1;
  const auto seen = fail_in_block(comm, op, SIGKILL, 300ms);
  expect(mentions(seen.error, "rank " + std::to_string(victim) + " died"),
         "the error names the dead rank: " + seen.error);
  expect(seen.waited < 5s, "the error came " + std::to_string(seen.waited.count()) +
                               " ms after the death (the timeout is 60 s)");
  tandem::test::worker::expect_unusable(comm);
  return exit_code();
}

template <CollectiveOp op>
int run_stopped_in_block(const tandem::World& world, const std::string& url) {
  // 2 s, not the stopped-peer case's 1 s: this job also makes a block and probes its path
  // before the fault, under the same timeout, on a machine CI loads with other tests.
  auto comm = tandem::init_process_group<tandem::ShmComm>(world, url, {.timeout = 2s});
  const int victim = comm.size() - 1;
  const auto seen = fail_in_block(comm, op, SIGSTOP, 300ms);
  expect(mentions(seen.error, "timed out after 2 s") &&
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
  return tandem::test::worker::run(
      argc, argv, "shm_worker",
      {{"dead-peer", run_dead_peer},
       {"stopped-peer", run_stopped_peer},
       {"dead-in-block:all_reduce", run_dead_in_block<CollectiveOp::all_reduce>},
       {"dead-in-block:reduce_scatter", run_dead_in_block<CollectiveOp::reduce_scatter>},
       {"dead-in-block:all_gather", run_dead_in_block<CollectiveOp::all_gather>},
       {"stopped-in-block:all_reduce", run_stopped_in_block<CollectiveOp::all_reduce>},
       {"stopped-in-block:reduce_scatter", run_stopped_in_block<CollectiveOp::reduce_scatter>},
       {"stopped-in-block:all_gather", run_stopped_in_block<CollectiveOp::all_gather>},
       {"killed", run_killed},
       {"small", run_small},
       {"alone", run_alone}});
}
