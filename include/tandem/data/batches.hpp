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
#include "tandem/data/detail/indexed_iterator.hpp"

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
  /// Random access over the batches; each is made on dereference (an input iterator to legacy
  /// algorithms, since it yields subranges by value).
  using iterator = detail::indexed_iterator<batch_view, batch_type, std::input_iterator_tag>;

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
