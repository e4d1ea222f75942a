// tandem/io/checkpoint.hpp - the whole training state (TrainingState: training_state.hpp) in one
// safetensors file, saved by rank 0 atomically and loaded on every rank (or broadcast from rank
// 0); the last K kept; the newest whole one found at start (a damaged file is reported and
// skipped; every one damaged is an Error, never a silent start from scratch). Safe on a shared
// machine: rank 0 holds the directory's lock for the job's life (a second job is refused with an
// Error naming the first), files honour the umask, an unwritable directory is found before the
// first step, a job never overwrites or prunes checkpoints it did not resume from; a failure on
// one rank is that rank's Error with its cause, and every other rank's Error names that rank and
// carries the cause; every rank is checked to have loaded the same checkpoint.
//   tandem::TrainingState state;
//   state.model(params).optimizer(opt).sampler(sampler, batches_done, 64).counter("step", step);
//   if (tandem::open_checkpoints(comm, dir, state, {.resume = true}))  // before the first step
//     loader.resume_at(batches_done);
//   tandem::save_checkpoint(comm, dir, step, state);          // dir/checkpoint-<step>.safetensors
// Needs: nlohmann-json (the tandem::io CMake component) and a Communicator.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/metrics.hpp"
#include "tandem/core/error.hpp"
#include "tandem/io/detail/checkpoint_directory.hpp"
#include "tandem/io/safetensors.hpp"
#include "tandem/io/training_state.hpp"

