// The Store contract, checked on every store type: HashStore, FileStore, TcpStore, each also
// behind PrefixStore and AnyStore.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "store_test_support.hpp"
#include "support/error_of.hpp"
#include "tandem/rendezvous/file_store.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/rendezvous/tcp_store.hpp"

using namespace std::chrono_literals;
using namespace tandem::test;
using tandem::Store;

#define STORE_FIXTURES                                                                        \
  HashFixture, PrefixOf<HashFixture>, AnyOf<HashFixture>, FileFixture, PrefixOf<FileFixture>, \
      AnyOf<FileFixture>, TcpFixture, PrefixOf<TcpFixture>, AnyOf<TcpFixture>

static_assert(Store<tandem::PrefixStore<tandem::FileStore>>);
static_assert(Store<tandem::PrefixStore<tandem::TcpStore>>);
static_assert(Store<tandem::PrefixStore<tandem::AnyStore>>);
static_assert(!Store<int>);

TEST_CASE_TEMPLATE("set and get round-trip any bytes", F, STORE_FIXTURES) {
  F fixture;
  auto store = fixture.make();
  const std::string binary("a\0b\xff\x00z", 6);
  store.set("binary", binary);
  store.set("empty", "");
  store.set("text", "first");
  store.set("text", "second");
  CHECK(store.get("binary") == binary);
  CHECK(store.get("binary").size() == 6);
  CHECK(store.get("empty").empty());
  CHECK(store.get("text") == "second");
  const std::string key_with_nul("k\0ey", 4);
  store.set(key_with_nul, "nul key");
  CHECK(store.get(key_with_nul) == "nul key");
  auto other = fixture.make();
  CHECK(other.get("binary") == binary);
}

TEST_CASE_TEMPLATE("get blocks until another thread sets the key", F, STORE_FIXTURES) {
  F fixture;
  auto store = fixture.make();
  std::thread setter([&fixture] {
    auto other = fixture.make();
    std::this_thread::sleep_for(50ms);
    other.set("late", "here");
  });
  CHECK(store.get("late", generous) == "here");
  setter.join();
}

TEST_CASE_TEMPLATE("get past its timeout is an Error naming the key and the timeout", F,
                   STORE_FIXTURES) {
  F fixture;
  auto store = fixture.make();
  const auto start = std::chrono::steady_clock::now();
  const auto message = error_of([&] { (void)store.get("never-set", 200ms); });
  CHECK(std::chrono::steady_clock::now() - start >= 190ms);
  CHECK(contains(message, "never-set"));
  CHECK(contains(message, "200 ms"));

  store.set_timeout(150ms);
  CHECK(store.timeout() == 150ms);
  CHECK(contains(error_of([&] { (void)store.get("also-never"); }), "150 ms"));

  // The store is still in step after a timeout.
  store.set_timeout(generous);
  store.set("k", "v");
  CHECK(store.get("k") == "v");
  CHECK(store.num_keys() >= 1);
}

TEST_CASE_TEMPLATE("add counts atomically and stores decimal text", F, STORE_FIXTURES) {
  F fixture;
  auto store = fixture.make();
  CHECK(store.add("counter", 5) == 5);
  CHECK(store.get("counter") == "5");
  CHECK(store.add("counter", -7) == -2);
  CHECK(store.get("counter") == "-2");
  CHECK(store.add("counter", 0) == -2);
  store.set("preset", "40");
  CHECK(store.add("preset", 2) == 42);

  store.set("word", "abc");
  CHECK(contains(error_of([&] { store.add("word", 1); }), "word"));
  CHECK(store.get("word") == "abc");
  store.set("big", std::to_string(INT64_MAX));
  CHECK(contains(error_of([&] { store.add("big", 1); }), "overflow"));
  CHECK(store.add("counter", 2) == 0);  // still usable after the errors
}

TEST_CASE_TEMPLATE("add from many threads loses no increment", F, STORE_FIXTURES) {
  F fixture;
  constexpr int threads = 8;
  constexpr int adds = 100;
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&fixture] {
      auto store = fixture.make();
      for (int i = 0; i < adds; ++i) store.add("hits", 1);
    });
  }
  for (auto& w : workers) w.join();
  auto store = fixture.make();
  CHECK(store.get("hits") == std::to_string(threads * adds));
}

TEST_CASE_TEMPLATE("one handle is safe to share between threads", F, STORE_FIXTURES) {
  F fixture;
  auto store = fixture.make();
  std::vector<std::thread> workers;
  for (int t = 0; t < 4; ++t) {
    workers.emplace_back([&store, t] {
      // Appended, not "t" + std::to_string(t): at -O3 GCC 12 sees a memcpy of an impossible size
      // in that string's inlined insert (a -Wstringop-overflow false positive).
      std::string key(1, 't');
      key += std::to_string(t);
      for (int i = 0; i < 50; ++i) {
        store.add("shared", 1);
        store.set(key, std::to_string(i));
        (void)store.check(std::vector<std::string>{"shared"});
      }
    });
  }
  for (auto& w : workers) w.join();
  CHECK(store.get("shared") == "200");
  CHECK(store.get("t3") == "49");
}

