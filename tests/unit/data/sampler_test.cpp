// DistributedSampler against index lists that torch.utils.data.DistributedSampler produced
// (tests/reference/golden_sampler.py), its evaluation mode, and views::batches.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <ranges>
#include <set>
#include <string>
#include <vector>

#include "support/golden.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/data/batches.hpp"
#include "tandem/data/sampler.hpp"

namespace {

using tandem::DistributedSampler;
using tandem::SamplerOptions;

const tandem::test::Golden& golden() {
  static const tandem::test::Golden file("sampler.txt");
  return file;
}

std::vector<std::int64_t> as_indices(const std::vector<double>& values) {
  return {values.begin(), values.end()};
}

std::vector<std::int64_t> collect(const DistributedSampler& sampler) {
  return {sampler.begin(), sampler.end()};
}

}  // namespace

static_assert(std::ranges::random_access_range<DistributedSampler>);
static_assert(std::ranges::sized_range<DistributedSampler>);
static_assert(std::ranges::viewable_range<DistributedSampler&>);
static_assert(std::same_as<std::ranges::range_value_t<DistributedSampler>, std::int64_t>);
static_assert(std::is_nothrow_copy_constructible_v<DistributedSampler>);

TEST_CASE("DistributedSampler yields exactly PyTorch's indices") {
  int checked = 0;
  for (std::size_t n : {1u, 3u, 7u, 8u, 10u, 37u}) {
    for (int replicas = 1; replicas <= 8; ++replicas) {
      for (bool drop_last : {false, true}) {
        for (bool shuffle : {false, true}) {
          const std::vector<std::uint64_t> seeds =
              shuffle ? std::vector<std::uint64_t>{0, 42, (1ull << 32) + 5, (1ull << 40) + 123}
                      : std::vector<std::uint64_t>{0};
          const std::vector<std::uint64_t> epochs =
              shuffle ? std::vector<std::uint64_t>{0, 2} : std::vector<std::uint64_t>{0};
          for (auto seed : seeds) {
            for (auto epoch : epochs) {
              for (int rank = 0; rank < replicas; ++rank) {
                const std::string key = "n" + std::to_string(n) + "/r" + std::to_string(replicas) +
                                        "/k" + std::to_string(rank) + "/s" + std::to_string(seed) +
                                        "/e" + std::to_string(epoch) + "/sh" +
                                        std::to_string(int(shuffle)) + "/dl" +
                                        std::to_string(int(drop_last));
                CAPTURE(key);
                DistributedSampler sampler(
                    n, replicas, rank, {.shuffle = shuffle, .seed = seed, .drop_last = drop_last});
                sampler.set_epoch(epoch);
                const auto expected = as_indices(golden().values(key));
                CHECK(collect(sampler) == expected);
                CHECK(sampler.size() == expected.size());
                CHECK(sampler.num_samples() == expected.size());
                CHECK(sampler.total_size() ==
                      static_cast<std::size_t>(golden().values(key + "/total").at(0)));
                ++checked;
              }
            }
          }
        }
      }
    }
  }
  CHECK(checked > 3000);
}

TEST_CASE("DistributedSampler matches PyTorch on 60000 samples (Fashion-MNIST's size)") {
  struct Case {
    int replicas;
    std::uint64_t seed, epoch;
  };
  for (auto c :
       {Case{1, 0, 0}, Case{2, 0, 0}, Case{2, 0, 1}, Case{3, 1ull << 33, 4}, Case{8, 7, 0}}) {
    for (int rank : std::set<int>{0, c.replicas - 1}) {
      for (bool drop_last : {false, true}) {
        const std::string key = "big/r" + std::to_string(c.replicas) + "/k" + std::to_string(rank) +
                                "/s" + std::to_string(c.seed) + "/e" + std::to_string(c.epoch) +
                                "/dl" + std::to_string(int(drop_last));
        CAPTURE(key);
        DistributedSampler sampler(60000, c.replicas, rank,
                                   {.seed = c.seed, .drop_last = drop_last});
        sampler.set_epoch(c.epoch);
        const auto prefix = as_indices(golden().values(key + "/prefix"));
        const auto checksum = golden().values(key + "/checksum");
        REQUIRE(sampler.size() == static_cast<std::size_t>(checksum.at(1)));
        CHECK(std::equal(prefix.begin(), prefix.end(), sampler.begin()));
        std::uint64_t sum = 0;
        for (std::size_t p = 0; p < sampler.size(); ++p) {
          sum = (sum + (p + 1) * static_cast<std::uint64_t>(sampler[p])) % 2147483647u;
        }
        CHECK(sum == static_cast<std::uint64_t>(checksum.at(0)));
      }
    }
  }
}

