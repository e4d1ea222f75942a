// Progress: plain lines at an interval for files and pipes, an in-place redraw on a terminal,
// the count, rate, ETA and metrics in the line; quiet when disabled.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "support/temp_dir.hpp"
#include "tandem/io/progress.hpp"

namespace {
std::string contents(std::FILE* file) {
  std::fflush(file);
  std::rewind(file);
  std::string text;
  char buffer[512];
  while (std::size_t n = std::fread(buffer, 1, sizeof buffer, file)) text.append(buffer, n);
  return text;
}
int count(const std::string& text, const std::string& part) {
  int n = 0;
  for (auto at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}
}  // namespace

TEST_CASE("not a terminal: plain lines at the interval, and a last one") {
  tandem::test::TempDir dir;
  std::FILE* file = std::fopen((dir / "out.txt").c_str(), "w+");
  REQUIRE(file);
  {
    tandem::Progress progress(
        50, {.label = "epoch 1", .stream = file, .interval = std::chrono::milliseconds(0)});
    for (int i = 0; i < 50; ++i) progress.update({{"loss", 0.5}, {"acc", 0.25}});
    CHECK(progress.done() == 50);
    progress.finish();
  }
  const std::string text = contents(file);
  std::fclose(file);
  CHECK(count(text, "\n") == 50);  // every update (interval 0); the last is the final line
  CHECK(text.find("epoch 1 1/50 [") == 0);
  CHECK(text.find("epoch 1 50/50 [") != std::string::npos);
  CHECK(text.find(" loss 0.5 acc 0.25") != std::string::npos);
  CHECK(text.find("ETA") != std::string::npos);
  CHECK(text.find('\r') == std::string::npos);
}

TEST_CASE("a long interval prints only the last line; a terminal redraws in place") {
  tandem::test::TempDir dir;
  std::FILE* file = std::fopen((dir / "out.txt").c_str(), "w+");
  REQUIRE(file);
  {
    tandem::Progress quiet(1000, {.stream = file});  // 10 s interval: nothing until the end
    for (int i = 0; i < 1000; ++i) quiet.update();
  }
  CHECK(count(contents(file), "\n") == 1);  // the line at done == total
  std::fclose(file);

  file = std::fopen((dir / "tty.txt").c_str(), "w+");
  REQUIRE(file);
  {
    tandem::Progress tty(
        3,
        {.label = "eval", .stream = file, .redraw = std::chrono::milliseconds(0), .terminal = 1});
    for (int i = 0; i < 3; ++i) tty.update({{"acc", 0.875}});
    tty.finish();
  }
  const std::string text = contents(file);
  std::fclose(file);
  CHECK(count(text, "\r") == 3);  // finish() only ends the line the last update drew
  CHECK(count(text, "\x1b[K") == 3);
  CHECK(count(text, "\n") == 1);
  CHECK(text.find("\reval 3/3 [") != std::string::npos);
}

TEST_CASE("a disabled Progress (another rank's) prints nothing but still counts") {
  tandem::test::TempDir dir;
  std::FILE* file = std::fopen((dir / "out.txt").c_str(), "w+");
  REQUIRE(file);
  {
    tandem::Progress progress(5, {.enabled = false, .stream = file, .terminal = 1});
    for (int i = 0; i < 5; ++i) progress.update();
    progress.finish();
    CHECK(progress.done() == 5);
    CHECK(progress.line().find("5/5") != std::string::npos);
  }
  CHECK(contents(file).empty());
  std::fclose(file);
}
