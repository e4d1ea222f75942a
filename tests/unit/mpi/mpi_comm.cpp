// MpiComm's own behaviour under mpirun (2 and 3 processes): the world and World::from_env,
// private communicators, split and new_group, the half / bfloat16 reduce ops, Work, MPI errors
// as tandem::Error, sync and `_async` forms of one collective mixed across ranks, the `_async`
// timeout and destruction with a collective left in MPI, and init_process_group<MpiComm>.
#include <doctest/doctest.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <mpi.h>

#include "mixed_forms.hpp"
#include "mpi_support.hpp"
#include "support/collective_suite.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/mpi/mpi.hpp"
#include "tandem/core/world.hpp"

namespace {

using namespace std::chrono_literals;
using tandem::test::mentions;

static_assert(tandem::Communicator<tandem::MpiComm>);
static_assert(tandem::ProcessGroupBackend<tandem::MpiComm>);
static_assert(!std::is_copy_constructible_v<tandem::MpiComm>);

/// Runs `call`, which must throw tandem::Error whose text holds every one of `parts`.
template <class Call, class... Parts>
void expect_error(Call call, const Parts&... parts) {
  try {
    call();
    FAIL_CHECK("no tandem::Error");
  } catch (const tandem::Error& e) {
    CHECK_MESSAGE(mentions(e.what(), parts...), e.what());
  }
}

std::string rank_text(const tandem::MpiComm& comm) {
  return "rank " + std::to_string(comm.rank());
}

}  // namespace

TEST_CASE("MpiComm::world is MPI_COMM_WORLD's ranks in a private communicator") {
  tandem::test::on_every_rank([](tandem::MpiComm& comm) {
    int rank = -1;
    int size = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    CHECK(comm.rank() == rank);
    CHECK(comm.size() == size);
    CHECK(comm.native() != MPI_COMM_WORLD);
    int relation = MPI_UNEQUAL;
    MPI_Comm_compare(comm.native(), MPI_COMM_WORLD, &relation);
    CHECK(relation == MPI_CONGRUENT);  // same ranks, another context
    int handler_returns = 0;
    MPI_Errhandler handler;
    MPI_Comm_get_errhandler(comm.native(), &handler);
    handler_returns = handler == MPI_ERRORS_RETURN;
    MPI_Errhandler_free(&handler);
    CHECK(handler_returns);
    CHECK(comm.options().timeout == tandem::default_timeout);
    CHECK(tandem::MpiComm::thread_level() == MPI_THREAD_MULTIPLE);
  });
}

