// tandem/arena/parameters.hpp - tandem::Parameters, a model's flat arena: every trained parameter,
// its gradient and every buffer (running statistics) are named views into three contiguous blocks.
//   tandem::Parameters<float> p; auto& w = p.add("fc.weight", {4, 3}); p.finalize(); w.grad()[0];
// Needs: the standard library; device storage needs tandem/cuda.hpp in a .cu file.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <ranges>
#include <string>
#include <string_view>
#include <utility>

#include "tandem/core/config.hpp"
#include "tandem/core/error.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// What a non-trained buffer holds. integral buffers (counters such as num_batches_tracked) keep
/// whole numbers in T: code that blends buffers (EMA) copies them instead of averaging.
enum class BufferKind : std::uint8_t { floating, integral };

/// The kind's name ("floating" or "integral"), for messages.
constexpr const char* name(BufferKind kind) noexcept {
  return kind == BufferKind::integral ? "integral" : "floating";
}

namespace detail {

/// Writes T{} (zero) over data[0, n). A struct, not a lambda, so that it runs on devices too.
template <class T>
struct fill_zero {
  T* data;
  TANDEM_HD void operator()(std::size_t i) const { data[i] = T{}; }
};

}  // namespace detail

/// A flat arena of parameters of element type T in memory space Space. Register with add() and
/// add_buffer(), then finalize() allocates one value block and one gradient block for the trained
/// parameters (in registration order) and one block for the buffers. Host storage starts zeroed;
/// device storage starts zeroed when finalized with an executor (finalize(exec)).
/// Parameter references stay valid for the arena's life, across finalize() and moves of the arena.
template <element_type T, memory_space Space = host>
class Parameters {
  static_assert(dtype_traits<T>::is_floating,
                "tandem: Parameters hold float, double, tandem::half or tandem::bfloat16");

  struct Storage;
  struct Key {
    explicit Key() = default;
  };

 public:
  /// The element type of every parameter, gradient and buffer.
  using value_type = T;
  /// The memory space of the flat storage (host, or a device space).
  using memory_space = Space;

  /// One named parameter or buffer: its shape and where it lies in the arena's flat storage.
  class Parameter {
   public:
    /// The name it was registered with.
    [[nodiscard]] const std::string& name() const noexcept { return name_; }
    /// Its shape.
    [[nodiscard]] const Shape& shape() const noexcept { return shape_; }
    /// Elements from the start of the flat storage of its kind (values()/grads() for trained
    /// parameters, buffer_values() for buffers).
    [[nodiscard]] std::size_t offset() const noexcept { return offset_; }
    /// Number of elements.
    [[nodiscard]] std::size_t size() const noexcept { return shape_.numel(); }
    /// Registration index among parameters of its kind (trained or buffer).
    [[nodiscard]] std::size_t index() const noexcept { return index_; }
    /// True for a non-trained buffer (running statistics and counters), false for a trained
    /// parameter.
    [[nodiscard]] bool is_buffer() const noexcept { return is_buffer_; }
    /// The buffer's kind; floating for trained parameters.
    [[nodiscard]] BufferKind kind() const noexcept { return kind_; }

    /// Its values, shaped. An Error before finalize().
    [[nodiscard]] View<T, Space> value() const {
      require_finalized("value");
      T* base = is_buffer_ ? storage_->buffers.data() : storage_->values.data();
      return View<T, Space>(base + offset_, shape_);
    }

    /// Its gradient, shaped: a slice of the flat gradient block. An Error for buffers and
    /// before finalize().
    [[nodiscard]] View<T, Space> grad() const {
      if (is_buffer_) {
        throw Error("Parameter::grad", "'" + name_ + "' is a buffer; buffers have no gradient");
      }
      require_finalized("grad");
      storage_->grads_viewed.store(true, std::memory_order_relaxed);
      return View<T, Space>(storage_->grad_data() + offset_, shape_);
    }

    /// Only Parameters makes entries (the key is private to it); public so that the arena's
    /// deque can construct them in place.
    Parameter(typename Parameters::Key, Storage* storage, std::string name, Shape shape,
              std::size_t offset, std::size_t index, bool is_buffer, BufferKind kind)
        : storage_(storage),
          name_(std::move(name)),
          shape_(shape),
          offset_(offset),
          index_(index),
          is_buffer_(is_buffer),
          kind_(kind) {}

   private:
    void require_finalized(const char* what) const {
      if (!storage_->finalized) {
        throw Error(std::string("Parameter::") + what,
                    "'" + name_ + "' has no storage before Parameters::finalize()");
      }
    }

    Storage* storage_;
    std::string name_;
    Shape shape_;
    std::size_t offset_;
    std::size_t index_;
    bool is_buffer_;
    BufferKind kind_;
  };

  Parameters() : storage_(std::make_unique<Storage>()) {}
  /// Moves the arena; views into it stay valid (the storage does not move).
  Parameters(Parameters&&) noexcept = default;
  /// Moves the arena; views into it stay valid (the storage does not move).
  Parameters& operator=(Parameters&&) noexcept = default;
  Parameters(const Parameters&) = delete;
  Parameters& operator=(const Parameters&) = delete;
  ~Parameters() = default;

