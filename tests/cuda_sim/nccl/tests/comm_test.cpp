// Communicators of the simulated NCCL: blocking and nonblocking init (ncclInProgress until every
// rank has joined), split (nonblocking too, NCCL_SPLIT_NOCOLOR), ncclCommInitAll and groups over
// several communicators, finalize and destroy, abort ending a waiting collective, the argument
// errors and their texts, and the order of a collective among other stream work.
#include <doctest/doctest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "support.hpp"

using namespace simtest;

namespace {

std::int32_t read_int(const std::vector<std::byte>& bytes, std::size_t i = 0) {
  std::int32_t value = 0;
  std::memcpy(&value, bytes.data() + i * 4, 4);
  return value;
}

/// An all-reduce (sum) of one int32 per rank, rank r contributing `value`; returns the sum.
std::int32_t sum_of(ncclComm_t comm, std::int32_t value, bool nonblocking = false) {
  Stream stream;
  Buffer buffer(4);
  buffer.upload(&value, 4, stream);
  const ncclResult_t issued =
      ncclAllReduce(buffer.get(), buffer.get(), 1, ncclInt32, ncclSum, comm, stream);
  if (nonblocking && issued == ncclInProgress) {
    expect(settle(comm) == ncclSuccess, "the all-reduce settles");
  } else {
    SIM_NCCL(issued);
  }
  return read_int(buffer.download(stream));
}

bool exists(const std::string& path) {
  return access(path.c_str(), F_OK) == 0;
}

}  // namespace

TEST_CASE("nonblocking init reports ncclInProgress until every rank has joined") {
  const ncclUniqueId id = unique_id();
  std::atomic<bool> first_waiting{false};
  CHECK_NOTHROW(run_ranks(2, [&](int rank) {
    ncclConfig_t config = nonblocking_config();
    ncclComm_t comm = nullptr;
    if (rank == 1) wait_for([&] { return first_waiting.load(); }, "rank 0's init");
    const ncclResult_t started = ncclCommInitRankConfig(&comm, 2, id, rank, &config);
    expect(comm != nullptr, "the handle is written at once");
    if (rank == 0) {
      // Rank 1 has not called init yet: rank 0 cannot have finished.
      expect(started == ncclInProgress, "init returns ncclInProgress while a rank is missing");
      ncclResult_t state = ncclSuccess;
      SIM_NCCL(ncclCommGetAsyncError(comm, &state));
      expect(state == ncclInProgress, "the communicator reports ncclInProgress");
      int count = 0;
      expect(ncclCommCount(comm, &count) == ncclInvalidArgument,
             "a call before init has settled is refused");
      expect(std::string(ncclGetLastError(comm)).find("previous operation") != std::string::npos,
             "with NCCL's reason");
      first_waiting.store(true);
    } else {
      expect(started == ncclSuccess || started == ncclInProgress, "init starts");
    }
    expect(settle(comm) == ncclSuccess, "init settles to ncclSuccess");
    expect(!exists(shm_path(id)), "no shared-memory name is left once every rank has joined");
    int count = 0, me = -1, device = -1;
    SIM_NCCL(ncclCommCount(comm, &count));
    SIM_NCCL(ncclCommUserRank(comm, &me));
    SIM_NCCL(ncclCommCuDevice(comm, &device));
    expect(count == 2 && me == rank && device == rank, "the queries answer");
    expect(sum_of(comm, rank + 1, true) == 3, "the communicator works");
    // Nonblocking finalize: ncclInProgress (or success) until flushed, then destroy.
    const ncclResult_t finalizing = ncclCommFinalize(comm);
    expect(finalizing == ncclSuccess || finalizing == ncclInProgress, "finalize starts");
    expect(settle(comm) == ncclSuccess, "finalize settles");
    SIM_NCCL(ncclCommDestroy(comm));
  }));
}

