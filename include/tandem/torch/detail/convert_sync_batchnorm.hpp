// tandem/torch/detail/convert_sync_batchnorm.hpp - the module-tree walk behind
// tandem::torch::convert_sync_batchnorm: which BatchNorm1d/2d/3d children can be rewired
// (Sequential, ModuleList, ModuleDict, registry-only) and their replacement in place.
//   detail::sync_batch_norm::convert<SyncBatchNormImpl>(module, "", group, skip, result);
// Needs: libtorch. Included by torch/sync_batch_norm.hpp, not by users; what cannot be converted
// and why: docs/libtorch.md, "SyncBatchNorm in detail".
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "tandem/core/error.hpp"

namespace tandem::torch {

namespace detail::sync_batch_norm {

/// A BatchNorm's options and tensors, for a SyncBatchNorm that takes its place.
struct BatchNormParts {
  ::torch::nn::BatchNormOptions options{1};
  at::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
  bool training = true;
};

template <class Impl>
bool parts_of(const std::shared_ptr<::torch::nn::Module>& module, BatchNormParts& parts) {
  const auto bn = std::dynamic_pointer_cast<Impl>(module);
  if (!bn) return false;
  parts.options = bn->options;
  parts.weight = bn->weight;
  parts.bias = bn->bias;
  parts.running_mean = bn->running_mean;
  parts.running_var = bn->running_var;
  parts.num_batches_tracked = bn->num_batches_tracked;
  parts.training = bn->is_training();
  return true;
}

inline bool batch_norm_parts(const std::shared_ptr<::torch::nn::Module>& module,
                             BatchNormParts& parts) {
  return parts_of<::torch::nn::BatchNorm1dImpl>(module, parts) ||
         parts_of<::torch::nn::BatchNorm2dImpl>(module, parts) ||
         parts_of<::torch::nn::BatchNorm3dImpl>(module, parts);
}

enum class Parent { sequential, module_list, module_dict, other };

inline Parent kind_of(::torch::nn::Module& module) {
  if (dynamic_cast<::torch::nn::SequentialImpl*>(&module)) return Parent::sequential;
  if (dynamic_cast<::torch::nn::ModuleListImpl*>(&module)) return Parent::module_list;
  if (dynamic_cast<::torch::nn::ModuleDictImpl*>(&module)) return Parent::module_dict;
  return Parent::other;
}

/// Walks `parent`'s subtree. With `group` null it only collects the member-held BatchNorms
/// (a dry run, so that an error leaves the model unchanged); otherwise it replaces each with a
/// Sync (SyncBatchNormImpl) made from the group and the BatchNorm's parts. Names go into
/// result.converted and result.skipped (ConvertedBatchNorms). `parts_of(child, parts)` says
/// which children are replaced (BatchNorm1d/2d/3d; torch/elastic.hpp: SyncBatchNorms, to move
/// them onto a healed group).
template <class Sync, class Erased, class Result, class PartsOf = decltype(&batch_norm_parts)>
void convert(::torch::nn::Module& parent, const std::string& prefix,
             const std::shared_ptr<const Erased>& group, bool skip_member_held, Result& result,
             PartsOf parts_of = &batch_norm_parts) {
  const Parent kind = kind_of(parent);
  // A copy of the registry: each child's handle count is 1 (the registry) + 1 (this copy) + one
  // per container slot (Sequential's AnyModule, ModuleList's vector, ModuleDict's dict) + one per
  // struct member or other holder.
  const auto children = parent.named_children();
  std::size_t index = 0;
  for (const auto& item : children) {
    const std::string name = prefix.empty() ? item.key() : prefix + "." + item.key();
    const std::shared_ptr<::torch::nn::Module>& child = item.value();
    const std::size_t position = index++;
    BatchNormParts parts;
    if (!parts_of(child, parts)) {
      convert<Sync>(*child, name, group, skip_member_held, result, parts_of);
      continue;
    }
    const long container_slot = kind == Parent::other ? 0 : 1;
    const bool member_held = child.use_count() > 2 + container_slot;
    if (kind == Parent::other && member_held) {
      result.skipped.push_back(name);
      continue;
    }
    if (!group) continue;  // dry run
    auto sync = std::make_shared<Sync>(group, parts);
    switch (kind) {
      case Parent::sequential: {
        auto& sequential = dynamic_cast<::torch::nn::SequentialImpl&>(parent);
        // Sequential's forward runs its AnyModule list, registered in the same order.
        auto slot = sequential.begin() + static_cast<std::ptrdiff_t>(position);
        if (slot->ptr() != child) {
          throw Error(group->rank(), "convert_sync_batchnorm",
                      "Sequential " + prefix + ": child order differs from its module list");
        }
        *slot = ::torch::nn::AnyModule(sync);
        parent.replace_module(item.key(), sync);
        break;
      }
      case Parent::module_list: {
        auto& list = dynamic_cast<::torch::nn::ModuleListImpl&>(parent);
        auto slot = list.begin() + static_cast<std::ptrdiff_t>(position);
        if (*slot != child) {
          throw Error(group->rank(), "convert_sync_batchnorm",
                      "ModuleList " + prefix + ": child order differs from its module list");
        }
        *slot = sync;
        parent.replace_module(item.key(), sync);
        break;
      }
      case Parent::module_dict:
        dynamic_cast<::torch::nn::ModuleDictImpl&>(parent).update(
            std::vector<std::pair<std::string, std::shared_ptr<::torch::nn::Module>>>{
                {item.key(), sync}});
        break;
      case Parent::other:
        parent.replace_module(item.key(), sync);  // only the registry held it
        break;
    }
    result.converted.push_back(name);
  }
}

}  // namespace detail::sync_batch_norm

}  // namespace tandem::torch
