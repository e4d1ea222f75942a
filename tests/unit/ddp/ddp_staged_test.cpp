// DistributedDataParallel over an arena in device memory on host communicators (LocalComm, and
// GlooComm when built with it), without a GPU: the arena lives in support/fake_device.hpp's
// memory space (ordinary memory that host code may not index: a host dereference on DDP's path
// would not compile), DDP's numeric passes run on a fake device executor, and the communicators
// stage the buckets through (fake, counted) pinned memory, as they stage real device tensors.
// The model (tests/support/mlp.hpp) computes on the host; each gradient is copied into the device
// arena as the backward completes it, and the reduced gradients are copied back for the step.
// Checked on 1 to 4 ranks: the DDP theorem and bitwise identical parameters across ranks, each
// rank's result bitwise equal to DDP over a host arena; exact reductions with unused parameters,
// float / half / bfloat16 / double, average and sum, bucket caps, compress<W> (bitwise equal to
// the host arena's); errors; and nothing left in pinned memory. Through the stream-ordering
// contract (comm/stream_order.hpp): on a communicator that orders on the device, DDP's executor
// waits on the host in no step, whichever stream it is on (order_after before each bucket and
// broadcast, hand_back after the broadcasts); on a host communicator, once per bucket and
// broadcast. defer_average_to: the average and
// GradScaler's unscale are one pass, with the two-pass gradients.
#include "support/fake_device_space.hpp"  // first: it specialises templates the headers use

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp_suite.hpp"
#include "support/runners.hpp"
#include "tandem/amp/grad_scaler.hpp"
#include "tandem/comm/local/local.hpp"
#if defined(TANDEM_TEST_GLOO)
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/store.hpp"
#endif

