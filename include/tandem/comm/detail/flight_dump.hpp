// tandem/comm/detail/flight_dump.hpp - how a process writes its flight records: who it is (its
// global rank, host, pid), where the records go (a directory that needs no configuration), and
// the JSON of one dump, written whole through a temporary file and a rename.
//   std::string path = write_flight_dump(dir, "timeout", cause, rings);   // "" when it could not
// Needs: POSIX. Not a public header: comm/flight_recorder.hpp is; comm/flight_trace.hpp reads it.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem/comm/detail/flight_ring.hpp"
#include "tandem/comm/flight_settings.hpp"
#include "tandem/core/detail/json.hpp"
#include "tandem/core/env.hpp"
#include "tandem/tensor/dtype.hpp"

namespace tandem::detail {

/// The layout of a dump; a reader refuses another.
inline constexpr int flight_dump_version = 1;
/// Dumps are the files "flight-*.json" of their directory.
inline constexpr std::string_view flight_dump_prefix = "flight-";

/// This process's rank in the job and the job's size, from whichever launcher started it
/// (torchrun/tandemrun, Open MPI, MPICH, Slurm); -1 when none says.
inline std::pair<int, int> launcher_rank(const EnvLookup& env = process_env) {
  static constexpr std::pair<std::string_view, std::string_view> variables[] = {
      {"RANK", "WORLD_SIZE"},
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
      {"PMI_RANK", "PMI_SIZE"},
      {"SLURM_PROCID", "SLURM_NTASKS"}};
  for (const auto& [rank_name, size_name] : variables) {
    const auto rank = env(rank_name);
    if (!rank) continue;
    const auto r = parse_int(*rank);
    if (!r || *r < 0 || *r >= (1 << 30)) continue;
    int world = -1;
    if (const auto size = env(size_name)) {
      if (const auto s = parse_int(*size); s && *s > 0 && *s < (1 << 30)) {
        world = static_cast<int>(*s);
      }
    }
    return {static_cast<int>(*r), world};
  }
  return {-1, -1};
}

inline std::string flight_host() {
  char host[256] = {};
  return ::gethostname(host, sizeof host - 1) == 0 ? std::string(host) : std::string("unknown");
}

/// `text` with every character but letters, digits, '.', '_' and '-' made '_' (a file name).
inline std::string file_name_safe(std::string_view text) {
  std::string out;
  for (const char c : text) {
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '.' || c == '_' || c == '-';
    out += keep ? c : '_';
  }
  return out.substr(0, 96);
}

/// The job's id as the launchers give it: the run id of torchrun/tandemrun, Slurm's job and step,
/// Open MPI's (PMIx) namespace, else the store's address; "" when no launcher says.
inline std::string flight_job_id(const EnvLookup& env = process_env) {
  if (const auto id = env("TORCHELASTIC_RUN_ID"); id && !id->empty()) return *id;
  if (const auto id = env("SLURM_JOB_ID"); id && !id->empty()) {
    const auto step = env("SLURM_STEP_ID");
    return *id + (step ? "." + *step : "");
  }
  if (const auto id = env("PMIX_NAMESPACE"); id && !id->empty()) return *id;
  if (const auto id = env("OMPI_MCA_ess_base_jobid"); id && !id->empty()) return "ompi" + *id;
  const auto addr = env("MASTER_ADDR");
  const auto port = env("MASTER_PORT");
  if (addr && port) return *addr + "-" + *port;
  return {};
}

/// Creates `path` and its parents (mode 0700 for those it makes); true when it is a directory.
inline bool make_flight_directory(const std::string& path) {
  std::string prefix;
  std::size_t at = 0;
  while (at != std::string::npos) {
    at = path.find('/', at + 1);
    prefix = path.substr(0, at);
    if (prefix.empty()) continue;
    if (::mkdir(prefix.c_str(), 0700) < 0 && errno != EEXIST) return false;
  }
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

/// Where this process writes its records: `settings.directory`, else
/// $TMPDIR/tandem-flight-<job id> (in /tmp without TMPDIR), or $TMPDIR/tandem-flight-uid<uid>
/// for a process no launcher started (its ranks are threads), made on first use. A default
/// directory another user owns is not used: the uid is added to the name instead.
inline std::string flight_directory(const FlightRecorderSettings& settings,
                                    const EnvLookup& env = process_env) {
  if (!settings.directory.empty()) return settings.directory;
  const auto tmp = env("TMPDIR");
  const std::string base = tmp && !tmp->empty() ? *tmp : "/tmp";
  const std::string job = flight_job_id(env);
  std::string path = base + "/tandem-flight-" +
                     (job.empty() ? "uid" + std::to_string(::getuid()) : file_name_safe(job));
  struct stat info {};
  if (::lstat(path.c_str(), &info) == 0 && (!S_ISDIR(info.st_mode) || info.st_uid != ::getuid())) {
    path += "-uid" + std::to_string(::getuid());
  }
  return path;
}

/// This process's dump file in `dir`: flight-rank<R>-<host>-<pid>.json (no rank part when no
/// launcher gave one: threads as ranks hold every rank in one file).
inline std::string flight_dump_path(const std::string& dir) {
  const int rank = launcher_rank().first;
  return dir + "/" + std::string(flight_dump_prefix) +
         (rank >= 0 ? "rank" + std::to_string(rank) + "-" : std::string()) +
         file_name_safe(flight_host()) + "-" + std::to_string(::getpid()) + ".json";
}

/// What one ring holds, with the conversion of its steady-clock times to Unix nanoseconds.
inline void append_ring_json(std::string& out, const FlightRing& ring, std::int64_t unix_offset) {
  const auto unix_ns = [&](std::int64_t steady) {
    return std::to_string(steady == 0 ? 0 : steady + unix_offset);
  };
  out += "{\"name\": " + json_string(ring.name()) + ", \"rank\": " + std::to_string(ring.rank()) +
         ", \"size\": " + std::to_string(ring.size()) + ", \"timeout_ms\": " +
         std::to_string(ring.timeout() == Timeout::max() ? -1 : ring.timeout().count()) +
         ", \"capacity\": " + std::to_string(ring.capacity()) + ", \"entries\": [";
  bool first = true;
  for (const FlightEntry& e : ring.entries()) {
    out += first ? "\n    " : ",\n    ";
    first = false;
    out +=
        "{\"seq\": " + std::to_string(e.sequence) + ", \"op\": " + json_string(e.operation) +
        ", \"collective\": " + (e.collective ? "true" : "false") +
        ", \"dtype\": " + json_string(e.typed ? tandem::name(e.type) : "") +
        ", \"count\": " + std::to_string(e.count) +
        ", \"bytes\": " + std::to_string(e.typed ? e.count * size_of(e.type) : 0) +
        ", \"peer\": " + std::to_string(e.peer) + ", \"async\": " + (e.async ? "true" : "false") +
        ", \"state\": " + json_string(name(e.state)) + ", \"queued_ns\": " + unix_ns(e.queued_ns) +
        ", \"started_ns\": " + unix_ns(e.started_ns) + ", \"ended_ns\": " + unix_ns(e.ended_ns) +
        "}";
  }
  out += "]}";
}

/// The whole dump of `rings` as JSON: why it was written and what each ring holds.
inline std::string flight_dump_json(std::string_view reason, std::string_view cause,
                                    const std::vector<std::shared_ptr<FlightRing>>& rings) {
  const auto unix_now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::system_clock::now().time_since_epoch())
                            .count();
  const std::int64_t offset = unix_now - flight_now_ns();
  const auto [rank, world] = launcher_rank();
  std::string out =
      "{\"tandem_flight_record\": " + std::to_string(flight_dump_version) +
      ", \"reason\": " + json_string(reason) + ", \"cause\": " + json_string(cause) +
      ", \"rank\": " + std::to_string(rank) + ", \"world_size\": " + std::to_string(world) +
      ", \"host\": " + json_string(flight_host()) + ", \"pid\": " + std::to_string(::getpid()) +
      ", \"time_ns\": " + std::to_string(unix_now) + ", \"communicators\": [";
  bool first = true;
  for (const auto& ring : rings) {
    out += first ? "\n  " : ",\n  ";
    first = false;
    append_ring_json(out, *ring, offset);
  }
  return out + "]}\n";
}

/// Writes `text` to `path` whole (a temporary file beside it, then a rename); false on any error.
/// Never throws.
inline bool write_file_whole(const std::string& path, std::string_view text) noexcept {
  try {
    const std::string temporary = path + ".tmp";
    const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return false;
    bool ok = true;
    while (!text.empty()) {
      const auto n = ::write(fd, text.data(), text.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        ok = false;
        break;
      }
      text.remove_prefix(static_cast<std::size_t>(n));
    }
    ok = ::close(fd) == 0 && ok;
    if (ok && ::rename(temporary.c_str(), path.c_str()) == 0) return true;
    ::unlink(temporary.c_str());
    return false;
  } catch (...) {
    return false;
  }
}

}  // namespace tandem::detail
