// C10dStore against a real torch.distributed.TCPStore server started by Python
// (c10d_server.py): every operation tandem uses, binary values both ways, timeouts, a server that
// goes away, and init_process_group through it as under torchrun. Skipped (exit 77) when no
// Python with torch is at hand.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "support/fake_env.hpp"
#include "support/free_port.hpp"
#include "tandem/comm/init.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/rendezvous/c10d_store.hpp"

using namespace std::chrono_literals;
using tandem::C10dProtocol;
using tandem::C10dStore;

namespace {

/// c10d_server.py, running: its port, its torch version, and the pipes that keep it alive.
class PythonStore {
 public:
  PythonStore() {
    int out[2];
    int in[2];
    if (::pipe(out) != 0 || ::pipe(in) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      ::close(in[1]);
      ::close(out[0]);
      ::execl(TANDEM_TORCH_PYTHON, TANDEM_TORCH_PYTHON, TANDEM_C10D_SERVER, nullptr);
      std::_Exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    stdin_ = in[1];
    stdout_ = out[0];
    line_ = read_line(std::chrono::seconds(120));
    unsigned port = 0;
    char version[64] = {};
    if (std::sscanf(line_.c_str(), "torch %63s port %u", version, &port) == 2) {
      version_ = version;
      port_ = static_cast<std::uint16_t>(port);
    }
  }
  PythonStore(const PythonStore&) = delete;
  PythonStore& operator=(const PythonStore&) = delete;
  ~PythonStore() { stop(); }

  /// Ends the server: closes its stdin and, if it lingers, kills it.
  void stop(bool kill = false) {
    if (pid_ <= 0) return;
    if (kill) ::kill(pid_, SIGKILL);
    if (stdin_ >= 0) ::close(stdin_);
    stdin_ = -1;
    for (int i = 0; i < 500; ++i) {
      if (::waitpid(pid_, &status_, WNOHANG) == pid_) break;
      std::this_thread::sleep_for(10ms);
      if (i == 499) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status_, 0);
      }
    }
    if (stdout_ >= 0) ::close(stdout_);
    stdout_ = -1;
    pid_ = -1;
  }

  [[nodiscard]] bool running() const { return port_ != 0; }
  [[nodiscard]] std::uint16_t port() const { return port_; }
  [[nodiscard]] const std::string& version() const { return version_; }
  [[nodiscard]] const std::string& first_line() const { return line_; }
  /// The protocol this torch's server speaks: validated from 2.2 on.
  [[nodiscard]] C10dProtocol expected_protocol() const {
    int major = 0;
    int minor = 0;
    std::sscanf(version_.c_str(), "%d.%d", &major, &minor);
    return major > 2 || (major == 2 && minor >= 2) ? C10dProtocol::validated : C10dProtocol::legacy;
  }

 private:
  std::string read_line(std::chrono::seconds limit) {
    std::string line;
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd entry{stdout_, POLLIN, 0};
      if (::poll(&entry, 1, 100) <= 0) continue;
      char c = 0;
      if (::read(stdout_, &c, 1) != 1) break;
      if (c == '\n') break;
      line += c;
    }
    return line;
  }

  pid_t pid_ = -1;
  int stdin_ = -1;
  int stdout_ = -1;
  int status_ = 0;
  std::uint16_t port_ = 0;
  std::string version_;
  std::string line_;
};

PythonStore* server = nullptr;  // the one the test cases share (set up in main)

C10dStore connect(C10dProtocol protocol = C10dProtocol::automatic, tandem::Timeout timeout = 10s) {
  return C10dStore(
      {.host = "127.0.0.1", .port = server->port(), .timeout = timeout, .protocol = protocol});
}

