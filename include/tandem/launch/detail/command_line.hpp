// tandem/launch/detail/command_line.hpp - tandemrun's command line (torchrun's flags, dashed and
// underscored) parsed with CLI11 into LaunchOptions; used by tools/tandemrun.cpp and its tests.
//   auto parsed = tandem::launch::detail::parse_command_line(argc, argv);
// Needs: CLI11 (header-only; CMake target CLI11::CLI11).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "tandem/launch/launcher.hpp"

namespace tandem::launch::detail {

/// What the command line asks for: options to resolve, or an exit right away (--help, a syntax
/// error) with text for stdout (exit code 0) or stderr (otherwise).
struct ParsedCommandLine {
  LaunchOptions options;
  int exit_code = -1;  ///< -1: go on and launch
  std::string output;
};

inline constexpr const char* tandemrun_footer =
    R"(PROGRAM runs as it is (no Python): everything after PROGRAM is passed to it unchanged.

Each worker gets torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_NAME, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID, and
OMP_NUM_THREADS=1 when unset and more than one process runs per node. RANK is
node_rank * nproc_per_node + local_rank. Without --devices, CUDA_VISIBLE_DEVICES is passed on
unchanged (by convention local rank i uses device i); with --devices 2,3,5 local rank i sees only
the i-th listed device (CUDA_VISIBLE_DEVICES=<that index>).

Output lines of rank N are shown behind "[rank N] ", unless --redirects sends them to
LOG_DIR/RUN_ID/attempt_K/LOCAL_RANK/{stdout,stderr}.log (--tee: to both).
A failing worker stops the others (after 2 s in which they may fail on their own: SIGTERM,
SIGKILL 5 s later) and the launcher exits 1 after a summary, unless restarts are left. With
--elastic, a worker ended by a signal (or stopped when all others have finished) is reported as
lost and the others go on (tandem::Elastic, docs/elastic.md); while --max-restarts are left and
no worker has finished, a lost worker is restarted alone, with TANDEM_ELASTIC_JOIN=1, and joins
the running group (each replacement takes one restart). Each
worker gets its own TORCHELASTIC_ERROR_FILE (unless the launcher's environment sets one); the
message a worker writes there (tandem::run_main, torch's @record) is the summary's error, and
the summary names first the worker that failed first on its own, not one that followed it.
SIGINT/SIGTERM/SIGHUP/SIGQUIT are forwarded to the workers; the launcher then exits 128+signal.

Flight records: each worker writes its communicators' last operations to
TANDEM_FLIGHT_RECORDER_DIR (LOG_DIR/RUN_ID/attempt_K/flight, or a directory of the launch kept
when it fails) on a failure, on SIGUSR1 and when a collective waits long; the launcher says when
a worker is stopped or the ranks wait long, and the summary merges the records.
`tandemrun --trace DIR` prints what the records of DIR say.

Multi-node: run on every node with the same --nnodes, --nproc-per-node, --master-addr (node 0's
address), --master-port and --rdzv-id, and that node's --node-rank.

Job token: rank 0's store (tandem's TcpStore) serves only clients that present the job's token,
given to workers as TANDEM_STORE_TOKEN. A single node gets a fresh random token per launch;
several nodes need the same --rdzv-token-file (or TANDEM_STORE_TOKEN) on every node, else the
store takes any client that can reach MASTER_ADDR:MASTER_PORT.)";

/// "Usage: tandemrun [OPTIONS] PROGRAM [ARGS...]": CLI11 does not know about PROGRAM.
class TandemrunFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App* /*app*/, std::string name) const override {
    return "Usage: " + name + " [OPTIONS] PROGRAM [ARGS...]\n";
  }
};

/// Where the workers run and how they meet: node count and index, workers per node, node 0's
/// address and port.
inline void add_topology_options(CLI::App& app, LaunchOptions& o) {
  app.add_option("--nproc-per-node,--nproc_per_node", o.nproc_per_node,
                 "Workers on this node: N, cpu (one per core), gpu (one per GPU) or auto (gpu if "
                 "there are GPUs, else cpu)")
      ->type_name("N|cpu|gpu|auto")
      ->capture_default_str();
  app.add_option("--nnodes", o.nnodes,
                 "Number of nodes: N, or N:N; MIN:MAX with --elastic starts the job with MIN "
                 "nodes, and with --rdzv-endpoint nodes started later join it, up to MAX")
      ->type_name("N")
      ->capture_default_str();
  app.add_option("--node-rank,--node_rank", o.node_rank, "This node's index, 0 .. nnodes-1")
      ->type_name("N")
      ->capture_default_str();
  app.add_option("--master-addr,--master_addr", o.master_addr,
                 "Address of node 0, where rank 0 listens")
      ->type_name("HOST")
      ->capture_default_str();
  app.add_option("--master-port,--master_port", o.master_port, "Port on node 0 for rank 0")
      ->type_name("PORT")
      ->capture_default_str();
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", o.rdzv_endpoint,
                 "With --elastic and --nnodes MIN:MAX: where the launchers meet (node 0's hosts a "
                 "store there; give every node the same); a node started later joins the running "
                 "job through it")
      ->type_name("HOST:PORT");
  app.add_flag("--standalone", o.standalone,
               "Single node: 127.0.0.1 and a free port, a unique run id");
}

