// tandem/torch/tensor.hpp - libtorch tensors on tandem's communicators: torch::Tensor as a
// DynamicTensor (comm.all_reduce(t), every operation of tandem's communicators), a checked typed
// view (tandem::torch::view<float>(t)), collectives for any Communicator that dispatch on the
// tensor's run-time dtype (tandem::torch::all_reduce(comm, t), broadcast), reduce_mean /
// reduce_sum of a tensor, and a Loader batch's fields as tensors (tandem::torch::tensors(batch)).
//   comm.all_reduce(grads, tandem::ReduceOp::avg);                     // any supported dtype
//   comm.all_reduce(tandem::torch::view<float>(t));                    // the typed way
//   torch::Tensor mean = tandem::reduce_mean(comm, loss.detach());     // PyTorch's reduce_tensor
//   auto [images, labels] = tandem::torch::tensors(batch);            // views, no copy
// Needs: libtorch (1.13 or 2.x; the tandem::torch CMake component) and a Communicator.
//
// How: tandem's Tensor concept fixes the element type and memory space at compile time (that is
// how a backend picks its typed algorithm and a wrong type fails to compile), while a
// torch::Tensor carries its dtype and device at run time. So a torch::Tensor is a DynamicTensor
// (tensor/dynamic.hpp) instead: tandem's communicators (LocalComm, GlooComm, MpiComm, ShmComm,
// HierarchicalComm, NcclComm) take it in every operation and see it through a typed view after
// the checks below; view<T, Space>(t) does the same check for one element type, and the free
// functions below do it for any Communicator (a user's own included). Anything else - an
// undefined, sparse or non-contiguous tensor, a dtype tandem does not move (bool, int8, int16,
// complex), a CUDA tensor on a host communicator or a CPU tensor on a device one - is a
// tandem::Error that names the operation and the cause, never a silent copy.
// CUDA tensors on a device communicator (NcclComm): libtorch's kernels run on its current stream,
// and each operation goes through tandem's stream-ordering contract (comm/stream_order.hpp) with
// that stream, as PyTorch's ProcessGroupNCCL does: the communicator orders the operation after
// the stream's queued work and a sync operation hands its result back to it, on the GPU, with no
// host wait (an `_async` one returns a Work: work.wait(stream) hands it back, work.wait() waits
// on the host). Finding libtorch's current CUDA stream needs libtorch's CUDA headers: include
// <tandem/torch/cuda.hpp> (a .cu file, nvcc; CurrentStream<device> below says so otherwise).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/stream_order.hpp"
#include "tandem/core/error.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/dynamic.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::torch {

/// libtorch's dtype for tandem's element type T (float -> kFloat, half -> kHalf, ...).
template <element_type T>
constexpr c10::ScalarType scalar_type_of() noexcept {
  if constexpr (std::is_same_v<T, float>) return c10::ScalarType::Float;
  if constexpr (std::is_same_v<T, double>) return c10::ScalarType::Double;
  if constexpr (std::is_same_v<T, half>) return c10::ScalarType::Half;
  if constexpr (std::is_same_v<T, bfloat16>) return c10::ScalarType::BFloat16;
  if constexpr (std::is_same_v<T, std::int32_t>) return c10::ScalarType::Int;
  if constexpr (std::is_same_v<T, std::int64_t>) return c10::ScalarType::Long;
  if constexpr (std::is_same_v<T, std::uint8_t>) return c10::ScalarType::Byte;
}

// view<half> and view<bfloat16> reinterpret libtorch's 16-bit types as tandem's: the same bits.
static_assert(sizeof(half) == sizeof(c10::Half) && sizeof(bfloat16) == sizeof(c10::BFloat16),
              "tandem::half and bfloat16 must have the size of c10::Half and c10::BFloat16");

/// The dtype's name as PyTorch prints it ("Float", "Long", ...), for messages.
inline std::string dtype_name(c10::ScalarType type) {
  return c10::toString(type);
}