namespace tandem {

/// Where and how checkpoints are kept.
struct CheckpointOptions {
  std::size_t keep_last = 3;           ///< older checkpoints are deleted after a save (0: keep all)
  std::string prefix = "checkpoint-";  ///< file names: prefix, the step in 12 digits, .safetensors
  bool broadcast = false;  ///< load: rank 0 reads and broadcasts (no shared file system)
  /// Rank 0 holds the directory's lock (a dot, the prefix, "lock": `.checkpoint-lock`; flock)
  /// from its first use until the process ends: another job using the directory is refused with
  /// an Error naming this one (run id, host, pid, start time). false where the file system has
  /// no locks.
  bool exclusive = true;
  bool resume = false;  ///< open_checkpoints: load the newest checkpoint there is, if any
};

/// The file of step `step` in `directory`.
[[nodiscard]] inline std::filesystem::path checkpoint_path(const std::filesystem::path& directory,
                                                           std::int64_t step,
                                                           const CheckpointOptions& options = {}) {
  char digits[32];
  std::snprintf(digits, sizeof digits, "%012lld", static_cast<long long>(step));
  return directory / (options.prefix + digits + ".safetensors");
}

/// The checkpoints in `directory`, newest (highest step) first, as (step, path).
[[nodiscard]] inline std::vector<std::pair<std::int64_t, std::filesystem::path>> list_checkpoints(
    const std::filesystem::path& directory, const CheckpointOptions& options = {}) {
  std::vector<std::pair<std::int64_t, std::filesystem::path>> found;
  std::error_code ignored;
  if (!std::filesystem::is_directory(directory, ignored)) return found;
  for (const auto& entry : std::filesystem::directory_iterator(directory, ignored)) {
    const std::string name = entry.path().filename().string();
    const std::string suffix = ".safetensors";
    if (!name.starts_with(options.prefix) || !name.ends_with(suffix)) continue;
    const std::string digits =
        name.substr(options.prefix.size(), name.size() - options.prefix.size() - suffix.size());
    const auto step = detail::whole_number<std::int64_t>(digits);
    if (!step) continue;  // not a step (or one too large to be ours)
    found.emplace_back(*step, entry.path());
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  return found;
}

/// The newest checkpoint in `directory` that is whole: its format valid and its data checksum
/// matching. Each damaged newer one is reported on `report` ("tandem: skipping damaged
/// checkpoint ...") and skipped, never loaded. Empty when there is no checkpoint (a first run).
/// When there are checkpoints but every one is damaged, a tandem::Error naming the newest and
/// why: resuming is impossible, and starting from scratch unasked would silently throw the
/// run's progress away (move the files aside to start afresh on purpose).
[[nodiscard]] inline std::optional<std::filesystem::path> latest_checkpoint(
    const std::filesystem::path& directory, const CheckpointOptions& options = {},
    std::FILE* report = stderr) {
  const auto found = list_checkpoints(directory, options);
  std::string newest_failure;
  for (const auto& [step, path] : found) {
    try {
      SafetensorsFile::map(path).verify_checksum();
      return path;
    } catch (const Error& error) {
      if (newest_failure.empty()) newest_failure = error.operation() + ": " + error.cause();
      if (report)
        std::fprintf(report, "tandem: skipping damaged checkpoint %s: %s\n", path.c_str(),
                     error.what());
    }
  }
  if (!found.empty()) {
    throw Error("latest_checkpoint " + directory.string(),
                "all " + std::to_string(found.size()) +
                    " checkpoint(s) are damaged, so the run cannot resume; refusing to start from "
                    "scratch (move them aside to do that). The newest: " +
                    newest_failure);
  }
  return std::nullopt;
}

namespace detail {

// What a failed step of a checkpoint says to the other ranks: a tandem::Error's operation and
// cause (without "tandem: rank R: ", which the Error of the rank reporting it adds), or the
// exception's type and text.
inline std::string failure_text(const std::exception& error) {
  if (const auto* own = dynamic_cast<const Error*>(&error)) {
    return own->operation() + ": " + own->cause();
  }
  if (dynamic_cast<const std::bad_alloc*>(&error)) return "out of memory (std::bad_alloc)";
  return error.what();
}

// Every rank's `text`, in rank order (a collective). At most 4000 bytes of each travel.
template <Communicator Comm>
std::vector<std::string> gather_text(Comm& comm, std::string_view text) {
  text = text.substr(0, 4000);
  const std::vector<std::uint8_t> bytes(text.begin(), text.end());
  std::vector<std::string> out;
  for (const auto& part : all_gather_per_rank(comm, std::span<const std::uint8_t>(bytes))) {
    out.emplace_back(part.begin(), part.end());
  }
  return out;
}

// "rank 0: A; ranks 1, 3: B": each distinct value once, with the ranks that hold it.
inline std::string values_by_rank(const std::vector<std::string>& values) {
  std::vector<std::pair<std::string, std::vector<std::size_t>>> groups;
  for (std::size_t r = 0; r < values.size(); ++r) {
    auto found = std::find_if(groups.begin(), groups.end(),
                              [&](const auto& group) { return group.first == values[r]; });
    if (found == groups.end()) {
      groups.push_back({values[r], {r}});
    } else {
      found->second.push_back(r);
    }
  }
  std::string text;
  for (const auto& [value, ranks] : groups) {
    if (!text.empty()) text += "; ";
    text += ranks.size() == 1 ? "rank " : "ranks ";
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      text += (i ? ", " : "") + std::to_string(ranks[i]);
    }
    text += ": " + value;
  }
  return text;
}

// Every rank's `failure` (empty: none) decides together: when any rank failed, an Error on every
// rank - its own cause on a rank that failed, and on the others "rank R failed to VERB: CAUSE",
// so that no rank claims another's failure and the cause reaches every rank's output.
template <Communicator Comm>
void agree_on_failure(Comm& comm, const std::string& failure, const std::string& operation,
                      const std::string& verb) {
  const auto all = gather_text(comm, failure);
  if (!failure.empty()) throw Error(comm.rank(), operation, failure);
  std::size_t failed = 0;
  std::size_t first = all.size();
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    ++failed;
    if (first == all.size()) first = r;
  }
  if (failed == 0) return;
  throw Error(
      comm.rank(), operation,
      "rank " + std::to_string(first) + " failed to " + verb +
          (failed > 1 ? " (and " + std::to_string(failed - 1) + " other rank(s) failed)" : "") +
          ": " + all[first]);
}

// Rank 0's part of preparing `directory` (claim: lock, probe, sweep); "" or why it failed.
inline std::string claim_failure(const std::filesystem::path& directory,
                                 const CheckpointOptions& options) {
  try {
    claim_directory(directory, options.prefix, options.exclusive,
                    "checkpoint directory " + directory.string());
  } catch (const std::exception& error) {
    return failure_text(error);
  }
  return {};
}

// Rank 0: an Error unless the checkpoints in `directory` are this run's (see check_ownership).
inline void check_checkpoints_are_ours(
    const std::filesystem::path& directory, const CheckpointOptions& options,
    const std::vector<std::pair<std::int64_t, std::filesystem::path>>& found) {
  check_ownership(directory, options.prefix, found.size(),
                  found.empty() ? std::string() : found.front().second.filename().string(),
                  "checkpoint directory " + directory.string());
}

// The step in the name of checkpoint `path` ("step 200"), or "" for another name.
inline std::string step_in_name(const std::filesystem::path& path,
                                const CheckpointOptions& options) {
  const std::string name = path.filename().string();
  const std::string suffix = ".safetensors";
  if (!name.starts_with(options.prefix) || !name.ends_with(suffix) ||
      name.size() < options.prefix.size() + suffix.size()) {
    return {};
  }
  const auto step = whole_number<std::int64_t>(
      name.substr(options.prefix.size(), name.size() - options.prefix.size() - suffix.size()));
  return step ? "step " + std::to_string(*step) + ", " : std::string();
}

// Rank 0, after a save: deletes the checkpoints beyond options.keep_last (0: none), saying on
// stderr which it could not.
inline void prune_checkpoints(const std::filesystem::path& directory,
                              const CheckpointOptions& options) {
  if (options.keep_last == 0) return;
  const auto all = list_checkpoints(directory, options);
  for (std::size_t i = options.keep_last; i < all.size(); ++i) {
    std::error_code error;
    std::filesystem::remove(all[i].second, error);
    if (error) {
      std::fprintf(stderr, "tandem: rank 0: could not remove the old checkpoint %s: %s\n",
                   all[i].second.c_str(), error.message().c_str());
    }
  }
}

}  // namespace detail

