// tandem/torch/state_dict.hpp - a libtorch module's state_dict in tandem's checkpoints: the model
// part of a TrainingState gets the module's named_parameters() and named_buffers() keys
// (PyTorch's state_dict keys), every buffer included (BatchNorm's int64 num_batches_tracked), so
// Python loads a model-only file with model.load_state_dict(safetensors.torch.load_file(f)).
//   tandem::TrainingState state;                               // tandem/io/checkpoint.hpp
//   tandem::torch::model(state, ddp).optimizer(opt).ema(ema, ddp.parameters());
//   tandem::save_checkpoint(comm, dir, step, state);           // and load_checkpoint to resume
// Needs: libtorch; a TrainingState (the tandem::io CMake component) to register with.
//
// Why an adapter: TrainingState::model(arena) writes the arena's one element type, and the arena
// holds each tensor once. A module's state_dict also has tensors of other dtypes (the module's
// own non-float32 buffers) and the second names of tied parameters. DistributedDataParallel keeps
// those as NamedTensors, one set per element type; model() registers the arena and each set that
// is not empty as model parts, so every key is in the file once, with its own dtype.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "tandem/core/error.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"
#include "tandem/torch/tensor.hpp"

namespace tandem::torch {

/// Named tensors of element type T in memory space Space (host for a CPU module, device for a
/// CUDA one), read the way TrainingState::model() reads an arena: none of them a trained
/// parameter, all of them buffers(). Each entry finds its elements when it is read, so it follows
/// storage that moved since it was registered.
template <element_type T, memory_space Space = host>
class NamedTensors {
 public:
  /// One tensor: its state_dict key, its sizes, and a way to its elements now.
  class Entry {
   public:
    /// `value` gives the elements when the entry is read.
    Entry(std::string name, std::vector<std::int64_t> shape, std::function<View<T, Space>()> value)
        : name_(std::move(name)), shape_(std::move(shape)), value_(std::move(value)) {}
    /// The state_dict key.
    [[nodiscard]] const std::string& name() const noexcept { return name_; }
    /// The sizes, outermost first.
    [[nodiscard]] const std::vector<std::int64_t>& shape() const noexcept { return shape_; }
    /// The elements, where they are now.
    [[nodiscard]] View<T, Space> value() const { return value_(); }

   private:
    std::string name_;
    std::vector<std::int64_t> shape_;
    std::function<View<T, Space>()> value_;
  };

  /// Adds a tensor under `name`.
  void add(std::string name, std::vector<std::int64_t> shape,
           std::function<View<T, Space>()> value) {
    entries_.emplace_back(std::move(name), std::move(shape), std::move(value));
  }
  /// Whether it holds no tensor.
  [[nodiscard]] bool empty() const noexcept { return entries_.empty(); }
  /// No trained parameters: begin() == end() (TrainingState::model() walks them first).
  [[nodiscard]] auto begin() noexcept { return entries_.end(); }
  /// See begin().
  [[nodiscard]] auto end() noexcept { return entries_.end(); }
  /// Every tensor, in the order added.
  [[nodiscard]] std::vector<Entry>& buffers() noexcept { return entries_; }
  /// The same, read-only.
  [[nodiscard]] const std::vector<Entry>& buffers() const noexcept { return entries_; }

 private:
  std::vector<Entry> entries_;
};

/// The tensors of a module's state_dict that a float32 arena does not hold, one NamedTensors per
/// element type tandem moves, and the names of those of a dtype it does not (bool, int8, ...).
/// Space is where the module's tensors live: host (CPU tensors) or device (CUDA tensors, read and
/// written by checkpoints through the CUDA copies of tandem/cuda.hpp).
template <memory_space Space = host>
class NamedTensorSets {
 public:
  /// The memory space of every tensor in the sets.
  using memory_space = Space;

