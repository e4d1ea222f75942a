// tandem/comm/shm/detail/ring.hpp - the messages of ShmComm's send and recv: the header in front
// of each message in a byte ring, a message as it arrives, the per-source inbox, and copying into
// and out of a ring that wraps around.
//   write_ring(data, ring_bytes, tail, from, n);   read_ring(data, ring_bytes, head, to, n);
// Needs: the standard library. Not a public header: detail/engine.hpp uses it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <vector>

#include "tandem/tensor/dtype.hpp"

namespace tandem::detail::shm {

/// The header in front of every message in a ring.
struct Frame {
  std::int64_t tag = 0;
  std::uint64_t type = 0;
  std::uint64_t count = 0;
  std::uint64_t bytes = 0;
};

/// A message taken off a ring (or sent by this rank to itself), whole or still arriving.
struct Message {
  dtype type = dtype::float32;
  std::size_t count = 0;
  std::vector<std::byte> bytes;
  std::size_t received = 0;
  [[nodiscard]] bool complete() const noexcept { return received == bytes.size(); }
};

/// What this rank has taken off the ring from one peer: its messages by tag, in order.
struct Inbox {
  std::uint64_t head = 0;
  Frame frame{};
  std::size_t frame_received = 0;
  Message* arriving = nullptr;  ///< the back of one of the queues, until it is complete
  std::map<std::int64_t, std::deque<Message>> by_tag;
};

inline void read_ring(const std::byte* ring, std::size_t ring_bytes, std::uint64_t position,
                      std::byte* to, std::size_t n) {
  const auto at = static_cast<std::size_t>(position % ring_bytes);
  const std::size_t first = std::min(n, ring_bytes - at);
  std::memcpy(to, ring + at, first);
  if (n > first) std::memcpy(to + first, ring, n - first);
}

inline void write_ring(std::byte* ring, std::size_t ring_bytes, std::uint64_t position,
                       const std::byte* from, std::size_t n) {
  const auto at = static_cast<std::size_t>(position % ring_bytes);
  const std::size_t first = std::min(n, ring_bytes - at);
  std::memcpy(ring + at, from, first);
  if (n > first) std::memcpy(ring, from + first, n - first);
}

}  // namespace tandem::detail::shm
