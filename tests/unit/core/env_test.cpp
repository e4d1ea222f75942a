#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "support/fake_env.hpp"
#include "tandem/core/env.hpp"

using tandem::test::FakeEnv;

TEST_CASE("parse_int accepts whole base-10 integers only") {
  CHECK(tandem::parse_int("42") == 42);
  CHECK(tandem::parse_int("+7") == 7);
  CHECK(tandem::parse_int("-3") == -3);
  CHECK(tandem::parse_int("0") == 0);
  CHECK_FALSE(tandem::parse_int(""));
  CHECK_FALSE(tandem::parse_int("+"));
  CHECK_FALSE(tandem::parse_int("4x"));
  CHECK_FALSE(tandem::parse_int(" 4"));
  CHECK_FALSE(tandem::parse_int("4 "));
  CHECK_FALSE(tandem::parse_int("0x10"));
  CHECK_FALSE(tandem::parse_int("99999999999999999999"));
  // Found by tests/fuzz (crashes/init_env/plus-then-minus-sign): one sign, not two.
  CHECK_FALSE(tandem::parse_int("+-1"));
  CHECK_FALSE(tandem::parse_int("-+1"));
  CHECK_FALSE(tandem::parse_int("++1"));
  CHECK(tandem::parse_int("-9223372036854775808") == INT64_MIN);
  CHECK_FALSE(tandem::parse_int("9223372036854775808"));
}

TEST_CASE("env_int is empty when unset and names the variable when malformed") {
  const FakeEnv env{{"GOOD", "12"}, {"BAD", "twelve"}};
  CHECK_FALSE(tandem::env_int(env.lookup(), "MISSING"));
  CHECK(tandem::env_int(env.lookup(), "GOOD") == 12);
  CHECK_THROWS_WITH_AS(tandem::env_int(env.lookup(), "BAD"),
                       "tandem: environment: BAD='twelve' is not an integer", tandem::Error);
}

TEST_CASE("env_int_in rejects values out of range, naming variable and range") {
  const FakeEnv env{{"PORT", "70000"}, {"OK", "80"}};
  CHECK(tandem::env_int_in(env.lookup(), "OK", 0, 65535) == 80);
  CHECK_THROWS_WITH_AS(tandem::env_int_in(env.lookup(), "PORT", 0, 65535),
                       "tandem: environment: PORT=70000 is out of range [0, 65535]", tandem::Error);
}

TEST_CASE("process_env reads the real environment") {
  REQUIRE(::setenv("TANDEM_TEST_PROCESS_ENV", "hello", 1) == 0);
  CHECK(tandem::process_env("TANDEM_TEST_PROCESS_ENV") == std::string("hello"));
  REQUIRE(::unsetenv("TANDEM_TEST_PROCESS_ENV") == 0);
  CHECK_FALSE(tandem::process_env("TANDEM_TEST_PROCESS_ENV"));
}
