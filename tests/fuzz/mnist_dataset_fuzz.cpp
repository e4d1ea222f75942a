// An MNIST-family data set built from hostile IDX bytes: IdxImageDataset either accepts exactly
// what an independent model says fits (unsigned-byte images in 3 dimensions with pixels, as many
// labels in 1 dimension, the expected image size, every label below the class count), or throws
// tandem::Error; an accepted set reads every sample within bounds (ASan watches), each label
// below the class count.
// Input: byte 0 the class count (0: any), bytes 1-2 the expected rows and columns (0: any),
// bytes 3-4 the length of the images file (big-endian), then the images file and the labels file.
//
// fuzz-needs: tandem::data
// fuzz-max-len: 4096
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "fuzz/fuzz_check.hpp"
#include "tandem/data/idx.hpp"
#include "tandem/data/mnist.hpp"

namespace {

// Whether the two arrays make a data set that fits `expected`, by its definition.
bool fits(const tandem::IdxArray& images, const tandem::IdxArray& labels,
          const tandem::IdxImageShape& expected) {
  if (images.type() != tandem::idx_type::u8 || images.shape().size() != 3) return false;
  if (labels.type() != tandem::idx_type::u8 || labels.shape().size() != 1) return false;
  const auto& shape = images.shape();
  if (shape[0] != labels.shape()[0] || shape[0] == 0 || shape[1] == 0 || shape[2] == 0) {
    return false;
  }
  if ((expected.rows != 0 && shape[1] != expected.rows) ||
      (expected.columns != 0 && shape[2] != expected.columns)) {
    return false;
  }
  const auto values = labels.values<std::uint8_t>();
  return expected.classes == 0 ||
         std::all_of(values.begin(), values.end(),
                     [&](std::uint8_t label) { return label < expected.classes; });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 5) return 0;
  const tandem::IdxImageShape expected{data[1], data[2], data[0]};
  const std::size_t images_length = (std::size_t{data[3]} << 8) | data[4];
  const auto rest = std::as_bytes(std::span<const std::uint8_t>(data + 5, size - 5));
  if (images_length > rest.size()) return 0;
  std::optional<tandem::IdxArray> images, labels;
  try {
    images = tandem::parse_idx(rest.first(images_length), "images");
    labels = tandem::parse_idx(rest.subspan(images_length), "labels");
  } catch (const tandem::Error&) {
    return 0;  // the IDX target covers the files themselves
  }
  const bool should_fit = fits(*images, *labels, expected);
  std::optional<tandem::IdxImageDataset> set;
  try {
    set.emplace(*images, *labels, "images", "labels", 0.5f, 0.25f, expected);
  } catch (const tandem::Error&) {
    FUZZ_CHECK(!should_fit);  // a data set that fits refused
    return 0;
  }
  FUZZ_CHECK(should_fit);  // a data set that does not fit accepted
  FUZZ_CHECK(set->size() == labels->shape()[0]);
  FUZZ_CHECK(set->classes() == expected.classes);
  FUZZ_CHECK(set->field_numel()[0] == set->rows() * set->columns());
  std::vector<float> image(set->rows() * set->columns());
  std::int64_t label = -1;
  for (std::size_t i = 0; i < std::min<std::size_t>(set->size(), 64); ++i) {
    set->read(i, image, std::span<std::int64_t>(&label, 1));
    FUZZ_CHECK(label >= 0 && label < 256);
    FUZZ_CHECK(expected.classes == 0 || static_cast<std::size_t>(label) < expected.classes);
  }
  return 0;
}