  /// Registers a trained parameter. An Error after finalize() or for a name already used.
  Parameter& add(std::string name, Shape shape) {
    check_can_add("Parameters::add", name);
    auto& entry = storage_->trained.emplace_back(Key{}, storage_.get(), std::move(name), shape,
                                                 storage_->trained_numel, storage_->trained.size(),
                                                 false, BufferKind::floating);
    storage_->trained_numel += entry.size();
    storage_->by_name.emplace(entry.name(), &entry);
    return entry;
  }

  /// Registers a non-trained buffer (running statistics, counters). Same rules as add().
  Parameter& add_buffer(std::string name, Shape shape, BufferKind kind = BufferKind::floating) {
    check_can_add("Parameters::add_buffer", name);
    auto& entry = storage_->buffer_entries.emplace_back(
        Key{}, storage_.get(), std::move(name), shape, storage_->buffer_numel,
        storage_->buffer_entries.size(), true, kind);
    storage_->buffer_numel += entry.size();
    storage_->by_name.emplace(entry.name(), &entry);
    return entry;
  }

  /// Allocates the value, gradient and buffer blocks (host storage zeroed). An Error if called
  /// twice.
  void finalize() {
    if (storage_->finalized) throw Error("Parameters::finalize", "already finalized");
    storage_->values = Buffer<T, Space>(storage_->trained_numel);
    storage_->grads = Buffer<T, Space>(storage_->trained_numel);
    storage_->buffers = Buffer<T, Space>(storage_->buffer_numel);
    storage_->finalized = true;
  }

  /// Exchanges the trained values with `other`, which must hold numel() elements: O(1), no copy.
  /// This is how EMA shows its averaged weights through the arena (apply_shadow / restore);
  /// every Parameter's value() follows, but Views taken before the swap keep the old storage.
  void swap_values(Buffer<T, Space>& other) {
    swap_block("Parameters::swap_values", storage_->values, other);
  }
  /// The same for the buffers (buffer_numel() elements).
  void swap_buffer_values(Buffer<T, Space>& other) {
    swap_block("Parameters::swap_buffer_values", storage_->buffers, other);
  }

  /// finalize(), then zero every block on exec: the way device storage starts from zero.
  template <Executor E>
  requires ExecutorFor<E, Space>
  void finalize(const E& exec) {
    finalize();
    zero(exec, storage_->values.data(), storage_->values.size());
    zero(exec, storage_->grads.data(), storage_->grads.size());
    zero(exec, storage_->buffers.data(), storage_->buffers.size());
    exec.synchronize();
  }

  /// True once finalize() has allocated the flat storage; nothing can be registered after that.
  [[nodiscard]] bool finalized() const noexcept { return storage_->finalized; }

  /// Every trained value, in registration order (numel() elements).
  [[nodiscard]] View<T, Space> values() { return block("values", storage_->values); }
  /// Every gradient, in registration order (numel() elements); a DDP bucket is a slice of it.
  [[nodiscard]] View<T, Space> grads() {
    if (!storage_->finalized) throw Error("Parameters::grads", "no storage before finalize()");
    storage_->grads_viewed.store(true, std::memory_order_relaxed);
    return View<T, Space>(storage_->grad_data(), storage_->trained_numel);
  }

  /// Whether a view of the gradients has been handed out (grads(), a Parameter's grad()): from
  /// then on the gradient block stays where it is (move_grads).
  [[nodiscard]] bool grads_viewed() const noexcept {
    return storage_->grads_viewed.load(std::memory_order_relaxed);
  }

  /// Moves the gradient block into `memory` (numel() elements of host-accessible memory, kept
  /// alive by `keep` for the arena's life), copying the gradients there - where no view of them
  /// has been handed out yet (grads_viewed()), since one taken before would go on pointing at the
  /// old block. Returns whether it moved them. This is how DistributedDataParallel puts the
  /// gradients where its communicator reduces them without copying them in (SharedMemoryComm:
  /// ShmComm's shared memory). An Error before finalize() and for a null `memory`.
  bool move_grads(T* memory, std::shared_ptr<void> keep) requires host_accessible<Space> {
    if (!storage_->finalized) throw Error("Parameters::move_grads", "no storage before finalize()");
    if (!memory) throw Error("Parameters::move_grads", "no memory given");
    if (grads_viewed()) return false;
    if (storage_->trained_numel) {
      std::memcpy(static_cast<void*>(memory), storage_->grad_data(),
                  storage_->trained_numel * sizeof(T));
    }
    storage_->grads_home = std::move(keep);
    storage_->grads_elsewhere = memory;
    storage_->grads = Buffer<T, Space>();  // the old block is freed
    return true;
  }
  /// Every buffer value, in registration order (buffer_numel() elements).
  [[nodiscard]] View<T, Space> buffer_values() { return block("buffer_values", storage_->buffers); }