/// libtorch's current stream as tandem's executor, for tensors in memory space Space: what the
/// bridge orders its communicators' operations and its own passes with (the stream-ordering
/// contract, comm/stream_order.hpp). Host memory: host_exec (libtorch's CPU kernels have finished
/// when they return). Device memory: cuda_exec on libtorch's current CUDA stream of the device,
/// which tandem/torch/cuda.hpp supplies.
template <memory_space Space>
struct CurrentStream {
  static_assert(host_accessible<Space>,
                "tandem: CUDA tensors on a device communicator (NcclComm) are ordered after "
                "libtorch's current CUDA stream: #include <tandem/torch/cuda.hpp> (in a .cu file "
                "compiled by nvcc, with a libtorch built with CUDA)");
  /// What runs in libtorch's order: host_exec.
  using executor = host_exec;
  /// The executor of libtorch's current stream on `device`.
  static executor of(const at::Device& /*device*/) { return {}; }
};

namespace detail {

/// run() (operations of `comm` on `t`, seen through typed views) in libtorch's stream order: for
/// a CUDA tensor on a device communicator, the communicator after libtorch's current stream and,
/// when run() returns nothing (sync operations), their results handed back to that stream.
template <class Space, class Comm, class Run>
decltype(auto) on_current_stream(Comm& comm, const at::Tensor& t, Run&& run) {
  if constexpr (host_accessible<Space>) {
    return run();
  } else {
    if (!t.defined() || !t.is_cuda()) return run();  // run() raises the Error naming the cause
    const auto exec = CurrentStream<Space>::of(t.device());
    tandem::order_after(comm, exec);
    if constexpr (std::is_void_v<decltype(run())>) {
      run();
      tandem::hand_back(comm, exec);
    } else {
      return run();  // a Work: handed back by its waiter (work.wait(stream) or work.wait())
    }
  }
}

}  // namespace detail

/// Why `t` cannot be seen as a flat tensor (empty when it can): undefined, not strided (sparse,
/// mkldnn), not contiguous, or on a device other than the CPU or a CUDA GPU.
inline std::string layout_problem(const at::Tensor& t) {
  if (!t.defined()) return "the tensor is undefined";
  if (t.layout() != c10::kStrided) return "the tensor is not dense (sparse or another layout)";
  if (!t.is_contiguous()) {
    return "the tensor is not contiguous (a transpose, slice or expand); call .contiguous() "
           "first, and copy the result back if the collective must write into it";
  }
  if (!t.is_cpu() && !t.is_cuda()) {
    return "the tensor is on " + t.device().str() + "; tandem moves CPU and CUDA tensors";
  }
  return {};
}

/// A tandem::View of `t`'s elements as T in memory space Space (host for CPU tensors, device
/// for CUDA tensors): an Error naming `operation` (and `rank`, when known) when `t` is not
/// dense and contiguous, its dtype is not T, or it does not live in Space.
template <element_type T, memory_space Space = host>
[[nodiscard]] View<T, Space> view(const at::Tensor& t, const char* operation = "torch::view",
                                  int rank = unknown_rank) {
  if (auto problem = layout_problem(t); !problem.empty()) throw Error(rank, operation, problem);
  if (t.scalar_type() != scalar_type_of<T>()) {
    throw Error(rank, operation,
                "the tensor's dtype is " + dtype_name(t.scalar_type()) + ", the view's " +
                    dtype_name(scalar_type_of<T>()) + " (" + dtype_traits<T>::name + ")");
  }
  if constexpr (host_accessible<Space>) {
    if (!t.is_cpu()) {
      throw Error(rank, operation,
                  "a " + t.device().str() +
                      " tensor cannot be seen in host memory; use a device "
                      "communicator (NcclComm) or copy it with .cpu()");
    }
  } else {
    if (!t.is_cuda()) {
      throw Error(rank, operation,
                  "a CPU tensor is not in device memory; a device communicator (NcclComm) moves "
                  "CUDA tensors only: move it with .cuda() or use a host communicator");
    }
  }
  // tandem::half and bfloat16 have c10::Half's and c10::BFloat16's bits.
  return View<T, Space>(static_cast<T*>(t.data_ptr()), static_cast<std::size_t>(t.numel()));
}

