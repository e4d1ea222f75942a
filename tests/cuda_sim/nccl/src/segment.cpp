// The shared segment of a simulated NCCL communicator (segment.hpp).
#include "segment.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <map>
#include <mutex>

namespace simnccl {
namespace {

constexpr std::size_t align_up(std::size_t n, std::size_t to) {
  return (n + to - 1) / to * to;
}

constexpr std::size_t ranks_offset = align_up(sizeof(SharedHeader), 64);
constexpr std::size_t ring_stride = sizeof(SharedRing) + ring_bytes;

std::size_t slots_offset(int nranks) {
  return align_up(ranks_offset + static_cast<std::size_t>(nranks) * sizeof(SharedRank), 4096);
}
std::size_t rings_offset(int nranks) {
  return slots_offset(nranks) + static_cast<std::size_t>(nranks) * 2 * slot_bytes;
}
std::size_t segment_size(int nranks) {
  const auto n = static_cast<std::size_t>(nranks);
  return rings_offset(nranks) + n * n * ring_stride;
}

std::uint64_t random_word() noexcept {
  std::uint64_t word = 0;
  while (getrandom(&word, sizeof word, 0) != static_cast<ssize_t>(sizeof word)) {
  }
  return word | 1;  // never 0: 0 means "not drawn yet"
}

std::atomic<std::uint64_t> token{0};

// Every segment this process has mapped, by name: ranks of one process share one mapping.
struct Registry {
  std::mutex mutex;
  std::map<std::string, std::weak_ptr<Segment>> segments;
};

Registry& registry() {
  static Registry* const instance = new Registry;  // never destroyed: stream work may outlive main
  return *instance;
}

// fork(): a child must not keep the parent's locks alive (its copy of a descriptor would), and
// is a process of its own (a token of its own).
void before_fork() {
  registry().mutex.lock();
}
void after_fork_parent() {
  registry().mutex.unlock();
}
void after_fork_child() {
  token.store(0);
  for (auto& [name, weak] : registry().segments) {
    (void)name;
    if (auto segment = weak.lock()) segment->forget_descriptor();
  }
  registry().mutex.unlock();
}

long futex(std::uint32_t* word, int op, std::uint32_t value, const timespec* limit) noexcept {
  return syscall(SYS_futex, word, op, value, limit, nullptr, 0);
}

}  // namespace

std::uint64_t process_token() noexcept {
  std::uint64_t current = token.load();
  if (current != 0) return current;
  const std::uint64_t drawn = random_word();
  return token.compare_exchange_strong(current, drawn) ? drawn : current;
}

std::shared_ptr<Segment> Segment::open(const std::string& name, int nranks, std::string& why) {
  static std::once_flag fork_handlers;
  std::call_once(fork_handlers,
                 [] { pthread_atfork(before_fork, after_fork_parent, after_fork_child); });
  Registry& reg = registry();
  std::lock_guard lock(reg.mutex);
  for (auto it = reg.segments.begin(); it != reg.segments.end();) {
    it = it->second.expired() ? reg.segments.erase(it) : std::next(it);
  }
  auto known = reg.segments.find(name);
  if (auto segment = known == reg.segments.end() ? nullptr : known->second.lock()) {
    if (segment->nranks() != nranks) {
      why = "ranks disagree on the communicator's size (" + std::to_string(segment->nranks()) +
            " and " + std::to_string(nranks) + ")";
      return nullptr;
    }
    return segment;
  }
  const std::size_t size = segment_size(nranks);
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    why = "shm_open(" + name + ") failed: " + std::strerror(errno);
    return nullptr;
  }
  struct stat status {};
  if (fstat(fd, &status) != 0) {
    why = "fstat(" + name + ") failed: " + std::strerror(errno);
    close(fd);
    return nullptr;
  }
  if (status.st_size == 0) {
    if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
      why = "ftruncate(" + name + ") failed: " + std::strerror(errno);
      close(fd);
      return nullptr;
    }
  } else if (static_cast<std::size_t>(status.st_size) != size) {
    why = "ranks disagree on the communicator's size (this rank says " + std::to_string(nranks) +
          ", the shared segment was made for another count)";
    close(fd);
    return nullptr;
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    why = "mmap(" + name + ") failed: " + std::strerror(errno);
    close(fd);
    return nullptr;
  }
  // A forked child gets no copy of the mapping: the mapping holds the file, and with it this
  // process's locks, which must end with this process (forget_descriptor does the same for the
  // descriptor).
  (void)madvise(base, size, MADV_DONTFORK);
  std::shared_ptr<Segment> segment(new Segment(name, fd, base, size, nranks));
  std::uint32_t expected = 0;
  auto& header = segment->header();
  if (!atomic(header.nranks)
           .compare_exchange_strong(expected, static_cast<std::uint32_t>(nranks)) &&
      expected != static_cast<std::uint32_t>(nranks)) {
    why = "ranks disagree on the communicator's size (" + std::to_string(expected) + " and " +
          std::to_string(nranks) + ")";
    return nullptr;
  }
  reg.segments[name] = segment;
  return segment;
}

