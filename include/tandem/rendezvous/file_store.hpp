// tandem/rendezvous/file_store.hpp - tandem::FileStore, a Store kept in a file that the processes
// of one machine (or of a shared file system with working locks) open together.
//   tandem::FileStore store("/tmp/job42.store", {.timeout = std::chrono::seconds(60)});
//   store.add("arrived", 1);
// Needs: Linux (open file description locks, fcntl F_OFD_SETLKW).
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/rendezvous/detail/socket.hpp"
#include "tandem/rendezvous/store.hpp"

namespace tandem {

/// What a FileStore takes besides its path.
struct FileStoreOptions {
  Timeout timeout = default_timeout;  ///< the default timeout of get() and wait()
};

/// A Store in a file. The file is an append-only log of records: a set record is the byte 'S',
/// then the key and the value, each as a u32 little-endian length and its bytes; a delete record
/// is 'D' and the key. Every operation takes an exclusive lock on byte 1 of the file (an open
/// file description lock, so threads and processes exclude each other alike), reads the records
/// appended since its last visit into a map, and appends its own. Blocking get/wait poll the file
/// (every 1 ms, backing off to 20 ms) until their timeout.
///
/// The file is reset when no live process has it open: every open FileStore holds a shared
/// lock on byte 0 for its whole life, and opening a file on which nobody holds one truncates it,
/// so a file left by an earlier run starts empty while one in use is joined.
///
/// The directory must exist (a missing one is a tandem::Error naming the path). A record cut
/// short (a process killed while writing) is a tandem::Error naming the file and the offset.
/// FileStore is a copyable handle: copies share the open file and the keys read; each copy has
/// its own timeout. Thread-safe, except that set_timeout must not race with calls on the same
/// handle.
class FileStore {
 public:
  /// Opts in as a tandem::Store.
  using store_concept = store_tag;

  /// Opens (or creates) the store's file at `path`; see the class for when it starts empty.
  explicit FileStore(std::filesystem::path path, FileStoreOptions options = {})
      : state_(std::make_shared<State>(std::move(path))), timeout_(options.timeout) {}

  /// Stores `value` under `key`, replacing what was there (Store requirement 2).
  void set(const std::string& key, std::string_view value) {
    Session session(*state_);
    session.append_set(key, value);
  }

  /// The value under `key`, waiting at most timeout() for the key to exist (requirement 3).
  [[nodiscard]] std::string get(const std::string& key) { return get(key, timeout_); }

  /// The value under `key`, waiting at most `timeout` for the key to exist.
  [[nodiscard]] std::string get(const std::string& key, Timeout timeout) {
    std::string value;
    const bool found = poll_until(timeout, [&] {
      Session session(*state_);
      const auto it = state_->map.find(key);
      if (it == state_->map.end()) return false;
      value = it->second;
      return true;
    });
    if (!found) throw detail::get_timeout_error("FileStore", key, timeout);
    return value;
  }

  /// Atomically adds `delta` to the decimal counter under `key` (missing: 0); the new value
  /// (requirement 4).
  std::int64_t add(const std::string& key, std::int64_t delta) {
    Session session(*state_);
    const auto it = state_->map.find(key);
    const auto value = detail::added_value("FileStore", key,
                                           it == state_->map.end() ? nullptr : &it->second, delta);
    session.append_set(key, std::to_string(value));
    return value;
  }

  /// Sets `key` to `desired` when it holds `expected` (or is missing and `expected` is empty), as
  /// torch does; returns the value it holds then (requirement 5).
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired) {
    Session session(*state_);
    const auto it = state_->map.find(key);
    auto outcome = detail::compare_set_outcome(it == state_->map.end() ? nullptr : &it->second,
                                               expected, desired);
    if (outcome.store) session.append_set(key, *outcome.store);
    return outcome.result;
  }

  /// Blocks until every key exists, at most timeout() (requirement 6).
  void wait(std::span<const std::string> keys) { wait(keys, timeout_); }