/// The newest whole checkpoint in `directory`, the same on every rank (a collective): each rank
/// looks for itself (with options.broadcast only rank 0 does, and tells the others), and when
/// ranks find different ones (a node-local directory, a file written meanwhile) that is an Error
/// on every rank naming the ranks and what each found. Empty when there is none (a first run).
template <Communicator Comm>
[[nodiscard]] std::optional<std::filesystem::path> latest_checkpoint(
    Comm& comm, const std::filesystem::path& directory, const CheckpointOptions& options = {}) {
  const std::string operation = "latest_checkpoint " + directory.string();
  std::string failure, found;
  if (!options.broadcast || comm.rank() == 0) {
    try {
      const auto latest =
          latest_checkpoint(directory, options, comm.rank() == 0 ? stderr : nullptr);
      found = latest ? "P" + latest->string() : "N";
    } catch (const std::exception& error) {
      failure = detail::failure_text(error);
    }
  }
  detail::agree_on_failure(comm, failure, operation, "look for the newest checkpoint");
  auto picks = detail::gather_text(comm, found);
  if (options.broadcast) picks.assign(picks.size(), picks.front());
  if (std::any_of(picks.begin(), picks.end(), [&](const auto& pick) { return pick != picks[0]; })) {
    for (auto& pick : picks) pick = pick == "N" ? "none" : pick.substr(1);
    throw Error(comm.rank(), operation,
                "the ranks found different newest checkpoints: " + detail::values_by_rank(picks));
  }
  if (picks[0] == "N") return std::nullopt;
  return std::filesystem::path(picks[0].substr(1));
}

/// Saves `state` to `path`: every rank takes part (random generators are gathered), rank 0
/// writes its parameters, buffers and optimizer state (every rank holds the same under DDP,
/// which broadcasts buffers from rank 0) atomically (temporary file, fsync, rename, fsync of the
/// directory); then every rank learns the outcome. A failure on rank 0 is its Error with the
/// cause, and every other rank's Error says "rank 0 failed to save ...: CAUSE".
template <Communicator Comm>
void save_checkpoint(Comm& comm, const std::filesystem::path& path, const TrainingState& state) {
  const auto ranks = detail::checkpoint_ranks(comm);
  SafetensorsWriter writer;
  std::string failure;
  try {
    state.save_to(writer, ranks);
    if (comm.rank() == 0) writer.checksum().write(path);
  } catch (const std::exception& error) {
    failure = detail::failure_text(error);
  }
  detail::agree_on_failure(comm, failure, "save_checkpoint " + path.string(),
                           "save checkpoint " + path.string());
}

/// Saves step `step` into `directory` and, on rank 0, deletes the oldest beyond
/// options.keep_last. Rank 0 claims the directory first where open_checkpoints did not (created
/// if needed, its lock taken, a write probed), and refuses one holding checkpoints this run did
/// not resume from. A failure on rank 0 (a full disk, say) is rank 0's Error with its cause; the
/// other ranks' Errors say "rank 0 failed to save checkpoint step S: CAUSE". Returns the path.
template <Communicator Comm>
std::filesystem::path save_checkpoint(Comm& comm, const std::filesystem::path& directory,
                                      std::int64_t step, const TrainingState& state,
                                      const CheckpointOptions& options = {}) {
  const auto path = checkpoint_path(directory, step, options);
  const auto ranks = detail::checkpoint_ranks(comm);
  SafetensorsWriter writer;
  std::string failure;
  try {
    state.save_to(writer, ranks);  // every rank: the collective parts
    if (comm.rank() == 0) {
      detail::claim_directory(directory, options.prefix, options.exclusive,
                              "checkpoint directory " + directory.string());
      detail::check_checkpoints_are_ours(directory, options, list_checkpoints(directory, options));
      writer.checksum().write(path);
    }
  } catch (const std::exception& error) {
    failure = detail::failure_text(error);
  }
  detail::agree_on_failure(
      comm, failure, "save_checkpoint step " + std::to_string(step) + " (" + path.string() + ")",
      "save checkpoint step " + std::to_string(step));
  if (comm.rank() == 0) detail::prune_checkpoints(directory, options);
  return path;
}

