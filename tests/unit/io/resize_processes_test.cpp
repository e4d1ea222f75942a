// A checkpoint resumed at another world size across processes (GlooComm over TCP on 127.0.0.1;
// the test starts its own executable once per rank): DDP and ZeRO stages 1 and 2 save mid-epoch
// at 2 ranks and resume at 3 and 1, and at 4 ranks and resume at 2 (the job of resize_job.hpp).
// Each rank writes what it trained on and holds to files; the test checks every sample of the
// epoch was used exactly once across the two jobs, the resumed parameters and optimizer state are
// the saved ones (hexadecimal floats), the epoch's steps at the new size, and the generators'
// rule (rank r < W takes saved stream r; the others a derived stream none of the saved ones).
//   io_resize_processes                        the tests
//   io_resize_processes MODE URL               one rank (RANK, WORLD_SIZE, TANDEM_TEST_DIR)
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "misuse_support.hpp"
#include "resize_job.hpp"
#include "support/child_process.hpp"
#include "support/temp_dir.hpp"
#include "support/worker_processes.hpp"
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"

namespace fs = std::filesystem;
using namespace tandem::test::resize;
using tandem::test::misuse::read_text;
using tandem::test::misuse::write_file;

namespace {

// The parameters and the optimizer's moments, exactly (%a).
template <class Job>
std::string held_state(Job& job) {
  std::string text;
  char number[64];
  for (float v : job.params.values()) {
    std::snprintf(number, sizeof number, "%a ", static_cast<double>(v));
    text += number;
  }
  const auto dict = job.opt.state_dict();  // a collective under ZeRO
  for (const auto& [index, param] : dict.state) {
    for (const auto& [name, tensor] : param.tensors) {
      text += "\n" + std::to_string(index) + "." + name + ":";
      for (std::size_t i = 0; i < tensor.size(); ++i) {
        std::snprintf(number, sizeof number, " %a", static_cast<double>(tensor.data()[i]));
        text += number;
      }
    }
  }
  return text + "\nlr " + std::to_string(job.opt.lr(0)) + " " + std::to_string(job.opt.lr(1));
}

template <int Stage>
void run_rank(tandem::GlooComm& comm, bool save, const fs::path& dir) {
  Job<tandem::GlooComm, Stage> job(comm);
  Uses uses;
  const std::string phase = save ? "save" : "resume";
  const std::string rank = std::to_string(comm.rank());
  if (save) {
    job.train(3, uses);
    tandem::save_checkpoint(comm, dir / "ckpt", job.step, job.state);
  } else {
    const auto latest = tandem::latest_checkpoint(comm, dir / "ckpt");
    if (!latest) throw tandem::Error(comm.rank(), "resize worker", "no checkpoint");
    tandem::load_checkpoint(comm, *latest, job.state);
  }
  write_file(dir / (phase + "-generator-" + rank), text_of(job.generator));
  write_file(dir / (phase + "-state-" + rank), held_state(job));
  if (!save) job.train(-1, uses);
  std::string used;
  for (std::size_t i = 0; i < samples; ++i) used += std::to_string(uses.count[i]) + " ";
  write_file(dir / (phase + "-uses-" + rank), used);
  write_file(dir / (phase + "-step-" + rank), std::to_string(job.step));
}

// One rank: MODE is "save-STAGE" or "resume-STAGE".
int worker(const std::string& mode, const std::string& url) {
  const int rank = std::atoi(std::getenv("RANK"));
  const int size = std::atoi(std::getenv("WORLD_SIZE"));
  const fs::path dir = std::getenv("TANDEM_TEST_DIR");
  try {
    auto comm = tandem::init_process_group<tandem::GlooComm>(
        tandem::World::single_node(rank, size), url, {.timeout = std::chrono::seconds(60)});
    const bool save = mode.starts_with("save-");
    switch (mode.back()) {
      case '1':
        run_rank<1>(comm, save, dir);
        break;
      case '2':
        run_rank<2>(comm, save, dir);
        break;
      default:
        run_rank<0>(comm, save, dir);
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return 1;
  }
  return 0;
}

void run_workers(const std::string& mode, int size, const fs::path& dir) {
  ::setenv("TANDEM_TEST_DIR", dir.c_str(), 1);
  ::setenv("GLOO_SOCKET_IFNAME", "lo", 0);
  auto children = tandem::test::start_workers(tandem::test::self_path(), size, size, mode,
                                              tandem::test::tcp_url());
  const auto statuses = tandem::test::wait_all(children, std::chrono::seconds(120));
  for (const auto& status : statuses) CHECK_MESSAGE(!status.failed(), status.describe());
}

std::vector<int> counts(const fs::path& file) {
  std::istringstream in(read_text(file));
  std::vector<int> out;
  for (int count; in >> count;) out.push_back(count);
  return out;
}

void check_resize(int stage, int from, int to) {
  CAPTURE(stage);
  CAPTURE(from);
  CAPTURE(to);
  tandem::test::TempDir dir;
  const std::string suffix = "-" + std::to_string(stage);
  run_workers("save" + suffix, from, dir.path());
  run_workers("resume" + suffix, to, dir.path());
  std::vector<int> total(samples, 0);
  for (const auto& [phase, size] : {std::pair{"save", from}, std::pair{"resume", to}}) {
    for (int r = 0; r < size; ++r) {
      const auto mine = counts(dir.path() / (std::string(phase) + "-uses-" + std::to_string(r)));
      REQUIRE(mine.size() == samples);
      for (std::size_t i = 0; i < samples; ++i) total[i] += mine[i];
    }
  }
  CHECK(std::count(total.begin(), total.end(), 1) == std::ptrdiff_t(samples));
  const auto saved_state = read_text(dir.path() / "save-state-0");
  std::vector<std::string> saved_generators;
  for (int r = 0; r < from; ++r) {
    saved_generators.push_back(read_text(dir.path() / ("save-generator-" + std::to_string(r))));
  }
  const std::size_t rest = samples - static_cast<std::size_t>(from) * 3 * batch;
  const std::size_t global = batch * static_cast<std::size_t>(to);
  for (int r = 0; r < to; ++r) {
    CAPTURE(r);
    const auto rank = std::to_string(r);
    CHECK(read_text(dir.path() / ("resume-state-" + rank)) == saved_state);
    CHECK(read_text(dir.path() / ("resume-step-" + rank)) ==
          std::to_string(3 + (rest + global - 1) / global));
    const auto generator = read_text(dir.path() / ("resume-generator-" + rank));
    if (r < from) {
      CHECK(generator == saved_generators[static_cast<std::size_t>(r)]);
    } else {
      CHECK(std::find(saved_generators.begin(), saved_generators.end(), generator) ==
            saved_generators.end());
    }
  }
}

}  // namespace

TEST_CASE("DDP processes: saved at 2 ranks resume at 3 and 1, saved at 4 resume at 2") {
  check_resize(0, 2, 3);
  check_resize(0, 2, 1);
  check_resize(0, 4, 2);
}

TEST_CASE("ZeRO stage 1 and 2 processes: the same") {
  check_resize(1, 2, 3);
  check_resize(2, 2, 1);
  check_resize(2, 4, 2);
}

int main(int argc, char** argv) {
  // A worker (start_workers runs `SELF MODE URL` with RANK and WORLD_SIZE set).
  if (argc == 3 && std::getenv("RANK") &&
      (std::string_view(argv[1]).starts_with("save-") ||
       std::string_view(argv[1]).starts_with("resume-"))) {
    return worker(argv[1], argv[2]);
  }
  doctest::Context context(argc, argv);
  return context.run();
}
