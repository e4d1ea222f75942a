// tandem/tensor/dynamic.hpp - DynamicTensor: a tensor whose element type and memory space are
// known at run time only (a torch::Tensor), which tandem's communicators take beside Tensors;
// each call sees it through a typed View once its dtype, layout and device are checked.
//   comm.all_reduce(t);   // t: a torch::Tensor, with <tandem/torch.hpp> included
// Needs: the standard library.
//
// Why an extension point of its own: a Tensor fixes its element type and memory space at compile
// time, which is how a backend picks its typed algorithm; a torch::Tensor carries both at run
// time. A library's tensor type becomes a DynamicTensor by specialising dynamic_tensor_traits:
//   static constexpr bool enabled = true;
//   template <memory_space Space, class F>
//   static decltype(auto) visit(const T& t, const char* operation, int rank, F&& f);
//     // calls f(View<E, Space>) for t's element type E, or throws a tandem::Error naming
//     // `operation` and the cause (not dense and contiguous, a dtype tandem does not move, not in
//     // Space)
//   template <element_type E, memory_space Space>
//   static View<E, Space> view(const T& t, const char* operation, int rank);
//     // t seen as E, or that Error (a dtype other than E included)
// A communicator of a host memory space sees dynamic tensors in host memory only: device ones are
// an Error there, not a staged copy (device staging needs the CUDA headers, which a CPU
// translation unit lacks).
#pragma once

#include <type_traits>
#include <utility>

#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// Not a dynamic tensor unless specialised (see the top of this header).
template <class T>
struct dynamic_tensor_traits {
  /// Whether T is a DynamicTensor: false unless a specialisation says true.
  static constexpr bool enabled = false;
};

/// A tensor typed at run time (see the top of this header).
template <class T>
concept DynamicTensor = dynamic_tensor_traits<std::remove_cvref_t<T>>::enabled;

/// What a communicator's operations take: a Tensor or a DynamicTensor.
template <class T>
concept AnyTensor = Tensor<T> || DynamicTensor<T>;

namespace detail {

/// Where a communicator of memory space Space sees dynamic tensors: host memory for host
/// communicators, its own device memory otherwise.
template <class Space>
using dynamic_view_space = std::conditional_t<host_accessible<Space>, host, Space>;

/// f(view of `t` with its own element type), for a communicator of memory space Space.
template <class Space, class T, class F>
decltype(auto) visit_dynamic(const T& t, const char* operation, int rank, F&& f) {
  return dynamic_tensor_traits<std::remove_cvref_t<T>>::template visit<dynamic_view_space<Space>>(
      t, operation, rank, std::forward<F>(f));
}

/// `t` seen as element type E, for a communicator of memory space Space.
template <class E, class Space, class T>
auto dynamic_view(const T& t, const char* operation, int rank) {
  return dynamic_tensor_traits<std::remove_cvref_t<T>>::template view<E, dynamic_view_space<Space>>(
      t, operation, rank);
}

/// f(in, out) with both arguments typed: a dynamic one takes the element type of the other, or
/// its own when both are dynamic (then `out` must have `in`'s dtype).
template <class Space, class In, class Out, class F>
decltype(auto) with_typed_pair(In& in, Out& out, const char* operation, int rank, F&& f) {
  if constexpr (DynamicTensor<In> && DynamicTensor<Out>) {
    return visit_dynamic<Space>(in, operation, rank, [&](auto typed_in) -> decltype(auto) {
      using E = std::remove_const_t<tensor_element_t<decltype(typed_in)>>;
      return f(typed_in, dynamic_view<E, Space>(out, operation, rank));
    });
  } else if constexpr (DynamicTensor<In>) {
    using E = std::remove_const_t<tensor_element_t<Out>>;
    return f(dynamic_view<E, Space>(in, operation, rank), out);
  } else {
    using E = std::remove_const_t<tensor_element_t<In>>;
    return f(in, dynamic_view<E, Space>(out, operation, rank));
  }
}

}  // namespace detail

}  // namespace tandem
