// tandem/launch/detail/process.hpp - process plumbing under tandemrun and tandem::spawn: owned
// fds and pipes, a forked child in its own process group that dies with its parent, exit statuses.
//   auto child = tandem::launch::detail::fork_child({}, [] { return 0; });   // ~Child reaps it
// Needs: POSIX and Linux (fork, pipe2, prctl, signalfd); dlopen for the CUDA probes.
#pragma once

#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/core/fd.hpp"

namespace tandem::launch::detail {

using tandem::detail::errno_text;
using tandem::detail::Fd;

struct Pipe {
  Fd read;
  Fd write;
};

/// A close-on-exec pipe; the child side is dup2'ed onto its target, which clears the flag there.
inline Pipe make_pipe(const char* what) {
  std::array<int, 2> ends{};
  if (::pipe2(ends.data(), O_CLOEXEC) < 0) throw Error(what, "pipe2: " + errno_text(errno));
  return {Fd(ends[0]), Fd(ends[1])};
}

inline void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

/// Writes all of `bytes` to a blocking descriptor; false when the descriptor is gone (EPIPE...).
inline bool write_all(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    const auto n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    bytes.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

/// "SIGSEGV", or "signal 42" for one without a common name.
inline std::string signal_name(int signal) {
  static constexpr std::array<std::pair<int, const char*>, 20> names{{
      {SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"}, {SIGILL, "SIGILL"},
      {SIGTRAP, "SIGTRAP"}, {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},
      {SIGKILL, "SIGKILL"}, {SIGUSR1, "SIGUSR1"}, {SIGSEGV, "SIGSEGV"}, {SIGUSR2, "SIGUSR2"},
      {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"}, {SIGCHLD, "SIGCHLD"},
      {SIGXCPU, "SIGXCPU"}, {SIGXFSZ, "SIGXFSZ"}, {SIGSYS, "SIGSYS"},   {SIGSTOP, "SIGSTOP"},
  }};
  for (const auto& [number, name] : names) {
    if (number == signal) return name;
  }
  return "signal " + std::to_string(signal);
}

/// How a process ended: an exit code, or the signal that killed it.
struct ExitStatus {
  int code = 0;
  int signal = 0;  ///< 0 when the process exited

  static ExitStatus from_wait_status(int status) {
    if (WIFSIGNALED(status)) return {0, WTERMSIG(status)};
    return {WIFEXITED(status) ? WEXITSTATUS(status) : 1, 0};
  }
  [[nodiscard]] bool failed() const noexcept { return signal != 0 || code != 0; }
  /// Python's Popen.returncode, as torchrun prints it: the code, or minus the signal.
  [[nodiscard]] int torch_exitcode() const noexcept { return signal != 0 ? -signal : code; }
  /// "exit code 3" or "signal SIGSEGV (11)".
  [[nodiscard]] std::string describe() const {
    if (signal != 0) return "signal " + signal_name(signal) + " (" + std::to_string(signal) + ")";
    return "exit code " + std::to_string(code);
  }
};

/// What a forked child sets up before it runs its body.
struct ChildSetup {
  int stdout_fd = -1;                     ///< dup2'ed onto 1 when set
  int stderr_fd = -1;                     ///< dup2'ed onto 2 when set
  const sigset_t* signal_mask = nullptr;  ///< restored in the child (the parent may block some)
};

/// A child process in its own process group. The destructor of one still running kills its
/// group with SIGKILL and reaps it, so no child outlives its owner. Move-only.
class Child {
 public:
  Child() = default;
  explicit Child(pid_t pid) noexcept : pid_(pid) {}
  Child(Child&& other) noexcept
      : pid_(std::exchange(other.pid_, -1)), ended_(other.ended_), status_(other.status_) {}
  Child& operator=(Child&& other) noexcept {
    if (this != &other) {
      kill_and_reap();
      pid_ = std::exchange(other.pid_, -1);
      ended_ = other.ended_;
      status_ = other.status_;
    }
    return *this;
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() { kill_and_reap(); }

  [[nodiscard]] pid_t pid() const noexcept { return pid_; }
  [[nodiscard]] bool ended() const noexcept { return ended_; }
  [[nodiscard]] const ExitStatus& status() const noexcept { return status_; }

  /// Reaps the child if it has ended (never blocks); true once it has.
  bool poll() {
    if (ended_ || pid_ < 0) return ended_;
    int status = 0;
    pid_t got = 0;
    do {
      got = ::waitpid(pid_, &status, WNOHANG);
    } while (got < 0 && errno == EINTR);
    if (got == pid_) {
      ended_ = true;
      status_ = ExitStatus::from_wait_status(status);
    } else if (got < 0) {
      // ECHILD: someone else reaped it (a SIGCHLD set to SIG_IGN); its status is lost.
      ended_ = true;
      status_ = {1, 0};
    }
    return ended_;
  }

  /// Sends `signal` to the child's process group (its own children too), or to the child alone
  /// should the group not exist yet. Nothing once the child has been reaped: its pid may be reused.
  void signal(int signal) const noexcept {
    if (ended_ || pid_ < 0) return;
    if (::kill(-pid_, signal) < 0) ::kill(pid_, signal);
  }

 private:
  void kill_and_reap() noexcept {
    if (pid_ < 0 || ended_) return;
    signal(SIGKILL);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    ended_ = true;
  }

  pid_t pid_ = -1;
  bool ended_ = false;
  ExitStatus status_{};
};

/// Forks a child that runs `body()` and exits with what it returns (through _exit: the parent's
/// atexit handlers and static destructors are the parent's business). The child gets its own
/// process group (so that a terminal's Ctrl-C reaches only the parent, which forwards it) and
/// PR_SET_PDEATHSIG=SIGKILL (so that it cannot outlive the thread that forked it).
template <class Body>
Child fork_child(const ChildSetup& setup, Body&& body) {
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw Error("fork", errno_text(errno));
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    // The parent may have died before prctl: then no signal would ever come.
    if (::getppid() != parent) ::_exit(128 + SIGKILL);
    if (setup.signal_mask != nullptr) ::sigprocmask(SIG_SETMASK, setup.signal_mask, nullptr);
    if (setup.stdout_fd >= 0 && ::dup2(setup.stdout_fd, STDOUT_FILENO) < 0) ::_exit(127);
    if (setup.stderr_fd >= 0 && ::dup2(setup.stderr_fd, STDERR_FILENO) < 0) ::_exit(127);
    ::_exit(body());
  }
  // Also here, so that a signal sent to the group right after fork cannot miss it.
  ::setpgid(pid, pid);
  return Child(pid);
}

/// NUL-terminated copies of strings in the form execve wants, built before fork (a child of a
/// threaded parent should not allocate).
class CStringArray {
 public:
  explicit CStringArray(const std::vector<std::string>& strings) : strings_(strings) {
    for (auto& s : strings_) pointers_.push_back(s.data());
    pointers_.push_back(nullptr);
  }
  [[nodiscard]] char* const* get() const noexcept { return pointers_.data(); }

 private:
  std::vector<std::string> strings_;
  std::vector<char*> pointers_;
};

/// Forks and execs `command` (searched on PATH) with exactly `environment` ("KEY=value").
/// A program that cannot be run is a tandem::Error here rather than an exit code 127 later.
inline Child exec_child(const std::vector<std::string>& command,
                        const std::vector<std::string>& environment, const ChildSetup& setup) {
  if (command.empty()) throw Error("exec", "no program to run");
  const CStringArray argv(command);
  const CStringArray envp(environment);
  auto report = make_pipe("exec");
  const int report_fd = report.write.get();
  Child child = fork_child(setup, [&] {
    ::execvpe(argv.get()[0], argv.get(), envp.get());
    const int error = errno;
    [[maybe_unused]] const auto n = ::write(report_fd, &error, sizeof error);
    return 127;
  });
  report.write.reset();
  int error = 0;
  ssize_t n = 0;
  do {
    n = ::read(report.read.get(), &error, sizeof error);
  } while (n < 0 && errno == EINTR);
  if (n == static_cast<ssize_t>(sizeof error)) {
    throw Error("exec", "cannot run '" + command.front() + "': " + errno_text(error));
  }
  return child;  // the read saw end-of-file: the exec succeeded and closed the report pipe
}

/// The signals a launcher forwards to its workers, blocked and read from a signalfd while this
/// object lives; the previous mask comes back on destruction. Children restore `original_mask`.
class SignalCatcher {
 public:
  SignalCatcher() {
    sigset_t set;
    sigemptyset(&set);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaddset(&set, sig);
    if (::pthread_sigmask(SIG_BLOCK, &set, &original_) != 0) {
      throw Error("signals", "pthread_sigmask failed");
    }
    fd_.reset(::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK));
    if (!fd_) {
      const int error = errno;
      ::pthread_sigmask(SIG_SETMASK, &original_, nullptr);
      throw Error("signals", "signalfd: " + errno_text(error));
    }
  }
  SignalCatcher(const SignalCatcher&) = delete;
  SignalCatcher& operator=(const SignalCatcher&) = delete;
  ~SignalCatcher() { ::pthread_sigmask(SIG_SETMASK, &original_, nullptr); }

  [[nodiscard]] int fd() const noexcept { return fd_.get(); }
  [[nodiscard]] const sigset_t& original_mask() const noexcept { return original_; }

  /// The next caught signal, if any (never blocks).
  std::optional<int> take() {
    signalfd_siginfo info{};
    const auto n = ::read(fd_.get(), &info, sizeof info);
    if (n != static_cast<ssize_t>(sizeof info)) return std::nullopt;
    return static_cast<int>(info.ssi_signo);
  }

 private:
  sigset_t original_{};
  Fd fd_;
};

/// A TCP port on 127.0.0.1 that was free a moment ago (the system's pick for port 0).
inline std::uint16_t free_port() {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) throw Error("free_port", "socket: " + errno_text(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof address;
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address) < 0 ||
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&address), &length) < 0) {
    throw Error("free_port", errno_text(errno));
  }
  return ntohs(address.sin_port);
}

