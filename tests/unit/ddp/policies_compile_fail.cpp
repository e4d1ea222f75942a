// Must NOT compile: each TANDEM_DDP_CASE_* names an impossible policy list, and the build fails
// with that case's static_assert (tests/unit/ddp/CMakeLists.txt checks the words).
#include "tandem/ddp/policies.hpp"

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
