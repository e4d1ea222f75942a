// tandem/comm/shm/detail/segment.hpp - the shared-memory segment under tandem::ShmComm: its
// layout (control block, one record per rank, a byte ring per ordered pair of ranks, two staging
// slots per rank), the POSIX object that holds it (shm_open, ftruncate, fallocate, mmap; unlinked
// once every rank has mapped it), futex waits on its words, and what /proc says about a peer.
// Not a public header: include tandem/comm/shm/shm.hpp.
// Needs: Linux (POSIX shared memory, futex, /proc).
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <new>
#include <random>
#include <string>
#include <string_view>
#include <utility>

#include "tandem/comm/checked.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/fd.hpp"
#include "tandem/core/timeout.hpp"

namespace tandem::detail::shm {

inline constexpr std::uint64_t segment_magic = 0x746e'6465'6d73'686dULL;
inline constexpr std::uint32_t layout_version = 2;
/// Bytes of the ring that carries one ordered pair's sends.
inline constexpr std::size_t ring_bytes = std::size_t{64} << 10;
/// Where segments live on Linux: shm_open's names are files here.
inline constexpr std::string_view shm_directory = "/dev/shm/";
/// Every segment's name starts so, then the creator's pid: see sweep_stale_segments().
inline constexpr std::string_view name_prefix = "tandem-shm-";

static_assert(std::atomic<std::uint32_t>::is_always_lock_free &&
                  std::atomic<std::uint64_t>::is_always_lock_free,
              "ShmComm needs address-free atomics in shared memory");
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t),
              "a futex word is 32 bits");

/// The start of the segment. The first failure is recorded here, so that every rank raises it.
struct Control {
  std::uint64_t magic = 0;
  std::uint32_t version = 0;
  std::uint32_t size = 0;
  std::uint64_t slot_bytes = 0;
  /// The futex word: bumped by every event a rank may sleep on (an arrival, a message, space
  /// freed in a ring, a failure); sleepers counts the ranks asleep on it.
  alignas(64) std::atomic<std::uint32_t> epoch{0};
  std::atomic<std::uint32_t> sleepers{0};
  alignas(64) std::atomic<std::uint32_t> mapped{0};  ///< ranks that have mapped the segment
  std::atomic<std::uint32_t> claim{0};               ///< 1 once a rank writes the failure record
  std::atomic<std::uint32_t> broken{0};  ///< 0, or 1 + the rank whose failure `reason` holds
  char reason[1024] = {};
  /// ShmComm::abort's record, apart from the group's own failure (which may come first: a peer
  /// that timed out waiting for the aborting rank), so that the cause given is never lost.
  std::atomic<std::uint32_t> abort_claim{0};  ///< 1 once a rank writes `abort_reason`
  std::atomic<std::uint32_t> aborted_by{0};   ///< 0, or 1 + the rank that aborted
  char abort_reason[1024] = {};
};

/// One rank's record. `calls` is plain data, published by the release store of `arrivals`.
struct alignas(64) RankState {
  std::atomic<std::uint64_t> arrivals{0};  ///< barriers this rank has arrived at
  std::atomic<std::int64_t> pid{0};
  std::atomic<std::uint32_t> left{0};  ///< its communicator is destroyed
  CollectiveFingerprint calls[2];      ///< its call, per staging half (see Engine::arrive)
};

/// Positions in the byte stream of one ordered pair: bytes written, bytes taken.
struct RingState {
  alignas(64) std::atomic<std::uint64_t> tail{0};
  alignas(64) std::atomic<std::uint64_t> head{0};
};

constexpr std::size_t round_up(std::size_t value, std::size_t to) noexcept {
  return (value + to - 1) / to * to;
}

/// Where everything lies in a segment for a group of `size` ranks.
struct Layout {
  int size = 1;
  std::size_t slot_bytes = 0;  ///< rounded up to 64
  std::size_t ranks_at = 0;
  std::size_t rings_at = 0;
  std::size_t ring_data_at = 0;
  std::size_t slots_at = 0;
  std::size_t total = 0;

