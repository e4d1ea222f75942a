// HierarchicalComm<ShmComm, GlooComm> across nodes, one process per rank started by tandemrun
// (env://). By default the job is cut into fake nodes of 2 ranks on this one host (rank r on node
// r / 2), so 4 processes are 2 nodes of 2 and 3 are a node of 2 and a node of 1: ShmComm within
// each, Gloo between the leaders. With --real-nodes the nodes are the launcher's (GROUP_RANK:
// multinode_test.sh runs it in two network namespaces). Cases: the collective conformance suite,
// the reduction order (node sums, then across nodes: the same bits on every rank), DDP's theorem,
// and a rank that leaves at either level (the others raise an Error at once instead of hanging).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "support/collective_suite.hpp"
#include "support/runners.hpp"
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/hierarchical/hierarchical.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/comm/shm/shm.hpp"
#include "tandem/rendezvous/file_store.hpp"
#include "unit/ddp/ddp_suite.hpp"

namespace {

using namespace std::chrono_literals;
using Comm = tandem::HierarchicalComm<tandem::ShmComm, tandem::GlooComm>;

static_assert(tandem::Communicator<Comm>);
static_assert(tandem::ProcessGroupBackend<Comm>);

std::optional<Comm> world_comm;  // made in main, before the tests run
tandem::World job_world;         // the World it was made with

Comm& comm() {
  REQUIRE(world_comm.has_value());
  return *world_comm;
}

/// Fake nodes of two ranks: rank r on node r / 2.
tandem::World fake_nodes(const tandem::World& job) {
  const int n = job.world_size;
  const int node = job.rank / 2;
  return tandem::World{job.rank, n, job.rank % 2, std::min(2, n - 2 * node), node, (n + 1) / 2};
}

/// Gloo over TCP costs milliseconds a call: each case in one mode, rotating.
const tandem::test::Matrix matrix{{0, 1, 13, 1031}, true};
const tandem::test::Matrix subgroup_matrix{{0, 1, 13}, true};

}  // namespace

TEST_CASE("HierarchicalComm: the nodes are the World's") {
  CHECK(comm().nodes() == job_world.nnodes);
  CHECK(comm().node() == job_world.node_rank);
  std::printf("rank %d of %d on node %d of %d: hierarchical communicator made\n", comm().rank(),
              comm().size(), comm().node(), comm().nodes());
}

TEST_CASE("HierarchicalComm: the conformance suite") {
  tandem::test::ProcessRunner<Comm> run{&comm()};
  tandem::test::check_conformance<Comm>(run, comm().size(), matrix, subgroup_matrix);
}

TEST_CASE("HierarchicalComm: lends its node's shared memory; on one node an all_reduce there") {
  static_assert(tandem::SharedMemoryComm<Comm>);
  // The job's group (fake nodes): a block per node, and a tensor in it all-reduces right.
  const std::size_t count = 100003;
  auto block = comm().allocate_shared(count * sizeof(float));
  REQUIRE(block);
  std::span<float> data(reinterpret_cast<float*>(block.data), count);
  std::fill(data.begin(), data.end(), static_cast<float>(comm().rank() + 1));
  comm().all_reduce(data);
  const auto n = static_cast<float>(comm().size());
  CHECK(data[0] == n * (n + 1) / 2);
  CHECK(data[count - 1] == n * (n + 1) / 2);
  // One node (every rank of the job): the node's ShmComm reduces it from the block, with the
  // bits of a tensor outside it.
  // (A store of its own: a FileStore named after this job's port, which tandemrun chose free.)
  const char* port = std::getenv("MASTER_PORT");
  const std::string file = "/tmp/tandem-hierarchical-one-node-" + std::string(port ? port : "0");
  tandem::AnyStore store(tandem::FileStore(file, {.timeout = 60s}));
  auto one = Comm::rendezvous(tandem::World::single_node(comm().rank(), comm().size()), store,
                              {.timeout = 60s});
  REQUIRE(one.nodes() == 1);
  auto on_node = one.allocate_shared(count * sizeof(float));
  REQUIRE(on_node);
  const auto mine = tandem::test::irregular_floats(comm().rank(), count);
  auto* in_block = reinterpret_cast<float*>(on_node.data);
  std::copy(mine.begin(), mine.end(), in_block);
  auto elsewhere = mine;
  one.all_reduce(std::span<float>(in_block, count));
  one.all_reduce(elsewhere);
  CHECK(std::memcmp(in_block, elsewhere.data(), count * sizeof(float)) == 0);
  one.barrier();  // every rank is done with the store's file
  if (comm().rank() == 0) std::remove(file.c_str());
}

