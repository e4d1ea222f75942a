// safetensors: round trips of every dtype tandem tensors hold, read whole or mapped, atomic
// writes; and hostile files (truncated at every byte, lying lengths, overlaps, holes, bad JSON,
// bad UTF-8, duplicates, huge shapes), each a tandem::Error naming the file.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "support/temp_dir.hpp"
#include "tandem/io/safetensors.hpp"

namespace {

using Bytes = std::vector<std::byte>;

// A file from a header text and data bytes, exactly as given (for hostile cases).
Bytes raw_file(const std::string& header, std::size_t data_bytes, std::uint64_t length = ~0ull) {
  if (length == ~0ull) length = header.size();
  Bytes out(8);
  for (int i = 0; i < 8; ++i)
    out[static_cast<std::size_t>(i)] = std::byte((length >> (8 * i)) & 0xFF);
  for (char c : header) out.push_back(std::byte(static_cast<unsigned char>(c)));
  out.resize(out.size() + data_bytes, std::byte{7});
  return out;
}

void fails_with(const Bytes& file, const char* text) {
  CAPTURE(text);
  CHECK_THROWS_WITH_AS((void)tandem::SafetensorsFile::parse(file, "bad.safetensors"),
                       doctest::Contains(text), tandem::Error);
}

}  // namespace

TEST_CASE("every dtype round-trips through a file, read whole and memory-mapped") {
  tandem::test::TempDir dir;
  const std::vector<double> f64{1.5, -2.25, 3e300};
  const std::vector<float> f32{0.1f, -0.0f, 1e-30f, 7.0f, 8.0f, 9.0f};
  const std::vector<tandem::half> f16{tandem::half(1.0f), tandem::half(-65504.0f)};
  const std::vector<tandem::bfloat16> bf16{tandem::bfloat16(3.0f), tandem::bfloat16(-1e30f)};
  const std::vector<std::int64_t> i64{-(1ll << 62), 5};
  const std::vector<std::int32_t> i32{-7, 2147483647};
  const std::vector<std::uint8_t> u8{0, 128, 255};
  const std::vector<float> empty;
  tandem::SafetensorsWriter writer;
  writer.add("w.f64", f64)
      .add("w.f32", f32, {2, 3})
      .add("w.f16", f16)
      .add("w.bf16", bf16)
      .add("w.i64", i64)
      .add("w.i32", i32)
      .add("w.u8", u8)
      .add("empty", empty, {0, 4})
      .metadata("epoch", "3")
      .metadata("note", "ünïcode ✓");
  const auto path = dir.path() / "all.safetensors";
  writer.write(path);
  for (bool mapped : {false, true}) {
    CAPTURE(mapped);
    const auto file =
        mapped ? tandem::SafetensorsFile::map(path) : tandem::SafetensorsFile::open(path);
    CHECK(file.tensors().size() == 8);
    CHECK(file.metadata().at("epoch") == "3");
    CHECK(file.metadata().at("note") == "ünïcode ✓");
    CHECK(file.values<double>("w.f64") == f64);
    CHECK(file.values<float>("w.f32") == f32);
    CHECK(file.entry("w.f32").shape == std::vector<std::int64_t>{2, 3});
    CHECK(file.entry("w.f32").dtype == tandem::st_dtype::F32);
    const auto halves = file.values<tandem::half>("w.f16");
    CHECK(float(halves[1]) == -65504.0f);
    CHECK(float(file.values<tandem::bfloat16>("w.bf16")[0]) == 3.0f);
    CHECK(file.values<std::int64_t>("w.i64") == i64);
    CHECK(file.values<std::int32_t>("w.i32") == i32);
    CHECK(file.values<std::uint8_t>("w.u8") == u8);
    CHECK(file.entry("empty").numel() == 0);
    CHECK(file.entry("w.bf16").dtype == tandem::st_dtype::BF16);
    std::vector<float> wrong_size(5);
    CHECK_THROWS_WITH_AS(file.read_into("w.f32", wrong_size), doctest::Contains("6 elements"),
                         tandem::Error);
    std::vector<double> wrong_type(6);
    CHECK_THROWS_WITH_AS(file.read_into("w.f32", wrong_type), doctest::Contains("is F32, not F64"),
                         tandem::Error);
    CHECK_THROWS_WITH_AS((void)file.entry("nope"), doctest::Contains("no tensor named 'nope'"),
                         tandem::Error);
  }
  // The header is padded to 8 bytes and the file is exactly header + data.
  const auto bytes = writer.serialize();
  std::uint64_t length = 0;
  std::memcpy(&length, bytes.data(), 8);
  CHECK(length % 8 == 0);
  CHECK(std::filesystem::file_size(path) == bytes.size());
  // No temporary file is left beside it.
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    (void)entry;
    ++files;
  }
  CHECK(files == 1);
}