TEST_CASE("World::from_env under mpirun agrees with MPI") {
  tandem::test::on_every_rank([](tandem::MpiComm& comm) {
    CHECK(tandem::World::launched());
    const auto world = tandem::World::from_env();
    CHECK(world.rank == comm.rank());
    CHECK(world.world_size == comm.size());
    // mpirun starts every process on this one node.
    MPI_Comm node = MPI_COMM_NULL;
    MPI_Comm_split_type(comm.native(), MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int node_rank = -1;
    int node_size = -1;
    MPI_Comm_rank(node, &node_rank);
    MPI_Comm_size(node, &node_size);
    MPI_Comm_free(&node);
    CHECK(world.local_rank == node_rank);
    CHECK(world.local_world_size == node_size);
    CHECK(world.nnodes == 1);
    CHECK(world.node_rank == 0);
  });
}

TEST_CASE("Messages of two MpiComms and of MPI_COMM_WORLD never match each other") {
  tandem::test::on_every_rank([](tandem::MpiComm& a) {
    auto b = tandem::MpiComm::world();
    const int me = a.rank();
    const int next = (me + 1) % a.size();
    const int prev = (me + a.size() - 1) % a.size();
    // The program's own message on MPI_COMM_WORLD, same peer and tag, sent first.
    std::int32_t user_out = 1000 + me;
    std::int32_t user_in = -1;
    MPI_Request user_send;
    MPI_Request user_recv;
    MPI_Isend(&user_out, 1, MPI_INT32_T, next, 7, MPI_COMM_WORLD, &user_send);
    std::vector<std::int32_t> to_a{me * 10 + 1};
    std::vector<std::int32_t> to_b{me * 10 + 2};
    auto sent_a = a.send_async(to_a, next, 7);
    auto sent_b = b.send_async(to_b, next, 7);
    std::vector<std::int32_t> from_a{-1};
    std::vector<std::int32_t> from_b{-1};
    b.recv(from_b, prev, 7);  // b first: a's message was sent earlier
    a.recv(from_a, prev, 7);
    MPI_Irecv(&user_in, 1, MPI_INT32_T, prev, 7, MPI_COMM_WORLD, &user_recv);
    MPI_Wait(&user_recv, MPI_STATUS_IGNORE);
    MPI_Wait(&user_send, MPI_STATUS_IGNORE);
    sent_a.wait();
    sent_b.wait();
    CHECK(from_a[0] == prev * 10 + 1);
    CHECK(from_b[0] == prev * 10 + 2);
    CHECK(user_in == 1000 + prev);
  });
}

TEST_CASE("MpiComm::split and new_group make subgroups; no_color and bad colours") {
  tandem::test::on_every_rank([](tandem::MpiComm& comm) {
    const int me = comm.rank();
    const int n = comm.size();
    expect_error([&] { (void)comm.split(-2); }, rank_text(comm), "split", "color -2", "negative");

    auto parity = comm.split(me % 2, me);
    REQUIRE(parity.has_value());  // the same on every rank
    CHECK(parity->size() == (n - me % 2 + 1) / 2);
    CHECK(parity->rank() == me / 2);
    CHECK(parity->native() != comm.native());
    std::vector<std::int64_t> ranks{me};
    parity->all_reduce(ranks);
    std::int64_t expected = 0;
    for (int r = me % 2; r < n; r += 2) expected += r;
    CHECK(ranks[0] == expected);

    auto last = tandem::new_group(comm, {n - 1});
    CHECK(last.has_value() == (me == n - 1));
    if (last) {
      CHECK(last->size() == 1);
      CHECK(last->rank() == 0);
      std::vector<float> one{2.5f};
      last->all_reduce(one, tandem::ReduceOp::avg);
      CHECK(one[0] == 2.5f);
    }
    expect_error(
        [&] {
          (void)tandem::new_group(comm, {0, n});
        },
        "new_group", "rank " + std::to_string(n));
    comm.barrier();
  });
}

TEST_CASE("A moved-from MpiComm raises tandem::Error") {
  tandem::test::on_every_rank([](tandem::MpiComm& comm) {
    tandem::MpiComm taken = std::move(comm);
    expect_error([&] { (void)comm.rank(); }, "MpiComm", "moved from");
    taken.barrier();
  });
}

namespace {

/// Non-integer values in [-4, 4) that differ between ranks and elements.
float float16_input(int rank, std::size_t i) {
  std::uint32_t state = 2654435761u * static_cast<std::uint32_t>(i + 1) + 40503u * (rank + 7u);
  state ^= state >> 13;
  state *= 0x5bd1e995u;
  state ^= state >> 15;
  return static_cast<float>(state % 8192u) / 1024.0f - 4.0f;
}

template <class T>
void check_float16_reduction(tandem::MpiComm& comm, tandem::ReduceOp op, bool async) {
  const int n = comm.size();
  constexpr std::size_t count = 1031;
  std::vector<T> data(count);
  for (std::size_t i = 0; i < count; ++i) data[i] = T(float16_input(comm.rank(), i));
  if (async) {
    comm.all_reduce_async(data, op).wait();
  } else {
    comm.all_reduce(data, op);
  }
  // A unit roundoff: one rounding of a result r errs by at most |r| * unit.
  const double unit = std::is_same_v<T, tandem::half> ? 0x1p-11 : 0x1p-8;
  int wrong = 0;
  for (std::size_t i = 0; i < count && wrong < 5; ++i) {
    // The serial float reference: rank order, accumulated in float, rounded once.
    float acc = static_cast<float>(T(float16_input(0, i)));
    double magnitude = std::abs(acc);
    for (int r = 1; r < n; ++r) {
      const float x = static_cast<float>(T(float16_input(r, i)));
      magnitude += std::abs(x);
      switch (op) {
        case tandem::ReduceOp::sum:
        case tandem::ReduceOp::avg:
          acc += x;
          break;
        case tandem::ReduceOp::prod:
          acc *= x;
          break;
        case tandem::ReduceOp::min:
          acc = x < acc ? x : acc;
          break;
        case tandem::ReduceOp::max:
          acc = acc < x ? x : acc;
          break;
      }
    }
    if (op == tandem::ReduceOp::avg) {
      acc /= static_cast<float>(n);
      magnitude /= n;
    }
    const T want(acc);
    const double got = static_cast<float>(data[i]);
    bool ok = false;
    if (op == tandem::ReduceOp::min || op == tandem::ReduceOp::max ||
        (n == 2 && op != tandem::ReduceOp::avg)) {
      // No rounding at all, or a single one: exactly the reference.
      ok = data[i].bits == want.bits;
    } else {
      // One rounding per combination of two ranks (and one for the division).
      const double scale =
          op == tandem::ReduceOp::prod ? std::abs(static_cast<double>(acc)) : magnitude;
      ok = std::abs(got - acc) <= (n + 1) * unit * scale + 1e-30;
    }
    if (!ok) {
      ++wrong;
      FAIL_CHECK(tandem::dtype_traits<T>::name << " " << tandem::name(op)
                                               << (async ? " async" : " sync") << " [" << i
                                               << "] = " << got << ", expected " << acc);
    }
  }
  // Every rank holds the same bits.
  std::vector<T> everyone(count * static_cast<std::size_t>(n));
  comm.all_gather(std::span<const T>(data), everyone);
  for (int r = 0; r < n; ++r) {
    bool same = true;
    for (std::size_t i = 0; i < count; ++i) {
      same = same && everyone[static_cast<std::size_t>(r) * count + i].bits == data[i].bits;
    }
    CHECK_MESSAGE(same, "rank ", comm.rank(), " and rank ", r, " differ");
  }
}

}  // namespace

TEST_CASE("half and bfloat16 reduce in float, rounding once per combination") {
  tandem::test::on_every_rank([](tandem::MpiComm& comm) {
    for (auto op : {tandem::ReduceOp::sum, tandem::ReduceOp::avg, tandem::ReduceOp::prod,
                    tandem::ReduceOp::min, tandem::ReduceOp::max}) {
      for (bool async : {false, true}) {
        check_float16_reduction<tandem::half>(comm, op, async);
        check_float16_reduction<tandem::bfloat16>(comm, op, async);
      }
    }
  });
}

TEST_CASE("Work of an `_async` operation: test and wait_for before and after it completes") {
  tandem::test::on_every_rank([](tandem::MpiComm& comm) {
    const int me = comm.rank();
    const int next = (me + 1) % comm.size();
    const int prev = (me + comm.size() - 1) % comm.size();
    std::vector<float> in(13, -1.0f);
    std::vector<float> out(13);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(me * 100 + i);
    auto received = comm.recv_async(in, next, 3);
    // `next` sends only after the barrier, which this rank has not entered yet.
    CHECK_FALSE(received.test());
    CHECK_FALSE(received.wait_for(20ms));
    CHECK_FALSE(received.failed());
    comm.barrier();  // a sync collective does not wait for a pending recv_async
    comm.send(out, prev, 3);
    CHECK(received.wait_for(60s));
    CHECK(received.test());
    CHECK_FALSE(received.failed());
    received.wait();
    for (std::size_t i = 0; i < in.size(); ++i) {
      CHECK(in[i] == static_cast<float>(next * 100 + i));
    }
    CHECK(tandem::Work().test());
  });
}

TEST_CASE("MPI errors and message sizes are tandem::Errors naming rank, operation and cause") {
  tandem::test::on_every_rank([](tandem::MpiComm& comm) {
    const int me = comm.rank();
    const int next = (me + 1) % comm.size();
    const int prev = (me + comm.size() - 1) % comm.size();
    const std::string me_text = rank_text(comm);

    // A longer message than the buffer: MPI's own error, converted (sync and async).
    std::vector<float> eight(8, 1.0f);
    std::vector<float> four(4);
    for (bool async : {false, true}) {
      auto sent = comm.send_async(eight, prev, 4);
      if (async) {
        auto received = comm.recv_async(four, next, 4);
        expect_error([&] { received.wait(); }, me_text, "recv", "MPI", "MPI_ERR_TRUNCATE");
        CHECK(received.failed());
        CHECK(received.test());
      } else {
        expect_error([&] { comm.recv(four, next, 4); }, me_text, "recv", "MPI_ERR_TRUNCATE");
      }
      sent.wait();
    }
    // A shorter message: MPI accepts it, MpiComm does not.
    std::vector<std::int64_t> two(2, 5);
    std::vector<std::int64_t> three(3);
    for (bool async : {false, true}) {
      auto sent = comm.send_async(two, prev, 5);
      auto call = [&] {
        if (async) {
          comm.recv_async(three, next, 5).wait();
        } else {
          comm.recv(three, next, 5);
        }
      };
      expect_error(call, me_text, "recv",
                   "expected 3 int64 elements from rank " + std::to_string(next) + " with tag 5",
                   "held 2");
      sent.wait();
    }
    // Arguments MPI would misread: checked before anything is sent.
    expect_error([&] { comm.send(four, comm.size(), 0); }, me_text, "send", "peer");
    expect_error([&] { comm.send(four, next, -1); }, me_text, "send", "tag -1");
    expect_error([&] { (void)comm.recv_async(four, -1, 0); }, me_text, "recv", "peer -1");
    expect_error([&] { comm.reduce(four, -1); }, me_text, "reduce", "root -1");
    expect_error([&] { (void)comm.gather_async(four, eight, comm.size()); }, me_text, "gather",
                 "root");
    std::vector<std::uint8_t> bytes(3);
    expect_error([&] { comm.reduce_scatter(bytes, bytes, tandem::ReduceOp::avg); }, me_text,
                 "reduce_scatter", "avg needs a floating-point element type, not uint8");
    // The communicator is still usable.
    std::vector<float> one{1.0f};
    comm.all_reduce(one);
    CHECK(one[0] == static_cast<float>(comm.size()));
  });
}

TEST_CASE("An `_async` operation a rank skips fails after the timeout and breaks the comm") {
  auto late = tandem::MpiComm::world();
  std::vector<float> data(16, 1.0f);  // outlives `comm`: MPI may write it until then
  tandem::test::on_every_rank(
      [&](tandem::MpiComm& comm) {
        const int me = comm.rank();
        const int skipper = comm.size() - 1;
        if (me == skipper) {
          // Joins only once the others have given up, so that their pending collective
          // completes (and the job can end cleanly).
          late.barrier();
          comm.all_reduce_async(data).wait();
          late.barrier();
          return;
        }
        auto work = comm.all_reduce_async(data);
        auto behind = comm.barrier_async();  // queued behind it: never starts, fails with it
        expect_error([&] { work.wait(); }, rank_text(comm), "all_reduce", "300 ms", "unusable");
        CHECK(work.failed());
        expect_error([&] { behind.wait(); }, rank_text(comm), "barrier", "unusable", "all_reduce");
        expect_error([&] { comm.barrier(); }, rank_text(comm), "barrier", "unusable", "all_reduce");
        expect_error([&] { (void)comm.broadcast_async(data, 0); }, "broadcast", "unusable");
        late.barrier();
        // The skipper joins the pending all_reduce now; destroying `comm` waits for it.
        late.barrier();
      },
      {.timeout = 300ms});
  late.barrier();
}

TEST_CASE("init_process_group<MpiComm> checks the World against MPI and returns the world") {
  // A file:// store in a directory rank 0 makes and every rank learns through MPI.
  auto world_comm = tandem::MpiComm::world();
  std::vector<char> path(256, '\0');
  std::string made;
  if (world_comm.rank() == 0) {
    char pattern[] = "/tmp/tandem-mpi-XXXXXX";
    const char* dir = ::mkdtemp(pattern);
    REQUIRE(dir != nullptr);
    made = dir;
    std::snprintf(path.data(), path.size(), "%s/store", dir);
  }
  world_comm.broadcast(
      std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(path.data()), path.size()), 0);
  const std::string url = std::string("file://") + path.data();
  const auto world = tandem::World::from_env();
  auto comm = tandem::init_process_group<tandem::MpiComm>(world, url, {.timeout = 60s});
  CHECK(comm.rank() == world.rank);
  CHECK(comm.size() == world.world_size);
  std::vector<std::int32_t> one{1};
  comm.all_reduce(one);
  CHECK(one[0] == comm.size());

  tandem::HashStore store;
  tandem::AnyStore any(std::move(store));
  auto wrong = world;
  wrong.rank = (world.rank + 1) % world.world_size;
  wrong.local_rank = wrong.rank;
  if (world.world_size > 1) {
    expect_error([&] { (void)tandem::MpiComm::rendezvous(wrong, any, {}); }, "MpiComm::rendezvous",
                 "rank " + std::to_string(wrong.rank),
                 "MPI_COMM_WORLD has this process as rank " + std::to_string(world.rank));
  }
  world_comm.barrier();
  if (!made.empty()) std::filesystem::remove_all(made);
}

