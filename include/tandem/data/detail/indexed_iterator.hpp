// tandem/data/detail/indexed_iterator.hpp - the random-access iterator of a range whose elements
// are computed from their position (a sampler's indices, a batch view's batches): it holds the
// range and a position, and yields range[position] by value.
#pragma once

#include <compare>
#include <cstddef>
#include <iterator>

namespace tandem::detail {

/// Iterates positions of `Owner`, yielding `(*owner)[k]` (a `Value`, by value). `Category` is the
/// legacy category (random access where the value is cheap to copy, input where it is not a
/// reference to stored data and algorithms must not hold on to it).
template <class Owner, class Value, class Category = std::random_access_iterator_tag>
class indexed_iterator {
 public:
  /// @cond TANDEM_ITERATOR_PROTOCOL
  using iterator_concept = std::random_access_iterator_tag;
  using iterator_category = Category;
  using value_type = Value;
  using difference_type = std::ptrdiff_t;
  using reference = Value;

  indexed_iterator() = default;
  indexed_iterator(const Owner* owner, std::size_t position) noexcept
      : owner_(owner), position_(static_cast<difference_type>(position)) {}

  reference operator*() const { return (*owner_)[static_cast<std::size_t>(position_)]; }
  reference operator[](difference_type k) const { return *(*this + k); }

  indexed_iterator& operator++() noexcept { return ++position_, *this; }
  indexed_iterator operator++(int) noexcept {
    return {owner_, static_cast<std::size_t>(position_++)};
  }
  indexed_iterator& operator--() noexcept { return --position_, *this; }
  indexed_iterator operator--(int) noexcept {
    return {owner_, static_cast<std::size_t>(position_--)};
  }
  indexed_iterator& operator+=(difference_type k) noexcept { return position_ += k, *this; }
  indexed_iterator& operator-=(difference_type k) noexcept { return position_ -= k, *this; }
  friend indexed_iterator operator+(indexed_iterator it, difference_type k) noexcept {
    return it += k;
  }
  friend indexed_iterator operator+(difference_type k, indexed_iterator it) noexcept {
    return it += k;
  }
  friend indexed_iterator operator-(indexed_iterator it, difference_type k) noexcept {
    return it -= k;
  }
  friend difference_type operator-(const indexed_iterator& a, const indexed_iterator& b) noexcept {
    return a.position_ - b.position_;
  }
  friend bool operator==(const indexed_iterator& a, const indexed_iterator& b) noexcept {
    return a.position_ == b.position_;
  }
  friend auto operator<=>(const indexed_iterator& a, const indexed_iterator& b) noexcept {
    return a.position_ <=> b.position_;
  }
  /// @endcond

 private:
  const Owner* owner_ = nullptr;
  difference_type position_ = 0;
};

}  // namespace tandem::detail