/// How the launcher watches the workers and where their output goes.
inline void add_supervision_options(CLI::App& app, LaunchOptions& o) {
  app.add_option("--max-restarts,--max_restarts", o.max_restarts,
                 "Restarts of the worker group after a failure (with --elastic, also "
                 "replacements of lost workers)")
      ->type_name("N")
      ->capture_default_str();
  app.add_flag("--elastic", o.elastic,
               "A worker ended by a signal is lost, not a failure: the others go on "
               "(tandem::Elastic heals them); the launch succeeds when the workers left exit 0");
  app.add_option("--monitor-interval,--monitor_interval", o.monitor_interval,
                 "Seconds between checks of the workers")
      ->type_name("SECONDS")
      ->capture_default_str();
  app.add_option("-r,--redirects", o.redirects,
                 "Send workers' output to files under --log-dir instead of the console: "
                 "0 none, 1 stdout, 2 stderr, 3 both; or per local rank: 0:1,1:2")
      ->type_name("STD")
      ->capture_default_str();
  app.add_option("-t,--tee", o.tee, "As --redirects, but also show the output on the console")
      ->type_name("STD")
      ->capture_default_str();
  app.add_option("--log-dir,--log_dir", o.log_dir,
                 "Directory of the log files (default: a new temporary directory)")
      ->type_name("DIR");
}

/// What names the job and what each worker is given: role, run id, devices, the job token.
inline void add_job_options(CLI::App& app, LaunchOptions& o, bool& no_python) {
  app.add_option("--role", o.role, "Role name of the workers (ROLE_NAME)")
      ->type_name("NAME")
      ->capture_default_str();
  app.add_option("--rdzv-id,--rdzv_id,--run-id,--run_id", o.run_id,
                 "Job id (TORCHELASTIC_RUN_ID); default: a unique id; give all nodes the same")
      ->type_name("ID");
  app.add_option("--devices", o.devices,
                 "GPUs of this node, e.g. 2,3,5: local rank i gets CUDA_VISIBLE_DEVICES=<i-th>")
      ->type_name("LIST");
  app.add_option("--rdzv-token,--rdzv_token", o.rdzv_token,
                 "Job token rank 0's store demands, given to workers as TANDEM_STORE_TOKEN "
                 "(default: TANDEM_STORE_TOKEN, else a random one on a single node); `ps` shows "
                 "it: prefer --rdzv-token-file")
      ->type_name("TOKEN");
  app.add_option("--rdzv-token-file,--rdzv_token_file", o.rdzv_token_file,
                 "File holding the job token (less a final newline; at most 1024 bytes)")
      ->type_name("FILE");
  app.add_flag("--no-python,--no_python", no_python,
               "Accepted for torchrun compatibility: tandemrun always runs PROGRAM directly");
}

/// PROGRAM and its arguments from what CLI11 left over (a leading "--" dropped); an empty
/// program, or a flag CLI11 did not know where PROGRAM should be, ends the launch with exit 2.
inline void take_program(std::vector<std::string> rest, ParsedCommandLine& parsed) {
  if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());
  if (rest.empty()) {
    parsed.exit_code = 2;
    parsed.output =
        "tandemrun: PROGRAM: no program to run was given\nUsage: tandemrun [OPTIONS] PROGRAM "
        "[ARGS...]\nRun with --help for usage.\n";
    return;
  }
  if (rest.front().size() > 1 && rest.front().front() == '-') {
    parsed.exit_code = 2;
    parsed.output = "tandemrun: " + rest.front() +
                    ": unknown flag (the program comes after the flags)\nRun with --help for "
                    "usage.\n";
    return;
  }
  parsed.options.command = std::move(rest);
}

inline ParsedCommandLine parse_command_line(int argc, const char* const* argv) {
  ParsedCommandLine parsed;
  CLI::App app(
      "tandemrun: starts PROGRAM as the workers of one node of a data-parallel job, "
      "with torchrun's flags and environment.",
      "tandemrun");
  app.formatter(std::make_shared<TandemrunFormatter>());
  app.prefix_command();
  app.footer(tandemrun_footer);
  app.get_formatter()->column_width(40);

  bool no_python = false;
  add_topology_options(app, parsed.options);
  add_supervision_options(app, parsed.options);
  add_job_options(app, parsed.options, no_python);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    parsed.exit_code = 0;
    parsed.output = app.help();
    return parsed;
  } catch (const CLI::ParseError& error) {
    parsed.exit_code = 2;
    parsed.output = "tandemrun: " + std::string(error.what()) + "\nRun with --help for usage.\n";
    return parsed;
  }
  take_program(app.remaining(), parsed);
  return parsed;
}

/// Overwrites the values of --rdzv-token in the launcher's own argv (`ps` and /proc/PID/cmdline
/// read them there) once they are parsed; the program's arguments (the last `program_args`) are
/// left alone. The token shows until this runs: a file or TANDEM_STORE_TOKEN never shows.
inline void hide_token_arguments(int argc, char** argv, std::size_t program_args) {
  const auto flags = static_cast<int>(static_cast<std::size_t>(argc) - program_args);
  const auto blank = [](char* text) {
    for (; *text != '\0'; ++text) *text = '*';
  };
  for (int i = 1; i < flags; ++i) {
    const std::string_view arg(argv[i]);
    if (arg == "--") break;
    if ((arg == "--rdzv-token" || arg == "--rdzv_token") && i + 1 < flags) {
      blank(argv[++i]);
    } else if (arg.starts_with("--rdzv-token=") || arg.starts_with("--rdzv_token=")) {
      blank(argv[i] + std::string_view("--rdzv-token=").size());
    }
  }
}

}  // namespace tandem::launch::detail
