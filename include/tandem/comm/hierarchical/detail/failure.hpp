// tandem/comm/hierarchical/detail/failure.hpp - how a HierarchicalComm names a failure: a
// level's messages with its rank numbers turned into the group's, and the relay through which
// every rank of the group names the first failure (the rank that was lost), not the peer that
// passed it on.
// Not a public header: include tandem/comm/hierarchical/hierarchical.hpp.
// Needs: the standard library and a tandem::AnyStore.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/rendezvous/store.hpp"

namespace tandem::detail::hierarchical {

/// "ranks 2, 3": a sub-group's members as ranks of this group, for messages.
inline std::string members_text(const std::vector<int>& members) {
  std::string text = members.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < members.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(members[i]);
  }
  return text;
}

/// Each id's number in the order the ids first appear: {5, 5, 2, 5} -> {0, 0, 1, 0}. Nodes are
/// numbered so, in the order of their first rank.
template <class Id>
std::vector<int> numbered_by_first_appearance(const std::vector<Id>& ids) {
  std::vector<Id> distinct;
  std::vector<int> numbers;
  for (const Id& id : ids) {
    auto at = std::find(distinct.begin(), distinct.end(), id);
    if (at == distinct.end()) at = distinct.insert(distinct.end(), id);
    numbers.push_back(static_cast<int>(at - distinct.begin()));
  }
  return numbers;
}

/// A sub-group's message with its rank numbers as this group's: "rank 1 died" in node 1's group
/// (ranks 2, 3) reads "rank 3 died", so that no message names a rank by a number it does not
/// have here. Renumbers the lists after "rank " and "ranks " ("ranks 0, 1 and 2"); a number
/// that is no member is left as it is.
inline std::string renumbered(const std::string& text, const std::vector<int>& members) {
  auto digit = [&](std::size_t at) {
    return at < text.size() && text[at] >= '0' && text[at] <= '9';
  };
  auto letter = [&](std::size_t at) {
    const char c = text[at];
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  };
  std::string out;
  std::size_t i = 0;
  while (i < text.size()) {
    std::size_t word = 0;
    if (i == 0 || !letter(i - 1)) {
      if (text.compare(i, 5, "rank ") == 0) word = 5;
      if (text.compare(i, 6, "ranks ") == 0) word = 6;
    }
    if (word == 0 || !digit(i + word)) {
      out += text[i++];
      continue;
    }
    out.append(text, i, word);
    i += word;
    while (digit(i)) {  // a number, then ", ", " and " or ", and " before another
      std::size_t end = i;
      while (digit(end)) ++end;
      const unsigned long n = std::stoul(text.substr(i, end - i));
      out += n < members.size() ? std::to_string(members[n]) : text.substr(i, end - i);
      i = end;
      for (const char* joint : {", and ", " and ", ", "}) {
        const std::size_t length = std::char_traits<char>::length(joint);
        if (text.compare(i, length, joint) == 0 && digit(i + length)) {
          out += joint;
          i += length;
          break;
        }
      }
    }
  }
  return out;
}

/// The longest a failing rank spends on the relay (or the timeout, where shorter): enough for
/// the others to read the first failure on a loaded machine, short beside a training job's end.
inline constexpr Timeout relay_limit = std::chrono::seconds(5);

/// How often a rank waiting on the store looks whether it may stop waiting (see within).
inline constexpr Timeout relay_look = std::chrono::milliseconds(20);

/// Runs `op(store)` on a thread of its own and waits for it until `deadline`, or until
/// `enough()` (asked every relay_look) holds. Returns what op returned, or nullopt where it threw
/// or still runs then; a late thread finishes on its own (it holds its own copy of the store,
/// bounded by the store's timeout). A failing rank talks to the store this way: its host may be
/// the rank that stopped, and a rank that has already failed must not wait on it for a whole
/// timeout more.
template <class Op, class Enough>
auto within(const AnyStore& store, const Deadline& deadline, Op op, Enough enough)
    -> std::optional<std::invoke_result_t<Op&, AnyStore&>> {
  using Result = std::invoke_result_t<Op&, AnyStore&>;
  struct Shared {
    std::mutex mutex;
    std::condition_variable finished;
    bool done = false;
    std::optional<Result> result;
  };
  auto shared = std::make_shared<Shared>();
  std::thread worker;
  try {
    worker = std::thread([shared, store = AnyStore(store), op]() mutable {
      std::optional<Result> result;
      try {
        result = op(store);
      } catch (...) {  // an unreachable store: the caller goes on with what it knows
      }
      const std::lock_guard lock(shared->mutex);
      shared->result = std::move(result);
      shared->done = true;
      shared->finished.notify_all();
    });
  } catch (const std::system_error&) {
    return std::nullopt;  // no thread to be had: go on without the store
  }
  std::unique_lock lock(shared->mutex);
  bool done = false;
  while (!done && !deadline.expired()) {
    const auto until = std::min(deadline.at(), Deadline::clock::now() + relay_look);
    done = shared->finished.wait_until(lock, until, [&] { return shared->done; });
    if (!done) {
      lock.unlock();
      const bool stop = enough();
      lock.lock();
      if (stop) break;
    }
  }
  lock.unlock();
  if (!done) {
    worker.detach();
    return std::nullopt;
  }
  worker.join();
  return std::move(shared->result);
}

