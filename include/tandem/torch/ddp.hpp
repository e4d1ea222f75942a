// tandem/torch/ddp.hpp - tandem::torch::DistributedDataParallel: a libtorch module (torch::nn)
// trained data-parallel by tandem's DDP, driven by autograd: gradients are averaged over the
// ranks when loss.backward() returns.
//   tandem::torch::DistributedDataParallel ddp(comm, model);      // model: shared_ptr<Net>
//   auto loss = torch::nn::functional::cross_entropy(ddp.forward(x), y);
//   opt.zero_grad(); loss.backward(); opt.step();                  // tandem::optim or torch::optim
// Needs: libtorch (1.13 or 2.x; the tandem::torch CMake component) and a Communicator. CUDA
// modules: a device communicator (NcclComm) and #include <tandem/torch/cuda.hpp> in a .cu file.
// How it works (the arena's views, the hooks, gradients set to none, EMA, checkpoints), streams
// and limits: docs/libtorch.md, "How the bridge's DDP works" and "CUDA".
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include "tandem/arena/parameters.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/core/error.hpp"
#include "tandem/ddp/ddp.hpp"
#include "tandem/ddp/policies.hpp"
#include "tandem/tensor/tensor.hpp"
#include "tandem/torch/detail/grad_hooks.hpp"
#include "tandem/torch/detail/module_check.hpp"
#include "tandem/torch/state_dict.hpp"
#include "tandem/torch/tensor.hpp"

namespace tandem::torch {

/// Data-parallel training of a libtorch module over `Comm` (see the top of this header).
/// Policies are tandem::DistributedDataParallel's. The communicator and the module must outlive
/// it; it neither copies nor moves. On destruction the module gets its own storage back (copies
/// of the arena's values and gradients).
template <Communicator Comm, class... Policies>
class DistributedDataParallel {
 public:
  /// Where the arena lives: host memory for a host communicator (CPU modules), the
  /// communicator's device memory for a device one (CUDA modules).
  using arena_space = std::conditional_t<host_accessible<typename Comm::memory_space>, host,
                                         typename Comm::memory_space>;
  /// The arena: the module's float32 parameters, gradients and buffers.
  using arena_type = Parameters<float, arena_space>;
  /// What runs the arena's passes (host_exec; cuda_exec on libtorch's stream for CUDA modules).
  using executor_type = typename CurrentStream<arena_space>::executor;
  /// The tandem DDP that reduces the arena.
  using inner_type = tandem::DistributedDataParallel<Comm, Policies...>;
  /// The RAII guard of gradient accumulation (see no_sync()): the wrapped DDP's guard, and while
  /// it lives more than one backward() may follow a forward.
  class [[nodiscard]] NoSyncGuard {
   public:
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;
    /// Hands the guard over; the moved-from guard no longer ends the accumulation.
    NoSyncGuard(NoSyncGuard&& other) noexcept
        : inner_(std::move(other.inner_)), depth_(std::exchange(other.depth_, nullptr)) {}
    NoSyncGuard& operator=(NoSyncGuard&&) = delete;
    ~NoSyncGuard() {
      if (depth_) --*depth_;
    }

   private:
    friend class DistributedDataParallel;
    NoSyncGuard(typename inner_type::NoSyncGuard inner, int* depth) noexcept
        : inner_(std::move(inner)), depth_(depth) {
      ++*depth_;
    }
    typename inner_type::NoSyncGuard inner_;
    int* depth_;
  };

  /// Collective: checks, moves into the arena and broadcasts `module`'s parameters and buffers
  /// (see the top of this header). An Error, on every rank, when the ranks' modules differ, a
  /// parameter is not float32, or the module is not where the communicator moves tensors (the
  /// CPU for a host communicator, its GPU for a device one); the module is left untouched then.
  template <class Module>
  requires std::derived_from<Module, ::torch::nn::Module> DistributedDataParallel(
      Comm& comm, std::shared_ptr<Module> module)
      : comm_(&comm), rank_(comm.rank()), module_(module) {
    if (!module_) throw Error(comm.rank(), operation, "the module is null");
    if constexpr (::torch::detail::has_forward<Module>::value) {
      forward_ = ::torch::nn::AnyModule(module);
    }
    wrap();
  }

