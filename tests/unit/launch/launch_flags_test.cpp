// tandemrun's flags (CLI11 spelling, resolve() checks), the worker environment and the failure
// summary, tested in-process.
#include <doctest/doctest.h>
#include <signal.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "support/fake_env.hpp"
#include "support/temp_dir.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/world.hpp"
#include "tandem/launch/detail/command_line.hpp"
#include "tandem/launch/launcher.hpp"
#include "tandem/launch/nodes.hpp"
#include "tandem/rendezvous/store.hpp"
#include "two_node_job.hpp"

namespace launch = tandem::launch;

namespace {

launch::detail::ParsedCommandLine parse(std::vector<std::string> args) {
  args.insert(args.begin(), "tandemrun");
  std::vector<const char*> argv;
  for (const auto& arg : args) argv.push_back(arg.c_str());
  return launch::detail::parse_command_line(static_cast<int>(argv.size()), argv.data());
}

/// A machine with 8 cores, `gpus` GPUs, no OMP_NUM_THREADS, port 40000 free, run id "rid".
launch::HostFacts host(int gpus = 0) {
  launch::HostFacts facts;
  facts.cpu_count = [] { return 8; };
  facts.gpu_count = [gpus] { return gpus; };
  facts.env = [](std::string_view) -> std::optional<std::string> { return std::nullopt; };
  facts.free_port = [] { return std::uint16_t{40000}; };
  facts.unique_id = [] { return std::string("rid"); };
  facts.random_token = [] { return std::string("random-token"); };
  facts.read_token_file = [](const std::string& path) { return "token-in-" + path; };
  return facts;
}

launch::LaunchOptions with_command(launch::LaunchOptions options) {
  options.command = {"./train"};
  return options;
}

/// The tandem::Error that resolve() throws, as "OPERATION: CAUSE".
std::string resolve_error(const launch::LaunchOptions& options, const launch::HostFacts& facts) {
  try {
    launch::resolve(options, facts);
  } catch (const tandem::Error& error) {
    return error.operation() + ": " + error.cause();
  }
  return "no error";
}

}  // namespace

TEST_CASE("every flag is read in its dashed and its underscored spelling") {
  const std::vector<std::pair<std::string, std::string>> spellings{
      {"--nproc-per-node", "--nproc_per_node"},
      {"--node-rank", "--node_rank"},
      {"--master-addr", "--master_addr"},
      {"--master-port", "--master_port"},
      {"--max-restarts", "--max_restarts"},
      {"--monitor-interval", "--monitor_interval"},
      {"--log-dir", "--log_dir"},
      {"--rdzv-id", "--rdzv_id"},
      {"--rdzv-endpoint", "--rdzv_endpoint"},
      {"--run-id", "--run_id"}};
  for (const auto& [dashed, underscored] : spellings) {
    for (const auto& flag : {dashed, underscored}) {
      CAPTURE(flag);
      const auto parsed = parse({flag, "7", "prog"});
      REQUIRE(parsed.exit_code == -1);
      const auto& o = parsed.options;
      const std::map<std::string, std::string> read{{"--nproc-per-node", o.nproc_per_node},
                                                    {"--node-rank", o.node_rank},
                                                    {"--master-addr", o.master_addr},
                                                    {"--master-port", o.master_port},
                                                    {"--max-restarts", o.max_restarts},
                                                    {"--monitor-interval", o.monitor_interval},
                                                    {"--log-dir", o.log_dir},
                                                    {"--rdzv-id", o.run_id},
                                                    {"--rdzv-endpoint", o.rdzv_endpoint},
                                                    {"--run-id", o.run_id}};
      CHECK(read.at(dashed) == "7");
      CHECK(o.command == std::vector<std::string>{"prog"});
    }
  }
}

