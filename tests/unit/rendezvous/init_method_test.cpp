#include <doctest/doctest.h>

#include <optional>
#include <string>

#include "support/fake_env.hpp"
#include "tandem/rendezvous/init_method.hpp"

using tandem::InitMethod;
using tandem::parse_init_method;
using tandem::resolve_world;
using tandem::World;
using tandem::test::FakeEnv;

TEST_CASE("env:// takes MASTER_ADDR and MASTER_PORT") {
  const FakeEnv env{{"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "29500"}};
  const InitMethod m = parse_init_method("env://", env.lookup());
  CHECK(m.scheme == InitMethod::Scheme::env);
  CHECK(m.host == "10.1.2.3");
  CHECK(m.port == 29500);
  CHECK_FALSE(m.rank);
}

TEST_CASE("env:// names the missing or malformed variable") {
  const FakeEnv no_addr{{"MASTER_PORT", "29500"}};
  CHECK_THROWS_WITH_AS(parse_init_method("env://", no_addr.lookup()),
                       doctest::Contains("MASTER_ADDR is not set"), tandem::Error);
  const FakeEnv no_port{{"MASTER_ADDR", "127.0.0.1"}};
  CHECK_THROWS_WITH_AS(parse_init_method("env://", no_port.lookup()),
                       doctest::Contains("MASTER_PORT is not set"), tandem::Error);
  const FakeEnv bad_port{{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "0"}};
  CHECK_THROWS_WITH_AS(parse_init_method("env://", bad_port.lookup()),
                       doctest::Contains("MASTER_PORT '0' is not a port number"), tandem::Error);
}

TEST_CASE("tcp:// with host, port and query parameters") {
  const FakeEnv env{};
  const InitMethod m = parse_init_method("tcp://node7:1234?rank=3&world_size=8", env.lookup());
  CHECK(m.scheme == InitMethod::Scheme::tcp);
  CHECK(m.host == "node7");
  CHECK(m.port == 1234);
  CHECK(m.rank == 3);
  CHECK(m.world_size == 8);

  const InitMethod v6 = parse_init_method("tcp://[::1]:29500", env.lookup());
  CHECK(v6.host == "::1");
  CHECK(v6.port == 29500);
}

TEST_CASE("tcp:// errors say what is missing") {
  const FakeEnv env{};
  CHECK_THROWS_WITH_AS(parse_init_method("tcp://node7", env.lookup()),
                       "tandem: init_process_group: init_method 'tcp://node7': no port: expected "
                       "tcp://HOST:PORT",
                       tandem::Error);
  CHECK_THROWS_WITH_AS(parse_init_method("tcp://:29500", env.lookup()),
                       doctest::Contains("no host"), tandem::Error);
  CHECK_THROWS_WITH_AS(parse_init_method("tcp://h:99999", env.lookup()),
                       doctest::Contains("port '99999' is not a port number"), tandem::Error);
  CHECK_THROWS_WITH_AS(parse_init_method("tcp://h:1?rnak=1", env.lookup()),
                       doctest::Contains("unknown query parameter 'rnak'"), tandem::Error);
  CHECK_THROWS_WITH_AS(parse_init_method("tcp://h:1?rank=x", env.lookup()),
                       doctest::Contains("rank='x' is not a non-negative integer"), tandem::Error);
  CHECK_THROWS_WITH_AS(parse_init_method("tcp://h:1?rank", env.lookup()),
                       doctest::Contains("'rank' has no value"), tandem::Error);
}

TEST_CASE("file:// needs an absolute path") {
  const FakeEnv env{};
  const InitMethod m = parse_init_method("file:///tmp/job/store?world_size=2&rank=1", env.lookup());
  CHECK(m.scheme == InitMethod::Scheme::file);
  CHECK(m.path == "/tmp/job/store");
  CHECK(m.rank == 1);
  CHECK_THROWS_WITH_AS(parse_init_method("file://relative/store", env.lookup()),
                       doctest::Contains("the path must be absolute"), tandem::Error);
}

TEST_CASE("unknown schemes are refused with the list of known ones") {
  const FakeEnv env{};
  CHECK_THROWS_WITH_AS(parse_init_method("nccl://x", env.lookup()),
                       doctest::Contains("use env://, tcp://HOST:PORT or file:///PATH"),
                       tandem::Error);
}

TEST_CASE("resolve_world: a given World must agree with the query") {
  const FakeEnv env{};
  const auto m = parse_init_method("tcp://h:1?world_size=4", env.lookup());
  const World w = resolve_world(m, World::single_node(2, 4), env.lookup());
  CHECK(w.rank == 2);
  const auto disagree = parse_init_method("tcp://h:1?world_size=3", env.lookup());
  CHECK_THROWS_WITH_AS(resolve_world(disagree, World::single_node(2, 4), env.lookup()),
                       doctest::Contains("?world_size=3 disagrees with the World passed in "
                                         "(world_size=4)"),
                       tandem::Error);
}

TEST_CASE("resolve_world: launcher variables, or query parameters, or a clear error") {
  const FakeEnv launched{{"RANK", "1"}, {"WORLD_SIZE", "2"}};
  const auto plain = parse_init_method("tcp://h:1", launched.lookup());
  CHECK(resolve_world(plain, std::nullopt, launched.lookup()).rank == 1);
  const auto conflicting = parse_init_method("tcp://h:1?rank=0", launched.lookup());
  CHECK_THROWS_WITH_AS(resolve_world(conflicting, std::nullopt, launched.lookup()),
                       doctest::Contains("?rank=0 disagrees with the launcher's variables"),
                       tandem::Error);

  const FakeEnv bare{};
  const auto query = parse_init_method("tcp://h:1?rank=2&world_size=3", bare.lookup());
  const World w = resolve_world(query, std::nullopt, bare.lookup());
  CHECK(w.rank == 2);
  CHECK(w.world_size == 3);
  CHECK(w.local_rank == 2);

  const auto no_rank = parse_init_method("tcp://h:1?world_size=3", bare.lookup());
  CHECK_THROWS_WITH_AS(resolve_world(no_rank, std::nullopt, bare.lookup()),
                       doctest::Contains("rank is unknown: set RANK"), tandem::Error);
  const auto no_size = parse_init_method("tcp://h:1?rank=0", bare.lookup());
  CHECK_THROWS_WITH_AS(resolve_world(no_size, std::nullopt, bare.lookup()),
                       doctest::Contains("world size is unknown: set WORLD_SIZE"), tandem::Error);
  const auto out_of_range = parse_init_method("tcp://h:1?rank=3&world_size=3", bare.lookup());
  CHECK_THROWS_WITH_AS(resolve_world(out_of_range, std::nullopt, bare.lookup()),
                       doctest::Contains("rank=3 must be less than world_size=3"), tandem::Error);
}
