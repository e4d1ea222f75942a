// tests/support/collective_suite.hpp - the collective conformance suite: the same assertions for
// every Communicator backend (LocalComm now; Gloo and MPI later). Each check_* takes a Runner:
//   run(world_size, fn)           starts world_size ranks and calls fn(comm) on each;
//   run.timed(world_size, t, fn)  the same with every blocking wait limited to t;
// both rethrow a rank's failure as tandem::Error after all ranks have ended. Ranks record what is
// wrong in a thread-safe Failures list; the main thread CHECKs it (doctest 2.4.9 assertions are
// not safe to call from several threads at once).
// Results are compared with a serial reference computed here, in rank order.
// The bodies pass host containers (std::vector, std::span); a backend whose tensors live on the
// GPU runs them through an adapter that stages each call through device memory (the NCCL tests
// do), with Matrix::tagged_send_recv false when its sends have no tags and wait for their recv.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <mutex>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/error.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem::test {

// --- recording failures from many threads -----------------------------------------------------

class Failures {
 public:
  template <class... Parts>
  void add(const Parts&... parts) {
    std::ostringstream text;
    (text << ... << parts);
    std::lock_guard lock(mutex_);
    list_.push_back(text.str());
  }

  template <class... Parts>
  void expect(bool ok, const Parts&... parts) {
    if (!ok) add(parts...);
  }

  /// On the main thread: one CHECK that holds the first failures.
  void report() const {
    std::lock_guard lock(mutex_);
    std::string text;
    for (std::size_t i = 0; i < list_.size() && i < 20; ++i) text += list_[i] + "\n";
    if (list_.size() > 20) text += "... and " + std::to_string(list_.size() - 20) + " more\n";
    CHECK_MESSAGE(list_.empty(), text);
  }

  [[nodiscard]] std::size_t count() const {
    std::lock_guard lock(mutex_);
    return list_.size();
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> list_;
};

// --- element types and values -------------------------------------------------------------------

using element_types =
    std::tuple<float, double, half, bfloat16, std::int32_t, std::int64_t, std::uint8_t>;

template <class Fn>
void for_each_type(Fn&& fn) {
  [&]<class... T>(std::tuple<T...>*) {
    (fn.template operator()<T>(), ...);
  }(static_cast<element_types*>(nullptr));
}

template <class T>
constexpr bool is_float16 = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

template <class T>
T from_int(long value) {
  if constexpr (is_float16<T>) {
    return T(static_cast<float>(value));
  } else {
    return static_cast<T>(value);
  }
}

template <class T>
double as_double(T value) {
  if constexpr (is_float16<T>) {
    return static_cast<double>(static_cast<float>(value));
  } else {
    return static_cast<double>(value);
  }
}

/// Small integers, exact in every element type, whose sums and products stay exact too.
template <class T>
T reduction_input(int rank, std::size_t i, ReduceOp op) {
  const auto r = static_cast<long>(rank);
  const auto j = static_cast<long>(i % 1000);
  if (op == ReduceOp::prod) {
    long v = (r + j) % 3 == 0 ? 2 : 1;
    if (!std::is_unsigned_v<T> && (r + 2 * j) % 5 == 1) v = -v;
    return from_int<T>(v);
  }
  long v = (r * 7 + j * 13 + 3) % 9 - 4;
  if (std::is_unsigned_v<T>) v += 4;
  return from_int<T>(v);
}

/// Distinct-looking values for the collectives that only move data.
template <class T>
T pattern(int rank, std::size_t i, int salt = 0) {
  return from_int<T>((static_cast<long>(rank) * 31 + static_cast<long>(salt) * 17 +
                      static_cast<long>(i % 1000) * 7) %
                     97);
}

/// Irregular floats, different on every rank (a linear congruential sequence seeded by the rank):
/// values whose sum, average and product depend on the order a backend reduces them in.
inline std::vector<float> irregular_floats(int rank, std::size_t count) {
  std::vector<float> data(count);
  std::uint32_t state = 777u + static_cast<std::uint32_t>(rank) * 7919u;
  for (auto& x : data) {
    state = state * 1664525u + 1013904223u;
    x = static_cast<float>(state >> 8) * 0x1p-17f - 60.0f;
  }
  return data;
}

/// The serial reference: rank order, 16-bit floats accumulated in float, integers wrapping.
template <class T, class Value>
T reference(int world_size, ReduceOp op, Value value) {
  using Acc = std::conditional_t<is_float16<T>, float, T>;
  auto combine = [op](Acc a, Acc b) -> Acc {
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg:
        if constexpr (std::is_integral_v<Acc>) {
          using U = std::make_unsigned_t<Acc>;
          return static_cast<Acc>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
        } else {
          return a + b;
        }
      case ReduceOp::prod:
        if constexpr (std::is_integral_v<Acc>) {
          using U = std::make_unsigned_t<Acc>;
          return static_cast<Acc>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
        } else {
          return a * b;
        }
      case ReduceOp::min:
        return std::min(a, b);
      case ReduceOp::max:
        return std::max(a, b);
    }
    return a;
  };
  Acc acc = static_cast<Acc>(value(0));
  for (int r = 1; r < world_size; ++r) acc = combine(acc, static_cast<Acc>(value(r)));
  if constexpr (!std::is_integral_v<Acc>) {
    if (op == ReduceOp::avg) acc = acc / static_cast<Acc>(world_size);
  }
  return static_cast<T>(acc);
}