TEST_CASE("the other flags, their defaults, and the program's arguments passed on unchanged") {
  const auto defaults = parse({"prog"});
  REQUIRE(defaults.exit_code == -1);
  CHECK(defaults.options.nproc_per_node == "1");
  CHECK(defaults.options.nnodes == "1");
  CHECK(defaults.options.node_rank == "0");
  CHECK(defaults.options.master_addr == "127.0.0.1");
  CHECK(defaults.options.master_port == "29500");
  CHECK(defaults.options.max_restarts == "0");
  CHECK(defaults.options.monitor_interval == "0.1");
  CHECK(defaults.options.role == "default");
  CHECK_FALSE(defaults.options.standalone);

  const auto parsed =
      parse({"--nnodes=2", "--standalone", "--redirects", "3", "-t", "0:1,1:2", "--role", "trainer",
             "--devices", "2,3", "--no-python", "prog", "--lr", "0.1", "--nnodes", "5", "-t"});
  REQUIRE(parsed.exit_code == -1);
  const auto& o = parsed.options;
  CHECK(o.nnodes == "2");
  CHECK(o.standalone);
  CHECK(o.redirects == "3");
  CHECK(o.tee == "0:1,1:2");
  CHECK(o.role == "trainer");
  CHECK(o.devices == "2,3");
  CHECK(o.command == std::vector<std::string>{"prog", "--lr", "0.1", "--nnodes", "5", "-t"});

  const auto separated = parse({"--nproc-per-node", "2", "--", "prog", "-x"});
  REQUIRE(separated.exit_code == -1);
  CHECK(separated.options.command == std::vector<std::string>{"prog", "-x"});
}

TEST_CASE("--help, an unknown flag and a missing program") {
  const auto help = parse({"--help"});
  CHECK(help.exit_code == 0);
  CHECK(help.output.find("Usage: tandemrun [OPTIONS] PROGRAM [ARGS...]") != std::string::npos);
  CHECK(help.output.find("--nproc_per_node") != std::string::npos);
  CHECK(help.output.find("CUDA_VISIBLE_DEVICES") != std::string::npos);

  const auto unknown = parse({"--bogus", "1", "prog"});
  CHECK(unknown.exit_code == 2);
  CHECK(unknown.output.find("--bogus") != std::string::npos);

  const auto missing = parse({"--nproc-per-node", "2"});
  CHECK(missing.exit_code == 2);
  CHECK(missing.output.find("no program") != std::string::npos);

  const auto no_value = parse({"prog_missing_value", "--nnodes"});
  CHECK(no_value.exit_code == -1);  // after PROGRAM everything is the program's
  const auto dangling = parse({"--nnodes"});
  CHECK(dangling.exit_code == 2);
  CHECK(dangling.output.find("--nnodes") != std::string::npos);
}

TEST_CASE("resolve: values, defaults and the machine's counts") {
  launch::LaunchOptions options;
  options.command = {"./train", "--lr", "0.1"};
  const auto plan = launch::resolve(options, host());
  CHECK(plan.nproc_per_node == 1);
  CHECK(plan.nnodes == 1);
  CHECK(plan.node_rank == 0);
  CHECK(plan.master_addr == "127.0.0.1");
  CHECK(plan.master_port == 29500);
  CHECK(plan.max_restarts == 0);
  CHECK(plan.monitor_interval == std::chrono::milliseconds(100));
  CHECK(plan.grace == std::chrono::seconds(5));
  CHECK(plan.role == "default");
  CHECK(plan.run_id == "rid");
  CHECK(plan.devices.empty());
  CHECK_FALSE(plan.set_omp_num_threads);  // torchrun sets it only for more than one process
  CHECK(plan.command == options.command);
  CHECK(launch::resolve({.nproc_per_node = "2", .command = {"./train"}}, host()).nproc_per_node ==
        2);

  auto nproc = [](const std::string& value, int gpus) {
    auto options = with_command({});
    options.nproc_per_node = value;
    return launch::resolve(options, host(gpus)).nproc_per_node;
  };
  CHECK(nproc("3", 0) == 3);
  CHECK(nproc("cpu", 4) == 8);
  CHECK(nproc("gpu", 4) == 4);
  CHECK(nproc("auto", 4) == 4);
  CHECK(nproc("auto", 0) == 8);

  auto devices = with_command({});
  devices.nproc_per_node = "gpu";
  devices.devices = "2,3,5";
  CHECK(launch::resolve(devices, host(8)).nproc_per_node == 3);  // the devices listed

  auto two_node = with_command({});
  two_node.nnodes = "2:2";
  two_node.node_rank = "1";
  two_node.nproc_per_node = "2";
  two_node.monitor_interval = "0.25";
  two_node.run_id = "job7";
  const auto fixed = launch::resolve(two_node, host());
  CHECK(fixed.nnodes == 2);
  CHECK(fixed.node_rank == 1);
  CHECK(fixed.monitor_interval == std::chrono::milliseconds(250));
  CHECK(fixed.run_id == "job7");
  CHECK(fixed.set_omp_num_threads);

  tandem::test::FakeEnv omp_set{{"OMP_NUM_THREADS", "4"}};
  auto facts = host();
  facts.env = omp_set.lookup();
  CHECK_FALSE(launch::resolve(two_node, facts).set_omp_num_threads);

  auto standalone = with_command({});
  standalone.standalone = true;
  standalone.master_addr = "10.1.1.1";
  const auto alone = launch::resolve(standalone, host());
  CHECK(alone.master_addr == "127.0.0.1");
  CHECK(alone.master_port == 40000);

  auto port_zero = with_command({});
  port_zero.master_port = "0";
  CHECK(launch::resolve(port_zero, host()).master_port == 40000);
}

