// examples/common/elastic.hpp - --elastic for the training examples (issue 32): a run under
// `tandemrun --elastic` whose ranks may be lost (SIGKILL, an OOM kill) goes on with the
// survivors through tandem::Elastic. A training loop is written once against a Group, which is
// either tandem::Elastic<Comm> or FixedGroup<Comm> (the plain run: every step taken at once,
// no heal), both offering comm(), generation(), first_rank(), on_heal(release, rebuild),
// on_join(save, load) (a replacement that tandemrun --elastic --max-restarts started joins the
// running group and receives the state), replacement(), step(compute, apply) and settle(work)
// (docs/elastic.md).
// Here: FixedGroup, what the loop needs across heals (HealingBatches, HealingProgress,
// HealLog, crash_if_asked), what a replacement receives (EpochEnds, joined_state,
// send_on_join), the last check that every rank holds the same parameters
// (check_same_parameters), the set-up's collectives under the heal's protection (SetUp, start)
// and the checks of the flags; elastic_run.hpp starts the group.
//   examples::FixedGroup group(comm);  train(group, s);                 // the plain run
// Needs: common/run.hpp (no tandem::Elastic itself: the CUDA programs include this too).
#pragma once

#include <signal.h>

#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "common/run.hpp"  // the backends' headers, RunSettings
#include "tandem/comm/metrics.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/hash.hpp"
#include "tandem/io/log.hpp"
#include "tandem/io/progress.hpp"
#include "tandem/io/training_state.hpp"

namespace examples {

/// A group that never changes: tandem::Elastic's interface over a plain communicator, so that one
/// training loop serves both runs. step() runs compute then apply, with no commit point, settle()
/// runs its work once; the heal callbacks are never called.
template <class Comm>
class FixedGroup {
 public:
  explicit FixedGroup(Comm& comm) : comm_(&comm) {}
  Comm& comm() { return *comm_; }
  int generation() const noexcept { return 0; }
  int first_rank() const { return comm_->rank(); }
  int heals() const noexcept { return 0; }
  int joins() const noexcept { return 0; }
  bool replacement() const noexcept { return false; }
  std::chrono::steady_clock::duration last_heal_time() const noexcept { return {}; }
  std::chrono::steady_clock::duration last_join_time() const noexcept { return {}; }
  template <class Release, class Rebuild>
  void on_heal(Release&& /*release*/, Rebuild&& /*rebuild*/) {}
  template <class Save, class Load>
  void on_join(Save&& /*save*/, Load&& /*load*/) {}
  template <class Compute, class Apply>
  void step(Compute&& compute, Apply&& apply) {
    compute(*comm_);
    apply();
  }
  template <class Work>
  void settle(Work&& work) {
    work(*comm_);
  }

 private:
  Comm* comm_;
};

/// True for FixedGroup (the plain run), false for tandem::Elastic.
template <class Group>
inline constexpr bool is_fixed_group = false;
template <class Comm>
inline constexpr bool is_fixed_group<FixedGroup<Comm>> = true;

/// The set-up's collectives (the flags' agreement, DDP's constructor, ZeRO's first attach, the
/// resume from a checkpoint, the TensorBoard directory's check) under --elastic: they run in
/// on_heal's rebuild, which Elastic::start() runs first under the heal's protection, for as long
/// as due() says some member has not finished them. A member lost during them heals like one
/// lost in a step, and the new group runs the whole set-up again (the resume included: every
/// member loads the same checkpoint again, whatever part of it each had loaded); a heal after it
/// rebuilds only. A replacement counts as set up when its sender was (counter(), sent with the
/// training state): it runs the set-up with the members when they run it again.
class SetUp {
 public:
  /// Whether the set-up is to run (again) over `comm`: some member has not finished it. An
  /// all_reduce: every member calls it at the same point (first in the rebuild).
  template <class Comm>
  bool due(Comm& comm) const {
    return tandem::reduce_sum(comm, std::int64_t{1} - done_) != 0;
  }
  /// The set-up's last collective returned on this member.
  void finish() noexcept { done_ = 1; }
  /// 1 once finished: what a replacement receives (TrainingState::counter).
  std::int64_t& counter() noexcept { return done_; }

 private:
  std::int64_t done_ = 0;
};

/// Runs the set-up once the group's callbacks are registered: in the plain run `set_up(comm)`
/// now; under --elastic Elastic::start(), whose first rebuild runs it (see SetUp).
template <class Group, class SetUpNow>
void start(Group& group, SetUpNow&& set_up) {
  if constexpr (is_fixed_group<Group>) {
    set_up(group.comm());
  } else {
    group.start();
  }
}

/// The Loader's position across heals: the training loop takes each step's batch through it,
/// and a heal's release stops the Loader (its workers read the sampler, which the rebuild
/// re-splits); the step's next compute then starts it on the new split from the batches done.
template <class Loader>
class HealingBatches {
 public:
  explicit HealingBatches(Loader& loader) : loader_(&loader) {}
  /// An epoch's start: the Loader from batch `done`, in the group's `generation`.
  void start(std::size_t done, int generation) {
    loader_->resume_at(done);
    batch_ = loader_->begin();
    generation_ = generation;
  }
  /// A heal's release: the Loader stops.
  void stop() {
    loader_->finish_epoch();
    generation_ = -1;
  }
  /// The step's batch; after a heal, from the Loader started again on the new split.
  const auto& current(std::size_t done, int generation) {
    if (generation_ != generation) start(done, generation);
    return *batch_;
  }
  /// The step was applied: on to the next batch (not once the Loader stopped: a survivor applies
  /// a step committed elsewhere during the heal, after the release).
  void next(int generation) {
    if (generation_ == generation) ++batch_;
  }

