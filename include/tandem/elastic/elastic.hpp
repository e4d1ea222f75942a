// tandem/elastic/elastic.hpp - tandem::Elastic<Backend>: a lost rank costs a step, not the job.
// When a rank dies (SIGKILL) or stops (SIGSTOP, seen by the collective timeout), the survivors
// abort the step in flight, agree on the group that goes on through the job's store
// (membership.hpp), rebuild their communicator (and, through the user's callbacks, DDP and the
// sampler) and take the step again: a step is applied once on every rank or on none.
//   tandem::Elastic<tandem::ShmComm> elastic("file:///tmp/job.store", options);
//   std::optional<tandem::DistributedDataParallel<tandem::ShmComm>> ddp;
//   ddp.emplace(elastic.comm(), model.params());
//   elastic.on_heal([&] { ddp.reset(); },                                    // before the old
//   group goes
//                   [&](tandem::ShmComm& comm) { ddp.emplace(comm, model.params()); });
//   while (elastic.steps_done() < steps)
//     elastic.step([&](tandem::ShmComm&) { /* forward, backward, ddp->finish_gradient_sync() */ },
//                  [&] { optimizer.step(); });                            // local only
// Needs: a ProcessGroupBackend (ShmComm, GlooComm, HierarchicalComm, LocalComm) and a store that
// outlives any one rank (file://, or torchrun's agent store; env:// keeps the store in rank 0,
// whose loss then cannot be healed). docs/elastic.md: what is exact, which backends, how long.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/elastic/membership.hpp"
#include "tandem/rendezvous/init_method.hpp"
#include "tandem/rendezvous/join.hpp"
#include "tandem/rendezvous/store.hpp"

namespace tandem {

/// How Elastic heals.
struct ElasticOptions {
  /// How long a survivor waits in a membership round for members that neither arrived nor are
  /// known lost (members on another host; a live one that does not come) before the group goes
  /// on without them. Members on this host whose process is gone or stopped are not waited for.
  /// Make it longer than a live survivor can take to arrive (its longest step's local work plus
  /// the detection): one that arrives later is left out and raises.
  Timeout window = std::chrono::seconds(10);
  /// Heals allowed over the whole run; one more loss is the job's end (an Error).
  int max_heals = 16;
  /// The smallest group that goes on; a heal that leaves fewer members raises.
  int min_world_size = 1;
};

/// One rank of an elastic group over backend B. Not copyable or movable: the callbacks given to
/// on_heal usually hold references to it. See the top of this header and docs/elastic.md.
template <ProcessGroupBackend B>
class Elastic {
 public:
  /// The backend's options (its timeout bounds every collective, and so the detection of a
  /// stopped rank).
  using options_type = typename B::options_type;

  /// Joins the job at `url` (as init_process_group: env://, tcp://HOST:PORT, file:///PATH) and
  /// forms generation 0 with every rank of `world`. Collective.
  Elastic(const World& world, std::string_view url, const options_type& options = {},
          ElasticOptions elastic = {}, const EnvLookup& env = process_env)
      : Elastic(open(world, url, options, env), options, elastic) {}

  /// As above, with the World from the launcher's variables.
  explicit Elastic(std::string_view url = "env://", const options_type& options = {},
                   ElasticOptions elastic = {}, const EnvLookup& env = process_env)
      : Elastic(resolve_world(parse_init_method(url, env), std::nullopt, env), url, options,
                elastic, env) {}

  /// Forms generation 0 with every rank of `world`, meeting in `store` (every rank passes the
  /// same store, which must outlive every rank that may be lost: it is where the survivors
  /// meet). Collective.
  Elastic(const World& world, AnyStore store, const options_type& options = {},
          ElasticOptions elastic = {})
      : Elastic(Opened{world, std::move(store)}, options, elastic) {}

  Elastic(const Elastic&) = delete;
  Elastic& operator=(const Elastic&) = delete;
  /// Ends this rank's part of the group. Destroy what holds comm() (DDP) first: declare it after
  /// the Elastic. The release callback is not called here (what it names may be gone already).
  ~Elastic() = default;