TEST_CASE("split: nonblocking parent in progress until all ranks split, colors, keys, NOCOLOR") {
  const ncclUniqueId id = unique_id();
  std::atomic<int> splitting{0};
  CHECK_NOTHROW(run_ranks(4, [&](int rank) {
    ncclConfig_t config = nonblocking_config();
    ncclComm_t parent = nullptr;
    (void)ncclCommInitRankConfig(&parent, 4, id, rank, &config);
    expect(settle(parent) == ncclSuccess, "init");
    // Ranks 0 and 2 make one child (keys reverse their order), 1 another, 3 passes NOCOLOR.
    const int colors[] = {0, 1, 0, NCCL_SPLIT_NOCOLOR};
    const int keys[] = {5, 0, 1, 0};
    if (rank != 0) wait_for([&] { return splitting.load() == 1; }, "rank 0's split");
    ncclComm_t* child = new ncclComm_t(reinterpret_cast<ncclComm_t>(0x1));  // NCCL writes it
    const ncclResult_t started = ncclCommSplit(parent, colors[rank], keys[rank], child, nullptr);
    expect(started == ncclSuccess || started == ncclInProgress, "split starts");
    if (rank == 0) {
      ncclResult_t state = ncclSuccess;
      SIM_NCCL(ncclCommGetAsyncError(parent, &state));
      expect(state == ncclInProgress, "the parent reports ncclInProgress while ranks are missing");
      splitting.store(1);
    }
    expect(settle(parent) == ncclSuccess, "the split settles");
    if (rank == 3) {
      expect(*child == nullptr, "NOCOLOR gets no communicator");
    } else {
      expect(*child != nullptr, "a child");
      expect(settle(*child) == ncclSuccess, "the child is ready");
      int count = 0, me = -1;
      SIM_NCCL(ncclCommCount(*child, &count));
      SIM_NCCL(ncclCommUserRank(*child, &me));
      const int want_count = rank == 1 ? 1 : 2;
      const int want_rank = rank == 0 ? 1 : 0;  // key 5 after key 1
      expect(count == want_count && me == want_rank, "child ranks ordered by key");
      // Children inherit nonblocking; the all-reduce sums its members' parent ranks.
      const std::int32_t sum = sum_of(*child, rank, true);
      expect(sum == (rank == 1 ? 1 : 2), "the child holds the ranks of its color");
      const ncclResult_t finalizing = ncclCommFinalize(*child);
      expect(finalizing == ncclSuccess || finalizing == ncclInProgress, "child finalize starts");
      expect(settle(*child) == ncclSuccess, "child finalize");
      SIM_NCCL(ncclCommDestroy(*child));
    }
    delete child;
    // The parent still works after the split.
    expect(sum_of(parent, 1, true) == 4, "the parent still works");
    SIM_NCCL(ncclCommAbort(parent));
  }));
}

TEST_CASE("blocking init and split, ncclCommInitAll, one thread driving a group of communicators") {
  ncclComm_t comms[3] = {nullptr, nullptr, nullptr};
  REQUIRE(ncclCommInitAll(comms, 3, nullptr) == ncclSuccess);
  CHECK_NOTHROW([&] {
    // One thread, three devices: the group's all-reduces progress together.
    std::vector<std::unique_ptr<Buffer>> buffers;
    std::vector<cudaStream_t> streams(3);
    for (int r = 0; r < 3; ++r) {
      SIM_CUDA(cudaSetDevice(r));
      SIM_CUDA(cudaStreamCreate(&streams[static_cast<std::size_t>(r)]));
      buffers.push_back(std::make_unique<Buffer>(4));
      const std::int32_t value = r + 1;
      buffers.back()->upload(&value, 4, streams[static_cast<std::size_t>(r)]);
    }
    SIM_NCCL(ncclGroupStart());
    for (int r = 0; r < 3; ++r) {
      SIM_NCCL(ncclAllReduce(buffers[static_cast<std::size_t>(r)]->get(),
                             buffers[static_cast<std::size_t>(r)]->get(), 1, ncclInt32, ncclSum,
                             comms[r], streams[static_cast<std::size_t>(r)]));
    }
    SIM_NCCL(ncclGroupEnd());
    for (int r = 0; r < 3; ++r) {
      SIM_CUDA(cudaSetDevice(r));
      expect(read_int(buffers[static_cast<std::size_t>(r)]->download(
                 streams[static_cast<std::size_t>(r)])) == 6,
             "the group's all-reduce");
      SIM_CUDA(cudaStreamDestroy(streams[static_cast<std::size_t>(r)]));
    }
    buffers.clear();
    SIM_CUDA(cudaSetDevice(0));
    // Blocking splits of all three from this thread: in one group, as NCCL requires.
    ncclComm_t children[3] = {nullptr, nullptr, nullptr};
    SIM_NCCL(ncclGroupStart());
    for (int r = 0; r < 3; ++r) {
      SIM_NCCL(ncclCommSplit(comms[r], r == 1 ? NCCL_SPLIT_NOCOLOR : 7, -r, &children[r], nullptr));
    }
    SIM_NCCL(ncclGroupEnd());
    expect(children[1] == nullptr && children[0] && children[2], "split's children");
    int rank0 = -1, rank2 = -1;
    SIM_NCCL(ncclCommUserRank(children[0], &rank0));
    SIM_NCCL(ncclCommUserRank(children[2], &rank2));
    expect(rank2 == 0 && rank0 == 1, "keys -2 and 0 order the child's ranks");
    for (ncclComm_t child : {children[0], children[2]}) SIM_NCCL(ncclCommDestroy(child));
    for (ncclComm_t comm : comms) {
      SIM_NCCL(ncclCommFinalize(comm));
      SIM_NCCL(ncclCommDestroy(comm));
    }
  }());
}

