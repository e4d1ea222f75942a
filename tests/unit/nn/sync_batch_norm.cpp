// tandem::SyncBatchNorm on LocalComm ranks (threads), host tensors: the shared suite
// (sync_batch_norm_suite.hpp: PyTorch's numbers from syncbn.txt on 1, 2 and 3 ranks with unequal
// and empty batches, the errors across ranks, a forward whose collective fails, the arena form),
// then what only host tensors show:
// which calls communicate, gradient accumulation, eval mode, and the errors of one rank.
// Tolerances: see syncbn_golden.hpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "instrumented_comm.hpp"
#include "support/collective_suite.hpp"
#include "support/error_of.hpp"
#include "sync_batch_norm_suite.hpp"
#include "syncbn_golden.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/nn/sync_batch_norm.hpp"

using namespace std::chrono_literals;
using tandem::Buffer;
using tandem::LocalComm;
using tandem::Shape;
using tandem::SyncBatchNorm;
using tandem::test::contains;
using tandem::test::error_of;
using tandem::test::Failures;
using tandem::test::syncbn::expect_close;
using tandem::test::syncbn::filled;
using tandem::test::syncbn::GoldenCase;

namespace {

using CountingComm = tandem::test::InstrumentedComm;

/// Runs fn(comm) with a CountingComm on each of n threads.
template <class Fn>
void run_counting(int n, Fn fn) {
  tandem::run_local(n,
                    [&](LocalComm& comm) {
                      CountingComm counting(std::move(comm));
                      fn(counting);
                    },
                    {.timeout = 30s});
}

}  // namespace

static_assert(std::same_as<SyncBatchNorm<LocalComm>::value_type, float>);
static_assert(std::same_as<SyncBatchNorm<LocalComm>::memory_space, tandem::host>);
static_assert(std::movable<SyncBatchNorm<LocalComm>>);

TEST_CASE_TEMPLATE("SyncBatchNorm matches PyTorch on 2 and 3 ranks with unequal and empty batches",
                   T, float, double) {
  // r2: batches 3 and 1, (N, 3, 4), momentum 0.1; r2empty: batches 0 and 5, (N, 4), no affine;
  // r3: batches 4, 0 and 2, (N, 2, 3, 2), cumulative average (momentum None), 3 steps.
  for (const char* name : {"r2", "r2empty", "r3"}) {
    CAPTURE(name);
    Failures failures;
    CHECK(tandem::test::syncbn::check_golden_case<T, tandem::host>(name, failures, 60s) > 0);
    failures.report();
  }
}

TEST_CASE_TEMPLATE("SyncBatchNorm on one rank is PyTorch's plain batch norm", T, float, double) {
  Failures failures;
  CHECK(tandem::test::syncbn::check_golden_case<T, tandem::host>("w1", failures, 60s) > 0);
  failures.report();
}

TEST_CASE("one rank given the concatenated batch computes what three ranks compute together") {
  const GoldenCase gc("r3");
  Failures failures;
  tandem::run_local(1, [&](LocalComm& comm) {
    SyncBatchNorm<LocalComm> bn(comm, gc.channels, gc.options);
    std::ranges::copy(gc.at("weight"), bn.weight().begin());
    std::ranges::copy(gc.at("bias"), bn.bias().begin());
    std::vector<double> input, grad_output, output, grad_input;
    std::int64_t batch = 0;
    for (int r = 0; r < gc.world; ++r) {
      const std::string prefix = "s0/r" + std::to_string(r);
      for (const auto& [to, key] : {std::pair{&input, "/input"},
                                    {&grad_output, "/grad_output"},
                                    {&output, "/output"},
                                    {&grad_input, "/grad_input"}}) {
        const auto& part = gc.at(prefix + key);
        to->insert(to->end(), part.begin(), part.end());
      }
      batch += gc.shapes[static_cast<std::size_t>(r)][0];
    }
    const Shape shape{batch, gc.channels, 3, 2};
    auto x = filled<float>(shape, input);
    auto dy = filled<float>(shape, grad_output);
    Buffer<float> y(shape);
    Buffer<float> dx(shape);
    bn.forward(x.view(), y.view());
    bn.backward(x.view(), dy.view(), dx.view());
    expect_close<float>(failures, "output", y.view(), output);
    expect_close<float>(failures, "grad_input", dx.view(), grad_input);
    expect_close<float>(failures, "running_mean", bn.running_mean(), gc.at("s0/running_mean"));
    expect_close<float>(failures, "running_var", bn.running_var(), gc.at("s0/running_var"));
    // The whole batch's weight gradient is the sum of the ranks' local ones.
    std::vector<double> grad_weight(static_cast<std::size_t>(gc.channels), 0.0);
    for (int r = 0; r < gc.world; ++r) {
      const auto& part = gc.at("s0/r" + std::to_string(r) + "/grad_weight");
      for (std::size_t c = 0; c < part.size(); ++c) grad_weight[c] += part[c];
    }
    expect_close<float>(failures, "grad_weight", bn.grad_weight(), grad_weight);
  });
  failures.report();
}