  /// Trained elements: the size of values() and grads().
  [[nodiscard]] std::size_t numel() const noexcept { return storage_->trained_numel; }
  /// Number of trained parameters.
  [[nodiscard]] std::size_t size() const noexcept { return storage_->trained.size(); }
  /// Buffer elements: the size of buffer_values().
  [[nodiscard]] std::size_t buffer_numel() const noexcept { return storage_->buffer_numel; }
  /// Number of buffers.
  [[nodiscard]] std::size_t buffer_count() const noexcept {
    return storage_->buffer_entries.size();
  }

  /// The parameter or buffer called `name`; an Error naming it when there is none.
  [[nodiscard]] Parameter& operator[](std::string_view name) { return lookup(name); }
  /// The same, read-only.
  [[nodiscard]] const Parameter& operator[](std::string_view name) const { return lookup(name); }

  /// The parameter or buffer called `name`, or nullptr.
  [[nodiscard]] Parameter* find(std::string_view name) noexcept {
    auto it = storage_->by_name.find(name);
    return it == storage_->by_name.end() ? nullptr : it->second;
  }
  /// The same, read-only.
  [[nodiscard]] const Parameter* find(std::string_view name) const noexcept {
    auto it = storage_->by_name.find(name);
    return it == storage_->by_name.end() ? nullptr : it->second;
  }

  /// Trained parameters in registration order.
  [[nodiscard]] auto begin() noexcept { return storage_->trained.begin(); }
  /// One past the last trained parameter.
  [[nodiscard]] auto end() noexcept { return storage_->trained.end(); }
  /// Trained parameters in registration order, read-only.
  [[nodiscard]] auto begin() const noexcept { return storage_->trained.cbegin(); }
  /// One past the last trained parameter, read-only.
  [[nodiscard]] auto end() const noexcept { return storage_->trained.cend(); }

  /// Buffers in registration order.
  [[nodiscard]] auto buffers() noexcept {
    return std::ranges::subrange(storage_->buffer_entries.begin(), storage_->buffer_entries.end());
  }
  /// Buffers in registration order, read-only.
  [[nodiscard]] auto buffers() const noexcept {
    return std::ranges::subrange(storage_->buffer_entries.cbegin(),
                                 storage_->buffer_entries.cend());
  }

  /// Zeroes every gradient in one pass (host-accessible spaces).
  void zero_grad() requires host_accessible<Space> { zero_grad(on_host); }

  /// Zeroes every gradient in one pass on exec (any space); does not wait on devices.
  template <Executor E>
  requires ExecutorFor<E, Space>
  void zero_grad(const E& exec) {
    if (!storage_->finalized) {
      throw Error("Parameters::zero_grad", "no gradients before Parameters::finalize()");
    }
    zero(exec, storage_->grad_data(), storage_->trained_numel);
  }

 private:
  // std::deque keeps references to its elements valid as it grows; the Storage lives on the heap
  // so that moving the arena leaves every Parameter's back pointer valid.
  struct Storage {
    std::deque<Parameter> trained;
    std::deque<Parameter> buffer_entries;
    std::map<std::string, Parameter*, std::less<>> by_name;
    std::size_t trained_numel = 0;
    std::size_t buffer_numel = 0;
    bool finalized = false;
    Buffer<T, Space> values;
    Buffer<T, Space> grads;
    Buffer<T, Space> buffers;
    /// Where move_grads put the gradients (then `grads` is empty), and what keeps them there.
    T* grads_elsewhere = nullptr;
    std::shared_ptr<void> grads_home;
    std::atomic<bool> grads_viewed{false};

    T* grad_data() noexcept { return grads_elsewhere ? grads_elsewhere : grads.data(); }
  };

  void check_can_add(const char* operation, const std::string& name) const {
    if (storage_->finalized) {
      throw Error(operation, "cannot register '" + name + "' after Parameters::finalize()");
    }
    if (name.empty()) throw Error(operation, "a parameter needs a non-empty name");
    if (storage_->by_name.contains(name)) {
      throw Error(operation, "the name '" + name + "' is already registered");
    }
  }

  Parameter& lookup(std::string_view name) const {
    auto it = storage_->by_name.find(name);
    if (it == storage_->by_name.end()) {
      throw Error("Parameters::operator[]",
                  "no parameter or buffer is called '" + std::string(name) + "'");
    }
    return *it->second;
  }

  View<T, Space> block(const char* operation, Buffer<T, Space>& storage) {
    if (!storage_->finalized) {
      throw Error(std::string("Parameters::") + operation, "no storage before finalize()");
    }
    return View<T, Space>(storage.data(), storage.size());
  }

  void swap_block(const char* operation, Buffer<T, Space>& mine, Buffer<T, Space>& other) {
    if (!storage_->finalized) throw Error(operation, "no storage before finalize()");
    if (other.size() != mine.size()) {
      throw Error(operation, "the other buffer holds " + std::to_string(other.size()) +
                                 " elements, the arena " + std::to_string(mine.size()));
    }
    std::swap(mine, other);
  }

  template <class E>
  static void zero(const E& exec, T* data, std::size_t count) {
    for_each_index(exec, count, detail::fill_zero<T>{data});
  }

  std::unique_ptr<Storage> storage_;
};

}  // namespace tandem
