// LocalComm's own behaviour beyond the shared suite: its concept, create_group with user threads,
// half/bfloat16 accumulation, point-to-point errors, timeouts, leaving ranks and run_local.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "support/collective_suite.hpp"
#include "tandem/comm/local.hpp"

using namespace std::chrono_literals;
using tandem::LocalComm;
using tandem::ReduceOp;
using tandem::test::Failures;
using tandem::test::mentions;

static_assert(tandem::Communicator<LocalComm>);
static_assert(std::same_as<LocalComm::memory_space, tandem::host>);
static_assert(!std::copy_constructible<LocalComm>);

namespace {

/// Runs fn(comm) on one user thread per rank of a create_group group.
template <class Fn>
void on_threads(std::vector<LocalComm> comms, Fn fn) {
  std::vector<std::thread> threads;
  for (auto& comm : comms) {
    threads.emplace_back([&fn, own = std::move(comm)]() mutable { fn(own); });
  }
  for (auto& thread : threads) thread.join();
}

}  // namespace

TEST_CASE("create_group gives one communicator per rank for threads the user manages") {
  auto comms = LocalComm::create_group(3, {.timeout = 5s});
  REQUIRE(comms.size() == 3);
  for (int r = 0; r < 3; ++r) {
    CHECK(comms[static_cast<std::size_t>(r)].rank() == r);
    CHECK(comms[static_cast<std::size_t>(r)].size() == 3);
    CHECK(comms[static_cast<std::size_t>(r)].options().timeout == 5s);
  }
  Failures failures;
  on_threads(std::move(comms), [&](LocalComm& comm) {
    tandem::Buffer<double> buffer(5);
    for (std::size_t i = 0; i < buffer.size(); ++i) buffer[i] = comm.rank() * 10.0 + double(i);
    comm.all_reduce(buffer.view(), ReduceOp::max);
    for (std::size_t i = 0; i < buffer.size(); ++i) {
      failures.expect(buffer[i] == 20.0 + double(i), "rank ", comm.rank(), " got ", buffer[i]);
    }
  });
  failures.report();
  CHECK_THROWS_AS((void)LocalComm::create_group(0), tandem::Error);
}

TEST_CASE("a moved-from LocalComm says so instead of crashing") {
  auto comms = LocalComm::create_group(1);
  LocalComm moved = std::move(comms[0]);
  CHECK(moved.rank() == 0);
  CHECK_THROWS_WITH_AS((void)comms[0].rank(), doctest::Contains("moved from"), tandem::Error);
}

TEST_CASE("half and bfloat16 accumulate in float and round once per element") {
  Failures failures;
  tandem::run_local(4, [&](LocalComm& comm) {
    // 2048 + 1 + 1 + 1 = 2051 rounds to 2052 in half; adding in half would stay at 2048.
    const float mine = comm.rank() == 0 ? 2048.0f : 1.0f;
    std::vector<tandem::half> h{tandem::half(mine)};
    comm.all_reduce(h);
    failures.expect(static_cast<float>(h[0]) == 2052.0f, "half sum gave ", float(h[0]));
    // bfloat16 near 256: 256 + 1 + 1 + 1 = 259 rounds to 260 (adding in bfloat16 stays 256).
    std::vector<tandem::bfloat16> b{tandem::bfloat16(comm.rank() == 0 ? 256.0f : 1.0f)};
    comm.all_reduce(b);
    failures.expect(static_cast<float>(b[0]) == 260.0f, "bfloat16 sum gave ", float(b[0]));
  });
  failures.report();
}

TEST_CASE("recv checks the element type and count of the message it takes") {
  Failures failures;
  tandem::run_local(2, [&](LocalComm& comm) {
    if (comm.rank() == 0) {
      std::vector<float> seven(7);
      comm.send(seven, 1, 3);
      comm.send(seven, 1, 4);
    } else {
      std::vector<float> eight(8);
      try {
        comm.recv(eight, 0, 3);
        failures.add("recv of 8 from a send of 7 succeeded");
      } catch (const tandem::Error& e) {
        failures.expect(mentions(e.what(), "rank 1", "recv", "rank 0", "7", "8"), e.what());
      }
      std::vector<std::int32_t> ints(7);
      try {
        comm.recv(ints, 0, 4);
        failures.add("recv of int32 from a float send succeeded");
      } catch (const tandem::Error& e) {
        failures.expect(mentions(e.what(), "int32", "float32"), e.what());
      }
    }
  });
  failures.report();
}