/// Equal for integers; within a few units of the last place for floating point (a backend may
/// reduce in another order or precision; LocalComm matches exactly).
template <class T>
bool close(T got, T want) {
  if constexpr (std::is_integral_v<T>) {
    return got == want;
  } else {
    const double tolerance = std::is_same_v<T, double>  ? 1e-12
                             : std::is_same_v<T, float> ? 1e-6
                             : std::is_same_v<T, half>  ? 2e-3
                                                        : 1e-2;
    const double g = as_double(got);
    const double w = as_double(want);
    return std::abs(g - w) <= tolerance * std::max(1.0, std::abs(w));
  }
}

template <class T>
std::vector<ReduceOp> ops_for() {
  if constexpr (dtype_traits<T>::is_floating) {
    return {ReduceOp::sum, ReduceOp::avg, ReduceOp::prod, ReduceOp::min, ReduceOp::max};
  } else {
    return {ReduceOp::sum, ReduceOp::prod, ReduceOp::min, ReduceOp::max};
  }
}

// --- what one case is, for messages --------------------------------------------------------

struct Mode {
  bool in_place = false;
  bool async = false;
};

inline constexpr Mode modes[] = {{false, false}, {true, false}, {false, true}, {true, true}};

struct Case {
  const char* operation;
  const char* type;
  std::size_t count;
  Mode mode;
  int rank;
  int world_size;
  std::optional<ReduceOp> op = std::nullopt;
  int root = -1;

  friend std::ostream& operator<<(std::ostream& out, const Case& c) {
    out << c.operation << "<" << c.type << ">";
    if (c.op) out << " op=" << name(*c.op);
    if (c.root >= 0) out << " root=" << c.root;
    return out << " count=" << c.count << (c.mode.in_place ? " in-place" : " out-of-place")
               << (c.mode.async ? " async" : " sync") << " rank " << c.rank << "/" << c.world_size;
  }
};

/// Compares `got` with want(i) for i < count; records the first difference.
template <class T, class Want>
void compare(Failures& failures, const Case& c, const T* got, std::size_t count, Want want,
             const char* what = "result") {
  for (std::size_t i = 0; i < count; ++i) {
    const T expected = want(i);
    if (!close(got[i], expected)) {
      failures.add(c, ": ", what, "[", i, "] = ", as_double(got[i]), ", expected ",
                   as_double(expected));
      return;
    }
  }
}

/// The counts a body runs: 0, 1, primes, and counts no world size up to 8 divides evenly.
struct Matrix {
  std::vector<std::size_t> counts{0, 1, 7, 13, 1031};
  /// false: every case runs in every mode (in/out of place, sync/async). true, for backends whose
  /// every call costs milliseconds (processes over TCP): each case runs in one mode, rotating so
  /// that every count still meets every mode within each body.
  bool rotate_modes = false;
  /// true: send/recv match by tag and a send never waits for its recv (send_recv_body). false,
  /// for backends without tags whose send waits for the matching recv (NCCL): ranks pair their
  /// sends and receives in an order that cannot deadlock (paired_send_recv_body).
  bool tagged_send_recv = true;
};

/// The modes of the next case of a body, as Matrix::rotate_modes asks. Every rank builds the
/// same sequence, so the ranks stay in step.
class ModePicker {
 public:
  explicit ModePicker(const Matrix& matrix) : rotate_(matrix.rotate_modes) {}

  std::vector<Mode> next_modes() {
    if (!rotate_) return {std::begin(modes), std::end(modes)};
    return {modes[pick(std::size(modes))]};
  }
  /// reduce and broadcast are always in place: only sync and async.
  std::vector<bool> next_asyncs() {
    if (!rotate_) return {false, true};
    return {pick(2) == 1};
  }

 private:
  // 0 1 2 3 1 2 3 0 2 3 0 1 ...: a group of cases shifted by one each time round.
  std::size_t pick(std::size_t n) { return (next_++ * 5 / 4) % n; }

  bool rotate_;
  std::size_t next_ = 0;
};

// --- the per-rank bodies (any Communicator) ---------------------------------------------------

template <class Comm>
void all_reduce_body(Comm& comm, Failures& failures, const Matrix& matrix) {
  const int n = comm.size();
  const int me = comm.rank();
  ModePicker picker(matrix);
  for_each_type([&]<class T>() {
    for (ReduceOp op : ops_for<T>()) {
      for (std::size_t count : matrix.counts) {
        for (Mode mode : picker.next_modes()) {
          const Case c{"all_reduce", dtype_traits<T>::name, count, mode, me, n, op};
          std::vector<T> in(count);
          for (std::size_t i = 0; i < count; ++i) in[i] = reduction_input<T>(me, i, op);
          const std::vector<T> original = in;
          std::vector<T> out(count);
          if (mode.in_place) {
            if (mode.async) {
              comm.all_reduce_async(in, op).wait();
            } else {
              comm.all_reduce(in, op);
            }
          } else {
            const std::span<const T> input(in);
            if (mode.async) {
              comm.all_reduce_async(input, out, op).wait();
            } else {
              comm.all_reduce(input, out, op);
            }
            compare(
                failures, c, in.data(), count, [&](std::size_t i) { return original[i]; }, "input");
          }
          const auto& result = mode.in_place ? in : out;
          compare(failures, c, result.data(), count, [&](std::size_t i) {
            return reference<T>(n, op, [&](int r) { return reduction_input<T>(r, i, op); });
          });
        }
      }
    }
  });
}

