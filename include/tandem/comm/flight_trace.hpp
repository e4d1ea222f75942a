// tandem/comm/flight_trace.hpp - reading flight records after the fact: every rank's dump in a
// directory parsed and checked, and merged into a diagnosis of where the job stands ("rank 2 is
// in all_reduce #1042 (4 MiB float32), started 31 s ago; ranks 0, 1, 3 wait in #1043").
//   auto set = tandem::read_flight_dumps("/tmp/tandem-flight-job7");
//   for (const auto& line : tandem::flight_diagnosis(set.files)) std::puts(line.c_str());
// Needs: POSIX (directory listing). tandemrun prints this in its failure summary and stall
// report; `tandemrun --trace DIR` prints flight_trace_report. The writer is flight_recorder.hpp.
#pragma once

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem/comm/detail/flight_dump.hpp"
#include "tandem/core/detail/json.hpp"

namespace tandem {

/// One recorded operation, as a dump holds it (times in Unix nanoseconds, 0 when not yet).
struct FlightTraceEntry {
  std::uint64_t sequence = 0;   ///< collectives counted from 1; send/recv counted apart
  std::string operation;        ///< "all_reduce", "send", ...
  bool collective = true;       ///< false for send and recv
  std::string dtype;            ///< "" for barrier and split
  std::uint64_t count = 0;      ///< elements
  std::uint64_t bytes = 0;      ///< count times the element size
  int peer = -1;                ///< the root or the peer, -1 when none
  bool async = false;           ///< issued as `_async`
  std::string state;            ///< queued, started, finished or failed
  std::int64_t queued_ns = 0;   ///< when it was issued (an `_async` one queued)
  std::int64_t started_ns = 0;  ///< when it started (0 while queued)
  std::int64_t ended_ns = 0;    ///< when it finished or failed (0 until then)
  /// Not ended yet (queued or started).
  [[nodiscard]] bool open() const { return state == "queued" || state == "started"; }
};

/// One communicator's ring in a dump.
struct FlightTraceComm {
  std::string name;                       ///< "GlooComm#0", a split's "GlooComm#0/1.0"
  int rank = 0;                           ///< this process's rank in it
  int size = 0;                           ///< its ranks
  std::int64_t timeout_ms = -1;           ///< its timeout; -1 forever
  std::vector<FlightTraceEntry> entries;  ///< oldest first
};

/// One process's dump.
struct FlightTraceFile {
  std::string path;          ///< the file it was read from
  std::string reason;        ///< timeout, mismatch, peer, error, signal, waiting or request
  std::string cause;         ///< the Error that made it write, if any
  int rank = -1;             ///< its rank in the job (-1: no launcher said)
  int world_size = -1;       ///< the job's size (-1: no launcher said)
  std::string host;          ///< the host it ran on
  std::int64_t pid = 0;      ///< its process id
  std::int64_t time_ns = 0;  ///< when it was written (Unix nanoseconds)
  std::vector<FlightTraceComm> communicators;  ///< every communicator of the process
};

/// What read_flight_dumps found: the dumps it could read, and why it skipped any other.
struct FlightTraceSet {
  std::vector<FlightTraceFile> files;  ///< the dumps read, oldest first
  std::vector<std::string> problems;   ///< "PATH: why" for each file skipped
};

/// A dump's text parsed and checked; nullopt (and `why`, when given) for anything else.
inline std::optional<FlightTraceFile> parse_flight_dump(std::string_view text,
                                                        std::string* why = nullptr) {
  const auto fail = [&](const std::string& reason) -> std::optional<FlightTraceFile> {
    if (why) *why = reason;
    return std::nullopt;
  };
  const auto doc = detail::parse_json(text);
  if (!doc || doc->kind != detail::JsonValue::Kind::object) return fail("not a JSON object");
  if (doc->int_or("tandem_flight_record", 0) != detail::flight_dump_version) {
    return fail("not a tandem flight record of version " +
                std::to_string(detail::flight_dump_version));
  }
  FlightTraceFile file;
  file.reason = doc->string_or("reason");
  file.cause = doc->string_or("cause");
  file.rank = static_cast<int>(std::clamp<std::int64_t>(doc->int_or("rank", -1), -1, 1 << 30));
  file.world_size =
      static_cast<int>(std::clamp<std::int64_t>(doc->int_or("world_size", -1), -1, 1 << 30));
  file.host = doc->string_or("host");
  file.pid = doc->int_or("pid", 0);
  file.time_ns = doc->int_or("time_ns", 0);
  const detail::JsonValue* comms = doc->find("communicators");
  if (!comms || comms->kind != detail::JsonValue::Kind::array) return fail("no communicators");
  for (const auto& c : comms->items) {
    FlightTraceComm comm;
    comm.name = c.string_or("name");
    const auto rank = c.int_or("rank", -1);
    const auto size = c.int_or("size", -1);
    if (comm.name.empty() || size < 1 || size > (1 << 30) || rank < 0 || rank >= size) {
      return fail("a communicator without a name, or with a rank outside its size");
    }
    comm.rank = static_cast<int>(rank);
    comm.size = static_cast<int>(size);
    comm.timeout_ms = c.int_or("timeout_ms", -1);
    const detail::JsonValue* entries = c.find("entries");
    if (!entries || entries->kind != detail::JsonValue::Kind::array) return fail("no entries");
    for (const auto& e : entries->items) {
      FlightTraceEntry entry;
      const auto seq = e.int_or("seq", -1);
      const auto count = e.int_or("count", -1);
      const auto bytes = e.int_or("bytes", -1);
      entry.operation = e.string_or("op");
      entry.state = e.string_or("state");
      if (seq < 0 || count < 0 || bytes < 0 || entry.operation.empty() ||
          (entry.state != "queued" && entry.state != "started" && entry.state != "finished" &&
           entry.state != "failed")) {
        return fail("an entry without a sequence number, operation, count or known state");
      }
      entry.sequence = static_cast<std::uint64_t>(seq);
      entry.count = static_cast<std::uint64_t>(count);
      entry.bytes = static_cast<std::uint64_t>(bytes);
      const detail::JsonValue* collective = e.find("collective");
      entry.collective =
          !collective || collective->kind != detail::JsonValue::Kind::boolean || collective->flag;
      const detail::JsonValue* async = e.find("async");
      entry.async = async && async->kind == detail::JsonValue::Kind::boolean && async->flag;
      entry.dtype = e.string_or("dtype");
      entry.peer = static_cast<int>(std::clamp<std::int64_t>(e.int_or("peer", -1), -1, 1 << 30));
      entry.queued_ns = e.int_or("queued_ns", 0);
      entry.started_ns = e.int_or("started_ns", 0);
      entry.ended_ns = e.int_or("ended_ns", 0);
      comm.entries.push_back(std::move(entry));
    }
    file.communicators.push_back(std::move(comm));
  }
  return file;
}

/// Every dump (flight-*.json) in `dir`, oldest first. A file that is not a dump, too large or
/// unreadable is skipped and named in `problems`; a missing directory gives nothing.
inline FlightTraceSet read_flight_dumps(const std::string& dir) {
  constexpr std::size_t max_bytes = std::size_t{256} << 20;
  FlightTraceSet set;
  DIR* listing = ::opendir(dir.c_str());
  if (listing == nullptr) return set;
  std::vector<std::string> names;
  while (const dirent* item = ::readdir(listing)) {
    const std::string_view name(item->d_name);
    if (name.starts_with(detail::flight_dump_prefix) && name.ends_with(".json")) {
      names.emplace_back(name);
    }
  }
  ::closedir(listing);
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    const std::string path = dir + "/" + name;
    struct stat info {};
    if (::stat(path.c_str(), &info) != 0 || !S_ISREG(info.st_mode)) continue;
    if (static_cast<std::size_t>(info.st_size) > max_bytes) {
      set.problems.push_back(path + ": larger than 256 MiB, skipped");
      continue;
    }
    std::ifstream in(path, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::string why;
    if (auto file = parse_flight_dump(text, &why)) {
      file->path = path;
      set.files.push_back(std::move(*file));
    } else {
      set.problems.push_back(path + ": " + why);
    }
  }
  std::stable_sort(set.files.begin(), set.files.end(),
                   [](const auto& a, const auto& b) { return a.time_ns < b.time_ns; });
  return set;
}

namespace detail {

/// "4 MiB", "1.5 KiB", "12 B".
inline std::string bytes_text(std::uint64_t bytes) {
  static constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  if (unit == 0 || value >= 100.0 ||
      value == static_cast<double>(static_cast<std::uint64_t>(value))) {
    std::snprintf(text, sizeof text, "%.0f %s", value, units[unit]);
  } else {
    std::snprintf(text, sizeof text, "%.1f %s", value, units[unit]);
  }
  return text;
}

/// "150 ms", "31 s", "2 min 5 s", "1 h 3 min": an age as a person reads it.
inline std::string age_text(std::int64_t ns) {
  const std::int64_t ms = std::max<std::int64_t>(ns, 0) / 1'000'000;
  if (ms < 1000) return std::to_string(ms) + " ms";
  const std::int64_t s = ms / 1000;
  if (s < 60) return std::to_string(s) + " s";
  if (s < 3600) {
    return std::to_string(s / 60) + " min" + (s % 60 ? " " + std::to_string(s % 60) + " s" : "");
  }
  return std::to_string(s / 3600) + " h" +
         (s % 3600 / 60 ? " " + std::to_string(s % 3600 / 60) + " min" : "");
}

/// "ranks 0, 1, 3" or "rank 2".
inline std::string ranks_text(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(ranks[i]);
  }
  return text;
}

/// "all_reduce #1042 (4 MiB float32)", "broadcast #7 (16 B int32, root 0)", "barrier #3",
/// "recv #2 (1 KiB float32) from rank 1".
inline std::string entry_text(const FlightTraceEntry& e) {
  std::string text = e.operation + " #" + std::to_string(e.sequence);
  std::string args;
  if (!e.dtype.empty()) args = bytes_text(e.bytes) + " " + e.dtype;
  if (e.collective && e.peer >= 0)
    args += (args.empty() ? "" : ", ") + std::string("root ") + std::to_string(e.peer);
  if (!args.empty()) text += " (" + args + ")";
  if (!e.collective && e.peer >= 0) {
    text += (e.operation == "send" ? " to rank " : " from rank ") + std::to_string(e.peer);
  }
  return text;
}

/// Where one rank stands in one communicator.
struct TracePosition {
  const FlightTraceEntry* open = nullptr;  ///< the oldest collective not ended: it is in it
  const FlightTraceEntry* last = nullptr;  ///< its last ended collective
  const FlightTraceEntry* p2p = nullptr;   ///< the oldest open send or recv
};

inline TracePosition trace_position(const FlightTraceComm& comm) {
  TracePosition at;
  for (const auto& e : comm.entries) {
    if (e.collective) {
      if (e.open()) {
        if (!at.open || e.sequence < at.open->sequence) at.open = &e;
      } else if (!at.last || e.sequence > at.last->sequence) {
        at.last = &e;
      }
    } else if (e.open() && (!at.p2p || e.queued_ns < at.p2p->queued_ns)) {
      at.p2p = &e;
    }
  }
  return at;
}

/// The ranks of one communicator across the dumps: nullptr where no dump holds that rank.
/// Empty when two dumps hold the same rank (different groups under one name).
inline std::vector<const FlightTraceComm*> group_members(const std::vector<FlightTraceFile>& files,
                                                         const std::string& name, int size) {
  std::vector<const FlightTraceComm*> members(static_cast<std::size_t>(size), nullptr);
  for (const auto& file : files) {
    for (const auto& comm : file.communicators) {
      if (comm.name != name || comm.size != size) continue;
      auto& slot = members[static_cast<std::size_t>(comm.rank)];
      if (slot) return {};
      slot = &comm;
    }
  }
  return members;
}

/// The diagnosis of one communicator: "" when none of its ranks is waiting or failed.
inline std::string group_diagnosis(const std::vector<const FlightTraceComm*>& members,
                                   std::int64_t now) {
  std::vector<TracePosition> at(members.size());
  bool trouble = false;
  const FlightTraceEntry* front = nullptr;  // the most advanced open collective
  for (std::size_t r = 0; r < members.size(); ++r) {
    if (!members[r]) continue;
    at[r] = trace_position(*members[r]);
    if (at[r].open || at[r].p2p || (at[r].last && at[r].last->state == "failed")) trouble = true;
    if (at[r].open && (!front || at[r].open->sequence > front->sequence)) front = at[r].open;
  }
  if (!trouble) return {};
  // Ranks with the same description are named together: those behind first (the likely
  // culprits), then those whose operation failed, then those waiting; each in rank order.
  std::vector<std::pair<std::string, std::vector<int>>> lagging;
  std::vector<std::pair<std::string, std::vector<int>>> failed;
  std::vector<std::pair<std::string, std::vector<int>>> waiting;
  const auto add = [](auto& list, const std::string& text, int rank) {
    for (auto& [said, ranks] : list) {
      if (said == text) return ranks.push_back(rank);
    }
    list.push_back({text, {rank}});
  };
  const auto started_at = [](const FlightTraceEntry& e) {
    return e.started_ns ? e.started_ns : e.queued_ns;
  };
  std::int64_t earliest = 0;
  for (std::size_t r = 0; r < members.size(); ++r) {
    const int rank = static_cast<int>(r);
    const TracePosition& p = at[r];
    if (!members[r]) {
      add(lagging, "wrote no flight record", rank);
    } else if (p.open && front && p.open->sequence == front->sequence) {
      const bool same = p.open->operation == front->operation && p.open->bytes == front->bytes;
      add(waiting, same ? "" : entry_text(*p.open), rank);
      if (earliest == 0 || started_at(*p.open) < earliest) earliest = started_at(*p.open);
    } else if (p.open) {
      add(lagging,
          std::string(p.open->state == "queued" ? "has queued " : "is in ") + entry_text(*p.open) +
              ", started " + age_text(now - started_at(*p.open)) + " ago",
          rank);
    } else if (p.p2p) {
      add(lagging,
          "is in " + entry_text(*p.p2p) + ", started " + age_text(now - started_at(*p.p2p)) +
              " ago",
          rank);
    } else if (p.last && p.last->state == "failed") {
      add(failed,
          "failed in " + entry_text(*p.last) + " after " +
              age_text(p.last->ended_ns - started_at(*p.last)),
          rank);
    } else if (front && p.last) {
      add(lagging,
          "has not called #" + std::to_string(front->sequence) + " (its last, " +
              entry_text(*p.last) + ", ended " + age_text(now - p.last->ended_ns) + " ago)",
          rank);
    } else if (front) {
      add(lagging, "has not called #" + std::to_string(front->sequence) + " (no collective yet)",
          rank);
    } else {
      add(lagging, "is in no collective", rank);
    }
  }
  std::string text;
  for (const auto* list : {&lagging, &failed}) {
    for (const auto& [said, ranks] : *list) {
      text += (text.empty() ? "" : "; ") + ranks_text(ranks) + " " + said;
    }
  }
  // The waiters' operation is named in full unless the text before names it already.
  const bool named = front && text.find(front->operation + " #") != std::string::npos;
  for (const auto& [said, ranks] : waiting) {
    const std::string verb = ranks.size() == 1 ? " waits in " : " wait in ";
    text += (text.empty() ? "" : "; ") + ranks_text(ranks) + verb;
    if (!said.empty()) {
      text += said;
      continue;
    }
    text += named ? "#" + std::to_string(front->sequence) : entry_text(*front);
    text += ", started " + age_text(now - earliest) + " ago";
  }
  return text;
}

}  // namespace detail

