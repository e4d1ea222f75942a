// tandem/io/tensorboard.hpp - tandem::TensorBoardWriter: scalar summaries in TensorBoard's event
// file format (TFRecord framing: length, masked CRC-32C of the length, an Event protocol
// buffer, masked CRC-32C of it), which `tensorboard --logdir DIR` reads. Rank 0 writes; on
// other ranks a writer made with `enabled = false` does nothing.
//   tandem::TensorBoardWriter tb("runs/mlp", comm.rank() == 0);
//   tb.add_scalar("train/loss", loss, step);
//   tb.flush();
// Needs: the standard library (the Event encoding is a few protobuf fields written by hand).
#pragma once

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/io/crc32c.hpp"

namespace tandem {

namespace detail::tfevents {

/// TFRecord's masked CRC-32C: the CRC rotated right by 15 bits plus a constant, so that a
/// CRC of data that itself holds CRCs is not trivially predictable.
inline std::uint32_t masked_crc(std::span<const std::byte> bytes) noexcept {
  const std::uint32_t crc = crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

inline void varint(std::string& out, std::uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}
inline void key(std::string& out, unsigned field, unsigned wire_type) {
  varint(out, (field << 3) | wire_type);
}
template <class T>
void fixed(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // protobuf's fixed fields are little-endian, as x86
  out.append(bytes, sizeof(T));
}
inline void length_delimited(std::string& out, unsigned field, std::string_view payload) {
  key(out, field, 2);
  varint(out, payload.size());
  out.append(payload);
}

// Event: 1 wall_time (double), 2 step (int64), 3 file_version (string), 5 summary (Summary).
// Summary: 1 value (repeated Value). Value: 1 tag (string), 2 simple_value (float).
inline std::string event(double wall_time, std::int64_t step) {
  std::string out;
  key(out, 1, 1);
  fixed(out, wall_time);
  key(out, 2, 0);
  varint(out, static_cast<std::uint64_t>(step));
  return out;
}

inline std::string scalar_event(double wall_time, std::int64_t step, std::string_view tag,
                                float value) {
  std::string summary_value;
  length_delimited(summary_value, 1, tag);
  key(summary_value, 2, 5);
  fixed(summary_value, value);
  std::string summary;
  length_delimited(summary, 1, summary_value);
  std::string out = event(wall_time, step);
  length_delimited(out, 5, summary);
  return out;
}

inline std::string record(std::string_view data) {
  std::string out;
  const std::uint64_t length = data.size();
  fixed(out, length);
  fixed(out, masked_crc(std::as_bytes(std::span(out.data(), out.size()))));
  out.append(data);
  fixed(out, masked_crc(std::as_bytes(std::span(data.data(), data.size()))));
  return out;
}

}  // namespace detail::tfevents

/// Writes scalar summaries to `events.out.tfevents.SECONDS.HOST.PID` in a directory, one file
/// per writer, for TensorBoard. Appends are buffered by stdio; flush() (or destruction) writes
/// them out. Disabled writers (the non-zero ranks, typically) create no file and ignore calls.
class TensorBoardWriter {
 public:
  /// A writer of a new event file in `directory` (created if needed); with `enabled` false it
  /// creates nothing and ignores every call (for ranks other than 0).
  explicit TensorBoardWriter(const std::filesystem::path& directory, bool enabled = true) {
    if (!enabled) return;
    std::error_code error;
    std::filesystem::create_directories(directory, error);
    if (error) {
      throw Error("TensorBoardWriter",
                  "cannot create " + directory.string() + ": " + error.message());
    }
    char host[256] = "localhost";
    ::gethostname(host, sizeof host - 1);
    const auto seconds = static_cast<long long>(now());
    path_ = directory / ("events.out.tfevents." + std::to_string(seconds) + "." + host + "." +
                         std::to_string(::getpid()));
    file_ = std::fopen(path_.c_str(), "wb");
    if (!file_) {
      throw Error("TensorBoardWriter",
                  "cannot create " + path_.string() + ": " + std::strerror(errno));
    }
    std::string first = detail::tfevents::event(now(), 0);
    detail::tfevents::length_delimited(first, 3, "brain.Event:2");
    write(first);
    flush();
  }
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  ~TensorBoardWriter() {
    if (file_) std::fclose(file_);
  }

  /// One scalar point of the curve `tag` ("train/loss") at `step`, stamped with the wall time.
  void add_scalar(std::string_view tag, double value, std::int64_t step) {
    if (!file_) return;
    write(detail::tfevents::scalar_event(now(), step, tag, static_cast<float>(value)));
  }

  /// Writes buffered events to the file, so TensorBoard sees them while the run goes on.
  void flush() {
    if (file_ && std::fflush(file_) != 0)
      throw Error("TensorBoardWriter", "cannot write " + path_.string());
  }

  /// Whether this writer writes (false on ranks made disabled).
  [[nodiscard]] bool enabled() const noexcept { return file_ != nullptr; }
  /// The event file (empty when disabled).
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

 private:
  static double now() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  void write(const std::string& data) {
    const std::string framed = detail::tfevents::record(data);
    if (std::fwrite(framed.data(), 1, framed.size(), file_) != framed.size()) {
      throw Error("TensorBoardWriter", "cannot write " + path_.string());
    }
  }

  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
};

}  // namespace tandem
