// ZeRO (DistributedDataParallel's shard<1> and shard<2>) on LocalComm, 1 to 4 ranks: the same
// parameters and optimizer state as plain DDP bit for bit, with two param groups, an LR change,
// no_sync accumulation and a GradScaler overflow on one rank; state memory 1/N of DDP's; misuse
// errors; consolidated checkpoints loaded at other world sizes, with and without sharding; the
// apex O2 compute copy (amp::ComputeWeights) refreshed after ddp.step, the same as DDP's.
// As one rank of a job of processes (TANDEM_TEST_ZERO_JOB names the backend), the same
// comparison runs on groups of 1 .. the job's size ranks split off the job, and nothing else:
// gloo (ctest zero_gloo_np3, under tandemrun; built with TANDEM_TEST_GLOO), shm (zero_shm_np3,
// the intra-node shared-memory path; TANDEM_TEST_SHM), mpi (zero_mpi_np4, under mpirun;
// TANDEM_TEST_MPI). One executable holds every backend it was built with, so that the LocalComm
// cases compile once. Each also runs the stages against DDP through a tandem::Join on uneven
// data (rank r runs 4 + 2r steps).
//
// Bit for bit: LocalComm's reduce_scatter and all_reduce add the ranks' inputs in rank order, so
// a shard<2> gradient equals the DDP one; the optimizers update each element on its own, so
// stepping only a rank's parts gives the same bits; all_gather copies. GlooComm reduce-scatters
// by all-reducing the N * (count / N) elements of a bucket's equal parts, where DDP all-reduces
// the whole bucket: Gloo's ring cuts the two buffers into different chunks, so from 3 ranks on
// an element's three addends may be added in another order (2 ranks: a + b == b + a exactly).
// MpiComm's reduce_scatter (MPI_Reduce_scatter_block) need not add in its all_reduce's order
// either. There shard<2> is compared within 1e-5 (absolute, on parameters of magnitude below 1
// after 5 steps of lr <= 0.1: a few float roundings of the gradient carried through the updates),
// and shard<1> (the same all_reduce as DDP) still bit for bit.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include "support/collective_suite.hpp"
#include "support/runners.hpp"
#include "tandem/amp/grad_scaler.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/ddp/ddp.hpp"
#include "tandem/ddp/join.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/optim/adamw.hpp"
#include "tandem/optim/sgd.hpp"
#include "tandem/tensor/precision.hpp"
#if defined(TANDEM_TEST_GLOO) || defined(TANDEM_TEST_SHM)
#include "tandem/comm/init.hpp"
#endif
#if defined(TANDEM_TEST_GLOO)
#include "tandem/comm/gloo/gloo.hpp"
#endif
#if defined(TANDEM_TEST_SHM)
#include "tandem/comm/shm/shm.hpp"
#endif
#if defined(TANDEM_TEST_MPI)
#include "tandem/comm/mpi/mpi.hpp"
#endif

namespace {

using tandem::LocalComm;
using tandem::test::Failures;

// Small buckets (16 and 7 floats) so that the 37-element arena has several, most of them not
// dividing by 2, 3 or 4 ranks.
template <class Comm, class... Policies>
using DdpOn = tandem::DistributedDataParallel<Comm, tandem::bucket_cap<64>,
                                              tandem::first_bucket_cap<28>, Policies...>;
template <class Comm, int Stage, bool Prefetch = false>
struct StageOn {
  using type = DdpOn<Comm, tandem::shard<Stage>>;
};
template <class Comm, int Stage>
struct StageOn<Comm, Stage, true> {
  using type = DdpOn<Comm, tandem::shard<Stage>, tandem::prefetch_parameters>;
};
template <class Comm>
struct StageOn<Comm, 0, false> {
  using type = DdpOn<Comm>;
};
using Plain = DdpOn<LocalComm>;
using Stage1 = DdpOn<LocalComm, tandem::shard<1>>;
using Stage2 = DdpOn<LocalComm, tandem::shard<2>>;

void build(tandem::Parameters<float>& params) {
  params.add("layer1.weight", {7});
  params.add("layer1.bias", {3, 5});
  params.add("layer2.weight", {11});
  params.add("layer2.bias", {4});
  params.finalize();
  auto values = params.values();
  for (std::size_t i = 0; i < values.size(); ++i) {
    values[i] = 0.01f * static_cast<float>(i % 13) - 0.05f;
  }
}

tandem::optim::SGD<float> make_sgd(tandem::Parameters<float>& params) {
  using tandem::optim::params_with_prefix;
  return tandem::optim::SGD<float>(
      params, {{params_with_prefix("layer1."), {.lr = 0.1, .momentum = 0.9}},
               {params_with_prefix("layer2."),
                {.lr = 0.05, .momentum = 0.5, .weight_decay = 0.01, .nesterov = true}}});
}

tandem::optim::AdamW<float> make_adamw(tandem::Parameters<float>& params) {
  using tandem::optim::params_with_prefix;
  return tandem::optim::AdamW<float>(
      params, {{params_with_prefix("layer1."), {.lr = 0.01, .weight_decay = 0.1}},
               {params_with_prefix("layer2."), {.lr = 0.02, .amsgrad = true}}});
}

/// One rank's model as the tests train it: the arena of build(), a D over it and an optimizer O
/// that `make` makes (not sharded yet: the tests call ddp.shard(opt) themselves).
template <class D, class O>
struct Trainee {
  tandem::Parameters<float> params;
  D ddp;
  O opt;

