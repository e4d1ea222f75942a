// The tandem::Join suite (ddp/join.hpp): deliberately uneven data on every host backend. Rank r
// runs 5 + 3r steps (or micro-batches); the ranks that run out shadow the others. Checked against
// a single process that steps through the same global schedule, each step averaging the ranks
// with data (the others contribute zeros, divided by the initial world size or by the ranks with
// data): bit for bit where the sums add in the same order (LocalComm, or 2 ranks on any
// backend), within 1e-6 otherwise; every rank ends with the same parameters, buffers and
// optimizer state, bit for bit. Plus SyncBatchNorm between DDP buckets (statistics of real
// samples only), ZeRO, and the misuse errors. Included by ddp_suite.hpp; same Runner contract.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "ddp_suite.hpp"
#include "join_errors.hpp"
#include "support/collective_suite.hpp"
#include "support/mlp.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/ddp/join.hpp"
#include "tandem/nn/sync_batch_norm.hpp"
#include "tandem/optim/sgd.hpp"

namespace tandem::test::ddp {

/// The uneven schedule: rank r has base + extra * r micro-batches; every `micro`-th (the last
/// of each cycle) synchronises gradients and steps, the others accumulate under no_sync().
struct Uneven {
  std::size_t base = 5;
  std::size_t extra = 3;
  std::size_t micro = 1;
  bool by_initial_world_size = true;

  [[nodiscard]] std::size_t batches(int rank) const {
    return base + extra * static_cast<std::size_t>(rank);
  }
  [[nodiscard]] bool active(int rank, std::size_t m) const { return m < batches(rank); }
  [[nodiscard]] bool syncs(std::size_t m) const { return (m + 1) % micro == 0; }
};

/// What a Join run ends with, per rank or from the reference.
struct JoinResult {
  std::vector<float> values, buffers;
};

inline const std::vector<std::size_t> join_widths{6, 12, 10, 3};
constexpr std::size_t join_per_rank = 4;
constexpr float join_lr = 0.05f;

/// The single-process reference of check_join: the model (seed 100, rank 0's), SGD with momentum
/// 0.9, and per synchronising micro-batch m the sum in rank order (LocalComm's) of each rank's
/// accumulated gradient divided as DDP divides it, zero for the ranks without data. The buffers
/// (the Mlp's running mean, updated by each forward) follow the rank they are broadcast from:
/// the lowest rank with data at the next micro-batch, in the end the lowest of the last.
inline JoinResult join_reference(int n, const Uneven& u) {
  Mlp<float> reference(join_widths, 100);
  optim::SGD<float> opt(reference.params(), {.lr = join_lr, .momentum = 0.9});
  std::vector<Mlp<float>> ranks;
  for (int r = 0; r < n; ++r) ranks.emplace_back(join_widths, 100);
  std::size_t total = 0;
  for (int r = 0; r < n; ++r) total = std::max(total, u.batches(r));
  std::vector<float> buffers(reference.params().buffer_values().begin(),
                             reference.params().buffer_values().end());
  for (std::size_t m = 0; m < total; ++m) {
    int next_root = -1;
    for (int r = 0; r < n && next_root < 0; ++r) {
      if (u.active(r, m + 1)) next_root = r;
    }
    for (int r = 0; r < n && next_root < 0; ++r) {
      if (u.active(r, m)) next_root = r;
    }
    std::vector<float> next_buffers = buffers;
    for (int r = 0; r < n; ++r) {
      auto& model = ranks[static_cast<std::size_t>(r)];
      if (m % u.micro == 0) {
        std::ranges::copy(reference.params().values(), model.params().values().begin());
        model.params().zero_grad();
      }
      if (!u.active(r, m)) continue;
      std::ranges::copy(buffers, model.params().buffer_values().begin());
      model.forward_backward(make_batch(7, m, join_per_rank * static_cast<std::size_t>(r),
                                        join_per_rank, model.inputs(), model.outputs()),
                             1.0 / static_cast<double>(join_per_rank));
      if (r == next_root) {
        next_buffers.assign(model.params().buffer_values().begin(),
                            model.params().buffer_values().end());
      }
    }
    buffers = next_buffers;
    if (!u.syncs(m)) continue;
    int with_data = 0;
    for (int r = 0; r < n; ++r) with_data += u.active(r, m) ? 1 : 0;
    const float divisor = static_cast<float>(u.by_initial_world_size ? n : with_data);
    auto grads = reference.params().grads();
    for (std::size_t i = 0; i < grads.size(); ++i) {
      float sum = 0.0f;
      for (int r = 0; r < n; ++r) {
        const float g =
            u.active(r, m) ? ranks[static_cast<std::size_t>(r)].params().grads()[i] : 0.0f;
        const float contribution = divisor == 1.0f ? g : g / divisor;
        sum = r == 0 ? contribution : sum + contribution;
      }
      grads[i] = sum;
    }
    opt.step();
  }
  return {{reference.params().values().begin(), reference.params().values().end()}, buffers};
}

/// The largest |a[i] - b[i]|, or infinity when the sizes differ.
inline double worst_difference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  }
  return worst;
}