/// The longest job token tandemrun passes on (TcpStore's limit).
inline constexpr std::size_t max_token_bytes = 1024;

/// 32 bytes from the kernel's random source (getrandom), as 64 hex digits: a job token.
inline std::string random_token() {
  std::array<std::uint8_t, 32> bytes{};
  std::size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = ::getrandom(bytes.data() + got, bytes.size() - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Error("rdzv-token", "getrandom: " + errno_text(errno));
    got += static_cast<std::size_t>(n);
  }
  static constexpr char digits[] = "0123456789abcdef";
  std::string text;
  for (const auto byte : bytes) {
    text += digits[byte >> 4];
    text += digits[byte & 0x0f];
  }
  return text;
}

/// The job token in a file (--rdzv-token-file): its bytes less one final newline. The file must
/// be a regular file holding 1 to max_token_bytes bytes; it is never waited on.
inline std::string read_token_file(const std::string& path) {
  const std::string flag = "--rdzv-token-file";
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
  if (!fd) throw Error(flag, "cannot open " + path + ": " + errno_text(errno));
  struct stat info {};
  if (::fstat(fd.get(), &info) < 0 || !S_ISREG(info.st_mode)) {
    throw Error(flag, path + " is not a regular file");
  }
  std::string token(max_token_bytes + 3, '\0');
  std::size_t got = 0;
  while (got < token.size()) {
    const ssize_t n = ::read(fd.get(), token.data() + got, token.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Error(flag, "cannot read " + path + ": " + errno_text(errno));
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  token.resize(got);
  if (token.ends_with('\n')) token.pop_back();
  if (token.ends_with('\r')) token.pop_back();
  if (token.empty()) throw Error(flag, path + " is empty");
  if (token.size() > max_token_bytes) {
    throw Error(flag, path + " holds more than " + std::to_string(max_token_bytes) + " bytes");
  }
  return token;
}

/// A random version-4 UUID in its usual text form, as torchrun's --standalone run id.
inline std::string unique_id() {
  std::random_device source;
  std::array<std::uint8_t, 16> bytes{};
  for (auto& byte : bytes) byte = static_cast<std::uint8_t>(source());
  bytes[6] = static_cast<std::uint8_t>((bytes[6] & 0x0f) | 0x40);
  bytes[8] = static_cast<std::uint8_t>((bytes[8] & 0x3f) | 0x80);
  static constexpr char digits[] = "0123456789abcdef";
  std::string text;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) text += '-';
    text += digits[bytes[i] >> 4];
    text += digits[bytes[i] & 0x0f];
  }
  return text;
}