  /// The current generation's communicator (a new object after each heal: take it again, or
  /// rebuild what holds it in the rebuild callback).
  [[nodiscard]] B& comm() {
    if (!comm_) throw Error(member_, "Elastic::comm", "the group is being re-formed");
    return *comm_;
  }
  /// 0 for the group as it first formed, +1 per heal.
  [[nodiscard]] int generation() const noexcept { return generation_; }
  /// The current members, by the rank each had when the job first formed (ascending; a
  /// member's rank in comm() is its index here).
  [[nodiscard]] const std::vector<int>& members() const noexcept { return members_; }
  /// This rank's rank when the job first formed (stable across heals).
  [[nodiscard]] int first_rank() const noexcept { return member_; }
  /// Steps applied through step(), the same on every member between steps.
  [[nodiscard]] std::int64_t steps_done() const noexcept { return steps_done_; }
  /// Heals so far.
  [[nodiscard]] int heals() const noexcept { return heals_; }
  /// How long the last heal took, from the failure this rank caught to the rebuilt group (the
  /// rebuild callback included); zero before the first.
  [[nodiscard]] std::chrono::steady_clock::duration last_heal_time() const noexcept {
    return last_heal_time_;
  }

  /// What a heal calls: `release()` first, while the old communicator still exists (drop what
  /// holds it: DDP, SyncBatchNorm, anything with work in flight), and `rebuild(comm)` once the
  /// new communicator is up (build them again over it; re-split the sampler over
  /// comm.size() and comm.rank() there). rebuild may run collectives on `comm`; a loss during
  /// it heals again, and then release() runs again: it must accept having nothing to drop
  /// (std::optional::reset does). Needed whenever anything holds comm().
  void on_heal(std::function<void()> release, std::function<void(B&)> rebuild) {
    release_ = std::move(release);
    rebuild_ = std::move(rebuild);
  }

  /// Takes one step: compute(comm) runs every collective of the step (forward, backward and
  /// the gradient reduction, metrics), then the group passes the step's commit point (a
  /// barrier), then apply() updates the model: local work only, no collectives, and nothing that
  /// release() dropped (opt.step(), not ddp.step(opt): a survivor may apply a step committed
  /// elsewhere during the heal, between release and rebuild). When a rank is lost before the
  /// commit point, the survivors heal and call compute again; when some passed it and others did
  /// not, the others apply the committed step during the heal. Returns once this step is
  /// applied on every member; steps_done() has grown by one.
  template <class Compute, class Apply>
  void step(Compute&& compute, Apply&& apply) {
    const std::int64_t target = steps_done_ + 1;
    while (steps_done_ < target) {
      reduced_ = false;
      try {
        compute(comm());
        reduced_ = true;
        comm().barrier();  // the commit point
      } catch (const Error& lost) {
        heal(lost, apply);
        continue;
      }
      apply();
      ++steps_done_;
    }
  }

 private:
  struct Opened {
    World world;
    AnyStore store;
  };

  static Opened open(const World& world, std::string_view url, const options_type& options,
                     const EnvLookup& env) {
    const InitMethod method = parse_init_method(url, env);
    const World resolved = resolve_world(method, world, env);
    AnyStore store = open_store(method, resolved, options.timeout, env);
    join_store(store, resolved, options.timeout, method.url, detail::wait_notice_interval(env));
    return {resolved, std::move(store)};
  }

  Elastic(Opened opened, const options_type& options, ElasticOptions elastic)
      : store_(PrefixStore<AnyStore>("tandem/elastic/", opened.store)),
        options_(options),
        elastic_(elastic),
        member_(opened.world.rank),
        round_(store_, opened.world.rank, elastic::MemberRecord::mine(opened.world),
               elastic::RoundOptions{.window = elastic.window}) {
    opened.world.validate();
    round_.announce();
    for (int r = 0; r < opened.world.world_size; ++r) members_.push_back(r);
    AnyStore scoped = generation_store();
    comm_.emplace(B::rendezvous(opened.world, scoped, options_));
  }

  AnyStore generation_store() {
    return AnyStore(
        PrefixStore<AnyStore>("gen" + std::to_string(generation_) + "/backend/", AnyStore(store_)));
  }

