// examples/common/run.hpp - what the training examples (fashion_mnist, its GPU variant,
// torch_resnet) share around their training loop: the numeric flags every one takes and the
// checks of their values (a refused value is named with the reason, never trained on), the CPU
// backend a --backend flag names started the way a PyTorch user starts it (and the one a run
// without the flag gets: default_cpu_backend), --resume from the newest checkpoint, and whether
// this is torchrun's first attempt (the crash tests kill a rank there only).
//   s.backend = examples::default_cpu_backend();   // before the flags are read
//   auto accuracy = examples::run_cpu_backend(s.backend, s.ranks, timeout,
//                                             [&](auto& comm) { return train(comm, s); });
#pragma once

#include <unistd.h>

#include <array>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "tandem/comm/agree.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/data/mnist.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/io/log.hpp"
#include "tandem/io/progress.hpp"
#include "tandem/io/tensorboard.hpp"
#if TANDEM_EXAMPLE_WITH_GLOO
#include "tandem/comm/gloo/gloo.hpp"
#endif
#if TANDEM_EXAMPLE_WITH_MPI
#include "tandem/comm/mpi/mpi.hpp"
#endif
#if TANDEM_EXAMPLE_WITH_SHM
#include "tandem/comm/shm/shm.hpp"
#endif
#if TANDEM_EXAMPLE_WITH_SHM && TANDEM_EXAMPLE_WITH_GLOO
#include "tandem/comm/hierarchical/hierarchical.hpp"
#endif

namespace examples {

/// The settings every training example has, with the same defaults; parse_run_number reads the
/// numeric ones. An example's Settings derives from it and adds its own.
struct RunSettings {
  std::string backend;
  int ranks = 2;
  int epochs = 3;
  std::size_t batch_size = 64;
  double lr = 0.1;
  std::uint64_t seed = 0;
  std::string data = tandem::FashionMNIST::default_directory().string();
  std::string checkpoint_dir;
  bool resume = false;
  int timeout_seconds = 1800;
  int workers = 1;
  std::string tensorboard;
  std::int64_t max_steps = -1;      // stop early (tests)
  std::int64_t crash_at_step = -1;  // rank 1 kills itself here on the first attempt (the test)
  bool crash_in_setup = false;      // --elastic: rank 1 kills itself in the set-up, first attempt
};

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

/// Says why a flag's value is refused, on `errors` (nothing when it is null), as
/// "PROGRAM: FLAG VALUE: REASON"; returns nullopt, which the parsers return for a refused flag.
inline std::nullopt_t refuse(std::FILE* errors, std::string_view program, std::string_view flag,
                             std::string_view value, std::string_view reason) {
  if (errors) {
    std::fprintf(errors, "%.*s: %.*s '%.*s': %.*s\n", int(program.size()), program.data(),
                 int(flag.size()), flag.data(), int(value.size()), value.data(), int(reason.size()),
                 reason.data());
  }
  return std::nullopt;
}

/// A decimal number that is the whole of `text` and finite ("0.1", "1e-3"); nullopt for anything
/// else ("", " 1", "0.1x", "inf", "nan", "1e999").
inline std::optional<double> parse_real(const char* text) {
  if (!text || !*text || std::isspace(static_cast<unsigned char>(*text))) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(value) || errno == ERANGE) {
    return std::nullopt;
  }
  return value;
}

/// The paths among the settings, checked before anything starts: --data must be a directory
/// this process can read, --checkpoint-dir and --tensorboard a directory where they exist
/// (whether they can be written, rank 0 finds out before the first step). The reason, or "".
template <class Settings>
std::string path_problem(const Settings& s) {
  namespace fs = std::filesystem;
  std::error_code error;
  if (!fs::is_directory(s.data, error)) {
    return "--data '" + s.data +
           "': " + (fs::exists(s.data, error) ? "not a directory" : "no such directory");
  }
  if (::access(s.data.c_str(), R_OK | X_OK) != 0) {
    return "--data '" + s.data + "': cannot read it: " + std::strerror(errno);
  }
  // A named array, not a braced list in the for: nvcc 13 cannot parse the braced form.
  const std::array<std::pair<const char*, const std::string*>, 2> directories{
      {{"--checkpoint-dir", &s.checkpoint_dir}, {"--tensorboard", &s.tensorboard}}};
  for (const auto& [flag, path_of] : directories) {
    const std::string& path = *path_of;
    if (!path.empty() && fs::exists(path, error) && !fs::is_directory(path, error)) {
      return std::string(flag) + " '" + path + "': exists and is not a directory";
    }
  }
  return {};
}

