// tandem/tensor/tensor.hpp - the Tensor concept (an element type, a memory space, data() and
// size() in elements), tandem::View (non-owning, optional shape) and tandem::Buffer (owning).
//   tandem::Buffer<float, tandem::host> grads(1024);
//   comm.all_reduce(grads.view(), tandem::ReduceOp::avg);   // std::vector / std::span work too
// Needs: the standard library; Buffer in pinned or device memory needs tandem/cuda.hpp.
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/memory.hpp"

namespace tandem {

/// What tandem knows of a tensor type: its element type and memory space. A type opts in either
/// with member typedefs `value_type` and `memory_space` (and a data() member), or by specialising
/// tensor_traits. Standard containers that live in host memory (std::vector, std::span,
/// std::array) are tensors.
template <class T>
struct tensor_traits {};

/// \cond
template <class T>
requires requires(T& t) {
  typename T::value_type;
  typename T::memory_space;
  t.data();  // without it, element_type below would be a hard error instead of "not a Tensor"
}
struct tensor_traits<T> {
  using element_type = std::remove_reference_t<decltype(*std::declval<T&>().data())>;
  using memory_space = typename T::memory_space;
};

template <class T, class A>
struct tensor_traits<std::vector<T, A>> {
  using element_type = T;
  using memory_space = host;
};
template <class T, std::size_t N>
struct tensor_traits<std::span<T, N>> {
  using element_type = T;
  using memory_space = host;
};
template <class T, std::size_t N>
struct tensor_traits<std::array<T, N>> {
  using element_type = T;
  using memory_space = host;
};
/// \endcond

/// The element type as seen through a (possibly const) T: const for a const container.
template <class T>
using tensor_element_t =
    std::remove_reference_t<decltype(*std::declval<std::remove_reference_t<T>&>().data())>;

/// The memory space of tensor type T (cv-qualifiers and references ignored).
template <class T>
using tensor_space_t = typename tensor_traits<std::remove_cvref_t<T>>::memory_space;

/// A Tensor, as tandem's algorithms need it:
/// 1. tensor_traits names its element type and memory space (opt in);
/// 2. the element type is one of the seven element types (float ... uint8);
/// 3. the memory space is a tandem::memory_space;
/// 4. data() gives a pointer to contiguous elements and size() their count, in elements.
template <class T>
concept Tensor = requires {
  typename tensor_traits<std::remove_cvref_t<T>>::memory_space;
}
&&element_type<tensor_element_t<T>>&& memory_space<tensor_space_t<T>>&& requires(
    std::remove_reference_t<T>& t) {
  { t.data() } -> std::same_as<tensor_element_t<T>*>;
  { t.size() } -> std::convertible_to<std::size_t>;
};

/// A Tensor whose elements can be written through it.
template <class T>
concept MutableTensor = Tensor<T> && !std::is_const_v<tensor_element_t<T>>;

/// A Tensor in memory space S.
template <class T, class S>
concept TensorIn = Tensor<T> && std::same_as<tensor_space_t<T>, S>;

/// Up to eight extents; a View keeps one so that a layer's weight knows it is {out, in}.
class Shape {
 public:
  /// The most extents a Shape holds.
  static constexpr std::size_t max_rank = 8;

  Shape() = default;
  /// A shape from its extents, outermost first: `Shape{out, in}`. More than max_rank, or a negative
  /// extent, is an Error.
  Shape(std::initializer_list<std::int64_t> extents) {
    if (extents.size() > max_rank) {
      throw Error("Shape", std::to_string(extents.size()) + " dimensions exceed the maximum of " +
                               std::to_string(max_rank));
    }
    for (auto extent : extents) {
      if (extent < 0) throw Error("Shape", "extent " + std::to_string(extent) + " is negative");
      extents_[rank_++] = extent;
    }
  }

