// tandem/optim/param_groups.hpp - param groups (contiguous runs of a Parameters arena, each with
// its own hyperparameters) and what SGD and AdamW share over them (their state_dict's shape is
// optim/state_dict.hpp's).
//   tandem::optim::SGD sgd(params, {{optim::params_with_prefix("layer2."), {.lr = 0.1}},
//                                   {optim::params_with_prefix("layer3."), {.lr = 0.2}}});
// Needs: the standard library, tandem/arena/parameters.hpp (the arena the groups slice).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/arena/parameters.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/error.hpp"
#include "tandem/optim/state_dict.hpp"
#include "tandem/tensor/detail/scalar_math.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/host_cpu.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::optim {

/// Trained parameters [first, last), as registration indices into a Parameters arena.
struct ParamRange {
  /// The registration index of the range's first parameter.
  std::size_t first = 0;
  /// One past the registration index of its last parameter.
  std::size_t last = 0;

  /// The number of parameters in the range.
  [[nodiscard]] std::size_t size() const noexcept { return last - first; }
  friend bool operator==(const ParamRange&, const ParamRange&) = default;
};

/// Which trained parameters form a param group. A group is always a contiguous run of the
/// arena (registration order), so its values, gradients and optimizer state are flat slices
/// that one fused pass updates. Make one with all_params(), param_range(), params_between() or
/// params_with_prefix().
class Selection {
 public:
  /// The parameters it names in `params`; an Error naming the cause when there are none, a name
  /// is unknown or a buffer, or a prefix's parameters are not contiguous.
  template <class T, class Space>
  [[nodiscard]] ParamRange resolve(const Parameters<T, Space>& params) const {
    switch (kind_) {
      case Kind::all:
        return checked({0, params.size()}, params);
      case Kind::range:
        if (first_ > last_ || last_ > params.size()) {
          throw Error("optim::param_range", "[" + std::to_string(first_) + ", " +
                                                std::to_string(last_) + ") is not a range of the " +
                                                std::to_string(params.size()) + " parameters");
        }
        return checked({first_, last_}, params);
      case Kind::between: {
        const std::size_t first = index_of(params, first_name_);
        const std::size_t last = index_of(params, last_name_);
        if (first > last) {
          throw Error("optim::params_between",
                      "'" + first_name_ + "' is registered after '" + last_name_ + "'");
        }
        return checked({first, last + 1}, params);
      }
      case Kind::prefix:
        return resolve_prefix(params);
    }
    return {};
  }

  /// What it selects, in words, for error messages.
  [[nodiscard]] std::string describe() const {
    switch (kind_) {
      case Kind::all:
        return "all parameters";
      case Kind::range:
        return "parameters [" + std::to_string(first_) + ", " + std::to_string(last_) + ")";
      case Kind::between:
        return "parameters '" + first_name_ + "' through '" + last_name_ + "'";
      case Kind::prefix:
        return "parameters named '" + first_name_ + "...'";
    }
    return {};
  }

 private:
  enum class Kind { all, range, between, prefix };

  friend Selection all_params();
  friend Selection param_range(std::size_t first, std::size_t last);
  friend Selection params_between(std::string first, std::string last);
  friend Selection params_with_prefix(std::string prefix);

  Selection(Kind kind, std::size_t first, std::size_t last, std::string first_name,
            std::string last_name)
      : kind_(kind),
        first_(first),
        last_(last),
        first_name_(std::move(first_name)),
        last_name_(std::move(last_name)) {}

  template <class T, class Space>
  ParamRange checked(ParamRange range, const Parameters<T, Space>&) const {
    if (range.first == range.last) {
      throw Error("optim::param_group", describe() + " selects no parameters");
    }
    return range;
  }

  template <class T, class Space>
  static std::size_t index_of(const Parameters<T, Space>& params, const std::string& name) {
    const auto* found = params.find(name);
    if (found == nullptr) {
      throw Error("optim::params_between", "no parameter is called '" + name + "'");
    }
    if (found->is_buffer()) {
      throw Error("optim::params_between", "'" + name + "' is a buffer; buffers are not trained");
    }
    return found->index();
  }

  template <class T, class Space>
  ParamRange resolve_prefix(const Parameters<T, Space>& params) const {
    ParamRange range{params.size(), params.size()};
    bool closed = false;  // a non-matching parameter followed the run
    for (const auto& parameter : params) {
      const bool match = std::string_view(parameter.name()).starts_with(first_name_);
      if (match && closed) {
        throw Error("optim::params_with_prefix",
                    "parameters named '" + first_name_ + "...' are not contiguous ('" +
                        parameter.name() + "' follows others); a param group is one run");
      }
      if (match && range.first == params.size()) range.first = parameter.index();
      if (match) range.last = parameter.index() + 1;
      if (!match && range.first != params.size()) closed = true;
    }
    return checked(range, params);
  }

