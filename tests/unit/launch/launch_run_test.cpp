// The built tandemrun end to end: environment, output, logs, failures, restarts and signals.
// TANDEMRUN and LAUNCH_WORKER are the paths of the launcher and of launch_test_worker.cpp.
#include <doctest/doctest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "launch_test_support.hpp"
#include "tandem/launch/launcher.hpp"
#include "two_node_job.hpp"

namespace fs = std::filesystem;
using tandem::test::read_file;
using tandem::test::read_key_values;
using tandem::test::TempDir;

namespace {

tandem::test::Result tandemrun(const std::vector<std::string>& args) {
  // Built front to back: at -O3, GCC 12 flags `args.insert(args.begin(), TANDEMRUN)` with a
  // -Warray-bounds false positive in the inlined move of the inserted string.
  std::vector<std::string> command{TANDEMRUN};
  command.reserve(args.size() + 1);
  for (const auto& arg : args) command.push_back(arg);
  return tandem::test::run(command);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

bool process_gone(pid_t pid) {
  return ::kill(pid, 0) < 0 && errno == ESRCH;
}

}  // namespace

TEST_CASE("workers get exactly the launcher's environment, and their arguments unchanged") {
  TempDir dir;
  ::unsetenv("OMP_NUM_THREADS");
  ::setenv("TANDEM_TEST_PASSTHROUGH", "kept", 1);
  ::setenv("RANK", "99", 1);  // a stale value the launcher must replace
  const auto result = tandemrun(
      {"--nnodes",      "2",        "--node_rank",   "1",         "--nproc-per-node", "2",
       "--master-addr", "10.9.8.7", "--master_port", "29999",     "--max-restarts",   "2",
       "--role",        "trainer",  "--rdzv-id",     "job5",      LAUNCH_WORKER,      "env",
       dir.str(),       "--lr",     "0.1",           "--nnodes=3"});
  ::unsetenv("RANK");
  ::unsetenv("TANDEM_TEST_PASSTHROUGH");
  REQUIRE_MESSAGE(result.exit_code == 0, result.err);
  CHECK(contains(result.err, "Setting OMP_NUM_THREADS environment variable"));

  // What the in-process environment builder says for the same flags...
  auto options = tandem::test::two_node_job("10.9.8.7", "29999", "2", "job5");
  options.node_rank = "1";
  options.command = {"worker"};
  tandem::launch::HostFacts facts;
  facts.env = [](std::string_view) -> std::optional<std::string> { return std::nullopt; };
  const auto plan = tandem::launch::resolve(options, facts);

  // ...is what the workers of node 1 (ranks 2 and 3) saw.
  for (int local = 0; local < 2; ++local) {
    CAPTURE(local);
    const auto seen = read_key_values(dir / ("env_" + std::to_string(2 + local) + ".txt"));
    REQUIRE_FALSE(seen.empty());
    for (const auto& [key, value] : tandem::launch::worker_variables(plan, local, 0)) {
      CHECK_MESSAGE(seen.at(key) == value, key);
    }
    CHECK(seen.at("RANK") == std::to_string(2 + local));
    CHECK(seen.at("GROUP_RANK") == "1");
    CHECK(seen.at("TORCHELASTIC_RUN_ID") == "job5");
    CHECK(seen.at("OMP_NUM_THREADS") == "1");
    CHECK(seen.at("TANDEM_TEST_PASSTHROUGH") == "kept");
    CHECK(seen.at("ARGS") == "--lr|0.1|--nnodes=3");
  }
}

TEST_CASE("the command line through the binary: spellings, bad values, help") {
  TempDir dir;
  const auto ok = tandemrun({"--nproc_per_node=2", "--standalone", "--max_restarts", "0",
                             LAUNCH_WORKER, "env", dir.str()});
  REQUIRE_MESSAGE(ok.exit_code == 0, ok.err);
  const auto env0 = read_key_values(dir / "env_0.txt");
  const auto env1 = read_key_values(dir / "env_1.txt");
  CHECK(env0.at("WORLD_SIZE") == "2");
  CHECK(env0.at("MASTER_ADDR") == "127.0.0.1");
  CHECK(env0.at("MASTER_PORT") != "29500");  // --standalone picks a free port
  CHECK(env0.at("MASTER_PORT") == env1.at("MASTER_PORT"));
  CHECK(env0.at("TORCHELASTIC_RUN_ID").size() == 36);  // a UUID
  CHECK(env0.at("TORCHELASTIC_RUN_ID") == env1.at("TORCHELASTIC_RUN_ID"));
  CHECK(env0.at("CUDA_VISIBLE_DEVICES") ==
        read_key_values(dir / "env_1.txt").at("CUDA_VISIBLE_DEVICES"));  // left as it is

  const auto elastic = tandemrun({"--nnodes", "1:2", LAUNCH_WORKER, "env", dir.str()});
  CHECK(elastic.exit_code == 2);
  CHECK(contains(elastic.err, "--nnodes: '1:2' is an elastic size"));

  const auto bad = tandemrun({"--monitor_interval", "soon", LAUNCH_WORKER});
  CHECK(bad.exit_code == 2);
  CHECK(contains(bad.err, "--monitor-interval: 'soon' is not a number of seconds"));

  const auto unknown = tandemrun({"--nproc", "2", LAUNCH_WORKER});
  CHECK(unknown.exit_code == 2);
  CHECK(contains(unknown.err, "--nproc"));

  const auto help = tandemrun({"--help"});
  CHECK(help.exit_code == 0);
  CHECK(contains(help.out, "Usage: tandemrun [OPTIONS] PROGRAM [ARGS...]"));

  const auto missing = tandemrun({"/nonexistent/program"});
  CHECK(missing.exit_code == 1);
  CHECK(contains(missing.err, "cannot run '/nonexistent/program'"));
}

TEST_CASE("--devices gives each local rank its own CUDA_VISIBLE_DEVICES") {
  TempDir dir;
  const auto result =
      tandemrun({"--nproc-per-node", "3", "--devices", "2,3,5", LAUNCH_WORKER, "env", dir.str()});
  REQUIRE_MESSAGE(result.exit_code == 0, result.err);
  CHECK(read_key_values(dir / "env_0.txt").at("CUDA_VISIBLE_DEVICES") == "2");
  CHECK(read_key_values(dir / "env_1.txt").at("CUDA_VISIBLE_DEVICES") == "3");
  CHECK(read_key_values(dir / "env_2.txt").at("CUDA_VISIBLE_DEVICES") == "5");

  const auto too_few =
      tandemrun({"--nproc-per-node", "2", "--devices", "4", LAUNCH_WORKER, "env", dir.str()});
  CHECK(too_few.exit_code == 2);
  CHECK(contains(too_few.err, "--devices: lists 1 device(s) for 2 processes per node"));
}

TEST_CASE("each output line is prefixed with its rank; an unfinished last line is flushed") {
  const auto result = tandemrun({"--nproc-per-node", "2", LAUNCH_WORKER, "print"});
  REQUIRE_MESSAGE(result.exit_code == 0, result.err);
  for (int rank = 0; rank < 2; ++rank) {
    const auto r = std::to_string(rank);
    CHECK(contains(result.out, "[rank " + r + "] hello from rank " + r + "\n"));
    CHECK(contains(result.out, "[rank " + r + "] second line of rank " + r + "\n"));
    CHECK(contains(result.out, "[rank " + r + "] unfinished line of rank " + r + "\n"));
    CHECK(contains(result.err, "[rank " + r + "] warning from rank " + r + "\n"));
    CHECK_FALSE(contains(result.out, "warning"));
  }
}

TEST_CASE("--redirects sends output to the log directory, --tee to both") {
  TempDir logs;
  const auto redirected = tandemrun({"--nproc-per-node", "2", "--redirects", "3", "--log-dir",
                                     logs.str(), "--rdzv-id", "r1", LAUNCH_WORKER, "print"});
  REQUIRE_MESSAGE(redirected.exit_code == 0, redirected.err);
  CHECK_FALSE(contains(redirected.out, "hello"));
  CHECK_FALSE(contains(redirected.err, "warning"));
  for (int rank = 0; rank < 2; ++rank) {
    const auto r = std::to_string(rank);
    const auto base = logs / ("r1/attempt_0/" + r);
    CHECK(read_file(base + "/stdout.log") ==
          "hello from rank " + r + "\nsecond line of rank " + r + "\nunfinished line of rank " + r);
    CHECK(read_file(base + "/stderr.log") == "warning from rank " + r + "\n");
  }

  const auto teed = tandemrun({"--nproc-per-node", "2", "--tee", "1", "--redirects", "0:2",
                               "--log_dir", logs.str(), "--rdzv-id", "r2", LAUNCH_WORKER, "print"});
  REQUIRE_MESSAGE(teed.exit_code == 0, teed.err);
  CHECK(contains(teed.out, "[rank 0] hello from rank 0\n"));
  CHECK(contains(teed.out, "[rank 1] hello from rank 1\n"));
  CHECK(contains(read_file(logs / "r2/attempt_0/0/stdout.log"), "hello from rank 0\n"));
  CHECK(contains(read_file(logs / "r2/attempt_0/1/stdout.log"), "hello from rank 1\n"));
  // Rank 0's stderr is redirected (file only); rank 1's stays on the console only.
  CHECK(read_file(logs / "r2/attempt_0/0/stderr.log") == "warning from rank 0\n");
  CHECK_FALSE(contains(teed.err, "warning from rank 0"));
  CHECK(contains(teed.err, "[rank 1] warning from rank 1\n"));
  CHECK_FALSE(fs::exists(logs / "r2/attempt_0/1/stderr.log"));
}

TEST_CASE("a worker that exits 3: the others are stopped, the summary names it, exit code 1") {
  TempDir dir;
  const auto result =
      tandemrun({"--nproc-per-node", "3", LAUNCH_WORKER, "fail", dir.str(), "1", "3"});
  CHECK(result.exit_code == 1);
  CHECK(contains(result.err, "FAILED"));
  const auto root = result.err.find("Root Cause");
  REQUIRE(root != std::string::npos);
  const auto cause = result.err.substr(root);
  CHECK(contains(cause, "rank      : 1 (local_rank: 1)"));
  CHECK(contains(cause, "exitcode  : 3 (pid: "));
  CHECK(contains(cause, "exited with code 3"));
  CHECK(contains(cause, "host      : "));
  CHECK(contains(cause, "time      : "));
  // Ranks 0 and 2 slept forever; the launcher stopped them and is gone itself.
  for (int rank : {0, 2}) {
    const auto pid_text = read_file(dir / ("pid_" + std::to_string(rank)));
    REQUIRE_FALSE(pid_text.empty());
    CHECK(process_gone(static_cast<pid_t>(std::stoi(pid_text))));
  }
}

TEST_CASE("a worker killed by SIGSEGV is reported with the signal's name") {
  TempDir dir;
  const auto result =
      tandemrun({"--nproc-per-node", "2", LAUNCH_WORKER, "fail", dir.str(), "0", "segv"});
  CHECK(result.exit_code == 1);
  const auto root = result.err.find("Root Cause");
  REQUIRE(root != std::string::npos);
  const auto cause = result.err.substr(root);
  CHECK(contains(cause, "rank      : 0 (local_rank: 0)"));
  CHECK(contains(cause, "exitcode  : -11"));
  CHECK(contains(cause, "SIGSEGV"));
  CHECK(process_gone(static_cast<pid_t>(std::stoi(read_file(dir / "pid_1")))));
}

TEST_CASE("restarts: a failure on attempt 0 is retried with TORCHELASTIC_RESTART_COUNT=1") {
  TempDir dir;
  const auto restarted =
      tandemrun({"--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.05",
                 LAUNCH_WORKER, "restart", dir.str()});
  CHECK_MESSAGE(restarted.exit_code == 0, restarted.err);
  CHECK(contains(restarted.err, "restarting the workers (restart 1 of 1)"));
  CHECK(read_file(dir / "done_0_1") == "1");
  CHECK(read_file(dir / "done_1_1") == "1");
  CHECK_FALSE(fs::exists(dir / "done_1_0"));

  TempDir again;
  const auto no_restart =
      tandemrun({"--nproc-per-node", "2", LAUNCH_WORKER, "restart", again.str()});
  CHECK(no_restart.exit_code == 1);
  CHECK(contains(no_restart.err, "exited with code 5"));
  CHECK_FALSE(fs::exists(again / "done_0_1"));
}

TEST_CASE("the summary shows the message run_main wrote to the worker's error file, once") {
  TempDir dir;
  ::unsetenv("TORCHELASTIC_ERROR_FILE");
  const auto result = tandemrun({"--nproc-per-node", "2", LAUNCH_WORKER, "raise", dir.str(), "1"});
  CHECK(result.exit_code == 1);
  const auto root = result.err.find("Root Cause");
  REQUIRE(root != std::string::npos);
  const auto cause = result.err.substr(root);
  CHECK(contains(cause, "rank      : 1 (local_rank: 1)"));
  CHECK(contains(cause, "exitcode  : 1 (pid: "));
  // what() itself, not "exited with code 1", and "tandem: " once though one Error wraps another.
  CHECK_MESSAGE(contains(cause,
                         "  error     : tandem: rank 1: load_checkpoint x.safetensors: "
                         "safetensors x.safetensors: the header is not valid JSON\n"),
                cause);
  CHECK_FALSE(contains(cause, "exited with code"));
  CHECK_FALSE(contains(result.err, "tandem::Error: tandem:"));
  CHECK(process_gone(static_cast<pid_t>(std::stoi(read_file(dir / "pid_0")))));
}

TEST_CASE(
    "each worker gets an error file of its own, unless the launcher's environment names one") {
  ::unsetenv("TORCHELASTIC_ERROR_FILE");
  SUBCASE("without --log-dir: in a directory of the launch's own, removed at its end") {
    TempDir dir;
    const auto result =
        tandemrun({"--nproc-per-node", "2", "--rdzv-id", "job7", LAUNCH_WORKER, "env", dir.str()});
    REQUIRE_MESSAGE(result.exit_code == 0, result.err);
    const fs::path file0 = read_key_values(dir / "env_0.txt").at("TORCHELASTIC_ERROR_FILE");
    const fs::path file1 = read_key_values(dir / "env_1.txt").at("TORCHELASTIC_ERROR_FILE");
    CHECK(file0 != file1);
    CHECK(file0.string().ends_with("/job7/attempt_0/0/error.json"));
    CHECK(file1.string().ends_with("/job7/attempt_0/1/error.json"));
    const auto own = file0.parent_path().parent_path().parent_path().parent_path();
    CHECK(own.filename().string().starts_with("tandemrun_errors_"));
    CHECK_FALSE(fs::exists(own));
  }
  SUBCASE("with --log-dir: beside the logs, as torchrun puts them") {
    TempDir dir;
    const auto logs = dir / "logs";
    const auto result = tandemrun({"--nproc-per-node", "2", "--log-dir", logs, "--rdzv-id", "job8",
                                   LAUNCH_WORKER, "env", dir.str()});
    REQUIRE_MESSAGE(result.exit_code == 0, result.err);
    CHECK(read_key_values(dir / "env_1.txt").at("TORCHELASTIC_ERROR_FILE") ==
          logs + "/job8/attempt_0/1/error.json");
  }
  SUBCASE("the user's own file is left to the user: inherited, and the summary gives the code") {
    TempDir dir;
    const auto mine = dir / "mine.json";
    ::setenv("TORCHELASTIC_ERROR_FILE", mine.c_str(), 1);
    const auto env_run = tandemrun({"--nproc-per-node", "2", LAUNCH_WORKER, "env", dir.str()});
    const auto failed =
        tandemrun({"--nproc-per-node", "2", LAUNCH_WORKER, "raise", dir.str(), "0"});
    ::unsetenv("TORCHELASTIC_ERROR_FILE");
    REQUIRE_MESSAGE(env_run.exit_code == 0, env_run.err);
    CHECK(read_key_values(dir / "env_0.txt").at("TORCHELASTIC_ERROR_FILE") == mine);
    CHECK(read_key_values(dir / "env_1.txt").at("TORCHELASTIC_ERROR_FILE") == mine);
    CHECK(failed.exit_code == 1);
    CHECK(contains(failed.err, "exited with code 1"));
    CHECK(contains(read_file(mine), "load_checkpoint x.safetensors"));
  }
}

TEST_CASE("the OMP_NUM_THREADS note: once per launch, restarts included, and only when it is set") {
  const std::string note = "Setting OMP_NUM_THREADS environment variable";
  const auto count = [&](const std::string& text) {
    int n = 0;
    for (auto at = text.find(note); at != std::string::npos; at = text.find(note, at + 1)) ++n;
    return n;
  };
  ::unsetenv("OMP_NUM_THREADS");
  TempDir restarted;
  const auto twice = tandemrun(
      {"--nproc-per-node", "2", "--max-restarts", "1", LAUNCH_WORKER, "restart", restarted.str()});
  REQUIRE_MESSAGE(twice.exit_code == 0, twice.err);
  CHECK(contains(twice.err, "restarting the workers"));
  CHECK(count(twice.out + twice.err) == 1);

  TempDir one;
  const auto single = tandemrun({"--nproc-per-node", "1", LAUNCH_WORKER, "env", one.str()});
  REQUIRE_MESSAGE(single.exit_code == 0, single.err);
  CHECK(count(single.out + single.err) == 0);
  CHECK(read_key_values(one / "env_0.txt").at("OMP_NUM_THREADS") == "<unset>");

  TempDir set;
  ::setenv("OMP_NUM_THREADS", "3", 1);
  const auto given = tandemrun({"--nproc-per-node", "2", LAUNCH_WORKER, "env", set.str()});
  ::unsetenv("OMP_NUM_THREADS");
  REQUIRE_MESSAGE(given.exit_code == 0, given.err);
  CHECK(count(given.out + given.err) == 0);
  CHECK(read_key_values(set / "env_1.txt").at("OMP_NUM_THREADS") == "3");
}

TEST_CASE("SIGTERM to the launcher reaches every worker; the launcher exits 128+15") {
  TempDir dir;
  const pid_t launcher =
      tandem::test::start({TANDEMRUN, "--nproc-per-node", "2", LAUNCH_WORKER, "trap", dir.str()},
                          dir / "out", dir / "err");
  const bool ready =
      tandem::test::wait_for_file(dir / "ready_0") && tandem::test::wait_for_file(dir / "ready_1");
  ::kill(launcher, SIGTERM);
  const int status = tandem::test::wait_for(launcher);
  REQUIRE(ready);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 128 + SIGTERM);
  CHECK(fs::exists(dir / "term_0"));
  CHECK(fs::exists(dir / "term_1"));
  CHECK(contains(read_file(dir / "err"), "received SIGTERM"));
}

