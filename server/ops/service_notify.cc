#include "ops/service_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "hiqcache/log.h"

namespace hiqcache::server {
namespace {

// Parses a decimal environment value; 0 when unset or malformed.
uint64_t EnvUint(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  errno = 0;
  unsigned long long n = std::strtoull(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0') return 0;
  return n;
}

}  // namespace

ServiceNotifier ServiceNotifier::FromEnvironment() {
  const char* sock = std::getenv("NOTIFY_SOCKET");
  std::string socket = sock != nullptr ? sock : "";
  // Only a filesystem path or an abstract name is a valid address (sd_notify(3)).
  if (!socket.empty() && socket[0] != '/' && socket[0] != '@') {
    HIQ_LOG(WARN) << "NOTIFY_SOCKET=" << socket << ": not a path or @abstract name; ignored";
    socket.clear();
  }
  std::chrono::microseconds watchdog{0};
  const uint64_t usec = EnvUint("WATCHDOG_USEC");
  const uint64_t pid = EnvUint("WATCHDOG_PID");
  // WATCHDOG_PID names the process the manager expects pings from; another one must not ping.
  if (usec != 0 && (pid == 0 || pid == static_cast<uint64_t>(::getpid()))) {
    watchdog = std::chrono::microseconds(usec);
  }
  return ServiceNotifier(std::move(socket), watchdog);
}

ServiceNotifier::ServiceNotifier(std::string socket, std::chrono::microseconds watchdog)
    : socket_(std::move(socket)),
      watchdog_(socket_.empty() ? std::chrono::microseconds(0) : watchdog) {}

ServiceNotifier::~ServiceNotifier() { StopWatchdog(); }

Status ServiceNotifier::Notify(std::string_view state) const {
  if (!enabled()) return Status::Ok();
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  if (socket_.size() >= sizeof(sa.sun_path)) {
    return InvalidArgument("NOTIFY_SOCKET: address longer than " +
                           std::to_string(sizeof(sa.sun_path) - 1) + " bytes");
  }
  std::memcpy(sa.sun_path, socket_.data(), socket_.size());
  socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + socket_.size());
  if (socket_[0] == '@') {
    sa.sun_path[0] = '\0';  // abstract namespace: the name is exactly the bytes after '@'
  } else {
    len += 1;  // the terminating NUL of a path
  }
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Internal(std::string("NOTIFY_SOCKET: socket: ") + std::strerror(errno));
  ssize_t sent;
  do {
    sent = ::sendto(fd, state.data(), state.size(), MSG_NOSIGNAL,
                    reinterpret_cast<const sockaddr*>(&sa), len);
  } while (sent < 0 && errno == EINTR);
  const int err = errno;
  ::close(fd);
  if (sent < 0) {
    return Unavailable("NOTIFY_SOCKET " + socket_ + ": sendto: " + std::strerror(err));
  }
  return Status::Ok();
}

namespace {
// STATUS= is one line: a newline in the text would start another assignment.
std::string OneLine(std::string_view text) {
  std::string out(text);
  for (char& c : out) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return out;
}
}  // namespace

Status ServiceNotifier::Ready(std::string_view status) const {
  return Notify("READY=1\nSTATUS=" + OneLine(status));
}

Status ServiceNotifier::SetStatus(std::string_view status) const {
  return Notify("STATUS=" + OneLine(status));
}

Status ServiceNotifier::Stopping(std::string_view status) const {
  return Notify("STOPPING=1\nSTATUS=" + OneLine(status));
}

void ServiceNotifier::StartWatchdog(std::function<bool()> alive) {
  if (!enabled() || watchdog_.count() == 0 || watchdog_thread_.joinable()) return;
  const auto period = watchdog_ / 2;
  watchdog_thread_ = std::thread([this, period, alive = std::move(alive)] {
    MutexLock lock(&mu_);
    bool warned = false;
    while (!stop_) {
      lock.Unlock();
      if (!alive || alive()) {
        Status st = Notify("WATCHDOG=1");
        if (!st.ok() && !warned) {
          HIQ_LOG(WARN) << "watchdog ping: " << st.ToString();
          warned = true;
        }
      } else {
        HIQ_LOG(ERROR) << "liveness check failed: watchdog ping withheld";
      }
      lock.Lock();
      cv_.WaitFor(&mu_, period, [this]() REQUIRES(mu_) { return stop_; });
    }
  });
}

void ServiceNotifier::StopWatchdog() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  if (watchdog_thread_.joinable()) watchdog_thread_.join();
}

}  // namespace hiqcache::server