TEST_CASE("HierarchicalComm: float reductions are node sums, then across nodes, same bits") {
  // The order the header states: each node's ranks in local order, then the nodes' partials
  // (with two nodes gloo's ring adds the two, which commutes exactly). Checked bit for bit.
  const int n = comm().size();
  REQUIRE(comm().nodes() <= 2);
  for (std::size_t count : {std::size_t{1031}, std::size_t{70000}}) {
    for (auto op : {tandem::ReduceOp::sum, tandem::ReduceOp::avg}) {
      auto mine = tandem::test::irregular_floats(comm().rank(), count);
      comm().all_reduce(mine, op);
      std::vector<float> want(count, 0.0f);
      std::vector<float> node_sum(count);
      for (int node = 0, first = 0; first < n; ++node) {
        int r = first;
        node_sum = tandem::test::irregular_floats(r, count);
        for (++r; r < n && (job_world.nnodes == 1 ? true : r / 2 == node); ++r) {
          const auto more = tandem::test::irregular_floats(r, count);
          for (std::size_t i = 0; i < count; ++i) node_sum[i] += more[i];
        }
        for (std::size_t i = 0; i < count; ++i)
          want[i] = node ? want[i] + node_sum[i] : node_sum[i];
        first = r;
      }
      if (op == tandem::ReduceOp::avg) {
        for (auto& x : want) x /= static_cast<float>(n);
      }
      CHECK_MESSAGE(std::memcmp(mine.data(), want.data(), count * sizeof(float)) == 0,
                    "count " << count << " op " << tandem::name(op));
      // And within float rounding of LocalComm's rank order.
      std::vector<float> local;
      tandem::run_local(n, [&](tandem::LocalComm& c) {
        auto data = tandem::test::irregular_floats(c.rank(), count);
        c.all_reduce(data, op);
        if (c.rank() == 0) local = data;
      });
      for (std::size_t i = 0; i < count; ++i) {
        if (std::abs(local[i] - mine[i]) > 1e-4f * std::max(1.0f, std::abs(local[i]))) {
          FAIL_CHECK("element " << i << ": " << mine[i] << " against LocalComm's " << local[i]);
          break;
        }
      }
    }
  }
}

TEST_CASE("HierarchicalComm: DDP's N ranks x batch b equal 1 rank x batch N*b") {
  tandem::test::ProcessRunner<Comm> run{&comm()};
  CHECK(tandem::test::ddp::check_theorem<Comm>(run, comm().size()) == 0);
}

TEST_CASE("HierarchicalComm: Join on uneven data, SyncBatchNorm between buckets, its misuse") {
  namespace suite = tandem::test::ddp;
  tandem::test::ProcessRunner<Comm> run{&comm()};
  const int n = comm().size();
  CHECK(suite::check_join<Comm>(run, n) == 0);
  CHECK(suite::check_join<Comm, tandem::shard<2>, tandem::bucket_cap<256>>(run, n, {.micro = 2}) ==
        0);
  CHECK(suite::check_join_batch_norm<Comm>(run, n) == 0);
  CHECK(suite::check_join_errors<Comm>(run, n) == 0);
}

