// tests/cuda/staged_comm.hpp - the conformance suite's host containers in front of a communicator
// that is given DEVICE tensors: NcclComm, or Gloo/MPI/LocalComm (which stage device tensors
// through pinned memory). StagedComm copies each call's host tensors to device memory on the
// caller's stream (keeping how they overlap, so in-place calls stay in place), runs the operation
// on the device copies and copies the results back. Sync calls read the results back on the
// caller's stream (for NcclComm this tests that the operation is ordered on it); `_async` calls
// wait for their Work first. A communicator with a host wait of its own (NcclComm::synchronize)
// is then asked whether what was read back is a result: an NCCL operation ended by an abort or
// a failed peer lets the stream go on, and only the communicator reports the failure.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>

#include "tandem/comm/communicator.hpp"
#include "tandem/cuda/runtime.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::test {

/// Device copies of one call's host tensors (one or two, possibly overlapping).
template <class E>
class DeviceCopies {
 public:
  /// `a` (and `b`, when given) as device views; where one lies inside the other, one device
  /// allocation holds both at the same offsets.
  DeviceCopies(const E* a, std::size_t a_size, const E* b, std::size_t b_size, cudaStream_t stream)
      : stream_(stream) {
    const auto a_at = reinterpret_cast<std::uintptr_t>(a);
    const auto b_at = reinterpret_cast<std::uintptr_t>(b);
    const bool a_in_b = b && a_at >= b_at && a_at + a_size * sizeof(E) <= b_at + b_size * sizeof(E);
    const bool b_in_a = b && b_at >= a_at && b_at + b_size * sizeof(E) <= a_at + a_size * sizeof(E);
    if (a_in_b && b_size > 0) {
      b_ = upload(b, b_size, 0);
      a_ = b_ + (a - b);
    } else if (b_in_a && a_size > 0) {
      a_ = upload(a, a_size, 0);
      b_ = a_ + (b - a);
    } else {
      a_ = upload(a, a_size, 0);
      if (b) b_ = upload(b, b_size, 1);
    }
  }
  DeviceCopies(const DeviceCopies&) = delete;
  DeviceCopies& operator=(const DeviceCopies&) = delete;
  ~DeviceCopies() {
    for (E* block : blocks_) {
      if (block) (void)cudaFreeAsync(block, stream_);
    }
  }

  [[nodiscard]] E* a() const { return a_; }
  [[nodiscard]] E* b() const { return b_; }

  /// Copies `count` elements at device pointer `from` back to host `to` on the stream, and
  /// waits for the stream (so for every operation the stream was told to wait for).
  void download(E* to, const E* from, std::size_t count) const {
    if (count > 0) {
      cuda::check(cudaMemcpyAsync(to, from, count * sizeof(E), cudaMemcpyDeviceToHost, stream_),
                  "cudaMemcpyAsync");
    }
    cuda::check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

 private:
  E* upload(const E* host, std::size_t count, int slot) {
    if (count == 0) return nullptr;
    void* block = nullptr;
    cuda::check(cudaMallocAsync(&block, count * sizeof(E), stream_), "cudaMallocAsync");
    blocks_[slot] = static_cast<E*>(block);
    cuda::check(cudaMemcpyAsync(block, host, count * sizeof(E), cudaMemcpyHostToDevice, stream_),
                "cudaMemcpyAsync");
    return static_cast<E*>(block);
  }

  cudaStream_t stream_;
  E* blocks_[2] = {nullptr, nullptr};
  E* a_ = nullptr;
  E* b_ = nullptr;
};

/// A host-space Communicator whose every call goes through Comm on device copies.
template <class Comm>
class StagedComm {
 public:
  using communicator_concept = communicator_tag;
  using memory_space = host;

  explicit StagedComm(Comm comm) : comm_(std::move(comm)) {}

  [[nodiscard]] int rank() const { return comm_.rank(); }
  [[nodiscard]] int size() const { return comm_.size(); }
  [[nodiscard]] Comm& inner() { return comm_; }

  template <class T>
  void all_reduce(T&& t, ReduceOp op = ReduceOp::sum) {
    (void)one<false>(t, [&](auto d) { comm_.all_reduce(d, op); });
  }
  template <class In, class Out>
  void all_reduce(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    (void)two<false>(in, out, [&](auto i, auto o) { comm_.all_reduce(i, o, op); });
  }
  template <class T>
  Work all_reduce_async(T&& t, ReduceOp op = ReduceOp::sum) {
    return one<true>(t, [&](auto d) { return comm_.all_reduce_async(d, op); });
  }
  template <class In, class Out>
  Work all_reduce_async(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    return two<true>(in, out, [&](auto i, auto o) { return comm_.all_reduce_async(i, o, op); });
  }

  template <class T>
  void reduce(T&& t, int root, ReduceOp op = ReduceOp::sum) {
    (void)one<false>(t, [&](auto d) { comm_.reduce(d, root, op); });
  }
  template <class T>
  Work reduce_async(T&& t, int root, ReduceOp op = ReduceOp::sum) {
    return one<true>(t, [&](auto d) { return comm_.reduce_async(d, root, op); });
  }

