// The Loader's staged path without a GPU: batches gathered into pinned memory and delivered in a
// memory space host code may not touch (support/fake_device.hpp), through a delivery that checks
// the protocol cuda_delivery relies on: no upload into a slot the consumer still holds, no
// hand-over before the slot's upload, every batch uploaded once per field.
#include "support/fake_device_space.hpp"

#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <span>
#include <vector>

#include "tandem/data/batches.hpp"
#include "tandem/data/loader.hpp"
#include "tandem/data/sampler.hpp"

namespace {

using tandem::test::fake_device;

struct Ramp {
  using fields = tandem::sample_fields<float, std::int64_t>;
  std::size_t size() const { return 150; }
  std::array<std::size_t, 2> field_numel() const { return {4, 1}; }
  void read(std::size_t i, std::span<float> x, std::span<std::int64_t> y) const {
    for (std::size_t k = 0; k < 4; ++k) x[k] = static_cast<float>(10 * i + k);
    y[0] = static_cast<std::int64_t>(i);
  }
};

struct Protocol {
  std::atomic<int> uploads{0};
  std::atomic<int> batches_uploaded{0};
  std::atomic<int> hand_overs{0};
  std::atomic<int> releases{0};
  std::atomic<int> violations{0};
  std::atomic<int> syncs{0};
};

// The slot's flags are written by a worker and by the consumer; the Loader's own ordering
// (ready under its mutex, release before a worker may claim the slot again) must make that
// race-free, which TSan checks.
struct CheckingDelivery {
  using staging_space = tandem::pinned;
  using memory_space = fake_device;
  struct slot {
    bool held_by_consumer = false;
    bool upload_pending = false;
  };
  Protocol* protocol;

  slot make_slot() { return {}; }
  void before_gather(slot& s) {
    if (s.held_by_consumer) ++protocol->violations;
  }
  void upload(slot& s, void* to, const void* from, std::size_t bytes) {
    if (s.held_by_consumer) ++protocol->violations;
    tandem::space_copy<fake_device, tandem::pinned>::copy(to, from, bytes);
    ++protocol->uploads;
  }
  void uploaded(slot& s) {
    s.upload_pending = true;
    ++protocol->batches_uploaded;
  }
  void hand_over(slot& s) {
    if (!s.upload_pending || s.held_by_consumer) ++protocol->violations;
    s.upload_pending = false;
    s.held_by_consumer = true;
    ++protocol->hand_overs;
  }
  void release(slot& s) {
    if (!s.held_by_consumer) ++protocol->violations;
    s.held_by_consumer = false;
    ++protocol->releases;
  }
  void synchronize() { ++protocol->syncs; }
};
static_assert(tandem::BatchDelivery<CheckingDelivery>);

}  // namespace

TEST_CASE("batches reach device memory through pinned staging, in order, for any worker count") {
  Ramp data;
  tandem::DistributedSampler sampler(data.size(), 3, 2, {.seed = 1});
  for (int workers : {0, 1, 2, 4}) {
    CAPTURE(workers);
    Protocol protocol;
    const int pinned_before = tandem::test::staging_counters.pinned_live.load();
    {
      tandem::Loader loader(data, sampler | tandem::views::batches(7), {.workers = workers},
                            CheckingDelivery{&protocol});
      using batch_type = typename decltype(loader)::batch_type;
      static_assert(std::same_as<typename batch_type::memory_space, fake_device>);
      std::vector<std::int64_t> labels;
      for (const auto& batch : loader) {
        auto [x, y] = batch.views();
        static_assert(std::same_as<decltype(x), tandem::View<float, fake_device>>);
        std::vector<float> host_x(x.size());
        std::vector<std::int64_t> host_y(y.size());
        tandem::space_copy<tandem::host, fake_device>::copy(host_x.data(), x.data(),
                                                            x.size() * sizeof(float));
        tandem::space_copy<tandem::host, fake_device>::copy(host_y.data(), y.data(),
                                                            y.size() * sizeof(std::int64_t));
        for (std::size_t j = 0; j < batch.size(); ++j) {
          CHECK(host_y[j] == batch.indices()[j]);
          CHECK(host_x[4 * j + 3] == static_cast<float>(10 * host_y[j] + 3));
        }
        labels.insert(labels.end(), host_y.begin(), host_y.end());
      }
      CHECK(labels == std::vector<std::int64_t>(sampler.begin(), sampler.end()));
      const int batches = static_cast<int>(loader.size());
      CHECK(protocol.batches_uploaded.load() == batches);
      CHECK(protocol.uploads.load() == 2 * batches);
      CHECK(protocol.hand_overs.load() == batches);
      CHECK(protocol.releases.load() == batches);
      CHECK(tandem::test::staging_counters.pinned_live.load() > pinned_before);
    }
    CHECK(protocol.violations.load() == 0);
    CHECK(protocol.syncs.load() >= 1);  // the destructor waited for the uploads
    CHECK(tandem::test::staging_counters.pinned_live.load() == pinned_before);
  }
}

TEST_CASE("an early stop releases the batch the consumer held") {
  Ramp data;
  tandem::DistributedSampler sampler(data.size(), 1, 0);
  Protocol protocol;
  {
    tandem::Loader loader(data, sampler | tandem::views::batches(10), {.workers = 2},
                          CheckingDelivery{&protocol});
    for (const auto& batch : loader) {
      if (batch.index() == 4) break;
    }
    for (const auto& batch : loader) {
      if (batch.index() == 1) break;
    }
  }
  CHECK(protocol.violations.load() == 0);
  CHECK(protocol.hand_overs.load() == protocol.releases.load());
  CHECK(protocol.hand_overs.load() == 5 + 2);
}