TEST_CASE("the writer refuses names and shapes that would make a bad file") {
  std::vector<float> v(6);
  tandem::SafetensorsWriter writer;
  writer.add("a", v);
  CHECK_THROWS_WITH_AS(writer.add("a", v), doctest::Contains("added twice"), tandem::Error);
  CHECK_THROWS_WITH_AS(writer.add("__metadata__", v), doctest::Contains("cannot name"),
                       tandem::Error);
  CHECK_THROWS_WITH_AS(writer.add("b", v, {4, 2}), doctest::Contains("a shape of 8"),
                       tandem::Error);
}

TEST_CASE("a file truncated at any byte is an Error") {
  std::vector<float> a{1, 2, 3};
  std::vector<std::int64_t> b{4, 5};
  tandem::SafetensorsWriter writer;
  writer.add("a", a).add("b", b).metadata("k", "v");
  const Bytes whole = writer.serialize();
  REQUIRE(tandem::SafetensorsFile::parse(whole, "whole").tensors().size() == 2);
  for (std::size_t cut = 0; cut < whole.size(); ++cut) {
    CAPTURE(cut);
    const Bytes part(whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(cut));
    CHECK_THROWS_AS((void)tandem::SafetensorsFile::parse(part, "part"), tandem::Error);
  }
}

TEST_CASE("hostile headers are Errors that say what is wrong") {
  const std::string one = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  REQUIRE(tandem::SafetensorsFile::parse(raw_file(one, 8), "ok").tensors().size() == 1);
  fails_with(raw_file(one, 8, 1ull << 40), "exceeds the limit");
  fails_with(raw_file(one, 8, 1000), "runs past the end");
  fails_with(raw_file(one, 9), "cover 8 of the data section's 9 bytes");
  fails_with(raw_file(one, 4), "ends at byte 8 of a data section of 4");
  struct Hostile {
    const char* header;
    std::size_t data_bytes;
    const char* says;
  };
  const Hostile hostile[] = {
      {"{not json", 0, "not valid JSON"},
      {"[1,2]", 0, "not a JSON object"},
      {"{\"\xff\xfe\":{}}", 0, "not valid JSON"},  // invalid UTF-8
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"t":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
       16, "'t' appears twice"},
      {R"({"t":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", 8, "unknown dtype 'Q7'"},
      {R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8,
       "12 bytes but data_offsets of 8"},
      {R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8,
       "not a non-negative integer"},
      {R"({"t":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}})",
       8, "more bytes but data_offsets of 8"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8, "end before they begin"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8, "no data_offsets pair"},
      {R"({"t":{"shape":[2],"data_offsets":[0,8]}})", 8, "no dtype string"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12, "overlaps"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8, "a hole of 4 bytes"},
      {R"({"__metadata__":{"k":1}})", 0, "metadata 'k' is not a string"},
      {R"({"__metadata__":[]})", 0, "__metadata__ is not an object"},
  };
  for (const auto& bad : hostile) fails_with(raw_file(bad.header, bad.data_bytes), bad.says);
  fails_with(Bytes(5), "truncated");
}

TEST_CASE("a recorded CRC-32C catches a changed data byte that the header cannot") {
  std::vector<float> v{1, 2, 3, 4};
  tandem::SafetensorsWriter writer;
  writer.add("v", v).checksum();
  Bytes bytes = writer.serialize();
  const auto good = tandem::SafetensorsFile::parse(bytes, "good");
  CHECK(good.has_checksum());
  good.verify_checksum();
  bytes[bytes.size() - 3] ^= std::byte{1};
  const auto bad = tandem::SafetensorsFile::parse(bytes, "bad");  // still well-formed
  CHECK_THROWS_WITH_AS(bad.verify_checksum(), doctest::Contains("damaged after it was written"),
                       tandem::Error);
  // CRC-32C's check value, and continuation.
  const std::string digits = "123456789";
  const auto* p = reinterpret_cast<const std::byte*>(digits.data());
  CHECK(tandem::crc32c({p, 9}) == 0xE3069283u);
  CHECK(tandem::crc32c({p + 4, 5}, tandem::crc32c({p, 4})) == 0xE3069283u);
}

TEST_CASE("opening a missing file or a directory is an Error naming it") {
  tandem::test::TempDir dir;
  CHECK_THROWS_WITH_AS((void)tandem::SafetensorsFile::open(dir.path() / "none.safetensors"),
                       doctest::Contains("none.safetensors: cannot open"), tandem::Error);
  CHECK_THROWS_WITH_AS((void)tandem::SafetensorsFile::map(dir.path()),
                       doctest::Contains("not a regular file"), tandem::Error);
}
