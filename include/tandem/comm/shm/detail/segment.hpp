// tandem/comm/shm/detail/segment.hpp - the shared-memory segment under tandem::ShmComm: its
// layout (control block, one record per rank, a byte ring per ordered pair of ranks, two staging
// slots per rank) sized to what /dev/shm has free, the POSIX object that holds it (shm_open of a
// random name, ftruncate, fallocate, mmap; unlinked once every rank has mapped it), the locks
// that tell a live rank from a dead one in any PID namespace, futex waits on its words, and what
// /proc says about a peer.
// Not a public header: include tandem/comm/shm/shm.hpp.
// Needs: Linux (POSIX shared memory, futex, /proc).
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <new>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>

#include "tandem/comm/checked.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/fd.hpp"
#include "tandem/core/timeout.hpp"

namespace tandem::detail::shm {

inline constexpr std::uint64_t segment_magic = 0x746e'6465'6d73'686dULL;
inline constexpr std::uint32_t layout_version = 4;  // 3: places, reduced; 4: claimed
/// Bytes of the ring that carries one ordered pair's sends, where /dev/shm has room for it...
inline constexpr std::size_t default_ring_bytes = std::size_t{64} << 10;
/// ... and the least it may shrink to (a group's rings take n x n of them).
inline constexpr std::size_t smallest_ring_bytes = std::size_t{1} << 10;
/// The least a staging slot may shrink to (and never under 8 bytes per rank: reduce_scatter and
/// all_to_all put a part per rank in it).
inline constexpr std::size_t smallest_slot_bytes = std::size_t{16} << 10;
/// Where segments live on Linux: shm_open's names are files here.
inline constexpr std::string_view shm_directory = "/dev/shm/";
/// Every segment's name is this, then 32 hex digits (random): see fresh_name().
inline constexpr std::string_view name_prefix = "tandem-shm-";
inline constexpr std::size_t name_digits = 32;
/// Tests (and a user who wants ShmComm to take less): the most of /dev/shm's free space that
/// ShmComm counts on, in bytes.
inline constexpr std::string_view free_bytes_variable = "TANDEM_SHM_FREE_BYTES";

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
  std::uint64_t ring_bytes = 0;
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

/// Where a rank's tensor of an operation lies: in block `block` (1, 2, ...: the group's shared
/// blocks, see detail/blocks.hpp) at byte `at` of the rank's part, or elsewhere (block 0). Ranks
/// compare it after the first barrier of an all_reduce, reduce_scatter or all_gather, since a
/// block's tensors take another path.
struct Place {
  std::uint64_t block = 0;
  std::uint64_t at = 0;
  friend bool operator==(const Place&, const Place&) = default;
};

/// One rank's record. `calls` and `places` are plain data, published by the release store of
/// `arrivals`.
struct alignas(64) RankState {
  std::atomic<std::uint64_t> arrivals{0};  ///< barriers this rank has arrived at
  std::atomic<std::int64_t> pid{0};
  std::atomic<std::uint64_t> pid_namespace{0};  ///< where `pid` means something (see pid_space)
  std::atomic<std::uint32_t> left{0};           ///< its communicator is destroyed
  std::atomic<std::uint32_t> locked{0};  ///< it holds its lock (Segment::lock_rank) while alive
  CollectiveFingerprint calls[2];        ///< its call, per staging half (see Engine::arrive)
  Place places[2];                       ///< its tensor's place, per staging half
  /// Chunks of this rank's share of the current collective in a shared block that are claimed,
  /// by it or by a peer done with its own (detail/in_block.hpp); it sets 0 before the first
  /// barrier. A cache line of its own: its owner counts every chunk there.
  alignas(64) std::atomic<std::uint64_t> claimed{0};
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
  std::size_t ring_bytes = 0;  ///< a power of two
  std::size_t ranks_at = 0;
  std::size_t rings_at = 0;
  std::size_t ring_data_at = 0;
  std::size_t slots_at = 0;
  std::size_t total = 0;

