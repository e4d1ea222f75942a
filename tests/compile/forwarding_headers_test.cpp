// The old include paths (before issue 21 split comm/ into rooms) still compile and still provide
// their names, one forwarding header each, until they go away in tandem 0.3. The real test is that
// this file compiles; the engines' headers are checked where their engine is built.
#include <concepts>
#include <type_traits>

#include "tandem/comm/c10d_store.hpp"
#include "tandem/comm/file_store.hpp"
#include "tandem/comm/init_method.hpp"
#include "tandem/comm/local.hpp"
#include "tandem/comm/store.hpp"
#include "tandem/comm/tcp_store.hpp"
#include "tandem/ddp/parameters.hpp"
#if TANDEM_TEST_GLOO
#include "tandem/comm/gloo.hpp"
#endif
#if TANDEM_TEST_MPI
#include "tandem/comm/mpi.hpp"
#endif
#if TANDEM_TEST_NCCL && defined(__CUDACC__)
#include "tandem/comm/nccl.hpp"
#if TANDEM_TEST_MPI
#include "tandem/comm/nccl_mpi.hpp"
#endif
#endif

static_assert(tandem::Store<tandem::HashStore>);
static_assert(tandem::Store<tandem::PrefixStore<tandem::HashStore>>);
static_assert(tandem::Store<tandem::AnyStore>);
static_assert(tandem::Store<tandem::FileStore>);
static_assert(tandem::Store<tandem::TcpStore>);
static_assert(tandem::Store<tandem::C10dStore>);
static_assert(std::same_as<decltype(tandem::parse_init_method("env://")), tandem::InitMethod>);
static_assert(tandem::Communicator<tandem::LocalComm>);
static_assert(std::is_class_v<tandem::LocalCommOptions>);
static_assert(std::is_class_v<tandem::Parameters<float>>);
#if TANDEM_TEST_GLOO
static_assert(tandem::Communicator<tandem::GlooComm>);
#endif
#if TANDEM_TEST_MPI
static_assert(tandem::Communicator<tandem::MpiComm>);
#endif
#if TANDEM_TEST_NCCL && defined(__CUDACC__)
static_assert(tandem::Communicator<tandem::NcclComm>);
#if TANDEM_TEST_MPI
static_assert(std::same_as<decltype(tandem::nccl_from_mpi(MPI_COMM_WORLD)), tandem::NcclComm>);
#endif
#endif

int main() {
  return 0;
}
