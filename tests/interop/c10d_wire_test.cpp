// C10dStore's bytes in the PyTorch 2.2+ ("validated") layout, against a stand-in server written
// from PyTorch's TCPStoreBackend.cpp / TCPStoreLibUvBackend.cpp: every connection must open with
// VALIDATE and the magic number (else it is closed, as the classic 2.x server does), then set 1,
// compare_set 2, get 3, add 4, check 5, wait 6, num_keys 7, delete_key 8. This pins the encoding
// and the reconnect-and-validate path where no PyTorch 2.x is installed; it is no substitute
// for a real 2.x server (interop_c10d_store runs against whatever torch is here).
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tandem/rendezvous/c10d_store.hpp"

using namespace std::chrono_literals;

namespace {

/// A validated-layout TCPStore server: a thread per connection, one map, waits that poll it.
class StandIn {
 public:
  StandIn() {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    ::listen(listener_, 16);
    socklen_t len = sizeof addr;
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    acceptor_ = std::thread([this] {
      for (;;) {
        const int fd = ::accept(listener_, nullptr, nullptr);
        if (fd < 0 || stopping_) {
          if (fd >= 0) ::close(fd);
          return;
        }
        std::lock_guard lock(mutex_);
        fds_.push_back(fd);
        workers_.emplace_back([this, fd] { serve(fd); });
      }
    });
  }
  ~StandIn() {
    {
      std::lock_guard lock(mutex_);  // a waiter sees the flag or gets the notification
      stopping_ = true;
    }
    ::shutdown(listener_, SHUT_RDWR);
    ::close(listener_);
    acceptor_.join();
    {
      std::lock_guard lock(mutex_);
      for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    }
    changed_.notify_all();
    for (auto& t : workers_) t.join();
    for (int fd : fds_) ::close(fd);
  }

  [[nodiscard]] std::uint16_t port() const { return port_; }
  [[nodiscard]] int validations() const { return validations_; }
  [[nodiscard]] int refused() const { return refused_; }
  [[nodiscard]] std::string raw(const std::string& key) {
    std::lock_guard lock(mutex_);
    return map_.at(key);
  }

 private:
  static bool read(int fd, void* data, std::size_t size) {
    auto* bytes = static_cast<char*>(data);
    while (size > 0) {
      const ssize_t n = ::recv(fd, bytes, size, 0);
      if (n <= 0) return false;
      bytes += n;
      size -= static_cast<std::size_t>(n);
    }
    return true;
  }
  static void write(int fd, const std::string& bytes) {
    ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  }
  static bool u64(int fd, std::uint64_t& value) { return read(fd, &value, 8); }
  static bool string(int fd, std::string& out) {
    std::uint64_t size = 0;
    if (!u64(fd, size) || size > (1u << 24)) return false;
    out.resize(size);
    return size == 0 || read(fd, out.data(), size);
  }
  static std::string value_reply(const std::string& value) {
    std::string out(8, '\0');
    std::uint64_t size = value.size();
    std::memcpy(out.data(), &size, 8);
    return out + value;
  }
  static std::string i64_reply(std::int64_t value) {
    return std::string(reinterpret_cast<char*>(&value), 8);
  }