  /// Blocks until every key exists, at most `timeout`.
  void wait(std::span<const std::string> keys, Timeout timeout) {
    std::vector<std::string> missing;
    const bool found = poll_until(timeout, [&] {
      Session session(*state_);
      missing.clear();
      for (const auto& key : keys) {
        if (!state_->map.contains(key)) missing.push_back(key);
      }
      return missing.empty();
    });
    if (!found) throw detail::wait_timeout_error("FileStore", missing, timeout);
  }

  /// True when every key exists; never blocks (requirement 7).
  [[nodiscard]] bool check(std::span<const std::string> keys) {
    Session session(*state_);
    return std::all_of(keys.begin(), keys.end(),
                       [&](const std::string& key) { return state_->map.contains(key); });
  }

  /// Removes `key`; says whether it was there (requirement 8).
  bool delete_key(const std::string& key) {
    Session session(*state_);
    if (!state_->map.contains(key)) return false;
    session.append_delete(key);
    return true;
  }

  /// Number of keys in the store (requirement 9).
  [[nodiscard]] std::int64_t num_keys() {
    Session session(*state_);
    return static_cast<std::int64_t>(state_->map.size());
  }

  /// The default timeout of get() and wait().
  [[nodiscard]] Timeout timeout() const { return timeout_; }
  /// Changes the default timeout of get() and wait().
  void set_timeout(Timeout timeout) { timeout_ = timeout; }

