// tandem/data/loader.hpp - tandem::Loader, PyTorch's DataLoader for a Dataset and a range of
// batches of indices: worker threads gather batches ahead into reused contiguous buffers and
// deliver them in order, whatever the number of workers.
//   tandem::Loader loader(train, sampler | tandem::views::batches(64), {.workers = 2});
//   for (int epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);
//     for (const auto& batch : loader) {
//       auto [images, labels] = batch.views();   // View<float>{64, 784}, View<std::int64_t>{64, 1}
//     }
//   }
// Needs: the standard library. Batches delivered to the GPU (pinned staging, copies on the
// loader's own stream) need tandem/data/cuda_delivery.hpp in a .cu file.
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <iterator>
#include <limits>
#include <mutex>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/data/dataset.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// How a Loader works: PyTorch's num_workers and prefetch.
struct LoaderOptions {
  int workers = 2;   ///< threads gathering batches; 0 gathers on the consumer's thread
  int prefetch = 0;  ///< batches in flight at most; 0 means 2 per worker (PyTorch's default)
};

/// Where a Loader delivers batches, and how they get there. A delivery names the space batches
/// are gathered in (`staging_space`) and the space the consumer receives them in
/// (`memory_space`); when the two differ it moves each batch between them:
/// 1. `make_slot()` gives the per-buffer state (events, say) of one slot of the prefetch ring;
/// 2. `before_gather(slot)` (worker thread) returns once the slot's staging memory may be
///    overwritten: its previous upload has finished reading it;
/// 3. `upload(slot, to, from, bytes)` (worker thread) starts a copy from staging to the
///    consumer's space that waits for the consumer to be done with the slot's last batch;
///    `uploaded(slot)` follows a batch's uploads;
/// 4. `hand_over(slot)` (consumer thread) orders the consumer's work after the uploads, and
///    `release(slot)` marks the point after which the consumer no longer reads the batch;
/// 5. `synchronize()` waits for every upload started.
template <class D>
concept BatchDelivery = memory_space<typename D::staging_space> &&
    memory_space<typename D::memory_space> &&
    requires(D& delivery, typename D::slot& slot, void* to, const void* from, std::size_t bytes) {
  { delivery.make_slot() } -> std::same_as<typename D::slot>;
  delivery.before_gather(slot);
  delivery.upload(slot, to, from, bytes);
  delivery.uploaded(slot);
  delivery.hand_over(slot);
  delivery.release(slot);
  delivery.synchronize();
};

/// Batches gathered in, and delivered from, one memory space: no copy after the gather.
template <memory_space Space>
struct in_place_delivery {
  using staging_space = Space;  ///< where batches are gathered
  using memory_space = Space;   ///< and where the consumer reads them
  struct slot {};               ///< no per-slot state
  /// @cond TANDEM_DELIVERY_PROTOCOL
  slot make_slot() const noexcept { return {}; }
  void before_gather(slot&) const noexcept {}
  void upload(slot&, void*, const void*, std::size_t) const noexcept {}
  void uploaded(slot&) const noexcept {}
  void hand_over(slot&) const noexcept {}
  void release(slot&) const noexcept {}
  void synchronize() const noexcept {}
  /// @endcond
};
/// Batches in ordinary host memory (the default).
using host_delivery = in_place_delivery<host>;
static_assert(BatchDelivery<host_delivery>);

/// One batch as the consumer sees it: `size()` samples, each field a contiguous View of
/// size() x field_numel elements in the delivery's memory space. It stays valid until the
/// loader's iterator moves past it.
template <memory_space Space, class... T>
class Batch {
 public:
  /// The memory space the fields' data is in (host, or device with cuda_delivery).
  using memory_space = Space;

  Batch() = default;
  /// What a Loader hands out: `size` samples at `data` (one pointer per field, `numel` elements
  /// per sample each), batch number `index`, with their data-set indices at `indices`.
  Batch(std::size_t size, std::size_t index, const std::int64_t* indices, std::tuple<T*...> data,
        std::array<std::size_t, sizeof...(T)> numel) noexcept
      : size_(size), index_(index), indices_(indices), data_(data), numel_(numel) {}