  Layout(int ranks, std::size_t slot) : size(ranks), slot_bytes(round_up(slot, 64)) {
    const auto n = static_cast<std::size_t>(ranks);
    ranks_at = round_up(sizeof(Control), 64);
    rings_at = ranks_at + n * sizeof(RankState);
    ring_data_at = round_up(rings_at + n * n * sizeof(RingState), 64);
    slots_at = round_up(ring_data_at + n * n * ring_bytes, 4096);
    total = slots_at + n * 2 * slot_bytes;
  }
  [[nodiscard]] std::size_t ring(int src, int dst) const noexcept {
    return rings_at + static_cast<std::size_t>(src * size + dst) * sizeof(RingState);
  }
  [[nodiscard]] std::size_t ring_data(int src, int dst) const noexcept {
    return ring_data_at + static_cast<std::size_t>(src * size + dst) * ring_bytes;
  }
  [[nodiscard]] std::size_t slot(int rank, std::size_t half) const noexcept {
    return slots_at + (static_cast<std::size_t>(rank) * 2 + half) * slot_bytes;
  }
};

// --- futex ------------------------------------------------------------------------------------

/// Sleeps while `word` holds `expected`, at most `timeout` (or until a wake). Not private: the
/// word is shared between processes.
inline void futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t expected, Timeout timeout) {
  const auto ms = timeout.count() > 0 ? timeout.count() : 1;
  timespec relative{static_cast<std::time_t>(ms / 1000), static_cast<long>(ms % 1000) * 1000000L};
  (void)::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT, expected,
                  &relative, nullptr, 0);
}

inline void futex_wake_all(std::atomic<std::uint32_t>& word) {
  (void)::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr,
                  nullptr, 0);
}

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// --- peers --------------------------------------------------------------------------------------

/// The state letter /proc gives process `pid` of this host: 'X' once it no longer exists, 'Z'
/// when it has ended and awaits its parent, 'T' when stopped by a signal; '?' when unreadable.
inline char process_state(std::int64_t pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return 'X';
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  Fd stat(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  char text[512];
  const ssize_t got = stat ? ::read(stat.get(), text, sizeof text) : -1;
  if (got <= 0) return stat ? '?' : 'X';
  // The command name, in parentheses, may hold anything: the state follows the last ')'.
  const std::string_view line(text, static_cast<std::size_t>(got));
  const auto end = line.rfind(')');
  return end != std::string_view::npos && end + 2 < line.size() ? line[end + 2] : '?';
}

// --- the segment ------------------------------------------------------------------------------

/// "/tandem-shm-<pid>-<serial>-<random>": unique among the live processes of this host (the pid
/// is), and unguessable, so that a stale segment of a dead process with the same pid never
/// collides in practice (create() retries on a collision anyway).
inline std::string fresh_name() {
  static std::atomic<std::uint64_t> serial{0};
  std::random_device entropy;
  char random[17];
  std::snprintf(random, sizeof random, "%08x%08x", entropy(), entropy());
  return "/" + std::string(name_prefix) + std::to_string(::getpid()) + "-" +
         std::to_string(serial.fetch_add(1)) + "-" + random;
}

/// Removes the segments left by processes of this host that died between creating a segment and
/// its last rank mapping it (the only window in which a SIGKILL leaves one behind).
inline void sweep_stale_segments() {
  DIR* dir = ::opendir(std::string(shm_directory).c_str());
  if (!dir) return;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string_view name(entry->d_name);
    if (name.substr(0, name_prefix.size()) != name_prefix) continue;
    const auto digits = name.substr(name_prefix.size());
    std::int64_t pid = 0;
    std::size_t i = 0;
    for (; i < digits.size() && digits[i] >= '0' && digits[i] <= '9'; ++i) {
      pid = pid * 10 + (digits[i] - '0');
    }
    if (i == 0 || i == digits.size() || digits[i] != '-' || pid <= 0) continue;
    if (const char state = process_state(pid); state == 'X' || state == 'Z') {
      (void)::shm_unlink(("/" + std::string(name)).c_str());
    }
  }
  ::closedir(dir);
}

