// DaemonProcess: starts the real hiqcached binary on a temporary unix socket with its own shm pool
// name, for integration tests and benchmarks. Header-only; one instance per daemon; not
// thread-safe.
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#ifndef HIQ_DAEMON_PATH
#error "HIQ_DAEMON_PATH must name the hiqcached binary"
#endif

namespace hiqcache::testing {

class DaemonProcess {
 public:
  // `pool_bytes` as the --pool-bytes flag takes it; extra flags appended verbatim.
  explicit DaemonProcess(std::string pool_bytes = "64MiB", std::vector<std::string> extra = {})
      : pool_bytes_(std::move(pool_bytes)), extra_(std::move(extra)) {
    static std::atomic<int> counter{0};
    const std::string tag = std::to_string(::getpid()) + "-" + std::to_string(counter++);
    dir_ = "/tmp/hiq-it-" + tag;
    std::filesystem::create_directories(dir_);
    // Owner-only writes whatever the umask: hiqcached refuses a directory others may write.
    ::chmod(dir_.c_str(), 0755);
    socket_path_ = dir_ + "/hiqcached.sock";
    shm_name_ = "/hiq-it-pool-" + tag;
  }
  ~DaemonProcess() {
    Kill();
    ::shm_unlink(shm_name_.c_str());
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  // Before Start: listen on `path` instead (its directory is the daemon's to create), and run
  // the daemon through `prefix` (e.g. it::AsUid's setpriv words: another user).
  void set_socket_path(std::string path) { socket_path_ = std::move(path); }
  void set_prefix(std::vector<std::string> prefix) { prefix_ = std::move(prefix); }

  std::string target() const { return "unix://" + socket_path_; }
  const std::string& socket_path() const { return socket_path_; }
  const std::string& shm_name() const { return shm_name_; }
  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0; }

  // Starts the daemon and waits until it serves: its session socket accepts connections (the
  // gRPC socket listens earlier, while the pool is pre-faulted). False on failure. The default
  // timeout holds for a sanitized daemon on a loaded machine.
  bool Start(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    std::vector<std::string> args = {HIQ_DAEMON_PATH, "--listen",    target(),
                                     "--pool-bytes",  pool_bytes_,   "--shm-name",
                                     shm_name_,       "--log-level", "warn"};
    args.insert(args.end(), extra_.begin(), extra_.end());
    args.insert(args.begin(), prefix_.begin(), prefix_.end());
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ == 0) {
      // A test that crashes or is killed by ctest's timeout takes its daemons with it (the
      // signal comes when the forking thread ends: tests start their daemons on the thread that
      // runs the test).
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) ::_exit(127);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    if (pid_ < 0) return false;
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      int status;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      if (Connectable(socket_path_ + ".session", SOCK_SEQPACKET)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  // SIGTERM and wait; returns the exit status (or -1).
  int Stop(std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    if (pid_ <= 0) return -1;
    ::kill(pid_, SIGTERM);
    auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    while (std::chrono::steady_clock::now() < deadline) {
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    Kill();
    return -1;
  }

  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  static bool Connectable(const std::string& path, int type) {
    int fd = ::socket(AF_UNIX, type, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::strncpy(sa.sun_path, path.c_str(), sizeof(sa.sun_path) - 1);
    bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0;
    ::close(fd);
    return ok;
  }

  std::string pool_bytes_;
  std::vector<std::string> extra_;
  std::vector<std::string> prefix_;
  std::string dir_;
  std::string socket_path_;
  std::string shm_name_;
  pid_t pid_ = -1;
};

// Starts a daemon with `flags_for(port)`, `port` a loopback TCP port from `next_port()` that was
// free when probed, for a daemon that listens on it (its metrics). Another process may take the
// port before the daemon binds it; such a daemon exits at once ("cannot listen"), and the next
// port is tried, up to `attempts` times. Answers the port and sets *out, or answers 0.
template <typename NextPort, typename FlagsFor>
int StartOnFreePort(std::unique_ptr<DaemonProcess>* out, const std::string& pool_bytes,
                    NextPort next_port, FlagsFor flags_for, int attempts = 5) {
  for (int attempt = 0; attempt < attempts; ++attempt) {
    const int port = next_port();
    if (port <= 0) continue;
    auto daemon = std::make_unique<DaemonProcess>(pool_bytes, flags_for(port));
    if (daemon->Start()) {
      *out = std::move(daemon);
      return port;
    }
  }
  return 0;
}

}  // namespace hiqcache::testing