  template <class T>
  void broadcast(T&& t, int root) {
    (void)one<false>(t, [&](auto d) { comm_.broadcast(d, root); });
  }
  template <class T>
  Work broadcast_async(T&& t, int root) {
    return one<true>(t, [&](auto d) { return comm_.broadcast_async(d, root); });
  }

#define TANDEM_STAGED_TWO(name)                                                          \
  template <class In, class Out>                                                         \
  void name(In&& in, Out&& out) {                                                        \
    (void)two<false>(in, out, [&](auto i, auto o) { comm_.name(i, o); });                \
  }                                                                                      \
  template <class In, class Out>                                                         \
  Work name##_async(In&& in, Out&& out) {                                                \
    return two<true>(in, out, [&](auto i, auto o) { return comm_.name##_async(i, o); }); \
  }
  TANDEM_STAGED_TWO(all_gather)
  TANDEM_STAGED_TWO(all_to_all)
#undef TANDEM_STAGED_TWO

  template <class In, class Out>
  void gather(In&& in, Out&& out, int root) {
    (void)two<false>(in, out, [&](auto i, auto o) { comm_.gather(i, o, root); });
  }
  template <class In, class Out>
  Work gather_async(In&& in, Out&& out, int root) {
    return two<true>(in, out, [&](auto i, auto o) { return comm_.gather_async(i, o, root); });
  }
  template <class In, class Out>
  void scatter(In&& in, Out&& out, int root) {
    (void)two<false>(in, out, [&](auto i, auto o) { comm_.scatter(i, o, root); });
  }
  template <class In, class Out>
  Work scatter_async(In&& in, Out&& out, int root) {
    return two<true>(in, out, [&](auto i, auto o) { return comm_.scatter_async(i, o, root); });
  }
  template <class In, class Out>
  void reduce_scatter(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    (void)two<false>(in, out, [&](auto i, auto o) { comm_.reduce_scatter(i, o, op); });
  }
  template <class In, class Out>
  Work reduce_scatter_async(In&& in, Out&& out, ReduceOp op = ReduceOp::sum) {
    return two<true>(in, out, [&](auto i, auto o) { return comm_.reduce_scatter_async(i, o, op); });
  }

  template <class T>
  void send(T&& t, int peer, int tag = 0) {
    (void)one<false>(t, [&](auto d) { comm_.send(d, peer, tag); });
  }
  template <class T>
  Work send_async(T&& t, int peer, int tag = 0) {
    return one<true>(t, [&](auto d) { return comm_.send_async(d, peer, tag); });
  }
  template <class T>
  void recv(T&& t, int peer, int tag = 0) {
    (void)one<false>(t, [&](auto d) { comm_.recv(d, peer, tag); });
  }
  template <class T>
  Work recv_async(T&& t, int peer, int tag = 0) {
    return one<true>(t, [&](auto d) { return comm_.recv_async(d, peer, tag); });
  }

  void barrier() {
    comm_.barrier();
  }
  Work barrier_async() {
    comm_.barrier_async().wait();
    return Work();
  }

  [[nodiscard]] std::optional<StagedComm> split(int color, int key = 0) {
    auto made = comm_.split(color, key);
    if (!made) return std::nullopt;
    return StagedComm(std::move(*made));
  }

 private:
  /// The device view of host tensor t (same constness), or of the copy at `at`.
  template <class T, class E>
  static auto device_view(T& t, E* at) {
    using Elem = std::remove_reference_t<decltype(*t.data())>;
    return View<Elem, device>(at, static_cast<std::size_t>(t.size()));
  }

  template <class T>
  static constexpr bool is_mutable =
      !std::is_const_v<std::remove_reference_t<decltype(*std::declval<T&>().data())>>;

  /// NcclComm orders its work after its caller's stream; the host communicators stage through
  /// synchronous copies on the legacy default stream, which the uploads here are ordered with.
  cudaStream_t stream() {
    if constexpr (requires { comm_.caller_stream(); }) {
      return comm_.caller_stream();
    } else {
      return cudaStream_t{};
    }
  }

  /// After a download: raises the communicator's failure, where it has a host wait to report it
  /// (NcclComm). Its operations are finished already (the download was ordered after them).
  void raise_failure() {
    if constexpr (requires { comm_.synchronize(); }) comm_.synchronize();
  }

  /// One tensor: upload, run, wait (Work or stream) and download.
  template <bool Async, class T, class Call>
  Work one(T& t, Call call) {
    using E = std::remove_cv_t<std::remove_reference_t<decltype(*t.data())>>;
    const cudaStream_t stream = this->stream();
    DeviceCopies<E> copies(t.data(), static_cast<std::size_t>(t.size()), nullptr, 0, stream);
    if constexpr (Async) {
      call(device_view(t, copies.a())).wait();
    } else {
      call(device_view(t, copies.a()));
    }
    if constexpr (is_mutable<T>) {
      copies.download(t.data(), copies.a(), static_cast<std::size_t>(t.size()));
    } else {
      copies.download(nullptr, nullptr, 0);
    }
    raise_failure();
    return Work();
  }

  /// Two tensors; both are downloaded where mutable (so an untouched input is checked too).
  template <bool Async, class In, class Out, class Call>
  Work two(In& in, Out& out, Call call) {
    using E = std::remove_cv_t<std::remove_reference_t<decltype(*out.data())>>;
    const cudaStream_t stream = this->stream();
    const auto in_size = static_cast<std::size_t>(in.size());
    const auto out_size = static_cast<std::size_t>(out.size());
    const E* out_host = out.data();
    DeviceCopies<E> copies(in.data(), in_size, out_host ? out_host : nullptr, out_size, stream);
    if constexpr (Async) {
      call(device_view(in, copies.a()), device_view(out, copies.b())).wait();
    } else {
      call(device_view(in, copies.a()), device_view(out, copies.b()));
    }
    if constexpr (is_mutable<In>) {
      // An input inside the output is downloaded with it; one apart, on its own.
      copies.download(in.data(), copies.a(), in_size);
    }
    copies.download(out.data(), copies.b(), out_size);
    raise_failure();
    return Work();
  }

  Comm comm_;
};

}  // namespace tandem::test
