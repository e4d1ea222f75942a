// tandem/rendezvous/detail/socket.hpp - RAII file descriptors and the TCP plumbing under TcpStore:
// deadline-bound send/recv that survive EINTR, partial transfers and SIGPIPE, connect with
// back-off, listen on an ephemeral port.
//   tandem::detail::Fd fd = tandem::detail::connect_tcp("127.0.0.1", 29500, Deadline(10s), "op");
//   auto r = tandem::detail::send_all(fd.get(), bytes.data(), bytes.size(), deadline);
// Needs: POSIX sockets (Linux).
#pragma once

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "tandem/core/error.hpp"
#include "tandem/core/fd.hpp"
#include "tandem/core/timeout.hpp"

namespace tandem::detail {

/// The milliseconds poll() should wait to reach `deadline`, rounded up; -1 for "forever".
inline int poll_timeout(const Deadline& deadline) {
  if (deadline.at() == Deadline::clock::time_point::max()) return -1;
  const auto left = deadline.at() - Deadline::clock::now();
  if (left <= Deadline::clock::duration::zero()) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<std::int64_t>(ms, INT_MAX));
}

enum class IoStatus { ok, closed, timed_out, failed };

struct IoResult {
  IoStatus status = IoStatus::ok;
  int error = 0;  ///< errno when failed
  [[nodiscard]] bool ok() const noexcept { return status == IoStatus::ok; }
  [[nodiscard]] std::string describe() const {
    switch (status) {
      case IoStatus::ok:
        return "ok";
      case IoStatus::closed:
        return "the connection was closed by the peer";
      case IoStatus::timed_out:
        return "timed out";
      case IoStatus::failed:
        return errno_text(error);
    }
    return "unknown";
  }
};

/// Waits until `fd` is ready for `events` (POLLIN or POLLOUT) or the deadline passes.
inline IoResult wait_ready(int fd, short events, const Deadline& deadline) {
  for (;;) {
    pollfd entry{fd, events, 0};
    const int n = ::poll(&entry, 1, poll_timeout(deadline));
    if (n > 0) return {};
    if (n == 0) return {IoStatus::timed_out, 0};
    if (errno != EINTR) return {IoStatus::failed, errno};
  }
}

inline void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    throw Error("socket", "fcntl(O_NONBLOCK): " + errno_text(errno));
  }
}

inline void set_nodelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // best effort
}

/// Sends all `size` bytes (the socket may be blocking or not); never raises SIGPIPE.
inline IoResult send_all(int fd, const void* data, std::size_t size, const Deadline& deadline) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::send(fd, bytes, size, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      bytes += n;
      size -= static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (const auto r = wait_ready(fd, POLLOUT, deadline); !r.ok()) return r;
      continue;
    }
    if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) return {IoStatus::closed, errno};
    return {IoStatus::failed, n < 0 ? errno : EIO};
  }
  return {};
}

/// Receives exactly `size` bytes; `closed` when the peer closes first.
inline IoResult recv_all(int fd, void* data, std::size_t size, const Deadline& deadline) {
  auto* bytes = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t n = ::recv(fd, bytes, size, MSG_DONTWAIT);
    if (n > 0) {
      bytes += n;
      size -= static_cast<std::size_t>(n);
      continue;
    }
    if (n == 0) return {IoStatus::closed, 0};
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (const auto r = wait_ready(fd, POLLIN, deadline); !r.ok()) return r;
      continue;
    }
    if (errno == ECONNRESET) return {IoStatus::closed, errno};
    return {IoStatus::failed, errno};
  }
  return {};
}

/// getaddrinfo for a TCP endpoint; throws Error naming host:port on failure.
struct AddrInfo {
  addrinfo* list = nullptr;
  AddrInfo(const std::string& host, std::uint16_t port, bool passive, const std::string& op) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = passive ? AI_PASSIVE : 0;
    const std::string service = std::to_string(port);
    const int rc =
        ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &list);
    if (rc != 0) {
      throw Error(op, "cannot resolve " + host + ":" + service + ": " + ::gai_strerror(rc));
    }
  }
  AddrInfo(const AddrInfo&) = delete;
  AddrInfo& operator=(const AddrInfo&) = delete;
  ~AddrInfo() {
    if (list != nullptr) ::freeaddrinfo(list);
  }
};