  /// The set of element type T.
  template <element_type T>
  [[nodiscard]] NamedTensors<T, Space>& of() noexcept {
    return std::get<NamedTensors<T, Space>>(sets_);
  }

  /// Adds the module's own tensor `t` under `name`, to the set of its dtype; one of a dtype
  /// tandem does not move is remembered (see require_supported()).
  void add(const std::string& name, const at::Tensor& t) {
    const auto sizes = t.sizes();
    std::vector<std::int64_t> shape(sizes.begin(), sizes.end());
    switch (t.scalar_type()) {
      case c10::ScalarType::Float:
        return add_as<float>(name, std::move(shape), t);
      case c10::ScalarType::Double:
        return add_as<double>(name, std::move(shape), t);
      case c10::ScalarType::Half:
        return add_as<half>(name, std::move(shape), t);
      case c10::ScalarType::BFloat16:
        return add_as<bfloat16>(name, std::move(shape), t);
      case c10::ScalarType::Int:
        return add_as<std::int32_t>(name, std::move(shape), t);
      case c10::ScalarType::Long:
        return add_as<std::int64_t>(name, std::move(shape), t);
      case c10::ScalarType::Byte:
        return add_as<std::uint8_t>(name, std::move(shape), t);
      default:
        unsupported_.push_back("'" + name + "' (" + dtype_name(t.scalar_type()) + ")");
    }
  }

  /// An Error naming `operation` and every tensor of a dtype tandem's checkpoints cannot hold.
  void require_supported(const char* operation, int rank = unknown_rank) const {
    if (unsupported_.empty()) return;
    std::string names;
    for (const auto& name : unsupported_) names += (names.empty() ? "" : ", ") + name;
    throw Error(rank, operation,
                "the module's state_dict holds " + names +
                    ", of a dtype tandem's checkpoints do not hold (Float, Double, Half, "
                    "BFloat16, Int, Long, Byte); convert the buffer or keep it out of the module");
  }

  /// f(set) for each element type's set, in a fixed order.
  template <class F>
  void for_each(F&& f) {
    std::apply([&](auto&... set) { (f(set), ...); }, sets_);
  }

 private:
  template <element_type T>
  void add_as(const std::string& name, std::vector<std::int64_t> shape, const at::Tensor& t) {
    of<T>().add(name, std::move(shape),
                [t, name] { return view<T, Space>(t, ("checkpoint of '" + name + "'").c_str()); });
  }

  std::tuple<NamedTensors<float, Space>, NamedTensors<double, Space>, NamedTensors<half, Space>,
             NamedTensors<bfloat16, Space>, NamedTensors<std::int32_t, Space>,
             NamedTensors<std::int64_t, Space>, NamedTensors<std::uint8_t, Space>>
      sets_;
  std::vector<std::string> unsupported_;
};

/// Registers `ddp`'s module with `state` (a tandem::TrainingState) as its model: the arena's
/// parameters and float32 buffers (its active values: EMA's while they are applied) and every
/// other state_dict tensor, each under the module's key with `prefix` before it ("module." gives
/// the keys of a DDP-wrapped PyTorch module; loading accepts files with or without it). Returns
/// `state`, to go on registering. An Error when the module holds a buffer of a dtype the file
/// cannot hold. `ddp` must outlive `state`.
template <class State, class Ddp>
requires requires(State& state, Ddp& ddp, std::string prefix) {
  state.model(ddp.parameters(), prefix);
  { ddp.tensors_outside_arena() } -> std::same_as<NamedTensorSets<typename Ddp::arena_space>&>;
}
State& model(State& state, Ddp& ddp, std::string prefix = "") {
  auto& outside = ddp.tensors_outside_arena();
  outside.require_supported("torch::model (checkpoint)", ddp.comm().rank());
  state.model(ddp.parameters(), prefix);
  outside.for_each([&](auto& set) {
    if (!set.empty()) state.model(set, prefix);
  });
  return state;
}

}  // namespace tandem::torch
