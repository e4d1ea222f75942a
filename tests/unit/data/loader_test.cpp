// tandem::Loader on the host: the same batches in the same order for any number of workers and
// any prefetch depth, epochs that follow the sampler, early stops, and a data set that throws.
#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <thread>
#include <vector>

#include "tandem/data/batches.hpp"
#include "tandem/data/loader.hpp"
#include "tandem/data/sampler.hpp"

namespace {

// Sample i: x = {i, i + 0.5, -i}, y = i * i. Reads may be slowed, or fail at one index.
struct Squares {
  using fields = tandem::sample_fields<float, std::int64_t>;
  std::size_t n = 100;
  std::int64_t fail_at = -1;
  bool jitter = false;
  mutable std::atomic<int> reads{0};

  std::size_t size() const { return n; }
  std::array<std::size_t, 2> field_numel() const { return {3, 1}; }
  void read(std::size_t i, std::span<float> x, std::span<std::int64_t> y) const {
    ++reads;
    if (static_cast<std::int64_t>(i) == fail_at)
      throw std::domain_error("sample " + std::to_string(i));
    if (jitter && i % 7 == 0) std::this_thread::sleep_for(std::chrono::microseconds(300));
    x[0] = static_cast<float>(i);
    x[1] = static_cast<float>(i) + 0.5f;
    x[2] = -static_cast<float>(i);
    y[0] = static_cast<std::int64_t>(i * i);
  }
};

struct NotADataset {
  using fields = tandem::sample_fields<float>;
  std::size_t size() const { return 1; }
  std::array<std::size_t, 1> field_numel() const { return {1}; }
  void read(std::size_t, std::span<double>) const {}  // the wrong element type
};

static_assert(tandem::Dataset<Squares>);
static_assert(!tandem::Dataset<NotADataset>);
static_assert(!tandem::Dataset<int>);
static_assert(std::same_as<tandem::field_type<Squares, 1>, std::int64_t>);

struct Seen {
  std::vector<std::int64_t> indices;
  std::vector<float> x;
  std::vector<std::int64_t> y;
  std::vector<std::size_t> sizes;
  bool operator==(const Seen&) const = default;
};

template <class L>
Seen drain(L& loader) {
  Seen seen;
  std::size_t expected_index = 0;
  for (const auto& batch : loader) {
    CHECK(batch.index() == expected_index++);
    auto [x, y] = batch.views();
    CHECK(x.shape()[0] == static_cast<std::int64_t>(batch.size()));
    CHECK(x.shape()[1] == 3);
    CHECK(y.size() == batch.size());
    seen.sizes.push_back(batch.size());
    seen.indices.insert(seen.indices.end(), batch.indices().begin(), batch.indices().end());
    seen.x.insert(seen.x.end(), x.data(), x.data() + x.size());
    seen.y.insert(seen.y.end(), y.data(), y.data() + y.size());
  }
  return seen;
}

}  // namespace

TEST_CASE("batches arrive complete and in order for 0, 1, 2 and 4 workers") {
  Squares data;
  data.n = 203;
  data.jitter = true;
  tandem::DistributedSampler sampler(data.size(), 2, 1, {.seed = 11});
  Seen reference;
  for (int workers : {0, 1, 2, 4}) {
    for (int prefetch : {0, 1, 3}) {
      CAPTURE(workers);
      CAPTURE(prefetch);
      tandem::Loader loader(data, sampler | tandem::views::batches(16),
                            {.workers = workers, .prefetch = prefetch});
      CHECK(loader.size() == 7);
      const Seen seen = drain(loader);
      CHECK(seen.indices == std::vector<std::int64_t>(sampler.begin(), sampler.end()));
      for (std::size_t k = 0; k < seen.indices.size(); ++k) {
        const auto i = seen.indices[k];
        CHECK(seen.x[3 * k] == static_cast<float>(i));
        CHECK(seen.x[3 * k + 2] == -static_cast<float>(i));
        CHECK(seen.y[k] == i * i);
      }
      if (workers == 0 && prefetch == 0) reference = seen;
      CHECK(seen == reference);
    }
  }
  CHECK(reference.sizes == std::vector<std::size_t>{16, 16, 16, 16, 16, 16, 6});
}