 private:
  Loader* loader_;
  decltype(std::declval<Loader&>().begin()) batch_{};
  int generation_ = -1;  // the group's generation batch_ was started in; -1: stopped
};

/// Rank 0's progress bar over an epoch's batches; after a heal, a new one over the new split's.
class HealingProgress {
 public:
  /// The bar of `group`'s current generation over `left` batches (a new one if the group healed
  /// since the last call), to update after each step.
  template <class Group>
  tandem::Progress& of(Group& group, int epoch, std::size_t left) {
    if (generation_ != group.generation()) {
      progress_.reset();
      progress_.emplace(left, tandem::ProgressOptions{.label = "epoch " + std::to_string(epoch),
                                                      .enabled = group.comm().rank() == 0});
      generation_ = group.generation();
    }
    return *progress_;
  }

 private:
  std::optional<tandem::Progress> progress_;
  int generation_ = -1;
};

/// --crash-at-step (the tests): rank 1 of the group as it first formed kills itself at `step`,
/// once: on the launcher's first attempt, before any heal.
template <class Group>
void crash_if_asked(const RunSettings& settings, std::int64_t step, Group& group) {
  if (settings.crash_at_step == step && group.first_rank() == 1 && group.generation() == 0 &&
      first_attempt())
    ::raise(SIGKILL);
}

/// --crash-in-setup (the tests): rank 1 of the group as it first formed kills itself in the
/// set-up (between DDP's constructor and the resume), once: on the launcher's first attempt,
/// before any heal. The others are then in the set-up's next collective.
template <class Group>
void crash_in_setup_if_asked(const RunSettings& settings, Group& group) {
  if (settings.crash_in_setup && group.first_rank() == 1 && group.generation() == 0 &&
      first_attempt())
    ::raise(SIGKILL);
}

/// The examples' set-up after DDP's constructor: --crash-in-setup's kill, the resume from the
/// newest checkpoint (--resume, --checkpoint-dir) and rank 0's TensorBoard writer into `board`.
/// Collective; under --elastic it runs again after a heal in it (see SetUp).
template <class Group, class Comm, class Loader>
void resume_and_open_board(Group& group, Comm& comm, const RunSettings& settings,
                           tandem::TrainingState& state, Loader& loader, std::size_t& batches_done,
                           std::int64_t& step, std::optional<tandem::TensorBoardWriter>& board) {
  crash_in_setup_if_asked(settings, group);
  resume_from_latest(comm, settings.resume, settings.checkpoint_dir, state, loader, batches_done,
                     step);
  const bool writes = rank0_writes_board(comm, settings.tensorboard);
  board.emplace(settings.tensorboard.empty() ? "." : settings.tensorboard, writes);
}

/// Takes the group's steps and says on rank 0 when one healed: "healed during step S (what):
/// N ranks go on; the heal took T ms, the step X ms" (X: from the step's start to its end on
/// this rank: the work lost in flight, the detection, the heal and the step taken again;
/// bench/elastic/run_elastic.sh reads it), and when replacements joined after it: "K
/// replacement(s) joined after step S (what): N ranks go on; the join took T ms" (T: from the step
/// boundary to the rebuilt group with the state sent); started() says the same of the set-up.
class HealLog {
 public:
  /// group.step(compute, apply), then the lines if the group healed or grew during it.
  template <class Group, class Compute, class Apply>
  void step(Group& group, std::int64_t step, const char* what, Compute&& compute, Apply&& apply) {
    const auto start = std::chrono::steady_clock::now();
    group.step(std::forward<Compute>(compute), std::forward<Apply>(apply));
    const std::string when = "step " + std::to_string(step) + " (" + what + ")";
    report(group, "during " + when, "after " + when, std::chrono::steady_clock::now() - start);
  }
  /// After examples::start: "healed during the set-up: N ranks go on; the heal took T ms" (a rank
  /// lost in the set-up's collectives), and "K replacement(s) joined during the set-up: ...".
  template <class Group>
  void started(Group& group) {
    report(group, "during the set-up", "during the set-up", std::nullopt);
  }

 private:
  using ms = std::chrono::duration<double, std::milli>;
  template <class Group>
  void report(Group& group, const std::string& healed, const std::string& joined,
              std::optional<std::chrono::steady_clock::duration> step_time) {
    if (group.heals() != seen_) {
      seen_ = group.heals();
      auto line = tandem::log0(group.comm());
      line << "healed " << healed << ": " << group.comm().size() << " ranks go on; the heal took "
           << ms(group.last_heal_time()).count() << " ms";
      if (step_time) line << ", the step " << ms(*step_time).count() << " ms";
    }
    if (group.joins() != joined_) {
      tandem::log0(group.comm()) << group.joins() - joined_ << " replacement(s) joined " << joined
                                 << ": " << group.comm().size() << " ranks go on; the join took "
                                 << ms(group.last_join_time()).count() << " ms";
      joined_ = group.joins();
    }
  }

