// tandem/io/safetensors.hpp - the safetensors format (8-byte little-endian header length, a JSON
// header of dtype, shape and data_offsets per tensor plus string metadata, then the data): a
// writer, and a reader that never trusts the file.
//   tandem::SafetensorsWriter out;
//   out.add("fc.weight", weights, {10, 784});              // any host tensor, or a View
//   out.metadata("epoch", "3");
//   out.write("model.safetensors");                 // temp file, fsync, rename, fsync dir (umask)
//   auto file = tandem::SafetensorsFile::map("model.safetensors");
//   file.read_into("fc.weight", weights);                   // dtype and size checked
// Needs: nlohmann-json (the tandem::io CMake component).
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/core/fd.hpp"
#include "tandem/io/crc32c.hpp"
#include "tandem/io/detail/atomic_file.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// The element types safetensors names, with their byte sizes.
enum class st_dtype { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

namespace detail {

struct st_dtype_entry {
  st_dtype dtype;
  const char* name;
  std::size_t size;
};
inline constexpr st_dtype_entry st_dtypes[] = {
    {st_dtype::F64, "F64", 8},   {st_dtype::F32, "F32", 4}, {st_dtype::F16, "F16", 2},
    {st_dtype::BF16, "BF16", 2}, {st_dtype::I64, "I64", 8}, {st_dtype::I32, "I32", 4},
    {st_dtype::I16, "I16", 2},   {st_dtype::I8, "I8", 1},   {st_dtype::U8, "U8", 1},
    {st_dtype::BOOL, "BOOL", 1},
};

template <class T>
constexpr st_dtype st_dtype_of() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, double>)
    return st_dtype::F64;
  else if constexpr (std::is_same_v<U, float>)
    return st_dtype::F32;
  else if constexpr (std::is_same_v<U, half>)
    return st_dtype::F16;
  else if constexpr (std::is_same_v<U, bfloat16>)
    return st_dtype::BF16;
  else if constexpr (std::is_same_v<U, std::int64_t>)
    return st_dtype::I64;
  else if constexpr (std::is_same_v<U, std::int32_t>)
    return st_dtype::I32;
  else if constexpr (std::is_same_v<U, std::int16_t>)
    return st_dtype::I16;
  else if constexpr (std::is_same_v<U, std::int8_t>)
    return st_dtype::I8;
  else if constexpr (std::is_same_v<U, std::uint8_t>)
    return st_dtype::U8;
  else if constexpr (std::is_same_v<U, bool>)
    return st_dtype::BOOL;
  else
    static_assert(sizeof(T) == 0, "tandem: safetensors has no dtype for this element type");
}

inline std::string hex32(std::uint32_t value) {
  constexpr char digits[] = "0123456789abcdef";
  std::string text(8, '0');
  for (int i = 7; i >= 0; --i, value >>= 4) text[static_cast<std::size_t>(i)] = digits[value & 0xF];
  return text;
}

}  // namespace detail

/// The dtype's name in the header ("F32", "BF16", ...).
[[nodiscard]] constexpr const char* st_dtype_name(st_dtype dtype) noexcept {
  for (const auto& entry : detail::st_dtypes) {
    if (entry.dtype == dtype) return entry.name;
  }
  return "?";
}
/// Bytes per element of the dtype.
[[nodiscard]] constexpr std::size_t st_dtype_size(st_dtype dtype) noexcept {
  for (const auto& entry : detail::st_dtypes) {
    if (entry.dtype == dtype) return entry.size;
  }
  return 0;
}
/// The dtype a header names, if it is one tandem knows.
[[nodiscard]] inline std::optional<st_dtype> st_dtype_from_name(std::string_view name) noexcept {
  for (const auto& entry : detail::st_dtypes) {
    if (name == entry.name) return entry.dtype;
  }
  return std::nullopt;
}

/// One tensor of a safetensors file: where its bytes lie in the data section.
struct SafetensorsEntry {
  std::string name;                 ///< the tensor's name (a state_dict key)
  st_dtype dtype = st_dtype::F32;   ///< its element type
  std::vector<std::int64_t> shape;  ///< its extents, outermost first
  std::size_t begin = 0;            ///< offset of the first byte in the data section
  std::size_t end = 0;              ///< one past the last byte
  /// Elements: the product of the shape (1 for a scalar).
  [[nodiscard]] std::size_t numel() const noexcept {
    std::size_t n = 1;
    for (auto extent : shape) n *= static_cast<std::size_t>(extent);
    return n;
  }
  /// Bytes of data: numel() times the dtype's size.
  [[nodiscard]] std::size_t bytes() const noexcept { return end - begin; }
};