  void serve(int fd) {
    std::uint8_t op = 0;
    std::uint32_t magic = 0;
    if (!read(fd, &op, 1) || op != 0 || !read(fd, &magic, 4) || magic != 0x3C85F7CEu) {
      ++refused_;
      ::shutdown(fd, SHUT_RDWR);
      return;
    }
    ++validations_;
    while (!stopping_ && read(fd, &op, 1)) {
      std::string key;
      std::string a;
      std::string b;
      std::unique_lock lock(mutex_);
      switch (op) {
        case 1:  // set
          lock.unlock();
          if (!string(fd, key) || !string(fd, a)) return;
          lock.lock();
          map_[key] = a;
          changed_.notify_all();
          break;
        case 2:  // compare_set
          lock.unlock();
          if (!string(fd, key) || !string(fd, a) || !string(fd, b)) return;
          lock.lock();
          if (!map_.contains(key)) {
            if (a.empty()) map_[key] = b;
            write(fd, value_reply(a.empty() ? b : a));
          } else {
            if (map_[key] == a) map_[key] = b;
            write(fd, value_reply(map_[key]));
          }
          changed_.notify_all();
          break;
        case 3:  // get
          lock.unlock();
          if (!string(fd, key)) return;
          lock.lock();
          write(fd, value_reply(map_[key]));
          break;
        case 4: {  // add
          lock.unlock();
          std::uint64_t delta = 0;
          if (!string(fd, key) || !u64(fd, delta)) return;
          lock.lock();
          const std::int64_t value =
              (map_.contains(key) ? std::stoll(map_[key]) : 0) + static_cast<std::int64_t>(delta);
          map_[key] = std::to_string(value);
          write(fd, i64_reply(value));
          changed_.notify_all();
          break;
        }
        case 5:    // check
        case 6: {  // wait: answers once every key exists (no timeout of its own)
          lock.unlock();
          std::uint64_t count = 0;
          if (!u64(fd, count)) return;
          std::vector<std::string> keys(count);
          for (auto& k : keys) {
            if (!string(fd, k)) return;
          }
          lock.lock();
          auto all = [&] {
            for (const auto& k : keys) {
              if (!map_.contains(k)) return false;
            }
            return true;
          };
          if (op == 5) {
            write(fd, std::string(1, all() ? '\0' : '\1'));
          } else {
            changed_.wait(lock, [&] { return stopping_ || all(); });
            if (!stopping_) write(fd, std::string(1, '\0'));
          }
          break;
        }
        case 7:  // num_keys
          write(fd, i64_reply(static_cast<std::int64_t>(map_.size())));
          break;
        case 8:  // delete_key
          lock.unlock();
          if (!string(fd, key)) return;
          lock.lock();
          write(fd, i64_reply(static_cast<std::int64_t>(map_.erase(key))));
          break;
        default:
          ::shutdown(fd, SHUT_RDWR);
          return;
      }
    }
  }

  int listener_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> validations_{0};
  std::atomic<int> refused_{0};
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::string> map_;
  std::vector<int> fds_;
  std::vector<std::thread> workers_;
  std::thread acceptor_;
};

}  // namespace

TEST_CASE("C10dStore speaks the validated (PyTorch 2.2+) layout to a server that expects it") {
  StandIn server;
  tandem::C10dStore store({.host = "127.0.0.1", .port = server.port(), .timeout = 10s});
  CHECK(store.protocol() == tandem::C10dProtocol::validated);
  CHECK(store.num_keys() == 0);  // a round trip: the server has read everything before it
  // The probe's connection validated first, then the store's own.
  CHECK(server.validations() == 2);
  CHECK(server.refused() == 0);

  store.set("k", std::string("a\0b", 3));
  CHECK(store.get("k") == std::string("a\0b", 3));
  CHECK(server.raw("/k") == std::string("a\0b", 3));  // "/" in front, as PyTorch's client puts it
  CHECK(store.add("n", 4) == 4);
  CHECK(store.add("n", -1) == 3);
  CHECK(store.compare_set("c", "", "x") == "x");
  CHECK(store.compare_set("c", "y", "z") == "x");
  CHECK(store.check(std::vector<std::string>{"k", "n", "c"}));
  CHECK_FALSE(store.check(std::vector<std::string>{"k", "none"}));
  CHECK(store.num_keys() == 3);
  CHECK(store.delete_key("c"));
  CHECK_FALSE(store.delete_key("c"));

  // A wait that times out drops its connection; the store validates a new one (here at once,
  // to find which keys are missing).
  const int before = server.validations();
  CHECK_THROWS_AS(store.wait(std::vector<std::string>{"late"}, 200ms), tandem::Error);
  CHECK(server.validations() == before + 1);
  store.set("late", "1");
  store.wait(std::vector<std::string>{"late"}, 5s);
  CHECK(store.get("late") == "1");
  CHECK(server.refused() == 0);
}

TEST_CASE("forcing the legacy layout on a validated server fails with an Error, not a hang") {
  StandIn server;
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(tandem::C10dStore({.host = "127.0.0.1",
                                     .port = server.port(),
                                     .timeout = 3s,
                                     .protocol = tandem::C10dProtocol::legacy}),
                  tandem::Error);
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  CHECK(server.refused() == 1);
}
