// tandem/io/detail/checkpoint_directory.hpp - a checkpoint directory claimed by one job at a time
// (rank 0's process): a lock file held with flock for the process's life, naming the job (run id,
// host, pid, start time) to any other job that tries; a probe write that finds an unwritable
// directory before the first step; temporary files of dead saves swept only while the lock proves
// their writers gone; and the rule that a job saves into a directory holding checkpoints only when
// it resumed from one of them (its own run's, then), so that it never overwrites or prunes
// another run's. checkpoint.hpp uses it on rank 0.
// Needs: POSIX (flock).
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/core/fd.hpp"
#include "tandem/io/detail/atomic_file.hpp"

namespace tandem::detail {

/// The lock file of the checkpoints named `prefix` in a directory.
inline std::string lock_file_name(const std::string& prefix) {
  return "." + prefix + "lock";
}

/// Whether `name` is a temporary file of a save (or a probe) of the checkpoints named `prefix`.
inline bool is_checkpoint_temporary(const std::string& name, const std::string& prefix) {
  return name.starts_with("." + prefix) &&
         name.find(".safetensors" + std::string(temporary_marker)) != std::string::npos;
}

/// This job as another job is told about it: "run R, host H, pid P, since T".
inline std::string job_description() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '?';
  const char* run = std::getenv("TORCHELASTIC_RUN_ID");
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  ::gmtime_r(&now, &utc);
  char since[32] = {};
  std::strftime(since, sizeof since, "%Y-%m-%d %H:%M:%S UTC", &utc);
  return std::string("run ") + (run && *run ? run : "(none)") + ", host " + host + ", pid " +
         std::to_string(::getpid()) + ", since " + since;
}

/// What this process knows of one checkpoint directory (and prefix).
struct DirectoryClaim {
  Fd lock;           // the lock file, flock'ed: the claim lasts as long as the process
  dev_t device = 0;  // the lock file's identity: a directory removed and made again is new
  ino_t inode = 0;
  bool claimed = false;            // rank 0 of a job in this process holds the directory
  bool resumed = false;            // a checkpoint of it was loaded: its checkpoints are this run's
  bool ownership_checked = false;  // its checkpoints were found to be this run's (or none)
};

/// The claims of this process, by directory and prefix (thread-safe: LocalComm's rank 0 is a
/// thread, and several jobs may run in one process one after another).
class DirectoryClaims {
 public:
  template <class F>
  decltype(auto) with(const std::filesystem::path& directory, const std::string& prefix, F&& f) {
    std::lock_guard guard(mutex_);
    return f(claims_[key(directory, prefix)]);
  }

 private:
  static std::string key(const std::filesystem::path& directory, const std::string& prefix) {
    std::error_code ignored;
    auto absolute = std::filesystem::weakly_canonical(directory, ignored);
    if (absolute.empty()) absolute = std::filesystem::absolute(directory, ignored);
    return absolute.lexically_normal().string() + '\n' + prefix;
  }

  std::mutex mutex_;
  std::map<std::string, DirectoryClaim> claims_;
};

inline DirectoryClaims& directory_claims() {
  static DirectoryClaims claims;
  return claims;
}

/// The text of the lock file (who holds it), or why it cannot be read.
inline std::string lock_holder(int fd) {
  char text[1024] = {};
  const ssize_t got = ::pread(fd, text, sizeof text - 1, 0);
  std::string holder = got > 0 ? std::string(text, static_cast<std::size_t>(got)) : "";
  while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
  return holder.empty() ? "a job that has not yet written who it is" : holder;
}

/// Takes the directory's lock for this process, or throws naming the job that holds it.
inline void take_lock(DirectoryClaim& claim, const std::filesystem::path& directory,
                      const std::string& prefix, const std::string& operation) {
  const auto path = directory / lock_file_name(prefix);
  Fd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666));  // the umask decides
  const bool writable = fd.valid();
  if (!fd && errno == EACCES) fd = Fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) {
    throw Error(operation, "cannot open the lock file " + path.string() + ": " + errno_text(errno) +
                               " (errno " + std::to_string(errno) + ")");
  }
  int status = 0;
  do {
    status = ::flock(fd.get(), LOCK_EX | LOCK_NB);
  } while (status != 0 && errno == EINTR);
  if (status != 0 && errno == EWOULDBLOCK) {
    throw Error(operation,
                "the directory is in use by another job (" + lock_holder(fd.get()) +
                    "; its lock: " + path.string() +
                    "). Two jobs saving into one directory would overwrite and prune each "
                    "other's checkpoints: give this job a directory of its own, or wait for that "
                    "one to end");
  }
  if (status != 0) {
    throw Error(operation, "cannot lock " + path.string() + ": " + errno_text(errno) +
                               " (this file system has no locks? CheckpointOptions::exclusive = "
                               "false saves without one; one job per directory is then yours "
                               "to ensure)");
  }
  if (writable) {
    const std::string who = job_description() + "\n";
    if (::ftruncate(fd.get(), 0) != 0 ||
        ::pwrite(fd.get(), who.data(), who.size(), 0) != static_cast<ssize_t>(who.size())) {
      throw Error(operation,
                  "cannot write the lock file " + path.string() + ": " + errno_text(errno));
    }
  }
  struct stat info {};
  ::fstat(fd.get(), &info);
  claim.device = info.st_dev;
  claim.inode = info.st_ino;
  claim.lock = std::move(fd);
}

