#include <doctest/doctest.h>

#include "tandem/core/world.hpp"

using tandem::World;

TEST_CASE("a hand-made World is validated field by field") {
  CHECK_NOTHROW(World{}.validate());
  CHECK_NOTHROW((World{3, 4, 1, 2, 1, 2}.validate()));
  CHECK_THROWS_WITH_AS((World{4, 4, 0, 4, 0, 1}.validate()),
                       "tandem: World: rank=4 must be less than world_size=4", tandem::Error);
  CHECK_THROWS_WITH_AS((World{-1, 4, 0, 4, 0, 1}.validate()),
                       "tandem: World: rank=-1 must not be negative", tandem::Error);
  CHECK_THROWS_WITH_AS((World{0, 2, 0, 3, 0, 1}.validate()),
                       "tandem: World: local_world_size=3 must not exceed world_size=2",
                       tandem::Error);
  CHECK_THROWS_WITH_AS((World{1, 4, 2, 4, 0, 1}.validate()),
                       "tandem: World: local_rank=2 must not exceed rank=1", tandem::Error);
  CHECK_THROWS_WITH_AS((World{0, 2, 0, 1, 0, 3}.validate()),
                       "tandem: World: nnodes=3 must not exceed world_size=2", tandem::Error);
  CHECK_THROWS_WITH_AS((World{0, 2, 0, 1, 2, 2}.validate()),
                       "tandem: World: node_rank=2 must be less than nnodes=2", tandem::Error);
}

TEST_CASE("single_node builds a one-node world and validates it") {
  const World w = World::single_node(2, 4);
  CHECK(w.rank == 2);
  CHECK(w.local_rank == 2);
  CHECK(w.local_world_size == 4);
  CHECK(w.nnodes == 1);
  CHECK_THROWS_AS(World::single_node(4, 4), tandem::Error);
}
