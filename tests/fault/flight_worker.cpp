// flight_worker: one rank of the flight recorder's fault cases (tests/fault/flight_driver.py
// starts it and reads what the ranks and the launcher say):
//   notice    three all_reduces of 1024 floats; before the second the victim waits until the
//             driver has seen a waiting notice naming it (DIR/go), then all finish (exit 0);
//   stall     all_reduces until the victim announces itself (DIR/rank<V>.at) before one and waits
//             for the driver's SIGSTOP; the others wait in that all_reduce until the timeout;
//   mismatch  rank 1 all_reduces 5 elements, the others 4: every rank raises the mismatch;
//   blame     rank 0 cannot save (its Error: no space left on device) and tells the others,
//             which raise at once ("rank 0 failed to save", "another rank failed to save");
//             rank 0 raises only once they have ended, as a slow rank would.
// Ranks are processes (gloo, shm, hierarchical over env://; mpi under mpirun) or threads (local).
// Each writes DIR/rank<R>.pid at start; errors end main through tandem::run_main (the error file
// tandemrun reads).
//   flight_worker --backend gloo --case notice --dir DIR --victim 1 [--timeout-ms T] [--ranks N]
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "tandem/comm/local/local.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/launch/elastic.hpp"
#include "worker.hpp"

namespace {

struct Settings {
  std::string backend = "local";
  std::string scenario = "notice";
  std::string dir = ".";
  int victim = 1;
  int ranks = 3;  // local only
  int timeout_ms = 60000;
};

bool exists(const std::string& path) {
  return ::access(path.c_str(), F_OK) == 0;
}

void write_file(const std::string& path, const std::string& text) {
  const std::string temporary = path + ".tmp" + std::to_string(::getpid());
  std::ofstream(temporary) << text;
  std::rename(temporary.c_str(), path.c_str());
}

/// Waits for `path`; a driver that never writes it is a bug of the driver (exit 3).
void await_file(const std::string& path, int rank) {
  for (int i = 0; i < 18000; ++i) {
    if (exists(path)) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::fprintf(stderr, "flight_worker: rank %d: %s never appeared\n", rank, path.c_str());
  std::_Exit(3);
}

/// Whether process `pid` (as written in DIR/rank<r>.pid) has ended.
bool ended(const Settings& settings, int r) {
  std::ifstream in(settings.dir + "/rank" + std::to_string(r) + ".pid");
  long pid = 0;
  if (!(in >> pid) || pid <= 0) return false;
  return ::kill(static_cast<pid_t>(pid), 0) != 0;
}

template <tandem::Communicator Comm>
void run_case(Comm& comm, const Settings& settings, bool threads) {
  const int rank = comm.rank();
  std::vector<float> data(1024, 1.0f);
  if (settings.scenario == "notice") {
    for (int step = 0; step < 3; ++step) {
      if (step == 1 && rank == settings.victim) await_file(settings.dir + "/go", rank);
      comm.all_reduce(data);
    }
    if (data[0] != static_cast<float>(comm.size() * comm.size() * comm.size())) {
      throw tandem::Error(rank, "flight_worker", "wrong all_reduce result");
    }
  } else if (settings.scenario == "stall") {
    for (int step = 0; step < 1000; ++step) {
      if (step == 2 && rank == settings.victim) {
        write_file(settings.dir + "/rank" + std::to_string(rank) + ".at", "before\n");
        for (;;) std::this_thread::sleep_for(std::chrono::milliseconds(10));  // SIGSTOP comes
      }
      comm.all_reduce(data);
    }
  } else if (settings.scenario == "mismatch") {
    comm.barrier();
    std::vector<float> mine(rank == 1 ? 5 : 4, 1.0f);
    comm.all_reduce(mine);
  } else if (settings.scenario == "blame") {
    comm.barrier();
    // Rank 0 fails to save and tells the others (a flag all_reduced, as a checkpoint would).
    std::vector<std::int32_t> failed{rank == 0 ? 1 : 0};
    comm.all_reduce(failed);
    if (rank != 0) {
      throw tandem::Error(rank, "save_checkpoint",
                          rank == 1 ? "rank 0 failed to save the checkpoint"
                                    : "another rank failed to save the checkpoint");
    }
    // Slow to report: the others end first (processes only: threads share one end).
    for (int i = 0; !threads && i < 12000; ++i) {
      bool all = true;
      for (int r = 1; r < comm.size(); ++r) all = all && ended(settings, r);
      if (all) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    throw tandem::Error(rank, "save_checkpoint",
                        "cannot write /ckpt/step-10.safetensors: No space left on device");
  } else {
    throw tandem::Error(rank, "flight_worker", "unknown case " + settings.scenario);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  const auto number = [](const std::string& value) {
    const auto parsed = tandem::parse_int(value);
    return parsed ? static_cast<int>(*parsed) : -1;
  };
  const bool read = tandem::test::fault::read_flags(
      argc, argv, [&](std::string_view flag, const std::string& value) {
        if (flag == "--backend") {
          settings.backend = value;
        } else if (flag == "--case") {
          settings.scenario = value;
        } else if (flag == "--dir") {
          settings.dir = value;
        } else if (flag == "--victim") {
          settings.victim = number(value);
        } else if (flag == "--ranks") {
          settings.ranks = number(value);
        } else if (flag == "--timeout-ms") {
          settings.timeout_ms = number(value);
        } else {
          std::fprintf(stderr, "flight_worker: unknown flag %s\n", std::string(flag).c_str());
          return false;
        }
        return true;
      });
  if (!read) {
    std::fprintf(stderr, "flight_worker: usage: --flag value pairs (see the top of the source)\n");
    return 2;
  }
  const char* rank_text = std::getenv("RANK");
  if (rank_text == nullptr) rank_text = std::getenv("OMPI_COMM_WORLD_RANK");
  write_file(settings.dir + "/rank" + std::string(rank_text ? rank_text : "0") + ".pid",
             std::to_string(::getpid()) + "\n");
  if (settings.backend == "local") {
    return tandem::run_main([&] {
      tandem::run_local(
          settings.ranks, [&](tandem::LocalComm& comm) { run_case(comm, settings, true); },
          tandem::LocalCommOptions{std::chrono::milliseconds(settings.timeout_ms)});
      return 0;
    });
  }
  return tandem::test::fault::with_process_comm("flight_worker", settings.backend,
                                                std::chrono::milliseconds(settings.timeout_ms),
                                                [&](auto make_comm) {
                                                  return tandem::run_main([&] {
                                                    auto comm = make_comm();
                                                    run_case(comm, settings, false);
                                                    return 0;
                                                  });
                                                });
}