template <class Comm>
void reduce_body(Comm& comm, Failures& failures, const Matrix& matrix) {
  const int n = comm.size();
  const int me = comm.rank();
  ModePicker picker(matrix);
  for_each_type([&]<class T>() {
    for (ReduceOp op : ops_for<T>()) {
      for (std::size_t count : matrix.counts) {
        for (bool async : picker.next_asyncs()) {
          const int root =
              static_cast<int>((count + (async ? 1 : 0)) % static_cast<std::size_t>(n));
          const Case c{"reduce", dtype_traits<T>::name, count, {true, async}, me, n, op, root};
          std::vector<T> data(count);
          for (std::size_t i = 0; i < count; ++i) data[i] = reduction_input<T>(me, i, op);
          const std::vector<T> original = data;
          if (async) {
            comm.reduce_async(data, root, op).wait();
          } else {
            comm.reduce(data, root, op);
          }
          if (me == root) {
            compare(failures, c, data.data(), count, [&](std::size_t i) {
              return reference<T>(n, op, [&](int r) { return reduction_input<T>(r, i, op); });
            });
          } else {
            compare(
                failures, c, data.data(), count, [&](std::size_t i) { return original[i]; },
                "non-root buffer");
          }
        }
      }
    }
  });
}

template <class Comm>
void broadcast_body(Comm& comm, Failures& failures, const Matrix& matrix) {
  const int n = comm.size();
  const int me = comm.rank();
  ModePicker picker(matrix);
  for_each_type([&]<class T>() {
    for (std::size_t count : matrix.counts) {
      for (bool async : picker.next_asyncs()) {
        const int root =
            static_cast<int>((count / 2 + (async ? 1 : 0)) % static_cast<std::size_t>(n));
        const Case c{"broadcast", dtype_traits<T>::name, count, {true, async}, me, n, {}, root};
        std::vector<T> data(count);
        for (std::size_t i = 0; i < count; ++i) data[i] = pattern<T>(me, i);
        if (async) {
          comm.broadcast_async(data, root).wait();
        } else {
          comm.broadcast(data, root);
        }
        compare(failures, c, data.data(), count,
                [&](std::size_t i) { return pattern<T>(root, i); });
      }
    }
  });
}

template <class Comm>
void all_gather_body(Comm& comm, Failures& failures, const Matrix& matrix) {
  const int n = comm.size();
  const int me = comm.rank();
  ModePicker picker(matrix);
  const auto un = static_cast<std::size_t>(n);
  const auto ume = static_cast<std::size_t>(me);
  for_each_type([&]<class T>() {
    for (std::size_t count : matrix.counts) {
      for (Mode mode : picker.next_modes()) {
        const Case c{"all_gather", dtype_traits<T>::name, count, mode, me, n};
        std::vector<T> mine(count);
        for (std::size_t i = 0; i < count; ++i) mine[i] = pattern<T>(me, i);
        std::vector<T> out(un * count, from_int<T>(99));
        std::span<const T> in(mine);
        if (mode.in_place) {
          std::copy(mine.begin(), mine.end(),
                    out.begin() + static_cast<std::ptrdiff_t>(ume * count));
          in = std::span<const T>(out.data() + ume * count, count);
        }
        if (mode.async) {
          comm.all_gather_async(in, out).wait();
        } else {
          comm.all_gather(in, out);
        }
        compare(failures, c, out.data(), out.size(), [&](std::size_t j) {
          return pattern<T>(static_cast<int>(j / std::max<std::size_t>(count, 1)),
                            j % std::max<std::size_t>(count, 1));
        });
      }
    }
  });
}

template <class Comm>
void gather_body(Comm& comm, Failures& failures, const Matrix& matrix) {
  const int n = comm.size();
  const int me = comm.rank();
  ModePicker picker(matrix);
  const auto un = static_cast<std::size_t>(n);
  for_each_type([&]<class T>() {
    for (std::size_t count : matrix.counts) {
      for (Mode mode : picker.next_modes()) {
        const int root = static_cast<int>((count + (mode.async ? 1 : 0)) % un);
        const Case c{"gather", dtype_traits<T>::name, count, mode, me, n, {}, root};
        std::vector<T> mine(count);
        for (std::size_t i = 0; i < count; ++i) mine[i] = pattern<T>(me, i, 1);
        std::vector<T> out(me == root ? un * count : 0, from_int<T>(99));
        std::span<const T> in(mine);
        if (mode.in_place && me == root) {
          std::copy(
              mine.begin(), mine.end(),
              out.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(me) * count));
          in = std::span<const T>(out.data() + static_cast<std::size_t>(me) * count, count);
        }
        if (mode.async) {
          comm.gather_async(in, out, root).wait();
        } else {
          comm.gather(in, out, root);
        }
        const auto k = std::max<std::size_t>(count, 1);
        compare(failures, c, out.data(), out.size(),
                [&](std::size_t j) { return pattern<T>(static_cast<int>(j / k), j % k, 1); });
      }
    }
  });
}

