// tandemrun - the torchrun-compatible launcher: `tandemrun [OPTIONS] PROGRAM [ARGS...]`, and
// `tandemrun --trace DIR`, which merges the flight records a job left in DIR.
// Everything it does lives in include/tandem/launch/launcher.hpp; this file only wires the
// command line to it, hosts or reaches the store where the launchers of a job that grows meet
// (--rdzv-endpoint, launch/nodes.hpp), and turns errors into exit codes (2: bad command line, 1:
// anything else).
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <optional>
#include <string_view>

#include "tandem/comm/flight_trace.hpp"
#include "tandem/core/error.hpp"
#include "tandem/launch/detail/command_line.hpp"
#include "tandem/launch/launcher.hpp"
#include "tandem/launch/nodes.hpp"
#include "tandem/rendezvous/tcp_store.hpp"

namespace {

/// The store where the launchers of a job that grows meet (plan.node_slots). Node 0's launcher
/// hosts it at the endpoint and opens the node slots; a launcher that cannot host it there
/// (another launcher already does, on this host or on the endpoint's) came later: it takes a free
/// slot, which makes it a node of the running job. Without node_slots: nothing.
std::optional<tandem::TcpStore> meet_other_nodes(tandem::launch::LaunchPlan& plan) {
  // Nodes 1 .. MIN-1 are nodes the job starts with: their slot is their node rank.
  if (!plan.node_slots || plan.node_rank != 0) return std::nullopt;
  tandem::TcpStoreOptions options;
  options.host = plan.rdzv_host;
  options.port = static_cast<std::uint16_t>(plan.rdzv_port);
  options.token = plan.store_token;
  options.timeout = std::chrono::seconds(60);
  options.client_name = "tandemrun";
  options.server_hint = "node 0's tandemrun hosts it (--rdzv-endpoint): is it running?";
  {
    // The server's thread must not take the signals the launcher forwards to its workers.
    sigset_t forwarded;
    sigset_t original;
    sigemptyset(&forwarded);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaddset(&forwarded, sig);
    ::pthread_sigmask(SIG_BLOCK, &forwarded, &original);
    options.is_server = true;
    std::optional<tandem::TcpStore> hosted;
    try {
      hosted.emplace(options);
    } catch (const tandem::Error&) {  // hosted elsewhere already: this node comes later
    }
    ::pthread_sigmask(SIG_SETMASK, &original, nullptr);
    if (hosted) {
      tandem::launch::open_node_slots(*hosted, plan);
      return hosted;
    }
    options.is_server = false;
  }
  tandem::TcpStore client(options);
  plan = tandem::launch::take_node_slot(client, plan, options.timeout);
  return std::nullopt;
}

}  // namespace

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
    const auto launchers = meet_other_nodes(plan);  // node 0 hosts it while the job runs
    return tandem::launch::run(plan);
  } catch (const tandem::Error& error) {
    std::fprintf(stderr, "tandemrun: %s: %s\n", error.operation().c_str(), error.cause().c_str());
  } catch (const std::exception& error) {
    std::fprintf(stderr, "tandemrun: %s\n", error.what());
  }
  return 1;
}
