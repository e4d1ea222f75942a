// tandem/core/world.hpp - tandem::World: where this process sits in a job (rank, world size,
// rank on its node, node index), read from tandemrun/torchrun, Slurm, OpenMPI or MPICH variables.
//   const auto world = tandem::World::from_env();   // {0, 1} when nothing is set
//   if (world.is_main()) std::puts("rank 0 of the job");
// Needs: the standard library only.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/core/env.hpp"
#include "tandem/core/error.hpp"

namespace tandem {

namespace detail {
struct world_env;
}

/// The position of one rank in a job. Every field is validated on construction from the
/// environment; a hand-made World is checked by validate() before a communicator uses it.
struct World {
  int rank = 0;              ///< this process's rank in the job, 0 .. world_size-1
  int world_size = 1;        ///< number of ranks in the job
  int local_rank = 0;        ///< rank among the processes of this node
  int local_world_size = 1;  ///< processes on this node
  int node_rank = 0;         ///< index of this node, 0 .. nnodes-1
  int nnodes = 1;            ///< number of nodes in the job

  /// True on rank 0, the rank that logs and writes checkpoints.
  [[nodiscard]] bool is_main() const noexcept { return rank == 0; }
  /// True on the first rank of each node.
  [[nodiscard]] bool is_local_main() const noexcept { return local_rank == 0; }

  /// Throws tandem::Error naming the first field that is out of range or inconsistent.
  void validate() const { validate_with(field_names{}); }

  /// A single-process world for rank `rank` of `world_size` ranks on one node.
  static World single_node(int rank, int world_size) {
    World world{rank, world_size, rank, world_size, 0, 1};
    world.validate();
    return world;
  }

  /// Reads the first launcher whose variables are present, in this order:
  /// 1. tandemrun / torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
  ///    GROUP_WORLD_SIZE (MASTER_PORT is checked to be a port number when set);
  /// 2. Slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE or
  ///    SLURM_TASKS_PER_NODE ("2(x3),1"), SLURM_NODEID, SLURM_NNODES;
  /// 3. OpenMPI: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE;
  /// 4. MPICH / PMI: PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS.
  /// No variables at all give World{0, 1}. Where the node layout is not given, ranks are taken
  /// to be placed in blocks of local_world_size per node (what every launcher does by default).
  /// A non-numeric, negative or inconsistent value is a tandem::Error naming the variable.
  static World from_env(const EnvLookup& env = process_env);

  /// Whether any launcher that from_env reads has set its rank variable.
  static bool launched(const EnvLookup& env = process_env) {
    return env("RANK") || env("WORLD_SIZE") || env("SLURM_PROCID") || env("OMPI_COMM_WORLD_RANK") ||
           env("OMPI_COMM_WORLD_SIZE") || env("PMI_RANK") || env("PMI_SIZE");
  }

 private:
  struct field_names {
    std::string_view rank = "rank", world_size = "world_size", local_rank = "local_rank",
                     local_world_size = "local_world_size", node_rank = "node_rank",
                     nnodes = "nnodes";
    /// Said after an error of a rank outside its world (a process too many): what to check.
    std::string_view hint = "";
  };

