// tandem/ddp/ddp.hpp - tandem::DistributedDataParallel: keeps a Parameters arena identical on
// every rank by all-reducing gradient buckets (slices of the flat gradient buffer) as the
// backward pass marks them ready.
//   tandem::DistributedDataParallel<tandem::GlooComm> ddp(comm, params);
//   ddp.before_forward(); /* forward, backward: ddp.grad_ready(p) */ ddp.finish_gradient_sync();
// Needs: a Communicator (comm/communicator.hpp); device arenas need tandem/cuda.hpp in a .cu file.
// How a step runs, memory spaces and streams, mixed precision, ZeRO: docs/ddp.md. The kernels and
// the arena's access: detail/arena_access.hpp; the registration check: detail/registration.hpp.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/arena/parameters.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/error.hpp"
#include "tandem/ddp/buckets.hpp"
#include "tandem/ddp/detail/arena_access.hpp"
#include "tandem/ddp/detail/registration.hpp"
#include "tandem/ddp/detail/shared_grads.hpp"
#include "tandem/ddp/detail/zero_checks.hpp"
#include "tandem/ddp/policies.hpp"
#include "tandem/ddp/shards.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/exec.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

namespace detail::ddp {

/// Whether DistributedDataParallel's constructor compares the ranks' registration.
enum class Registration : std::uint8_t { compare, compared_by_caller };
inline constexpr Registration compare_registration = Registration::compare;
inline constexpr Registration registration_compared_by_caller = Registration::compared_by_caller;

}  // namespace detail::ddp

namespace detail::join {
struct access;  // tandem::Join's way to the hooks below (ddp/join.hpp)
}  // namespace detail::join

/// Data-parallel training over a Communicator: see the top of this header for one step.
/// Policies (tandem/ddp/policies.hpp) choose the bucket caps, overlap or sync_at_end, average or
/// sum, 16-bit compression and the buffer broadcast; impossible combinations do not compile.
/// The arena's element type, memory space and executor are the constructor's, so one
/// `DistributedDataParallel<tandem::GlooComm>` wraps a host or a device arena alike.
/// The communicator and the arena must outlive this object and stay where they are (neither is
/// moved while wrapped); it neither copies nor moves.
template <Communicator Comm, class... Policies>
class DistributedDataParallel {
 public:
  /// The policies, checked and with defaults filled in (bucket caps, schedule, reduction, ...).
  using config = detail::ddp_config<Policies...>;
  /// The communicator type the gradients travel through.
  using comm_type = Comm;

  /// While alive (see no_sync()), gradients accumulate locally and finish_gradient_sync() moves
  /// nothing.
  class [[nodiscard]] NoSyncGuard {
   public:
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;
    /// Hands the guard over; the moved-from guard no longer re-enables synchronisation.
    NoSyncGuard(NoSyncGuard&& other) noexcept : ddp_(std::exchange(other.ddp_, nullptr)) {}
    NoSyncGuard& operator=(NoSyncGuard&&) = delete;
    ~NoSyncGuard() {
      if (ddp_) --ddp_->no_sync_depth_;
    }

   private:
    friend class DistributedDataParallel;
    explicit NoSyncGuard(DistributedDataParallel* ddp) noexcept : ddp_(ddp) {}
    DistributedDataParallel* ddp_;
  };

  /// Collective: checks that every rank registered the same parameters and buffers (names,
  /// shapes, element type; an Error names the first difference and the ranks), then broadcasts
  /// the values and buffers from rank 0. `params` must be finalized. The arena lives in the
  /// communicator's memory space or, on a host communicator (which stages it through pinned
  /// memory), in device memory; `exec` runs the numeric passes where the arena lives (by
  /// default host_exec for host arenas, cuda_exec{} (its default stream) for device ones).
  template <element_type T, memory_space Space, Executor Exec = default_executor_t<Space>>
  DistributedDataParallel(Comm& comm, Parameters<T, Space>& params, Exec exec = {})
      : DistributedDataParallel(detail::ddp::compare_registration, comm, params, std::move(exec)) {}

