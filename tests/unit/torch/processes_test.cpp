// tandem::torch::DistributedDataParallel with one process per rank: GlooComm under tandemrun
// (torch_processes_gloo_np4, on 127.0.0.1) and MpiComm under mpiexec (torch_processes_mpi_np4).
// Groups of 2, 3 and 4 ranks are split off the 4-process job. In each group the gradients after
// loss.backward() equal what one process computes over the whole batch, with overlap and with
// sync_at_end, with a branch that some ranks (or none) use, and with no_sync accumulation;
// construction gives every rank rank 0's parameters and buffers, and each training forward rank
// 0's buffers (BatchNorm's running statistics and its int64 num_batches_tracked); modules that
// differ are the same Error on every rank. One executable for both backends: each libtorch
// translation unit costs about 20 s of compilation.
// Tolerance: 1e-5 relative plus 1e-6 absolute (why: gradient_check.hpp, shared with ddp_test.cpp).
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "gradient_check.hpp"
#include "support/error_of.hpp"
#include "support/runners.hpp"
#include "tandem/ddp/policies.hpp"
#include "tandem/torch.hpp"
#if TANDEM_TEST_GLOO
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"
#endif
#if TANDEM_TEST_MPI
#include "tandem/comm/mpi/mpi.hpp"
#endif

using tandem::test::contains;
using tandem::test::error_of;

namespace {

using namespace torch_ddp_check;  // Net, Data, slice, reference_grads, ddp_grads

// The job's communicator, made once per process (every test case uses it).
#if TANDEM_TEST_MPI
tandem::MpiComm& mpi_job() {
  static tandem::MpiComm job = tandem::MpiComm::world();
  return job;
}
#endif
#if TANDEM_TEST_GLOO
tandem::GlooComm& gloo_job() {
  static tandem::GlooComm job = tandem::init_process_group<tandem::GlooComm>();
  return job;
}
#endif

/// Runs check(job) on this process's job: MpiComm under mpiexec, GlooComm (env://) under
/// tandemrun. Run alone, it says so and checks nothing (CTest starts it through a launcher only).
template <class Check>
void on_job(Check&& check) {
  torch::set_num_threads(1);  // the ranks are the parallelism
  if (std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE")) {
#if TANDEM_TEST_MPI
    check(mpi_job());
#else
    DOCTEST_FAIL("started by mpiexec, but built without MpiComm");
#endif
  } else if (std::getenv("WORLD_SIZE")) {
#if TANDEM_TEST_GLOO
    check(gloo_job());
#else
    DOCTEST_FAIL("started by tandemrun, but built without GlooComm");
#endif
  } else {
    DOCTEST_MESSAGE("not started by tandemrun or mpiexec: nothing checked");
  }
}

/// Every rank of groups of 2, 3 and 4 (as many as the job has).
template <class Comm, class F>
void for_each_group(Comm& job, F&& f) {
  tandem::test::SplitRunner<Comm> run{&job};
  for (int n = 2; n <= job.size() && n <= 4; ++n) run(n, [&](Comm& comm) { f(comm, n); });
}

/// In a group of n processes, DDP's gradients after `micro` micro-batches equal one process's.
template <class... Policies, class Comm>
void gradients_match(Comm& comm, int micro, const SpareUse& spare, const std::string& what) {
  const int n = comm.size();
  const int r = comm.rank();
  const Data data;
  Net reference = net_from(7);
  const auto want = reference_grads(reference, data, n, micro, spare);
  Net net = net_from(7);
  net->use_spare = spare(r);
  check_close(ddp_grads<Policies...>(comm, net, data, micro), want,
              what + ", " + std::to_string(n) + " ranks, rank " + std::to_string(r));
}

}  // namespace

TEST_CASE("2, 3 and 4 processes: gradients after backward() equal one process's over the batch") {
  on_job([](auto& job) {
    using Comm = std::remove_reference_t<decltype(job)>;
    for_each_group(job, [](Comm& comm, int) {
      gradients_match<>(comm, 1, nowhere, "overlap");
      gradients_match<tandem::sync_at_end>(comm, 1, nowhere, "sync_at_end");
    });
  });
}

TEST_CASE("2, 3 and 4 processes: a branch used by some ranks only, or by none, needs no flag") {
  on_job([](auto& job) {
    using Comm = std::remove_reference_t<decltype(job)>;
    for_each_group(job, [](Comm& comm, int) {
      gradients_match<>(
          comm, 1, [](int r) { return r == 0; }, "branch on rank 0 only");
      gradients_match<>(
          comm, 1, [](int r) { return r % 2 == 1; }, "branch on odd ranks");
      gradients_match<tandem::sync_at_end>(
          comm, 1, [](int r) { return r == 1; }, "branch on rank 1 only, sync_at_end");
    });
  });
}