TEST_CASE("resolve: a bad value is an error naming its flag") {
  const auto error = [](void (*set)(launch::LaunchOptions&), int gpus = 0) {
    auto options = with_command({});
    set(options);
    return resolve_error(options, host(gpus));
  };
  CHECK(error([](auto& o) { o.nproc_per_node = "two"; }) ==
        "--nproc-per-node: 'two' is not a number, 'cpu', 'gpu' or 'auto'");
  CHECK(error([](auto& o) { o.nproc_per_node = "0"; }).starts_with("--nproc-per-node: 0 is out"));
  CHECK(error([](auto& o) { o.nproc_per_node = "gpu"; }) ==
        "--nproc-per-node: 'gpu' asks for one worker per GPU, but no GPU was found");
  CHECK(error([](auto& o) { o.nnodes = "1:4"; }) ==
        "--nnodes: '1:4' is an elastic size; tandemrun supports fixed sizes only (N or N:N)");
  CHECK(error([](auto& o) { o.nnodes = "x"; }) == "--nnodes: 'x' is not an integer");
  CHECK(error([](auto& o) { o.nnodes = "2:"; }) == "--nnodes: '' is not an integer");
  CHECK(error([](auto& o) { o.node_rank = "1"; }) == "--node-rank: 1 is out of range [0, 0]");
  CHECK(error([](auto& o) { o.node_rank = "-1"; }) == "--node-rank: -1 is out of range [0, 0]");
  CHECK(error([](auto& o) { o.master_port = "70000"; }) ==
        "--master-port: 70000 is out of range [0, 65535]");
  CHECK(error([](auto& o) { o.master_port = "http"; }) ==
        "--master-port: 'http' is not an integer");
  CHECK(error([](auto& o) { o.master_addr = ""; }) == "--master-addr: must not be empty");
  CHECK(error([](auto& o) { o.max_restarts = "-2"; }).starts_with("--max-restarts: -2 is out"));
  CHECK(error([](auto& o) { o.monitor_interval = "fast"; }) ==
        "--monitor-interval: 'fast' is not a number of seconds");
  CHECK(error([](auto& o) { o.monitor_interval = "0"; }).starts_with("--monitor-interval: '0'"));
  CHECK(error([](auto& o) { o.redirects = "4"; }) ==
        "--redirects: '4' is not 0 (none), 1 (stdout), 2 (stderr) or 3 (both)");
  CHECK(error([](auto& o) { o.tee = "0:1,1"; }) == "--tee: '1' in '0:1,1' is not LOCAL_RANK:VALUE");
  CHECK(error([](auto& o) { o.tee = "a:1"; }) == "--tee: 'a' is not an integer");
  CHECK(error([](auto& o) { o.devices = "1,x"; }) ==
        "--devices: '1,x' is not a comma-separated list of GPU indices like 2,3,5");
  CHECK(error([](auto& o) {
          o.devices = "4";
          o.nproc_per_node = "2";
        }) == "--devices: lists 1 device(s) for 2 processes per node");
  CHECK(error([](auto& o) { o.role = ""; }) == "--role: must not be empty");
  CHECK(error([](auto& o) {
          o.standalone = true;
          o.nnodes = "2";
        }) == "--standalone: runs a single node, but --nnodes is 2");
  CHECK(error([](auto& o) {
          o.nnodes = "2";
          o.master_port = "0";
        }) == "--master-port: 0 (a free port) works on a single node only");
  CHECK(resolve_error({}, host()) == "PROGRAM: no program to run was given");
}

