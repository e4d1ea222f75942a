// tandem/comm/detail/collective_args.hpp - what every communicator checks about a call before it
// moves anything: the tensors' memory space, element types and mutability (at compile time); the
// root, peer, colour, sizes and reduce op (a tandem::Error with the texts all backends share);
// then the typed pointers and the element count the call works on.
//   const auto args = tandem::detail::all_reduce_args<tandem::host>(rank, in, out, op);
// Needs: the standard library. Not a public header: backends include it.
#pragma once

#include <concepts>
#include <cstddef>
#include <string>
#include <type_traits>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/error.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::detail {

template <class T>
using elem_t = std::remove_cv_t<tensor_element_t<T>>;

// --- compile time: Space is the communicator's memory_space -------------------------------------

template <class Space, class T>
constexpr void check_space() {
  static_assert(!host_accessible<Space> || host_accessible<tensor_space_t<T>>,
                "tandem: this communicator's tensors must live in host memory");
  static_assert(host_accessible<Space> || std::same_as<tensor_space_t<T>, Space>,
                "tandem: this communicator's tensors must live in its memory space");
}

/// One call's input and output: in the communicator's space, a mutable output, one element type.
template <class Space, class In, class Out>
constexpr void check_tensors() {
  check_space<Space, In>();
  check_space<Space, Out>();
  static_assert(!std::is_const_v<tensor_element_t<Out>>,
                "tandem: the output tensor must be mutable (it is const)");
  static_assert(std::same_as<elem_t<In>, elem_t<Out>>,
                "tandem: the input and output tensors of one call must have the same element type");
}

/// t.data() as the pointer an operation needs; null where a static_assert above has already
/// rejected the tensor (so the compiler reports that, not a conversion error).
template <class E, class T>
const E* in_ptr(T& t) noexcept {
  if constexpr (std::same_as<elem_t<T>, E>) {
    return t.data();
  } else {
    return nullptr;
  }
}
template <class E, class T>
E* out_ptr(T& t) noexcept {
  if constexpr (std::same_as<tensor_element_t<T>, E>) {
    return t.data();
  } else {
    return nullptr;
  }
}

// --- run time: each check raises tandem::Error(rank, operation, cause)
// ----------------------------

inline void check_root(int rank, int size, int root, const char* op) {
  if (root < 0 || root >= size) {
    throw Error(rank, op,
                "root " + std::to_string(root) + " is not a rank of this group of " +
                    std::to_string(size) + " ranks");
  }
}

inline void check_peer(int rank, int size, int peer, const char* op) {
  if (peer < 0 || peer >= size) {
    throw Error(rank, op,
                "peer " + std::to_string(peer) + " is not a rank of this group of " +
                    std::to_string(size) + " ranks");
  }
}

/// For a transport whose tags run from 0 to `upper_bound` ("MPI's range", say).
inline void check_tag(int rank, int tag, int upper_bound, const char* range, const char* op) {
  if (tag < 0 || tag > upper_bound) {
    throw Error(rank, op,
                "tag " + std::to_string(tag) + " is outside " + range + " 0 to " +
                    std::to_string(upper_bound));
  }
}

inline void check_color(int rank, int color) {
  if (color < 0 && color != no_color) {
    throw Error(rank, "split",
                "color " + std::to_string(color) + " is negative (use tandem::no_color)");
  }
}

template <class E>
void check_reduce_op(int rank, ReduceOp op, const char* name) {
  if (op == ReduceOp::avg && !dtype_traits<E>::is_floating) {
    throw Error(
        rank, name,
        std::string("avg needs a floating-point element type, not ") + dtype_traits<E>::name);
  }
}

// --- one function per operation: every check, then the call's pointers and count -----------------

/// What a checked call works on: `count` is the per-op count of the Communicator concept (the
/// elements per rank, or all_to_all's total).
template <class E>
struct CallArgs {
  const E* in;
  E* out;
  std::size_t count;
};

template <class Space, class In, class Out>
CallArgs<elem_t<Out>> all_reduce_args(int rank, In& in, Out& out, ReduceOp op) {
  using E = elem_t<Out>;
  check_tensors<Space, In, Out>();
  check_reduce_op<E>(rank, op, "all_reduce");
  if (static_cast<std::size_t>(in.size()) != static_cast<std::size_t>(out.size())) {
    throw Error(rank, "all_reduce",
                "in has " + std::to_string(in.size()) + " elements and out " +
                    std::to_string(out.size()) + "; they must be equal");
  }
  return {in_ptr<E>(in), out_ptr<E>(out), static_cast<std::size_t>(out.size())};
}

/// reduce and broadcast (which passes ReduceOp::sum): one buffer, a root.
template <class Space, class T>
elem_t<T>* rooted_args(int rank, int size, T& t, int root, ReduceOp op, const char* name) {
  check_tensors<Space, T, T>();
  check_root(rank, size, root, name);
  check_reduce_op<elem_t<T>>(rank, op, name);
  return out_ptr<elem_t<T>>(t);
}