inline std::string host_name() {
  std::array<char, 256> name{};
  if (::gethostname(name.data(), name.size() - 1) < 0) return "localhost";
  return name.data();
}

inline int cpu_count() {
  const long count = ::sysconf(_SC_NPROCESSORS_ONLN);
  return count > 0 ? static_cast<int>(count) : 1;
}

// The CUDA driver API's entry points, looked up at run time so that nothing links CUDA.
using cu_init_fn = int (*)(unsigned int);
using cu_device_get_count_fn = int (*)(int*);
inline constexpr int cuda_success = 0;

/// The number of GPUs the CUDA driver sees (honouring CUDA_VISIBLE_DEVICES); 0 without a
/// driver, a GPU, or on any error. This initialises CUDA in the calling process, so the
/// launcher calls it (its children exec), never tandem::spawn.
inline int cuda_device_count() {
  // Deliberately never closed: unloading an initialised driver is not supported.
  void* library = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) return 0;
  auto init = reinterpret_cast<cu_init_fn>(::dlsym(library, "cuInit"));
  auto count = reinterpret_cast<cu_device_get_count_fn>(::dlsym(library, "cuDeviceGetCount"));
  int devices = 0;
  if (init == nullptr || count == nullptr || init(0) != cuda_success) return 0;
  if (count(&devices) != cuda_success) return 0;
  return devices;
}

/// Whether this process has initialised CUDA (a forked child could not use it). Loads nothing:
/// without libcuda.so.1 already in the process the answer is no; with it, cuDeviceGetCount
/// answers CUDA_ERROR_NOT_INITIALIZED until cuInit has succeeded.
inline bool cuda_initialised() {
  void* library = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (library == nullptr) return false;
  auto count = reinterpret_cast<cu_device_get_count_fn>(::dlsym(library, "cuDeviceGetCount"));
  int devices = 0;
  const bool initialised = count != nullptr && count(&devices) == cuda_success;
  ::dlclose(library);
  return initialised;
}

}  // namespace tandem::launch::detail
