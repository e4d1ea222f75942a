// tandem/core/fd.hpp - an owned POSIX file descriptor (closed on destruction) and a thread-safe
// strerror, shared by the rooms that talk to the operating system (stores, launcher).
//   tandem::detail::Fd socket(::socket(AF_INET, SOCK_STREAM, 0));   // closed at scope exit
// Needs: POSIX.
#pragma once

#include <unistd.h>

#include <string>
#include <system_error>
#include <utility>

namespace tandem::detail {

/// An owned file descriptor, closed on destruction. Move-only.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) reset(std::exchange(other.fd_, -1));
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }
  explicit operator bool() const noexcept { return valid(); }
  int release() noexcept { return std::exchange(fd_, -1); }
  /// Closes the descriptor held (EINTR from close is not retried: Linux has closed it anyway).
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

/// strerror, thread-safe.
inline std::string errno_text(int error) {
  return std::generic_category().message(error);
}

}  // namespace tandem::detail