Segment::~Segment() {
  munmap(base_, size_);
  if (fd_ >= 0) close(fd_);
}

SharedRank& Segment::rank(int r) const noexcept {
  return *reinterpret_cast<SharedRank*>(static_cast<std::byte*>(base_) + ranks_offset +
                                        static_cast<std::size_t>(r) * sizeof(SharedRank));
}

std::byte* Segment::slot(int r, std::uint64_t round) const noexcept {
  return static_cast<std::byte*>(base_) + slots_offset(nranks_) +
         (static_cast<std::size_t>(r) * 2 + round % 2) * slot_bytes;
}

SharedRing& Segment::ring(int from, int to) const noexcept {
  const auto index = static_cast<std::size_t>(from) * static_cast<std::size_t>(nranks_) +
                     static_cast<std::size_t>(to);
  return *reinterpret_cast<SharedRing*>(static_cast<std::byte*>(base_) + rings_offset(nranks_) +
                                        index * ring_stride);
}

std::byte* Segment::ring_data(int from, int to) const noexcept {
  return reinterpret_cast<std::byte*>(&ring(from, to)) + sizeof(SharedRing);
}

namespace {

struct Doorbell {
  std::uint32_t& word;
  std::uint32_t& waiters;
};

Doorbell doorbell(SharedHeader& head, Bell which) {
  if (which == Bell::stream) return {head.stream_bell, head.stream_waiters};
  return {head.host_bell, head.host_waiters};
}

}  // namespace

void Segment::ring_bell(Bell which) const noexcept {
  const Doorbell door = doorbell(header(), which);
  atomic(door.word).fetch_add(1);
  if (atomic(door.waiters).load() != 0) futex(&door.word, FUTEX_WAKE, INT_MAX, nullptr);
}

std::uint32_t Segment::bell(Bell which) const noexcept {
  return atomic(doorbell(header(), which).word).load();
}

void Segment::wait_bell(Bell which, std::uint32_t seen,
                        std::chrono::microseconds limit) const noexcept {
  const Doorbell door = doorbell(header(), which);
  atomic(door.waiters).fetch_add(1);
  if (atomic(door.word).load() == seen) {
    const auto micros = limit.count();
    const timespec span{static_cast<time_t>(micros / 1000000),
                        static_cast<long>(micros % 1000000) * 1000};
    futex(&door.word, FUTEX_WAIT, seen, &span);
  }
  atomic(door.waiters).fetch_sub(1);
}

namespace {

// An open file description lock of type `type` on byte r of the segment: rank r's.
struct flock byte_lock(short type, int r) {
  struct flock lock {};
  lock.l_type = type;
  lock.l_whence = SEEK_SET;
  lock.l_start = r;
  lock.l_len = 1;
  return lock;
}

}  // namespace

void Segment::hold_rank(int r) const noexcept {
  if (fd_ < 0) return;
  struct flock lock = byte_lock(F_WRLCK, r);
  (void)fcntl(fd_, F_OFD_SETLK, &lock);
}

void Segment::release_rank(int r) const noexcept {
  if (fd_ < 0) return;
  struct flock lock = byte_lock(F_UNLCK, r);
  (void)fcntl(fd_, F_OFD_SETLK, &lock);
}

bool Segment::rank_process_alive(int r) const noexcept {
  SharedRank& record = rank(r);
  if (atomic(record.ready).load(std::memory_order_acquire) == 0) return true;  // not known yet
  if (record.process == process_token() || fd_ < 0) return true;
  struct flock lock = byte_lock(F_WRLCK, r);
  if (fcntl(fd_, F_OFD_GETLK, &lock) != 0) return true;  // cannot tell: assume it lives
  return lock.l_type != F_UNLCK;
}

void Segment::forget_descriptor() noexcept {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

void Segment::unlink() const noexcept {
  (void)shm_unlink(name_.c_str());
}

}  // namespace simnccl
