// DistributedDataParallel on LocalComm (ranks as threads), 1 to 4 ranks: the whole suite.
#include <doctest/doctest.h>

#include <chrono>

#include "ddp_suite.hpp"
#include "tandem/comm/local.hpp"

namespace {

using namespace std::chrono_literals;
namespace suite = tandem::test::ddp;

struct LocalRunner {
  template <class Fn>
  void operator()(int n, Fn&& fn) {
    tandem::run_local(
        n, [&](tandem::LocalComm& comm) { fn(comm); }, tandem::LocalCommOptions{30s});
  }
};

constexpr int max_ranks = 4;

}  // namespace

TEST_CASE("DDP on LocalComm: N ranks x batch b equal 1 rank x batch N*b") {
  LocalRunner run;
  suite::check_theorems<tandem::LocalComm>(run, max_ranks);
}

TEST_CASE("DDP on LocalComm: no_sync accumulation equals one step on the whole batch") {
  LocalRunner run;
  suite::check_no_syncs<tandem::LocalComm>(run, max_ranks);
}

TEST_CASE("DDP on LocalComm: unused parameters, element types, reductions and bucket caps") {
  LocalRunner run;
  suite::check_reductions<tandem::LocalComm>(run, max_ranks);
}

TEST_CASE("DDP on LocalComm: marking twice and mismatched registrations are errors") {
  LocalRunner run;
  suite::check_errors<tandem::LocalComm>(run, max_ranks);
}

TEST_CASE("DDP on LocalComm: 16-bit compression stays within its rounding bound") {
  LocalRunner run;
  suite::check_compressions<tandem::LocalComm>(run, max_ranks);
}
