// Ranks as processes: this test binary starts copies of itself (posix_spawn, `--child ...`), which
// join communicators with threads of this process through the shared segment. A peer process
// that is killed makes the waiting ranks report ncclRemoteError naming it; one that is only
// stopped makes them wait; one that dies before everyone has joined fails the others' init; and
// nothing is left in /dev/shm. Stress mode (TANDEM_CUDA_SIM_STRESS) runs in a child of its own.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "support.hpp"

extern char** environ;

using namespace simtest;

namespace {

std::string to_hex(const ncclUniqueId& id) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string text;
  for (char c : id.internal) {
    const auto byte = static_cast<unsigned char>(c);
    text += digits[byte >> 4];
    text += digits[byte & 15];
  }
  return text;
}

ncclUniqueId from_hex(const std::string& text) {
  ncclUniqueId id{};
  for (std::size_t i = 0; i < sizeof id.internal && 2 * i + 1 < text.size(); ++i) {
    id.internal[i] = static_cast<char>(std::stoi(text.substr(2 * i, 2), nullptr, 16));
  }
  return id;
}

/// A child process running `--child <scenario> <rank> <nranks> <id>`, its stdin a pipe we hold;
/// killed and reaped at scope end if still there.
class Child {
 public:
  Child(const std::string& scenario, int rank, int nranks, const ncclUniqueId& id,
        const char* extra_environment = nullptr) {
    int fds[2];
    expect(pipe(fds) == 0, "pipe failed");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[0], 0);
    posix_spawn_file_actions_addclose(&actions, fds[1]);
    std::vector<std::string> args = {
        "/proc/self/exe",       "--child", scenario, std::to_string(rank),
        std::to_string(nranks), to_hex(id)};
    std::vector<char*> argv;
    for (auto& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    std::vector<char*> env;
    for (char** e = environ; *e; ++e) env.push_back(*e);
    std::string extra = extra_environment ? extra_environment : "";
    if (!extra.empty()) env.push_back(extra.data());
    env.push_back(nullptr);
    const int spawned =
        posix_spawn(&pid_, "/proc/self/exe", &actions, nullptr, argv.data(), env.data());
    posix_spawn_file_actions_destroy(&actions);
    close(fds[0]);
    input_ = fds[1];
    expect(spawned == 0, "posix_spawn failed: " + std::string(std::strerror(spawned)));
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() {
    if (input_ >= 0) close(input_);
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      (void)waitpid(pid_, nullptr, 0);
    }
  }
  [[nodiscard]] pid_t pid() const { return pid_; }
  /// Lets a child waiting on its stdin go on.
  void go() {
    const char byte = 'g';
    expect(write(input_, &byte, 1) == 1, "writing to the child");
  }
  void signal(int number) { expect(kill(pid_, number) == 0, "kill"); }
  /// Waits for the child to end: its exit code, or -signal.
  int wait() {
    int status = 0;
    wait_for([&] { return waitpid(pid_, &status, WNOHANG) == pid_; }, "the child process to end");
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  }

 private:
  pid_t pid_ = -1;
  int input_ = -1;
};

void wait_for_stdin() {
  char byte = 0;
  (void)read(0, &byte, 1);
}

