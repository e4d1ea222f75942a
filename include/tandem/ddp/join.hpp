// tandem/ddp/join.hpp - tandem::Join: training on uneven inputs, like PyTorch's
// torch.distributed.algorithms.Join. Ranks that run out of batches shadow the collectives of the
// ranks that still have some (DistributedDataParallel's buffer broadcasts and gradient buckets,
// ZeRO's step and parameter all_gather, SyncBatchNorm's statistics), contributing nothing,
// until every rank is done; then every rank holds the same model.
//   tandem::Join join(ddp, bn1, bn2);
//   for (auto& batch : my_batches) join.step([&] { /* forward, backward, ddp.step(opt) */ });
//   join.finish();  // shadows the others' remaining steps
// Needs: a Communicator of host memory (GlooComm, MpiComm, ShmComm, LocalComm, ...); the
// joinables: DistributedDataParallel (ddp/ddp.hpp) and SyncBatchNorm (nn/sync_batch_norm.hpp).
//
// How. Each step starts with one small collective, an all_gather of one int64 per rank (waited for
// at the first collective a joinable issues, so that it overlaps the forward until then, as
// PyTorch's notify all_reduce does): whether the rank has data, which DistributedDataParallel
// synchronise gradients this step (no no_sync() guard open), and checks that keep misuse loud.
// While a rank runs a step, its joinables note each collective they issue, in order, into the
// step's journal; the first step of each kind (which DDPs synchronise) is kept, and every later
// step of that kind must issue the same collectives (an Error otherwise). A rank that has run out
// of data (in finish()) replays the kept journal of the kind the others announce, each collective
// with a zero contribution: DistributedDataParallel's buckets as zero gradients (into its own
// arena, so that under ZeRO it holds its parts' reduced gradients and steps them), its buffer
// broadcasts received from the lowest rank with data, its steps through ddp.step(opt) /
// ddp.step(scaler, opt) replayed (with scaler.update()), SyncBatchNorm's forward and backward on an
// empty batch (statistics of count 0, so the running statistics count only real samples). Once
// every rank is out of data, each DistributedDataParallel broadcasts its parameters and buffers
// from the lowest of the last ranks to join, as PyTorch's DDP does from the last joiner.
//
// Gradients are divided by the initial world size (JoinOptions::divide_by_initial_world_size,
// PyTorch's default): each sample weighs the same whichever rank had it. With it false, by the
// number of ranks with data in that step. throw_on_early_termination: the first rank to run out
// of data makes every rank raise an Error at the next step instead.
//
// What it asks of the loop: every collective inside join.step() comes from a joinable (a
// collective of your own, such as a logged all_reduce of the loss, is not shadowed: do it outside
// the loop); open ddp.no_sync() before join.step(), not inside it; step a sharded optimizer
// through ddp.step(...); host-side work of a step (an LR schedule, an EMA update) that a rank out
// of data must keep doing goes to after_each_step(); every rank runs at least one step of each
// kind before its data ends; the joinables outlive the Join and do not move. A rank that leaves
// the loop without finish() (an exception, an early return) tells the others, which raise an
// Error naming it at their next step instead of waiting.
#pragma once

#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/hash.hpp"
#include "tandem/ddp/ddp.hpp"
#include "tandem/ddp/detail/join_access.hpp"
#include "tandem/ddp/detail/join_protocol.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// PyTorch's Join arguments, with its defaults.
struct JoinOptions {
  /// Divide gradients by the world size the Join started with, whatever the number of ranks
  /// with data in a step (every sample weighs the same); false: by the ranks with data.
  bool divide_by_initial_world_size = true;
  /// When the first rank runs out of data, every rank raises an Error at that step instead of
  /// shadowing (for loops with collectives of their own).
  bool throw_on_early_termination = false;
};

/// Training on uneven inputs: see the top of this header. Not copyable or movable (its joinables
/// hold a hook into it). Every rank of the joinables' communicator makes one, with the same
/// joinables in the same order and the same options.
template <Communicator Comm>
class Join {
  static_assert(host_accessible<typename Comm::memory_space>,
                "tandem: Join exchanges its per-step status in host memory; a communicator of "
                "device memory only (NcclComm) is not supported yet");