TEST_CASE("gradients accumulate across backward calls until zero_grad") {
  const GoldenCase gc("w1");
  Failures failures;
  tandem::run_local(1, [&](LocalComm& comm) {
    SyncBatchNorm<LocalComm> bn(comm, gc.channels, gc.options);
    std::ranges::copy(gc.at("weight"), bn.weight().begin());
    std::ranges::copy(gc.at("bias"), bn.bias().begin());
    const Shape shape = gc.shapes[0];
    auto x = filled<float>(shape, gc.at("s0/r0/input"));
    auto dy = filled<float>(shape, gc.at("s0/r0/grad_output"));
    Buffer<float> y(shape);
    bn.forward(x.view(), y.view());
    // grad_input may be grad_output itself: the second backward writes over dy.
    Buffer<float> dx(shape);
    bn.backward(x.view(), dy.view(), dx.view());
    bn.backward(x.view(), dy.view(), dy.view());
    expect_close<float>(failures, "in-place grad_input", dy.view(), gc.at("s0/r0/grad_input"));
    std::vector<double> twice = gc.at("s0/r0/grad_weight");
    for (double& v : twice) v *= 2;
    expect_close<float>(failures, "grad_weight after two backwards", bn.grad_weight(), twice);
    bn.zero_grad();
    for (float g : bn.grad_weight()) failures.expect(g == 0.0f, "zero_grad left ", g);
    for (float g : bn.grad_bias()) failures.expect(g == 0.0f, "zero_grad left ", g);
  });
  failures.report();
}

TEST_CASE(
    "training on several ranks runs one all_gather and one all_reduce per step, "
    "also on a rank with an empty batch; eval and one rank run none") {
  std::vector<int> counts(6, -1);
  Failures failures;
  run_counting(3, [&](CountingComm& comm) {
    const std::int64_t batch = comm.rank() == 1 ? 0 : 2;
    const Shape shape{batch, 2, 3};
    Buffer<float> x(shape);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = float(i % 7) - float(comm.rank());
    Buffer<float> y(shape);
    Buffer<float> dx(shape);
    SyncBatchNorm<CountingComm> bn(comm, 2);
    bn.forward(x.view(), y.view());  // the first one also checks that the ranks agree on C
    const int first = comm.collectives;
    bn.backward(x.view(), x.view(), dx.view());
    const int after_first_step = comm.collectives;
    bn.forward(x.view(), y.view());
    bn.backward(x.view(), x.view(), dx.view());
    const int per_step = comm.collectives - after_first_step;
    failures.expect(after_first_step == first + 1, "rank ", comm.rank(), ": backward ran ",
                    after_first_step - first, " collectives");
    bn.eval();
    const int before_eval = comm.collectives;
    bn.forward(x.view(), y.view());
    bn.backward(x.view(), x.view(), dx.view());
    const int eval = comm.collectives - before_eval;
    if (comm.rank() == 0) {
      counts[0] = first;
      counts[1] = per_step;
      counts[2] = eval;
    }
    if (comm.rank() == 1) counts[3] = per_step;
  });
  CHECK(counts[0] == 2);
  CHECK(counts[1] == 2);
  CHECK(counts[2] == 0);
  CHECK(counts[3] == 2);
  failures.report();

  run_counting(1, [&](CountingComm& comm) {
    SyncBatchNorm<CountingComm> bn(comm, 2);
    Buffer<float> x(Shape{4, 2});
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = float(i * i);
    Buffer<float> y(x.shape());
    Buffer<float> dx(x.shape());
    bn.forward(x.view(), y.view());
    bn.backward(x.view(), x.view(), dx.view());
    counts[4] = comm.collectives;
    CHECK(bn.num_batches_tracked() == 1);
  });
  CHECK(counts[4] == 0);
}

TEST_CASE("eval mode needs no partner: ranks may call it different numbers of times") {
  Failures failures;
  tandem::run_local(
      2,
      [&](LocalComm& comm) {
        SyncBatchNorm<LocalComm> bn(comm, 3);
        bn.eval();
        std::ranges::fill(bn.running_mean(), 1.0f);
        std::ranges::fill(bn.running_var(), 4.0f);
        Buffer<float> x(Shape{2, 3});
        std::ranges::fill(x, 3.0f);
        Buffer<float> y(x.shape());
        for (int i = 0; i < (comm.rank() == 0 ? 3 : 1); ++i) bn.forward(x.view(), y.view());
        comm.barrier();  // a collective inside eval would be mismatched with this barrier
        const double want = 2.0 / std::sqrt(4.0 + 1e-5);
        for (float v : y) failures.expect(std::abs(v - want) < 1e-6, "eval output ", v);
        CHECK(bn.num_batches_tracked() == 0);
      },
      {.timeout = 30s});
  failures.report();
}

