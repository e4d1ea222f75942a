// tandem::agree (comm/agree.hpp) on LocalComm ranks: the configuration every rank must share,
// checked at start; a difference is an Error on every rank naming the setting, the ranks and
// their values, and the communicator stays usable after it.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "support/collective_suite.hpp"
#include "tandem/comm/agree.hpp"
#include "tandem/comm/local/local.hpp"

using tandem::LocalComm;
using tandem::Setting;
using tandem::test::Failures;
using tandem::test::mentions;

namespace {

/// Runs agree(comm, settings_of(rank)) on `n` ranks; each rank's Error text ("" when none), and
/// a failure when a rank's communicator is unusable afterwards (the ranks ran the same
/// collectives).
template <class SettingsOf>
std::vector<std::string> agree_on(int n, SettingsOf settings_of) {
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  Failures failures;
  tandem::run_local(n, [&](LocalComm& comm) {
    const std::vector<Setting> settings = settings_of(comm.rank());
    try {
      tandem::agree(comm, settings);
    } catch (const tandem::Error& error) {
      errors[static_cast<std::size_t>(comm.rank())] = error.what();
    }
    std::vector<std::int32_t> one{1};
    comm.all_reduce(one, tandem::ReduceOp::sum);
    failures.expect(one[0] == comm.size(), "rank ", comm.rank(), ": all_reduce after agree gave ",
                    one[0]);
  });
  failures.report();
  return errors;
}

}  // namespace

TEST_CASE("a Setting holds its value's kind and exact text") {
  CHECK(Setting("--seed", 42).text() == "42");
  CHECK(Setting("--seed", std::uint64_t{18446744073709551615ull}).text() == "18446744073709551615");
  CHECK(Setting("--steps", std::int64_t{-3}).kind() == Setting::Kind::integer);
  CHECK(Setting("--amp", true).text() == "true");
  CHECK(Setting("--amp", false).kind() == Setting::Kind::boolean);
  CHECK(Setting("--lr", 0.1).text() == "0.1");
  CHECK(Setting("--lr", 3e-5).text() == "3e-05");
  CHECK(Setting("--lr", 0.1f).text() == "0.1");  // float's own shortest text
  CHECK(Setting("--lr", 0.1 + 1.3877787807814457e-17).text() == "0.10000000000000002");
  CHECK(Setting("--lr", -0.0).text() == "-0");
  CHECK(Setting("--lr", std::numeric_limits<double>::quiet_NaN()).text() == "nan");
  CHECK(Setting("--data", "/data/fmnist").shown() == "\"/data/fmnist\"");
  CHECK(Setting("--data", std::string("a b")).kind() == Setting::Kind::text);
  CHECK(Setting("--data", std::filesystem::path("./data")).text() == "./data");
  CHECK(Setting("--lr", 0.5).shown() == "0.5");
}

TEST_CASE("agree returns on every rank when the settings are the same") {
  for (int n : {1, 2, 4}) {
    const auto errors = agree_on(n, [](int) {
      return std::vector<Setting>{{"--seed", 7},
                                  {"--lr", 0.1},
                                  {"--batch", std::size_t{64}},
                                  {"--amp", true},
                                  {"--data", std::filesystem::path("/data/fmnist")},
                                  {"--model", "resnet"}};
    });
    for (const auto& error : errors) CHECK_MESSAGE(error.empty(), n, " ranks: ", error);
  }
  const auto none = agree_on(3, [](int) { return std::vector<Setting>{}; });
  for (const auto& error : none) CHECK(error.empty());
}

TEST_CASE("misuse: one rank with another --lr is an Error on every rank naming ranks and values") {
  const auto errors = agree_on(4, [](int rank) {
    return std::vector<Setting>{{"--seed", 7}, {"--lr", rank == 2 ? 0.2 : 0.1}};
  });
  for (int r = 0; r < 4; ++r) {
    const auto& error = errors[static_cast<std::size_t>(r)];
    CHECK_MESSAGE(mentions(error, "rank " + std::to_string(r) + ": agree: ",
                           "--lr differs: ranks 0, 1, 3 have 0.1; rank 2 has 0.2"),
                  error);
    CHECK_MESSAGE(error.find("--seed") == std::string::npos, error);  // it agrees
  }
}

TEST_CASE("misuse: every setting that differs is named, with each rank's value") {
  const auto errors = agree_on(3, [](int rank) {
    return std::vector<Setting>{{"--seed", 42 + rank},
                                {"--batch", 64},
                                {"--data", rank == 1 ? "./data" : "data"},
                                {"--amp", rank != 0}};
  });
  for (const auto& error : errors) {
    CHECK_MESSAGE(mentions(error, "--seed differs: rank 0 has 42; rank 1 has 43; rank 2 has 44",
                           "--data differs: ranks 0, 2 have \"data\"; rank 1 has \"./data\"",
                           "--amp differs: rank 0 has false; ranks 1, 2 have true"),
                  error);
    CHECK_MESSAGE(error.find("--batch") == std::string::npos, error);
  }
}

TEST_CASE("misuse: floating-point values are compared bit for bit") {
  const double next = std::nextafter(0.1, 1.0);
  const auto errors = agree_on(2, [&](int rank) {
    return std::vector<Setting>{{"--lr", rank == 0 ? 0.1 : next},
                                {"--momentum", rank == 0 ? 0.0 : -0.0}};
  });
  for (const auto& error : errors) {
    CHECK_MESSAGE(mentions(error, "--lr differs: rank 0 has 0.1; rank 1 has 0.10000000000000002",
                           "--momentum differs: rank 0 has 0; rank 1 has -0"),
                  error);
  }
}

TEST_CASE("misuse: values of different kinds, missing settings and another order are Errors") {
  const auto kinds = agree_on(2, [](int rank) {
    return rank == 0 ? std::vector<Setting>{{"--epochs", 3}}
                     : std::vector<Setting>{{"--epochs", 3.0}};
  });
  for (const auto& error : kinds) {
    CHECK_MESSAGE(mentions(error,
                           "--epochs differs: rank 0 has 3 (an integer); rank 1 has 3 (a "
                           "floating-point value)"),
                  error);
  }
  const auto missing = agree_on(3, [](int rank) {
    std::vector<Setting> settings{{"--seed", 1}};
    if (rank != 1) settings.emplace_back("--resume", "ckpt");
    return settings;
  });
  for (const auto& error : missing) {
    CHECK_MESSAGE(
        mentions(error, "--resume differs: ranks 0, 2 have \"ckpt\"; rank 1 has no such setting"),
        error);
  }
  const auto order = agree_on(2, [](int rank) {
    return rank == 0 ? std::vector<Setting>{{"--seed", 1}, {"--lr", 0.5}}
                     : std::vector<Setting>{{"--lr", 0.5}, {"--seed", 1}};
  });
  for (const auto& error : order) CHECK_MESSAGE(mentions(error, "different orders"), error);
}

TEST_CASE("agree takes a braced list") {
  Failures failures;
  tandem::run_local(2, [&](LocalComm& comm) {
    const int seed = 5;
    const double lr = 0.25;
    try {
      tandem::agree(comm, {{"--seed", seed}, {"--lr", lr}, {"--rank-dependent", comm.rank()}});
      failures.add("rank ", comm.rank(), ": no Error for --rank-dependent");
    } catch (const tandem::Error& error) {
      failures.expect(mentions(std::string(error.what()),
                               "--rank-dependent differs: rank 0 has 0; rank 1 has 1"),
                      error.what());
    }
  });
  failures.report();
}