  Kind kind_;
  std::size_t first_ = 0;
  std::size_t last_ = 0;
  std::string first_name_;
  std::string last_name_;
};

/// Every trained parameter.
inline Selection all_params() {
  return {Selection::Kind::all, 0, 0, {}, {}};
}
/// Trained parameters [first, last) by registration index.
inline Selection param_range(std::size_t first, std::size_t last) {
  return {Selection::Kind::range, first, last, {}, {}};
}
/// Trained parameters from `first` through `last` (both included), by name.
inline Selection params_between(std::string first, std::string last) {
  return {Selection::Kind::between, 0, 0, std::move(first), std::move(last)};
}
/// Every trained parameter whose name starts with `prefix` ("layer2."); they must be contiguous.
inline Selection params_with_prefix(std::string prefix) {
  return {Selection::Kind::prefix, 0, 0, std::move(prefix), {}};
}

/// One param group as the user states it: which parameters, with which hyperparameters.
template <class Options>
struct ParamGroup {
  /// Which parameters the group trains (resolved against the arena when the optimizer is made).
  Selection params;
  /// The group's hyperparameters (SGDOptions, AdamWOptions).
  Options options;
};

namespace detail {

/// to[i] = from[i]: how state moves in and out of a state_dict on any executor.
template <class T>
struct copy_elements {
  const T* from;
  T* to;
  TANDEM_HD void operator()(std::size_t i) const { to[i] = from[i]; }
};

/// value[i] = 0 for state that starts from zero (AdamW's moments).
template <class T>
struct fill_zeros {
  T* data;
  TANDEM_HD void operator()(std::size_t i) const { data[i] = T{}; }
};

// The optimizers' scalar arithmetic, rounded alike on the host and the device.
using tandem::detail::fused_multiply_add;
using tandem::detail::multiply;
using tandem::detail::square_root;

/// A checked lookup in a state_dict's option map.
inline double option(const std::map<std::string, double>& options, const std::string& key,
                     const char* operation) {
  auto found = options.find(key);
  if (found == options.end()) {
    throw Error(operation, "param_groups entry has no option '" + key + "'");
  }
  return found->second;
}

/// Runs one optimizer pass: on the host executor through the FMA clone where the CPU has FMA
/// (same results: the fused multiply-add is exact either way), elsewhere through the executor.
template <class E, class F>
void run_pass(const E& exec, std::size_t n, const F& f) {
#if defined(TANDEM_HOST_FMA_CLONE)
  if constexpr (std::is_same_v<E, host_exec>) {
    if (cpu_has(cpu_feature::avx2_fma)) {
      ::tandem::detail::cpu::for_range_fma(f, 0, n);
      return;
    }
  }
#endif
  for_each_index(exec, n, f);
}

/// What SGD and AdamW share: resolved groups over one arena, the executor, the gradient view,
/// zero_grad, per-group learning rates, and moving flat state in and out of a StateDict.
/// Options must offer `void validate(const char* optimizer) const` and `double lr`.
template <class Options, element_type T, memory_space Space, class E>
class GroupedOptimizer {
 public:
  using value_type = T;
  using memory_space = Space;
  using executor_type = E;
  using options_type = Options;
  using state_type = opmath_t<T>;  // element type of the optimizer's state
  using state_dict_type = StateDict<state_type, Space>;

  /// The executor every pass runs on.
  [[nodiscard]] const E& executor() const noexcept { return exec_; }

  /// The gradients this optimizer reads: the smallest slice of the arena's gradients holding
  /// every group (parameters lying between two groups, in no group, are inside it too).
  [[nodiscard]] View<T, Space> grads() const noexcept {
    return View<T, Space>(grads_.data() + span_offset_, span_size_);
  }
  /// The parameter values it updates, the same slice of the arena's values.
  [[nodiscard]] View<T, Space> values() const noexcept {
    return View<T, Space>(values_.data() + span_offset_, span_size_);
  }

  /// Zeroes the gradients of every parameter in a group: one pass per group on the executor.
  void zero_grad() {
    for (const auto& group : groups_) {
      for_each_index(exec_, group.size, fill_zeros<T>{grads_.data() + group.offset});
    }
  }

  [[nodiscard]] std::size_t group_count() const noexcept { return groups_.size(); }