/// Rank `rank` of the collectives every process-and-thread communicator here runs: an
/// all-reduce, a broadcast and a ring in a group, with large messages.
void collectives(ncclComm_t comm, int rank, int n) {
  Stream stream;
  const std::size_t count = 100000;
  std::vector<float> mine(count);
  for (std::size_t i = 0; i < count; ++i)
    mine[i] = static_cast<float>(rank + 1) + static_cast<float>(i % 7);
  Buffer a(count * 4), b(count * 4), c(count * 4);
  a.upload(mine.data(), count * 4, stream);
  b.upload(mine.data(), count * 4, stream);
  SIM_NCCL(ncclAllReduce(a.get(), a.get(), count, ncclFloat32, ncclSum, comm, stream));
  SIM_NCCL(ncclBroadcast(b.get(), b.get(), count, ncclFloat32, n - 1, comm, stream));
  SIM_NCCL(ncclGroupStart());
  SIM_NCCL(ncclSend(b.get(), count, ncclFloat32, (rank + 1) % n, comm, stream));
  SIM_NCCL(ncclRecv(c.get(), count, ncclFloat32, (rank + n - 1) % n, comm, stream));
  SIM_NCCL(ncclGroupEnd());
  const auto sums = a.download(stream), ring = c.download(stream);
  const float ranks_sum = static_cast<float>(n * (n + 1) / 2);
  for (std::size_t i = 0; i < count; i += 997) {
    float sum = 0, passed = 0;
    std::memcpy(&sum, sums.data() + i * 4, 4);
    std::memcpy(&passed, ring.data() + i * 4, 4);
    expect(sum == ranks_sum + static_cast<float>(n) * static_cast<float>(i % 7),
           "all-reduce across processes");
    expect(passed == static_cast<float>(n) + static_cast<float>(i % 7), "broadcast, then the ring");
  }
}

std::int32_t sum_one(ncclComm_t comm, std::int32_t value, cudaStream_t stream) {
  Buffer buffer(4);
  buffer.upload(&value, 4, stream);
  SIM_NCCL(ncclAllReduce(buffer.get(), buffer.get(), 1, ncclInt32, ncclSum, comm, stream));
  const auto got = buffer.download(stream);
  std::int32_t sum = 0;
  std::memcpy(&sum, got.data(), 4);
  return sum;
}

/// Stress mode: nonblocking communicators whose calls report ncclInProgress at random.
void stress(int n) {
  const ncclUniqueId id = unique_id();
  run_ranks(n, [&](int rank) {
    ncclConfig_t config = nonblocking_config();
    ncclComm_t comm = nullptr;
    (void)ncclCommInitRankConfig(&comm, n, id, rank, &config);
    expect(settle(comm) == ncclSuccess, "init");
    Stream stream;
    Buffer buffer(4096 * 4);
    int in_progress = 0;
    for (int i = 0; i < 200; ++i) {
      const ncclResult_t issued =
          ncclAllReduce(buffer.get(), buffer.get(), 4096, ncclFloat32, ncclSum, comm, stream);
      if (issued == ncclInProgress) ++in_progress;
      expect(issued == ncclSuccess || issued == ncclInProgress, "an all-reduce");
      expect(settle(comm) == ncclSuccess, "it settles");
      SIM_NCCL(ncclGroupStart());
      SIM_NCCL(ncclSend(buffer.get(), 16, ncclFloat32, (rank + 1) % n, comm, stream));
      SIM_NCCL(ncclRecv(buffer.bytes() + 64, 16, ncclFloat32, (rank + n - 1) % n, comm, stream));
      const ncclResult_t ended = ncclGroupEnd();
      expect(ended == ncclSuccess || ended == ncclInProgress, "a group");
      expect(settle(comm) == ncclSuccess, "the group settles");
    }
    SIM_CUDA(cudaStreamSynchronize(stream));
    expect(in_progress > 0, "stress mode reported ncclInProgress at least once in 200 calls");
    ncclComm_t child = nullptr;
    (void)ncclCommSplit(comm, 0, rank, &child, nullptr);
    expect(settle(comm) == ncclSuccess && child != nullptr, "split");
    expect(settle(child) == ncclSuccess, "the child");
    SIM_NCCL(ncclCommAbort(child));
    SIM_NCCL(ncclCommAbort(comm));
  });
}

/// Kills `peer` (rank 1) while this rank's work on `stream` waits for it: the communicator
/// reports ncclRemoteError naming rank 1, the waiting work gives up (the stream moves on), and the
/// communicator is aborted.
void kill_while_waited_for(Child& peer, ncclComm_t comm, cudaStream_t stream) {
  peer.signal(SIGKILL);
  expect(peer.wait() == -SIGKILL, "the peer was killed");
  const ncclResult_t state = wait_state(
      comm, [](ncclResult_t now) { return now != ncclSuccess; }, "the communicator to notice");
  expect(state == ncclRemoteError,
         "ncclRemoteError, not " + std::string(ncclGetErrorString(state)));
  const std::string text = ncclGetLastError(comm);
  expect(text.find("rank 1") != std::string::npos && text.find("died") != std::string::npos,
         "the text names the rank: " + text);
  SIM_CUDA(cudaStreamSynchronize(stream));
  SIM_NCCL(ncclCommAbort(comm));
}

}  // namespace

