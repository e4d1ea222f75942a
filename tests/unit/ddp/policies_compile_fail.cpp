// Must NOT compile: each TANDEM_DDP_CASE_* names an impossible policy list, and the build fails
// with that case's static_assert (tests/unit/ddp/CMakeLists.txt checks the words).
#include "tandem/ddp/policies.hpp"

#if defined(TANDEM_DDP_CASE_device_comm_host_arena)
#include <optional>

#include "tandem/arena/parameters.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/ddp/ddp.hpp"

/// A communicator of device tensors only, as NcclComm is (which needs nvcc): every operation a
/// stub, since only the constructor's static_assert is under test.
struct DeviceOnlyComm {
  using communicator_concept = tandem::communicator_tag;
  using memory_space = tandem::device;
  [[nodiscard]] int rank() const { return 0; }
  [[nodiscard]] int size() const { return 1; }
#define TANDEM_STUB(op)                \
  template <class... Args>             \
  void op(Args&&...) {}                \
  template <class... Args>             \
  tandem::Work op##_async(Args&&...) { \
    return {};                         \
  }
  TANDEM_STUB(all_reduce)
  TANDEM_STUB(reduce)
  TANDEM_STUB(broadcast)
  TANDEM_STUB(all_gather)
  TANDEM_STUB(gather)
  TANDEM_STUB(scatter)
  TANDEM_STUB(reduce_scatter)
  TANDEM_STUB(all_to_all)
  TANDEM_STUB(send)
  TANDEM_STUB(recv)
  TANDEM_STUB(barrier)
#undef TANDEM_STUB
  std::optional<DeviceOnlyComm> split(int, int) {
    return std::nullopt;
  }
};
static_assert(tandem::Communicator<DeviceOnlyComm>);

struct config {
  static constexpr bool overlapped = true;
};

void wrap_host_arena(DeviceOnlyComm& comm, tandem::Parameters<float>& params) {
  tandem::DistributedDataParallel<DeviceOnlyComm, tandem::overlap> ddp(comm, params);
}
#endif

#if defined(TANDEM_DDP_CASE_overlap_and_sync_at_end)
using config = tandem::detail::ddp_config<tandem::overlap, tandem::sync_at_end>;
#elif defined(TANDEM_DDP_CASE_average_and_sum)
using config = tandem::detail::ddp_config<tandem::average, tandem::sum>;
#elif defined(TANDEM_DDP_CASE_compress_float)
using config = tandem::detail::ddp_config<tandem::compress<float> >;
#elif defined(TANDEM_DDP_CASE_two_bucket_caps)
using config = tandem::detail::ddp_config<tandem::bucket_cap<64>, tandem::bucket_cap<128> >;
#elif defined(TANDEM_DDP_CASE_not_a_policy)
using config = tandem::detail::ddp_config<tandem::overlap, int>;
#endif

int main() {
  return config::overlapped ? 0 : 1;
}