/// One non-blocking connect attempt bounded by `deadline`; an invalid Fd and `error` on failure.
inline Fd try_connect(const addrinfo& ai, const Deadline& deadline, int& error) {
  Fd fd(::socket(ai.ai_family, ai.ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai.ai_protocol));
  if (!fd) {
    error = errno;
    return {};
  }
  int rc = ::connect(fd.get(), ai.ai_addr, ai.ai_addrlen);
  if (rc < 0 && errno == EINTR) rc = -1, errno = EINPROGRESS;  // the connect goes on
  if (rc < 0 && errno != EINPROGRESS) {
    error = errno;
    return {};
  }
  if (rc < 0) {
    const auto ready = wait_ready(fd.get(), POLLOUT, deadline);
    if (!ready.ok()) {
      error = ready.status == IoStatus::timed_out ? ETIMEDOUT : ready.error;
      return {};
    }
    int so_error = 0;
    socklen_t len = sizeof so_error;
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &so_error, &len) < 0) so_error = errno;
    if (so_error != 0) {
      error = so_error;
      return {};
    }
  }
  set_nodelay(fd.get());
  return fd;
}

/// What connect_tcp says while it retries: `say(waited)` every `interval` of waiting (never
/// when `interval` is zero or Timeout::max()).
struct ConnectNotice {
  Timeout interval = Timeout::max();
  std::function<void(Timeout waited)> say;
};

/// Connects to host:port, retrying with back-off (10 ms doubling to 1 s) until `timeout`;
/// then tandem::Error "could not reach HOST:PORT within T: <last error>". The socket returned is
/// non-blocking, close-on-exec, with TCP_NODELAY. With `notice`, calls notice->say every
/// notice->interval while it waits.
inline Fd connect_tcp(const std::string& host, std::uint16_t port, Timeout timeout,
                      const std::string& op, const ConnectNotice* notice = nullptr) {
  const Deadline deadline(timeout);
  const auto started = Deadline::clock::now();
  const bool notices = notice != nullptr && notice->say && notice->interval > Timeout::zero() &&
                       notice->interval < Timeout::max();
  auto next_notice = started + (notices ? notice->interval : Timeout::zero());
  auto backoff = std::chrono::milliseconds(10);
  int error = ETIMEDOUT;
  for (;;) {
    {
      const AddrInfo addresses(host, port, false, op);
      for (const addrinfo* ai = addresses.list; ai != nullptr; ai = ai->ai_next) {
        if (Fd fd = try_connect(*ai, deadline, error)) return fd;
      }
    }
    if (deadline.expired()) break;
    auto pause = std::min<Timeout>(backoff, deadline.remaining());
    if (notices) {
      const auto now = Deadline::clock::now();
      if (now >= next_notice) {
        notice->say(std::chrono::duration_cast<Timeout>(now - started));
        while (next_notice <= now) next_notice += notice->interval;
      }
      pause = std::min<Timeout>(pause,
                                std::chrono::ceil<Timeout>(next_notice - Deadline::clock::now()));
      pause = std::max<Timeout>(pause, Timeout::zero());
    }
    std::this_thread::sleep_for(pause);
    backoff = std::min<Timeout>(backoff * 2, std::chrono::seconds(1));
    if (deadline.expired()) break;
  }
  throw Error(op, "could not reach " + host + ":" + std::to_string(port) + " within " +
                      describe(timeout) + ": " + errno_text(error));
}

/// A listening socket on host:port (port 0: an ephemeral port) with SO_REUSEADDR, and the port
/// it actually got. Non-blocking, close-on-exec.
inline std::pair<Fd, std::uint16_t> listen_tcp(const std::string& host, std::uint16_t port,
                                               const std::string& op, int backlog = 512) {
  const AddrInfo addresses(host, port, true, op);
  int error = EADDRNOTAVAIL;
  for (const addrinfo* ai = addresses.list; ai != nullptr; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
    if (!fd) {
      error = errno;
      continue;
    }
    const int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) < 0 || ::listen(fd.get(), backlog) < 0) {
      error = errno;
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len) < 0) {
      error = errno;
      continue;
    }
    std::uint16_t actual = port;
    if (bound.ss_family == AF_INET) {
      actual = ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
    } else if (bound.ss_family == AF_INET6) {
      actual = ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port);
    }
    return {std::move(fd), actual};
  }
  throw Error(op,
              "cannot listen on " + host + ":" + std::to_string(port) + ": " + errno_text(error));
}

}  // namespace tandem::detail