/// The largest header the reader accepts, as the reference implementation does.
inline constexpr std::size_t safetensors_max_header = 100'000'000;

namespace detail {

// The file opened for reading, and its size; an Error unless it is a regular file.
inline Fd open_regular(const std::string& name, std::size_t& size) {
  Fd fd(::open(name.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) throw Error("safetensors " + name, std::string("cannot open: ") + std::strerror(errno));
  struct stat info {};
  if (::fstat(fd.get(), &info) != 0) {
    throw Error("safetensors " + name, std::string("cannot stat: ") + std::strerror(errno));
  }
  if (!S_ISREG(info.st_mode)) throw Error("safetensors " + name, "not a regular file");
  size = static_cast<std::size_t>(info.st_size);
  return fd;
}

// The whole regular file `name`, read once.
inline std::vector<std::uint8_t> read_whole_file(const std::string& name) {
  std::size_t size = 0;
  const Fd fd = open_regular(name, size);
  std::vector<std::uint8_t> bytes(size);
  std::size_t done = 0;
  while (done < size) {
    const ssize_t got = ::read(fd.get(), bytes.data() + done, size - done);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) throw Error("safetensors " + name, "the file ended while being read");
    done += static_cast<std::size_t>(got);
  }
  return bytes;
}

}  // namespace detail

/// A validated safetensors file in memory (read whole, or memory-mapped). Every violation of the
/// format is a tandem::Error naming the file and the problem: a header length beyond the file or
/// 100 MB, bad JSON or UTF-8, an unknown dtype, a shape whose bytes do not match its offsets,
/// offsets out of range, overlapping or leaving holes, a name or key given twice (nlohmann-json
/// would keep the last silently), non-string metadata.
class SafetensorsFile {
 public:
  /// Reads the whole file into memory.
  static SafetensorsFile open(const std::filesystem::path& path) {
    const std::string name = path.string();
    auto storage = std::make_shared<std::vector<std::uint8_t>>(detail::read_whole_file(name));
    const auto bytes = std::as_bytes(std::span<const std::uint8_t>(*storage));
    return SafetensorsFile(std::move(storage), bytes, name);
  }

  /// Maps the file read-only: nothing is copied until a tensor is read.
  static SafetensorsFile map(const std::filesystem::path& path) {
    const std::string name = path.string();
    std::size_t size = 0;
    const detail::Fd fd = detail::open_regular(name, size);
    if (size == 0) return parse({}, name);
    void* address = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (address == MAP_FAILED) {
      throw Error("safetensors " + name, std::string("cannot map: ") + std::strerror(errno));
    }
    std::shared_ptr<void> owner(address, [size](void* p) { ::munmap(p, size); });
    std::span<const std::byte> bytes(static_cast<const std::byte*>(address), size);
    return SafetensorsFile(std::move(owner), bytes, name);
  }

  /// Validates bytes already in memory; they must outlive the result. `name` is for errors.
  static SafetensorsFile parse(std::span<const std::byte> bytes, std::string name) {
    return SafetensorsFile(nullptr, bytes, std::move(name));
  }

  /// The file's path (or the name given to parse()), as errors show it.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The tensors in the order of their data (by offset).
  [[nodiscard]] const std::vector<SafetensorsEntry>& tensors() const noexcept { return entries_; }
  /// The header's `__metadata__` strings.
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const noexcept {
    return metadata_;
  }
  /// Whether a tensor of that name is in the file.
  [[nodiscard]] bool contains(std::string_view tensor) const { return find(tensor) != nullptr; }
  /// The tensor named so; tandem::Error if there is none.
  [[nodiscard]] const SafetensorsEntry& entry(std::string_view tensor) const {
    const auto* found = find(tensor);
    if (!found) fail("no tensor named '" + std::string(tensor) + "'");
    return *found;
  }
  /// The metadata key under which tandem records the CRC-32C of the data section.
  static constexpr const char* checksum_key = "tandem.data_crc32c";

  /// Whether the file carries tandem's data checksum.
  [[nodiscard]] bool has_checksum() const { return metadata_.contains(checksum_key); }

  /// Checks the data section against the recorded CRC-32C (a file without one passes): an Error
  /// naming the file when a byte of the data changed since it was written.
  void verify_checksum() const {
    const auto recorded = metadata_.find(checksum_key);
    if (recorded == metadata_.end()) return;
    const std::string actual = detail::hex32(crc32c(data_));
    if (actual != recorded->second) {
      fail("the data's CRC-32C is " + actual + ", the header records " + recorded->second +
           " (the file was damaged after it was written)");
    }
  }

