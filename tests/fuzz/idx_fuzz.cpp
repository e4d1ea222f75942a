// The IDX reader on hostile bytes, plain and gzip: parse_idx either returns exactly what an
// independent model of the format says the bytes hold, or throws tandem::Error when the model
// says they are not an IDX file; it never reads past its input and never allocates more than
// the input can decode to (ASan and libFuzzer's memory limit watch both).
// The first byte picks how the rest reaches the reader, so that the gzip paths also see streams
// that inflate, not only corrupt ones:
//   'z': the rest, gzip-compressed here (read exactly as the plain rest would be);
//   't': the same, its last 1-16 bytes cut off (always an Error: the trailer is damaged);
//   'a': the same, 1-16 bytes of the rest appended after the gzip trailer (always an Error);
//   anything else: the whole input as it is (a raw gzip file starts with 0x1f 0x8b).
//
// fuzz-needs: tandem::data
// fuzz-max-len: 4096
#include <zlib.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "fuzz/fuzz_check.hpp"
#include "tandem/data/idx.hpp"

namespace {

using Bytes = std::vector<std::byte>;

Bytes gzip(std::span<const std::byte> plain) {
  z_stream stream{};
  FUZZ_CHECK(deflateInit2(&stream, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  Bytes out(deflateBound(&stream, static_cast<uLong>(plain.size())) + 32);
  stream.next_in = reinterpret_cast<Bytef*>(const_cast<std::byte*>(plain.data()));
  stream.avail_in = static_cast<uInt>(plain.size());
  stream.next_out = reinterpret_cast<Bytef*>(out.data());
  stream.avail_out = static_cast<uInt>(out.size());
  FUZZ_CHECK(deflate(&stream, Z_FINISH) == Z_STREAM_END);
  out.resize(stream.total_out);
  deflateEnd(&stream);
  return out;
}

// What a plain IDX file holds, by the format's definition; nullopt when it is not one.
struct Expected {
  std::vector<std::size_t> shape;
  std::size_t element_size = 0;
  Bytes host_order;  // the data with each element's bytes reversed (big-endian to little)
};
std::optional<Expected> model(std::span<const std::byte> p) {
  auto byte = [&](std::size_t i) { return std::to_integer<unsigned>(p[i]); };
  if (p.size() < 4 || byte(0) != 0 || byte(1) != 0) return std::nullopt;
  Expected e;
  switch (byte(2)) {
    case 0x08:
    case 0x09:
      e.element_size = 1;
      break;
    case 0x0B:
      e.element_size = 2;
      break;
    case 0x0C:
    case 0x0D:
      e.element_size = 4;
      break;
    case 0x0E:
      e.element_size = 8;
      break;
    default:
      return std::nullopt;
  }
  const std::size_t rank = byte(3);
  if (rank == 0 || p.size() < 4 + 4 * rank) return std::nullopt;
  std::size_t count = 1;  // saturates at p.size() + 1: no file this size holds more
  for (std::size_t d = 0; d < rank; ++d) {
    const std::size_t at = 4 + 4 * d;
    const std::size_t extent =
        (byte(at) << 24) | (byte(at + 1) << 16) | (byte(at + 2) << 8) | byte(at + 3);
    e.shape.push_back(extent);
    count = extent != 0 && count > (p.size() + 1) / extent ? p.size() + 1 : count * extent;
  }
  const std::size_t header = 4 + 4 * rank;
  if (count * e.element_size != p.size() - header) return std::nullopt;
  e.host_order.assign(p.begin() + static_cast<std::ptrdiff_t>(header), p.end());
  for (std::size_t i = 0; i < e.host_order.size(); i += e.element_size) {
    std::reverse(e.host_order.begin() + static_cast<std::ptrdiff_t>(i),
                 e.host_order.begin() + static_cast<std::ptrdiff_t>(i + e.element_size));
  }
  return e;
}

template <class T>
void check_values(const tandem::IdxArray& array) {
  const auto values = array.values<T>();
  FUZZ_CHECK(values.size() == array.numel());
  FUZZ_CHECK(static_cast<const void*>(values.data()) ==
             static_cast<const void*>(array.bytes().data()));
}

// The array agrees with itself: shape, count, bytes, and values<T>() of its own type.
void check_consistent(const tandem::IdxArray& array) {
  std::size_t product = 1;
  for (auto extent : array.shape()) product *= extent;
  FUZZ_CHECK(!array.shape().empty());
  FUZZ_CHECK(product == array.numel());
  FUZZ_CHECK(array.bytes().size() == array.numel() * tandem::idx_element_size(array.type()));
  switch (array.type()) {
    case tandem::idx_type::u8:
      return check_values<std::uint8_t>(array);
    case tandem::idx_type::i8:
      return check_values<std::int8_t>(array);
    case tandem::idx_type::i16:
      return check_values<std::int16_t>(array);
    case tandem::idx_type::i32:
      return check_values<std::int32_t>(array);
    case tandem::idx_type::f32:
      return check_values<float>(array);
    case tandem::idx_type::f64:
      return check_values<double>(array);
  }
  FUZZ_CHECK(!"an array of a type outside idx_type");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto whole = std::as_bytes(std::span<const std::uint8_t>(data, size));
  const char mode = size > 0 ? static_cast<char>(data[0]) : '\0';
  const bool compressed_here = mode == 'z' || mode == 't' || mode == 'a';
  const auto plain = compressed_here ? whole.subspan(1) : whole;

  Bytes prepared;
  std::span<const std::byte> input = whole;
  bool must_fail = false;
  if (compressed_here) {
    prepared = gzip(plain);
    const std::size_t amount = plain.empty() ? 1 : std::to_integer<std::size_t>(plain[0]) % 16 + 1;
    if (mode == 't') {
      prepared.resize(prepared.size() - std::min(amount, prepared.size()));
      must_fail = true;
    } else if (mode == 'a' && !plain.empty()) {
      prepared.insert(prepared.end(), plain.begin(),
                      plain.begin() + static_cast<std::ptrdiff_t>(std::min(amount, plain.size())));
      must_fail = true;
    }
    input = prepared;
  }
  // The model speaks for plain bytes, and for gzip made here from them.
  const bool modelled = compressed_here || size < 2 || data[0] != 0x1f || data[1] != 0x8b;
  const auto expected = modelled ? model(plain) : std::nullopt;

  tandem::IdxArray array;
  try {
    array = tandem::parse_idx(input, "fuzz");
  } catch (const tandem::Error&) {
    FUZZ_CHECK(must_fail || !expected);  // a valid file refused
    return 0;
  }
  FUZZ_CHECK(!must_fail);  // a damaged stream accepted
  check_consistent(array);
  if (modelled) {
    FUZZ_CHECK(expected.has_value());  // a file the format does not allow accepted
    FUZZ_CHECK(array.shape() == expected->shape);
    FUZZ_CHECK(tandem::idx_element_size(array.type()) == expected->element_size);
    FUZZ_CHECK(std::equal(array.bytes().begin(), array.bytes().end(), expected->host_order.begin(),
                          expected->host_order.end()));
  }
  return 0;
}
