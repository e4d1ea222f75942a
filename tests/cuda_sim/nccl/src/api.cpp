// NCCL's collective and point-to-point calls and its groups on the simulator: the argument checks
// NCCL makes (and the pointer check it makes under NCCL_CHECK_POINTERS, here always), then the
// operations go to the calling thread's group; the outermost ncclGroupEnd (an ungrouped call is a
// group of its own) queues them on their streams (engine.hpp).
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine.hpp"
#include "group.hpp"
#include "reduce.hpp"
#include "state.hpp"

namespace simnccl {
namespace {

struct Group {
  int depth = 0;
  ncclResult_t error = ncclSuccess;
  int blocking = -1;  ///< the mode of the communicators in it; -1 before the first
  std::vector<Op> ops;
  std::vector<std::shared_ptr<CommState>> comms;  ///< keeps the ops' communicators until launched
  std::vector<std::function<ncclResult_t()>> jobs;
};

thread_local Group group;

ncclResult_t end_group() {
  if (group.depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd: not in a group call.");
  if (--group.depth > 0) return ncclSuccess;
  Group taken = std::move(group);
  group = Group{};
  if (taken.error != ncclSuccess) {
    for (const auto& comm : taken.comms) {
      if (!comm->blocking) comm->set_error(taken.error);
    }
    return taken.error;
  }
  ncclResult_t result = ncclSuccess;
  if (taken.jobs.size() == 1) {
    result = taken.jobs.front()();
  } else if (!taken.jobs.empty()) {
    // Each waits for ranks that may be the others: all at once.
    std::vector<ncclResult_t> results(taken.jobs.size(), ncclSuccess);
    std::vector<std::thread> threads;
    for (std::size_t i = 0; i < taken.jobs.size(); ++i) {
      threads.emplace_back([&, i] { results[i] = taken.jobs[i](); });
    }
    for (auto& thread : threads) thread.join();
    for (ncclResult_t each : results) {
      if (result == ncclSuccess) result = each;
    }
  }
  if (!taken.ops.empty()) {
    const ncclResult_t launched = launch(std::move(taken.ops));
    if (launched != ncclSuccess && launched != ncclInProgress) {
      for (const auto& comm : taken.comms) {
        if (!comm->blocking) comm->set_error(launched);
      }
    }
    if (result == ncclSuccess) result = launched;
  }
  return result;
}

enum class Call {
  all_reduce,
  reduce,
  broadcast,
  all_gather,
  reduce_scatter,
  gather,
  scatter,
  all_to_all,
  send,
  recv
};

struct Request {
  Call call;
  const char* api;
  const void* send;
  void* recv;
  std::size_t count;
  int type;  // NCCL's enums as the caller's bits: a C caller may pass any value
  int op;
  int root;
  ncclComm_t comm;
  cudaStream_t stream;
};

/// An enum argument's bits, read without loading it as the enum (a value outside the enum's
/// range would be undefined behaviour in C++, and NCCL must refuse it, not trust it).
template <class Enum>
int bits(const Enum& value) {
  int raw = 0;
  static_assert(sizeof raw == sizeof value);
  std::memcpy(&raw, &value, sizeof raw);
  return raw;
}

bool reduces(Call call) {
  return call == Call::all_reduce || call == Call::reduce || call == Call::reduce_scatter;
}
bool point_to_point(Call call) {
  return call == Call::send || call == Call::recv;
}

std::string address(const void* pointer) {
  char text[32];
  std::snprintf(text, sizeof text, "%p", pointer);
  return text;
}

ncclResult_t check_pointer(CommState& comm, const Request& r, const void* pointer,
                           const char* which) {
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, pointer);
  if (status != cudaSuccess) (void)cudaGetLastError();  // ours, not the program's
  if (status != cudaSuccess || attributes.devicePointer == nullptr) {
    return comm.fail(ncclInvalidArgument, std::string(r.api) + " : " + which + " " +
                                              address(pointer) +
                                              " is not a valid pointer (not device memory)");
  }
  if (attributes.type == cudaMemoryTypeDevice && attributes.device != comm.device) {
    return comm.fail(ncclInvalidArgument,
                     std::string(r.api) + " : " + which + " allocated on device " +
                         std::to_string(attributes.device) + " mismatchs with NCCL device " +
                         std::to_string(comm.device));
  }
  return ncclSuccess;
}

ncclResult_t check(CommState& comm, const Request& r) {
  const std::string api = r.api;
  const bool p2p = point_to_point(r.call);
  if (r.root < 0 || r.root >= comm.nranks) {
    return comm.fail(ncclInvalidArgument, api + " : invalid " + (p2p ? "peer " : "root ") +
                                              std::to_string(r.root) + " (" +
                                              (p2p ? "peer" : "root") + " should be in the 0.." +
                                              std::to_string(comm.nranks - 1) + " range)");
  }
  if (r.type < 0 || r.type >= ncclNumTypes) {
    return comm.fail(ncclInvalidArgument, api + " : invalid type " + std::to_string(r.type));
  }
  if (reduces(r.call)) {
    if (r.op < 0 || r.op >= ncclNumOps) {
      return comm.fail(ncclInvalidArgument, api + " : reduction operation " + std::to_string(r.op) +
                                                " unknown to this communicator");
    }
    if (!reducible(static_cast<ncclDataType_t>(r.type))) {
      return comm.fail(ncclInvalidArgument, api + " : the simulator does not reduce " +
                                                type_name(static_cast<ncclDataType_t>(r.type)));
    }
  }
  const bool spread = r.call == Call::all_gather || r.call == Call::reduce_scatter ||
                      r.call == Call::gather || r.call == Call::scatter ||
                      r.call == Call::all_to_all;
  const std::size_t factor = type_size(static_cast<ncclDataType_t>(r.type)) *
                             (spread ? static_cast<std::size_t>(comm.nranks) : 1);
  if (r.count > std::numeric_limits<std::size_t>::max() / 2 / factor) {
    return comm.fail(ncclInvalidArgument,
                     api + " : count " + std::to_string(r.count) + " is too large");
  }
  if (comm.finalize_called.load()) {
    return comm.fail(ncclInvalidUsage, api + " : the communicator was finalized");
  }
  if (r.count == 0) return ncclSuccess;
  const bool root = comm.rank == r.root;
  const bool needs_send = !(r.call == Call::recv || (r.call == Call::broadcast && !root) ||
                            (r.call == Call::scatter && !root));
  const bool needs_recv = !(r.call == Call::send || (r.call == Call::reduce && !root) ||
                            (r.call == Call::gather && !root));
  if (needs_send) {
    if (const ncclResult_t bad = check_pointer(comm, r, r.send, p2p ? "buff" : "sendbuff");
        bad != ncclSuccess) {
      return bad;
    }
  }
  if (needs_recv) {
    if (const ncclResult_t bad = check_pointer(comm, r, r.recv, p2p ? "buff" : "recvbuff");
        bad != ncclSuccess) {
      return bad;
    }
  }
  return ncclSuccess;
}

/// The operations of one call (gather, scatter and all-to-all as sends and receives).
void build(const std::shared_ptr<CommState>& comm, const Request& r, std::vector<Op>& out) {
  Op base;
  base.api = r.api;
  base.comm = comm.get();  // the caller's std::shared_ptr keeps it alive until it is held
  base.segment = comm->segment().get();
  base.count = r.count;
  base.type = static_cast<ncclDataType_t>(r.type);
  base.op = static_cast<ncclRedOp_t>(r.op);
  base.root = r.root;
  base.stream = r.stream;
  const auto* send = static_cast<const std::byte*>(r.send);
  auto* recv = static_cast<std::byte*>(r.recv);
  const std::size_t slice = r.count * type_size(base.type);
  auto add = [&](Kind kind, const std::byte* from, std::byte* to, int peer) {
    Op op = base;
    op.kind = kind;
    op.send = from;
    op.recv = to;
    op.root = peer;
    out.push_back(std::move(op));
  };
  const int n = comm->nranks;
  switch (r.call) {
    case Call::send:
      return add(Kind::send, send, nullptr, r.root);
    case Call::recv:
      return add(Kind::recv, nullptr, recv, r.root);
    default:
      break;
  }
  if (r.count == 0) return;  // NCCL discards empty collectives
  switch (r.call) {
    case Call::all_reduce:
      return add(Kind::all_reduce, send, recv, r.root);
    case Call::reduce:
      return add(Kind::reduce, send, recv, r.root);
    case Call::broadcast:
      return add(Kind::broadcast, send, recv, r.root);
    case Call::all_gather:
      return add(Kind::all_gather, send, recv, r.root);
    case Call::reduce_scatter:
      return add(Kind::reduce_scatter, send, recv, r.root);
    case Call::gather:
      add(Kind::send, send, nullptr, r.root);
      if (comm->rank == r.root) {
        for (int q = 0; q < n; ++q)
          add(Kind::recv, nullptr, recv + static_cast<std::size_t>(q) * slice, q);
      }
      return;
    case Call::scatter:
      if (comm->rank == r.root) {
        for (int q = 0; q < n; ++q)
          add(Kind::send, send + static_cast<std::size_t>(q) * slice, nullptr, q);
      }
      add(Kind::recv, nullptr, recv, r.root);
      return;
    case Call::all_to_all:
      for (int q = 0; q < n; ++q) {
        add(Kind::send, send + static_cast<std::size_t>(q) * slice, nullptr, q);
        add(Kind::recv, nullptr, recv + static_cast<std::size_t>(q) * slice, q);
      }
      return;
    default:
      return;
  }
}

ncclResult_t enqueue(const Request& r) {
  auto comm = find_comm(r.comm);
  if (!comm) {
    const ncclResult_t bad = bad_comm(r.comm, r.api);
    if (group.depth > 0 && group.error == ncclSuccess) group.error = bad;
    return bad;
  }
  ++group.depth;  // an ungrouped call is a group of its own
  ncclResult_t state = ensure_ready(*comm, r.api);
  if (state == ncclSuccess && !comm->joined.load()) {
    state = comm->fail(ncclInvalidUsage, std::string(r.api) +
                                             " : the communicator's init has not finished (a "
                                             "blocking init in a group finishes at ncclGroupEnd)");
  }
  if (state == ncclSuccess) state = check(*comm, r);
  if (state == ncclSuccess) state = group_join_mode(comm->blocking);
  if (state == ncclSuccess) {
    build(comm, r, group.ops);
    group.comms.push_back(comm);
  } else {
    if (!comm->blocking) comm->set_error(state);
    if (group.error == ncclSuccess) group.error = state;
  }
  const ncclResult_t ended = end_group();
  if (state != ncclSuccess) return state;
  if (ended != ncclSuccess && ended != ncclInProgress) return ended;
  return comm->blocking ? ncclSuccess : comm->async_state();
}

}  // namespace

int group_depth() noexcept {
  return group.depth;
}

ncclResult_t group_join_mode(bool blocking) {
  if (group.depth == 0) return ncclSuccess;
  const int mode = blocking ? 1 : 0;
  if (group.blocking == -1) group.blocking = mode;
  if (group.blocking == mode) return ncclSuccess;
  return fail(ncclInvalidArgument,
              "Blocking and nonblocking communicators are not allowed in the same group.");
}

void group_add_job(std::function<ncclResult_t()> body) {
  group.jobs.push_back(std::move(body));
}

}  // namespace simnccl