  /// The whole arena's values (groups are slices of it); DistributedDataParallel::shard checks
  /// that the optimizer steps the arena it wraps.
  [[nodiscard]] View<T, Space> arena_values() const noexcept { return values_; }

  /// What a sharded optimizer's state_dict() calls to make a range of the arena whole: `full`
  /// holds arena-many elements, this rank's own elements of [begin, end) are set, and after the
  /// call every element of [begin, end) is (a collective: every rank calls it alike).
  using shard_gather =
      std::function<void(View<state_type, Space> full, std::size_t begin, std::size_t end)>;

  /// ZeRO (see DistributedDataParallel::shard, which calls it): from now on the optimizer owns
  /// only the arena elements in `owned` (sorted, disjoint (offset, size) ranges): its state is
  /// sized to them, step() updates only them, state_dict() gathers the full state through
  /// `gather` (a collective) and load_state_dict() keeps the owned part of a full state. An
  /// Error once a group has stepped (its state would be lost) or when sharded already.
  void shard_to(const std::vector<std::pair<std::size_t, std::size_t>>& owned,
                shard_gather gather) {
    const std::string operation = std::string(name_) + "::shard";
    if (gather_) throw Error(operation, "the optimizer is sharded already");
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      if (groups_[g].step != 0) {
        throw Error(operation, "param group " + std::to_string(g) + " has taken " +
                                   std::to_string(groups_[g].step) +
                                   " steps; shard the optimizer before its first step (load a "
                                   "saved state after sharding)");
      }
    }
    for (auto& group : groups_) {
      group.pieces.clear();
      std::size_t state = 0;
      for (const auto& [begin, size] : owned) {
        const std::size_t lo = std::max(begin, group.offset);
        const std::size_t hi = std::min(begin + size, group.offset + group.size);
        if (lo >= hi) continue;
        group.pieces.push_back({lo, hi - lo, state});
        state += hi - lo;
      }
      group.state_size = state;
    }
    gather_ = std::move(gather);
  }

  /// Whether shard_to() restricted the optimizer to some of the arena's elements.
  [[nodiscard]] bool sharded() const noexcept { return static_cast<bool>(gather_); }

  /// Group g's hyperparameters; change them between steps as PyTorch code changes
  /// param_groups[g] (step() checks them again).
  [[nodiscard]] Options& options(std::size_t g) { return group_at(g).options; }
  [[nodiscard]] const Options& options(std::size_t g) const { return group_at(g).options; }

  /// Group g's learning rate: what LR schedules read and set.
  [[nodiscard]] double lr(std::size_t g) const { return group_at(g).options.lr; }
  void set_lr(std::size_t g, double lr) { group_at(g).options.lr = lr; }

  /// Group g's parameters (registration indices) and how many steps it has taken.
  [[nodiscard]] ParamRange group_params(std::size_t g) const { return group_at(g).params; }
  [[nodiscard]] std::int64_t group_steps(std::size_t g) const { return group_at(g).step; }

 protected:
  struct Slot {
    std::size_t offset = 0;  // elements into values()/grads()
    Shape shape;
  };
  /// A run of a group's elements that this optimizer steps: the whole group, or under
  /// sharding each owned range inside it, with where its state starts in the group's state.
  struct Piece {
    std::size_t offset = 0;  // elements into values()/grads()
    std::size_t size = 0;
    std::size_t state_offset = 0;  // elements into the group's flat state
  };
  struct Group {
    ParamRange params;
    std::size_t offset = 0;             // elements into values()/grads()
    std::size_t size = 0;               // elements
    std::size_t first_state_index = 0;  // PyTorch's number for its first parameter
    std::int64_t step = 0;
    Options options;
    std::vector<Piece> pieces;   // what step() updates
    std::size_t state_size = 0;  // elements of each flat state buffer: size, or the owned part
  };