template <class Comm>
void scatter_body(Comm& comm, Failures& failures, const Matrix& matrix) {
  const int n = comm.size();
  const int me = comm.rank();
  ModePicker picker(matrix);
  const auto un = static_cast<std::size_t>(n);
  for_each_type([&]<class T>() {
    for (std::size_t count : matrix.counts) {
      for (Mode mode : picker.next_modes()) {
        const int root = static_cast<int>((count / 3 + (mode.async ? 1 : 0)) % un);
        const Case c{"scatter", dtype_traits<T>::name, count, mode, me, n, {}, root};
        std::vector<T> in(me == root ? un * count : 0);
        const auto k = std::max<std::size_t>(count, 1);
        for (std::size_t j = 0; j < in.size(); ++j) {
          in[j] = pattern<T>(static_cast<int>(j / k), j % k, 2);
        }
        std::vector<T> own(count, from_int<T>(99));
        std::span<T> out(own);
        if (mode.in_place && me == root) {
          out = std::span<T>(in.data() + static_cast<std::size_t>(me) * count, count);
        }
        const std::span<const T> input(in);
        if (mode.async) {
          comm.scatter_async(input, out, root).wait();
        } else {
          comm.scatter(input, out, root);
        }
        compare(failures, c, out.data(), count,
                [&](std::size_t i) { return pattern<T>(me, i, 2); });
      }
    }
  });
}

template <class Comm>
void reduce_scatter_body(Comm& comm, Failures& failures, const Matrix& matrix) {
  const int n = comm.size();
  const int me = comm.rank();
  ModePicker picker(matrix);
  const auto un = static_cast<std::size_t>(n);
  const auto ume = static_cast<std::size_t>(me);
  for_each_type([&]<class T>() {
    for (ReduceOp op : ops_for<T>()) {
      for (std::size_t count : matrix.counts) {
        for (Mode mode : picker.next_modes()) {
          const Case c{"reduce_scatter", dtype_traits<T>::name, count, mode, me, n, op};
          std::vector<T> in(un * count);
          for (std::size_t j = 0; j < in.size(); ++j) in[j] = reduction_input<T>(me, j, op);
          std::vector<T> own(count, from_int<T>(99));
          std::span<T> out(own);
          if (mode.in_place) out = std::span<T>(in.data() + ume * count, count);
          if (mode.async) {
            comm.reduce_scatter_async(in, out, op).wait();
          } else {
            comm.reduce_scatter(in, out, op);
          }
          compare(failures, c, out.data(), count, [&](std::size_t i) {
            return reference<T>(n, op,
                                [&](int r) { return reduction_input<T>(r, ume * count + i, op); });
          });
        }
      }
    }
  });
}

template <class Comm>
void all_to_all_body(Comm& comm, Failures& failures, const Matrix& matrix) {
  const int n = comm.size();
  const int me = comm.rank();
  ModePicker picker(matrix);
  const auto un = static_cast<std::size_t>(n);
  for_each_type([&]<class T>() {
    for (std::size_t count : matrix.counts) {
      for (Mode mode : picker.next_modes()) {
        const Case c{"all_to_all", dtype_traits<T>::name, count, mode, me, n};
        const auto k = std::max<std::size_t>(count, 1);
        // Slot s of rank r's input holds what r sends to s: pattern(r, i, salt s).
        std::vector<T> in(un * count);
        for (std::size_t j = 0; j < in.size(); ++j) {
          in[j] = pattern<T>(me, j % k, 3 + static_cast<int>(j / k));
        }
        std::vector<T> own(un * count, from_int<T>(99));
        std::vector<T>& out = mode.in_place ? in : own;
        if (mode.async) {
          comm.all_to_all_async(in, out).wait();
        } else {
          comm.all_to_all(in, out);
        }
        compare(failures, c, out.data(), out.size(),
                [&](std::size_t j) { return pattern<T>(static_cast<int>(j / k), j % k, 3 + me); });
      }
    }
  });
}