namespace {

using namespace std::chrono_literals;
using tandem::DistributedDataParallel;
using tandem::host;
using tandem::Parameters;
using tandem::View;
using tandem::test::Failures;
using tandem::test::fake_device;
using tandem::test::fake_device_exec;
using tandem::test::staging_counters;
namespace suite = tandem::test::ddp;
using tandem::test::LocalRunner;
#if defined(TANDEM_TEST_GLOO)
using tandem::test::GlooThreadRunner;
#endif

// --- moving data between the host model and the device arena ------------------------------------

/// Ranks run on threads, where doctest's assertions are not safe: a wrong size throws instead.
inline void same_size(std::size_t destination, std::size_t source) {
  if (destination != source) {
    throw tandem::Error("ddp_staged_test", "copy of " + std::to_string(source) + " elements into " +
                                               std::to_string(destination));
  }
}

template <class T>
void to_device(View<T, fake_device> destination, View<T, host> source) {
  same_size(destination.size(), source.size());
  tandem::space_copy<fake_device, host>::copy(destination.data(), source.data(),
                                              source.size_bytes());
}

template <class T>
void to_host(View<T, host> destination, View<T, fake_device> source) {
  same_size(destination.size(), source.size());
  tandem::space_copy<host, fake_device>::copy(destination.data(), source.data(),
                                              source.size_bytes());
}

/// A device arena registered as `like` (names, shapes, buffers), zeroed.
template <class T>
Parameters<T, fake_device> mirror_of(const Parameters<T>& like) {
  Parameters<T, fake_device> arena;
  for (const auto& p : like) arena.add(p.name(), p.shape());
  for (const auto& b : like.buffers()) arena.add_buffer(b.name(), b.shape(), b.kind());
  arena.finalize(fake_device_exec{});
  return arena;
}

/// What one run of a check saw on every rank, rank after rank.
using PerRank = std::vector<std::vector<unsigned char>>;

template <class T>
std::vector<unsigned char> bytes_of(View<T, host> view) {
  std::vector<unsigned char> bytes(view.size_bytes());
  if (!bytes.empty()) std::memcpy(bytes.data(), view.data(), bytes.size());
  return bytes;
}

/// The staging counters move while ranks run; between runs nothing may stay in pinned memory.
void expect_staging_clean(Failures& failures, int n, int to_pinned_before) {
  failures.expect(staging_counters.pinned_live.load() == 0,
                  "pinned memory left allocated: ", staging_counters.pinned_live.load(),
                  " block(s) (", n, " ranks)");
  failures.expect(staging_counters.to_pinned.load() > to_pinned_before,
                  "the device arena was never staged through pinned memory (", n, " ranks)");
}

// --- the DDP theorem ----------------------------------------------------------------------------

/// K SGD steps of the MLP on n ranks with DDP over a host arena (OnDevice false) or a device
/// arena (true): every rank's final parameters. Checks on the way that the ranks' parameters are
/// bitwise identical after every step and that they match 1 rank x batch n*b (as
/// suite::check_theorem, whose tolerance and its justification apply).
template <bool OnDevice, class Comm, class... Policies, class Runner>
PerRank train(Runner& run, int n, Failures& failures) {
  constexpr std::size_t steps = 4;
  constexpr std::size_t per_rank = 4;
  constexpr float lr = 0.1f;
  constexpr double tolerance = 1e-6;
  const char* space = OnDevice ? "device arena" : "host arena";

  tandem::test::Mlp<float> reference(suite::mlp_widths, 100);
  for (std::size_t k = 0; k < steps; ++k) {
    reference.params().zero_grad();
    const auto batch = tandem::test::make_batch(7, k, 0, per_rank * static_cast<std::size_t>(n),
                                                reference.inputs(), reference.outputs());
    reference.forward_backward(batch, 1.0 / static_cast<double>(batch.count));
    reference.sgd_step(lr);
  }
  const auto expected = reference.params().values();

  PerRank results(static_cast<std::size_t>(n));
  run(n, [&](Comm& comm) {
    const int me = comm.rank();
    tandem::test::Mlp<float> model(suite::mlp_widths, 100 + static_cast<std::uint64_t>(me));
    auto& params = model.params();
    auto step = [&](auto& ddp, auto&& after_forward, auto&& ready, auto&& before_update) {
      for (std::size_t k = 0; k < steps; ++k) {
        params.zero_grad();
        ddp.before_forward();
        after_forward();
        const auto batch = tandem::test::make_batch(7, k, per_rank * static_cast<std::size_t>(me),
                                                    per_rank, model.inputs(), model.outputs());
        model.forward_backward(batch, 1.0 / static_cast<double>(per_rank), ready);
        ddp.finish_gradient_sync();
        before_update();
        model.sgd_step(lr);
        const auto all = suite::gather_all<Comm, float>(comm, params.values());
        failures.expect(suite::bitwise_same_chunks(all, params.numel()),
                        suite::where(me, n, "parameters differ across ranks after step "), k, " (",
                        space, ")");
      }
    };
    if constexpr (OnDevice) {
      const fake_device_exec exec;
      auto arena = mirror_of(params);
      to_device(arena.values(), params.values());
      to_device(arena.buffer_values(), params.buffer_values());
      DistributedDataParallel<Comm, Policies...> ddp(comm, arena, exec);
      to_host(params.values(), arena.values());  // rank 0's, broadcast
      to_host(params.buffer_values(), arena.buffer_values());
      step(
          ddp,
          [&] {
            to_host(params.buffer_values(), arena.buffer_values());
            arena.zero_grad(exec);
          },
          [&](auto& p) {
            auto& twin = arena[p.name()];
            to_device(twin.grad(), p.grad());
            ddp.grad_ready(twin);
          },
          [&] {
            to_host(params.grads(), arena.grads());
            // The host model updates its own buffers in forward; the arena keeps them for the
            // next before_forward().
            to_device(arena.buffer_values(), params.buffer_values());
          });
    } else {
      DistributedDataParallel<Comm, Policies...> ddp(comm, params);
      step(
          ddp, [] {}, [&](auto& p) { ddp.grad_ready(p); }, [] {});
    }
    auto values = params.values();
    double worst = 0.0;
    for (std::size_t i = 0; i < values.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(values[i]) - expected[i]));
    }
    failures.expect(worst <= tolerance,
                    suite::where(me, n, "parameters differ from 1 rank x batch "),
                    per_rank * static_cast<std::size_t>(n), " by ", worst, " (", space, ", ",
                    suite::policy_name<Policies...>(), ")");
    results[static_cast<std::size_t>(me)] = bytes_of(values);
  });
  return results;
}

/// The theorem on a device arena, and each rank's parameters bitwise equal to a host arena's.
template <class Comm, class... Policies, class Runner>
std::size_t check_theorem_on_device(Runner& run, int n) {
  Failures failures;
  const int to_pinned_before = staging_counters.to_pinned.load();
  const int waits_before = fake_device_exec::host_waits.load();
  const auto on_host = train<false, Comm, Policies...>(run, n, failures);
  const auto on_device = train<true, Comm, Policies...>(run, n, failures);
  for (int r = 0; r < n; ++r) {
    failures.expect(on_host[static_cast<std::size_t>(r)] == on_device[static_cast<std::size_t>(r)],
                    suite::where(r, n, "device arena's parameters differ from the host arena's"),
                    " (", suite::policy_name<Policies...>(), ")");
  }
  failures.expect(fake_device_exec::host_waits.load() > waits_before,
                  "DDP never synchronised the device executor");
  expect_staging_clean(failures, n, to_pinned_before);
  failures.report();
  return failures.count();
}

// --- exact reductions and compression -----------------------------------------------------------

