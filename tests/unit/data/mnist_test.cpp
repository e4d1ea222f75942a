// Fashion-MNIST from Debian's dataset-fashion-mnist (or $FASHION_MNIST_DIR): counts, shapes,
// first labels, torchvision's normalisation, and a Loader over it. Skipped (exit 77) without the
// files.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "tandem/data/batches.hpp"
#include "tandem/data/loader.hpp"
#include "tandem/data/mnist.hpp"
#include "tandem/data/sampler.hpp"

TEST_CASE("Fashion-MNIST: 60000 + 10000 images of 28 x 28, labels as PyTorch reads them") {
  const tandem::FashionMNIST train(tandem::split::train);
  const tandem::FashionMNIST test(tandem::split::test);
  CHECK(train.size() == 60000);
  CHECK(test.size() == 10000);
  CHECK(train.rows() == 28);
  CHECK(train.columns() == 28);
  CHECK(train.field_numel() == std::array<std::size_t, 2>{784, 1});
  const std::vector<int> first_train{9, 0, 0, 3, 0, 2, 7, 2, 5, 5};
  const std::vector<int> first_test{9, 2, 1, 1, 6, 1, 4, 6, 5, 7};
  for (std::size_t i = 0; i < 10; ++i) {
    CHECK(train.labels()[i] == first_train[i]);
    CHECK(test.labels()[i] == first_test[i]);
  }
  std::vector<int> per_class(10, 0);
  for (auto label : train.labels()) ++per_class.at(label);
  CHECK(per_class == std::vector<int>(10, 6000));

  // Normalised with the training set's own statistics: mean 0 and deviation 1 over it.
  std::vector<float> image(784);
  std::int64_t label = -1;
  double sum = 0, squares = 0;
  for (std::size_t i = 0; i < train.size(); ++i) {
    train.read(i, image, std::span<std::int64_t>(&label, 1));
    for (float v : image) {
      sum += v;
      squares += double(v) * v;
    }
  }
  const double count = 60000.0 * 784.0;
  const double mean = sum / count;
  CHECK(std::abs(mean) < 1e-5);
  CHECK(std::abs(std::sqrt(squares / count - mean * mean) - 1.0) < 1e-5);
  // torchvision: (pixel / 255 - mean) / std in float, bit for bit, for every pixel value seen.
  std::vector<bool> value_seen(256, false);
  for (std::size_t i = 0; i < 200; ++i) {
    train.read(i, image, std::span<std::int64_t>(&label, 1));
    CHECK(label == train.labels()[i]);
    for (std::size_t p = 0; p < 784; ++p) {
      const std::uint8_t pixel = train.pixels()[i * 784 + p];
      value_seen[pixel] = true;
      REQUIRE(image[p] == (static_cast<float>(pixel) / 255.0f - 0.2860406f) / 0.3530242f);
    }
  }
  CHECK(std::count(value_seen.begin(), value_seen.end(), true) == 256);
  CHECK_THROWS_AS(train.read(60000, image, std::span<std::int64_t>(&label, 1)), tandem::Error);
}

TEST_CASE("a Loader over Fashion-MNIST with two ranks' samplers covers the training set") {
  const tandem::FashionMNIST train(tandem::split::train);
  std::vector<int> seen(train.size(), 0);
  for (int rank = 0; rank < 2; ++rank) {
    tandem::DistributedSampler sampler(train.size(), 2, rank, {.seed = 0});
    tandem::Loader loader(train, sampler | tandem::views::batches(64), {.workers = 2});
    std::size_t batches = 0;
    for (const auto& batch : loader) {
      auto [images, labels] = batch.views();
      for (std::size_t j = 0; j < batch.size(); ++j) {
        const auto index = static_cast<std::size_t>(batch.indices()[j]);
        ++seen[index];
        CHECK(labels.data()[j] == train.labels()[index]);
      }
      CHECK(images.shape()[1] == 784);
      ++batches;
    }
    CHECK(batches == 469);  // ceil(30000 / 64)
  }
  for (int c : seen) REQUIRE(c == 1);
}

TEST_CASE("a missing directory is an Error naming the files looked for") {
  CHECK_THROWS_WITH_AS(tandem::FashionMNIST(tandem::split::train, "/nonexistent/fmnist"),
                       doctest::Contains("/nonexistent/fmnist/train-images-idx3-ubyte.gz"),
                       tandem::Error);
}

int main(int argc, char** argv) {
  const auto dir = tandem::FashionMNIST::default_directory();
  if (!std::filesystem::exists(dir / "train-images-idx3-ubyte.gz") &&
      !std::filesystem::exists(dir / "train-images-idx3-ubyte")) {
    std::printf(
        "skipped: no Fashion-MNIST files in %s (apt-get install dataset-fashion-mnist, "
        "or set FASHION_MNIST_DIR)\n",
        dir.c_str());
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