  /// Number of extents; 0 for a scalar.
  [[nodiscard]] std::size_t rank() const noexcept { return rank_; }
  /// Extent `i`, outermost first (i < rank()).
  [[nodiscard]] std::int64_t operator[](std::size_t i) const noexcept { return extents_[i]; }
  /// The extents, outermost first.
  [[nodiscard]] const std::int64_t* begin() const noexcept { return extents_.data(); }
  /// One past the last extent.
  [[nodiscard]] const std::int64_t* end() const noexcept { return extents_.data() + rank_; }

  /// Number of elements; 1 for a scalar (rank 0).
  [[nodiscard]] std::size_t numel() const noexcept {
    std::size_t count = 1;
    for (auto extent : *this) count *= static_cast<std::size_t>(extent);
    return count;
  }

  friend bool operator==(const Shape& a, const Shape& b) noexcept {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }

  /// "[2, 3]", for messages.
  [[nodiscard]] std::string to_string() const {
    std::string text = "[";
    for (std::size_t i = 0; i < rank_; ++i) {
      if (i) text += ", ";
      text += std::to_string(extents_[i]);
    }
    return text + "]";
  }

 private:
  std::array<std::int64_t, max_rank> extents_{};
  std::size_t rank_ = 0;
};

template <element_type T, memory_space Space = host>
class View;

/// True for the View types.
template <class T>
inline constexpr bool is_view_v = false;
/// \cond
template <class T, class S>
inline constexpr bool is_view_v<View<T, S>> = true;
/// \endcond

/// A non-owning window on contiguous elements of type T in memory space Space; cheap to copy.
/// T may be const (a read-only view). Its shape, when given, must hold exactly size() elements.
template <element_type T, memory_space Space>
class View {
 public:
  /// The element type without const.
  using value_type = std::remove_cv_t<T>;
  /// The element type, const for a read-only view.
  using element_type = T;
  /// The memory space the elements live in.
  using memory_space = Space;

  View() = default;
  /// A flat view of `size` elements at `data`, shaped {size}.
  View(T* data, std::size_t size) noexcept
      : data_(data), size_(size), shape_{static_cast<std::int64_t>(size)} {}
  /// A view of shape.numel() elements at `data`, shaped `shape`.
  View(T* data, Shape shape) : data_(data), size_(shape.numel()), shape_(shape) {}

  /// Any tensor of the same space whose elements convert to T* (non-const to const included).
  template <Tensor Other>
  requires(!is_view_v<std::remove_cvref_t<Other>> && std::same_as<tensor_space_t<Other>, Space> &&
           std::convertible_to<tensor_element_t<Other>*, T*> &&
           // A view of a temporary container would dangle; a temporary span or view would not.
           (std::is_lvalue_reference_v<Other> ||
            std::ranges::enable_borrowed_range<std::remove_cvref_t<Other>>)) View(Other&& other)
  noexcept  // NOLINT(google-explicit-constructor): a view of it, like span
      : View(other.data(), static_cast<std::size_t>(other.size())) {}

  /// View<float> converts to View<const float>.
  template <class U>
  requires(!std::same_as<U, T> && std::convertible_to<U*, T*>) View(const View<U, Space>& other)
  noexcept : data_(other.data()), size_(other.size()), shape_(other.shape()) {}

  /// The first element.
  [[nodiscard]] T* data() const noexcept { return data_; }
  /// Number of elements.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// Number of bytes: size() * sizeof(T).
  [[nodiscard]] std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  /// True when the view has no element.
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  /// Its shape (flat views: {size()}).
  [[nodiscard]] const Shape& shape() const noexcept { return shape_; }

  /// Elements [offset, offset + count), as a flat view. Out of range is an Error.
  [[nodiscard]] View subview(std::size_t offset, std::size_t count) const {
    if (offset > size_ || count > size_ - offset) {
      throw Error("View::subview", "range [" + std::to_string(offset) + ", " +
                                       std::to_string(offset) + " + " + std::to_string(count) +
                                       ") lies outside a view of " + std::to_string(size_) +
                                       " elements");
    }
    return View(data_ + offset, count);
  }

