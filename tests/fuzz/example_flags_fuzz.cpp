// The training examples' command line (fashion_mnist and fashion_mnist_cuda: recipe.hpp's parse,
// with run.hpp's numeric flags and path checks): the input is split into arguments at NUL bytes.
// parse either refuses (nullopt; the example prints the usage and exits 2) or returns settings
// every value of which is in range: a finite learning rate above 0, a batch of 1 to 60000, 1 to
// 1000 epochs, 1 to 64 ranks, 0 to 64 workers, a timeout of 1 to 86400 s, a ZeRO stage of 0 to 2,
// --await-replacement of 0 to 3600 s and above 0 only with --elastic, the CPU-only flags
// (--elastic, --await-replacement, --crash-in-setup, --zero, --async-save) unset for the GPU
// program, a data directory that is a directory. Never a crash, an exception, or an exit.
//
// fuzz-needs: tandem::data tandem::io
// fuzz-max-len: 1024
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "fashion_mnist/recipe.hpp"
#include "fuzz/fuzz_check.hpp"

namespace {

void check(const fashion_mnist::Settings& s, fashion_mnist::program which) {
  FUZZ_CHECK(std::isfinite(s.lr) && s.lr > 0);
  FUZZ_CHECK(s.batch_size >= 1 && s.batch_size <= 60000);
  FUZZ_CHECK(s.epochs >= 1 && s.epochs <= 1000);
  FUZZ_CHECK(s.ranks >= 1 && s.ranks <= 64);
  FUZZ_CHECK(s.workers >= 0 && s.workers <= 64);
  FUZZ_CHECK(s.timeout_seconds >= 1 && s.timeout_seconds <= 86400);
  FUZZ_CHECK(s.zero >= 0 && s.zero <= 2);
  FUZZ_CHECK(s.await_replacement >= 0 && s.await_replacement <= 3600);
  FUZZ_CHECK(s.await_replacement == 0 || s.elastic);
  if (which == fashion_mnist::program::gpu) {
    FUZZ_CHECK(!s.elastic && s.await_replacement == 0 && !s.crash_in_setup && s.zero == 0 &&
               !s.async_save && s.elastic_store.empty());
  }
  FUZZ_CHECK(s.elastic_store.empty() || s.elastic_store.starts_with("file:///"));
  FUZZ_CHECK(s.precision == "fp16" || s.precision == "bf16" || s.precision == "fp32");
  std::error_code error;
  FUZZ_CHECK(std::filesystem::is_directory(s.data, error));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> args{"fashion_mnist"};
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  while (!bytes.empty()) {
    const auto nul = bytes.find('\0');
    args.emplace_back(bytes.substr(0, nul));
    if (nul == std::string_view::npos) break;
    bytes.remove_prefix(nul + 1);
  }
  std::vector<char*> argv;
  for (auto& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  const int argc = static_cast<int>(args.size());
  for (const auto which : {fashion_mnist::program::cpu, fashion_mnist::program::gpu}) {
    if (const auto settings = fashion_mnist::parse(argc, argv.data(), which, nullptr)) {
      check(*settings, which);
    }
  }
  return 0;
}