namespace simtest {

/// The child processes' scenarios (main.cpp hands `--child ...` here).
int child_main(int argc, char** argv) {
  if (argc < 6) return 2;
  const std::string scenario = argv[2];
  const int rank = std::atoi(argv[3]);
  const int nranks = std::atoi(argv[4]);
  const ncclUniqueId id = from_hex(argv[5]);
  try {
    if (scenario == "stress") {
      stress(nranks);
      return 0;
    }
    SIM_CUDA(cudaSetDevice(0));
    ncclComm_t comm = nullptr;
    if (scenario == "partial") {
      ncclConfig_t config = nonblocking_config();
      (void)ncclCommInitRankConfig(&comm, nranks, id, rank, &config);
      wait_for_stdin();  // killed meanwhile
      return 3;
    }
    SIM_NCCL(ncclCommInitRank(&comm, nranks, id, rank));
    if (scenario == "collectives") {
      collectives(comm, rank, nranks);
    } else if (scenario == "idle") {
      wait_for_stdin();  // killed meanwhile
      return 3;
    } else if (scenario == "forker") {
      // A forked child that outlives us must not keep us looking alive.
      if (fork() == 0) {
        wait_for_stdin();  // until the test closes our stdin
        _exit(0);
      }
      Stream stream;
      expect(sum_one(comm, rank + 1, stream) == 3, "the all-reduce after the fork");
      wait_for_stdin();  // killed meanwhile
      return 3;
    } else if (scenario == "stopped") {
      wait_for_stdin();  // the parent stops us first, then lets us go
      Stream stream;
      expect(sum_one(comm, rank + 1, stream) == 3, "the all-reduce after the stop");
    }
    SIM_NCCL(ncclCommDestroy(comm));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "child rank %d (%s): %s\n", rank, scenario.c_str(), e.what());
    return 1;
  }
}

}  // namespace simtest

TEST_CASE("ranks in processes and threads together: collectives and point to point") {
  // Ranks 0 and 1 are threads here, 2 and 3 are processes (each on its device 0).
  const ncclUniqueId id = unique_id();
  Child two("collectives", 2, 4, id), three("collectives", 3, 4, id);
  CHECK_NOTHROW(run_ranks(2, [&](int rank) {
    ncclComm_t comm = nullptr;
    SIM_NCCL(ncclCommInitRank(&comm, 4, id, rank));
    collectives(comm, rank, 4);
    SIM_NCCL(ncclCommDestroy(comm));
  }));
  CHECK(two.wait() == 0);
  CHECK(three.wait() == 0);
  CHECK(access(shm_path(id).c_str(), F_OK) != 0);
}

TEST_CASE("a peer process that is killed: the waiting rank reports ncclRemoteError naming it") {
  const ncclUniqueId id = unique_id();
  Child peer("idle", 1, 2, id);
  CHECK_NOTHROW(run_ranks(1, [&](int) {
    ncclComm_t comm = nullptr;
    SIM_NCCL(ncclCommInitRank(&comm, 2, id, 0));
    Stream stream;
    Buffer buffer(1024 * 4);
    SIM_NCCL(ncclAllReduce(buffer.get(), buffer.get(), 1024, ncclFloat32, ncclSum, comm, stream));
    expect(cudaStreamQuery(stream) == cudaErrorNotReady, "the all-reduce waits for rank 1");
    kill_while_waited_for(peer, comm, stream);
  }));
  CHECK(access(shm_path(id).c_str(), F_OK) != 0);
}