TEST_CASE("the ranks of a training sampler cover every sample; epochs differ; copies share") {
  const std::size_t n = 1001;
  std::multiset<std::int64_t> seen;
  for (int rank = 0; rank < 4; ++rank) {
    DistributedSampler sampler(n, 4, rank, {.seed = 3});
    CHECK(sampler.size() == 251);
    seen.insert(sampler.begin(), sampler.end());
  }
  CHECK(seen.size() == 1004);  // padded by 3 repeats
  for (std::int64_t i = 0; i < static_cast<std::int64_t>(n); ++i) CHECK(seen.count(i) >= 1);

  DistributedSampler a(n, 4, 0, {.seed = 3});
  DistributedSampler copy = a;
  const auto epoch0 = collect(a);
  a.set_epoch(1);
  CHECK(collect(a) != epoch0);
  CHECK(collect(copy) == epoch0);  // a copy keeps its epoch's permutation
  a.set_epoch(0);
  CHECK(collect(a) == epoch0);

  DistributedSampler ordered(10, 3, 1, {.shuffle = false});
  CHECK(collect(ordered) == std::vector<std::int64_t>{1, 4, 7, 0});
  CHECK(ordered.begin()[2] == 7);
  CHECK(std::ranges::distance(ordered) == 4);
}

TEST_CASE("evaluation mode: every sample exactly once, rank sizes within one") {
  for (std::size_t n : {1u, 2u, 5u, 8u, 10u, 37u, 10000u}) {
    for (int replicas = 1; replicas <= 8; ++replicas) {
      CAPTURE(n);
      CAPTURE(replicas);
      std::vector<int> count(n, 0);
      std::size_t smallest = n, largest = 0, total = 0;
      for (int rank = 0; rank < replicas; ++rank) {
        auto sampler = DistributedSampler::evaluation(n, replicas, rank);
        CHECK(sampler.is_evaluation());
        CHECK(sampler.total_size() == n);
        for (auto i : sampler) ++count[static_cast<std::size_t>(i)];
        CHECK(std::is_sorted(sampler.begin(), sampler.end()));
        smallest = std::min(smallest, sampler.size());
        largest = std::max(largest, sampler.size());
        total += sampler.size();
      }
      CHECK(total == n);
      CHECK(largest - smallest <= 1);
      CHECK(std::all_of(count.begin(), count.end(), [](int c) { return c == 1; }));
    }
  }
}

TEST_CASE("samplers from a World and from a communicator take its rank and size") {
  const tandem::World world = tandem::World::single_node(2, 3);
  DistributedSampler from_world(30, world, {.shuffle = false});
  CHECK(from_world.rank() == 2);
  CHECK(from_world.num_replicas() == 3);
  CHECK(from_world[0] == 2);
  tandem::run_local(3, [](tandem::LocalComm& comm) {
    DistributedSampler sampler(30, comm);
    CHECK(sampler.rank() == comm.rank());
    CHECK(sampler.num_replicas() == 3);
    auto eval = DistributedSampler::evaluation(31, comm);
    CHECK(eval.size() == (comm.rank() == 0 ? 11u : 10u));
  });
}

