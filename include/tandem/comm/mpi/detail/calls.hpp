// tandem/comm/mpi/detail/calls.hpp - MpiComm's tasks (the front end's X_task hooks): each
// operation's MPI call in its blocking and non-blocking forms, with what follows completion,
// built on the calling thread before anything is sent: the arguments checked (the front end's
// texts), MPI's in-place and int-count rules applied, a collective's fingerprint attached where
// the engine checks collectives.
//   detail::mpi::Call call = detail::mpi::Calls(engine).all_reduce_task(in, out, ReduceOp::sum);
// Needs: an MPI (C API, MPI-3). Not a public header: mpi.hpp uses it.
#pragma once

#include <climits>
#include <cstddef>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <mpi.h>

#include "tandem/comm/checked.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/collective_args.hpp"
#include "tandem/comm/detail/reduction.hpp"
#include "tandem/comm/mpi/detail/engine.hpp"
#include "tandem/comm/mpi/detail/mpi_runtime.hpp"
#include "tandem/comm/mpi/detail/progress.hpp"
#include "tandem/core/error.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/memory.hpp"

namespace tandem::detail::mpi {

/// A copy of `count` elements at `data` that lives as long as the closures holding it.
template <class T>
std::shared_ptr<std::vector<T>> scratch_copy(const T* data, std::size_t count) {
  return std::make_shared<std::vector<T>>(data, data + count);
}

/// Builds the Calls of one MpiComm's operations on its engine; holds nothing but the engine.
class Calls {
 public:
  explicit Calls(Engine& engine) noexcept : engine_(engine) {}

  template <class In, class Out>
  Call all_reduce_task(In& in, Out& out, ReduceOp op) const {
    using E = detail::elem_t<Out>;
    const auto args = detail::all_reduce_args<host>(rank(), in, out, op);
    const auto count = args.count;
    const int n = to_int(count, "all_reduce");
    const E* source = args.in;
    E* target = args.out;
    const void* sendbuf = source;
    if (source == target) {
      sendbuf = MPI_IN_PLACE;
    } else if (detail::overlap(source, count, target, count)) {
      std::memmove(target, source, count * sizeof(E));
      sendbuf = MPI_IN_PLACE;
    }
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Op mpi_op = detail::mpi::reduce_op<E>(self().runtime(), op);
    const MPI_Comm comm = native();
    return checked(
        Call{"all_reduce", true,
             [=](MPI_Status*) { return MPI_Allreduce(sendbuf, target, n, type, mpi_op, comm); },
             [=](MPI_Request* r) {
               return MPI_Iallreduce(sendbuf, target, n, type, mpi_op, comm, r);
             },
             average(op, target, count)},
        detail::CollectiveOp::all_reduce, dtype_of<E>, count, 0, op);
  }

  template <class T>
  Call reduce_task(T& t, int root, ReduceOp op) const {
    using E = detail::elem_t<T>;
    E* data = detail::rooted_args<host>(rank(), size(), t, root, op, "reduce");
    const auto count = static_cast<std::size_t>(t.size());
    const int n = to_int(count, "reduce");
    const bool is_root = rank() == root;
    const void* sendbuf = is_root ? MPI_IN_PLACE : static_cast<const void*>(data);
    void* recvbuf = is_root ? data : nullptr;
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Op mpi_op = detail::mpi::reduce_op<E>(self().runtime(), op);
    const MPI_Comm comm = native();
    return checked(
        Call{"reduce", true,
             [=](MPI_Status*) { return MPI_Reduce(sendbuf, recvbuf, n, type, mpi_op, root, comm); },
             [=](MPI_Request* r) {
               return MPI_Ireduce(sendbuf, recvbuf, n, type, mpi_op, root, comm, r);
             },
             is_root ? average(op, data, count) : nullptr},
        detail::CollectiveOp::reduce, dtype_of<E>, count, root, op);
  }

  template <class T>
  Call broadcast_task(T& t, int root) const {
    using E = detail::elem_t<T>;
    E* data = detail::rooted_args<host>(rank(), size(), t, root, ReduceOp::sum, "broadcast");
    const int n = to_int(static_cast<std::size_t>(t.size()), "broadcast");
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Comm comm = native();
    return checked(
        Call{"broadcast", true, [=](MPI_Status*) { return MPI_Bcast(data, n, type, root, comm); },
             [=](MPI_Request* r) { return MPI_Ibcast(data, n, type, root, comm, r); }, nullptr},
        detail::CollectiveOp::broadcast, dtype_of<E>, static_cast<std::size_t>(t.size()), root);
  }

  /// The send buffer of a gather into `out` whose slot `slot` is this rank's: MPI_IN_PLACE when
  /// `in` is that slot, a copy when `in` overlaps `out` elsewhere (kept alive in `keep`).
  template <class E>
  static const void* gather_source(const E* in, std::size_t count, E* out, std::size_t total,
                                   std::size_t slot, std::shared_ptr<std::vector<E>>& keep) {
    if (in == out + slot * count) return MPI_IN_PLACE;
    if (!detail::overlap(in, count, static_cast<const E*>(out), total)) return in;
    keep = detail::mpi::scratch_copy(in, count);
    return keep->data();
  }

