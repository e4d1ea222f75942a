// tandem/data/idx.hpp - the IDX format of MNIST and Fashion-MNIST (a magic number naming the
// element type and rank, big-endian dimension sizes, big-endian data), plain or gzip-compressed.
//   tandem::IdxArray images = tandem::read_idx("train-images-idx3-ubyte.gz");
//   std::span<const std::uint8_t> pixels = images.values<std::uint8_t>();  // shape() {60000,28,28}
// Needs: zlib (the tandem::data CMake component). A truncated, corrupt or lying file is a
// tandem::Error naming the file and the problem; the reader never over-reads and never allocates
// more than the file holds (a gzip stream: more than it has inflated to so far).
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/core/fd.hpp"

namespace tandem {

/// The element types IDX names in the third byte of its magic number.
enum class idx_type : std::uint8_t {
  u8 = 0x08,
  i8 = 0x09,
  i16 = 0x0B,
  i32 = 0x0C,
  f32 = 0x0D,
  f64 = 0x0E,
};

/// Bytes per element of an IDX type.
[[nodiscard]] constexpr std::size_t idx_element_size(idx_type type) noexcept {
  switch (type) {
    case idx_type::u8:
    case idx_type::i8:
      return 1;
    case idx_type::i16:
      return 2;
    case idx_type::i32:
    case idx_type::f32:
      return 4;
    case idx_type::f64:
      return 8;
  }
  return 0;
}

namespace detail {
inline std::string hex_byte(unsigned value) {
  constexpr char digits[] = "0123456789abcdef";
  return {digits[(value >> 4) & 0xF], digits[value & 0xF]};
}

template <class T>
inline constexpr bool is_idx_element =
    std::is_same_v<T, std::uint8_t> || std::is_same_v<T, std::int8_t> ||
    std::is_same_v<T, std::int16_t> || std::is_same_v<T, std::int32_t> ||
    std::is_same_v<T, float> || std::is_same_v<T, double>;
template <class T>
constexpr idx_type idx_type_of() noexcept {
  if constexpr (std::is_same_v<T, std::uint8_t>) return idx_type::u8;
  if constexpr (std::is_same_v<T, std::int8_t>) return idx_type::i8;
  if constexpr (std::is_same_v<T, std::int16_t>) return idx_type::i16;
  if constexpr (std::is_same_v<T, std::int32_t>) return idx_type::i32;
  if constexpr (std::is_same_v<T, float>) return idx_type::f32;
  return idx_type::f64;
}
}  // namespace detail

/// One IDX file's contents: its element type, its dimensions and its data in host byte order.
class IdxArray {
 public:
  IdxArray() = default;
  /// Elements of `type` in `shape`, their `bytes` already in host byte order (parse_idx's result).
  IdxArray(idx_type type, std::vector<std::size_t> shape, std::vector<std::byte> bytes)
      : type_(type), shape_(std::move(shape)), bytes_(std::move(bytes)) {}

  /// The element type the file's magic number names.
  [[nodiscard]] idx_type type() const noexcept { return type_; }
  /// Dimension sizes, outermost first (images: {count, rows, columns}).
  [[nodiscard]] const std::vector<std::size_t>& shape() const noexcept { return shape_; }
  /// Elements in all.
  [[nodiscard]] std::size_t numel() const noexcept {
    return bytes_.size() / idx_element_size(type_);
  }
  /// The data as raw bytes in host byte order, numel() * idx_element_size(type()) of them.
  [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return bytes_; }

  /// The elements as T, which must be the file's element type (tandem::Error otherwise).
  template <class T>
  requires detail::is_idx_element<T>
  [[nodiscard]] std::span<const T> values() const {
    if (detail::idx_type_of<T>() != type_) {
      throw Error("IdxArray::values",
                  "the file holds elements of type 0x" + detail::hex_byte(unsigned(type_)) +
                      ", not the type asked for (0x" +
                      detail::hex_byte(unsigned(detail::idx_type_of<T>())) + ")");
    }
    return {reinterpret_cast<const T*>(bytes_.data()), numel()};
  }

 private:
  idx_type type_ = idx_type::u8;
  std::vector<std::size_t> shape_;
  std::vector<std::byte> bytes_;
};

namespace detail {

/// A source of decoded bytes: the file itself, or its gzip stream inflated on the fly. It never
/// yields more bytes than the input holds, and says how many more it could at most.
class IdxSource {
 public:
  IdxSource(std::span<const std::byte> input, std::string name)
      : input_(input), name_(std::move(name)) {
    gzip_ = input.size() >= 2 && input[0] == std::byte{0x1f} && input[1] == std::byte{0x8b};
    if (gzip_) {
      stream_.next_in = reinterpret_cast<Bytef*>(const_cast<std::byte*>(input.data()));
      stream_.avail_in = 0;
      // 16 + MAX_WBITS: a gzip header and trailer (with its CRC and length checked).
      if (inflateInit2(&stream_, 16 + MAX_WBITS) != Z_OK) fail("zlib could not start inflating");
      open_ = true;
    }
  }
  IdxSource(const IdxSource&) = delete;
  IdxSource& operator=(const IdxSource&) = delete;
  ~IdxSource() {
    if (open_) inflateEnd(&stream_);
  }

