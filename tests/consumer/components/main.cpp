// Built against the installed tandem::gloo and tandem::mpi components: a one-rank Gloo group
// averages a vector; the MPI communicator type is only compiled and linked (running MPI needs a
// launcher, which the backend's own tests provide).
#include <tandem/comm/gloo/gloo.hpp>
#include <tandem/comm/mpi/mpi.hpp>
#include <tandem/tandem.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

static_assert(tandem::Communicator<tandem::MpiComm>);

/// A port on 127.0.0.1 that was free a moment ago.
static int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof addr;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length);
  ::close(fd);
  return ntohs(addr.sin_port);
}

int main() {
  const std::string url = "tcp://127.0.0.1:" + std::to_string(free_port()) + "?rank=0&world_size=1";
  auto comm = tandem::init_process_group<tandem::GlooComm>(url);
  std::vector<float> values(10, 3.0f);
  comm.all_reduce(values, tandem::ReduceOp::avg);
  const bool ok = comm.size() == 1 && values[9] == 3.0f;
  std::printf("consumer (gloo, mpi components): %s\n", ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