/// One step of suite::check_exact_reduction's set-up (parameter 1 unused on odd ranks, the last on
/// every rank, holding garbage; ranks marking in different orders) over a host arena or a device
/// arena: every rank's reduced gradients. Uncompressed, they must be the exact mean (or sum).
template <bool OnDevice, class T, class Comm, class... Policies, class Runner>
PerRank reduce_once(Runner& run, int n, const std::vector<std::int64_t>& sizes,
                    Failures& failures) {
  using config = tandem::detail::ddp_config<Policies...>;
  const char* space = OnDevice ? "device arena" : "host arena";
  PerRank results(static_cast<std::size_t>(n));
  run(n, [&](Comm& comm) {
    const int me = comm.rank();
    Parameters<T> params;
    suite::add_exact_reduction_params(params, sizes);
    const std::size_t last = sizes.size() - 1;
    auto unused_here = [&](int rank, std::size_t p) {
      return p == last || (p == 1 && rank % 2 == 1);
    };
    std::vector<std::size_t> order(sizes.size());
    for (std::size_t p = 0; p < order.size(); ++p) order[p] = p;
    std::rotate(order.begin(), order.begin() + me % static_cast<int>(order.size()), order.end());
    if (me % 2 == 1) std::reverse(order.begin(), order.end());
    for (std::size_t p = 0; p < sizes.size(); ++p) {
      auto g = params["p" + std::to_string(p)].grad();
      for (std::size_t i = 0; i < g.size(); ++i) {
        g[i] = unused_here(me, p) ? T(1000.0f) : T(suite::exact_grad(me, n, p, i));
      }
    }
    auto mark_all = [&](auto& ddp, auto& arena) {
      for (auto p : order) {
        if (unused_here(me, p)) continue;
        if (p % 2 == 0) {
          ddp.grad_ready(arena["p" + std::to_string(p)]);
        } else {
          ddp.grad_ready("p" + std::to_string(p));
        }
      }
      ddp.finish_gradient_sync();
    };
    if constexpr (OnDevice) {
      auto arena = mirror_of(params);
      DistributedDataParallel<Comm, Policies...> ddp(comm, arena, fake_device_exec{});
      to_device(arena.grads(), params.grads());
      mark_all(ddp, arena);
      to_host(params.grads(), arena.grads());
    } else {
      DistributedDataParallel<Comm, Policies...> ddp(comm, params);
      mark_all(ddp, params);
    }
    if constexpr (!config::compressed) {
      for (std::size_t p = 0; p < sizes.size(); ++p) {
        auto g = params["p" + std::to_string(p)].grad();
        for (std::size_t i = 0; i < g.size(); ++i) {
          float want = 0.0f;
          for (int r = 0; r < n; ++r) {
            if (!unused_here(r, p)) want += suite::exact_grad(r, n, p, i);
          }
          if (config::averaged) want /= static_cast<float>(n);
          if (static_cast<float>(g[i]) != want) {
            failures.add(suite::where(me, n, "wrong reduced gradient"), ": p", p, "[", i,
                         "] = ", static_cast<float>(g[i]), ", expected ", want, " (",
                         tandem::dtype_traits<T>::name, ", ", space, ", ",
                         suite::policy_name<Policies...>(), ")");
            break;
          }
        }
      }
    }
    results[static_cast<std::size_t>(me)] = bytes_of(params.grads());
  });
  return results;
}

/// The reduction over a device arena: exact (uncompressed) and bitwise equal, rank by rank, to the
/// host arena's (compressed too), with identical gradients on every rank.
template <class T, class Comm, class... Policies, class Runner>
std::size_t check_reduction_on_device(Runner& run, int n, const std::vector<std::int64_t>& sizes) {
  Failures failures;
  const int to_pinned_before = staging_counters.to_pinned.load();
  const auto on_host = reduce_once<false, T, Comm, Policies...>(run, n, sizes, failures);
  const auto on_device = reduce_once<true, T, Comm, Policies...>(run, n, sizes, failures);
  for (int r = 0; r < n; ++r) {
    const auto& mine = on_device[static_cast<std::size_t>(r)];
    failures.expect(mine == on_host[static_cast<std::size_t>(r)],
                    suite::where(r, n, "device arena's gradients differ from the host arena's"),
                    " (", tandem::dtype_traits<T>::name, ", ", suite::policy_name<Policies...>(),
                    ")");
    failures.expect(mine == on_device[0], suite::where(r, n, "gradients differ across ranks"), " (",
                    tandem::dtype_traits<T>::name, ", ", suite::policy_name<Policies...>(), ")");
  }
  expect_staging_clean(failures, n, to_pinned_before);
  failures.report();
  return failures.count();
}