/// An Error unless `data` fits the model: `inputs` values per sample and labels below `classes`
/// (a label out of range would index past the model's outputs).
template <class Dataset>
void check_data_fits(const Dataset& data, std::size_t inputs, std::size_t classes,
                     const std::string& directory) {
  if (data.field_numel()[0] != inputs || data.classes() == 0 || data.classes() > classes) {
    throw tandem::Error("--data " + directory,
                        "the samples have " + std::to_string(data.field_numel()[0]) +
                            " values and labels below " + std::to_string(data.classes()) +
                            " (0: unchecked); the model takes " + std::to_string(inputs) +
                            " values and " + std::to_string(classes) + " classes");
  }
}

/// Whether this is torchrun's first attempt at the job (TORCHELASTIC_RESTART_COUNT unset or 0).
inline bool first_attempt() {
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return !restart || std::string_view(restart) == "0";
}

/// With a checkpoint directory, before the first step: prepares it (rank 0 takes its lock, so
/// that another job using it is refused, and checks it can be written: tandem::open_checkpoints)
/// and, with --resume, loads its newest checkpoint into `state` on every rank (the same one:
/// checked) and moves the loader to the batch it had reached (`batches_done` and `step` are
/// registered in `state`; a sampler registered with its batch size continues its epoch split
/// anew over this job's ranks, whatever the world size it was saved at, from batch 0 of the new
/// split). Without a directory nothing; without a checkpoint, a first run.
template <class Comm, class Loader>
void resume_from_latest(Comm& comm, bool resume, const std::string& directory,
                        tandem::TrainingState& state, Loader& loader,
                        const std::size_t& batches_done, const std::int64_t& step) {
  if (directory.empty()) return;
  if (auto last = tandem::open_checkpoints(comm, directory, state, {.resume = resume})) {
    loader.resume_at(batches_done);
    tandem::log0(comm) << "resumed from " << last->string() << " at step " << step;
  }
}

/// Whether this rank writes the run's TensorBoard events: rank 0 when `directory` is given; the
/// other ranks (and a run without --tensorboard) write nothing. A directory rank 0 cannot create or
/// write in is an Error on every rank now (rank 0's with its cause, the others naming rank 0),
/// before the first step, not rank 0 alone failing while the others wait for it. Collective.
template <class Comm>
bool rank0_writes_board(Comm& comm, const std::string& directory) {
  std::string failure;
  if (comm.rank() == 0 && !directory.empty()) {
    try {
      std::error_code error;
      std::filesystem::create_directories(directory, error);
      if (error) {
        throw tandem::Error("TensorBoardWriter",
                            "cannot create " + directory + ": " + error.message());
      }
      tandem::detail::probe_write(directory, "tensorboard-", "TensorBoardWriter " + directory);
    } catch (const std::exception& error) {
      failure = tandem::detail::failure_text(error);
    }
  }
  tandem::detail::agree_on_failure(comm, failure, "--tensorboard " + directory,
                                   "open its TensorBoard directory");
  return comm.rank() == 0 && !directory.empty();
}

/// The TensorBoard writer of a run (rank0_writes_board says who writes). Collective.
template <class Comm>
tandem::TensorBoardWriter rank0_board(Comm& comm, const std::string& directory) {
  const bool writes = rank0_writes_board(comm, directory);
  return tandem::TensorBoardWriter(directory.empty() ? "." : directory, writes);
}

/// The start of epoch `epoch`: a resumed run is already in it (its sampler's epoch and the
/// batches done); any other starts the sampler's order for the epoch from its first batch.
template <class Sampler>
void begin_epoch(Sampler& sampler, int epoch, std::size_t& batches_done) {
  if (static_cast<std::uint64_t>(epoch) != sampler.epoch()) {
    sampler.set_epoch(static_cast<std::uint64_t>(epoch));
    batches_done = 0;
  }
}

/// Rank 0's progress bar over the `batches_left` batches of epoch `epoch`.
template <class Comm>
tandem::Progress epoch_progress(const Comm& comm, int epoch, std::size_t batches_left) {
  return tandem::Progress(batches_left,
                          {.label = "epoch " + std::to_string(epoch), .enabled = comm.rank() == 0});
}

/// What an epoch's evaluation found.
struct EpochResult {
  int epoch = 0;
  std::int64_t step = 0;
  double accuracy = 0;      ///< the model's, 0..1
  double ema_accuracy = 0;  ///< the EMA's, 0..1
  double trained_seconds = 0;
};

