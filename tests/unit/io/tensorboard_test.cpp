// TensorBoardWriter: the records framed and checksummed as TFRecord wants, the events decoded
// back (tags, steps, values); a disabled writer writes nothing. TensorBoard's own reader is
// tried in tensorboard_read.py.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "support/temp_dir.hpp"
#include "tandem/io/tensorboard.hpp"

namespace {

struct Decoded {
  std::string file_version;
  std::int64_t step = 0;
  std::string tag;
  float value = 0;
  bool has_value = false;
};

std::uint64_t read_varint(const std::string& s, std::size_t& at) {
  std::uint64_t value = 0;
  for (int shift = 0; at < s.size(); shift += 7) {
    const auto byte = static_cast<unsigned char>(s[at++]);
    value |= std::uint64_t(byte & 0x7F) << shift;
    if (!(byte & 0x80)) break;
  }
  return value;
}

// A minimal protobuf walk over Event / Summary / Value, enough for the fields tandem writes.
void decode(const std::string& s, Decoded& out, int depth) {
  std::size_t at = 0;
  while (at < s.size()) {
    const auto key = read_varint(s, at);
    const auto field = key >> 3, wire = key & 7;
    if (wire == 0) {
      const auto v = read_varint(s, at);
      if (depth == 0 && field == 2) out.step = static_cast<std::int64_t>(v);
    } else if (wire == 1) {
      at += 8;
    } else if (wire == 5) {
      if (depth == 2 && field == 2) {
        std::memcpy(&out.value, s.data() + at, 4);
        out.has_value = true;
      }
      at += 4;
    } else if (wire == 2) {
      const auto n = read_varint(s, at);
      const std::string payload = s.substr(at, n);
      at += n;
      if (depth == 0 && field == 3)
        out.file_version = payload;
      else if (depth == 0 && field == 5)
        decode(payload, out, 1);
      else if (depth == 1 && field == 1)
        decode(payload, out, 2);
      else if (depth == 2 && field == 1)
        out.tag = payload;
    } else {
      FAIL("unexpected wire type " << wire);
    }
  }
}

std::vector<Decoded> read_events(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<Decoded> events;
  std::size_t at = 0;
  while (at < bytes.size()) {
    REQUIRE(at + 12 <= bytes.size());
    std::uint64_t length;
    std::uint32_t length_crc, data_crc;
    std::memcpy(&length, bytes.data() + at, 8);
    std::memcpy(&length_crc, bytes.data() + at + 8, 4);
    CHECK(length_crc ==
          tandem::detail::tfevents::masked_crc(std::as_bytes(std::span(bytes.data() + at, 8))));
    const std::string data = bytes.substr(at + 12, length);
    std::memcpy(&data_crc, bytes.data() + at + 12 + length, 4);
    CHECK(data_crc ==
          tandem::detail::tfevents::masked_crc(std::as_bytes(std::span(data.data(), data.size()))));
    Decoded event;
    decode(data, event, 0);
    events.push_back(event);
    at += 12 + length + 4;
  }
  return events;
}

}  // namespace

TEST_CASE("scalars are written as TFRecord-framed Events TensorBoard reads") {
  tandem::test::TempDir dir;
  std::string path;
  {
    tandem::TensorBoardWriter writer(dir / "run");
    REQUIRE(writer.enabled());
    path = writer.path().string();
    CHECK(writer.path().filename().string().rfind("events.out.tfevents.", 0) == 0);
    for (int step = 0; step < 5; ++step) writer.add_scalar("train/loss", 1.0 / (step + 1), step);
    writer.add_scalar("test/accuracy", 0.875, 300);
  }
  const auto events = read_events(path);
  REQUIRE(events.size() == 7);
  CHECK(events[0].file_version == "brain.Event:2");
  CHECK(events[3].tag == "train/loss");
  CHECK(events[3].step == 2);
  CHECK(events[3].value == static_cast<float>(1.0 / 3));
  CHECK(events[6].tag == "test/accuracy");
  CHECK(events[6].step == 300);
  CHECK(events[6].value == 0.875f);
  // A masked CRC differs from the plain one (TFRecord's definition).
  const std::string digits = "123456789";
  CHECK(tandem::detail::tfevents::masked_crc(std::as_bytes(std::span(digits.data(), 9))) ==
        ((0xE3069283u >> 15 | 0xE3069283u << 17) + 0xa282ead8u));
}

TEST_CASE("a disabled writer (another rank's) creates nothing") {
  tandem::test::TempDir dir;
  tandem::TensorBoardWriter writer(dir / "run", false);
  writer.add_scalar("x", 1, 1);
  writer.flush();
  CHECK_FALSE(writer.enabled());
  CHECK_FALSE(std::filesystem::exists(dir / "run"));
}