template <class Comm, class Runner>
std::size_t check_reductions_on_device(Runner& run, int n) {
  using namespace tandem::literals;
  const std::vector<std::int64_t> sizes{7, 3, 4, 2};
  const std::vector<std::int64_t> odd_sizes{3, 1, 0, 100, 2, 5};
  std::size_t failed = 0;
  failed += check_reduction_on_device<float, Comm>(run, n, sizes);
  failed += check_reduction_on_device<tandem::half, Comm, tandem::bucket_cap<8>>(run, n, sizes);
  failed += check_reduction_on_device<tandem::bfloat16, Comm, tandem::sync_at_end>(run, n, sizes);
  failed += check_reduction_on_device<double, Comm, tandem::sum>(run, n, sizes);
  failed +=
      check_reduction_on_device<float, Comm, tandem::bucket_cap<sizeof(float)>>(run, n, odd_sizes);
  failed +=
      check_reduction_on_device<float, Comm, tandem::first_bucket_cap<8>, tandem::bucket_cap<16>,
                                tandem::sync_at_end>(run, n, odd_sizes);
  failed += check_reduction_on_device<float, Comm, tandem::compress<tandem::half>,
                                      tandem::bucket_cap<16>>(run, n, sizes);
  failed +=
      check_reduction_on_device<double, Comm, tandem::compress<tandem::bfloat16>, tandem::sum>(
          run, n, odd_sizes);
  return failed;
}

// --- stream-ordered communicators ---------------------------------------------------------------

/// LocalComm that orders on the device as NcclComm does (order_after(stream), wait_stream(stream)
/// for fake_device_exec's stream ids), counting the calls the contract makes of it. Device-only
/// like NcclComm (LocalComm stages its fake-device tensors). Everything runs at once on the host
/// here, so the host waits DDP asks of its executor are what tells the orders apart.
class DeviceOrderingComm : public tandem::LocalComm {
 public:
  using memory_space = fake_device;

  explicit DeviceOrderingComm(tandem::LocalComm&& comm) : tandem::LocalComm(std::move(comm)) {}

  void order_after(int /*stream*/) { ++orders_after; }
  void wait_stream(int /*stream*/) { ++stream_waits; }

  [[nodiscard]] std::optional<DeviceOrderingComm> split(int color, int key) {
    auto group = tandem::LocalComm::split(color, key);
    if (!group) return std::nullopt;
    return DeviceOrderingComm(std::move(*group));
  }

  int orders_after = 0;  ///< order_after() calls
  int stream_waits = 0;  ///< wait_stream() calls
};

static_assert(tandem::Communicator<DeviceOrderingComm>);
static_assert(tandem::OrdersOnStream<DeviceOrderingComm, fake_device_exec>);
static_assert(!tandem::OrdersOnStream<tandem::LocalComm, fake_device_exec>);
static_assert(!tandem::OrdersOnStream<DeviceOrderingComm, tandem::host_exec>);

enum class Order { none, same_stream, other_stream };

const char* order_name(Order order) {
  constexpr const char* names[] = {"LocalComm, no stream order",
                                   "stream-ordered, the executor on stream 0",
                                   "stream-ordered, the executor on stream 1"};
  return names[static_cast<int>(order)];
}

/// What `steps` steps of DDP over a device arena (with a buffer) did on each rank.
struct StreamRun {
  PerRank grads;                  ///< the reduced gradients after the last step
  std::vector<int> waits;         ///< the executor's host waits in the steps
  std::vector<int> orders_after;  ///< order_after() calls the communicator saw in the steps
  std::vector<int> stream_waits;  ///< wait_stream() calls the communicator saw in the steps
  std::vector<int> unordered;     ///< where the contract orders: one per launched bucket and
                                  ///< buffer broadcast
};

constexpr int stream_steps = 3;
const std::vector<std::int64_t> sizes_of_p{7, 3, 4, 2};

/// A host arena of parameters p0, p1, ... of sizes_of_p, and a buffer when `with_buffer`.
Parameters<float> host_arena_of_p(bool with_buffer) {
  Parameters<float> arena;
  for (std::size_t p = 0; p < sizes_of_p.size(); ++p) {
    arena.add("p" + std::to_string(p), {sizes_of_p[p]});
  }
  if (with_buffer) arena.add_buffer("stats", {2});
  arena.finalize();
  return arena;
}

/// The buckets that a step launches (empty ones are skipped).
template <class Ddp>
int launched_buckets(const Ddp& ddp) {
  return static_cast<int>(std::count_if(ddp.buckets().begin(), ddp.buckets().end(),
                                        [](const auto& bucket) { return bucket.count > 0; }));
}

