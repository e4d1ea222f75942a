// DistributedDataParallel on ShmComm: one process per rank under tandemrun (ctest shm_ddp_np3);
// the job joins with init_process_group (env://) and groups of 1 .. WORLD_SIZE ranks are split
// off it, each with a segment of its own. The Join cases too (join_suite.hpp). Then the
// gradients in shared memory: DDP moves an arena's gradients into a block of the group's shared
// memory where nothing has viewed them yet, and its buckets (above 64 KiB) are reduced straight
// from the peers' gradients - bit-for-bit the training of gradients left where they are. And
// ZeRO (shard<1>, shard<2>, with prefetch_parameters): its reduce_scatter in place from the
// gradients' block and its parameters' all_gather from its staging's block train bit for bit as
// the slots' path (no block: TANDEM_SHM_FREE_BYTES leaves none room) and as LocalComm threads.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "support/runners.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/comm/shm/shm.hpp"
#include "tandem/ddp/ddp.hpp"
#include "tandem/optim/sgd.hpp"
#include "unit/ddp/ddp_suite.hpp"

namespace {

namespace suite = tandem::test::ddp;

tandem::ShmComm& job() {
  static tandem::ShmComm comm = tandem::init_process_group<tandem::ShmComm>();
  return comm;
}

}  // namespace

TEST_CASE("DDP on ShmComm: N ranks x batch b equal 1 rank x batch N*b") {
  tandem::test::SplitRunner<tandem::ShmComm> run{&job()};
  CHECK(suite::check_theorems<tandem::ShmComm>(run, job().size()) == 0);
}

TEST_CASE("DDP on ShmComm: no_sync accumulation equals one step on the whole batch") {
  tandem::test::SplitRunner<tandem::ShmComm> run{&job()};
  CHECK(suite::check_no_syncs<tandem::ShmComm>(run, job().size()) == 0);
}

TEST_CASE("DDP on ShmComm: unused parameters, element types, reductions and bucket caps") {
  tandem::test::SplitRunner<tandem::ShmComm> run{&job()};
  CHECK(suite::check_reductions<tandem::ShmComm>(run, job().size()) == 0);
}

TEST_CASE("DDP on ShmComm: marking twice and mismatched registrations are errors") {
  tandem::test::SplitRunner<tandem::ShmComm> run{&job()};
  CHECK(suite::check_errors<tandem::ShmComm>(run, job().size()) == 0);
}

TEST_CASE("DDP on ShmComm: 16-bit compression stays within its rounding bound") {
  tandem::test::SplitRunner<tandem::ShmComm> run{&job()};
  CHECK(suite::check_compressions<tandem::ShmComm>(run, job().size()) == 0);
}

TEST_CASE("Join on ShmComm: uneven data equals the single-process schedule") {
  tandem::test::SplitRunner<tandem::ShmComm> run{&job()};
  CHECK(suite::check_joins<tandem::ShmComm>(run, job().size()) == 0);
}

TEST_CASE("Join on ShmComm: SyncBatchNorm between buckets; misuse is an Error, never a hang") {
  tandem::test::SplitRunner<tandem::ShmComm> run{&job()};
  CHECK(suite::check_join_norms_and_errors<tandem::ShmComm>(run, job().size()) == 0);
}

namespace {

/// Whether `address` lies in a mapping of a POSIX shared-memory object of ShmComm's (the maps
/// line names "/dev/shm/tandem-shm-...", deleted once every rank has mapped it).
bool in_shared_block(const void* address) {
  std::ifstream maps("/proc/self/maps");
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  for (std::string line; std::getline(maps, line);) {
    unsigned long begin = 0;
    unsigned long end = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &begin, &end) != 2) continue;
    if (at >= begin && at < end) return line.find("/dev/shm/tandem-shm-") != std::string::npos;
  }
  return false;
}

/// How many mappings of ShmComm's POSIX objects (its segments and blocks) this process has.
int shared_mappings() {
  std::ifstream maps("/proc/self/maps");
  int found = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/dev/shm/tandem-shm-") != std::string::npos) ++found;
  }
  return found;
}

/// The arena the trainings below use: two parameters (77100 and 40001 floats: with a 200000-byte
/// bucket cap, two buckets of odd sizes), values that differ element by element.
struct TwoParameters {
  tandem::Parameters<float> params;
  tandem::Parameters<float>::Parameter& weight = params.add("weight", {300, 257});
  tandem::Parameters<float>::Parameter& bias = params.add("bias", {40001});