TEST_CASE("Large messages (4 MiB) take MPI's rendezvous path, sync and async") {
  tandem::test::on_every_rank([](tandem::MpiComm& comm) {
    const int me = comm.rank();
    const int n = comm.size();
    constexpr std::size_t count = std::size_t{1} << 20;
    std::vector<float> data(count);
    for (std::size_t i = 0; i < count; ++i) data[i] = static_cast<float>(me + i % 7);
    std::vector<float> sum(count);
    comm.all_reduce(std::span<const float>(data), sum);
    auto averaged = data;
    comm.all_reduce_async(averaged, tandem::ReduceOp::avg).wait();
    const float ranks = static_cast<float>(n * (n - 1) / 2);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const float want = ranks + static_cast<float>(n) * static_cast<float>(i % 7);
      wrong += sum[i] != want;
      wrong += averaged[i] != want / static_cast<float>(n);
    }
    CHECK(wrong == 0);

    // A ring of large point-to-point messages: each rank sends before it receives.
    const int next = (me + 1) % n;
    const int prev = (me + n - 1) % n;
    std::vector<float> incoming(count, -1.0f);
    auto sent = comm.send_async(data, next, 11);
    comm.recv(incoming, prev, 11);
    sent.wait();
    CHECK(incoming.front() == static_cast<float>(prev));
    CHECK(incoming.back() == static_cast<float>(prev + (count - 1) % 7));
  });
}

