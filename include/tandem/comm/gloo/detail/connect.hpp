// tandem/comm/gloo/detail/connect.hpp - how a GlooComm's rank joins a new group: the TCP device
// (the interface or host to listen on), the connection of every rank to every other through the
// store, and where each peer runs (for naming a rank whose process is gone).
//   auto device = make_device(world, options);
//   Connected connected = connect(store, "gloo/1", rank, size, device, options.timeout);
// Needs: Gloo with its TCP transport (libgloo-dev) and POSIX. Not a public header: gloo.hpp uses
// it through detail/engine.hpp.
#pragma once

#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include "tandem/comm/gloo/detail/gloo_support.hpp"
#include "tandem/comm/gloo/options.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/timeout.hpp"
#include "tandem/core/world.hpp"
#include "tandem/rendezvous/store.hpp"

namespace tandem::detail::gloo_comm {

/// A peer that dies makes writes to its socket raise SIGPIPE, which would kill this process
/// instead of failing the collective: where SIGPIPE has its default action it is set to ignored
/// (as PyTorch's gloo backend does), so the write fails with an error. A handler the program
/// installed is left alone.
inline void ignore_default_sigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL &&
      !(current.sa_flags & SA_SIGINFO)) {
    ::signal(SIGPIPE, SIG_IGN);
  }
}

/// gloo's "[path/file.cc:123] message" without the source location.
inline std::string gloo_message(const std::string& what) {
  if (!what.empty() && what.front() == '[') {
    if (const auto end = what.find("] "); end != std::string::npos) return what.substr(end + 2);
  }
  return what;
}

/// The transport device: see GlooCommOptions::interface for the order of choices.
inline std::shared_ptr<::gloo::transport::Device> make_device(const World& world,
                                                              const GlooCommOptions& options) {
  ::gloo::transport::tcp::attr attr;
  if (!options.interface.empty()) {
    attr.iface = options.interface;
  } else if (!options.hostname.empty()) {
    attr.hostname = options.hostname;
  } else if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME"); iface && *iface) {
    attr.iface = iface;
  } else if (world.nnodes <= 1) {
    attr.hostname = "127.0.0.1";
  } else {
    attr.hostname = this_host();
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (::getaddrinfo(attr.hostname.c_str(), nullptr, &hints, &found) != 0) {
      throw Error(world.rank, "GlooComm",
                  "this host's name '" + attr.hostname +
                      "' does not resolve to an address; set GlooCommOptions::interface or "
                      "GLOO_SOCKET_IFNAME");
    }
    ::freeaddrinfo(found);
  }
  try {
    return ::gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    const std::string where =
        attr.iface.empty() ? "host '" + attr.hostname + "'" : "interface '" + attr.iface + "'";
    throw Error(world.rank, "GlooComm",
                "cannot listen on " + where + ": " + gloo_message(e.what()));
  }
}

/// What one rendezvous produced: a connected gloo context and where its peers run.
struct Connected {
  std::shared_ptr<::gloo::Context> context;
  std::vector<Peer> peers;
};

/// Every member of one new context calls this with the same `prefix` (unique to that context in
/// `store`); it returns once all `size` ranks are connected to each other.
inline Connected connect(AnyStore& store, const std::string& prefix, int rank, int size,
                         const std::shared_ptr<::gloo::transport::Device>& device,
                         Timeout timeout) {
  AnyStore scoped(PrefixStore<AnyStore>(prefix, store));
  scoped.set("peer/" + std::to_string(rank), describe_self());
  auto context = std::make_shared<::gloo::rendezvous::Context>(rank, size);
  context->setTimeout(timeout);
  StoreAdapter adapter(scoped, timeout);
  auto dev = device;
  try {
    context->connectFullMesh(adapter, dev);
  } catch (const Error& e) {
    throw Error(rank, "GlooComm rendezvous", e.what());
  } catch (const std::exception& e) {
    throw Error(rank, "GlooComm rendezvous",
                "connecting " + std::to_string(size) + " ranks failed: " + gloo_message(e.what()));
  }
  Connected connected{context, {}};
  for (int r = 0; r < size; ++r) {
    connected.peers.push_back(parse_peer(scoped.get("peer/" + std::to_string(r), timeout)));
  }
  return connected;
}

}  // namespace tandem::detail::gloo_comm