  TwoParameters() {
    params.finalize();
    auto values = params.values();
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = initial(i);
  }
  static float initial(std::size_t i) { return static_cast<float>(i % 101) * 0.013f - 0.6f; }

  /// A backward pass: gradients that depend on the rank, the step and the values (as a real
  /// one's do), each parameter marked ready as it is written, the last one first.
  template <class Ddp>
  void backward(Ddp& ddp, int rank, int step) {
    for (auto* p : {&bias, &weight}) {
      auto g = p->grad();
      auto v = p->value();
      for (std::size_t i = 0; i < g.size(); ++i) {
        g[i] = v[i] * (0.5f + 0.25f * static_cast<float>(rank)) +
               static_cast<float>((i * 7 + static_cast<std::size_t>(step)) % 13) * 0.031f;
      }
      ddp.grad_ready(*p);
    }
  }
};

/// Trains a two-parameter arena for a few steps under DDP on `comm` with gradients that depend
/// on the rank, the step and the values (as a backward pass's do); `view_first` takes a view of
/// the gradients before DDP wraps the arena, which keeps them out of shared memory. Returns the
/// final values and whether the gradients were in a shared block.
std::pair<std::vector<float>, bool> train(tandem::ShmComm& comm, bool view_first) {
  TwoParameters model;
  auto& params = model.params;
  auto values = params.values();
  if (view_first) (void)params.grads();
  tandem::DistributedDataParallel<tandem::ShmComm> ddp(comm, params);
  const bool shared = in_shared_block(params.grads().data());
  for (int step = 0; step < 4; ++step) {
    ddp.before_forward();
    params.zero_grad();
    model.backward(ddp, comm.rank(), step);
    ddp.finish_gradient_sync();
    auto grads = params.grads();
    for (std::size_t i = 0; i < values.size(); ++i) values[i] -= 0.1f * grads[i];
  }
  return {std::vector<float>(values.begin(), values.end()), shared};
}

void check_training(tandem::ShmComm& comm) {
  const auto [in_block, shared] = train(comm, false);
  const auto [elsewhere, not_shared] = train(comm, true);
  CHECK(shared);
  CHECK_FALSE(not_shared);
  REQUIRE(in_block.size() == elsewhere.size());
  CHECK(std::memcmp(in_block.data(), elsewhere.data(), in_block.size() * sizeof(float)) == 0);
  // And the same bits on every rank: rank 0's values, broadcast, compared here.
  auto root = in_block;
  comm.broadcast(std::span<float>(root), 0);
  CHECK(std::memcmp(root.data(), in_block.data(), root.size() * sizeof(float)) == 0);
}

}  // namespace

TEST_CASE("DDP on ShmComm: gradients in shared memory train bit-for-bit as outside it") {
  check_training(job());
  // A group of 2 split off the job.
  auto pair = job().split(job().rank() < 2 ? 0 : tandem::no_color, job().rank());
  if (pair) check_training(*pair);
  job().barrier();
}

TEST_CASE("DDP on ShmComm: a rank whose gradients were viewed keeps every rank's out of it") {
  // Rank 0 viewed its gradients before DDP: no rank moves them (or the buckets' all_reduces
  // would meet tensors in different places).
  tandem::Parameters<float> params;
  (void)params.add("weight", {100000});
  params.finalize();
  if (job().rank() == 0) (void)params.grads();
  tandem::DistributedDataParallel<tandem::ShmComm> ddp(job(), params);
  CHECK_FALSE(in_shared_block(params.grads().data()));
  ddp.before_forward();
  auto g = params.grads();
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = 1.0f;
  ddp.grad_ready(params["weight"]);
  ddp.finish_gradient_sync();
  CHECK(g[g.size() - 1] == 1.0f);  // averaged: every rank gave 1
}

