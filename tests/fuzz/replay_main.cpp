// Replays saved fuzz inputs through one fuzz target without libFuzzer: every file of the
// directories (or the files) named on the command line is passed to LLVMFuzzerTestOneInput in
// name order. This is what CI runs (ctest -L fuzz) with the target's corpus and the crashes the
// fuzzer once found, so every input that ever broke a parser stays a regression test.
//   fuzz_replay_idx tests/fuzz/corpus/idx tests/fuzz/crashes/idx
// A directory that does not exist is skipped (a target may have no crashes yet), but at least
// one input must run: a replay that tested nothing fails.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

std::vector<std::uint8_t> read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The inputs under `where`: the file itself, or a directory's regular files in name order.
std::vector<std::filesystem::path> inputs_in(const std::filesystem::path& where) {
  std::vector<std::filesystem::path> found;
  if (std::filesystem::is_regular_file(where)) {
    found.push_back(where);
  } else if (std::filesystem::is_directory(where)) {
    for (const auto& entry : std::filesystem::directory_iterator(where)) {
      const auto name = entry.path().filename().string();
      if (entry.is_regular_file() && !name.starts_with(".") && name != "README.md") {
        found.push_back(entry.path());
      }
    }
    std::sort(found.begin(), found.end());
  }
  return found;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t total = 0;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::filesystem::path where(argv[i]);
      std::size_t here = 0;
      for (const auto& path : inputs_in(where)) {
        const auto bytes = read_file(path);
        // Named before it runs: a crash's output ends with the input that caused it.
        std::printf("  %s (%zu bytes)\n", path.filename().string().c_str(), bytes.size());
        std::fflush(stdout);
        // A copy of exactly the input's size, so ASan sees any read past its end.
        std::unique_ptr<std::uint8_t[]> exact(new std::uint8_t[bytes.size() + (bytes.empty())]);
        std::copy(bytes.begin(), bytes.end(), exact.get());
        LLVMFuzzerTestOneInput(exact.get(), bytes.size());
        ++here;
      }
      std::printf("%s: %zu inputs%s\n", where.string().c_str(), here,
                  std::filesystem::exists(where) ? "" : " (absent)");
      total += here;
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "fuzz replay: an exception escaped the target: %s\n", error.what());
    return 1;
  }
  std::printf("fuzz replay: %zu inputs replayed\n", total);
  if (total == 0) {
    std::fprintf(stderr, "fuzz replay: no inputs found: the corpus is missing\n");
    return 1;
  }
  return 0;
}