  /// The same for a module holder (torch::nn::Linear, a TORCH_MODULE type).
  template <class Impl>
  DistributedDataParallel(Comm& comm, const ::torch::nn::ModuleHolder<Impl>& module)
      : DistributedDataParallel(comm, module.ptr()) {}

  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// Removes the hooks and gives the module its own storage again: copies of the arena's values,
  /// buffers and gradients.
  ~DistributedDataParallel() {
    try {
      inner_.reset();
      at::NoGradGuard no_grad;
      for (auto& slot : trained_) {
        if (slot.accumulator) slot.accumulator->del_post_hook(slot.hook_key);
        slot.tensor.set_data(slot.tensor.detach().clone());
        auto& grad = slot.tensor.mutable_grad();
        if (grad.defined()) grad = grad.detach().clone();
      }
      for (auto& slot : arena_buffers_) slot.tensor.set_data(slot.tensor.detach().clone());
    } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
    }
  }

  /// Elastic training (the release callback; docs/libtorch.md): drops the tandem DDP that holds
  /// the communicator (buckets, a reduction in flight). The module stays wired to the arena with
  /// its hooks, and the arena stays (optimizers, EMA, checkpoints over parameters() keep working).
  /// Until rebind(), forward, backward and step are an Error. A second call does nothing.
  void release() noexcept {
    inner_.reset();
    comm_ = nullptr;
    callback_queued_ = false;  // a backward that failed in flight never ran its callback
    reduced_since_forward_ = false;
  }

  /// Elastic training (the rebuild callback): reduces over `comm`, the healed group, with a new
  /// tandem DDP over the same arena (the modules were compared at construction and cannot have
  /// changed). Collective: rank 0's values and buffers are broadcast. Not under shard<1|2>: a lost
  /// rank's optimizer shard is gone. An Error unless release() came first.
  void rebind(Comm& comm) {
    static_assert(inner_type::config::shard_stage == 0,
                  "rebind: a ZeRO shard lives on its rank only; a lost rank's part is gone");
    if (inner_) {
      throw Error(comm.rank(), "torch::DistributedDataParallel::rebind",
                  "the wrapper still reduces over its communicator; call release() first");
    }
    comm_ = &comm;
    rank_ = comm.rank();
    attach();
    attach_grads(/*undefined_is_zero=*/true);
    bind_inner();
  }

  /// Runs the module's forward(args...) and returns what it returns (ReturnType, torch::Tensor
  /// by default; through torch::nn::AnyModule, so argument types must match forward's exactly).
  /// Before it, as before_forward(). An Error for a module without a single non-template
  /// forward(): call before_forward() and the module's own forward then.
  template <class ReturnType = at::Tensor, class... Args>
  ReturnType forward(Args&&... args) {
    before_forward();
    if (forward_.is_empty()) {
      throw Error(rank_, "torch::DistributedDataParallel::forward",
                  "the module has no single non-template forward(); call ddp.before_forward() "
                  "and then the module's forward yourself");
    }
    return forward_.template forward<ReturnType>(std::forward<Args>(args)...);
  }

  /// What forward() does before the module's forward: checks that no parameter was added,
  /// replaced or moved since wrapping (an Error naming it), re-points the module's tensors at
  /// the arena (after an EMA swap, or a zero_grad that set gradients to none: those count as
  /// zero) and, in training mode, broadcasts the buffers from rank 0 (policy broadcast_buffers,
  /// the default; collective).
  void before_forward() {
    (void)bound("torch::DistributedDataParallel::forward");
    check_stream("torch::DistributedDataParallel::forward");
    check_unchanged("torch::DistributedDataParallel::forward");
    reduced_since_forward_ = false;
    attach();
    attach_grads(/*undefined_is_zero=*/true);
    if (module_->is_training()) {
      inner_->before_forward();
      if constexpr (inner_type::config::broadcasts_buffers) broadcast_other_buffers();
    }
  }

  /// Re-points every parameter and buffer of the module at the arena's active value blocks (EMA
  /// swaps them); forward() does it, call it to see the EMA weights through the module directly.
  void attach() {
    if (attached_values_ == arena_.values().data() &&
        attached_buffers_ == arena_.buffer_values().data()) {
      return;
    }
    at::NoGradGuard no_grad;
    float* values = arena_.values().data();
    float* buffers = arena_.buffer_values().data();
    for (auto& slot : trained_) slot.tensor.set_data(blob(values + slot.entry->offset(), slot));
    for (auto& slot : arena_buffers_) {
      slot.tensor.set_data(blob(buffers + slot.entry->offset(), slot));
    }
    attached_values_ = values;
    attached_buffers_ = buffers;
  }

