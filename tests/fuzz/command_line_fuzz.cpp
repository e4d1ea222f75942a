// libFuzzer target: tandemrun's command line. The input is split into arguments at NUL bytes
// and parsed as tandemrun's argv (parse_command_line); when that asks to launch, the options are
// resolved into a plan (resolve) on a made-up machine, and each worker's environment is built.
// Bad input must end as an exit code with a message or a tandem::Error: never a crash, an abort,
// an exit, another exception, or a file read.
// Build and run by hand (tests/fuzz/run.sh does it for every target):
//   clang++ -std=c++20 -fsanitize=fuzzer,address,undefined -Iinclude -Itests/fuzz
//     tests/fuzz/command_line_fuzz.cpp -o /tmp/command_line_fuzz && /tmp/command_line_fuzz
//     tests/fuzz/corpus/command_line
// fuzz-needs: CLI11::CLI11
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_check.hpp"
#include "tandem/core/error.hpp"
#include "tandem/launch/detail/command_line.hpp"
#include "tandem/launch/launcher.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size > 4096) return 0;  // a command line, not a file
  std::vector<std::string> args{"tandemrun"};
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  for (;;) {
    const auto nul = bytes.find('\0');
    args.emplace_back(bytes.substr(0, nul));
    if (nul == std::string_view::npos) break;
    bytes.remove_prefix(nul + 1);
  }
  std::vector<const char*> argv;
  for (const auto& arg : args) argv.push_back(arg.c_str());
  argv.push_back(nullptr);

  const auto parsed =
      tandem::launch::detail::parse_command_line(static_cast<int>(args.size()), argv.data());
  if (parsed.exit_code >= 0) {
    FUZZ_CHECK(!parsed.output.empty());
    return 0;
  }
  FUZZ_CHECK(!parsed.options.command.empty());

  tandem::launch::HostFacts host;
  host.cpu_count = [] { return 4; };
  host.gpu_count = [] { return 2; };
  host.env = [](std::string_view) -> std::optional<std::string> { return std::nullopt; };
  host.free_port = [] { return std::uint16_t{40000}; };
  host.unique_id = [] { return std::string("fuzz-run"); };
  host.random_token = [] { return std::string("fuzz-token"); };
  host.read_token_file = [](const std::string& path) {
    if (path.size() % 2 == 0) throw tandem::Error("--rdzv-token-file", "cannot open " + path);
    return path;
  };
  try {
    const auto plan = tandem::launch::resolve(parsed.options, host);
    FUZZ_CHECK(plan.nproc_per_node >= 1 && plan.nnodes >= 1);
    FUZZ_CHECK(plan.node_rank >= 0 && plan.node_rank < plan.nnodes);
    FUZZ_CHECK(plan.master_port > 0 && plan.master_port <= 65535);
    FUZZ_CHECK(!plan.command.empty() && !plan.command.front().empty());
    FUZZ_CHECK(plan.store_token.size() <= tandem::launch::detail::max_token_bytes);
    // A plan may ask for 2^20 workers: build the environment of the first and the last only.
    for (const int local : {0, plan.nproc_per_node - 1}) {
      const auto vars = tandem::launch::worker_variables(plan, local, 0);
      FUZZ_CHECK(vars.at("RANK") == std::to_string(plan.global_rank(local)));
    }
  } catch (const tandem::Error&) {
    // A bad value, named by its flag: what tandemrun prints before exiting 2.
  }
  return 0;
}