  [[nodiscard]] bool gzip() const noexcept { return gzip_; }

  /// The most bytes the rest of the input can decode to: exact for a plain file; for gzip,
  /// deflate's best ratio (1032:1) plus a margin, so a lying header cannot make us allocate more.
  [[nodiscard]] std::size_t bound() const noexcept {
    // Input handed to zlib but not yet inflated counts as unread.
    const std::size_t rest = input_.size() - consumed_ + (gzip_ ? stream_.avail_in : 0);
    if (!gzip_) return rest;
    if (rest > std::numeric_limits<std::size_t>::max() / 1032 - 1024) {
      return std::numeric_limits<std::size_t>::max();
    }
    return rest * 1032 + 1024;
  }

  /// Exactly `size` bytes into `out`, or tandem::Error saying the file ends too soon; the part
  /// at `offset` of `what`'s `whole` bytes (0: `size`), which the error names.
  void read(void* out, std::size_t size, std::string_view what, std::size_t offset = 0,
            std::size_t whole = 0) {
    if (whole == 0) whole = size;
    if (!gzip_) {
      if (input_.size() - consumed_ < size) {
        truncated(what, whole, offset + input_.size() - consumed_);
      }
      if (size != 0) std::memcpy(out, input_.data() + consumed_, size);
      consumed_ += size;
      return;
    }
    auto* cursor = static_cast<Bytef*>(out);
    std::size_t left = size;
    while (left > 0) {
      if (finished_) truncated(what, whole, offset + size - left);
      if (stream_.avail_in == 0) feed();
      const auto chunk = static_cast<uInt>(std::min<std::size_t>(left, 1u << 30));
      stream_.next_out = cursor;
      stream_.avail_out = chunk;
      const int status = inflate(&stream_, Z_NO_FLUSH);
      const std::size_t produced = chunk - stream_.avail_out;
      cursor += produced;
      left -= produced;
      if (status == Z_STREAM_END) {
        finished_ = true;
      } else if (status == Z_BUF_ERROR && produced == 0 && stream_.avail_in == 0 &&
                 consumed_ == input_.size()) {
        truncated(what, whole, offset + size - left);
      } else if (status != Z_OK && status != Z_BUF_ERROR) {
        fail(std::string("corrupt gzip data (zlib: ") + (stream_.msg ? stream_.msg : "error") +
             ")");
      }
    }
  }

  /// The input must end here: no bytes after the data, and a gzip stream closed by its trailer.
  void expect_end() {
    if (!gzip_) {
      if (consumed_ != input_.size()) {
        fail(std::to_string(input_.size() - consumed_) +
             " bytes follow the data that the header describes");
      }
      return;
    }
    if (!finished_) {
      std::byte extra{};
      stream_.next_out = reinterpret_cast<Bytef*>(&extra);
      stream_.avail_out = 1;
      for (;;) {
        if (stream_.avail_in == 0 && consumed_ < input_.size()) feed();
        const int status = inflate(&stream_, Z_NO_FLUSH);
        if (stream_.avail_out == 0) fail("the data is longer than its header says");
        if (status == Z_STREAM_END) break;
        if (status == Z_BUF_ERROR ||
            (status == Z_OK && stream_.avail_in == 0 && consumed_ == input_.size())) {
          fail("the gzip stream ends without its trailer (truncated file)");
        }
        if (status != Z_OK) {
          fail(std::string("corrupt gzip data (zlib: ") + (stream_.msg ? stream_.msg : "error") +
               ")");
        }
      }
      finished_ = true;
    }
    if (stream_.avail_in != 0 || consumed_ != input_.size()) {
      fail("bytes follow the gzip stream (a second member or garbage)");
    }
  }

  [[noreturn]] void fail(const std::string& cause) const {
    throw Error("read_idx " + name_, cause);
  }

 private:
  void feed() {
    const std::size_t rest = input_.size() - consumed_;
    const auto chunk = static_cast<uInt>(std::min<std::size_t>(rest, 1u << 30));
    stream_.next_in = reinterpret_cast<Bytef*>(const_cast<std::byte*>(input_.data() + consumed_));
    stream_.avail_in = chunk;
    consumed_ += chunk;
  }

  [[noreturn]] void truncated(std::string_view what, std::size_t wanted, std::size_t got) const {
    fail("truncated: " + std::string(what) + " needs " + std::to_string(wanted) +
         " bytes, the file has " + std::to_string(got));
  }

