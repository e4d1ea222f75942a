// tandem-ckpt on files written here: info lists, verify accepts a valid file and rejects every
// truncation of it (exit 1, never a crash), diff finds a changed element and exits 1.
#include <doctest/doctest.h>

#include <chrono>
#include <fstream>
#include <string>
#include <vector>

#include "support/child_process.hpp"
#include "support/temp_dir.hpp"
#include "tandem/io/safetensors.hpp"

#ifndef TANDEM_CKPT
#error "TANDEM_CKPT (the tandem-ckpt program's path) must be defined"
#endif

namespace {
int ckpt(const std::vector<std::string>& args) {
  std::vector<std::string> argv{TANDEM_CKPT};
  argv.insert(argv.end(), args.begin(), args.end());
  return tandem::test::run_process(argv, {}, std::chrono::seconds(30));
}
}  // namespace

TEST_CASE("tandem-ckpt info, verify and diff") {
  tandem::test::TempDir dir;
  std::vector<float> weights{1, 2, 3, 4};
  std::vector<std::int64_t> step{7};
  tandem::SafetensorsWriter writer;
  writer.add("fc.weight", weights, {2, 2}).add("step", step).metadata("epoch", "1");
  const std::string a = dir / "a.safetensors";
  writer.write(a);
  CHECK(ckpt({"info", a}) == 0);
  CHECK(ckpt({"verify", a}) == 0);
  CHECK(ckpt({"diff", a, a}) == 0);

  weights[3] = 4.5f;
  tandem::SafetensorsWriter changed;
  changed.add("fc.weight", weights, {2, 2}).add("step", step);
  const std::string b = dir / "b.safetensors";
  changed.write(b);
  CHECK(ckpt({"diff", a, b}) == 1);

  const auto bytes = writer.serialize();
  const std::string cut = dir / "cut.safetensors";
  for (std::size_t length = 0; length < bytes.size(); length += 7) {
    CAPTURE(length);
    std::ofstream(cut, std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(length));
    CHECK(ckpt({"verify", cut}) == 1);
  }
  CHECK(ckpt({"verify", dir / "missing.safetensors"}) == 1);
  CHECK(ckpt({"frobnicate", a}) == 2);
}