  Layout(int ranks, std::size_t slot, std::size_t ring = default_ring_bytes)
      : size(ranks), slot_bytes(round_up(slot, 64)), ring_bytes(ring) {
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

/// The least a staging slot of a group of `ranks` may be.
constexpr std::size_t smallest_slot_for(int ranks) noexcept {
  return std::max(smallest_slot_bytes, round_up(static_cast<std::size_t>(ranks) * 8, 64));
}

/// The layout for `ranks` ranks with slots of `slot` bytes and the default rings, shrunk until
/// it takes at most `budget` bytes: whichever of the slots (2 per rank) and the rings (one per
/// ordered pair) takes more is halved first, down to smallest_slot_for(ranks) and
/// smallest_ring_bytes. nullopt where even the smallest does not fit.
inline std::optional<Layout> fit_layout(int ranks, std::size_t slot, std::size_t budget) {
  const std::size_t least_slot = std::min(slot, smallest_slot_for(ranks));
  std::size_t ring = default_ring_bytes;
  const auto n = static_cast<std::size_t>(ranks);
  for (;;) {
    const Layout layout(ranks, slot, ring);
    if (layout.total <= budget) return layout;
    const bool slots_weigh_more = 2 * n * slot >= n * n * ring;
    if (slot / 2 >= least_slot && (slots_weigh_more || ring / 2 < smallest_ring_bytes)) {
      slot /= 2;
    } else if (ring / 2 >= smallest_ring_bytes) {
      ring /= 2;
    } else {
      return std::nullopt;
    }
  }
}

/// "64.0 MiB", "330 KiB": a size in an error message.
inline std::string mebibytes(std::size_t bytes) {
  char text[48];
  if (bytes < (std::size_t{1} << 20)) {
    std::snprintf(text, sizeof text, "%zu KiB", (bytes + 1023) >> 10);
  } else {
    std::snprintf(text, sizeof text, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  }
  return text;
}

/// What /dev/shm has free for this user (statvfs), at most TANDEM_SHM_FREE_BYTES where that is
/// set (a bad value is an Error naming it). SIZE_MAX where statvfs cannot tell.
inline std::size_t shm_free_bytes(const EnvLookup& env = process_env) {
  std::size_t free = SIZE_MAX;
  struct statvfs info {};
  if (::statvfs(std::string(shm_directory).c_str(), &info) == 0) {
    free = static_cast<std::size_t>(info.f_bavail) * static_cast<std::size_t>(info.f_frsize);
  }
  if (const auto cap = env_int_in(env, free_bytes_variable, 0, INT64_MAX)) {
    free = std::min(free, static_cast<std::size_t>(*cap));
  }
  return free;
}

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

/// This process's PID namespace (the inode of /proc/self/ns/pid; 0 where unreadable): a peer's
/// pid is looked up in /proc only where its namespace is this one - in another container's
/// namespace the same number is another process, or none.
inline std::uint64_t pid_space() {
  struct stat info {};
  return ::stat("/proc/self/ns/pid", &info) == 0 ? static_cast<std::uint64_t>(info.st_ino) : 0;
}

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

/// "/tandem-shm-<32 random hex digits>": 128 random bits, so that names made by any process of
/// any container or PID namespace that shares this /dev/shm never meet (no pid in it: pids repeat
/// across namespaces); create() retries on a collision anyway. Rank 0 makes it and announces it
/// to the group through the store.
inline std::string fresh_name() {
  std::random_device entropy;
  char random[name_digits + 1];
  std::snprintf(random, sizeof random, "%08x%08x%08x%08x", entropy(), entropy(), entropy(),
                entropy());
  return "/" + std::string(name_prefix) + random;
}

/// A lock on byte `at` of the object behind `fd`, or on all of it (`bytes` 0), as an open file
/// description lock: held until the last descriptor of this open is closed - when its process
/// ends, however it ends - and seen by every process that opens the object, whatever its PID
/// namespace.
inline struct flock lock_region(short type, std::size_t at, std::size_t bytes) {
  struct flock region {};  // "struct": <sys/file.h>'s flock() function shares the name
  region.l_type = type;
  region.l_whence = SEEK_SET;
  region.l_start = static_cast<off_t>(at);
  region.l_len = static_cast<off_t>(bytes);
  return region;
}

/// Whether some other open of the object behind `fd` holds a lock over [at, at + bytes) (bytes
/// 0: to the end); nullopt where the system cannot tell.
inline std::optional<bool> locked_by_another(int fd, std::size_t at, std::size_t bytes) {
  struct flock region = lock_region(F_WRLCK, at, bytes);
  if (::fcntl(fd, F_OFD_GETLK, &region) != 0) return std::nullopt;
  return region.l_type != F_UNLCK;
}

/// Removes the names left by groups whose creator died between making a segment and its last
/// rank mapping it (the only window in which one is left behind): a name of this form whose
/// object has a size (its creator had locked it before it gave it one) and no lock (every rank
/// that opened it is gone). A segment some rank still holds - of any job, in any container - is
/// never touched, nor one this user may not open, nor a name of another form.
inline void sweep_stale_segments() {
  DIR* dir = ::opendir(std::string(shm_directory).c_str());
  if (!dir) return;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string_view name(entry->d_name);
    if (name.size() != name_prefix.size() + name_digits ||
        name.substr(0, name_prefix.size()) != name_prefix ||
        name.find_first_not_of("0123456789abcdef", name_prefix.size()) != std::string_view::npos) {
      continue;
    }
    const std::string path = "/" + std::string(name);
    Fd fd(::shm_open(path.c_str(), O_RDWR, 0));
    if (!fd) continue;
    struct stat info {};
    if (::fstat(fd.get(), &info) != 0 || info.st_size == 0) continue;
    if (locked_by_another(fd.get(), 0, 0) == false) (void)::shm_unlink(path.c_str());
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
        fd_(std::move(other.fd_)),
        base_(std::exchange(other.base_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        size_(other.size_),
        creator_(std::exchange(other.creator_, false)),
        locked_(std::exchange(other.locked_, false)),
        has_control_(other.has_control_) {}
  Segment& operator=(Segment&&) = delete;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() {
    if (creator_ && (!base_ || !has_control_ || control().mapped.load() < size_)) {
      (void)::shm_unlink(name_.c_str());
    }
    if (base_) ::munmap(base_, bytes_);
  }

  /// A new segment of `layout.total` bytes, its memory reserved (a full /dev/shm is an Error
  /// here, not a SIGBUS later) and its control block and rank records constructed. Where
  /// /dev/shm has no room and `no_room` is given, sets it and returns an empty Segment instead.
  static Segment create(int rank, const Layout& layout, const char* operation,
                        bool* no_room = nullptr) {
    Segment segment = create_object(rank, layout.total, operation, no_room);
    if (!segment.base_) return segment;
    segment.size_ = static_cast<std::uint32_t>(layout.size);
    segment.has_control_ = true;
    auto* control = new (segment.base_) Control();
    control->magic = segment_magic;
    control->version = layout_version;
    control->size = segment.size_;
    control->slot_bytes = layout.slot_bytes;
    control->ring_bytes = layout.ring_bytes;
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

  /// A new object of `bytes` bytes (zeroed), named, locked by rank `rank`, reserved and mapped,
  /// with nothing constructed in it: the control segment above, or a group's shared block. The
  /// creator unlinks the name on destruction until release_name(). Where /dev/shm has no room
  /// and `no_room` is given, sets it and returns an empty Segment instead.
  static Segment create_object(int rank, std::size_t bytes, const char* operation,
                               bool* no_room = nullptr) {
    sweep_stale_segments();
    Segment segment;
    Fd& fd = segment.fd_;
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
    // Locked before it has a size: sweep_stale_segments() leaves a sized object with a lock alone.
    segment.lock_rank(rank);
    const auto size = static_cast<off_t>(bytes);
    // posix_fallocate returns its error instead of setting errno.
    const int error =
        ::ftruncate(fd.get(), size) != 0 ? errno : ::posix_fallocate(fd.get(), 0, size);
    if (error != 0) {  // the destructor unlinks the name
      if (no_room && (error == ENOSPC || error == ENOMEM || error == EFBIG)) {
        *no_room = true;
        return Segment();
      }
      throw Error(rank, operation,
                  "cannot reserve " + std::to_string(bytes >> 10) + " KiB in /dev/shm (" +
                      errno_text(error) +
                      "): free some, or lower ShmCommOptions::slot_bytes (2 per rank)");
    }
    segment.map(bytes, rank, operation);
    return segment;
  }

  /// Maps the segment `name` that rank 0 created for the same layout.
  static Segment open(int rank, const std::string& name, const Layout& layout,
                      const char* operation) {
    Segment segment = open_object(rank, name, layout.total, operation,
                                  "do all ranks pass the same ShmCommOptions::slot_bytes?");
    segment.size_ = static_cast<std::uint32_t>(layout.size);
    segment.has_control_ = true;
    const Control& control = segment.control();
    if (control.magic != segment_magic || control.version != layout_version ||
        control.size != segment.size_ || control.slot_bytes != layout.slot_bytes ||
        control.ring_bytes != layout.ring_bytes) {
      throw Error(rank, operation,
                  "rank 0's segment " + name +
                      " has another layout (a different tandem version, group size or "
                      "slot_bytes)");
    }
    return segment;
  }

  /// Maps the object `name` of `bytes` bytes that rank 0 created (create_object), taking this
  /// rank's lock on it; `hint` ends the Error where its size is another.
  static Segment open_object(int rank, const std::string& name, std::size_t bytes,
                             const char* operation, const char* hint) {
    Segment segment;
    segment.name_ = name;
    Fd& fd = segment.fd_;
    fd = Fd(::shm_open(name.c_str(), O_RDWR, 0));
    if (!fd) {
      throw Error(rank, operation,
                  "shm_open(" + name + ") of rank 0's segment failed: " + errno_text(errno) +
                      " (do all ranks run on one host, with one /dev/shm?)");
    }
    struct stat info {};
    if (::fstat(fd.get(), &info) != 0 || static_cast<std::size_t>(info.st_size) != bytes) {
      throw Error(rank, operation,
                  "rank 0's object " + name + " holds " + std::to_string(info.st_size) +
                      " bytes, this rank expects " + std::to_string(bytes) + " (" + hint + ")");
    }
    segment.lock_rank(rank);
    segment.map(bytes, rank, operation);
    return segment;
  }

  /// The creator no longer unlinks the name on destruction (every rank has mapped it and one
  /// has unlinked it, or will).
  void release_name() noexcept { creator_ = false; }
  /// Bytes mapped.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

  /// Removes the name (the memory stays while any rank has it mapped).
  void unlink() const noexcept { (void)::shm_unlink(name_.c_str()); }

  /// Whether rank `r` still holds the lock it took when it opened the segment (see lock_rank):
  /// false once its process has ended, whatever its PID namespace; nullopt where the system
  /// cannot tell.
  [[nodiscard]] std::optional<bool> rank_holds_lock(int r) const {
    return locked_by_another(fd_.get(), static_cast<std::size_t>(r), 1);
  }

  /// Whether this rank holds its lock (taken when the segment was made or opened).
  [[nodiscard]] bool locked() const noexcept { return locked_; }

  [[nodiscard]] std::byte* base() const noexcept { return base_; }
  [[nodiscard]] Control& control() const noexcept { return *reinterpret_cast<Control*>(base_); }
  [[nodiscard]] const std::string& name() const noexcept { return name_; }

 private:
  /// Takes the lock on byte `rank` of the object, which this open holds while the process lives
  /// (rank_holds_lock); a system without open file description locks goes without.
  void lock_rank(int rank) {
    struct flock region = lock_region(F_WRLCK, static_cast<std::size_t>(rank), 1);
    locked_ = ::fcntl(fd_.get(), F_OFD_SETLK, &region) == 0;
  }

  void map(std::size_t bytes, int rank, const char* operation) {
    void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), 0);
    if (base == MAP_FAILED) {
      throw Error(rank, operation,
                  "mmap of " + std::to_string(bytes >> 10) + " KiB failed: " + errno_text(errno));
    }
    base_ = static_cast<std::byte*>(base);
    bytes_ = bytes;
  }

  std::string name_;
  Fd fd_;  ///< kept open: it holds this rank's lock
  std::byte* base_ = nullptr;
  std::size_t bytes_ = 0;
  std::uint32_t size_ = 0;
  bool creator_ = false;
  bool locked_ = false;
  bool has_control_ = false;  ///< a control segment (create/open), not a block (create_object)
};

}  // namespace tandem::detail::shm