TEST_CASE("each pass over the Loader is an epoch, following the sampler's set_epoch") {
  Squares data;
  tandem::DistributedSampler sampler(data.size(), 1, 0, {.seed = 5});
  tandem::Loader loader(data, sampler | tandem::views::batches(10, tandem::views::drop_last),
                        {.workers = 2});
  const Seen first = drain(loader);
  const Seen again = drain(loader);
  CHECK(first == again);
  sampler.set_epoch(1);
  const Seen second = drain(loader);
  CHECK(second.indices != first.indices);
  CHECK(second.indices == std::vector<std::int64_t>(sampler.begin(), sampler.end()));
}

TEST_CASE("leaving the loop early, starting over, and destroying a busy Loader end cleanly") {
  Squares data;
  data.n = 1000;
  tandem::DistributedSampler sampler(data.size(), 1, 0, {.shuffle = false});
  {
    tandem::Loader loader(data, sampler | tandem::views::batches(8), {.workers = 3, .prefetch = 5});
    int taken = 0;
    for (const auto& batch : loader) {
      CHECK(batch.indices()[0] == 8 * taken);
      if (++taken == 3) break;
    }
    // The workers are now blocked on a full ring; a new pass starts from the beginning.
    taken = 0;
    for (const auto& batch : loader) {
      CHECK(batch.indices()[0] == 8 * taken);
      if (++taken == 2) break;
    }
    CHECK(taken == 2);
  }  // destroyed with its workers waiting for the consumer
  {
    tandem::Loader loader(data, sampler | tandem::views::batches(8), {.workers = 2});
    auto it = loader.begin();
    CHECK(it->indices()[0] == 0);
  }
  // Gathering stops at the prefetch depth while nobody consumes.
  data.reads = 0;
  tandem::Loader idle(data, sampler | tandem::views::batches(10), {.workers = 2, .prefetch = 2});
  auto it = idle.begin();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(data.reads.load() <= 2 * 10);
  CHECK(it->size() == 10);
}

TEST_CASE("a data set's exception reaches the consumer at the batch where it happened") {
  Squares data;
  data.fail_at = 37;  // in batch 3 of 10-sample batches, unshuffled
  tandem::DistributedSampler sampler(data.size(), 1, 0, {.shuffle = false});
  for (int workers : {0, 1, 3}) {
    CAPTURE(workers);
    tandem::Loader loader(data, sampler | tandem::views::batches(10), {.workers = workers});
    std::size_t delivered = 0;
    bool caught = false;
    try {
      for (const auto& batch : loader) {
        CHECK(batch.index() == delivered);
        ++delivered;
      }
    } catch (const std::domain_error& error) {
      caught = true;
      CHECK(std::string(error.what()) == "sample 37");
    }
    CHECK(caught);
    CHECK(delivered == 3);
  }
}

TEST_CASE("an index outside the data set is an error naming the batch and the index") {
  Squares data;
  data.n = 10;
  std::vector<std::int64_t> indices{0, 1, 2, 3, 10, 4};
  tandem::Loader loader(data, indices | tandem::views::batches(4), {.workers = 1});
  auto it = loader.begin();
  CHECK(it->size() == 4);
  ++it;
  CHECK_THROWS_WITH_AS(*it, doctest::Contains("batch 1 asks for sample 10"), tandem::Error);
  CHECK_THROWS_WITH_AS(tandem::Loader(data, indices | tandem::views::batches(4), {.workers = -1}),
                       doctest::Contains("workers = -1"), tandem::Error);
}

TEST_CASE("resume_at starts the next epoch at a batch, once") {
  Squares data;
  tandem::DistributedSampler sampler(data.size(), 1, 0, {.seed = 2});
  for (int workers : {0, 2}) {
    tandem::Loader loader(data, sampler | tandem::views::batches(10), {.workers = workers});
    const Seen whole = drain(loader);
    loader.resume_at(7);
    std::vector<std::size_t> indices;
    std::vector<std::int64_t> samples;
    for (const auto& batch : loader) {
      indices.push_back(batch.index());
      samples.insert(samples.end(), batch.indices().begin(), batch.indices().end());
    }
    CHECK(indices == std::vector<std::size_t>{7, 8, 9});
    CHECK(samples == std::vector<std::int64_t>(whole.indices.begin() + 70, whole.indices.end()));
    CHECK(drain(loader) == whole);  // the epoch after starts at 0 again
    loader.resume_at(11);
    CHECK_THROWS_WITH_AS(loader.begin(), doctest::Contains("batch 11 of an epoch of 10"),
                         tandem::Error);
  }
}