/// Tags select messages; messages with one (source, tag) arrive in order.
template <class Comm>
void send_recv_body(Comm& comm, Failures& failures) {
  const int n = comm.size();
  const int me = comm.rank();
  const int next = (me + 1) % n;
  const int prev = (me + n - 1) % n;
  for_each_type([&]<class T>() {
    for (bool async : {false, true}) {
      const Case c{"send/recv", dtype_traits<T>::name, 13, {false, async}, me, n};
      // Three tags sent in order 0, 1, 2 (tag 1 twice), received 2, 1, 1, 0.
      std::vector<std::vector<T>> outgoing;
      for (int m = 0; m < 4; ++m) {
        std::vector<T> message(13);
        for (std::size_t i = 0; i < message.size(); ++i) message[i] = pattern<T>(me, i, m);
        outgoing.push_back(std::move(message));
      }
      const int tags[] = {0, 1, 1, 2};
      std::vector<Work> work;
      for (int m = 0; m < 4; ++m) {
        if (async) {
          work.push_back(comm.send_async(outgoing[static_cast<std::size_t>(m)], next, tags[m]));
        } else {
          comm.send(outgoing[static_cast<std::size_t>(m)], next, tags[m]);
        }
      }
      std::vector<std::vector<T>> incoming(4, std::vector<T>(13));
      for (int m : {3, 1, 2, 0}) {
        if (async) {
          work.push_back(comm.recv_async(incoming[static_cast<std::size_t>(m)], prev, tags[m]));
        } else {
          comm.recv(incoming[static_cast<std::size_t>(m)], prev, tags[m]);
        }
      }
      for (auto& w : work) w.wait();
      for (int m = 0; m < 4; ++m) {
        compare(
            failures, c, incoming[static_cast<std::size_t>(m)].data(), 13,
            [&](std::size_t i) { return pattern<T>(prev, i, m); }, "message");
      }
    }
  });
}

/// Tag 0 only, and every send waits for its recv: around the ring, even ranks send first and odd
/// ranks receive first, so no rank waits on a peer that waits on it. A single rank has no peer.
template <class Comm>
void paired_send_recv_body(Comm& comm, Failures& failures) {
  const int n = comm.size();
  const int me = comm.rank();
  if (n < 2) return;
  const int next = (me + 1) % n;
  const int prev = (me + n - 1) % n;
  // With an odd ring the last rank is even as well as rank 0: it receives first too, or rank 0's
  // receive from it would wait behind its send to rank 0.
  const bool send_first = me % 2 == 0 && !(n % 2 == 1 && me == n - 1);
  for_each_type([&]<class T>() {
    for (bool async : {false, true}) {
      const Case c{"send/recv", dtype_traits<T>::name, 13, {false, async}, me, n};
      std::vector<T> outgoing(13);
      for (std::size_t i = 0; i < outgoing.size(); ++i) outgoing[i] = pattern<T>(me, i, 5);
      std::vector<T> incoming(13, from_int<T>(99));
      const std::span<const T> message(outgoing);
      auto send = [&] {
        if (async) {
          comm.send_async(message, next, 0).wait();
        } else {
          comm.send(message, next, 0);
        }
      };
      auto recv = [&] {
        if (async) {
          comm.recv_async(incoming, prev, 0).wait();
        } else {
          comm.recv(incoming, prev, 0);
        }
      };
      if (send_first) {
        send();
        recv();
      } else {
        recv();
        send();
      }
      compare(failures, c, incoming.data(), incoming.size(),
              [&](std::size_t i) { return pattern<T>(prev, i, 5); });
    }
  });
}

/// send_recv_body or paired_send_recv_body, as the matrix says the backend's sends behave.
template <class Comm>
void point_to_point_body(Comm& comm, Failures& failures, const Matrix& matrix) {
  if (matrix.tagged_send_recv) {
    send_recv_body(comm, failures);
  } else {
    paired_send_recv_body(comm, failures);
  }
}

/// Several `_async` operations in flight, then a sync one: all complete, in order.
template <class Comm>
void async_ordering_body(Comm& comm, Failures& failures) {
  const int n = comm.size();
  const int me = comm.rank();
  const Case c{"async ordering", "float32", 257, {true, true}, me, n, ReduceOp::sum};
  std::vector<std::vector<float>> buffers(6, std::vector<float>(257));
  std::vector<Work> work;
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    for (std::size_t i = 0; i < 257; ++i) buffers[b][i] = static_cast<float>(me + b + i % 5);
    work.push_back(comm.all_reduce_async(buffers[b]));
  }
  // Depends on buffers[0] being reduced first: a sync op is ordered after pending async ones.
  std::vector<float> copy(257);
  comm.all_reduce(std::span<const float>(buffers[0]), copy, ReduceOp::max);
  work.push_back(comm.barrier_async());
  for (auto it = work.rbegin(); it != work.rend(); ++it) it->wait();
  for (auto& w : work) failures.expect(w.test() && !w.failed(), c, ": work not complete");
  const float ranks_sum = static_cast<float>(n * (n - 1) / 2);
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    compare(failures, c, buffers[b].data(), 257, [&](std::size_t i) {
      return ranks_sum + static_cast<float>(n) * static_cast<float>(b + i % 5);
    });
  }
  compare(
      failures, c, copy.data(), 257, [&](std::size_t i) { return buffers[0][i]; }, "copy");
}