  int seen_ = 0;
  int joined_ = 0;
};

/// The world size the job's ranks first formed with: this process's group's size, or on a
/// replacement (which joins a group that may have shrunk) the launcher's WORLD_SIZE, so that what
/// every member computed from it at the start (the schedule's length) is computed alike.
template <class Group>
int first_world_size(Group& group) {
  if (group.replacement()) {
    const char* text = std::getenv("WORLD_SIZE");
    const auto size = tandem::parse_int(text ? text : "");
    if (size && *size > 0) return static_cast<int>(*size);
  }
  return group.comm().size();
}

/// --elastic's last check, between steps (group.settle): every member, the healed survivors and
/// the replacements included, holds the same parameters bit for bit (tandem::agree of their
/// FNV-1a hash: an Error naming the ranks that differ), which rank 0 says. `before(comm)` runs
/// first (under ZeRO the last all_gather of the parameters).
template <class Group, class Params, class Before>
void check_same_parameters(Group& group, Params& params, Before&& before) {
  group.settle([&](auto& comm) {
    before(comm);
    const auto values = params.values();
    const std::uint64_t hash =
        tandem::fnv1a(std::as_bytes(std::span(values.data(), values.size())));
    tandem::agree(comm, {{"the parameters' FNV-1a hash", hash}});
    tandem::log0(comm) << "the " << comm.size() << " ranks hold the same parameters";
  });
}

/// Where a group stands at an epoch's end besides the training state, sent to a replacement with
/// it so that it takes up the loop at the members' point: the epochs evaluated (and the last
/// evaluation's results, bit for bit) and the epochs checkpointed.
struct EpochEnds {
  std::int64_t evaluated = 0;  // epochs evaluated
  std::int64_t saved = 0;      // epochs checkpointed
  std::int64_t accuracy_bits = 0;
  std::int64_t ema_accuracy_bits = 0;

  /// The evaluation of `epoch` is done (an apply: local).
  void evaluated_epoch(int epoch, double accuracy, double ema_accuracy) {
    evaluated = epoch + 1;
    accuracy_bits = std::bit_cast<std::int64_t>(accuracy);
    ema_accuracy_bits = std::bit_cast<std::int64_t>(ema_accuracy);
  }
  [[nodiscard]] double accuracy() const { return std::bit_cast<double>(accuracy_bits); }
  [[nodiscard]] double ema_accuracy() const { return std::bit_cast<double>(ema_accuracy_bits); }
};

/// What a replacement receives: `state`, `ends`' counters and whether the set-up is done (add
/// the program's own to it).
inline tandem::TrainingState joined_state(const tandem::TrainingState& state, EpochEnds& ends,
                                          SetUp& set_up) {
  tandem::TrainingState joined = state;
  joined.counter("set_up", set_up.counter())
      .counter("evaluated", ends.evaluated)
      .counter("saved", ends.saved)
      .counter("accuracy_bits", ends.accuracy_bits)
      .counter("ema_accuracy_bits", ends.ema_accuracy_bits);
  return joined;
}

/// group.on_join over `joined` (which must outlive the group's steps): a member sends it, a
/// replacement loads it.
template <class Group>
void send_on_join(Group& group, tandem::TrainingState& joined) {
  group.on_join([&joined] { return joined.to_bytes(); },
                [&joined, &group](std::span<const std::byte> bytes) {
                  joined.from_bytes(bytes, group.comm().rank());
                });
}

/// Why `backend` cannot run --elastic, or "".
inline std::string elastic_problem(const std::string& backend) {
  if (backend == "local") {
    return "--elastic with --backend local: threads of one process are lost together with it; "
           "start the ranks as processes under `tandemrun --elastic` (backend shm, gloo or "
           "hierarchical)";
  }
  if (backend == "mpi") {
    return "--elastic with --backend mpi: MPI cannot shrink a communicator (mpirun ends the job "
           "when a rank dies); use shm, gloo or hierarchical under `tandemrun --elastic`";
  }
  return {};
}

/// The store the survivors meet in: `given` (file:///PATH) when set, else a file named after the
/// launcher's run id (TORCHELASTIC_RUN_ID, unique per tandemrun launch) in $TMPDIR or /tmp.
/// nullopt outside a launcher without `given`.
inline std::optional<std::string> elastic_store_url(const std::string& given) {
  if (!given.empty()) return given;
  const char* run_id = std::getenv("TORCHELASTIC_RUN_ID");
  if (!run_id || !*run_id || std::string(run_id) == "none") return std::nullopt;
  const char* tmp = std::getenv("TMPDIR");
  return "file://" + std::string(tmp && *tmp == '/' ? tmp : "/tmp") + "/tandem-elastic-" + run_id +
         ".store";
}

}  // namespace examples
