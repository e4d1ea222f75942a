// tandem/comm/detail/staging.hpp - lets a host communicator (Gloo, MPI) take device tensors: it
// copies them into pinned host memory, runs the host operation there, and copies the outputs
// back, so the same DDP code runs with device tensors on a machine with one GPU.
//   if constexpr (detail::needs_staging<host, In, Out>)
//     return detail::staged(in, out, [&](auto& i, auto& o) { all_reduce(i, o, op); });
// Needs: the standard library; device tensors need tandem/cuda.hpp (it supplies the copies).
//
// The copies are synchronous and ordered with the legacy default stream: the kernels that wrote
// an input must have finished (synchronise their stream first, as before reading it on the
// host). An `_async` operation copies its inputs at the call and its outputs back on the thread
// that completes it, before its Work reports completion.
#pragma once

#include <cstddef>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::detail {

/// Whether a communicator whose tensors live in Space must stage some of Ts through pinned memory.
template <class Space, class... Ts>
inline constexpr bool needs_staging = host_accessible<Space> &&
                                      (!host_accessible<tensor_space_t<Ts>> || ...);

/// pinned, named through T so that the pinned allocator (which only CUDA translation units
/// have) is looked up when a device tensor is staged, not when this header is read.
template <class T>
struct staging_space {
  using type = pinned;
};

/// The pinned copies of one call's device tensors; copies outputs back when told to.
class Staging {
 public:
  Staging() = default;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() {
    for (auto& slot : slots_) slot.release(slot.pinned);
  }

  /// A host-readable view of `t`'s elements as they are now.
  template <class T>
  auto input(T& t) {
    return stage(t, /*read=*/true, /*write_back=*/false);
  }
  /// A host view whose contents are copied into `t` by copy_back().
  template <class T>
  auto output(T& t) {
    return stage(t, /*read=*/false, /*write_back=*/true);
  }
  /// Both: read now, written back later (in-place operations).
  template <class T>
  auto in_out(T& t) {
    return stage(t, /*read=*/true, /*write_back=*/true);
  }

  void copy_back() {
    for (auto& slot : slots_) {
      if (slot.write_back && slot.bytes) slot.copy_to_device(slot.device, slot.pinned, slot.bytes);
    }
  }

 private:
  struct Slot {
    void* device = nullptr;
    void* pinned = nullptr;
    std::size_t bytes = 0;
    bool write_back = false;
    void (*copy_to_device)(void*, const void*, std::size_t) = nullptr;
    void (*release)(void*) noexcept = nullptr;
  };

  template <class T>
  auto stage(T& t, bool read, bool write_back) {
    using Space = tensor_space_t<T>;
    using E = tensor_element_t<T>;
    if constexpr (host_accessible<Space>) {
      return view(t);
    } else {
      using Plain = std::remove_const_t<E>;
      using Pinned = typename staging_space<T>::type;
      using Allocator = space_allocator<Pinned>;
      auto* device_data = const_cast<Plain*>(t.data());
      const std::size_t count = static_cast<std::size_t>(t.size());
      // One pinned copy per device buffer: an in-place call passes the same tensor twice.
      for (auto& slot : slots_) {
        if (slot.device == device_data && slot.bytes == count * sizeof(Plain)) {
          slot.write_back = slot.write_back || write_back;
          return View<E, pinned>(static_cast<Plain*>(slot.pinned), count);
        }
      }
      Slot slot;
      slot.device = device_data;
      slot.bytes = count * sizeof(Plain);
      slot.write_back = write_back;
      slot.copy_to_device = &space_copy<Space, Pinned>::copy;
      slot.release = [](void* pointer) noexcept {
        Allocator::template deallocate<Plain>(static_cast<Plain*>(pointer), 0);
      };
      Plain* host_data = Allocator::template allocate<Plain>(count);
      slot.pinned = host_data;
      slots_.push_back(slot);
      if (read && count) space_copy<Pinned, Space>::copy(host_data, device_data, slot.bytes);
      return View<E, pinned>(host_data, count);
    }
  }

  std::vector<Slot> slots_;
};

/// Runs `operation(staged_in, staged_out)` on pinned copies and writes the output back.
template <class In, class Out, class Operation>
void staged(In& in, Out& out, Operation&& operation) {
  Staging staging;
  auto host_in = staging.input(in);
  auto host_out = staging.output(out);
  operation(host_in, host_out);
  staging.copy_back();
}

/// How a single-tensor operation uses its tensor on this rank.
enum class Direction { read, write, read_write };

template <class T>
auto stage_one(Staging& staging, T& t, Direction direction) {
  switch (direction) {
    case Direction::read:
      return staging.input(t);
    case Direction::write:
      return staging.output(t);
    case Direction::read_write:
      break;
  }
  return staging.in_out(t);
}

/// The same for a single-tensor operation (reduce, broadcast, send, recv).
template <class T, class Operation>
void staged_one(T& t, Direction direction, Operation&& operation) {
  Staging staging;
  auto host_t = stage_one(staging, t, direction);
  operation(host_t);
  staging.copy_back();
}

inline void attach(Work& work, std::shared_ptr<Staging> staging) {
  if (!work.state()) {  // finished already (a backend may complete trivial calls at once)
    staging->copy_back();
    return;
  }
  work.state()->after_success([staging = std::move(staging)] { staging->copy_back(); });
}

/// `_async` forms: the pinned copies live until the operation ends; outputs are written back
/// before its Work completes.
template <class In, class Out, class Operation>
Work staged_async(In& in, Out& out, Operation&& operation) {
  auto staging = std::make_shared<Staging>();
  auto host_in = staging->input(in);
  auto host_out = staging->output(out);
  Work work = operation(host_in, host_out);
  attach(work, std::move(staging));
  return work;
}
template <class T, class Operation>
Work staged_one_async(T& t, Direction direction, Operation&& operation) {
  auto staging = std::make_shared<Staging>();
  auto host_t = stage_one(*staging, t, direction);
  Work work = operation(host_t);
  attach(work, std::move(staging));
  return work;
}

}  // namespace tandem::detail