/// Float sums of irregular values: every rank gets the same bits.
template <class Comm>
void determinism_body(Comm& comm, Failures& failures) {
  const int n = comm.size();
  const int me = comm.rank();
  constexpr std::size_t count = 1031;
  std::vector<float> data(count);
  std::uint32_t state = 12345u + static_cast<std::uint32_t>(me) * 7919u;
  for (auto& x : data) {
    state = state * 1664525u + 1013904223u;
    x = static_cast<float>(state >> 8) * 0x1p-13f - 1000.0f;
  }
  comm.all_reduce(data, ReduceOp::sum);
  std::vector<float> everyone(static_cast<std::size_t>(n) * count);
  comm.all_gather(std::span<const float>(data), everyone);
  for (int r = 0; r < n; ++r) {
    const bool same = std::equal(
        data.begin(), data.end(), everyone.begin() + static_cast<std::ptrdiff_t>(r) * count,
        [](float a, float b) { return detail::float_bits(a) == detail::float_bits(b); });
    failures.expect(same, "determinism: rank ", me, " and rank ", r, " of ", n,
                    " got different bits from one float all_reduce");
  }
}

// --- the checks a test case calls -------------------------------------------------------------

template <class Runner>
void check_all_collectives(Runner& run, int world_size, const Matrix& matrix = {}) {
  Failures failures;
  run(world_size, [&](auto& comm) {
    all_reduce_body(comm, failures, matrix);
    reduce_body(comm, failures, matrix);
    broadcast_body(comm, failures, matrix);
    all_gather_body(comm, failures, matrix);
    gather_body(comm, failures, matrix);
    scatter_body(comm, failures, matrix);
    reduce_scatter_body(comm, failures, matrix);
    all_to_all_body(comm, failures, matrix);
    point_to_point_body(comm, failures, matrix);
    async_ordering_body(comm, failures);
    determinism_body(comm, failures);
    comm.barrier();
  });
  failures.report();
}

template <class Comm>
void subgroup_bodies(Comm& comm, Failures& failures, const Matrix& matrix) {
  all_reduce_body(comm, failures, matrix);
  reduce_body(comm, failures, matrix);
  broadcast_body(comm, failures, matrix);
  all_gather_body(comm, failures, matrix);
  gather_body(comm, failures, matrix);
  scatter_body(comm, failures, matrix);
  reduce_scatter_body(comm, failures, matrix);
  all_to_all_body(comm, failures, matrix);
  point_to_point_body(comm, failures, matrix);
}

/// split (colours by parity, keys reversing the order), nested split, no_color, and new_group.
template <class Runner>
void check_subgroups(Runner& run, int world_size, const Matrix& matrix = {{0, 1, 13}}) {
  Failures failures;
  run(world_size, [&](auto& comm) {
    const int me = comm.rank();
    const int n = comm.size();
    auto sub = comm.split(me % 2, -me);
    const int parity_size = (n - me % 2 + 1) / 2;
    failures.expect(sub.has_value(), "split: rank ", me, " got no group");
    if (!sub) return;
    failures.expect(sub->size() == parity_size, "split: rank ", me, " in a group of ", sub->size(),
                    ", expected ", parity_size);
    // Keys -me order the group by descending old rank.
    const int expected_rank = parity_size - 1 - me / 2;
    failures.expect(sub->rank() == expected_rank, "split: rank ", me, " became ", sub->rank(),
                    ", expected ", expected_rank);
    subgroup_bodies(*sub, failures, matrix);

    // Rank 0 stays out; the others form one group in old order.
    auto rest = comm.split(me == 0 ? no_color : 1, 0);
    failures.expect(rest.has_value() == (me != 0), "split no_color: rank ", me);
    if (rest) {
      failures.expect(rest->size() == n - 1 && rest->rank() == me - 1, "split no_color: rank ", me,
                      " became ", rest->rank(), "/", rest->size());
      all_reduce_body(*rest, failures, matrix);
      // A split of a split.
      auto halves = rest->split(rest->rank() < rest->size() / 2 ? 0 : 1, 0);
      if (halves) all_reduce_body(*halves, failures, matrix);
    }

    // new_group: the last rank, then rank 0, then the odd ranks below the last.
    std::vector<int> members{n - 1};
    if (n > 1) members.push_back(0);
    for (int r = 1; r < n - 1; r += 2) members.push_back(r);
    auto group = new_group(comm, std::span<const int>(members));
    const auto position = std::find(members.begin(), members.end(), me);
    failures.expect(group.has_value() == (position != members.end()), "new_group: rank ", me);
    if (group) {
      const int want = static_cast<int>(position - members.begin());
      failures.expect(group->rank() == want && group->size() == static_cast<int>(members.size()),
                      "new_group: rank ", me, " became ", group->rank(), "/", group->size(),
                      ", expected ", want, "/", members.size());
      subgroup_bodies(*group, failures, matrix);
    }
    comm.barrier();
  });
  failures.report();
}

/// Whether an Error's text contains every one of `parts`.
template <class... Parts>
bool mentions(const std::string& text, const Parts&... parts) {
  return ((text.find(parts) != std::string::npos) && ...);
}