  template <class Comm, class Make>
  Trainee(Comm& comm, Make make) : ddp(comm, built(params)), opt(make(params)) {}

 private:
  static tandem::Parameters<float>& built(tandem::Parameters<float>& params) {
    build(params);
    return params;
  }
};
template <class D, class Make>
using TraineeOf = Trainee<D, std::invoke_result_t<Make&, tandem::Parameters<float>&>>;

struct Loop {
  bool scaler = false;  // GradScaler(comm); step 3 overflows on the last rank only
  int first = 0;        // the first step's number (a resumed run goes on from there)
  int steps = 5;
  bool uneven = false;  // train_uneven(): through a tandem::Join, rank r running 4 + 2r steps
};

/// What train() and train_uneven() share: a synthetic backward per micro-batch (each rank's
/// gradients depend on its rank, the step and the micro-batch; with a scaler, step 3 overflows on
/// the last rank) and the optimizer's step through the DDP.
template <class Comm, class D, class O>
struct Steps {
  Comm& comm;
  Trainee<D, O>& t;
  std::optional<tandem::GradScaler<>> scaler;
  std::vector<bool> stepped;  // per step: whether the optimizer stepped
  std::vector<tandem::Parameters<float>::Parameter*> order;

  Steps(Comm& c, Trainee<D, O>& trainee, bool with_scaler) : comm(c), t(trainee) {
    if (with_scaler) scaler.emplace(comm, tandem::GradScalerOptions{.init_scale = 1024.0});
    for (auto& p : t.params) order.push_back(&p);
  }

  /// Micro-batch m of step s, then finish_gradient_sync(). Under prefetch_parameters the
  /// "forward" waits for each parameter's gather in registration order before reading it.
  void backward(int s, int m) {
    t.ddp.before_forward();
    if constexpr (D::config::prefetches) {
      for (auto* p : order) t.ddp.wait_parameters(*p);
    }
    const float scale = scaler ? static_cast<float>(scaler->scale(1.0f)) : 1.0f;
    auto values = t.params.values();
    auto grads = t.params.grads();
    for (std::size_t i = 0; i < grads.size(); ++i) {
      const float g =
          scale * (0.3f * values[i] +
                   std::sin(static_cast<float>(1 + i + 7 * comm.rank() + 13 * s + 29 * m)));
      grads[i] = m == 0 ? g : grads[i] + g;
    }
    if (scaler && s == 3 && comm.rank() == comm.size() - 1) {
      grads[5] = std::numeric_limits<float>::infinity();
    }
    for (auto it = order.rbegin(); it != order.rend(); ++it) t.ddp.grad_ready(**it);
    t.ddp.finish_gradient_sync();
  }

