// tandem/comm/local/detail/local_group.hpp - the shared state behind tandem::LocalComm: a group of
// ranks that are threads of one process, its generation-counted barrier that also exchanges each
// rank's call description (and checks that the ranks agree), and its point-to-point mailbox.
// Not a public header: include tandem/comm/local/local.hpp.
// Needs: the standard library.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tandem/comm/checked.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/collective_args.hpp"
#include "tandem/comm/detail/collective_op.hpp"
#include "tandem/comm/local/options.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem::detail::local {

using Op = CollectiveOp;

/// What one rank published for one collective (phase 0) or one step inside it (phase > 0).
struct Desc {
  Op op = Op::barrier;
  int phase = 0;
  dtype type = dtype::float32;
  std::size_t count = 0;  ///< the per-op count every rank must agree on
  int root = 0;
  ReduceOp reduce_op = ReduceOp::sum;
  const void* in = nullptr;
  void* out = nullptr;
  int color = 0;
  int key = 0;
};

class Group;

/// Everything the ranks of one collective learn from each other at its first barrier. Immutable
/// once published, so a slow rank reads it while a fast one has moved on.
struct Round {
  std::vector<Desc> descs;
  std::string error;  ///< non-empty: the ranks disagree, and every rank raises this
  std::vector<std::shared_ptr<Group>> split_groups;  ///< per old rank (null: no_color)
  std::vector<int> split_ranks;                      ///< per old rank, its rank in the new group
};

/// Shared by a group made by create_group and every group split from it: a failure of one rank
/// (run_local's abort) wakes every rank blocked in any of them.
class Family {
 public:
  /// `managed`: run_local owns the threads and aborts the family when a rank's function throws.
  explicit Family(bool managed) : managed_(managed) {}

  [[nodiscard]] bool managed() const noexcept { return managed_; }
  void add(const std::shared_ptr<Group>& group);
  void abort(const std::string& reason);

  [[nodiscard]] std::optional<std::string> aborted() const {
    std::lock_guard lock(mutex_);
    return aborted_;
  }

 private:
  const bool managed_;
  mutable std::mutex mutex_;
  std::vector<std::weak_ptr<Group>> groups_;
  std::optional<std::string> aborted_;
};