std::string bytes(std::initializer_list<int> values) {
  std::string out;
  for (int v : values) out.push_back(static_cast<char>(v));
  return out;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

TEST_CASE("C10dStore finds the protocol of the torch that serves it") {
  MESSAGE("torch " << server->version() << " serves the store");
  auto store = connect();
  CHECK(store.protocol() == server->expected_protocol());
  // Naming it gives the same store.
  auto named = connect(server->expected_protocol());
  named.set("named/key", "v");
  CHECK(store.get("named/key") == "v");
}

TEST_CASE("values with any bytes go both ways between tandem and Python's TCPStore client") {
  auto store = connect();
  CHECK(store.get("py/bytes") == bytes({0x00, 0xff, 'p', 'y', 0x00}));
  store.set("cpp/bytes", bytes({0x00, 0x01, 'c', 'p', 'p', 0xff, 0x00}));
  store.set("cpp/done", "1");
  CHECK(store.get("py/verified", 30s) == "yes");

  std::string all(256, '\0');
  for (int i = 0; i < 256; ++i) all[static_cast<std::size_t>(i)] = static_cast<char>(i);
  store.set("binary/all", all);
  store.set("binary/empty", "");
  CHECK(store.get("binary/all") == all);
  CHECK(store.get("binary/empty").empty());
  store.set("binary/all", "replaced");
  CHECK(store.get("binary/all") == "replaced");
  const std::string big(1 << 20, 'x');
  store.set("binary/big", big);
  CHECK(store.get("binary/big") == big);
}

TEST_CASE("add, compare_set, check, delete_key and num_keys behave as torch's") {
  auto store = connect();
  CHECK(store.add("counter/a", 5) == 5);
  CHECK(store.add("counter/a", -2) == 3);
  CHECK(store.get("counter/a") == "3");

  // compare_set: the four cases of the Store concept, as the server does them.
  CHECK(store.compare_set("cas/new", "", "first") == "first");
  CHECK(store.get("cas/new") == "first");
  CHECK(store.compare_set("cas/missing", "expected", "x") == "expected");
  CHECK_FALSE(store.check(std::vector<std::string>{"cas/missing"}));
  CHECK(store.compare_set("cas/new", "first", "second") == "second");
  CHECK(store.compare_set("cas/new", "wrong", "third") == "second");

  CHECK(store.check(std::vector<std::string>{"cas/new", "counter/a"}));
  CHECK_FALSE(store.check(std::vector<std::string>{"cas/new", "nobody/set/this"}));

  const auto before = store.num_keys();
  store.set("delete/me", "x");
  CHECK(store.num_keys() == before + 1);
  CHECK(store.delete_key("delete/me"));
  CHECK_FALSE(store.delete_key("delete/me"));
  CHECK(store.num_keys() == before);
  CHECK_FALSE(store.check(std::vector<std::string>{"delete/me"}));
}

TEST_CASE("wait and get time out with an Error naming the keys, and the store goes on working") {
  auto store = connect();
  const auto start = std::chrono::steady_clock::now();
  try {
    (void)store.get("timeout/never", 300ms);
    FAIL("get returned a key nobody set");
  } catch (const tandem::Error& e) {
    CHECK(std::string(e.what()).find("'timeout/never'") != std::string::npos);
  }
  const double waited = seconds_since(start);
  CHECK(waited >= 0.29);
  CHECK(waited < 5.0);

  store.set("timeout/present", "here");
  try {
    store.wait(std::vector<std::string>{"timeout/present", "timeout/absent"}, 200ms);
    FAIL("wait returned with a key missing");
  } catch (const tandem::Error& e) {
    const std::string what = e.what();
    CHECK(what.find("'timeout/absent'") != std::string::npos);
    CHECK(what.find("timeout/present") == std::string::npos);  // only the missing one
  }
  // The connection was dropped to cancel the wait; the next call opens a new one.
  CHECK(store.get("timeout/present") == "here");
}

TEST_CASE("wait returns as soon as another client sets the key") {
  auto waiter = connect();
  auto setter = connect();
  std::thread late([&] {
    std::this_thread::sleep_for(200ms);
    setter.set("late/key", "now");
  });
  const auto start = std::chrono::steady_clock::now();
  waiter.wait(std::vector<std::string>{"late/key"}, 20s);
  late.join();
  CHECK(seconds_since(start) < 10.0);
  CHECK(waiter.get("late/key") == "now");
}

TEST_CASE("add on a value that is not an integer, and oversize keys, are Errors") {
  auto store = connect();
  store.set("text/value", "not a number");
  CHECK_THROWS_AS((void)store.add("text/value", 1), tandem::Error);
  CHECK(store.get("text/value") == "not a number");  // reconnected, nothing changed
  CHECK_THROWS_AS(store.set(std::string(9000, 'k'), "v"), tandem::Error);
  CHECK_THROWS_AS(store.set("big/value", std::string((8 << 20) + 1, 'v')), tandem::Error);
}

TEST_CASE("a server that is not there, or goes away, is an Error within the timeout") {
  const auto nobody = tandem::test::free_port();
  auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(C10dStore({.host = "127.0.0.1", .port = nobody, .timeout = 500ms}),
                  tandem::Error);
  CHECK(seconds_since(start) < 5.0);

  PythonStore doomed;
  REQUIRE(doomed.running());
  C10dStore store({.host = "127.0.0.1", .port = doomed.port(), .timeout = 2s});
  store.set("alive", "1");
  doomed.stop(/*kill=*/true);
  start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS((void)store.get("never", 1s), tandem::Error);
  CHECK_THROWS_AS(store.set("after", "x"), tandem::Error);
  CHECK(seconds_since(start) < 10.0);
}

TEST_CASE("init_process_group under torchrun's variables meets in the agent's store") {
  // What torchrun gives each worker when its agent hosts the store (static rendezvous).
  auto env_of = [](int rank, int restart) {
    return tandem::test::FakeEnv{{"RANK", std::to_string(rank)},
                                 {"WORLD_SIZE", "2"},
                                 {"LOCAL_RANK", std::to_string(rank)},
                                 {"LOCAL_WORLD_SIZE", "2"},
                                 {"MASTER_ADDR", "127.0.0.1"},
                                 {"MASTER_PORT", std::to_string(server->port())},
                                 {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                 {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart)}};
  };
  for (int restart : {0, 1}) {  // a restart meets again, in keys of its own
    std::vector<float> seen(2, -1.0f);
    std::vector<std::string> errors(2);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.emplace_back([&, r] {
        try {
          const auto env = env_of(r, restart);
          auto comm = tandem::init_process_group<tandem::LocalComm>("env://", {.timeout = 30s},
                                                                    env.lookup());
          std::vector<float> value{static_cast<float>(comm.rank() + 1)};
          comm.all_reduce(value, tandem::ReduceOp::sum);
          seen[static_cast<std::size_t>(r)] = value[0];
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
        }
      });
    }
    for (auto& t : ranks) t.join();
    CAPTURE(restart);
    CHECK(errors[0] == "");
    CHECK(errors[1] == "");
    CHECK(seen[0] == 3.0f);
    CHECK(seen[1] == 3.0f);
  }
  // tandem's keys sit under its own prefix, apart from torchrun's.
  auto store = connect();
  CHECK(store.get("tandem/attempt_0/tandem/init/world_size") == "2");
  CHECK(store.get("tandem/attempt_1/tandem/init/world_size") == "2");
}

int main(int argc, char** argv) {
  if (std::string(TANDEM_TORCH_PYTHON).empty()) {
    std::printf("skipped: no Python with torch was found when CMake ran\n");
    return 77;
  }
  PythonStore shared;
  if (!shared.running()) {
    std::printf("skipped: %s could not host a TCPStore (%s)\n", TANDEM_TORCH_PYTHON,
                shared.first_line().c_str());
    return shared.first_line().starts_with("skip:") ? 77 : 1;
  }
  server = &shared;
  doctest::Context context(argc, argv);
  const int failed = context.run();
  server = nullptr;
  return failed;
}