  /// The store's file.
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return state_->path; }

 private:
  static constexpr off_t liveness_byte = 0;   // shared-locked by every open FileStore
  static constexpr off_t operation_byte = 1;  // exclusive-locked by every operation

  static Error failure(const std::filesystem::path& path, const std::string& what, int error) {
    return Error("FileStore", path.string() + ": " + what + ": " + detail::errno_text(error));
  }

  /// Sets an open file description lock on one byte; false when `wait` is off and it is taken.
  static bool lock_byte(int fd, const std::filesystem::path& path, off_t byte, short type,
                        bool wait) {
    struct flock lock {};
    lock.l_type = type;
    lock.l_whence = SEEK_SET;
    lock.l_start = byte;
    lock.l_len = 1;
    lock.l_pid = 0;
    for (;;) {
      if (::fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &lock) == 0) return true;
      if (errno == EINTR) continue;
      if (!wait && (errno == EAGAIN || errno == EACCES)) return false;
      throw failure(path, "fcntl lock", errno);
    }
  }

  struct State {
    explicit State(std::filesystem::path p) : path(std::move(p)) {
      const auto parent = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
      std::error_code ec;
      if (!std::filesystem::is_directory(parent, ec)) {
        throw Error("FileStore",
                    path.string() + ": the directory " + parent.string() + " does not exist");
      }
      fd.reset(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
      if (!fd) throw failure(path, "cannot open", errno);
      lock_byte(fd.get(), path, operation_byte, F_WRLCK, true);
      try {
        if (lock_byte(fd.get(), path, liveness_byte, F_WRLCK, false)) {
          // Nobody has the file open: what it holds is from an earlier run.
          if (::ftruncate(fd.get(), 0) < 0) throw failure(path, "cannot truncate", errno);
        }
        lock_byte(fd.get(), path, liveness_byte, F_RDLCK, true);  // (downgrades ours)
      } catch (...) {
        lock_byte(fd.get(), path, operation_byte, F_UNLCK, true);
        throw;
      }
      lock_byte(fd.get(), path, operation_byte, F_UNLCK, true);
    }

    std::filesystem::path path;
    detail::Fd fd;
    std::mutex mutex;  // threads sharing this descriptor (one OFD lock owner) take turns here
    std::map<std::string, std::string, std::less<>> map;
    std::uint64_t offset = 0;  // how far the log has been read into map
  };

  /// One operation: the thread mutex and the file lock held, the map brought up to date.
  class Session {
   public:
    explicit Session(State& state) : state_(state), lock_(state.mutex) {
      lock_byte(state_.fd.get(), state_.path, operation_byte, F_WRLCK, true);
      try {
        catch_up();
      } catch (...) {
        unlock();
        throw;
      }
    }
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;
    ~Session() { unlock(); }

    void append_set(const std::string& key, std::string_view value) {
      std::string record(1, 'S');
      append_field(record, key);
      append_field(record, value);
      append(record);
      state_.map.insert_or_assign(key, std::string(value));
    }

    void append_delete(const std::string& key) {
      std::string record(1, 'D');
      append_field(record, key);
      append(record);
      state_.map.erase(key);
    }

   private:
    void unlock() noexcept {
      struct flock lock {};
      lock.l_type = F_UNLCK;
      lock.l_whence = SEEK_SET;
      lock.l_start = operation_byte;
      lock.l_len = 1;
      while (::fcntl(state_.fd.get(), F_OFD_SETLK, &lock) < 0 && errno == EINTR) {
      }
    }

    static void append_field(std::string& record, std::string_view bytes) {
      if (bytes.size() > UINT32_MAX) throw Error("FileStore", "a key or value exceeds 4 GiB");
      detail::append_u32(record, static_cast<std::uint32_t>(bytes.size()));
      record.append(bytes);
    }

    void append(const std::string& record) {
      std::size_t done = 0;
      while (done < record.size()) {
        const ssize_t n = ::pwrite(state_.fd.get(), record.data() + done, record.size() - done,
                                   static_cast<off_t>(state_.offset + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) throw failure(state_.path, "cannot write", n < 0 ? errno : EIO);
        done += static_cast<std::size_t>(n);
      }
      state_.offset += record.size();
    }

    void corrupt(std::uint64_t at, const std::string& what) const {
      throw Error("FileStore", state_.path.string() + ": corrupt record at offset " +
                                   std::to_string(at) + ": " + what);
    }

    /// Reads the records appended since state_.offset into the map.
    void catch_up() {
      struct stat info {};
      if (::fstat(state_.fd.get(), &info) < 0) throw failure(state_.path, "cannot stat", errno);
      const auto size = static_cast<std::uint64_t>(info.st_size);
      if (size < state_.offset) {  // someone truncated the file under us: start over
        state_.map.clear();
        state_.offset = 0;
      }
      if (size == state_.offset) return;
      std::string bytes(size - state_.offset, '\0');
      std::size_t done = 0;
      while (done < bytes.size()) {
        const ssize_t n = ::pread(state_.fd.get(), bytes.data() + done, bytes.size() - done,
                                  static_cast<off_t>(state_.offset + done));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) throw failure(state_.path, "cannot read", errno);
        if (n == 0) break;
        done += static_cast<std::size_t>(n);
      }
      bytes.resize(done);

      std::size_t pos = 0;
      auto field = [&](std::uint64_t record_start) {
        if (bytes.size() - pos < 4) corrupt(record_start, "truncated length");
        const std::uint32_t length = detail::load_u32(bytes.data() + pos);
        pos += 4;
        if (bytes.size() - pos < length) corrupt(record_start, "truncated field");
        std::string out = bytes.substr(pos, length);
        pos += length;
        return out;
      };
      while (pos < bytes.size()) {
        const std::uint64_t record_start = state_.offset + pos;
        const char type = bytes[pos++];
        if (type == 'S') {
          std::string key = field(record_start);
          std::string value = field(record_start);
          state_.map.insert_or_assign(std::move(key), std::move(value));
        } else if (type == 'D') {
          state_.map.erase(field(record_start));
        } else {
          corrupt(record_start, "unknown record type");
        }
      }
      state_.offset += bytes.size();
    }

    State& state_;
    std::unique_lock<std::mutex> lock_;
  };

  /// Calls `ready` until it returns true (then true) or `timeout` passes (then false), sleeping
  /// 1 ms between tries, growing to 20 ms.
  template <class Ready>
  static bool poll_until(Timeout timeout, Ready ready) {
    const Deadline deadline(timeout);
    auto pause = std::chrono::microseconds(1000);
    for (;;) {
      if (ready()) return true;
      if (deadline.expired()) return false;
      std::this_thread::sleep_for(std::min<std::chrono::microseconds>(
          pause, deadline.remaining() + std::chrono::milliseconds(1)));
      pause = std::min<std::chrono::microseconds>(pause * 3 / 2, std::chrono::milliseconds(20));
    }
  }

  std::shared_ptr<State> state_;
  Timeout timeout_;
};

static_assert(Store<FileStore>);

}  // namespace tandem
