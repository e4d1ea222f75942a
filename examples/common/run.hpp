// examples/common/run.hpp - what the training examples (fashion_mnist, its GPU variant,
// torch_resnet) share around their training loop: the numeric flags every one takes, the CPU
// backend a --backend flag names started the way a PyTorch user starts it, --resume from the
// newest checkpoint, and whether this is torchrun's first attempt (the crash tests kill a rank
// there only).
//   auto accuracy = examples::run_cpu_backend(s.backend, s.ranks, timeout,
//                                             [&](auto& comm) { return train(comm, s); });
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "tandem/comm/local/local.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/io/log.hpp"
#if TANDEM_EXAMPLE_WITH_GLOO
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"
#endif
#if TANDEM_EXAMPLE_WITH_MPI
#include "tandem/comm/mpi/mpi.hpp"
#endif
#if TANDEM_EXAMPLE_WITH_SHM
#include "tandem/comm/init.hpp"
#include "tandem/comm/shm/shm.hpp"
#endif

namespace examples {

/// The numeric flags every training example takes, written into the Settings fields of the same
/// names; `number(low, high)` reads the flag's value, nullopt outside [low, high]. False when
/// `arg` is none of them or its value is out of range (the caller then prints its usage).
template <class Settings, class Number>
bool parse_run_number(std::string_view arg, Number&& number, Settings& s) {
  std::optional<std::int64_t> v;
  if (arg == "--ranks" && (v = number(1, 64)))
    s.ranks = int(*v);
  else if (arg == "--epochs" && (v = number(1, 1000)))
    s.epochs = int(*v);
  else if (arg == "--batch-size" && (v = number(1, 60000)))
    s.batch_size = std::size_t(*v);
  else if (arg == "--seed" && (v = number(0, INT64_MAX)))
    s.seed = std::uint64_t(*v);
  else if (arg == "--timeout" && (v = number(1, 86400)))
    s.timeout_seconds = int(*v);
  else if (arg == "--workers" && (v = number(0, 64)))
    s.workers = int(*v);
  else if (arg == "--max-steps" && (v = number(0, INT64_MAX)))
    s.max_steps = *v;
  else if (arg == "--crash-at-step" && (v = number(0, INT64_MAX)))
    s.crash_at_step = *v;
  else
    return false;
  return true;
}

/// Whether this is torchrun's first attempt at the job (TORCHELASTIC_RESTART_COUNT unset or 0).
inline bool first_attempt() {
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return !restart || std::string_view(restart) == "0";
}

/// With --resume and a checkpoint directory: loads the newest checkpoint there into `state` on
/// every rank and moves the loader to the batch it had reached (`batches_done` and `step` are
/// registered in `state`). Nothing where there is none yet: a first run.
template <class Comm, class Loader>
void resume_from_latest(Comm& comm, bool resume, const std::string& directory,
                        tandem::TrainingState& state, Loader& loader,
                        const std::size_t& batches_done, const std::int64_t& step) {
  if (!resume || directory.empty()) return;
  if (auto last = tandem::latest_checkpoint(directory)) {
    tandem::load_checkpoint(comm, *last, state);
    loader.resume_at(batches_done);
    tandem::log0(comm) << "resumed from " << last->string() << " at step " << step;
  }
}

/// Runs train(comm) on the CPU backend `backend` names and returns rank 0's result: "local" as
/// `ranks` threads of this process, "gloo" as this process's rank of torchrun's job (env://),
/// "shm" the same in shared memory (ShmComm: every rank on this host), "mpi" as its rank of
/// mpirun's. nullopt where that backend is not built in.
template <class Train>
std::optional<double> run_cpu_backend(const std::string& backend, int ranks,
                                      std::chrono::seconds timeout, Train&& train) {
  if (backend == "local") {
    double result = 0;
    tandem::run_local(
        ranks,
        [&](tandem::LocalComm& comm) {
          const double mine = train(comm);
          if (comm.rank() == 0) result = mine;
        },
        tandem::LocalCommOptions{timeout});
    return result;
  }
#if TANDEM_EXAMPLE_WITH_GLOO
  if (backend == "gloo") {
    tandem::GlooCommOptions options;
    options.timeout = timeout;
    auto comm = tandem::init_process_group<tandem::GlooComm>("env://", options);
    const double result = train(comm);
    comm.barrier();
    return result;
  }
#endif
#if TANDEM_EXAMPLE_WITH_SHM
  if (backend == "shm") {
    tandem::ShmCommOptions options;
    options.timeout = timeout;
    auto comm = tandem::init_process_group<tandem::ShmComm>("env://", options);
    const double result = train(comm);
    comm.barrier();
    return result;
  }
#endif
#if TANDEM_EXAMPLE_WITH_MPI
  if (backend == "mpi") {
    auto comm = tandem::MpiComm::world();
    return train(comm);
  }
#endif
  return std::nullopt;
}

}  // namespace examples