TEST_CASE("Ranks may call one collective sync on some and `_async` on others") {
  tandem::test::on_every_rank([](tandem::MpiComm& comm) { tandem::test::check_mixed_forms(comm); });
}

TEST_CASE("Mixed forms on a subgroup, with the parent's `_async` collectives in flight") {
  tandem::test::on_every_rank([](tandem::MpiComm& comm) {
    const int me = comm.rank();
    // Split is a sync collective: it waits for the parent's pending all_reduce first.
    std::vector<std::int64_t> parent{me};
    auto parent_work = comm.all_reduce_async(parent);
    auto reversed = comm.split(0, -me);
    REQUIRE(reversed.has_value());
    CHECK(parent_work.test());
    CHECK(parent[0] == comm.size() * (comm.size() - 1) / 2);
    CHECK(reversed->rank() == comm.size() - 1 - me);
    tandem::test::check_mixed_forms(*reversed, 2);
  });
}

TEST_CASE("An `_async` collective runs on the worker while the calling thread goes on") {
  tandem::test::on_every_rank([](tandem::MpiComm& comm) {
    const int me = comm.rank();
    const int n = comm.size();
    std::vector<float> data{static_cast<float>(me)};
    std::vector<std::int32_t> token{me == 0 ? 7 : -1};
    if (me == 0) {
      auto work = comm.all_reduce_async(data);
      // Rank 1 joins the all_reduce only once it has this message, sent from this thread while
      // the worker waits inside MPI for rank 1.
      CHECK_FALSE(work.test());
      comm.send(token, 1, 21);
      CHECK(work.wait_for(60s));
    } else {
      if (me == 1) comm.recv(token, 0, 21);
      comm.all_reduce(data);
    }
    if (me <= 1) CHECK(token[0] == 7);
    CHECK(data[0] == static_cast<float>(n * (n - 1) / 2));
  });
}

