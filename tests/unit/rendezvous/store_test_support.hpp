// Helpers shared by the store tests: a temporary directory, and one fixture per store type
// whose make() returns a fresh handle on one shared store (a copy, a second FileStore on the
// same file, a second TcpStore client of the same server).
#pragma once

#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

#include "tandem/rendezvous/file_store.hpp"
#include "tandem/rendezvous/store.hpp"
#include "tandem/rendezvous/tcp_store.hpp"

#include "support/temp_dir.hpp"

namespace tandem::test {

using namespace std::chrono_literals;

/// What a call that should succeed may take on a loaded machine.
inline constexpr Timeout generous = std::chrono::seconds(60);

struct HashFixture {
  HashStore base{generous};
  HashStore make() { return base; }
};

struct FileFixture {
  TempDir dir;
  std::filesystem::path file = dir.path() / "store";
  FileStore base{file, {.timeout = generous}};
  FileStore make() { return FileStore(file, {.timeout = generous}); }
};

struct TcpFixture {
  TcpStore base{{.port = 0, .is_server = true, .timeout = generous}};
  TcpStore make() { return TcpStore({.port = base.port(), .timeout = generous}); }
};

template <class Fixture>
struct PrefixOf {
  Fixture inner;
  auto make() { return PrefixStore("job", inner.make()); }
};

template <class Fixture>
struct AnyOf {
  Fixture inner;
  AnyStore make() { return AnyStore(inner.make()); }
};

}  // namespace tandem::test
