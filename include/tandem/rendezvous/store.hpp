// tandem/rendezvous/store.hpp - the key-value stores ranks meet through (rendezvous), as in
// torch.distributed: the Store concept, HashStore (one process), PrefixStore (a namespace inside
// another store) and AnyStore (any store behind one type). FileStore and TcpStore have their own
// headers.
//   tandem::HashStore store;
//   store.set("addr", "10.0.0.1:29500");
//   std::string addr = store.get("addr");          // blocks until some thread sets it
//   std::int64_t arrived = store.add("arrived", 1);  // atomic counter, stored as text "1"
// Needs: the standard library.
#pragma once

#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"

namespace tandem {

/// A store opts in with `using store_concept = store_tag;`.
struct store_tag {};

/// True for a type that opted in with `using store_concept = store_tag;`.
template <class S>
inline constexpr bool enable_store = requires {
  typename S::store_concept;
  requires std::same_as<typename S::store_concept, store_tag>;
};

/// A Store: a key-value map shared by the ranks of a job, used to find each other. Keys are
/// strings, values are bytes (any std::string, NUL bytes included). Requirements:
/// 1. it opts in (enable_store) and is movable;
/// 2. `s.set(key, value)` stores `value` under `key`, replacing what was there;
/// 3. `s.get(key)` returns the value, blocking until the key exists, at most `s.timeout()`;
///    `s.get(key, timeout)` waits at most `timeout`. Past it: tandem::Error naming the key and
///    the timeout;
/// 4. `s.add(key, delta)` atomically adds `delta` to the integer stored under `key` (a missing
///    key counts as 0) and returns the new value. The value is stored as decimal text, so get()
///    of a counter returns e.g. "5"; add() on a value that is not a decimal integer (or that
///    would overflow int64) is a tandem::Error;
/// 5. `s.compare_set(key, expected, desired)`, atomically and as torch does it: a missing key
///    with an empty `expected` is set to `desired` and `desired` is returned; a missing key with
///    a non-empty `expected` is left missing and `expected` is returned; a key holding `expected`
///    is set to `desired` and `desired` is returned; otherwise the current value is returned and
///    nothing changes;
/// 6. `s.wait(keys)` / `s.wait(keys, timeout)` block until every key exists (at most the store's
///    timeout or `timeout`); past it: tandem::Error listing the keys still missing;
/// 7. `s.check(keys)` says, without blocking, whether every key exists;
/// 8. `s.delete_key(key)` removes the key and says whether it was there;
/// 9. `s.num_keys()` counts the keys in the store;
/// 10. `s.timeout()` and `s.set_timeout(t)` read and change the default timeout of 3 and 6.
/// Every operation but set_timeout may be called from several threads at once.
template <class S>
concept Store = enable_store<S> && std::movable<S> &&
    requires(S& s, const S& cs, const std::string& key, std::string_view value,
             std::span<const std::string> keys, Timeout timeout, std::int64_t delta) {
  s.set(key, value);
  { s.get(key) } -> std::same_as<std::string>;
  { s.get(key, timeout) } -> std::same_as<std::string>;
  { s.add(key, delta) } -> std::same_as<std::int64_t>;
  { s.compare_set(key, value, value) } -> std::same_as<std::string>;
  s.wait(keys);
  s.wait(keys, timeout);
  { s.check(keys) } -> std::same_as<bool>;
  { s.delete_key(key) } -> std::same_as<bool>;
  { s.num_keys() } -> std::same_as<std::int64_t>;
  { cs.timeout() } -> std::same_as<Timeout>;
  s.set_timeout(timeout);
};

namespace detail {

/// "'a', 'b'" for an error message.
inline std::string quote_keys(std::span<const std::string> keys) {
  std::string text;
  for (const auto& key : keys) {
    if (!text.empty()) text += ", ";
    text += "'" + key + "'";
  }
  return text;
}

inline Error get_timeout_error(std::string_view store, const std::string& key, Timeout timeout) {
  return Error(std::string(store) + ".get",
               "key '" + key + "' was not set within " + describe(timeout));
}

inline Error wait_timeout_error(std::string_view store, std::span<const std::string> missing,
                                Timeout timeout) {
  return Error(std::string(store) + ".wait", (missing.size() == 1 ? "key " : "keys ") +
                                                 quote_keys(missing) +
                                                 (missing.size() == 1 ? " was" : " were") +
                                                 " not set within " + describe(timeout));
}

/// The value add() stores: current (nullptr when the key is missing) + delta.
inline std::int64_t added_value(std::string_view store, const std::string& key,
                                const std::string* current, std::int64_t delta) {
  std::int64_t value = 0;
  if (current != nullptr) {
    const auto parsed = parse_int(*current);
    if (!parsed) {
      throw Error(std::string(store) + ".add",
                  "key '" + key + "' holds '" + *current + "', which is not an integer");
    }
    value = *parsed;
  }
  std::int64_t sum = 0;
  if (__builtin_add_overflow(value, delta, &sum)) {
    throw Error(std::string(store) + ".add", "key '" + key + "': " + std::to_string(value) + " + " +
                                                 std::to_string(delta) + " overflows int64");
  }
  return sum;
}

/// What compare_set does to a key whose value is `current` (nullptr when missing): the value to
/// store (nullopt for no change) and the value to return.
struct CompareSetOutcome {
  std::optional<std::string> store;
  std::string result;
};

inline CompareSetOutcome compare_set_outcome(const std::string* current, std::string_view expected,
                                             std::string_view desired) {
  if (current == nullptr) {
    if (expected.empty()) return {std::string(desired), std::string(desired)};
    return {std::nullopt, std::string(expected)};
  }
  if (*current == expected) return {std::string(desired), std::string(desired)};
  return {std::nullopt, *current};
}

/// Little-endian fixed-width integers for the file and wire formats.
inline void append_u32(std::string& out, std::uint32_t value) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xffu));
}
inline void append_u64(std::string& out, std::uint64_t value) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xffu));
}
inline std::uint32_t load_u32(const char* bytes) {
  std::uint32_t value = 0;
  for (int i = 0; i < 4; ++i) {
    value |= static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  }
  return value;
}
inline std::uint64_t load_u64(const char* bytes) {
  std::uint64_t value = 0;
  for (int i = 0; i < 8; ++i) {
    value |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  }
  return value;
}

}  // namespace detail

