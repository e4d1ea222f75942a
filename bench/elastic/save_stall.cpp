// bench_save_stall: how long a training step stalls for a checkpoint of a 124 M-parameter model
// (issue 32, item 5), written by save_checkpoint (the step waits for the whole file) beside
// AsyncCheckpoints (the step waits for the snapshot only; a thread writes the file while the
// steps go on). A "step" is bench/step's SGD pass (momentum, weight decay) over one flat arena of
// N float parameters, on one rank (LocalComm); the checkpoint holds the parameters and the
// momentum (2 x 4 N bytes). Each mode runs STEPS steps with one save after step STEPS / 4, and
// the table gives the steps' median time without a save, the save call's own time (the stall at
// the save), the time the steps after it lost while the background write ran, and the total
// stall (the run's time over its steps at the median time; the async run goes on past STEPS
// until its write has ended, so that no final wait is counted). Fails unless every step ran, every
// file was written whole (its size checked) and the parameters moved.
//   bench_save_stall [--params N] [--steps S] [--dir DIR]   DIR: where the files go (default
//   a fresh directory under $TMPDIR or /tmp, removed at the end)
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

#include "tandem/arena/parameters.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/core/env.hpp"
#include "tandem/io/async_checkpoint.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/optim/sgd.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Outcome {
  double step_median = 0;  // steps without a save in flight
  double save_call = 0;    // the save call itself
  double after_save = 0;   // the steps after the save, over as many median steps
  double total_stall = 0;  // the run over steps x median
  int steps = 0;           // steps taken (async: until the write ended)
  std::uintmax_t file_bytes = 0;
};

}  // namespace

int main(int argc, char** argv) {
  std::size_t n = 124'000'000;
  int steps = 24;
  std::string dir;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (i + 1 < argc && (arg == "--params" || arg == "--steps")) {
      const auto v = tandem::parse_int(argv[++i]);
      if (!v || *v < 4) {
        std::fprintf(stderr, "bench_save_stall: %s '%s': a whole number of at least 4\n",
                     arg.data(), argv[i]);
        return 2;
      }
      if (arg == "--params")
        n = static_cast<std::size_t>(*v);
      else
        steps = static_cast<int>(*v);
    } else if (i + 1 < argc && arg == "--dir") {
      dir = argv[++i];
    } else {
      std::fprintf(stderr, "usage: bench_save_stall [--params N] [--steps S] [--dir DIR]\n");
      return 2;
    }
  }
  const bool own_dir = dir.empty();
  if (own_dir) {
    const char* tmp = std::getenv("TMPDIR");
    dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/tandem-save-stall-" +
          std::to_string(::getpid());
  }

  tandem::Parameters<float> params;  // one flat block: the model's size is what counts here
  params.add("model", {static_cast<std::int64_t>(n)});
  params.finalize();
  std::fill_n(params.values().data(), n, 0.5f);
  std::fill_n(params.grads().data(), n, 1e-3f);
  tandem::optim::SGD sgd(
      params, tandem::optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-4});
  std::int64_t step = 0;
  tandem::TrainingState state;
  state.model(params).optimizer(sgd).counter("step", step);
  const float before = params.values()[n / 2];

  Outcome outcomes[2];
  bool ok = true;
  tandem::run_local(1, [&](tandem::LocalComm& comm) {
    for (int mode = 0; mode < 2; ++mode) {
      const std::filesystem::path where =
          std::filesystem::path(dir) / (mode == 0 ? "sync" : "async");
      std::filesystem::remove_all(where);
      tandem::AsyncCheckpoints async(comm, where, {.keep_last = 1});
      std::vector<double> plain, after;
      const int save_after = steps / 4;
      const auto run_start = clock_type::now();
      int taken = 0;
      // Async: on until the background write has ended (and been reported), so that the run
      // measures the steps it slowed, not a final wait.
      for (int s = 0; s < steps || (mode == 1 && async.in_flight() && s < 100 * steps); ++s) {
        const auto start = clock_type::now();
        sgd.step();
        ++step;
        ++taken;
        if (mode == 1) async.check();  // a failed background write would throw here
        const double took = seconds_since(start);
        // The first step after the save, and any while its write is in flight: "after".
        const bool in_flight = mode == 1 && (async.in_flight() || s == save_after + 1);
        (s > save_after && in_flight ? after : plain).push_back(took);
        if (s == save_after) {
          const auto save_start = clock_type::now();
          if (mode == 0)
            tandem::save_checkpoint(comm, where, step, state, {.keep_last = 1});
          else
            (void)async.save(step, state);
          outcomes[mode].save_call = seconds_since(save_start);
        }
      }
      if (mode == 1) async.wait();
      const double total = seconds_since(run_start);
      auto& out = outcomes[mode];
      out.step_median = median(plain);
      double extra = 0;
      for (double t : after) extra += t - out.step_median;
      out.after_save = extra;
      out.total_stall = total - static_cast<double>(taken) * out.step_median;
      out.steps = taken;
      const auto files = tandem::list_checkpoints(where, {});
      if (taken < steps || files.empty()) {
        ok = false;
      } else {
        out.file_bytes = std::filesystem::file_size(files.back().second);
        // The parameters and the momentum, 4 bytes each, and a header.
        if (out.file_bytes < 8 * n) ok = false;
      }
    }
  });
  if (own_dir) std::filesystem::remove_all(dir);
  if (params.values()[n / 2] == before) ok = false;
  std::printf(
      "| save | steps | step median s | save call s | steps after it lost s | total stall s |"
      " file MB |\n|---|---:|---:|---:|---:|---:|---:|\n");
  const char* names[2] = {"save_checkpoint", "AsyncCheckpoints"};
  for (int mode = 0; mode < 2; ++mode) {
    const auto& o = outcomes[mode];
    std::printf("| %s | %d | %.3f | %.3f | %.3f | %.3f | %.0f |\n", names[mode], o.steps,
                o.step_median, o.save_call, o.after_save, o.total_stall,
                static_cast<double>(o.file_bytes) / 1e6);
  }
  for (int mode = 0; mode < 2; ++mode) {
    const auto& o = outcomes[mode];
    std::printf(
        "RESULT save=\"%s\" params=%zu steps=%d step_median=%.6f save_call=%.6f "
        "after_save=%.6f total_stall=%.6f bytes=%ju\n",
        names[mode], n, o.steps, o.step_median, o.save_call, o.after_save, o.total_stall,
        o.file_bytes);
  }
  if (!ok) {
    std::fprintf(stderr,
                 "bench_save_stall: the timed work did not happen whole (a step, a file "
                 "or its size missing, or the parameters did not move)\n");
    return 1;
  }
  return 0;
}