  /// What identifies the file's content, "HHHHHHHH-DDDDDDDD": the CRC-32C of its header (length
  /// and JSON: names, shapes, metadata) and of its data section (the recorded one, which
  /// verify_checksum() checks, where the file has it). Two files with the same fingerprint hold
  /// the same checkpoint; ranks compare it to know they loaded the same one.
  [[nodiscard]] std::string fingerprint() const {
    const auto recorded = metadata_.find(checksum_key);
    return detail::hex32(crc32c(header_)) + "-" +
           (recorded != metadata_.end() ? recorded->second : detail::hex32(crc32c(data_)));
  }

  /// The tensor's bytes, little-endian as stored.
  [[nodiscard]] std::span<const std::byte> bytes(const SafetensorsEntry& e) const noexcept {
    return data_.subspan(e.begin, e.end - e.begin);
  }

  /// Copies the tensor into `out`, which must have its element type and element count; device
  /// memory is filled through a pinned staging buffer.
  template <Tensor Out>
  void read_into(std::string_view tensor, Out&& out) const {
    using T = tensor_element_t<std::remove_cvref_t<Out>>;
    using Space = tensor_space_t<std::remove_cvref_t<Out>>;
    const auto& e = entry(tensor);
    if (e.dtype != detail::st_dtype_of<T>()) {
      fail("tensor '" + e.name + "' is " + st_dtype_name(e.dtype) + ", not " +
           st_dtype_name(detail::st_dtype_of<T>()));
    }
    const std::size_t count = std::ranges::size(out);
    if (count != e.numel()) {
      fail("tensor '" + e.name + "' has " + std::to_string(e.numel()) + " elements, not " +
           std::to_string(count));
    }
    static_assert(std::endian::native == std::endian::little,
                  "tandem: safetensors is little-endian; this host is not");
    if constexpr (host_accessible<Space>) {
      if (count != 0) std::memcpy(std::data(out), bytes(e).data(), e.bytes());
    } else {
      Buffer<T, pinned> staging(count);
      if (count != 0) std::memcpy(staging.data(), bytes(e).data(), e.bytes());
      space_copy<Space, pinned>::copy(std::data(out), staging.data(), e.bytes());
    }
  }

  /// The tensor as a host vector of T (its dtype must be T's).
  template <class T>
  [[nodiscard]] std::vector<T> values(std::string_view tensor) const {
    std::vector<T> out(entry(tensor).numel());
    read_into(tensor, out);
    return out;
  }

 private:
  SafetensorsFile(std::shared_ptr<void> owner, std::span<const std::byte> file, std::string name)
      : owner_(std::move(owner)), name_(std::move(name)) {
    validate(file);
  }

  [[noreturn]] void fail(const std::string& cause) const {
    throw Error("safetensors " + name_, cause);
  }

  const SafetensorsEntry* find(std::string_view tensor) const {
    for (const auto& e : entries_) {
      if (e.name == tensor) return &e;
    }
    return nullptr;
  }

  void validate(std::span<const std::byte> file) {
    if (file.size() < 8) {
      fail("truncated: " + std::to_string(file.size()) +
           " bytes, less than the 8-byte header length");
    }
    std::uint64_t header_length = 0;
    for (int i = 7; i >= 0; --i) {
      header_length =
          (header_length << 8) | std::to_integer<std::uint64_t>(file[static_cast<std::size_t>(i)]);
    }
    if (header_length > safetensors_max_header) {
      fail("header length " + std::to_string(header_length) + " exceeds the limit of " +
           std::to_string(safetensors_max_header) + " bytes");
    }
    if (header_length > file.size() - 8) {
      fail("header length " + std::to_string(header_length) + " runs past the end of the file (" +
           std::to_string(file.size()) + " bytes)");
    }
    const auto header = file.subspan(8, static_cast<std::size_t>(header_length));
    header_ = file.first(8 + static_cast<std::size_t>(header_length));
    data_ = file.subspan(8 + static_cast<std::size_t>(header_length));

    // nlohmann keeps the last of duplicate keys silently: the callback sees every key first, in
    // the header's object and in every object inside it (__metadata__, each tensor's entry).
    std::vector<std::set<std::string>> open_objects;
    std::optional<std::string> duplicate;
    auto watch = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
      using event_t = nlohmann::json::parse_event_t;
      if (event == event_t::object_start) {
        open_objects.emplace_back();
      } else if (event == event_t::object_end) {
        if (!open_objects.empty()) open_objects.pop_back();
      } else if (event == event_t::key && !open_objects.empty()) {
        const auto& key = parsed.get_ref<const std::string&>();
        if (!open_objects.back().insert(key).second && !duplicate) duplicate = key;
      }
      return true;
    };
    nlohmann::json json;
    try {
      const auto* text = reinterpret_cast<const char*>(header.data());
      json = nlohmann::json::parse(text, text + header.size(), watch);
    } catch (const nlohmann::json::exception& error) {
      fail(std::string("the header is not valid JSON: ") + error.what());
    }
    if (duplicate) fail("the name '" + *duplicate + "' appears twice");
    if (!json.is_object()) fail("the header is not a JSON object");

