// tandem/io/detail/atomic_file.hpp - writing a file so that a reader sees the old one or the new
// one, never a mix: a temporary file of this process's own beside the target, fsync, rename, fsync
// of the directory. Files are created the way open() creates them (0666 less the umask, and a
// default ACL applies), never with a fixed mode.
//   tandem::detail::write_atomically("dir/model.safetensors", bytes, "safetensors dir/model...");
// Needs: POSIX.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

#include "tandem/core/error.hpp"
#include "tandem/core/fd.hpp"

namespace tandem::detail {

/// What every temporary file of an atomic write has in its name, after the target's name.
inline constexpr std::string_view temporary_marker = ".tmp-";

/// Eight hex digits that differ between calls in this process and between processes started at
/// the same moment (the pid is in the name as well).
inline std::string unique_suffix() {
  static std::atomic<std::uint64_t> counter{0};
  const auto now =
      static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  std::uint64_t mixed = now ^ (counter.fetch_add(1) * 0x9E3779B97F4A7C15ull);
  mixed ^= mixed >> 29;
  mixed *= 0xBF58476D1CE4E5B9ull;
  mixed ^= mixed >> 32;
  constexpr char digits[] = "0123456789abcdef";
  std::string text(8, '0');
  for (auto& c : text) c = digits[(mixed >>= 4) & 0xF];
  return text;
}

/// A new, empty file of this process's own beside `path` (".NAME.tmp-PID-XXXXXXXX"), opened for
/// writing, created with mode 0666 so that the umask (and a default ACL) decide; its name is
/// returned in `name`. Throws Error(operation, cause) when the directory refuses it.
inline Fd create_temporary_beside(const std::filesystem::path& path, std::string& name,
                                  const std::string& operation) {
  const std::filesystem::path directory =
      path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  for (int attempt = 0;; ++attempt) {
    name = (directory / ("." + path.filename().string() + std::string(temporary_marker) +
                         std::to_string(::getpid()) + "-" + unique_suffix()))
               .string();
    Fd fd(::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666));
    if (fd) return fd;
    if (errno == EEXIST && attempt < 100) continue;
    throw Error(operation, "cannot create a file in " + directory.string() + ": " +
                               errno_text(errno) + " (errno " + std::to_string(errno) + ")");
  }
}

/// Writes `bytes` to `fd` whole, retrying short writes; the error text or "".
inline std::string write_whole(int fd, std::span<const std::byte> bytes) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t wrote = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote < 0) return errno_text(errno);
    if (wrote == 0) return "the file system accepted no more bytes";
    done += static_cast<std::size_t>(wrote);
  }
  return {};
}

/// Writes `bytes` to `path` atomically: a temporary file of this process's own in the same
/// directory, fsync, rename over `path`, fsync of the directory. A crash leaves the old file or
/// the new one; a failure removes the temporary file and throws Error(operation, cause), the cause
/// naming the step and the system's reason ("cannot write: No space left on device").
inline void write_atomically(const std::filesystem::path& path, std::span<const std::byte> bytes,
                             const std::string& operation) {
  std::string temporary;
  Fd fd = create_temporary_beside(path, temporary, operation);
  auto fail = [&](const std::string& cause) {
    fd.reset();
    ::unlink(temporary.c_str());
    throw Error(operation, cause);
  };
  if (const auto error = write_whole(fd.get(), bytes); !error.empty()) {
    fail("cannot write: " + error);
  }
  if (::fsync(fd.get()) != 0) fail("cannot sync: " + errno_text(errno));
  // close() reports what a network file system defers to it.
  if (::close(fd.release()) != 0) fail("cannot close: " + errno_text(errno));
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    fail("cannot rename " + temporary + " into place: " + errno_text(errno));
  }
  const std::filesystem::path directory =
      path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  Fd dir(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir || ::fsync(dir.get()) != 0) {
    throw Error(operation, "cannot sync its directory: " + errno_text(errno));
  }
}

}  // namespace tandem::detail
