// tandem/comm/shm/options.hpp - tandem::ShmCommOptions, how a group of ShmComm ranks (processes of
// one node meeting in shared memory) behaves.
//   auto comm = tandem::init_process_group<tandem::ShmComm>("env://", {.timeout = 60s});
// Needs: the standard library.
#pragma once

#include <chrono>
#include <cstddef>

#include "tandem/core/timeout.hpp"

namespace tandem {

/// How a group of ShmComm ranks behaves. Every rank of a group passes the same values.
struct ShmCommOptions {
  /// How long any wait (rendezvous, collective, send, recv) lasts before it raises tandem::Error.
  Timeout timeout = default_timeout;
  /// Bytes of each of a rank's two staging slots: a collective moves a larger tensor through in
  /// pieces of this size, one barrier each. A group's segment holds 2 x slot_bytes per rank, plus
  /// 64 KiB per ordered pair of ranks for send and recv; where that is more than half of what
  /// /dev/shm has free, rank 0 halves the slots and the rings (down to 16 KiB and 1 KiB) before it
  /// gives up (docs/shm.md).
  std::size_t slot_bytes = std::size_t{4} << 20;
  /// How long a waiting rank polls before it sleeps on a futex. Negative (the default): 50 us
  /// where the machine has four CPUs for every rank of the group, else 0 (sleep at once: ranks
  /// that share a CPU would take turns burning it).
  std::chrono::microseconds spin{-1};
  /// How long a waiting rank then polls giving its CPU away (sched_yield) before it sleeps on a
  /// futex. Negative (the default): 50 us. A peer that waits for this CPU runs at once, and the
  /// waiter sees what it waits for without a futex wake-up, which waits for the scheduler (4 KiB
  /// all_reduce, 4 ranks on 2 CPUs: 42 us with 0, 14 us with 50; docs/shm.md); where no other
  /// thread wants the CPU, it polls. 0: sleep at once after the spin.
  std::chrono::microseconds yield{-1};
};

}  // namespace tandem