/// Calls f(T{}) with tandem's element type for `t`'s dtype; an Error naming `operation` for a
/// dtype tandem does not move.
template <class F>
decltype(auto) visit_dtype(const at::Tensor& t, const char* operation, int rank, F&& f) {
  switch (t.scalar_type()) {
    case c10::ScalarType::Float:
      return f(float{});
    case c10::ScalarType::Double:
      return f(double{});
    case c10::ScalarType::Half:
      return f(half{});
    case c10::ScalarType::BFloat16:
      return f(bfloat16{});
    case c10::ScalarType::Int:
      return f(std::int32_t{});
    case c10::ScalarType::Long:
      return f(std::int64_t{});
    case c10::ScalarType::Byte:
      return f(std::uint8_t{});
    default:
      throw Error(rank, operation,
                  "dtype " + dtype_name(t.scalar_type()) +
                      " is not one tandem moves (Float, Double, Half, BFloat16, Int, Long, Byte)");
  }
}

/// A tandem::View as a libtorch tensor over the same memory (no copy): its shape, its element
/// type's dtype, on the CPU for host memory or on the GPU that holds it for device memory. It is
/// valid as long as the View's memory is.
template <element_type T, memory_space Space>
[[nodiscard]] at::Tensor tensor(View<T, Space> v) {
  const Shape& shape = v.shape();
  std::vector<std::int64_t> sizes(shape.begin(), shape.end());
  auto options = at::TensorOptions().dtype(scalar_type_of<T>());
  // Without an index, libtorch asks CUDA which GPU the pointer is on.
  options = options.device(host_accessible<Space> ? at::kCPU : at::kCUDA);
  return at::from_blob(static_cast<void*>(v.data()), sizes, options);
}

/// A Loader batch's fields as libtorch tensors, in the data set's field order, each a view of
/// the batch's memory (no copy) of shape {batch size, elements of one sample} and its element
/// type's dtype:
///   auto [images, labels] = tandem::torch::tensors(batch);   // Float {n, 784}, Long {n, 1}
///   auto loss = cross_entropy(ddp.forward(images.view({-1, 1, 28, 28})), labels.view(-1));
/// They are valid while the batch is (until the loop's next iteration: the Loader reuses its
/// buffers); .clone() one to keep it, .to(device) to move it to a GPU.
template <class Batch>
requires requires(const Batch& batch) {
  batch.views();
}
[[nodiscard]] auto tensors(const Batch& batch) {
  return std::apply([](auto... views) { return std::make_tuple(tensor(views)...); }, batch.views());
}

}  // namespace tandem::torch

namespace tandem {

/// torch::Tensor (at::Tensor) is a DynamicTensor: tandem's communicators take it directly. A
/// CUDA tensor on a device communicator is ordered with libtorch's current stream (ordered()).
template <>
struct dynamic_tensor_traits<at::Tensor> {
  /// at::Tensor is a DynamicTensor.
  static constexpr bool enabled = true;

  /// f(view of `t` as its own element type, in Space); an Error naming `operation` otherwise.
  template <memory_space Space, class F>
  static decltype(auto) visit(const at::Tensor& t, const char* operation, int rank, F&& f) {
    if (auto problem = torch::layout_problem(t); !problem.empty()) {
      throw Error(rank, operation, problem);
    }
    return torch::visit_dtype(t, operation, rank, [&](auto tag) -> decltype(auto) {
      return f(view<decltype(tag), Space>(t, operation, rank));
    });
  }

  /// `t` seen as E in Space; an Error naming `operation` when it cannot be.
  template <element_type E, memory_space Space>
  static View<E, Space> view(const at::Tensor& t, const char* operation, int rank) {
    return torch::view<E, Space>(t, operation, rank);
  }

