// TcpStore: ports, unreachable servers, hostile and vanishing clients, and several processes.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "store_test_support.hpp"
#include "tandem/comm/detail/socket.hpp"
#include "tandem/comm/tcp_store.hpp"

using namespace std::chrono_literals;
using namespace tandem::test;
using tandem::TcpStore;

namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// A plain blocking socket connected to the server, for sending it whatever we like.
tandem::detail::Fd raw_connect(std::uint16_t port) {
  tandem::detail::Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  REQUIRE(fd.valid());
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0);
  return fd;
}

void raw_send(int fd, const std::string& bytes) {
  REQUIRE(
      tandem::detail::send_all(fd, bytes.data(), bytes.size(), tandem::Deadline(generous)).ok());
}

/// Whether the server closes the connection (EOF) within a generous time, reading past
/// anything it sends first.
bool closed_by_server(int fd) {
  const tandem::Deadline deadline(generous);
  char buffer[256];
  for (;;) {
    if (!tandem::detail::wait_ready(fd, POLLIN, deadline).ok()) return false;
    const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
    if (n == 0) return true;
    if (n < 0 && errno == ECONNRESET) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

std::string frame(const std::string& body) {
  std::string out;
  tandem::detail::append_u32(out, static_cast<std::uint32_t>(body.size()));
  return out + body;
}

std::uint16_t unused_port() {
  auto [fd, port] = tandem::detail::listen_tcp("127.0.0.1", 0, "test");
  return port;  // closed on return: nothing listens there now
}

}  // namespace

TEST_CASE("a server on port 0 reports the port it got and serves clients there") {
  TcpStore server({.port = 0, .is_server = true, .timeout = generous});
  CHECK(server.port() != 0);
  CHECK(server.is_server());
  TcpStore client({.port = server.port(), .timeout = generous});
  CHECK_FALSE(client.is_server());
  client.set("k", "v");
  CHECK(server.get("k") == "v");
}

TEST_CASE("a client with no server gives up within its timeout, naming host:port") {
  const auto port = unused_port();
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    TcpStore client({.port = port, .timeout = 300ms});
  } catch (const tandem::Error& error) {
    message = error.what();
  }
  const auto took = std::chrono::steady_clock::now() - start;
  CHECK(contains(message, "could not reach 127.0.0.1:" + std::to_string(port)));
  CHECK(contains(message, "300 ms"));
  CHECK(took >= 250ms);
  CHECK(took < 20s);
}

TEST_CASE("a client started before its server connects once the server is up") {
  const auto port = unused_port();
  std::thread late_server([port] {
    std::this_thread::sleep_for(100ms);
    TcpStore server({.port = port, .is_server = true, .timeout = generous});
    server.wait(std::vector<std::string>{"client-was-here"});
  });
  TcpStore client({.port = port, .timeout = generous});
  client.set("client-was-here", "yes");
  late_server.join();
}

