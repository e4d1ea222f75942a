// tandem/comm/nccl/nccl_mpi.hpp - an NcclComm bootstrapped through MPI when the job runs under
// mpirun: rank 0 of an MPI communicator makes the ncclUniqueId and broadcasts it (no store needed).
//   MPI_Init(&argc, &argv);  cudaSetDevice(local_rank);
//   tandem::NcclComm comm = tandem::nccl_from_mpi(MPI_COMM_WORLD);
// Needs: MPI (link tandem::mpi) and NCCL (tandem::nccl); a .cu translation unit (nvcc). Kept
// apart from nccl.hpp so that NCCL users without MPI never need its headers.
#pragma once

#include <mpi.h>

#include <string>

#include "tandem/comm/nccl/nccl.hpp"
#include "tandem/core/error.hpp"

namespace tandem {

/// The NcclComm whose ranks are those of `comm` (same rank numbers), on each process's current
/// GPU unless options.device says otherwise. Collective over `comm`; MPI must be initialised,
/// and the calling thread must be one that may make MPI calls.
[[nodiscard]] inline NcclComm nccl_from_mpi(MPI_Comm comm, const NcclCommOptions& options = {}) {
  int rank = 0;
  int size = 0;
  if (MPI_Comm_rank(comm, &rank) != MPI_SUCCESS || MPI_Comm_size(comm, &size) != MPI_SUCCESS) {
    throw Error("nccl_from_mpi", "MPI_Comm_rank/MPI_Comm_size failed (is MPI initialised?)");
  }
  ncclUniqueId id{};
  if (rank == 0) id = NcclComm::unique_id();
  if (MPI_Bcast(&id, static_cast<int>(sizeof id), MPI_BYTE, 0, comm) != MPI_SUCCESS) {
    throw Error(rank, "nccl_from_mpi", "MPI_Bcast of the NCCL unique id failed");
  }
  return NcclComm::create(id, rank, size, options);
}

}  // namespace tandem