TEST_CASE("Destroying an MpiComm whose `_async` collective a rank never joined does not hang") {
  auto late = tandem::MpiComm::world();
  auto& runtime = tandem::detail::mpi::Runtime::instance();
  const int me = late.rank();
  const int n = late.size();
  const int skipper = n - 1;
  const int attached = runtime.live();
  // Outlives the detached worker's MPI call, which writes it once the skipper joins.
  std::vector<float> data(16, 1.0f);
  try {
    // Options are per rank: the skipper's own collective must not time out while it joins.
    auto comm = tandem::MpiComm::world({.timeout = me == skipper ? 60000ms : 200ms});
    if (me != skipper) {
      auto work = comm.all_reduce_async(data);
      { auto doomed = std::move(comm); }  // waits 200 ms at most, then detaches the worker
      CHECK(work.failed());
      expect_error([&] { work.wait(); }, rank_text(late), "all_reduce", "unusable");
      // The worker is still inside MPI: its communicator still counts as attached.
      CHECK(runtime.live() == attached + 1);
      late.barrier();  // lets the skipper join the collective
      const tandem::Deadline deadline(60s);
      while (runtime.live() != attached && !deadline.expired()) std::this_thread::sleep_for(1ms);
      CHECK(runtime.live() == attached);  // MPI let the worker go; it freed the communicator
    } else {
      late.barrier();
      comm.all_reduce_async(data).wait();  // matches the detached workers' collectives
    }
  } catch (const std::exception& e) {
    tandem::test::abort_job(e.what());
  }
  CHECK(data[0] == static_cast<float>(n));
  late.barrier();
}

