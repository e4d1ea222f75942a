// tandem/launch/nodes.hpp - the node slots of an elastic job that grows (tandemrun --nnodes
// MIN:MAX --elastic --rdzv-endpoint HOST:PORT): node 0's launcher opens them in a store it hosts
// at the endpoint (the first MIN are the nodes the job starts with); a launcher started later
// takes the next free one with an atomic add, which makes it node MIN, MIN+1, ... up to MAX-1,
// and its workers join the running group (tandem::Elastic) with ranks beyond the first world.
//   tandem::launch::open_node_slots(store, plan);             // node 0, hosting the store
//   plan = tandem::launch::take_node_slot(store, plan);       // a node that comes later
// Needs: the Store concept (tools/tandemrun.cpp hosts or reaches a TcpStore at the endpoint).
#pragma once

#include <chrono>
#include <sstream>
#include <string>
#include <string_view>

#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/launch/plan.hpp"
#include "tandem/rendezvous/store.hpp"

namespace tandem::launch {

/// Where node 0 describes the job to later launchers: "MIN MAX NPROC_PER_NODE".
inline constexpr std::string_view node_job_key = "tandem/launch/job";
/// The count of node slots taken, the first MIN among them (an atomic add takes one).
inline constexpr std::string_view node_count_key = "tandem/launch/nodes";

/// "--nnodes MIN:MAX".
inline std::string nnodes_text(int low, int high) {
  return "--nnodes " + std::to_string(low) + ":" + std::to_string(high);
}

/// Node 0's side: counts the job's first plan.nnodes nodes as in, then describes the job (last,
/// so that a launcher that finds the description finds the count set).
template <Store S>
void open_node_slots(S& store, const LaunchPlan& plan) {
  (void)store.add(std::string(node_count_key), plan.nnodes);
  store.set(std::string(node_job_key), std::to_string(plan.nnodes) + " " +
                                           std::to_string(plan.max_nnodes) + " " +
                                           std::to_string(plan.nproc_per_node));
}

/// A later node's side: waits (at most `timeout`) for node 0's description of the job, checks
/// that this launcher agrees with it (MAX and --nproc-per-node), and takes the next node slot.
/// Returns the plan of that node: node_rank the slot, nnodes the nodes the job has with it,
/// joins_running_job set. A tandem::Error (operation "--nnodes") names the cause when the job
/// already has MAX nodes, or the launchers disagree. A slot is never given back: a node whose
/// workers have all ended still counts.
template <Store S>
LaunchPlan take_node_slot(S& store, LaunchPlan plan, Timeout timeout = std::chrono::seconds(60)) {
  const std::string where = plan.rdzv_host + ":" + std::to_string(plan.rdzv_port);
  const std::string text = store.get(std::string(node_job_key), timeout);
  std::istringstream in(text);
  int low = 0;
  int high = 0;
  int nproc = 0;
  if (!(in >> low >> high >> nproc)) {
    throw Error("--rdzv-endpoint", "the store at " + where + " holds no tandemrun job ('" + text +
                                       "' under " + std::string(node_job_key) + ")");
  }
  if (high != plan.max_nnodes || nproc != plan.nproc_per_node) {
    throw Error("--nnodes", "the job at " + where + " runs " + nnodes_text(low, high) + " with " +
                                std::to_string(nproc) +
                                " process(es) per node; this launcher has " +
                                nnodes_text(plan.nnodes, plan.max_nnodes) + " and " +
                                std::to_string(plan.nproc_per_node) +
                                ": give every node the same --nnodes and --nproc-per-node");
  }
  const auto taken = store.add(std::string(node_count_key), 1);  // this node's slot is taken - 1
  if (taken > high) {
    throw Error("--nnodes", "the job at " + where + " already has its " + std::to_string(high) +
                                " nodes, the most " + nnodes_text(low, high) +
                                " allows: this node cannot join it (a node's slot is not given "
                                "back when its workers end)");
  }
  plan.node_rank = static_cast<int>(taken - 1);
  plan.nnodes = plan.node_rank + 1;
  plan.joins_running_job = true;
  return plan;
}

}  // namespace tandem::launch
