// tandem/comm/stream_order.hpp - the one way GPU work is ordered with a communicator's: queued
// work is marked by an event, the communicator orders its next operations after it, and finished
// work hands back to the caller's stream; the host waits only where it must (it copies, or reads).
//   tandem::order_after(comm, exec);          // comm's next operations follow exec's queued work
//   tandem::Work work = comm.all_reduce_async(grads);
//   tandem::hand_back(work, exec);            // exec's later work sees the reduced grads
//   comm.broadcast(buffers, 0);  tandem::hand_back(comm, exec);   // after sync operations
// Needs: the standard library (no CUDA: the verbs dispatch at compile time on the types of the
// executor and the communicator; no virtual call).
//
// What each verb does (the table in docs/gpu.md, "The stream-ordering contract"):
// - an executor without a stream (host_exec): order_after and hand_back(comm, exec) do nothing,
//   hand_back(work, exec) is work.wait();
// - a stream executor (cuda_exec{s}) and a communicator that orders on the device (NcclComm):
//   order_after is comm.order_after(s), an event on s that comm's next operation waits for on the
//   GPU; hand_back(work, exec) is work.wait(s), s waiting on the GPU for the operation's end event
//   (a host wait for a Work that has none, e.g. one issued inside an NcclGroup); hand_back(comm,
//   exec) is comm.wait_stream(s);
// - a stream executor and a host communicator (LocalComm, GlooComm, MpiComm, ShmComm, staging
//   device tensors through pinned memory): order_after is exec.synchronize() (the host copies, so
//   the host waits), hand_back(work, exec) is work.wait(), hand_back(comm, exec) nothing (a sync
//   operation has finished when it returns).
//
// A stream executor is an Executor with a `stream` member (cuda_exec). A communicator orders on
// the device when it has `order_after(s)` and `wait_stream(s)` for that stream's type; neither
// verb changes the communicator's caller stream for its other callers, and where `s` is that
// caller stream (the defaults of NcclComm and cuda_exec: the thread's default stream) both are
// free: every operation follows its caller stream, and a sync one runs on it.
//
// Errors: where the host does not wait, an operation that fails later does not raise here. As
// with PyTorch's reducer on NCCL, the communicator's watchdog aborts the communicator on NCCL's
// asynchronous error or an operation older than its timeout, the streams waiting on it go on
// (with garbage), and the communicator's next call (or hand_back of a Work that has failed by
// then, or a host read through comm.synchronize()) raises the tandem::Error naming the rank, the
// operation and its sequence number.
#pragma once

#include <concepts>
#include <exception>
#include <type_traits>
#include <vector>

#include "tandem/comm/work.hpp"
#include "tandem/tensor/exec.hpp"

