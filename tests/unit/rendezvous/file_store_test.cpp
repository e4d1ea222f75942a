// FileStore: sharing a file, resetting stale files, and the errors it owes its users.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "store_test_support.hpp"
#include "support/error_of.hpp"
#include "tandem/rendezvous/file_store.hpp"

using namespace std::chrono_literals;
using namespace tandem::test;
using tandem::FileStore;

TEST_CASE("two FileStores on one file see each other's writes") {
  TempDir dir;
  FileStore a(dir.path() / "s", {.timeout = generous});
  FileStore b(dir.path() / "s", {.timeout = generous});
  a.set("from-a", "1");
  b.set("from-b", "2");
  CHECK(b.get("from-a") == "1");
  CHECK(a.get("from-b") == "2");
  CHECK(a.delete_key("from-b"));
  CHECK_FALSE(b.check(std::vector<std::string>{"from-b"}));
  CHECK(b.num_keys() == 1);
  CHECK(a.path() == dir.path() / "s");
}

TEST_CASE("a file nobody has open is reset, a file in use is joined") {
  TempDir dir;
  const auto path = dir.path() / "s";
  {
    FileStore earlier(path, {.timeout = generous});
    earlier.set("old", "run");
  }
  CHECK(std::filesystem::file_size(path) > 0);
  FileStore live(path, {.timeout = generous});
  CHECK(live.num_keys() == 0);
  CHECK_FALSE(live.check(std::vector<std::string>{"old"}));
  live.set("new", "run");
  FileStore joiner(path, {.timeout = generous});
  CHECK(joiner.get("new") == "run");
  CHECK(joiner.num_keys() == 1);
}

TEST_CASE("a stale file with garbage in it is reset on open") {
  TempDir dir;
  const auto path = dir.path() / "s";
  std::ofstream(path, std::ios::binary) << "this is not a store file";
  FileStore store(path, {.timeout = generous});
  CHECK(store.num_keys() == 0);
  store.set("k", "v");
  CHECK(store.get("k") == "v");
}

TEST_CASE("a missing directory is an Error naming the path") {
  TempDir dir;
  const auto path = dir.path() / "no-such-dir" / "store";
  const auto message = error_of([&] { FileStore store(path); });
  CHECK(contains(message, path.string()));
  CHECK(contains(message, "does not exist"));
}

TEST_CASE("a truncated record is an Error naming the file and the offset") {
  TempDir dir;
  const auto path = dir.path() / "s";
  FileStore store(path, {.timeout = generous});
  store.set("good", "value");
  const auto end = std::filesystem::file_size(path);
  {
    std::ofstream out(path, std::ios::binary | std::ios::app);
    out.write("S\x05\x00\x00\x00ke", 7);  // a set record cut short in its key
  }
  FileStore reader(path, {.timeout = generous});  // store is live: the file is not reset
  std::string message;
  try {
    (void)reader.get("good");
  } catch (const tandem::Error& error) {
    message = error.what();
  }
  CHECK(contains(message, path.string()));
  CHECK(contains(message, "offset " + std::to_string(end)));
  CHECK_THROWS_AS(store.set("more", "x"), tandem::Error);

  std::filesystem::resize_file(path, end + 1);  // only the record's 'S' is left
  CHECK_THROWS_AS((void)reader.num_keys(), tandem::Error);
  std::filesystem::resize_file(path, end);  // the damage cut away: readable again
  CHECK(reader.get("good") == "value");
}

TEST_CASE("an unknown record type is an Error") {
  TempDir dir;
  const auto path = dir.path() / "s";
  FileStore store(path, {.timeout = generous});
  store.set("a", "b");
  {
    std::ofstream out(path, std::ios::binary | std::ios::app);
    out.write("X", 1);
  }
  FileStore reader(path, {.timeout = generous});
  CHECK_THROWS_AS((void)reader.num_keys(), tandem::Error);
}

TEST_CASE("processes share a FileStore") {
  TempDir dir;
  const auto path = dir.path() / "s";
  FileStore parent(path, {.timeout = generous});
  constexpr int children = 4;
  const auto pids = tandem::test::fork_children(children, [&](int i) {
    FileStore store(path, {.timeout = generous});
    for (int n = 0; n < 25; ++n) store.add("count", 1);
    store.set("child" + std::to_string(i), std::to_string(i * 10));
    return store.get("go") == "yes" ? 0 : 2;
  });
  std::vector<std::string> keys;
  for (int i = 0; i < children; ++i) keys.push_back("child" + std::to_string(i));
  parent.wait(keys);
  parent.set("go", "yes");
  for (const int code : tandem::test::wait_children(pids)) CHECK(code == 0);
  CHECK(parent.get("count") == std::to_string(children * 25));
  CHECK(parent.get("child3") == "30");
}
