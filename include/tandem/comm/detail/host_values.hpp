// tandem/comm/detail/host_values.hpp - collectives over a few host values (flags, counts, lengths,
// the bytes of a small record) on any communicator, also one whose tensors live on a GPU
// (NcclComm): there the values travel through a staging buffer in the communicator's memory
// space and come back once the collective has finished.
//   tandem::detail::host_all_reduce(comm, std::span<std::int32_t>(flags), tandem::ReduceOp::max);
// Needs: a Communicator; for a device communicator, the translation unit that instantiates this
// includes tandem/cuda.hpp (it already does, to use the communicator).
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>

#include "tandem/comm/communicator.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::detail {

/// Whether Comm's tensors are host memory (then host values go to it as they are).
template <class Comm>
inline constexpr bool host_communicator = host_accessible<typename Comm::memory_space>;

/// Waits on the host until the communicator's operations so far have finished, where it has
/// such a call (a device communicator's sync operations are only ordered on a stream).
template <class Comm>
void finish_on_host(Comm& comm) {
  if constexpr (requires { comm.synchronize(); }) comm.synchronize();
}

/// A copy of `values` in the communicator's memory space.
template <class Comm, class T>
Buffer<std::remove_const_t<T>, typename Comm::memory_space> stage(std::span<T> values) {
  using Space = typename Comm::memory_space;
  Buffer<std::remove_const_t<T>, Space> staged(values.size());
  if (!values.empty())
    space_copy<Space, host>::copy(staged.data(), values.data(), values.size_bytes());
  return staged;
}

/// Copies a staged buffer back into `values` once the communicator has finished with it.
template <class Comm, class T, class Staged>
void unstage(Comm& comm, const Staged& staged, std::span<T> values) {
  finish_on_host(comm);
  if (!values.empty()) {
    space_copy<host, typename Comm::memory_space>::copy(values.data(), staged.data(),
                                                        values.size_bytes());
  }
}

/// all_reduce of host values, in place, on every rank.
template <Communicator Comm, class T>
void host_all_reduce(Comm& comm, std::span<T> values, ReduceOp op) {
  if constexpr (host_communicator<Comm>) {
    comm.all_reduce(View<T, host>(values.data(), values.size()), op);
  } else {
    auto staged = stage<Comm>(values);
    comm.all_reduce(staged.view(), op);
    unstage(comm, staged, values);
  }
}

/// broadcast of host values from `root`, in place.
template <Communicator Comm, class T>
void host_broadcast(Comm& comm, std::span<T> values, int root) {
  if constexpr (host_communicator<Comm>) {
    comm.broadcast(View<T, host>(values.data(), values.size()), root);
  } else {
    auto staged = stage<Comm>(values);
    comm.broadcast(staged.view(), root);
    unstage(comm, staged, values);
  }
}

/// all_gather of host values: `out` holds size() * in.size() values, rank r's at r * in.size().
template <Communicator Comm, class T>
void host_all_gather(Comm& comm, std::span<const T> in, std::span<T> out) {
  if constexpr (host_communicator<Comm>) {
    comm.all_gather(View<const T, host>(in.data(), in.size()),
                    View<T, host>(out.data(), out.size()));
  } else {
    auto staged_in = stage<Comm>(in);
    Buffer<T, typename Comm::memory_space> staged_out(out.size());
    comm.all_gather(staged_in.view(), staged_out.view());
    unstage(comm, staged_out, out);
  }
}

}  // namespace tandem::detail
