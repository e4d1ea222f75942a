// tandem/data/dataset.hpp - the Dataset concept: a size, and a way to read sample i's fields
// (an image, a label, ...) into memory the caller provides, so a Loader gathers a batch straight
// into contiguous buffers with no allocation per sample.
//   struct Squares {
//     using fields = tandem::sample_fields<float, std::int64_t>;       // x, y
//     std::size_t size() const { return 100; }
//     std::array<std::size_t, 2> field_numel() const { return {1, 1}; }  // per sample
//     void read(std::size_t i, std::span<float> x, std::span<std::int64_t> y) const {
//       x[0] = float(i); y[0] = std::int64_t(i * i);
//     }
//   };
//   static_assert(tandem::Dataset<Squares>);
// Needs: the standard library.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <span>
#include <tuple>

#include "tandem/tensor/dtype.hpp"

namespace tandem {

/// The element types of a sample's fields, in order (`sample_fields<float, std::int64_t>`).
template <class... T>
struct sample_fields {
  static constexpr std::size_t count = sizeof...(T);  ///< the number of fields
  using types = std::tuple<T...>;  ///< the element types as a tuple, for std::tuple_element_t
};

namespace detail {
template <class D, class Fields>
inline constexpr bool reads_fields = false;
template <class D, class... T>
inline constexpr bool reads_fields<D, sample_fields<T...>> = sizeof...(T) > 0 &&
                                                             (element_type<T> && ...) &&
                                                             requires(const D& dataset,
                                                                      std::size_t index,
                                                                      std::span<T>... out) {
  dataset.read(index, out...);
};
}  // namespace detail

/// A data set a Loader can read:
/// 1. `D::fields` is a `tandem::sample_fields<T...>` of tandem element types;
/// 2. `d.size()` is the number of samples;
/// 3. `d.field_numel()` gives, per field, the elements one sample holds (a std::array);
/// 4. `d.read(i, std::span<T>... out)` writes sample i's fields into `out`, one span per field of
///    exactly field_numel() elements; it may be called from several threads at once.
/// A data set may also offer `d.prefetch(i)`, a hint that sample i will be read soon (a Loader
/// gives it four samples ahead, within a batch), to start fetching it from memory or storage.
template <class D>
concept Dataset = requires(const D& dataset) {
  typename D::fields;
  { dataset.size() } -> std::convertible_to<std::size_t>;
  { dataset.field_numel() } -> std::convertible_to<std::array<std::size_t, D::fields::count>>;
}
&&detail::reads_fields<D, typename D::fields>;

/// Whether D takes prefetch hints (`d.prefetch(i)`).
template <class D>
concept prefetching_dataset = requires(const D& dataset, std::size_t index) {
  dataset.prefetch(index);
};

/// The element type of field K of data set D.
template <Dataset D, std::size_t K>
using field_type = std::tuple_element_t<K, typename D::fields::types>;

}  // namespace tandem
