// Point to point and groups on the simulated NCCL: rings inside a group, messages matched in
// issue order, the ungrouped send's rendezvous (a deadlock, ended by abort), groups of
// collectives, nested groups, and a send and receive that disagree.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <numeric>
#include <vector>

#include "support.hpp"

using namespace simtest;

namespace {

std::vector<std::int32_t> pattern(int rank, std::size_t count, int salt = 0) {
  std::vector<std::int32_t> values(count);
  for (std::size_t i = 0; i < count; ++i) {
    values[i] = static_cast<std::int32_t>(rank * 1000003 + salt * 7919 + static_cast<int>(i));
  }
  return values;
}

void expect_pattern(const std::vector<std::byte>& got, int rank, std::size_t count, int salt,
                    const std::string& what) {
  const auto want = pattern(rank, count, salt);
  expect(got.size() >= count * sizeof(std::int32_t) &&
             std::memcmp(got.data(), want.data(), count * sizeof(std::int32_t)) == 0,
         what);
}

}  // namespace

TEST_CASE("a ring of sends and receives in one group, messages larger than the channel") {
  // 100000 int32 = 400 KB per message, six times a pair's ring: the group's sends and receives
  // must progress together.
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    const std::size_t count = 100000;
    CHECK_NOTHROW(with_communicator(n, [&](ncclComm_t comm, cudaStream_t stream, int rank) {
      Buffer send(count * 4), recv(count * 4);
      const auto mine = pattern(rank, count);
      send.upload(mine.data(), count * 4, stream);
      const int next = (rank + 1) % n, previous = (rank + n - 1) % n;
      SIM_NCCL(ncclGroupStart());
      SIM_NCCL(ncclSend(send.get(), count, ncclInt32, next, comm, stream));
      SIM_NCCL(ncclRecv(recv.get(), count, ncclInt32, previous, comm, stream));
      SIM_NCCL(ncclGroupEnd());
      expect_pattern(recv.download(stream), previous, count, 0, "the ring's message");
    }));
  }
}

TEST_CASE("messages between two ranks match in issue order; a send to oneself in a group") {
  CHECK_NOTHROW(with_communicator(2, [&](ncclComm_t comm, cudaStream_t stream, int rank) {
    const int other = 1 - rank;
    // Rank 0 sends three messages (of different sizes) ungrouped; rank 1 receives them.
    const std::size_t counts[] = {5, 70000, 0};
    std::vector<std::unique_ptr<Buffer>> buffers;
    for (int m = 0; m < 3; ++m) {
      buffers.push_back(std::make_unique<Buffer>(counts[m] * 4));
      if (rank == 0) {
        const auto values = pattern(rank, counts[m], m);
        if (counts[m] > 0) buffers.back()->upload(values.data(), counts[m] * 4, stream);
        SIM_NCCL(ncclSend(buffers.back()->get(), counts[m], ncclInt32, other, comm, stream));
      } else {
        SIM_NCCL(ncclRecv(buffers.back()->get(), counts[m], ncclInt32, other, comm, stream));
      }
    }
    SIM_CUDA(cudaStreamSynchronize(stream));
    if (rank == 1) {
      for (int m = 0; m < 2; ++m) {
        expect_pattern(buffers[static_cast<std::size_t>(m)]->download(stream), 0, counts[m], m,
                       "message " + std::to_string(m));
      }
    }
    // To oneself: only in a group (the send waits for its receive).
    Buffer from(64 * 4), to(64 * 4);
    const auto values = pattern(rank, 64, 9);
    from.upload(values.data(), 64 * 4, stream);
    SIM_NCCL(ncclGroupStart());
    SIM_NCCL(ncclRecv(to.get(), 64, ncclInt32, rank, comm, stream));
    SIM_NCCL(ncclSend(from.get(), 64, ncclInt32, rank, comm, stream));
    SIM_NCCL(ncclGroupEnd());
    expect_pattern(to.download(stream), rank, 64, 9, "the message to oneself");
  }));
}

