// bench/loader: Fashion-MNIST through tandem's Loader (batch 64, DistributedSampler, 2 workers),
// in samples per second, and the gather's own bandwidth beside memcpy's on this machine.
// run_loader.sh runs it beside PyTorch's DataLoader (loader_torch.py) and writes the table.
//   bench_loader [--epochs N] [--workers N] [--batch B] [--data DIR]
// Every epoch is checked: all 60000 samples delivered once, each label the one of its index,
// and sampled pixels equal to the data set's own normalisation; otherwise it exits 1.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tandem/data/batches.hpp"
#include "tandem/data/loader.hpp"
#include "tandem/data/mnist.hpp"
#include "tandem/data/sampler.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "bench_loader: FAILED: %s\n", what.c_str());
  std::exit(1);
}

// Best of five: bytes read plus bytes written per second.
double memcpy_bandwidth(std::size_t bytes) {
  std::vector<char> from(bytes, 1), to(bytes, 0);
  double best = 0;
  for (int run = 0; run < 5; ++run) {
    from[static_cast<std::size_t>(run)] = static_cast<char>(run + 2);
    const auto start = clock_type::now();
    std::memcpy(to.data(), from.data(), bytes);
    best = std::max(best, 2.0 * static_cast<double>(bytes) / seconds_since(start));
    if (to[static_cast<std::size_t>(run)] != from[static_cast<std::size_t>(run)]) fail("memcpy");
  }
  return best;
}

struct EpochCheck {
  std::size_t samples = 0;
  std::int64_t weighted_labels = 0;  // sum of index * label, exact
};

template <class L>
EpochCheck run_epoch(L& loader, const tandem::FashionMNIST& data) {
  EpochCheck check;
  for (const auto& batch : loader) {
    auto [images, labels] = batch.views();
    for (std::size_t j = 0; j < batch.size(); ++j) {
      check.weighted_labels += batch.indices()[j] * labels.data()[j];
    }
    // One pixel per batch against the data set's own table.
    const auto index = static_cast<std::size_t>(batch.indices()[0]);
    const std::uint8_t pixel = data.pixels()[index * 784 + 300];
    const float expected = (static_cast<float>(pixel) / 255.0f - data.mean()) / data.std();
    if (images.data()[300] != expected) fail("a delivered pixel differs from the data set's");
    check.samples += batch.size();
  }
  return check;
}

}  // namespace

int main(int argc, char** argv) {
  int epochs = 3;
  int workers = 2;
  std::size_t batch_size = 64;
  std::string directory = tandem::FashionMNIST::default_directory().string();
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--epochs")
      epochs = std::atoi(argv[i + 1]);
    else if (flag == "--workers")
      workers = std::atoi(argv[i + 1]);
    else if (flag == "--batch")
      batch_size = static_cast<std::size_t>(std::atoi(argv[i + 1]));
    else if (flag == "--data")
      directory = argv[i + 1];
    else
      fail("unknown flag " + flag);
  }
  const tandem::FashionMNIST data(tandem::split::train, directory);
  std::int64_t expected_weighted = 0;
  for (std::size_t i = 0; i < data.size(); ++i) {
    expected_weighted += static_cast<std::int64_t>(i) * data.labels()[i];
  }
  tandem::DistributedSampler sampler(data.size(), 1, 0, {.seed = 0});

  // The gather alone: no workers, one thread doing nothing else.
  {
    tandem::Loader loader(data, sampler | tandem::views::batches(batch_size), {.workers = 0});
    double best = 1e30;
    for (int run = 0; run < 3; ++run) {
      const auto start = clock_type::now();
      const EpochCheck check = run_epoch(loader, data);
      best = std::min(best, seconds_since(start));
      if (check.samples != data.size() || check.weighted_labels != expected_weighted) {
        fail("gather epoch incomplete");
      }
    }
    // Per sample: 784 pixel bytes and a label byte read; 784 floats and an int64 written.
    const double bytes = static_cast<double>(data.size()) * (784 + 1 + 784 * 4 + 8);
    const double memcpy_bps = memcpy_bandwidth(64u << 20);
    std::printf("RESULT gather_gbps %.3f\n", bytes / best / 1e9);
    std::printf("RESULT memcpy_gbps %.3f\n", memcpy_bps / 1e9);
    std::printf("RESULT gather_of_memcpy %.3f\n", bytes / best / memcpy_bps);
  }

  tandem::Loader loader(data, sampler | tandem::views::batches(batch_size), {.workers = workers});
  const auto start = clock_type::now();
  std::size_t samples = 0;
  for (int epoch = 0; epoch < epochs; ++epoch) {
    sampler.set_epoch(static_cast<std::uint64_t>(epoch));
    const EpochCheck check = run_epoch(loader, data);
    if (check.samples != data.size()) fail("an epoch delivered " + std::to_string(check.samples));
    if (check.weighted_labels != expected_weighted) fail("labels do not match their indices");
    samples += check.samples;
  }
  const double elapsed = seconds_since(start);
  std::printf("RESULT tandem_samples_per_s %.0f\n", static_cast<double>(samples) / elapsed);
  std::printf("RESULT tandem_epoch_s %.4f\n", elapsed / epochs);
  std::printf("RESULT tandem_workers %d\n", workers);
  return 0;
}