TEST_CASE("abort ends a collective that waits for a rank that never comes; the stream moves on") {
  const ncclUniqueId id = unique_id();
  ncclComm_t comms[2] = {nullptr, nullptr};
  CHECK_NOTHROW(
      run_ranks(2, [&](int rank) { SIM_NCCL(ncclCommInitRank(&comms[rank], 2, id, rank)); }));
  CHECK_NOTHROW(run_ranks(1, [&](int) {
    Stream stream;
    Buffer buffer(1000 * 4);
    SIM_NCCL(
        ncclAllReduce(buffer.get(), buffer.get(), 1000, ncclFloat32, ncclSum, comms[0], stream));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    expect(cudaStreamQuery(stream) == cudaErrorNotReady, "the collective waits for rank 1");
    std::thread aborter([&] { (void)ncclCommAbort(comms[0]); });  // from another thread
    aborter.join();
    SIM_CUDA(cudaStreamSynchronize(stream));
    ncclResult_t state = ncclSuccess;
    expect(ncclCommGetAsyncError(comms[0], &state) == ncclInvalidArgument,
           "an aborted communicator's handle is refused");
    expect(ncclAllReduce(buffer.get(), buffer.get(), 1, ncclFloat32, ncclSum, comms[0], stream) ==
               ncclInvalidArgument,
           "later calls fail");
  }));
  // Rank 1 never took part; it is destroyed cleanly.
  CHECK(ncclCommDestroy(comms[1]) == ncclSuccess);
}

TEST_CASE("a group over two communicators on one stream: aborting one leaves the other's work") {
  // Rank 0 groups an all-reduce on A (whose rank 1 never joins it) with one on B, on one stream:
  // they run as one host function. Aborting A must not take B's all-reduce with it.
  const ncclUniqueId a_id = unique_id(), b_id = unique_id();
  ncclComm_t a[2] = {nullptr, nullptr}, b[2] = {nullptr, nullptr};
  CHECK_NOTHROW(run_ranks(2, [&](int rank) {
    SIM_NCCL(ncclCommInitRank(&a[rank], 2, a_id, rank));
    SIM_NCCL(ncclCommInitRank(&b[rank], 2, b_id, rank));
  }));
  std::atomic<bool> a_waiting{false};
  CHECK_NOTHROW(run_ranks(2, [&](int rank) {
    Stream stream;
    Buffer on_a(4), on_b(4);
    const std::int32_t value = rank + 1;
    on_b.upload(&value, 4, stream);
    if (rank == 0) {
      SIM_NCCL(ncclGroupStart());
      SIM_NCCL(ncclAllReduce(on_a.get(), on_a.get(), 1, ncclInt32, ncclSum, a[0], stream));
      SIM_NCCL(ncclAllReduce(on_b.get(), on_b.get(), 1, ncclInt32, ncclSum, b[0], stream));
      SIM_NCCL(ncclGroupEnd());
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      expect(cudaStreamQuery(stream) == cudaErrorNotReady, "A's all-reduce waits for its rank 1");
      a_waiting.store(true);
      SIM_NCCL(ncclCommAbort(a[0]));
    } else {
      wait_for([&] { return a_waiting.load(); }, "rank 0's group");
      SIM_NCCL(ncclAllReduce(on_b.get(), on_b.get(), 1, ncclInt32, ncclSum, b[1], stream));
    }
    expect(read_int(on_b.download(stream)) == 3, "B's all-reduce ran to its end");
    SIM_NCCL(ncclCommDestroy(b[rank]));
  }));
  CHECK(ncclCommDestroy(a[1]) == ncclSuccess);
}