  template <class In, class Out>
  Call all_gather_task(In& in, Out& out) const {
    using E = detail::elem_t<Out>;
    const auto args = detail::all_gather_args<host>(rank(), size(), in, out);
    const auto count = args.count;
    const int n = to_int(count, "all_gather");
    E* target = args.out;
    std::shared_ptr<std::vector<E>> keep;
    const void* sendbuf =
        gather_source(args.in, count, target, static_cast<std::size_t>(out.size()),
                      static_cast<std::size_t>(rank()), keep);
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Comm comm = native();
    return checked(
        Call{"all_gather", true,
             [=](MPI_Status*) { return MPI_Allgather(sendbuf, n, type, target, n, type, comm); },
             [=](MPI_Request* r) {
               return MPI_Iallgather(sendbuf, n, type, target, n, type, comm, r);
             },
             [keep](const MPI_Status&) {}},
        detail::CollectiveOp::all_gather, dtype_of<E>, count);
  }

  template <class In, class Out>
  Call gather_task(In& in, Out& out, int root) const {
    using E = detail::elem_t<Out>;
    const auto args = detail::gather_args<host>(rank(), size(), in, out, root);
    const bool is_root = rank() == root;
    const auto count = args.count;
    const int n = to_int(count, "gather");
    const E* source = args.in;
    E* target = is_root ? args.out : nullptr;
    std::shared_ptr<std::vector<E>> keep;
    const void* sendbuf =
        is_root ? gather_source(source, count, target, static_cast<std::size_t>(out.size()),
                                static_cast<std::size_t>(root), keep)
                : source;
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Comm comm = native();
    return checked(
        Call{"gather", true,
             [=](MPI_Status*) { return MPI_Gather(sendbuf, n, type, target, n, type, root, comm); },
             [=](MPI_Request* r) {
               return MPI_Igather(sendbuf, n, type, target, n, type, root, comm, r);
             },
             [keep](const MPI_Status&) {}},
        detail::CollectiveOp::gather, dtype_of<E>, count, root);
  }

  template <class In, class Out>
  Call scatter_task(In& in, Out& out, int root) const {
    using E = detail::elem_t<Out>;
    const auto args = detail::scatter_args<host>(rank(), size(), in, out, root);
    const bool is_root = rank() == root;
    const auto count = args.count;
    const int n = to_int(count, "scatter");
    const E* source = is_root ? args.in : nullptr;
    E* target = args.out;
    void* recvbuf = target;
    std::shared_ptr<std::vector<E>> keep;
    if (is_root) {
      const auto total = static_cast<std::size_t>(in.size());
      if (target == source + static_cast<std::size_t>(root) * count) {
        recvbuf = MPI_IN_PLACE;
      } else if (detail::overlap(static_cast<const E*>(target), count, source, total)) {
        keep = detail::mpi::scratch_copy(source, total);
        source = keep->data();
      }
    }
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Comm comm = native();
    return checked(Call{"scatter", true,
                        [=](MPI_Status*) {
                          return MPI_Scatter(source, n, type, recvbuf, n, type, root, comm);
                        },
                        [=](MPI_Request* r) {
                          return MPI_Iscatter(source, n, type, recvbuf, n, type, root, comm, r);
                        },
                        [keep](const MPI_Status&) {}},
                   detail::CollectiveOp::scatter, dtype_of<E>, count, root);
  }

  template <class In, class Out>
  Call reduce_scatter_task(In& in, Out& out, ReduceOp op) const {
    using E = detail::elem_t<Out>;
    const auto args = detail::reduce_scatter_args<host>(rank(), size(), in, out, op);
    const auto count = args.count;
    const int n = to_int(count, "reduce_scatter");
    const E* source = args.in;
    E* target = args.out;
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Op mpi_op = detail::mpi::reduce_op<E>(self().runtime(), op);
    const MPI_Comm comm = native();
    const int ranks = size();
    const bool average = op == ReduceOp::avg;
    // MPI's in-place form leaves the result at the start of the buffer, not in this rank's slot:
    // an output inside the input goes through scratch instead.
    std::shared_ptr<std::vector<E>> keep;
    E* result = target;
    if (detail::overlap(static_cast<const E*>(target), count, source,
                        static_cast<std::size_t>(in.size()))) {
      keep = std::make_shared<std::vector<E>>(count);
      result = keep->data();
    }
    return checked(Call{"reduce_scatter", true,
                        [=](MPI_Status*) {
                          return MPI_Reduce_scatter_block(source, result, n, type, mpi_op, comm);
                        },
                        [=](MPI_Request* r) {
                          return MPI_Ireduce_scatter_block(source, result, n, type, mpi_op, comm,
                                                           r);
                        },
                        [=](const MPI_Status&) {
                          if (keep) std::memcpy(target, keep->data(), count * sizeof(E));
                          if (average) detail::divide(target, count, ranks);
                        }},
                   detail::CollectiveOp::reduce_scatter, dtype_of<E>, count, 0, op);
  }

