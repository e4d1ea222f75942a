// Every collective of the simulated NCCL, for every reducible type and op, at 2, 3 and 4 ranks
// (threads of this process, one device each), in place and out of place, against reference.hpp.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "reference.hpp"
#include "support.hpp"

using namespace simtest;

namespace {

constexpr std::byte sentinel{0x5a};
const std::vector<ncclRedOp_t> all_ops = {ncclSum, ncclProd, ncclMin, ncclMax, ncclAvg};

std::string describe(const char* what, ncclDataType_t type, ncclRedOp_t op, bool in_place,
                     std::size_t i) {
  return std::string(what) + " type " + std::to_string(type) + " op " + std::to_string(op) +
         (in_place ? " in place" : " out of place") + ": element " + std::to_string(i) +
         " differs from the reference";
}

/// One rank's part of the reductions of type T: all-reduce, reduce and reduce-scatter.
template <class T>
void reductions(ncclComm_t comm, cudaStream_t stream, int rank, int n, std::size_t count,
                const std::vector<ncclRedOp_t>& ops = all_ops) {
  const std::size_t size = sizeof(T);
  const ncclDataType_t type = nccl_type<T>();
  const int root = n - 1;
  std::vector<T> mine(count * static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = input<T>(rank, i);
  Buffer send(count * static_cast<std::size_t>(n) * size);
  Buffer recv(count * static_cast<std::size_t>(n) * size);
  const std::vector<std::byte> blank(recv.size(), sentinel);
  for (ncclRedOp_t op : ops) {
    for (bool in_place : {false, true}) {
      // all-reduce
      send.upload(mine.data(), count * size, stream);
      recv.upload(blank.data(), blank.size(), stream);
      void* out = in_place ? send.get() : recv.get();
      SIM_NCCL(ncclAllReduce(send.get(), out, count, type, op, comm, stream));
      auto got = (in_place ? send : recv).download(stream);
      for (std::size_t i = 0; i < count; ++i) {
        expect(same_bits(got.data() + i * size, expected<T>(op, n, i)),
               [&] { return describe("ncclAllReduce", type, op, in_place, i); });
      }
      if (!in_place) {
        const auto kept = send.download(stream);
        expect(std::memcmp(kept.data(), mine.data(), count * size) == 0,
               "ncclAllReduce changed its send buffer");
      }
      // reduce: the root's buffer only
      send.upload(mine.data(), count * size, stream);
      recv.upload(blank.data(), blank.size(), stream);
      out = in_place ? send.get() : recv.get();
      SIM_NCCL(ncclReduce(send.get(), out, count, type, op, root, comm, stream));
      got = (in_place ? send : recv).download(stream);
      for (std::size_t i = 0; i < count; ++i) {
        if (rank == root) {
          expect(same_bits(got.data() + i * size, expected<T>(op, n, i)),
                 [&] { return describe("ncclReduce", type, op, in_place, i); });
        } else if (!in_place) {
          expect(got[i * size] == sentinel, "ncclReduce wrote a non-root rank's receive buffer");
        }
      }
      // reduce-scatter: rank r gets elements [r * count, (r + 1) * count) of the reduction
      send.upload(mine.data(), mine.size() * size, stream);
      recv.upload(blank.data(), blank.size(), stream);
      out = in_place ? send.bytes() + static_cast<std::size_t>(rank) * count * size : recv.get();
      SIM_NCCL(ncclReduceScatter(send.get(), out, count, type, op, comm, stream));
      got = (in_place ? send : recv).download(stream);
      const std::size_t at = in_place ? static_cast<std::size_t>(rank) * count : 0;
      for (std::size_t i = 0; i < count; ++i) {
        const std::size_t global = static_cast<std::size_t>(rank) * count + i;
        expect(same_bits(got.data() + (at + i) * size, expected<T>(op, n, global)),
               [&] { return describe("ncclReduceScatter", type, op, in_place, i); });
      }
    }
  }
}

/// One rank's part of the collectives that only move data: broadcast, all-gather, gather,
/// scatter, all-to-all.
template <class T>
void movements(ncclComm_t comm, cudaStream_t stream, int rank, int n, std::size_t count) {
  const std::size_t size = sizeof(T);
  const ncclDataType_t type = nccl_type<T>();
  const auto un = static_cast<std::size_t>(n);
  const int root = 1 % n;
  // Rank q's element i of a send buffer of count * n elements: input<T>(q, i).
  auto check_slot = [&](const std::vector<std::byte>& got, std::size_t at, int from,
                        std::size_t first, const char* what) {
    for (std::size_t i = 0; i < count; ++i) {
      expect(same_bits(got.data() + (at + i) * size, input<T>(from, first + i)), [&] {
        return std::string(what) + ": element " + std::to_string(i) + " from rank " +
               std::to_string(from) + " is wrong";
      });
    }
  };
  std::vector<T> mine(count * un);
  for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = input<T>(rank, i);
  Buffer send(count * un * size);
  Buffer recv(count * un * size);
  const std::vector<std::byte> blank(recv.size(), sentinel);
  for (bool in_place : {false, true}) {
    // broadcast of the root's first count elements
    send.upload(mine.data(), count * size, stream);
    recv.upload(blank.data(), blank.size(), stream);
    SIM_NCCL(ncclBroadcast(send.get(), in_place ? send.get() : recv.get(), count, type, root, comm,
                           stream));
    check_slot((in_place ? send : recv).download(stream), 0, root, 0, "ncclBroadcast");
    // all-gather: slot q holds rank q's first count elements
    const std::size_t own = static_cast<std::size_t>(rank) * count;
    if (in_place) {
      recv.upload(blank.data(), blank.size(), stream);
      recv.upload(mine.data(), count * size, stream, own * size);
    } else {
      send.upload(mine.data(), count * size, stream);
      recv.upload(blank.data(), blank.size(), stream);
    }
    SIM_NCCL(ncclAllGather(in_place ? recv.bytes() + own * size : send.get(), recv.get(), count,
                           type, comm, stream));
    auto got = recv.download(stream);
    for (int q = 0; q < n; ++q)
      check_slot(got, static_cast<std::size_t>(q) * count, q, 0, "ncclAllGather");
    // gather to the root (in place: the root's own slot is its send buffer)
    recv.upload(blank.data(), blank.size(), stream);
    const void* gather_from = send.get();
    if (in_place && rank == root) {
      recv.upload(mine.data(), count * size, stream, own * size);
      gather_from = recv.bytes() + own * size;
    } else {
      send.upload(mine.data(), count * size, stream);
    }
    SIM_NCCL(ncclGather(gather_from, recv.get(), count, type, root, comm, stream));
    got = recv.download(stream);
    if (rank == root) {
      for (int q = 0; q < n; ++q)
        check_slot(got, static_cast<std::size_t>(q) * count, q, 0, "ncclGather");
    } else {
      expect(got[0] == sentinel, "ncclGather wrote a non-root rank's receive buffer");
    }
    // scatter from the root: rank q gets the root's slot q
    send.upload(mine.data(), mine.size() * size, stream);
    recv.upload(blank.data(), blank.size(), stream);
    void* scatter_to = in_place && rank == root ? send.bytes() + own * size : recv.get();
    SIM_NCCL(ncclScatter(send.get(), scatter_to, count, type, root, comm, stream));
    got = (in_place && rank == root ? send : recv).download(stream);
    check_slot(got, in_place && rank == root ? own : 0, root, own, "ncclScatter");
    // all-to-all (out of place only: NCCL's is not in place)
    if (!in_place) {
      send.upload(mine.data(), mine.size() * size, stream);
      recv.upload(blank.data(), blank.size(), stream);
      SIM_NCCL(ncclAlltoAll(send.get(), recv.get(), count, type, comm, stream));
      got = recv.download(stream);
      for (int q = 0; q < n; ++q)
        check_slot(got, static_cast<std::size_t>(q) * count, q, own, "ncclAlltoAll");
    }
  }
}

template <class... T>
void every_type(ncclComm_t comm, cudaStream_t stream, int rank, int n, std::size_t count) {
  (reductions<T>(comm, stream, rank, n, count), ...);
  (movements<T>(comm, stream, rank, n, count), ...);
}

void all_collectives(int n, std::size_t count) {
  with_communicator(n, [&](ncclComm_t comm, cudaStream_t stream, int rank) {
    every_type<std::int8_t, std::uint8_t, std::int32_t, std::uint32_t, std::int64_t, std::uint64_t,
               __half, __nv_bfloat16, float, double>(comm, stream, rank, n, count);
  });
}

}  // namespace

TEST_CASE("every collective, type and op matches the reference bit for bit at 2, 3 and 4 ranks") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    CHECK_NOTHROW(all_collectives(n, 37));
  }
}