TEST_CASE("recv times out naming the peer and the tag; a peer that left is reported at once") {
  Failures failures;
  std::atomic<bool> timed_out{false};
  tandem::run_local(
      2,
      [&](LocalComm& comm) {
        if (comm.rank() == 0) {  // stays in the group, sending nothing, until rank 1 gave up
          for (int i = 0; i < 1000 && !timed_out.load(); ++i) std::this_thread::sleep_for(5ms);
          return;
        }
        std::vector<float> data(4);
        try {
          comm.recv(data, 0, 9);
          failures.add("recv without a send succeeded");
        } catch (const tandem::Error& e) {
          failures.expect(mentions(e.what(), "rank 1", "recv", "timed out", "rank 0", "tag 9"),
                          e.what());
        }
        timed_out = true;
      },
      {.timeout = 200ms});
  failures.report();

  const auto start = std::chrono::steady_clock::now();
  tandem::run_local(2, [&](LocalComm& comm) {
    if (comm.rank() == 1) {
      std::vector<float> data(4);
      try {
        comm.recv(data, 0, 1);
        failures.add("recv from a rank that returned succeeded");
      } catch (const tandem::Error& e) {
        failures.expect(mentions(e.what(), "rank 0 left"), e.what());
      }
    }
  });
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  failures.report();
}

TEST_CASE("a rank whose function returns early is reported by the ranks waiting for it") {
  Failures failures;
  const auto start = std::chrono::steady_clock::now();
  tandem::run_local(3, [&](LocalComm& comm) {
    if (comm.rank() == 1) return;
    try {
      comm.barrier();
      failures.add("barrier without rank 1 succeeded");
    } catch (const tandem::Error& e) {
      failures.expect(mentions(e.what(), "barrier", "rank 1 left"), e.what());
    }
  });
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  failures.report();
}

TEST_CASE("after a timeout the group is unusable and says why at once") {
  Failures failures;
  std::atomic<int> gave_up{0};
  auto body = [&](LocalComm& comm) {
    if (comm.rank() == 2) {
      while (gave_up.load() < 2) std::this_thread::sleep_for(5ms);
    } else {
      try {
        comm.barrier();
      } catch (const tandem::Error&) {
      }
      ++gave_up;
    }
    const auto start = std::chrono::steady_clock::now();
    std::vector<float> data(3);
    try {
      comm.all_reduce(data);
      failures.add("rank ", comm.rank(), ": all_reduce on a timed-out group succeeded");
    } catch (const tandem::Error& e) {
      failures.expect(mentions(e.what(), "timed out", "rank 2"), e.what());
    }
    failures.expect(std::chrono::steady_clock::now() - start < 500ms, "rank ", comm.rank(),
                    " waited on a broken group");
  };
  tandem::run_local(3, body, {.timeout = 1s});
  failures.report();
}

TEST_CASE("a failure on one rank wakes ranks blocked in a subgroup and in recv") {
  Failures failures;
  auto body = [&](LocalComm& comm) {
    auto sub = comm.split(comm.rank() < 2 ? 0 : 1, 0);
    if (comm.rank() == 3) {
      std::this_thread::sleep_for(30ms);
      throw tandem::Error(3, "training step", "loss is NaN");
    }
    try {
      if (comm.rank() == 0) {
        std::vector<float> data(2);
        comm.recv(data, 1, 0);
      } else if (comm.rank() == 1) {
        comm.barrier();
      } else {
        sub->barrier();
      }
      failures.add("rank ", comm.rank(), " was not woken");
    } catch (const tandem::Error& e) {
      failures.expect(mentions(e.what(), "rank 3 failed", "loss is NaN"), e.what());
    }
  };
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(tandem::run_local(4, body, {.timeout = 60s}),
                       "tandem: rank 3: training step: loss is NaN", tandem::Error);
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  failures.report();
}

TEST_CASE("run_local rejects a group of no ranks and wraps exceptions that are not tandem::Error") {
  CHECK_THROWS_AS(tandem::run_local(0, [](LocalComm&) {}), tandem::Error);
  auto throws_int = [](LocalComm& comm) {
    if (comm.rank() == 1) throw 42;
  };
  CHECK_THROWS_WITH_AS(tandem::run_local(2, throws_int), doctest::Contains("rank 1"),
                       tandem::Error);
}

TEST_CASE("split rejects a negative colour other than no_color") {
  Failures failures;
  tandem::run_local(2, [&](LocalComm& comm) {
    try {
      (void)comm.split(-5, 0);
      failures.add("split(-5) succeeded");
    } catch (const tandem::Error& e) {
      failures.expect(mentions(e.what(), "split", "-5"), e.what());
    }
  });
  failures.report();
}

TEST_CASE("destroying a LocalComm waits for its pending async operations") {
  Failures failures;
  tandem::run_local(3, [&](LocalComm& comm) {
    std::vector<float> data(100, 1.0f);
    tandem::Work work;
    {
      auto sub = comm.split(0, 0);
      work = sub->all_reduce_async(data);
    }  // sub destroyed here: waits for the all_reduce
    failures.expect(work.test(), "rank ", comm.rank(), ": work still pending");
    work.wait();
    failures.expect(data[0] == 3.0f, "rank ", comm.rank(), " got ", data[0]);
  });
  failures.report();
}
