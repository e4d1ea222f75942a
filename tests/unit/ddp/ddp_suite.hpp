// The DistributedDataParallel suite: the same checks on every host backend. Each check takes a
// Runner: run(n, fn) calls fn(comm) on every rank of a fresh group of n ranks (threads or
// processes) and returns when all have ended; run.max_ranks() is the largest n it can make.
// Ranks record what is wrong in a Failures list (doctest assertions are not thread-safe); the
// caller CHECKs it.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "support/collective_suite.hpp"
#include "support/mlp.hpp"
#include "tandem/core/units.hpp"
#include "tandem/ddp/ddp.hpp"

namespace tandem::test::ddp {

using namespace tandem::literals;

inline const std::vector<std::size_t> mlp_widths{6, 12, 10, 3};

/// Every rank's copy of `mine` (same size on all ranks), rank after rank.
template <class Comm, class T>
std::vector<T> gather_all(Comm& comm, View<const T> mine) {
  std::vector<T> all(mine.size() * static_cast<std::size_t>(comm.size()));
  comm.all_gather(mine, all);
  return all;
}

/// Whether every rank's chunk of `all` has the same bits as rank 0's.
template <class T>
bool bitwise_same_chunks(const std::vector<T>& all, std::size_t chunk) {
  for (std::size_t r = 1; chunk && r < all.size() / chunk; ++r) {
    if (std::memcmp(all.data(), all.data() + r * chunk, chunk * sizeof(T)) != 0) return false;
  }
  return true;
}

inline std::string where(int rank, int n, const char* what) {
  return std::string(what) + " (rank " + std::to_string(rank) + " of " + std::to_string(n) + ")";
}

template <class... Policies>
std::string policy_name() {
  using config = detail::ddp_config<Policies...>;
  return std::string(config::overlapped ? "overlap" : "sync_at_end") +
         (config::compressed ? ", compressed" : "") + ", bucket cap " +
         std::to_string(config::bucket_cap_bytes) + " B";
}

// --- the DDP theorem ----------------------------------------------------------------------------

/// N ranks with batch b each, averaging, reach the same parameters after K SGD steps as 1 rank
/// with batch N*b; after every step the ranks' parameters are bitwise identical.
///
/// Tolerance, 1e-6 absolute: both sides compute the same float sums over the N*b samples, only
/// grouped differently (per rank, then divided by N, then summed across ranks; N = 2, 4 divide
/// exactly, N = 3 rounds once). A gradient element sums at most 16 products of O(1) terms, so the
/// regrouping moves it by at most ~16 * 2^-24 of the magnitudes summed (~1e-6 |g|, |g| < 1);
/// over K = 4 steps of lr = 0.1 that is <= 4 * 0.1 * 1e-6 = 4e-7 in the parameters, plus one
/// rounding of each update per step (K ulps of parameters < 0.5: 4 * 3e-8 = 1.2e-7) - below
/// 1e-6. Measured: 3e-8 (one ulp) for N = 2..4. A missing division by N or a dropped bucket moves
/// the parameters by ~lr * |g| ~ 1e-2. With N = 1 nothing is regrouped: bitwise equal.
template <class Comm, class... Policies, class Runner>
std::size_t check_theorem(Runner& run, int n, std::size_t steps = 4) {
  constexpr std::size_t per_rank = 4;
  constexpr float lr = 0.1f;
  constexpr double tolerance = 1e-6;
  Failures failures;

  // The reference: one rank, batch n * per_rank, no communication.
  Mlp<float> reference(mlp_widths, 100);
  for (std::size_t k = 0; k < steps; ++k) {
    reference.params().zero_grad();
    const auto batch = make_batch(7, k, 0, per_rank * static_cast<std::size_t>(n),
                                  reference.inputs(), reference.outputs());
    reference.forward_backward(batch, 1.0 / static_cast<double>(batch.count));
    reference.sgd_step(lr);
  }
  const std::vector<float> expected(reference.params().values().begin(),
                                    reference.params().values().end());

  run(n, [&](Comm& comm) {
    const int me = comm.rank();
    Mlp<float> model(mlp_widths, 100 + static_cast<std::uint64_t>(me));  // rank 0's wins
    DistributedDataParallel<Comm, Policies...> ddp(comm, model.params());
    for (std::size_t k = 0; k < steps; ++k) {
      model.params().zero_grad();
      ddp.before_forward();
      const auto batch = make_batch(7, k, per_rank * static_cast<std::size_t>(me), per_rank,
                                    model.inputs(), model.outputs());
      model.forward_backward(batch, 1.0 / static_cast<double>(per_rank),
                             [&](auto& p) { ddp.grad_ready(p); });
      ddp.finish_gradient_sync();
      model.sgd_step(lr);
      const auto values = gather_all<Comm, float>(comm, model.params().values());
      failures.expect(bitwise_same_chunks(values, model.params().numel()),
                      where(me, n, "parameters differ across ranks after step "), k);
    }
    ddp.before_forward();
    const auto buffers = gather_all<Comm, float>(comm, model.params().buffer_values());
    failures.expect(bitwise_same_chunks(buffers, model.params().buffer_numel()),
                    where(me, n, "buffers differ across ranks after before_forward()"));

    auto values = model.params().values();
    double worst = 0.0;
    for (std::size_t i = 0; i < values.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(values[i]) - expected[i]));
    }
    if (n == 1) {
      failures.expect(std::equal(values.begin(), values.end(), expected.begin()),
                      where(me, n, "one rank differs from the reference: worst "), worst);
    }
    failures.expect(worst <= tolerance, where(me, n, "parameters differ from 1 rank x batch "),
                    per_rank * static_cast<std::size_t>(n), " by ", worst, " > ", tolerance, " (",
                    policy_name<Policies...>(), ")");
  });
  failures.report();
  return failures.count();
}