TEST_CASE("counts larger than a round's chunk run in several rounds (odd remainders too)") {
  // 100003 floats are 7 rounds of a 64 KiB slot (reduce-scatter's rounds are n times smaller);
  // 65541 bytes are 2 rounds, and larger messages than a pair's 64 KiB ring.
  CHECK_NOTHROW(with_communicator(3, [&](ncclComm_t comm, cudaStream_t stream, int rank) {
    reductions<float>(comm, stream, rank, 3, 100003, {ncclSum, ncclAvg});
    movements<std::uint8_t>(comm, stream, rank, 3, 65536 + 5);
  }));
}

TEST_CASE("a communicator of one rank, and operations on no elements") {
  CHECK_NOTHROW(with_communicator(1, [&](ncclComm_t comm, cudaStream_t stream, int) {
    reductions<double>(comm, stream, 0, 1, 1000);
    movements<__half>(comm, stream, 0, 1, 1000);
    // Count 0: nothing happens, null buffers are fine.
    SIM_NCCL(ncclAllReduce(nullptr, nullptr, 0, ncclFloat32, ncclSum, comm, stream));
    SIM_NCCL(ncclAllGather(nullptr, nullptr, 0, ncclFloat32, comm, stream));
    SIM_NCCL(ncclAlltoAll(nullptr, nullptr, 0, ncclFloat32, comm, stream));
    SIM_CUDA(cudaStreamSynchronize(stream));
  }));
}