TEST_CASE("hostile or vanishing clients lose their connection; others are served") {
  TcpStore server({.port = 0, .is_server = true, .timeout = generous, .max_message_bytes = 4096});
  TcpStore good({.port = server.port(), .timeout = generous});
  good.set("before", "1");

  SUBCASE("unknown opcode") {
    auto fd = raw_connect(server.port());
    raw_send(fd.get(), frame(std::string("\x63garbage", 8)));
    CHECK(closed_by_server(fd.get()));
  }
  SUBCASE("random bytes") {
    auto fd = raw_connect(server.port());
    raw_send(fd.get(), std::string("\x05\x00\x00\x00\xee\xff\x01\x02\x03", 9));
    CHECK(closed_by_server(fd.get()));
  }
  SUBCASE("a length beyond max_message_bytes") {
    auto fd = raw_connect(server.port());
    raw_send(fd.get(), std::string("\xff\xff\xff\xff", 4));
    CHECK(closed_by_server(fd.get()));
  }
  SUBCASE("a zero length") {
    auto fd = raw_connect(server.port());
    raw_send(fd.get(), std::string("\x00\x00\x00\x00", 4));
    CHECK(closed_by_server(fd.get()));
  }
  SUBCASE("a field longer than its frame") {
    std::string body(1, '\x01');  // set
    tandem::detail::append_u32(body, 1000);
    body += "short";
    auto fd = raw_connect(server.port());
    raw_send(fd.get(), frame(body));
    CHECK(closed_by_server(fd.get()));
  }
  SUBCASE("trailing bytes after the fields") {
    std::string body(1, '\x08');  // num_keys takes no fields
    body += "extra";
    auto fd = raw_connect(server.port());
    raw_send(fd.get(), frame(body));
    CHECK(closed_by_server(fd.get()));
  }
  SUBCASE("a wait whose key count the frame cannot hold") {
    std::string body(1, '\x05');
    tandem::detail::append_u32(body, 0xffffffffu);
    auto fd = raw_connect(server.port());
    raw_send(fd.get(), frame(body));
    CHECK(closed_by_server(fd.get()));
  }
  SUBCASE("disconnect in the middle of a frame") {
    auto fd = raw_connect(server.port());
    raw_send(fd.get(), std::string("\x64\x00\x00\x00\x01\x02\x03", 7));
    fd.reset();
  }
  SUBCASE("disconnect while a get waits, then the key is set") {
    std::string body(1, '\x02');  // get "pending" with a long timeout
    tandem::detail::tcp_store::put_string(body, "pending");
    tandem::detail::append_u64(body, 60'000);
    auto fd = raw_connect(server.port());
    raw_send(fd.get(), frame(body));
    std::this_thread::sleep_for(50ms);
    fd.reset();
    std::this_thread::sleep_for(50ms);
    good.set("pending", "now");
  }
  SUBCASE("a client that never reads its replies is dropped when it leaves") {
    auto fd = raw_connect(server.port());
    std::string body(1, '\x08');
    std::string many;
    for (int i = 0; i < 1000; ++i) many += frame(body);
    raw_send(fd.get(), many);
    fd.reset();
  }
  SUBCASE("a request over max_message_bytes is refused by the client itself") {
    CHECK_THROWS_AS(good.set("big", std::string(5000, 'x')), tandem::Error);
  }

  good.set("after", "2");
  CHECK(good.get("before") == "1");
  CHECK(good.get("after") == "2");
  CHECK(good.add("n", 1) == 1);
  TcpStore late({.port = server.port(), .timeout = generous});
  CHECK(late.get("after") == "2");
}

TEST_CASE("pipelined requests are answered in order, behind a waiting get") {
  TcpStore server({.port = 0, .is_server = true, .timeout = generous});
  auto fd = raw_connect(server.port());
  std::string get(1, '\x02');
  tandem::detail::tcp_store::put_string(get, "later");
  tandem::detail::append_u64(get, 60'000);
  std::string count(1, '\x08');
  raw_send(fd.get(), frame(get) + frame(count));
  std::this_thread::sleep_for(50ms);
  server.set("later", "value");

  const tandem::Deadline deadline(generous);
  char header[4];
  REQUIRE(tandem::detail::recv_all(fd.get(), header, 4, deadline).ok());
  std::string reply(tandem::detail::load_u32(header), '\0');
  REQUIRE(tandem::detail::recv_all(fd.get(), reply.data(), reply.size(), deadline).ok());
  tandem::detail::tcp_store::Reader first(reply);
  CHECK(first.u8() == 0);
  CHECK(first.string() == "value");
  CHECK(first.at_end());
  REQUIRE(tandem::detail::recv_all(fd.get(), header, 4, deadline).ok());
  reply.assign(tandem::detail::load_u32(header), '\0');
  REQUIRE(tandem::detail::recv_all(fd.get(), reply.data(), reply.size(), deadline).ok());
  tandem::detail::tcp_store::Reader second(reply);
  CHECK(second.u8() == 0);
  CHECK(second.u64() == 1);
}

TEST_CASE("a client whose server is gone gets an Error, not a hang") {
  auto server = std::make_unique<TcpStore>(
      tandem::TcpStoreOptions{.port = 0, .is_server = true, .timeout = generous});
  TcpStore client({.port = server->port(), .timeout = 500ms});
  client.set("k", "v");
  server.reset();
  CHECK_THROWS_AS(client.set("k", "w"), tandem::Error);
  CHECK_THROWS_AS((void)client.get("k"), tandem::Error);  // reconnecting fails in 500 ms
}

TEST_CASE("a blocked get is released when its server shuts down") {
  auto server = std::make_unique<TcpStore>(
      tandem::TcpStoreOptions{.port = 0, .is_server = true, .timeout = generous});
  TcpStore client({.port = server->port(), .timeout = generous});
  std::thread stopper([&] {
    std::this_thread::sleep_for(100ms);
    server.reset();
  });
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS((void)client.get("never", generous), tandem::Error);
  CHECK(std::chrono::steady_clock::now() - start < 30s);
  stopper.join();
}

TEST_CASE("forked processes share the parent's server") {
  TcpStore server({.port = 0, .is_server = true, .timeout = generous});
  const auto port = server.port();
  constexpr int children = 4;
  std::vector<pid_t> pids;
  for (int i = 0; i < children; ++i) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      // No doctest in here: report through the exit status only.
      int status = 0;
      try {
        TcpStore client({.port = port, .timeout = generous});
        if (client.add("arrived", 1) < 1) status = 2;
        client.set("child" + std::to_string(i), "pid " + std::to_string(::getpid()));
        if (client.get("release") != "go") status = 3;
      } catch (...) {
        status = 4;
      }
      ::_exit(status);
    }
    pids.push_back(pid);
  }
  std::vector<std::string> keys;
  for (int i = 0; i < children; ++i) keys.push_back("child" + std::to_string(i));
  server.wait(keys);
  CHECK(server.get("arrived") == std::to_string(children));
  server.set("release", "go");
  for (const pid_t pid : pids) {
    int status = -1;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
  CHECK(server.num_keys() == children + 2);
}