// --- no_sync ------------------------------------------------------------------------------------

/// M micro-batches, the first M - 1 under no_sync(), equal one step on the concatenated batch of
/// every rank's micro-batches (tolerance: as for the theorem, with one step over at most 36
/// samples); no communication happens under the guard.
template <class Comm, class... Policies, class Runner>
std::size_t check_no_sync(Runner& run, int n) {
  constexpr std::size_t per_micro = 3;
  constexpr std::size_t micro = 3;
  constexpr float lr = 0.1f;
  const std::size_t total = per_micro * micro * static_cast<std::size_t>(n);
  Failures failures;

  // Rank r's micro-batch m is samples [(r * micro + m) * per_micro, ...) of the stream.
  Mlp<float> reference(mlp_widths, 5);
  reference.forward_backward(make_batch(11, 0, 0, total, reference.inputs(), reference.outputs()),
                             1.0 / static_cast<double>(total));
  reference.sgd_step(lr);
  const std::vector<float> expected(reference.params().values().begin(),
                                    reference.params().values().end());

  run(n, [&](Comm& comm) {
    const int me = comm.rank();
    Mlp<float> model(mlp_widths, 5);
    DistributedDataParallel<Comm, Policies...> ddp(comm, model.params());
    const double scale = 1.0 / static_cast<double>(per_micro * micro);
    auto micro_batch = [&](std::size_t m) {
      ddp.before_forward();
      const auto batch = make_batch(11, 0, (static_cast<std::size_t>(me) * micro + m) * per_micro,
                                    per_micro, model.inputs(), model.outputs());
      model.forward_backward(batch, scale, [&](auto& p) { ddp.grad_ready(p); });
      ddp.finish_gradient_sync();
    };
    {
      auto guard = ddp.no_sync();
      for (std::size_t m = 0; m + 1 < micro; ++m) {
        micro_batch(m);
        failures.expect(ddp.buckets_launched() == 0,
                        where(me, n, "a bucket was launched under no_sync()"));
      }
    }
    if (n > 1) {
      // Still local: every rank's accumulated gradient is its own.
      const auto grads = gather_all<Comm, float>(comm, model.params().grads());
      failures.expect(!bitwise_same_chunks(grads, model.params().numel()),
                      where(me, n, "gradients were reduced under no_sync()"));
    }
    micro_batch(micro - 1);
    model.sgd_step(lr);
    auto values = model.params().values();
    double worst = 0.0;
    for (std::size_t i = 0; i < values.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(values[i]) - expected[i]));
    }
    failures.expect(worst <= 1e-6, where(me, n, "no_sync accumulation differs from one step by "),
                    worst, " (", policy_name<Policies...>(), ")");
    const auto all = gather_all<Comm, float>(comm, model.params().values());
    failures.expect(bitwise_same_chunks(all, model.params().numel()),
                    where(me, n, "parameters differ across ranks after no_sync accumulation"));
  });
  failures.report();
  return failures.count();
}

