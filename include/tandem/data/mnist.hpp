// tandem/data/mnist.hpp - Fashion-MNIST and MNIST as tandem Datasets: 28x28 images as 784
// floats normalised the way torchvision's ToTensor + Normalize(mean, std) does, labels as int64.
//   tandem::FashionMNIST train(tandem::split::train);   // Debian's dataset-fashion-mnist files
//   tandem::FashionMNIST test(tandem::split::test, "/data/fashion-mnist");
// Needs: zlib (the tandem::data CMake component), for the .gz files.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/data/dataset.hpp"
#include "tandem/data/idx.hpp"
#include "tandem/tensor/host_cpu.hpp"

namespace tandem {

namespace detail {

#if defined(TANDEM_X86_DISPATCH)
// torchvision's arithmetic, eight pixels at a time: (float(p) / 255 - mean) / std, each operation
// rounded in float exactly as the scalar table computes it (no reciprocal, no fused operation).
[[gnu::target("avx2")]] inline void normalize_pixels_avx2(const std::uint8_t* in, float* out,
                                                          std::size_t n, float mean, float std) {
  const __m256 scale = _mm256_set1_ps(255.0f);
  const __m256 shift = _mm256_set1_ps(mean);
  const __m256 spread = _mm256_set1_ps(std);
  std::size_t p = 0;
  for (; p + 8 <= n; p += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + p));
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    _mm256_storeu_ps(out + p, _mm256_div_ps(_mm256_sub_ps(_mm256_div_ps(v, scale), shift), spread));
  }
  for (; p < n; ++p) out[p] = (static_cast<float>(in[p]) / 255.0f - mean) / std;
}

#endif

}  // namespace detail

/// Which half of an MNIST-family data set: the training set or the test set (t10k).
enum class split { train, test };

/// What a data set of IDX images must hold to fit the model it feeds (0: any): the image size and
/// the number of classes (every label below it). A file that does not fit is an Error naming it,
/// never an index out of a model's range.
struct IdxImageShape {
  std::size_t rows = 0;     ///< image height in pixels
  std::size_t columns = 0;  ///< image width in pixels
  std::size_t classes = 0;  ///< labels are 0 .. classes - 1
};

/// Images and labels of an MNIST-family data set, read from its four IDX files. Sample i is the
/// image as rows*cols floats, (pixel / 255 - mean) / std exactly as torchvision computes it in
/// float, and its label as one std::int64_t. The pixels stay bytes in memory (47 MB for 60000
/// images) and are normalised as a batch is gathered: eight at a time with AVX2 where the CPU
/// has it, else through a 256-entry table; both give torchvision's floats bit for bit.
class IdxImageDataset {
 public:
  /// A sample: the normalised image (float) and its label (std::int64_t).
  using fields = sample_fields<float, std::int64_t>;

  /// The two IDX files (plain or .gz), the normalisation's mean and standard deviation, and the
  /// image size and class count the files must have (`expected`; 0: any).
  IdxImageDataset(const std::filesystem::path& images, const std::filesystem::path& labels,
                  float mean, float std, IdxImageShape expected = {})
      : IdxImageDataset(read_idx(images), read_idx(labels), images.string(), labels.string(), mean,
                        std, expected) {}

