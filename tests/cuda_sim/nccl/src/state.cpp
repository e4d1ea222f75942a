// A simulated NCCL communicator's rank, handles, errors and waiting (state.hpp).
#include "state.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <vector>

#if __has_include(<cuda_sim/control.h>)
#include <cuda_sim/control.h>  // the simulated runtime's stress switch
#define SIMNCCL_RUNTIME_CONTROL 1
#endif

namespace simnccl {
namespace {

// ncclGetUniqueId's ids: this magic, then 32 random bytes (the segment's name uses 16 of them).
constexpr char id_magic[8] = {'T', 'N', 'D', 'M', 'S', 'I', 'M', '1'};
constexpr std::size_t id_random_at = sizeof id_magic;
constexpr std::size_t id_random_bytes = 32;

std::uint64_t mix(std::uint64_t x) noexcept {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

struct LastError {
  std::mutex mutex;
  std::string text;
};

LastError& last_error() {
  static LastError* const instance = new LastError;
  return *instance;
}

bool debug_warnings() {
  static const bool on = [] {
    const char* level = std::getenv("NCCL_DEBUG");
    return level && (std::strcmp(level, "WARN") == 0 || std::strcmp(level, "INFO") == 0 ||
                     std::strcmp(level, "TRACE") == 0);
  }();
  return on;
}

struct Handles {
  std::mutex mutex;
  std::unordered_map<const ncclComm*, std::shared_ptr<CommState>> live;
  std::vector<ncclComm*> made;  // never freed: a stale handle stays recognisable
  std::uint64_t serial = 0;
};

Handles& handles() {
  static Handles* const instance = new Handles;
  return *instance;
}

}  // namespace

void set_last_error(const std::string& text) {
  if (debug_warnings()) std::fprintf(stderr, "NCCL WARN (simulated) %s\n", text.c_str());
  LastError& last = last_error();
  std::lock_guard lock(last.mutex);
  last.text = text;
}

std::string copy_last_error() {
  LastError& last = last_error();
  std::lock_guard lock(last.mutex);
  return last.text;
}

ncclResult_t fail(ncclResult_t code, const std::string& text) {
  set_last_error(text);
  return code;
}

// Stress mode is the simulated runtime's (cuda_sim_set_stress, TANDEM_CUDA_SIM_STRESS=<seed>).
bool stress_mode() noexcept {
#ifdef SIMNCCL_RUNTIME_CONTROL
  return cuda_sim_stress_enabled(nullptr) != 0;
#else
  static const bool on = [] {
    const char* seed = std::getenv("TANDEM_CUDA_SIM_STRESS");
    return seed != nullptr && *seed != '\0';
  }();
  return on;
#endif
}

std::uint64_t stress_draw() noexcept {
  unsigned long long seed = 0;
#ifdef SIMNCCL_RUNTIME_CONTROL
  (void)cuda_sim_stress_enabled(&seed);
#else
  const char* text = std::getenv("TANDEM_CUDA_SIM_STRESS");
  seed = text ? std::strtoull(text, nullptr, 10) : 0;
#endif
  static std::atomic<std::uint64_t> counter{0};
  return mix(seed ^ mix(counter.fetch_add(1)));
}

std::string segment_name(const ncclUniqueId& id) {
  if (std::memcmp(id.internal, id_magic, sizeof id_magic) != 0) return {};
  static constexpr char digits[] = "0123456789abcdef";
  std::string name = "/tandem-nccl-sim-";
  for (std::size_t i = id_random_at; i < id_random_at + 16; ++i) {
    const auto byte = static_cast<unsigned char>(id.internal[i]);
    name += digits[byte >> 4];
    name += digits[byte & 15];
  }
  return name;
}

ncclUniqueId child_id(const ncclUniqueId& parent, std::uint64_t split, int color) {
  ncclUniqueId child{};
  std::memcpy(child.internal, id_magic, sizeof id_magic);
  const std::uint64_t salt = mix(split) ^ mix(0x5eed0000ull + static_cast<std::uint32_t>(color));
  for (std::size_t word = 0; word < id_random_bytes / 8; ++word) {
    std::uint64_t bits = 0;
    for (std::size_t w = 0; w < id_random_bytes / 8; ++w) {
      std::uint64_t in = 0;
      std::memcpy(&in, parent.internal + id_random_at + 8 * w, 8);
      bits = mix(bits ^ in ^ mix(word * 4 + w) ^ salt);
    }
    std::memcpy(child.internal + id_random_at + 8 * word, &bits, 8);
  }
  return child;
}

// --- CommState ----------------------------------------------------------------------------------

CommState::CommState(const ncclUniqueId& id_, int rank_, int nranks_, int device_, bool blocking_)
    : id(id_),
      name(segment_name(id_)),
      rank(rank_),
      nranks(nranks_),
      device(device_),
      blocking(blocking_) {}

std::shared_ptr<CommState> CommState::make(const ncclUniqueId& id, int rank, int nranks, int device,
                                           bool blocking) {
  return std::shared_ptr<CommState>(new CommState(id, rank, nranks, device, blocking),
                                    [](CommState* comm) { release(comm); });
}

void CommState::release(CommState* comm) noexcept {
  if (comm->holds_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete comm;
}

CommState::~CommState() {
  join_job();
  leave();
}

void CommState::set_segment(std::shared_ptr<Segment> segment) {
  std::lock_guard lock(segment_mutex_);
  segment_ = std::move(segment);
}

std::shared_ptr<Segment> CommState::segment() const {
  std::lock_guard lock(segment_mutex_);
  return segment_;
}

ncclResult_t CommState::fail(ncclResult_t code, const std::string& text) {
  {
    std::lock_guard lock(text_mutex_);
    text_ = text;
  }
  set_last_error(text);
  return code;
}

void CommState::set_error(ncclResult_t code) noexcept {
  if (code == ncclSuccess || code == ncclInProgress) return;
  int expected = ncclSuccess;
  error_.compare_exchange_strong(expected, code, std::memory_order_acq_rel);
}

std::string CommState::error_text() const {
  std::lock_guard lock(text_mutex_);
  return text_;
}

ncclResult_t CommState::async_state() {
  if (const ncclResult_t failed = error(); failed != ncclSuccess) return failed;
  {
    std::lock_guard lock(job_mutex_);
    if (job_active_) {
      if (!job_done_.load(std::memory_order_acquire)) return ncclInProgress;
      job_.join();
      job_active_ = false;
      if (job_result_ != ncclSuccess) {
        set_error(job_result_);
        return error();
      }
    }
  }
  if (delayed.load(std::memory_order_acquire) > 0) return ncclInProgress;
  if (finalize_called.load() && !flushed()) return ncclInProgress;
  return ncclSuccess;
}

void CommState::start_job(std::function<ncclResult_t()> body) {
  std::lock_guard lock(job_mutex_);
  if (job_active_) {  // a finished job nobody asked about (callers ensured it ended)
    job_.join();
    if (job_result_ != ncclSuccess) set_error(job_result_);
  }
  job_done_.store(false);
  job_active_ = true;
  job_ = std::thread([this, body = std::move(body)] {
    job_result_ = body();
    job_done_.store(true, std::memory_order_release);
  });
}

void CommState::join_job() {
  std::lock_guard lock(job_mutex_);
  if (!job_active_) return;
  job_.join();
  job_active_ = false;
  if (job_result_ != ncclSuccess) set_error(job_result_);
}

void CommState::abort() {
  aborted.store(true, std::memory_order_release);
  if (auto shared = segment()) {
    shared->ring_bell(Bell::stream);
    shared->ring_bell(Bell::host);
  }
  { std::lock_guard lock(turn_mutex_); }
  turn_cv_.notify_all();
  join_job();
  leave();
}

void CommState::leave() {
  if (left_.exchange(true)) return;
  const auto shared = segment();
  if (!shared) return;
  if (claimed.load()) {
    atomic(shared->rank(rank).left).store(1, std::memory_order_release);
    shared->release_rank(rank);
  }
  if (!joined.load()) shared->unlink();  // an init that never completed leaves no name behind
  shared->ring_bell(Bell::stream);
  shared->ring_bell(Bell::host);
}

bool CommState::wait_turn(std::uint64_t ticket) {
  std::unique_lock lock(turn_mutex_);
  turn_cv_.wait(lock, [&] { return completed_ == ticket || aborted.load(); });
  return !aborted.load();
}

void CommState::finish_turn(std::uint64_t ticket) {
  {
    std::lock_guard lock(turn_mutex_);
    if (ticket == completed_) {
      ++completed_;
      while (finished_early_.erase(completed_) != 0) ++completed_;
    } else {
      finished_early_.insert(ticket);
    }
  }
  turn_cv_.notify_all();
}

bool CommState::flushed() {
  std::lock_guard lock(turn_mutex_);
  return completed_ == issued_;
}

bool CommState::wait_flushed() {
  std::unique_lock lock(turn_mutex_);
  turn_cv_.wait(lock, [&] { return completed_ == issued_ || aborted.load(); });
  return !aborted.load();
}

// --- handles ------------------------------------------------------------------------------------

ncclComm_t register_comm(const std::shared_ptr<CommState>& comm) {
  Handles& all = handles();
  std::lock_guard lock(all.mutex);
  auto* handle = new ncclComm{++all.serial};
  all.made.push_back(handle);
  all.live.emplace(handle, comm);
  comm->handle = handle;
  return handle;
}

std::shared_ptr<CommState> find_comm(ncclComm_t handle) {
  if (handle == nullptr) return nullptr;
  Handles& all = handles();
  std::lock_guard lock(all.mutex);
  const auto found = all.live.find(handle);
  return found == all.live.end() ? nullptr : found->second;
}

void unregister_comm(ncclComm_t handle) {
  Handles& all = handles();
  std::shared_ptr<CommState> last;  // released outside the lock
  std::lock_guard lock(all.mutex);
  if (auto found = all.live.find(handle); found != all.live.end()) {
    last = std::move(found->second);
    all.live.erase(found);
  }
}

ncclResult_t bad_comm(ncclComm_t handle, const char* api) {
  if (handle == nullptr)
    return fail(ncclInvalidArgument, std::string(api) + " : comm argument is NULL");
  char address[32];
  std::snprintf(address, sizeof address, "%p", static_cast<void*>(handle));
  return fail(ncclInvalidArgument, std::string(api) + " : comm " + address +
                                       " is not a live communicator (destroyed or aborted)");
}

ncclResult_t ensure_ready(CommState& comm, const char* api) {
  const ncclResult_t state = comm.async_state();
  if (state == ncclInProgress) {
    return comm.fail(ncclInvalidArgument,
                     std::string(api) +
                         " : Attempt to use communicator before the previous operation returned "
                         "ncclSuccess");
  }
  return state;
}

// --- waiting ------------------------------------------------------------------------------------

void Patience::idle(std::uint32_t mark) {
  if (++idle_ < 16) {
    std::this_thread::yield();
  } else if (segment_) {
    segment_->wait_bell(bell_, mark, std::chrono::milliseconds(20));
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

bool Patience::check_due() {
  const auto now = std::chrono::steady_clock::now();
  if (now - last_check_ < std::chrono::milliseconds(100)) return false;
  last_check_ = now;
  return true;
}

std::string peer_gone(const Segment& segment, int q) {
  SharedRank& record = segment.rank(q);
  if (atomic(record.left).load(std::memory_order_acquire) != 0) {
    return "rank " + std::to_string(q) + " left the communicator (aborted, destroyed or failed)";
  }
  if (!segment.rank_process_alive(q)) {
    return "rank " + std::to_string(q) + " (process " + std::to_string(record.pid) + ") died";
  }
  return {};
}

}  // namespace simnccl
