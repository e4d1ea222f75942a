// tandem/comm/gloo/detail/ring.hpp - GlooComm's reduce_scatter: a pipelined ring over gloo's
// unbound buffers. Each rank sends to the next rank and receives from the previous one, so a rank
// moves (n - 1) / n of its input once (an all_reduce moves twice that), in pieces of at most
// ring_piece_bytes, reducing each piece as it arrives; it needs two pieces of scratch, plus one
// rank's slot for the partial sums where out cannot hold them (more than 2 ranks, out inside in).
//   ring_reduce_scatter(context, in, out, count, op, {.slot = s, .timeout = t}, scratch, wait);
// Needs: Gloo with its TCP transport (libgloo-dev). Not a public header: engine.hpp uses it.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/reduction.hpp"
#include "tandem/comm/gloo/detail/gloo_support.hpp"

namespace tandem::detail::gloo_comm {

/// The most bytes one ring message carries (gloo's own allreduce uses the same): each message
/// costs a round trip before it moves (the receiver announces its buffer), so smaller pieces lose
/// time - 128 KiB took twice as long as 1 MiB for 25 MiB over loopback at 2 ranks, 4 MiB about a
/// tenth less - while larger ones hold more scratch and overlap less of the reduction.
inline constexpr std::size_t ring_piece_bytes = std::size_t{1} << 20;

/// What one ring call runs under: its slot (unique per collective, so that nothing else on the
/// connections can match its messages) and the bound on every wait.
struct RingCall {
  std::uint64_t slot = 0;
  std::chrono::milliseconds timeout{0};
};

/// Scratch the ring keeps for the communicator's life: the two pieces messages arrive in, with
/// their gloo buffer (made once: gloo's device thread may still finish a completion handler on a
/// buffer after its wait returned, see Engine::exchange), and the partial sums where out cannot
/// hold them.
struct RingScratch {
  std::vector<std::byte> pieces;
  std::unique_ptr<::gloo::transport::UnboundBuffer> pieces_buffer;
  std::vector<std::byte> partials;
};

/// The per-call gloo buffers over the caller's input and over the partial sums; buried by the
/// engine on a failure (quiescing), as gloo may still be completing a send from them.
struct RingBuffers {
  std::unique_ptr<::gloo::transport::UnboundBuffer> input;
  std::unique_ptr<::gloo::transport::UnboundBuffer> partials;
};

/// One wait for a ring transfer; false (an aborted wait) is a failure like gloo's own errors.
inline void expect_done(bool completed, const char* what) {
  if (!completed)
    throw std::runtime_error(std::string("reduce_scatter: the ") + what + " was aborted");
}

/// out = the reduction over every rank of slot `rank` of `in` (n slots of `count` elements), for
/// n > 1 and count > 0; avg is left as a sum (the caller divides). `out` may be this rank's own
/// slot of `in` or overlap it anywhere. `wait(fn, keep)` runs a wait that may throw, keeping
/// `keep` alive should it fail (the engine's quiescing).
template <class T, class Wait>
void ring_reduce_scatter(::gloo::Context& context, const T* in, T* out, std::size_t count,
                         ReduceOp op, const RingCall& call, RingScratch& scratch, Wait&& wait) {
  const auto n = static_cast<std::size_t>(context.size);
  const auto me = static_cast<std::size_t>(context.rank);
  const int left = static_cast<int>((me + n - 1) % n);
  const int right = static_cast<int>((me + 1) % n);

  // Step s (0 .. n-2) sends the partial sum of slot (me - s - 1) and receives the one of slot
  // (me - s - 2), adding this rank's own part; step n-2 receives slot `me`, the last part.
  const auto send_slot = [&](std::size_t step) { return (me + 2 * n - step - 1) % n; };
  const auto recv_slot = [&](std::size_t step) { return (me + 2 * n - step - 2) % n; };
  const std::size_t last_step = n - 2;

  // Where the partial sums of the steps before the last live, and where the last one goes. out
  // holds them unless it lies inside in: then the partials (read after step 0's sends from in)
  // go to scratch, and so does the result unless out is exactly this rank's slot (each element
  // of that slot is read once, by the last step, just before its result overwrites it).
  const bool out_in_input = overlap(in, n * count, static_cast<const T*>(out), count);
  const bool own_slot = out == in + me * count;
  const bool needs_partials = out_in_input && (n > 2 || !own_slot);
  if (needs_partials && scratch.partials.size() < count * sizeof(T)) {
    scratch.partials.resize(count * sizeof(T));
  }
  T* partials = needs_partials ? reinterpret_cast<T*>(scratch.partials.data()) : out;
  T* result = out_in_input && !own_slot ? partials : out;

  constexpr std::size_t piece = ring_piece_bytes / sizeof(T);
  const std::size_t pieces_per_slot = (count + piece - 1) / piece;
  const std::size_t units = (n - 1) * pieces_per_slot;  // one message each way per unit
  // Two pieces in flight while the previous one is reduced; one when the partial to send next is
  // the one just received (a slot of one piece).
  const std::size_t window = std::min<std::size_t>(2, pieces_per_slot);

  if (!scratch.pieces_buffer) {
    scratch.pieces.resize(2 * ring_piece_bytes);
    scratch.pieces_buffer =
        context.createUnboundBuffer(scratch.pieces.data(), 2 * ring_piece_bytes);
  }
  T* arrived = reinterpret_cast<T*>(scratch.pieces.data());

  auto buffers = std::make_shared<RingBuffers>();
  buffers->input = context.createUnboundBuffer(const_cast<T*>(in), n * count * sizeof(T));
  if (n > 2) buffers->partials = context.createUnboundBuffer(partials, count * sizeof(T));
  auto& into = *scratch.pieces_buffer;
  const auto reduce = reducer<T>(op);

  struct Unit {
    std::size_t step, begin, length, half;
  };
  const auto unit = [&](std::size_t i) {
    const std::size_t begin = (i % pieces_per_slot) * piece;
    return Unit{i / pieces_per_slot, begin, std::min(piece, count - begin), i % 2};
  };
  const auto sender = [&](const Unit& u) -> ::gloo::transport::UnboundBuffer& {
    return u.step == 0 ? *buffers->input : *buffers->partials;
  };
  const auto post = [&](std::size_t i) {
    const Unit u = unit(i);
    const std::size_t bytes = u.length * sizeof(T);
    into.recv(left, call.slot, u.half * piece * sizeof(T), bytes);
    const std::size_t from = u.step == 0 ? send_slot(0) * count + u.begin : u.begin;
    sender(u).send(right, call.slot, from * sizeof(T), bytes);
  };
  // Messages on one slot between two ranks arrive in the order they were sent, so the i-th wait
  // on a buffer completes its i-th transfer.
  const auto complete = [&](std::size_t i) {
    const Unit u = unit(i);
    wait(
        [&] {
          expect_done(into.waitRecv(call.timeout), "receive");
          // The send read the partial this unit's reduction overwrites.
          expect_done(sender(u).waitSend(call.timeout), "send");
        },
        buffers);
    T* target = (u.step == last_step ? result : partials) + u.begin;
    reduce(target, arrived + u.half * piece, in + recv_slot(u.step) * count + u.begin, u.length);
  };

  std::size_t completed = 0;
  for (std::size_t i = 0; i < units; ++i) {
    while (completed + window <= i) complete(completed++);
    post(i);
  }
  while (completed < units) complete(completed++);
  copy_elements(static_cast<const T*>(result), count, out);
}

}  // namespace tandem::detail::gloo_comm