/// The first failure of a group spanning nodes, agreed through the group's store: the rank that
/// fails first records what it saw ("rank 0 saw this communicator's first failure (broadcast: in
/// node 0's group (ranks 0, 1): rank 1 died ...)") before it closes its levels; a rank that fails
/// because a peer closed a level reads it there (or from its node's group, where the peer passed
/// it on) instead of naming the peer. Inactive (no store) on one node, where ShmComm names the
/// lost rank itself.
class FailureRelay {
 public:
  /// Inactive.
  FailureRelay() = default;
  /// A relay for a group of `size` ranks over `store` (a namespace of the group's own), waiting
  /// on it at most `limit` per failure.
  FailureRelay(AnyStore store, int size, Timeout limit)
      : store_(std::move(store)), size_(size), limit_(limit) {}

  [[nodiscard]] bool active() const noexcept { return store_.has_value(); }
  /// How long a failing rank may spend on the relay.
  [[nodiscard]] Timeout limit() const noexcept { return limit_; }

  /// The relay of the group split from this one with `sequence` (its split count, the same on
  /// every rank) and `color`; inactive where the new group is on one node.
  [[nodiscard]] FailureRelay split(std::uint64_t sequence, int color, int size,
                                   bool one_node) const {
    if (!store_ || one_node) return {};
    return FailureRelay(
        AnyStore(PrefixStore<AnyStore>(
            "split" + std::to_string(sequence) + "/color" + std::to_string(color) + "/", *store_)),
        size, limit_);
  }

  /// The group's first failure as the store has it: `mine` where no rank recorded one before,
  /// else the one recorded; nullopt where the store cannot be reached before `deadline`, or where
  /// `enough()` holds first (another way brought the failure). With `defer`, a rank first waits
  /// for another's record (half the time it has, 2 s at most): its own cause is a timeout, and a
  /// rank that saw why (a stopped peer) times out about as soon and will record that.
  template <class Enough>
  [[nodiscard]] std::optional<std::string> first(const std::string& mine, bool defer,
                                                 const Deadline& deadline, Enough enough) const {
    if (!store_) return std::nullopt;
    const Timeout patience =
        defer ? std::min<Timeout>(deadline.remaining() / 2, std::chrono::seconds(2))
              : Timeout::zero();
    return within(
        *store_, deadline,
        [mine, patience](AnyStore& store) {
          if (patience > Timeout::zero()) {
            const Deadline waited(patience);
            try {
              return store.get("first", patience);
            } catch (const Error&) {
              // Nothing recorded in time: this rank's cause is the first. Sooner, the store
              // itself failed (its host is gone), and asking again would only wait to reconnect.
              if (!waited.expired()) throw;
            }
          }
          return store.compare_set("first", "", mine);
        },
        enough);
  }

  /// Says that this rank has raised the failure and waits, until `deadline` at most, for all
  /// ranks but one (the lost one) to say so too: the store's host (rank 0 on env:// and tcp://)
  /// may have failed early, and must serve the ranks that read the failure after it.
  void ended(const Deadline& deadline) const {
    if (!store_) return;
    (void)within(
        *store_, deadline,
        [size = size_, deadline](AnyStore& store) {
          const std::string all = "all but one ended";
          if (store.add("ended", 1) >= size - 1) store.set(all, "1");
          const std::vector<std::string> keys{all};
          store.wait(keys, deadline.remaining());
          return true;
        },
        [] { return false; });
  }

 private:
  std::optional<AnyStore> store_;
  int size_ = 1;
  Timeout limit_ = Timeout::zero();
};

}  // namespace tandem::detail::hierarchical