TEST_CASE("without running statistics, eval normalises each rank's batch on its own") {
  Failures failures;
  tandem::run_local(
      2,
      [&](LocalComm& comm) {
        SyncBatchNorm<LocalComm> bn(comm, 1, {.affine = false, .track_running_stats = false});
        bn.eval();
        Buffer<float> x(Shape{4, 1});
        for (std::size_t i = 0; i < 4; ++i) x[i] = float(i) + 10.0f * float(comm.rank());
        Buffer<float> y(x.shape());
        bn.forward(x.view(), y.view());
        // Each rank's values 0..3 (+ 10 r): mean 1.5, biased variance 1.25.
        for (std::size_t i = 0; i < 4; ++i) {
          const double want = (double(i) - 1.5) / std::sqrt(1.25 + 1e-5);
          failures.expect(std::abs(y[i] - want) < 1e-6, "rank ", comm.rank(), " y[", i, "] ", y[i],
                          " want ", want);
        }
        CHECK(error_of([&] { (void)bn.running_mean(); }).find("track_running_stats") !=
              std::string::npos);
      },
      {.timeout = 30s});
  failures.report();
}

TEST_CASE("ranks that disagree on C, or have one value per channel between them, get Errors") {
  Failures failures;
  CHECK(tandem::test::syncbn::check_errors_across_ranks<tandem::host>(failures, 30s) == 8);
  failures.report();
}

TEST_CASE("a forward whose collective fails leaves the running statistics and the counter alone") {
  Failures failures;
  CHECK(tandem::test::syncbn::check_failed_collective<tandem::host>(failures, 30s) > 0);
  failures.report();
}

TEST_CASE("parameters and buffers can live in a Parameters arena under PyTorch's names") {
  Failures failures;
  CHECK(tandem::test::syncbn::check_arena<tandem::host>(failures, 30s) > 0);
  failures.report();
}

TEST_CASE("bad shapes and options are Errors naming the cause") {
  tandem::run_local(1, [&](LocalComm& comm) {
    SyncBatchNorm<LocalComm> bn(comm, 3);
    Buffer<float> x(Shape{2, 3, 4});
    Buffer<float> y(x.shape());
    Buffer<float> flat(24);

    CHECK(contains(error_of([&] { bn.forward(flat.view(), y.view()); }),
                   "at least 2 dimensions, got shape [24]"));
    Buffer<float> four(Shape{2, 4, 3});
    CHECK(contains(error_of([&] { bn.forward(four.view(), y.view()); }),
                   "input of shape [2, 4, 3] has 4 channels, this SyncBatchNorm has 3"));
    Buffer<float> other(Shape{2, 3, 2, 2});
    CHECK(contains(error_of([&] { bn.forward(x.view(), other.view()); }),
                   "output shape [2, 3, 2, 2] differs from input shape [2, 3, 4]"));
    CHECK(contains(error_of([&] { bn.forward(x.view(), x.view()); }), "overlaps the input"));
    CHECK(contains(error_of([&] { bn.backward(x.view(), x.view(), y.view()); }),
                   "no forward to differentiate"));
    Buffer<float> one(Shape{1, 3});
    Buffer<float> one_out(one.shape());
    CHECK(contains(error_of([&] { bn.forward(one.view(), one_out.view()); }),
                   "more than 1 value per channel when training, got 1 in input of shape [1, 3]"));

    for (std::size_t i = 0; i < x.size(); ++i) x[i] = float(i);
    bn.forward(x.view(), y.view());
    Buffer<float> smaller(Shape{1, 3, 4});
    CHECK(contains(error_of([&] { bn.backward(smaller.view(), smaller.view(), smaller.view()); }),
                   "input shape [1, 3, 4] differs from the last forward's [2, 3, 4]"));
    CHECK(contains(error_of([&] { bn.backward(x.view(), flat.view(), y.view()); }),
                   "must have the input's shape [2, 3, 4]"));

    CHECK(contains(error_of([&] { SyncBatchNorm<LocalComm> none(comm, 0); }),
                   "num_features must be at least 1, not 0"));
    CHECK(contains(error_of([&] { SyncBatchNorm<LocalComm> bad(comm, 3, {.eps = 0.0}); }),
                   "eps must be positive"));
    SyncBatchNorm<LocalComm> plain(comm, 3, {.affine = false});
    const auto message = error_of([&] { (void)plain.weight(); });
    CHECK(contains(message, "tandem: rank 0: SyncBatchNorm::weight: affine is off"));
  });
}