template <class... Policies>
StreamRun run_in_order(LocalRunner& run, int n, Order order) {
  const auto& sizes = sizes_of_p;
  const auto ranks = static_cast<std::size_t>(n);
  StreamRun result{PerRank(ranks), std::vector<int>(ranks), std::vector<int>(ranks),
                   std::vector<int>(ranks), std::vector<int>(ranks)};
  run(n, [&](tandem::LocalComm& comm) {
    const int me = comm.rank();
    const auto slot = static_cast<std::size_t>(me);
    auto host_twin = host_arena_of_p(true);
    auto arena = mirror_of(host_twin);
    to_device(arena.buffer_values(), host_twin.buffer_values());
    const fake_device_exec exec{order == Order::other_stream ? 1 : 0};
    auto train = [&](auto& any_comm) {
      using Comm = std::remove_reference_t<decltype(any_comm)>;
      DistributedDataParallel<Comm, Policies...> ddp(any_comm, arena, exec);
      result.unordered[slot] = stream_steps * (launched_buckets(ddp) + (n > 1 ? 1 : 0));
      const int before = fake_device_exec::host_waits_here;
      int orders_before = 0;
      int stream_waits_before = 0;
      if constexpr (std::same_as<Comm, DeviceOrderingComm>) {
        orders_before = any_comm.orders_after;
        stream_waits_before = any_comm.stream_waits;
      }
      for (int k = 0; k < stream_steps; ++k) {
        for (std::size_t p = 0; p < sizes.size(); ++p) {
          auto g = host_twin["p" + std::to_string(p)].grad();
          for (std::size_t i = 0; i < g.size(); ++i) {
            g[i] = suite::exact_grad(me, n, p, i) * static_cast<float>(k + 1);
          }
        }
        to_device(arena.grads(), host_twin.grads());
        ddp.before_forward();
        for (std::size_t p = sizes.size(); p-- > 0;) ddp.grad_ready(arena["p" + std::to_string(p)]);
        ddp.finish_gradient_sync();
      }
      result.waits[slot] = fake_device_exec::host_waits_here - before;
      if constexpr (std::same_as<Comm, DeviceOrderingComm>) {
        result.orders_after[slot] = any_comm.orders_after - orders_before;
        result.stream_waits[slot] = any_comm.stream_waits - stream_waits_before;
      }
    };
    if (order == Order::none) {
      train(comm);
    } else {
      auto group = comm.split(0, me);
      DeviceOrderingComm ordered(std::move(*group));
      train(ordered);
    }
    to_host(host_twin.grads(), arena.grads());
    result.grads[slot] = bytes_of(host_twin.grads());
  });
  return result;
}

/// Through the contract: no host wait in any step where the communicator orders on the device,
/// whichever stream the executor uses (order_after instead of each wait, wait_stream after each
/// buffer broadcast); one wait per bucket and broadcast on a host communicator; the same
/// gradients.
template <class... Policies>
std::size_t check_stream_order(LocalRunner& run, int n) {
  Failures failures;
  const auto unordered = run_in_order<Policies...>(run, n, Order::none);
  for (auto order : {Order::none, Order::same_stream, Order::other_stream}) {
    const auto got = order == Order::none ? unordered : run_in_order<Policies...>(run, n, order);
    for (std::size_t r = 0; r < static_cast<std::size_t>(n); ++r) {
      const bool ordered = order != Order::none;
      const int want = ordered ? 0 : unordered.unordered[r];
      const auto context = [&] {
        return std::string(" (") + order_name(order) + ", " + suite::policy_name<Policies...>() +
               ")";
      };
      failures.expect(got.waits[r] == want,
                      suite::where(static_cast<int>(r), n, "the executor's host waits"), ": ",
                      got.waits[r], " in ", stream_steps, " steps, expected ", want, context());
      const int want_orders = ordered ? unordered.unordered[r] : 0;
      failures.expect(got.orders_after[r] == want_orders,
                      suite::where(static_cast<int>(r), n, "order_after calls"), ": ",
                      got.orders_after[r], ", expected ", want_orders, context());
      const int want_stream_waits = ordered && n > 1 ? stream_steps : 0;
      failures.expect(got.stream_waits[r] == want_stream_waits,
                      suite::where(static_cast<int>(r), n, "wait_stream calls"), ": ",
                      got.stream_waits[r], ", expected ", want_stream_waits, context());
      failures.expect(got.grads[r] == unordered.grads[r],
                      suite::where(static_cast<int>(r), n, "gradients differ from LocalComm's"),
                      context());
    }
  }
  failures.expect(unordered.unordered[0] > 0, "nothing to compare: no waits without stream order");
  failures.report();
  return failures.count();
}

// --- the average folded into GradScaler's unscale ----------------------------------------------

/// The smallest Optimizer over an arena's gradients (GradScaler unscales exactly grads()); its
/// step only counts.
template <class T, class Space, class Exec>
struct ArenaOptimizer {
  using value_type = T;
  using memory_space = Space;

  Parameters<T, Space>* params;
  Exec exec;
  int steps = 0;

