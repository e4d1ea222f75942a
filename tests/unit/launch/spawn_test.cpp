// tandem::spawn: ranks as forked processes, their environment, and failures.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include "launch_test_support.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/world.hpp"
#include "tandem/launch/spawn.hpp"

using tandem::test::read_file;
using tandem::test::TempDir;

namespace {

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "<unset>";
}

/// The tandem::Error spawn throws (its rank and what()), or rank -2 when it throws none.
std::pair<int, std::string> spawn_error(int n, auto fn) {
  try {
    tandem::spawn(n, fn, {.grace = std::chrono::seconds(5)});
  } catch (const tandem::Error& error) {
    return {error.rank(), error.what()};
  }
  return {-2, ""};
}

}  // namespace

TEST_CASE("spawn runs fn(int rank) in n processes and waits for all") {
  TempDir dir;
  const auto parent = ::getpid();
  tandem::spawn(3, [&](int rank) {
    if (::getpid() == parent) throw std::runtime_error("not in a child");
    std::ofstream(dir / ("rank_" + std::to_string(rank))) << ::getpid();
  });
  for (int rank = 0; rank < 3; ++rank) {
    const auto text = read_file(dir / ("rank_" + std::to_string(rank)));
    REQUIRE_FALSE(text.empty());
    CHECK(std::stoi(text) != parent);
  }
  CHECK(env("RANK") == "<unset>");  // the parent's environment is untouched
}

TEST_CASE("spawn gives fn(World) tandemrun's environment") {
  TempDir dir;
  tandem::spawn(2, [&](tandem::World world) {
    const auto from_env = tandem::World::from_env();
    std::ofstream out(dir / ("env_" + std::to_string(world.rank)));
    out << "rank=" << world.rank << " size=" << world.world_size << " same="
        << (from_env.rank == world.rank && from_env.world_size == world.world_size &&
            from_env.local_rank == world.local_rank)
        << " RANK=" << env("RANK") << " LOCAL_RANK=" << env("LOCAL_RANK")
        << " WORLD_SIZE=" << env("WORLD_SIZE") << " GROUP_RANK=" << env("GROUP_RANK")
        << " MASTER_ADDR=" << env("MASTER_ADDR") << " MASTER_PORT=" << env("MASTER_PORT")
        << " RESTARTS=" << env("TORCHELASTIC_RESTART_COUNT") << "\n";
    std::ofstream(dir / ("token_" + std::to_string(world.rank))) << env("TANDEM_STORE_TOKEN");
  });
  // A job token only these ranks know, the same for all.
  CHECK(read_file(dir / "token_0").size() == 64);
  CHECK(read_file(dir / "token_0") == read_file(dir / "token_1"));
  const auto rank0 = read_file(dir / "env_0");
  const auto rank1 = read_file(dir / "env_1");
  CHECK(
      rank0.starts_with("rank=0 size=2 same=1 RANK=0 LOCAL_RANK=0 WORLD_SIZE=2 GROUP_RANK=0 "
                        "MASTER_ADDR=127.0.0.1 MASTER_PORT="));
  CHECK(
      rank1.starts_with("rank=1 size=2 same=1 RANK=1 LOCAL_RANK=1 WORLD_SIZE=2 GROUP_RANK=0 "
                        "MASTER_ADDR=127.0.0.1 MASTER_PORT="));
  CHECK(rank0.ends_with(" RESTARTS=0\n"));
  const auto port = [](const std::string& text) {
    const auto at = text.find("MASTER_PORT=") + 12;
    return text.substr(at, text.find(' ', at) - at);
  };
  CHECK(port(rank0) == port(rank1));
  CHECK(std::stoi(port(rank0)) > 0);
}

TEST_CASE("an exception in a rank: the others are stopped and spawn names the rank") {
  const auto [rank, what] = spawn_error(3, [](int rank) {
    if (rank == 1) throw std::runtime_error("boom");
    ::pause();  // the others would wait forever: spawn must stop them
  });
  CHECK(rank == 1);
  CHECK(what.find("rank 1") != std::string::npos);
  CHECK(what.find("exit code 1") != std::string::npos);
}

TEST_CASE("an exit code or a signal in a rank is named") {
  const auto [code_rank, code_what] = spawn_error(2, [](int rank) {
    if (rank == 0) std::_Exit(7);
    ::pause();
  });
  CHECK(code_rank == 0);
  CHECK(code_what.find("exit code 7") != std::string::npos);

  const auto [signal_rank, signal_what] = spawn_error(2, [](int rank) {
    if (rank == 1) ::kill(::getpid(), SIGKILL);
    ::pause();
  });
  CHECK(signal_rank == 1);
  CHECK(signal_what.find("SIGKILL") != std::string::npos);
}

TEST_CASE("spawn refuses a bad count, and a timeout stops the ranks") {
  CHECK_THROWS_AS(tandem::spawn(0, [](int) {}), tandem::Error);
  try {
    tandem::spawn(2, [](int) { ::pause(); }, {.timeout = std::chrono::milliseconds(300)});
    FAIL("spawn should have timed out");
  } catch (const tandem::Error& error) {
    CHECK(std::string(error.what()).find("did not end within 300 ms") != std::string::npos);
  }
}

TEST_CASE("CUDA not initialised here, so spawn is allowed") {
  CHECK_FALSE(tandem::launch::detail::cuda_initialised());
}
