// The host functions that run NCCL's operations on the simulated streams (engine.hpp).
//
// Collectives run in rounds. In round R each rank copies its contribution (a bounded chunk) into
// its slot R % 2, publishes `posted = R`, waits until every rank has posted R, computes its part
// of the result from all slots (reductions in rank order), and publishes `consumed = R`. A slot is
// refilled (round R + 2) only once every rank has consumed round R. Point to point goes through a
// ring buffer per ordered pair: a message is its byte count, then its bytes; a send finishes once
// its receiver has taken the last byte (NCCL's rendezvous).
#include "engine.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <utility>

#include "reduce.hpp"

namespace simnccl {
namespace {

/// One host function's work. It holds each of its communicators (CommState::hold) from the
/// host's call until its stream work has run (or failed to be queued).
struct Launch {
  int device = 0;
  cudaStream_t stream = nullptr;
  std::vector<CommState*> comms;
  std::vector<std::uint64_t> tickets;
  std::vector<Op> ops;

  Launch() = default;
  Launch(const Launch&) = delete;
  Launch& operator=(const Launch&) = delete;
  ~Launch() {
    for (CommState* comm : comms) CommState::release(comm);
  }
};

bool collective(Kind kind) {
  return kind != Kind::send && kind != Kind::recv;
}

void ring_put(std::byte* data, std::uint64_t at, const std::byte* from, std::size_t n) {
  const std::size_t position = at % ring_bytes;
  const std::size_t first = std::min(n, ring_bytes - position);
  std::memcpy(data + position, from, first);
  std::memcpy(data, from + first, n - first);
}

void ring_get(const std::byte* data, std::uint64_t at, std::byte* to, std::size_t n) {
  const std::size_t position = at % ring_bytes;
  const std::size_t first = std::min(n, ring_bytes - position);
  std::memcpy(to, data + position, first);
  std::memcpy(to + first, data, n - first);
}

std::string where(const Op& op) {
  return std::string(op.api) + " (rank " + std::to_string(op.comm->rank) + " of " +
         std::to_string(op.comm->nranks) + ")";
}

// --- one step of each kind of operation: as far as the other ranks allow, never waiting ------

ncclResult_t step_collective(Op& op, bool& progressed) {
  CommState& comm = *op.comm;
  const Segment& segment = *op.segment;
  const int n = comm.nranks;
  const int me = comm.rank;
  const std::size_t size = type_size(op.type);
  const std::size_t pieces = op.kind == Kind::reduce_scatter ? static_cast<std::size_t>(n) : 1;
  const std::size_t per_round = slot_bytes / (size * pieces);
  if (op.phase == 0) {
    const std::uint64_t round = comm.round + 1;
    for (int q = 0; q < n && round > 2; ++q) {
      if (atomic(segment.rank(q).consumed).load(std::memory_order_acquire) < round - 2) {
        return ncclSuccess;
      }
    }
    const std::size_t c = std::min(per_round, op.count - op.offset);
    std::byte* slot = segment.slot(me, round);
    switch (op.kind) {
      case Kind::all_reduce:
      case Kind::reduce:
      case Kind::all_gather:
        std::memcpy(slot, op.send + op.offset * size, c * size);
        break;
      case Kind::broadcast:
        if (me == op.root) std::memcpy(slot, op.send + op.offset * size, c * size);
        break;
      case Kind::reduce_scatter:
        for (std::size_t p = 0; p < pieces; ++p) {
          std::memcpy(slot + p * c * size, op.send + (p * op.count + op.offset) * size, c * size);
        }
        break;
      default:
        break;
    }
    atomic(segment.rank(me).posted).store(round, std::memory_order_release);
    segment.ring_bell(Bell::stream);
    comm.round = round;
    op.round = round;
    op.chunk = c;
    op.phase = 1;
    progressed = true;
  }
  for (int q = 0; q < n; ++q) {
    if (atomic(segment.rank(q).posted).load(std::memory_order_acquire) < op.round) {
      return ncclSuccess;
    }
  }
  const std::size_t c = op.chunk;
  std::vector<const std::byte*> inputs(static_cast<std::size_t>(n));
  for (int q = 0; q < n; ++q) inputs[static_cast<std::size_t>(q)] = segment.slot(q, op.round);
  switch (op.kind) {
    case Kind::all_reduce:
      reduce(op.type, op.op, n, inputs.data(), op.recv + op.offset * size, c);
      break;
    case Kind::reduce:
      if (me == op.root) reduce(op.type, op.op, n, inputs.data(), op.recv + op.offset * size, c);
      break;
    case Kind::broadcast:
      if (me != op.root || op.send != op.recv) {
        std::memcpy(op.recv + op.offset * size, inputs[static_cast<std::size_t>(op.root)],
                    c * size);
      }
      break;
    case Kind::all_gather:
      for (int q = 0; q < n; ++q) {
        std::memcpy(op.recv + (static_cast<std::size_t>(q) * op.count + op.offset) * size,
                    inputs[static_cast<std::size_t>(q)], c * size);
      }
      break;
    case Kind::reduce_scatter:
      for (auto& input : inputs) input += static_cast<std::size_t>(me) * c * size;
      reduce(op.type, op.op, n, inputs.data(), op.recv + op.offset * size, c);
      break;
    default:
      break;
  }
  atomic(segment.rank(me).consumed).store(op.round, std::memory_order_release);
  segment.ring_bell(Bell::stream);
  op.offset += c;
  op.phase = 0;
  op.done = op.offset == op.count;
  progressed = true;
  return ncclSuccess;
}

constexpr std::size_t header_bytes = sizeof(std::uint64_t);

ncclResult_t step_send(Op& op, bool& progressed) {
  const Segment& segment = *op.segment;
  SharedRing& ring = segment.ring(op.comm->rank, op.root);
  std::byte* data = segment.ring_data(op.comm->rank, op.root);
  const std::size_t bytes = op.count * type_size(op.type);
  std::uint64_t written = atomic(ring.written).load(std::memory_order_relaxed);
  const std::uint64_t before = written;
  if (op.phase == 0) {
    const std::uint64_t read = atomic(ring.read).load(std::memory_order_acquire);
    if (written - read > ring_bytes - header_bytes) return ncclSuccess;
    const std::uint64_t length = bytes;
    ring_put(data, written, reinterpret_cast<const std::byte*>(&length), header_bytes);
    written += header_bytes;
    op.end = written + bytes;
    op.phase = 1;
  }
  if (op.phase == 1) {
    const std::uint64_t read = atomic(ring.read).load(std::memory_order_acquire);
    const std::size_t space = ring_bytes - static_cast<std::size_t>(written - read);
    const std::size_t n = std::min(space, bytes - op.offset);
    ring_put(data, written, op.send + op.offset, n);
    written += n;
    op.offset += n;
    if (op.offset == bytes) op.phase = 2;
  }
  if (written != before) {
    atomic(ring.written).store(written, std::memory_order_release);
    segment.ring_bell(Bell::stream);
    progressed = true;
  }
  if (op.phase == 2 && atomic(ring.read).load(std::memory_order_acquire) >= op.end) {
    op.done = true;
    progressed = true;
  }
  return ncclSuccess;
}

ncclResult_t step_recv(Op& op, bool& progressed) {
  const Segment& segment = *op.segment;
  SharedRing& ring = segment.ring(op.root, op.comm->rank);
  const std::byte* data = segment.ring_data(op.root, op.comm->rank);
  const std::size_t bytes = op.count * type_size(op.type);
  std::uint64_t read = atomic(ring.read).load(std::memory_order_relaxed);
  const std::uint64_t before = read;
  const std::uint64_t written = atomic(ring.written).load(std::memory_order_acquire);
  if (op.phase == 0) {
    if (written - read < header_bytes) return ncclSuccess;
    std::uint64_t length = 0;
    ring_get(data, read, reinterpret_cast<std::byte*>(&length), header_bytes);
    if (length != bytes) {
      return op.comm->fail(ncclInvalidUsage,
                           where(op) + ": expects " + std::to_string(bytes) + " bytes from rank " +
                               std::to_string(op.root) + ", whose matching send has " +
                               std::to_string(length) +
                               " (a send and its receive must agree on count and type)");
    }
    read += header_bytes;
    op.phase = 1;
  }
  const std::size_t n = std::min(static_cast<std::size_t>(written - read), bytes - op.offset);
  ring_get(data, read, op.recv + op.offset, n);
  read += n;
  op.offset += n;
  if (read != before) {
    atomic(ring.read).store(read, std::memory_order_release);
    segment.ring_bell(Bell::stream);
    progressed = true;
  }
  op.done = op.offset == bytes;
  return ncclSuccess;
}

/// "" while every rank `op` waits for takes part; otherwise why one does not.
std::string stalled_on(const Op& op) {
  const Segment& segment = *op.segment;
  std::vector<int> waits_for;
  if (collective(op.kind)) {
    const int n = op.comm->nranks;
    for (int q = 0; q < n; ++q) {
      SharedRank& record = segment.rank(q);
      const bool behind = op.phase == 0 ? atomic(record.consumed).load() + 2 < op.comm->round + 1
                                        : atomic(record.posted).load() < op.round;
      if (behind) waits_for.push_back(q);
    }
  } else {
    waits_for.push_back(op.root);
  }
  for (int q : waits_for) {
    if (q == op.comm->rank) continue;
    if (std::string gone = peer_gone(segment, q); !gone.empty()) {
      return where(op) + ": " + gone + " while rank " + std::to_string(op.comm->rank) +
             " waited for it";
    }
  }
  return {};
}

// --- a launch ---------------------------------------------------------------------------------

/// Which operations may advance now: per communicator, the oldest unfinished collective, and
/// per peer the oldest unfinished send and receive (messages between two ranks match in order).
struct Lanes {
  char collective = 0;
  std::vector<char> send, recv;
  void reset() {
    collective = 0;
    std::fill(send.begin(), send.end(), 0);
    std::fill(recv.begin(), recv.end(), 0);
  }
  char& of(const Op& op) {
    if (op.kind == Kind::send) return send[static_cast<std::size_t>(op.root)];
    if (op.kind == Kind::recv) return recv[static_cast<std::size_t>(op.root)];
    return collective;
  }
};

/// Gives up a communicator's part of the launch (aborted, or failed): the others' go on. Returns
/// whether it had any left.
bool drop(Launch& launch, const CommState* comm) {
  bool dropped = false;
  for (Op& op : launch.ops) {
    if (op.comm == comm && !op.done) {
      op.done = true;
      dropped = true;
    }
  }
  return dropped;
}

void advance(Launch& launch) {
  const Segment* shared = launch.ops.front().segment;
  for (const Op& op : launch.ops) {
    if (op.segment != shared) shared = nullptr;
  }
  Patience patience(shared, Bell::stream);
  std::vector<Lanes> lanes(launch.comms.size());
  for (std::size_t i = 0; i < lanes.size(); ++i) {
    lanes[i].send.resize(static_cast<std::size_t>(launch.comms[i]->nranks));
    lanes[i].recv.resize(static_cast<std::size_t>(launch.comms[i]->nranks));
  }
  const Op* suspect = nullptr;  // waits for a rank seen gone
  std::string suspicion;
  for (;;) {
    const std::uint32_t mark = patience.mark();
    bool progressed = false;
    bool remaining = false;
    for (auto& lane : lanes) lane.reset();
    for (Op& op : launch.ops) {
      if (op.done) continue;
      remaining = true;
      char& busy = lanes[op.comm_index].of(op);
      if (busy) continue;
      ncclResult_t state = ncclSuccess;
      if (collective(op.kind)) {
        state = step_collective(op, progressed);
      } else if (op.kind == Kind::send) {
        state = step_send(op, progressed);
      } else {
        state = step_recv(op, progressed);
      }
      if (state != ncclSuccess) {
        op.comm->set_error(state);
        drop(launch, op.comm);
        progressed = true;
        continue;
      }
      if (!op.done) busy = 1;
    }
    if (!remaining) return;
    for (CommState* comm : launch.comms) {
      if (comm->aborted.load() && drop(launch, comm)) progressed = true;
    }
    if (progressed) {
      patience.progressed();
      suspect = nullptr;
      continue;
    }
    if (suspect) {
      // A peer was gone before this pass, and the pass could still do nothing: it is not just a
      // peer that finished its part and left in the meantime.
      suspect->comm->fail(ncclRemoteError, suspicion);
      suspect->comm->set_error(ncclRemoteError);
      drop(launch, suspect->comm);
      suspect = nullptr;
      continue;
    }
    patience.idle(mark);
    if (!patience.check_due()) continue;
    for (auto& lane : lanes) lane.reset();
    for (Op& op : launch.ops) {
      if (op.done) continue;
      char& busy = lanes[op.comm_index].of(op);
      if (busy) continue;
      busy = 1;
      if (std::string why = stalled_on(op); !why.empty()) {
        suspect = &op;  // confirmed only by one more pass without progress
        suspicion = std::move(why);
        break;
      }
    }
  }
}

void execute(Launch& launch) {
  for (std::size_t i = 0; i < launch.comms.size(); ++i) {
    CommState* comm = launch.comms[i];
    // A communicator aborted, or failed earlier, does nothing more (as NCCL's kernels of an
    // aborted or failed communicator).
    if (!comm->wait_turn(launch.tickets[i]) || comm->error() != ncclSuccess) drop(launch, comm);
  }
  advance(launch);
  for (std::size_t i = 0; i < launch.comms.size(); ++i) {
    launch.comms[i]->finish_turn(launch.tickets[i]);
  }
}

void CUDART_CB run_launch(void* data) {
  std::unique_ptr<Launch> launch(static_cast<Launch*>(data));
  execute(*launch);
}

struct StreamOnDevice {
  cudaStream_t stream;
  int device;
  bool operator==(const StreamOnDevice&) const = default;
};

/// Makes a device current for a scope.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      changed_ = cudaSetDevice(device) == cudaSuccess;
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope() {
    if (changed_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool changed_ = false;
};

ncclResult_t cuda_failed(const Launch& launch, const char* call, cudaError_t status) {
  return launch.comms.front()->fail(
      ncclUnhandledCudaError,
      std::string(launch.ops.front().api) + ": " + call + " failed: " + cudaGetErrorString(status));
}

/// Queues the launch's host function on its stream, after the earlier work of the other streams
/// in `joined`, which then wait for it.
ncclResult_t submit(std::unique_ptr<Launch> launch, const std::vector<cudaStream_t>& joined) {
  DeviceScope scope(launch->device);
  std::vector<cudaEvent_t> events;
  auto cleanup = [&] {
    for (cudaEvent_t event : events) (void)cudaEventDestroy(event);
  };
  for (cudaStream_t other : joined) {
    cudaEvent_t event = nullptr;
    cudaError_t status = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (status == cudaSuccess) events.push_back(event);
    if (status == cudaSuccess) status = cudaEventRecord(event, other);
    if (status == cudaSuccess) status = cudaStreamWaitEvent(launch->stream, event, 0);
    if (status != cudaSuccess) {
      cleanup();
      for (std::size_t i = 0; i < launch->comms.size(); ++i) {
        launch->comms[i]->finish_turn(launch->tickets[i]);
      }
      return cuda_failed(*launch, "joining streams", status);
    }
  }
  Launch* raw = launch.get();
  const cudaStream_t stream = launch->stream;
  if (const cudaError_t status = cudaLaunchHostFunc(stream, run_launch, raw);
      status != cudaSuccess) {
    cleanup();
    for (std::size_t i = 0; i < launch->comms.size(); ++i) {
      launch->comms[i]->finish_turn(launch->tickets[i]);
    }
    return cuda_failed(*launch, "cudaLaunchHostFunc", status);
  }
  (void)launch.release();  // the host function owns it now
  if (!joined.empty()) {
    cudaEvent_t after = nullptr;
    if (cudaEventCreateWithFlags(&after, cudaEventDisableTiming) == cudaSuccess) {
      events.push_back(after);
      if (cudaEventRecord(after, stream) == cudaSuccess) {
        for (cudaStream_t other : joined) (void)cudaStreamWaitEvent(other, after, 0);
      }
    }
  }
  cleanup();
  return ncclSuccess;
}

/// Stress mode: whether to report ncclInProgress for this launch of nonblocking communicators.
bool delay_it(const Launch& launch) {
  if (!stress_mode()) return false;
  for (const CommState* comm : launch.comms) {
    if (comm->blocking) return false;
  }
  return stress_draw() % 2 == 0;
}

}  // namespace

ncclResult_t launch(std::vector<Op> ops) {
  // Operations that share a communicator or a stream (of one device) run together.
  const std::size_t n = ops.size();
  std::vector<std::size_t> leader(n);
  std::iota(leader.begin(), leader.end(), 0);
  auto find = [&](std::size_t i) {
    while (leader[i] != i) i = leader[i] = leader[leader[i]];
    return i;
  };
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = i + 1; j < n; ++j) {
      const bool same_stream =
          ops[i].stream == ops[j].stream && ops[i].comm->device == ops[j].comm->device;
      if (ops[i].comm == ops[j].comm || same_stream) leader[find(j)] = find(i);
    }
  }
  ncclResult_t result = ncclSuccess;
  for (std::size_t head = 0; head < n; ++head) {
    if (find(head) != head) continue;
    auto made = std::make_unique<Launch>();
    made->device = ops[head].comm->device;
    made->stream = ops[head].stream;
    std::vector<cudaStream_t> joined;
    for (std::size_t i = head; i < n; ++i) {
      if (find(i) != head) continue;
      Op& op = ops[i];
      auto known = std::find(made->comms.begin(), made->comms.end(), op.comm);
      if (known == made->comms.end()) {
        op.comm->hold();
        made->comms.push_back(op.comm);
        made->tickets.push_back(op.comm->take_ticket());
        known = made->comms.end() - 1;
      }
      op.comm_index = static_cast<std::size_t>(known - made->comms.begin());
      if (op.stream != made->stream &&
          std::find(joined.begin(), joined.end(), op.stream) == joined.end()) {
        joined.push_back(op.stream);
      }
      made->ops.push_back(std::move(op));
    }
    if (!delay_it(*made)) {
      if (const ncclResult_t queued = submit(std::move(made), joined); queued != ncclSuccess) {
        result = queued;
      }
      continue;
    }
    // Stress mode: report ncclInProgress and queue the work a little later, from another thread
    // (the per-thread default stream belongs to this thread: that work is queued now).
    const auto pause = std::chrono::microseconds(50 + stress_draw() % 500);
    std::vector<CommState*> comms = made->comms;
    for (CommState* comm : comms) {
      comm->hold();  // the delaying thread's own, given back after `delayed`
      comm->delayed.fetch_add(1);
    }
    const bool now = made->stream == cudaStreamPerThread ||
                     std::find(joined.begin(), joined.end(), cudaStreamPerThread) != joined.end();
    if (now) {
      if (const ncclResult_t queued = submit(std::move(made), joined); queued != ncclSuccess) {
        result = queued;
      }
    }
    std::thread([comms, pause, joined, later = now ? nullptr : std::move(made)]() mutable {
      std::this_thread::sleep_for(pause);
      if (later) {
        if (const ncclResult_t queued = submit(std::move(later), joined); queued != ncclSuccess) {
          for (CommState* comm : comms) comm->set_error(queued);
        }
      }
      for (CommState* comm : comms) {
        comm->delayed.fetch_sub(1, std::memory_order_release);
        CommState::release(comm);
      }
    }).detach();
    if (result == ncclSuccess) result = ncclInProgress;
  }
  return result;
}

}  // namespace simnccl