  void step() {
    if (scaler) {
      stepped.push_back(t.ddp.step(*scaler, t.opt));
      scaler->update();
    } else {
      t.ddp.step(t.opt);
      stepped.push_back(true);
    }
    t.opt.zero_grad();
  }
};

/// A synthetic training run: Steps' backward; step 2 accumulates two micro-batches under
/// no_sync(); step 3 halves group 0's lr afterwards. Returns, per step, whether the optimizer
/// stepped.
template <class Comm, class D, class O>
std::vector<bool> train(Comm& comm, Trainee<D, O>& t, Loop loop) {
  Steps<Comm, D, O> run(comm, t, loop.scaler);
  for (int s = loop.first; s < loop.first + loop.steps; ++s) {
    const int micros = s == 2 ? 2 : 1;
    for (int m = 0; m < micros; ++m) {
      std::optional<typename D::NoSyncGuard> guard;
      if (m + 1 < micros) guard.emplace(t.ddp.no_sync());
      run.backward(s, m);
    }
    run.step();
    if (s == 3) t.opt.set_lr(0, t.opt.lr(0) * 0.5);
  }
  return run.stepped;
}

/// Whether a and b agree within `tolerance` (0: bit for bit).
bool agree(tandem::View<float> a, tandem::View<float> b, float tolerance) {
  if (a.size() != b.size()) return false;
  if (tolerance == 0) return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!(std::fabs(a[i] - b[i]) <= tolerance)) return false;
  }
  return true;
}

using StateDict = tandem::optim::StateDict<float>;

/// Every tensor and scalar of two state dicts, bit for bit (tensors within `tolerance` when it is
/// not 0); a failure names the first difference.
std::string compare(const StateDict& a, const StateDict& b, float tolerance = 0) {
  if (a.state.size() != b.state.size()) return "state entries differ in number";
  if (a.param_groups.size() != b.param_groups.size()) return "param groups differ in number";
  for (std::size_t g = 0; g < a.param_groups.size(); ++g) {
    if (a.param_groups[g].options != b.param_groups[g].options ||
        a.param_groups[g].step != b.param_groups[g].step ||
        a.param_groups[g].params != b.param_groups[g].params) {
      return "param group " + std::to_string(g) + " differs";
    }
  }
  for (const auto& [index, entry] : a.state) {
    auto other = b.state.find(index);
    if (other == b.state.end()) return "no state " + std::to_string(index);
    if (entry.scalars != other->second.scalars) return "scalars of " + std::to_string(index);
    if (entry.tensors.size() != other->second.tensors.size()) {
      return "tensor count of " + std::to_string(index);
    }
    for (const auto& [key, tensor] : entry.tensors) {
      auto t = other->second.tensors.find(key);
      if (t == other->second.tensors.end()) return key + " missing in " + std::to_string(index);
      if (!agree(tandem::View<float>(const_cast<float*>(t->second.data()), t->second.size()),
                 tandem::View<float>(const_cast<float*>(tensor.data()), tensor.size()),
                 tolerance)) {
        return key + " of parameter " + std::to_string(index) + " differs";
      }
    }
  }
  return {};
}

template <class Comm>
std::size_t total_over_ranks(Comm& comm, std::size_t mine) {
  std::vector<std::int64_t> value{static_cast<std::int64_t>(mine)};
  comm.all_reduce(tandem::View<std::int64_t>(value.data(), 1), tandem::ReduceOp::sum);
  return static_cast<std::size_t>(value[0]);
}

/// train() on uneven data through a tandem::Join: rank r runs 4 + 2r steps (step 2 accumulating
/// two micro-batches under no_sync(); with a scaler, the division by world size deferred to it
/// and step 3 overflowing on the last rank), the ranks out of data shadowing the others; group
/// 0's lr halves after step 3 through join.after_each_step(), on every rank. Returns, per step
/// this rank ran, whether the optimizer stepped.
template <class Comm, class D, class O>
std::vector<bool> train_uneven(Comm& comm, Trainee<D, O>& t, Loop loop) {
  Steps<Comm, D, O> run(comm, t, loop.scaler);
  if (run.scaler) t.ddp.defer_average_to(*run.scaler, t.opt);
  tandem::Join join(t.ddp);
  int micro_steps = 0;  // counted on every rank, shadowed steps included
  join.after_each_step([&] {
    if (++micro_steps == 5) t.opt.set_lr(0, t.opt.lr(0) * 0.5);  // after step 3
  });
  for (int s = 0; s < 4 + 2 * comm.rank(); ++s) {
    const int micros = s == 2 ? 2 : 1;
    for (int m = 0; m < micros; ++m) {
      std::optional<typename D::NoSyncGuard> guard;
      if (m + 1 < micros) guard.emplace(t.ddp.no_sync());
      join.step([&] {
        run.backward(s, m);
        if (m + 1 == micros) run.step();
      });
    }
  }
  join.finish();
  return run.stepped;
}

