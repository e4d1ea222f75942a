// tandem/ddp/detail/zero_checks.hpp - the misuse checks of ZeRO (the shard<1>/shard<2> and
// prefetch_parameters policies of DistributedDataParallel) and their Errors.
//   detail::ddp::fail_not_gathered(rank, "layer0.weight");
// Needs: core/error.hpp; included by ddp/ddp.hpp, not by users.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/core/error.hpp"

namespace tandem::detail::ddp {

/// A parameter of a Parameters arena, as grad_ready and wait_parameters take it.
template <class P>
concept arena_parameter = requires(const P& p) {
  { p.index() } -> std::convertible_to<std::size_t>;
  { p.is_buffer() } -> std::convertible_to<bool>;
  { p.name() } -> std::convertible_to<std::string_view>;
};

/// shard(opt): the optimizer must step the arena the DDP wraps (its values at `wrapped`, `numel`
/// elements); an Error otherwise.
inline void require_same_arena(const void* stepped, std::size_t size, const void* wrapped,
                               std::size_t numel, int rank) {
  if (stepped == wrapped && size == numel) return;
  throw Error(rank, "DistributedDataParallel::shard",
              "the optimizer steps another arena (" + std::to_string(size) +
                  " elements) than the one this DistributedDataParallel wraps (" +
                  std::to_string(numel) + " elements)");
}

/// Under shard<stage> (stage > 0) the optimizer stepped through the DDP must have been given to
/// shard(): an Error naming `operation` otherwise (a full optimizer would keep state for, and
/// step, every element on every rank).
inline void require_sharded(int stage, const std::vector<const void*>& sharded, const void* opt,
                            int rank, const char* operation) {
  if (stage == 0 || std::find(sharded.begin(), sharded.end(), opt) != sharded.end()) return;
  throw Error(rank, operation,
              "under shard<" + std::to_string(stage) +
                  "> the optimizer must be sharded first: call ddp.shard(opt) before its first "
                  "step (a full optimizer would keep state for, and step, every element on every "
                  "rank)");
}

/// Under sharding each synchronised step must end with step()/gather_parameters(): without the
/// all_gather, ranks would go on with only their own parts updated.
[[noreturn]] inline void fail_not_stepped(int stage, int rank, const char* operation) {
  throw Error(rank, operation,
              "under shard<" + std::to_string(stage) +
                  "> every finish_gradient_sync() must be followed by ddp.step(opt) (or "
                  "ddp.step(scaler, opt)), which steps the sharded optimizer and all-gathers the "
                  "parameters; the last one was not (was opt.step() called directly?)");
}

/// prefetch_parameters: a gradient was marked ready for a parameter whose values were still on
/// the wire, so the forward read them before they had arrived.
[[noreturn]] inline void fail_not_gathered(int rank, const std::string& name) {
  throw Error(rank, "DistributedDataParallel::grad_ready",
              "parameter '" + name +
                  "' has a gradient, but its values' all_gather, which step() left in flight "
                  "(prefetch_parameters), was not waited: call ddp.wait_parameters(p) (or "
                  "ddp.wait_parameters()) before the forward reads it");
}

}  // namespace tandem::detail::ddp
