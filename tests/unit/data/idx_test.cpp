// The IDX reader on files made here: every element type, plain and gzip, and hostile inputs
// (truncated at every byte, lying sizes, trailing bytes, corrupt compression, paths that are no
// file), each an Error; and images and labels that do not fit their data set (labels outside its
// classes, images of another size), each an Error naming the file.
#include <zlib.h>

#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "support/temp_dir.hpp"
#include "tandem/data/idx.hpp"
#include "tandem/data/mnist.hpp"

namespace {

using Bytes = std::vector<std::byte>;

Bytes idx_file(std::uint8_t type, std::vector<std::uint32_t> dims, const Bytes& big_endian_data) {
  Bytes out{std::byte{0}, std::byte{0}, std::byte{type}, std::byte(dims.size())};
  for (auto d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(std::byte((d >> shift) & 0xFF));
  }
  out.insert(out.end(), big_endian_data.begin(), big_endian_data.end());
  return out;
}

Bytes gzip(const Bytes& plain) {
  z_stream stream{};
  REQUIRE(deflateInit2(&stream, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  Bytes out(deflateBound(&stream, static_cast<uLong>(plain.size())) + 32);
  stream.next_in = reinterpret_cast<Bytef*>(const_cast<std::byte*>(plain.data()));
  stream.avail_in = static_cast<uInt>(plain.size());
  stream.next_out = reinterpret_cast<Bytef*>(out.data());
  stream.avail_out = static_cast<uInt>(out.size());
  REQUIRE(deflate(&stream, Z_FINISH) == Z_STREAM_END);
  out.resize(stream.total_out);
  deflateEnd(&stream);
  return out;
}

Bytes bytes_of(std::initializer_list<int> values) {
  Bytes out;
  for (int v : values) out.push_back(std::byte(v));
  return out;
}

// 2 x 3 unsigned bytes.
Bytes small_u8() {
  return idx_file(0x08, {2, 3}, bytes_of({1, 2, 3, 4, 5, 255}));
}

}  // namespace

TEST_CASE("IDX files of every element type read back in host byte order, plain and gzip") {
  for (bool compressed : {false, true}) {
    CAPTURE(compressed);
    auto prepare = [&](const Bytes& b) { return compressed ? gzip(b) : b; };

    auto u8 = tandem::parse_idx(prepare(small_u8()), "u8");
    CHECK(u8.type() == tandem::idx_type::u8);
    CHECK(u8.shape() == std::vector<std::size_t>{2, 3});
    CHECK(u8.values<std::uint8_t>()[5] == 255);
    CHECK_THROWS_WITH_AS((void)u8.values<float>(), doctest::Contains("type 0x08"), tandem::Error);

    auto i16 =
        tandem::parse_idx(prepare(idx_file(0x0B, {2}, bytes_of({0x01, 0x02, 0xFF, 0xFE}))), "i16");
    CHECK(i16.values<std::int16_t>()[0] == 0x0102);
    CHECK(i16.values<std::int16_t>()[1] == -2);

    auto i32 =
        tandem::parse_idx(prepare(idx_file(0x0C, {1}, bytes_of({0xFF, 0xFF, 0xFF, 0xFD}))), "i32");
    CHECK(i32.values<std::int32_t>()[0] == -3);

    auto f32 =
        tandem::parse_idx(prepare(idx_file(0x0D, {1, 1}, bytes_of({0x3F, 0xC0, 0, 0}))), "f32");
    CHECK(f32.values<float>()[0] == 1.5f);

    auto f64 = tandem::parse_idx(
        prepare(idx_file(0x0E, {1}, bytes_of({0xC0, 0x04, 0, 0, 0, 0, 0, 0}))), "f64");
    CHECK(f64.values<double>()[0] == -2.5);

    auto i8 = tandem::parse_idx(prepare(idx_file(0x09, {3}, bytes_of({0x80, 0x7F, 0}))), "i8");
    CHECK(i8.values<std::int8_t>()[0] == -128);

    auto empty = tandem::parse_idx(prepare(idx_file(0x08, {0, 28}, {})), "empty");
    CHECK(empty.numel() == 0);
  }
}

TEST_CASE("read_idx reads a file from disk and names it in errors") {
  tandem::test::TempDir dir;
  const auto path = dir / "images.gz";
  const Bytes data = gzip(small_u8());
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  CHECK(tandem::read_idx(path).numel() == 6);
  CHECK_THROWS_WITH_AS((void)tandem::read_idx(dir / "missing"),
                       doctest::Contains("missing: cannot open"), tandem::Error);
}

TEST_CASE("a file truncated at any byte is an Error, plain or gzip") {
  // 3 x 5 x 7 bytes of varied data, so that the gzip stream has several blocks' worth of state.
  Bytes data;
  for (int i = 0; i < 105; ++i) data.push_back(std::byte((i * 37) & 0xFF));
  const Bytes plain = idx_file(0x08, {3, 5, 7}, data);
  for (const Bytes& whole : {plain, gzip(plain)}) {
    REQUIRE(tandem::parse_idx(whole, "whole").numel() == 105);
    for (std::size_t cut = 0; cut < whole.size(); ++cut) {
      CAPTURE(cut);
      const Bytes part(whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(cut));
      CHECK_THROWS_AS((void)tandem::parse_idx(part, "part"), tandem::Error);
    }
  }
}

TEST_CASE("lying, corrupt and malformed headers are Errors that say what is wrong") {
  auto fails = [](const Bytes& input, const char* text) {
    CAPTURE(text);
    CHECK_THROWS_WITH_AS((void)tandem::parse_idx(input, "f.idx"), doctest::Contains(text),
                         tandem::Error);
  };
  fails(bytes_of({1, 0, 8, 1, 0, 0, 0, 0}), "two zero bytes");
  fails(bytes_of({0, 0, 0x07, 1, 0, 0, 0, 0}), "unknown element type 0x07");
  fails(bytes_of({0, 0, 8, 0}), "zero dimensions");
  // A header that claims 4 GiB of data in a 16-byte file: refused before any allocation.
  fails(idx_file(0x08, {65536, 65536}, bytes_of({1, 2})), "more than the file can hold");
  fails(gzip(idx_file(0x08, {65536, 65536}, bytes_of({1, 2}))), "more than the file can hold");
  // Dimensions whose product overflows 64 bits.
  fails(idx_file(0x0E, {0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF}, {}), "overflows");
  // More data than the header says.
  Bytes longer = small_u8();
  longer.push_back(std::byte{9});
  fails(longer, "1 bytes follow");
  fails(gzip(longer), "longer than its header says");
  // Garbage after the gzip stream, and a second gzip member.
  Bytes tail = gzip(small_u8());
  tail.push_back(std::byte{0});
  fails(tail, "follow the gzip stream");
  Bytes twice = gzip(small_u8());
  const Bytes again = gzip(bytes_of({1}));
  twice.insert(twice.end(), again.begin(), again.end());
  fails(twice, "follow the gzip stream");
  // A flipped byte inside the compressed data or its CRC.
  Bytes data;
  for (int i = 0; i < 4000; ++i) data.push_back(std::byte((i * 7919) & 0xFF));
  const Bytes good = gzip(idx_file(0x08, {4000}, data));
  int caught = 0;
  for (std::size_t at = 12; at < good.size(); at += 13) {
    Bytes bad = good;
    bad[at] ^= std::byte{0x5A};
    try {
      (void)tandem::parse_idx(bad, "flipped");
    } catch (const tandem::Error& error) {
      ++caught;
      CHECK(std::string(error.what()).find("flipped") != std::string::npos);
    }
  }
  // Every flip is caught: by the inflater, the header checks, or gzip's CRC-32 and length.
  CHECK(caught == static_cast<int>((good.size() - 12 + 12) / 13));
}

TEST_CASE("a zero extent makes an empty file, however large the other extents") {
  // Found by tests/fuzz (crashes/idx/zero-extent-beside-huge-extents): the product was checked
  // for overflow extent by extent, so a file of zero elements was refused as overflowing.
  for (bool compressed : {false, true}) {
    CAPTURE(compressed);
    const Bytes plain = idx_file(0x08, {0x1c00, 0xffff0000, 0x00ffff00, 0, 0x0f0f0f}, {});
    const auto array = tandem::parse_idx(compressed ? gzip(plain) : plain, "empty.idx");
    CHECK(array.numel() == 0);
    CHECK(array.shape() == std::vector<std::size_t>{0x1c00, 0xffff0000, 0x00ffff00, 0, 0x0f0f0f});
    CHECK(array.values<std::uint8_t>().empty());
    // The same extents without the zero still overflow, and data after an empty array is extra.
    CHECK_THROWS_WITH_AS(
        (void)tandem::parse_idx(idx_file(0x0E, {0x1c00, 0xffff0000, 0x00ffff00, 0x0f0f0f}, {}),
                                "f.idx"),
        doctest::Contains("overflows"), tandem::Error);
  }
  CHECK_THROWS_WITH_AS((void)tandem::parse_idx(idx_file(0x08, {0, 7}, bytes_of({1})), "f.idx"),
                       doctest::Contains("1 bytes follow"), tandem::Error);
}

TEST_CASE("a path that is not a regular file is an Error naming it, never an allocation") {
  tandem::test::TempDir dir;
  const std::string directory = dir.str() + ": is a directory, not an IDX file";
  CHECK_THROWS_WITH_AS((void)tandem::read_idx(dir.path()), doctest::Contains(directory.c_str()),
                       tandem::Error);
  CHECK_THROWS_WITH_AS((void)tandem::read_idx("/dev/null"),
                       doctest::Contains("/dev/null: is not a regular file"), tandem::Error);
}

TEST_CASE("a gzip header claiming far more than the stream holds is an Error") {
  // 1 GiB claimed by a 2 MB stream of incompressible bytes: within deflate's best ratio (1032:1),
  // so only the stream's early end tells; the reader finds it having allocated what inflated
  // (16 MB at a time), not the gigabyte claimed.
  Bytes data(2'000'000);
  std::uint32_t noise = 12345;
  for (auto& b : data) b = std::byte((noise = noise * 1664525u + 1013904223u) >> 24);
  const Bytes plain = idx_file(0x08, {1024, 1024, 1024}, data);
  CHECK_THROWS_WITH_AS((void)tandem::parse_idx(gzip(plain), "claims.gz"),
                       doctest::Contains("truncated: the data needs 1073741824 bytes, the file "
                                         "has 2000000"),
                       tandem::Error);
}

namespace {

// An images file of `count` images of rows x columns and a labels file of `labels`.
std::pair<tandem::IdxArray, tandem::IdxArray> image_set(std::uint32_t count, std::uint32_t rows,
                                                        std::uint32_t columns,
                                                        std::vector<int> labels) {
  const Bytes pixels(std::size_t{count} * rows * columns, std::byte{7});
  Bytes label_bytes;
  for (int l : labels) label_bytes.push_back(std::byte(l));
  return {tandem::parse_idx(idx_file(0x08, {count, rows, columns}, pixels), "images"),
          tandem::parse_idx(
              idx_file(0x08, {static_cast<std::uint32_t>(labels.size())}, label_bytes), "labels")};
}

}  // namespace

TEST_CASE("images and labels that do not fit the data set are Errors naming the file") {
  const tandem::IdxImageShape mnist{28, 28, 10};
  auto make = [&](std::uint32_t rows, std::uint32_t columns, std::vector<int> labels) {
    const auto [images, label_array] = image_set(3, rows, columns, std::move(labels));
    return tandem::IdxImageDataset(images, label_array, "train-images", "train-labels", 0.5f, 0.25f,
                                   mnist);
  };
  const auto fine = make(28, 28, {0, 9, 4});
  CHECK(fine.classes() == 10);
  CHECK(fine.field_numel() == std::array<std::size_t, 2>{784, 1});
  CHECK_THROWS_WITH_AS((void)make(28, 28, {0, 12, 3}),
                       doctest::Contains("IdxImageDataset train-labels: sample 1 has the label "
                                         "12, outside the 10 classes (0 to 9)"),
                       tandem::Error);
  CHECK_THROWS_WITH_AS((void)make(27, 28, {0, 1, 2}),
                       doctest::Contains("IdxImageDataset train-images: the images are 27 x 28 "
                                         "pixels; this data set's are 28 x 28"),
                       tandem::Error);
  CHECK_THROWS_WITH_AS((void)make(28, 28, {0, 1}), doctest::Contains("3 images but 2 labels"),
                       tandem::Error);
  // Without expectations any label and size passes (a data set of its own kind).
  const auto [images, labels] = image_set(2, 5, 4, {200, 3});
  const tandem::IdxImageDataset any(images, labels, "i", "l", 0.5f, 0.25f);
  CHECK(any.classes() == 0);
  CHECK(any.field_numel()[0] == 20);
  const auto [no_pixels, two] = image_set(2, 0, 4, {1, 1});
  CHECK_THROWS_WITH_AS(tandem::IdxImageDataset(no_pixels, two, "i", "l", 0.5f, 0.25f),
                       doctest::Contains("the images have no pixels"), tandem::Error);
  CHECK_THROWS_WITH_AS(tandem::IdxImageDataset(images, labels, "i", "l", 0.5f, 0.0f),
                       doctest::Contains("std finite and positive"), tandem::Error);
}

TEST_CASE("FashionMNIST refuses a directory whose files do not fit it, naming the file") {
  tandem::test::TempDir dir;
  auto write = [&](const std::string& name, const Bytes& bytes) {
    std::ofstream(dir / name, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()),
               static_cast<std::streamsize>(bytes.size()));
  };
  const Bytes pixels(std::size_t{2} * 28 * 28, std::byte{1});
  write("train-images-idx3-ubyte", idx_file(0x08, {2, 28, 28}, pixels));
  write("train-labels-idx1-ubyte", idx_file(0x08, {2}, bytes_of({3, 10})));
  const std::string label_10 =
      dir / "train-labels-idx1-ubyte" + ": sample 1 has the label 10, outside the 10 classes";
  CHECK_THROWS_WITH_AS(tandem::FashionMNIST(tandem::split::train, dir.path()),
                       doctest::Contains(label_10.c_str()), tandem::Error);
  write("train-labels-idx1-ubyte", idx_file(0x08, {2}, bytes_of({3, 9})));
  CHECK(tandem::FashionMNIST(tandem::split::train, dir.path()).size() == 2);
  CHECK_THROWS_WITH_AS(tandem::FashionMNIST(tandem::split::test, dir.path()),
                       doctest::Contains("t10k-images-idx3-ubyte.gz nor"), tandem::Error);
  CHECK_THROWS_WITH_AS(tandem::FashionMNIST(tandem::split::train, dir / "train-images-idx3-ubyte"),
                       doctest::Contains("not a directory"), tandem::Error);
}