  /// The same from IDX arrays already read; `images_name` and `labels_name` name them in errors.
  IdxImageDataset(const IdxArray& image_array, const IdxArray& label_array,
                  const std::string& images_name, const std::string& labels_name, float mean,
                  float std, IdxImageShape expected = {})
      : classes_(expected.classes), mean_(mean), std_(std) {
    const std::string where = images_name + " and " + labels_name;
    if (image_array.type() != idx_type::u8 || image_array.shape().size() != 3) {
      throw Error("IdxImageDataset " + images_name,
                  "expected unsigned bytes in 3 dimensions (count, rows, columns)");
    }
    if (label_array.type() != idx_type::u8 || label_array.shape().size() != 1) {
      throw Error("IdxImageDataset " + labels_name, "expected unsigned bytes in 1 dimension");
    }
    if (image_array.shape()[0] != label_array.shape()[0]) {
      throw Error("IdxImageDataset " + where,
                  std::to_string(image_array.shape()[0]) + " images but " +
                      std::to_string(label_array.shape()[0]) + " labels");
    }
    if (image_array.shape()[0] == 0) throw Error("IdxImageDataset " + where, "no samples");
    if (!(std > 0.0f) || !std::isfinite(std) || !std::isfinite(mean)) {
      throw Error("IdxImageDataset " + where, "mean must be finite and std finite and positive");
    }
    rows_ = image_array.shape()[1];
    columns_ = image_array.shape()[2];
    if ((expected.rows != 0 && rows_ != expected.rows) ||
        (expected.columns != 0 && columns_ != expected.columns)) {
      throw Error("IdxImageDataset " + images_name,
                  "the images are " + std::to_string(rows_) + " x " + std::to_string(columns_) +
                      " pixels; this data set's are " + std::to_string(expected.rows) + " x " +
                      std::to_string(expected.columns));
    }
    if (rows_ == 0 || columns_ == 0) {
      throw Error("IdxImageDataset " + images_name, "the images have no pixels");
    }
    const auto label_values = label_array.values<std::uint8_t>();
    if (classes_ != 0) {
      for (std::size_t i = 0; i < label_values.size(); ++i) {
        if (label_values[i] >= classes_) {
          throw Error("IdxImageDataset " + labels_name,
                      "sample " + std::to_string(i) + " has the label " +
                          std::to_string(label_values[i]) + ", outside the " +
                          std::to_string(classes_) + " classes (0 to " +
                          std::to_string(classes_ - 1) + ")");
        }
      }
    }
    const auto pixels = image_array.values<std::uint8_t>();
    pixels_.assign(pixels.begin(), pixels.end());
    labels_.assign(label_values.begin(), label_values.end());
    for (unsigned v = 0; v < 256; ++v) {
      // torchvision: ToTensor divides by 255 in float, Normalize subtracts and divides in float.
      table_[v] = (static_cast<float>(v) / 255.0f - mean) / std;
    }
  }

  /// The number of samples (images).
  [[nodiscard]] std::size_t size() const noexcept { return labels_.size(); }
  /// Elements per sample: rows() * columns() floats of image, one label.
  [[nodiscard]] std::array<std::size_t, 2> field_numel() const noexcept {
    return {rows_ * columns_, 1};
  }
  /// Image height in pixels (28 for the MNIST family).
  [[nodiscard]] std::size_t rows() const noexcept { return rows_; }
  /// Image width in pixels (28 for the MNIST family).
  [[nodiscard]] std::size_t columns() const noexcept { return columns_; }
  /// The class count every label is below (10 for the MNIST family); 0 when not checked.
  [[nodiscard]] std::size_t classes() const noexcept { return classes_; }
  /// The mean subtracted from every pixel / 255.
  [[nodiscard]] float mean() const noexcept { return mean_; }
  /// The standard deviation the centred pixels are divided by.
  [[nodiscard]] float std() const noexcept { return std_; }
  /// The raw pixels, sample after sample.
  [[nodiscard]] std::span<const std::uint8_t> pixels() const noexcept { return pixels_; }
  /// The raw labels, one byte per sample.
  [[nodiscard]] std::span<const std::uint8_t> labels() const noexcept { return labels_; }

  /// A hint that sample `index` is read next: its pixels are fetched into the cache, so that a
  /// shuffled epoch does not wait on memory for every row.
  void prefetch(std::size_t index) const noexcept {
    if (index >= size()) return;
    const std::size_t pixels = rows_ * columns_;
    const auto* row = reinterpret_cast<const char*>(pixels_.data() + index * pixels);
    for (std::size_t offset = 0; offset < pixels; offset += 64) __builtin_prefetch(row + offset);
  }

  /// Sample `index` (< size()): its normalised image and its label.
  void read(std::size_t index, std::span<float> image, std::span<std::int64_t> label) const {
    const std::size_t pixels = rows_ * columns_;
    if (index >= size() || image.size() != pixels || label.size() != 1) {
      throw Error("IdxImageDataset::read", "sample " + std::to_string(index) + " of " +
                                               std::to_string(size()) + " into spans of " +
                                               std::to_string(image.size()) + " and " +
                                               std::to_string(label.size()) + " elements (want " +
                                               std::to_string(pixels) + " and 1)");
    }
    const std::uint8_t* source = pixels_.data() + index * pixels;
    float* out = image.data();
#if defined(TANDEM_X86_DISPATCH)
    if (cpu_has(cpu_feature::avx2)) {
      detail::normalize_pixels_avx2(source, out, pixels, mean_, std_);
      label[0] = labels_[index];
      return;
    }
#endif
    for (std::size_t p = 0; p < pixels; ++p) out[p] = table_[source[p]];
    label[0] = labels_[index];
  }