TEST_CASE("2, 3 and 4 processes: no_sync accumulates two micro-batches, then one reduction") {
  on_job([](auto& job) {
    using Comm = std::remove_reference_t<decltype(job)>;
    for_each_group(job, [](Comm& comm, int) {
      gradients_match<>(comm, 2, nowhere, "no_sync");
      gradients_match<tandem::sync_at_end>(
          comm, 2, [](int r) { return r == 0; }, "no_sync, branch on rank 0, sync_at_end");
    });
  });
}

TEST_CASE("2, 3 and 4 processes: rank 0's parameters and buffers at construction and forward") {
  on_job([](auto& job) {
    using Comm = std::remove_reference_t<decltype(job)>;
    for_each_group(job, [](Comm& comm, int n) {
      const int r = comm.rank();
      Net rank0 = net_from(100);
      Net net = net_from(100 + static_cast<std::uint64_t>(r));  // each rank its own weights
      {
        torch::NoGradGuard no_grad;
        net->bn->running_mean.fill_(float(r + 1));
        net->bn->num_batches_tracked.fill_(10 * r + 5);
      }
      tandem::torch::DistributedDataParallel ddp(comm, net.ptr());
      DOCTEST_CHECK(torch::equal(net->fc1->weight, rank0->fc1->weight));
      DOCTEST_CHECK(torch::equal(net->spare->bias, rank0->spare->bias));
      DOCTEST_CHECK(net->bn->running_mean.eq(1.0f).all().item<bool>());
      DOCTEST_CHECK(net->bn->num_batches_tracked.item<std::int64_t>() == 5);

      // A training step on each rank's own data moves each rank's running statistics its own way.
      torch::manual_seed(200 + static_cast<std::uint64_t>(r));
      auto x = torch::randn({6, 6}) * float(r + 1);
      auto y = torch::randint(0, 3, {6}, torch::kLong);
      torch::nn::functional::cross_entropy(ddp.forward(x), y).backward();
      DOCTEST_CHECK(net->bn->num_batches_tracked.item<std::int64_t>() == 6);
      {
        torch::NoGradGuard no_grad;
        net->bn->num_batches_tracked.fill_(40 + r);  // as if ranks had counted differently
      }
      auto mean = net->bn->running_mean.clone();
      auto var = net->bn->running_var.clone();
      auto count = net->bn->num_batches_tracked.clone();
      tandem::torch::broadcast(comm, mean, 0);
      tandem::torch::broadcast(comm, var, 0);
      tandem::torch::broadcast(comm, count, 0);
      if (r != 0) DOCTEST_CHECK_FALSE(torch::equal(net->bn->running_mean, mean));
      // The next training forward starts from rank 0's buffers.
      ddp.before_forward();
      DOCTEST_CHECK_MESSAGE(torch::equal(net->bn->running_mean, mean), n << " ranks, rank " << r);
      DOCTEST_CHECK(torch::equal(net->bn->running_var, var));
      DOCTEST_CHECK(net->bn->num_batches_tracked.item<std::int64_t>() == 40);
      DOCTEST_CHECK(torch::equal(net->bn->num_batches_tracked, count));
    });
  });
}

TEST_CASE("3 processes: modules that differ are the same Error on every rank, naming the rank") {
  on_job([](auto& job) {
    using Comm = std::remove_reference_t<decltype(job)>;
    if (job.size() < 3) return;
    tandem::test::SplitRunner<Comm>{&job}(3, [](Comm& comm) {
      torch::nn::Sequential net(torch::nn::Linear(4, 3),
                                torch::nn::Linear(3, comm.rank() == 2 ? 5 : 2));
      const auto e = error_of([&] { tandem::torch::DistributedDataParallel ddp(comm, net.ptr()); });
      DOCTEST_CAPTURE(e);
      DOCTEST_CHECK(contains(e, "differ"));
      DOCTEST_CHECK(contains(e, "'1.weight'"));
      DOCTEST_CHECK(contains(e, "ranks 0, 1 have"));
      DOCTEST_CHECK(contains(e, "rank 2 has"));
      // The group is still usable: the check left no collective half-done.
      auto t = torch::ones({3});
      tandem::torch::all_reduce(comm, t);
      DOCTEST_CHECK(t.eq(3.0f).all().item<bool>());
    });
  });
}
