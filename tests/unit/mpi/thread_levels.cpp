// MpiComm in a program that initialised MPI itself at a thread level below MULTIPLE:
//   serialized  MPI_THREAD_SERIALIZED: all MPI calls of the process take turns on one mutex;
//   funneled    MPI_THREAD_FUNNELED: only the calling thread uses MPI (`_async` runs eagerly).
// MpiComm must keep to that level, and must not finalise MPI: main does, after the tests (a
// second MPI_Finalize would make OpenMPI fail the job).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <mpi.h>

#include "mixed_forms.hpp"
#include "mpi_support.hpp"
#include "support/collective_suite.hpp"
#include "tandem/comm/mpi/mpi.hpp"

namespace {

int requested_level = MPI_THREAD_MULTIPLE;

}  // namespace

TEST_CASE("MpiComm keeps the thread level the program initialised MPI with") {
  CHECK(tandem::MpiComm::thread_level() == requested_level);
}

TEST_CASE("MpiComm below MPI_THREAD_MULTIPLE: every collective, element type and op") {
  tandem::test::MpiRunner run;
  tandem::test::check_all_collectives(run, tandem::test::job_size(), {{0, 1, 1031}});
}

TEST_CASE("MpiComm below MPI_THREAD_MULTIPLE: subgroups") {
  tandem::test::MpiRunner run;
  tandem::test::check_subgroups(run, tandem::test::job_size(), {{0, 13}});
}

TEST_CASE("MpiComm below MPI_THREAD_MULTIPLE: mismatched collectives are errors on every rank") {
  tandem::test::MpiRunner run;
  run.options.check_collectives = true;
  tandem::test::check_mismatch_errors(run, tandem::test::job_size());
  // `_async` forms compare too (polled before the request starts, or run at once below
  // SERIALIZED): the Work fails on every rank, and the communicator stays usable.
  tandem::test::on_every_rank(
      [](tandem::MpiComm& comm) {
        const int odd = comm.size() - 1;
        std::vector<float> data(comm.rank() == odd ? 3 : 2, 1.0f);
        auto work = comm.all_reduce_async(data);
        try {
          work.wait();
          FAIL_CHECK("an all_reduce_async with mismatched counts succeeded");
        } catch (const tandem::Error& e) {
          CHECK_MESSAGE(tandem::test::mentions(
                            e.what(), "rank " + std::to_string(comm.rank()) + ":",
                            "ranks disagree on the element count",
                            "rank " + std::to_string(odd) + " called all_reduce(3 x float32, sum)",
                            "called all_reduce(2 x float32, sum)"),
                        e.what());
        }
        std::vector<float> one{1.0f};
        comm.all_reduce(one);
        CHECK(one[0] == static_cast<float>(comm.size()));
      },
      {.check_collectives = true});
}

TEST_CASE("MpiComm below MPI_THREAD_MULTIPLE: ranks may mix sync and `_async` forms") {
  tandem::test::on_every_rank([](tandem::MpiComm& comm) { tandem::test::check_mixed_forms(comm); });
}

TEST_CASE("MpiComm below MPI_THREAD_MULTIPLE: recv_async completes once the message is sent") {
  using namespace std::chrono_literals;
  tandem::test::on_every_rank([](tandem::MpiComm& comm) {
    const int next = (comm.rank() + 1) % comm.size();
    const int prev = (comm.rank() + comm.size() - 1) % comm.size();
    std::vector<double> in(5, -1.0);
    std::vector<double> out(5, static_cast<double>(comm.rank()));
    if (requested_level >= MPI_THREAD_SERIALIZED) {
      auto received = comm.recv_async(in, next, 9);
      // The message cannot have been sent: `next` sends only after the barrier.
      CHECK_FALSE(received.test());
      comm.barrier();
      comm.send(out, prev, 9);
      CHECK(received.wait_for(60s));
    } else {
      // Below SERIALIZED an `_async` operation completes before it returns: a recv_async posted
      // before its message is sent would wait for it, so send first.
      auto sent = comm.send_async(out, prev, 9);
      CHECK(sent.test());
      auto received = comm.recv_async(in, next, 9);
      CHECK(received.test());
      received.wait();
    }
    CHECK(in == std::vector<double>(5, static_cast<double>(next)));
  });
}

int main(int argc, char** argv) {
  const std::string level = argc > 1 ? argv[1] : "";
  if (level == "serialized") {
    requested_level = MPI_THREAD_SERIALIZED;
  } else if (level == "funneled") {
    requested_level = MPI_THREAD_FUNNELED;
  } else {
    std::fprintf(stderr, "usage: %s serialized|funneled [doctest options]\n", argv[0]);
    return 2;
  }
  int provided = 0;
  MPI_Init_thread(&argc, &argv, requested_level, &provided);
  if (provided != requested_level) {
    std::fprintf(stderr, "asked MPI for thread level %d, got %d\n", requested_level, provided);
  }
  requested_level = provided;

  doctest::Context context;
  context.applyCommandLine(argc - 1, argv + 1);
  const int failed = context.run();

  int finalized = 1;
  MPI_Finalized(&finalized);
  if (finalized) {
    std::fprintf(stderr, "MpiComm finalised MPI that the program had initialised\n");
    return 1;
  }
  MPI_Finalize();
  return failed;
}