  /// The same elements under another shape with the same element count.
  [[nodiscard]] View reshape(Shape shape) const {
    if (shape.numel() != size_) {
      throw Error("View::reshape", "shape " + shape.to_string() + " holds " +
                                       std::to_string(shape.numel()) + " elements, the view " +
                                       std::to_string(size_));
    }
    return View(data_, shape);
  }

  /// Element `i`; host-accessible spaces only.
  T& operator[](std::size_t i) const noexcept requires host_accessible<Space> { return data_[i]; }
  /// The first element, for range-for; host-accessible spaces only.
  T* begin() const noexcept requires host_accessible<Space> { return data_; }
  /// One past the last element; host-accessible spaces only.
  T* end() const noexcept requires host_accessible<Space> { return data_ + size_; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
  Shape shape_{0};
};

}  // namespace tandem

/// \cond
template <class T, class S>
inline constexpr bool std::ranges::enable_borrowed_range<tandem::View<T, S>> = true;
/// \endcond

namespace tandem {

/// Deduces View's element type and memory space from a Tensor: `View v = vector;`.
template <Tensor T>
View(T&&) -> View<tensor_element_t<T>, tensor_space_t<T>>;

/// A View of any Tensor.
template <Tensor T>
[[nodiscard]] auto view(T&& tensor) noexcept {
  if constexpr (is_view_v<std::remove_cvref_t<T>>)
    return tensor;  // keeps its shape
  else
    return View<tensor_element_t<T>, tensor_space_t<T>>(tensor.data(),
                                                        static_cast<std::size_t>(tensor.size()));
}

namespace detail {
// What a space's allocator offers besides allocate<T>(count) / deallocate(pointer, count): the
// allocation_state overloads (device memory). Named concepts at namespace scope: the same
// requires-expressions written inside Buffer's constructor template crash nvcc 13's cicc.
template <class Allocator, class T, class State>
concept allocates_with_state = requires(std::size_t count, State& state) {
  Allocator::template allocate<T>(count, state);
};
template <class Allocator, class T, class Exec, class State>
concept allocates_for_executor = requires(std::size_t count, const Exec& exec, State& state) {
  Allocator::template allocate<T>(count, exec, state);
};
template <class Allocator, class T, class State>
concept deallocates_with_state = requires(T* pointer, std::size_t count, const State& state) {
  Allocator::deallocate(pointer, count, state);
};
}  // namespace detail

/// Owns `size` elements of T in memory space Space; move-only. Host buffers start zeroed (like
/// std::vector); other spaces leave their contents to the allocator of that space.
/// Device memory is stream-ordered (tandem/cuda/memory.hpp): Buffer(shape) is usable on every
/// stream when constructed, Buffer(shape, cuda_exec{stream}) on `stream` without any wait; both
/// are freed in stream order, so work on other non-blocking streams must be finished or joined
/// (an Event) before the Buffer is destroyed.
template <element_type T, memory_space Space = host>
class Buffer {
  static_assert(!std::is_const_v<T>, "tandem: a Buffer owns mutable elements; use View<const T>");
  using allocator = space_allocator<Space>;

 public:
  /// Its element type.
  using value_type = T;
  /// Its element type (a Buffer's elements are never const).
  using element_type = T;
  /// The memory space it allocates in.
  using memory_space = Space;

  Buffer() = default;
  /// `size` elements, shaped {size}: zeroed in host memory, uninitialised elsewhere.
  explicit Buffer(std::size_t size) : Buffer(Shape{static_cast<std::int64_t>(size)}) {}
  /// shape.numel() elements, shaped `shape`: zeroed in host memory, uninitialised elsewhere.
  explicit Buffer(Shape shape) : size_(shape.numel()), shape_(shape) {
    if constexpr (detail::allocates_with_state<allocator, T, allocation_state<Space>>) {
      data_ = allocator::template allocate<T>(size_, allocation_);
    } else {
      data_ = allocator::template allocate<T>(size_);
    }
    if constexpr (std::same_as<Space, host>) std::fill_n(data_, size_, T{});
  }