TEST_CASE("--redirects / --tee values") {
  const auto all = launch::parse_std_streams("--tee", "3");
  CHECK(all.for_rank(0) == launch::Std::all);
  CHECK(all.for_rank(17) == launch::Std::all);
  CHECK(all.any());
  const auto map = launch::parse_std_streams("--redirects", "0:1,1:2,3:0");
  CHECK(map.for_rank(0) == launch::Std::out);
  CHECK(map.for_rank(1) == launch::Std::err);
  CHECK(map.for_rank(2) == launch::Std::none);
  CHECK(map.for_rank(3) == launch::Std::none);
  CHECK(map.any());
  CHECK_FALSE(launch::parse_std_streams("--tee", "0").any());
  CHECK_FALSE(launch::parse_std_streams("--tee", "0:0").any());
}

TEST_CASE("the environment of every worker of 2 nodes x 2 processes") {
  auto options = with_command(tandem::test::two_node_job("10.0.0.1", "29400", "3", "job42"));
  for (int node = 0; node < 2; ++node) {
    options.node_rank = std::to_string(node);
    const auto plan = launch::resolve(options, host());
    for (int local = 0; local < 2; ++local) {
      CAPTURE(node);
      CAPTURE(local);
      const auto rank = std::to_string(node * 2 + local);
      const std::map<std::string, std::string> expected{
          {"RANK", rank},
          {"LOCAL_RANK", std::to_string(local)},
          {"WORLD_SIZE", "4"},
          {"LOCAL_WORLD_SIZE", "2"},
          {"GROUP_RANK", std::to_string(node)},
          {"GROUP_WORLD_SIZE", "2"},
          {"ROLE_RANK", rank},
          {"ROLE_NAME", "trainer"},
          {"ROLE_WORLD_SIZE", "4"},
          {"MASTER_ADDR", "10.0.0.1"},
          {"MASTER_PORT", "29400"},
          {"TORCHELASTIC_RESTART_COUNT", "2"},
          {"TORCHELASTIC_MAX_RESTARTS", "3"},
          {"TORCHELASTIC_RUN_ID", "job42"},
          {"OMP_NUM_THREADS", "1"},
      };
      const auto vars = launch::worker_variables(plan, local, 2);
      CHECK(vars == expected);

      // And World reads them back as the same position.
      const auto world =
          tandem::World::from_env([&](std::string_view name) -> std::optional<std::string> {
            const auto found = vars.find(std::string(name));
            if (found == vars.end()) return std::nullopt;
            return found->second;
          });
      CHECK(world.rank == node * 2 + local);
      CHECK(world.world_size == 4);
      CHECK(world.local_rank == local);
      CHECK(world.node_rank == node);
      CHECK(world.nnodes == 2);
    }
  }
}

