// tandem/torch/elastic.hpp - a libtorch model under tandem::Elastic (docs/libtorch.md, "Elastic
// training"): what a heal rebuilds. The bridge's DDP keeps its arena and hooks across a heal
// (release(), then rebind(comm)), so the optimizer, EMA and checkpoint state made over
// ddp.parameters() stay valid; rebind_sync_batchnorm moves the model's SyncBatchNorms onto the
// new group, sharing their tensors.
//   elastic.on_heal([&] { ddp.release(); },
//                   [&](Comm& comm) {
//                     tandem::torch::rebind_sync_batchnorm(*net, comm);
//                     ddp.rebind(comm);               // rank 0's values and buffers everywhere
//                     sampler.resplit(comm, taken);
//                   });
// Needs: libtorch (the tandem::torch CMake component) and tandem/elastic/elastic.hpp.
#pragma once

#include <memory>
#include <string>

#include <torch/torch.h>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/error.hpp"
#include "tandem/torch/detail/convert_sync_batchnorm.hpp"
#include "tandem/torch/sync_batch_norm.hpp"

namespace tandem::torch {

namespace detail::sync_batch_norm {

/// A SyncBatchNorm's options and tensors (the parts a new one over another group shares).
inline bool sync_batch_norm_parts(const std::shared_ptr<::torch::nn::Module>& module,
                                  BatchNormParts& parts) {
  return parts_of<SyncBatchNormImpl>(module, parts);
}

}  // namespace detail::sync_batch_norm

/// Replaces every SyncBatchNorm under `module` that libtorch lets us rewire (those
/// convert_sync_batchnorm made, or held by a Sequential, ModuleList or ModuleDict) with one over
/// `comm` sharing its parameters, buffers and training flag: after a heal, the statistics are
/// reduced over the new group. Returns the names. A SyncBatchNorm a struct member holds cannot be
/// rewired: an Error naming it, nothing changed (construct such a member's module again
/// yourself). Not collective.
template <Communicator Comm>
ConvertedBatchNorms rebind_sync_batchnorm(::torch::nn::Module& module, Comm& comm) {
  namespace sbn = detail::sync_batch_norm;
  ConvertedBatchNorms dry;
  sbn::convert<SyncBatchNormImpl>(module, "", std::shared_ptr<const sbn::Group>(), true, dry,
                                  &sbn::sync_batch_norm_parts);
  if (!dry.skipped.empty()) {
    std::string names;
    for (const auto& name : dry.skipped) names += (names.empty() ? "" : ", ") + name;
    throw Error(comm.rank(), "rebind_sync_batchnorm",
                "SyncBatchNorm module(s) " + names +
                    " are held by struct members, which libtorch cannot rewire from outside; "
                    "construct them again over the new communicator in those members");
  }
  ConvertedBatchNorms result;
  sbn::convert<SyncBatchNormImpl>(module, "", std::make_shared<const sbn::Group>(comm), true,
                                  result, &sbn::sync_batch_norm_parts);
  return result;
}

}  // namespace tandem::torch
