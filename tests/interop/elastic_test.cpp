// tandem/launch/elastic.hpp: run_main and the error file torchrun reads, restart_count.
#include <doctest/doctest.h>

#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>

#include "support/fake_env.hpp"
#include "support/temp_dir.hpp"
#include "tandem/launch/elastic.hpp"

namespace {

std::string read(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST_CASE("run_main returns the body's code, 0 for a void body") {
  const tandem::test::FakeEnv env{};
  CHECK(tandem::run_main([] { return 7; }, env.lookup()) == 7);
  CHECK(tandem::run_main([] {}, env.lookup()) == 0);
}

TEST_CASE("an exception that ends the body is written to TORCHELASTIC_ERROR_FILE as torch does") {
  tandem::test::TempDir dir;
  const std::string path = dir.str() + "/error.json";
  const tandem::test::FakeEnv env{{"TORCHELASTIC_ERROR_FILE", path}};

  SUBCASE("tandem::Error") {
    const int code = tandem::run_main(
        []() -> int { throw tandem::Error(1, "all_reduce", "rank 0 \"left\"\n\tearly"); },
        env.lookup());
    CHECK(code == 1);
    const std::string json = read(path);
    // torch.distributed.elastic's layout: message.message, message.extraInfo.{py_callstack,
    // timestamp as a string of seconds}; torchrun's summary shows py_callstack.
    CHECK(json.starts_with(
        "{\"message\": {\"message\": \"tandem::Error: tandem: rank 1: all_reduce: rank 0 "
        "\\\"left\\\"\\n\\tearly\", \"extraInfo\": {\"py_callstack\": \"tandem: rank 1: "
        "all_reduce: rank 0 \\\"left\\\"\\n\\tearly\\n(tandem::Error thrown by a C++ program; no "
        "Python traceback)\", \"timestamp\": \""));
    const auto stamp = json.find("\"timestamp\": \"") + 14;
    const auto seconds = std::stoll(json.substr(stamp));
    CHECK(seconds > 1700000000);  // a plausible Unix time
    CHECK(json.ends_with("\"}}}\n"));
  }
  SUBCASE("any std::exception, named by its type") {
    CHECK(tandem::run_main([]() -> int { throw std::out_of_range("index 9"); }, env.lookup()) == 1);
    const std::string json = read(path);
    CHECK(json.find("\"message\": \"std::out_of_range: tandem: uncaught std::out_of_range: index "
                    "9\"") != std::string::npos);
  }
  SUBCASE("control characters are escaped") {
    CHECK(tandem::detail::json_string(std::string("a\x01z\\", 4)) == "\"a\\u0001z\\\\\"");
  }
}

TEST_CASE(
    "without TORCHELASTIC_ERROR_FILE nothing is written, and restart_count reads torchrun's") {
  CHECK_FALSE(tandem::write_error_file("T", "what", tandem::test::FakeEnv{}.lookup()));
  CHECK(tandem::restart_count(tandem::test::FakeEnv{}.lookup()) == 0);
  CHECK(tandem::restart_count(
            tandem::test::FakeEnv{{"TORCHELASTIC_RESTART_COUNT", "2"}}.lookup()) == 2);
  CHECK_THROWS_AS((void)tandem::restart_count(
                      tandem::test::FakeEnv{{"TORCHELASTIC_RESTART_COUNT", "-1"}}.lookup()),
                  tandem::Error);
}
