// tandem/comm/shm/detail/messages.hpp - send and recv of a ShmComm group: how the Engine writes
// a message into the byte ring to its peer (waiting for room) and takes what its peers wrote
// into its inboxes, which it does in every wait (so that a sender blocked on a full ring goes on).
//   engine.put(peer, tag, bytes, n);   engine.pump_all();
// Needs: Linux (through segment.hpp). Not a public header: detail/engine.hpp declares these
// members and shm.hpp includes this header.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tandem/comm/shm/detail/engine.hpp"
#include "tandem/comm/shm/detail/ring.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem::detail::shm {

inline void Engine::put(int peer, int tag, const std::byte* from, std::size_t n) {
  RingState& state = ring(rank_, peer);
  std::byte* data = ring_data(rank_, peer);
  std::uint64_t& tail = sent_[static_cast<std::size_t>(peer)];
  auto room = [&] {
    return layout_.ring_bytes -
           static_cast<std::size_t>(tail - state.head.load(std::memory_order_acquire));
  };
  while (n > 0) {
    wait([&] { return room() > 0; }, [&] { return std::vector<int>{peer}; },
         [&] {
           return "timed out after " + describe(options_.timeout) + " waiting for rank " +
                  std::to_string(peer) + " to take this rank's earlier messages (tag " +
                  std::to_string(tag) + "; the ring to it is full)";
         });
    const std::size_t take = std::min(n, room());
    write_ring(data, layout_.ring_bytes, tail, from, take);
    tail += take;
    state.tail.store(tail, std::memory_order_release);
    notify();
    from += take;
    n -= take;
  }
}

inline void Engine::pump_all() {
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) pump(r);
  }
}

inline void Engine::pump(int src) {
  RingState& state = ring(src, rank_);
  Inbox& in = inboxes_[static_cast<std::size_t>(src)];
  const std::uint64_t tail = state.tail.load(std::memory_order_acquire);
  if (tail == in.head) return;
  const std::byte* data = ring_data(src, rank_);
  while (in.head < tail) {
    const auto available = static_cast<std::size_t>(tail - in.head);
    if (!in.arriving) {
      const std::size_t take = std::min(available, sizeof(Frame) - in.frame_received);
      read_ring(data, layout_.ring_bytes, in.head,
                reinterpret_cast<std::byte*>(&in.frame) + in.frame_received, take);
      in.head += take;
      in.frame_received += take;
      if (in.frame_received < sizeof(Frame)) break;
      in.frame_received = 0;
      begin_message(src, in);
    } else {
      Message& message = *in.arriving;
      const std::size_t take = std::min(available, message.bytes.size() - message.received);
      read_ring(data, layout_.ring_bytes, in.head, message.bytes.data() + message.received, take);
      in.head += take;
      message.received += take;
      if (message.complete()) in.arriving = nullptr;
    }
  }
  state.head.store(in.head, std::memory_order_release);
  notify();
}

inline void Engine::begin_message(int src, Inbox& in) {
  const Frame& frame = in.frame;
  if (frame.type > static_cast<std::uint64_t>(dtype::uint8) ||
      frame.bytes != frame.count * size_of(static_cast<dtype>(frame.type))) {
    fail("rank " + std::to_string(src) + " sent a corrupt message header");
  }
  auto& queue = in.by_tag[frame.tag];
  queue.push_back(Message{static_cast<dtype>(frame.type), static_cast<std::size_t>(frame.count),
                          std::vector<std::byte>(static_cast<std::size_t>(frame.bytes)), 0});
  in.arriving = queue.back().complete() ? nullptr : &queue.back();
}

}  // namespace tandem::detail::shm