TEST_CASE("the job token reaches every worker, and workers meet through the locked store") {
  TempDir dir;
  ::unsetenv("TANDEM_STORE_TOKEN");
  {
    std::ofstream(dir / "token") << "file-token\n";
    const auto result = tandemrun({"--nproc-per-node", "2", "--rdzv-token-file", dir / "token",
                                   LAUNCH_WORKER, "env", dir.str()});
    REQUIRE_MESSAGE(result.exit_code == 0, result.err);
    for (int rank = 0; rank < 2; ++rank) {
      const auto seen = read_key_values(dir / ("env_" + std::to_string(rank) + ".txt"));
      CHECK(seen.at("TANDEM_STORE_TOKEN") == "file-token");
    }
  }
  {
    // No token given on one node: a random one, the same for every worker of the launch.
    const auto result = tandemrun({"--nproc-per-node", "2", LAUNCH_WORKER, "env", dir.str()});
    REQUIRE_MESSAGE(result.exit_code == 0, result.err);
    const auto first = read_key_values(dir / "env_0.txt").at("TANDEM_STORE_TOKEN");
    CHECK(first.size() == 64);
    CHECK(read_key_values(dir / "env_1.txt").at("TANDEM_STORE_TOKEN") == first);
  }
  // The workers host and join a TcpStore that demands the token: they meet.
  const auto port = std::to_string(tandem::launch::detail::free_port());
  const auto met = tandemrun({"--nproc-per-node", "3", "--master-port", port, "--rdzv-token",
                              "cli-token", LAUNCH_WORKER, "store"});
  REQUIRE_MESSAGE(met.exit_code == 0, met.err);
  for (int rank = 0; rank < 3; ++rank) {
    CHECK(contains(met.out, "[rank " + std::to_string(rank) + "] rank " + std::to_string(rank) +
                                " of 3 on node 0 met all ranks"));
  }
}