/// A Store inside one process: threads share it by copying the handle (copies share the keys;
/// each copy has its own timeout). Thread-safe, but for set_timeout on a shared handle.
class HashStore {
 public:
  /// Opts in as a tandem::Store.
  using store_concept = store_tag;

  /// An empty store whose get() and wait() wait at most `timeout` by default.
  explicit HashStore(Timeout timeout = default_timeout)
      : state_(std::make_shared<State>()), timeout_(timeout) {}

  /// Stores `value` under `key`, replacing what was there (Store requirement 2).
  void set(const std::string& key, std::string_view value) {
    {
      std::lock_guard lock(state_->mutex);
      state_->map.insert_or_assign(key, std::string(value));
    }
    state_->changed.notify_all();
  }

  /// The value under `key`, waiting at most timeout() for the key to exist (requirement 3).
  [[nodiscard]] std::string get(const std::string& key) { return get(key, timeout_); }

  /// The value under `key`, waiting at most `timeout` for the key to exist.
  [[nodiscard]] std::string get(const std::string& key, Timeout timeout) {
    const Deadline deadline(timeout);
    std::unique_lock lock(state_->mutex);
    for (;;) {
      if (const auto it = state_->map.find(key); it != state_->map.end()) return it->second;
      if (!wait_until(lock, deadline)) {
        if (const auto it = state_->map.find(key); it != state_->map.end()) return it->second;
        throw detail::get_timeout_error("HashStore", key, timeout);
      }
    }
  }