  /// Samples in the batch (a short last batch has fewer than the others).
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// This batch's position in the epoch (0, 1, ...).
  [[nodiscard]] std::size_t index() const noexcept { return index_; }
  /// The data set's indices of the samples, in order (on the host).
  [[nodiscard]] std::span<const std::int64_t> indices() const noexcept { return {indices_, size_}; }

  /// Field K as a View of shape {size(), numel of one sample}.
  template <std::size_t K>
  [[nodiscard]] auto get() const {
    using Element = std::tuple_element_t<K, std::tuple<T...>>;
    return View<Element, Space>(std::get<K>(data_), Shape{static_cast<std::int64_t>(size_),
                                                          static_cast<std::int64_t>(numel_[K])});
  }
  /// Every field's View, for structured bindings: `auto [images, labels] = batch.views();`.
  [[nodiscard]] std::tuple<View<T, Space>...> views() const {
    return views_of(std::index_sequence_for<T...>{});
  }

 private:
  template <std::size_t... K>
  std::tuple<View<T, Space>...> views_of(std::index_sequence<K...>) const {
    return {get<K>()...};
  }

  std::size_t size_ = 0;
  std::size_t index_ = 0;
  const std::int64_t* indices_ = nullptr;
  std::tuple<T*...> data_{};
  std::array<std::size_t, sizeof...(T)> numel_{};
};

namespace detail {
template <class Space, class Fields>
struct batch_for;
template <class Space, class... T>
struct batch_for<Space, sample_fields<T...>> {
  using type = Batch<Space, T...>;
  template <class S>
  using buffers = std::tuple<Buffer<T, S>...>;
};

template <class R>
concept batch_of_indices = std::ranges::sized_range<R> && std::ranges::input_range<R> &&
    std::integral<std::ranges::range_value_t<R>>;
}  // namespace detail

/// Reads batches of a Dataset in the order a range of batches gives (typically
/// `sampler | views::batches(b)`), gathering ahead on `workers` threads into a ring of
/// `prefetch` reused buffers. Iterating it runs one epoch; iterating again runs the next, and
/// sees the sampler's new epoch. Batches arrive in order whatever the number of workers.
/// Stopping early (leaving the loop, or destroying the Loader) ends the workers cleanly. An
/// exception thrown by the data set on a worker is rethrown on the consumer's thread at the
/// batch where it happened (earlier batches are delivered first).
/// The data set must outlive the Loader; so must a sampler it refers to.
template <Dataset D, class Batches, class Delivery = host_delivery>
class Loader {
  static_assert(std::ranges::random_access_range<const Batches> &&
                    std::ranges::sized_range<const Batches>,
                "tandem::Loader: the batches must be a sized random-access range (workers take "
                "batch k directly), such as sampler | tandem::views::batches(b)");
  static_assert(detail::batch_of_indices<std::ranges::range_reference_t<const Batches>>,
                "tandem::Loader: each batch must be a sized range of integer sample indices");
  static_assert(BatchDelivery<Delivery>, "tandem::Loader: Delivery must model BatchDelivery");

  using fields = typename D::fields;
  using staging_space = typename Delivery::staging_space;
  using delivery_space = typename Delivery::memory_space;
  static constexpr bool staged = !std::same_as<staging_space, delivery_space>;
  static constexpr std::size_t field_count = fields::count;

 public:
  /// What iterating yields: a Batch of the data set's fields in the delivery's memory space.
  using batch_type = typename detail::batch_for<delivery_space, fields>::type;
  class iterator;