// --- unused parameters, marking order, marking twice, bucket caps -----------------------------

/// Gradient element i of parameter p on rank r: small integers times n, so that the mean over
/// ranks is exact in every element type.
inline float exact_grad(int rank, int n, std::size_t p, std::size_t i) {
  return static_cast<float>(
      n * (static_cast<int>((static_cast<std::size_t>(rank) * 3 + p * 5 + i * 7) % 9) - 4));
}

/// The arena of check_exact_reduction's set-up: parameter "p<i>" of sizes[i] elements, a buffer.
template <class T>
void add_exact_reduction_params(Parameters<T>& params, const std::vector<std::int64_t>& sizes) {
  for (std::size_t p = 0; p < sizes.size(); ++p) params.add("p" + std::to_string(p), {sizes[p]});
  params.add_buffer("stats", {2});
  params.finalize();
}

/// Parameters of `sizes`; parameter 1 is unused on odd ranks, the last on every rank; the ranks
/// mark in different orders. The unused ones hold garbage that must count as zero. The reduced
/// gradient is the exact mean (or sum), bitwise identical on every rank.
template <class T, class Comm, class... Policies, class Runner>
std::size_t check_exact_reduction(Runner& run, int n, const std::vector<std::int64_t>& sizes) {
  using config = detail::ddp_config<Policies...>;
  Failures failures;
  run(n, [&](Comm& comm) {
    const int me = comm.rank();
    Parameters<T> params;
    add_exact_reduction_params(params, sizes);
    DistributedDataParallel<Comm, Policies...> ddp(comm, params);
    const std::size_t last = sizes.size() - 1;
    auto unused_here = [&](int rank, std::size_t p) {
      return p == last || (p == 1 && rank % 2 == 1);
    };
    for (int step = 0; step < 2; ++step) {
      params.zero_grad();
      ddp.before_forward();
      std::vector<std::size_t> order(sizes.size());
      for (std::size_t p = 0; p < order.size(); ++p) order[p] = p;
      std::rotate(order.begin(), order.begin() + (me + step) % static_cast<int>(order.size()),
                  order.end());
      if (me % 2 == 1) std::reverse(order.begin(), order.end());
      for (auto p : order) {
        auto& param = params["p" + std::to_string(p)];
        auto g = param.grad();
        for (std::size_t i = 0; i < g.size(); ++i) {
          g[i] = unused_here(me, p) ? T(1000.0f) : T(exact_grad(me, n, p, i));
        }
        if (unused_here(me, p)) continue;
        if (p % 2 == 0) {
          ddp.grad_ready(param);
        } else {
          ddp.grad_ready(param.name());
        }
      }
      ddp.finish_gradient_sync();
      for (std::size_t p = 0; p < sizes.size(); ++p) {
        auto g = params["p" + std::to_string(p)].grad();
        for (std::size_t i = 0; i < g.size(); ++i) {
          float want = 0.0f;
          for (int r = 0; r < n; ++r) {
            if (!unused_here(r, p)) want += exact_grad(r, n, p, i);
          }
          if (config::averaged) want /= static_cast<float>(n);
          if (static_cast<float>(g[i]) != want) {
            failures.add(where(me, n, "wrong reduced gradient"), ": p", p, "[", i,
                         "] = ", static_cast<float>(g[i]), ", expected ", want, " (",
                         dtype_traits<T>::name, ", ", policy_name<Policies...>(), ")");
            break;
          }
        }
      }
      const auto all = gather_all<Comm, T>(comm, params.grads());
      failures.expect(bitwise_same_chunks(all, params.numel()),
                      where(me, n, "gradients differ across ranks"));
    }
  });
  failures.report();
  return failures.count();
}