  /// Atomically adds `delta` to the decimal counter under `key` (missing: 0); the new value
  /// (requirement 4).
  std::int64_t add(const std::string& key, std::int64_t delta) {
    std::int64_t value = 0;
    {
      std::lock_guard lock(state_->mutex);
      const auto it = state_->map.find(key);
      value = detail::added_value("HashStore", key, it == state_->map.end() ? nullptr : &it->second,
                                  delta);
      state_->map.insert_or_assign(key, std::to_string(value));
    }
    state_->changed.notify_all();
    return value;
  }

  /// Sets `key` to `desired` when it holds `expected` (or is missing and `expected` is empty), as
  /// torch does; returns the value it holds then (requirement 5).
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired) {
    detail::CompareSetOutcome outcome;
    {
      std::lock_guard lock(state_->mutex);
      const auto it = state_->map.find(key);
      outcome = detail::compare_set_outcome(it == state_->map.end() ? nullptr : &it->second,
                                            expected, desired);
      if (outcome.store) state_->map.insert_or_assign(key, *outcome.store);
    }
    if (outcome.store) state_->changed.notify_all();
    return outcome.result;
  }

  /// Blocks until every key exists, at most timeout() (requirement 6).
  void wait(std::span<const std::string> keys) { wait(keys, timeout_); }

  /// Blocks until every key exists, at most `timeout`.
  void wait(std::span<const std::string> keys, Timeout timeout) {
    const Deadline deadline(timeout);
    std::unique_lock lock(state_->mutex);
    while (!all_present(keys)) {
      if (!wait_until(lock, deadline) && !all_present(keys)) {
        std::vector<std::string> missing;
        for (const auto& key : keys) {
          if (!state_->map.contains(key)) missing.push_back(key);
        }
        throw detail::wait_timeout_error("HashStore", missing, timeout);
      }
    }
  }

  /// True when every key exists; never blocks (requirement 7).
  [[nodiscard]] bool check(std::span<const std::string> keys) {
    std::lock_guard lock(state_->mutex);
    return all_present(keys);
  }

  /// Removes `key`; says whether it was there (requirement 8).
  bool delete_key(const std::string& key) {
    std::lock_guard lock(state_->mutex);
    return state_->map.erase(key) > 0;
  }

  /// Number of keys in the store (requirement 9).
  [[nodiscard]] std::int64_t num_keys() {
    std::lock_guard lock(state_->mutex);
    return static_cast<std::int64_t>(state_->map.size());
  }

  /// The default timeout of get() and wait().
  [[nodiscard]] Timeout timeout() const { return timeout_; }
  /// Changes the default timeout of get() and wait().
  void set_timeout(Timeout timeout) { timeout_ = timeout; }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable changed;
    std::map<std::string, std::string, std::less<>> map;
  };

  bool all_present(std::span<const std::string> keys) const {
    for (const auto& key : keys) {
      if (!state_->map.contains(key)) return false;
    }
    return true;
  }

  /// Waits for a change; false once the deadline has passed.
  bool wait_until(std::unique_lock<std::mutex>& lock, const Deadline& deadline) {
    if (deadline.expired()) return false;
    if (deadline.at() == Deadline::clock::time_point::max()) {
      state_->changed.wait(lock);
    } else {
      state_->changed.wait_until(lock, deadline.at());
    }
    return true;
  }

  std::shared_ptr<State> state_;
  Timeout timeout_;
};

/// A Store that puts every key of `S` under "prefix/", so that several users (process groups,
/// say) share one store without their keys meeting. It holds `S` by value: pass a copy of a
/// shared handle (HashStore, FileStore, AnyStore, ...) or move a store in.
/// num_keys() is the count of the underlying store, all prefixes together (as in torch).
/// Errors raised by the underlying store name the full key, "prefix/key".
template <Store S>
class PrefixStore {
 public:
  /// Opts in as a tandem::Store.
  using store_concept = store_tag;