  std::span<const std::byte> input_;
  std::string name_;
  std::size_t consumed_ = 0;
  bool gzip_ = false;
  bool open_ = false;
  bool finished_ = false;
  z_stream stream_{};
};

inline std::uint32_t big_endian_u32(const unsigned char* p) noexcept {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) |
         std::uint32_t{p[3]};
}

}  // namespace detail

/// Parses IDX bytes already in memory (plain or gzip); `name` is used in error messages.
[[nodiscard]] inline IdxArray parse_idx(std::span<const std::byte> input, std::string name) {
  detail::IdxSource source(input, std::move(name));
  unsigned char magic[4];
  source.read(magic, 4, "the magic number");
  if (magic[0] != 0 || magic[1] != 0) {
    source.fail("not an IDX file: the magic number must start with two zero bytes");
  }
  const auto type = static_cast<idx_type>(magic[2]);
  const std::size_t element_size = idx_element_size(type);
  if (element_size == 0) {
    source.fail("unknown element type 0x" + detail::hex_byte(magic[2]) +
                " (known: 08 u8, 09 i8, 0b i16, 0c i32, 0d f32, 0e f64)");
  }
  const int rank = magic[3];
  if (rank == 0) source.fail("zero dimensions");

  std::vector<std::size_t> shape(static_cast<std::size_t>(rank));
  for (int d = 0; d < rank; ++d) {
    unsigned char size_bytes[4];
    source.read(size_bytes, 4, "dimension " + std::to_string(d) + "'s size");
    shape[static_cast<std::size_t>(d)] = detail::big_endian_u32(size_bytes);
  }
  // One zero extent makes the file empty, however large the others: no product to overflow.
  std::size_t count = 0;
  if (std::find(shape.begin(), shape.end(), std::size_t{0}) == shape.end()) {
    count = 1;
    for (const std::size_t size : shape) {
      if (count > std::numeric_limits<std::size_t>::max() / element_size / size) {
        source.fail("the dimensions' product overflows");
      }
      count *= size;
    }
  }
  const std::size_t data_bytes = count * element_size;
  if (data_bytes > source.bound()) {
    source.fail("the header describes " + std::to_string(data_bytes) +
                " bytes of data, more than the file can hold (" + std::to_string(source.bound()) +
                (source.gzip() ? " at most once inflated)" : ")"));
  }
  std::vector<std::byte> bytes;
  if (!source.gzip()) {
    bytes.resize(data_bytes);  // no more than the file's own bytes: checked above
    source.read(bytes.data(), data_bytes, "the data");
  } else {
    // A gzip header may claim up to 1032 times its file's size: grow with what actually inflates,
    // so that a lying header ends as an Error, not as an allocation of what it claimed.
    constexpr std::size_t chunk = std::size_t{16} << 20;
    while (bytes.size() < data_bytes) {
      const std::size_t done = bytes.size();
      const std::size_t next = std::min(chunk, data_bytes - done);
      bytes.resize(done + next);
      source.read(bytes.data() + done, next, "the data", done, data_bytes);
    }
  }
  source.expect_end();

  if (element_size > 1 && std::endian::native == std::endian::little) {
    for (std::size_t i = 0; i < data_bytes; i += element_size) {
      for (std::size_t a = i, b = i + element_size - 1; a < b; ++a, --b)
        std::swap(bytes[a], bytes[b]);
    }
  }
  return IdxArray(type, std::move(shape), std::move(bytes));
}

/// Reads an IDX file (gzip-compressed when it starts with gzip's magic bytes). A path that is not
/// a regular file (a directory, a device, a pipe) or cannot be read is an Error naming it.
[[nodiscard]] inline IdxArray read_idx(const std::filesystem::path& path) {
  const std::string name = path.string();
  auto fail = [&](const std::string& cause) -> void { throw Error("read_idx " + name, cause); };
  detail::Fd fd(::open(name.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) fail("cannot open the file: " + detail::errno_text(errno));
  struct stat info {};
  if (::fstat(fd.get(), &info) != 0) fail("cannot stat the file: " + detail::errno_text(errno));
  if (!S_ISREG(info.st_mode)) {
    fail(S_ISDIR(info.st_mode) ? "is a directory, not an IDX file" : "is not a regular file");
  }
  std::vector<std::byte> input(static_cast<std::size_t>(info.st_size));
  std::size_t done = 0;
  while (done < input.size()) {
    const ssize_t got = ::read(fd.get(), input.data() + done, input.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail("cannot read the file: " + detail::errno_text(errno));
    if (got == 0) fail("the file shrank while being read");
    done += static_cast<std::size_t>(got);
  }
  return parse_idx(input, name);
}

}  // namespace tandem