/// Stage `Stage` (with prefetch_parameters when Prefetch) against plain DDP on n ranks of `run`
/// with optimizer `make` and loop `loop`, the parameters and gathered state within `tolerance`
/// (0: bit for bit).
template <class Comm, int Stage, class Run, class Make, bool Prefetch = false>
void check_against_ddp(Run& run, int n, Make make, Loop loop, Failures& failures,
                       float tolerance = 0) {
  using Sharded = typename StageOn<Comm, Stage, Prefetch>::type;
  run(n, [&](Comm& comm) {
    const int me = comm.rank();
    TraineeOf<DdpOn<Comm>, Make> ref(comm, make);
    auto train_as_told = [&](auto& trainee) {
      return loop.uneven ? train_uneven(comm, trainee, loop) : train(comm, trainee, loop);
    };
    const auto ref_stepped = train_as_told(ref);
    TraineeOf<Sharded, Make> sharded(comm, make);
    auto& params = sharded.params;
    auto& ddp = sharded.ddp;
    auto& opt = sharded.opt;
    ddp.shard(opt);
    const auto stepped = train_as_told(sharded);

    if constexpr (Prefetch) ddp.wait_parameters();  // the last step's gather, before reading
    const std::string where = "stage " + std::to_string(Sharded::shard_stage) +
                              (Prefetch ? " with prefetch_parameters, " : ", ") +
                              std::to_string(n) + " ranks, rank " + std::to_string(me) +
                              (loop.uneven ? ", uneven data through a Join" : "") + ": ";
    failures.expect(stepped == ref_stepped, where, "steps taken differ from DDP's");
    if (loop.scaler) {
      failures.expect(stepped.size() > 3 && !stepped[3], where,
                      "the overflow on the last rank did not skip step 3 here");
    }
    failures.expect(agree(params.values(), ref.params.values(), tolerance), where,
                    "parameters differ from DDP's");
    const std::string state = compare(opt.state_dict(), ref.opt.state_dict(), tolerance);
    failures.expect(state.empty(), where, "gathered optimizer state: ", state);
    const auto values = params.values();
    std::vector<float> all(values.size() * static_cast<std::size_t>(n));
    comm.all_gather(tandem::View<const float>(values.data(), values.size()),
                    tandem::View<float>(all.data(), all.size()));
    for (int r = 1; r < n; ++r) {
      failures.expect(std::memcmp(all.data(), all.data() + r * values.size(),
                                  values.size() * sizeof(float)) == 0,
                      where, "rank ", r, "'s parameters differ from rank 0's");
    }

    // Memory: the ranks' state adds up to DDP's exactly (no element lost or held twice), and
    // a rank holds at most one element per bucket beyond 1/N.
    const std::size_t full = ref.opt.state_bytes();
    const std::size_t mine = opt.state_bytes();
    failures.expect(total_over_ranks(comm, mine) == full, where, "state bytes ", mine,
                    " do not add up to DDP's ", full);
    const std::size_t most_per_element = 3 * sizeof(float);  // AdamW with amsgrad
    failures.expect(
        mine <= full / static_cast<std::size_t>(n) + ddp.buckets().size() * most_per_element, where,
        "state bytes ", mine, " exceed 1/", n, " of DDP's ", full, " plus one element",
        " per bucket");
  });
}

/// The comparison with DDP on groups of 1 .. job.size() ranks split off a job of processes:
/// shard<1> bit for bit, shard<2> within 1e-5 from 3 ranks on (see the top of the file).
template <class JobComm>
void check_job(JobComm& job) {
  tandem::test::SplitRunner<JobComm> run{&job};
  Failures failures;
  for (int n = 1; n <= job.size(); ++n) {
    const float stage2_tolerance = n <= 2 ? 0.0f : 1e-5f;
    check_against_ddp<JobComm, 1>(run, n, make_sgd, {}, failures);
    check_against_ddp<JobComm, 2>(run, n, make_sgd, {}, failures, stage2_tolerance);
    check_against_ddp<JobComm, 1>(run, n, make_adamw, {.scaler = true}, failures);
    check_against_ddp<JobComm, 2>(run, n, make_adamw, {.scaler = true}, failures, stage2_tolerance);
    check_against_ddp<JobComm, 1>(run, n, make_sgd, {.uneven = true}, failures);
    check_against_ddp<JobComm, 2>(run, n, make_adamw, {.scaler = true, .uneven = true}, failures,
                                  stage2_tolerance);
    check_against_ddp<JobComm, 1, decltype(run), decltype(&make_adamw), true>(
        run, n, make_adamw, {.scaler = true}, failures);
    check_against_ddp<JobComm, 2, decltype(run), decltype(&make_sgd), true>(
        run, n, make_sgd, {}, failures, stage2_tolerance);
  }
  failures.report();
}