// --- mismatch checks (tandem/comm/checked.hpp) -------------------------------------------------

TEST_CASE("MpiComm: mismatched `_async` collectives fail their Work on every rank, and go on") {
  tandem::test::on_every_rank(
      [](tandem::MpiComm& comm) {
        const int me = comm.rank();
        const int odd = comm.size() - 1;
        std::vector<double> data(me == odd ? 4 : 3, 1.0);
        // Forms mixed across ranks: the odd rank's is `_async` (the worker compares), the
        // others' sync (this thread compares).
        if (me == odd) {
          auto work = comm.broadcast_async(data, 0);
          expect_error([&] { work.wait(); }, rank_text(comm), "ranks called different operations",
                       "rank " + std::to_string(odd) + " called broadcast(4 x float64, root 0)");
        } else {
          expect_error([&] { comm.all_reduce(data); }, rank_text(comm),
                       "called all_reduce(3 x float64, sum)",
                       "rank " + std::to_string(odd) + " called broadcast(4 x float64, root 0)");
        }
        // Nothing ran and nothing broke: the queue goes on.
        std::vector<double> one{1.0};
        comm.all_reduce_async(one).wait();
        CHECK(one[0] == static_cast<double>(comm.size()));
      },
      {.check_collectives = true});
}

TEST_CASE("MpiComm: with the check switched off nothing is compared, so a mismatch goes by") {
  const auto ranks_reducing_differently = [](tandem::MpiComm& comm) {
    // Harmless to MPI in practice (each rank combines with its own op), so it shows only
    // whether the ranks compared their calls.
    std::vector<float> ones(16, 1.0f);
    comm.all_reduce(ones,
                    comm.rank() == comm.size() - 1 ? tandem::ReduceOp::max : tandem::ReduceOp::sum);
  };
  tandem::test::on_every_rank(
      [&](tandem::MpiComm& comm) {
        CHECK(comm.checks_collectives());
        expect_error([&] { ranks_reducing_differently(comm); }, "ranks disagree on the reduce op");
      },
      {.check_collectives = true});
  tandem::test::on_every_rank(
      [&](tandem::MpiComm& comm) {
        CHECK_FALSE(comm.checks_collectives());
        CHECK_NOTHROW(ranks_reducing_differently(comm));
        auto half = comm.split(comm.rank() % 2);  // a split inherits the setting
        REQUIRE(half.has_value());
        CHECK_FALSE(half->checks_collectives());
      },
      {.check_collectives = false});
}

TEST_CASE("MpiComm: ranks that disagree on the check, or cannot read it, all fail when made") {
  auto world = tandem::MpiComm::world();
  const int me = world.rank();
  const int odd = world.size() - 1;
  expect_error([&] { (void)tandem::MpiComm::world({.check_collectives = me != 0}); },
               rank_text(world), "MpiComm", "TANDEM_CHECK_COLLECTIVES", "rank 0: off",
               world.size() == 2 ? "rank 1: on" : "ranks 1, 2: on", "would wait for fingerprints");
  if (me == odd) ::setenv("TANDEM_CHECK_COLLECTIVES", "on", 1);
  try {
    (void)tandem::MpiComm::world();
    FAIL_CHECK("a communicator was made with TANDEM_CHECK_COLLECTIVES=on on rank " << odd);
  } catch (const tandem::Error& e) {
    if (me == odd) {
      CHECK_MESSAGE(mentions(e.what(), "TANDEM_CHECK_COLLECTIVES='on'"), e.what());
    } else {
      CHECK_MESSAGE(mentions(e.what(), rank_text(world) + ":",
                             "rank " + std::to_string(odd) + " could not read"),
                    e.what());
    }
  }
  if (me == odd) ::unsetenv("TANDEM_CHECK_COLLECTIVES");
  world.barrier();
}