/// Loads `state` from `path` on every rank: each rank reads the file (or, with
/// options.broadcast, rank 0 reads it and broadcasts its bytes). The file's format and data
/// checksum are checked first, then that every rank holds the same checkpoint (path, step and
/// content fingerprint: an Error naming the ranks and what each holds when they differ), then
/// the state is restored. Any failure is an Error on every rank: its own cause on the rank that
/// failed, "rank R failed to load ...: CAUSE" on the others.
template <Communicator Comm>
void load_checkpoint(Comm& comm, const std::filesystem::path& path, const TrainingState& state,
                     const CheckpointOptions& options = {}) {
  const std::string operation = "load_checkpoint " + path.string();
  const std::string verb = "load the checkpoint";  // its path: in the cause
  const auto ranks = detail::checkpoint_ranks(comm);
  std::string failure;
  std::optional<SafetensorsFile> file;
  std::vector<std::uint8_t> bytes;
  if (options.broadcast) {
    if (comm.rank() == 0) {
      try {
        bytes = detail::read_whole_file(path.string());
        // Validated before anything is sent.
        (void)SafetensorsFile::parse(std::as_bytes(std::span<const std::uint8_t>(bytes)),
                                     path.string());
      } catch (const std::exception& error) {
        failure = detail::failure_text(error);
      }
    }
    detail::agree_on_failure(comm, failure, operation, verb);
    broadcast_vector(comm, bytes, 0);
  }
  std::string identity;
  try {
    file = options.broadcast
               ? SafetensorsFile::parse(std::as_bytes(std::span<const std::uint8_t>(bytes)),
                                        path.string())
               : SafetensorsFile::map(path);
    file->verify_checksum();
    // With broadcast every rank holds rank 0's bytes, whatever path it was given.
    identity = options.broadcast ? "rank 0's file (content " + file->fingerprint() + ")"
                                 : path.string() + " (" + detail::step_in_name(path, options) +
                                       "content " + file->fingerprint() + ")";
  } catch (const std::exception& error) {
    failure = detail::failure_text(error);
  }
  detail::agree_on_failure(comm, failure, operation, verb);
  const auto identities = detail::gather_text(comm, identity);
  if (std::any_of(identities.begin(), identities.end(),
                  [&](const auto& other) { return other != identities[0]; })) {
    throw Error(comm.rank(), operation,
                "the ranks hold different checkpoints: " + detail::values_by_rank(identities));
  }
  try {
    state.load_from(*file, ranks);
    // One of a directory's checkpoints: this run continues that directory's run (a file of
    // another name, weights to start from, says nothing about the directory).
    if (comm.rank() == 0 && !detail::step_in_name(path, options).empty()) {
      detail::note_resumed_from(path.has_parent_path() ? path.parent_path() : ".", options.prefix);
    }
  } catch (const std::exception& error) {
    failure = detail::failure_text(error);
  }
  detail::agree_on_failure(comm, failure, operation, verb);
}

/// Prepares `directory` before the first step (a collective): rank 0 creates it, takes its lock
/// (options.exclusive: a directory another job holds is an Error naming that job), checks that a
/// file can be written there (an unwritable directory is an Error naming it and the reason now,
/// not at the first save) and sweeps the temporary files of dead saves; with options.resume,
/// the newest checkpoint (latest_checkpoint(comm, ...), the same on every rank) is loaded into
/// `state` and returned; then a directory holding checkpoints this run did not resume from is
/// refused (saving would overwrite and prune another run's files). Any failure is an Error on
/// every rank. save_checkpoint does the same at its first save where this was not called.
template <Communicator Comm>
std::optional<std::filesystem::path> open_checkpoints(Comm& comm,
                                                      const std::filesystem::path& directory,
                                                      const TrainingState& state,
                                                      const CheckpointOptions& options = {}) {
  const std::string operation = "open_checkpoints " + directory.string();
  const std::string verb = "prepare its checkpoint directory";  // which: in the cause
  detail::agree_on_failure(comm, comm.rank() == 0 ? detail::claim_failure(directory, options) : "",
                           operation, verb);
  std::optional<std::filesystem::path> last;
  if (options.resume) {
    last = latest_checkpoint(comm, directory, options);
    if (last) load_checkpoint(comm, *last, state, options);
  }
  std::string failure;
  if (comm.rank() == 0) {
    try {
      detail::check_checkpoints_are_ours(directory, options, list_checkpoints(directory, options));
    } catch (const std::exception& error) {
      failure = detail::failure_text(error);
    }
  }
  detail::agree_on_failure(comm, failure, operation, verb);
  return last;
}

}  // namespace tandem