TEST_CASE("HierarchicalComm: a level's rank numbers are this group's in its messages") {
  using tandem::detail::hierarchical::renumbered;
  const std::vector<int> node{2, 3};
  CHECK(renumbered("rank 1 died (its process is gone)", node) ==
        "rank 3 died (its process is gone)");
  CHECK(renumbered("timed out after 3 s waiting for rank 1 (arrived: rank 0); rank 1 is stopped",
                   node) ==
        "timed out after 3 s waiting for rank 3 (arrived: rank 2); rank 3 is stopped");
  CHECK(renumbered("ranks 0, 1 and 2 (ranks 2, and 0)", {4, 5, 6}) ==
        "ranks 4, 5 and 6 (ranks 6, and 4)");
  // Not a member, not after the word rank, or no number: left as it is.
  CHECK(renumbered("rank 7; frank 1; 2 ranks; the other ranks (gloo: rank)", node) ==
        "rank 7; frank 1; 2 ranks; the other ranks (gloo: rank)");
}

TEST_CASE("HierarchicalComm: a rank that leaves fails the others at either level, promptly") {
  // The victim destroys its communicator instead of joining an all_reduce: first the last rank
  // (a non-leader where its node has two: the others notice it in shared memory), then the first
  // rank of the last node (a leader: its node notices it in shared memory, the other leaders
  // over Gloo).
  const int n = comm().size();
  const int me = comm().rank();
  for (const int victim : {n - 1, (n - 1) / 2 * 2}) {
    auto group = comm().split(0, me);
    REQUIRE(group.has_value());
    // Every rank has finished making the group (both levels connected) before the victim leaves:
    // a rank that leaves mid-rendezvous fails the split instead, which is not this case.
    comm().barrier();
    if (me == victim) {
      group.reset();
    } else {
      const auto start = std::chrono::steady_clock::now();
      std::vector<float> data(4096, 1.0f);
      try {
        group->all_reduce(data);
        FAIL_CHECK("rank " << me << " completed an all_reduce that rank " << victim << " left");
      } catch (const tandem::Error& e) {
        // "in node 1's group (ranks 2, 3): rank 3 left the group ...", "in the leaders' group
        // between nodes (ranks 0, 2): gloo: ...": the victim's node names it by its job rank.
        CHECK_MESSAGE(tandem::test::mentions(e.what(), "rank " + std::to_string(me) + ":",
                                             "all_reduce", "group", "(rank"),
                      std::string(e.what()));
        if (me / 2 == victim / 2) {
          CHECK_MESSAGE(tandem::test::mentions(e.what(), "rank " + std::to_string(victim) + " "),
                        std::string(e.what()));
        }
        // No rank that stayed is said to have left or died: a rank whose leader (or another
        // node's) gave up because of the victim names the first failure, not that leader.
        for (int other = 0; other < n; ++other) {
          if (other == victim) continue;
          for (const char* blame : {" left", " died", " has died"}) {
            CHECK_MESSAGE(
                !tandem::test::mentions(e.what(), "rank " + std::to_string(other) + blame),
                std::string(e.what()));
          }
        }
      }
      CHECK(std::chrono::steady_clock::now() - start < 10s);
      try {
        group->barrier();
        FAIL_CHECK("a failed communicator ran a barrier");
      } catch (const tandem::Error& e) {
        CHECK_MESSAGE(tandem::test::mentions(e.what(), "barrier", "unusable"),
                      std::string(e.what()));
      }
    }
    comm().barrier();
  }
}

int main(int argc, char** argv) {
  // --real-nodes: the launcher's nodes instead of fake ones (taken out before doctest sees it).
  bool real_nodes = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--real-nodes") {
      real_nodes = true;
    } else {
      args.push_back(argv[i]);
    }
  }
  const tandem::World job = tandem::World::from_env();
  job_world = real_nodes ? job : fake_nodes(job);
  doctest::Context context(static_cast<int>(args.size()), args.data());
  try {
    // Small slots (the groups split off it inherit them): dozens of groups are made.
    world_comm.emplace(tandem::init_process_group<Comm>(
        job_world, "env://", {.timeout = 60s, .intra = {.slot_bytes = std::size_t{256} << 10}}));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hierarchical_conformance: %s\n", e.what());
    return 1;
  }
  int result = context.run();
  try {
    world_comm->barrier();  // no rank closes its levels while others still work
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hierarchical_conformance: final barrier: %s\n", e.what());
    result = result ? result : 1;
  }
  world_comm.reset();
  return result;
}
