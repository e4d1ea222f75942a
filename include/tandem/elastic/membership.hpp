// tandem/elastic/membership.hpp - how the survivors of a lost rank agree on the group that goes on:
// a membership round in the job's store, one per generation, closed within a bounded time; and
// the decision every survivor takes from it (who is in, the new dense ranks, which step the
// group redoes and which survivors first apply the step that was committed before the loss);
// and what a process that joins a running group (a replacement, or a new member of a group that
// grows) and the group tell each other in the store (how_it_comes, JoinRequest, Admission,
// refusal).
//   tandem::elastic::MembershipRound round(store, self_record, {.window = 10s});
//   auto agreed = round.run(/*generation=*/1, previous_members, {steps_done, reduced});
//   auto plan = tandem::elastic::plan_heal(agreed.records);   // pure: unit-tested alone
// Needs: the Store concept (rendezvous/store.hpp); POSIX and /proc to tell a lost process on this
// host (one whose process is gone or stopped) without waiting for the window.
#pragma once

#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/elastic/options.hpp"
#include "tandem/rendezvous/store.hpp"

namespace tandem::elastic {

/// Where a member runs, written once into the store when the group first forms, so that a
/// survivor on the same host can tell a lost member (process gone, or stopped by SIGSTOP) at
/// once instead of waiting for the round's window.
struct MemberRecord {
  std::string host;       ///< gethostname()
  std::string pid_space;  ///< the PID namespace (/proc/self/ns/pid), so that pids compare
  long pid = 0;           ///< its process
  long tid = 0;           ///< the thread that joined (ranks that are threads of one process)
  int node_rank = 0;      ///< World::node_rank when the group first formed

  /// This thread's record.
  static MemberRecord mine(const World& world) {
    MemberRecord record;
    char name[256] = {};
    if (::gethostname(name, sizeof name - 1) != 0) name[0] = '?';
    record.host = name;
    char link[128] = {};
    const auto length = ::readlink("/proc/self/ns/pid", link, sizeof link - 1);
    record.pid_space = length > 0 ? std::string(link, static_cast<std::size_t>(length)) : "?";
    record.pid = static_cast<long>(::getpid());
    record.tid = static_cast<long>(::syscall(SYS_gettid));
    record.node_rank = world.node_rank;
    return record;
  }

  /// "host pid_space pid tid node_rank" (host names and namespace links hold no spaces).
  [[nodiscard]] std::string text() const {
    return host + " " + pid_space + " " + std::to_string(pid) + " " + std::to_string(tid) + " " +
           std::to_string(node_rank);
  }

  /// The record text() wrote; nullopt when it is not one.
  static std::optional<MemberRecord> parse(const std::string& text) {
    std::istringstream in(text);
    MemberRecord record;
    if (!(in >> record.host >> record.pid_space >> record.pid >> record.tid >> record.node_rank)) {
      return std::nullopt;
    }
    return record;
  }

  /// True when this member is known lost from here: it ran on this host, in this PID namespace,
  /// and its process (or, in this process, its thread) is gone, a zombie or stopped. False
  /// when it is alive or cannot be told from here (another host): then only the window decides.
  [[nodiscard]] bool known_lost(const MemberRecord& self) const {
    if (host != self.host || pid_space != self.pid_space || pid_space == "?") return false;
    const std::string stat_path = pid == self.pid
                                      ? "/proc/self/task/" + std::to_string(tid) + "/stat"
                                      : "/proc/" + std::to_string(pid) + "/stat";
    std::ifstream in(stat_path);
    std::string stat;
    if (!in || !std::getline(in, stat)) {
      if (pid == self.pid) return true;  // the thread has ended
      return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
    }
    const auto close = stat.rfind(')');
    if (close == std::string::npos || close + 2 >= stat.size()) return false;
    const char state = stat[close + 2];
    return state == 'Z' || state == 'X' || state == 'T' || state == 't';
  }
};

/// What a survivor says of itself in a round: who it is, how far it got.
struct Arrival {
  int member = 0;               ///< its rank when the job first formed (stable across heals)
  std::int64_t steps_done = 0;  ///< steps it has applied
  bool reduced = false;         ///< the step in flight had its gradients reduced on this rank