  /// The same for a face that has compared its ranks' registration itself (the libtorch bridge
  /// compares the module's parameters and buffers, of which the arena is made): no second
  /// comparison. With detail::ddp::compare_registration, the constructor above.
  template <element_type T, memory_space Space, Executor Exec>
  DistributedDataParallel(detail::ddp::Registration registration, Comm& comm,
                          Parameters<T, Space>& params, Exec exec)
      : comm_(&comm) {
    using comm_space = typename Comm::memory_space;
    static_assert(std::same_as<Space, comm_space> || host_accessible<comm_space>,
                  "tandem: DistributedDataParallel: this communicator moves only tensors of its "
                  "own memory space (NcclComm: device memory), so it cannot reduce an arena in "
                  "another space; use Parameters<T, tandem::device> with NcclComm, or a host "
                  "communicator (GlooComm, MpiComm, LocalComm), which takes host arenas and "
                  "stages device arenas through pinned memory");
    static_assert(ExecutorFor<Exec, Space>,
                  "tandem: DistributedDataParallel: the executor must run where the arena lives "
                  "(host_exec for host or pinned arenas, cuda_exec for device arenas)");
    if (!params.finalized()) {
      throw Error(comm.rank(), "DistributedDataParallel",
                  "the Parameters arena must be finalized before it is wrapped");
    }
    numel_ = params.numel();
    buffer_numel_ = params.buffer_numel();
    average_deferrable_ = std::same_as<T, float>;

    std::vector<std::size_t> sizes;
    for (auto& p : params) {
      identity_.push_back(&p);
      names_.push_back(p.name());
      index_of_.emplace(p.name(), sizes.size());
      sizes.push_back(p.size());
      offsets_.push_back(p.offset());
    }
    // The check's few integers travel in the communicator's own space: host memory on host
    // communicators (nothing to stage), the arena's device memory on device-only ones.
    if (registration == detail::ddp::compare_registration) {
      if constexpr (host_accessible<comm_space>) {
        detail::ddp::verify_registration(comm, on_host, detail::ddp::registration_of(params));
      } else {
        detail::ddp::verify_registration(comm, exec, detail::ddp::registration_of(params));
      }
    }
    grads_address_ = detail::ddp::place_grads(comm, params);  // shared memory where Comm lends it

    plan_ =
        plan_buckets(sizes, sizeof(T), config::first_bucket_cap_bytes, config::bucket_cap_bytes);
    if constexpr (config::shard_stage > 0) {
      layout_ = plan_shards(plan_.buckets, comm.size(), comm.rank());
    }
    values_address_ = params.values().data();
    ready_.assign(sizes.size(), 0);
    touched_.assign(sizes.size(), 0);
    reset_step();

    arena_ = std::make_unique<detail::ddp::ArenaAccessFor<Comm, config, T, Space, Exec>>(
        comm, params, exec, layout_);
    arena_->broadcast(*comm_, /*values_too=*/true, /*root=*/0);
  }

  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// Waits for buckets still on the wire (a step left unfinished), ignoring their failures.
  ~DistributedDataParallel() {
    if (join_record_) join_record_(join_destroyed, 0);  // the Join stops using it
    for (auto& work : works_) {
      try {
        work.wait();
      } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
      }
    }
  }

  /// Call before each forward: broadcasts the buffers from rank 0 (policy broadcast_buffers, the
  /// default), as PyTorch's DDP does at the start of its forward. Collective.
  void before_forward() {
    if constexpr (config::broadcasts_buffers) {
      if (buffer_numel_ == 0 || comm_->size() == 1) return;
      join_note(join_buffers, 0);
      arena_->broadcast(*comm_, /*values_too=*/false, broadcast_root_);
    }
  }

  /// Marks the gradient of `param` (a parameter of the wrapped arena) complete for this step.
  template <detail::ddp::arena_parameter P>
  void grad_ready(const P& param) {
    mark(index_checked(param, "DistributedDataParallel::grad_ready"));
  }

  /// Marks the gradient of the parameter called `name` complete for this step.
  void grad_ready(std::string_view name) {
    auto it = index_of_.find(name);
    if (it == index_of_.end()) {
      throw Error(comm_->rank(), "DistributedDataParallel::grad_ready",
                  "no trained parameter is called '" + std::string(name) + "'");
    }
    mark(it->second);
  }

  /// Starts the buckets not started yet (gradients never marked count as zeros), waits for every
  /// bucket and leaves each rank with the same gradients. Collective. Under no_sync() it only
  /// ends the micro-batch: the gradients stay local and keep accumulating.
  void finish_gradient_sync() {
    require_stepped("DistributedDataParallel::finish_gradient_sync");
    wait_parameters();
    if (no_sync_depth_ > 0 && !join_shadowing_) {
      for (std::size_t i = 0; i < ready_.size(); ++i) touched_[i] = touched_[i] | ready_[i];
      reset_step();
      return;
    }
    std::exception_ptr failure;
    try {
      for (; next_launch_ < plan_.buckets.size(); ++next_launch_) {
        zero_unused(plan_.buckets[next_launch_]);
        launch(next_launch_);
      }
    } catch (...) {
      failure = std::current_exception();
    }
    failure = arena_->hand_back(works_, failure);
    if constexpr (config::compressed) {
      if (!failure) arena_->expand(plan_.buckets);
    }
    if constexpr (config::shard_stage == 2) {
      if (!failure) arena_->settle_shards();
    }
    // A rank shadowing the step leaves the division to the replay of the step that takes it.
    if (!failure && hand_average_ && !join_shadowing_ && average_divisor() > 1) {
      try {
        hand_average_(average_divisor());
      } catch (...) {
        failure = std::current_exception();
      }
    }
    touched_.assign(touched_.size(), 0);
    reset_step();
    if (failure) std::rethrow_exception(failure);
    step_due_ = config::shard_stage > 0;
    join_note(join_finish, 0);
  }

  /// `auto guard = ddp.no_sync();` - until the guard ends, steps accumulate gradients locally
  /// (gradient accumulation); the first finish_gradient_sync() after it reduces the accumulated
  /// sum. An Error in the middle of a step (after a gradient was marked ready).
  [[nodiscard]] NoSyncGuard no_sync() {
    if (in_step_) {
      throw Error(comm_->rank(), "DistributedDataParallel::no_sync",
                  "called in the middle of a step: finish_gradient_sync() first");
    }
    ++no_sync_depth_;
    return NoSyncGuard(this);
  }

  /// Leaves the division by world size to `scaler` (docs/ddp.md, "How DDP works"): the buckets
  /// travel undivided and the scaler's next unscale of `opt` (unscale_(), step(), or
  /// amp::FusedStep's update) multiplies by 1/(scale * world size) instead of 1/scale. `opt` must
  /// read exactly the arena's gradients; the scaler and `opt` must outlive this object. Returns
  /// whether the scaler took the division: it does for float gradients and an enabled scaler.
  template <class Scaler, class O>
  requires requires(Scaler& scaler, O& opt) {
    { scaler.is_enabled() } -> std::convertible_to<bool>;
    scaler.divide_at_next_unscale(opt, 2.0);
    opt.grads().data();
    opt.grads().size();
  }
  bool defer_average_to(Scaler& scaler, O& opt) {
    static_assert(config::averaged,
                  "tandem: DistributedDataParallel::defer_average_to: under the sum policy there "
                  "is no division by world size to hand over");
    static_assert(
        !config::compressed,
        "tandem: DistributedDataParallel::defer_average_to: compress<W> divides before "
        "the 16-bit wire (to keep the sum in range), so it cannot hand the division over");
    const char* operation = "DistributedDataParallel::defer_average_to";
    if (in_step_) {
      throw Error(comm_->rank(), operation,
                  "called in the middle of a step: finish_gradient_sync() first");
    }
    auto grads = opt.grads();
    if (static_cast<const void*>(grads.data()) != grads_address_ || grads.size() != numel_) {
      throw Error(comm_->rank(), operation,
                  "the optimizer's gradients (" + std::to_string(grads.size()) +
                      " elements) are not the wrapped arena's (" + std::to_string(numel_) +
                      " elements): the scaler would divide other gradients than DDP reduced");
    }
    hand_average_ = nullptr;
    if (!average_deferrable_ || !scaler.is_enabled()) return false;
    hand_average_ = [&scaler, &opt](double divisor) {
      scaler.divide_at_next_unscale(opt, divisor);
    };
    return true;
  }

  /// ZeRO (shard<1>, shard<2>): restricts `opt` (optim::SGD or optim::AdamW over the wrapped
  /// arena, not stepped yet) to this rank's parts of every bucket: its state is allocated for
  /// those elements only, its step() updates only them, and its state_dict() becomes a
  /// collective that gathers every rank's parts into the full state (the layout a DDP run saves).
  /// Step it through step(opt) / step(scaler, opt), which all-gather the parameters afterwards.
  /// Without a shard policy it does nothing (plain DDP keeps a full optimizer on every rank).
  template <class O>
  requires requires(O& o) {
    typename O::state_type;
    o.arena_values();
  }
  void shard(O& opt) {
    if constexpr (config::shard_stage > 0) {
      using S = typename O::state_type;
      using Space = typename O::memory_space;
      const auto arena = opt.arena_values();
      detail::ddp::require_same_arena(arena.data(), arena.size(), values_address_, numel_, rank());
      auto gather = [this, exec = opt.executor()](View<S, Space> full, std::size_t begin,
                                                  std::size_t end) {
        // In the executor's stream order: freed there, after the collectives handed back to it.
        Buffer<S, Space> staging(layout_.staging(), exec);
        detail::ddp::all_gather_parts<S, Space>(*comm_, exec, layout_, full.data(), staging.data(),
                                                begin, end);
      };
      opt.shard_to(layout_.owned(), std::move(gather));
      sharded_.push_back(static_cast<const void*>(&opt));
    } else {
      (void)opt;
    }
  }

  /// Steps `opt` after finish_gradient_sync(): opt.step() and, under shard<1>/shard<2>, the
  /// all_gather that brings every rank's updated parts to every rank (under prefetch_parameters
  /// started and left in flight: see wait_parameters). Collective under sharding.
  /// An Error under sharding when `opt` was not given to shard() (a full optimizer would step
  /// every element on every rank: under shard<2> with gradients only partly reduced).
  template <class O>
  requires requires(O& o) { o.step(); }
  void step(O& opt) {
    require_sharded(opt, "DistributedDataParallel::step");
    if (join_record_) join_note(join_step, join_slot(&opt, nullptr, [this, &opt] { step(opt); }));
    opt.step();
    gather_shards();
  }

  /// The same through a GradScaler: scaler.step(opt), then the all_gather when it stepped;
  /// returns whether it stepped (call scaler.update() after it). Under shard<2> the scaler must
  /// agree across ranks, GradScaler(comm) (docs/zero.md); an Error otherwise.
  template <class Scaler, class O>
  requires requires(Scaler& scaler, O& o) {
    { scaler.step(o) } -> std::convertible_to<bool>;
    { scaler.agrees_across_ranks() } -> std::convertible_to<bool>;
  }
  bool step(Scaler& scaler, O& opt) {
    const char* operation = "DistributedDataParallel::step";
    require_sharded(opt, operation);
    if (join_record_) {
      // A joined rank's shadow of finish_gradient_sync() left the division to this replay.
      join_note(join_step, join_slot(&opt, &scaler, [this, &scaler, &opt] {
                  if (hand_average_ && average_divisor() > 1) hand_average_(average_divisor());
                  step(scaler, opt);
                  if constexpr (requires { scaler.update(); }) scaler.update();
                }));
    }
    if constexpr (config::shard_stage == 2) {
      if (comm_->size() > 1 && scaler.is_enabled() && !scaler.agrees_across_ranks()) {
        throw Error(comm_->rank(), operation,
                    "under shard<2> each rank holds only its own parts' reduced gradients, so "
                    "the GradScaler's inf check must be agreed across ranks: make it with the "
                    "communicator, GradScaler(comm)");
      }
    }
    const bool stepped = scaler.step(opt);
    if (stepped) {
      gather_shards();
    } else {
      step_due_ = false;  // skipped everywhere: the parameters did not change
    }
    return stepped;
  }

  /// ZeRO: all-gathers the parameters from every rank's own parts, as step() does (for a sharded
  /// optimizer stepped some other way). Collective; nothing without a shard policy. An Error
  /// inside a tandem::Join, whose ranks out of data replay only step(opt) / step(scaler, opt).
  void gather_parameters() {
    if (config::shard_stage > 0 && join_record_) {
      throw Error(comm_->rank(), "DistributedDataParallel::gather_parameters",
                  "inside a tandem::Join, step a sharded optimizer through ddp.step(opt) or "
                  "ddp.step(scaler, opt): a rank that has run out of data replays that call to "
                  "keep its own parts current, and cannot replay a step taken another way");
    }
    gather_shards();
  }

  /// prefetch_parameters: ends the all_gather of the bucket that holds `param` (a trained
  /// parameter of the wrapped arena), which step() left in flight; call it before the forward
  /// first reads `param`. Nothing when that gather has ended, or without the policy.
  template <detail::ddp::arena_parameter P>
  void wait_parameters(const P& param) {
    arena_->wait_gathered(
        plan_.bucket_of[index_checked(param, "DistributedDataParallel::wait_parameters")]);
  }
  /// prefetch_parameters: ends every parameter all_gather still in flight; call it before
  /// reading the parameters outside a forward (EMA, evaluation, a checkpoint).
  void wait_parameters() { arena_->wait_gathered(detail::ddp::all_buckets); }

  /// ZeRO: this rank's shards of the arena (empty without a shard policy).
  [[nodiscard]] const ShardLayout& shard_layout() const noexcept { return layout_; }
  /// The ZeRO stage of the policies: 0 (none), 1 or 2.
  static constexpr int shard_stage = config::shard_stage;

  /// The buckets, in launch order (bucket 0 holds the last-registered parameters).
  [[nodiscard]] const std::vector<Bucket>& buckets() const noexcept { return plan_.buckets; }
  /// The bucket that holds the parameter with registration index `index`.
  [[nodiscard]] std::size_t bucket_of(std::size_t index) const { return plan_.bucket_of.at(index); }
  /// How many buckets of the current step have been started.
  [[nodiscard]] std::size_t buckets_launched() const noexcept { return next_launch_; }
  /// The wrapped communicator.
  [[nodiscard]] Comm& comm() const noexcept { return *comm_; }
  /// This rank in the communicator's group.
  [[nodiscard]] int rank() const { return comm_->rank(); }
  /// Number of ranks in the communicator's group.
  [[nodiscard]] int world_size() const { return comm_->size(); }

 private:
  template <class O>
  void require_sharded(const O& opt, const char* operation) const {
    detail::ddp::require_sharded(config::shard_stage, sharded_, &opt, comm_->rank(), operation);
  }
  void require_stepped(const char* operation) const {
    if (config::shard_stage > 0 && step_due_) {
      detail::ddp::fail_not_stepped(config::shard_stage, comm_->rank(), operation);
    }
  }

  /// The registration index of `param`, a trained parameter of the wrapped arena; an Error
  /// naming `operation` otherwise.
  template <class P>
  std::size_t index_checked(const P& param, const char* operation) const {
    const std::size_t i = param.index();
    if (param.is_buffer() || i >= identity_.size() ||
        identity_[i] != static_cast<const void*>(&param)) {
      throw Error(comm_->rank(), operation,
                  std::string(param.is_buffer() ? "buffer" : "parameter") + " '" +
                      std::string(param.name()) +
                      "' is not a trained parameter of the arena this DistributedDataParallel "
                      "wraps");
    }
    return i;
  }

  void mark(std::size_t i) {
    require_stepped("DistributedDataParallel::grad_ready");
    if (!arena_->gathered(plan_.bucket_of[i])) detail::ddp::fail_not_gathered(rank(), names_[i]);
    if (no_sync_depth_ > 0) {
      touched_[i] = 1;
      return;
    }
    if (ready_[i]) {
      throw Error(comm_->rank(), "DistributedDataParallel::grad_ready",
                  "parameter '" + names_[i] +
                      "' was marked ready twice in one step; call grad_ready once per parameter "
                      "between finish_gradient_sync() calls");
    }
    ready_[i] = 1;
    in_step_ = true;
    --pending_[plan_.bucket_of[i]];
    if constexpr (config::overlapped) {
      while (next_launch_ < plan_.buckets.size() && pending_[next_launch_] == 0) {
        launch(next_launch_);
        ++next_launch_;
      }
    }
  }

  /// Zeroes the gradients of the bucket's parameters that nobody marked since the last sync.
  void zero_unused(const Bucket& bucket) {
    for (std::size_t i = bucket.first_param; i < bucket.end_param; ++i) {
      if (ready_[i] || touched_[i]) continue;
      arena_->zero_grads(offsets_[i], sizes_of(i));
    }
  }

  [[nodiscard]] std::size_t sizes_of(std::size_t i) const {
    return (i + 1 < offsets_.size() ? offsets_[i + 1] : numel_) - offsets_[i];
  }

  /// Pre-divides (or compresses) bucket k and starts its all_reduce.
  void launch(std::size_t k) {
    const Bucket& bucket = plan_.buckets[k];
    if (bucket.count == 0) return;
    join_note(join_bucket, k);
    const double divisor = config::averaged && !hand_average_ ? average_divisor() : 1.0;
    arena_->launch(*comm_, bucket, k, divisor, works_);
  }

  void gather_shards() {
    // Inside a tandem::Join the gather ends here: a joined rank's replay cannot wait later.
    if constexpr (config::shard_stage > 0) {
      arena_->gather_values(*comm_, config::prefetches && !join_record_);
    }
    step_due_ = false;
  }

  // --- tandem::Join (ddp/join.hpp), through detail::join::access -------------------------------
  friend struct detail::join::access;
  /// What join_record_ is told: each collective of a step (buckets by index; steps by the slot
  /// of their replay), then `destroyed` from the destructor.
  enum join_event : int { join_buffers, join_bucket, join_finish, join_step, join_destroyed };

  /// The division averaging uses: the world size, or what the Join says (the ranks with data).
  [[nodiscard]] double average_divisor() const {
    return join_divisor_ > 0 ? join_divisor_ : static_cast<double>(comm_->size());
  }
  void join_note(int event, std::size_t argument) const {
    if (join_record_) join_record_(event, argument);
  }
  /// The replay slot of step(opt) / step(scaler, opt) for these objects, made on first use.
  template <class Replay>
  std::size_t join_slot(const void* opt, const void* scaler, Replay&& replay) {
    for (std::size_t i = 0; i < join_steps_.size(); ++i) {
      if (join_steps_[i].first == std::pair{opt, scaler}) return i;
    }
    join_steps_.emplace_back(std::pair{opt, scaler}, std::forward<Replay>(replay));
    return join_steps_.size() - 1;
  }
  /// A rank that has run out of data shadows one collective of the step the others run, with
  /// zeros for its gradients and the others' values for everything else.
  void join_shadow(int event, std::size_t argument) {
    switch (event) {
      case join_buffers:
        before_forward();
        break;
      case join_bucket:
        arena_->zero_grads(plan_.buckets[argument].offset, plan_.buckets[argument].count);
        launch(argument);
        next_launch_ = argument + 1;
        in_step_ = true;
        break;
      case join_finish:  // zeros for the buckets left (none marked, none accumulated)
        touched_.assign(touched_.size(), 0);
        join_shadowing_ = true;
        try {
          finish_gradient_sync();
        } catch (...) {
          join_shadowing_ = false;
          throw;
        }
        join_shadowing_ = false;
        break;
      case join_step:
        join_steps_.at(argument).second();
        break;
      default:
        break;
    }
  }

  void reset_step() {
    ready_.assign(ready_.size(), 0);
    pending_.assign(plan_.buckets.size(), 0);
    for (std::size_t k = 0; k < plan_.buckets.size(); ++k) {
      pending_[k] = plan_.buckets[k].end_param - plan_.buckets[k].first_param;
    }
    next_launch_ = 0;
    works_.clear();
    in_step_ = false;
  }

  Comm* comm_;
  ShardLayout layout_;  // before arena_, which holds it by address
  std::unique_ptr<detail::ddp::ArenaAccess<Comm>> arena_;
  std::size_t numel_ = 0;
  std::size_t buffer_numel_ = 0;
  const void* grads_address_ = nullptr;   // the arena's gradients, for defer_average_to's check
  const void* values_address_ = nullptr;  // the arena's values, for shard()'s check
  std::vector<const void*> sharded_;      // the optimizers shard() restricted
  bool step_due_ = false;                 // sharding: a sync happened and its step() has not yet
  bool average_deferrable_ = false;       // float gradients (see defer_average_to)
  std::function<void(double)> hand_average_;  // set by defer_average_to: tells the scaler
  std::vector<const void*> identity_;
  std::vector<std::string> names_;
  std::map<std::string, std::size_t, std::less<>> index_of_;
  std::vector<std::size_t> offsets_;
  BucketPlan plan_;

  // The current step.
  std::vector<unsigned char> ready_;    // marked in this step
  std::vector<unsigned char> touched_;  // marked in a no_sync() micro-batch since the last sync
  std::vector<std::size_t> pending_;    // per bucket: parameters not marked yet
  std::size_t next_launch_ = 0;
  std::vector<Work> works_;
  bool in_step_ = false;
  int no_sync_depth_ = 0;

  // tandem::Join: the hook it attached, where buffers come from, the averaging divisor (0: the
  // world size), and the replays of step(...) calls by slot.
  std::function<void(int, std::size_t)> join_record_;
  int broadcast_root_ = 0;
  double join_divisor_ = 0;
  bool join_shadowing_ = false;
  std::vector<std::pair<std::pair<const void*, const void*>, std::function<void()>>> join_steps_;
};

}  // namespace tandem