  void step() { ++steps; }
  void zero_grad() { params->zero_grad(exec); }
  [[nodiscard]] View<T, Space> grads() { return params->grads(); }
  [[nodiscard]] Exec executor() const { return exec; }
  [[nodiscard]] std::map<std::string, double> state_dict() const { return {}; }
  void load_state_dict(const std::map<std::string, double>& /*state*/) {}
};

static_assert(tandem::Optimizer<ArenaOptimizer<float, fake_device, fake_device_exec>>);

/// A scaled gradient that is no small integer, so that sums round.
float scaled_grad(int rank, std::size_t p, std::size_t i, int step) {
  return 65536.0f * (0.37f * static_cast<float>(rank + 1) -
                     0.013f * static_cast<float>(i * 7 + p * 3) + 0.1f * static_cast<float>(step));
}

constexpr int fold_steps = 2;

/// What fold_run saw on each rank: the unscaled gradients after the last step, and the passes
/// (kernels) that finish_gradient_sync() and scaler.step() launched over the device arena.
struct FoldRun {
  PerRank grads;
  std::vector<int> passes;
  std::vector<int> expected_passes;
};

/// fold_steps steps of DDP (averaging, small buckets) and GradScaler over a host arena or a
/// device arena on LocalComm, with the average handed to the scaler (Deferred) or not.
template <bool OnDevice, bool Deferred>
FoldRun fold_run(LocalRunner& run, int n, Failures& failures) {
  const auto ranks = static_cast<std::size_t>(n);
  FoldRun result{PerRank(ranks), std::vector<int>(ranks), std::vector<int>(ranks)};
  run(n, [&](tandem::LocalComm& comm) {
    const int me = comm.rank();
    const auto slot = static_cast<std::size_t>(me);
    auto host_arena = host_arena_of_p(false);
    auto train = [&](auto& arena, auto exec) {
      using Exec = decltype(exec);
      using Space = typename Exec::memory_space;
      DistributedDataParallel<tandem::LocalComm, tandem::first_bucket_cap<16>,
                              tandem::bucket_cap<16>>
          ddp(comm, arena, exec);
      ArenaOptimizer<float, Space, Exec> opt{&arena, exec};
      tandem::GradScaler<Space> scaler;
      if constexpr (Deferred) {
        failures.expect(ddp.defer_average_to(scaler, opt),
                        suite::where(me, n, "the scaler did not take the average"));
      }
      // Per step: the unscale-and-check reduction and the read of its flag, plus a division per
      // bucket unless the scaler took it (or there is one rank).
      result.expected_passes[slot] =
          fold_steps * (2 + (Deferred || n == 1 ? 0 : launched_buckets(ddp)));
      for (int k = 0; k < fold_steps; ++k) {
        (void)scaler.scale(1.0f);
        for (std::size_t p = 0; p < sizes_of_p.size(); ++p) {
          auto g = host_arena["p" + std::to_string(p)].grad();
          for (std::size_t i = 0; i < g.size(); ++i) g[i] = scaled_grad(me, p, i, k);
        }
        if constexpr (OnDevice) to_device(arena.grads(), host_arena.grads());
        const int before = fake_device_exec::passes_here;
        for (std::size_t p = 0; p < sizes_of_p.size(); ++p) {
          ddp.grad_ready(arena["p" + std::to_string(p)]);
        }
        ddp.finish_gradient_sync();
        failures.expect(scaler.step(opt), suite::where(me, n, "the scaler skipped a step"));
        result.passes[slot] += fake_device_exec::passes_here - before;
        scaler.update();
      }
      if constexpr (OnDevice) to_host(host_arena.grads(), arena.grads());
    };
    if constexpr (OnDevice) {
      auto arena = mirror_of(host_arena);
      train(arena, fake_device_exec{});
    } else {
      train(host_arena, tandem::host_exec{});
    }
    result.grads[slot] = bytes_of(host_arena.grads());
  });
  return result;
}