 private:
  std::vector<std::uint8_t> pixels_;
  std::vector<std::uint8_t> labels_;
  std::size_t rows_ = 0;
  std::size_t columns_ = 0;
  std::size_t classes_ = 0;
  float mean_ = 0.0f;
  float std_ = 1.0f;
  std::array<float, 256> table_{};
};

namespace detail {
/// `stem` in `directory`, gzip-compressed or not (the .gz file first).
inline std::filesystem::path idx_file(const std::filesystem::path& directory, const char* stem) {
  const auto gz = directory / (std::string(stem) + ".gz");
  const auto plain = directory / stem;
  const std::string looked_for = gz.string() + " nor " + plain.string();
  std::error_code error;
  const bool is_directory = std::filesystem::is_directory(directory, error);
  if (error && error != std::errc::no_such_file_or_directory) {
    throw Error("mnist " + directory.string(),
                "cannot look into the directory (" + error.message() + ") for " + looked_for);
  }
  if (!is_directory) {
    throw Error("mnist " + directory.string(),
                (std::filesystem::exists(directory, error) ? "not a directory, so neither "
                                                           : "no such directory, so neither ") +
                    looked_for + " exists");
  }
  for (const auto& candidate : {gz, plain}) {
    if (std::filesystem::exists(candidate, error)) return candidate;
    if (error && error != std::errc::no_such_file_or_directory) {
      throw Error("mnist " + directory.string(),
                  "cannot look for " + candidate.string() + ": " + error.message());
    }
  }
  throw Error("mnist " + directory.string(), "neither " + looked_for + " exists");
}

/// The 28 x 28 images of 10 classes every MNIST-family data set holds.
inline constexpr IdxImageShape mnist_shape{28, 28, 10};

inline IdxImageDataset mnist_family(const std::filesystem::path& directory, split which, float mean,
                                    float std) {
  const bool train = which == split::train;
  // Images first, so a missing directory is reported by its first file.
  const auto images =
      idx_file(directory, train ? "train-images-idx3-ubyte" : "t10k-images-idx3-ubyte");
  const auto labels =
      idx_file(directory, train ? "train-labels-idx1-ubyte" : "t10k-labels-idx1-ubyte");
  return IdxImageDataset(images, labels, mean, std, mnist_shape);
}
}  // namespace detail

/// Fashion-MNIST (Zalando): 60000 training and 10000 test images of 10 kinds of clothing.
/// Normalised with the training set's pixel mean 0.2860406 and standard deviation 0.3530242
/// (over all 47,040,000 training pixels / 255), for both splits, as torchvision users do.
class FashionMNIST : public IdxImageDataset {
 public:
  static constexpr float mean_value = 0.2860406f;  ///< the training pixels' mean (of pixel / 255)
  static constexpr float std_value = 0.3530242f;   ///< their standard deviation

  /// Where the files are looked for: $FASHION_MNIST_DIR, else Debian's dataset-fashion-mnist.
  static std::filesystem::path default_directory() {
    if (const char* dir = std::getenv("FASHION_MNIST_DIR"); dir && *dir) return dir;
    return "/usr/share/datasets/fashion-mnist";
  }

  /// The `which` split from `directory`'s IDX files (each plain or .gz); tandem::Error when one is
  /// missing or malformed.
  explicit FashionMNIST(split which, const std::filesystem::path& directory = default_directory())
      : IdxImageDataset(detail::mnist_family(directory, which, mean_value, std_value)) {}
};

/// MNIST (handwritten digits), in the same files and layout; normalised with its usual
/// mean 0.1307 and standard deviation 0.3081.
class MNIST : public IdxImageDataset {
 public:
  static constexpr float mean_value = 0.1307f;  ///< the usual pixel mean (of pixel / 255)
  static constexpr float std_value = 0.3081f;   ///< the usual pixel standard deviation

  /// The `which` split from `directory`'s IDX files (each plain or .gz); tandem::Error when one is
  /// missing or malformed.
  MNIST(split which, const std::filesystem::path& directory)
      : IdxImageDataset(detail::mnist_family(directory, which, mean_value, std_value)) {}
};

static_assert(Dataset<FashionMNIST>);

}  // namespace tandem