  /// Reads `dataset` in the order of `batches`, as `options` say, delivering through `delivery`.
  /// Nothing starts before begin(). tandem::Error for negative workers or prefetch.
  Loader(const D& dataset, Batches batches, LoaderOptions options = {}, Delivery delivery = {})
      : dataset_(&dataset),
        batches_(std::move(batches)),
        options_(options),
        delivery_(std::move(delivery)) {
    if (options_.workers < 0) {
      throw Error("Loader", "workers = " + std::to_string(options_.workers) + " is negative");
    }
    if (options_.prefetch < 0) {
      throw Error("Loader", "prefetch = " + std::to_string(options_.prefetch) + " is negative");
    }
    if (options_.prefetch == 0) options_.prefetch = std::max(2, 2 * options_.workers);
    if (options_.workers == 0) options_.prefetch = 1;
    const auto numel = dataset.field_numel();
    std::copy(numel.begin(), numel.end(), numel_.begin());
  }
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;
  ~Loader() { finish_epoch(); }

  /// Batches per epoch.
  [[nodiscard]] std::size_t size() const {
    return static_cast<std::size_t>(std::ranges::size(batches_));
  }
  /// The options in effect, defaults resolved (prefetch 0 replaced by its actual depth).
  [[nodiscard]] const LoaderOptions& options() const noexcept { return options_; }
  /// The delivery, for its streams (cuda_delivery::copy_stream(), say).
  [[nodiscard]] Delivery& delivery() noexcept { return delivery_; }

  /// Starts an epoch (ending one still running) and returns its first position.
  iterator begin() {
    const std::size_t first = std::exchange(resume_at_, 0);
    start_epoch(first);
    return iterator(this, first);
  }

  /// The next epoch (the next begin()) starts at batch `batch` instead of 0, once: how a run
  /// resumed from a checkpoint skips the batches of its epoch that were already trained on.
  /// Batch indices stay those of the whole epoch.
  void resume_at(std::size_t batch) { resume_at_ = batch; }
  /// The end of the epoch: the iterator compares equal to it after the last batch.
  std::default_sentinel_t end() const noexcept { return {}; }