  void validate_with(const field_names& names) const {
    auto fail = [](std::string_view what) { throw Error("World", std::string(what)); };
    auto show = [](std::string_view name, int value) {
      return std::string(name) + "=" + std::to_string(value);
    };
    if (world_size < 1) fail(show(names.world_size, world_size) + " must be at least 1");
    if (rank < 0) fail(show(names.rank, rank) + " must not be negative");
    if (rank >= world_size) {
      fail(show(names.rank, rank) + " must be less than " + show(names.world_size, world_size) +
           std::string(names.hint));
    }
    if (local_world_size < 1) {
      fail(show(names.local_world_size, local_world_size) + " must be at least 1");
    }
    if (local_world_size > world_size) {
      fail(show(names.local_world_size, local_world_size) + " must not exceed " +
           show(names.world_size, world_size));
    }
    if (local_rank < 0) fail(show(names.local_rank, local_rank) + " must not be negative");
    if (local_rank >= local_world_size) {
      fail(show(names.local_rank, local_rank) + " must be less than " +
           show(names.local_world_size, local_world_size) + std::string(names.hint));
    }
    if (local_rank > rank) {
      fail(show(names.local_rank, local_rank) + " must not exceed " + show(names.rank, rank));
    }
    if (nnodes < 1) fail(show(names.nnodes, nnodes) + " must be at least 1");
    if (nnodes > world_size) {
      fail(show(names.nnodes, nnodes) + " must not exceed " + show(names.world_size, world_size));
    }
    if (node_rank < 0) fail(show(names.node_rank, node_rank) + " must not be negative");
    if (node_rank >= nnodes) {
      fail(show(names.node_rank, node_rank) + " must be less than " + show(names.nnodes, nnodes) +
           std::string(names.hint));
    }
  }

  friend struct detail::world_env;
};

namespace detail {

struct world_env {
  /// What a process outside the launcher's world should check (see World::field_names::hint).
  static constexpr std::string_view outside_hint =
      " (more processes than the job holds? check the launch command's counts - torchrun and "
      "tandemrun: --nnodes, --nproc-per-node, --node-rank - or these variables where set by "
      "hand)";

  struct launcher {
    std::string_view rank, world_size, local_rank, local_world_size, node_rank, nnodes;
  };

  static int read(const EnvLookup& env, std::string_view name, int fallback) {
    const auto value = env_int_in(env, name, 0, INT32_MAX);
    return value ? static_cast<int>(*value) : fallback;
  }

  static bool any_set(const EnvLookup& env, std::initializer_list<std::string_view> names) {
    for (auto name : names) {
      if (env(name)) return true;
    }
    return false;
  }

  /// Slurm's compressed per-node task counts ("2(x3),1" means 2, 2, 2, 1): the count of node
  /// `node`, or nullopt when the list is shorter. The whole list is checked, but never expanded:
  /// "1(x1000000)" a thousand times over costs its text, not four gigabytes.
  static std::optional<int> tasks_on_node(std::string_view text, std::string_view name, int node) {
    const std::string whole(text);
    auto fail = [&] {
      return Error("environment", std::string(name) + "='" + whole + "' is not a Slurm task list");
    };
    if (text.empty()) throw fail();
    std::optional<int> found;
    std::int64_t first_node = 0;  // of the current item
    while (!text.empty()) {
      const auto comma = text.find(',');
      std::string_view item = text.substr(0, comma);
      text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
      std::int64_t repeat = 1;
      if (const auto paren = item.find("(x"); paren != std::string_view::npos) {
        if (item.back() != ')') throw fail();
        const auto times = parse_int(item.substr(paren + 2, item.size() - paren - 3));
        if (!times || *times < 1 || *times > 1'000'000) throw fail();
        repeat = *times;
        item = item.substr(0, paren);
      }
      const auto count = parse_int(item);
      if (!count || *count < 1 || *count > INT32_MAX) throw fail();
      if (!found && node >= first_node && node < first_node + repeat) {
        found = static_cast<int>(*count);
      }
      first_node += repeat;
    }
    return found;
  }