/// The unscaled mean with the average handed to GradScaler, against DDP's own division: bitwise
/// equal when n is a power of two (only an exact factor of 1/n moves from before the sum to
/// after it); otherwise within 4n float roundings of the mean's magnitude,
/// 4n * 2^-24 * sum_r |g_r| / (n * scale): each rank's quotient, both sums and both products
/// round once each. On the device arena: one pass per step where there were 1 + buckets.
template <bool OnDevice>
std::size_t check_average_folded(LocalRunner& run, int n) {
  Failures failures;
  const char* space = OnDevice ? "device arena" : "host arena";
  const auto two_pass = fold_run<OnDevice, false>(run, n, failures);
  const auto folded = fold_run<OnDevice, true>(run, n, failures);
  const bool power_of_two = (n & (n - 1)) == 0;
  for (std::size_t r = 0; r < static_cast<std::size_t>(n); ++r) {
    const auto& want_bytes = two_pass.grads[r];
    const auto& got_bytes = folded.grads[r];
    if (power_of_two) {
      failures.expect(got_bytes == want_bytes,
                      suite::where(static_cast<int>(r), n, "folded gradients differ bitwise"), " (",
                      space, ")");
    } else {
      std::vector<float> want(want_bytes.size() / sizeof(float));
      std::vector<float> got(got_bytes.size() / sizeof(float));
      std::memcpy(want.data(), want_bytes.data(), want_bytes.size());
      std::memcpy(got.data(), got_bytes.data(), got_bytes.size());
      std::size_t offset = 0;
      for (std::size_t p = 0; p < sizes_of_p.size(); ++p) {
        for (std::size_t i = 0; i < static_cast<std::size_t>(sizes_of_p[p]); ++i, ++offset) {
          double magnitude = 0.0;
          for (int q = 0; q < n; ++q) magnitude += std::abs(scaled_grad(q, p, i, fold_steps - 1));
          const double bound = 4.0 * n * std::ldexp(1.0, -24) * magnitude / (n * 65536.0);
          const double error = std::abs(static_cast<double>(got[offset]) - want[offset]);
          failures.expect(error <= bound,
                          suite::where(static_cast<int>(r), n, "a folded gradient is off"), ": p",
                          p, "[", i, "] = ", got[offset], ", two passes gave ", want[offset],
                          " (bound ", bound, ", ", space, ")");
        }
      }
    }
    if constexpr (OnDevice) {
      failures.expect(folded.passes[r] == folded.expected_passes[r] &&
                          two_pass.passes[r] == two_pass.expected_passes[r],
                      suite::where(static_cast<int>(r), n, "passes over the gradients: "),
                      folded.passes[r], " folded (expected ", folded.expected_passes[r], "), ",
                      two_pass.passes[r], " in two passes (expected ", two_pass.expected_passes[r],
                      ")");
    }
  }
  failures.report();
  return failures.count();
}

/// When DDP keeps its own division (16-bit and double gradients, a disabled scaler), and the
/// Errors: another optimizer's gradients, mid-step, a reduction before the last one's unscale.
std::size_t check_average_folding_limits(LocalRunner& run) {
  Failures failures;
  const int n = 2;
  run(n, [&](tandem::LocalComm& comm) {
    const int me = comm.rank();
    auto arena_of = [](auto zero) {
      Parameters<decltype(zero)> arena;
      arena.add("w", {4});
      arena.finalize();
      return arena;
    };
    auto half_arena = arena_of(tandem::half{});
    DistributedDataParallel<tandem::LocalComm> half_ddp(comm, half_arena);
    ArenaOptimizer<tandem::half, host, tandem::host_exec> half_opt{&half_arena, {}};
    tandem::GradScaler<> scaler;
    failures.expect(!half_ddp.defer_average_to(scaler, half_opt),
                    suite::where(me, n, "half gradients handed their division over"));
    auto double_arena = arena_of(0.0);
    DistributedDataParallel<tandem::LocalComm> double_ddp(comm, double_arena);
    ArenaOptimizer<double, host, tandem::host_exec> double_opt{&double_arena, {}};
    failures.expect(!double_ddp.defer_average_to(scaler, double_opt),
                    suite::where(me, n, "double gradients handed their division over"));

    auto arena = arena_of(0.0f);
    auto other = arena_of(0.0f);
    DistributedDataParallel<tandem::LocalComm> ddp(comm, arena);
    ArenaOptimizer<float, host, tandem::host_exec> opt{&arena, {}};
    ArenaOptimizer<float, host, tandem::host_exec> other_opt{&other, {}};
    tandem::GradScaler<> disabled(tandem::GradScalerOptions{.enabled = false});
    failures.expect(!ddp.defer_average_to(disabled, opt),
                    suite::where(me, n, "a disabled scaler took the division"));
    auto expect_error = [&](const char* call, const char* phrase, auto&& fn) {
      try {
        fn();
        failures.add(suite::where(me, n, call), ": no error");
      } catch (const tandem::Error& e) {
        failures.expect(tandem::test::mentions(e.what(), phrase), suite::where(me, n, call),
                        ": unexpected text: ", e.what());
      }
    };
    expect_error("another arena's optimizer", "not the wrapped arena's",
                 [&] { (void)ddp.defer_average_to(scaler, other_opt); });
    ddp.grad_ready(arena["w"]);
    expect_error("defer_average_to mid-step", "middle of a step",
                 [&] { (void)ddp.defer_average_to(scaler, opt); });
    ddp.finish_gradient_sync();
    failures.expect(ddp.defer_average_to(scaler, opt),
                    suite::where(me, n, "the scaler did not take the division"));
    (void)scaler.scale(1.0f);
    ddp.finish_gradient_sync();
    // Reduced again while the last reduction's division is still pending.
    expect_error("a second reduction before the unscale", "reduced again",
                 [&] { ddp.finish_gradient_sync(); });
    failures.expect(scaler.step(opt), suite::where(me, n, "the scaler skipped a clean step"));
    scaler.update();
  });
  failures.report();
  return failures.count();
}

