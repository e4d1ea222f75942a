// Compile-only test: the real test is that this file compiles. Each static_assert states that a
// type models, or does not model, one of tandem's concepts; main() only gives CTest something to
// run once the compilation succeeded.
#include <array>
#include <cstddef>
#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/tensor/dtype.hpp"
#include "tandem/tensor/memory.hpp"
#include "tandem/tensor/tensor.hpp"

namespace {

using tandem::Buffer;
using tandem::device;
using tandem::host;
using tandem::MutableTensor;
using tandem::pinned;
using tandem::Tensor;
using tandem::TensorIn;
using tandem::View;

// --- element types -----------------------------------------------------------------------------
static_assert(tandem::element_type<float>);
static_assert(tandem::element_type<double>);
static_assert(tandem::element_type<tandem::half>);
static_assert(tandem::element_type<tandem::bfloat16>);
static_assert(tandem::element_type<std::int32_t>);
static_assert(tandem::element_type<std::int64_t>);
static_assert(tandem::element_type<std::uint8_t>);
static_assert(tandem::element_type<const float>);
static_assert(tandem::element_type<const volatile std::uint8_t>);
static_assert(!tandem::element_type<char>);
static_assert(!tandem::element_type<signed char>);
static_assert(!tandem::element_type<bool>);
static_assert(!tandem::element_type<long double>);
static_assert(!tandem::element_type<std::int16_t>);
static_assert(!tandem::element_type<std::uint16_t>);
static_assert(!tandem::element_type<std::uint32_t>);
static_assert(!tandem::element_type<std::uint64_t>);
static_assert(!tandem::element_type<float*>);
static_assert(!tandem::element_type<float&>);
static_assert(!tandem::element_type<void>);
static_assert(!tandem::element_type<std::string>);

// --- memory spaces -----------------------------------------------------------------------------
static_assert(tandem::memory_space<host>);
static_assert(tandem::memory_space<pinned>);
static_assert(tandem::memory_space<device>);
static_assert(!tandem::memory_space<int>);
static_assert(!tandem::memory_space<void>);

static_assert(tandem::host_accessible<host>);
static_assert(tandem::host_accessible<pinned>);
static_assert(!tandem::host_accessible<device>);

}  // namespace

/// Named like a memory space, but not opted in.
struct named_but_not_opted_in {
  static constexpr const char* name = "mine";
};
static_assert(!tandem::memory_space<named_but_not_opted_in>);

/// A user's memory space: opted in, named.
struct managed {
  static constexpr const char* name = "managed";
};
template <>
inline constexpr bool tandem::enable_memory_space<managed> = true;
static_assert(tandem::memory_space<managed>);

