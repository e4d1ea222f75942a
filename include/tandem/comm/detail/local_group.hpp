// tandem/comm/detail/local_group.hpp - the shared state behind tandem::LocalComm: a group of
// ranks that are threads of one process, its generation-counted barrier that also exchanges each
// rank's call description (and checks that the ranks agree), its point-to-point mailbox, the
// per-rank worker thread of the `_async` operations, and the element-wise reduction kernels.
// Not a public header: include tandem/comm/local.hpp.
// Needs: the standard library.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem {

/// How a group of LocalComm ranks behaves.
struct LocalCommOptions {
  /// How long a blocking operation waits for the other ranks before it raises tandem::Error.
  Timeout timeout = default_timeout;
};

namespace detail::local {

enum class Op : std::uint8_t {
  all_reduce,
  reduce,
  broadcast,
  all_gather,
  gather,
  scatter,
  reduce_scatter,
  all_to_all,
  barrier,
  split,
};

constexpr const char* name(Op op) noexcept {
  switch (op) {
    case Op::all_reduce:
      return "all_reduce";
    case Op::reduce:
      return "reduce";
    case Op::broadcast:
      return "broadcast";
    case Op::all_gather:
      return "all_gather";
    case Op::gather:
      return "gather";
    case Op::scatter:
      return "scatter";
    case Op::reduce_scatter:
      return "reduce_scatter";
    case Op::all_to_all:
      return "all_to_all";
    case Op::barrier:
      return "barrier";
    case Op::split:
      return "split";
  }
  return "unknown";
}

constexpr bool is_typed(Op op) noexcept {
  return op != Op::barrier && op != Op::split;
}
constexpr bool has_root(Op op) noexcept {
  return op == Op::reduce || op == Op::broadcast || op == Op::gather || op == Op::scatter;
}
constexpr bool has_reduce_op(Op op) noexcept {
  return op == Op::all_reduce || op == Op::reduce || op == Op::reduce_scatter;
}

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

inline std::string rank_list(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i) text += ", ";
    text += std::to_string(ranks[i]);
  }
  return text;
}

/// "" when all ranks have the same value, otherwise "ranks 0, 2: float32; rank 1: int32".
template <class Value, class Show>
std::string disagreement(const std::vector<Value>& values, Show show) {
  std::vector<std::pair<Value, std::vector<int>>> distinct;
  for (std::size_t r = 0; r < values.size(); ++r) {
    auto found = std::find_if(distinct.begin(), distinct.end(),
                              [&](const auto& entry) { return entry.first == values[r]; });
    if (found == distinct.end()) {
      distinct.push_back({values[r], {static_cast<int>(r)}});
    } else {
      found->second.push_back(static_cast<int>(r));
    }
  }
  if (distinct.size() < 2) return {};
  std::string text;
  for (const auto& [value, ranks] : distinct) {
    if (!text.empty()) text += "; ";
    text += rank_list(ranks) + ": " + show(value);
  }
  return text;
}

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
          throw Error(dst, "recv",
                      "rank " + std::to_string(src) + " sent " + std::to_string(message.count) +
                          " " + name(message.type) + " elements with tag " + std::to_string(tag) +
                          ", but this rank receives " + std::to_string(count) + " " + name(type) +
                          " elements");
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
      broken_ = "ranks lost step inside a collective: " + check_agreement();
    } else if (first.phase == 0) {
      auto round = std::make_shared<Round>();
      round->descs = descs_;
      round->error = check_agreement();
      if (round->error.empty() && first.op == Op::split) make_split(*round);
      round_ = std::move(round);
    }
    std::fill(here_.begin(), here_.end(), 0);
    arrived_ = 0;
    ++generation_;
  }

  std::string check_agreement() const {
    auto field = [&](auto get) {
      std::vector<decltype(get(descs_.front()))> values;
      for (const auto& d : descs_) values.push_back(get(d));
      return values;
    };
    auto show_int = [](auto v) { return std::to_string(v); };
    const auto ops = field([](const Desc& d) { return d.op; });
    if (auto text = disagreement(ops, [](Op op) { return std::string(name(op)); }); !text.empty()) {
      return "ranks called different operations: " + text;
    }
    const auto phases = field([](const Desc& d) { return d.phase; });
    if (auto text = disagreement(phases, show_int); !text.empty()) {
      return "ranks are at different steps: " + text;
    }
    const Op op = descs_.front().op;
    if (is_typed(op)) {
      const auto types = field([](const Desc& d) { return d.type; });
      if (auto text = disagreement(types, [](dtype t) { return std::string(name(t)); });
          !text.empty()) {
        return "ranks disagree on the element type: " + text;
      }
      const auto counts = field([](const Desc& d) { return d.count; });
      if (auto text = disagreement(counts, show_int); !text.empty()) {
        return "ranks disagree on the element count: " + text;
      }
    }
    if (has_root(op)) {
      const auto roots = field([](const Desc& d) { return d.root; });
      if (auto text = disagreement(roots, show_int); !text.empty()) {
        return "ranks disagree on the root: " + text;
      }
    }
    if (has_reduce_op(op)) {
      const auto reduce_ops = field([](const Desc& d) { return d.reduce_op; });
      if (auto text =
              disagreement(reduce_ops, [](ReduceOp o) { return std::string(tandem::name(o)); });
          !text.empty()) {
        return "ranks disagree on the reduce op: " + text;
      }
    }
    return {};
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

  const int size_;
  const LocalCommOptions options_;
  const std::shared_ptr<Family> family_;

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

/// The thread that runs one rank's `_async` operations in issue order.
class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ~Worker() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }

  void post(std::function<void()> task) {
    {
      std::lock_guard lock(mutex_);
      tasks_.push_back(std::move(task));
    }
    changed_.notify_all();
  }

  /// Waits until every task posted so far has finished. Each task is itself bounded by the
  /// group's timeout, so this wait is too.
  void drain() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return tasks_.empty() && !busy_; });
  }

 private:
  void loop() {
    std::unique_lock lock(mutex_);
    for (;;) {
      changed_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping, and everything posted has run
      auto task = std::move(tasks_.front());
      tasks_.pop_front();
      busy_ = true;
      lock.unlock();
      task();  // never throws: the task completes its WorkState
      lock.lock();
      busy_ = false;
      changed_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> tasks_;
  bool busy_ = false;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after the members above exist
};

// --- element-wise reductions --------------------------------------------------------------------

/// The type a reduction accumulates in: float for the 16-bit floats, the unsigned twin for signed
/// integers (sums and products wrap in two's complement, as in NCCL, instead of overflowing).
template <class T>
struct accumulator {
  using type = T;
};
template <>
struct accumulator<half> {
  using type = float;
};
template <>
struct accumulator<bfloat16> {
  using type = float;
};

template <class T>
using accumulator_t = typename accumulator<T>::type;

/// Integers are summed and multiplied in their unsigned twin (defined wrap-around).
template <class T>
struct wrapping {
  using type = T;
};
template <std::integral T>
struct wrapping<T> {
  using type = std::make_unsigned_t<T>;
};

template <ReduceOp Op, class T>
T combine(T a, T b) noexcept {
  using Wide = typename wrapping<T>::type;
  if constexpr (Op == ReduceOp::sum || Op == ReduceOp::avg) {
    if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(static_cast<Wide>(static_cast<Wide>(a) + static_cast<Wide>(b)));
    } else {
      return a + b;
    }
  } else if constexpr (Op == ReduceOp::prod) {
    if constexpr (std::is_integral_v<T>) {
      // uint8 promotes to int; 255 * 255 still fits.
      return static_cast<T>(static_cast<Wide>(static_cast<Wide>(a) * static_cast<Wide>(b)));
    } else {
      return a * b;
    }
  } else if constexpr (Op == ReduceOp::min) {
    return b < a ? b : a;
  } else {
    return a < b ? b : a;
  }
}