  GroupedOptimizer(const char* name, Parameters<T, Space>& params,
                   std::span<const ParamGroup<Options>> wanted, E exec)
      : name_(name), exec_(std::move(exec)) {
    if (!params.finalized()) {
      throw Error(name_, "the Parameters arena must be finalized before making an optimizer");
    }
    if (wanted.empty()) throw Error(name_, "no param groups were given");
    values_ = params.values();
    grads_ = params.grads();
    for (const auto& parameter : params) slots_.push_back({parameter.offset(), parameter.shape()});
    std::vector<std::size_t> owner(params.size(), wanted.size());
    std::size_t state_index = 0;
    for (const auto& group : wanted) {
      group.options.validate(name_);
      const ParamRange range = group.params.resolve(params);
      for (std::size_t i = range.first; i < range.last; ++i) {
        if (owner[i] != wanted.size()) {
          throw Error(name_, "some parameters appear in more than one parameter group (parameter " +
                                 std::to_string(i) + " in groups " + std::to_string(owner[i]) +
                                 " and " + std::to_string(groups_.size()) + ")");
        }
        owner[i] = groups_.size();
      }
      const std::size_t begin = slots_[range.first].offset;
      const std::size_t end = slots_[range.last - 1].offset + slots_[range.last - 1].shape.numel();
      groups_.push_back({range,
                         begin,
                         end - begin,
                         state_index,
                         0,
                         group.options,
                         {Piece{begin, end - begin, 0}},
                         end - begin});
      state_index += range.size();
    }
    std::size_t end = 0;
    span_offset_ = groups_.front().offset;
    for (const auto& group : groups_) {
      span_offset_ = std::min(span_offset_, group.offset);
      end = std::max(end, group.offset + group.size);
    }
    span_size_ = end - span_offset_;
  }

  Group& group_at(std::size_t g) { return groups_[checked_group(g)]; }
  const Group& group_at(std::size_t g) const { return groups_[checked_group(g)]; }

  std::size_t checked_group(std::size_t g) const {
    if (g >= groups_.size()) {
      throw Error(name_, "param group " + std::to_string(g) + " does not exist (there are " +
                             std::to_string(groups_.size()) + ")");
    }
    return g;
  }

  /// A copy of parameter `param`'s slice of a group's flat state, shaped like the parameter.
  Buffer<state_type, Space> export_state(const Group& group, std::size_t param,
                                         const state_type* flat) const {
    const Slot& slot = slots_[param];
    Buffer<state_type, Space> copy(slot.shape);
    for_each_index(exec_, copy.size(),
                   copy_elements<state_type>{flat + (slot.offset - group.offset), copy.data()});
    return copy;
  }

  /// Copies a state_dict tensor into parameter `param`'s slice of a group's flat state; an
  /// Error when its size is not the parameter's.
  void import_state(const Group& group, std::size_t param, const Buffer<state_type, Space>& from,
                    const std::string& key, state_type* flat) const {
    const Slot& slot = slots_[param];
    if (from.size() != slot.shape.numel()) {
      throw Error(std::string(name_) + "::load_state_dict",
                  "state '" + key + "' of parameter " + std::to_string(state_index(group, param)) +
                      " has " + std::to_string(from.size()) + " elements, the parameter " +
                      std::to_string(slot.shape.numel()));
    }
    for_each_index(exec_, from.size(),
                   copy_elements<state_type>{from.data(), flat + (slot.offset - group.offset)});
  }

  /// A group's flat state as the whole group's (group.size elements): `state` itself, or under
  /// sharding every rank's parts gathered into `scratch` (a collective).
  const state_type* full_state(const Group& group, const Buffer<state_type, Space>& state,
                               Buffer<state_type, Space>& scratch) const {
    if (!sharded()) return state.data();
    Buffer<state_type, Space> arena(values_.size());
    for_each_index(exec_, arena.size(), fill_zeros<state_type>{arena.data()});
    for (const auto& piece : group.pieces) {
      for_each_index(exec_, piece.size,
                     copy_elements<state_type>{state.data() + piece.state_offset,
                                               arena.data() + piece.offset});
    }
    gather_(View<state_type, Space>(arena.data(), arena.size()), group.offset,
            group.offset + group.size);
    scratch = Buffer<state_type, Space>(group.size);
    for_each_index(exec_, group.size,
                   copy_elements<state_type>{arena.data() + group.offset, scratch.data()});
    exec_.synchronize();
    return scratch.data();
  }

  /// Where load_state_dict() imports a group's full state: `state` itself, or under sharding a
  /// group-sized `scratch` that keep_owned() then cuts down.
  state_type* import_target(const Group& group, Buffer<state_type, Space>& state,
                            Buffer<state_type, Space>& scratch) const {
    if (!sharded()) return state.data();
    if (scratch.size() != group.size) scratch = Buffer<state_type, Space>(group.size);
    return scratch.data();
  }

  /// Under sharding: copies the owned elements of a full group state (`scratch`) into `state`.
  void keep_owned(const Group& group, const Buffer<state_type, Space>& scratch,
                  Buffer<state_type, Space>& state) const {
    if (!sharded()) return;
    for (const auto& piece : group.pieces) {
      for_each_index(exec_, piece.size,
                     copy_elements<state_type>{scratch.data() + (piece.offset - group.offset),
                                               state.data() + piece.state_offset});
    }
    exec_.synchronize();
  }