namespace {

// --- tensors -----------------------------------------------------------------------------------
static_assert(Tensor<std::vector<float>>);
static_assert(MutableTensor<std::vector<float>>);
static_assert(TensorIn<std::vector<float>, host>);
static_assert(!TensorIn<std::vector<float>, device>);
static_assert(Tensor<std::vector<float>&>);
static_assert(Tensor<const std::vector<float>&>);
static_assert(!MutableTensor<const std::vector<float>>);
static_assert(!MutableTensor<const std::vector<float>&>);
static_assert(Tensor<std::vector<tandem::half>>);
static_assert(Tensor<std::vector<tandem::bfloat16>>);
static_assert(Tensor<std::span<double>>);
static_assert(Tensor<std::span<double, 4>>);
static_assert(MutableTensor<const std::span<double>>);  // a const span still writes through
static_assert(Tensor<std::span<const double>>);
static_assert(!MutableTensor<std::span<const double>>);
static_assert(Tensor<std::array<std::uint8_t, 3>>);
static_assert(!MutableTensor<const std::array<std::uint8_t, 3>>);

static_assert(!Tensor<int>);
static_assert(!Tensor<float>);
static_assert(!Tensor<float*>);
static_assert(!Tensor<const float*>);
static_assert(!Tensor<float[4]>);
static_assert(!Tensor<std::vector<char>>);  // not an element type
static_assert(!Tensor<std::vector<bool>>);  // no data()
static_assert(!Tensor<std::vector<std::int16_t>>);
static_assert(!Tensor<std::string>);  // char, and no opt-in
static_assert(!Tensor<std::list<float>>);

struct looks_like_a_tensor {  // data() and size(), but no opt-in
  float* data();
  std::size_t size() const;
};
static_assert(!Tensor<looks_like_a_tensor>);

struct user_tensor {  // opts in with value_type + memory_space
  using value_type = float;
  using memory_space = tandem::host;
  float* data();
  const float* data() const;
  std::size_t size() const;
};
static_assert(Tensor<user_tensor>);
static_assert(MutableTensor<user_tensor>);
static_assert(TensorIn<user_tensor, host>);
static_assert(Tensor<const user_tensor>);
static_assert(!MutableTensor<const user_tensor>);
static_assert(std::same_as<tandem::tensor_element_t<const user_tensor&>, const float>);

struct user_device_tensor {  // a user space and an int size() count as well
  using value_type = std::int64_t;
  using memory_space = managed;
  std::int64_t* data() const;
  int size() const;
};
static_assert(TensorIn<user_device_tensor, managed>);
static_assert(!TensorIn<user_device_tensor, host>);

/// Opts in with value_type and memory_space, and has data() and size() only where asked: each
/// type below but the first gets one thing wrong.
template <class Value, class Space, bool with_data = true, bool with_size = true>
struct opted_in {
  using value_type = Value;
  using memory_space = Space;
  Value* data() requires with_data;
  std::size_t size() const requires with_size;
};
static_assert(Tensor<opted_in<float, tandem::host>>);
static_assert(!Tensor<opted_in<float, tandem::host, false>>);  // once a hard error in tensor_traits
static_assert(!Tensor<opted_in<float, tandem::host, true, false>>);  // no size()
static_assert(!Tensor<opted_in<float, int>>);                        // a bad memory space
static_assert(!Tensor<opted_in<char, tandem::host>>);                // a bad element type

}  // namespace

/// Opting in by specialising tensor_traits, for a type one cannot change.
namespace third_party {
struct device_array {
  float* data();
  std::size_t size() const;
};
}  // namespace third_party
template <>
struct tandem::tensor_traits<third_party::device_array> {
  using element_type = float;
  using memory_space = tandem::device;
};
static_assert(tandem::TensorIn<third_party::device_array, tandem::device>);

namespace {

// --- View and Buffer ---------------------------------------------------------------------------
static_assert(Tensor<View<float>>);
static_assert(MutableTensor<View<float>>);
static_assert(MutableTensor<const View<float>>);  // a const View still writes through
static_assert(Tensor<View<const float>>);
static_assert(!MutableTensor<View<const float>>);
static_assert(TensorIn<View<float, device>, device>);
static_assert(TensorIn<View<const tandem::half, pinned>, pinned>);
static_assert(!TensorIn<View<float, device>, host>);
static_assert(std::is_trivially_copyable_v<View<float>>);

static_assert(Tensor<Buffer<float>>);
static_assert(MutableTensor<Buffer<float>>);
static_assert(!MutableTensor<const Buffer<float>>);
static_assert(TensorIn<Buffer<float, device>, device>);  // naming the type needs no allocator
static_assert(TensorIn<Buffer<tandem::bfloat16, pinned>, pinned>);
static_assert(!TensorIn<Buffer<float, device>, host>);

// Element access exists only where the host may touch the memory.
template <class T>
concept indexable = requires(T& t) {
  t[0];
};
template <class T>
concept iterable = requires(T& t) {
  t.begin();
  t.end();
};
static_assert(indexable<View<float>> && iterable<View<float>>);
static_assert(indexable<View<float, pinned>> && iterable<View<float, pinned>>);
static_assert(!indexable<View<float, device>> && !iterable<View<float, device>>);
static_assert(indexable<Buffer<float>> && iterable<const Buffer<float>>);
static_assert(!indexable<Buffer<float, device>> && !iterable<Buffer<float, device>>);

// Views convert like spans: to const, not across element types or spaces.
static_assert(std::is_convertible_v<std::vector<float>&, View<float>>);
static_assert(std::is_convertible_v<std::vector<float>&, View<const float>>);
static_assert(!std::is_convertible_v<const std::vector<float>&, View<float>>);
static_assert(!std::is_convertible_v<std::vector<double>&, View<float>>);
static_assert(!std::is_convertible_v<std::vector<float>&, View<float, device>>);
static_assert(std::is_convertible_v<View<float, device>, View<const float, device>>);
static_assert(!std::is_convertible_v<View<float, device>, View<float, host>>);
static_assert(std::is_convertible_v<Buffer<float, device>&, View<float, device>>);

// --- communicators -----------------------------------------------------------------------------
// Every operation but barrier_async and split, whose presence the fakes below vary. Declarations
// suffice: nothing is called.
struct fake_comm_ops {
  using memory_space = tandem::host;
  using Out = View<float>;
  using In = View<const float>;
  using Op = tandem::ReduceOp;