/// Size mismatches within one call and avg on integers: a tandem::Error on the calling rank,
/// before anything is sent (the ranks then still agree on a barrier).
template <class Runner>
void check_local_errors(Runner& run, int world_size) {
  Failures failures;
  run(world_size, [&](auto& comm) {
    const int me = comm.rank();
    const auto n = static_cast<std::size_t>(comm.size());
    const std::string rank_text = "rank " + std::to_string(me);
    auto expect_error = [&](const char* what, auto call, auto... parts) {
      try {
        call();
        failures.add(what, ": no error on rank ", me);
      } catch (const Error& e) {
        failures.expect(mentions(e.what(), rank_text, parts...), what, ": rank ", me,
                        " got: ", e.what());
      }
    };
    std::vector<float> in(3), out(3 * n + 1), small(2);
    const std::string expected_out = std::to_string(3 * n + 1);
    expect_error(
        "all_gather sizes", [&] { comm.all_gather(in, out); }, "all_gather", "3", expected_out);
    expect_error(
        "all_gather_async sizes", [&] { (void)comm.all_gather_async(in, out); }, "all_gather",
        expected_out);
    expect_error(
        "all_reduce sizes", [&] { comm.all_reduce(in, small); }, "all_reduce", "3", "2");
    expect_error(
        "reduce_scatter sizes", [&] { comm.reduce_scatter(out, in); }, "reduce_scatter",
        expected_out);
    expect_error(
        "all_to_all sizes", [&] { comm.all_to_all(in, out); }, "all_to_all", "3", expected_out);
    expect_error(
        "scatter sizes", [&] { comm.scatter(out, in, me); }, "scatter", expected_out);
    expect_error(
        "gather sizes", [&] { comm.gather(in, out, me); }, "gather", expected_out);
    expect_error(
        "broadcast root", [&] { comm.broadcast(in, static_cast<int>(n)); }, "broadcast", "root");
    std::vector<std::int32_t> ints(4);
    expect_error(
        "avg on int32", [&] { comm.all_reduce(ints, ReduceOp::avg); }, "all_reduce",
        "avg needs a floating-point element type");
    expect_error(
        "avg on int32 async", [&] { (void)comm.all_reduce_async(ints, ReduceOp::avg); },
        "avg needs a floating-point element type");
    std::vector<std::uint8_t> bytes(4);
    expect_error(
        "reduce avg on uint8", [&] { comm.reduce(bytes, 0, ReduceOp::avg); }, "reduce",
        "avg needs a floating-point element type");
    // Nothing was sent: the group still works.
    std::vector<float> one{1.0f};
    comm.all_reduce(one);
    failures.expect(one[0] == static_cast<float>(n), "after local errors: all_reduce gave ",
                    one[0]);
  });
  failures.report();
}

/// The conformance suite of backend Comm: the cases every communicator must pass, and the cases
/// its capability traits promise (a backend without a capability says so at compile time).
template <class Comm, class Runner>
void check_conformance(Runner& run, int world_size, const Matrix& matrix,
                       const Matrix& subgroup_matrix);

/// Ranks that call one collective with different arguments: every rank raises a tandem::Error
/// naming what differs and every rank's whole call (tandem/comm/checked.hpp's text), for backends
/// that detect it. A communicator whose check is switched off skips this.
template <class Runner>
void check_mismatch_errors(Runner& run, int world_size) {
  REQUIRE(world_size >= 2);
  Failures failures;
  run(world_size, [&](auto& comm) {
    if constexpr (requires { comm.checks_collectives(); }) {
      if (!comm.checks_collectives()) return;
    }
    const int me = comm.rank();
    const int odd = comm.size() - 1;  // the rank that disagrees
    std::string others = odd == 1 ? "rank 0" : "ranks 0";
    for (int r = 1; r < odd; ++r) others += ", " + std::to_string(r);
    const std::string odd_rank = "rank " + std::to_string(odd);
    // `what` differs; `usual` is what the others called and `unusual` what the odd rank called.
    auto expect_error = [&](const char* case_name, auto call, const char* what,
                            const std::string& usual, const std::string& unusual) {
      try {
        call();
        failures.add(case_name, ": no error on rank ", me);
      } catch (const Error& e) {
        failures.expect(mentions(e.what(), "rank " + std::to_string(me) + ":", what,
                                 others + " called " + usual, odd_rank + " called " + unusual),
                        case_name, ": rank ", me, " got: ", e.what());
      }
    };
    std::vector<float> data(me == odd ? 8 : 7);
    expect_error(
        "count", [&] { comm.all_reduce(data); }, "ranks disagree on the element count",
        "all_reduce(7 x float32, sum)", "all_reduce(8 x float32, sum)");
    std::vector<float> floats(5);
    std::vector<std::int32_t> ints(5);
    expect_error(
        "type",
        [&] {
          if (me == odd) {
            comm.all_reduce(ints);
          } else {
            comm.all_reduce(floats);
          }
        },
        "ranks disagree on the element type", "all_reduce(5 x float32, sum)",
        "all_reduce(5 x int32, sum)");
    expect_error(
        "operation",
        [&] {
          if (me == odd) {
            comm.broadcast(floats, 0);
          } else {
            comm.all_reduce(floats);
          }
        },
        "ranks called different operations", "all_reduce(5 x float32, sum)",
        "broadcast(5 x float32, root 0)");
    expect_error(
        "root", [&] { comm.broadcast(floats, me == odd ? 1 : 0); }, "ranks disagree on the root",
        "broadcast(5 x float32, root 0)", "broadcast(5 x float32, root 1)");
    expect_error(
        "reduce op", [&] { comm.all_reduce(floats, me == odd ? ReduceOp::max : ReduceOp::sum); },
        "ranks disagree on the reduce op", "all_reduce(5 x float32, sum)",
        "all_reduce(5 x float32, max)");
    std::vector<float> in(4), out(4 * static_cast<std::size_t>(comm.size()));
    std::vector<float> in_odd(5), out_odd(5 * static_cast<std::size_t>(comm.size()));
    expect_error(
        "all_gather count",
        [&] {
          if (me == odd) {
            comm.all_gather(in_odd, out_odd);
          } else {
            comm.all_gather(in, out);
          }
        },
        "ranks disagree on the element count", "all_gather(4 x float32)",
        "all_gather(5 x float32)");
    // The odd rank skips a reduce to root 0 and goes on to a barrier; the others meet it there
    // with their reduce. (Had it skipped a call exactly like its next one, the two would pair up
    // and the others' extra call would time out instead.)
    expect_error(
        "skipped collective",
        [&] {
          if (me == odd) {
            comm.barrier();
          } else {
            comm.reduce(floats, 0);
          }
        },
        "ranks called different operations", "reduce(5 x float32, root 0, sum)", "barrier()");
    // A detected mismatch leaves the group usable.
    std::vector<float> one{1.0f};
    comm.all_reduce(one);
    failures.expect(one[0] == static_cast<float>(comm.size()), "after mismatches: all_reduce gave ",
                    one[0]);
  });
  failures.report();
}