  /// Ends the epoch in progress, if any: the workers stop after the batch each is gathering.
  void finish_epoch() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    worker_wake_.notify_all();
    for (auto& thread : threads_) thread.join();
    threads_.clear();
    if (handed_) {
      delivery_.release(slots_[*handed_ % slots_.size()].transfer);
      handed_.reset();
    }
    delivery_.synchronize();
    for (auto& slot : slots_) {
      slot.ready = false;
      slot.error = nullptr;
    }
  }

 private:
  using staging_buffers =
      typename detail::batch_for<delivery_space, fields>::template buffers<staging_space>;
  using delivery_buffers =
      typename detail::batch_for<delivery_space, fields>::template buffers<delivery_space>;
  static constexpr std::size_t no_batch = std::numeric_limits<std::size_t>::max();

  struct Slot {
    staging_buffers staging;
    std::conditional_t<staged, delivery_buffers, std::tuple<>> delivered;
    std::vector<std::int64_t> indices;
    std::size_t capacity = 0;  // samples the buffers hold
    std::size_t count = 0;     // samples of the batch in it
    std::size_t batch = no_batch;
    bool ready = false;
    std::exception_ptr error;
    typename Delivery::slot transfer;
  };

  void start_epoch(std::size_t first_batch) {
    finish_epoch();
    num_batches_ = size();
    std::size_t largest = 0;
    const auto first = std::ranges::begin(batches_);
    for (std::size_t b = 0; b < num_batches_; ++b) {
      largest = std::max(largest, static_cast<std::size_t>(
                                      std::ranges::size(first[static_cast<std::ptrdiff_t>(b)])));
    }
    const auto depth = static_cast<std::size_t>(options_.prefetch);
    if (slots_.size() != depth) {
      slots_.clear();
      slots_.resize(depth);
      for (auto& slot : slots_) slot.transfer = delivery_.make_slot();
    }
    for (auto& slot : slots_) {
      if (slot.capacity < largest) allocate(slot, largest);
      slot.batch = no_batch;
      slot.ready = false;
      slot.error = nullptr;
    }
    if (first_batch > num_batches_) {
      throw Error("Loader::resume_at", "batch " + std::to_string(first_batch) + " of an epoch of " +
                                           std::to_string(num_batches_) + " batches");
    }
    next_claim_ = first_batch;
    released_ = first_batch;
    stopping_ = false;
    for (int w = 0; w < options_.workers; ++w) threads_.emplace_back([this] { work(); });
  }

  void allocate(Slot& slot, std::size_t capacity) {
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      ((std::get<K>(slot.staging) = std::tuple_element_t<K, staging_buffers>(capacity * numel_[K])),
       ...);
      if constexpr (staged) {
        ((std::get<K>(slot.delivered) =
              std::tuple_element_t<K, delivery_buffers>(capacity * numel_[K])),
         ...);
      }
    }
    (std::make_index_sequence<field_count>{});
    slot.indices.assign(capacity, 0);
    slot.capacity = capacity;
  }

  void work() {
    const std::size_t depth = slots_.size();
    for (;;) {
      std::size_t b = 0;
      {
        std::unique_lock lock(mutex_);
        if (stopping_ || next_claim_ >= num_batches_) return;
        b = next_claim_++;
        // Batch b goes where batch b - depth was: wait until the consumer is done with it.
        worker_wake_.wait(lock, [&] { return stopping_ || b < released_ + depth; });
        if (stopping_) return;
      }
      Slot& slot = slots_[b % depth];
      fill(slot, b);
      {
        std::lock_guard lock(mutex_);
        slot.batch = b;
        slot.ready = true;
      }
      consumer_wake_.notify_all();
    }
  }

  // Gathers batch b into the slot's staging buffers and starts its uploads. An exception is
  // kept in the slot, for the consumer to rethrow when it reaches batch b.
  void fill(Slot& slot, std::size_t b) noexcept {
    try {
      const auto batch = std::ranges::begin(batches_)[static_cast<std::ptrdiff_t>(b)];
      const std::size_t count = static_cast<std::size_t>(std::ranges::size(batch));
      delivery_.before_gather(slot.transfer);
      std::size_t j = 0;
      if constexpr (prefetching_dataset<D>) {
        // Hints run a few samples ahead of the reads: about one memory latency's worth.
        constexpr std::size_t distance = 4;
        auto ahead = std::ranges::begin(batch);
        const auto last = std::ranges::end(batch);
        for (std::size_t k = 0; k < distance && ahead != last; ++k, ++ahead) {
          dataset_->prefetch(static_cast<std::size_t>(*ahead));
        }
        for (auto index : batch) {
          if (ahead != last) dataset_->prefetch(static_cast<std::size_t>(*ahead++));
          gather_one(slot, b, index, j++);
        }
      } else {
        for (auto index : batch) gather_one(slot, b, index, j++);
      }
      slot.count = count;
      if constexpr (staged) {
        [&]<std::size_t... K>(std::index_sequence<K...>) {
          (delivery_.upload(
               slot.transfer, std::get<K>(slot.delivered).data(), std::get<K>(slot.staging).data(),
               count * numel_[K] * sizeof(std::tuple_element_t<K, typename fields::types>)),
           ...);
        }
        (std::make_index_sequence<field_count>{});
        delivery_.uploaded(slot.transfer);
      }
      slot.error = nullptr;
    } catch (...) {
      slot.error = std::current_exception();
    }
  }

  // Sample `index` of batch b into row j of the slot.
  template <class Index>
  void gather_one(Slot& slot, std::size_t b, Index index, std::size_t j) const {
    bool negative = false;
    if constexpr (std::is_signed_v<Index>) negative = index < 0;
    if (negative || static_cast<std::size_t>(index) >= dataset_->size()) {
      throw Error("Loader", "batch " + std::to_string(b) + " asks for sample " +
                                std::to_string(index) + " of a data set of " +
                                std::to_string(dataset_->size()));
    }
    slot.indices[j] = static_cast<std::int64_t>(index);
    read_sample(slot, static_cast<std::size_t>(index), j);
  }

  void read_sample(Slot& slot, std::size_t index, std::size_t j) const {
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      dataset_->read(index, std::span<std::tuple_element_t<K, typename fields::types>>(
                                std::get<K>(slot.staging).data() + j * numel_[K], numel_[K])...);
    }
    (std::make_index_sequence<field_count>{});
  }

  // The consumer's side: batch b, waited for (or gathered here with no workers) and handed over.
  const batch_type& acquire(std::size_t b) {
    if (handed_ == b) return current_;
    Slot& slot = slots_[b % slots_.size()];
    if (threads_.empty()) {
      fill(slot, b);
      slot.batch = b;
      slot.ready = true;
    } else {
      std::unique_lock lock(mutex_);
      consumer_wake_.wait(lock, [&] { return slot.ready && slot.batch == b; });
    }
    if (slot.error) std::rethrow_exception(slot.error);
    delivery_.hand_over(slot.transfer);
    handed_ = b;
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      if constexpr (staged) {
        current_ = batch_type(slot.count, b, slot.indices.data(),
                              {std::get<K>(slot.delivered).data()...}, numel_);
      } else {
        current_ = batch_type(slot.count, b, slot.indices.data(),
                              {std::get<K>(slot.staging).data()...}, numel_);
      }
    }
    (std::make_index_sequence<field_count>{});
    return current_;
  }

  void release(std::size_t b) {
    acquire(b);  // a batch skipped without a look is still waited for, and its error raised
    Slot& slot = slots_[b % slots_.size()];
    delivery_.release(slot.transfer);
    handed_.reset();
    {
      std::lock_guard lock(mutex_);
      slot.ready = false;
      released_ = b + 1;
    }
    worker_wake_.notify_all();
  }

  const D* dataset_;
  Batches batches_;
  LoaderOptions options_;
  Delivery delivery_;
  std::array<std::size_t, field_count> numel_{};

  std::vector<Slot> slots_;
  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable worker_wake_;
  std::condition_variable consumer_wake_;
  std::size_t num_batches_ = 0;
  std::size_t next_claim_ = 0;
  std::size_t released_ = 0;
  std::size_t resume_at_ = 0;
  bool stopping_ = false;
  std::optional<std::size_t> handed_;
  batch_type current_;
};