  static World from_launcher(const EnvLookup& env, const launcher& names) {
    if (!env(names.world_size)) {
      throw Error("environment", std::string(names.rank) + " is set but " +
                                     std::string(names.world_size) + " is not");
    }
    World world;
    world.rank = read(env, names.rank, 0);
    world.world_size = read(env, names.world_size, 1);
    // Without a node layout the job is taken to run on one node.
    world.local_rank = read(env, names.local_rank, world.rank);
    world.local_world_size = read(env, names.local_world_size, world.world_size);
    // Zero sizes are left for validation to report by name rather than divided by here.
    const int per_node = world.local_world_size > 0 ? world.local_world_size : 1;
    // Rounded up without forming world_size + per_node, which overflows int above 2^30 ranks.
    const int blocks = world.world_size / per_node + (world.world_size % per_node != 0 ? 1 : 0);
    world.nnodes = names.nnodes.empty() ? blocks : read(env, names.nnodes, blocks);
    const int block_of_rank = world.rank / per_node;
    world.node_rank =
        names.node_rank.empty() ? block_of_rank : read(env, names.node_rank, block_of_rank);
    // A derived field is named as a field; only a variable that was really set is named as one.
    auto shown = [&](std::string_view variable, std::string_view field) {
      return !variable.empty() && env(variable) ? variable : field;
    };
    world.validate_with({names.rank, names.world_size, shown(names.local_rank, "local_rank"),
                         shown(names.local_world_size, "local_world_size"),
                         shown(names.node_rank, "node_rank"), shown(names.nnodes, "nnodes"),
                         outside_hint});
    return world;
  }

  static World from_slurm(const EnvLookup& env) {
    if (!env("SLURM_NTASKS")) {
      throw Error("environment", "SLURM_PROCID is set but SLURM_NTASKS is not");
    }
    World world;
    world.rank = read(env, "SLURM_PROCID", 0);
    world.world_size = read(env, "SLURM_NTASKS", 1);
    world.node_rank = read(env, "SLURM_NODEID", 0);
    world.nnodes = read(env, "SLURM_NNODES", 1);
    world.local_rank = read(env, "SLURM_LOCALID", world.rank);
    std::string_view local_size_name = "SLURM_NTASKS_PER_NODE";
    if (env("SLURM_NTASKS_PER_NODE")) {
      world.local_world_size = read(env, "SLURM_NTASKS_PER_NODE", 1);
    } else if (const auto list = env("SLURM_TASKS_PER_NODE")) {
      local_size_name = "SLURM_TASKS_PER_NODE";
      const auto count = tasks_on_node(*list, local_size_name, world.node_rank);
      if (!count) {
        throw Error("environment", "SLURM_NODEID=" + std::to_string(world.node_rank) +
                                       " has no entry in SLURM_TASKS_PER_NODE='" + *list + "'");
      }
      world.local_world_size = *count;
    } else {
      world.local_world_size = world.nnodes > 0 ? world.world_size / world.nnodes : 0;
    }
    world.validate_with({"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", local_size_name,
                         "SLURM_NODEID", "SLURM_NNODES", outside_hint});
    return world;
  }
};

}  // namespace detail

inline World World::from_env(const EnvLookup& env) {
  // Checked whichever launcher is in use: a bad port must not wait until rendezvous to surface.
  env_int_in(env, "MASTER_PORT", 0, 65535);

  if (detail::world_env::any_set(env, {"RANK", "WORLD_SIZE"})) {
    if (!env("RANK")) throw Error("environment", "WORLD_SIZE is set but RANK is not");
    return detail::world_env::from_launcher(
        env,
        {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"});
  }
  if (env("SLURM_PROCID")) return detail::world_env::from_slurm(env);
  if (detail::world_env::any_set(env, {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"})) {
    if (!env("OMPI_COMM_WORLD_RANK")) {
      throw Error("environment", "OMPI_COMM_WORLD_SIZE is set but OMPI_COMM_WORLD_RANK is not");
    }
    return detail::world_env::from_launcher(
        env, {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
              "OMPI_COMM_WORLD_LOCAL_SIZE", "", ""});
  }
  if (detail::world_env::any_set(env, {"PMI_RANK", "PMI_SIZE"})) {
    if (!env("PMI_RANK")) throw Error("environment", "PMI_SIZE is set but PMI_RANK is not");
    return detail::world_env::from_launcher(
        env, {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "", ""});
  }
  return World{};
}

}  // namespace tandem