/// reduce_range for one operation. Works tile by tile: a tile of every source is combined into
/// a small accumulator, in rank order, then written to dst. The loops run over contiguous
/// elements with the operation fixed, so the compiler vectorises them; and because dst is
/// written only after every source of that tile has been read, dst may alias a source.
template <ReduceOp Op, class T>
void reduce_tiles(T* dst, const std::vector<const T*>& sources, std::size_t begin,
                  std::size_t end) {
  using Acc = accumulator_t<T>;
  constexpr std::size_t tile = 1024;
  Acc acc[tile];
  const auto n = sources.size();
  for (std::size_t first = begin; first < end; first += tile) {
    const std::size_t length = std::min(tile, end - first);
    const T* source = sources[0] + first;
    for (std::size_t j = 0; j < length; ++j) acc[j] = static_cast<Acc>(source[j]);
    for (std::size_t s = 1; s < n; ++s) {
      source = sources[s] + first;
      for (std::size_t j = 0; j < length; ++j) {
        acc[j] = combine<Op, Acc>(acc[j], static_cast<Acc>(source[j]));
      }
    }
    if constexpr (Op == ReduceOp::avg && !std::is_integral_v<Acc>) {
      const auto ranks = static_cast<Acc>(n);
      for (std::size_t j = 0; j < length; ++j) acc[j] = acc[j] / ranks;
    }
    T* out = dst + first;
    for (std::size_t j = 0; j < length; ++j) out[j] = static_cast<T>(acc[j]);
  }
}

/// dst[i] = sources[0][i] op sources[1][i] op ... (in rank order) for i in [begin, end), each
/// element accumulated in accumulator_t<T> and rounded once. dst may alias one of the sources.
template <class T>
void reduce_range(T* dst, const std::vector<const T*>& sources, std::size_t begin, std::size_t end,
                  ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return reduce_tiles<ReduceOp::sum>(dst, sources, begin, end);
    case ReduceOp::avg:
      return reduce_tiles<ReduceOp::avg>(dst, sources, begin, end);
    case ReduceOp::prod:
      return reduce_tiles<ReduceOp::prod>(dst, sources, begin, end);
    case ReduceOp::min:
      return reduce_tiles<ReduceOp::min>(dst, sources, begin, end);
    case ReduceOp::max:
      return reduce_tiles<ReduceOp::max>(dst, sources, begin, end);
  }
}

template <class T>
void copy_elements(const T* src, std::size_t count, T* dst) noexcept {
  if (count && src != dst) std::memmove(dst, src, count * sizeof(T));
}

}  // namespace detail::local
}  // namespace tandem
