// fault_worker: one rank of a short data-parallel training (tests/support/mlp.hpp's perceptron,
// DistributedDataParallel overlapping its bucket all_reduces with the backward, plain SGD, the
// loss averaged over the ranks each step) that one rank, the victim, abandons at a chosen step
// and point. tests/fault/fault_driver.py starts it and injects the fault; see the README there.
//
// Processes (gloo, shm, hierarchical, mpi): the victim announces where it is in DIR/rank<V>.at
// and the driver sends the signal (SIGKILL or SIGSTOP) from outside:
//   before  the victim announces and waits for the signal before entering the collective;
//   after   the victim leaves the collective, announces and waits for the signal;
//   inside  the victim announces and enters the collective; the survivors enter it only once
//           the driver has signalled the victim (DIR/signalled), so the victim is blocked inside
//           it when the signal lands (after a random delay). The victim writes "passed" should
//           the collective return, so the driver knows where it landed.
// The collective is the step's gradient sync (--target grads: before = before the forward,
// inside = in finish_gradient_sync with buckets on the wire, after = once it returned) or the
// loss all_reduce (--target loss).
// Threads (local): a rank thread cannot be signalled, so the victim thread does it itself:
// --fault exit makes it return from its rank function at the point (its LocalComm is destroyed:
// the group sees it leave, the SIGKILL of a thread), --fault stop makes it block there until the
// survivors have ended (a thread that stops participating and never returns, the SIGSTOP of a
// thread). For inside it first starts the collective as `_async` (its part is in flight); the
// survivors enter it once the victim has announced.
//
// No step waits on the clock: a process rank starts its rendezvous once every rank's process has
// started (DIR/rank<R>.pid), so that a slow start on a loaded machine does not count against the
// short collective timeout the rendezvous shares, and the survivors wait for the events above.
//
// Every rank writes DIR/rank<R>.pid at start and DIR/rank<R>.end (exit code, CLOCK_MONOTONIC
// nanoseconds, the error text) as it ends; a survivor prints the tandem::Error it caught to
// stderr. Without a fault (--fault-step -1) every rank trains to the end and exits 0 only if the
// loss fell.
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "support/mlp.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/ddp/ddp.hpp"
#include "worker.hpp"

namespace {

struct Settings {
  std::string backend = "local";
  int ranks = 2;  // threads to run (local); processes: the job's size, for the start (see the top)
  int steps = 40;
  int timeout_ms = 2500;
  int fault_step = -1;
  std::string point = "before";  // before | inside | after
  std::string target = "grads";  // grads | loss
  std::string fault = "exit";    // local: exit | stop
  int victim = 1;
  std::string dir = ".";
};

std::int64_t monotonic_ns() {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<std::int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
}

/// Writes `text` to DIR/name through a temporary file and a rename, so the driver never reads
/// half of it.
void publish(const Settings& settings, const std::string& name, const std::string& text) {
  const std::string path = settings.dir + "/" + name;
  const std::string temporary = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << text;
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    std::fprintf(stderr, "fault_worker: cannot write %s\n", path.c_str());
  }
}

/// The victim's announcement: where it is, and when.
void announce(const Settings& settings, int rank, const char* state, int step) {
  publish(settings, "rank" + std::to_string(rank) + ".at",
          std::string(state) + " " + std::to_string(step) + " " + settings.target + " " +
              std::to_string(monotonic_ns()) + "\n");
}