/// The position in a Loader's epoch: dereferencing waits for the batch; moving on hands its
/// buffers back to the workers. A single-pass input iterator.
template <Dataset D, class Batches, class Delivery>
class Loader<D, Batches, Delivery>::iterator {
 public:
  // The standard input iterator protocol, left out of the API reference.
  /// @cond TANDEM_ITERATOR_PROTOCOL
  using value_type = batch_type;
  using difference_type = std::ptrdiff_t;

  iterator() = default;
  const batch_type& operator*() const { return loader_->acquire(position_); }
  const batch_type* operator->() const { return &**this; }
  iterator& operator++() {
    loader_->release(position_++);
    return *this;
  }
  void operator++(int) { ++*this; }
  friend bool operator==(const iterator& it, std::default_sentinel_t) noexcept {
    return it.at_end();
  }
  /// @endcond

 private:
  friend class Loader;
  iterator(Loader* loader, std::size_t position) noexcept : loader_(loader), position_(position) {}
  [[nodiscard]] bool at_end() const noexcept { return position_ >= loader_->num_batches_; }

  Loader* loader_ = nullptr;
  std::size_t position_ = 0;
};

/// Keeps the batches as std::views::all would: a view (`sampler | views::batches(b)`) by
/// value, a container by reference (or owned, when moved in).
template <Dataset D, class B>
Loader(const D&, B&&) -> Loader<D, std::views::all_t<B>>;
/// The same, with options.
template <Dataset D, class B>
Loader(const D&, B&&, LoaderOptions) -> Loader<D, std::views::all_t<B>>;
/// The same, with options and a delivery (cuda_delivery, say).
template <Dataset D, class B, class Delivery>
Loader(const D&, B&&, LoaderOptions, Delivery) -> Loader<D, std::views::all_t<B>, Delivery>;

}  // namespace tandem