/// One rank skips a collective: the others raise a tandem::Error naming their rank, the
/// operation and the missing rank once the timeout has passed, and do not hang.
template <class Runner>
void check_timeout(Runner& run, int world_size) {
  REQUIRE(world_size >= 2);
  using namespace std::chrono_literals;
  Failures failures;
  std::atomic<int> done{0};
  const int skipper = world_size / 2;
  const auto start = std::chrono::steady_clock::now();
  run.timed(world_size, 200ms, [&](auto& comm) {
    const int me = comm.rank();
    if (me == skipper) {
      // Stay in the group (alive, not calling) until the others have given up.
      for (int i = 0; i < 1000 && done.load() < world_size - 1; ++i) {
        std::this_thread::sleep_for(10ms);
      }
      return;
    }
    std::vector<float> data(16);
    try {
      comm.all_reduce(data);
      failures.add("timeout: rank ", me, " completed an all_reduce rank ", skipper, " skipped");
    } catch (const Error& e) {
      failures.expect(mentions(e.what(), "rank " + std::to_string(me) + ":", "all_reduce",
                               "rank " + std::to_string(skipper)),
                      "timeout: rank ", me, " got: ", e.what());
    }
    ++done;
  });
  const auto elapsed = std::chrono::steady_clock::now() - start;
  CHECK(elapsed < 5s);
  failures.report();
}

/// A rank that throws wakes the ranks blocked in a collective long before the timeout; the
/// runner rethrows the failure naming the rank and keeping its message.
template <class Runner>
void check_abort(Runner& run, int world_size) {
  REQUIRE(world_size >= 2);
  using namespace std::chrono_literals;
  Failures failures;
  const int failing = world_size - 1;
  const auto start = std::chrono::steady_clock::now();
  std::string raised;
  try {
    run.timed(world_size, 60s, [&](auto& comm) {
      const int me = comm.rank();
      if (me == failing) {
        std::this_thread::sleep_for(50ms);
        throw std::runtime_error("boom from the test");
      }
      std::vector<double> data(32);
      try {
        comm.all_reduce(data);
        failures.add("abort: rank ", me, " completed an all_reduce");
      } catch (const Error& e) {
        failures.expect(
            mentions(e.what(), "rank " + std::to_string(failing) + " failed", "boom from the test"),
            "abort: rank ", me, " got: ", e.what());
      }
    });
    failures.add("abort: the runner did not rethrow");
  } catch (const Error& e) {
    raised = e.what();
  }
  const auto elapsed = std::chrono::steady_clock::now() - start;
  CHECK(elapsed < 10s);
  CHECK_MESSAGE(mentions(raised, "rank " + std::to_string(failing), "boom from the test"), raised);
  failures.report();
}

template <class Comm, class Runner>
void check_conformance(Runner& run, int world_size, const Matrix& matrix,
                       const Matrix& subgroup_matrix) {
  {
    INFO("every collective, element type and op");
    check_all_collectives(run, world_size, matrix);
  }
  {
    INFO("collectives on subgroups made by split and new_group");
    check_subgroups(run, world_size, subgroup_matrix);
  }
  {
    INFO("size mismatches and avg on integers are errors before anything is sent");
    check_local_errors(run, world_size);
  }
  if constexpr (can_check_collectives<Comm>) {
    if (world_size >= 2) {
      INFO("ranks that disagree on a collective all raise an error naming them");
      check_mismatch_errors(run, world_size);
    }
  }
}

}  // namespace tandem::test
