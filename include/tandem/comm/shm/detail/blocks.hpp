// tandem/comm/shm/detail/blocks.hpp - the shared blocks of a ShmComm group (ShmComm::
// allocate_shared): one POSIX object per allocation, holding one part per rank, mapped whole by
// every rank; the registry that tells whether a tensor lies in this rank's part of one (and
// where); and the copy with non-temporal stores that the all_reduce in a block finishes with.
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

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace tandem::detail::shm {

/// Up to this many bytes an all_reduce in a block takes the slots' path even so: one barrier and
/// a small copy in cost less than the block's two barriers and chunk counts (measured: 14 us
/// against 20 us at 64 KiB, 36 us against 29 us at 128 KiB; bench/results/shm-allreduce.md).
inline constexpr std::size_t in_block_most_slot_bytes = std::size_t{64} << 10;
/// In an all_reduce of a tensor of at least this many bytes the copies of the peers' shares
/// bypass the cache (non-temporal stores): the parts of every rank then pass the last-level
/// cache (32 MiB here) and the tensor is not read from it again, so the stores need not read
/// the destination's lines first. Below it, the tensor stays in the cache for whoever reads it
/// next (the optimizer). On the loaded 2-core machine of bench/results/shm-allreduce.md the
/// difference was within the noise at 1 to 64 MiB.
inline constexpr std::size_t streaming_copy_bytes = std::size_t{16} << 20;
/// A rank reduces its share in chunks of this many bytes, and counts each one done in its record
/// (RankState::reduced); the peers copy a chunk as soon as it is counted, while it is still in
/// the cache, instead of waiting for every share behind a barrier.
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

/// dst[i] = parts[0][i] + ... + parts[N-1][i] (divided by N for `average`) for i in [begin,
/// end), one pass per element; dst may be one of the parts (each element is read before it is
/// written).
template <std::size_t N, class T>
void sum_parts(T* dst, const std::vector<const T*>& parts, std::size_t begin, std::size_t end,
               bool average) {
  std::array<const T*, N> from{};
  std::copy_n(parts.begin(), N, from.begin());
  const auto ranks = static_cast<T>(N);
  for (std::size_t i = begin; i < end; ++i) {
    T acc = from[0][i];
    for (std::size_t k = 1; k < N; ++k) acc = acc + from[k][i];
    dst[i] = average ? acc / ranks : acc;
  }
}

/// reduce_range (comm/detail/reduction.hpp) over the parts of a block. Sum and avg of float and
/// double over 2 to 8 parts run as one pass per element - the same additions in the same (rank)
/// order and the same division, so the same bits (the tests compare them), at 3 to 4 times the
/// speed of reduce_range's tiles, which copy each tile through an accumulator (the reduction is
/// what limits an all_reduce in a block); everything else is reduce_range's.
template <class T>
void reduce_parts(T* dst, const std::vector<const T*>& parts, std::size_t begin, std::size_t end,
                  ReduceOp op) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    if (op == ReduceOp::sum || op == ReduceOp::avg) {
      const bool average = op == ReduceOp::avg;
      switch (parts.size()) {
        case 2:
          return sum_parts<2>(dst, parts, begin, end, average);
        case 3:
          return sum_parts<3>(dst, parts, begin, end, average);
        case 4:
          return sum_parts<4>(dst, parts, begin, end, average);
        case 5:
          return sum_parts<5>(dst, parts, begin, end, average);
        case 6:
          return sum_parts<6>(dst, parts, begin, end, average);
        case 7:
          return sum_parts<7>(dst, parts, begin, end, average);
        case 8:
          return sum_parts<8>(dst, parts, begin, end, average);
        default:
          break;
      }
    }
  }
  reduce_range(dst, parts, begin, end, op);
}

/// memcpy of `bytes` bytes; `streaming` (the tensor is large: streaming_copy_bytes) with
/// non-temporal stores where both ends have the same alignment (the same offset in two parts of
/// a block: always): the destination's lines are not read first, and the copy does not evict
/// what the cache holds.
inline void copy_bytes(const std::byte* from, std::byte* to, std::size_t bytes,
                       bool streaming) noexcept {
#if defined(__x86_64__)
  const auto misaligned = reinterpret_cast<std::uintptr_t>(from) % 16;
  if (streaming && bytes >= 64 && misaligned == reinterpret_cast<std::uintptr_t>(to) % 16) {
    if (misaligned) {  // up to the first aligned byte as it is
      const std::size_t head = 16 - misaligned;
      std::memcpy(to, from, head);
      from += head;
      to += head;
      bytes -= head;
    }
    const std::size_t blocks = bytes / 64;
    const auto* source = reinterpret_cast<const __m128i*>(from);
    auto* target = reinterpret_cast<__m128i*>(to);
    for (std::size_t i = 0; i < blocks; ++i, source += 4, target += 4) {
      const __m128i a = _mm_load_si128(source);
      const __m128i b = _mm_load_si128(source + 1);
      const __m128i c = _mm_load_si128(source + 2);
      const __m128i d = _mm_load_si128(source + 3);
      _mm_stream_si128(target, a);
      _mm_stream_si128(target + 1, b);
      _mm_stream_si128(target + 2, c);
      _mm_stream_si128(target + 3, d);
    }
    _mm_sfence();  // the stores are seen before the barrier that publishes them
    const std::size_t done = blocks * 64;
    if (done < bytes) std::memcpy(to + done, from + done, bytes - done);
    return;
  }
#else
  (void)streaming;
#endif
  if (bytes) std::memcpy(to, from, bytes);
}

}  // namespace tandem::detail::shm