/// The state the ranks of one LocalComm group share. Every member is guarded by mutex_.
class Group {
 public:
  Group(int size, LocalCommOptions options, std::shared_ptr<Family> family)
      : size_(size),
        options_(options),
        family_(std::move(family)),
        descs_(static_cast<std::size_t>(size)),
        here_(static_cast<std::size_t>(size), 0),
        left_(static_cast<std::size_t>(size), 0) {}

  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] const LocalCommOptions& options() const noexcept { return options_; }
  /// This group's number among the groups this process made (its ranks' flight records name it).
  [[nodiscard]] std::uint64_t serial() const noexcept { return serial_; }
  [[nodiscard]] const std::shared_ptr<Family>& family() const noexcept { return family_; }

  /// Marks the group unusable and wakes every waiter, which raises `reason`. The first reason wins.
  void fail(const std::string& reason) {
    {
      std::lock_guard lock(mutex_);
      if (!broken_) broken_ = reason;
    }
    changed_.notify_all();
  }

  /// Rank `rank` will never call into this group again (its LocalComm was destroyed).
  void leave(int rank) {
    {
      std::lock_guard lock(mutex_);
      left_[static_cast<std::size_t>(rank)] = 1;
    }
    changed_.notify_all();
  }

  /// Publishes `desc` and waits until every rank has published its own. Phase 0 returns the
  /// Round (throws when the ranks disagree); later phases return null. Throws tandem::Error on a
  /// timeout, an abort, or a rank that left without arriving.
  std::shared_ptr<const Round> arrive(int rank, const Desc& desc, const Deadline& deadline) {
    const char* op = name(desc.op);
    std::unique_lock lock(mutex_);
    if (broken_) throw Error(rank, op, *broken_);
    descs_[static_cast<std::size_t>(rank)] = desc;
    here_[static_cast<std::size_t>(rank)] = 1;
    const std::uint64_t generation = generation_;
    if (++arrived_ == size_) {
      finish_generation();
      changed_.notify_all();
    } else {
      while (generation_ == generation) {
        if (broken_) throw Error(rank, op, *broken_);
        if (const auto missing = missing_ranks(true); !missing.empty()) {
          broken_ = rank_list(missing) + " left the group without joining " + op;
          changed_.notify_all();
          throw Error(rank, op, *broken_);
        }
        if (deadline.at() == Deadline::clock::time_point::max()) {
          changed_.wait(lock);
        } else if (changed_.wait_until(lock, deadline.at()) == std::cv_status::timeout &&
                   generation_ == generation && !broken_) {
          std::vector<int> arrived;
          for (int r = 0; r < size_; ++r) {
            if (here_[static_cast<std::size_t>(r)]) arrived.push_back(r);
          }
          broken_ = "timed out after " + describe(deadline.timeout()) + " waiting for " +
                    rank_list(missing_ranks(false)) + " (arrived: " + rank_list(arrived) + ")";
          changed_.notify_all();
          throw Error(rank, op, *broken_);
        }
      }
    }
    if (broken_) throw Error(rank, op, *broken_);
    // No later generation can complete before this rank arrives again, so round_ is ours.
    auto round = desc.phase == 0 ? round_ : nullptr;
    if (round && !round->error.empty()) throw Error(rank, op, round->error);
    return round;
  }

  /// Eager send: copies the elements into the mailbox of (src, dst, tag).
  void post(int src, int dst, int tag, dtype type, const void* data, std::size_t count) {
    Message message{type, count, std::vector<std::byte>(count * size_of(type))};
    if (count) std::memcpy(message.bytes.data(), data, message.bytes.size());
    {
      std::lock_guard lock(mutex_);
      if (broken_) throw Error(src, "send", *broken_);
      mailbox_[{src, dst, tag}].push_back(std::move(message));
    }
    changed_.notify_all();
  }

  /// Waits for the oldest message of (src, dst, tag) and copies it into `data`.
  void take(int src, int dst, int tag, dtype type, void* data, std::size_t count,
            const Deadline& deadline) {
    const auto key = std::tuple(src, dst, tag);
    std::unique_lock lock(mutex_);
    for (;;) {
      if (broken_) throw Error(dst, "recv", *broken_);
      if (auto found = mailbox_.find(key); found != mailbox_.end() && !found->second.empty()) {
        Message message = std::move(found->second.front());
        found->second.pop_front();
        if (found->second.empty()) mailbox_.erase(found);
        lock.unlock();
        if (message.type != type || message.count != count) {
          throw recv_mismatch(dst, src, tag, message.type, message.count, type, count);
        }
        if (count) std::memcpy(data, message.bytes.data(), message.bytes.size());
        return;
      }
      if (left_[static_cast<std::size_t>(src)]) {
        throw Error(dst, "recv",
                    "rank " + std::to_string(src) + " left the group without sending with tag " +
                        std::to_string(tag));
      }
      if (deadline.at() == Deadline::clock::time_point::max()) {
        changed_.wait(lock);
      } else if (changed_.wait_until(lock, deadline.at()) == std::cv_status::timeout) {
        throw Error(dst, "recv",
                    "timed out after " + describe(deadline.timeout()) + " waiting for rank " +
                        std::to_string(src) + " to send with tag " + std::to_string(tag));
      }
    }
  }

 private:
  struct Message {
    dtype type;
    std::size_t count;
    std::vector<std::byte> bytes;
  };

  std::vector<int> missing_ranks(bool only_left) const {
    std::vector<int> missing;
    for (int r = 0; r < size_; ++r) {
      const auto i = static_cast<std::size_t>(r);
      if (!here_[i] && (!only_left || left_[i])) missing.push_back(r);
    }
    return missing;
  }

  // The last rank to arrive: checks agreement, builds the Round, opens the next generation.
  void finish_generation() {
    const Desc& first = descs_.front();
    bool same_step = true;
    bool inside = false;
    for (const auto& d : descs_) {
      same_step = same_step && d.op == first.op && d.phase == first.phase;
      inside = inside || d.phase > 0;
    }
    if (!same_step && inside) {
      broken_ = "ranks lost step inside a collective: " + check_collectives();
    } else if (first.phase == 0) {
      auto round = std::make_shared<Round>();
      round->descs = descs_;
      round->error = check_collectives();
      if (round->error.empty() && first.op == Op::split) make_split(*round);
      round_ = std::move(round);
    }
    std::fill(here_.begin(), here_.end(), 0);
    arrived_ = 0;
    ++generation_;
  }

  /// checked.hpp's comparison of the ranks' calls, with the step inside a collective too. The
  /// sequence number is left out: every rank's call here belongs to the same generation.
  std::string check_collectives() const {
    std::vector<CollectiveFingerprint> calls;
    calls.reserve(descs_.size());
    for (const auto& d : descs_) {
      calls.push_back(make_fingerprint(d.op, 0, d.type, d.count, d.root, d.reduce_op));
    }
    const auto ops = field_values(descs_, [](const Desc& d) { return static_cast<int>(d.op); });
    if (disagreement(ops, show_int).empty()) {
      const auto phases = field_values(descs_, [](const Desc& d) { return d.phase; });
      if (auto text = disagreement(phases, show_int); !text.empty()) {
        return "ranks are at different steps: " + text;
      }
    }
    return fingerprint_disagreement(calls);
  }

  void make_split(Round& round) const {
    round.split_groups.resize(static_cast<std::size_t>(size_));
    round.split_ranks.assign(static_cast<std::size_t>(size_), -1);
    std::vector<int> order(static_cast<std::size_t>(size_));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      const auto& da = descs_[static_cast<std::size_t>(a)];
      const auto& db = descs_[static_cast<std::size_t>(b)];
      return std::tie(da.color, da.key, a) < std::tie(db.color, db.key, b);
    });
    for (std::size_t begin = 0; begin < order.size();) {
      const int color = descs_[static_cast<std::size_t>(order[begin])].color;
      std::size_t end = begin;
      while (end < order.size() && descs_[static_cast<std::size_t>(order[end])].color == color) {
        ++end;
      }
      if (color != no_color) {
        auto group = std::make_shared<Group>(static_cast<int>(end - begin), options_, family_);
        family_->add(group);
        for (std::size_t i = begin; i < end; ++i) {
          round.split_groups[static_cast<std::size_t>(order[i])] = group;
          round.split_ranks[static_cast<std::size_t>(order[i])] = static_cast<int>(i - begin);
        }
      }
      begin = end;
    }
  }

  static std::uint64_t next_serial() noexcept {
    static std::atomic<std::uint64_t> made{0};
    return made++;
  }

  const int size_;
  const LocalCommOptions options_;
  const std::shared_ptr<Family> family_;
  const std::uint64_t serial_ = next_serial();

  std::mutex mutex_;
  std::condition_variable changed_;
  std::uint64_t generation_ = 0;
  int arrived_ = 0;
  std::vector<Desc> descs_;
  std::vector<char> here_;
  std::vector<char> left_;
  std::shared_ptr<const Round> round_;
  std::optional<std::string> broken_;
  std::map<std::tuple<int, int, int>, std::deque<Message>> mailbox_;
};

inline void Family::add(const std::shared_ptr<Group>& group) {
  std::optional<std::string> reason;
  {
    std::lock_guard lock(mutex_);
    std::erase_if(groups_, [](const auto& weak) { return weak.expired(); });
    groups_.push_back(group);
    reason = aborted_;
  }
  if (reason) group->fail(*reason);
}

inline void Family::abort(const std::string& reason) {
  std::vector<std::weak_ptr<Group>> groups;
  {
    std::lock_guard lock(mutex_);
    if (aborted_) return;
    aborted_ = reason;
    groups = groups_;
  }
  for (const auto& weak : groups) {
    if (auto group = weak.lock()) group->fail(reason);
  }
}

}  // namespace tandem::detail::local
