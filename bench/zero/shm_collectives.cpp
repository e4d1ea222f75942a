// bench/zero/shm_collectives.cpp - ZeRO's two collectives on ShmComm, each through the segment's
// slots (the path before issue 33's shared blocks) and through a shared block, alternating, in one
// run: shard<2>'s reduce-scatter of a bucket (before: from the gradients into a staging buffer,
// then the copy of the reduced part into the gradients; after: in place in the gradients' block)
// and the parameters' all_gather (before: from a staging buffer of the rank's own; after: from a
// staging block the peers read); and the copy of a rank's own part alone, which is what keeping the
// parameters themselves in a block would save of the block's all_gather (the copy into the
// staging and the copy out of it into the rank's own part: twice that time, at most).
//   tandemrun --standalone --nproc-per-node N bench_zero_shm [--floats F] [--repeats R]
// F: the bucket's floats (10333333: one of bench_zero's 12 buckets of 124 M parameters); R: runs of
// each (15). Prints, on rank 0, the fastest run of each (of its slowest rank's: the least disturbed
// by other work on a shared machine) and after / before. Fails (exit 1, no RESULT line) unless
// both paths gave the same bits and the sums are right.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "tandem/comm/init.hpp"
#include "tandem/comm/shm/shm.hpp"

namespace {

using Clock = std::chrono::steady_clock;

/// The slowest rank's seconds for body(), after a barrier.
template <class Body>
double timed(tandem::ShmComm& comm, Body&& body) {
  comm.barrier();
  const auto start = Clock::now();
  body();
  std::vector<double> seconds{std::chrono::duration<double>(Clock::now() - start).count()};
  comm.all_reduce(std::span<double>(seconds), tandem::ReduceOp::max);
  return seconds[0];
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t floats = 10333333;
  int repeats = 15;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--floats") floats = std::strtoull(argv[i + 1], nullptr, 10);
    if (flag == "--repeats") repeats = std::atoi(argv[i + 1]);
  }
  auto comm = tandem::init_process_group<tandem::ShmComm>();
  const auto n = static_cast<std::size_t>(comm.size());
  const auto me = static_cast<std::size_t>(comm.rank());
  const std::size_t count = floats / n;
  const std::size_t total = count * n;
  auto grads_block = comm.allocate_shared(total * sizeof(float));
  auto staging_block = comm.allocate_shared(count * sizeof(float));
  if (n < 2 || !grads_block || !staging_block) {
    if (me == 0) std::fprintf(stderr, "bench_zero_shm: needs 2 or more ranks and /dev/shm room\n");
    return 1;
  }
  auto* grads = reinterpret_cast<float*>(grads_block.data);
  auto* shared_staging = reinterpret_cast<float*>(staging_block.data);
  std::vector<float> staging(count);
  std::vector<float> values(total);
  std::vector<float> before_part(count);
  std::vector<float> before_values(total);
  auto fill = [&] {  // each rank's gradients: small integers, so every sum is exact
    for (std::size_t i = 0; i < total; ++i) grads[i] = static_cast<float>(i % 7 + me);
  };
  for (std::size_t i = 0; i < count; ++i) values[me * count + i] = static_cast<float>(i % 5 + me);
  double best[5] = {1e30, 1e30, 1e30, 1e30, 1e30};
  bool same = true;
  for (int r = 0; r < repeats; ++r) {
    fill();
    best[0] = std::min(best[0], timed(comm, [&] {
                         comm.reduce_scatter(std::span<const float>(grads, total),
                                             std::span<float>(staging));
                         std::memcpy(grads + me * count, staging.data(), count * sizeof(float));
                       }));
    std::memcpy(before_part.data(), grads + me * count, count * sizeof(float));
    fill();
    best[1] = std::min(best[1], timed(comm, [&] {
                         comm.reduce_scatter(std::span<float>(grads, total),
                                             std::span<float>(grads + me * count, count));
                       }));
    same = same && std::memcmp(before_part.data(), grads + me * count, count * sizeof(float)) == 0;
    best[2] =
        std::min(best[2], timed(comm, [&] {
                   std::memcpy(staging.data(), values.data() + me * count, count * sizeof(float));
                   comm.all_gather(std::span<const float>(staging), std::span<float>(values));
                 }));
    before_values = values;
    best[3] = std::min(
        best[3], timed(comm, [&] {
          std::memcpy(shared_staging, values.data() + me * count, count * sizeof(float));
          comm.all_gather(std::span<const float>(shared_staging, count), std::span<float>(values));
        }));
    same = same && before_values == values;
    best[4] =
        std::min(best[4], timed(comm, [&] {
                   std::memcpy(shared_staging, values.data() + me * count, count * sizeof(float));
                 }));
  }
  // The work happened: element i of rank me's part summed (i' % 7 + r) over the ranks r.
  bool right = true;
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t at = me * count + i;
    right = right && grads[at] == static_cast<float>(n * (at % 7) + n * (n - 1) / 2);
  }
  for (std::size_t r = 0; r < n; ++r) right = right && values[r * count] == static_cast<float>(r);
  std::vector<int> ok{same && right ? 1 : 0};
  comm.all_reduce(std::span<int>(ok), tandem::ReduceOp::min);
  if (ok[0] == 0) {
    if (me == 0) std::fprintf(stderr, "bench_zero_shm: FAILED: the paths differ or sum wrongly\n");
    return 1;
  }
  if (me == 0) {
    std::printf(
        "RESULT bench=zero_shm_collectives ranks=%zu floats=%zu repeats=%d "
        "reduce_scatter_slots_ms=%.2f reduce_scatter_block_ms=%.2f reduce_scatter_ratio=%.2f "
        "all_gather_slots_ms=%.2f all_gather_block_ms=%.2f all_gather_ratio=%.2f "
        "own_part_copy_ms=%.2f all_gather_without_own_copies_ratio=%.2f\n",
        n, total, repeats, best[0] * 1e3, best[1] * 1e3, best[1] / best[0], best[2] * 1e3,
        best[3] * 1e3, best[3] / best[2], best[4] * 1e3,
        std::max(0.0, best[3] - 2 * best[4]) / best[3]);
  }
  return 0;
}
