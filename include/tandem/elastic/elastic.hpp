// tandem/elastic/elastic.hpp - tandem::Elastic<Backend>: a lost rank costs a step, not the job.
// When a rank dies (SIGKILL) or stops (SIGSTOP, seen by the collective timeout), the survivors
// abort the step in flight, agree on the group that goes on through the job's store
// (membership.hpp), rebuild their communicator (and, through the user's callbacks, DDP and the
// sampler) and take the step again: a step is applied once on every rank or on none.
//   tandem::Elastic<tandem::ShmComm> elastic("file:///tmp/job.store", options);
//   if (elastic.finished()) return 0;  // a replacement that came after the run ended
//   std::optional<tandem::DistributedDataParallel<tandem::ShmComm>> ddp;
//   elastic.on_heal([&] { ddp.reset(); },  // before the old group goes
//                   [&](tandem::ShmComm& comm) { ddp.emplace(comm, model.params()); });
//   elastic.on_join([&] { return state.to_bytes(); },  // io/ TrainingState: a replacement's
//                   [&](auto bytes) { state.from_bytes(bytes, elastic.comm().rank()); });
//   ddp.emplace(elastic.comm(), model.params());  // collective: after on_join
//   while (elastic.steps_done() < steps)
//     elastic.step([&](tandem::ShmComm&) { /* forward, backward, ddp->finish_gradient_sync() */ },
//                  [&] { optimizer.step(); });  // local only
// A process that tandemrun --elastic --max-restarts starts for a lost rank, or with a rank beyond
// the first world on a node that came later (--nnodes MIN:MAX; TANDEM_ELASTIC_JOIN=1), joins the
// running group at a step boundary and receives the state on_join names from a live member.
// Needs: a ProcessGroupBackend (ShmComm, GlooComm, HierarchicalComm, LocalComm) and a store that
// outlives any one rank (file://, or torchrun's agent store; env:// keeps the store in rank 0,
// whose loss then cannot be healed). docs/elastic.md: what is exact, which backends, how long.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/metrics.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/elastic/membership.hpp"
#include "tandem/elastic/options.hpp"
#include "tandem/rendezvous/init_method.hpp"
#include "tandem/rendezvous/join.hpp"
#include "tandem/rendezvous/store.hpp"

namespace tandem {

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
      : Elastic(open(world, url, options, env, replaces(elastic, env)), options,
                replaces(elastic, env)) {}

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
      : Elastic(Opened{world, std::move(store)}, options, replaces(elastic, process_env)) {}

  Elastic(const Elastic&) = delete;
  Elastic& operator=(const Elastic&) = delete;
  /// Ends this rank's part of the group. Destroy what holds comm() (DDP) first: declare it after
  /// the Elastic. The release callback is not called here (what it names may be gone already).
  /// A member that ends without an exception in flight tells replacements still waiting that
  /// the job is over (they see finished()).
  ~Elastic() {
    if (std::uncaught_exceptions() != 0 || finished_) return;
    try {
      store_.set("done", std::to_string(steps_done_));
    } catch (...) {  // NOLINT(bugprone-empty-catch): a store gone with the job tells them too
    }
  }