  /// A view of `store` that puts every key under "prefix/".
  PrefixStore(std::string prefix, S store)
      : prefix_(std::move(prefix) + "/"), store_(std::move(store)) {}

  /// Stores `value` under `key`, replacing what was there (Store requirement 2).
  void set(const std::string& key, std::string_view value) { store_.set(full(key), value); }
  /// The value under `key`, waiting at most timeout() for the key to exist (requirement 3).
  [[nodiscard]] std::string get(const std::string& key) { return store_.get(full(key)); }
  /// The value under `key`, waiting at most `timeout` for the key to exist.
  [[nodiscard]] std::string get(const std::string& key, Timeout timeout) {
    return store_.get(full(key), timeout);
  }
  /// Atomically adds `delta` to the decimal counter under `key` (missing: 0); the new value
  /// (requirement 4).
  std::int64_t add(const std::string& key, std::int64_t delta) {
    return store_.add(full(key), delta);
  }
  /// Sets `key` to `desired` when it holds `expected` (or is missing and `expected` is empty), as
  /// torch does; returns the value it holds then (requirement 5).
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired) {
    return store_.compare_set(full(key), expected, desired);
  }
  /// Blocks until every key exists, at most timeout() (requirement 6).
  void wait(std::span<const std::string> keys) { store_.wait(full(keys)); }
  /// Blocks until every key exists, at most `timeout`.
  void wait(std::span<const std::string> keys, Timeout timeout) {
    store_.wait(full(keys), timeout);
  }
  /// True when every key exists; never blocks (requirement 7).
  [[nodiscard]] bool check(std::span<const std::string> keys) { return store_.check(full(keys)); }
  /// Removes `key`; says whether it was there (requirement 8).
  bool delete_key(const std::string& key) { return store_.delete_key(full(key)); }
  /// The number of keys in the underlying store, not only those under this prefix.
  [[nodiscard]] std::int64_t num_keys() { return store_.num_keys(); }
  /// The default timeout of get() and wait().
  [[nodiscard]] Timeout timeout() const { return store_.timeout(); }
  /// Changes the default timeout of get() and wait().
  void set_timeout(Timeout timeout) { store_.set_timeout(timeout); }

  /// "prefix/" as it is put in front of every key.
  [[nodiscard]] const std::string& prefix() const noexcept { return prefix_; }
  /// The store underneath, whose keys carry the prefix.
  [[nodiscard]] S& underlying() noexcept { return store_; }
  /// The store underneath, read-only.
  [[nodiscard]] const S& underlying() const noexcept { return store_; }

 private:
  std::string full(const std::string& key) const { return prefix_ + key; }
  std::vector<std::string> full(std::span<const std::string> keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& key : keys) out.push_back(full(key));
    return out;
  }

  std::string prefix_;
  S store_;
};

/// Any Store behind one type, for code that must not be a template (a process group that keeps
/// "its store"). Copies share the store, its timeout included.
class AnyStore {
 public:
  /// Opts in as a tandem::Store.
  using store_concept = store_tag;

  /// Holds `store` (by value: copy a shared handle in, or move a store in).
  template <class S>
  requires(!std::same_as<std::remove_cvref_t<S>, AnyStore> && Store<std::remove_cvref_t<S>>)
      AnyStore(S store)  // NOLINT(google-explicit-constructor): any Store converts, by design
      : store_(std::make_shared<Model<std::remove_cvref_t<S>>>(std::move(store))) {}