TEST_CASE("a peer process's forked child does not keep the dead peer looking alive") {
  const ncclUniqueId id = unique_id();
  Child peer("forker", 1, 2, id);
  CHECK_NOTHROW(run_ranks(1, [&](int) {
    ncclComm_t comm = nullptr;
    SIM_NCCL(ncclCommInitRank(&comm, 2, id, 0));
    Stream stream;
    expect(sum_one(comm, 1, stream) == 3, "the all-reduce after the peer forked");
    Buffer buffer(4);
    SIM_NCCL(ncclAllReduce(buffer.get(), buffer.get(), 1, ncclInt32, ncclSum, comm, stream));
    kill_while_waited_for(peer, comm, stream);
  }));
}

TEST_CASE("a peer process that is stopped makes the others wait; they go on when it continues") {
  const ncclUniqueId id = unique_id();
  Child peer("stopped", 1, 2, id);
  CHECK_NOTHROW(run_ranks(1, [&](int) {
    ncclComm_t comm = nullptr;
    SIM_NCCL(ncclCommInitRank(&comm, 2, id, 0));
    Stream stream;
    peer.signal(SIGSTOP);
    peer.go();  // it cannot read this while stopped
    Buffer buffer(4);
    const std::int32_t one = 1;
    buffer.upload(&one, 4, stream);
    SIM_NCCL(ncclAllReduce(buffer.get(), buffer.get(), 1, ncclInt32, ncclSum, comm, stream));
    for (int look = 0; look < 5; ++look) {  // well past the simulator's 100 ms liveness checks
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      ncclResult_t state = ncclSuccess;
      SIM_NCCL(ncclCommGetAsyncError(comm, &state));
      expect(state == ncclSuccess, "a stopped peer is no error");
      expect(cudaStreamQuery(stream) == cudaErrorNotReady, "the all-reduce waits for it");
    }
    peer.signal(SIGCONT);
    const auto got = buffer.download(stream);
    std::int32_t sum = 0;
    std::memcpy(&sum, got.data(), 4);
    expect(sum == 3, "the all-reduce finished after the peer continued");
    SIM_NCCL(ncclCommDestroy(comm));
  }));
  CHECK(peer.wait() == 0);
}

TEST_CASE("a peer that dies before every rank has joined fails the others' init; no name is left") {
  // White box: rank 1 (a process) has claimed its place once the segment's joined count (the
  // header's second word) is 2.
  const ncclUniqueId id = unique_id();
  CHECK_NOTHROW(run_ranks(1, [&](int) {
    ncclConfig_t config = nonblocking_config();
    ncclComm_t comm = nullptr;
    const ncclResult_t started = ncclCommInitRankConfig(&comm, 3, id, 0, &config);
    expect(started == ncclInProgress, "rank 0 waits for ranks 1 and 2");
    Child peer("partial", 1, 3, id);
    wait_for(
        [&] {
          const int fd = open(shm_path(id).c_str(), O_RDONLY);
          std::uint32_t joined = 0;
          const bool read_it = fd >= 0 && pread(fd, &joined, 4, 4) == 4;
          if (fd >= 0) close(fd);
          return read_it && joined == 2;
        },
        "rank 1 to join");
    peer.signal(SIGKILL);
    expect(peer.wait() == -SIGKILL, "the peer was killed");
    const ncclResult_t state = settle(comm);
    expect(state == ncclRemoteError,
           "init fails with ncclRemoteError, not " + std::string(ncclGetErrorString(state)));
    expect(std::string(ncclGetLastError(comm)).find("rank 1") != std::string::npos, "naming it");
    SIM_NCCL(ncclCommAbort(comm));
  }));
  CHECK(access(shm_path(id).c_str(), F_OK) != 0);
}

TEST_CASE("stress mode: nonblocking calls report ncclInProgress at random, and settle") {
  const ncclUniqueId unused = unique_id();
  Child stressed("stress", 0, 3, unused, "TANDEM_CUDA_SIM_STRESS=12345");
  CHECK(stressed.wait() == 0);
}