/// The backend of the job of processes this process is one rank of (TANDEM_TEST_ZERO_JOB: gloo,
/// shm or mpi, set by the test that starts it), or "" when it runs alone.
std::string job_backend() {
  const char* backend = std::getenv("TANDEM_TEST_ZERO_JOB");
  return backend ? backend : "";
}

/// Whether this process is one rank of a job of processes (which runs the job's case only).
bool in_job() {
  return !job_backend().empty();
}

#if defined(TANDEM_TEST_GLOO) || defined(TANDEM_TEST_SHM)
/// This process's rank of the tandemrun job over Comm.
template <class Comm>
void check_launched_job() {
  auto comm = tandem::init_process_group<Comm>();
  check_job(comm);
}
#endif

}  // namespace

TEST_CASE("shard<1> and shard<2> equal DDP on the processes of a job (tandemrun, mpirun)") {
  const std::string backend = job_backend();
  if (backend.empty()) return;  // alone: the LocalComm cases below
  bool built = false;
#if defined(TANDEM_TEST_GLOO)
  if (backend == "gloo") {
    built = true;
    check_launched_job<tandem::GlooComm>();
  }
#endif
#if defined(TANDEM_TEST_SHM)
  if (backend == "shm") {
    built = true;
    check_launched_job<tandem::ShmComm>();
  }
#endif
#if defined(TANDEM_TEST_MPI)
  if (backend == "mpi") {
    built = true;
    auto world = tandem::MpiComm::world();
    check_job(world);
  }
#endif
  REQUIRE_MESSAGE(built, "TANDEM_TEST_ZERO_JOB=", backend, ": this build has no such backend");
}

TEST_CASE("shard<1> and shard<2> equal DDP bit for bit: SGD, two groups, no_sync, lr change") {
  if (in_job()) return;  // a rank of a job of processes: the job's case only
  tandem::test::LocalRunner run;
  Failures failures;
  for (int n = 1; n <= 4; ++n) {
    check_against_ddp<LocalComm, 1>(run, n, make_sgd, {}, failures);
    check_against_ddp<LocalComm, 2>(run, n, make_sgd, {}, failures);
  }
  failures.report();
}

TEST_CASE("shard<1> and shard<2> equal DDP bit for bit: AdamW and a GradScaler overflow") {
  if (in_job()) return;
  tandem::test::LocalRunner run;
  Failures failures;
  for (int n = 1; n <= 4; ++n) {
    check_against_ddp<LocalComm, 1>(run, n, make_adamw, {.scaler = true}, failures);
    check_against_ddp<LocalComm, 2>(run, n, make_adamw, {.scaler = true}, failures);
    check_against_ddp<LocalComm, 2>(run, n, make_adamw, {}, failures);
  }
  failures.report();
}

namespace {

/// Each rank's master values and half compute copy after 4 steps of apex O2 (the backward reads
/// and writes the half copy, whose gradients are cast into the arena) on n LocalComm ranks with D
/// and SGD with momentum, stepped through ddp.step: under ZeRO the all_gather brings the master
/// values back whole, so one refresh() gives every rank the whole compute copy.
template <class D>
std::vector<std::pair<std::vector<float>, std::vector<float>>> trained_o2(int n) {
  std::vector<std::pair<std::vector<float>, std::vector<float>>> out(static_cast<std::size_t>(n));
  tandem::run_local(n, [&](LocalComm& comm) {
    Trainee<D, tandem::optim::SGD<float>> t(comm, make_sgd);
    t.ddp.shard(t.opt);
    tandem::amp::ComputeWeights<tandem::amp::O2<>> weights(t.params.numel());
    std::vector<tandem::Parameters<float>::Parameter*> order;
    for (auto& p : t.params) order.push_back(&p);
    for (int s = 0; s < 4; ++s) {
      weights.refresh(tandem::on_host, t.params.values());
      t.ddp.before_forward();
      const auto half_values = weights.values();
      const auto half_grads = weights.grads();
      for (std::size_t i = 0; i < half_grads.size(); ++i) {
        const float wave = std::sin(static_cast<float>(1 + i + 7 * comm.rank() + 13 * s));
        half_grads[i] = tandem::half(0.3f * static_cast<float>(half_values[i]) + wave);
      }
      weights.grads_to_master(tandem::on_host, t.params.grads());
      for (auto it = order.rbegin(); it != order.rend(); ++it) t.ddp.grad_ready(**it);
      t.ddp.finish_gradient_sync();
      t.ddp.step(t.opt);
      t.opt.zero_grad();
    }
    weights.refresh(tandem::on_host, t.params.values());
    auto& mine = out[static_cast<std::size_t>(comm.rank())];
    const auto values = t.params.values();
    mine.first.assign(values.begin(), values.end());
    for (const tandem::half h : weights.values()) mine.second.push_back(static_cast<float>(h));
  });
  return out;
}

}  // namespace