/// Uneven data through a Join with DistributedDataParallel<Comm, Policies...> and SGD stepped by
/// ddp.step(opt): the reference's parameters and buffers, the same bits on every rank (momentum
/// included: the ranks out of data replay the steps), and the steps each rank ran and shadowed.
template <class Comm, class... Policies, class Runner>
std::size_t check_join(Runner& run, int n, Uneven u = {}) {
  using Ddp = DistributedDataParallel<Comm, Policies...>;
  constexpr bool compressed = detail::ddp_config<Policies...>::compressed;
  // compress<W>: every gradient travels in 16 bits (see check_compression's bound); ~2^-11
  // relative per step over <= 14 steps of lr 0.05 stays below 5e-3 on parameters below 1.
  const bool bitwise = !compressed && (std::is_same_v<Comm, LocalComm> || n <= 2);
  const double tolerance = compressed ? 5e-3 : 1e-6;
  const JoinResult expected = join_reference(n, u);
  std::size_t total = 0;
  for (int r = 0; r < n; ++r) total = std::max(total, u.batches(r));
  Failures failures;
  run(n, [&](Comm& comm) {
    const int me = comm.rank();
    Mlp<float> model(join_widths, 100 + static_cast<std::uint64_t>(me));  // rank 0's wins
    Ddp ddp(comm, model.params());
    optim::SGD<float> opt(model.params(), {.lr = join_lr, .momentum = 0.9});
    ddp.shard(opt);  // ZeRO: this rank's parts only (nothing without a shard policy)
    Join join(JoinOptions{.divide_by_initial_world_size = u.by_initial_world_size}, ddp);
    for (std::size_t m = 0; m < u.batches(me); ++m) {
      std::optional<typename Ddp::NoSyncGuard> guard;
      if (!u.syncs(m)) guard.emplace(ddp.no_sync());
      join.step([&] {
        if (m % u.micro == 0) opt.zero_grad();
        ddp.before_forward();
        const auto batch = make_batch(7, m, join_per_rank * static_cast<std::size_t>(me),
                                      join_per_rank, model.inputs(), model.outputs());
        model.forward_backward(batch, 1.0 / static_cast<double>(join_per_rank),
                               [&](auto& p) { ddp.grad_ready(p); });
        ddp.finish_gradient_sync();
        if (u.syncs(m)) ddp.step(opt);
      });
    }
    join.finish();

    const std::string where = "rank " + std::to_string(me) + " of " + std::to_string(n) + " (" +
                              policy_name<Policies...>() + ", micro " + std::to_string(u.micro) +
                              (u.by_initial_world_size ? "" : ", divided by ranks with data") +
                              "): ";
    failures.expect(
        join.own_steps() == u.batches(me) && join.shadowed_steps() == total - u.batches(me), where,
        "ran ", join.own_steps(), " and shadowed ", join.shadowed_steps(), " steps of ", total);
    const JoinResult mine{
        {model.params().values().begin(), model.params().values().end()},
        {model.params().buffer_values().begin(), model.params().buffer_values().end()}};
    for (const auto* part : {&mine.values, &mine.buffers}) {
      const auto all = gather_all<Comm, float>(comm, View<const float>(part->data(), part->size()));
      failures.expect(bitwise_same_chunks(all, part->size()), where,
                      part == &mine.values ? "parameters" : "buffers", " differ across ranks");
    }
    const auto state = opt.state_dict();
    std::vector<float> momentum;
    for (const auto& [index, entry] : state.state) {
      const auto& buffer = entry.tensors.at("momentum_buffer");
      momentum.insert(momentum.end(), buffer.begin(), buffer.end());
    }
    const auto all_momentum =
        gather_all<Comm, float>(comm, View<const float>(momentum.data(), momentum.size()));
    failures.expect(bitwise_same_chunks(all_momentum, momentum.size()), where,
                    "momentum differs across ranks (a rank out of data did not replay a step)");
    const double worst = std::max(worst_difference(mine.values, expected.values),
                                  worst_difference(mine.buffers, expected.buffers));
    if (bitwise) {
      failures.expect(mine.values == expected.values && mine.buffers == expected.buffers, where,
                      "not the reference's bits: worst difference ", worst);
    }
    failures.expect(worst <= tolerance, where, "differs from the reference by ", worst, " > ",
                    tolerance);
  });
  failures.report();
  return failures.count();
}