  /// The current generation's communicator (a new object after each heal: take it again, or
  /// rebuild what holds it in the rebuild callback).
  [[nodiscard]] B& comm() {
    if (finished_) {
      throw Error(member_, "Elastic::comm",
                  "this replacement came after the group had finished (see finished())");
    }
    if (!comm_) throw Error(member_, "Elastic::comm", "the group is being re-formed");
    return *comm_;
  }
  /// True on a replacement that came when the group had already finished its run (a member
  /// said so in the store, or the store holds no group: a file:// store is reset once no process
  /// has it open): it has nothing to do and should exit 0. Check it right after construction.
  [[nodiscard]] bool finished() const noexcept { return finished_; }
  /// True on a replacement (a process that joined a running group) until on_join received its
  /// state, and false on a member that formed the group or was admitted and loaded.
  [[nodiscard]] bool awaiting_state() const noexcept { return awaiting_state_; }
  /// Whether this process joined a running group as a replacement.
  [[nodiscard]] bool replacement() const noexcept { return elastic_.replacement; }
  /// Replacements admitted so far (as seen by this member).
  [[nodiscard]] int joins() const noexcept { return joins_; }
  /// How long the last admission of replacements took on this member, from the step boundary
  /// (or the heal's agreement) to the rebuilt group with the state sent: release, rendezvous,
  /// the state's transfer, rebuild; on a replacement, from its start to its loaded state.
  [[nodiscard]] std::chrono::steady_clock::duration last_join_time() const noexcept {
    return last_join_time_;
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

  /// The state a replacement needs: `save()` (called on one member, the sender, when a
  /// replacement is admitted) returns it as bytes (TrainingState::to_bytes: parameters,
  /// optimizer, EMA, GradScaler, RNG streams, the sampler's position), `load(bytes)` restores it
  /// on the replacement (TrainingState::from_bytes). Register it on every member, before the
  /// first step; without it no replacement is admitted. On a replacement the state is received
  /// here, from the sender over comm() (a collective with the members' admission), so register
  /// it after the model, optimizer and sampler exist and before anything collective (DDP's
  /// constructor): the members rebuild DDP once the state is sent.
  void on_join(std::function<std::vector<std::byte>()> save,
               std::function<void(std::span<const std::byte>)> load) {
    save_ = std::move(save);
    load_ = std::move(load);
    if (std::exchange(state_owed_, false)) return send_state(member_);  // see reform
    if (!awaiting_state_) return;
    std::vector<std::uint8_t> bytes;
    broadcast_vector(comm(), bytes, rank_of(sender_));
    load_(std::as_bytes(std::span<const std::uint8_t>(bytes)));
    awaiting_state_ = false;
    last_join_time_ = std::chrono::steady_clock::now() - started_;
  }

  /// Runs on_heal's rebuild(comm()) for the first time under the heal's protection: build DDP
  /// (whose constructor broadcasts) through it, and a member lost before the first step heals
  /// from step 0. Call it once, after on_heal and on_join, before the first step; on a
  /// replacement too (it meets the rebuild the members run once they sent the state).
  void start() {
    check_state_sent("Elastic::start");
    if (!rebuild_) return;
    try {
      rebuild_(comm());
    } catch (const Error& lost) {  // the heal re-forms the group and runs rebuild again
      auto nothing_to_apply = [] {};
      reduced_ = false;
      heal(lost, nothing_to_apply);
    }
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
    if (awaiting_state_) {
      throw Error(member_, "Elastic::step",
                  "this replacement has not received its state: call on_join(save, load) first");
    }
    check_state_sent("Elastic::step");
    const std::int64_t target = steps_done_ + 1;
    std::int64_t requests = 0;
    while (steps_done_ < target) {
      reduced_ = false;
      try {
        compute(comm());
        reduced_ = true;
        requests = commit();
      } catch (const Error& lost) {
        heal(lost, apply);
        continue;
      }
      apply();
      ++steps_done_;
      reduced_ = false;
    }
    if (requests > tickets_) {
      try {
        const auto started = std::chrono::steady_clock::now();
        release_and_drop();
        reform(members_, requests, steps_done_);
        last_join_time_ = std::chrono::steady_clock::now() - started;
      } catch (const Error& lost) {  // a loss while admitting: heal (no step is in flight)
        heal(lost, apply);
      }
    }
  }

  /// Runs `work(comm)` between steps: collectives that take no step (no commit point, nothing
  /// applied, steps_done() unchanged), such as ZeRO's all_gather of the last step's parameters
  /// (ElasticZero::gather). A loss during it heals the group, and work runs again from the start
  /// over the new one: it must be safe to repeat. Every member calls it at the same point.
  template <class Work>
  void settle(Work&& work) {
    check_state_sent("Elastic::settle");
    const auto nothing_to_apply = [] {};
    for (;;) {
      reduced_ = false;
      try {
        work(comm());
        return;
      } catch (const Error& lost) {
        heal(lost, nothing_to_apply);
      }
    }
  }

 private:
  struct Opened {
    World world;
    AnyStore store;
    elastic::Coming coming{};  // a replacement's, or a new member's
  };

  static ElasticOptions replaces(ElasticOptions elastic, const EnvLookup& env) {
    if (const auto join = env("TANDEM_ELASTIC_JOIN"); join && *join == "1") {
      elastic.replacement = true;
    }
    const auto most = env_int_in(env, "TANDEM_ELASTIC_MAX_WORLD_SIZE", 1, INT32_MAX);
    if (most) elastic.max_world_size = static_cast<int>(*most);
    return elastic;
  }

  static Opened open(const World& world, std::string_view url, const options_type& options,
                     const EnvLookup& env, const ElasticOptions& elastic) {
    const InitMethod method = parse_init_method(url, env);
    const World resolved = resolve_world(method, world, env);
    AnyStore store = open_store(method, resolved, options.timeout, env);
    // A replacement's rank is held in the store by the member it replaces: it joins later,
    // unless that member was lost before joining (start-up): then it forms generation 0 as it.
    // A rank beyond the job's first size is a new member of a group that grows.
    elastic::Coming coming;
    if (elastic.replacement) {  // join_store's key of the first size
      coming =
          elastic::how_it_comes(store, "tandem/init/world_size", std::string(detail::join_prefix),
                                resolved.rank, options.timeout);
    }
    if (!elastic.replacement || coming.fills_in) {
      join_store(store, resolved, options.timeout, method.url, detail::wait_notice_interval(env));
    }
    return {resolved, std::move(store), coming};
  }

  Elastic(Opened opened, const options_type& options, ElasticOptions elastic)
      : store_(PrefixStore<AnyStore>("tandem/elastic/", opened.store)),
        options_(options),
        elastic_(elastic),
        member_(opened.world.rank),
        world_size_(opened.coming.first_size > 0 ? opened.coming.first_size
                                                 : opened.world.world_size),
        round_(store_, opened.world.rank, elastic::MemberRecord::mine(opened.world),
               elastic::RoundOptions{.window = elastic.window}) {
    opened.world.validate();
    if (opened.coming.fills_in) elastic_.replacement = false;  // the member, lost at start-up
    if (elastic_.join_check_every < 1) {
      throw Error(member_, "Elastic", "ElasticOptions::join_check_every must be at least 1");
    }
    if (elastic_.replacement) {
      join(elastic::MemberRecord::mine(opened.world));
      return;
    }
    round_.announce();
    max_members_ =
        elastic::agree_max_members(store_, member_, world_size_, elastic_.max_world_size);
    for (int r = 0; r < opened.world.world_size; ++r) members_.push_back(r);
    AnyStore scoped = generation_store();
    try {
      comm_.emplace(B::rendezvous(opened.world, scoped, options_));
    } catch (const Error& lost) {  // a member lost at start-up: heal from step 0
      auto nothing_to_apply = [] {};
      constructing_ = true;
      heal(lost, nothing_to_apply);
      constructing_ = false;
    }
  }

  /// A replacement's side: asks to join (a ticket in the store), waits to be admitted, and forms
  /// the new group's communicator with the members; on_join then receives the state.
  void join(const elastic::MemberRecord& self) {
    // No record of the member it replaces: the store is not the running group's (a FileStore
    // starts empty when no process holds it). A new member may come before the group formed.
    if (member_ < world_size_ &&
        !store_.check(std::vector<std::string>{"member/" + std::to_string(member_)})) {
      finished_ = true;
      return;
    }
    max_members_ = elastic::max_members(store_, member_, elastic_.join_timeout);
    const std::int64_t ticket = store_.add("joins", 1);
    const std::string key = "join/" + std::to_string(ticket);
    store_.set(key, elastic::JoinRequest{member_, self}.text());
    const Deadline deadline(elastic_.join_timeout);
    const std::vector<std::string> answered{key + "/admitted"};
    const std::vector<std::string> done{"done"};
    while (!store_.check(answered)) {
      if (store_.check(done)) {
        finished_ = true;
        return;
      }
      if (deadline.expired()) {
        throw Error(member_, "elastic join",
                    "not admitted within " + describe(elastic_.join_timeout) +
                        " (ElasticOptions::join_timeout): the group never reached a step boundary "
                        "with on_join registered");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const auto text = store_.get(answered.front());
    const auto admission = elastic::Admission::parse(text);
    if (!admission) {
      throw Error(member_, "elastic join", "the admission '" + text + "' is unreadable");
    }
    if (!admission->refused.empty()) {
      throw Error(member_, "elastic join",
                  "the group refused this replacement: " + admission->refused);
    }
    generation_ = admission->generation;
    members_ = admission->members;
    steps_done_ = admission->steps_done;
    sender_ = admission->sender;
    tickets_ = admission->tickets;
    round_.replace_record(member_, self, false);
    std::map<int, int> node_of;
    for (int m : members_) node_of[m] = round_.record_of(m).node_rank;
    AnyStore scoped = generation_store();
    comm_.emplace(B::rendezvous(elastic::world_of(members_, node_of, member_), scoped, options_));
    awaiting_state_ = true;
  }

  /// The commit point: a barrier every member enters once its gradients are reduced; with
  /// on_join registered, an all-reduce (a barrier too) carrying rank 0's count of the join
  /// requests in the store.
  std::int64_t commit() {
    if (!save_) {  // no state to give a replacement: none is admitted, a barrier will do
      comm_->barrier();
      return 0;
    }
    std::int64_t requests = 0;
    if (comm_->rank() == 0 && steps_done_ % elastic_.join_check_every == 0) {
      requests = tickets_;
      while (store_.check(std::vector<std::string>{"join/" + std::to_string(requests + 1)})) {
        ++requests;
      }
    }
    return reduce_sum(*comm_, requests);
  }

  /// Drops what holds the communicator, and the communicator (no loss: nothing to abort).
  void release_and_drop() {
    if (release_) release_();
    comm_.reset();
  }

  /// Forms the next generation of `members` (the group agreed on) and the replacements that
  /// asked with tickets up to `requests`: the lowest member answers each (admitted, or refused:
  /// a rank that is a member, or outside the job), the group meets over the backend, the
  /// lowest member sends the state to the replacements (on_join's save), and rebuild runs.
  void reform(std::vector<int> members, std::int64_t requests, std::int64_t steps) {
    const int sender = members.front();
    const std::vector<int> before = members;
    std::vector<std::pair<std::int64_t, elastic::JoinRequest>> admitted;
    std::vector<std::pair<std::int64_t, std::string>> refused;
    for (std::int64_t t = tickets_ + 1; t <= requests; ++t) {
      const auto text = store_.get("join/" + std::to_string(t), elastic_.window);
      const auto request = elastic::JoinRequest::parse(text);
      const std::string why = elastic::refusal(request, text, members, max_members_);
      if (!why.empty()) {
        refused.emplace_back(t, why);
        continue;
      }
      members.push_back(request->member);
      admitted.emplace_back(t, *request);
    }
    std::sort(members.begin(), members.end());
    const bool answers = member_ == sender;
    for (const auto& [ticket, request] : admitted) {
      round_.replace_record(request.member, request.record, answers);
    }
    if (answers) {
      for (const auto& [ticket, why] : refused) {
        store_.set("join/" + std::to_string(ticket) + "/admitted",
                   elastic::Admission{0, 0, 0, 0, {}, why}.text());
      }
      for (const auto& [ticket, request] : admitted) {
        store_.set(
            "join/" + std::to_string(ticket) + "/admitted",
            elastic::Admission{generation_ + 1, steps, sender, requests, members, {}}.text());
      }
    }
    tickets_ = requests;
    joins_ += static_cast<int>(admitted.size());
    std::map<int, int> node_of;
    for (int m : members) node_of[m] = round_.record_of(m).node_rank;
    members_ = std::move(members);
    ++generation_;
    AnyStore scoped = generation_store();
    comm_.emplace(B::rendezvous(elastic::world_of(members_, node_of, member_), scoped, options_));
    if (!admitted.empty()) {
      // A sender healing in its constructor has no save yet: it sends in on_join (which comes
      // before anything collective), and the others' broadcast here meets it.
      answers && !save_ ? void(state_owed_ = true) : send_state(sender);
    }
    if (rebuild_) rebuild_(*comm_);
  }

  /// A replacement's state (on_join's save on the sender) broadcast from the sender.
  void send_state(int sender) {
    std::vector<std::uint8_t> bytes;
    if (member_ == sender) {
      const auto state = save_();
      bytes.resize(state.size());
      if (!state.empty()) std::memcpy(bytes.data(), state.data(), state.size());
    }
    broadcast_vector(*comm_, bytes, rank_of(sender));
  }

  void check_state_sent(const char* operation) const {
    if (!state_owed_) return;
    throw Error(member_, operation, "call on_join first: a replacement awaits its state");
  }

  /// `member`'s rank in the current group.
  [[nodiscard]] int rank_of(int member) const {
    return static_cast<int>(std::find(members_.begin(), members_.end(), member) - members_.begin());
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
    std::string rebuild_failure;  // the last re-forming's Error, should it not have been a loss
    for (;;) {
      if (heals_ >= elastic_.max_heals) {
        throw Error(member_, "elastic heal",
                    "gave up after " + std::to_string(heals_) +
                        " heals (ElasticOptions::max_heals); the last failure: " + told(cause));
      }
      ++heals_;
      abandon(cause);
      const auto arrivals = agree(cause);
      if (arrivals.size() == members_.size() && !rebuild_failure.empty()) {
        throw Error(member_, "elastic heal",
                    "re-forming the group failed with no rank lost: " + rebuild_failure);
      }
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
      // Replacements: those waiting now, or (await_replacement) those of the lost members
      // that come in time; the lowest survivor decides how many and tells the others. All take
      // its count, on_join or not yet (in the constructor): else each formed its own group.
      std::int64_t requests = tickets_;
      if (elastic_.await_replacement > Timeout::zero()) {
        requests = elastic::awaited_requests(
            store_, generation_ + 1, tickets_, members_.size() - plan.members.size(),
            member_ == plan.members.front(), save_ || constructing_, elastic_);
      }
      try {
        reform(plan.members, requests, plan.steps_done);
        last_heal_time_ = std::chrono::steady_clock::now() - started;
        return;
      } catch (const Error& again) {  // another loss while re-forming: heal again
        reduced_ = false;
        rebuild_failure = told(again);
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
  int world_size_;       // the job's ranks when it first formed: a replacement takes one of them
  int max_members_ = 0;  // the group's largest size (agree_max_members): new members below it
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
  std::function<std::vector<std::byte>()> save_;
  std::function<void(std::span<const std::byte>)> load_;
  std::int64_t tickets_ = 0;  // join requests answered
  int joins_ = 0;
  int sender_ = 0;  // a replacement's sender (first rank)
  bool awaiting_state_ = false;
  bool constructing_ = false;  // healing inside the constructor: on_join is still to come
  bool state_owed_ = false;    // admitted a replacement in that heal, sends in on_join
  bool finished_ = false;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::duration last_join_time_{};
};

}  // namespace tandem
