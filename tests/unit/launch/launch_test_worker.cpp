// The worker program that the launcher tests start under tandemrun. The first argument picks
// what it does:
//   env DIR [ARGS...]             write DIR/env_<RANK>.txt: the launcher's variables and ARGS
//   print                          lines on stdout and stderr, and a last line without newline
//   fail DIR RANK CODE|segv        rank RANK fails (exit CODE or SIGSEGV) once every other rank
//                                  has written DIR/pid_<rank>; the others sleep forever
//   raise DIR RANK                 as fail, but rank RANK throws a tandem::Error (one wrapping
//                                  another, as load_checkpoint's do) out of tandem::run_main
//   restart DIR                    rank 1 exits 5 on attempt 0; otherwise writes
//                                  DIR/done_<RANK>_<attempt> and exits 0
//   trap DIR                       on SIGTERM writes DIR/term_<RANK>; writes DIR/ready_<RANK>,
//                                  then sleeps forever
//   store                          checks its variables and meets every rank through a TcpStore
//                                  served by rank 0 on MASTER_ADDR:MASTER_PORT (multi-node test)
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/launch/elastic.hpp"
#include "tandem/rendezvous/tcp_store.hpp"

namespace {

const char* const launcher_variables[] = {"RANK",
                                          "LOCAL_RANK",
                                          "WORLD_SIZE",
                                          "LOCAL_WORLD_SIZE",
                                          "GROUP_RANK",
                                          "GROUP_WORLD_SIZE",
                                          "ROLE_RANK",
                                          "ROLE_NAME",
                                          "ROLE_WORLD_SIZE",
                                          "MASTER_ADDR",
                                          "MASTER_PORT",
                                          "TORCHELASTIC_RESTART_COUNT",
                                          "TORCHELASTIC_MAX_RESTARTS",
                                          "TANDEM_STORE_TOKEN",
                                          "TORCHELASTIC_RUN_ID",
                                          "OMP_NUM_THREADS",
                                          "CUDA_VISIBLE_DEVICES",
                                          "TORCHELASTIC_ERROR_FILE",
                                          "TANDEM_TEST_PASSTHROUGH"};

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : fallback;
}

int env_int(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) {
    std::fprintf(stderr, "%s is not set\n", name);
    std::exit(90);
  }
  return std::atoi(value);
}