  static std::size_t state_index(const Group& group, std::size_t param) {
    return group.first_state_index + (param - group.params.first);
  }

  /// The param_groups part of a state_dict (options written by the caller).
  typename state_dict_type::GroupState export_group(const Group& group) const {
    typename state_dict_type::GroupState out;
    out.step = group.step;
    for (std::size_t p = group.params.first; p < group.params.last; ++p) {
      out.params.push_back(state_index(group, p));
    }
    return out;
  }

  /// state_dict()'s loop, one for SGD and AdamW: each group's param_groups entry with the
  /// options `options_of(group.options)` names, then, for a group that has stepped,
  /// `export_states(group, g, dict)` adds its parameters' state. Waits for the copies.
  template <class OptionsOf, class ExportStates>
  [[nodiscard]] state_dict_type collect_state_dict(const OptionsOf& options_of,
                                                   const ExportStates& export_states) const {
    state_dict_type dict;
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const Group& group = groups_[g];
      auto out = export_group(group);
      out.options = options_of(group.options);
      dict.param_groups.push_back(std::move(out));
      if (group.step != 0) export_states(group, g, dict);
    }
    exec_.synchronize();
    return dict;
  }

  /// Whether group g's parameters have state in `dict` (has_state(p, entry) for one that has an
  /// entry): all or none, else an Error naming `what` and how many have it.
  template <class HasState>
  [[nodiscard]] bool group_has_state(const state_dict_type& dict, std::size_t g, const char* what,
                                     const HasState& has_state) const {
    const Group& group = groups_[g];
    std::size_t with_state = 0;
    for (std::size_t p = group.params.first; p < group.params.last; ++p) {
      auto found = dict.state.find(state_index(group, p));
      with_state += found != dict.state.end() && has_state(found->second) ? 1 : 0;
    }
    if (with_state != 0 && with_state != group.params.size()) {
      throw Error(std::string(name_) + "::load_state_dict",
                  "param group " + std::to_string(g) + " has " + what + " for " +
                      std::to_string(with_state) + " of its " +
                      std::to_string(group.params.size()) + " parameters");
    }
    return with_state != 0;
  }

  /// An Error unless parameter `param`'s `entry` holds tensor `key` with the parameter's size:
  /// load_state_dict checks every tensor before it changes anything.
  void require_state(const Group& group, std::size_t param,
                     const typename state_dict_type::ParamState& entry, const char* key) const {
    const std::size_t index = state_index(group, param);
    auto tensor = entry.tensors.find(key);
    if (tensor == entry.tensors.end()) {
      throw Error(std::string(name_) + "::load_state_dict",
                  "parameter " + std::to_string(index) + " has no " + key);
    }
    if (tensor->second.size() != slots_[param].shape.numel()) {
      throw Error(std::string(name_) + "::load_state_dict",
                  std::string(key) + " of parameter " + std::to_string(index) + " has " +
                      std::to_string(tensor->second.size()) + " elements, the parameter " +
                      std::to_string(slots_[param].shape.numel()));
    }
  }

  /// Checks that a state_dict describes this optimizer's groups and parameters.
  void check_layout(const state_dict_type& dict) const {
    const std::string operation = std::string(name_) + "::load_state_dict";
    if (dict.param_groups.size() != groups_.size()) {
      throw Error(operation, "loaded state dict has a different number of parameter groups (" +
                                 std::to_string(dict.param_groups.size()) + ", this optimizer " +
                                 std::to_string(groups_.size()) + ")");
    }
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      if (dict.param_groups[g].params != export_group(groups_[g]).params) {
        throw Error(operation, "loaded state dict contains a parameter group " + std::to_string(g) +
                                   " that doesn't match the size or order of this optimizer's");
      }
      if (dict.param_groups[g].step < 0) {
        throw Error(operation, "param group " + std::to_string(g) + " has a negative step count");
      }
    }
    for (const auto& [index, state] : dict.state) {
      bool known = false;
      for (const auto& group : groups_) {
        known = known || (index >= group.first_state_index &&
                          index < group.first_state_index + group.params.size());
      }
      if (!known) {
        throw Error(operation, "state for parameter " + std::to_string(index) +
                                   " names no parameter of this optimizer");
      }
    }
  }

  const char* name_;
  E exec_;
  View<T, Space> values_;
  View<T, Space> grads_;
  std::vector<Slot> slots_;
  std::vector<Group> groups_;
  std::size_t span_offset_ = 0;
  std::size_t span_size_ = 0;
  shard_gather gather_;  // set by shard_to()
};

}  // namespace detail
}  // namespace tandem::optim
