// The shared memory where the ranks of one simulated NCCL communicator meet: a POSIX shared
// memory object named from the communicator's unique id, mapped once per process (threads of one
// process share the mapping, so ThreadSanitizer sees their atomics), unlinked as soon as every
// rank has joined. Its words are touched only through std::atomic_ref; a futex on one of them
// (the doorbell) lets a waiting rank sleep until another rank changes something.
//
// Layout: a header, one record per rank, two collective slots per rank (a round's contribution,
// double-buffered), and one ring buffer per ordered pair of ranks for point to point.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace simnccl {

/// One rank's share of a collective round (a bounded chunk: any count works in rounds).
inline constexpr std::size_t slot_bytes = 64 * 1024;
/// One direction of one pair's point-to-point channel.
inline constexpr std::size_t ring_bytes = 64 * 1024;
/// Ranks a communicator may have here (the rings grow with its square).
inline constexpr int max_ranks = 256;

struct SharedHeader {
  std::uint32_t nranks;  // set once by the first rank to open the segment
  std::uint32_t joined;  // ranks that have claimed their record
  // Futex words, bumped on every change a waiter may look for, and their sleepers: one for stream
  // work, one for the host's init and split, so that the host never synchronises with stream
  // work through them (ThreadSanitizer must see a host read of unsynchronised results).
  std::uint32_t stream_bell;
  std::uint32_t stream_waiters;
  std::uint32_t host_bell;
  std::uint32_t host_waiters;
};

/// Which of the segment's doorbells: stream work's, or the host's (init, split).
enum class Bell { stream, host };

struct alignas(64) SharedRank {
  std::uint32_t claimed;  // 0 -> 1 by the rank's init
  std::uint32_t ready;    // its fields below are written
  std::uint32_t left;     // aborted or destroyed: it will not take part any more
  std::int32_t device;
  std::uint64_t process;               // random token of the rank's process
  std::int64_t pid;                    // for messages only
  alignas(64) std::uint64_t posted;    // last collective round whose slot it has filled
  alignas(64) std::uint64_t consumed;  // last collective round it has finished reading
  alignas(64) std::uint64_t split_seq[2];
  std::int32_t split_color[2];
  std::int32_t split_key[2];
};

struct alignas(64) SharedRing {
  std::uint64_t written;           // bytes the sender has put in, ever
  alignas(64) std::uint64_t read;  // bytes the receiver has taken out, ever
};

template <class T>
std::atomic_ref<T> atomic(T& word) noexcept {
  return std::atomic_ref<T>(word);
}

/// This process's random token (a fresh one in a forked child).
std::uint64_t process_token() noexcept;

/// A mapped segment. Shared (std::shared_ptr) by every rank of the process that uses it.
class Segment {
 public:
  /// Opens (creating if need be) and maps the segment `name` for a communicator of `nranks`;
  /// returns null and explains why on failure (a size that disagrees: ranks that disagree on
  /// nranks).
  static std::shared_ptr<Segment> open(const std::string& name, int nranks, std::string& why);

  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  [[nodiscard]] int nranks() const noexcept { return nranks_; }
  [[nodiscard]] const std::string& name() const noexcept { return name_; }

  SharedHeader& header() const noexcept { return *static_cast<SharedHeader*>(base_); }
  SharedRank& rank(int r) const noexcept;
  std::byte* slot(int r, std::uint64_t round) const noexcept;
  SharedRing& ring(int from, int to) const noexcept;
  std::byte* ring_data(int from, int to) const noexcept;

  /// Tells every waiter on `which` that something changed.
  void ring_bell(Bell which) const noexcept;
  [[nodiscard]] std::uint32_t bell(Bell which) const noexcept;
  /// Sleeps until the doorbell differs from `seen` or `limit` has passed.
  void wait_bell(Bell which, std::uint32_t seen, std::chrono::microseconds limit) const noexcept;

  /// Marks rank r as held by this process (an open file description lock on byte r: the
  /// kernel drops it when the process dies, however it dies).
  void hold_rank(int r) const noexcept;
  void release_rank(int r) const noexcept;
  /// Whether rank r's process still holds the segment (a rank of this process always does).
  [[nodiscard]] bool rank_process_alive(int r) const noexcept;

  /// Removes the name (the mapping stays): once every rank has joined, or on a failed init.
  void unlink() const noexcept;

  /// In a forked child: closes its copy of the descriptor, which would otherwise keep the
  /// parent's locks (and so the parent's ranks) alive after the parent has died.
  void forget_descriptor() noexcept;

 private:
  Segment(std::string name, int fd, void* base, std::size_t size, int nranks)
      : name_(std::move(name)), fd_(fd), base_(base), size_(size), nranks_(nranks) {}

  std::string name_;
  int fd_ = -1;
  void* base_ = nullptr;
  std::size_t size_ = 0;
  int nranks_ = 0;
};

}  // namespace simnccl