  /// Stores `value` under `key`, replacing what was there (Store requirement 2).
  void set(const std::string& key, std::string_view value) { store_->set(key, value); }
  /// The value under `key`, waiting at most timeout() for the key to exist (requirement 3).
  [[nodiscard]] std::string get(const std::string& key) { return store_->get(key); }
  /// The value under `key`, waiting at most `timeout` for the key to exist.
  [[nodiscard]] std::string get(const std::string& key, Timeout timeout) {
    return store_->get(key, timeout);
  }
  /// Atomically adds `delta` to the decimal counter under `key` (missing: 0); the new value
  /// (requirement 4).
  std::int64_t add(const std::string& key, std::int64_t delta) { return store_->add(key, delta); }
  /// Sets `key` to `desired` when it holds `expected` (or is missing and `expected` is empty), as
  /// torch does; returns the value it holds then (requirement 5).
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired) {
    return store_->compare_set(key, expected, desired);
  }
  /// Blocks until every key exists, at most timeout() (requirement 6).
  void wait(std::span<const std::string> keys) { store_->wait(keys); }
  /// Blocks until every key exists, at most `timeout`.
  void wait(std::span<const std::string> keys, Timeout timeout) { store_->wait(keys, timeout); }
  /// True when every key exists; never blocks (requirement 7).
  [[nodiscard]] bool check(std::span<const std::string> keys) { return store_->check(keys); }
  /// Removes `key`; says whether it was there (requirement 8).
  bool delete_key(const std::string& key) { return store_->delete_key(key); }
  /// Number of keys in the store (requirement 9).
  [[nodiscard]] std::int64_t num_keys() { return store_->num_keys(); }
  /// The default timeout of get() and wait().
  [[nodiscard]] Timeout timeout() const { return store_->timeout(); }
  /// Changes the default timeout of get() and wait().
  void set_timeout(Timeout timeout) { store_->set_timeout(timeout); }

 private:
  struct Concept {
    virtual ~Concept() = default;
    virtual void set(const std::string& key, std::string_view value) = 0;
    virtual std::string get(const std::string& key) = 0;
    virtual std::string get(const std::string& key, Timeout timeout) = 0;
    virtual std::int64_t add(const std::string& key, std::int64_t delta) = 0;
    virtual std::string compare_set(const std::string& key, std::string_view expected,
                                    std::string_view desired) = 0;
    virtual void wait(std::span<const std::string> keys) = 0;
    virtual void wait(std::span<const std::string> keys, Timeout timeout) = 0;
    virtual bool check(std::span<const std::string> keys) = 0;
    virtual bool delete_key(const std::string& key) = 0;
    virtual std::int64_t num_keys() = 0;
    virtual Timeout timeout() const = 0;
    virtual void set_timeout(Timeout timeout) = 0;
  };

  template <class S>
  struct Model final : Concept {
    explicit Model(S s) : store(std::move(s)) {}
    void set(const std::string& key, std::string_view value) override { store.set(key, value); }
    std::string get(const std::string& key) override { return store.get(key); }
    std::string get(const std::string& key, Timeout timeout) override {
      return store.get(key, timeout);
    }
    std::int64_t add(const std::string& key, std::int64_t delta) override {
      return store.add(key, delta);
    }
    std::string compare_set(const std::string& key, std::string_view expected,
                            std::string_view desired) override {
      return store.compare_set(key, expected, desired);
    }
    void wait(std::span<const std::string> keys) override { store.wait(keys); }
    void wait(std::span<const std::string> keys, Timeout timeout) override {
      store.wait(keys, timeout);
    }
    bool check(std::span<const std::string> keys) override { return store.check(keys); }
    bool delete_key(const std::string& key) override { return store.delete_key(key); }
    std::int64_t num_keys() override { return store.num_keys(); }
    Timeout timeout() const override { return store.timeout(); }
    void set_timeout(Timeout timeout) override { store.set_timeout(timeout); }
    S store;
  };

  std::shared_ptr<Concept> store_;
};

static_assert(Store<HashStore>);
static_assert(Store<PrefixStore<HashStore>>);
static_assert(Store<AnyStore>);

}  // namespace tandem