  /// "member steps_done reduced" (reduced: 0 or 1), as the round's store keeps it.
  [[nodiscard]] std::string text() const {
    return std::to_string(member) + " " + std::to_string(steps_done) + " " + (reduced ? "1" : "0");
  }
  /// The arrival text() wrote; nullopt when it is not one.
  static std::optional<Arrival> parse(const std::string& text) {
    std::istringstream in(text);
    Arrival arrival;
    int reduced = 0;
    if (!(in >> arrival.member >> arrival.steps_done >> reduced)) return std::nullopt;
    arrival.reduced = reduced != 0;
    return arrival;
  }
};

/// What every survivor decides from the round's arrivals (plan_heal).
struct HealPlan {
  std::vector<int> members;      ///< the new group, by first rank, ascending: new rank = index
  std::int64_t steps_done = 0;   ///< steps every member has applied once the heal is done
  std::vector<int> catching_up;  ///< members that first apply the committed step in flight
};

/// The decision, the same on every survivor because it reads the same arrivals. A step's commit
/// point is the barrier after its gradient reduction: a rank applies step s only after it left
/// that barrier, which every rank entered only once its own reduction had completed. So when one
/// survivor has applied step s, every survivor holds step s's reduced gradients (reduced = true,
/// steps_done = s) and applies them now (catching_up); when none has, all redo step s. Anything
/// else breaks that invariant (a program that stepped outside Elastic::step) and is an Error.
inline HealPlan plan_heal(std::vector<Arrival> arrivals, int rank = unknown_rank) {
  if (arrivals.empty()) throw Error(rank, "elastic heal", "no member arrived in the round");
  std::sort(arrivals.begin(), arrivals.end(),
            [](const Arrival& a, const Arrival& b) { return a.member < b.member; });
  HealPlan plan;
  std::int64_t most = arrivals.front().steps_done;
  for (const auto& a : arrivals) most = std::max(most, a.steps_done);
  for (std::size_t i = 0; i < arrivals.size(); ++i) {
    const auto& a = arrivals[i];
    if (i > 0 && arrivals[i - 1].member == a.member) {
      throw Error(rank, "elastic heal", "member " + std::to_string(a.member) + " arrived twice");
    }
    plan.members.push_back(a.member);
    if (a.steps_done == most) continue;
    if (a.steps_done == most - 1 && a.reduced) {
      plan.catching_up.push_back(a.member);
      continue;
    }
    throw Error(rank, "elastic heal",
                "member " + std::to_string(a.member) + " has applied " +
                    std::to_string(a.steps_done) + " steps " +
                    (a.reduced ? "" : "without the next one's gradients ") + "and another " +
                    std::to_string(most) +
                    ": the steps were not all taken through Elastic::step, so no exact "
                    "state can be agreed");
  }
  plan.steps_done = most;
  return plan;
}

/// The World of member `me` in the group `members` (first ranks, ascending) whose first node
/// ranks are `node_of` (by first rank): dense ranks in that order, nodes renumbered densely in
/// the order of their first member, local ranks in rank order within each node.
inline World world_of(const std::vector<int>& members, const std::map<int, int>& node_of, int me) {
  World world;
  world.world_size = static_cast<int>(members.size());
  std::vector<int> nodes;  // old node ranks, in order of first appearance
  for (int m : members) {
    const int node = node_of.count(m) ? node_of.at(m) : 0;
    if (std::find(nodes.begin(), nodes.end(), node) == nodes.end()) nodes.push_back(node);
  }
  world.nnodes = static_cast<int>(nodes.size());
  const int my_node = node_of.count(me) ? node_of.at(me) : 0;
  world.node_rank =
      static_cast<int>(std::find(nodes.begin(), nodes.end(), my_node) - nodes.begin());
  world.local_rank = 0;
  world.local_world_size = 0;
  for (std::size_t i = 0; i < members.size(); ++i) {
    const int m = members[i];
    if (m == me) world.rank = static_cast<int>(i);
    if ((node_of.count(m) ? node_of.at(m) : 0) != my_node) continue;
    if (m < me) ++world.local_rank;
    ++world.local_world_size;
  }
  return world;
}

/// On a replacement of `rank` in a job of `size` ranks: true when the job's store is in use (a
/// rank joined it: a key `joined_prefix` + rank, as join_store writes) but `rank` never joined, so
/// that the member it replaces was lost at start-up and left nothing in the store. A store no rank
/// has joined yet waits up to `timeout` for one (the launcher may restart a rank lost at start-up
/// before the others opened the store); one that stays empty is a job that has ended.
template <Store S>
bool never_joined(S& store, const std::string& joined_prefix, int rank, int size, Timeout timeout) {
  const auto joined = [&](int r) {
    return store.check(std::vector<std::string>{joined_prefix + std::to_string(r)});
  };
  const Deadline deadline(timeout);
  for (;;) {
    for (int r = 0; r < size; ++r) {
      if (joined(r)) return !joined(rank);
    }
    if (deadline.expired()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

/// How a process started to join a running job (ElasticOptions::replacement) comes to it.
struct Coming {
  int first_size = 0;     ///< the ranks the job formed with (0: no job in the store)
  bool fills_in = false;  ///< it forms generation 0 as the member it replaces (lost at start-up)
  bool grows = false;     ///< a new member (a rank at or beyond first_size): the group grows
};

/// What a process with rank `rank`, started to join the job whose store is `store`, is: the
/// replacement of a member (rank below the job's first size, read from `size_key`, which the
/// first rank to join sets); one that fills in for a member lost before it joined
/// (never_joined); or a new member of a group that grows (tandemrun --nnodes MIN:MAX, a node
/// started later). Waits up to `timeout` for the store to be in use; a store that stays empty is
/// a job that has ended (first_size 0: the join then finds it finished).
template <Store S>
Coming how_it_comes(S& store, const std::string& size_key, const std::string& joined_prefix,
                    int rank, Timeout timeout) {
  Coming coming;
  const Deadline deadline(timeout);
  while (!store.check(std::vector<std::string>{size_key})) {
    if (deadline.expired()) return coming;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const auto text = store.get(size_key);
  try {
    coming.first_size = std::stoi(text);
  } catch (...) {
    throw Error(rank, "elastic join", "the job's world size '" + text + "' is unreadable");
  }
  coming.grows = rank >= coming.first_size;
  coming.fills_in =
      !coming.grows && never_joined(store, joined_prefix, rank, coming.first_size, timeout);
  return coming;
}

/// The most members the group may have, agreed in `store` (key "max_members") by the members
/// that form generation 0: each offers max(`first_size`, `offered`) and all must offer the same
/// (ElasticOptions::max_world_size, which tandemrun sets alike on every node). Raises, naming both,
/// when they differ.
template <Store S>
int agree_max_members(S& store, int member, int first_size, int offered) {
  const std::string mine = std::to_string(std::max(first_size, offered));
  const std::string agreed = store.compare_set("max_members", "", mine);
  if (agreed != mine) {
    throw Error(member, "Elastic",
                "this rank allows the group up to " + mine +
                    " members (ElasticOptions::max_world_size, TANDEM_ELASTIC_MAX_WORLD_SIZE) and "
                    "ranks that formed it earlier " +
                    agreed + ": give every rank the same");
  }
  return std::max(first_size, offered);
}

/// Why a rank is not admitted as a new member of a group of at most `max_members`.
inline std::string beyond_largest(int member, int max_members) {
  return "rank " + std::to_string(member) + " is beyond the group's largest size, " +
         std::to_string(max_members) +
         " ranks (tandemrun --nnodes MIN:MAX sets it to MAX x --nproc-per-node; "
         "ElasticOptions::max_world_size)";
}

/// What the group agreed as its largest size (agree_max_members), as a process that joins it as
/// `member` reads it (waiting at most `timeout`: a new member may come while generation 0 still
/// forms); raises when `member` is beyond it.
/// How many join requests (tickets after `answered`) the heal into `generation` admits. The
/// deciding survivor (the lowest: it sends the state) counts them within await_replacement until
/// `lost` are there, or admits none when it cannot send (`can_send`: on_join, or on_join still to
/// come), and publishes the count; the others read it, so that every survivor forms one group.
template <Store S>
std::int64_t awaited_requests(S& store, int generation, std::int64_t answered, std::size_t lost,
                              bool decides, bool can_send, const ElasticOptions& options) {
  const std::string key = "gen" + std::to_string(generation) + "/requests";
  if (!decides) return std::stoll(store.get(key, options.await_replacement + options.window));
  const Deadline deadline(options.await_replacement);
  std::int64_t requests = answered;
  while (can_send) {
    while (store.check(std::vector<std::string>{"join/" + std::to_string(requests + 1)})) {
      ++requests;
    }
    if (static_cast<std::size_t>(requests - answered) >= lost || deadline.expired()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  store.set(key, std::to_string(requests));
  return requests;
}

template <Store S>
int max_members(S& store, int member, Timeout timeout) {
  const auto text = store.get("max_members", timeout);
  int most = 0;
  try {
    most = std::stoi(text);
  } catch (...) {
    throw Error(member, "elastic join", "the group's largest size '" + text + "' is unreadable");
  }
  if (member >= most) throw Error(member, "elastic join", beyond_largest(member, most));
  return most;
}

/// What a replacement (a process started for a lost member) writes when it asks to join: the
/// first rank it takes over and where it runs.
struct JoinRequest {
  int member = 0;       ///< the first rank it takes over (its RANK)
  MemberRecord record;  ///< where it runs (the lost member's record is replaced by this)

  /// "member host pid_space pid tid node_rank", as the store keeps it.
  [[nodiscard]] std::string text() const { return std::to_string(member) + " " + record.text(); }
  /// The request text() wrote; nullopt when it is not one.
  static std::optional<JoinRequest> parse(const std::string& text) {
    const auto space = text.find(' ');
    if (space == std::string::npos) return std::nullopt;
    JoinRequest request;
    try {
      request.member = std::stoi(text.substr(0, space));
    } catch (...) {
      return std::nullopt;
    }
    auto record = MemberRecord::parse(text.substr(space + 1));
    if (!record || request.member < 0) return std::nullopt;
    request.record = std::move(*record);
    return request;
  }
};

/// What the group answers a replacement: the generation it joins, the steps every member has
/// applied, the member that sends it the state, and the members (first ranks, ascending); or why
/// it was refused.
struct Admission {
  int generation = 0;           ///< the generation the replacement is a member of
  std::int64_t steps_done = 0;  ///< steps applied by the group it joins
  int sender = 0;               ///< the first rank of the member that sends the state
  std::int64_t tickets = 0;     ///< join requests the group has answered, this one among them
  std::vector<int> members;     ///< the new group
  std::string refused;          ///< not empty: it is not admitted, and why

  /// "generation steps_done sender tickets m0 m1 ..." or "refused WHY".
  [[nodiscard]] std::string text() const {
    if (!refused.empty()) return "refused " + refused;
    std::string out = std::to_string(generation) + " " + std::to_string(steps_done) + " " +
                      std::to_string(sender) + " " + std::to_string(tickets);
    for (int m : members) out += " " + std::to_string(m);
    return out;
  }
  /// The admission text() wrote; nullopt when it is not one.
  static std::optional<Admission> parse(const std::string& text) {
    Admission admission;
    if (text.starts_with("refused ")) {
      admission.refused = text.substr(8);
      return admission;
    }
    std::istringstream in(text);
    if (!(in >> admission.generation >> admission.steps_done >> admission.sender >>
          admission.tickets)) {
      return std::nullopt;
    }
    for (int m = 0; in >> m;) admission.members.push_back(m);
    if (admission.members.empty() ||
        !std::is_sorted(admission.members.begin(), admission.members.end())) {
      return std::nullopt;
    }
    return admission;
  }
};

/// Why the group refuses the join request stored as `text` (`request`: its parse), the group
/// being `members` (first ranks) of at most `max_members`; empty when it is admitted: a rank
/// below max_members (the job's first ranks, and with a group that grows the new ones) that is
/// not a live member.
inline std::string refusal(const std::optional<JoinRequest>& request, const std::string& text,
                           const std::vector<int>& members, int max_members) {
  if (!request) return "its request '" + text + "' is unreadable";
  const std::string rank = "rank " + std::to_string(request->member);
  if (request->member >= max_members) return beyond_largest(request->member, max_members);
  if (std::find(members.begin(), members.end(), request->member) != members.end()) {
    return rank + " is a live member";
  }
  return {};
}

/// How a round waits.
struct RoundOptions {
  /// How long a survivor waits, from its own arrival, for members that have neither arrived nor
  /// are known lost (members on other hosts, or alive but not arriving) before the round closes
  /// without them. A member on this host whose process is gone or stopped is not waited for.
  Timeout window = std::chrono::seconds(10);
  /// How often a waiting survivor looks at the round again.
  Timeout poll = std::chrono::milliseconds(5);
};

/// One survivor's side of the membership rounds, in a namespace of the job's store.
///
/// The round of generation g: each survivor takes a ticket (add("gen<g>/arrivals", 1)) and
/// writes its Arrival under it; it closes the round once every member of generation g-1 has
/// arrived or is known lost (MemberRecord::known_lost), or its window has passed: closing adds
/// a large constant to the ticket counter, so the first closer alone learns how many tickets
/// came before the close and publishes that count; a ticket drawn after the close is a member
/// the group left behind (it raises). Every survivor reads the same tickets, so all decide alike.
template <Store S>
class MembershipRound {
 public:
  /// `store`: a namespace of the job's store every member shares; `self`: this member's first
  /// rank and record.
  MembershipRound(S store, int member, MemberRecord self, RoundOptions options = {})
      : store_(std::move(store)), member_(member), self_(std::move(self)), options_(options) {}

  /// Writes this member's record (once, when the group first forms).
  void announce() { store_.set("member/" + std::to_string(member_), self_.text()); }

  /// Takes `record` as `member`'s from now on (a replacement's, once it is admitted) and writes
  /// it into the store for the members that have not looked `member` up yet.
  void replace_record(int member, const MemberRecord& record, bool write) {
    if (write) store_.set("member/" + std::to_string(member), record.text());
    records_[member] = record;
  }

  /// The record `member` announced (looked up once, then kept).
  const MemberRecord& record_of(int member) {
    auto found = records_.find(member);
    if (found != records_.end()) return found->second;
    const auto text = store_.get("member/" + std::to_string(member), options_.window);
    auto parsed = MemberRecord::parse(text);
    if (!parsed) {
      throw Error(member_, "elastic heal",
                  "member " + std::to_string(member) + "'s record '" + text + "' is unreadable");
    }
    return records_.emplace(member, *parsed).first->second;
  }

  /// Runs this survivor's side of generation `generation`'s round, the previous generation's
  /// members being `previous` (first ranks). Returns every arrival admitted, this one among
  /// them; raises when the group re-formed without this member.
  std::vector<Arrival> run(int generation, const std::vector<int>& previous, Arrival mine) {
    const std::string prefix = "gen" + std::to_string(generation) + "/";
    seen_.clear();
    const std::int64_t ticket = store_.add(prefix + "arrivals", 1);
    if (ticket > closed_mark) throw left_behind(generation);
    store_.set(prefix + "arrival/" + std::to_string(ticket), mine.text());
    const Deadline window(options_.window);
    std::optional<std::int64_t> size;
    while (!size) {
      if (store_.check(std::vector<std::string>{prefix + "size"})) {
        size = std::stoll(store_.get(prefix + "size"));
        break;
      }
      const std::int64_t drawn = store_.add(prefix + "arrivals", 0);
      if (drawn < closed_mark && (window.expired() || all_accounted(prefix, drawn, previous))) {
        const std::int64_t after = store_.add(prefix + "arrivals", closed_mark);
        if (after - closed_mark < closed_mark) {  // the first to close: publish the count
          size = after - closed_mark;
          store_.set(prefix + "size", std::to_string(*size));
          break;
        }
      }
      std::this_thread::sleep_for(options_.poll);
    }
    if (ticket > *size) throw left_behind(generation);
    std::vector<Arrival> arrivals;
    for (std::int64_t t = 1; t <= *size; ++t) arrivals.push_back(arrival(prefix, t));
    return arrivals;
  }

 private:
  // Far above any count of tickets: the counter passes it exactly when the round closes.
  static constexpr std::int64_t closed_mark = std::int64_t{1} << 40;

  Arrival arrival(const std::string& prefix, std::int64_t ticket) {
    if (auto found = seen_.find(ticket); found != seen_.end()) return found->second;
    const auto text = store_.get(prefix + "arrival/" + std::to_string(ticket), options_.window);
    auto parsed = Arrival::parse(text);
    if (!parsed) {
      throw Error(member_, "elastic heal", "an arrival record '" + text + "' is unreadable");
    }
    return seen_.emplace(ticket, *parsed).first->second;
  }

  /// Whether every member of the previous generation has arrived (one of the first `drawn`
  /// tickets) or is known lost from here. A member without a record (lost at start-up before it
  /// wrote one) cannot be told lost: the window decides.
  bool all_accounted(const std::string& prefix, std::int64_t drawn,
                     const std::vector<int>& previous) {
    std::set<int> arrived;
    for (std::int64_t t = 1; t <= drawn; ++t) arrived.insert(arrival(prefix, t).member);
    return std::all_of(previous.begin(), previous.end(), [&](int m) {
      if (arrived.count(m) > 0) return true;
      const bool recorded = records_.count(m) > 0 ||
                            store_.check(std::vector<std::string>{"member/" + std::to_string(m)});
      return recorded && record_of(m).known_lost(self_);
    });
  }

  [[nodiscard]] Error left_behind(int generation) const {
    return Error(member_, "elastic heal",
                 "the group re-formed as generation " + std::to_string(generation) +
                     " without this rank (it arrived after the round closed: it was stopped, or "
                     "slower than the window); it cannot rejoin in this version");
  }

  S store_;
  int member_;
  MemberRecord self_;
  RoundOptions options_;
  std::map<int, MemberRecord> records_;
  std::map<std::int64_t, Arrival> seen_;  // this round's arrivals read so far, by ticket
};

}  // namespace tandem::elastic