using namespace simnccl;

ncclResult_t ncclGroupStart() {
  ++group.depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  return end_group();
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  return enqueue({Call::all_reduce, "ncclAllReduce", sendbuff, recvbuff, count, bits(datatype),
                  bits(op), 0, comm, stream});
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return enqueue({Call::reduce, "ncclReduce", sendbuff, recvbuff, count, bits(datatype), bits(op),
                  root, comm, stream});
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  return enqueue({Call::broadcast, "ncclBroadcast", sendbuff, recvbuff, count, bits(datatype),
                  ncclSum, root, comm, stream});
}

ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                       cudaStream_t stream) {
  return enqueue({Call::broadcast, "ncclBcast", buff, buff, count, bits(datatype), ncclSum, root,
                  comm, stream});
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  return enqueue({Call::all_gather, "ncclAllGather", sendbuff, recvbuff, sendcount, bits(datatype),
                  ncclSum, 0, comm, stream});
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  return enqueue({Call::reduce_scatter, "ncclReduceScatter", sendbuff, recvbuff, recvcount,
                  bits(datatype), bits(op), 0, comm, stream});
}

ncclResult_t ncclGather(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  return enqueue({Call::gather, "ncclGather", sendbuff, recvbuff, count, bits(datatype), ncclSum,
                  root, comm, stream});
}

ncclResult_t ncclScatter(const void* sendbuff, void* recvbuff, size_t count,
                         ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream) {
  return enqueue({Call::scatter, "ncclScatter", sendbuff, recvbuff, count, bits(datatype), ncclSum,
                  root, comm, stream});
}

ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count,
                          ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  return enqueue({Call::all_to_all, "ncclAlltoAll", sendbuff, recvbuff, count, bits(datatype),
                  ncclSum, 0, comm, stream});
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return enqueue({Call::send, "ncclSend", sendbuff, nullptr, count, bits(datatype), ncclSum, peer,
                  comm, stream});
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return enqueue({Call::recv, "ncclRecv", nullptr, recvbuff, count, bits(datatype), ncclSum, peer,
                  comm, stream});
}