TEST_CASE_TEMPLATE("compare_set follows torch in all four cases", F, STORE_FIXTURES) {
  F fixture;
  auto store = fixture.make();
  // Missing key, non-empty expected: nothing happens, expected comes back.
  CHECK(store.compare_set("cas", "old", "new") == "old");
  CHECK_FALSE(store.check(std::vector<std::string>{"cas"}));
  // Missing key, empty expected: the key is set.
  CHECK(store.compare_set("cas", "", "first") == "first");
  CHECK(store.get("cas") == "first");
  // Current value matches: swapped.
  CHECK(store.compare_set("cas", "first", "second") == "second");
  CHECK(store.get("cas") == "second");
  // Current value differs: nothing happens, the current value comes back.
  CHECK(store.compare_set("cas", "first", "third") == "second");
  CHECK(store.get("cas") == "second");
}

TEST_CASE_TEMPLATE("wait and check", F, STORE_FIXTURES) {
  F fixture;
  auto store = fixture.make();
  const std::vector<std::string> keys{"w1", "w2", "w3"};
  CHECK_FALSE(store.check(keys));
  CHECK(store.check(std::vector<std::string>{}));
  store.set("w1", "x");
  CHECK_FALSE(store.check(keys));

  const auto message = error_of([&] { store.wait(keys, 150ms); });
  CHECK(contains(message, "w2'"));
  CHECK(contains(message, "w3'"));
  CHECK_FALSE(contains(message, "w1'"));
  CHECK(contains(message, "150 ms"));

  std::thread setter([&fixture] {
    auto other = fixture.make();
    std::this_thread::sleep_for(30ms);
    other.set("w2", "");
    std::this_thread::sleep_for(30ms);
    other.add("w3", 1);
  });
  store.wait(keys, generous);
  setter.join();
  CHECK(store.check(keys));
  store.wait(keys);  // already there: returns at once
}

TEST_CASE_TEMPLATE("delete_key and num_keys", F, STORE_FIXTURES) {
  F fixture;
  auto store = fixture.make();
  CHECK(store.num_keys() == 0);
  store.set("a", "1");
  store.set("b", "2");
  store.add("c", 3);
  CHECK(store.num_keys() == 3);
  CHECK(store.delete_key("b"));
  CHECK_FALSE(store.delete_key("b"));
  CHECK_FALSE(store.delete_key("never"));
  CHECK(store.num_keys() == 2);
  CHECK_FALSE(store.check(std::vector<std::string>{"b"}));
  CHECK(contains(error_of([&] { (void)store.get("b", 100ms); }), "b' was not set"));
  store.set("b", "again");
  CHECK(store.get("b") == "again");
}

TEST_CASE_TEMPLATE("PrefixStore keeps the keys of its users apart", F, STORE_FIXTURES) {
  F fixture;
  auto base = fixture.make();
  tandem::PrefixStore first("first", fixture.make());
  tandem::PrefixStore second("second", fixture.make());
  first.set("key", "1");
  second.set("key", "2");
  CHECK(first.get("key") == "1");
  CHECK(second.get("key") == "2");
  CHECK(first.add("n", 1) == 1);
  CHECK(second.add("n", 10) == 10);
  CHECK(base.get("first/key") == "1");
  CHECK(base.get("second/n") == "10");
  CHECK(first.check(std::vector<std::string>{"key", "n"}));
  CHECK_FALSE(first.check(std::vector<std::string>{"other"}));
  CHECK(second.delete_key("key"));
  CHECK(first.get("key") == "1");
  CHECK(first.num_keys() == base.num_keys());  // num_keys counts the whole underlying store
  CHECK(contains(error_of([&] { (void)second.get("key", 100ms); }), "key"));
}

TEST_CASE("AnyStore copies share one store and its timeout") {
  tandem::AnyStore any = tandem::HashStore();
  tandem::AnyStore copy = any;
  any.set("k", "v");
  CHECK(copy.get("k") == "v");
  copy.set_timeout(123ms);
  CHECK(any.timeout() == 123ms);
  tandem::AnyStore nested = tandem::PrefixStore("p", any);
  nested.set("k", "w");
  CHECK(any.get("p/k") == "w");
}

TEST_CASE("HashStore copies share keys but keep their own timeout") {
  tandem::HashStore a(1s);
  tandem::HashStore b = a;
  b.set_timeout(2s);
  CHECK(a.timeout() == 1s);
  b.set("x", "y");
  CHECK(a.get("x") == "y");
}
