// ShmComm's shared blocks (allocate_shared), in shm_conformance (one process per rank, 2 to 4
// ranks under tandemrun, and groups of 1 to n split off them): an all_reduce of a tensor in a
// block gives the bits of the slots' path on every rank, at sizes around the chunk and share
// boundaries, at offsets that break the alignment, in every type and operation, sync and async;
// so do a reduce_scatter in place in a block (and LocalComm's arithmetic) and an all_gather from
// one, at odd slice sizes;
// ranks that pass tensors in different places, or ask for blocks of different sizes, all raise
// the same Error and the group goes on; nothing is left in /dev/shm; a block outlives its group;
// the sum kernel's variants (SSE2, AVX2) give reduce_range's bits.
#include <doctest/doctest.h>

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "support/collective_suite.hpp"
#include "support/process_conformance.hpp"
#include "tandem/comm/shm/shm.hpp"

namespace {

using namespace std::chrono_literals;

constexpr auto& comm = tandem::test::job<tandem::ShmComm>;
using tandem::test::regroup;

/// The largest counts the checks below try: all of them, or those around a 64 KiB chunk.
constexpr std::size_t every_count = std::size_t{1} << 24;
constexpr std::size_t chunk_boundaries = 16385;

/// Irregular values of T for `rank` (floats with many bits set; integers small enough that
/// products of four ranks do not wrap differently from a reference).
template <class T>
std::vector<T> values(int rank, std::size_t count) {
  const auto floats = tandem::test::irregular_floats(rank, count);
  std::vector<T> out(count);
  for (std::size_t i = 0; i < count; ++i) {
    if constexpr (std::is_integral_v<T>) {
      out[i] = static_cast<T>(static_cast<std::int64_t>(floats[i] * 100.0f) % 1000);
    } else {
      out[i] = static_cast<T>(floats[i]);
    }
  }
  return out;
}

/// For every count and offset: the tensor in the block, all-reduced in place, holds the bits
/// the slots' path gives for the same values (a copy outside the block).
template <class T>
void check_type(tandem::ShmComm& group, const tandem::SharedBlock& block,
                const std::vector<tandem::ReduceOp>& ops, std::size_t max_count,
                tandem::test::Failures& failures) {
  const std::size_t room = block.bytes / sizeof(T);
  for (const std::size_t count : {std::size_t{16384} * 4 / sizeof(T), std::size_t{16385},
                                  std::size_t{100003}, (std::size_t{1} << 20) + 7}) {
    for (const std::size_t offset : {std::size_t{0}, std::size_t{13}}) {
      if (offset + count > room || count > max_count) continue;
      for (const auto op : ops) {
        const auto mine = values<T>(group.rank(), count);
        T* in_block = reinterpret_cast<T*>(block.data) + offset;
        std::memcpy(in_block, mine.data(), count * sizeof(T));
        auto elsewhere = mine;
        group.all_reduce(std::span<T>(in_block, count), op);
        group.all_reduce(std::span<T>(elsewhere), op);
        failures.expect(std::memcmp(in_block, elsewhere.data(), count * sizeof(T)) == 0,
                        tandem::name(tandem::dtype_of<T>), " count ", count, " offset ", offset,
                        " ", tandem::name(op), ": the block's bits differ from the slots' path");
      }
    }
  }
}

/// `max_count`: the largest count checked (the groups split off the job check the chunk
/// boundaries only: the job's own group, at 2, 3 and 4 ranks, checks every count, and under
/// ThreadSanitizer, CI's, the large counts again on every subgroup took most of the test).
void check_block_bits(tandem::ShmComm& group, std::size_t max_count) {
  tandem::test::Failures failures;
  // Room for the largest count at an offset, in 8-byte elements.
  const auto block = group.allocate_shared(((std::size_t{1} << 20) + 32) * sizeof(double));
  REQUIRE(block);
  CHECK(block.bytes == ((std::size_t{1} << 20) + 32) * sizeof(double));
  CHECK(reinterpret_cast<std::uintptr_t>(block.data) % 64 == 0);
  using tandem::ReduceOp;
  check_type<float>(group, block, {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}, max_count,
                    failures);
  check_type<double>(group, block, {ReduceOp::sum, ReduceOp::prod}, max_count, failures);
  check_type<std::int32_t>(group, block, {ReduceOp::sum, ReduceOp::min}, max_count, failures);
  check_type<tandem::bfloat16>(group, block, {ReduceOp::sum}, max_count, failures);
  // The sums themselves, for one count: 1 + 2 + ... + n everywhere.
  const std::size_t count = 300001;
  auto* data = reinterpret_cast<float*>(block.data);
  for (std::size_t i = 0; i < count; ++i) data[i] = static_cast<float>(group.rank() + 1);
  group.all_reduce(std::span<float>(data, count));
  const auto n = static_cast<float>(group.size());
  bool right = true;
  for (std::size_t i = 0; i < count; ++i) right = right && data[i] == n * (n + 1) / 2;
  failures.expect(right, "the sum in the block is not 1 + ... + n everywhere");
  // Async, queued behind another: the same bits.
  const auto mine = values<float>(group.rank(), count);
  std::memcpy(data, mine.data(), count * sizeof(float));
  auto elsewhere = mine;
  auto first = group.all_reduce_async(std::span<float>(data, count));
  auto second = group.all_reduce_async(std::span<float>(elsewhere));
  first.wait();
  second.wait();
  failures.expect(std::memcmp(data, elsewhere.data(), count * sizeof(float)) == 0,
                  "async: the block's bits differ from the slots' path");
  failures.report();
}

/// Every rank's values for a reduce_scatter of `count` elements a rank, reduced in rank order:
/// LocalComm's arithmetic (reduce_range), computed here from the values every rank gives.
template <class T>
std::vector<T> reduced_slice(const std::vector<std::vector<T>>& inputs, int rank, std::size_t count,
                             tandem::ReduceOp op) {
  std::vector<const T*> sources;
  const std::size_t first = static_cast<std::size_t>(rank) * count;
  for (const auto& input : inputs) sources.push_back(input.data() + first);
  std::vector<T> out(count);
  tandem::detail::reduce_range(out.data(), sources, 0, count, op);
  return out;
}

/// For every slice size and offset: a reduce_scatter in place of a tensor in the block gives the
/// bits of the slots' path (a copy outside the block) and of LocalComm's arithmetic, and leaves
/// the other slices as they were; an all_gather from the block gives what the slots' path gives.
/// Slices of odd sizes, below and above a chunk, at offsets that break the alignment.
template <class T>
void check_scatter_gather(tandem::ShmComm& group, const tandem::SharedBlock& block,
                          const std::vector<tandem::ReduceOp>& ops, std::size_t max_count,
                          tandem::test::Failures& failures) {
  const std::size_t room = block.bytes / sizeof(T);
  const int me = group.rank();
  const auto n = static_cast<std::size_t>(group.size());
  for (const std::size_t count :
       {std::size_t{1001}, std::size_t{16385}, std::size_t{100003}, (std::size_t{1} << 18) + 7}) {
    if (count > max_count) continue;
    // Every rank's values, made once per count (under ThreadSanitizer making them for each
    // offset and op was much of the test's time).
    std::vector<std::vector<T>> inputs;
    for (int r = 0; r < group.size(); ++r) inputs.push_back(values<T>(r, n * count));
    for (const std::size_t offset : {std::size_t{0}, std::size_t{13}}) {
      if (offset + n * count > room) continue;
      T* in_block = reinterpret_cast<T*>(block.data) + offset;
      const std::string where = std::string(tandem::name(tandem::dtype_of<T>)) + " slice " +
                                std::to_string(count) + " offset " + std::to_string(offset);
      for (const auto op : ops) {
        const auto& mine = inputs[static_cast<std::size_t>(me)];
        std::memcpy(in_block, mine.data(), n * count * sizeof(T));
        auto elsewhere = mine;
        T* slice = in_block + static_cast<std::size_t>(me) * count;
        group.reduce_scatter(std::span<T>(in_block, n * count), std::span<T>(slice, count), op);
        group.reduce_scatter(
            std::span<T>(elsewhere),
            std::span<T>(elsewhere.data() + static_cast<std::size_t>(me) * count, count), op);
        failures.expect(std::memcmp(in_block, elsewhere.data(), n * count * sizeof(T)) == 0, where,
                        " ", tandem::name(op),
                        ": the block's reduce_scatter differs from the slots' path");
        const auto want = reduced_slice<T>(inputs, me, count, op);
        failures.expect(std::memcmp(slice, want.data(), count * sizeof(T)) == 0, where, " ",
                        tandem::name(op), ": the block's reduce_scatter is not LocalComm's sum");
      }
      const auto mine = values<T>(me, count);
      std::memcpy(in_block, mine.data(), count * sizeof(T));
      std::vector<T> gathered(n * count);
      std::vector<T> want(n * count);
      group.all_gather(std::span<const T>(in_block, count), std::span<T>(gathered));
      group.all_gather(std::span<const T>(mine), std::span<T>(want));
      failures.expect(std::memcmp(gathered.data(), want.data(), n * count * sizeof(T)) == 0, where,
                      ": the all_gather from the block differs from the slots' path");
      const auto last = values<T>(group.size() - 1, count);
      failures.expect(
          std::memcmp(gathered.data() + (n - 1) * count, last.data(), count * sizeof(T)) == 0,
          where, ": the all_gather from the block lost the last rank's slice");
    }
  }
}

/// `max_count`: as check_block_bits's.
void check_block_scatter_gather(tandem::ShmComm& group, std::size_t max_count) {
  tandem::test::Failures failures;
  const auto n = static_cast<std::size_t>(group.size());
  const auto block = group.allocate_shared(((std::size_t{1} << 18) + 32) * n * sizeof(double));
  REQUIRE(block);
  using tandem::ReduceOp;
  check_scatter_gather<float>(group, block, {ReduceOp::sum, ReduceOp::avg, ReduceOp::max},
                              max_count, failures);
  check_scatter_gather<double>(group, block, {ReduceOp::sum}, max_count, failures);
  check_scatter_gather<std::int32_t>(group, block, {ReduceOp::sum}, max_count, failures);
  // Async, queued behind another: the same bits.
  const std::size_t count = 50001;
  auto* data = reinterpret_cast<float*>(block.data);
  const auto mine = values<float>(group.rank(), n * count);
  std::memcpy(data, mine.data(), n * count * sizeof(float));
  auto elsewhere = mine;
  const std::size_t at = static_cast<std::size_t>(group.rank()) * count;
  auto first = group.reduce_scatter_async(std::span<float>(data, n * count),
                                          std::span<float>(data + at, count));
  auto second = group.reduce_scatter_async(std::span<float>(elsewhere),
                                           std::span<float>(elsewhere.data() + at, count));
  first.wait();
  second.wait();
  failures.expect(std::memcmp(data, elsewhere.data(), n * count * sizeof(float)) == 0,
                  "async: the block's reduce_scatter differs from the slots' path");
  failures.report();
}

/// Each instruction set's variant of the block's sum kernel (and the dispatch between them)
/// against reduce_range, bit for bit, on N parts: counts around a cache line, starts off it.
/// The tests build without optimisation, so the multi-rank bits above run the kernel's loops
/// unvectorised; this runs every variant that this CPU has, whatever the build.
template <std::size_t N, class T>
void check_sum_kernels(tandem::test::Failures& failures) {
  using namespace tandem::detail::shm;
  for (const std::size_t begin : {std::size_t{0}, std::size_t{1}, std::size_t{3}}) {
    for (const std::size_t count :
         {std::size_t{1}, std::size_t{15}, std::size_t{16}, std::size_t{17}, std::size_t{1000}}) {
      for (const bool average : {false, true}) {
        const std::size_t end = begin + count;
        std::vector<std::vector<T>> inputs;
        std::vector<const T*> sources;
        for (std::size_t k = 0; k < N; ++k) inputs.push_back(values<T>(static_cast<int>(k), end));
        for (const auto& input : inputs) sources.push_back(input.data());
        std::vector<T> want(end);
        tandem::detail::reduce_range(want.data(), sources, begin, end,
                                     average ? tandem::ReduceOp::avg : tandem::ReduceOp::sum);
        // Into every part (the all_reduce), then into part `owner` only (the reduce_scatter).
        for (const bool every : {true, false}) {
          const std::size_t owner = N - 1;
          for (int variant = 0; variant < 3; ++variant) {
            auto parts = inputs;
            std::vector<T*> pointers;
            std::array<T*, N> from{};
            for (std::size_t k = 0; k < N; ++k) from[k] = parts[k].data();
            for (auto& part : parts) pointers.push_back(part.data());
            const std::array<T*, 1> one{from[owner]};
            if (variant == 0) sum_parts<N>(pointers, owner, every, begin, end, average);
            if (variant == 1 && every) sum_lines_baseline(from, from, begin, end, average);
            if (variant == 1 && !every) sum_lines_baseline(from, one, begin, end, average);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
            if (variant == 2 && !__builtin_cpu_supports("avx2")) continue;
            if (variant == 2 && every) sum_lines_avx2(from, from, begin, end, average);
            if (variant == 2 && !every) sum_lines_avx2(from, one, begin, end, average);
#else
            if (variant == 2) continue;
#endif
            for (std::size_t k = 0; k < N; ++k) {
              const bool written = every || k == owner;
              const T* expected = written ? want.data() : inputs[k].data();
              failures.expect(
                  std::memcmp(parts[k].data() + begin, expected + begin, count * sizeof(T)) == 0,
                  "sum kernel variant ", variant, " on ", N, " parts of ",
                  tandem::name(tandem::dtype_of<T>), " begin ", begin, " count ", count,
                  average ? " avg" : " sum", every ? " into every part" : " into one", ": part ", k,
                  written ? " differs from reduce_range" : " was written");
            }
          }
        }
      }
    }
  }
}

template <class T>
void check_sum_kernels(tandem::test::Failures& failures) {
  check_sum_kernels<2, T>(failures);
  check_sum_kernels<3, T>(failures);
  check_sum_kernels<4, T>(failures);
  check_sum_kernels<5, T>(failures);
  check_sum_kernels<6, T>(failures);
  check_sum_kernels<7, T>(failures);
  check_sum_kernels<8, T>(failures);
}

}  // namespace

