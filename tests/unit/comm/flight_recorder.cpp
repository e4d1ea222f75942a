// The flight recorder (comm/flight_recorder.hpp, comm/flight_trace.hpp): the ring, the JSON of a
// dump and its refusal of malformed files, the merged diagnosis's words, and on LocalComm the
// dumps (on a failure, on SIGUSR1, on demand), the group names and the waiting notice naming the
// rank that has not arrived. Nothing here asserts a duration.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "support/error_of.hpp"
#include "support/temp_dir.hpp"
#include "tandem/comm/flight_recorder.hpp"
#include "tandem/comm/flight_trace.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/core/detail/json.hpp"

namespace {

using tandem::FlightTraceComm;
using tandem::FlightTraceEntry;
using tandem::FlightTraceFile;
using tandem::detail::FlightCall;
using tandem::detail::FlightRing;
using tandem::detail::FlightState;

constexpr std::int64_t second = 1'000'000'000;

FlightCall all_reduce_call(std::size_t count) {
  return {"all_reduce", true, true, tandem::dtype::float32, count, -1};
}

/// Settings for one test: its own directory, a 1 s notice; the environment decides again after.
struct RecorderFor {
  explicit RecorderFor(const std::string& dir, std::size_t size = 64) {
    tandem::set_flight_recorder({size, std::chrono::seconds(1), dir});
  }
  RecorderFor(const RecorderFor&) = delete;
  RecorderFor& operator=(const RecorderFor&) = delete;
  ~RecorderFor() { tandem::reset_flight_recorder(); }
};

/// Polls `dir` until a dump whose reason is `reason` appears (a limit far beyond any load).
std::optional<FlightTraceFile> wait_for_dump(const std::string& dir, const std::string& reason) {
  for (int i = 0; i < 6000; ++i) {
    for (auto& file : tandem::read_flight_dumps(dir).files) {
      if (file.reason == reason) return file;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return std::nullopt;
}

/// Everything written to stderr while it lives goes to a file instead (the notices).
class CapturedStderr {
 public:
  explicit CapturedStderr(std::string path) : path_(std::move(path)) {
    saved_ = ::dup(STDERR_FILENO);
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0600);
    ::dup2(fd, STDERR_FILENO);
    ::close(fd);
  }
  CapturedStderr(const CapturedStderr&) = delete;
  CapturedStderr& operator=(const CapturedStderr&) = delete;
  ~CapturedStderr() {
    ::dup2(saved_, STDERR_FILENO);
    ::close(saved_);
  }
  [[nodiscard]] std::string text() const {
    std::ifstream in(path_);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

 private:
  std::string path_;
  int saved_ = -1;
};

FlightTraceEntry entry(std::uint64_t seq, const std::string& state, std::int64_t started,
                       std::int64_t ended = 0) {
  FlightTraceEntry e;
  e.sequence = seq;
  e.operation = "all_reduce";
  e.dtype = "float32";
  e.count = 1 << 20;
  e.bytes = 4 << 20;
  e.state = state;
  e.queued_ns = started;
  e.started_ns = started;
  e.ended_ns = ended;
  return e;
}

FlightTraceFile rank_file(int rank, std::vector<FlightTraceEntry> entries, std::int64_t time) {
  FlightTraceFile file;
  file.rank = rank;
  file.world_size = 4;
  file.reason = "waiting";
  file.pid = 100 + rank;
  file.time_ns = time;
  FlightTraceComm comm;
  comm.name = "GlooComm#0";
  comm.rank = rank;
  comm.size = 4;
  comm.entries = std::move(entries);
  file.communicators.push_back(std::move(comm));
  return file;
}

}  // namespace

TEST_CASE("the ring keeps the last N operations in order, with their states") {
  FlightRing ring("test#0", 0, 2, 4, std::chrono::seconds(5));
  const auto first = ring.record(all_reduce_call(8), false);
  ring.end(first, false);
  const auto send = ring.record({"send", false, true, tandem::dtype::int64, 3, 1}, false);
  const auto queued = ring.record(all_reduce_call(16), true);
  auto open = ring.open_entries();
  REQUIRE(open.size() == 2);
  CHECK(open[0].state == FlightState::started);
  CHECK(open[0].sequence == 1);  // send/recv are counted apart from collectives
  CHECK(open[1].state == FlightState::queued);
  CHECK(open[1].sequence == 2);
  CHECK(open[1].started_ns == 0);
  ring.start(queued);
  ring.end(queued, true);
  ring.end(send, false);
  CHECK(ring.open_entries().empty());
  for (int i = 0; i < 5; ++i) ring.end(ring.record(all_reduce_call(1), false), false);
  const auto all = ring.entries();
  REQUIRE(all.size() == 4);  // the capacity: the oldest are gone
  CHECK(all.front().sequence == 4);
  CHECK(all.back().sequence == 7);
  for (const auto& e : all) {
    CHECK(e.state == FlightState::finished);
    CHECK(e.ended_ns >= e.started_ns);
  }
  ring.end(first, true);  // a ticket the ring no longer holds changes nothing
  CHECK(ring.entries().front().state == FlightState::finished);
}

TEST_CASE("the JSON parser takes what the writer writes and refuses anything malformed") {
  using tandem::detail::parse_json;
  const std::string odd = std::string("tab\t quote\" back\\ nl\n ctl\x01 utf8 \xc3\xa9", 30);
  const auto doc = parse_json("{\"a\": [1, -2, 3.5e2], \"s\": " + tandem::detail::json_string(odd) +
                              ", \"n\": null, \"t\": true, \"u\": \"\\ud83d\\ude00\"}");
  REQUIRE(doc);
  CHECK(doc->find("s")->as_string() == odd);
  CHECK(doc->find("a")->items.size() == 3);
  CHECK(doc->find("a")->items[1].as_int() == -2);
  CHECK(doc->find("u")->as_string() == "\xf0\x9f\x98\x80");
  CHECK(doc->find("t")->flag);
  for (const char* bad : {"", "{", "{\"a\" 1}", "[1,]", "{\"a\": 1,}", "\"\\x\"", "[1] 2",
                          "{\"a\": tru}", "\"raw\ncontrol\"", "-", "{\"a\": \"\\ud83d\\u0041\"}"}) {
    CAPTURE(bad);
    CHECK_FALSE(parse_json(bad));
  }
  CHECK_FALSE(parse_json(std::string(100, '[') + std::string(100, ']')));  // too deep
  CHECK(parse_json(std::string(20, '[') + std::string(20, ']')));
}

TEST_CASE("a dump reads back as it was written, and a malformed one is refused") {
  auto ring = std::make_shared<FlightRing>("GlooComm#0", 1, 3, 8, std::chrono::seconds(30));
  ring->end(ring->record(all_reduce_call(1024), false), false);
  ring->record({"broadcast", true, true, tandem::dtype::int32, 4, 0}, false);
  const auto text =
      tandem::detail::flight_dump_json("timeout", "tandem: rank 1: x: \"why\"", {ring});
  std::string why;
  const auto file = tandem::parse_flight_dump(text, &why);
  REQUIRE_MESSAGE(file, why);
  CHECK(file->reason == "timeout");
  CHECK(file->cause == "tandem: rank 1: x: \"why\"");
  REQUIRE(file->communicators.size() == 1);
  const auto& comm = file->communicators[0];
  CHECK(comm.name == "GlooComm#0");
  CHECK(comm.rank == 1);
  CHECK(comm.size == 3);
  CHECK(comm.timeout_ms == 30000);
  REQUIRE(comm.entries.size() == 2);
  CHECK(comm.entries[0].operation == "all_reduce");
  CHECK(comm.entries[0].bytes == 4096);
  CHECK(comm.entries[0].state == "finished");
  CHECK(comm.entries[0].ended_ns >= comm.entries[0].started_ns);
  CHECK(comm.entries[1].peer == 0);
  CHECK(comm.entries[1].open());
  CHECK(tandem::detail::entry_text(comm.entries[1]) == "broadcast #2 (16 B int32, root 0)");

  const auto refused = [](std::string text, const std::string& from, const std::string& to) {
    const auto at = text.find(from);
    REQUIRE(at != std::string::npos);
    text.replace(at, from.size(), to);
    std::string reason;
    CHECK_FALSE(tandem::parse_flight_dump(text, &reason));
    CHECK_FALSE(reason.empty());
  };
  refused(text, "\"tandem_flight_record\": 1", "\"tandem_flight_record\": 2");
  refused(text, "\"rank\": 1, \"size\": 3", "\"rank\": 3, \"size\": 3");
  refused(text, "\"state\": \"finished\"", "\"state\": \"dancing\"");
  refused(text, "\"count\": 1024", "\"count\": -5");
  refused(text, "\"communicators\": [", "\"communicators\": {");
  CHECK_FALSE(tandem::parse_flight_dump(text.substr(0, text.size() / 2)));
}

TEST_CASE("the diagnosis names the rank behind and where the others wait") {
  const std::int64_t now = 1000 * second;
  std::vector<FlightTraceFile> files;
  for (int r : {0, 1, 3}) {
    files.push_back(rank_file(r,
                              {entry(1042, "finished", now - 40 * second, now - 31 * second),
                               entry(1043, "started", now - 30 * second)},
                              now));
  }
  SUBCASE("in an older collective") {
    files.push_back(rank_file(2, {entry(1042, "started", now - 31 * second)}, now));
    const auto lines = tandem::flight_diagnosis(files, now);
    REQUIRE(lines.size() == 1);
    CHECK(lines[0] ==
          "rank 2 is in all_reduce #1042 (4 MiB float32), started 31 s ago; ranks 0, 1, 3 wait "
          "in #1043, started 30 s ago");
  }
  SUBCASE("never called the next one") {
    files.push_back(
        rank_file(2, {entry(1042, "finished", now - 40 * second, now - 31 * second)}, now));
    const auto lines = tandem::flight_diagnosis(files, now);
    REQUIRE(lines.size() == 1);
    CHECK(lines[0] ==
          "rank 2 has not called #1043 (its last, all_reduce #1042 (4 MiB float32), ended 31 s "
          "ago); ranks 0, 1, 3 wait in #1043, started 30 s ago");
  }
  SUBCASE("wrote nothing (stopped)") {
    const auto lines = tandem::flight_diagnosis(files, now);
    REQUIRE(lines.size() == 1);
    CHECK(lines[0] ==
          "rank 2 wrote no flight record; ranks 0, 1, 3 wait in all_reduce #1043 (4 MiB float32), "
          "started 30 s ago");
  }
  SUBCASE("a failure's cause is quoted") {
    files.push_back(
        rank_file(2, {entry(1043, "failed", now - 30 * second, now - 2 * second)}, now));
    files.back().reason = "timeout";
    files.back().cause = "tandem: rank 2: all_reduce: timed out";
    const auto lines = tandem::flight_diagnosis(files, now);
    REQUIRE(lines.size() == 2);
    CHECK(lines[0] ==
          "rank 2 failed in all_reduce #1043 (4 MiB float32) after 28 s; ranks 0, 1, 3 wait in "
          "#1043, started 30 s ago");
    CHECK(lines[1] == "rank 2 (pid 102, timeout): tandem: rank 2: all_reduce: timed out");
  }
  SUBCASE("nothing amiss says nothing") {
    files.clear();
    for (int r = 0; r < 4; ++r) {
      files.push_back(rank_file(r, {entry(7, "finished", now - 2 * second, now - second)}, now));
    }
    CHECK(tandem::flight_diagnosis(files, now).empty());
  }
}

TEST_CASE("LocalComm: a failure writes the dump once, with the cause; split groups are named") {
  tandem::test::TempDir dir;
  RecorderFor recorder(dir.str());
  const auto what = tandem::test::error_of([&] {
    tandem::run_local(2, [](tandem::LocalComm& comm) {
      std::vector<float> data(comm.rank() == 0 ? 4 : 5, 1.0f);
      auto half = comm.split(comm.rank() % 2, 0);
      REQUIRE(half);
      half->barrier();
      comm.all_reduce(data);
    });
  });
  CHECK(tandem::test::contains(what, "disagree"));
  const auto dump = wait_for_dump(dir.str(), "mismatch");
  REQUIRE(dump);
  CHECK(tandem::test::contains(dump->cause, "element count"));
  std::vector<std::string> names;
  for (const auto& comm : dump->communicators) names.push_back(comm.name);
  bool split_named = false;
  for (const auto& name : names) split_named = split_named || name.find("/1.") != std::string::npos;
  CHECK(split_named);
  bool failed_seen = false;
  for (const auto& comm : dump->communicators) {
    for (const auto& e : comm.entries) failed_seen = failed_seen || e.state == "failed";
  }
  CHECK(failed_seen);
  CHECK(tandem::read_flight_dumps(dir.str()).problems.empty());
}

TEST_CASE("LocalComm: a rank that waits says so, naming the rank that has not arrived") {
  tandem::test::TempDir dir;
  RecorderFor recorder(dir.str());
  CapturedStderr captured(dir / "stderr.txt");
  const auto noticed = [&] {
    const auto text = captured.text();
    return text.find("in barrier #2 for rank 2") != std::string::npos;
  };
  tandem::run_local(
      3,
      [&](tandem::LocalComm& comm) {
        comm.barrier();
        if (comm.rank() == 2) {
          // Late on purpose: until the others have said they wait for it (or far too long).
          for (int i = 0; i < 6000 && !noticed(); ++i) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
        }
        comm.barrier();
      },
      tandem::LocalCommOptions{std::chrono::minutes(5)});
  const auto text = captured.text();
  CAPTURE(text);
  CHECK(noticed());
  CHECK(tandem::test::contains(text, "rank 0 has waited"));
  CHECK(tandem::test::contains(text, "(rank 1 has arrived)"));
  CHECK(tandem::test::contains(text, "timeout in"));
  // Past half the interval the process wrote where it waits.
  const auto dump = wait_for_dump(dir.str(), "waiting");
  REQUIRE(dump);
  CHECK_FALSE(tandem::flight_diagnosis(std::vector<FlightTraceFile>{*dump}).empty());
}

TEST_CASE("SIGUSR1 and dump_flight_records write the records without stopping anything") {
  tandem::test::TempDir dir;
  RecorderFor recorder(dir.str());
  auto comms = tandem::LocalComm::create_group(1);
  std::vector<double> x{1.0};
  comms[0].all_reduce(x);
  const std::string path = tandem::dump_flight_records();
  REQUIRE_FALSE(path.empty());
  CHECK(tandem::flight_recorder_directory() == dir.str());
  const auto requested = wait_for_dump(dir.str(), "request");
  REQUIRE(requested);
  CHECK(requested->communicators.at(0).entries.at(0).operation == "all_reduce");
  REQUIRE(::raise(SIGUSR1) == 0);  // the default action would end the process
  const auto signalled = wait_for_dump(dir.str(), "signal");
  REQUIRE(signalled);
  CHECK(signalled->communicators.at(0).entries.at(0).state == "finished");
  comms[0].all_reduce(x);  // still working
}

TEST_CASE("size 0 records nothing; a bad variable is an Error naming it") {
  tandem::test::TempDir dir;
  {
    RecorderFor off(dir.str(), 0);
    auto comms = tandem::LocalComm::create_group(1);
    comms[0].barrier();
    CHECK(tandem::dump_flight_records().empty());
  }
  const auto env = [](std::string_view name) -> std::optional<std::string> {
    if (name == tandem::flight_recorder_size_variable) return "lots";
    return std::nullopt;
  };
  CHECK(tandem::test::contains(
      tandem::test::error_of([&] { (void)tandem::flight_recorder_settings(env); }),
      "TANDEM_FLIGHT_RECORDER_SIZE='lots' is not an integer"));
  CHECK(tandem::test::contains(
      tandem::test::error_of([&] { tandem::set_flight_recorder({.size = 20'000'000}); }),
      "over the limit"));
}
