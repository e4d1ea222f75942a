// ShmComm's shared blocks (allocate_shared), in shm_conformance (one process per rank, 2 to 4
// ranks under tandemrun, and groups of 1 to n split off them): an all_reduce of a tensor in a
// block gives the bits of the slots' path on every rank, at sizes around the chunk and share
// boundaries, at offsets that break the alignment, in every type and operation, sync and async;
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
                const std::vector<tandem::ReduceOp>& ops, tandem::test::Failures& failures) {
  const std::size_t room = block.bytes / sizeof(T);
  for (const std::size_t count : {std::size_t{16384} * 4 / sizeof(T), std::size_t{16385},
                                  std::size_t{100003}, (std::size_t{1} << 20) + 7}) {
    for (const std::size_t offset : {std::size_t{0}, std::size_t{13}}) {
      if (offset + count > room) continue;
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

void check_block_bits(tandem::ShmComm& group) {
  tandem::test::Failures failures;
  // Room for the largest count at an offset, in 8-byte elements.
  const auto block = group.allocate_shared(((std::size_t{1} << 20) + 32) * sizeof(double));
  REQUIRE(block);
  CHECK(block.bytes == ((std::size_t{1} << 20) + 32) * sizeof(double));
  CHECK(reinterpret_cast<std::uintptr_t>(block.data) % 64 == 0);
  using tandem::ReduceOp;
  check_type<float>(group, block, {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}, failures);
  check_type<double>(group, block, {ReduceOp::sum, ReduceOp::prod}, failures);
  check_type<std::int32_t>(group, block, {ReduceOp::sum, ReduceOp::min}, failures);
  check_type<tandem::bfloat16>(group, block, {ReduceOp::sum}, failures);
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
        for (int variant = 0; variant < 3; ++variant) {
          auto parts = inputs;
          std::vector<T*> pointers;
          std::array<T*, N> to{};
          for (std::size_t k = 0; k < N; ++k) to[k] = parts[k].data();
          for (auto& part : parts) pointers.push_back(part.data());
          if (variant == 0) sum_into_parts<N>(pointers, begin, end, average);
          if (variant == 1) sum_into_parts_baseline<N>(to, begin, end, average);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
          if (variant == 2 && __builtin_cpu_supports("avx2")) {
            sum_into_parts_avx2<N>(to, begin, end, average);
          } else if (variant == 2) {
            continue;
          }
#else
          if (variant == 2) continue;
#endif
          for (std::size_t k = 0; k < N; ++k) {
            failures.expect(
                std::memcmp(parts[k].data() + begin, want.data() + begin, count * sizeof(T)) == 0,
                "sum kernel variant ", variant, " on ", N, " parts of ",
                tandem::name(tandem::dtype_of<T>), " begin ", begin, " count ", count,
                average ? " avg" : " sum", ": part ", k, " differs from reduce_range");
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
  check_block_bits(comm());
  // Every group size from 1 up, split off the job (rank order kept).
  for (int members = 1; members < comm().size(); ++members) {
    CAPTURE(members);
    auto part = comm().split(comm().rank() < members ? 0 : tandem::no_color, comm().rank());
    if (part) check_block_bits(*part);
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