namespace tandem {

/// An executor that queues its work on a device stream, named by its `stream` member (cuda_exec):
/// its calls return before the work has run.
template <class E>
concept StreamExecutor = Executor<E> && requires(const E& exec) {
  exec.stream;
};

/// A communicator that orders its operations on the device after, and hands their results back
/// to, a stream of Exec: it has `order_after(stream)` and `wait_stream(stream)` (NcclComm with
/// cuda_exec). Where this is false for a stream executor, the contract waits on the host.
template <class Comm, class Exec>
concept OrdersOnStream = StreamExecutor<Exec> && requires(Comm& comm, const Exec& exec) {
  comm.order_after(exec.stream);
  comm.wait_stream(exec.stream);
};

/// The communicator's next operations (and so every later one: operations run in issue order)
/// start after everything queued on `exec` so far (see the table at the top of this header).
template <class Comm, Executor Exec>
void order_after([[maybe_unused]] Comm& comm, [[maybe_unused]] const Exec& exec) {
  if constexpr (OrdersOnStream<Comm, Exec>) {
    comm.order_after(exec.stream);
  } else if constexpr (StreamExecutor<Exec>) {
    exec.synchronize();  // a host communicator reads device memory through host copies
  }
}

/// `exec`'s later work sees the result of `work`: the stream waits on the device where the Work
/// can make it (an NcclComm operation's end event), else the host waits. Rethrows a failure the
/// operation has already had.
template <Executor Exec>
void hand_back(const Work& work, [[maybe_unused]] const Exec& exec) {
  if constexpr (requires { work.wait(exec.stream); }) {
    work.wait(exec.stream);
  } else {
    work.wait();
  }
}

/// `exec`'s later work sees the results of the sync operations issued on `comm` so far: on a
/// communicator that orders on the device, the stream waits for them there; a host
/// communicator's sync operations have finished when they return. (A Work is handed back by
/// the overload above, never by this one.)
template <class Comm, Executor Exec>
requires(!std::is_convertible_v<Comm&, const Work&>) void hand_back(
    [[maybe_unused]] Comm& comm, [[maybe_unused]] const Exec& exec) {
  if constexpr (OrdersOnStream<Comm, Exec>) comm.wait_stream(exec.stream);
}

namespace detail {

/// Runs `launch` (which starts operations, adding their Works to `works`), then hands every Work
/// back to `exec`. Returns the first failure (launch's, then the Works' in order), or null. When
/// launch failed, the host waits for every Work started, even after a failure, so that none is
/// left writing memory the caller may then free.
template <Executor Exec, class Launch>
std::exception_ptr launch_and_hand_back(std::vector<Work>& works, const Exec& exec,
                                        Launch&& launch) {
  std::exception_ptr failure;
  try {
    launch();
  } catch (...) {
    failure = std::current_exception();
  }
  for (auto& work : works) {
    try {
      if (failure) {
        work.wait();
      } else {
        tandem::hand_back(work, exec);
      }
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  return failure;
}

/// An executor reduced to what the contract needs, for code that keeps its communicator behind a
/// type-erased call (GradScaler's inf-flag all_reduce): its stream where that is a pointer (a
/// cudaStream_t), and its host wait. Refers to the executor, which must outlive it.
class ErasedExecutor {
 public:
  template <Executor Exec>
  explicit ErasedExecutor(const Exec& exec)
      : exec_(&exec),
        synchronize_([](const void* e) { static_cast<const Exec*>(e)->synchronize(); }) {
    if constexpr (StreamExecutor<Exec>) {
      has_stream_ = true;
      if constexpr (std::is_pointer_v<std::remove_cvref_t<decltype(exec.stream)>>) {
        stream_ = static_cast<void*>(exec.stream);
      }
    }
  }

  /// Whether the executor queues its work on a stream.
  [[nodiscard]] bool has_stream() const noexcept { return has_stream_; }
  /// Its stream as a pointer, null when it has none or its stream is not a pointer.
  [[nodiscard]] void* stream() const noexcept { return stream_; }
  /// Blocks the host until the executor's queued work has run.
  void synchronize() const { synchronize_(exec_); }

 private:
  const void* exec_;
  void (*synchronize_)(const void*);
  bool has_stream_ = false;
  void* stream_ = nullptr;
};

/// The stream type a communicator orders on, where it has one (its caller_stream()'s type).
template <class Comm>
concept OrdersOnErasedStream = requires(Comm& comm) {
  requires std::is_pointer_v<std::remove_cvref_t<decltype(comm.caller_stream())>>;
  comm.order_after(comm.caller_stream());
  comm.wait_stream(comm.caller_stream());
  comm.synchronize();
};

/// order_after for an executor whose type was erased: the same dispatch as the typed one.
template <class Comm>
void order_after_erased(Comm& comm, const ErasedExecutor& exec) {
  if (!exec.has_stream()) return;
  if constexpr (OrdersOnErasedStream<Comm>) {
    using Stream = std::remove_cvref_t<decltype(comm.caller_stream())>;
    if (exec.stream() != nullptr) {
      comm.order_after(static_cast<Stream>(exec.stream()));
      return;
    }
  }
  exec.synchronize();
}

/// hand_back(comm, exec) for an executor whose type was erased: the same dispatch as the typed
/// one.
template <class Comm>
void hand_back_erased([[maybe_unused]] Comm& comm, [[maybe_unused]] const ErasedExecutor& exec) {
  if constexpr (OrdersOnErasedStream<Comm>) {
    using Stream = std::remove_cvref_t<decltype(comm.caller_stream())>;
    if (exec.stream() != nullptr) {
      comm.wait_stream(static_cast<Stream>(exec.stream()));
    } else if (exec.has_stream()) {
      comm.synchronize();  // a stream it cannot name: the host waits for the results
    }
  }
}

}  // namespace detail

}  // namespace tandem