TEST_CASE("an ungrouped send waits for its receive: two ranks that both send first deadlock") {
  // As on a GPU. Shown without hanging: the streams stay busy while we look, then both
  // communicators are aborted and the streams move on.
  const ncclUniqueId id = unique_id();
  ncclComm_t comms[2] = {nullptr, nullptr};
  std::atomic<int> issued{0};
  std::atomic<bool> aborted{false};
  CHECK_NOTHROW(run_ranks(2, [&](int rank) {
    SIM_NCCL(ncclCommInitRank(&comms[rank], 2, id, rank));
    Stream stream;
    Buffer send(16 * 4), recv(16 * 4);
    SIM_NCCL(ncclSend(send.get(), 16, ncclInt32, 1 - rank, comms[rank], stream));
    SIM_NCCL(ncclRecv(recv.get(), 16, ncclInt32, 1 - rank, comms[rank], stream));
    issued.fetch_add(1);
    if (rank == 0) {
      wait_for([&] { return issued.load() == 2; }, "both ranks to issue");
      // Neither send can finish; give them time to show it.
      for (int look = 0; look < 20; ++look) {
        expect(cudaStreamQuery(stream) == cudaErrorNotReady,
               "a send finished without its receive having started");
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      SIM_NCCL(ncclCommAbort(comms[0]));
      SIM_NCCL(ncclCommAbort(comms[1]));
      aborted.store(true);
    }
    wait_for([&] { return aborted.load(); }, "the abort");
    SIM_CUDA(cudaStreamSynchronize(stream));  // the aborted work has given up
  }));
}

TEST_CASE("groups: several collectives and point to point together, nested groups, NCCL's errors") {
  CHECK_NOTHROW(with_communicator(3, [&](ncclComm_t comm, cudaStream_t stream, int rank) {
    Buffer a(100 * 4), b(100 * 4), p(10 * 4), q(10 * 4);
    std::vector<std::int32_t> ones(100, rank + 1);
    a.upload(ones.data(), 400, stream);
    b.upload(ones.data(), 400, stream);
    const auto mine = pattern(rank, 10);
    p.upload(mine.data(), 40, stream);
    SIM_NCCL(ncclGroupStart());
    SIM_NCCL(ncclGroupStart());  // nested: only the outermost end launches
    SIM_NCCL(ncclAllReduce(a.get(), a.get(), 100, ncclInt32, ncclSum, comm, stream));
    SIM_NCCL(ncclGroupEnd());
    SIM_NCCL(ncclSend(p.get(), 10, ncclInt32, (rank + 1) % 3, comm, stream));
    SIM_NCCL(ncclAllReduce(b.get(), b.get(), 100, ncclInt32, ncclMax, comm, stream));
    SIM_NCCL(ncclRecv(q.get(), 10, ncclInt32, (rank + 2) % 3, comm, stream));
    SIM_NCCL(ncclGroupEnd());
    const auto sums = a.download(stream), maxima = b.download(stream);
    for (int i = 0; i < 100; ++i) {
      std::int32_t sum = 0, maximum = 0;
      std::memcpy(&sum, sums.data() + i * 4, 4);
      std::memcpy(&maximum, maxima.data() + i * 4, 4);
      expect(sum == 6 && maximum == 3, "a collective in the group");
    }
    expect_pattern(q.download(stream), (rank + 2) % 3, 10, 0, "the group's message");

    // A failed call in a group fails the group: ncclGroupEnd reports it, nothing runs.
    SIM_NCCL(ncclGroupStart());
    SIM_NCCL(ncclAllReduce(a.get(), a.get(), 100, ncclInt32, ncclSum, comm, stream));
    expect(ncclBroadcast(a.get(), a.get(), 100, ncclInt32, 7, comm, stream) == ncclInvalidArgument,
           "a bad root inside a group");
    expect(ncclGroupEnd() == ncclInvalidArgument, "ncclGroupEnd reports the group's error");
    expect(ncclGroupEnd() == ncclInvalidUsage, "ncclGroupEnd outside a group");
    SIM_CUDA(cudaStreamSynchronize(stream));
    const auto unchanged = a.download(stream);
    std::int32_t first = 0;
    std::memcpy(&first, unchanged.data(), 4);
    expect(first == 6, "a failed group ran nothing");
  }));
}

TEST_CASE("a communicator's work runs in issue order across streams; a group joins its streams") {
  // Rank 0 issues X on a stream held back by earlier work, then Y on another stream; rank 1
  // issues both on one stream. Unless rank 0 runs X before Y (as NCCL serialises a
  // communicator's kernels), the ranks would pair X with Y.
  CHECK_NOTHROW(with_communicator(2, [&](ncclComm_t comm, cudaStream_t first, int rank) {
    Stream second;
    Buffer x(1000 * 4), y(1000 * 4);
    std::vector<std::int32_t> xs(1000, 1), ys(1000, 100);
    x.upload(xs.data(), 4000, first);
    y.upload(ys.data(), 4000, first);
    if (rank == 0) {
      SIM_CUDA(cudaLaunchHostFunc(
          first, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); },
          nullptr));
    }
    SIM_NCCL(ncclAllReduce(x.get(), x.get(), 1000, ncclInt32, ncclSum, comm, first));
    SIM_NCCL(ncclAllReduce(y.get(), y.get(), 1000, ncclInt32, ncclSum, comm,
                           rank == 0 ? second : first));
    SIM_CUDA(cudaStreamSynchronize(second));
    const auto got_x = x.download(first), got_y = y.download(first);
    std::int32_t sum_x = 0, sum_y = 0;
    std::memcpy(&sum_x, got_x.data() + 999 * 4, 4);
    std::memcpy(&sum_y, got_y.data() + 999 * 4, 4);
    expect(sum_x == 2 && sum_y == 200, "X paired with X, Y with Y");

    // One group with operations on two streams: they run as one, and both streams' later
    // work sees the results.
    x.upload(xs.data(), 4000, first);
    y.upload(ys.data(), 4000, first);
    SIM_NCCL(ncclGroupStart());
    SIM_NCCL(ncclAllReduce(x.get(), x.get(), 1000, ncclInt32, ncclSum, comm, first));
    SIM_NCCL(ncclAllReduce(y.get(), y.get(), 1000, ncclInt32, ncclMax, comm, second));
    SIM_NCCL(ncclGroupEnd());
    const auto joined_x = x.download(first), joined_y = y.download(second);
    std::memcpy(&sum_x, joined_x.data(), 4);
    std::memcpy(&sum_y, joined_y.data(), 4);
    expect(sum_x == 2 && sum_y == 100, "the group on two streams");
  }));
}

