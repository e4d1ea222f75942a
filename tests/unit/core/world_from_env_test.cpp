#include <doctest/doctest.h>

#include <string>

#include "support/fake_env.hpp"
#include "tandem/core/world.hpp"

using tandem::World;
using tandem::test::FakeEnv;

namespace {

void check_world(const World& w, int rank, int size, int local_rank, int local_size, int node,
                 int nodes) {
  CHECK(w.rank == rank);
  CHECK(w.world_size == size);
  CHECK(w.local_rank == local_rank);
  CHECK(w.local_world_size == local_size);
  CHECK(w.node_rank == node);
  CHECK(w.nnodes == nodes);
}

}  // namespace

TEST_CASE("no launcher variables give a single-process world") {
  const FakeEnv env{{"PATH", "/usr/bin"}};
  const World w = World::from_env(env.lookup());
  check_world(w, 0, 1, 0, 1, 0, 1);
  CHECK(w.is_main());
  CHECK(w.is_local_main());
}

TEST_CASE("torchrun / tandemrun variables") {
  const FakeEnv env{{"RANK", "5"},
                    {"WORLD_SIZE", "8"},
                    {"LOCAL_RANK", "1"},
                    {"LOCAL_WORLD_SIZE", "4"},
                    {"GROUP_RANK", "1"},
                    {"GROUP_WORLD_SIZE", "2"},
                    {"MASTER_ADDR", "10.0.0.1"},
                    {"MASTER_PORT", "29500"}};
  const World w = World::from_env(env.lookup());
  check_world(w, 5, 8, 1, 4, 1, 2);
  CHECK_FALSE(w.is_main());
}

TEST_CASE("torchrun variables without a node layout mean one node") {
  const FakeEnv env{{"RANK", "2"}, {"WORLD_SIZE", "3"}};
  check_world(World::from_env(env.lookup()), 2, 3, 2, 3, 0, 1);
}

TEST_CASE("torchrun variables: the node is derived from blocks of LOCAL_WORLD_SIZE") {
  const FakeEnv env{
      {"RANK", "6"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "4"}};
  check_world(World::from_env(env.lookup()), 6, 8, 2, 4, 1, 2);
}

TEST_CASE("torchrun variables win over Slurm's when both are present") {
  const FakeEnv env{
      {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}};
  check_world(World::from_env(env.lookup()), 1, 2, 1, 2, 0, 1);
}