/// Where one tensor (`whole`, `whole_size` elements) holds every rank's `count` elements of the
/// other (`part`): that it holds size * count.
inline void check_all_ranks(int rank, int size, const char* op, std::size_t whole_size,
                            const char* whole, std::size_t count, const char* part) {
  const auto expected = count * static_cast<std::size_t>(size);
  if (whole_size != expected) {
    throw Error(rank, op,
                std::string(whole) + " has " + std::to_string(whole_size) +
                    " elements, but size() * " + part + ".size() = " + std::to_string(size) +
                    " * " + std::to_string(count) + " = " + std::to_string(expected));
  }
}

/// all_gather and gather: out holds size * in.size() elements (checked where `uses_out`).
template <class Space, class In, class Out>
CallArgs<elem_t<Out>> gather_like_args(int rank, int size, In& in, Out& out, const char* name,
                                       bool uses_out) {
  check_tensors<Space, In, Out>();
  const auto count = static_cast<std::size_t>(in.size());
  if (uses_out) {
    check_all_ranks(rank, size, name, static_cast<std::size_t>(out.size()), "out", count, "in");
  }
  return {in_ptr<elem_t<Out>>(in), out_ptr<elem_t<Out>>(out), count};
}

/// scatter and reduce_scatter: in holds size * out.size() elements (checked where `uses_in`).
template <class Space, class In, class Out>
CallArgs<elem_t<Out>> scatter_like_args(int rank, int size, In& in, Out& out, const char* name,
                                        bool uses_in) {
  check_tensors<Space, In, Out>();
  const auto count = static_cast<std::size_t>(out.size());
  if (uses_in) {
    check_all_ranks(rank, size, name, static_cast<std::size_t>(in.size()), "in", count, "out");
  }
  return {in_ptr<elem_t<Out>>(in), out_ptr<elem_t<Out>>(out), count};
}

template <class Space, class In, class Out>
CallArgs<elem_t<Out>> all_gather_args(int rank, int size, In& in, Out& out) {
  return gather_like_args<Space>(rank, size, in, out, "all_gather", true);
}

/// out is used (and its size checked) on the root only.
template <class Space, class In, class Out>
CallArgs<elem_t<Out>> gather_args(int rank, int size, In& in, Out& out, int root) {
  check_root(rank, size, root, "gather");
  return gather_like_args<Space>(rank, size, in, out, "gather", rank == root);
}

/// in is used (and its size checked) on the root only.
template <class Space, class In, class Out>
CallArgs<elem_t<Out>> scatter_args(int rank, int size, In& in, Out& out, int root) {
  check_root(rank, size, root, "scatter");
  return scatter_like_args<Space>(rank, size, in, out, "scatter", rank == root);
}

template <class Space, class In, class Out>
CallArgs<elem_t<Out>> reduce_scatter_args(int rank, int size, In& in, Out& out, ReduceOp op) {
  check_reduce_op<elem_t<Out>>(rank, op, "reduce_scatter");
  return scatter_like_args<Space>(rank, size, in, out, "reduce_scatter", true);
}

/// in and out hold the same multiple of size elements; count is that total.
template <class Space, class In, class Out>
CallArgs<elem_t<Out>> all_to_all_args(int rank, int size, In& in, Out& out) {
  check_tensors<Space, In, Out>();
  const auto total = static_cast<std::size_t>(in.size());
  if (static_cast<std::size_t>(out.size()) != total ||
      total % static_cast<std::size_t>(size) != 0) {
    throw Error(rank, "all_to_all",
                "in has " + std::to_string(in.size()) + " elements and out " +
                    std::to_string(out.size()) +
                    "; both must be the same multiple of size() = " + std::to_string(size));
  }
  return {in_ptr<elem_t<Out>>(in), out_ptr<elem_t<Out>>(out), total};
}

/// send's data (its tensor may be const).
template <class Space, class T>
const elem_t<T>* send_args(int rank, int size, T& t, int peer) {
  check_space<Space, T>();
  check_peer(rank, size, peer, "send");
  return in_ptr<elem_t<T>>(t);
}

template <class Space, class T>
elem_t<T>* recv_args(int rank, int size, T& t, int peer) {
  check_tensors<Space, T, T>();
  check_peer(rank, size, peer, "recv");
  return out_ptr<elem_t<T>>(t);
}

/// The Error of a recv on `rank` whose message from `peer` with `tag` holds `sent_count`
/// elements of `sent`, where the recv takes `count` elements of `type`.
inline Error recv_mismatch(int rank, int peer, int tag, dtype sent, std::size_t sent_count,
                           dtype type, std::size_t count) {
  return Error(rank, "recv",
               "rank " + std::to_string(peer) + " sent " + std::to_string(sent_count) + " " +
                   name(sent) + " elements with tag " + std::to_string(tag) +
                   ", but this rank receives " + std::to_string(count) + " " + name(type) +
                   " elements");
}

/// The Error of a recv from `rank` itself with `tag` when it has sent no such message before.
inline Error recv_from_self_unsent(int rank, int tag) {
  return Error(rank, "recv",
               "no message from this rank itself with tag " + std::to_string(tag) +
                   " was sent before (it would wait forever)");
}

}  // namespace tandem::detail
