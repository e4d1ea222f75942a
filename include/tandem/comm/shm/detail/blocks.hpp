// tandem/comm/shm/detail/blocks.hpp - the shared blocks of a ShmComm group (ShmComm::
// allocate_shared): one POSIX object per allocation, holding one part per rank, mapped whole by
// every rank; the registry that tells whether a tensor lies in this rank's part of one (and
// where); and the reduction of a collective in a block, which writes its result into every
// rank's part (all_reduce) or into its owner's (reduce_scatter).
//   if (auto found = blocks.find(out, bytes)) { ... found->part(peer) + found->at ... }
// Needs: Linux (through segment.hpp). Not a public header: detail/engine.hpp holds a Blocks.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/reduction.hpp"
#include "tandem/comm/shm/detail/segment.hpp"

namespace tandem::detail::shm {

/// Up to this many bytes (of the whole: the all_reduce's tensor, the reduce_scatter's input, the
/// all_gather's output) a collective in a block takes the slots' path even so: one barrier and a
/// small copy in cost less than the block's two barriers (measured: 14 us against 20 us at 64
/// KiB, 36 us against 29 us at 128 KiB; bench/results/shm-allreduce.md).
inline constexpr std::size_t in_block_most_slot_bytes = std::size_t{64} << 10;
/// A collective in a block hands out the shares in chunks of this many bytes (a rank done with
/// its own share takes the chunks of a peer's that are left), and looks for a failure recorded
/// by another rank (or an abort) before each: a rank that was stopped past the others' timeout
/// stops writing into their parts within a chunk of running again.
inline constexpr std::size_t block_chunk_bytes = std::size_t{64} << 10;

/// One block: `parts` parts of `part_bytes` bytes, rank r's at base + r * part_bytes.
struct BlockRecord {
  std::uint64_t id = 0;  ///< 1, 2, ... in allocation order: the same on every rank
  std::byte* base = nullptr;
  std::size_t part_bytes = 0;
  std::weak_ptr<Segment> mapping;  ///< the SharedBlocks' keep: expired once the user let go
};

/// Where a tensor lies in a block: `at` bytes into this rank's part of block `id`. Holds the
/// mapping while the operation runs.
struct InBlock {
  std::uint64_t id = 0;
  std::size_t at = 0;
  std::byte* base = nullptr;
  std::size_t part_bytes = 0;
  std::shared_ptr<Segment> hold;

  /// Rank r's copy of the tensor.
  template <class T>
  [[nodiscard]] T* part(int r) const noexcept {
    return reinterpret_cast<T*>(base + static_cast<std::size_t>(r) * part_bytes + at);
  }
  /// Every rank's copy, in rank order.
  template <class T>
  [[nodiscard]] std::vector<T*> parts(int ranks) const {
    std::vector<T*> all;
    all.reserve(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) all.push_back(part<T>(r));
    return all;
  }
};

/// This rank's registry of its group's blocks. Used by the thread running the Engine's
/// operation only.
class Blocks {
 public:
  /// Records a block just mapped (the caller keeps the only shared_ptr: the SharedBlock's).
  void add(BlockRecord record) { records_.push_back(std::move(record)); }

  /// The id the next block will have (the same on every rank: allocation is collective).
  [[nodiscard]] std::uint64_t next_id() const noexcept { return next_id_; }
  void count_one() noexcept { ++next_id_; }

  /// Where [data, data + bytes) lies in this rank's part of a live block, or nullopt. A block
  /// whose SharedBlocks are all gone is forgotten here (its memory is unmapped, and its
  /// addresses may be another allocation's by now).
  [[nodiscard]] std::optional<InBlock> find(const void* data, std::size_t bytes, int rank) {
    std::erase_if(records_, [](const BlockRecord& r) { return r.mapping.expired(); });
    const auto* at = static_cast<const std::byte*>(data);
    for (const BlockRecord& record : records_) {
      const std::byte* mine = record.base + static_cast<std::size_t>(rank) * record.part_bytes;
      if (at < mine || at >= mine + record.part_bytes) continue;
      const auto offset = static_cast<std::size_t>(at - mine);
      if (bytes > record.part_bytes - offset) return std::nullopt;  // runs past the part
      auto hold = record.mapping.lock();
      if (!hold) return std::nullopt;
      return InBlock{record.id, offset, record.base, record.part_bytes, std::move(hold)};
    }
    return std::nullopt;
  }