  template <class In, class Out>
  Call all_to_all_task(In& in, Out& out) const {
    using E = detail::elem_t<Out>;
    const auto args = detail::all_to_all_args<host>(rank(), size(), in, out);
    const auto total = args.count;
    const int n = to_int(total / static_cast<std::size_t>(size()), "all_to_all");
    const E* source = args.in;
    E* target = args.out;
    // In place (or overlapping) through a copy of the input: simpler and safer than relying on
    // each MPI's in-place all-to-all.
    std::shared_ptr<std::vector<E>> keep;
    if (detail::overlap(source, total, static_cast<const E*>(target), total)) {
      keep = detail::mpi::scratch_copy(source, total);
      source = keep->data();
    }
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Comm comm = native();
    return checked(
        Call{"all_to_all", true,
             [=](MPI_Status*) { return MPI_Alltoall(source, n, type, target, n, type, comm); },
             [=](MPI_Request* r) {
               return MPI_Ialltoall(source, n, type, target, n, type, comm, r);
             },
             [keep](const MPI_Status&) {}},
        detail::CollectiveOp::all_to_all, dtype_of<E>, total);
  }

  template <class T>
  Call send_task(T& t, int peer, int tag) const {
    using E = detail::elem_t<T>;
    const E* data = detail::send_args<host>(rank(), size(), t, peer);
    check_tag(tag, "send");
    const int n = to_int(static_cast<std::size_t>(t.size()), "send");
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Comm comm = native();
    return {"send", false, [=](MPI_Status*) { return MPI_Send(data, n, type, peer, tag, comm); },
            [=](MPI_Request* r) { return MPI_Isend(data, n, type, peer, tag, comm, r); }, nullptr};
  }

  template <class T>
  Call recv_task(T& t, int peer, int tag) const {
    using E = detail::elem_t<T>;
    E* data = detail::recv_args<host>(rank(), size(), t, peer);
    check_tag(tag, "recv");
    const int n = to_int(static_cast<std::size_t>(t.size()), "recv");
    const MPI_Datatype type = detail::mpi::datatype<E>();
    const MPI_Comm comm = native();
    const int me = rank();
    return {"recv", false,
            [=](MPI_Status* status) { return MPI_Recv(data, n, type, peer, tag, comm, status); },
            [=](MPI_Request* r) { return MPI_Irecv(data, n, type, peer, tag, comm, r); },
            [=](const MPI_Status& status) {
              int got = 0;
              MPI_Get_count(&status, type, &got);
              if (got != n) {
                throw Error(me, "recv",
                            "expected " + std::to_string(n) + " " + dtype_traits<E>::name +
                                " elements from rank " + std::to_string(peer) + " with tag " +
                                std::to_string(tag) + ", but the message held " +
                                std::to_string(got));
              }
            }};
  }

  Call barrier_task() const {
    const MPI_Comm comm = native();
    return checked(Call{"barrier", true, [=](MPI_Status*) { return MPI_Barrier(comm); },
                        [=](MPI_Request* r) { return MPI_Ibarrier(comm, r); }, nullptr},
                   detail::CollectiveOp::barrier, dtype::float32, 0);
  }

 private:
  [[nodiscard]] int rank() const { return engine_.rank(); }
  [[nodiscard]] int size() const { return engine_.size(); }
  [[nodiscard]] MPI_Comm native() const { return engine_.comm(); }
  [[nodiscard]] Engine& self() const { return engine_; }

  /// `call` with the fingerprint it is checked by, where this communicator checks collectives.
  Call checked(Call call, detail::CollectiveOp op, dtype type, std::size_t count, int root = 0,
               ReduceOp reduce_op = ReduceOp::sum) const {
    call.fingerprint = self().fingerprint(op, type, count, root, reduce_op);
    return call;
  }

  [[nodiscard]] Error error(const char* op, const std::string& cause) const {
    return Error(rank(), op, cause);
  }

  [[nodiscard]] int to_int(std::size_t count, const char* op) const {
    if (count > static_cast<std::size_t>(INT_MAX)) {
      throw error(op, std::to_string(count) + " elements per rank exceed MPI's limit of " +
                          std::to_string(INT_MAX) + " in one call");
    }
    return static_cast<int>(count);
  }

  void check_tag(int tag, const char* op) const {
    detail::check_tag(rank(), tag, tag_upper_bound(), "MPI's range", op);
  }

  [[nodiscard]] int tag_upper_bound() const { return self().tag_upper_bound(); }

  /// The avg division after a sum, where `op` asks for it.
  template <class E>
  std::function<void(const MPI_Status&)> average(ReduceOp op, E* data, std::size_t count) const {
    if (op != ReduceOp::avg || count == 0) return {};
    const int ranks = size();
    return [data, count, ranks](const MPI_Status&) { detail::divide(data, count, ranks); };
  }

  Engine& engine_;
};

}  // namespace tandem::detail::mpi