namespace {

/// Two buckets of TwoParameters' odd sizes (parts that are no multiple of the block's 64 KiB
/// chunks, tails at 2 and 3 ranks), each above the size where a block is used.
template <class Comm, int Stage, class... More>
using ZeroOn = tandem::DistributedDataParallel<Comm, tandem::shard<Stage>,
                                               tandem::bucket_cap<std::size_t{200000}>, More...>;

/// ZeRO (`Ddp`, a shard<Stage> DDP) trained for a few steps on `comm` with SGD with momentum,
/// gradients that depend on the rank, the step and the values; returns this rank's final values.
/// `blocks` counts the shared mappings the DDP made (its gradients' block and its staging's).
template <class Ddp, class Comm>
std::vector<float> train_zero(Comm& comm, int* blocks = nullptr) {
  TwoParameters model;
  auto& params = model.params;
  auto values = params.values();
  const int before = shared_mappings();
  Ddp ddp(comm, params);
  if (blocks) *blocks = shared_mappings() - before;
  tandem::optim::SGD<float> opt(params, tandem::optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
  ddp.shard(opt);
  for (int step = 0; step < 4; ++step) {
    ddp.before_forward();
    if constexpr (Ddp::config::prefetches) ddp.wait_parameters();
    model.backward(ddp, comm.rank(), step);
    ddp.finish_gradient_sync();
    ddp.step(opt);
    opt.zero_grad();
  }
  if constexpr (Ddp::config::prefetches) ddp.wait_parameters();
  return std::vector<float>(values.begin(), values.end());
}

/// Every rank's final values of `Ddp` over LocalComm threads (in rank order).
template <int Stage, class... More>
std::vector<std::vector<float>> zero_on_threads(int n) {
  std::vector<std::vector<float>> all(static_cast<std::size_t>(n));
  tandem::run_local(n, [&](tandem::LocalComm& local) {
    all[static_cast<std::size_t>(local.rank())] =
        train_zero<ZeroOn<tandem::LocalComm, Stage, More...>>(local);
  });
  return all;
}

/// shard<Stage> on `comm` through the blocks, then with no block (TANDEM_SHM_FREE_BYTES: no
/// room in /dev/shm, so the gradients and the staging stay in this process's memory and every
/// collective takes the slots' path), then on LocalComm threads: the same bits on every rank.
template <int Stage, class... More>
void check_zero(tandem::ShmComm& comm) {
  using Ddp = ZeroOn<tandem::ShmComm, Stage, More...>;
  const std::string what = "shard<" + std::to_string(Stage) + ">" +
                           (sizeof...(More) ? " with prefetch_parameters" : "") + " on " +
                           std::to_string(comm.size()) + " ranks, rank " +
                           std::to_string(comm.rank());
  CAPTURE(what);
  int blocks = 0;
  const auto through_blocks = train_zero<Ddp>(comm, &blocks);
  CHECK(blocks == (comm.size() > 1 ? 2 : 0));  // the gradients' and the staging's
  REQUIRE(::setenv("TANDEM_SHM_FREE_BYTES", "4096", 1) == 0);
  int none = 0;
  const auto through_slots = train_zero<Ddp>(comm, &none);
  REQUIRE(::unsetenv("TANDEM_SHM_FREE_BYTES") == 0);
  CHECK(none == 0);
  const auto threads = zero_on_threads<Stage, More...>(comm.size());
  REQUIRE(through_blocks.size() == through_slots.size());
  const std::size_t bytes = through_blocks.size() * sizeof(float);
  CHECK(std::memcmp(through_blocks.data(), through_slots.data(), bytes) == 0);
  CHECK(std::memcmp(through_blocks.data(), threads[static_cast<std::size_t>(comm.rank())].data(),
                    bytes) == 0);
  // The training happened: the values moved from where they started.
  bool moved = false;
  for (std::size_t i = 0; i < through_blocks.size(); ++i) {
    moved = moved || through_blocks[i] != TwoParameters::initial(i);
  }
  CHECK(moved);
}

void check_zero_stages(tandem::ShmComm& comm) {
  check_zero<1>(comm);
  check_zero<2>(comm);
  check_zero<2, tandem::prefetch_parameters>(comm);
}

}  // namespace

TEST_CASE(
    "ZeRO on ShmComm: through the shared blocks, through the slots and on LocalComm, the "
    "same bits") {
  check_zero_stages(job());
  // Groups of 2 and 1 split off the job.
  for (int members = 1; members < job().size(); ++members) {
    auto part = job().split(job().rank() < members ? 0 : tandem::no_color, job().rank());
    if (part) check_zero_stages(*part);
    job().barrier();
  }
}