/// One mapping of a named POSIX shared-memory object. The creator unlinks the name on
/// destruction unless every rank has mapped it (then the last one to map has unlinked it).
class Segment {
 public:
  Segment() = default;
  Segment(Segment&& other) noexcept
      : name_(std::move(other.name_)),
        base_(std::exchange(other.base_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        size_(other.size_),
        creator_(std::exchange(other.creator_, false)) {}
  Segment& operator=(Segment&&) = delete;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() {
    if (creator_ && (!base_ || control().mapped.load() < size_)) (void)::shm_unlink(name_.c_str());
    if (base_) ::munmap(base_, bytes_);
  }

  /// A new segment of `layout.total` bytes, its memory reserved (a full /dev/shm is an Error
  /// here, not a SIGBUS later) and its control block and rank records constructed. Where
  /// /dev/shm has no room and `no_room` is given, sets it and returns an empty Segment instead.
  static Segment create(int rank, const Layout& layout, const char* operation,
                        bool* no_room = nullptr) {
    sweep_stale_segments();
    Segment segment;
    Fd fd;
    for (int attempt = 0; attempt < 8 && !fd; ++attempt) {
      segment.name_ = fresh_name();
      fd = Fd(::shm_open(segment.name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600));
      if (!fd && errno != EEXIST) break;
    }
    if (!fd) {
      throw Error(rank, operation,
                  "shm_open(" + segment.name_ + ") failed: " + errno_text(errno) +
                      " (is /dev/shm mounted and writable?)");
    }
    segment.creator_ = true;
    segment.size_ = static_cast<std::uint32_t>(layout.size);
    const auto bytes = static_cast<off_t>(layout.total);
    // posix_fallocate returns its error instead of setting errno.
    const int error =
        ::ftruncate(fd.get(), bytes) != 0 ? errno : ::posix_fallocate(fd.get(), 0, bytes);
    if (error != 0) {  // the destructor unlinks the name
      if (no_room && (error == ENOSPC || error == ENOMEM || error == EFBIG)) {
        *no_room = true;
        return Segment();
      }
      throw Error(rank, operation,
                  "cannot reserve " + std::to_string(layout.total >> 10) + " KiB in /dev/shm (" +
                      errno_text(error) +
                      "): free some, or lower ShmCommOptions::slot_bytes (2 per rank)");
    }
    segment.map(fd, layout.total, rank, operation);
    auto* control = new (segment.base_) Control();
    control->magic = segment_magic;
    control->version = layout_version;
    control->size = segment.size_;
    control->slot_bytes = layout.slot_bytes;
    for (int r = 0; r < layout.size; ++r) {
      new (segment.base_ + layout.ranks_at + static_cast<std::size_t>(r) * sizeof(RankState))
          RankState();
    }
    for (int r = 0; r < layout.size * layout.size; ++r) {
      new (segment.base_ + layout.rings_at + static_cast<std::size_t>(r) * sizeof(RingState))
          RingState();
    }
    return segment;
  }

  /// Maps the segment `name` that rank 0 created for the same layout.
  static Segment open(int rank, const std::string& name, const Layout& layout,
                      const char* operation) {
    Segment segment;
    segment.name_ = name;
    segment.size_ = static_cast<std::uint32_t>(layout.size);
    Fd fd(::shm_open(name.c_str(), O_RDWR, 0));
    if (!fd) {
      throw Error(rank, operation,
                  "shm_open(" + name + ") of rank 0's segment failed: " + errno_text(errno) +
                      " (do all ranks run on one host, with one /dev/shm?)");
    }
    struct stat info {};
    if (::fstat(fd.get(), &info) != 0 || static_cast<std::size_t>(info.st_size) != layout.total) {
      throw Error(rank, operation,
                  "rank 0's segment holds " + std::to_string(info.st_size) +
                      " bytes, this rank "
                      "expects " +
                      std::to_string(layout.total) +
                      " (do all ranks pass the same ShmCommOptions::slot_bytes?)");
    }
    segment.map(fd, layout.total, rank, operation);
    const Control& control = segment.control();
    if (control.magic != segment_magic || control.version != layout_version ||
        control.size != segment.size_ || control.slot_bytes != layout.slot_bytes) {
      throw Error(rank, operation,
                  "rank 0's segment " + name +
                      " has another layout (a different tandem version, group size or "
                      "slot_bytes)");
    }
    return segment;
  }

  /// Removes the name (the memory stays while any rank has it mapped).
  void unlink() const noexcept { (void)::shm_unlink(name_.c_str()); }

  [[nodiscard]] std::byte* base() const noexcept { return base_; }
  [[nodiscard]] Control& control() const noexcept { return *reinterpret_cast<Control*>(base_); }
  [[nodiscard]] const std::string& name() const noexcept { return name_; }

 private:
  void map(const Fd& fd, std::size_t bytes, int rank, const char* operation) {
    void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (base == MAP_FAILED) {
      throw Error(rank, operation,
                  "mmap of " + std::to_string(bytes >> 10) + " KiB failed: " + errno_text(errno));
    }
    base_ = static_cast<std::byte*>(base);
    bytes_ = bytes;
  }

  std::string name_;
  std::byte* base_ = nullptr;
  std::size_t bytes_ = 0;
  std::uint32_t size_ = 0;
  bool creator_ = false;
};

}  // namespace tandem::detail::shm