TEST_CASE("argument errors: codes and ncclGetLastError's text") {
  const ncclUniqueId id = unique_id();
  CHECK_NOTHROW(run_ranks(1, [&](int) {
    ncclComm_t comm = nullptr;
    SIM_NCCL(ncclCommInitRank(&comm, 1, id, 0));
    Stream stream;
    Buffer device(64);
    std::vector<float> host(16);
    auto fails = [&](ncclResult_t got, ncclResult_t want, const char* words, const char* what) {
      expect(got == want, std::string(what) + ": got " + ncclGetErrorString(got));
      const std::string text = ncclGetLastError(nullptr);
      expect(text.find(words) != std::string::npos, std::string(what) + ": text " + text);
    };
    fails(ncclAllReduce(device.get(), device.get(), 4, ncclFloat32, ncclSum, nullptr, stream),
          ncclInvalidArgument, "comm argument is NULL", "null communicator");
    fails(ncclBroadcast(device.get(), device.get(), 4, ncclFloat32, 3, comm, stream),
          ncclInvalidArgument, "invalid root 3", "root out of range");
    fails(ncclSend(device.get(), 4, ncclFloat32, -1, comm, stream), ncclInvalidArgument,
          "invalid peer -1", "peer out of range");
    fails(ncclAllReduce(device.get(), device.get(), 4, static_cast<ncclDataType_t>(99), ncclSum,
                        comm, stream),
          ncclInvalidArgument, "invalid type 99", "bad type");
    fails(ncclAllReduce(device.get(), device.get(), 4, ncclFloat32, static_cast<ncclRedOp_t>(42),
                        comm, stream),
          ncclInvalidArgument, "reduction operation 42", "bad op");
    fails(ncclAllReduce(host.data(), device.get(), 4, ncclFloat32, ncclSum, comm, stream),
          ncclInvalidArgument, "sendbuff", "host memory as sendbuff");
    fails(ncclAllGather(device.get(), host.data(), 4, ncclFloat32, comm, stream),
          ncclInvalidArgument, "recvbuff", "host memory as recvbuff");
    fails(ncclGroupEnd(), ncclInvalidUsage, "not in a group", "ncclGroupEnd alone");
    fails(ncclCommInitRank(nullptr, 1, id, 0), ncclInvalidArgument, "newcomm", "no newcomm");
    ncclComm_t other = nullptr;
    fails(ncclCommInitRank(&other, 2, id, 5), ncclInvalidArgument, "Invalid rank requested : 5/2",
          "rank out of range");
    ncclUniqueId zero{};
    fails(ncclCommInitRank(&other, 1, zero, 0), ncclInvalidArgument, "ncclGetUniqueId",
          "an id not from ncclGetUniqueId");
    ncclConfig_t raw{};
    fails(ncclCommInitRankConfig(&other, 1, unique_id(), 0, &raw), ncclInvalidArgument,
          "NCCL_CONFIG_INITIALIZER", "an uninitialised config");
    int version = 0;
    SIM_NCCL(ncclGetVersion(&version));
    expect(version == NCCL_VERSION_CODE, "the version is the header's");
    expect(std::string(ncclGetErrorString(ncclRemoteError)).find("remote") != std::string::npos,
           "error strings");
    // The communicator is still usable after refused calls (it is blocking).
    SIM_NCCL(ncclAllReduce(device.get(), device.get(), 4, ncclFloat32, ncclSum, comm, stream));
    SIM_CUDA(cudaStreamSynchronize(stream));
    // Finalize: later operations are refused; a second finalize too; destroy frees.
    SIM_NCCL(ncclCommFinalize(comm));
    fails(ncclAllReduce(device.get(), device.get(), 4, ncclFloat32, ncclSum, comm, stream),
          ncclInvalidUsage, "finalized", "an operation after finalize");
    fails(ncclCommFinalize(comm), ncclInvalidArgument, "finalized already", "finalize twice");
    SIM_NCCL(ncclCommDestroy(comm));
    fails(ncclCommDestroy(comm), ncclInvalidArgument, "not a live communicator", "destroy twice");
    SIM_NCCL(ncclCommDestroy(nullptr));
    SIM_NCCL(ncclCommAbort(nullptr));
  }));
}