// --- SyncBatchNorm between DDP's buckets -------------------------------------------------------

/// x (N x 3) -> fc0 (3 -> 4) -> SyncBatchNorm(4) -> tanh -> fc1 (4 -> 2), loss = 0.5 |f - y|^2 /
/// 4 per sample, in double, over one arena (the norm's weight, bias and running statistics
/// included). The backward marks fc1, then runs the norm's backward (a collective), then marks
/// the norm and fc0: with a bucket per parameter, the norm's collectives fall between buckets.
template <class Comm>
struct BnNet {
  static constexpr std::size_t in = 3, channels = 4, out = 2;
  Parameters<double> params;
  Parameters<double>::Parameter& w0 = params.add("fc0.weight", {channels, in});
  Parameters<double>::Parameter& b0 = params.add("fc0.bias", {channels});
  SyncBatchNorm<Comm, double> bn;
  Parameters<double>::Parameter& w1 = params.add("fc1.weight", {out, channels});
  Parameters<double>::Parameter& b1 = params.add("fc1.bias", {out});

  explicit BnNet(Comm& comm) : bn(comm, params, "bn.", channels, {.momentum = 0.2}) {
    params.finalize();
    bn.reset_parameters();
    for (auto* p : {&w0, &b0, &w1, &b1}) {
      auto v = p->value();
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.5 * hashed_unit(3, p->index(), 0, i);
    }
  }

  /// Samples [first, first + count) of micro-batch m.
  static std::vector<double> inputs(std::size_t m, std::size_t first, std::size_t count) {
    std::vector<double> x(count * in);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = hashed_unit(11, m, first * in + i, 0);
    return x;
  }

  template <class Ready>
  void forward_backward(const std::vector<double>& x, Ready&& ready) {
    const std::size_t n = x.size() / in;
    const Shape shape{static_cast<std::int64_t>(n), static_cast<std::int64_t>(channels)};
    std::vector<double> h(n * channels), z(n * channels), o(n * out);
    for (std::size_t s = 0; s < n; ++s) {
      for (std::size_t c = 0; c < channels; ++c) {
        double sum = b0.value()[c];
        for (std::size_t i = 0; i < in; ++i) sum += w0.value()[c * in + i] * x[s * in + i];
        h[s * channels + c] = sum;
      }
    }
    bn.forward(View<const double>(h.data(), shape), View<double>(z.data(), shape));
    for (auto& v : z) v = std::tanh(v);
    std::vector<double> delta(n * out);
    for (std::size_t s = 0; s < n; ++s) {
      for (std::size_t k = 0; k < out; ++k) {
        double sum = b1.value()[k];
        for (std::size_t c = 0; c < channels; ++c)
          sum += w1.value()[k * channels + c] * z[s * channels + c];
        delta[s * out + k] = (sum - std::sin(x[s * in] + static_cast<double>(k))) / 4.0;
      }
    }
    std::vector<double> dz(n * channels, 0.0);
    for (std::size_t s = 0; s < n; ++s) {
      for (std::size_t k = 0; k < out; ++k) {
        const double d = delta[s * out + k];
        b1.grad()[k] += d;
        for (std::size_t c = 0; c < channels; ++c) {
          w1.grad()[k * channels + c] += d * z[s * channels + c];
          dz[s * channels + c] += d * w1.value()[k * channels + c];
        }
      }
    }
    ready(w1);
    ready(b1);
    for (std::size_t i = 0; i < dz.size(); ++i) dz[i] *= 1.0 - z[i] * z[i];
    bn.backward(View<const double>(h.data(), shape), View<const double>(dz.data(), shape),
                View<double>(dz.data(), shape));
    ready(params["bn.weight"]);
    ready(params["bn.bias"]);
    for (std::size_t s = 0; s < n; ++s) {
      for (std::size_t c = 0; c < channels; ++c) {
        b0.grad()[c] += dz[s * channels + c];
        for (std::size_t i = 0; i < in; ++i)
          w0.grad()[c * in + i] += dz[s * channels + c] * x[s * in + i];
      }
    }
    ready(w0);
    ready(b0);
  }
};