 private:
  std::vector<BlockRecord> records_;
  std::uint64_t next_id_ = 1;
};

/// For i in [begin, end): to[0][i], ..., to[M-1][i] become from[0][i] + ... + from[N-1][i]
/// (divided by N for `average`) - reduce_range's additions in the same (rank) order and its
/// division, so its bits. A cache line of every part at a time, read whole into an accumulator
/// before any part is written: fixed-length loops the compiler vectorises although the
/// destinations are sources too (every part for the all_reduce, the owner's for the
/// reduce_scatter). Inlined into each instruction set's variant below. Ordinary stores:
/// streaming (non-temporal) ones into the peers' parts, or into every part, made the all_reduce
/// 1.2-4.4x slower from 1 to 16 MiB and won nothing at 64 MiB (c4941f8,
/// bench/results/shm-allreduce-stream.md) - every line written was just read, so they save no
/// read for ownership, and they push the result out of the caches its next reader looks in.
template <std::size_t N, std::size_t M, class T>
[[gnu::always_inline]] inline void sum_lines(const std::array<T*, N>& from,
                                             const std::array<T*, M>& to, std::size_t begin,
                                             std::size_t end, bool average) {
  const auto ranks = static_cast<T>(N);
  constexpr std::size_t lanes = 64 / sizeof(T);
  std::size_t i = begin;
  for (; i + lanes <= end; i += lanes) {
    T acc[lanes];
    for (std::size_t l = 0; l < lanes; ++l) acc[l] = from[0][i + l];
    for (std::size_t k = 1; k < N; ++k) {
      for (std::size_t l = 0; l < lanes; ++l) acc[l] = acc[l] + from[k][i + l];
    }
    if (average) {
      for (std::size_t l = 0; l < lanes; ++l) acc[l] = acc[l] / ranks;
    }
    for (std::size_t k = 0; k < M; ++k) {
      for (std::size_t l = 0; l < lanes; ++l) to[k][i + l] = acc[l];
    }
  }
  for (; i < end; ++i) {
    T acc = from[0][i];
    for (std::size_t k = 1; k < N; ++k) acc = acc + from[k][i];
    if (average) acc = acc / ranks;
    for (std::size_t k = 0; k < M; ++k) to[k][i] = acc;
  }
}

/// sum_lines for the baseline instruction set (SSE2 on x86-64).
template <std::size_t N, std::size_t M, class T>
void sum_lines_baseline(const std::array<T*, N>& from, const std::array<T*, M>& to,
                        std::size_t begin, std::size_t end, bool average) {
  sum_lines(from, to, begin, end, average);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/// The same with 32-byte vectors, where the CPU has AVX2: the loop is bound by its stores, not
/// by the caches (measured on the 2-CPU EPYC of bench/results/shm-allreduce-2.md: 4 MiB of two
/// parts in 143 us with SSE2, 90 us with AVX2, one core). Additions and divisions of single
/// elements, as in SSE2: the same bits (no FMA: nothing is multiplied).
template <std::size_t N, std::size_t M, class T>
[[gnu::target("avx2")]] void sum_lines_avx2(const std::array<T*, N>& from,
                                            const std::array<T*, M>& to, std::size_t begin,
                                            std::size_t end, bool average) {
  sum_lines(from, to, begin, end, average);
}
#endif

/// sum_lines with the widest vectors this CPU has.
template <std::size_t N, std::size_t M, class T>
void sum_lines_here(const std::array<T*, N>& from, const std::array<T*, M>& to, std::size_t begin,
                    std::size_t end, bool average) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool avx2 = __builtin_cpu_supports("avx2") != 0;
  if (avx2) return sum_lines_avx2(from, to, begin, end, average);
#endif
  sum_lines_baseline(from, to, begin, end, average);
}

/// The sum (or average) of N parts, written into every part (`every`) or into part `owner`.
template <std::size_t N, class T>
void sum_parts(const std::vector<T*>& parts, std::size_t owner, bool every, std::size_t begin,
               std::size_t end, bool average) {
  std::array<T*, N> from{};
  std::copy_n(parts.begin(), N, from.begin());
  if (every) return sum_lines_here(from, from, begin, end, average);
  sum_lines_here(from, std::array<T*, 1>{from[owner]}, begin, end, average);
}

/// reduce_range (comm/detail/reduction.hpp) of [begin, end) of the parts, written into part
/// `owner` and, where `every` (the all_reduce), into every other part too. Sum and avg of float
/// and double over 2 to 8 parts run as one pass (sum_parts); everything else is reduce_range
/// into the owner's part, then copied into the others. Either way reduce_range's bits (the tests
/// compare them).
template <class T>
void reduce_chunk(const std::vector<T*>& parts, std::size_t owner, bool every, std::size_t begin,
                  std::size_t end, ReduceOp op) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    if (op == ReduceOp::sum || op == ReduceOp::avg) {
      const bool average = op == ReduceOp::avg;
      switch (parts.size()) {
        case 2:
          return sum_parts<2>(parts, owner, every, begin, end, average);
        case 3:
          return sum_parts<3>(parts, owner, every, begin, end, average);
        case 4:
          return sum_parts<4>(parts, owner, every, begin, end, average);
        case 5:
          return sum_parts<5>(parts, owner, every, begin, end, average);
        case 6:
          return sum_parts<6>(parts, owner, every, begin, end, average);
        case 7:
          return sum_parts<7>(parts, owner, every, begin, end, average);
        case 8:
          return sum_parts<8>(parts, owner, every, begin, end, average);
        default:
          break;
      }
    }
  }
  const std::vector<const T*> sources(parts.begin(), parts.end());
  reduce_range(parts[owner], sources, begin, end, op);
  if (!every) return;
  for (std::size_t k = 0; k < parts.size(); ++k) {
    if (k != owner) std::memcpy(parts[k] + begin, parts[owner] + begin, (end - begin) * sizeof(T));
  }
}

}  // namespace tandem::detail::shm