TEST_CASE("a refused call on a nonblocking communicator becomes its asynchronous error") {
  // NCCL 2.28 records a failed argument check of a nonblocking communicator as its error.
  const ncclUniqueId id = unique_id();
  CHECK_NOTHROW(run_ranks(1, [&](int) {
    ncclConfig_t config = nonblocking_config();
    ncclComm_t comm = nullptr;
    (void)ncclCommInitRankConfig(&comm, 1, id, 0, &config);
    expect(settle(comm) == ncclSuccess, "init");
    Stream stream;
    Buffer device(16);
    expect(ncclBroadcast(device.get(), device.get(), 4, ncclFloat32, 2, comm, stream) ==
               ncclInvalidArgument,
           "bad root");
    ncclResult_t state = ncclSuccess;
    SIM_NCCL(ncclCommGetAsyncError(comm, &state));
    expect(state == ncclInvalidArgument, "recorded as the communicator's error");
    SIM_NCCL(ncclCommAbort(comm));
  }));
}

TEST_CASE("two ranks of one communicator on one device of one process: Duplicate GPU detected") {
  const ncclUniqueId id = unique_id();
  std::vector<ncclResult_t> results(2, ncclSuccess);
  std::vector<std::string> texts(2);
  std::vector<ncclComm_t> comms(2, nullptr);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      (void)cudaSetDevice(0);
      results[static_cast<std::size_t>(r)] =
          ncclCommInitRank(&comms[static_cast<std::size_t>(r)], 2, id, r);
      texts[static_cast<std::size_t>(r)] = ncclGetLastError(nullptr);
    });
  }
  for (auto& thread : threads) thread.join();
  for (int r = 0; r < 2; ++r) {
    CHECK(results[static_cast<std::size_t>(r)] == ncclInvalidUsage);
    CHECK(comms[static_cast<std::size_t>(r)] == nullptr);
  }
  CHECK(texts[0].find("Duplicate GPU detected") != std::string::npos);
  CHECK(!exists(shm_path(id)));
}

TEST_CASE("a collective runs in stream order: it sees earlier stream work, later work sees it") {
  CHECK_NOTHROW(with_communicator(2, [&](ncclComm_t comm, cudaStream_t stream, int rank) {
    const std::size_t count = 50000;
    Buffer buffer(count * 4);
    struct Work {
      std::int32_t* data;
      std::size_t count;
      int rank;
      bool ok = true;
    } work{static_cast<std::int32_t*>(buffer.get()), count, rank};
    for (int round = 0; round < 3; ++round) {
      // Stream work before the collective writes its input...
      SIM_CUDA(cudaLaunchHostFunc(
          stream,
          [](void* p) {
            auto* w = static_cast<Work*>(p);
            for (std::size_t i = 0; i < w->count; ++i) w->data[i] = w->rank + static_cast<int>(i);
          },
          &work));
      SIM_NCCL(ncclAllReduce(buffer.get(), buffer.get(), count, ncclInt32, ncclSum, comm, stream));
      // ...and stream work after it reads the result.
      SIM_CUDA(cudaLaunchHostFunc(
          stream,
          [](void* p) {
            auto* w = static_cast<Work*>(p);
            for (std::size_t i = 0; i < w->count; ++i) {
              if (w->data[i] != 1 + 2 * static_cast<int>(i)) w->ok = false;
            }
          },
          &work));
    }
    SIM_CUDA(cudaStreamSynchronize(stream));
    expect(work.ok, "the stream work after the collective saw its result");
  }));
}
