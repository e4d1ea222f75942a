// tandem/data/batches.hpp - tandem::views::batches(b): a sized random-access range cut into
// consecutive subranges of b elements (the last one shorter, or dropped with views::drop_last).
//   for (auto batch : sampler | tandem::views::batches(64)) for (std::int64_t i : batch) ...
//   auto full = std::views::iota(0, 100) | tandem::views::batches(32, tandem::views::drop_last);
// Needs: the standard library.
#pragma once

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <ranges>
#include <string>
#include <type_traits>
#include <utility>

#include "tandem/core/error.hpp"

namespace tandem {

/// A view of R in consecutive chunks of `batch_size` elements, each a std::ranges::subrange of
/// R's iterators; random-access and sized itself, so a Loader can hand batch k to any worker.
template <std::ranges::view R>
requires std::ranges::random_access_range<R> && std::ranges::sized_range<R>
class batch_view : public std::ranges::view_interface<batch_view<R>> {
  using base_iterator = std::ranges::iterator_t<const R>;

 public:
  /// One batch: a subrange of the underlying range's iterators (no copy of the elements).
  using batch_type = std::ranges::subrange<base_iterator>;
  class iterator;

  batch_view() = default;
  /// `base` in batches of `batch_size` (tandem::Error when 0), the short last one dropped when
  /// `drop_last`; views::batches makes one.
  batch_view(R base, std::size_t batch_size, bool drop_last)
      : base_(std::move(base)), batch_size_(batch_size), drop_last_(drop_last) {
    if (batch_size == 0) throw Error("views::batches", "batch_size = 0 must be at least 1");
  }

  /// Batches in the range: ceil(n / b), or floor(n / b) with drop_last.
  [[nodiscard]] std::size_t size() const {
    const auto n = static_cast<std::size_t>(std::ranges::size(base_));
    return drop_last_ ? n / batch_size_ : (n + batch_size_ - 1) / batch_size_;
  }
  /// Elements per batch (a last batch may have fewer).
  [[nodiscard]] std::size_t batch_size() const noexcept { return batch_size_; }
  /// Whether a last batch shorter than batch_size() is left out.
  [[nodiscard]] bool drop_last() const noexcept { return drop_last_; }
  /// The range being cut into batches.
  [[nodiscard]] const R& base() const& noexcept { return base_; }

  /// Batch k (k < size()).
  [[nodiscard]] batch_type operator[](std::size_t k) const {
    const auto n = static_cast<std::size_t>(std::ranges::size(base_));
    const std::size_t first = k * batch_size_;
    const std::size_t last = std::min(n, first + batch_size_);
    auto begin = std::ranges::begin(base_);
    using difference = std::iter_difference_t<base_iterator>;
    return {begin + static_cast<difference>(first), begin + static_cast<difference>(last)};
  }

  /// The first batch.
  [[nodiscard]] iterator begin() const { return {this, 0}; }
  /// Past the last batch.
  [[nodiscard]] iterator end() const { return {this, size()}; }

 private:
  R base_{};
  std::size_t batch_size_ = 1;
  bool drop_last_ = false;
};

/// A random-access iterator over a batch_view's batches, yielding each by value (a subrange);
/// it refers to its view, which must outlive it.
template <std::ranges::view R>
requires std::ranges::random_access_range<R> && std::ranges::sized_range<R>
class batch_view<R>::iterator {
 public:
  // The standard random-access iterator protocol, left out of the API reference.
  /// @cond TANDEM_ITERATOR_PROTOCOL
  using iterator_concept = std::random_access_iterator_tag;
  using iterator_category = std::input_iterator_tag;  // yields subranges by value
  using value_type = batch_type;
  using difference_type = std::ptrdiff_t;

  iterator() = default;
  iterator(const batch_view* view, std::size_t position) noexcept
      : view_(view), position_(static_cast<difference_type>(position)) {}

  value_type operator*() const { return (*view_)[static_cast<std::size_t>(position_)]; }
  value_type operator[](difference_type k) const { return *(*this + k); }

  iterator& operator++() noexcept { return ++position_, *this; }
  iterator operator++(int) noexcept { return {view_, static_cast<std::size_t>(position_++)}; }
  iterator& operator--() noexcept { return --position_, *this; }
  iterator operator--(int) noexcept { return {view_, static_cast<std::size_t>(position_--)}; }
  iterator& operator+=(difference_type k) noexcept { return position_ += k, *this; }
  iterator& operator-=(difference_type k) noexcept { return position_ -= k, *this; }
  friend iterator operator+(iterator it, difference_type k) noexcept { return it += k; }
  friend iterator operator+(difference_type k, iterator it) noexcept { return it += k; }
  friend iterator operator-(iterator it, difference_type k) noexcept { return it -= k; }
  friend difference_type operator-(const iterator& a, const iterator& b) noexcept {
    return a.position_ - b.position_;
  }
  friend bool operator==(const iterator& a, const iterator& b) noexcept {
    return a.position_ == b.position_;
  }
  friend auto operator<=>(const iterator& a, const iterator& b) noexcept {
    return a.position_ <=> b.position_;
  }
  /// @endcond

 private:
  const batch_view* view_ = nullptr;
  difference_type position_ = 0;
};

/// Makes a view of any viewable range, as std::views::all does: a view is kept as is, a
/// container referred to (or owned, when moved in).
template <class R>
batch_view(R&&, std::size_t, bool) -> batch_view<std::views::all_t<R>>;

namespace views {

/// Tag for views::batches(b, views::drop_last): leave out a last batch shorter than b.
struct drop_last_t {
  explicit drop_last_t() = default;
};
inline constexpr drop_last_t drop_last{};

/// The pipeable closure of views::batches; `range | closure` makes a batch_view.
struct batches_closure {
  std::size_t batch_size;  ///< elements per batch
  bool drop_last;          ///< leave out a last batch shorter than batch_size

  template <std::ranges::viewable_range R>
  requires std::ranges::random_access_range<R> && std::ranges::sized_range<R>
  friend auto operator|(R&& range, const batches_closure& closure) {
    return batch_view(std::forward<R>(range), closure.batch_size, closure.drop_last);
  }
};

/// `range | views::batches(b)`: consecutive batches of b elements, the last one shorter.
inline batches_closure batches(std::size_t batch_size) {
  return {batch_size, false};
}
/// `range | views::batches(b, views::drop_last)`: only full batches of b elements.
inline batches_closure batches(std::size_t batch_size, drop_last_t) {
  return {batch_size, true};
}

}  // namespace views
}  // namespace tandem
