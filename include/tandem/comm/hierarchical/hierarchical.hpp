// tandem/comm/hierarchical/hierarchical.hpp - tandem::HierarchicalComm<Intra, Inter>, the
// Communicator of a job across nodes whose ranks meet within a node over Intra (shared memory:
// ShmComm) and between nodes over Inter (a network engine: GlooComm), the way NCCL, oneCCL and MPI
// keep a node's traffic off the network.
//   using Comm = tandem::HierarchicalComm<tandem::ShmComm, tandem::GlooComm>;
//   auto comm = tandem::init_process_group<Comm>();   // under tandemrun / torchrun, any nodes
// Needs: the two backends' headers and components (for ShmComm + GlooComm: tandem::shm and
// tandem::gloo); this header includes neither. Its design (nodes, which operations go through a
// node's leader, reduction order, split, failures, mismatches): docs/shm.md, "Across nodes".
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/detail/frontend.hpp"
#include "tandem/comm/detail/issue_order.hpp"
#include "tandem/comm/detail/reduction.hpp"
#include "tandem/comm/hierarchical/detail/engine.hpp"
#include "tandem/comm/hierarchical/options.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/shared_memory.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/tensor/memory.hpp"

namespace tandem {

/// A communicator across nodes: each node's ranks meet over Intra, one leader per node over
/// Inter. Models tandem::Communicator, and tandem::ProcessGroupBackend where both levels do; see
/// docs/shm.md. Its public operations (and memory_space, host) come from
/// detail::CollectiveFrontend.
template <Communicator Intra, Communicator Inter>
class HierarchicalComm : public detail::CollectiveFrontend<HierarchicalComm<Intra, Inter>, host> {
  using Engine = detail::hierarchical::Engine<Intra, Inter>;

 public:
  /// What init_process_group<HierarchicalComm> and rendezvous take besides the World and store.
  using options_type =
      HierarchicalCommOptions<typename Intra::options_type, typename Inter::options_type>;

  /// Moves both levels; the moved-from communicator may only be destroyed or assigned.
  HierarchicalComm(HierarchicalComm&&) noexcept = default;
  /// Moves both levels; the moved-from communicator may only be destroyed or assigned.
  HierarchicalComm& operator=(HierarchicalComm&&) noexcept = default;
  ~HierarchicalComm() = default;

  /// Joins this rank with the others of `world`, meeting them in `store` (every rank passes the
  /// same store; init_process_group gives one of its own). Collective. The ranks with one
  /// world.node_rank form a node; on one node only the Intra group is made.
  [[nodiscard]] static HierarchicalComm rendezvous(const World& world, AnyStore& store,
                                                   const options_type& options = {}) {
    world.validate();
    constexpr const char* operation = "HierarchicalComm rendezvous";
    // Ranks call rendezvous on a store the same number of times, so this count names the group.
    const std::int64_t generation =
        store.add("hierarchical/rendezvous/rank" + std::to_string(world.rank), 1);
    const std::string name = "hierarchical/" + std::to_string(generation);
    AnyStore scoped(PrefixStore<AnyStore>(name, store));
    scoped.set("node/" + std::to_string(world.rank), std::to_string(world.node_rank));
    std::vector<int> node_ranks;
    for (int r = 0; r < world.world_size; ++r) {
      const std::string value = scoped.get("node/" + std::to_string(r), options.timeout);
      node_ranks.push_back(std::atoi(value.c_str()));
    }
    // Nodes in the order of their first rank; a rank's place in its node in job-rank order.
    std::vector<int> node_of = detail::hierarchical::numbered_by_first_appearance(node_ranks);
    const int node = node_of[static_cast<std::size_t>(world.rank)];
    int local = 0;
    int node_size = 0;
    for (int r = 0; r < world.world_size; ++r) {
      if (node_of[static_cast<std::size_t>(r)] != node) continue;
      if (r < world.rank) ++local;
      ++node_size;
    }
    auto intra_options = options.intra;
    intra_options.timeout = options.timeout;
    auto inter_options = options.inter;
    inter_options.timeout = options.timeout;
    // Which step failed, for the message: a rank that is missing shows up at one of them.
    std::string step = "making node " + std::to_string(node) + "'s group";
    try {
      AnyStore node_store(
          PrefixStore<AnyStore>(name + "/node" + std::to_string(world.node_rank), store));
      Intra intra =
          Intra::rendezvous(World::single_node(local, node_size), node_store, intra_options);
      std::optional<Inter> inter;
      if (std::any_of(node_of.begin(), node_of.end(), [](int n) { return n > 0; })) {
        step = "making the group of all ranks between nodes";
        AnyStore all_store(PrefixStore<AnyStore>(name + "/all", store));
        inter.emplace(Inter::rendezvous(world, all_store, inter_options));
      }
      step = "checking the groups";
      detail::hierarchical::FailureRelay relay(
          AnyStore(PrefixStore<AnyStore>(name + "/failure/", store)), world.world_size,
          std::min<Timeout>(options.timeout, detail::hierarchical::relay_limit));
      auto engine = std::make_unique<Engine>(world.rank, std::move(node_of), std::move(intra),
                                             std::move(inter), options.timeout, std::move(relay));
      step = "making the leaders' group between nodes";
      engine->make_leaders();
      return HierarchicalComm(std::move(engine));
    } catch (const Error& e) {
      throw Error(world.rank, operation, step + ": " + e.cause());
    }
  }

  /// Collective: this rank's part of a new block of its node's shared memory, where Intra lends
  /// one (SharedMemoryComm: ShmComm::allocate_shared; every rank asks for the same size). On one
  /// node an in-place all_reduce of a tensor in it is Intra's, straight from the peers' parts;
  /// across nodes it takes the ordinary path (the node's reduce goes through the slots).
  /// DistributedDataParallel puts its gradients there.
  [[nodiscard]] SharedBlock allocate_shared(std::size_t bytes) requires SharedMemoryComm<Intra> {
    SharedBlock block;
    self().now([&] { block = self().allocate_shared(bytes); });
    return block;
  }

  /// The number of nodes this group spans (1: every operation is the node's group's).
  [[nodiscard]] int nodes() const { return self().nodes(); }
  /// This rank's node, 0 .. nodes()-1, in the order of the nodes' first ranks.
  [[nodiscard]] int node() const { return self().node(); }

 private:
  friend class detail::CollectiveFrontend<HierarchicalComm, host>;

  explicit HierarchicalComm(std::unique_ptr<Engine> self) : self_(std::move(self)) {}

  Engine& self() const {
    if (!self_) throw Error("HierarchicalComm", "this communicator was moved from");
    return *self_;
  }

  /// split's collective part (see CollectiveFrontend::split).
  std::optional<HierarchicalComm> split_group(int color, int key) {
    auto made = self().split(color, key);
    if (!made) return std::nullopt;
    return HierarchicalComm(std::move(made));
  }

  std::unique_ptr<Engine> self_;
};

}  // namespace tandem