/// Waits for DIR/name to exist (a file another process writes), polling; false when it has not
/// after `limit` (a hang elsewhere: the caller goes on, and the trial fails where it should).
bool await_file(const Settings& settings, const std::string& name, std::chrono::seconds limit) {
  const std::string path = settings.dir + "/" + name;
  const auto until = std::chrono::steady_clock::now() + limit;
  while (::access(path.c_str(), F_OK) != 0) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

/// A process rank waits here until every rank's process has started (see the top).
void await_every_rank(const Settings& settings) {
  for (int r = 0; r < settings.ranks; ++r) {
    if (!await_file(settings, "rank" + std::to_string(r) + ".pid", std::chrono::seconds(300))) {
      std::fprintf(stderr, "fault_worker: rank %d never started\n", r);
      return;
    }
  }
}

/// A process victim waits here for the driver's signal; one that never comes is a driver bug.
[[noreturn]] void await_signal(int rank) {
  for (int i = 0; i < 6000; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::fprintf(stderr, "fault_worker: rank %d: the driver never sent its signal\n", rank);
  std::_Exit(3);
}

/// The process-wide hand-off between a local victim that stops and the survivors it outlives.
struct LocalStop {
  std::mutex mutex;
  std::condition_variable changed;
  int ended = 0;
};

/// Thrown by a local victim that "exits": it leaves its rank function at once.
struct VictimExit {};

/// What a victim does at its point (where = before | inside | after; inside: after it started
/// the collective). Before an inside collective, survivors wait for the fault (see the top).
class FaultPlan {
 public:
  FaultPlan(const Settings& settings, int rank, bool threads, LocalStop* stop)
      : settings_(settings), rank_(rank), threads_(threads), stop_(stop) {}

  [[nodiscard]] bool victim() const { return rank_ == settings_.victim; }

  /// Local victims only: the buffer of the collective a victim leaves in flight.
  std::vector<double>* in_flight = nullptr;

  /// Called at each point of each step's collective `target` (grads | loss).
  void at(int step, std::string_view target, std::string_view where) {
    if (step != settings_.fault_step || target != settings_.target) return;
    if (!victim()) {
      if (where == "before" && settings_.point == "inside") {
        // Threads: the victim has announced (it leaves right after); processes: the driver has
        // signalled it, inside the collective the survivors have not entered.
        (void)await_file(settings_,
                         threads_ ? "rank" + std::to_string(settings_.victim) + ".at" : "signalled",
                         std::chrono::seconds(300));
      }
      return;
    }
    if (where == "passed") {
      if (settings_.point == "inside") announce(settings_, rank_, "passed", step);
      return;
    }
    if (where != settings_.point) return;
    announce(settings_, rank_, settings_.point.c_str(), step);
    if (!threads_) {
      if (settings_.point != "inside") await_signal(rank_);
      return;  // inside: the collective follows; the driver signals during it
    }
    if (settings_.fault == "exit") throw VictimExit{};
    // stop: never return to the training; wake once the survivors have ended.
    std::unique_lock lock(stop_->mutex);
    stop_->changed.wait_for(lock, std::chrono::seconds(60),
                            [&] { return stop_->ended >= settings_.ranks - 1; });
    throw VictimExit{};
  }

 private:
  const Settings& settings_;
  int rank_;
  bool threads_;
  LocalStop* stop_;
};

/// One rank's training. Returns whether the loss fell; throws what the communicator throws.
template <tandem::Communicator Comm>
bool train(Comm& comm, const Settings& settings, FaultPlan& plan) {
  constexpr std::size_t local_batch = 16;
  tandem::test::Mlp<float> model({8, 48, 48, 4}, /*seed=*/7);
  // Small buckets: several all_reduces per step, the first started during the backward.
  tandem::DistributedDataParallel<Comm, tandem::overlap, tandem::bucket_cap<4096>> ddp(
      comm, model.params());
  const auto rank = static_cast<std::size_t>(comm.rank());
  const bool threads = settings.backend == "local";
  double first_loss = 0.0;
  double last_loss = 0.0;
  for (int step = 0; step < settings.steps; ++step) {
    ddp.before_forward();  // broadcasts the running mean from rank 0
    model.params().zero_grad();
    plan.at(step, "grads", "before");
    const auto batch = tandem::test::make_batch(3, static_cast<std::size_t>(step) % 8,
                                                rank * local_batch, local_batch, 8, 4);
    const double loss = model.forward_backward(batch, 1.0 / static_cast<double>(local_batch),
                                               [&](auto& param) { ddp.grad_ready(param); });
    // A thread victim leaves here with the buckets started during the backward in flight.
    plan.at(step, "grads", "inside");
    ddp.finish_gradient_sync();
    plan.at(step, "grads", "passed");
    plan.at(step, "grads", "after");
    model.sgd_step(0.05f);

    std::vector<double> mean{loss};
    plan.at(step, "loss", "before");
    if (threads && settings.point == "inside" && plan.victim() && step == settings.fault_step &&
        settings.target == "loss") {
      // The victim thread leaves with its all_reduce in flight, on a buffer that outlives its
      // LocalComm (whose destructor runs what is still queued).
      auto& buffer = *plan.in_flight;
      buffer = mean;
      auto work = comm.all_reduce_async(buffer, tandem::ReduceOp::avg);
      plan.at(step, "loss", "inside");
      work.wait();
      mean = buffer;
    } else {
      plan.at(step, "loss", "inside");
      comm.all_reduce(mean, tandem::ReduceOp::avg);
      plan.at(step, "loss", "passed");
    }
    plan.at(step, "loss", "after");
    if (step == 0) first_loss = mean[0];
    last_loss = mean[0];
  }
  if (rank == 0) {
    std::printf("fault_worker: loss %.5f at the start, %.5f after %d steps\n", first_loss,
                last_loss, settings.steps);
    std::fflush(stdout);
  }
  return last_loss < first_loss;
}

void record_end(const Settings& settings, int rank, int code, const std::string& error) {
  publish(settings, "rank" + std::to_string(rank) + ".end",
          std::to_string(code) + " " + std::to_string(monotonic_ns()) + "\n" + error + "\n");
}

int run_local(const Settings& settings) {
  LocalStop stop;
  std::vector<char> ok(static_cast<std::size_t>(settings.ranks), 0);
  std::vector<std::vector<double>> in_flight(static_cast<std::size_t>(settings.ranks));
  publish(settings, "rank0.pid", std::to_string(::getpid()) + "\n");
  try {
    tandem::run_local(
        settings.ranks,
        [&](tandem::LocalComm& comm) {
          const int rank = comm.rank();
          FaultPlan plan(settings, rank, /*threads=*/true, &stop);
          plan.in_flight = &in_flight[static_cast<std::size_t>(rank)];
          try {
            ok[static_cast<std::size_t>(rank)] = train(comm, settings, plan);
            record_end(settings, rank, 0, "");
          } catch (const VictimExit&) {
            ok[static_cast<std::size_t>(rank)] = 1;  // the fault, not a failure of this rank
            return;
          } catch (const std::exception& e) {
            std::fprintf(stderr, "fault_worker: rank %d caught: %s\n", rank, e.what());
            std::fflush(stderr);
            record_end(settings, rank, 1, e.what());
            {
              std::lock_guard lock(stop.mutex);
              ++stop.ended;
            }
            stop.changed.notify_all();
            throw;
          }
          {
            std::lock_guard lock(stop.mutex);
            ++stop.ended;
          }
          stop.changed.notify_all();
        },
        tandem::LocalCommOptions{std::chrono::milliseconds(settings.timeout_ms)});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fault_worker: run_local: %s\n", e.what());
    return 1;
  }
  for (char each : ok) {
    if (!each) return 1;
  }
  return 0;
}

/// A process rank: trains, and reports how it ended (the survivors' Error on stderr).
template <class MakeComm>
int run_process(const Settings& settings, int rank, MakeComm&& make_comm) {
  publish(settings, "rank" + std::to_string(rank) + ".pid", std::to_string(::getpid()) + "\n");
  await_every_rank(settings);
  try {
    auto comm = make_comm();
    FaultPlan plan(settings, comm.rank(), /*threads=*/false, nullptr);
    const bool ok = train(comm, settings, plan);
    comm.barrier();
    record_end(settings, rank, ok ? 0 : 1, ok ? "" : "the loss did not fall");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fault_worker: rank %d caught: %s\n", rank, e.what());
    std::fflush(stderr);
    record_end(settings, rank, 1, e.what());
    return 1;
  }
}

int usage() {
  std::fprintf(
      stderr,
      "usage: fault_worker --backend local|gloo|shm|hierarchical|mpi --dir DIR\n"
      "  [--ranks N] [--steps S] [--timeout-ms T] [--fault-step S --point before|inside|after\n"
      "  --target grads|loss --victim V --fault exit|stop]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  const auto number = [](const std::string& value) {
    const auto parsed = tandem::parse_int(value);
    if (!parsed || *parsed < -1 || *parsed > 1000000) throw std::invalid_argument(value);
    return static_cast<int>(*parsed);
  };
  try {
    const bool read = tandem::test::fault::read_flags(
        argc, argv, [&](std::string_view flag, const std::string& value) {
          if (flag == "--backend")
            settings.backend = value;
          else if (flag == "--dir")
            settings.dir = value;
          else if (flag == "--ranks")
            settings.ranks = number(value);
          else if (flag == "--steps")
            settings.steps = number(value);
          else if (flag == "--timeout-ms")
            settings.timeout_ms = number(value);
          else if (flag == "--fault-step")
            settings.fault_step = number(value);
          else if (flag == "--point")
            settings.point = value;
          else if (flag == "--target")
            settings.target = value;
          else if (flag == "--fault")
            settings.fault = value;
          else if (flag == "--victim")
            settings.victim = number(value);
          else
            return false;
          return true;
        });
    if (!read) return usage();
  } catch (const std::invalid_argument&) {
    return usage();
  }
  const auto timeout = std::chrono::milliseconds(settings.timeout_ms);
  if (settings.backend == "local") return run_local(settings);
  return tandem::test::fault::with_process_comm(
      "fault_worker", settings.backend, timeout, [&](auto make_comm) {
        return run_process(settings, tandem::test::fault::launcher_rank(settings.backend),
                           make_comm);
      });
}
