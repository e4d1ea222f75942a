// LocalComm's own behaviour beyond the shared suite: its concept, create_group with user threads,
// half/bfloat16 accumulation, point-to-point errors, timeouts, leaving ranks and run_local.
#include <doctest/doctest.h>

#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "support/collective_suite.hpp"
#include "support/fake_env.hpp"
#include "tandem/comm/checked.hpp"
#include "tandem/comm/local/local.hpp"

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

// --- tandem/comm/checked.hpp: the switch, the fingerprint and the mismatch text ---------------

namespace {

using tandem::CollectiveCheck;
using tandem::detail::CollectiveFingerprint;
using tandem::detail::CollectiveOp;
using tandem::detail::make_fingerprint;

// Only a bool is a choice, and the setting never reads as one (it means nothing until resolved).
static_assert(std::is_constructible_v<CollectiveCheck, bool>);
static_assert(!std::is_constructible_v<CollectiveCheck, int>);
static_assert(!std::is_constructible_v<CollectiveCheck, const char*>);
static_assert(!std::is_convertible_v<CollectiveCheck, bool>);
static_assert(!std::is_constructible_v<bool, CollectiveCheck>);
static_assert(sizeof(CollectiveFingerprint) == 64);

/// Sets a process environment variable for one scope (before any thread of the test starts).
class ScopedVariable {
 public:
  ScopedVariable(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedVariable() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedVariable(const ScopedVariable&) = delete;
  ScopedVariable& operator=(const ScopedVariable&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace

TEST_CASE("TANDEM_CHECK_COLLECTIVES: unset gives the default, 0 and 1 switch, others are errors") {
  const tandem::test::FakeEnv unset{};
  const tandem::test::FakeEnv on{{"TANDEM_CHECK_COLLECTIVES", "1"}};
  const tandem::test::FakeEnv off{{"TANDEM_CHECK_COLLECTIVES", "0"}};
  CHECK(CollectiveCheck{}.resolve(true, unset.lookup()));
  CHECK_FALSE(CollectiveCheck{}.resolve(false, unset.lookup()));
  CHECK(CollectiveCheck{}.resolve(false, on.lookup()));
  CHECK_FALSE(CollectiveCheck{}.resolve(true, off.lookup()));
  // An explicit choice wins over the variable.
  CHECK(CollectiveCheck{true}.resolve(false, off.lookup()));
  CHECK_FALSE(CollectiveCheck{false}.resolve(true, on.lookup()));
  CHECK(CollectiveCheck::from_environment() == CollectiveCheck{});
  CHECK(CollectiveCheck{false}.setting() == CollectiveCheck::Setting::off);
  for (const char* bad : {"", "yes", "true", "2", " 1", "1 ", "on"}) {
    CAPTURE(bad);
    const tandem::test::FakeEnv env{{"TANDEM_CHECK_COLLECTIVES", bad}};
    try {
      (void)CollectiveCheck{}.resolve(true, env.lookup());
      FAIL("accepted TANDEM_CHECK_COLLECTIVES='" << bad << "'");
    } catch (const tandem::Error& e) {
      CHECK_MESSAGE(
          mentions(e.what(), "environment", "TANDEM_CHECK_COLLECTIVES='" + std::string(bad) + "'",
                   "not 0", "or 1"),
          e.what());
    }
    // An explicit choice does not read the variable at all.
    CHECK(CollectiveCheck{true}.resolve(false, env.lookup()));
  }
}

TEST_CASE("Fingerprints: equal calls agree; every difference names each rank's whole call") {
  using tandem::detail::fingerprint_disagreement;
  auto all_reduce = [](std::size_t count, std::uint64_t sequence = 1) {
    return make_fingerprint<float>(CollectiveOp::all_reduce, sequence, count, 0, ReduceOp::sum);
  };
  // Fields an operation does not use do not count.
  CHECK(make_fingerprint<float>(CollectiveOp::all_reduce, 1, 3, 5) ==
        make_fingerprint<float>(CollectiveOp::all_reduce, 1, 3, 0));
  CHECK(make_fingerprint<float>(CollectiveOp::barrier, 1, 3) ==
        make_fingerprint<std::int32_t>(CollectiveOp::barrier, 1, 9));
  std::vector<CollectiveFingerprint> same{all_reduce(7), all_reduce(7), all_reduce(7)};
  CHECK(fingerprint_disagreement(same).empty());
  CHECK(fingerprint_disagreement(std::vector<CollectiveFingerprint>{all_reduce(7)}).empty());

  std::vector<CollectiveFingerprint> counts{all_reduce(7), all_reduce(8), all_reduce(7)};
  CHECK(fingerprint_disagreement(counts) ==
        "ranks disagree on the element count: ranks 0, 2 called all_reduce(7 x float32, sum); "
        "rank 1 called all_reduce(8 x float32, sum)");

  std::vector<CollectiveFingerprint> rooted{
      make_fingerprint<std::int64_t>(CollectiveOp::reduce, 4, 2, 0, ReduceOp::max),
      make_fingerprint<std::int64_t>(CollectiveOp::reduce, 4, 2, 1, ReduceOp::max)};
  CHECK(fingerprint_disagreement(rooted) ==
        "ranks disagree on the root: rank 0 called reduce(2 x int64, root 0, max); rank 1 "
        "called reduce(2 x int64, root 1, max)");

  // Identical calls at different positions: a rank skipped a collective (or made an extra one).
  std::vector<CollectiveFingerprint> skipped{all_reduce(7, 12), all_reduce(7, 11)};
  CHECK(fingerprint_disagreement(skipped) ==
        "ranks are at different collectives of this communicator (one skipped a collective, or "
        "made one the others did not): rank 0 called #12 all_reduce(7 x float32, sum); rank 1 "
        "called #11 all_reduce(7 x float32, sum)");

  // A fingerprint that is no known call is reported, never shown as garbage.
  CollectiveFingerprint garbage;
  garbage.op = 99;
  CHECK(
      mentions(fingerprint_disagreement(std::vector<CollectiveFingerprint>{all_reduce(7), garbage}),
               "unreadable"));

  CHECK(tandem::detail::switch_disagreement({true, true}).empty());
  CHECK(tandem::detail::switch_disagreement({true, false, true}) ==
        "ranks disagree on whether to check collectives (TANDEM_CHECK_COLLECTIVES or the "
        "options' check_collectives): ranks 0, 2: on; rank 1: off; a rank that checks would wait "
        "for fingerprints the others never send");
}

TEST_CASE("LocalComm: always checks, and a bad TANDEM_CHECK_COLLECTIVES is an error") {
  {
    ScopedVariable off("TANDEM_CHECK_COLLECTIVES", "0");
    // 0 leaves LocalComm's check on: it is free, and without it a mismatch would read past the
    // end of a buffer.
    Failures failures;
    tandem::run_local(2, [&](LocalComm& comm) {
      std::vector<float> data(comm.rank() == 1 ? 8 : 7);
      try {
        comm.all_reduce(data);
        failures.add("rank ", comm.rank(), ": no error with TANDEM_CHECK_COLLECTIVES=0");
      } catch (const tandem::Error& e) {
        failures.expect(mentions(e.what(), "rank 0 called all_reduce(7 x float32, sum)",
                                 "rank 1 called all_reduce(8 x float32, sum)"),
                        e.what());
      }
    });
    failures.report();
  }
  ScopedVariable bad("TANDEM_CHECK_COLLECTIVES", "maybe");
  try {
    (void)LocalComm::create_group(2);
    FAIL("LocalComm accepted TANDEM_CHECK_COLLECTIVES=maybe");
  } catch (const tandem::Error& e) {
    CHECK_MESSAGE(mentions(e.what(), "TANDEM_CHECK_COLLECTIVES='maybe'"), e.what());
  }
}
