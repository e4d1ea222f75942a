// tandem/comm/detail/reduction.hpp - the element-wise arithmetic of every backend's reductions:
// what a ReduceOp computes for each element type, LocalComm's vectorisable tile loop, avg's
// division, and the copies and overlap tests around them.
//   tandem::detail::reduce_range(dst, sources, 0, count, tandem::ReduceOp::sum);
// Needs: the standard library. Not a public header: backends include it.
//
// The rules, as in NCCL: 16-bit floats compute in float and round once per result; signed
// integers sum and multiply in their unsigned twin (two's complement wrap-around, never undefined
// overflow); min and max keep the first of two equal elements; avg is a sum divided by the number
// of ranks, for floating-point types only (callers reject it for integers first).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem::detail {

template <class T>
inline constexpr bool is_float16 = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

/// The type a reduction accumulates in: float for the 16-bit floats, T otherwise.
template <class T>
using accumulator_t = std::conditional_t<is_float16<T>, float, T>;

/// Integers are summed and multiplied in their unsigned twin (defined wrap-around).
template <class T>
struct wrapping {
  using type = T;
};
template <std::integral T>
struct wrapping<T> {
  using type = std::make_unsigned_t<T>;
};

/// a op b on accumulator values (avg combines as sum; the division comes last).
template <ReduceOp Op, class T>
T combine(T a, T b) noexcept {
  using Wide = typename wrapping<T>::type;
  if constexpr (Op == ReduceOp::sum || Op == ReduceOp::avg) {
    if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(static_cast<Wide>(static_cast<Wide>(a) + static_cast<Wide>(b)));
    } else {
      return a + b;
    }
  } else if constexpr (Op == ReduceOp::prod) {
    if constexpr (std::is_integral_v<T>) {
      // uint8 promotes to int; 255 * 255 still fits.
      return static_cast<T>(static_cast<Wide>(static_cast<Wide>(a) * static_cast<Wide>(b)));
    } else {
      return a * b;
    }
  } else if constexpr (Op == ReduceOp::min) {
    return b < a ? b : a;
  } else {
    return a < b ? b : a;
  }
}

/// a op b for two elements: computed in accumulator_t<T> and rounded once; min and max return
/// one of the two elements unchanged.
template <ReduceOp Op, class T>
T combine_elements(T a, T b) noexcept {
  using Acc = accumulator_t<T>;
  if constexpr (Op == ReduceOp::min) {
    return static_cast<Acc>(b) < static_cast<Acc>(a) ? b : a;
  } else if constexpr (Op == ReduceOp::max) {
    return static_cast<Acc>(a) < static_cast<Acc>(b) ? b : a;
  } else {
    return static_cast<T>(combine<Op, Acc>(static_cast<Acc>(a), static_cast<Acc>(b)));
  }
}

/// reduce_range for one operation. Works tile by tile: a tile of every source is combined into
/// a small accumulator, in rank order, then written to dst. The loops run over contiguous
/// elements with the operation fixed, so the compiler vectorises them; and because dst is
/// written only after every source of that tile has been read, dst may alias a source.
template <ReduceOp Op, class T>
void reduce_tiles(T* dst, const std::vector<const T*>& sources, std::size_t begin,
                  std::size_t end) {
  using Acc = accumulator_t<T>;
  constexpr std::size_t tile = 1024;
  Acc acc[tile];
  const auto n = sources.size();
  for (std::size_t first = begin; first < end; first += tile) {
    const std::size_t length = std::min(tile, end - first);
    const T* source = sources[0] + first;
    for (std::size_t j = 0; j < length; ++j) acc[j] = static_cast<Acc>(source[j]);
    for (std::size_t s = 1; s < n; ++s) {
      source = sources[s] + first;
      for (std::size_t j = 0; j < length; ++j) {
        acc[j] = combine<Op, Acc>(acc[j], static_cast<Acc>(source[j]));
      }
    }
    if constexpr (Op == ReduceOp::avg && !std::is_integral_v<Acc>) {
      const auto ranks = static_cast<Acc>(n);
      for (std::size_t j = 0; j < length; ++j) acc[j] = acc[j] / ranks;
    }
    T* out = dst + first;
    for (std::size_t j = 0; j < length; ++j) out[j] = static_cast<T>(acc[j]);
  }
}

/// dst[i] = sources[0][i] op sources[1][i] op ... (in rank order) for i in [begin, end), each
/// element accumulated in accumulator_t<T> and rounded once. dst may alias one of the sources.
template <class T>
void reduce_range(T* dst, const std::vector<const T*>& sources, std::size_t begin, std::size_t end,
                  ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return reduce_tiles<ReduceOp::sum>(dst, sources, begin, end);
    case ReduceOp::avg:
      return reduce_tiles<ReduceOp::avg>(dst, sources, begin, end);
    case ReduceOp::prod:
      return reduce_tiles<ReduceOp::prod>(dst, sources, begin, end);
    case ReduceOp::min:
      return reduce_tiles<ReduceOp::min>(dst, sources, begin, end);
    case ReduceOp::max:
      return reduce_tiles<ReduceOp::max>(dst, sources, begin, end);
  }
}

/// avg's second half: data[i] /= ranks, rounded once (16-bit floats divide in float). Integers
/// never get here (avg is rejected for them before anything is sent).
template <class T>
void divide(T* data, std::size_t count, int ranks) noexcept {
  if constexpr (is_float16<T>) {
    for (std::size_t i = 0; i < count; ++i) {
      data[i] = T(static_cast<float>(data[i]) / static_cast<float>(ranks));
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    for (std::size_t i = 0; i < count; ++i) data[i] = data[i] / static_cast<T>(ranks);
  }
}

template <class T>
void copy_elements(const T* src, std::size_t count, T* dst) noexcept {
  if (count && src != dst) std::memmove(dst, src, count * sizeof(T));
}

/// Whether [a, a + n) and [b, b + m) share an element.
template <class T>
bool overlap(const T* a, std::size_t n, const T* b, std::size_t m) noexcept {
  if (n == 0 || m == 0) return false;
  const std::less<const T*> before;
  return before(a, b + m) && before(b, a + n);
}

}  // namespace tandem::detail