  int rank() const;
  int size() const;
  void all_reduce(Out, Op);
  void all_reduce(In, Out, Op);
  void reduce(Out, int, Op);
  void broadcast(Out, int);
  void all_gather(In, Out);
  void gather(In, Out, int);
  void scatter(In, Out, int);
  void reduce_scatter(In, Out, Op);
  void all_to_all(In, Out);
  void send(In, int, int);
  void recv(Out, int, int);
  void barrier();
  tandem::Work all_reduce_async(Out, Op);
  tandem::Work all_reduce_async(In, Out, Op);
  tandem::Work reduce_async(Out, int, Op);
  tandem::Work broadcast_async(Out, int);
  tandem::Work all_gather_async(In, Out);
  tandem::Work gather_async(In, Out, int);
  tandem::Work scatter_async(In, Out, int);
  tandem::Work reduce_scatter_async(In, Out, Op);
  tandem::Work all_to_all_async(In, Out);
  tandem::Work send_async(In, int, int);
  tandem::Work recv_async(Out, int, int);
};

struct fake_comm : fake_comm_ops {
  using communicator_concept = tandem::communicator_tag;
  tandem::Work barrier_async();
  std::optional<fake_comm> split(int color, int key);
};
static_assert(tandem::Communicator<fake_comm>);

struct fake_comm_without_barrier_async : fake_comm_ops {
  using communicator_concept = tandem::communicator_tag;
  std::optional<fake_comm_without_barrier_async> split(int color, int key);
};
static_assert(!tandem::Communicator<fake_comm_without_barrier_async>);

struct fake_comm_without_tag : fake_comm_ops {
  tandem::Work barrier_async();
  std::optional<fake_comm_without_tag> split(int color, int key);
};
static_assert(!tandem::Communicator<fake_comm_without_tag>);

struct fake_comm_with_wrong_tag : fake_comm_ops {
  using communicator_concept = int;
  tandem::Work barrier_async();
  std::optional<fake_comm_with_wrong_tag> split(int color, int key);
};
static_assert(!tandem::Communicator<fake_comm_with_wrong_tag>);

struct fake_comm_with_blocking_async : fake_comm_ops {  // barrier_async returns void
  using communicator_concept = tandem::communicator_tag;
  void barrier_async();
  std::optional<fake_comm_with_blocking_async> split(int color, int key);
};
static_assert(!tandem::Communicator<fake_comm_with_blocking_async>);

struct fake_device_comm : fake_comm {  // same operations, but declares the device space
  using memory_space = tandem::device;
  std::optional<fake_device_comm> split(int color, int key);
};
static_assert(!tandem::Communicator<fake_device_comm>);  // its operations take host views

static_assert(!tandem::Communicator<int>);
static_assert(!tandem::Communicator<user_tensor>);

}  // namespace

int main() {
  return 0;
}

// A View of a temporary container would dangle, so it does not convert; spans and views do.
static_assert(!std::is_constructible_v<tandem::View<float>, std::vector<float>&&>);
static_assert(!std::is_constructible_v<tandem::View<float>, tandem::Buffer<float>&&>);
static_assert(std::is_constructible_v<tandem::View<float>, std::vector<float>&>);
static_assert(std::is_constructible_v<tandem::View<float>, std::span<float>&&>);
