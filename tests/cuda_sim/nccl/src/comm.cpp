// NCCL's communicator calls on the simulator: unique ids, init (blocking, nonblocking, in a
// group, InitAll), split, finalize, destroy, abort, the asynchronous error and the queries.
#include <cuda_runtime.h>
#include <nccl.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "group.hpp"
#include "segment.hpp"
#include "state.hpp"

namespace simnccl {
namespace {

constexpr unsigned config_magic = 0xcafebeef;

std::string to_text(int value) {
  return std::to_string(value);
}

/// The blocking mode a config asks for (NCCL_CONFIG_INITIALIZER leaves it undefined: blocking).
ncclResult_t blocking_of(const ncclConfig_t* config, bool inherited, bool& blocking) {
  blocking = inherited;
  if (config == nullptr) return ncclSuccess;
  if (config->magic != config_magic) {
    return fail(ncclInvalidArgument,
                "ncclConfig_t argument not initialized via NCCL_CONFIG_INITIALIZER");
  }
  if (config->blocking == NCCL_CONFIG_UNDEF_INT) {
    blocking = true;
    return ncclSuccess;
  }
  if (config->blocking != 0 && config->blocking != 1) {
    return fail(ncclInvalidArgument,
                "Invalid config blocking attribute value " + to_text(config->blocking));
  }
  blocking = config->blocking == 1;
  return ncclSuccess;
}

/// Claims this rank's record in the communicator's segment and waits until every rank has (or
/// `comm` or `stop` is aborted). Blocks: run inline for a blocking init, in a job otherwise.
ncclResult_t join(CommState& comm, const std::atomic<bool>* stop, const char* api) {
  const std::string prefix =
      std::string(api) + " (rank " + to_text(comm.rank) + " of " + to_text(comm.nranks) + "): ";
  std::string why;
  auto segment = Segment::open(comm.name, comm.nranks, why);
  if (!segment) {
    const bool usage = why.find("disagree") != std::string::npos;
    return comm.fail(usage ? ncclInvalidUsage : ncclSystemError, prefix + why);
  }
  comm.set_segment(segment);
  SharedRank& mine = segment->rank(comm.rank);
  std::uint32_t unclaimed = 0;
  if (!atomic(mine.claimed).compare_exchange_strong(unclaimed, 1)) {
    comm.leave();
    return comm.fail(ncclInvalidUsage, prefix + "rank " + to_text(comm.rank) +
                                           " joined twice (two ranks with one number, or a unique "
                                           "id used for two communicators)");
  }
  comm.claimed.store(true);
  mine.device = comm.device;
  mine.process = process_token();
  mine.pid = getpid();
  segment->hold_rank(comm.rank);
  atomic(mine.ready).store(1, std::memory_order_release);
  SharedHeader& header = segment->header();
  atomic(header.joined).fetch_add(1, std::memory_order_acq_rel);
  segment->ring_bell(Bell::host);

  Patience patience(segment.get(), Bell::host);
  const auto everyone = static_cast<std::uint32_t>(comm.nranks);
  std::string gone;  // a rank seen gone: fatal unless the next look finds everyone joined
  for (;;) {
    const std::uint32_t mark = patience.mark();
    if (atomic(header.joined).load(std::memory_order_acquire) == everyone) break;
    if (comm.aborted.load() || (stop && stop->load())) {
      comm.leave();
      return comm.fail(ncclInternalError, prefix + "aborted while waiting for the other ranks");
    }
    if (!gone.empty()) {
      comm.leave();
      return comm.fail(ncclRemoteError,
                       prefix + gone + " before every rank had joined the communicator");
    }
    patience.idle(mark);
    if (!patience.check_due()) continue;
    for (int q = 0; q < comm.nranks && gone.empty(); ++q) {
      if (q != comm.rank) gone = peer_gone(*segment, q);
    }
  }
  comm.joined.store(true);
  segment->unlink();  // every rank has mapped it: the name has done its work
  for (int a = 0; a < comm.nranks; ++a) {
    for (int b = a + 1; b < comm.nranks; ++b) {
      const SharedRank& first = segment->rank(a);
      const SharedRank& second = segment->rank(b);
      if (first.process == second.process && first.device == second.device) {
        comm.leave();
        return comm.fail(ncclInvalidUsage, prefix + "Duplicate GPU detected : rank " + to_text(a) +
                                               " and rank " + to_text(b) + " both on CUDA device " +
                                               to_text(first.device));
      }
    }
  }
  return ncclSuccess;
}

/// ncclCommSplit's work: every rank of the parent posts (color, key) in the parent's segment,
/// then the ranks of each color join the child named from the parent, the split and the color.
ncclResult_t split(CommState* parent, int color, int key, ncclComm_t* newcomm, bool blocking,
                   std::uint64_t number) {
  const std::string prefix =
      "ncclCommSplit (rank " + to_text(parent->rank) + " of " + to_text(parent->nranks) + "): ";
  const auto segment = parent->segment();
  const std::size_t parity = number % 2;
  SharedRank& mine = segment->rank(parent->rank);
  mine.split_color[parity] = color;
  mine.split_key[parity] = key;
  atomic(mine.split_seq[parity]).store(number, std::memory_order_release);
  segment->ring_bell(Bell::host);

  Patience patience(segment.get(), Bell::host);
  std::string gone;  // the missing rank seen gone: fatal unless the next look finds it posted
  for (;;) {
    const std::uint32_t mark = patience.mark();
    int missing = -1;
    for (int q = 0; q < parent->nranks && missing < 0; ++q) {
      if (atomic(segment->rank(q).split_seq[parity]).load(std::memory_order_acquire) < number) {
        missing = q;
      }
    }
    if (missing < 0) break;
    if (parent->aborted.load()) {
      return parent->fail(ncclInternalError, prefix + "the parent was aborted during the split");
    }
    if (!gone.empty()) {
      return parent->fail(ncclRemoteError, prefix + gone + " before it called ncclCommSplit");
    }
    patience.idle(mark);
    if (patience.check_due()) gone = peer_gone(*segment, missing);
  }
  if (color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
  std::vector<std::pair<int, int>> members;  // (key, parent rank) of this color
  for (int q = 0; q < parent->nranks; ++q) {
    const SharedRank& record = segment->rank(q);
    if (record.split_color[parity] == color) members.emplace_back(record.split_key[parity], q);
  }
  std::sort(members.begin(), members.end());
  const auto me = std::find(members.begin(), members.end(), std::make_pair(key, parent->rank));
  const int rank = static_cast<int>(me - members.begin());
  const int size = static_cast<int>(members.size());
  auto child =
      CommState::make(child_id(parent->id, number, color), rank, size, parent->device, blocking);
  const ncclResult_t joined = join(*child, &parent->aborted, "ncclCommSplit");
  if (joined != ncclSuccess) return parent->fail(joined, child->error_text());
  *newcomm = register_comm(child);
  return ncclSuccess;
}

}  // namespace
}  // namespace simnccl

using namespace simnccl;

ncclResult_t ncclGetVersion(int* version) {
  if (version == nullptr)
    return fail(ncclInvalidArgument, "ncclGetVersion : version argument is NULL");
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
  if (uniqueId == nullptr) {
    return fail(ncclInvalidArgument, "ncclGetUniqueId : uniqueId argument is NULL");
  }
  ncclUniqueId id{};
  std::memcpy(id.internal, "TNDMSIM1", 8);
  std::size_t drawn = 0;
  while (drawn < 32) {
    const ssize_t got = getrandom(id.internal + 8 + drawn, 32 - drawn, 0);
    if (got > 0) drawn += static_cast<std::size_t>(got);
  }
  *uniqueId = id;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError:
      return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError:
      return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument:
      return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage:
      return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  // NCCL keeps one text per process; a live communicator's own newest text is more precise.
  thread_local std::string text;
  std::string own;
  if (auto state = find_comm(comm)) own = state->error_text();
  text = own.empty() ? copy_last_error() : own;
  return text.c_str();
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* newcomm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t* config) {
  if (newcomm == nullptr)
    return fail(ncclInvalidArgument, "CommInitRank : newcomm argument is NULL");
  int device = 0;
  if (const cudaError_t status = cudaGetDevice(&device); status != cudaSuccess) {
    return fail(ncclUnhandledCudaError, std::string("ncclCommInitRank: cudaGetDevice failed: ") +
                                            cudaGetErrorString(status));
  }
  bool blocking = true;
  if (const ncclResult_t parsed = blocking_of(config, true, blocking); parsed != ncclSuccess) {
    return parsed;
  }
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return fail(ncclInvalidArgument,
                "Invalid rank requested : " + to_text(rank) + "/" + to_text(nranks));
  }
  if (nranks > max_ranks) {
    return fail(ncclInvalidArgument, "ncclCommInitRank: the simulator runs at most " +
                                         to_text(max_ranks) + " ranks, not " + to_text(nranks));
  }
  if (segment_name(commId).empty()) {
    return fail(ncclInvalidArgument,
                "ncclCommInitRank: the ncclUniqueId was not made by ncclGetUniqueId");
  }
  if (const ncclResult_t mode = group_join_mode(blocking); mode != ncclSuccess) return mode;
  auto comm = CommState::make(commId, rank, nranks, device, blocking);
  *newcomm = register_comm(comm);
  CommState* made = comm.get();
  if (!blocking) {
    made->start_job([made] { return join(*made, nullptr, "ncclCommInitRank"); });
    return made->async_state();
  }
  if (group_depth() > 0) {
    group_add_job([made] {
      const ncclResult_t joined = join(*made, nullptr, "ncclCommInitRank");
      made->set_error(joined);
      return joined;
    });
    return ncclSuccess;
  }
  const ncclResult_t joined = join(*made, nullptr, "ncclCommInitRank");
  if (joined != ncclSuccess) {
    unregister_comm(*newcomm);
    *newcomm = nullptr;
  }
  return joined;
}