TEST_CASE("ShmComm: the block's sum kernels give reduce_range's bits in every variant") {
  tandem::test::Failures failures;
  check_sum_kernels<float>(failures);
  check_sum_kernels<double>(failures);
  failures.report();
}

TEST_CASE("ShmComm: an all_reduce in a shared block gives the slots' bits, on groups of 1 to n") {
  check_block_bits(comm(), every_count);
  // Every group size from 1 up, split off the job (rank order kept).
  for (int members = 1; members < comm().size(); ++members) {
    CAPTURE(members);
    auto part = comm().split(comm().rank() < members ? 0 : tandem::no_color, comm().rank());
    if (part) check_block_bits(*part, chunk_boundaries);
    comm().barrier();
  }
}

TEST_CASE(
    "ShmComm: a reduce_scatter in place and an all_gather from a shared block give the "
    "slots' bits, on groups of 1 to n") {
  check_block_scatter_gather(comm(), every_count);
  for (int members = 1; members < comm().size(); ++members) {
    CAPTURE(members);
    auto part = comm().split(comm().rank() < members ? 0 : tandem::no_color, comm().rank());
    if (part) check_block_scatter_gather(*part, chunk_boundaries);
    comm().barrier();
  }
}

TEST_CASE("ShmComm: tensors in different places, or blocks of different sizes, are an Error") {
  auto group = regroup(comm(), {.timeout = 60s});
  const int n = group.size();
  if (n < 2) return;
  auto block = group.allocate_shared(std::size_t{1} << 20);
  REQUIRE(block);
  const std::size_t count = 100000;
  auto* in_block = reinterpret_cast<float*>(block.data);
  std::vector<float> elsewhere(count, 1.0f);
  // The last rank passes a tensor outside the block; then one at another offset of it.
  for (const std::size_t last_offset : {std::size_t{0}, std::size_t{64}}) {
    const bool last = group.rank() == n - 1;
    std::span<float> tensor(in_block, count);
    if (last) tensor = last_offset ? std::span<float>(in_block + last_offset, count) : elsewhere;
    try {
      group.all_reduce(tensor);
      FAIL_CHECK("ranks with tensors in different places all-reduced them");
    } catch (const tandem::Error& e) {
      CHECK_MESSAGE(tandem::test::mentions(e.what(), "rank " + std::to_string(group.rank()) + ":",
                                           "all_reduce", "ranks disagree on where the tensor lies",
                                           last_offset ? "at byte 256" : "outside the shared"),
                    e.what());
    }
  }
  // reduce_scatter and all_gather: the last rank's input outside the block; then counts that
  // differ (rank 0 one element more a slice).
  const std::size_t slice = count / static_cast<std::size_t>(n);
  const auto me = static_cast<std::size_t>(group.rank());
  const bool last = group.rank() == n - 1;
  for (const bool other_count : {false, true}) {
    const std::size_t mine = slice + (other_count && group.rank() == 0 ? 1 : 0);
    float* in = last && !other_count ? elsewhere.data() : in_block;
    try {
      group.reduce_scatter(std::span<float>(in, mine * static_cast<std::size_t>(n)),
                           std::span<float>(in + me * mine, mine));
      FAIL_CHECK("ranks whose reduce_scatters disagree reduced them");
    } catch (const tandem::Error& e) {
      CHECK_MESSAGE(
          tandem::test::mentions(e.what(), "rank " + std::to_string(group.rank()) + ":",
                                 "reduce_scatter", other_count ? "" : "outside the shared"),
          e.what());
    }
    std::vector<float> gathered(mine * static_cast<std::size_t>(n));
    try {
      group.all_gather(std::span<const float>(in, mine), std::span<float>(gathered));
      FAIL_CHECK("ranks whose all_gathers disagree gathered");
    } catch (const tandem::Error& e) {
      CHECK_MESSAGE(tandem::test::mentions(e.what(), "rank " + std::to_string(group.rank()) + ":",
                                           "all_gather",
                                           other_count ? "" : "ranks disagree on where the tensor"),
                    e.what());
    }
  }
  // Blocks of different sizes.
  try {
    (void)group.allocate_shared(group.rank() == 0 ? 4096 : 8192);
    FAIL_CHECK("ranks made a block asking for different sizes");
  } catch (const tandem::Error& e) {
    CHECK_MESSAGE(tandem::test::mentions(e.what(), "allocate_shared", "different sizes"), e.what());
  }
  // The group goes on.
  for (std::size_t i = 0; i < count; ++i) in_block[i] = 1.0f;
  group.all_reduce(std::span<float>(in_block, count));
  CHECK(in_block[count - 1] == static_cast<float>(n));
}

TEST_CASE("ShmComm: a shared block leaves nothing in /dev/shm and outlives its group") {
  tandem::SharedBlock block;
  std::string name;
  {
    auto store = comm().store();
    tandem::AnyStore scoped(tandem::PrefixStore<tandem::AnyStore>("blocks-left/", store));
    auto group = tandem::ShmComm::rendezvous(
        tandem::World::single_node(comm().rank(), comm().size()), scoped, {.timeout = 60s});
    block = group.allocate_shared(std::size_t{256} << 10);
    REQUIRE(block);
    name = scoped.get("shm/1/block/1", 60s);
    CHECK(name.rfind("/tandem-shm-", 0) == 0);
    CHECK_MESSAGE(::access(("/dev/shm" + name).c_str(), F_OK) != 0, "left in /dev/shm: " << name);
    std::vector<std::uint8_t> zeros(block.bytes, 0);
    CHECK(std::memcmp(block.data, zeros.data(), block.bytes) == 0);
  }
  // The group is gone; the block's memory stays mapped while the block lives.
  std::memset(block.data, 7, block.bytes);
  CHECK(static_cast<int>(block.data[block.bytes - 1]) == 7);
  comm().barrier();
}