  /// Allocated for work on `exec`: device memory in the order of its stream (usable there at
  /// once, freed behind that stream's work, so the stream must outlive the Buffer); other spaces
  /// as Buffer(shape).
  template <Executor E>
  requires ExecutorFor<E, Space>
  explicit Buffer(std::size_t size, const E& exec)
      : Buffer(Shape{static_cast<std::int64_t>(size)}, exec) {}
  /// The same, shaped `shape`.
  template <Executor E>
  requires ExecutorFor<E, Space>
  explicit Buffer(Shape shape, const E& exec) : size_(shape.numel()), shape_(shape) {
    if constexpr (detail::allocates_for_executor<allocator, T, E, allocation_state<Space>>) {
      data_ = allocator::template allocate<T>(size_, exec, allocation_);
    } else if constexpr (detail::allocates_with_state<allocator, T, allocation_state<Space>>) {
      data_ = allocator::template allocate<T>(size_, allocation_);
    } else {
      data_ = allocator::template allocate<T>(size_);
    }
    if constexpr (std::same_as<Space, host>) std::fill_n(data_, size_, T{});
  }

  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  /// Takes the allocation over; `other` is left empty.
  Buffer(Buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        shape_(std::exchange(other.shape_, Shape{0})),
        allocation_(other.allocation_) {}
  /// Frees its own allocation and takes `other`'s; `other` is left empty.
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      shape_ = std::exchange(other.shape_, Shape{0});
      allocation_ = other.allocation_;
    }
    return *this;
  }
  ~Buffer() { release(); }

  /// The first element.
  [[nodiscard]] T* data() noexcept { return data_; }
  /// The first element, read-only.
  [[nodiscard]] const T* data() const noexcept { return data_; }
  /// Number of elements.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// Number of bytes: size() * sizeof(T).
  [[nodiscard]] std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  /// True when it holds no element.
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  /// Its shape.
  [[nodiscard]] Shape shape() const noexcept { return shape_; }
  /// Where the allocation is ordered (device memory: its stream and device); empty elsewhere.
  [[nodiscard]] const allocation_state<Space>& allocation() const noexcept { return allocation_; }

  /// A view of every element, with its shape.
  [[nodiscard]] View<T, Space> view() noexcept { return View<T, Space>(data_, shape()); }
  /// A read-only view of every element, with its shape.
  [[nodiscard]] View<const T, Space> view() const noexcept {
    return View<const T, Space>(data_, shape());
  }

  /// Element `i`; host-accessible spaces only.
  T& operator[](std::size_t i) noexcept requires host_accessible<Space> { return data_[i]; }
  /// Element `i`, read-only; host-accessible spaces only.
  const T& operator[](std::size_t i) const noexcept requires host_accessible<Space> {
    return data_[i];
  }
  /// The first element, for range-for; host-accessible spaces only.
  T* begin() noexcept requires host_accessible<Space> { return data_; }
  /// One past the last element; host-accessible spaces only.
  T* end() noexcept requires host_accessible<Space> { return data_ + size_; }
  /// The first element, read-only; host-accessible spaces only.
  const T* begin() const noexcept requires host_accessible<Space> { return data_; }
  /// One past the last element, read-only; host-accessible spaces only.
  const T* end() const noexcept requires host_accessible<Space> { return data_ + size_; }

 private:
  void release() noexcept {
    if constexpr (detail::deallocates_with_state<allocator, T, allocation_state<Space>>) {
      allocator::deallocate(data_, size_, allocation_);
    } else {
      allocator::deallocate(data_, size_);
    }
    data_ = nullptr;
    size_ = 0;
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
  Shape shape_{0};  // always the true shape: a rank-0 shape is a scalar of one element
  [[no_unique_address]] allocation_state<Space> allocation_{};
};

}  // namespace tandem