  /// `auto guard = ddp.no_sync();` - backward passes accumulate gradients locally until the
  /// guard ends; the first backward after it reduces the sum (gradient accumulation).
  [[nodiscard]] NoSyncGuard no_sync() {
    return NoSyncGuard(bound("torch::DistributedDataParallel::no_sync").no_sync(), &no_sync_depth_);
  }

  /// ZeRO (policies shard<1>, shard<2>; docs/zero.md): gives `opt`, a tandem optimizer over
  /// parameters(), only this rank's parts of the arena. Call it before the first step and step
  /// through step(opt). Does nothing without a shard policy.
  template <class O>
  void shard(O& opt) {
    bound("torch::DistributedDataParallel::shard").shard(opt);
  }
  /// Steps `opt` after loss.backward(): opt.step() and, under shard<1>/shard<2>, the all_gather
  /// that brings every rank's updated parts into the module's parameters (collective then).
  template <class O>
  void step(O& opt) {
    bound("torch::DistributedDataParallel::step").step(opt);
  }
  /// The same through a GradScaler (tandem::DistributedDataParallel::step); whether it stepped.
  template <class Scaler, class O>
  bool step(Scaler& scaler, O& opt) {
    return bound("torch::DistributedDataParallel::step").step(scaler, opt);
  }