/// Marking a parameter twice is an Error naming it; the step can still be finished, correctly.
template <class Comm, class... Policies, class Runner>
std::size_t check_mark_twice(Runner& run, int n) {
  Failures failures;
  run(n, [&](Comm& comm) {
    const int me = comm.rank();
    Parameters<float> params;
    params.add("encoder.weight", {4});
    params.add("decoder.weight", {3});
    params.finalize();
    DistributedDataParallel<Comm, Policies...> ddp(comm, params);
    for (auto& g : params.grads()) g = static_cast<float>(n);
    ddp.grad_ready("decoder.weight");
    try {
      ddp.grad_ready(params["decoder.weight"]);
      failures.add(where(me, n, "marking twice raised no error"));
    } catch (const Error& e) {
      failures.expect(
          mentions(e.what(), "'decoder.weight'", "twice", "rank " + std::to_string(me) + ":"),
          where(me, n, "unexpected text: "), e.what());
    }
    try {
      ddp.grad_ready("no.such.parameter");
      failures.add(where(me, n, "an unknown name raised no error"));
    } catch (const Error& e) {
      failures.expect(mentions(e.what(), "'no.such.parameter'"), where(me, n, "unexpected text: "),
                      e.what());
    }
    Parameters<float> other;
    auto& stranger = other.add("decoder.weight", {3});
    other.finalize();
    try {
      ddp.grad_ready(stranger);
      failures.add(where(me, n, "a parameter of another arena raised no error"));
    } catch (const Error& e) {
      failures.expect(mentions(e.what(), "is not a trained parameter"),
                      where(me, n, "unexpected text: "), e.what());
    }
    ddp.grad_ready("encoder.weight");
    ddp.finish_gradient_sync();
    for (auto g : params.grads()) {
      failures.expect(g == static_cast<float>(n), where(me, n, "wrong gradient after the error"));
    }
    // The next step starts clean: marking once is fine again.
    ddp.grad_ready("decoder.weight");
    ddp.finish_gradient_sync();
  });
  failures.report();
  return failures.count();
}

/// Ranks that registered different parameters all get an Error naming the first difference and
/// the ranks; nothing hangs.
template <class Comm, class Runner>
std::size_t check_mismatched_registration(Runner& run, int n) {
  REQUIRE(n >= 2);
  std::size_t failed = 0;
  struct Case {
    const char* what;
    std::vector<const char*> expect;
  };
  // On the last rank: 0: a shape differs; 1: a name; 2: an extra parameter; 3: a buffer's shape;
  // 4: the element type; 5: an extra buffer at the end.
  const std::vector<Case> cases{
      {"shape", {"'fc.weight' [2, 3]", "'fc.weight' [3, 2]", "entry 1"}},
      {"name", {"'fc.bias'", "'fc.offset'", "entry 2"}},
      {"parameter count", {"'extra.weight' [5]", "buffer 'bn.mean' [3]", "entry 3"}},
      {"buffer", {"buffer 'bn.mean' [3]", "buffer 'bn.mean' [4]", "entry 3"}},
      {"element type", {"element type float32", "element type float64", "entry 0"}},
      {"buffer count", {"buffer 'bn.count' [1]", " nothing", "entry 4"}},
  };
  for (std::size_t c = 0; c < cases.size(); ++c) {
    Failures failures;
    run(n, [&](Comm& comm) {
      const int me = comm.rank();
      const bool odd_one = me == comm.size() - 1;
      auto build = [&](auto& params) {
        params.add("fc.weight", c == 0 && odd_one ? Shape{3, 2} : Shape{2, 3});
        params.add(c == 1 && odd_one ? "fc.offset" : "fc.bias", {2});
        if (c == 2 && odd_one) params.add("extra.weight", {5});
        params.add_buffer("bn.mean", {c == 3 && odd_one ? 4 : 3});
        if (c == 5 && odd_one) params.add_buffer("bn.count", {1}, BufferKind::integral);
        params.finalize();
      };
      try {
        if (c == 4 && odd_one) {
          Parameters<double> params;
          build(params);
          DistributedDataParallel<Comm> ddp(comm, params);
        } else {
          Parameters<float> params;
          build(params);
          DistributedDataParallel<Comm> ddp(comm, params);
        }
        failures.add(where(me, n, "no error for a mismatched "), cases[c].what);
      } catch (const Error& e) {
        const std::string text = e.what();
        bool all = mentions(text, "rank " + std::to_string(me) + ":", "registered different",
                            "rank " + std::to_string(n - 1) + " has");
        for (const char* part : cases[c].expect) all = all && mentions(text, part);
        failures.expect(all, where(me, n, "unexpected text for a mismatched "), cases[c].what, ": ",
                        text);
      }
      comm.barrier();  // the group is still usable
    });
    failures.report();
    failed += failures.count();
  }
  return failed;
}