TEST_CASE("Slurm with SLURM_NTASKS_PER_NODE") {
  const FakeEnv env{{"SLURM_PROCID", "5"},          {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                    {"SLURM_NTASKS_PER_NODE", "4"}, {"SLURM_NODEID", "1"}, {"SLURM_NNODES", "2"}};
  check_world(World::from_env(env.lookup()), 5, 8, 1, 4, 1, 2);
}

TEST_CASE("Slurm with an uneven SLURM_TASKS_PER_NODE list") {
  // Nodes 0-2 run 2 tasks each, node 3 runs 1: rank 6 is alone on node 3.
  const FakeEnv env{{"SLURM_PROCID", "6"},  {"SLURM_NTASKS", "7"},
                    {"SLURM_LOCALID", "0"}, {"SLURM_TASKS_PER_NODE", "2(x3),1"},
                    {"SLURM_NODEID", "3"},  {"SLURM_NNODES", "4"}};
  check_world(World::from_env(env.lookup()), 6, 7, 0, 1, 3, 4);

  const FakeEnv second{{"SLURM_PROCID", "3"},  {"SLURM_NTASKS", "7"},
                       {"SLURM_LOCALID", "1"}, {"SLURM_TASKS_PER_NODE", "2(x3),1"},
                       {"SLURM_NODEID", "1"},  {"SLURM_NNODES", "4"}};
  check_world(World::from_env(second.lookup()), 3, 7, 1, 2, 1, 4);
}

TEST_CASE("Slurm task lists that are malformed or too short are errors naming the variable") {
  for (const char* list : {"2(x3", "x", "2(x0)", "", "2,,1", "-1"}) {
    CAPTURE(list);
    const FakeEnv env{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_TASKS_PER_NODE", list}};
    CHECK_THROWS_WITH_AS(World::from_env(env.lookup()), doctest::Contains("SLURM_TASKS_PER_NODE"),
                         tandem::Error);
  }
  const FakeEnv short_list{{"SLURM_PROCID", "3"},
                           {"SLURM_NTASKS", "4"},
                           {"SLURM_NODEID", "2"},
                           {"SLURM_NNODES", "3"},
                           {"SLURM_TASKS_PER_NODE", "2(x2)"}};
  CHECK_THROWS_WITH_AS(World::from_env(short_list.lookup()),
                       "tandem: environment: SLURM_NODEID=2 has no entry in "
                       "SLURM_TASKS_PER_NODE='2(x2)'",
                       tandem::Error);
}

TEST_CASE("a Slurm task list is read without expanding it and named whole in errors") {
  // "1(x1000000)" two thousand times: two billion nodes, which an expanded list would hold in
  // eight gigabytes; the node's own count is found by walking the text.
  std::string huge;
  for (int i = 0; i < 2000; ++i) {
    // Appended piece by piece: at -O3, GCC 12 sees a memcpy of an impossible size in the inlined
    // `const char* + std::string` that stood here (a -Wstringop-overflow false positive).
    if (i != 0) huge += ',';
    huge += "1(x1000000)";
  }
  huge += ",3";
  const FakeEnv env{{"SLURM_PROCID", "2"},          {"SLURM_NTASKS", "3"}, {"SLURM_LOCALID", "2"},
                    {"SLURM_TASKS_PER_NODE", huge}, {"SLURM_NODEID", "0"}, {"SLURM_NNODES", "1"}};
  CHECK_THROWS_WITH_AS(World::from_env(env.lookup()),
                       doctest::Contains("SLURM_LOCALID=2 must be less than "
                                         "SLURM_TASKS_PER_NODE=1"),
                       tandem::Error);
  // A bad item after the node's own is still an error, and the message shows the whole list.
  const FakeEnv bad_tail{
      {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_TASKS_PER_NODE", "2,1(x3"}};
  CHECK_THROWS_WITH_AS(World::from_env(bad_tail.lookup()),
                       "tandem: environment: SLURM_TASKS_PER_NODE='2,1(x3' is not a Slurm task "
                       "list",
                       tandem::Error);
}

TEST_CASE("world sizes up to INT32_MAX derive their node count without overflowing") {
  // Found by tests/fuzz (crashes/init_env/world-size-above-2-to-the-30): world_size +
  // local_world_size - 1 overflowed int (undefined behaviour) above 2^30 ranks.
  const FakeEnv env{{"RANK", "0"}, {"WORLD_SIZE", "1297502770"}};
  check_world(World::from_env(env.lookup()), 0, 1297502770, 0, 1297502770, 0, 1);
  const FakeEnv widest{{"RANK", "2147483646"},
                       {"WORLD_SIZE", "2147483647"},
                       {"LOCAL_RANK", "0"},
                       {"LOCAL_WORLD_SIZE", "2"}};
  check_world(World::from_env(widest.lookup()), 2147483646, 2147483647, 0, 2, 1073741823,
              1073741824);
}

TEST_CASE("OpenMPI variables") {
  const FakeEnv env{{"OMPI_COMM_WORLD_RANK", "3"},
                    {"OMPI_COMM_WORLD_SIZE", "4"},
                    {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  check_world(World::from_env(env.lookup()), 3, 4, 1, 2, 1, 2);
}

TEST_CASE("MPICH / PMI variables") {
  const FakeEnv env{
      {"PMI_RANK", "2"}, {"PMI_SIZE", "3"}, {"MPI_LOCALRANKID", "2"}, {"MPI_LOCALNRANKS", "3"}};
  check_world(World::from_env(env.lookup()), 2, 3, 2, 3, 0, 1);
}

TEST_CASE("non-numeric values are errors naming the variable") {
  const FakeEnv env{{"RANK", "one"}, {"WORLD_SIZE", "2"}};
  CHECK_THROWS_WITH_AS(World::from_env(env.lookup()),
                       "tandem: environment: RANK='one' is not an integer", tandem::Error);
  const FakeEnv slurm{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2.5"}};
  CHECK_THROWS_WITH_AS(World::from_env(slurm.lookup()),
                       "tandem: environment: SLURM_NTASKS='2.5' is not an integer", tandem::Error);
}

TEST_CASE("negative values are errors naming the variable") {
  const FakeEnv env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "-1"}};
  CHECK_THROWS_WITH_AS(World::from_env(env.lookup()), doctest::Contains("LOCAL_RANK=-1"),
                       tandem::Error);
}

TEST_CASE("inconsistent values are errors naming both variables") {
  const FakeEnv rank_too_big{{"RANK", "4"}, {"WORLD_SIZE", "4"}};
  // A process too many (RANK past WORLD_SIZE) is told what to check.
  CHECK_THROWS_WITH_AS(World::from_env(rank_too_big.lookup()),
                       doctest::Contains("tandem: World: RANK=4 must be less than WORLD_SIZE=4 "
                                         "(more processes than the job holds? check the launch "
                                         "command's counts - torchrun and tandemrun: --nnodes, "
                                         "--nproc-per-node, --node-rank"),
                       tandem::Error);

  const FakeEnv local_too_big{
      {"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}};
  CHECK_THROWS_WITH_AS(World::from_env(local_too_big.lookup()),
                       doctest::Contains("tandem: World: LOCAL_RANK=2 must be less than "
                                         "LOCAL_WORLD_SIZE=2 (more processes"),
                       tandem::Error);

  const FakeEnv zero_size{{"RANK", "0"}, {"WORLD_SIZE", "0"}};
  CHECK_THROWS_WITH_AS(World::from_env(zero_size.lookup()),
                       "tandem: World: WORLD_SIZE=0 must be at least 1", tandem::Error);

  const FakeEnv bad_node{
      {"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "2"}};
  CHECK_THROWS_WITH_AS(
      World::from_env(bad_node.lookup()),
      doctest::Contains("tandem: World: GROUP_RANK=2 must be less than nnodes=2 ("), tandem::Error);

  const FakeEnv ompi_local{{"OMPI_COMM_WORLD_RANK", "0"},
                           {"OMPI_COMM_WORLD_SIZE", "2"},
                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}};
  CHECK_THROWS_WITH_AS(World::from_env(ompi_local.lookup()),
                       "tandem: World: OMPI_COMM_WORLD_LOCAL_SIZE=3 must not exceed "
                       "OMPI_COMM_WORLD_SIZE=2",
                       tandem::Error);
}

TEST_CASE("half a launcher's variables is an error naming the missing one") {
  const FakeEnv rank_only{{"RANK", "0"}};
  CHECK_THROWS_WITH_AS(World::from_env(rank_only.lookup()),
                       "tandem: environment: RANK is set but WORLD_SIZE is not", tandem::Error);
  const FakeEnv size_only{{"WORLD_SIZE", "2"}};
  CHECK_THROWS_WITH_AS(World::from_env(size_only.lookup()),
                       "tandem: environment: WORLD_SIZE is set but RANK is not", tandem::Error);
  const FakeEnv slurm{{"SLURM_PROCID", "0"}};
  CHECK_THROWS_WITH_AS(World::from_env(slurm.lookup()),
                       "tandem: environment: SLURM_PROCID is set but SLURM_NTASKS is not",
                       tandem::Error);
  const FakeEnv pmi{{"PMI_SIZE", "2"}};
  CHECK_THROWS_WITH_AS(World::from_env(pmi.lookup()),
                       "tandem: environment: PMI_SIZE is set but PMI_RANK is not", tandem::Error);
}

TEST_CASE("a MASTER_PORT that is no port is an error whichever launcher is in use") {
  const FakeEnv env{{"MASTER_PORT", "65536"}};
  CHECK_THROWS_WITH_AS(World::from_env(env.lookup()),
                       "tandem: environment: MASTER_PORT=65536 is out of range [0, 65535]",
                       tandem::Error);
  const FakeEnv text{{"MASTER_PORT", "http"}, {"RANK", "0"}, {"WORLD_SIZE", "1"}};
  CHECK_THROWS_WITH_AS(World::from_env(text.lookup()),
                       "tandem: environment: MASTER_PORT='http' is not an integer", tandem::Error);
}

TEST_CASE("from_env without arguments reads the process environment") {
  REQUIRE(::setenv("RANK", "1", 1) == 0);
  REQUIRE(::setenv("WORLD_SIZE", "2", 1) == 0);
  const World w = World::from_env();
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  CHECK(w.rank == 1);
  CHECK(w.world_size == 2);
}