/// Whether the lock this process holds is still the directory's lock file (not one of a directory
/// removed and made again under the same name).
inline bool lock_still_there(const DirectoryClaim& claim, const std::filesystem::path& directory,
                             const std::string& prefix) {
  struct stat info {};
  const auto path = directory / lock_file_name(prefix);
  return claim.lock.valid() && ::stat(path.c_str(), &info) == 0 && info.st_dev == claim.device &&
         info.st_ino == claim.inode;
}

/// A small file written, synced and removed in `directory`: an Error naming the directory and the
/// system's reason (EACCES, EROFS, ENOSPC, EDQUOT) before the first step rather than at the
/// first save.
inline void probe_write(const std::filesystem::path& directory, const std::string& prefix,
                        const std::string& operation) {
  std::string name;
  Fd fd = create_temporary_beside(directory / (prefix + "probe.safetensors"), name, operation);
  const std::vector<std::byte> block(4096, std::byte{0});
  std::string error = write_whole(fd.get(), block);
  if (error.empty() && ::fsync(fd.get()) != 0) error = errno_text(errno);
  fd.reset();
  const bool removed = ::unlink(name.c_str()) == 0;
  const int unlink_errno = errno;
  if (!error.empty()) {
    throw Error(operation, "cannot write a file in " + directory.string() + ": " + error);
  }
  if (!removed) {
    throw Error(operation, "cannot remove a file from " + directory.string() + ": " +
                               errno_text(unlink_errno) + " (old checkpoints could not be pruned)");
  }
}

/// Removes the temporary files of saves of `prefix` in `directory` (their writers are dead: this
/// process holds the lock every writer holds while it saves).
inline void sweep_dead_temporaries(const std::filesystem::path& directory,
                                   const std::string& prefix) {
  std::error_code ignored;
  for (const auto& entry : std::filesystem::directory_iterator(directory, ignored)) {
    if (is_checkpoint_temporary(entry.path().filename().string(), prefix)) {
      std::filesystem::remove(entry.path(), ignored);
    }
  }
}

/// Rank 0's claim on `directory` for the checkpoints named `prefix`: creates the directory, takes
/// its lock (unless `exclusive` is false), checks a file can be written there, and sweeps the
/// temporary files of dead saves. Once per process and directory; an Error(operation, cause)
/// naming the directory and the reason otherwise.
inline void claim_directory(const std::filesystem::path& directory, const std::string& prefix,
                            bool exclusive, const std::string& operation) {
  directory_claims().with(directory, prefix, [&](DirectoryClaim& claim) {
    if (claim.claimed && (!exclusive || lock_still_there(claim, directory, prefix))) return;
    if (claim.claimed) claim.ownership_checked = false;  // the directory was removed and made again
    claim.claimed = false;
    claim.lock.reset();
    std::error_code error;
    std::filesystem::create_directories(directory, error);
    if (error) {
      throw Error(operation, "cannot create the directory " + directory.string() + ": " +
                                 error.message() + " (errno " + std::to_string(error.value()) +
                                 ")");
    }
    if (!std::filesystem::is_directory(directory, error)) {
      throw Error(operation, directory.string() + " is not a directory");
    }
    if (exclusive) take_lock(claim, directory, prefix, operation);
    probe_write(directory, prefix, operation);
    if (exclusive) sweep_dead_temporaries(directory, prefix);
    claim.claimed = true;
  });
}

/// Records that this process loaded a checkpoint of `directory`: the checkpoints there are the
/// run it continues, which it may overwrite and prune.
inline void note_resumed_from(const std::filesystem::path& directory, const std::string& prefix) {
  directory_claims().with(directory, prefix, [](DirectoryClaim& claim) { claim.resumed = true; });
}

/// Rank 0, before its first save into `directory`: an Error when the directory holds
/// checkpoints (`count`, the newest `newest`) this job did not resume from: they are another
/// run's (or a finished run's), and saving would overwrite and prune them.
inline void check_ownership(const std::filesystem::path& directory, const std::string& prefix,
                            std::size_t count, const std::string& newest,
                            const std::string& operation) {
  directory_claims().with(directory, prefix, [&](DirectoryClaim& claim) {
    if (claim.ownership_checked) return;
    if (count != 0 && !claim.resumed) {
      throw Error(operation,
                  "the directory already holds " + std::to_string(count) +
                      " checkpoint(s) (the newest: " + newest +
                      ") that this run did not resume from; saving here would overwrite and "
                      "prune them. Resume from them (--resume, or load_checkpoint / "
                      "open_checkpoints with .resume = true), move them aside, or choose another "
                      "directory");
    }
    claim.ownership_checked = true;
  });
}

}  // namespace tandem::detail
