// tandem/ddp/detail/join_access.hpp - how tandem::Join (ddp/join.hpp) reaches its joinables:
// which types are joinables (DistributedDataParallel, SyncBatchNorm), the friend that calls
// their private hooks, and a joinable with its type erased.
//   detail::join::Entry entry;  entry.shadow(entry.object, event, argument);
// Needs: ddp/ddp.hpp; nn/sync_batch_norm.hpp is only declared here (a Join's SyncBatchNorm
// brings its own header).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>

#include "tandem/comm/communicator.hpp"
#include "tandem/ddp/ddp.hpp"
#include "tandem/tensor/memory.hpp"

namespace tandem {

template <Communicator Comm, class T, memory_space Space, class Exec>
class SyncBatchNorm;

namespace detail::join {

/// Which joinable a type is: 1 DistributedDataParallel, 2 SyncBatchNorm, 0 none.
template <class J>
struct kind_of : std::integral_constant<int, 0> {};
template <class C, class... P>
struct kind_of<DistributedDataParallel<C, P...>> : std::integral_constant<int, 1> {
  using comm_type = C;
};
template <class C, class T, class S, class E>
struct kind_of<SyncBatchNorm<C, T, S, E>> : std::integral_constant<int, 2> {
  using comm_type = C;
};

/// A type a Join takes: DistributedDataParallel or SyncBatchNorm.
template <class J>
concept joinable = kind_of<std::remove_cv_t<J>>::value != 0;

template <class J>
using comm_of_t = typename kind_of<std::remove_cv_t<J>>::comm_type;

/// What an event is to the Join: part of a DistributedDataParallel's gradient synchronisation
/// (absent from a step under no_sync()), the end of one (finish_gradient_sync()), the joinable's
/// destructor, or anything else.
enum class EventClass { other, sync, sync_end, destroyed };

/// What the Join reaches in its joinables (their hooks are private; this is their friend).
struct access {
  template <class J>
  static auto& communicator(J& j) {
    if constexpr (kind_of<J>::value == 1) {
      return j.comm();
    } else {
      return j.communicator();
    }
  }
  template <class J>
  static bool attached(const J& j) {
    return static_cast<bool>(j.join_record_);
  }
  template <class J>
  static void attach(J& j, std::function<void(int, std::size_t)> record) {
    j.join_record_ = std::move(record);
  }
  template <class J>
  static void detach(void* j) {
    auto& joinable = *static_cast<J*>(j);
    joinable.join_record_ = nullptr;
    if constexpr (kind_of<J>::value == 1) {
      configure<J>(j, 0, 0);
      joinable.join_steps_.clear();  // replays refer to objects a later Join may not see again
    }
  }
  template <class J>
  static void shadow(void* j, int event, std::size_t argument) {
    static_cast<J*>(j)->join_shadow(event, argument);
  }
  // DistributedDataParallel only.
  template <class J>
  static bool synchronises(const void* j) {
    return static_cast<const J*>(j)->no_sync_depth_ == 0;
  }
  template <class J>
  static void configure(void* j, int root, double divisor) {
    static_cast<J*>(j)->broadcast_root_ = root;
    static_cast<J*>(j)->join_divisor_ = divisor;
  }
  /// The final agreement: parameters and buffers from `root`. Collective.
  template <class J>
  static void agree(void* j, int root) {
    auto& ddp = *static_cast<J*>(j);
    if (ddp.comm_->size() > 1) ddp.arena_->broadcast(*ddp.comm_, /*values_too=*/true, root);
  }
  /// What `event` of joinable J is to the Join.
  template <class J>
  static EventClass classify(int event) {
    if constexpr (kind_of<J>::value == 1) {
      if (event == J::join_destroyed) return EventClass::destroyed;
      if (event == J::join_finish) return EventClass::sync_end;
      return event == J::join_buffers ? EventClass::other : EventClass::sync;
    } else {
      return EventClass::other;
    }
  }
  template <class J>
  static std::string describe(int event, std::size_t argument) {
    if constexpr (kind_of<J>::value == 1) {
      switch (event) {
        case J::join_buffers:
          return "the buffer broadcast (before_forward)";
        case J::join_bucket:
          return "bucket " + std::to_string(argument) + "'s reduction";
        case J::join_finish:
          return "finish_gradient_sync()";
        default:
          return "ddp.step(...)";
      }
    } else {
      return event == J::join_forward ? "a synchronised forward" : "a synchronised backward";
    }
  }
};

/// One joinable, its type erased.
struct Entry {
  void* object = nullptr;
  std::string name;    // "DistributedDataParallel #0", "SyncBatchNorm #1" (its own kind's count)
  int ddp_index = -1;  // its bit in the patterns (DistributedDataParallel only)
  void (*detach)(void*) = nullptr;
  void (*shadow)(void*, int, std::size_t) = nullptr;
  bool (*synchronises)(const void*) = nullptr;
  void (*configure)(void*, int, double) = nullptr;
  void (*agree)(void*, int) = nullptr;
  EventClass (*classify)(int) = nullptr;
  std::string (*describe)(int, std::size_t) = nullptr;
};

}  // namespace detail::join

}  // namespace tandem
