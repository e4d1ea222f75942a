// The test that ranks may call one collective in different forms: even ranks call the sync form,
// odd ranks the `_async` form (and wait), for every collective, several rounds in a row, with
// `_async` collectives pending on every rank around them. MPI never matches a blocking
// collective with a non-blocking one, so this hangs unless MpiComm runs both forms alike.
#pragma once

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/mpi/mpi.hpp"

namespace tandem::test {

inline void check_mixed_forms(MpiComm& comm, int rounds = 3) {
  const int me = comm.rank();
  const int n = comm.size();
  const auto un = static_cast<std::size_t>(n);
  const bool sync = me % 2 == 0;
  // The sync form here, the `_async` form (then wait) on the ranks of the other parity.
  auto both = [&](auto&& call_sync, auto&& call_async) {
    if (sync) {
      call_sync();
    } else {
      Work work = call_async();
      work.wait();
      CHECK_FALSE(work.failed());
    }
  };
  const int ranks_sum = n * (n - 1) / 2;
  for (int round = 0; round < rounds; ++round) {
    CAPTURE(round);
    const int root = round % n;
    // Pending on every rank across the mixed ones below: a sync collective runs after it, an
    // `_async` one behind it.
    std::vector<double> background(257);
    for (std::size_t i = 0; i < background.size(); ++i) {
      background[i] = static_cast<double>(me + round) + static_cast<double>(i % 3);
    }
    Work pending = comm.all_reduce_async(background);

    std::vector<float> data{static_cast<float>(me + 1 + 10 * round), 2.0f};
    both([&] { comm.all_reduce(data); }, [&] { return comm.all_reduce_async(data); });
    CHECK(data[0] == static_cast<float>(n * (n + 1) / 2 + 10 * round * n));
    CHECK(data[1] == static_cast<float>(2 * n));

    std::vector<double> averaged{static_cast<double>(me), 1.0};
    both([&] { comm.all_reduce(averaged, ReduceOp::avg); },
         [&] { return comm.all_reduce_async(averaged, ReduceOp::avg); });
    CHECK(averaged[0] == static_cast<double>(ranks_sum) / n);
    CHECK(averaged[1] == 1.0);

    std::vector<std::int64_t> reduced{me + round};
    both([&] { comm.reduce(reduced, root, ReduceOp::max); },
         [&] { return comm.reduce_async(reduced, root, ReduceOp::max); });
    if (me == root) CHECK(reduced[0] == n - 1 + round);

    std::vector<std::int32_t> broadcasted{me == root ? 42 + round : -1};
    both([&] { comm.broadcast(broadcasted, root); },
         [&] { return comm.broadcast_async(broadcasted, root); });
    CHECK(broadcasted[0] == 42 + round);

    std::vector<float> mine{static_cast<float>(me), static_cast<float>(round)};
    std::vector<float> all(2 * un, -1.0f);
    both([&] { comm.all_gather(mine, all); }, [&] { return comm.all_gather_async(mine, all); });
    for (int r = 0; r < n; ++r) {
      CHECK(all[2 * static_cast<std::size_t>(r)] == static_cast<float>(r));
      CHECK(all[2 * static_cast<std::size_t>(r) + 1] == static_cast<float>(round));
    }

    std::vector<std::int32_t> gathered(me == root ? un : 0, -1);
    std::vector<std::int32_t> one{me * 3};
    both([&] { comm.gather(one, gathered, root); },
         [&] { return comm.gather_async(one, gathered, root); });
    for (int r = 0; r < n && me == root; ++r) {
      CHECK(gathered[static_cast<std::size_t>(r)] == r * 3);
    }

    std::vector<std::int32_t> to_scatter;
    if (me == root) {
      for (int r = 0; r < n; ++r) to_scatter.push_back(100 * r + round);
    }
    std::vector<std::int32_t> scattered{-1};
    both([&] { comm.scatter(to_scatter, scattered, root); },
         [&] { return comm.scatter_async(to_scatter, scattered, root); });
    CHECK(scattered[0] == 100 * me + round);

    std::vector<float> slots(2 * un, static_cast<float>(me + 1));
    std::vector<float> slot(2);
    both([&] { comm.reduce_scatter(slots, slot); },
         [&] { return comm.reduce_scatter_async(slots, slot); });
    CHECK(slot[0] == static_cast<float>(n * (n + 1) / 2));
    CHECK(slot[1] == static_cast<float>(n * (n + 1) / 2));

    std::vector<float> to_each(un);
    for (int r = 0; r < n; ++r)
      to_each[static_cast<std::size_t>(r)] = static_cast<float>(me * n + r);
    std::vector<float> from_each(un, -1.0f);
    both([&] { comm.all_to_all(to_each, from_each); },
         [&] { return comm.all_to_all_async(to_each, from_each); });
    for (int r = 0; r < n; ++r) {
      CHECK(from_each[static_cast<std::size_t>(r)] == static_cast<float>(r * n + me));
    }

    both([&] { comm.barrier(); }, [&] { return comm.barrier_async(); });

    // Several in a row: sync ones here, `_async` ones in flight together on the other ranks.
    std::vector<std::vector<std::int32_t>> many(4, std::vector<std::int32_t>(3, me));
    if (sync) {
      for (auto& buffer : many) comm.all_reduce(buffer);
    } else {
      std::vector<Work> works;
      for (auto& buffer : many) works.push_back(comm.all_reduce_async(buffer));
      for (auto& work : works) work.wait();
    }
    for (auto& buffer : many) CHECK(buffer == std::vector<std::int32_t>(3, ranks_sum));

    pending.wait();
    CHECK_FALSE(pending.failed());
    for (std::size_t i = 0; i < background.size(); ++i) {
      const double want =
          static_cast<double>(ranks_sum + n * round) + static_cast<double>(n) * (i % 3);
      if (background[i] != want) {
        FAIL_CHECK("background[" << i << "] = " << background[i] << ", expected " << want);
        break;
      }
    }
  }
}

}  // namespace tandem::test
