// tandem/comm/gloo/detail/gloo_support.hpp - the pieces under tandem::GlooComm that do not run
// collectives: tandem's stores seen through gloo's rendezvous::Store interface, the outbox that
// owns eager point-to-point sends until they are delivered, the reduce functions gloo calls back,
// and what is known about the peers.
// Not a public header: include tandem/comm/gloo/gloo.hpp.
// Needs: Gloo (libgloo-dev) and POSIX (getpid, kill, gethostname).
#pragma once

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <gloo/rendezvous/store.h>
#include <gloo/transport/unbound_buffer.h>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/reduction.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem::detail::gloo_comm {

/// A tandem store (any Store, through AnyStore) as gloo's rendezvous store. Every wait is bounded
/// by `timeout`, so a rank that never arrives ends in a tandem::Error, not a hang.
class StoreAdapter final : public ::gloo::rendezvous::Store {
 public:
  StoreAdapter(AnyStore store, Timeout timeout) : store_(std::move(store)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(key, std::string_view(data.data(), data.size()));
  }
  std::vector<char> get(const std::string& key) override {
    const std::string value = store_.get(key, timeout_);
    return {value.begin(), value.end()};
  }
  void wait(const std::vector<std::string>& keys) override { store_.wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    // gloo passes its own 30 s default here; the communicator's timeout is the one that counts.
    (void)timeout;
    store_.wait(keys, timeout_);
  }

 private:
  AnyStore store_;
  Timeout timeout_;
};

/// The fixed-size header in front of every point-to-point message: the receiver checks it
/// before it accepts the payload, so a mismatch is an Error instead of a gloo abort.
struct MessageHeader {
  std::uint64_t type = 0;
  std::uint64_t count = 0;
};

/// One eager send: a private copy of the data, and gloo's buffers for header and payload.
struct OutgoingMessage {
  MessageHeader header;
  std::vector<std::byte> payload;
  std::unique_ptr<::gloo::transport::UnboundBuffer> header_buffer;
  std::unique_ptr<::gloo::transport::UnboundBuffer> payload_buffer;  ///< null for 0 elements
  int peer = 0;
  int tag = 0;
  Deadline deadline{Timeout::zero()};
};

/// Owns the eager sends until gloo has delivered them. gloo only moves a payload once the
/// receiver has posted its recv, so send() cannot wait for that (two ranks sending to each other
/// first would deadlock); a thread of its own waits instead, each send bounded by the timeout.
class Outbox {
 public:
  using FailureHandler = std::function<void(const std::string&)>;

  explicit Outbox(FailureHandler on_failure) : on_failure_(std::move(on_failure)) {}
  Outbox(const Outbox&) = delete;
  Outbox& operator=(const Outbox&) = delete;
  ~Outbox() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  void post(std::unique_ptr<OutgoingMessage> message) {
    {
      std::lock_guard lock(mutex_);
      if (aborted_) {
        interrupt(*message);
        return;  // dropped: the communicator has failed and reports that itself
      }
      queue_.push_back(std::move(message));
      if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    }
    changed_.notify_all();
  }

  /// Stops waiting for deliveries (the communicator has failed): pending sends are dropped.
  void abort() {
    std::lock_guard lock(mutex_);
    aborted_ = true;
    for (auto& message : queue_) interrupt(*message);
    if (current_) interrupt(*current_);
  }

 private:
  static void interrupt(OutgoingMessage& message) {
    message.header_buffer->abortWaitSend();
    if (message.payload_buffer) message.payload_buffer->abortWaitSend();
  }

  /// At least 1 ms: gloo treats a zero timeout as "expired" and closes every connection, which is
  /// what a send whose deadline has passed deserves.
  static std::chrono::milliseconds left(const Deadline& deadline) {
    return std::max(deadline.remaining(), Timeout(1));
  }

  void loop() {
    std::unique_lock lock(mutex_);
    for (;;) {
      changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      current_ = std::move(queue_.front());
      queue_.pop_front();
      const bool skip = aborted_;
      lock.unlock();
      if (!skip) {
        try {
          if (current_->header_buffer->waitSend(left(current_->deadline)) &&
              current_->payload_buffer) {
            (void)current_->payload_buffer->waitSend(left(current_->deadline));
          }
        } catch (const std::exception& e) {
          on_failure_("send to rank " + std::to_string(current_->peer) + " with tag " +
                      std::to_string(current_->tag) + " failed: " + e.what());
        }
      }
      lock.lock();
      current_.reset();
    }
  }

