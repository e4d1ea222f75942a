// tandem/comm/gloo/gloo.hpp - tandem::GlooComm, the Communicator whose ranks are processes that
// talk over TCP through Facebook's Gloo (the CPU backend of torch.distributed).
//   auto comm = tandem::init_process_group<tandem::GlooComm>();   // under tandemrun / torchrun
//   comm.all_reduce(grads, tandem::ReduceOp::avg);
// Needs: Gloo with its TCP transport (libgloo-dev; link tandem::gloo) and POSIX. Semantics, the
// collective check, failures and SIGPIPE: docs/backends.md, "GlooComm in detail".
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/check_switch.hpp"
#include "tandem/comm/detail/frontend.hpp"
#include "tandem/comm/gloo/detail/engine.hpp"
#include "tandem/comm/gloo/options.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem {

/// A communicator whose ranks are processes connected by Gloo over TCP. Models
/// tandem::Communicator and tandem::ProcessGroupBackend; see docs/backends.md. Its public
/// operations (and memory_space, host) come from detail::CollectiveFrontend; split's new group
/// has its own gloo connections.
class GlooComm : public detail::CollectiveFrontend<GlooComm, host> {
 public:
  /// What init_process_group<GlooComm> and rendezvous take besides the World and the store.
  using options_type = GlooCommOptions;

  /// Moves the group's connections; the moved-from GlooComm may only be destroyed or assigned.
  GlooComm(GlooComm&&) noexcept = default;
  /// Moves the group's connections; the moved-from GlooComm may only be destroyed or assigned.
  GlooComm& operator=(GlooComm&&) noexcept = default;
  ~GlooComm() = default;

  /// Connects this rank with the others of `world`, meeting them in `store` (every rank passes
  /// the same store; init_process_group gives one of its own). Collective. A copy of the store
  /// is kept for split. Each call on one store makes a new group (its keys never collide).
  [[nodiscard]] static GlooComm rendezvous(const World& world, AnyStore& store,
                                           const GlooCommOptions& options = {}) {
    world.validate();
    detail::gloo_comm::ignore_default_sigpipe();
    // Ranks call rendezvous on a store the same number of times, so this count names the group.
    const std::int64_t generation =
        store.add("gloo/rendezvous/rank" + std::to_string(world.rank), 1);
    const std::string name = "gloo/" + std::to_string(generation);
    auto device = detail::gloo_comm::make_device(world, options);
    const bool checks_collectives = agree_on_check(store, name, world, options);
    auto connected = detail::gloo_comm::connect(store, name, world.rank, world.world_size, device,
                                                options.timeout);
    return GlooComm(std::make_unique<detail::gloo_comm::Engine>(std::move(connected), device, store,
                                                                name, options, checks_collectives));
  }

  /// The options this group was made with.
  [[nodiscard]] const GlooCommOptions& options() const { return self().options(); }
  /// The store this group met in (shared: copies see the same keys).
  [[nodiscard]] AnyStore store() const { return self().store(); }
  /// Whether every collective is checked first (options().check_collectives, resolved against
  /// TANDEM_CHECK_COLLECTIVES at rendezvous; the same on every rank).
  [[nodiscard]] bool checks_collectives() const { return self().checks_collectives(); }

 private:
  friend class detail::CollectiveFrontend<GlooComm, host>;

  explicit GlooComm(std::unique_ptr<detail::gloo_comm::Engine> self) : self_(std::move(self)) {}

  /// Resolves options.check_collectives and compares it with every rank's through the store
  /// (detail/check_switch.hpp says why and what each rank raises). A rank whose
  /// TANDEM_CHECK_COLLECTIVES is unreadable tells the others, then raises its Error at once.
  static bool agree_on_check(AnyStore& store, const std::string& name, const World& world,
                             const GlooCommOptions& options) {
    AnyStore scoped(PrefixStore<AnyStore>(name, store));
    return detail::agree_on_check_switch(
        world.rank, "GlooComm rendezvous", options.check_collectives, true, [&](int mine) {
          scoped.set("check/" + std::to_string(world.rank), std::to_string(mine));
          std::vector<int> all;
          if (mine == detail::check_switch_unreadable) return all;
          for (int r = 0; r < world.world_size; ++r) {
            const std::string value = scoped.get("check/" + std::to_string(r), options.timeout);
            all.push_back(value == std::to_string(detail::check_switch_on) ? detail::check_switch_on
                          : value == std::to_string(detail::check_switch_off)
                              ? detail::check_switch_off
                              : detail::check_switch_unreadable);
          }
          return all;
        });
  }

  detail::gloo_comm::Engine& self() const {
    if (!self_) throw Error("GlooComm", "this communicator was moved from");
    return *self_;
  }

  /// split's collective part (see CollectiveFrontend::split).
  std::optional<GlooComm> split_group(int color, int key) {
    auto made = self().split(color, key);
    if (!made) return std::nullopt;
    return GlooComm(std::move(made));
  }

  std::unique_ptr<detail::gloo_comm::Engine> self_;
};

static_assert(Communicator<GlooComm>);

/// GlooComm compares every collective's fingerprints first unless switched off (see
/// GlooComm::checks_collectives()).
template <>
inline constexpr bool can_check_collectives<GlooComm> = true;

}  // namespace tandem