    for (const auto& [key, value] : json.items()) {
      if (key == "__metadata__") {
        if (!value.is_object()) fail("__metadata__ is not an object");
        for (const auto& [meta_key, meta_value] : value.items()) {
          if (!meta_value.is_string()) fail("metadata '" + meta_key + "' is not a string");
          metadata_[meta_key] = meta_value.get<std::string>();
        }
        continue;
      }
      entries_.push_back(parse_entry(key, value));
    }
    std::sort(entries_.begin(), entries_.end(), [](const auto& a, const auto& b) {
      return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
    });
    std::size_t expected = 0;
    for (const auto& e : entries_) {
      if (e.begin < expected) fail("tensor '" + e.name + "' overlaps the tensor before it");
      if (e.begin > expected) {
        fail("a hole of " + std::to_string(e.begin - expected) + " bytes precedes tensor '" +
             e.name + "'");
      }
      expected = e.end;
    }
    if (expected != data_.size()) {
      fail("the tensors cover " + std::to_string(expected) + " of the data section's " +
           std::to_string(data_.size()) + " bytes");
    }
  }

  SafetensorsEntry parse_entry(const std::string& key, const nlohmann::json& value) const {
    const std::string what = "tensor '" + key + "'";
    if (!value.is_object()) fail(what + " is not an object");
    SafetensorsEntry e;
    e.name = key;
    const auto dtype = value.find("dtype");
    if (dtype == value.end() || !dtype->is_string()) fail(what + " has no dtype string");
    const auto known = st_dtype_from_name(dtype->get_ref<const std::string&>());
    if (!known) fail(what + " has the unknown dtype '" + dtype->get<std::string>() + "'");
    e.dtype = *known;
    const auto shape = value.find("shape");
    if (shape == value.end() || !shape->is_array()) fail(what + " has no shape array");
    std::size_t numel = 1;
    bool overflow = false;
    for (const auto& extent : *shape) {
      if (!extent.is_number_unsigned() &&
          !(extent.is_number_integer() && extent.get<std::int64_t>() >= 0)) {
        fail(what + " has a shape entry that is not a non-negative integer");
      }
      const auto n = extent.get<std::uint64_t>();
      if (n > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        fail(what + " has a shape entry out of range");
      }
      e.shape.push_back(static_cast<std::int64_t>(n));
      if (n != 0 && numel > std::numeric_limits<std::size_t>::max() / n) overflow = true;
      numel *= static_cast<std::size_t>(n);
    }
    const auto offsets = value.find("data_offsets");
    if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2 ||
        !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
      fail(what + " has no data_offsets pair of non-negative integers");
    }
    const auto begin = (*offsets)[0].get<std::uint64_t>();
    const auto end = (*offsets)[1].get<std::uint64_t>();
    if (begin > end) fail(what + " has data_offsets that end before they begin");
    if (end > data_.size()) {
      fail(what + " ends at byte " + std::to_string(end) + " of a data section of " +
           std::to_string(data_.size()));
    }
    const std::size_t element = st_dtype_size(e.dtype);
    if (overflow || numel > std::numeric_limits<std::size_t>::max() / element ||
        numel * element != end - begin) {
      fail(what + " has shape and dtype of " +
           (overflow ? std::string("more") : std::to_string(numel * element)) +
           " bytes but data_offsets of " + std::to_string(end - begin));
    }
    e.begin = static_cast<std::size_t>(begin);
    e.end = static_cast<std::size_t>(end);
    return e;
  }

  std::shared_ptr<void> owner_;
  std::string name_;
  std::span<const std::byte> header_;  // the length and the JSON
  std::span<const std::byte> data_;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