// --- errors -------------------------------------------------------------------------------------

/// Device arenas registered differently: the Error names the difference on every rank; a host
/// twin's Parameter given to grad_ready is refused; marking twice is an Error.
template <class Comm, class Runner>
std::size_t check_errors_on_device(Runner& run, int n) {
  Failures failures;
  run(n, [&](Comm& comm) {
    const int me = comm.rank();
    const bool odd_one = n > 1 && me == n - 1;
    Parameters<float> host_twin;
    host_twin.add("fc.weight", odd_one ? tandem::Shape{3, 2} : tandem::Shape{2, 3});
    host_twin.add("fc.bias", {2});
    host_twin.finalize();
    auto arena = mirror_of(host_twin);
    try {
      DistributedDataParallel<Comm> ddp(comm, arena, fake_device_exec{});
      failures.expect(n == 1, suite::where(me, n, "no error for a mismatched shape"));
      try {
        ddp.grad_ready(host_twin["fc.bias"]);
        failures.add(suite::where(me, n, "a host twin's parameter raised no error"));
      } catch (const tandem::Error& e) {
        failures.expect(tandem::test::mentions(e.what(), "is not a trained parameter"),
                        suite::where(me, n, "unexpected text: "), e.what());
      }
      ddp.grad_ready(arena["fc.bias"]);
      try {
        ddp.grad_ready("fc.bias");
        failures.add(suite::where(me, n, "marking twice raised no error"));
      } catch (const tandem::Error& e) {
        failures.expect(tandem::test::mentions(e.what(), "'fc.bias'", "twice"),
                        suite::where(me, n, "unexpected text: "), e.what());
      }
      ddp.finish_gradient_sync();
    } catch (const tandem::Error& e) {
      failures.expect(n > 1 && tandem::test::mentions(e.what(), "registered different",
                                                      "'fc.weight' [2, 3]", "'fc.weight' [3, 2]"),
                      suite::where(me, n, "unexpected error: "), e.what());
    }
    comm.barrier();  // the group is still usable
  });
  failures.report();
  return failures.count();
}

template <class Comm, class Runner>
std::size_t check_all_on_device(Runner& run, int max_ranks) {
  return suite::over_group_sizes(max_ranks, [&](int n) {
    return std::vector<std::size_t>{
        check_theorem_on_device<Comm>(run, n),
        check_theorem_on_device<Comm, tandem::sync_at_end>(run, n),
        check_theorem_on_device<Comm, tandem::first_bucket_cap<64>, tandem::bucket_cap<256>>(run,
                                                                                             n),
        check_reductions_on_device<Comm>(run, n), check_errors_on_device<Comm>(run, n)};
  });
}

}  // namespace

// The arena's space comes from the constructor: the class is the same as over a host arena.
static_assert(
    std::constructible_from<DistributedDataParallel<tandem::LocalComm, tandem::overlap>,
                            tandem::LocalComm&, Parameters<float, fake_device>&, fake_device_exec>);
static_assert(std::constructible_from<DistributedDataParallel<tandem::LocalComm, tandem::overlap>,
                                      tandem::LocalComm&, Parameters<float>&>);

TEST_CASE("DDP over a device arena on LocalComm: staged, bitwise equal to a host arena") {
  LocalRunner run;
  CHECK(check_all_on_device<tandem::LocalComm>(run, 4) == 0);
}

TEST_CASE("DDP on a communicator that orders on the device never waits on the host") {
  LocalRunner run;
  for (int n = 1; n <= 3; ++n) {
    CAPTURE(n);
    CHECK(check_stream_order(run, n) == 0);
    CHECK(check_stream_order<tandem::sync_at_end, tandem::bucket_cap<16>>(run, n) == 0);
    CHECK(check_stream_order<tandem::compress<tandem::half>, tandem::bucket_cap<8>>(run, n) == 0);
  }
}

TEST_CASE("DDP's average and GradScaler's unscale are one pass, with the same gradients") {
  LocalRunner run;
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    CHECK(check_average_folded<false>(run, n) == 0);
    CHECK(check_average_folded<true>(run, n) == 0);
  }
  CHECK(check_average_folding_limits(run) == 0);
}

#if defined(TANDEM_TEST_GLOO)
TEST_CASE("DDP over a device arena on GlooComm: staged, bitwise equal to a host arena") {
  GlooThreadRunner run;
  CHECK(check_all_on_device<tandem::GlooComm>(run, 3) == 0);
}
#endif