  FailureHandler on_failure_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::unique_ptr<OutgoingMessage>> queue_;
  std::unique_ptr<OutgoingMessage> current_;  ///< the send being waited for (guarded by mutex_)
  bool aborted_ = false;
  bool stopping_ = false;
  std::thread thread_;
};

// --- peers --------------------------------------------------------------------------------------

/// Where a rank runs, published at the rendezvous so that a failure can name a dead peer.
struct Peer {
  std::string host;
  long pid = 0;
};

inline std::string this_host() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "?";
  return host;
}

inline std::string describe_self() {
  return this_host() + " " + std::to_string(::getpid());
}

inline Peer parse_peer(const std::string& text) {
  Peer peer;
  const auto space = text.rfind(' ');
  if (space == std::string::npos) return peer;
  peer.host = text.substr(0, space);
  try {
    peer.pid = std::stol(text.substr(space + 1));
  } catch (...) {
    peer.pid = 0;
  }
  return peer;
}

/// The state letter of process `pid` of this host in /proc/PID/stat ('R', 'S', 'T', 'Z', ...);
/// 'X' when it no longer exists, '?' when that cannot be read.
inline char process_state(long pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH ? 'X' : '?';
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return '?';
  const auto close = line.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos || close + 2 >= line.size()) return '?';
  return line[close + 2];
}

/// Whether process `pid` of this host has ended (a zombie not yet reaped counts as ended).
inline bool process_gone(long pid) {
  const char state = process_state(pid);
  return state == 'Z' || state == 'X';
}

/// Whether process `pid` of this host is stopped by a signal (SIGSTOP): alive but not running.
/// A tracing stop ('t') is left out: a sanitizer's leak check ptrace-stops its own process as it
/// exits, which is a peer ending, not one stopped.
inline bool process_stopped(long pid) {
  return process_state(pid) == 'T';
}

/// The ranks of `peers` that ran on this host and whose process is stopped.
inline std::vector<int> stopped_peers(const std::vector<Peer>& peers, int me) {
  std::vector<int> stopped;
  const std::string host = this_host();
  for (std::size_t r = 0; r < peers.size(); ++r) {
    if (static_cast<int>(r) == me || peers[r].host != host || peers[r].pid <= 0) continue;
    if (process_stopped(peers[r].pid)) stopped.push_back(static_cast<int>(r));
  }
  return stopped;
}

/// The ranks of `peers` that ran on this host and whose process is gone.
inline std::vector<int> dead_peers(const std::vector<Peer>& peers, int me) {
  std::vector<int> dead;
  const std::string host = this_host();
  for (std::size_t r = 0; r < peers.size(); ++r) {
    if (static_cast<int>(r) == me || peers[r].host != host || peers[r].pid <= 0) continue;
    if (process_gone(peers[r].pid)) dead.push_back(static_cast<int>(r));
  }
  return dead;
}

// --- reductions ---------------------------------------------------------------------------------

/// out[i] = a[i] op b[i] (reduction.hpp's combine_elements), as gloo's reduce function.
template <class T, ReduceOp Op>
void combine_range(void* out, const void* a, const void* b, std::size_t n) {
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (std::size_t i = 0; i < n; ++i) o[i] = combine_elements<Op>(x[i], y[i]);
}

/// The function gloo's allreduce and reduce call: out[i] = a[i] op b[i] (avg sums; the caller
/// divides afterwards).
template <class T>
std::function<void(void*, const void*, const void*, std::size_t)> reducer(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return &combine_range<T, ReduceOp::sum>;
    case ReduceOp::prod:
      return &combine_range<T, ReduceOp::prod>;
    case ReduceOp::min:
      return &combine_range<T, ReduceOp::min>;
    case ReduceOp::max:
      return &combine_range<T, ReduceOp::max>;
  }
  return &combine_range<T, ReduceOp::sum>;
}

}  // namespace tandem::detail::gloo_comm
