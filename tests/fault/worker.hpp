// tests/fault/worker.hpp - what the fault workers (fault_worker, flight_worker) share: their
// command line's "--flag value" pairs, the process backends they were built with
// (TANDEM_FAULT_WITH_GLOO, _SHM, _MPI: tests/fault/CMakeLists.txt), and the one way they make a
// rank's communicator from the backend's name.
//   if (!tandem::test::fault::read_flags(argc, argv, on_flag)) return usage();
//   return tandem::test::fault::with_process_comm("fault_worker", backend, timeout,
//                                                  [&](auto make_comm) { return run(make_comm); });
// Needs: tandem/comm/init.hpp and the backends' headers (included here as built).
#pragma once

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "tandem/core/env.hpp"
#if TANDEM_FAULT_WITH_GLOO
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/comm/init.hpp"
#endif
#if TANDEM_FAULT_WITH_MPI
#include "tandem/comm/mpi/mpi.hpp"
#endif
#if TANDEM_FAULT_WITH_SHM
#include "tandem/comm/init.hpp"
#include "tandem/comm/shm/shm.hpp"
#endif
#if TANDEM_FAULT_WITH_SHM && TANDEM_FAULT_WITH_GLOO
#include "tandem/comm/hierarchical/hierarchical.hpp"
#endif

namespace tandem::test::fault {

/// Reads the command line as "--flag value" pairs, calling on_flag(flag, value) for each in
/// order. False, at once, when on_flag returns false (a flag it does not know, a bad value), and
/// for a flag left without its value.
template <class OnFlag>
bool read_flags(int argc, char** argv, OnFlag&& on_flag) {
  if (argc % 2 == 0) return false;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!on_flag(std::string_view(argv[i]), std::string(argv[i + 1]))) return false;
  }
  return true;
}

/// This process's rank as its launcher gives it: OMPI_COMM_WORLD_RANK under mpirun (backend
/// "mpi"), RANK otherwise (env://); -1 when it is not set or not a number.
inline int launcher_rank(std::string_view backend) {
  const char* text = std::getenv(backend == "mpi" ? "OMPI_COMM_WORLD_RANK" : "RANK");
  const auto rank = tandem::parse_int(text ? text : "");
  return rank ? static_cast<int>(*rank) : -1;
}

#if TANDEM_FAULT_WITH_GLOO || TANDEM_FAULT_WITH_SHM
/// What makes a rank's Comm over env:// with `timeout` (HierarchicalComm: both levels').
template <class Comm>
auto over_env(std::chrono::milliseconds timeout) {
  return [timeout] {
    typename Comm::options_type options;
    options.timeout = timeout;
    return tandem::init_process_group<Comm>("env://", options);
  };
}
#endif

/// Returns run(make_comm) for a process backend, where make_comm() makes this rank's
/// communicator with `timeout` as its collective timeout: init_process_group<Comm>("env://") for
/// gloo, shm and hierarchical (HierarchicalComm<ShmComm, GlooComm>, both levels' timeout), or
/// MpiComm::world() for mpi. A backend the worker was built without: a message naming `worker`
/// and 77, CTest's skip.
template <class Run>
int with_process_comm(const char* worker, std::string_view backend,
                      [[maybe_unused]] std::chrono::milliseconds timeout,
                      [[maybe_unused]] Run&& run) {
#if TANDEM_FAULT_WITH_GLOO
  if (backend == "gloo") return run(over_env<tandem::GlooComm>(timeout));
#endif
#if TANDEM_FAULT_WITH_SHM
  if (backend == "shm") return run(over_env<tandem::ShmComm>(timeout));
#endif
#if TANDEM_FAULT_WITH_SHM && TANDEM_FAULT_WITH_GLOO
  if (backend == "hierarchical") {
    return run(over_env<tandem::HierarchicalComm<tandem::ShmComm, tandem::GlooComm>>(timeout));
  }
#endif
#if TANDEM_FAULT_WITH_MPI
  if (backend == "mpi") {
    return run([timeout] {
      tandem::MpiCommOptions options;
      options.timeout = timeout;
      return tandem::MpiComm::world(options);
    });
  }
#endif
  std::fprintf(stderr, "%s: backend '%s' is not built in\n", worker, std::string(backend).c_str());
  return 77;
}

}  // namespace tandem::test::fault
