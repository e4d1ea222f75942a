// tandem/comm/init.hpp - init_process_group: ranks meet through a store (rank 0 hosts a TcpStore
// for env:// and tcp://, a shared file for file://; under torchrun, torchrun's own c10d store),
// check they agree, then start a backend. A rank that waits for the others says so on stderr
// every 10 s (TANDEM_WAIT_NOTICE_S sets the interval in seconds, 0 silences it). The URLs and the
// joining live in tandem/rendezvous/ (init_method.hpp, join.hpp); this header adds the backend.
//   auto comm = tandem::init_process_group<tandem::LocalComm>(world, "tcp://127.0.0.1:29500");
//   auto comm = tandem::init_process_group<Backend>();   // env:// with torchrun's variables
// Needs: POSIX sockets and files (Linux), through tandem/rendezvous/.
#pragma once

#include <concepts>
#include <optional>
#include <string>
#include <string_view>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/init_method.hpp"
#include "tandem/rendezvous/join.hpp"
#include "tandem/rendezvous/store.hpp"

namespace tandem {

/// A backend that init_process_group can start:
/// 1. it is a Communicator;
/// 2. `options_type` holds its settings, among them a `timeout`, which the rendezvous uses too;
/// 3. `B::rendezvous(world, store, options)` builds this rank's communicator once every rank has
///    joined `store` (a namespace of its own in the job's store; keep a copy to use it later).
template <class B>
concept ProcessGroupBackend = Communicator<B> &&
    requires(const World& world, AnyStore& store, const typename B::options_type& options) {
  { options.timeout } -> std::convertible_to<Timeout>;
  { B::rendezvous(world, store, options) } -> std::same_as<B>;
};

/// Starts backend B for `world`, meeting the other ranks at `url` (env://, tcp://HOST:PORT or
/// file:///PATH; see parse_init_method). Rank 0 keeps the store alive until every rank has
/// finished the backend's rendezvous, so no rank loses the store half-way. Under torchrun
/// (TORCHELASTIC_USE_AGENT_STORE=True) the ranks meet in the agent's store (see open_store).
template <ProcessGroupBackend B>
[[nodiscard]] B init_process_group(const World& world, std::string_view url = "env://",
                                   const typename B::options_type& options = {},
                                   const EnvLookup& env = process_env) {
  const InitMethod method = parse_init_method(url, env);
  const World resolved = resolve_world(method, world, env);
  const Timeout notice = detail::wait_notice_interval(env);
  AnyStore store = open_store(method, resolved, options.timeout, env);
  join_store(store, resolved, options.timeout, method.url, notice);
  AnyStore backend_store(PrefixStore<AnyStore>("tandem/backend", store));
  B comm = B::rendezvous(resolved, backend_store, options);
  store.set("tandem/init/ready/" + std::to_string(resolved.rank), "1");
  if (resolved.rank == 0) {
    detail::wait_for_ranks(store, resolved, "tandem/init/ready/", options.timeout, method.url,
                           "finish the rendezvous at", notice, "finish the rendezvous");
  }
  return comm;
}

/// As above, with the World taken from the launcher's variables (torchrun, tandemrun, Slurm,
/// OpenMPI, MPICH) or from ?rank=R&world_size=N in the URL.
template <ProcessGroupBackend B>
[[nodiscard]] B init_process_group(std::string_view url = "env://",
                                   const typename B::options_type& options = {},
                                   const EnvLookup& env = process_env) {
  const InitMethod method = parse_init_method(url, env);
  return init_process_group<B>(resolve_world(method, std::nullopt, env), url, options, env);
}

}  // namespace tandem
