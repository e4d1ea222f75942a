// tests/unit/ddp/runners.hpp - how the DDP tests start N ranks as threads of this process: on
// LocalComm, or (where TANDEM_TEST_GLOO is defined) each with its own
// GlooComm meeting the others in a HashStore. A runner is called as run(n, fn(Comm&)).
#pragma once

#include <chrono>
#include <cstddef>
#include <exception>
#include <thread>
#include <vector>

#include "tandem/comm/local/local.hpp"
#if defined(TANDEM_TEST_GLOO)
#include "tandem/comm/gloo/gloo.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/store.hpp"
#endif

namespace tandem::test::ddp {

struct LocalRunner {
  template <class Fn>
  void operator()(int n, Fn&& fn) {
    tandem::run_local(
        n, [&](tandem::LocalComm& comm) { fn(comm); },
        tandem::LocalCommOptions{std::chrono::seconds(30)});
  }
};

#if defined(TANDEM_TEST_GLOO)
/// Each rank a thread of this process with its own GlooComm, meeting the others in a HashStore.
struct GlooThreadRunner {
  template <class Fn>
  void operator()(int n, Fn&& fn) {
    tandem::HashStore store(std::chrono::seconds(30));  // a fresh store per group: no stale keys
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
    {
      std::vector<std::jthread> ranks;
      for (int r = 0; r < n; ++r) {
        ranks.emplace_back([&, r] {
          try {
            tandem::AnyStore any(store);
            tandem::GlooCommOptions options;
            options.timeout = std::chrono::seconds(30);
            auto comm =
                tandem::GlooComm::rendezvous(tandem::World::single_node(r, n), any, options);
            fn(comm);
          } catch (...) {
            errors[static_cast<std::size_t>(r)] = std::current_exception();
          }
        });
      }
    }
    for (auto& error : errors) {
      if (error) std::rethrow_exception(error);
    }
  }
};
#endif

}  // namespace tandem::test::ddp
