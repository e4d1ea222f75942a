// examples/common/elastic.hpp - --elastic for the training examples (issue 32): a run under
// `tandemrun --elastic` whose ranks may be lost (SIGKILL, an OOM kill) goes on with the
// survivors through tandem::Elastic. A training loop is written once against a Group, which is
// either tandem::Elastic<Comm> or FixedGroup<Comm> (the plain run: every step taken at once,
// no heal), both offering comm(), generation(), first_rank(), on_heal(release, rebuild) and
// step(compute, apply) (docs/elastic.md).
//   auto accuracy = examples::run_elastic_backend(s.backend, store, timeout,
//                                                 [&](auto& group) { return train(group, s); });
//   examples::FixedGroup group(comm);  train(group, s);                 // the plain run
// Needs: the backends the example is built with (shm, gloo, hierarchical heal; local and mpi do
// not: see elastic_problem).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

#include "tandem/core/env.hpp"
#include "tandem/elastic/elastic.hpp"
#include "tandem/io/log.hpp"
#if TANDEM_EXAMPLE_WITH_GLOO
#include "tandem/comm/gloo/gloo.hpp"
#endif
#if TANDEM_EXAMPLE_WITH_SHM
#include "tandem/comm/shm/shm.hpp"
#endif
#if TANDEM_EXAMPLE_WITH_SHM && TANDEM_EXAMPLE_WITH_GLOO
#include "tandem/comm/hierarchical/hierarchical.hpp"
#endif

namespace examples {

/// A group that never changes: tandem::Elastic's interface over a plain communicator, so that one
/// training loop serves both runs. step() runs compute then apply, with no commit point; the
/// heal callbacks are never called.
template <class Comm>
class FixedGroup {
 public:
  explicit FixedGroup(Comm& comm) : comm_(&comm) {}
  Comm& comm() { return *comm_; }
  int generation() const noexcept { return 0; }
  int first_rank() const { return comm_->rank(); }
  int heals() const noexcept { return 0; }
  std::chrono::steady_clock::duration last_heal_time() const noexcept { return {}; }
  template <class Release, class Rebuild>
  void on_heal(Release&& /*release*/, Rebuild&& /*rebuild*/) {}
  template <class Compute, class Apply>
  void step(Compute&& compute, Apply&& apply) {
    compute(*comm_);
    apply();
  }

 private:
  Comm* comm_;
};

/// Rank 0's line after a step during which the group healed ("healed at step S: N ranks go on;
/// the heal took T ms": bench/elastic reads it); `heals_seen` is the count already reported.
template <class Group>
void report_heal(Group& group, int& heals_seen, std::int64_t step) {
  if (group.heals() == heals_seen) return;
  heals_seen = group.heals();
  const auto took = std::chrono::duration<double, std::milli>(group.last_heal_time()).count();
  tandem::log0(group.comm()) << "healed at step " << step << ": " << group.comm().size()
                             << " ranks go on; the heal took " << took << " ms";
}

/// Why `backend` (with `zero`, a ZeRO stage, 0 for none) cannot run --elastic, or "".
inline std::string elastic_problem(const std::string& backend, int zero) {
  if (zero != 0) {
    return "--elastic with --zero: ZeRO keeps each rank's part of the optimizer state (the "
           "momentum) on that rank only, so a lost rank takes its part with it and the survivors "
           "cannot go on exactly; train with plain DDP (no --zero), or use tandemrun "
           "--max-restarts to restart from checkpoints";
  }
  if (backend == "local") {
    return "--elastic with --backend local: threads of one process are lost together with it; "
           "start the ranks as processes under `tandemrun --elastic` (backend shm, gloo or "
           "hierarchical)";
  }
  if (backend == "mpi") {
    return "--elastic with --backend mpi: MPI cannot shrink a communicator (mpirun ends the job "
           "when a rank dies); use shm, gloo or hierarchical under `tandemrun --elastic`";
  }
  return {};
}

/// The store the survivors meet in: `given` (file:///PATH) when set, else a file named after the
/// launcher's run id (TORCHELASTIC_RUN_ID, unique per tandemrun launch) in $TMPDIR or /tmp.
/// nullopt outside a launcher without `given`.
inline std::optional<std::string> elastic_store_url(const std::string& given) {
  if (!given.empty()) return given;
  const char* run_id = std::getenv("TORCHELASTIC_RUN_ID");
  if (!run_id || !*run_id || std::string(run_id) == "none") return std::nullopt;
  const char* tmp = std::getenv("TMPDIR");
  return "file://" + std::string(tmp && *tmp == '/' ? tmp : "/tmp") + "/tandem-elastic-" + run_id +
         ".store";
}

/// train(group) as this process's member of an elastic job over Comm (tandem::Elastic<Comm>
/// meeting in `store_url`), `timeout` bounding each collective.
template <class Comm, class Train>
double run_elastic_rank(const std::string& store_url, std::chrono::seconds timeout, Train& train) {
  typename Comm::options_type options;
  options.timeout = timeout;
  tandem::Elastic<Comm> elastic(store_url, options);
  return train(elastic);
}

/// Runs train(group) with a tandem::Elastic group over the backend `backend` names (shm, gloo or
/// hierarchical: those that heal); nullopt where it is not built in or cannot heal (check
/// elastic_problem first for the reason).
template <class Train>
std::optional<double> run_elastic_backend(const std::string& backend, const std::string& store_url,
                                          std::chrono::seconds timeout, Train&& train) {
#if TANDEM_EXAMPLE_WITH_GLOO
  if (backend == "gloo") return run_elastic_rank<tandem::GlooComm>(store_url, timeout, train);
#endif
#if TANDEM_EXAMPLE_WITH_SHM
  if (backend == "shm") return run_elastic_rank<tandem::ShmComm>(store_url, timeout, train);
#endif
#if TANDEM_EXAMPLE_WITH_SHM && TANDEM_EXAMPLE_WITH_GLOO
  if (backend == "hierarchical") {
    return run_elastic_rank<tandem::HierarchicalComm<tandem::ShmComm, tandem::GlooComm>>(
        store_url, timeout, train);
  }
#endif
  (void)store_url;
  (void)timeout;
  (void)train;
  return std::nullopt;
}

}  // namespace examples