TEST_CASE("bad sampler arguments name the argument and its value") {
  CHECK_THROWS_WITH_AS(DistributedSampler(10, 0, 0), doctest::Contains("num_replicas = 0"),
                       tandem::Error);
  CHECK_THROWS_WITH_AS(DistributedSampler(10, 4, 4), doctest::Contains("rank = 4"), tandem::Error);
  CHECK_THROWS_WITH_AS(DistributedSampler(10, 4, -1), doctest::Contains("rank = -1"),
                       tandem::Error);
  CHECK_THROWS_WITH_AS(DistributedSampler(0, 2, 0), doctest::Contains("empty"), tandem::Error);
  CHECK_THROWS_WITH_AS(DistributedSampler::evaluation(0, 1, 0), doctest::Contains("empty"),
                       tandem::Error);
}

TEST_CASE("the 64-bit permutation above PyTorch's threshold is a permutation") {
  // PyTorch switches to 64-bit draws at n >= UINT32_MAX / 20 (214748364): far too large for a
  // golden list, so check only the property here (the formula follows aten's randperm_cpu).
  // A small n cannot reach that branch; this checks the 32-bit branch's threshold neighbour.
  const auto permutation = tandem::detail::torch_randperm(100000, 5);
  std::vector<std::int64_t> sorted = permutation;
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::int64_t> iota(100000);
  std::iota(iota.begin(), iota.end(), 0);
  CHECK(sorted == iota);
  CHECK(permutation != iota);
}

TEST_CASE("views::batches cuts a sized random-access range into consecutive batches") {
  DistributedSampler sampler(10, 1, 0, {.shuffle = false});
  auto batches = sampler | tandem::views::batches(4);
  static_assert(std::ranges::random_access_range<decltype(batches)>);
  static_assert(std::ranges::sized_range<decltype(batches)>);
  REQUIRE(batches.size() == 3);
  std::vector<std::vector<std::int64_t>> seen;
  for (auto batch : batches) seen.emplace_back(batch.begin(), batch.end());
  CHECK(seen == std::vector<std::vector<std::int64_t>>{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}});
  CHECK(std::ranges::size(batches[2]) == 2);
  CHECK(batches.begin()[1].front() == 4);

  auto full = sampler | tandem::views::batches(4, tandem::views::drop_last);
  CHECK(full.size() == 2);
  CHECK(std::ranges::size(full[1]) == 4);

  // Any sized random-access range, by reference (a later set_epoch shows) or by value.
  std::vector<int> values(7);
  std::iota(values.begin(), values.end(), 100);
  auto by_three = values | tandem::views::batches(3);
  CHECK(by_three.size() == 3);
  values[6] = 7;
  CHECK(by_three[2].front() == 7);
  auto from_iota = std::views::iota(0, 64) | tandem::views::batches(64, tandem::views::drop_last);
  CHECK(from_iota.size() == 1);
  CHECK((std::views::iota(0, 63) | tandem::views::batches(64, tandem::views::drop_last)).empty());

  DistributedSampler shuffled(50, 2, 1, {.seed = 9});
  auto epoch_batches = shuffled | tandem::views::batches(8);
  const std::vector<std::int64_t> epoch0(epoch_batches[0].begin(), epoch_batches[0].end());
  shuffled.set_epoch(1);
  const std::vector<std::int64_t> epoch1(epoch_batches[0].begin(), epoch_batches[0].end());
  CHECK(epoch0 != epoch1);
  CHECK(epoch1 == std::vector<std::int64_t>(shuffled.begin(), shuffled.begin() + 8));

  CHECK_THROWS_WITH_AS(sampler | tandem::views::batches(0), doctest::Contains("batch_size = 0"),
                       tandem::Error);
}

