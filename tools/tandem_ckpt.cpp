// tandem-ckpt: inspects safetensors checkpoints without loading a model.
//   tandem-ckpt info FILE      tensors (name, dtype, shape, bytes) and metadata
//   tandem-ckpt verify FILE    exit 0 for a valid file (its data checksum matching, its training
//                              state JSON); 1 and the reason for any other
//   tandem-ckpt diff A B       each tensor's largest absolute difference; exit 1 if any differs
// Every file is validated first (tandem/io/safetensors.hpp): a damaged file is reported, never
// read past its end.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tandem/io/safetensors.hpp"

namespace {

int usage(std::FILE* to = stderr) {
  std::fprintf(to,
               "usage: tandem-ckpt info FILE | verify FILE | diff A B\n"
               "  info    list tensors (name, dtype, shape, bytes) and metadata\n"
               "  verify  exit 0 if FILE is a valid safetensors file, else 1 with the reason\n"
               "  diff    largest absolute difference per tensor; exit 1 if any differs\n");
  return to == stdout ? 0 : 2;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

template <class T>
T load(const std::byte* at) {
  T value;
  std::memcpy(&value, at, sizeof(T));
  return value;
}

// Element i of a tensor as a double, whatever its dtype.
double element(const tandem::SafetensorsFile& file, const tandem::SafetensorsEntry& e,
               std::size_t i) {
  const std::byte* at = file.bytes(e).data() + i * tandem::st_dtype_size(e.dtype);
  switch (e.dtype) {
    case tandem::st_dtype::F64:
      return load<double>(at);
    case tandem::st_dtype::F32:
      return load<float>(at);
    case tandem::st_dtype::F16:
      return static_cast<float>(load<tandem::half>(at));
    case tandem::st_dtype::BF16:
      return static_cast<float>(load<tandem::bfloat16>(at));
    case tandem::st_dtype::I64:
      return static_cast<double>(load<std::int64_t>(at));
    case tandem::st_dtype::I32:
      return load<std::int32_t>(at);
    case tandem::st_dtype::I16:
      return load<std::int16_t>(at);
    case tandem::st_dtype::I8:
      return load<std::int8_t>(at);
    case tandem::st_dtype::U8:
      return load<std::uint8_t>(at);
    case tandem::st_dtype::BOOL:
      return load<std::uint8_t>(at) != 0 ? 1.0 : 0.0;
  }
  return 0;
}

int info(const char* path) {
  const auto file = tandem::SafetensorsFile::map(path);
  std::size_t total = 0;
  std::printf("%-40s %-5s %-20s %12s\n", "tensor", "dtype", "shape", "bytes");
  for (const auto& e : file.tensors()) {
    std::printf("%-40s %-5s %-20s %12zu\n", e.name.c_str(), tandem::st_dtype_name(e.dtype),
                shape_text(e.shape).c_str(), e.bytes());
    total += e.bytes();
  }
  std::printf("%zu tensors, %zu bytes of data\n", file.tensors().size(), total);
  for (const auto& [key, value] : file.metadata()) {
    std::printf("metadata %s = %s\n", key.c_str(), value.c_str());
  }
  return 0;
}

int diff(const char* a_path, const char* b_path) {
  const auto a = tandem::SafetensorsFile::map(a_path);
  const auto b = tandem::SafetensorsFile::map(b_path);
  bool differs = false;
  for (const auto& ea : a.tensors()) {
    if (!b.contains(ea.name)) {
      std::printf("%-40s only in %s\n", ea.name.c_str(), a_path);
      differs = true;
      continue;
    }
    const auto& eb = b.entry(ea.name);
    if (ea.shape != eb.shape) {
      std::printf("%-40s shapes differ: %s and %s\n", ea.name.c_str(), shape_text(ea.shape).c_str(),
                  shape_text(eb.shape).c_str());
      differs = true;
      continue;
    }
    double largest = 0;
    bool nan_mismatch = false;
    for (std::size_t i = 0; i < ea.numel(); ++i) {
      const double x = element(a, ea, i), y = element(b, eb, i);
      if (std::isnan(x) || std::isnan(y)) {
        nan_mismatch = nan_mismatch || std::isnan(x) != std::isnan(y);
        continue;
      }
      largest = std::max(largest, std::abs(x - y));
    }
    const bool same_bytes = ea.dtype == eb.dtype &&
                            std::memcmp(a.bytes(ea).data(), b.bytes(eb).data(), ea.bytes()) == 0;
    std::printf("%-40s max |a - b| = %.9g%s%s\n", ea.name.c_str(), largest,
                ea.dtype != eb.dtype ? " (dtypes differ)" : "",
                nan_mismatch ? " (NaN in one only)" : "");
    differs = differs || !same_bytes;
  }
  for (const auto& eb : b.tensors()) {
    if (!a.contains(eb.name)) {
      std::printf("%-40s only in %s\n", eb.name.c_str(), b_path);
      differs = true;
    }
  }
  std::printf(differs ? "the files differ\n" : "the tensors are identical\n");
  return differs ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && (std::string_view(argv[1]) == "--help" || std::string_view(argv[1]) == "-h")) {
    return usage(stdout);
  }
  if (argc < 3) return usage();
  const std::string command = argv[1];
  try {
    if (command == "info" && argc == 3) return info(argv[2]);
    if (command == "verify" && argc == 3) {
      const auto file = tandem::SafetensorsFile::map(argv[2]);
      file.verify_checksum();
      // A tandem checkpoint's training state must at least be a JSON object (what it restores
      // is checked when it is loaded into a TrainingState).
      if (const auto state = file.metadata().find("tandem.state"); state != file.metadata().end()) {
        const auto parsed = nlohmann::json::parse(state->second, nullptr, false);
        if (!parsed.is_object()) {
          std::fprintf(stderr,
                       "tandem-ckpt: %s: the training state (metadata tandem.state) is %s\n",
                       argv[2], parsed.is_discarded() ? "not valid JSON" : "not a JSON object");
          return 1;
        }
      }
      std::printf("%s: valid, %zu tensors%s\n", argv[2], file.tensors().size(),
                  file.has_checksum() ? ", data checksum matches" : "");
      return 0;
    }
    if (command == "diff" && argc == 4) return diff(argv[2], argv[3]);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "tandem-ckpt: %s\n", error.what());
    return 1;
  }
  return usage();
}