TEST_CASE("the whole environment: inherited variables kept, the launcher's put over them") {
  auto options = with_command({});
  options.devices = "2,3,5";
  options.nproc_per_node = "3";
  const auto plan = launch::resolve(options, host());
  std::string keep = "KEEP=me";
  std::string stale = "RANK=99";
  std::string cuda = "CUDA_VISIBLE_DEVICES=0,1";
  char* base[] = {keep.data(), stale.data(), cuda.data(), nullptr};
  const auto environment = launch::worker_environment(plan, 2, 0, base);
  std::map<std::string, int> seen;
  std::map<std::string, std::string> values;
  for (const auto& entry : environment) {
    const auto eq = entry.find('=');
    REQUIRE(eq != std::string::npos);
    ++seen[entry.substr(0, eq)];
    values[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  for (const auto& [key, count] : seen) CHECK_MESSAGE(count == 1, key);
  CHECK(values.at("KEEP") == "me");
  CHECK(values.at("RANK") == "2");
  CHECK(values.at("CUDA_VISIBLE_DEVICES") == "5");
  CHECK(launch::worker_variables(plan, 0, 0).at("CUDA_VISIBLE_DEVICES") == "2");
  CHECK(launch::worker_variables(plan, 1, 0).at("CUDA_VISIBLE_DEVICES") == "3");
  const auto without = launch::resolve(with_command({}), host());
  CHECK_FALSE(launch::worker_variables(without, 0, 0).contains("CUDA_VISIBLE_DEVICES"));
}

TEST_CASE("the failure summary names the root cause first, with code or signal name") {
  using tandem::launch::WorkerFailure;
  const auto now = std::chrono::system_clock::now();
  const std::vector<WorkerFailure> failures{
      {3, 1, {7, 0}, 4242, "node-a", now},
      {2, 0, {0, SIGSEGV}, 4241, "node-a", now},
  };
  const auto text = launch::failure_summary("./train", failures);
  CHECK(text.find("./train FAILED") != std::string::npos);
  const auto root = text.find("Root Cause (first observed failure):");
  const auto other = text.find("Other Failures:");
  REQUIRE(root != std::string::npos);
  REQUIRE(other != std::string::npos);
  CHECK(root < other);
  const auto first = text.substr(root, other - root);
  CHECK(first.find("rank      : 3 (local_rank: 1)") != std::string::npos);
  CHECK(first.find("exitcode  : 7 (pid: 4242)") != std::string::npos);
  CHECK(first.find("host      : node-a") != std::string::npos);
  CHECK(first.find("time      : 20") != std::string::npos);
  const auto second = text.substr(other);
  CHECK(second.find("rank      : 2 (local_rank: 0)") != std::string::npos);
  CHECK(second.find("exitcode  : -11 (pid: 4241)") != std::string::npos);
  CHECK(second.find("Signal 11 (SIGSEGV) received by PID 4241") != std::string::npos);
}

TEST_CASE("the failure summary shows an error file's message in place of the exit code") {
  const auto now = std::chrono::system_clock::now();
  std::vector<launch::WorkerFailure> failures{
      {1, 1, {1, 0}, 4243, "node-a", now, "tandem::Error: tandem: rank 1: barrier: timed out"},
      {0, 0, {1, 0}, 4244, "node-a", now, "RuntimeError: CUDA error\nsecond line"},
      {2, 0, {1, 0}, 4245, "node-a", now, ""},
  };
  const auto text = launch::failure_summary("./train", failures);
  // tandem's what() alone (it says "tandem: " already); another type's message whole, its
  // second line under the first; no message: the exit code.
  CHECK(text.find("  error     : tandem: rank 1: barrier: timed out\n") != std::string::npos);
  CHECK(text.find("tandem::Error:") == std::string::npos);
  CHECK(text.find("  error     : RuntimeError: CUDA error\n              second line\n") !=
        std::string::npos);
  CHECK(text.find("  error     : exited with code 1\n") != std::string::npos);
}

TEST_CASE("read_error_file reads what run_main and Python's @record write") {
  tandem::test::TempDir dir;
  const std::string path = dir.str() + "/error.json";
  const auto write = [&](const std::string& text) { std::ofstream(path) << text; };

  write(tandem::error_file_json("tandem::Error", "tandem: rank 0: all_reduce: \"x\"\n\tdone",
                                "trace", 1700000000));
  CHECK(tandem::read_error_file(path) ==
        std::optional<std::string>("tandem::Error: tandem: rank 0: all_reduce: \"x\"\n\tdone"));
  // torch's layout with members in another order, nested values to skip, \u escapes (a
  // surrogate pair too) and a message that is a plain string.
  write(R"({"extra": [1, {"a": null}, true, -2.5e3], "message": {"extraInfo": {"py_callstack": )"
        R"("T", "timestamp": "1"}, "message": "RuntimeError: caf\u00e9 \ud83d\ude00 \/"}})");
  CHECK(tandem::read_error_file(path) ==
        std::optional<std::string>("RuntimeError: caf\xc3\xa9 \xf0\x9f\x98\x80 /"));
  write(R"({"message": "ValueError: plain"})");
  CHECK(tandem::read_error_file(path) == std::optional<std::string>("ValueError: plain"));
  for (const std::string& bad :
       std::vector<std::string>{"", "{", "{\"message\": 3}", "[\"message\"]",
                                "{\"message\": {\"message\": \"unterminated}}",
                                "{\"deep\": " + std::string(5000, '[')}) {
    CAPTURE(bad);
    write(bad);
    CHECK_FALSE(tandem::read_error_file(path).has_value());
  }
  CHECK_FALSE(tandem::read_error_file(dir.str() + "/missing.json").has_value());
}

TEST_CASE("resolve: error files unless the launcher's environment has TORCHELASTIC_ERROR_FILE") {
  launch::LaunchOptions options;
  options.command = {"./train"};
  CHECK(launch::resolve(options, host()).error_files);
  auto facts = host();
  facts.env = [](std::string_view name) -> std::optional<std::string> {
    if (name == "TORCHELASTIC_ERROR_FILE") return "/tmp/mine.json";
    return std::nullopt;
  };
  CHECK_FALSE(launch::resolve(options, facts).error_files);
}

TEST_CASE("signal names and exit descriptions") {
  using launch::detail::ExitStatus;
  CHECK(launch::detail::signal_name(SIGSEGV) == "SIGSEGV");
  CHECK(launch::detail::signal_name(SIGTERM) == "SIGTERM");
  CHECK(launch::detail::signal_name(SIGRTMIN + 3).starts_with("signal "));
  CHECK(ExitStatus{3, 0}.describe() == "exit code 3");
  CHECK(ExitStatus{0, SIGKILL}.describe() == "signal SIGKILL (9)");
  CHECK(ExitStatus{0, SIGKILL}.torch_exitcode() == -9);
  CHECK_FALSE(ExitStatus{0, 0}.failed());
}

TEST_CASE("the job token: flags, file, inherited, random on one node, none across nodes") {
  for (const auto* flag : {"--rdzv-token", "--rdzv_token"}) {
    const auto parsed = parse({flag, "s3cret", "prog"});
    REQUIRE(parsed.exit_code == -1);
    CHECK(parsed.options.rdzv_token == "s3cret");
  }
  for (const auto* flag : {"--rdzv-token-file", "--rdzv_token_file"}) {
    const auto parsed = parse({flag, "/run/token", "prog"});
    REQUIRE(parsed.exit_code == -1);
    CHECK(parsed.options.rdzv_token_file == "/run/token");
  }
  CHECK(parse({"--help"}).output.find("--rdzv-token-file") != std::string::npos);

  auto options = with_command({});
  CHECK(launch::resolve(options, host()).store_token == "random-token");  // one node
  options.nnodes = "2";
  CHECK(launch::resolve(options, host()).store_token.empty());  // every node must share it
  options.rdzv_token = "s3cret";
  const auto given = launch::resolve(options, host());
  CHECK(given.store_token == "s3cret");
  CHECK(launch::worker_variables(given, 0, 0).at("TANDEM_STORE_TOKEN") == "s3cret");
  options.rdzv_token_file = "f";
  CHECK(resolve_error(options, host()) ==
        "--rdzv-token: give --rdzv-token or --rdzv-token-file, not both");
  options.rdzv_token.clear();
  CHECK(launch::resolve(options, host()).store_token == "token-in-f");
  options.rdzv_token_file.clear();

  auto inherited = host();
  inherited.env = [](std::string_view name) -> std::optional<std::string> {
    if (name == "TANDEM_STORE_TOKEN") return "from-env";
    return std::nullopt;
  };
  CHECK(launch::resolve(options, inherited).store_token == "from-env");
  options.nnodes = "1";
  CHECK(launch::resolve(options, inherited).store_token == "from-env");

  options.rdzv_token = std::string(1025, 't');
  CHECK(resolve_error(options, host()).starts_with("--rdzv-token: the token has 1025 bytes"));
  options.rdzv_token.clear();
  auto no_token = launch::resolve(options, host());
  no_token.store_token.clear();
  CHECK_FALSE(launch::worker_variables(no_token, 0, 0).contains("TANDEM_STORE_TOKEN"));
}

TEST_CASE("random tokens and token files") {
  const auto a = launch::detail::random_token();
  const auto b = launch::detail::random_token();
  CHECK(a.size() == 64);
  CHECK(a.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(a != b);

  tandem::test::TempDir dir;
  const auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir.path() / name) << text;
    return (dir.path() / name).string();
  };
  const auto error = [](const std::string& path) {
    try {
      launch::detail::read_token_file(path);
    } catch (const tandem::Error& e) {
      return e.operation() + ": " + e.cause();
    }
    return std::string("no error");
  };
  CHECK(launch::detail::read_token_file(write("t1", "s3cret\n")) == "s3cret");
  CHECK(launch::detail::read_token_file(write("t2", "s3cret\r\n")) == "s3cret");
  CHECK(launch::detail::read_token_file(write("t3", "no newline")) == "no newline");
  CHECK(error(write("empty", "\n")).ends_with("is empty"));
  CHECK(error(write("long", std::string(1025, 'x'))).ends_with("holds more than 1024 bytes"));
  CHECK(error(dir.path().string()).ends_with("is not a regular file"));
  CHECK(error((dir.path() / "missing").string()).starts_with("--rdzv-token-file: cannot open"));
}

TEST_CASE("a token given on the command line is blanked in the launcher's argv") {
  std::vector<std::string> args{
      "tandemrun", "--rdzv-token", "s3cret", "--rdzv_token=abc", "--nnodes", "1",
      "prog",      "--rdzv-token", "kept"};
  std::vector<char*> argv;
  for (auto& arg : args) argv.push_back(arg.data());
  launch::detail::hide_token_arguments(static_cast<int>(argv.size()), argv.data(), 3);
  CHECK(std::string(argv[2]) == "******");
  CHECK(std::string(argv[3]) == "--rdzv_token=***");
  CHECK(std::string(argv[5]) == "1");
  CHECK(std::string(argv[8]) == "kept");  // the program's own argument
}

namespace {

/// --nnodes 1:3 --elastic --nproc-per-node 2 --rdzv-endpoint `endpoint` --rdzv-token job-token.
launch::LaunchOptions growing_job(std::string endpoint) {
  auto options = with_command({});
  options.nnodes = "1:3";
  options.elastic = true;
  options.nproc_per_node = "2";
  options.rdzv_endpoint = std::move(endpoint);
  options.rdzv_token = "job-token";
  return options;
}

}  // namespace

TEST_CASE("--nnodes MIN:MAX --elastic --rdzv-endpoint: a job that grows") {
  auto options = growing_job("10.0.0.1:29400");
  const auto plan = launch::resolve(options, host());
  CHECK(plan.node_slots);
  CHECK(plan.rdzv_host == "10.0.0.1");
  CHECK(plan.rdzv_port == 29400);
  CHECK(plan.nnodes == 1);
  CHECK(plan.max_world_size() == 6);
  CHECK_FALSE(plan.joins_running_job);
  auto vars = launch::worker_variables(plan, 1, 0);
  CHECK(vars.at("TANDEM_ELASTIC_MAX_WORLD_SIZE") == "6");
  CHECK(vars.at("WORLD_SIZE") == "2");

  // A launcher of such a job needs a token the others can have: no random one on a single node.
  options.rdzv_token.clear();
  CHECK(launch::resolve(options, host()).store_token.empty());
  options.rdzv_endpoint = "[::1]:29400";
  CHECK(launch::resolve(options, host()).rdzv_host == "::1");

  const auto error = [](void (*set)(launch::LaunchOptions&)) {
    auto o = with_command({});
    o.nnodes = "1:2";
    o.elastic = true;
    o.rdzv_endpoint = "10.0.0.1:29400";
    set(o);
    return resolve_error(o, host());
  };
  const std::string needs =
      "--rdzv-endpoint: is where nodes started later join a running job: it needs --elastic and "
      "--nnodes MIN:MAX with MIN < MAX";
  CHECK(error([](auto& o) { o.nnodes = "2"; }) == needs);
  CHECK(error([](auto& o) { o.elastic = false; }) ==
        "--nnodes: '1:2' is an elastic size; tandemrun supports fixed sizes only (N or N:N)");
  CHECK(error([](auto& o) { o.rdzv_endpoint = "10.0.0.1"; }) ==
        "--rdzv-endpoint: '10.0.0.1' is not HOST:PORT");
  CHECK(error([](auto& o) { o.rdzv_endpoint = "h:0"; }) ==
        "--rdzv-endpoint: 0 is out of range [1, 65535]");
  CHECK(error([](auto& o) {
          o.master_addr = "10.0.0.1";
          o.master_port = "29400";
        }) ==
        "--rdzv-endpoint: 10.0.0.1:29400 is MASTER_ADDR:MASTER_PORT, where rank 0's store "
        "listens: give the launchers another port");
}

TEST_CASE("node slots: node 0 opens them, later nodes take them up to MAX, then are refused") {
  const auto plan = launch::resolve(growing_job("127.0.0.1:29400"), host());
  tandem::HashStore store;
  launch::open_node_slots(store, plan);

  const auto second = launch::take_node_slot(store, plan, std::chrono::seconds(1));
  CHECK(second.joins_running_job);
  CHECK(second.node_rank == 1);
  CHECK(second.nnodes == 2);
  auto vars = launch::worker_variables(second, 1, 0);
  CHECK(vars.at("RANK") == "3");
  CHECK(vars.at("WORLD_SIZE") == "4");
  CHECK(vars.at("GROUP_RANK") == "1");
  CHECK(vars.at("TANDEM_ELASTIC_MAX_WORLD_SIZE") == "6");
  CHECK(launch::take_node_slot(store, plan, std::chrono::seconds(1)).node_rank == 2);

  const auto refused = [&](const launch::LaunchPlan& p) {
    try {
      (void)launch::take_node_slot(store, p, std::chrono::seconds(1));
    } catch (const tandem::Error& e) {
      return e.operation() + ": " + e.cause();
    }
    return std::string("admitted");
  };
  CHECK(refused(plan) ==
        "--nnodes: the job at 127.0.0.1:29400 already has its 3 nodes, the most --nnodes 1:3 "
        "allows: this node cannot join it (a node's slot is not given back when its workers "
        "end)");
  tandem::HashStore fresh;
  launch::open_node_slots(fresh, plan);
  auto other = plan;
  other.nproc_per_node = 4;
  try {
    (void)launch::take_node_slot(fresh, other, std::chrono::seconds(1));
    FAIL("a launcher with another --nproc-per-node joined");
  } catch (const tandem::Error& e) {
    CHECK(std::string(e.cause()) ==
          "the job at 127.0.0.1:29400 runs --nnodes 1:3 with 2 process(es) per node; this "
          "launcher has --nnodes 1:3 and 4: give every node the same --nnodes and "
          "--nproc-per-node");
  }
  tandem::HashStore empty;  // no job there: the wait for its description ends in an Error
  CHECK_THROWS_AS((void)launch::take_node_slot(empty, plan, std::chrono::milliseconds(20)),
                  tandem::Error);
}