namespace {

// Takes the first `count` indices of `sampler` into `uses` (uses[i]: how often sample i came).
void take(const DistributedSampler& sampler, std::size_t count, std::vector<int>& uses) {
  REQUIRE(count <= sampler.size());
  for (std::size_t k = 0; k < count; ++k) ++uses.at(static_cast<std::size_t>(sampler[k]));
}

// The ranks of one membership, each a sampler.
std::vector<DistributedSampler> membership(std::size_t n, int size, SamplerOptions options) {
  std::vector<DistributedSampler> ranks;
  for (int r = 0; r < size; ++r) ranks.emplace_back(n, size, r, options);
  return ranks;
}

// One epoch whose membership changes after each rank took `done[i]` samples of split i, through
// `sizes` (sizes.size() == done.size() + 1): survivors re-split in one call, ranks that join
// continue from the progress a survivor reports. The last membership takes the rest. Checks
// every rank of each split has the same size and every sample is used once, plus the padding of
// the split that reaches the epoch's end (without drop_last) or less the last split's cut (with
// drop_last). Returns the last split's samplers.
std::vector<DistributedSampler> run_epoch(std::size_t n, SamplerOptions options,
                                          const std::vector<int>& sizes,
                                          const std::vector<std::size_t>& done) {
  std::vector<int> uses(n, 0);
  auto ranks = membership(n, sizes[0], options);
  for (auto& rank : ranks) rank.set_epoch(3);
  for (std::size_t split = 0; split < done.size(); ++split) {
    for (const auto& rank : ranks) take(rank, done[split], uses);
    const int next = sizes[split + 1];
    const auto progress = ranks[0].progress(done[split]);
    std::vector<DistributedSampler> after;
    for (int r = 0; r < next; ++r) {
      if (r < static_cast<int>(ranks.size())) {
        after.push_back(ranks[static_cast<std::size_t>(r)]);
        after.back().resplit(next, r, done[split]);  // the live re-split: one call
      } else {
        after.emplace_back(n, next, r, options);  // a newcomer: told the progress
        after.back().continue_from(progress);
      }
      CHECK(after.back().progress(0) == progress);
      CHECK(after.back().offset() == progress.consumed);
    }
    ranks = std::move(after);
  }
  const std::size_t last = ranks[0].size();
  for (const auto& rank : ranks) {
    CHECK(rank.size() == last);  // every rank steps the same number of times
    take(rank, last, uses);
  }
  const auto width = static_cast<std::size_t>(ranks.size());
  const std::size_t rest = n - ranks[0].offset();
  const std::size_t total = static_cast<std::size_t>(std::accumulate(uses.begin(), uses.end(), 0));
  if (options.drop_last) {
    CHECK(*std::max_element(uses.begin(), uses.end()) <= 1);  // never twice
    CHECK(n - total == rest % width);                         // only the last split's cut
  } else {
    CHECK(*std::min_element(uses.begin(), uses.end()) >= 1);  // every sample
    if (rest > 0) {
      CHECK(total - n == (width - rest % width) % width);  // only the last split's padding
    } else {  // an earlier split took the epoch to its end, padding it (less than one round)
      CHECK(total - n < static_cast<std::size_t>(*std::max_element(sizes.begin(), sizes.end())));
    }
  }
  CHECK(ranks[0].progress(last).consumed == (options.drop_last ? n - rest % width : n));
  return ranks;
}

}  // namespace

TEST_CASE("a re-split mid-epoch uses every sample of the epoch once, at any new world size") {
  int epochs = 0;
  for (std::size_t n : {1u, 7u, 37u, 45u, 60u, 101u}) {
    for (bool shuffle : {false, true}) {
      for (bool drop_last : {false, true}) {
        const SamplerOptions options{.shuffle = shuffle, .seed = 11, .drop_last = drop_last};
        for (const auto& [from, to] :
             std::vector<std::pair<int, int>>{{2, 3}, {3, 2}, {4, 1}, {1, 4}, {2, 2}, {3, 5}}) {
          const std::size_t per_rank = DistributedSampler(n, from, 0, options).size();
          for (std::size_t done = 0; done <= per_rank; done += std::max<std::size_t>(1, n / 9)) {
            CAPTURE(n);
            CAPTURE(shuffle);
            CAPTURE(drop_last);
            CAPTURE(from);
            CAPTURE(to);
            CAPTURE(done);
            run_epoch(n, options, {from, to}, {done});
            ++epochs;
          }
        }
        // Two changes in one epoch: 2 -> 3 -> 2, and 4 -> 3 -> 1.
        if (n >= 37) {
          run_epoch(n, options, {2, 3, 2}, {5, 4});
          run_epoch(n, options, {4, 3, 1}, {3, 2});
          epochs += 2;
        }
      }
    }
  }
  CHECK(epochs > 300);
}

