// examples/common/elastic_run.hpp - starts a training example's rank as a member of a
// tandem::Elastic group over the backend --backend names (--elastic; common/elastic.hpp has the
// rest).
//   auto accuracy = examples::run_elastic_backend(s.backend, store, timeout,
//                                                 [&](auto& group) { return train(group, s); });
// Needs: the backends the example is built with (shm, gloo, hierarchical heal; local and mpi do
// not: see elastic_problem).
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include "common/run.hpp"  // the backends' headers
#include "tandem/elastic/elastic.hpp"

namespace examples {

/// train(group) as this process's member of an elastic job over Comm (tandem::Elastic<Comm>
/// meeting in `store_url`), `timeout` bounding each collective. A replacement (tandemrun
/// --elastic --max-restarts sets TANDEM_ELASTIC_JOIN=1) joins the running group; train must
/// register on_join before anything collective. One that came after the run ended has nothing to
/// do: 0.
template <class Comm, class Train>
double run_elastic_rank(const std::string& store_url, std::chrono::seconds timeout, Train& train,
                        const tandem::ElasticOptions& elastic_options) {
  typename Comm::options_type options;
  options.timeout = timeout;
  tandem::Elastic<Comm> elastic(store_url, options, elastic_options);
  if (elastic.finished()) {
    tandem::log_rank(elastic.first_rank()) << "replacement: the run had already finished";
    return 0;
  }
  return train(elastic);
}

/// Runs train(group) with a tandem::Elastic group over the backend `backend` names (shm, gloo or
/// hierarchical: those that heal), healing as `elastic_options` say; nullopt where it is not built
/// in or cannot heal (check elastic_problem first for the reason).
template <class Train>
std::optional<double> run_elastic_backend(const std::string& backend, const std::string& store_url,
                                          std::chrono::seconds timeout, Train&& train,
                                          const tandem::ElasticOptions& elastic_options = {}) {
#if TANDEM_EXAMPLE_WITH_GLOO
  if (backend == "gloo") {
    return run_elastic_rank<tandem::GlooComm>(store_url, timeout, train, elastic_options);
  }
#endif
#if TANDEM_EXAMPLE_WITH_SHM
  if (backend == "shm") {
    return run_elastic_rank<tandem::ShmComm>(store_url, timeout, train, elastic_options);
  }
#endif
#if TANDEM_EXAMPLE_WITH_SHM && TANDEM_EXAMPLE_WITH_GLOO
  if (backend == "hierarchical") {
    return run_elastic_rank<tandem::HierarchicalComm<tandem::ShmComm, tandem::GlooComm>>(
        store_url, timeout, train, elastic_options);
  }
#endif
  (void)store_url;
  (void)timeout;
  (void)train;
  (void)elastic_options;
  return std::nullopt;
}

}  // namespace examples