/// Where the job stands, one line per communicator whose ranks wait or failed, merged from every
/// rank's dump; then the cause each dump was written for. `now_ns` (Unix nanoseconds; 0: the
/// newest dump's time) is what "started 31 s ago" counts from. Empty when nothing is amiss.
[[nodiscard]] inline std::vector<std::string> flight_diagnosis(
    const std::vector<FlightTraceFile>& files, std::int64_t now_ns = 0) {
  if (now_ns == 0) {
    for (const auto& file : files) now_ns = std::max(now_ns, file.time_ns);
  }
  std::vector<std::pair<std::string, int>> groups;
  for (const auto& file : files) {
    for (const auto& comm : file.communicators) {
      const std::pair<std::string, int> key{comm.name, comm.size};
      if (std::find(groups.begin(), groups.end(), key) == groups.end()) groups.push_back(key);
    }
  }
  std::vector<std::string> lines;
  for (const auto& [name, size] : groups) {
    const auto members = detail::group_members(files, name, size);
    if (members.empty()) continue;  // several groups share the name: no rank order to compare
    auto text = detail::group_diagnosis(members, now_ns);
    if (text.empty()) continue;
    lines.push_back(groups.size() > 1 ? name + ": " + text : text);
  }
  for (const auto& file : files) {
    if (file.cause.empty()) continue;
    const std::string who = file.rank >= 0 ? "rank " + std::to_string(file.rank) : file.host;
    lines.push_back(who + " (pid " + std::to_string(file.pid) + ", " + file.reason +
                    "): " + file.cause);
  }
  return lines;
}

