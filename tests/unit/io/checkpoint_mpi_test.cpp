// Exact resume on MpiComm: one process per rank under mpirun; the checkpoint directory is
// rank 0's, broadcast to the others.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <mpi.h>

#include "resume_suite.hpp"
#include "support/temp_dir.hpp"
#include "tandem/comm/mpi/mpi.hpp"
#include "unit/mpi/mpi_support.hpp"

namespace {
// run(n, fn): fn on this process's rank of the job; a rank that throws ends the job.
struct MpiRunner {
  template <class Fn>
  void operator()(int, Fn&& fn) {
    tandem::test::on_every_rank([&](tandem::MpiComm& world) {
      fn(world);
      world.barrier();
    });
  }
};
}  // namespace

TEST_CASE("a resumed MPI run ends bit for bit where an uninterrupted one does") {
  auto world = tandem::MpiComm::world();
  std::optional<tandem::test::TempDir> mine;
  std::vector<std::uint8_t> path(4096, 0);
  if (world.rank() == 0) {
    mine.emplace();
    const std::string text = mine->str();
    std::copy(text.begin(), text.end(), path.begin());
  }
  world.broadcast(path, 0);
  const std::filesystem::path dir(reinterpret_cast<const char*>(path.data()));
  for (bool broadcast : {false, true}) {
    CAPTURE(broadcast);
    // Each process compares its own rank.
    CHECK(tandem::test::resume::check_resume(MpiRunner{}, world.size(),
                                             dir / (broadcast ? "b" : "a"), broadcast) == 1);
  }
  world.barrier();  // rank 0 removes the directory only after everyone is done with it
}