/// Rank r has 2 + r samples per step and 3 + 2r steps. The reference: one rank (SyncBatchNorm
/// then normalises alone) over each step's samples of the ranks with data, gradient / n. Double
/// throughout: the regrouped sums agree within 1e-10. The running statistics count real samples
/// only, and num_batches_tracked every step of the slowest rank, on every rank.
template <class Comm, class... Policies, class Runner>
std::size_t check_join_batch_norm(Runner& run, int n) {
  const Uneven u{.base = 3, .extra = 2};
  auto samples = [](int r) { return 2 + static_cast<std::size_t>(r); };
  auto first = [&](int r) {
    std::size_t f = 0;
    for (int q = 0; q < r; ++q) f += samples(q);
    return f;
  };
  std::size_t total = 0;
  for (int r = 0; r < n; ++r) total = std::max(total, u.batches(r));
  std::vector<double> expected_values, expected_buffers;
  run_local(1, [&](LocalComm& alone) {
    BnNet<LocalComm> net(alone);
    optim::SGD<double> opt(net.params, {.lr = 0.1, .momentum = 0.5});
    for (std::size_t m = 0; m < total; ++m) {
      std::vector<double> x;
      for (int r = 0; r < n; ++r) {
        if (!u.active(r, m)) continue;
        const auto part = BnNet<LocalComm>::inputs(m, first(r), samples(r));
        x.insert(x.end(), part.begin(), part.end());
      }
      opt.zero_grad();
      net.forward_backward(x, [](auto&) {});
      for (auto& g : net.params.grads()) g /= static_cast<double>(n);
      opt.step();
    }
    expected_values.assign(net.params.values().begin(), net.params.values().end());
    expected_buffers.assign(net.params.buffer_values().begin(), net.params.buffer_values().end());
  });
  Failures failures;
  run(n, [&](Comm& comm) {
    const int me = comm.rank();
    BnNet<Comm> net(comm);
    DistributedDataParallel<Comm, bucket_cap<sizeof(double)>, Policies...> ddp(comm, net.params);
    optim::SGD<double> opt(net.params, {.lr = 0.1, .momentum = 0.5});
    ddp.shard(opt);
    Join join(ddp, net.bn);
    for (std::size_t m = 0; m < u.batches(me); ++m) {
      join.step([&] {
        opt.zero_grad();
        ddp.before_forward();
        net.forward_backward(BnNet<Comm>::inputs(m, first(me), samples(me)),
                             [&](auto& p) { ddp.grad_ready(p); });
        ddp.finish_gradient_sync();
        ddp.step(opt);
      });
    }
    join.finish();
    const std::string where =
        "SyncBatchNorm in a Join, rank " + std::to_string(me) + " of " + std::to_string(n) + ": ";
    double worst = 0.0;
    const auto values = net.params.values();
    const auto buffers = net.params.buffer_values();
    for (std::size_t i = 0; i < values.size(); ++i) {
      worst = std::max(worst, std::abs(values[i] - expected_values[i]));
    }
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      worst = std::max(worst, std::abs(buffers[i] - expected_buffers[i]));
    }
    failures.expect(worst <= 1e-10, where, "differs from one rank over the real samples by ",
                    worst);
    failures.expect(net.bn.num_batches_tracked() == static_cast<std::int64_t>(total), where,
                    "num_batches_tracked ", net.bn.num_batches_tracked(), ", expected ", total);
    const auto all =
        gather_all<Comm, double>(comm, View<const double>(values.data(), values.size()));
    failures.expect(bitwise_same_chunks(all, values.size()), where,
                    "parameters differ across ranks");
  });
  failures.report();
  return failures.count();
}

// --- groups of checks ----------------------------------------------------------------------

/// For n = 1 .. max_ranks: the uneven schedule under the default policies, sync_at_end, a bucket
/// per few parameters, the division by the ranks with data, gradient accumulation (two
/// micro-batches a step; rank 0 runs out in the middle of a cycle), compress<half>, ZeRO.
template <class Comm, class Runner>
std::size_t check_joins(Runner& run, int max_ranks) {
  return over_group_sizes(max_ranks, [&](int n) {
    return std::vector<std::size_t>{
        check_join<Comm>(run, n),
        check_join<Comm, sync_at_end>(run, n),
        check_join<Comm, first_bucket_cap<64>, bucket_cap<256>>(run, n),
        check_join<Comm>(run, n, {.by_initial_world_size = false}),
        check_join<Comm, bucket_cap<256>>(run, n, {.micro = 2}),
        check_join<Comm, compress<half>>(run, n),
        check_join<Comm, shard<2>, bucket_cap<256>>(run, n, {.micro = 2})};
  });
}

/// SyncBatchNorm between the buckets (plain DDP and shard<2>), and the misuse errors, for
/// n = 2 .. max_ranks.
template <class Comm, class Runner>
std::size_t check_join_norms_and_errors(Runner& run, int max_ranks) {
  return over_group_sizes(max_ranks, [&](int n) {
    if (n < 2) return std::vector<std::size_t>{};
    return std::vector<std::size_t>{check_join_batch_norm<Comm>(run, n),
                                    check_join_batch_norm<Comm, shard<2>>(run, n),
                                    check_join_errors<Comm>(run, n)};
  });
}

}  // namespace tandem::test::ddp