TEST_CASE("shard<1> and shard<2> through a Join on uneven data equal DDP's Join bit for bit") {
  if (in_job()) return;
  tandem::test::LocalRunner run;
  Failures failures;
  for (int n = 1; n <= 4; ++n) {
    check_against_ddp<LocalComm, 1>(run, n, make_sgd, {.uneven = true}, failures);
    check_against_ddp<LocalComm, 2>(run, n, make_sgd, {.uneven = true}, failures);
    check_against_ddp<LocalComm, 1>(run, n, make_adamw, {.scaler = true, .uneven = true}, failures);
    check_against_ddp<LocalComm, 2>(run, n, make_adamw, {.scaler = true, .uneven = true}, failures);
  }
  failures.report();
}

TEST_CASE(
    "Inside a Join, a sharded optimizer steps through ddp.step: gather_parameters is an Error") {
  if (in_job()) return;
  Failures failures;
  tandem::test::LocalRunner{}(2, [&](LocalComm& comm) {
    Trainee<Stage2, tandem::optim::SGD<float>> t(comm, make_sgd);
    t.ddp.shard(t.opt);
    std::string text;
    {
      tandem::Join join(t.ddp);
      try {
        join.step([&] {
          for (auto& p : t.params) t.ddp.grad_ready(p);
          t.ddp.finish_gradient_sync();
          t.opt.step();
          t.ddp.gather_parameters();
        });
      } catch (const tandem::Error& e) {
        text = e.what();
      }
    }
    failures.expect(
        text.find("step a sharded optimizer through ddp.step(opt)") != std::string::npos, "rank ",
        comm.rank(), ": ", text);
    t.ddp.gather_parameters();  // outside the Join it is allowed again
  });
  failures.report();
}

TEST_CASE("shard<1> and shard<2> under O2: the same master and half weights as DDP") {
  if (in_job()) return;
  for (int n = 1; n <= 3; ++n) {
    const auto plain = trained_o2<Plain>(n);
    CHECK_MESSAGE((trained_o2<Stage1>(n) == plain), n << " ranks, shard<1>");
    CHECK_MESSAGE((trained_o2<Stage2>(n) == plain), n << " ranks, shard<2>");
  }
}

namespace {

/// What `fn` throws as a tandem::Error, or "" when it throws nothing.
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const tandem::Error& e) {
    return e.what();
  }
  return {};
}

}  // namespace

TEST_CASE("prefetch_parameters equals shard<1> and shard<2> (and DDP) bit for bit") {
  if (in_job()) return;
  tandem::test::LocalRunner run;
  Failures failures;
  using Sgd = decltype(&make_sgd);
  using Adamw = decltype(&make_adamw);
  for (int n = 1; n <= 4; ++n) {
    check_against_ddp<LocalComm, 1, decltype(run), Sgd, true>(run, n, make_sgd, {}, failures);
    check_against_ddp<LocalComm, 2, decltype(run), Sgd, true>(run, n, make_sgd, {}, failures);
    check_against_ddp<LocalComm, 1, decltype(run), Adamw, true>(run, n, make_adamw,
                                                                {.scaler = true}, failures);
    check_against_ddp<LocalComm, 2, decltype(run), Adamw, true>(run, n, make_adamw,
                                                                {.scaler = true}, failures);
    check_against_ddp<LocalComm, 2, decltype(run), Sgd, true>(run, n, make_sgd, {.uneven = true},
                                                              failures);
  }
  failures.report();
}