  /// The arena (parameters, gradients, buffers): what tandem's optimizers, GradScaler and EMA
  /// take. Its names are the module's named_parameters() / named_buffers() keys.
  [[nodiscard]] arena_type& parameters() noexcept { return arena_; }
  /// The executor of the arena's passes: give it to tandem's optimizers, GradScaler and EMA on a
  /// CUDA module (cuda_exec on libtorch's stream), so that they run in the same stream order.
  [[nodiscard]] const executor_type& executor() const noexcept { return exec_; }
  /// Where the module lives (the CPU, or its GPU).
  [[nodiscard]] const at::Device& device() const noexcept { return device_; }
  /// The wrapped module.
  [[nodiscard]] ::torch::nn::Module& module() const noexcept { return *module_; }
  /// The wrapped module, shared.
  [[nodiscard]] const std::shared_ptr<::torch::nn::Module>& module_ptr() const noexcept {
    return module_;
  }
  /// The tandem DDP that reduces the arena (its buckets, for instance).
  [[nodiscard]] inner_type& ddp() { return bound("torch::DistributedDataParallel::ddp"); }
  /// The communicator.
  [[nodiscard]] Comm& comm() const {
    (void)bound("torch::DistributedDataParallel::comm");
    return *comm_;
  }
  /// Buffers that are not float32 (BatchNorm's num_batches_tracked), by name: the module's own
  /// tensors, broadcast with the arena's buffers.
  [[nodiscard]] std::vector<std::pair<std::string, at::Tensor>> other_buffers() const {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& [name, tensor] : other_buffers_) out.emplace_back(name, tensor);
    return out;
  }
  /// The module's state_dict entries that the arena does not hold, by element type: buffers that
  /// are not float32 and the second names of tied parameters and buffers. With parameters(),
  /// every key of named_parameters() and named_buffers() once; tandem::torch::model() registers
  /// both with a checkpoint.
  [[nodiscard]] NamedTensorSets<arena_space>& tensors_outside_arena() noexcept { return outside_; }

 private:
  template <class>
  friend struct detail::GradReadyHook;

  static constexpr const char* operation = "torch::DistributedDataParallel";

  struct Slot {
    std::string name;
    at::Tensor tensor;  // the module's parameter or buffer
    typename arena_type::Parameter* entry = nullptr;
    at::Tensor grad_view;  // trained: the view of its arena gradient
    detail::AccumulatorPtr accumulator;
    std::uintptr_t hook_key = 0;
  };

  at::Tensor blob(float* data, const Slot& slot) const {
    return at::from_blob(data, slot.tensor.sizes(),
                         at::TensorOptions().dtype(at::kFloat).device(device_));
  }

  /// The tandem DDP; an Error naming `where` while released (between release() and rebind()).
  inner_type& bound(const char* where) const {
    if (inner_) return *inner_;
    throw Error(rank_, where,
                "the wrapper was released from its communicator (release(), a heal in progress); "
                "call rebind(comm) with the new group first");
  }

  void wrap() {
    const int rank = comm_->rank();
    const auto params = module_->named_parameters(/*recurse=*/true);
    const auto buffers = module_->named_buffers(/*recurse=*/true);

    // Where the module must be, and libtorch's stream, which every collective is ordered with.
    device_ = expected_device(params);
    exec_ = CurrentStream<arena_space>::of(device_);
    // The same entries on every rank, or an Error naming the first difference.
    detail::require_same_entries(*comm_, detail::module_entries(params, buffers), operation);

    // Same everywhere, so every rank raises the same Errors below.
    std::unordered_map<const void*, std::string> seen;  // a tensor's first name
    struct Alias {
      std::string name, first;
      at::Tensor tensor;
    };
    std::vector<Alias> aliases;  // tied: a tensor's second and later names
    for (const auto& item : params) {
      const auto& t = item.value();
      if (t.scalar_type() != at::kFloat || t.layout() != c10::kStrided) {
        throw Error(rank, operation,
                    "parameter '" + item.key() + "' is a " + dtype_name(t.scalar_type()) +
                        " tensor; tandem::torch::DistributedDataParallel supports dense float32 "
                        "parameters only (keep parameters float32; use autocast for 16-bit)");
      }
      require_on_device(item.key(), "parameter", t);
      const auto [where, fresh] = seen.emplace(t.unsafeGetTensorImpl(), item.key());
      if (!fresh) {  // a shared (tied) parameter: its first name owns the slot
        aliases.push_back({item.key(), where->second, t});
        continue;
      }
      Slot slot{item.key(), t, nullptr, {}, {}, 0};
      auto shape = detail::shape_of(t.sizes(), item.key(), rank);
      if (t.requires_grad()) {
        slot.entry = &arena_.add(item.key(), shape);
        trained_.push_back(std::move(slot));
      } else {
        slot.entry = &arena_.add_buffer(item.key(), shape);
        arena_buffers_.push_back(std::move(slot));
      }
    }
    for (const auto& item : buffers) {
      const auto& t = item.value();
      if (auto problem = layout_problem(t); !problem.empty()) {
        throw Error(rank, operation, "buffer '" + item.key() + "': " + problem);
      }
      require_on_device(item.key(), "buffer", t);
      if (const auto [where, fresh] = seen.emplace(t.unsafeGetTensorImpl(), item.key()); !fresh) {
        aliases.push_back({item.key(), where->second, t});
        continue;
      }
      if (t.scalar_type() == at::kFloat) {
        Slot slot{item.key(), t, nullptr, {}, {}, 0};
        slot.entry = &arena_.add_buffer(item.key(), detail::shape_of(t.sizes(), item.key(), rank));
        arena_buffers_.push_back(std::move(slot));
      } else {
        other_buffers_.emplace_back(item.key(), t);
      }
    }
    if constexpr (host_accessible<arena_space>) {
      arena_.finalize();
    } else {
      arena_.finalize(exec_);
    }
    for (const auto& [name, t] : other_buffers_) outside_.add(name, t);
    for (const auto& alias : aliases) {
      if (const auto* first = arena_.find(alias.first)) {
        const auto sizes = alias.tensor.sizes();
        outside_.template of<float>().add(alias.name,
                                          std::vector<std::int64_t>(sizes.begin(), sizes.end()),
                                          [first] { return first->value(); });
      } else {
        outside_.add(alias.name, alias.tensor);
      }
    }
    for (const auto& p : module_->parameters(/*recurse=*/true)) {
      known_.push_back(p.unsafeGetTensorImpl());
    }

    // Into the arena: values, gradients (an undefined one is zero), then views everywhere.
    {
      at::NoGradGuard no_grad;
      float* values = arena_.values().data();
      float* grads = arena_.grads().data();
      float* buffer_values = arena_.buffer_values().data();
      for (auto& slot : trained_) {
        blob(values + slot.entry->offset(), slot).copy_(slot.tensor);
        slot.grad_view = blob(grads + slot.entry->offset(), slot);
        const auto& grad = slot.tensor.grad();
        if (grad.defined()) slot.grad_view.copy_(grad);
      }
      for (auto& slot : arena_buffers_) {
        blob(buffer_values + slot.entry->offset(), slot).copy_(slot.tensor);
      }
    }
    attach();
    attach_grads(/*undefined_is_zero=*/false);
    for (std::size_t i = 0; i < trained_.size(); ++i) {
      auto& slot = trained_[i];
      slot.accumulator = ::torch::autograd::impl::grad_accumulator(slot.tensor);
      slot.hook_key = slot.accumulator->add_post_hook(
          std::make_unique<detail::GradReadyHook<DistributedDataParallel>>(this, i));
    }
    bind_inner();
  }

  /// tandem's DDP over comm_ (it checks its arena once more, cheap, and broadcasts rank 0's
  /// values and buffers; the module's entries were compared, so it does not compare its
  /// arena's), and rank 0's other buffers.
  void bind_inner() {
    inner_ = std::make_unique<inner_type>(tandem::detail::ddp::registration_compared_by_caller,
                                          *comm_, arena_, exec_);
    broadcast_other_buffers();
  }

  /// Where the module must live: the CPU for a host communicator; for a device one, its GPU (the
  /// communicator's device() where it has one, else the first parameter's GPU).
  template <class Named>
  at::Device expected_device(const Named& params) const {
    if constexpr (host_accessible<arena_space>) {
      return at::Device(at::kCPU);
    } else {
      if constexpr (requires(const Comm& c) { c.device(); }) {
        return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(comm_->device()));
      } else {
        for (const auto& item : params) {
          if (item.value().is_cuda()) return item.value().device();
        }
        return at::Device(at::kCUDA, 0);
      }
    }
  }

  /// An Error naming `where` unless libtorch's current stream is still the one the arena's passes
  /// and the communicator's operations are ordered with.
  void check_stream(const char* where) const {
    if constexpr (StreamExecutor<executor_type>) {
      if (CurrentStream<arena_space>::of(device_).stream == exec_.stream) return;
      throw Error(rank_, where,
                  "libtorch's current CUDA stream on " + device_.str() +
                      " is not the one DistributedDataParallel was constructed under; the "
                      "arena's passes and the communicator's operations are ordered with that "
                      "stream only: construct the wrapper under the same "
                      "c10::cuda::CUDAStreamGuard as the training loop (or none for both)");
    } else {
      (void)where;
    }
  }

  /// An Error unless `t` (parameter or buffer `name`) lives where the communicator moves tensors.
  void require_on_device(const std::string& name, const char* kind, const at::Tensor& t) const {
    if (t.device() == device_) return;
    std::string fix;
    if constexpr (host_accessible<arena_space>) {
      fix =
          "a host communicator moves CPU tensors: keep the module on the CPU, or train a CUDA "
          "module over NcclComm";
    } else {
      fix = "the communicator's GPU is " + device_.str() + ": move the module there (module->to(" +
            "torch::Device(torch::kCUDA, " + std::to_string(device_.index()) +
            "))) before wrapping";
    }
    throw Error(rank_, operation,
                std::string(kind) + " '" + name + "' is on " + t.device().str() + "; " + fix);
  }

  /// Gradients into the arena: a .grad() that is not the arena view is copied in (undefined:
  /// zero when `undefined_is_zero`, else the arena keeps what it has), then the view is set.
  void attach_grads(bool undefined_is_zero) {
    for (auto& slot : trained_) adopt_grad(slot, undefined_is_zero);
  }

  void adopt_grad(Slot& slot, bool undefined_is_zero) {
    auto& grad = slot.tensor.mutable_grad();
    if (grad.defined() && grad.data_ptr() == slot.grad_view.data_ptr()) return;
    at::NoGradGuard no_grad;
    if (grad.defined()) {
      slot.grad_view.copy_(grad);
    } else if (undefined_is_zero) {
      slot.grad_view.zero_();
    }
    grad = slot.grad_view;
  }

  /// From the hook: parameter i's gradient is complete for this backward.
  void on_grad_ready(std::size_t i) {
    (void)bound("torch::DistributedDataParallel (backward)");
    check_stream("torch::DistributedDataParallel (backward)");
    if (reduced_since_forward_ && no_sync_depth_ == 0) {
      throw Error(rank_, "torch::DistributedDataParallel (backward)",
                  "parameter '" + trained_[i].name +
                      "' was marked ready twice in one step: a second backward() after the one "
                      "that reduced the gradients, with no forward (ddp.forward() or "
                      "ddp.before_forward()) in between (PyTorch's DDP: \"Expected to mark a "
                      "variable ready only once\"); sum the losses and call backward() once, or "
                      "accumulate micro-batches under ddp.no_sync()");
    }
    if (!callback_queued_) {
      ::torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_backward(); });
      callback_queued_ = true;
    }
    adopt_grad(trained_[i], /*undefined_is_zero=*/false);
    inner_->grad_ready(*trained_[i].entry);
  }

  /// From the engine, as backward ends: the reduction finishes (collective), then the checks.
  void finish_backward() {
    callback_queued_ = false;
    reduced_since_forward_ = no_sync_depth_ == 0;
    inner_->finish_gradient_sync();
    attach_grads(/*undefined_is_zero=*/false);  // unused parameters get their reduced gradient
    check_unchanged("torch::DistributedDataParallel (backward)");
  }

  /// An Error when the module's parameters are not the ones wrapped.
  void check_unchanged(const char* where) {
    const auto now = module_->parameters(/*recurse=*/true);
    bool same = now.size() == known_.size();
    for (std::size_t i = 0; same && i < now.size(); ++i) {
      same = now[i].unsafeGetTensorImpl() == known_[i];
    }
    if (!same) {
      std::string names;
      for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
        const auto* impl = item.value().unsafeGetTensorImpl();
        if (std::find(known_.begin(), known_.end(), impl) == known_.end()) {
          names += (names.empty() ? "'" : ", '") + item.key() + "'";
        }
      }
      throw Error(rank_, where,
                  "the module's parameters changed after it was wrapped (added or replaced: " +
                      (names.empty() ? std::string("some were removed") : names) +
                      "); register every parameter before constructing DistributedDataParallel");
    }
    float* values = arena_.values().data();
    for (const auto& slot : trained_) {
      const void* data = slot.tensor.data_ptr();
      if (data != attached_values_ + slot.entry->offset() &&
          data != values + slot.entry->offset()) {
        throw Error(rank_, where,
                    "parameter '" + slot.name +
                        "' no longer lies in the arena (set_data or .to() after wrapping?); "
                        "move or convert the module before constructing DistributedDataParallel");
      }
    }
  }

  /// Rank 0's non-float32 buffers everywhere, packed into one broadcast of bytes.
  void broadcast_other_buffers() {
    if (other_buffers_.empty() || comm_->size() == 1) return;
    if constexpr (!host_accessible<arena_space>) {
      // In libtorch's stream order (the contract, with the arena's executor), one broadcast each:
      // a few counters, and packing them would take as many copies.
      tandem::order_after(*comm_, exec_);
      for (const auto& [name, t] : other_buffers_) {
        visit_dtype(t, operation, comm_->rank(), [&](auto tag) {
          comm_->broadcast(view<decltype(tag), arena_space>(t, operation, comm_->rank()), 0);
        });
      }
      tandem::hand_back(*comm_, exec_);
    } else {
      std::size_t total = 0;
      for (const auto& [name, t] : other_buffers_) total += t.nbytes();
      std::vector<std::uint8_t> bytes(total);
      std::size_t at = 0;
      for (const auto& [name, t] : other_buffers_) {
        if (!t.is_contiguous()) {
          throw Error(rank_, operation, "buffer '" + name + "' is not contiguous");
        }
        std::memcpy(bytes.data() + at, t.data_ptr(), t.nbytes());
        at += t.nbytes();
      }
      comm_->broadcast(bytes, 0);
      at = 0;
      for (const auto& [name, t] : other_buffers_) {
        std::memcpy(t.data_ptr(), bytes.data() + at, t.nbytes());
        at += t.nbytes();
      }
    }
  }

  Comm* comm_;  // null between release() and rebind()
  int rank_;    // this rank in comm_ (the last one while released), for Errors
  std::shared_ptr<::torch::nn::Module> module_;
  ::torch::nn::AnyModule forward_;
  arena_type arena_;
  executor_type exec_{};
  at::Device device_{at::kCPU};
  std::vector<Slot> trained_;
  std::vector<Slot> arena_buffers_;  // float32 buffers and frozen parameters
  std::vector<std::pair<std::string, at::Tensor>> other_buffers_;
  NamedTensorSets<arena_space> outside_;
  std::vector<const c10::TensorImpl*> known_;
  float* attached_values_ = nullptr;
  float* attached_buffers_ = nullptr;
  bool callback_queued_ = false;
  bool reduced_since_forward_ = false;  // a backward reduced the gradients since the last forward
  int no_sync_depth_ = 0;               // open NoSyncGuards
  std::unique_ptr<inner_type> inner_;
};

/// `DistributedDataParallel ddp(comm, model)` with a shared_ptr to a module.
template <Communicator Comm, class Module>
DistributedDataParallel(Comm&, std::shared_ptr<Module>) -> DistributedDataParallel<Comm>;
/// `DistributedDataParallel ddp(comm, linear)` with a module holder.
template <Communicator Comm, class Impl>
DistributedDataParallel(Comm&, const ::torch::nn::ModuleHolder<Impl>&)
    -> DistributedDataParallel<Comm>;

}  // namespace tandem::torch