  /// Runs a communicator's operation on `t` (run()) in libtorch's stream order: a CUDA tensor on
  /// a device communicator through the stream-ordering contract with libtorch's current stream
  /// (needs tandem/torch/cuda.hpp), anything else as it is.
  template <memory_space Space, class Comm, class Run>
  static decltype(auto) ordered(Comm& comm, const at::Tensor& t, Run&& run) {
    return torch::detail::on_current_stream<Space>(comm, t, std::forward<Run>(run));
  }
};

}  // namespace tandem

namespace tandem::torch {

namespace detail {

/// f(view) with the typed view of `t` in Comm's memory space, in libtorch's stream order (see
/// on_current_stream), for any Communicator.
template <Communicator Comm, class F>
decltype(auto) with_view(Comm& comm, const at::Tensor& t, const char* operation, F&& f) {
  using Space = typename Comm::memory_space;
  return on_current_stream<tandem::detail::dynamic_view_space<Space>>(
      comm, t, [&]() -> decltype(auto) {
        return tandem::detail::visit_dynamic<Space>(t, operation, comm.rank(), f);
      });
}

}  // namespace detail

/// In place: every rank's `t` becomes the reduction of all ranks' `t` (comm.all_reduce on its
/// typed view). `t` must be dense, contiguous, of a dtype tandem moves, in comm's memory space.
template <Communicator Comm>
void all_reduce(Comm& comm, const at::Tensor& t, ReduceOp op = ReduceOp::sum) {
  detail::with_view(comm, t, "torch::all_reduce", [&](auto v) { comm.all_reduce(v, op); });
}

/// all_reduce, started: `t` must stay alive and untouched until the Work completes.
template <Communicator Comm>
[[nodiscard]] Work all_reduce_async(Comm& comm, const at::Tensor& t, ReduceOp op = ReduceOp::sum) {
  return detail::with_view(comm, t, "torch::all_reduce_async",
                           [&](auto v) { return comm.all_reduce_async(v, op); });
}

/// In place: every rank's `t` becomes rank `root`'s.
template <Communicator Comm>
void broadcast(Comm& comm, const at::Tensor& t, int root) {
  detail::with_view(comm, t, "torch::broadcast", [&](auto v) { comm.broadcast(v, root); });
}

/// broadcast, started: `t` must stay alive and untouched until the Work completes.
template <Communicator Comm>
[[nodiscard]] Work broadcast_async(Comm& comm, const at::Tensor& t, int root) {
  return detail::with_view(comm, t, "torch::broadcast_async",
                           [&](auto v) { return comm.broadcast_async(v, root); });
}

}  // namespace tandem::torch

namespace tandem {

/// The element-wise sum of `t` over the ranks, as a new tensor on every rank (`t` is untouched;
/// a non-contiguous `t` is fine here, its copy is contiguous).
template <Communicator Comm>
[[nodiscard]] at::Tensor reduce_sum(Comm& comm, const at::Tensor& t) {
  at::Tensor out = t.detach().clone(at::MemoryFormat::Contiguous);
  torch::all_reduce(comm, out, ReduceOp::sum);
  return out;
}

/// The element-wise mean of `t` over the ranks, as a new tensor on every rank: PyTorch's
/// reduce_tensor (clone, all_reduce, divide). Floating dtypes only: an integer mean would
/// truncate (use reduce_sum).
template <Communicator Comm>
[[nodiscard]] at::Tensor reduce_mean(Comm& comm, const at::Tensor& t) {
  if (t.defined() && !at::isFloatingType(t.scalar_type())) {
    throw Error(comm.rank(), "reduce_mean",
                "dtype " + torch::dtype_name(t.scalar_type()) +
                    " is not floating; an integer mean would truncate (use reduce_sum)");
  }
  at::Tensor out = t.detach().clone(at::MemoryFormat::Contiguous);
  torch::all_reduce(comm, out, ReduceOp::avg);
  return out;
}

}  // namespace tandem