/// Buckets: a parameter larger than the cap gets its own bucket, a cap of one element makes one
/// bucket per parameter, and the reduction stays exact through every layout.
template <class Comm, class Runner>
std::size_t check_bucket_caps(Runner& run, int n) {
  // Sizes in elements: a zero-size parameter and one far over the caps below.
  const std::vector<std::int64_t> sizes{3, 1, 0, 100, 2, 5};
  check_exact_reduction<float, Comm, bucket_cap<sizeof(float)>>(run, n, sizes);
  check_exact_reduction<float, Comm, bucket_cap<sizeof(float)>, sync_at_end>(run, n, sizes);
  check_exact_reduction<float, Comm, first_bucket_cap<8>, bucket_cap<16>>(run, n, sizes);
  check_exact_reduction<float, Comm, bucket_cap<1_MiB>, sum>(run, n, sizes);

  Failures failures;
  run(n, [&](Comm& comm) {
    Parameters<float> params;
    for (std::size_t p = 0; p < sizes.size(); ++p) params.add("p" + std::to_string(p), {sizes[p]});
    params.finalize();
    DistributedDataParallel<Comm, bucket_cap<sizeof(float)>> one(comm, params);
    // From the last parameter: {5}, {2}, {100 and the empty one}, {1}, {3}.
    const std::vector<Bucket> expected{
        {106, 5, 5, 6}, {104, 2, 4, 5}, {4, 100, 2, 4}, {3, 1, 1, 2}, {0, 3, 0, 1}};
    failures.expect(one.buckets() == expected, where(comm.rank(), n, "unexpected 1-element plan"));
    DistributedDataParallel<Comm> standard(comm, params);
    failures.expect(standard.buckets().size() == 1,
                    where(comm.rank(), n, "small parameters need one default bucket"));
  });
  failures.report();
  return failures.count();
}

// --- compression --------------------------------------------------------------------------------

/// compress<W>: every reduced element is a W value (the bucket travelled in 16 bits), identical
/// on every rank, within the rounding a 16-bit average allows of the exact float mean:
/// each rank's g/N is rounded once (relative error u = 2^-11 for half, 2^-8 for bfloat16) and the
/// sum of N such terms may round once per addition, so |error| <= (N + 1) u sum_r |g_r| / N, plus
/// N half-ulps of the smallest subnormal for values near zero.
template <class W, class Comm, class... Policies, class Runner>
std::size_t check_compression(Runner& run, int n) {
  const double u = std::is_same_v<W, half> ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
  const double tiny = std::is_same_v<W, half> ? std::ldexp(1.0, -25) : 0.0;
  constexpr std::size_t count = 3000;
  auto grad = [](int rank, std::size_t i) {
    return hashed_unit(static_cast<std::uint64_t>(rank), i, 3, 4) * (i % 3 == 0 ? 1e-3f : 1.0f);
  };
  Failures failures;
  run(n, [&](Comm& comm) {
    const int me = comm.rank();
    Parameters<float> params;
    params.add("big", {static_cast<std::int64_t>(count - 100)});
    params.add("small", {100});
    params.finalize();
    DistributedDataParallel<Comm, compress<W>, first_bucket_cap<256>, bucket_cap<4096>, Policies...>
        ddp(comm, params);
    auto g = params.grads();
    for (std::size_t i = 0; i < count; ++i) g[i] = grad(me, i);
    ddp.grad_ready("small");
    ddp.grad_ready("big");
    ddp.finish_gradient_sync();
    std::size_t bad = 0;
    double worst_ratio = 0.0;
    for (std::size_t i = 0; i < count; ++i) {
      double mean = 0.0;
      double magnitude = 0.0;
      for (int r = 0; r < n; ++r) {
        mean += grad(r, i);
        magnitude += std::abs(static_cast<double>(grad(r, i)));
      }
      // Under sum, nothing is divided: the bound scales with the sum instead of the mean.
      const double divisor = detail::ddp_config<Policies...>::averaged ? n : 1;
      mean /= divisor;
      const double bound = (n + 1) * u * magnitude / divisor + n * tiny;
      const double error = std::abs(static_cast<double>(g[i]) - mean);
      worst_ratio = std::max(worst_ratio, bound > 0 ? error / bound : 0.0);
      if (error > bound || static_cast<float>(W(g[i])) != g[i]) ++bad;
    }
    failures.expect(bad == 0, where(me, n, "compressed elements out of bound or not 16-bit: "), bad,
                    " (worst error/bound ", worst_ratio, ", ", dtype_traits<W>::name, ")");
    const auto all = gather_all<Comm, float>(comm, params.grads());
    failures.expect(bitwise_same_chunks(all, count),
                    where(me, n, "compressed gradients differ across ranks"));
  });
  failures.report();
  return failures.count();
}

