// The safetensors reader on hostile bytes: SafetensorsFile::parse either accepts a file whose
// every tensor lies inside the data section with a size matching its dtype and shape, or throws
// tandem::Error; never anything else. The fingerprint ranks compare depends on the bytes only. An
// accepted file's tensors read back through values<T>(), its checksum verifies or fails with an
// Error, and writing it again with SafetensorsWriter gives a file that parses to the same tensors,
// bytes and metadata.
//
// fuzz-needs: tandem::io
// fuzz-max-len: 4096
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fuzz/fuzz_check.hpp"
#include "tandem/io/safetensors.hpp"

namespace {

using tandem::st_dtype;

// Reads the tensor as its own element type, checks the copy is its bytes, and adds it to `again`.
template <class T>
void read_as(const tandem::SafetensorsFile& file, const tandem::SafetensorsEntry& e,
             tandem::SafetensorsWriter& again) {
  const std::vector<T> values = file.values<T>(e.name);
  FUZZ_CHECK(values.size() == e.numel());
  FUZZ_CHECK(values.size() * sizeof(T) == e.bytes());
  if (!values.empty()) {
    FUZZ_CHECK(std::memcmp(values.data(), file.bytes(e).data(), e.bytes()) == 0);
  }
  again.add(e.name, values, e.shape);
}

// Reads the tensor as its element type where tandem tensors have one and adds it to `again`;
// false for I16, I8 and BOOL, which tandem reads and writes as bytes only.
bool read_tensor(const tandem::SafetensorsFile& file, const tandem::SafetensorsEntry& e,
                 tandem::SafetensorsWriter& again) {
  switch (e.dtype) {
    case st_dtype::F64:
      read_as<double>(file, e, again);
      return true;
    case st_dtype::F32:
      read_as<float>(file, e, again);
      return true;
    case st_dtype::F16:
      read_as<tandem::half>(file, e, again);
      return true;
    case st_dtype::BF16:
      read_as<tandem::bfloat16>(file, e, again);
      return true;
    case st_dtype::I64:
      read_as<std::int64_t>(file, e, again);
      return true;
    case st_dtype::I32:
      read_as<std::int32_t>(file, e, again);
      return true;
    case st_dtype::U8:
      read_as<std::uint8_t>(file, e, again);
      return true;
    case st_dtype::I16:
    case st_dtype::I8:
    case st_dtype::BOOL:
      FUZZ_CHECK(file.bytes(e).size() == e.bytes());
      return false;
  }
  FUZZ_CHECK(!"an entry with a dtype outside st_dtype");
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto input = std::as_bytes(std::span<const std::uint8_t>(data, size));
  std::optional<tandem::SafetensorsFile> parsed;
  try {
    parsed.emplace(tandem::SafetensorsFile::parse(input, "fuzz"));
  } catch (const tandem::Error&) {
    return 0;  // rejected with the promised error
  }
  const auto& file = *parsed;

  // Tensors tile the data section in offset order: no overlap, no hole.
  std::size_t expected = 0;
  for (const auto& e : file.tensors()) {
    FUZZ_CHECK(e.begin == expected);
    FUZZ_CHECK(e.begin <= e.end);
    FUZZ_CHECK(e.numel() * tandem::st_dtype_size(e.dtype) == e.bytes());
    FUZZ_CHECK(file.contains(e.name));
    FUZZ_CHECK(&file.entry(e.name) == &e);
    expected = e.end;
  }
  FUZZ_CHECK(size >= 8 + expected);

  try {
    file.verify_checksum();
  } catch (const tandem::Error&) {
    FUZZ_CHECK(file.has_checksum());  // only a recorded checksum can disagree
  }
  // The fingerprint that ranks compare: the same for the same bytes.
  FUZZ_CHECK(file.fingerprint() == tandem::SafetensorsFile::parse(input, "again").fingerprint());
  FUZZ_CHECK(file.fingerprint().size() == 17);

  // Written again and read back: the same tensors with the same shapes (0-d ones stay 0-d), the
  // same metadata.
  tandem::SafetensorsWriter again;
  for (const auto& [key, value] : file.metadata()) again.metadata(key, value);
  for (const auto& e : file.tensors()) {
    if (e.name.empty()) return 0;  // the writer refuses a name a PyTorch module cannot have
    if (!read_tensor(file, e, again)) return 0;
  }
  const std::vector<std::byte> written = again.serialize();
  const auto reread = tandem::SafetensorsFile::parse(written, "fuzz rewritten");
  FUZZ_CHECK(reread.tensors().size() == file.tensors().size());
  FUZZ_CHECK(reread.metadata() == file.metadata());
  for (const auto& e : file.tensors()) {
    const auto& r = reread.entry(e.name);
    FUZZ_CHECK(r.shape == e.shape);
    FUZZ_CHECK(r.dtype == e.dtype);
    FUZZ_CHECK(r.bytes() == e.bytes());
    if (e.bytes() != 0) {
      FUZZ_CHECK(std::memcmp(reread.bytes(r).data(), file.bytes(e).data(), e.bytes()) == 0);
    }
  }
  return 0;
}