/// Builds a safetensors file from tensors, copied in when added (device ones through pinned
/// memory), and writes it atomically.
class SafetensorsWriter {
 public:
  /// Adds a tensor under `name`, 1-D of its size.
  template <Tensor In>
  SafetensorsWriter& add(std::string name, const In& in) {
    return add(std::move(name), in, {static_cast<std::int64_t>(std::ranges::size(in))});
  }
  /// Adds a tensor under `name` with `shape` (its product must be the tensor's size); `{}` is a
  /// 0-dimensional tensor of one element, as PyTorch holds BatchNorm's num_batches_tracked.
  template <Tensor In>
  SafetensorsWriter& add(std::string name, const In& in, std::vector<std::int64_t> shape) {
    using T = tensor_element_t<In>;
    using Space = tensor_space_t<In>;
    const std::size_t count = std::ranges::size(in);
    std::size_t numel = 1;
    for (auto extent : shape) {
      if (extent < 0)
        throw Error("SafetensorsWriter", "tensor '" + name + "' has a negative extent");
      numel *= static_cast<std::size_t>(extent);
    }
    if (numel != count) {
      throw Error("SafetensorsWriter", "tensor '" + name + "' has " + std::to_string(count) +
                                           " elements but a shape of " + std::to_string(numel));
    }
    check_name(name);
    Pending p{std::move(name), detail::st_dtype_of<T>(), std::move(shape),
              std::vector<std::byte>(count * sizeof(T))};
    if constexpr (host_accessible<Space>) {
      if (count != 0) std::memcpy(p.bytes.data(), std::data(in), p.bytes.size());
    } else {
      space_copy<host, Space>::copy(p.bytes.data(), std::data(in), p.bytes.size());
    }
    pending_.push_back(std::move(p));
    return *this;
  }

  /// A metadata string (`__metadata__` in the header).
  SafetensorsWriter& metadata(std::string key, std::string value) {
    metadata_[std::move(key)] = std::move(value);
    return *this;
  }

  /// Records the CRC-32C of the data section in the metadata (SafetensorsFile::verify_checksum
  /// checks it), so a damaged file is caught even where its header still parses.
  SafetensorsWriter& checksum(bool on = true) {
    checksum_ = on;
    return *this;
  }

  /// The whole file as bytes: header length, header padded with spaces to 8 bytes, data.
  [[nodiscard]] std::vector<std::byte> serialize() const {
    nlohmann::json header = nlohmann::json::object();
    auto metadata = metadata_;
    if (checksum_) {
      std::uint32_t crc = 0;
      for (const auto& p : pending_) crc = crc32c(p.bytes, crc);
      metadata[SafetensorsFile::checksum_key] = detail::hex32(crc);
    }
    if (!metadata.empty()) header["__metadata__"] = metadata;
    std::size_t offset = 0;
    for (const auto& p : pending_) {
      header[p.name] = {{"dtype", st_dtype_name(p.dtype)},
                        {"shape", p.shape},
                        {"data_offsets", {offset, offset + p.bytes.size()}}};
      offset += p.bytes.size();
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    std::vector<std::byte> out(8 + text.size() + offset);
    std::uint64_t length = text.size();
    for (int i = 0; i < 8; ++i)
      out[static_cast<std::size_t>(i)] = std::byte((length >> (8 * i)) & 0xFF);
    std::memcpy(out.data() + 8, text.data(), text.size());
    std::size_t at = 8 + text.size();
    for (const auto& p : pending_) {
      if (!p.bytes.empty()) std::memcpy(out.data() + at, p.bytes.data(), p.bytes.size());
      at += p.bytes.size();
    }
    return out;
  }

  /// Writes the file atomically: a temporary file of this process's own in the same directory
  /// (created as open() creates files: 0666 less the umask), fsync, rename over `path`, fsync of
  /// the directory. A crash leaves the old file or the new one, never a mix; a failure removes
  /// the temporary file and is an Error naming `path` and the system's reason.
  void write(const std::filesystem::path& path) const {
    const std::vector<std::byte> bytes = serialize();
    detail::write_atomically(path, bytes, "safetensors " + path.string());
  }

 private:
  struct Pending {
    std::string name;
    st_dtype dtype;
    std::vector<std::int64_t> shape;
    std::vector<std::byte> bytes;
  };

  void check_name(const std::string& name) const {
    if (name.empty() || name == "__metadata__") {
      throw Error("SafetensorsWriter", "'" + name + "' cannot name a tensor");
    }
    for (const auto& p : pending_) {
      if (p.name == name) throw Error("SafetensorsWriter", "tensor '" + name + "' added twice");
    }
  }

  std::vector<Pending> pending_;
  std::map<std::string, std::string> metadata_;
  bool checksum_ = false;
};

}  // namespace tandem
