// TcpStore: ports, unreachable servers, hostile and vanishing clients, and several processes.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "store_test_support.hpp"
#include "support/error_of.hpp"
#include "tandem/rendezvous/detail/socket.hpp"
#include "tandem/rendezvous/tcp_store.hpp"

using namespace std::chrono_literals;
using namespace tandem::test;
using tandem::TcpStore;

namespace {

void raw_send(int fd, const std::string& bytes) {
  REQUIRE(
      tandem::detail::send_all(fd, bytes.data(), bytes.size(), tandem::Deadline(generous)).ok());
}

std::string frame(const std::string& body) {
  std::string out;
  tandem::detail::append_u32(out, static_cast<std::uint32_t>(body.size()));
  return out + body;
}

/// The hello frame that opens every connection.
std::string hello(const std::string& token = "") {
  std::string body(1, '\x09');
  tandem::detail::append_u32(body, tandem::detail::tcp_store::magic);
  tandem::detail::tcp_store::put_string(body, token);
  return frame(body);
}

/// One reply body, read whole.
std::string read_reply(int fd) {
  const tandem::Deadline deadline(generous);
  char header[4];
  REQUIRE(tandem::detail::recv_all(fd, header, 4, deadline).ok());
  std::string reply(tandem::detail::load_u32(header), '\0');
  REQUIRE(reply.size() < 1u << 20);
  REQUIRE(tandem::detail::recv_all(fd, reply.data(), reply.size(), deadline).ok());
  return reply;
}

/// A plain blocking socket connected to the server at `address`, for sending it whatever we
/// like; with `say_hello`, the hello (and its reply) are done.
tandem::detail::Fd raw_connect(std::uint16_t port, bool say_hello = true,
                               const char* address = "127.0.0.1", int receive_buffer = 0) {
  tandem::detail::Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  REQUIRE(fd.valid());
  if (receive_buffer > 0) {  // fixed, not grown by the kernel's autotuning
    REQUIRE(::setsockopt(fd.get(), SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof receive_buffer) ==
            0);
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  REQUIRE(::inet_pton(AF_INET, address, &addr.sin_addr) == 1);
  REQUIRE(::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0);
  if (say_hello) {
    raw_send(fd.get(), hello());
    REQUIRE(read_reply(fd.get()).front() == 0);
  }
  return fd;
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
    tandem::detail::append_u32(body, 1000);
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
  auto fd = raw_connect(server.port(), false);
  std::string get(1, '\x02');
  tandem::detail::tcp_store::put_string(get, "later");
  tandem::detail::append_u64(get, 60'000);
  std::string count(1, '\x08');
  raw_send(fd.get(), hello() + frame(get) + frame(count));
  CHECK(read_reply(fd.get()).front() == 0);  // the hello's
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
  const auto pids = tandem::test::fork_children(children, [&](int i) {
    TcpStore client({.port = port, .timeout = generous});
    int status = client.add("arrived", 1) < 1 ? 2 : 0;
    client.set("child" + std::to_string(i), "pid " + std::to_string(::getpid()));
    if (client.get("release") != "go") status = 3;
    return status;
  });
  std::vector<std::string> keys;
  for (int i = 0; i < children; ++i) keys.push_back("child" + std::to_string(i));
  server.wait(keys);
  CHECK(server.get("arrived") == std::to_string(children));
  server.set("release", "go");
  for (const int code : tandem::test::wait_children(pids)) CHECK(code == 0);
  CHECK(server.num_keys() == children + 2);
}

namespace {

/// A set request body.
std::string set_body(const std::string& key, const std::string& value) {
  std::string body(1, '\x01');
  tandem::detail::tcp_store::put_string(body, key);
  tandem::detail::tcp_store::put_string(body, value);
  return body;
}

/// Sets (or, with nullptr, unsets) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

/// What this process writes to stderr while `fn` runs.
std::string capture_stderr(const std::function<void()>& fn) {
  TempDir dir;
  const auto path = dir.path() / "stderr";
  std::fflush(stderr);
  const int saved = ::dup(STDERR_FILENO);
  const int file = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  REQUIRE(file >= 0);
  ::dup2(file, STDERR_FILENO);
  ::close(file);
  try {
    fn();
  } catch (...) {
    std::fflush(stderr);
    ::dup2(saved, STDERR_FILENO);
    ::close(saved);
    throw;
  }
  std::fflush(stderr);
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

TEST_CASE("the job token: the right one is served, others are refused before any key") {
  ScopedEnv no_env_token("TANDEM_STORE_TOKEN", nullptr);
  TcpStore server({.port = 0, .is_server = true, .timeout = generous, .token = "s3cret"});
  TcpStore good({.port = server.port(), .timeout = generous, .token = "s3cret"});
  good.set("k", "v");
  CHECK(good.get("k") == "v");
  const std::vector<std::string> intruder{"intruder"};

  SUBCASE("a client without a token") {
    const auto message =
        error_of([&] { TcpStore client({.port = server.port(), .timeout = generous}); });
    CHECK(contains(message, "refused this client's token (this client has none)"));
    CHECK(contains(message, "127.0.0.1:" + std::to_string(server.port())));
  }
  SUBCASE("a client with another token") {
    const auto message = error_of(
        [&] { TcpStore client({.port = server.port(), .timeout = generous, .token = "guess"}); });
    CHECK(contains(message, "refused this client's token (this client's differs)"));
    CHECK_FALSE(contains(message, "s3cret"));
  }
  SUBCASE("a prefix of the token") {
    const auto message = error_of(
        [&] { TcpStore client({.port = server.port(), .timeout = generous, .token = "s3cre"}); });
    CHECK(contains(message, "refused this client's token"));
  }
  SUBCASE("a wrong token with a set right behind it: closed, nothing written") {
    auto fd = raw_connect(server.port(), false);
    raw_send(fd.get(), hello("guess") + frame(set_body("intruder", "x")));
    const auto reply = read_reply(fd.get());
    CHECK(reply.front() == 3);  // closing
    CHECK(closed_by_server(fd.get()));
  }
  SUBCASE("a set with no hello at all: closed, nothing written") {
    auto fd = raw_connect(server.port(), false);
    raw_send(fd.get(), frame(set_body("intruder", "x")));
    CHECK(closed_by_server(fd.get()));
  }
  SUBCASE("the token from TANDEM_STORE_TOKEN") {
    ScopedEnv token("TANDEM_STORE_TOKEN", "s3cret");
    TcpStore client({.port = server.port(), .timeout = generous});
    CHECK(client.get("k") == "v");
  }
  CHECK_FALSE(good.check(intruder));
  CHECK(good.num_keys() == 1);
}

TEST_CASE("a server without a token takes clients with or without one") {
  ScopedEnv no_env_token("TANDEM_STORE_TOKEN", nullptr);
  TcpStore server({.port = 0, .is_server = true, .timeout = generous});
  TcpStore with({.port = server.port(), .timeout = generous, .token = "anything"});
  with.set("k", "v");
  CHECK(server.get("k") == "v");
  CHECK(contains(
      error_of([&] { TcpStore({.port = server.port(), .token = std::string(2000, 't')}); }),
      "at most 1024"));
}

TEST_CASE("limits: oversize keys, values, counts and frames are refused; memory is bounded") {
  tandem::TcpStoreLimits limits;
  limits.max_key_bytes = 64;
  limits.max_value_bytes = 1000;
  limits.max_keys_per_request = 8;
  limits.max_store_bytes = 4096;
  TcpStore server({.port = 0,
                   .is_server = true,
                   .timeout = generous,
                   .max_message_bytes = 8192,
                   .limits = limits});
  TcpStore client({.port = server.port(), .timeout = generous});

  SUBCASE("a key over max_key_bytes") {
    const auto message = error_of([&] { client.set(std::string(65, 'k'), "v"); });
    CHECK(contains(message, "TcpStore.set"));
    CHECK(contains(message, "a key of 65 bytes exceeds the store's limit of 64 bytes"));
    CHECK(contains(error_of([&] { (void)client.get(std::string(100, 'k'), 10ms); }),
                   "a key of 100 bytes"));
  }
  SUBCASE("a value over max_value_bytes") {
    const auto message = error_of([&] { client.set("k", std::string(1001, 'v')); });
    CHECK(contains(message, "a value of 1001 bytes exceeds the store's limit of 1000 bytes"));
    CHECK(contains(error_of([&] { client.compare_set("k", "", std::string(1001, 'v')); }),
                   "a value of 1001 bytes"));
  }
  SUBCASE("a wait or check naming more keys than max_keys_per_request") {
    const std::vector<std::string> keys(9, "k");
    CHECK(contains(error_of([&] { client.wait(keys, 10ms); }),
                   "9 keys in one request exceed the store's limit of 8"));
    CHECK(contains(error_of([&] { (void)client.check(keys); }), "9 keys"));
    // A raw count of 2^32-1: refused from the count alone, nothing allocated for it.
    auto fd = raw_connect(server.port());
    std::string body(1, '\x05');
    tandem::detail::append_u32(body, 0xffffffffu);
    raw_send(fd.get(), frame(body));
    const auto reply = read_reply(fd.get());
    CHECK(reply.front() == 2);  // error; the connection goes on
    CHECK(contains(reply, "4294967295 keys"));
  }
  SUBCASE("a frame over max_message_bytes gets a closing reply and is closed") {
    auto fd = raw_connect(server.port());
    raw_send(fd.get(), std::string("\xff\xff\xff\xff", 4));
    const auto reply = read_reply(fd.get());
    CHECK(reply.front() == 3);
    CHECK(contains(reply, "4294967295 bytes is outside the store's limit of 1 to 8192 bytes"));
    CHECK(closed_by_server(fd.get()));
  }
  SUBCASE("before its hello a connection may send a few KiB only") {
    auto fd = raw_connect(server.port(), false);
    raw_send(fd.get(), std::string("\x00\x10\x00\x00", 4));  // 4 KiB: beyond a hello
    CHECK(read_reply(fd.get()).front() == 3);
    CHECK(closed_by_server(fd.get()));
  }
  SUBCASE("new keys stop at max_store_bytes; replacing and deleting still work") {
    int stored = 0;
    std::string message;
    for (; stored < 1000; ++stored) {
      message =
          error_of([&] { client.set("key" + std::to_string(stored), std::string(100, 'v')); });
      if (message != no_error) break;
    }
    CHECK(contains(message, "the store is full"));
    CHECK(contains(message, "4096 bytes"));
    CHECK(stored == 4096 / (4 + 100 + 64));  // key, value and 64 bytes a key
    CHECK(client.num_keys() == stored);
    client.set("key0", std::string(100, 'w'));  // the same size: fits
    CHECK(client.get("key0") == std::string(100, 'w'));
    CHECK(contains(error_of([&] { (void)client.add("counter", 1); }), "the store is full"));
    CHECK(client.delete_key("key1"));
    CHECK(client.add("counter", 1) == 1);
  }
  // The connection that was refused (error, not closing) goes on.
  client.set("after", "ok");
  CHECK(client.get("after") == "ok");
}

TEST_CASE("connections: at most max_connections") {
  tandem::TcpStoreLimits limits;
  limits.max_connections = 2;
  TcpStore server(
      {.port = 0, .is_server = true, .timeout = generous, .limits = limits});  // connection 1
  TcpStore client({.port = server.port(), .timeout = generous});               // connection 2
  SUBCASE("a third client is refused, saying why") {
    const auto message =
        error_of([&] { TcpStore third({.port = server.port(), .timeout = generous}); });
    CHECK(contains(message, "refused this client: the store has 2 connections open"));
  }
  SUBCASE("a third raw connection is closed at once") {
    auto third = raw_connect(server.port(), false);
    CHECK(closed_by_server(third.get()));
  }
  client.set("k", "v");
  CHECK(server.get("k") == "v");
}

TEST_CASE("silent connections: dropped after hello_timeout, the oldest first past the limit") {
  tandem::TcpStoreLimits limits;
  limits.max_unauthenticated = 2;
  limits.hello_timeout = 500ms;
  TcpStore server({.port = 0, .is_server = true, .timeout = generous, .limits = limits});
  const auto start = std::chrono::steady_clock::now();
  auto first = raw_connect(server.port(), false);
  std::this_thread::sleep_for(20ms);
  auto second = raw_connect(server.port(), false);
  std::this_thread::sleep_for(20ms);
  auto third = raw_connect(server.port(), false);
  CHECK(closed_by_server(first.get()));  // made room for the third
  const auto first_closed = std::chrono::steady_clock::now() - start;
  CHECK(closed_by_server(second.get()));  // its hello_timeout
  CHECK(std::chrono::steady_clock::now() - start >= 450ms);
  CHECK(first_closed < std::chrono::steady_clock::now() - start);
  TcpStore client({.port = server.port(), .timeout = generous});
  client.set("k", "v");
}

TEST_CASE("the server listens on its host's address only") {
  TcpStore server({.host = "127.0.0.1", .port = 0, .is_server = true, .timeout = generous});
  const auto port = server.port();
  CHECK(server.listen_address() == "127.0.0.1:" + std::to_string(port));
  TcpStore client({.port = port, .timeout = generous});
  CHECK(client.listen_address().empty());

  const auto reachable = [&](const char* address) {
    tandem::detail::Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    REQUIRE(::inet_pton(AF_INET, address, &addr.sin_addr) == 1);
    return ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0;
  };
  CHECK(reachable("127.0.0.1"));
  CHECK_FALSE(reachable("127.0.0.2"));  // loopback too, but not the address bound
  // Every other IPv4 address of this machine's interfaces, if it has any.
  ifaddrs* list = nullptr;
  REQUIRE(::getifaddrs(&list) == 0);
  int others = 0;
  for (const ifaddrs* entry = list; entry != nullptr; entry = entry->ifa_next) {
    if (entry->ifa_addr == nullptr || entry->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(entry->ifa_addr)->sin_addr, text,
                sizeof text);
    if (std::string(text) == "127.0.0.1") continue;
    CAPTURE(text);
    CHECK_FALSE(reachable(text));
    ++others;
  }
  ::freeifaddrs(list);
  MESSAGE("other local IPv4 addresses tried: " << others);
}

TEST_CASE("a client waiting for its server says so on stderr") {
  const auto port = unused_port();
  const auto said = capture_stderr([&] {
    CHECK_THROWS_AS(
        TcpStore({.port = port, .timeout = 2500ms, .client_name = "rank 7", .notice_interval = 1s}),
        tandem::Error);
  });
  CHECK(contains(said, "tandem: rank 7 waiting for the store at 127.0.0.1:" + std::to_string(port) +
                           " (1 s of 2 s)\n"));
  CHECK(contains(said, "(2 s of 2 s)\n"));

  // A hint about the server (open_store's: who hosts it) goes into the notice and the Error.
  std::string error;
  const auto hinted = capture_stderr([&] {
    try {
      TcpStore({.port = port,
                .timeout = 1500ms,
                .client_name = "rank 7",
                .notice_interval = 1s,
                .server_hint = "rank 0 hosts it"});
    } catch (const tandem::Error& e) {
      error = e.what();
    }
  });
  CHECK(contains(hinted, "tandem: rank 7 waiting for the store at 127.0.0.1:" +
                             std::to_string(port) + " (rank 0 hosts it) (1 s of 1 s)\n"));
  CHECK(contains(error, "(rank 0 hosts it)"));

  const auto quiet = capture_stderr([&] {
    CHECK_THROWS_AS(TcpStore({.port = port, .timeout = 300ms, .notice_interval = 0ms}),
                    tandem::Error);
  });
  CHECK(quiet.empty());
}

TEST_CASE("a client that does not read its replies is held back, not buffered without bound") {
  TcpStore server({.port = 0, .is_server = true, .timeout = generous, .max_message_bytes = 65536});
  server.set("big", std::string(32768, 'b'));
  auto fd = raw_connect(server.port(), true, "127.0.0.1", 65536);
  std::string get(1, '\x02');
  tandem::detail::tcp_store::put_string(get, "big");
  tandem::detail::append_u64(get, 0);
  std::string pipeline;
  for (int i = 0; i < 2000; ++i) pipeline += frame(get);  // 64 MB of replies, never read
  pipeline += frame(set_body("marker", "reached"));
  raw_send(fd.get(), pipeline);
  std::this_thread::sleep_for(300ms);
  // The server stopped taking its requests once about max_message_bytes of replies waited
  // (beyond what the sockets hold), so the set at the end of the pipeline has not run.
  const std::vector<std::string> marker{"marker"};
  CHECK_FALSE(server.check(marker));
  fd.reset();
  TcpStore other({.port = server.port(), .timeout = generous});
  CHECK(other.get("big").size() == 32768);
}
