// tandem::SyncBatchNorm in a tandem::Join (ddp/join.hpp) on LocalComm ranks (threads): ranks
// with different batch sizes and numbers of steps; those out of data shadow the forward and
// backward with an empty batch. Every step's outputs, input gradients and the running statistics
// equal one rank normalising the real samples of that step alone (the ranks out of data count
// for nothing), num_batches_tracked counts every step on every rank, and a step whose real
// samples are too few is an Error on every rank, the shadowing ones included.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "support/collective_suite.hpp"
#include "support/mlp.hpp"
#include "support/runners.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/ddp/join.hpp"
#include "tandem/nn/sync_batch_norm.hpp"

namespace {

using tandem::LocalComm;
using tandem::Shape;
using tandem::View;
using tandem::test::Failures;
using Norm = tandem::SyncBatchNorm<LocalComm>;

constexpr std::int64_t channels = 3;
constexpr std::int64_t inner = 2;

/// Rank r: 1 + r samples a step (rank 0 alone would be too few), 2 + 2r steps.
std::size_t samples_of(int r) {
  return 1 + static_cast<std::size_t>(r);
}
std::size_t steps_of(int r) {
  return 2 + 2 * static_cast<std::size_t>(r);
}

/// Rank r's input (or, with `which` 1, the output gradient) at step s: samples_of(r) x C x inner.
std::vector<float> data(int r, std::size_t s, int which) {
  std::vector<float> x(samples_of(r) * channels * inner);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = 2.0f * tandem::test::hashed_unit(static_cast<std::uint64_t>(r), s, i,
                                            static_cast<std::uint64_t>(which)) +
           static_cast<float>(which == 0 ? i % channels : 0);
  }
  return x;
}

Shape shape_of(std::size_t n) {
  return Shape{static_cast<std::int64_t>(n), channels, inner};
}

/// What one rank saw: each step's output and input gradient, then the running statistics.
struct Seen {
  std::vector<std::vector<float>> outputs, input_grads;
  std::vector<float> running_mean, running_var;
  std::int64_t tracked = 0;
};

/// One rank alone (LocalComm of 1: plain batch norm) over each step's samples of the ranks with
/// data, concatenated in rank order; returns, per rank, its rows of each step.
std::vector<Seen> reference(int n) {
  std::vector<Seen> seen(static_cast<std::size_t>(n));
  tandem::run_local(1, [&](LocalComm& alone) {
    Norm bn(alone, channels, {.momentum = 0.3});
    for (std::size_t s = 0; s < steps_of(n - 1); ++s) {
      std::vector<float> x, dy;
      std::size_t total = 0;
      for (int r = 0; r < n; ++r) {
        if (s >= steps_of(r)) continue;
        const auto xr = data(r, s, 0);
        const auto dyr = data(r, s, 1);
        x.insert(x.end(), xr.begin(), xr.end());
        dy.insert(dy.end(), dyr.begin(), dyr.end());
        total += samples_of(r);
      }
      std::vector<float> y(x.size()), dx(x.size());
      bn.forward(View<const float>(x.data(), shape_of(total)),
                 View<float>(y.data(), shape_of(total)));
      bn.backward(View<const float>(x.data(), shape_of(total)),
                  View<const float>(dy.data(), shape_of(total)),
                  View<float>(dx.data(), shape_of(total)));
      std::size_t at = 0;
      for (int r = 0; r < n; ++r) {
        if (s >= steps_of(r)) continue;
        const std::size_t count = samples_of(r) * channels * inner;
        auto& mine = seen[static_cast<std::size_t>(r)];
        mine.outputs.emplace_back(y.begin() + static_cast<std::ptrdiff_t>(at),
                                  y.begin() + static_cast<std::ptrdiff_t>(at + count));
        mine.input_grads.emplace_back(dx.begin() + static_cast<std::ptrdiff_t>(at),
                                      dx.begin() + static_cast<std::ptrdiff_t>(at + count));
        at += count;
      }
    }
    for (auto& mine : seen) {
      mine.running_mean.assign(bn.running_mean().begin(), bn.running_mean().end());
      mine.running_var.assign(bn.running_var().begin(), bn.running_var().end());
      mine.tracked = bn.num_batches_tracked();
    }
  });
  return seen;
}

double worst(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double w = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    w = std::max(w, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  }
  return w;
}

}  // namespace

TEST_CASE("SyncBatchNorm in a Join: the statistics of the real samples only, on every rank") {
  for (int n = 2; n <= 4; ++n) {
    CAPTURE(n);
    const auto expected = reference(n);
    Failures failures;
    tandem::test::LocalRunner{}(n, [&](LocalComm& comm) {
      const int me = comm.rank();
      Norm bn(comm, channels, {.momentum = 0.3});
      tandem::Join join(bn);
      Seen mine;
      for (std::size_t s = 0; s < steps_of(me); ++s) {
        join.step([&] {
          const auto x = data(me, s, 0);
          const auto dy = data(me, s, 1);
          const auto shape = shape_of(samples_of(me));
          std::vector<float> y(x.size()), dx(x.size());
          bn.forward(View<const float>(x.data(), shape), View<float>(y.data(), shape));
          bn.backward(View<const float>(x.data(), shape), View<const float>(dy.data(), shape),
                      View<float>(dx.data(), shape));
          mine.outputs.push_back(y);
          mine.input_grads.push_back(dx);
        });
      }
      join.finish();
      // Statistics in double, each output rounded once: within a few float ulps of values < 8.
      constexpr double tolerance = 1e-5;
      const auto& want = expected[static_cast<std::size_t>(me)];
      const std::string where = "rank " + std::to_string(me) + " of " + std::to_string(n) + ": ";
      for (std::size_t s = 0; s < mine.outputs.size(); ++s) {
        const double w = std::max(worst(mine.outputs[s], want.outputs[s]),
                                  worst(mine.input_grads[s], want.input_grads[s]));
        failures.expect(w <= tolerance, where, "step ", s, " differs by ", w);
      }
      const std::vector<float> mean(bn.running_mean().begin(), bn.running_mean().end());
      const std::vector<float> var(bn.running_var().begin(), bn.running_var().end());
      const double w = std::max(worst(mean, want.running_mean), worst(var, want.running_var));
      failures.expect(w <= tolerance, where, "running statistics differ by ", w);
      failures.expect(bn.num_batches_tracked() == want.tracked, where, "num_batches_tracked ",
                      bn.num_batches_tracked(), ", expected ", want.tracked);
    });
    failures.report();
  }
}

TEST_CASE("SyncBatchNorm in a Join: too few real samples is an Error on every rank") {
  // Rank 1 alone has data at the second step, one sample: rank 0, shadowing, raises too.
  Failures failures;
  tandem::test::LocalRunner{}(2, [&](LocalComm& comm) {
    const int me = comm.rank();
    Norm bn(comm, channels);
    std::string text;
    {
      tandem::Join join(bn);
      try {
        for (int s = 0; s < 1 + me; ++s) {
          join.step([&] {
            // One value per channel (no inner dimensions) from each rank with data.
            const Shape one{1, channels};
            std::vector<float> x(channels, static_cast<float>(s + me)), y(x.size());
            bn.forward(View<const float>(x.data(), one), View<float>(y.data(), one));
          });
        }
        join.finish();
      } catch (const tandem::Error& e) {
        text = e.what();
      }
    }
    failures.expect(text.find("expected more than 1 value per channel") != std::string::npos &&
                        text.find("got 1 across 2 ranks") != std::string::npos,
                    "rank ", me, ": ", text);
    comm.barrier();
  });
  failures.report();
}
