// tandem/io/async_checkpoint.hpp - AsyncCheckpoints: save_checkpoint's checkpoints, written in
// the background. save() takes a snapshot of the training state at a step boundary (every rank
// takes part, as in save_checkpoint: random generators gathered, a ZeRO optimizer's parts
// gathered; rank 0 copies everything into memory) and returns; a thread of rank 0 writes the file
// (atomically, as save_checkpoint does) and prunes the oldest while training goes on. One save is
// in flight at a time: a save while one is in flight waits for it first. A failed write is
// reported by the first check() or wait() after it ended (or by the next save()), on every rank,
// with its cause, as save_checkpoint reports one.
//   tandem::AsyncCheckpoints checkpoints(comm, "ckpt", {.keep_last = 3});
//   for (...) {
//     train_step();
//     checkpoints.check();                              // a failed background save throws here
//     if (step % 500 == 0) checkpoints.save(step, state);  // returns once the snapshot is taken
//   }
//   checkpoints.wait();                                 // the last file is on disk
// Needs: nlohmann-json (the tandem::io CMake component) and a Communicator.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/metrics.hpp"
#include "tandem/core/error.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/io/safetensors.hpp"
#include "tandem/io/training_state.hpp"

namespace tandem {

/// Checkpoints of one job in `directory`, written by a background thread of rank 0 while
/// training goes on. Every member function is a collective: every rank calls it at the same
/// point of the run. The directory rules are save_checkpoint's (rank 0 claims it at the first
/// save, a directory holding another run's checkpoints is refused, the last keep_last are kept).
/// The destructor waits for the write in flight, so no snapshot taken is lost; a failure it finds
/// goes to stderr (a destructor cannot throw): call wait() before the end to have it raised.
template <Communicator Comm>
class AsyncCheckpoints {
 public:
  /// Checkpoints of `comm`'s job in `directory`, kept and named as `options` say.
  AsyncCheckpoints(Comm& comm, std::filesystem::path directory, CheckpointOptions options = {})
      : comm_(&comm), directory_(std::move(directory)), options_(std::move(options)) {}
  AsyncCheckpoints(const AsyncCheckpoints&) = delete;
  AsyncCheckpoints& operator=(const AsyncCheckpoints&) = delete;
  ~AsyncCheckpoints() {
    if (!write_.valid()) return;
    const std::string failure = write_.get();
    if (!failure.empty()) {
      std::fprintf(stderr, "tandem: rank 0: %s: %s\n", operation().c_str(), failure.c_str());
    }
  }

  /// Takes the snapshot of `state` for step `step` and starts writing it: first waits for a save
  /// still in flight (raising its failure), then every rank takes part in the snapshot (the
  /// collective parts of `state`) and rank 0 copies the state into memory, claims the directory
  /// where it has not yet, and hands the copy to its writer thread. Returns the file's path once
  /// the snapshot is taken: the state may change from then on. A failure before the write (the
  /// snapshot, the directory) is an Error on every rank now, as save_checkpoint's.
  std::filesystem::path save(std::int64_t step, const TrainingState& state) {
    wait();
    const auto path = checkpoint_path(directory_, step, options_);
    auto writer = std::make_unique<SafetensorsWriter>();
    std::string failure;
    try {
      state.save_to(*writer, detail::checkpoint_ranks(*comm_));
      if (comm_->rank() == 0) {
        detail::claim_directory(directory_, options_.prefix, options_.exclusive,
                                "checkpoint directory " + directory_.string());
        detail::check_checkpoints_are_ours(directory_, options_,
                                           list_checkpoints(directory_, options_));
      }
    } catch (const std::exception& error) {
      failure = detail::failure_text(error);
    }
    step_ = step;
    path_ = path;
    detail::agree_on_failure(*comm_, failure, operation(), "save checkpoint " + step_text());
    in_flight_ = true;
    if (comm_->rank() == 0) {
      write_ = std::async(std::launch::async, [writer = std::move(writer), path,
                                               directory = directory_, options = options_] {
        try {
          writer->checksum().write(path);
          detail::prune_checkpoints(directory, options);
        } catch (const std::exception& error) {
          return detail::failure_text(error);
        }
        return std::string();
      });
    }
    return path;
  }

  /// Reports the save in flight if its write has ended (a collective of one integer when it
  /// has not, or has succeeded): a failure is an Error on every rank, rank 0's with its cause
  /// and the others' naming rank 0 and the cause. Never waits for the write. Call it every step.
  void check() { report(false); }

  /// Waits for the save in flight, if any, and reports it as check() does.
  void wait() { report(true); }

  /// Whether a save's outcome is still to be reported (its write may have ended).
  [[nodiscard]] bool in_flight() const noexcept { return in_flight_; }

 private:
  enum : std::int64_t { running = 0, written = 1, failed = 2 };

  void report(bool block) {
    if (!in_flight_) return;
    std::int64_t status = running;
    std::string failure;
    if (comm_->rank() == 0 &&
        (block || write_.wait_for(std::chrono::seconds(0)) == std::future_status::ready)) {
      failure = write_.get();
      status = failure.empty() ? written : failed;
    }
    status = reduce_sum(*comm_, std::array<std::int64_t, 1>{status})[0];  // rank 0's
    if (status == running) return;
    in_flight_ = false;
    if (status == written) return;
    detail::agree_on_failure(*comm_, failure, operation(), "save checkpoint " + step_text());
  }

  [[nodiscard]] std::string step_text() const { return "step " + std::to_string(step_); }
  [[nodiscard]] std::string operation() const {
    return "save_checkpoint " + step_text() + " (" + path_.string() + ", in the background)";
  }

  Comm* comm_;
  std::filesystem::path directory_;
  CheckpointOptions options_;
  std::int64_t step_ = 0;
  std::filesystem::path path_;
  bool in_flight_ = false;
  std::future<std::string> write_;  // rank 0's writer: its failure, "" when it succeeded
};

}  // namespace tandem
