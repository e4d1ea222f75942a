#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "support/fake_env.hpp"
#include "support/free_port.hpp"
#include "support/temp_dir.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/local/local.hpp"

using namespace std::chrono_literals;
using tandem::LocalComm;
using tandem::World;

static_assert(tandem::ProcessGroupBackend<LocalComm>);

namespace {

std::string tcp_url() {
  return "tcp://127.0.0.1:" + std::to_string(tandem::test::free_port());
}

/// Starts `n` threads; thread r runs fn(r). Returns the message of each thread's exception ("" if
/// none), so the main thread can CHECK them.
template <class Fn>
std::vector<std::string> run_threads(int n, Fn fn) {
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

/// Every rank joins at `url` and averages its rank; returns what each rank saw.
std::vector<float> average_ranks(int n, const std::string& url) {
  std::vector<float> seen(static_cast<std::size_t>(n), -1.0f);
  const auto errors = run_threads(n, [&](int r) {
    auto comm =
        tandem::init_process_group<LocalComm>(World::single_node(r, n), url, {.timeout = 20s});
    std::vector<float> value{static_cast<float>(comm.rank())};
    comm.all_reduce(value, tandem::ReduceOp::avg);
    seen[static_cast<std::size_t>(r)] = value[0];
  });
  for (const auto& e : errors) CHECK(e == "");
  return seen;
}

}  // namespace

TEST_CASE("init_process_group over tcp:// gives a working group") {
  for (float v : average_ranks(4, tcp_url())) CHECK(v == 1.5f);
}

TEST_CASE("init_process_group over file:// gives a working group, and a rerun on the file too") {
  const tandem::test::TempDir dir;
  const std::string url = "file://" + (dir.path() / "store").string();
  for (float v : average_ranks(3, url)) CHECK(v == 1.0f);
  for (float v : average_ranks(3, url)) CHECK(v == 1.0f);  // the stale file of run one is reset
}

TEST_CASE("init_process_group over env:// reads MASTER_ADDR and MASTER_PORT") {
  const tandem::test::FakeEnv env{{"MASTER_ADDR", "127.0.0.1"},
                                  {"MASTER_PORT", std::to_string(tandem::test::free_port())}};
  std::vector<int> sizes(2, 0);
  const auto errors = run_threads(2, [&](int r) {
    auto comm = tandem::init_process_group<LocalComm>(World::single_node(r, 2), "env://",
                                                      {.timeout = 20s}, env.lookup());
    sizes[static_cast<std::size_t>(r)] = comm.size();
  });
  for (const auto& e : errors) CHECK(e == "");
  CHECK(sizes == std::vector<int>{2, 2});
}

TEST_CASE("init_process_group takes the World from the URL's query parameters") {
  const std::string url = tcp_url();
  const tandem::test::FakeEnv bare{};
  std::vector<int> ranks(2, -1);
  const auto errors = run_threads(2, [&](int r) {
    auto comm = tandem::init_process_group<LocalComm>(
        url + "?world_size=2&rank=" + std::to_string(r), {.timeout = 20s}, bare.lookup());
    ranks[static_cast<std::size_t>(r)] = comm.rank();
  });
  for (const auto& e : errors) CHECK(e == "");
  CHECK(ranks == std::vector<int>{0, 1});
}

TEST_CASE("a rank that never joins is named in the timeout error") {
  const std::string url = tcp_url();
  const auto errors = run_threads(2, [&](int r) {  // ranks 0 and 1 of 3; rank 2 never comes
    (void)tandem::init_process_group<LocalComm>(World::single_node(r, 3), url, {.timeout = 500ms});
  });
  // Rank 0 hosts the store and names the missing rank; rank 1 does too, unless rank 0 gave up
  // first and took the store with it, which rank 1's error must then say.
  CHECK(errors[0].find("rank(s) 2 did not join " + url + " within 500 ms") != std::string::npos);
  const bool named = errors[1].find("rank(s) 2 did not join") != std::string::npos;
  const bool lost = errors[1].find("lost the store at " + url) != std::string::npos;
  CHECK_MESSAGE(named != lost, errors[1]);
}

TEST_CASE("two ranks claiming one rank number, or disagreeing on the world size, are errors") {
  SUBCASE("one rank twice") {
    // Ranks 0, 1 and 1 again of 3: rank 2 never comes, so no rank can finish (and take the
    // server away) before the second claim of rank 1 has been seen.
    const std::string url = tcp_url();
    const auto errors = run_threads(3, [&](int r) {
      (void)tandem::init_process_group<LocalComm>(World::single_node(r == 2 ? 1 : r, 3), url,
                                                  {.timeout = 3s});
    });
    int twice = 0;
    for (const auto& e : errors)
      twice += e.find("rank 1 joined " + url + " twice") != std::string::npos;
    CHECK(twice == 1);
    // The second claim ends the others' wait too, naming the rank claimed twice.
    CHECK(errors[0].find("rank 1 was claimed by two processes") != std::string::npos);
  }
  SUBCASE("world sizes disagree") {
    const std::string url = tcp_url();
    const auto errors = run_threads(2, [&](int r) {
      (void)tandem::init_process_group<LocalComm>(World::single_node(r, r == 0 ? 2 : 3), url,
                                                  {.timeout = 2s});
    });
    int disagree = 0;
    for (const auto& e : errors)
      disagree += e.find("earlier have world_size=") != std::string::npos;
    CHECK(disagree == 1);
  }
}

TEST_CASE("LocalComm ranks in two processes are refused with a clear error") {
  const std::string url = tcp_url();
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // Rank 1 in another process: it must be told to use another backend.
    int status = 1;
    try {
      (void)tandem::init_process_group<LocalComm>(World::single_node(1, 2), url, {.timeout = 5s});
    } catch (const tandem::Error& e) {
      status =
          std::string(e.what()).find("must be threads of one process") != std::string::npos ? 0 : 2;
    } catch (...) {
      status = 3;
    }
    ::_exit(status);
  }
  std::string parent_error;
  try {
    (void)tandem::init_process_group<LocalComm>(World::single_node(0, 2), url, {.timeout = 3s});
  } catch (const tandem::Error& e) {
    parent_error = e.what();
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  // Rank 0 finished its half but rank 1 never did: rank 0 names it instead of hanging.
  CHECK(parent_error.find("rank(s) 1 did not finish the rendezvous at") != std::string::npos);
}

namespace {

/// Runs fn with stderr (fd 2) going to a file; returns what it wrote there.
template <class Fn>
std::string capture_stderr(Fn fn) {
  tandem::test::TempDir dir;
  const std::string path = dir.str() + "/stderr";
  std::fflush(stderr);
  const int saved = ::dup(2);
  std::FILE* file = std::fopen(path.c_str(), "w");
  REQUIRE(file != nullptr);
  ::dup2(::fileno(file), 2);
  try {
    fn();
  } catch (...) {
    std::fflush(stderr);
    ::dup2(saved, 2);
    ::close(saved);
    std::fclose(file);
    throw;
  }
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  std::fclose(file);
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST_CASE("a rank waiting at the rendezvous says so every TANDEM_WAIT_NOTICE_S seconds") {
  // Rank 0 of 2, alone: it hosts the store, waits 2.5 s for rank 1 and names it at the end.
  const tandem::test::FakeEnv env{{"TANDEM_WAIT_NOTICE_S", "1"}};
  std::string error;
  const auto said = capture_stderr([&] {
    try {
      (void)tandem::init_process_group<LocalComm>(World::single_node(0, 2), tcp_url(),
                                                  {.timeout = 2500ms}, env.lookup());
    } catch (const tandem::Error& e) {
      error = e.what();
    }
  });
  const std::string notice = "tandem: rank 0 waiting for rank 1 of 2 to join (expected on host ";
  CHECK(said.find(notice) != std::string::npos);
  CHECK(said.find("(1 s of 2 s)\n") != std::string::npos);
  std::size_t notices = 0;
  for (auto at = said.find(notice); at != std::string::npos; at = said.find(notice, at + 1)) {
    ++notices;
  }
  CHECK(notices == 2);  // at 1 s and 2 s; the timeout comes before a third
  CHECK(error.find("rank(s) 1 did not join") != std::string::npos);

  // The default is every 10 s, as for a collective; 0 silences it; anything else is an Error naming
  // the variable.
  using tandem::detail::wait_notice_interval;
  CHECK(wait_notice_interval(tandem::test::FakeEnv{}.lookup()) == 10s);
  CHECK(wait_notice_interval(tandem::test::FakeEnv{{"TANDEM_WAIT_NOTICE_S", "0"}}.lookup()) ==
        tandem::Timeout::max());
  CHECK_THROWS_WITH_AS(
      wait_notice_interval(tandem::test::FakeEnv{{"TANDEM_WAIT_NOTICE_S", "soon"}}.lookup()),
      doctest::Contains("TANDEM_WAIT_NOTICE_S"), tandem::Error);
  CHECK(tandem::detail::waiting_notice(3, {5, 6}, 8, "", "", 30s, 30min) ==
        "tandem: rank 3 waiting for ranks 5, 6 of 8 (30 s of 1800 s)");
}

TEST_CASE(
    "TORCHELASTIC_USE_AGENT_STORE=True needs TORCHELASTIC_RESTART_COUNT, and names tandem's "
    "keys by attempt") {
  CHECK(tandem::use_agent_store(
      tandem::test::FakeEnv{{"TORCHELASTIC_USE_AGENT_STORE", "True"}}.lookup()));
  CHECK_FALSE(tandem::use_agent_store(
      tandem::test::FakeEnv{{"TORCHELASTIC_USE_AGENT_STORE", "False"}}.lookup()));
  CHECK_FALSE(tandem::use_agent_store(tandem::test::FakeEnv{}.lookup()));
  CHECK(tandem::agent_store_prefix(
            tandem::test::FakeEnv{{"TORCHELASTIC_RESTART_COUNT", "2"}}.lookup()) ==
        "tandem/attempt_2");
  CHECK_THROWS_WITH_AS(tandem::agent_store_prefix(tandem::test::FakeEnv{}.lookup()),
                       doctest::Contains("TORCHELASTIC_RESTART_COUNT"), tandem::Error);
  CHECK(tandem::c10d_protocol_from_env(tandem::test::FakeEnv{}.lookup()) ==
        tandem::C10dProtocol::automatic);
  CHECK(tandem::c10d_protocol_from_env(
            tandem::test::FakeEnv{{"TANDEM_C10D_PROTOCOL", "legacy"}}.lookup()) ==
        tandem::C10dProtocol::legacy);
  CHECK_THROWS_AS(tandem::c10d_protocol_from_env(
                      tandem::test::FakeEnv{{"TANDEM_C10D_PROTOCOL", "v3"}}.lookup()),
                  tandem::Error);
}