[[noreturn]] void sleep_forever() {
  for (;;) ::pause();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

int write_env(const std::string& dir, int argc, char** argv) {
  std::string text;
  for (const char* name : launcher_variables) {
    text += std::string(name) + "=" + env_or(name, "<unset>") + "\n";
  }
  text += "ARGS=";
  for (int i = 3; i < argc; ++i) text += std::string(i > 3 ? "|" : "") + argv[i];
  text += "\n";
  write_file(dir + "/env_" + env_or("RANK", "x") + ".txt", text);
  return 0;
}

int print_lines() {
  const int rank = env_int("RANK");
  std::printf("hello from rank %d\nsecond line of rank %d\n", rank, rank);
  std::fprintf(stderr, "warning from rank %d\n", rank);
  std::printf("unfinished line of rank %d", rank);
  std::fflush(nullptr);
  return 0;
}

int fail(const std::string& dir, int failing_rank, const std::string& how) {
  const int rank = env_int("RANK");
  const int world = env_int("WORLD_SIZE");
  if (rank != failing_rank) {
    write_file(dir + "/pid_" + std::to_string(rank), std::to_string(::getpid()));
    sleep_forever();
  }
  for (int waited = 0; waited < 2000; ++waited) {  // at most 20 s
    int present = 0;
    for (int r = 0; r < world; ++r) {
      if (r != rank && std::filesystem::exists(dir + "/pid_" + std::to_string(r))) ++present;
    }
    if (present == world - 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (how == "segv") {
    // Past any handler a sanitizer may have installed: the default action, a real SIGSEGV death.
    struct sigaction action {};
    action.sa_handler = SIG_DFL;
    ::sigaction(SIGSEGV, &action, nullptr);
    ::raise(SIGSEGV);
  }
  return std::atoi(how.c_str());
}

int raise_error(const std::string& dir, int failing_rank) {
  return tandem::run_main([&] {
    fail(dir, failing_rank, "0");  // the other ranks sleep in there
    const tandem::Error inner("safetensors x.safetensors", "the header is not valid JSON");
    throw tandem::Error(failing_rank, "load_checkpoint x.safetensors", inner.what());
  });
}

int restart(const std::string& dir) {
  const int rank = env_int("RANK");
  const int attempt = env_int("TORCHELASTIC_RESTART_COUNT");
  if (rank == 1 && attempt == 0) return 5;
  write_file(dir + "/done_" + std::to_string(rank) + "_" + std::to_string(attempt),
             env_or("TORCHELASTIC_MAX_RESTARTS", "<unset>"));
  return 0;
}

std::string term_path;

void on_sigterm(int) {
  const int fd = ::open(term_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) ::close(fd);
  ::_exit(0);
}

int trap(const std::string& dir) {
  const int rank = env_int("RANK");
  term_path = dir + "/term_" + std::to_string(rank);
  struct sigaction action {};
  action.sa_handler = on_sigterm;
  ::sigaction(SIGTERM, &action, nullptr);
  write_file(dir + "/ready_" + std::to_string(rank), "ready");
  sleep_forever();
}

int meet_through_store() {
  const int rank = env_int("RANK");
  const int world = env_int("WORLD_SIZE");
  const int local_rank = env_int("LOCAL_RANK");
  const int local_world = env_int("LOCAL_WORLD_SIZE");
  const int node = env_int("GROUP_RANK");
  const int nodes = env_int("GROUP_WORLD_SIZE");
  if (rank != node * local_world + local_rank || world != nodes * local_world ||
      env_int("ROLE_RANK") != rank || env_int("ROLE_WORLD_SIZE") != world) {
    std::fprintf(stderr, "inconsistent variables on rank %d\n", rank);
    return 91;
  }
  const std::string addr = env_or("MASTER_ADDR", "");
  const auto port = static_cast<std::uint16_t>(env_int("MASTER_PORT"));
  tandem::TcpStore store(
      {.host = addr, .port = port, .is_server = rank == 0, .timeout = std::chrono::seconds(30)});
  store.set("rank/" + std::to_string(rank),
            std::to_string(node) + "/" + std::to_string(local_rank));
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back("rank/" + std::to_string(r));
  store.wait(keys);
  for (int r = 0; r < world; ++r) {
    const auto expected = std::to_string(r / local_world) + "/" + std::to_string(r % local_world);
    const auto value = store.get("rank/" + std::to_string(r));
    if (value != expected) {
      std::fprintf(stderr, "rank %d: rank/%d is '%s', expected '%s'\n", rank, r, value.c_str(),
                   expected.c_str());
      return 92;
    }
  }
  // The server must outlive every client's last call.
  store.set("done/" + std::to_string(rank), "1");
  if (rank == 0) {
    std::vector<std::string> done;
    for (int r = 0; r < world; ++r) done.push_back("done/" + std::to_string(r));
    store.wait(done);
  }
  std::printf("rank %d of %d on node %d met all ranks\n", rank, world, node);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "env" && argc >= 3) return write_env(argv[2], argc, argv);
    if (mode == "print") return print_lines();
    if (mode == "fail" && argc == 5) return fail(argv[2], std::atoi(argv[3]), argv[4]);
    if (mode == "raise" && argc == 4) return raise_error(argv[2], std::atoi(argv[3]));
    if (mode == "restart" && argc == 3) return restart(argv[2]);
    if (mode == "trap" && argc == 3) return trap(argv[2]);
    if (mode == "store") return meet_through_store();
  } catch (const std::exception& error) {
    std::fprintf(stderr, "worker: %s\n", error.what());
    return 93;
  }
  std::fprintf(stderr, "launch_test_worker: bad arguments\n");
  return 94;
}