  /// Ends this rank's part of the old group (the others blocked on it fail now), agrees on the
  /// new one, applies a committed step this rank had not, and rebuilds. Raises when the group
  /// cannot go on (too many heals, too few members, this rank left behind, nobody lost).
  template <class Apply>
  void heal(const Error& cause, Apply& apply) {
    const auto started = std::chrono::steady_clock::now();
    for (;;) {
      if (heals_ >= elastic_.max_heals) {
        throw Error(member_, "elastic heal",
                    "gave up after " + std::to_string(heals_) +
                        " heals (ElasticOptions::max_heals); the last failure: " + told(cause));
      }
      ++heals_;
      abandon(cause);
      const auto arrivals = agree(cause);
      if (arrivals.size() == members_.size()) {
        throw Error(member_, "elastic heal",
                    "every member failed the step and none was lost, so this is no lost rank: " +
                        told(cause));
      }
      const auto plan = elastic::plan_heal(arrivals, member_);
      if (static_cast<int>(plan.members.size()) < elastic_.min_world_size) {
        throw Error(member_, "elastic heal",
                    std::to_string(plan.members.size()) +
                        " members are left, fewer than ElasticOptions::min_world_size (" +
                        std::to_string(elastic_.min_world_size) +
                        "); the first failure: " + told(cause));
      }
      if (steps_done_ < plan.steps_done) {  // the step in flight was committed elsewhere
        apply();                            // members() is still the group that reduced it
        ++steps_done_;
      }
      std::map<int, int> node_of;
      for (int m : plan.members) node_of[m] = round_.record_of(m).node_rank;
      members_ = plan.members;
      ++generation_;
      try {
        AnyStore scoped = generation_store();
        comm_.emplace(
            B::rendezvous(elastic::world_of(members_, node_of, member_), scoped, options_));
        if (rebuild_) rebuild_(*comm_);
        last_heal_time_ = std::chrono::steady_clock::now() - started;
        return;
      } catch (const Error& again) {  // another loss while re-forming: heal again
        reduced_ = false;
        (void)again;
      }
    }
  }

  /// An Error's text inside another's ("rank 1: all_reduce: ..."): "tandem: " once per message.
  static std::string told(const Error& error) {
    const std::string_view text = error.what();
    constexpr std::string_view prefix = "tandem: ";
    return std::string(text.starts_with(prefix) ? text.substr(prefix.size()) : text);
  }

  /// This rank's side of the next generation's round; a store that fails is named as the cause.
  std::vector<elastic::Arrival> agree(const Error& cause) {
    try {
      return round_.run(generation_ + 1, members_, {member_, steps_done_, reduced_});
    } catch (const Error& e) {
      if (e.operation().starts_with("elastic")) throw;
      throw Error(member_, "elastic heal",
                  "the survivors cannot meet: the job's store failed (" + told(e) +
                      "); it must outlive every rank that may be lost (env:// and tcp:// keep it "
                      "in rank 0: use file:// or torchrun's agent store). The step had failed "
                      "with: " +
                      told(cause));
    }
  }

  /// Tells the old group this rank is gone: a backend that can abort does so first (the work in
  /// flight then ends at once), the user releases what holds the communicator, and it is
  /// destroyed (the others see its end).
  void abandon(const Error& cause) {
    if (!comm_) return;
    if constexpr (requires(B & c) { c.abort(std::string()); }) {
      try {
        comm_->abort("rank " + std::to_string(member_) + " left the step to heal the group (" +
                     cause.cause() + ")");
      } catch (...) {  // NOLINT(bugprone-empty-catch): the group is going anyway
      }
    }
    if (release_) release_();
    comm_.reset();
  }

  AnyStore store_;
  options_type options_;
  ElasticOptions elastic_;
  int member_;
  elastic::MembershipRound<AnyStore> round_;
  std::vector<int> members_;
  int generation_ = 0;
  std::int64_t steps_done_ = 0;
  bool reduced_ = false;
  int heals_ = 0;
  std::chrono::steady_clock::duration last_heal_time_{};
  std::optional<B> comm_;
  std::function<void()> release_;
  std::function<void(B&)> rebuild_;
};

}  // namespace tandem
