// Values across ranks on LocalComm (comm/metrics.hpp): reduce_mean/reduce_sum, all_gather_unequal
// with the counts the evaluation sampler gives (every sample once), broadcast_vector of any length;
// and io/log.hpp's log0/log_rank lines.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "support/temp_dir.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/comm/metrics.hpp"
#include "tandem/data/sampler.hpp"
#include "tandem/io/log.hpp"

TEST_CASE("reduce_mean and reduce_sum give every rank the same numbers") {
  tandem::run_local(4, [](tandem::LocalComm& comm) {
    const float loss = static_cast<float>(comm.rank() + 1);  // 1, 2, 3, 4
    CHECK(tandem::reduce_mean(comm, loss) == 2.5f);
    CHECK(tandem::reduce_sum(comm, comm.rank()) == 6);
    CHECK(tandem::reduce_mean(comm, comm.rank()) == 1.5);  // integers averaged in double
    const auto counts = tandem::reduce_sum(comm, std::array<std::int64_t, 2>{comm.rank(), 10});
    CHECK(counts == std::array<std::int64_t, 2>{6, 40});
    std::vector<double> t{double(comm.rank()), 2.0 * comm.rank()};
    tandem::reduce_mean_(comm, t);
    CHECK(t == std::vector<double>{1.5, 3.0});
  });
}

TEST_CASE("distributed evaluation counts every test sample once") {
  const std::size_t n = 1003;  // not a multiple of the ranks
  tandem::run_local(3, [&](tandem::LocalComm& comm) {
    auto eval = tandem::DistributedSampler::evaluation(n, comm);
    std::vector<std::int64_t> seen(eval.begin(), eval.end());
    const auto all = tandem::all_gather_unequal(comm, seen);
    CHECK(all.size() == n);
    std::vector<std::int64_t> sorted = all;
    std::sort(sorted.begin(), sorted.end());
    std::vector<std::int64_t> expected(n);
    std::iota(expected.begin(), expected.end(), 0);
    CHECK(sorted == expected);
    // "Correct" when the index is even: accuracy over the whole set, exactly.
    std::int64_t correct = 0;
    for (auto i : eval) correct += (i % 2 == 0);
    const auto totals =
        tandem::reduce_sum(comm, std::array<std::int64_t, 2>{correct, std::int64_t(eval.size())});
    CHECK(totals[0] == 502);
    CHECK(totals[1] == 1003);
    // A rank with nothing to give.
    std::vector<float> nothing_on_odd(comm.rank() % 2 == 0 ? 2 : 0, float(comm.rank()));
    CHECK(tandem::all_gather_unequal(comm, nothing_on_odd) == std::vector<float>{0, 0, 2, 2});
  });
}

TEST_CASE("broadcast_vector gives every rank the root's values, however many") {
  tandem::run_local(3, [](tandem::LocalComm& comm) {
    // Every rank starts with a different length: the root's length and values win.
    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(comm.rank()) * 5 + 1,
                                    static_cast<std::uint8_t>(comm.rank()));
    tandem::broadcast_vector(comm, bytes, 1);
    CHECK(bytes == std::vector<std::uint8_t>(6, 1));
    std::vector<double> values;
    if (comm.rank() == 2) values = {0.5, -1.25};
    tandem::broadcast_vector(comm, values, 2);
    CHECK(values == std::vector<double>{0.5, -1.25});
    std::vector<std::int64_t> none(comm.rank() == 0 ? 0 : 4, 7);
    tandem::broadcast_vector(comm, none, 0);
    CHECK(none.empty());
  });
}

TEST_CASE("log0 prints on rank 0 only, log_rank on every rank, in whole lines") {
  tandem::test::TempDir dir;
  const std::string path = dir / "log.txt";
  std::FILE* file = std::fopen(path.c_str(), "w");
  REQUIRE(file != nullptr);
  tandem::run_local(3, [&](tandem::LocalComm& comm) {
    for (int i = 0; i < 50; ++i) {
      tandem::log0(comm, file) << "step " << i << " loss " << 0.5;
      tandem::log_rank(comm, file) << "line " << i;
    }
  });
  tandem::log0(tandem::World::single_node(1, 2), file) << "never";
  tandem::log0(0, file) << "done";
  std::fclose(file);
  std::FILE* in = std::fopen(path.c_str(), "r");
  REQUIRE(in != nullptr);
  char buffer[256];
  int rank0 = 0, per_rank = 0, lines = 0;
  std::string last;
  while (std::fgets(buffer, sizeof buffer, in)) {
    const std::string line(buffer);
    ++lines;
    if (line.rfind("step ", 0) == 0) ++rank0;
    if (line.rfind("[rank ", 0) == 0 && line.find("] line ") != std::string::npos) ++per_rank;
    last = line;
  }
  std::fclose(in);
  CHECK(rank0 == 50);
  CHECK(per_rank == 150);
  CHECK(lines == 201);
  CHECK(last == "done\n");
}