TEST_CASE("a receive that expects another size than its send fails the communicator") {
  const ncclUniqueId id = unique_id();
  std::atomic<bool> seen{false};
  CHECK_NOTHROW(run_ranks(2, [&](int rank) {
    ncclComm_t comm = nullptr;
    SIM_NCCL(ncclCommInitRank(&comm, 2, id, rank));
    {
      Stream stream;
      Buffer buffer(64 * 4);
      if (rank == 0) {
        SIM_NCCL(ncclSend(buffer.get(), 16, ncclInt32, 1, comm, stream));
        // Its receiver rejects the message: the send never completes; abort ends it.
        wait_for([&] { return seen.load(); }, "the receiver to see the mismatch");
      } else {
        SIM_NCCL(ncclRecv(buffer.get(), 32, ncclInt32, 0, comm, stream));
        SIM_CUDA(cudaStreamSynchronize(stream));
        ncclResult_t state = ncclSuccess;
        SIM_NCCL(ncclCommGetAsyncError(comm, &state));
        expect(state == ncclInvalidUsage, "the mismatched receive is the communicator's error");
        const std::string text = ncclGetLastError(comm);
        expect(text.find("128 bytes from rank 0") != std::string::npos &&
                   text.find("has 64") != std::string::npos,
               "the error says what disagreed: " + text);
        seen.store(true);
      }
      SIM_NCCL(ncclCommAbort(comm));
      SIM_CUDA(cudaStreamSynchronize(stream));
    }
  }));
}