 public:
  /// Attaches the joinables (DistributedDataParallel and SyncBatchNorm objects over one
  /// communicator, each in at most one Join at a time). Not collective.
  template <detail::join::joinable... Joinables>
  requires(sizeof...(Joinables) > 0) explicit Join(Joinables&... joinables)
      : Join(JoinOptions{}, joinables...) {}

  /// The same with options (PyTorch's divide_by_initial_world_size, throw_on_early_termination).
  template <detail::join::joinable... Joinables>
  requires(sizeof...(Joinables) > 0) Join(JoinOptions options, Joinables&... joinables)
      : comm_(&detail::join::access::communicator(first_of(joinables...))),
        options_(options),
        unwinding_(std::uncaught_exceptions()) {
    static_assert((std::same_as<detail::join::comm_of_t<Joinables>, Comm> && ...),
                  "tandem: every joinable of a Join must run over the Join's communicator type");
    int ddps = 0;
    int norms = 0;
    try {
      (add(joinables, ddps, norms), ...);
    } catch (...) {
      detach_all();  // no joinable keeps a hook into a Join that was never made
      throw;
    }
    // The options and the joinables' kinds, one letter each, hashed to the 16 bits the status
    // exchange carries.
    std::string shape;
    shape += options_.divide_by_initial_world_size ? 'd' : '-';
    shape += options_.throw_on_early_termination ? 't' : '-';
    for (const auto& entry : entries_) shape += entry.ddp_index >= 0 ? 'D' : 'B';
    const std::uint64_t hash = fnv1a(shape);
    config_ = static_cast<std::uint16_t>(hash ^ (hash >> 16) ^ (hash >> 32) ^ (hash >> 48));
  }

  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  /// Without finish(): tells the other ranks at their next status exchange (they raise an Error
  /// naming this rank instead of waiting for it), unless an error inside a step left them
  /// inside a collective, or every rank knows already. Then lets go of the joinables.
  ~Join() {
    abandon_exchange();
    if (phase_ == Phase::open || phase_ == Phase::failed) {
      const bool unwinding = std::uncaught_exceptions() > unwinding_;
      try {
        (void)exchange("Join", unwinding ? State::left_with_exception : State::left, 0);
      } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
      }
    }
    detach_all();
  }

  /// One step on a rank that has data: the status exchange, then fn() (the forward, backward
  /// and ddp.step(...)), then the after_each_step() work. Collective. An Error on every rank when
  /// another rank left without finish(), or (throw_on_early_termination) ran out of data, or the
  /// ranks disagree on no_sync(); an Error on this rank when the step issued other collectives
  /// than the first step of its kind.
  template <std::invocable Fn>
  void step(Fn&& fn) {
    require_open("Join::step");
    const std::uint32_t pattern = sync_pattern();
    // The exchange overlaps fn() until the first collective a joinable notes (or fn's end).
    start_exchange(State::active, pattern);
    journal_.clear();
    recording_ = true;
    try {
      std::forward<Fn>(fn)();
      if (pending_) settle_step();
    } catch (...) {
      recording_ = false;
      abandon_exchange();
      if (phase_ == Phase::open) phase_ = Phase::torn;  // the others may be in this step
      throw;
    }
    recording_ = false;
    check_step(pattern);
    ++own_steps_;
    after_step();
  }

  /// This rank has no more data: shadows the steps the other ranks still run, until every rank
  /// has called finish(); then each DistributedDataParallel's parameters and buffers come from
  /// the lowest of the last ranks to finish. Collective. Under throw_on_early_termination an
  /// Error on every rank unless all finish at the same step.
  void finish() {
    require_open("Join::finish");
    detail::join::Verdict verdict;
    if (options_.throw_on_early_termination) {
      verdict = exchange("Join::finish", State::exhausted, 0);
    } else {
      for (;;) {
        verdict = exchange("Join::finish", State::joined, journals_.widest());
        if (verdict.done) break;
        configure(verdict);
        try {
          replay(verdict.pattern);
        } catch (...) {
          phase_ = Phase::torn;
          throw;
        }
        ++shadowed_;
        after_step();
      }
    }
    try {
      for (auto& entry : entries_) {
        if (entry.agree) entry.agree(live(entry), verdict.root);
      }
    } catch (...) {
      phase_ = Phase::torn;
      throw;
    }
    phase_ = Phase::finished;
    detach_all();
  }

  /// Work every step does on the host besides its collectives (an LR schedule, an EMA update,
  /// counting steps): runs after each step's fn on a rank with data and after each shadowed
  /// step on a rank out of data, so that it stays current on every rank. Replaces earlier work.
  void after_each_step(std::function<void()> work) { after_each_step_ = std::move(work); }

  /// Steps this rank ran with data of its own.
  [[nodiscard]] std::size_t own_steps() const noexcept { return own_steps_; }
  /// Steps this rank shadowed after running out of data.
  [[nodiscard]] std::size_t shadowed_steps() const noexcept { return shadowed_; }
  /// Whether finish() has returned.
  [[nodiscard]] bool finished() const noexcept { return phase_ == Phase::finished; }
  /// The options it was made with.
  [[nodiscard]] const JoinOptions& options() const noexcept { return options_; }

 private:
  using State = detail::join::State;
  using access = detail::join::access;
  /// open: usable; finished; told: every rank raised the same Error; torn: an error inside a
  /// step (the others may be inside a collective); failed: an error on this rank between steps.
  enum class Phase { open, finished, told, torn, failed };

  template <class First, class... Rest>
  static First& first_of(First& first, Rest&...) {
    return first;
  }

  template <class J>
  void add(J& joinable, int& ddps, int& norms) {
    using detail::join::kind_of;
    constexpr bool is_ddp = kind_of<J>::value == 1;
    if (&access::communicator(joinable) != comm_) {
      throw Error(comm_->rank(), "Join",
                  "its joinables run over different communicators; a Join takes the "
                  "DistributedDataParallel and SyncBatchNorm of one communicator");
    }
    if (access::attached(joinable)) {
      throw Error(comm_->rank(), "Join",
                  std::string(is_ddp ? "a DistributedDataParallel" : "a SyncBatchNorm") +
                      " is given twice, or belongs to another Join that is still alive");
    }
    if (is_ddp && ddps == 32) {
      throw Error(comm_->rank(), "Join", "a Join takes at most 32 DistributedDataParallel");
    }
    detail::join::Entry entry;
    entry.object = &joinable;
    entry.name = is_ddp ? "DistributedDataParallel #" + std::to_string(ddps)
                        : "SyncBatchNorm #" + std::to_string(norms);
    entry.detach = &access::detach<J>;
    entry.shadow = &access::shadow<J>;
    entry.classify = &access::classify<J>;
    entry.describe = &access::describe<J>;
    if constexpr (is_ddp) {
      entry.ddp_index = ddps++;
      entry.synchronises = &access::synchronises<J>;
      entry.configure = &access::configure<J>;
      entry.agree = &access::agree<J>;
    } else {
      ++norms;
    }
    const auto owner = static_cast<std::uint32_t>(entries_.size());
    entries_.push_back(std::move(entry));
    access::attach(
        joinable, [this, owner](int event, std::size_t argument) { note(owner, event, argument); });
  }

  /// A joinable's hook: one collective of the running step (ignored outside a step of its own:
  /// while a rank shadows, its joinables' replays are not steps to keep).
  void note(std::uint32_t owner, int event, std::size_t argument) {
    auto& entry = entries_[owner];
    if (entry.classify(event) == detail::join::EventClass::destroyed) {
      entry.object = nullptr;
      return;
    }
    if (!recording_) return;
    if (pending_) settle_step();  // before the joinable's first collective of the step
    journal_.push_back({owner, event, argument});
  }

  /// The step's status exchange, waited for: the joinables learn where buffers come from and
  /// what to divide by.
  void settle_step() { configure(settle("Join::step")); }

  void* live(const detail::join::Entry& entry) const {
    if (!entry.object) {
      throw Error(comm_->rank(), "Join",
                  entry.name +
                      " was destroyed while the Join still held it: joinables must "
                      "outlive their Join");
    }
    return entry.object;
  }

  void require_open(const char* operation) const {
    switch (phase_) {
      case Phase::open:
        return;
      case Phase::finished:
        throw Error(comm_->rank(), operation, "the Join has finished already");
      default:
        throw Error(comm_->rank(), operation,
                    "an earlier error ended this Join (the ranks' collectives no longer match)");
    }
  }

  /// The DistributedDataParallel that synchronise gradients in the coming step, as bits.
  [[nodiscard]] std::uint32_t sync_pattern() const {
    std::uint32_t pattern = 0;
    for (const auto& entry : entries_) {
      if (entry.ddp_index >= 0 && entry.synchronises(live(entry))) {
        pattern |= 1u << entry.ddp_index;
      }
    }
    return pattern;
  }

  /// The status exchange: one int64 per rank, all-gathered, and the verdict every rank draws.
  detail::join::Verdict exchange(const char* operation, State state, std::uint32_t pattern) {
    start_exchange(state, pattern);
    return settle(operation);
  }

  void start_exchange(State state, std::uint32_t pattern) {
    detail::join::Status mine;
    mine.state = state;
    mine.shadowed = shadowed_ > 0;
    mine.has_journal = journals_.any();
    mine.config = config_;
    mine.pattern = pattern;
    word_ = detail::join::encode(mine);
    words_.assign(static_cast<std::size_t>(comm_->size()), 0);
    try {
      pending_ =
          comm_->all_gather_async(View<const std::int64_t>(&word_, 1), View<std::int64_t>(words_));
    } catch (...) {
      phase_ = Phase::torn;
      throw;
    }
  }

  /// Waits for the exchange start_exchange() began; never leaves it writing words_.
  void abandon_exchange() noexcept {
    if (!pending_) return;
    try {
      pending_->wait();
    } catch (...) {  // NOLINT(bugprone-empty-catch): the error that brought us here comes first
    }
    pending_.reset();
  }

  detail::join::Verdict settle(const char* operation) {
    Work work = std::move(*pending_);
    pending_.reset();
    try {
      work.wait();
    } catch (...) {
      phase_ = Phase::torn;
      throw;
    }
    ++steps_;
    std::vector<detail::join::Status> statuses;
    statuses.reserve(words_.size());
    for (const auto w : words_) statuses.push_back(detail::join::decode(w));
    auto verdict = detail::join::judge(statuses, steps_);
    if (!verdict.error.empty()) {
      phase_ = Phase::told;
      throw Error(comm_->rank(), operation, verdict.error);
    }
    return verdict;
  }

  /// Where each DistributedDataParallel's buffers come from this step, and what it divides by.
  void configure(const detail::join::Verdict& verdict) {
    const double divisor =
        options_.divide_by_initial_world_size ? 0.0 : static_cast<double>(verdict.active);
    for (auto& entry : entries_) {
      if (entry.configure) entry.configure(live(entry), verdict.root, divisor);
    }
  }

  /// A step of kind `pattern` as this rank ran it first, each collective with nothing of its
  /// own: that journal, or the widest one without the DistributedDataParallel that do not
  /// synchronise now (judge() checked that it covers `pattern`).
  void replay(std::uint32_t pattern) {
    const auto* events = journals_.find(pattern);
    const bool filter = events == nullptr;
    if (filter) events = &journals_.widest_events();
    for (const auto& event : *events) {
      const auto& entry = entries_[event.owner];
      if (filter && entry.ddp_index >= 0 && ((pattern >> entry.ddp_index) & 1u) == 0 &&
          entry.classify(event.kind) != detail::join::EventClass::other) {
        continue;
      }
      entry.shadow(live(entry), event.kind, event.argument);
    }
  }

  /// After a step with data: the no_sync() state it announced held throughout, each announced
  /// DistributedDataParallel finished its synchronisation, and the collectives repeat the first
  /// step of the kind (which a rank out of data would replay).
  void check_step(std::uint32_t pattern) {
    const char* operation = "Join::step";
    if (sync_pattern() != pattern) {
      fail(operation, "a no_sync() guard was opened or closed inside join.step() (" +
                          detail::join::describe_pattern(pattern) + " synchronised at its start, " +
                          detail::join::describe_pattern(sync_pattern()) +
                          " at its end): open the guard before join.step() and close it after");
    }
    for (const auto& entry : entries_) {
      if (entry.ddp_index < 0 || ((pattern >> entry.ddp_index) & 1u) == 0) continue;
      const bool ended = std::ranges::any_of(journal_, [&](const detail::join::Event& e) {
        return &entries_[e.owner] == &entry &&
               entry.classify(e.kind) == detail::join::EventClass::sync_end;
      });
      if (!ended) {
        fail(operation, entry.name +
                            " synchronises gradients in this step (no no_sync() guard was open "
                            "when join.step() began) but finish_gradient_sync() was not called, "
                            "or called under a no_sync() guard opened inside the step: open the "
                            "guard before join.step(), and evaluate outside the Join");
      }
    }
    const std::size_t at = journals_.keep(pattern, journal_);
    if (at != detail::join::Journals::npos) {
      const auto* kept = journals_.find(pattern);
      auto show = [&](const std::vector<detail::join::Event>& events) -> std::string {
        if (at >= events.size()) return "nothing more";
        const auto& e = events[at];
        return entries_[e.owner].name + "'s " + entries_[e.owner].describe(e.kind, e.argument);
      };
      fail(operation, "this step issued other collectives than the first step of its kind (" +
                          detail::join::describe_pattern(pattern) + " synchronising): collective " +
                          std::to_string(at) + " was " + show(*kept) + ", now " + show(journal_) +
                          "; a rank out of data replays the first, so every step of a kind must "
                          "issue the same collectives (evaluate outside the Join)");
    }
  }

  void after_step() {
    if (!after_each_step_) return;
    try {
      after_each_step_();
    } catch (...) {
      phase_ = Phase::failed;
      throw;
    }
  }

  [[noreturn]] void fail(const char* operation, const std::string& cause) {
    phase_ = Phase::failed;
    throw Error(comm_->rank(), operation, cause);
  }

  void detach_all() noexcept {
    for (auto& entry : entries_) {
      if (entry.object) entry.detach(entry.object);
      entry.object = nullptr;
    }
  }

  Comm* comm_;
  JoinOptions options_;
  int unwinding_;  // std::uncaught_exceptions() when made: more at destruction means unwinding
  std::uint16_t config_ = 0;
  std::vector<detail::join::Entry> entries_;
  detail::join::Journals journals_;
  std::vector<detail::join::Event> journal_;  // the running step's
  std::function<void()> after_each_step_;
  std::optional<Work> pending_;  // the running step's status exchange, until settled
  std::int64_t word_ = 0;        // this rank's status in it
  std::vector<std::int64_t> words_;
  Phase phase_ = Phase::open;
  bool recording_ = false;
  std::size_t steps_ = 0;  // status exchanges: the steps of the slowest rank so far
  std::size_t own_steps_ = 0;
  std::size_t shadowed_ = 0;
};

/// `tandem::Join join(ddp, bn);`: the communicator type is the joinables'.
template <detail::join::joinable First, detail::join::joinable... Rest>
Join(First&, Rest&...) -> Join<detail::join::comm_of_t<First>>;
/// `tandem::Join join(tandem::JoinOptions{...}, ddp, bn);`
template <detail::join::joinable First, detail::join::joinable... Rest>
Join(JoinOptions, First&, Rest&...) -> Join<detail::join::comm_of_t<First>>;

}  // namespace tandem