TEST_CASE("a re-split to the same world size yields exactly the rest of each rank's list") {
  for (bool drop_last : {false, true}) {
    for (int size : {1, 2, 3, 4}) {
      for (std::size_t done : {0u, 1u, 5u, 11u}) {
        const SamplerOptions options{.shuffle = true, .seed = 5, .drop_last = drop_last};
        for (int r = 0; r < size; ++r) {
          DistributedSampler whole(45, size, r, options);
          whole.set_epoch(2);
          DistributedSampler resumed = whole;
          resumed.resplit(size, r, done);
          const auto all = collect(whole);
          CHECK(collect(resumed) == std::vector<std::int64_t>(all.begin() + done, all.end()));
        }
      }
    }
  }
  // With offset 0 a sampler is PyTorch's: continue_from the start changes nothing.
  DistributedSampler fresh(45, 3, 1, {.seed = 5});
  DistributedSampler moved = fresh;
  moved.continue_from(fresh.progress(0));
  CHECK(collect(moved) == collect(fresh));
}

TEST_CASE("a re-split's batches, epochs and refusals") {
  DistributedSampler sampler(100, 2, 1, {.seed = 3});
  auto batches = sampler | tandem::views::batches(8);
  CHECK(batches.size() == 7);  // 50 samples
  sampler.resplit(3, 2, 16);   // 2 batches of 8 taken on each of 2 ranks: 32 positions
  CHECK(sampler.offset() == 32);
  CHECK(sampler.size() == 23);  // ceil(68 / 3)
  CHECK(batches.size() == 3);   // the view sees the new split
  CHECK(sampler.progress(23).consumed == 100);
  sampler.set_epoch(0);  // the epoch already set: the split stays
  CHECK(sampler.offset() == 32);
  sampler.set_epoch(1);  // a new epoch starts from its first position, over the new ranks
  CHECK(sampler.offset() == 0);
  DistributedSampler fresh(100, 3, 2, {.seed = 3});
  fresh.set_epoch(1);
  CHECK(collect(sampler) == collect(fresh));

  CHECK_THROWS_WITH_AS((void)sampler.progress(35), doctest::Contains("35 samples done"),
                       tandem::Error);
  CHECK_THROWS_WITH_AS(sampler.resplit(0, 0, 0), doctest::Contains("num_replicas = 0"),
                       tandem::Error);
  CHECK_THROWS_WITH_AS(sampler.resplit(2, 2, 0), doctest::Contains("rank = 2"), tandem::Error);
  CHECK(sampler.num_replicas() == 3);  // a refused re-split changes nothing
  CHECK_THROWS_WITH_AS(sampler.continue_from({1, 101}), doctest::Contains("101 positions"),
                       tandem::Error);
  auto evaluation = DistributedSampler::evaluation(10, 2, 0);
  CHECK_THROWS_WITH_AS(evaluation.resplit(3, 0, 0), doctest::Contains("evaluation"), tandem::Error);

  // Through a communicator: the new membership's rank and size.
  tandem::run_local(3, [](tandem::LocalComm& comm) {
    DistributedSampler mine(30, 2, comm.rank() % 2, {.shuffle = false});
    mine.resplit(comm, 4);
    CHECK(mine.rank() == comm.rank());
    CHECK(mine.num_replicas() == 3);
    CHECK(mine[0] == 8 + comm.rank());
  });
}