TEST_CASE("prefetch_parameters: a parameter used before its gather is waited is an Error") {
  if (in_job()) return;
  Failures failures;
  using Prefetched = DdpOn<LocalComm, tandem::shard<1>, tandem::prefetch_parameters>;
  tandem::test::LocalRunner{}(3, [&](LocalComm& comm) {
    Trainee<Prefetched, tandem::optim::SGD<float>> trainee(comm, make_sgd);
    auto& params = trainee.params;
    auto& ddp = trainee.ddp;
    ddp.shard(trainee.opt);
    std::vector<tandem::Parameters<float>::Parameter*> order;
    for (auto& p : params) order.push_back(&p);
    auto sync_and_step = [&] {
      for (auto it = order.rbegin(); it != order.rend(); ++it) ddp.grad_ready(**it);
      ddp.finish_gradient_sync();
      ddp.step(trainee.opt);
    };
    sync_and_step();  // the first step: nothing was in flight
    // The gather is in flight: a gradient of a parameter whose gather was not waited.
    const std::string early = error_of([&] { ddp.grad_ready(*order.back()); });
    failures.expect(early.find("ddp.wait_parameters(p)") != std::string::npos &&
                        early.find(order.back()->name()) != std::string::npos,
                    "rank ", comm.rank(), ": grad_ready before the wait: ", early);
    // Waiting for one parameter ends its bucket's gather only: its gradient is accepted, a
    // parameter of another bucket is still refused.
    ddp.wait_parameters(*order.back());
    const std::size_t waited = ddp.bucket_of(order.back()->index());
    tandem::Parameters<float>::Parameter* elsewhere = nullptr;
    for (auto* p : order) {
      if (ddp.bucket_of(p->index()) != waited) elsewhere = p;
    }
    failures.expect(elsewhere != nullptr, "the test's arena has a single bucket");
    failures.expect(error_of([&] { ddp.grad_ready(*order.back()); }).empty(), "rank ", comm.rank(),
                    ": grad_ready after wait_parameters(p) was refused");
    if (elsewhere) {
      const std::string other = error_of([&] { ddp.grad_ready(*elsewhere); });
      failures.expect(other.find("was not waited") != std::string::npos, "rank ", comm.rank(),
                      ": another bucket's parameter: ", other);
    }
    // finish_gradient_sync() ends the gathers left; the values equal a synchronous gather's.
    ddp.finish_gradient_sync();
    ddp.step(trainee.opt);
    ddp.wait_parameters();
    for (auto* p : order) ddp.grad_ready(*p);  // every gather has ended: all accepted
    // A parameter of another arena.
    tandem::Parameters<float> other;
    build(other);
    const std::string stranger = error_of([&] { ddp.wait_parameters(*other.begin()); });
    failures.expect(stranger.find("not a trained parameter") != std::string::npos,
                    "another arena's parameter: ", stranger);
    ddp.finish_gradient_sync();
    ddp.step(trainee.opt);  // left in flight: the destructor waits for it
  });
  failures.report();
}

TEST_CASE("ZeRO misuse is an Error") {
  if (in_job()) return;
  Failures failures;
  tandem::test::LocalRunner{}(2, [&](LocalComm& comm) {
    Trainee<Stage2, tandem::optim::SGD<float>> trainee(comm, make_sgd);
    auto& params = trainee.params;
    auto& ddp = trainee.ddp;
    auto& opt = trainee.opt;
    // A full optimizer stepped through the DDP.
    const std::string unsharded = error_of([&] { ddp.step(opt); });
    failures.expect(unsharded.find("ddp.shard(opt)") != std::string::npos,
                    "unsharded step: ", unsharded);
    // shard<2> with a scaler whose inf check is not agreed across ranks.
    ddp.shard(opt);
    tandem::GradScaler<> lonely;
    (void)lonely.scale(1.0f);
    const std::string scaler = error_of([&] { ddp.step(lonely, opt); });
    failures.expect(scaler.find("GradScaler(comm)") != std::string::npos,
                    "scaler without comm: ", scaler);
    // Sharding twice, and a sharded optimizer stepped around the DDP.
    const std::string twice = error_of([&] { ddp.shard(opt); });
    failures.expect(twice.find("sharded already") != std::string::npos, "twice: ", twice);
    for (auto& p : params) ddp.grad_ready(p);
    ddp.finish_gradient_sync();
    opt.step();  // no all_gather: the ranks' parameters now differ
    const std::string skipped = error_of([&] { ddp.grad_ready(*params.begin()); });
    failures.expect(skipped.find("followed by ddp.step(opt)") != std::string::npos,
                    "skipped gather: ", skipped);
    ddp.gather_parameters();
    // Another arena's optimizer.
    tandem::Parameters<float> other;
    build(other);
    auto stranger = make_sgd(other);
    const std::string arena = error_of([&] { ddp.shard(stranger); });
    failures.expect(arena.find("another arena") != std::string::npos, "arena: ", arena);
  });
  failures.report();
}