ncclResult_t ncclCommInitRank(ncclComm_t* newcomm, int nranks, ncclUniqueId commId, int rank) {
  return ncclCommInitRankConfig(newcomm, nranks, commId, rank, nullptr);
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  if (comms == nullptr) return fail(ncclInvalidArgument, "CommInitAll : comms argument is NULL");
  if (ndev < 0)
    return fail(ncclInvalidArgument, "Invalid device count requested : " + to_text(ndev));
  int devices = 0;
  if (const cudaError_t status = cudaGetDeviceCount(&devices); status != cudaSuccess) {
    return fail(
        ncclUnhandledCudaError,
        std::string("ncclCommInitAll: cudaGetDeviceCount failed: ") + cudaGetErrorString(status));
  }
  std::vector<bool> seen(static_cast<std::size_t>(devices), false);
  for (int i = 0; i < ndev; ++i) {
    const int device = devlist ? devlist[i] : i;
    if (device < 0 || device >= devices) {
      return fail(ncclInvalidArgument,
                  "Invalid device " + to_text(device) + " (totalnDev " + to_text(devices) + ")");
    }
    if (seen[static_cast<std::size_t>(device)]) {
      return fail(ncclInvalidUsage, "Duplicate device " + to_text(device) + " in device list");
    }
    seen[static_cast<std::size_t>(device)] = true;
  }
  if (ndev == 0) return ncclSuccess;
  ncclUniqueId id{};
  (void)ncclGetUniqueId(&id);
  int previous = 0;
  (void)cudaGetDevice(&previous);
  ncclResult_t result = ncclGroupStart();
  for (int i = 0; i < ndev && result == ncclSuccess; ++i) {
    if (cudaSetDevice(devlist ? devlist[i] : i) != cudaSuccess) result = ncclUnhandledCudaError;
    if (result == ncclSuccess) result = ncclCommInitRank(comms + i, ndev, id, i);
  }
  const ncclResult_t ended = ncclGroupEnd();
  (void)cudaSetDevice(previous);
  return result != ncclSuccess ? result : ended;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                           ncclConfig_t* config) {
  auto parent = find_comm(comm);
  if (!parent) return bad_comm(comm, "ncclCommSplit");
  if (newcomm == nullptr) return fail(ncclInvalidArgument, "CommSplit : newcomm argument is NULL");
  if (const ncclResult_t ready = ensure_ready(*parent, "ncclCommSplit"); ready != ncclSuccess) {
    return ready;
  }
  if (!parent->joined.load()) {
    return parent->fail(ncclInvalidUsage, "ncclCommSplit : the parent's init has not finished");
  }
  if (color < 0 && color != NCCL_SPLIT_NOCOLOR) {
    return parent->fail(ncclInvalidArgument, "ncclCommSplit : invalid color " + to_text(color) +
                                                 " (non-negative, or NCCL_SPLIT_NOCOLOR)");
  }
  bool blocking = parent->blocking;
  if (const ncclResult_t parsed = blocking_of(config, parent->blocking, blocking);
      parsed != ncclSuccess) {
    return parsed;
  }
  if (const ncclResult_t mode = group_join_mode(parent->blocking); mode != ncclSuccess) return mode;
  *newcomm = nullptr;
  const std::uint64_t number = ++parent->splits;
  CommState* raw = parent.get();
  auto body = [raw, color, key, newcomm, blocking, number] {
    return split(raw, color, key, newcomm, blocking, number);
  };
  if (!parent->blocking) {
    parent->start_job(body);
    // NCCL returns ncclSuccess here while the parent reports ncclInProgress.
    return stress_mode() && stress_draw() % 2 ? ncclInProgress : ncclSuccess;
  }
  if (group_depth() > 0) {
    group_add_job(body);
    return ncclSuccess;
  }
  return body();
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  auto state = find_comm(comm);
  if (!state) return bad_comm(comm, "ncclCommFinalize");
  if (const ncclResult_t ready = ensure_ready(*state, "ncclCommFinalize"); ready != ncclSuccess) {
    if (!state->blocking) state->set_error(ready);
    return ready;
  }
  if (state->finalize_called.exchange(true)) {
    return state->fail(ncclInvalidArgument,
                       "ncclCommFinalize : the communicator is finalized already");
  }
  if (!state->blocking) return state->async_state();
  if (!state->wait_flushed()) {
    return state->fail(ncclInternalError, "ncclCommFinalize : the communicator was aborted");
  }
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  auto state = find_comm(comm);
  if (!state) return bad_comm(comm, "ncclCommDestroy");
  if (const ncclResult_t ready = ensure_ready(*state, "ncclCommDestroy"); ready != ncclSuccess) {
    return ready;
  }
  if (!state->finalize_called.load()) (void)state->wait_flushed();
  state->leave();
  unregister_comm(comm);
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  auto state = find_comm(comm);
  if (!state) return bad_comm(comm, "ncclCommAbort");
  state->abort();
  unregister_comm(comm);
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  auto state = find_comm(comm);
  if (!state) return bad_comm(comm, "ncclGetAsyncError");
  if (asyncError == nullptr) {
    return fail(ncclInvalidArgument, "ncclGetAsyncError : asyncError argument is NULL");
  }
  *asyncError = state->async_state();
  return ncclSuccess;
}

namespace {

template <class Read>
ncclResult_t query(ncclComm_t comm, const char* api, const void* out, Read read) {
  auto state = find_comm(comm);
  if (!state) return bad_comm(comm, api);
  if (out == nullptr)
    return fail(ncclInvalidArgument, std::string(api) + " : output argument is NULL");
  if (const ncclResult_t ready = ensure_ready(*state, api); ready != ncclSuccess) return ready;
  read(*state);
  return ncclSuccess;
}

}  // namespace

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  return query(comm, "CommCount", count, [&](CommState& s) { *count = s.nranks; });
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  return query(comm, "CommCuDevice", device, [&](CommState& s) { *device = s.device; });
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  return query(comm, "CommUserRank", rank, [&](CommState& s) { *rank = s.rank; });
}