// --- groups of checks, for n = 1 .. max_ranks --------------------------------------------------

/// For n = 1 .. max_ranks: the failures counted by the checks each(n) runs, summed. each returns
/// the counts as a braced list, whose elements (unlike the operands of +) run in the order written.
template <class Each>
std::size_t over_group_sizes(int max_ranks, const Each& each) {
  std::size_t failed = 0;
  for (int n = 1; n <= max_ranks; ++n) {
    CAPTURE(n);
    for (const std::size_t count : each(n)) failed += count;
  }
  return failed;
}

template <class Comm, class Runner>
std::size_t check_theorems(Runner& run, int max_ranks) {
  return over_group_sizes(max_ranks, [&](int n) {
    return std::vector<std::size_t>{
        check_theorem<Comm>(run, n), check_theorem<Comm, sync_at_end>(run, n),
        check_theorem<Comm, first_bucket_cap<64>, bucket_cap<256>>(run, n),
        check_theorem<Comm, sync_at_end, bucket_cap<sizeof(float)>>(run, n)};
  });
}

template <class Comm, class Runner>
std::size_t check_no_syncs(Runner& run, int max_ranks) {
  return over_group_sizes(max_ranks, [&](int n) {
    return std::vector<std::size_t>{check_no_sync<Comm>(run, n),
                                    check_no_sync<Comm, sync_at_end, bucket_cap<128>>(run, n)};
  });
}

/// Unused parameters, marking order, float / half / bfloat16 / double, average and sum, caps.
template <class Comm, class Runner>
std::size_t check_reductions(Runner& run, int max_ranks) {
  return over_group_sizes(max_ranks, [&](int n) {
    return std::vector<std::size_t>{
        check_exact_reduction<float, Comm>(run, n, {7, 3, 4, 2}),
        check_exact_reduction<half, Comm, bucket_cap<8>>(run, n, {7, 3, 4, 2}),
        check_exact_reduction<bfloat16, Comm, sync_at_end>(run, n, {7, 3, 4, 2}),
        check_exact_reduction<double, Comm, sum>(run, n, {7, 3, 4, 2}),
        check_exact_reduction<half, Comm, sum, first_bucket_cap<2>, bucket_cap<6>>(run, n,
                                                                                   {7, 3, 4, 2}),
        check_bucket_caps<Comm>(run, n)};
  });
}

template <class Comm, class Runner>
std::size_t check_errors(Runner& run, int max_ranks) {
  return over_group_sizes(max_ranks, [&](int n) {
    return std::vector<std::size_t>{
        check_mark_twice<Comm>(run, n), check_mark_twice<Comm, sync_at_end>(run, n),
        n >= 2 ? check_mismatched_registration<Comm>(run, n) : std::size_t{0}};
  });
}

template <class Comm, class Runner>
std::size_t check_compressions(Runner& run, int max_ranks) {
  return over_group_sizes(max_ranks, [&](int n) {
    return std::vector<std::size_t>{check_compression<half, Comm>(run, n),
                                    check_compression<bfloat16, Comm, sync_at_end>(run, n),
                                    check_compression<half, Comm, sum>(run, n)};
  });
}

}  // namespace tandem::test::ddp

#include "join_suite.hpp"  // the Join cases, over the same runners