namespace {

/// One run of `steps` AdamW steps from `first` on n ranks under D, optionally loading `load`
/// first and saving to `save` after; rank 0's parameters and gathered state at the end.
struct RunResult {
  std::vector<float> params;
  StateDict state;
};

template <class D>
RunResult checkpoint_run(int n, int first, int steps, const std::filesystem::path& load,
                         const std::filesystem::path& save) {
  RunResult result;
  std::mutex mutex;
  tandem::test::LocalRunner{}(n, [&](LocalComm& comm) {
    Trainee<D, tandem::optim::AdamW<float>> trainee(comm, make_adamw);
    auto& params = trainee.params;
    auto& ddp = trainee.ddp;
    auto& opt = trainee.opt;
    ddp.shard(opt);
    tandem::TrainingState state;
    state.model(params).optimizer(opt);
    if (!load.empty()) tandem::load_checkpoint(comm, load, state);
    train(comm, trainee, {.first = first, .steps = steps});
    if (!save.empty()) tandem::save_checkpoint(comm, save, state);
    auto dict = opt.state_dict();  // collective under sharding
    if (comm.rank() == 0) {
      std::lock_guard lock(mutex);
      result.params.assign(params.values().begin(), params.values().end());
      result.state = std::move(dict);
    }
  });
  return result;
}

}  // namespace

TEST_CASE("ZeRO checkpoints are DDP's layout: exact resume at 2 ranks, loads at 1, 3 and 4") {
  if (in_job()) return;
  const auto dir =
      std::filesystem::temp_directory_path() / ("tandem-zero-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto file = dir / "zero.safetensors";
  const auto plain_file = dir / "ddp.safetensors";

  // Three steps at 2 ranks, sharded and not: the two files hold the same state.
  const auto saved = checkpoint_run<Stage1>(2, 0, 3, {}, file);
  const auto plain = checkpoint_run<Plain>(2, 0, 3, {}, plain_file);
  CHECK(saved.params == plain.params);
  CHECK(compare(saved.state, plain.state).empty());

  // Exact resume at the same world size: 3 + 2 steps equal 5 steps in one run.
  const auto whole = checkpoint_run<Stage1>(2, 0, 5, {}, {});
  const auto resumed = checkpoint_run<Stage1>(2, 3, 2, file, {});
  CHECK(resumed.params == whole.params);
  CHECK(compare(resumed.state, whole.state).empty());

  // Another world size, sharded or not, reads the sharded run's file as it reads DDP's.
  const auto at3 = checkpoint_run<Stage1>(3, 3, 0, file, {});
  CHECK(compare(at3.state, saved.state).empty());
  const auto at1 = checkpoint_run<Plain>(1, 3, 0, file, {});
  CHECK(compare(at1.state, saved.state).empty());
  CHECK(at1.params == saved.params);
  const auto on3 = checkpoint_run<Stage2>(3, 3, 2, file, {});
  const auto on3_plain = checkpoint_run<Plain>(3, 3, 2, plain_file, {});
  CHECK(on3.params == on3_plain.params);
  CHECK(compare(on3.state, on3_plain.state).empty());

  // A shard<2> run's file, saved at 3 ranks (arena sizes no rank count divides), resumed under
  // shard<1> at 4 ranks: the same as DDP's own file resumed by DDP at 4.
  const auto file3 = dir / "zero3.safetensors";
  const auto plain_file3 = dir / "ddp3.safetensors";
  const auto saved3 = checkpoint_run<Stage2>(3, 0, 3, {}, file3);
  const auto plain3 = checkpoint_run<Plain>(3, 0, 3, {}, plain_file3);
  CHECK(saved3.params == plain3.params);
  const auto on4 = checkpoint_run<Stage1>(4, 3, 2, file3, {});
  const auto on4_plain = checkpoint_run<Plain>(4, 3, 2, plain_file3, {});
  CHECK(on4.params == on4_plain.params);
  CHECK(compare(on4.state, on4_plain.state).empty());

  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}
