// The calling thread's NCCL group (ncclGroupStart/ncclGroupEnd): what comm.cpp needs of it.
#pragma once

#include <nccl.h>

#include <functional>

namespace simnccl {

/// Open ncclGroupStart calls of this thread.
int group_depth() noexcept;

/// Notes that a communicator of this blocking mode takes part in the thread's group (a call
/// outside a group is a group of its own); ncclInvalidArgument if the group already holds one of
/// the other mode, as NCCL refuses to mix them.
ncclResult_t group_join_mode(bool blocking);

/// A blocking init or split inside a group: run at the outermost ncclGroupEnd, all of the
/// group's at once (each waits for other ranks, possibly the group's own).
void group_add_job(std::function<ncclResult_t()> body);

}  // namespace simnccl