/// The end of an epoch: both accuracies to TensorBoard and rank 0's line; an epoch whose batches
/// are all done moves the sampler to the next one, so that a checkpoint saved now resumes there.
template <class Comm, class Sampler>
void end_epoch(Comm& comm, tandem::TensorBoardWriter& board, const EpochResult& result,
               Sampler& sampler, std::size_t& batches_done, std::size_t batches) {
  board.add_scalar("test/accuracy", result.accuracy, result.step);
  board.add_scalar("test/accuracy_ema", result.ema_accuracy, result.step);
  board.flush();
  tandem::log0(comm) << "epoch " << result.epoch << ": test accuracy " << 100 * result.accuracy
                     << " % (EMA " << 100 * result.ema_accuracy << " %) after "
                     << result.trained_seconds << " s of training";
  if (batches_done == batches) {
    sampler.set_epoch(static_cast<std::uint64_t>(result.epoch + 1));
    batches_done = 0;
  }
}

/// Rank 0's last line, which the examples' tests read: "test accuracy A % after S steps on N
/// ranks".
template <class Comm>
void log_final_accuracy(Comm& comm, double accuracy, std::int64_t step) {
  tandem::log0(comm) << "test accuracy " << 100 * accuracy << " % after " << step << " steps on "
                     << comm.size() << " ranks";
}

/// train(comm) as this process's rank of torchrun's job (env://) over Comm, with `timeout`; the
/// ranks leave together (a barrier), so that none tears the group down under another.
template <class Comm, class Train>
double run_env_rank(std::chrono::seconds timeout, Train& train) {
  typename Comm::options_type options;
  options.timeout = timeout;
  auto comm = tandem::init_process_group<Comm>("env://", options);
  const double result = train(comm);
  comm.barrier();
  return result;
}

/// Collective, at start: the flags that must be the same on every rank are (tandem::agree), with
/// the example's own (`more`); otherwise an Error on every rank naming the flag, the ranks and
/// their values. Not compared: what may differ per rank or node (--data and --checkpoint-dir are
/// places, which open_checkpoints checks by what every rank loads; --workers, --timeout,
/// --tensorboard).
template <class Comm>
void agree_on_flags(Comm& comm, const RunSettings& s, const std::vector<tandem::Setting>& more) {
  std::vector<tandem::Setting> flags{{"--epochs", s.epochs},
                                     {"--batch-size", s.batch_size},
                                     {"--lr", s.lr},
                                     {"--seed", s.seed},
                                     {"--resume", s.resume},
                                     {"--max-steps", s.max_steps},
                                     {"--crash-at-step", s.crash_at_step},
                                     {"--crash-in-setup", s.crash_in_setup}};
  flags.insert(flags.end(), more.begin(), more.end());
  tandem::agree(comm, flags);
}

/// The backend of a run without --backend: under a launcher (WORLD_SIZE set) the shared-memory
/// path, "hierarchical" (each node's ranks in shared memory, Gloo between nodes; on one node no
/// Gloo at all), else "local" (threads). Where the shared-memory component is not built: "gloo";
/// where Gloo is not: "shm" (one node only).
inline std::string default_cpu_backend() {
  if (!std::getenv("WORLD_SIZE")) return "local";
#if TANDEM_EXAMPLE_WITH_SHM && TANDEM_EXAMPLE_WITH_GLOO
  return "hierarchical";
#elif TANDEM_EXAMPLE_WITH_SHM
  return "shm";
#else
  return "gloo";
#endif
}

/// Runs train(comm) on the CPU backend `backend` names and returns rank 0's result: "local" as
/// `ranks` threads of this process, "gloo" as this process's rank of torchrun's job (env://),
/// "shm" the same in shared memory (ShmComm: every rank on this host), "hierarchical" the same
/// over HierarchicalComm<ShmComm, GlooComm> (shared memory within each node, Gloo between the
/// nodes' leaders), "mpi" as its rank of mpirun's. nullopt where that backend is not built in.
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
  if (backend == "gloo") return run_env_rank<tandem::GlooComm>(timeout, train);
#endif
#if TANDEM_EXAMPLE_WITH_SHM
  if (backend == "shm") return run_env_rank<tandem::ShmComm>(timeout, train);
#endif
#if TANDEM_EXAMPLE_WITH_SHM && TANDEM_EXAMPLE_WITH_GLOO
  if (backend == "hierarchical") {
    return run_env_rank<tandem::HierarchicalComm<tandem::ShmComm, tandem::GlooComm>>(timeout,
                                                                                     train);
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