/// What `tandemrun --trace DIR` prints: the diagnosis, then each dump's last operations per
/// communicator (`last` of them), then the files that could not be read.
[[nodiscard]] inline std::string flight_trace_report(const FlightTraceSet& set,
                                                     std::size_t last = 5) {
  std::string out;
  if (set.files.empty()) out += "no flight records\n";
  for (const auto& line : flight_diagnosis(set.files)) out += line + "\n";
  std::int64_t now = 0;
  for (const auto& file : set.files) now = std::max(now, file.time_ns);
  for (const auto& file : set.files) {
    out += "\n" + file.path + ": " +
           (file.rank >= 0 ? "rank " + std::to_string(file.rank) : "ranks") + " on " + file.host +
           " (pid " + std::to_string(file.pid) + "), written for " + file.reason + " " +
           detail::age_text(now - file.time_ns) + " before the newest\n";
    for (const auto& comm : file.communicators) {
      out += "  " + comm.name + " rank " + std::to_string(comm.rank) + " of " +
             std::to_string(comm.size) + ":\n";
      const std::size_t from = comm.entries.size() > last ? comm.entries.size() - last : 0;
      for (std::size_t i = from; i < comm.entries.size(); ++i) {
        const auto& e = comm.entries[i];
        const std::int64_t started = e.started_ns ? e.started_ns : e.queued_ns;
        out += "    " + detail::entry_text(e) + ": " + e.state;
        if (e.ended_ns) {
          out += " after " + detail::age_text(e.ended_ns - started);
        } else {
          out += ", " + detail::age_text(now - started) + " before the newest record";
        }
        out += "\n";
      }
    }
  }
  for (const auto& problem : set.problems) out += "skipped " + problem + "\n";
  return out;
}

}  // namespace tandem
