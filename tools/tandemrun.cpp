// tandemrun - the torchrun-compatible launcher: `tandemrun [OPTIONS] PROGRAM [ARGS...]`, and
// `tandemrun --trace DIR`, which merges the flight records a job left in DIR.
// Everything it does lives in include/tandem/launch/launcher.hpp; this file only wires the
// command line to it and turns errors into exit codes (2: bad command line, 1: anything else).
#include <cstdio>
#include <exception>
#include <string_view>

#include "tandem/comm/flight_trace.hpp"
#include "tandem/core/error.hpp"
#include "tandem/launch/detail/command_line.hpp"
#include "tandem/launch/launcher.hpp"

int main(int argc, char** argv) {
  // `tandemrun --trace DIR`: what the flight records a job left in DIR say.
  if (argc >= 2 && std::string_view(argv[1]) == "--trace") {
    if (argc != 3) {
      std::fputs("usage: tandemrun --trace DIR (a job's flight records)\n", stderr);
      return 2;
    }
    const auto set = tandem::read_flight_dumps(argv[2]);
    std::fputs(tandem::flight_trace_report(set).c_str(), stdout);
    return set.files.empty() ? 1 : 0;
  }
  const auto parsed = tandem::launch::detail::parse_command_line(argc, argv);
  tandem::launch::detail::hide_token_arguments(argc, argv, parsed.options.command.size());
  if (parsed.exit_code >= 0) {
    std::fputs(parsed.output.c_str(), parsed.exit_code == 0 ? stdout : stderr);
    return parsed.exit_code;
  }
  tandem::launch::LaunchPlan plan;
  try {
    plan = tandem::launch::resolve(parsed.options);
  } catch (const tandem::Error& error) {
    std::fprintf(stderr, "tandemrun: %s: %s\nRun with --help for usage.\n",
                 error.operation().c_str(), error.cause().c_str());
    return 2;
  }
  try {
    return tandem::launch::run(plan);
  } catch (const tandem::Error& error) {
    std::fprintf(stderr, "tandemrun: %s: %s\n", error.operation().c_str(), error.cause().c_str());
  } catch (const std::exception& error) {
    std::fprintf(stderr, "tandemrun: %s\n", error.what());
  }
  return 1;
}
