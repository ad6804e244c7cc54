#include "hiqcache/session.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <string_view>

#include "hiqcache/session_protocol.h"
#include "hiqcache/socket_trust.h"

namespace hiqcache {
namespace {

using Clock = std::chrono::steady_clock;

std::string ErrnoText(int err) { return std::strerror(err); }

// Milliseconds left until `deadline` for poll(), at least 0.
int PollMs(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, 1 << 30));
}

// Waits until `fd` is readable; UNAVAILABLE on timeout or hang-up without data.
Status WaitReadable(int fd, Clock::time_point deadline, const std::string& path) {
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    const int n = ::poll(&p, 1, PollMs(deadline));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Unavailable("session " + path + ": poll: " + ErrnoText(errno));
    if (n == 0) return Unavailable("session " + path + ": no answer from hiqcached in time");
    if (p.revents & POLLIN) return Status::Ok();
    return Unavailable("session " + path + ": closed by hiqcached");
  }
}

// Receives one packet (a whole message: SOCK_SEQPACKET keeps boundaries).
StatusOr<std::string> RecvMessage(int fd, Clock::time_point deadline, const std::string& path) {
  HIQ_RETURN_IF_ERROR(WaitReadable(fd, deadline, path));
  std::string buf(kMaxSessionMessageBytes, '\0');
  for (;;) {
    const ssize_t n = ::recv(fd, buf.data(), buf.size(), MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Unavailable("session " + path + ": recv: " + ErrnoText(errno));
    if (n == 0) return Unavailable("session " + path + ": closed by hiqcached");
    buf.resize(static_cast<size_t>(n));
    while (!buf.empty() && (buf.back() == '\n' || buf.back() == '\0')) buf.pop_back();
    return buf;
  }
}

bool ParseU64(std::string_view s, uint64_t* out) {
  if (s.empty()) return false;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

std::vector<std::string_view> Words(std::string_view s) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && s[i] == ' ') ++i;
    const size_t start = i;
    while (i < s.size() && s[i] != ' ') ++i;
    if (i > start) out.push_back(s.substr(start, i - start));
  }
  return out;
}

// Shortens what the daemon sent for an error text (it may be anything).
std::string Quote(std::string_view s) {
  std::string out;
  for (char c : s.substr(0, 200)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  return "\"" + out + (s.size() > 200 ? "...\"" : "\"");
}

}  // namespace

Session::Session(int fd, std::string path, std::chrono::milliseconds timeout)
    : fd_(fd), path_(std::move(path)), timeout_(timeout) {}

Session::~Session() { ::close(fd_); }

StatusOr<std::unique_ptr<Session>> Session::Open(const std::string& target,
                                                 std::chrono::milliseconds timeout) {
  const std::string path = !target.empty() && target.front() == '/'
                               ? target + std::string(kSessionSocketSuffix)
                               : SessionSocketPathForTarget(target);
  if (path.empty()) {
    return FailedPrecondition("target \"" + target +
                              "\": no session (only unix socket targets have one)");
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return InvalidArgument("target \"" + target + "\": session socket path " + path +
                           " is longer than " + std::to_string(sizeof(addr.sun_path) - 1) +
                           " bytes");
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  const auto deadline = Clock::now() + timeout;
  // Nothing (no fd, no token, not even a connect) goes to a listener this process does not
  // trust as its daemon (socket_trust.h): checked on the directory and both socket files first,
  // then on the connected peer.
  HIQ_ASSIGN_OR_RETURN(const std::vector<uint32_t> trusted, TrustedDaemonUids(path));
  HIQ_RETURN_IF_ERROR(
      CheckSocketOwner(path.substr(0, path.size() - kSessionSocketSuffix.size()), trusted));
  HIQ_RETURN_IF_ERROR(CheckSocketOwner(path, trusted));

  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return Internal("session " + path + ": socket: " + ErrnoText(errno));
  std::unique_ptr<Session> session(new Session(fd, path, timeout));  // owns fd from here
  // A unix connect blocks only while the listener's backlog is full, for at most SO_SNDTIMEO.
  const auto ms = std::max<int64_t>(timeout.count(), 1);
  timeval tv{static_cast<time_t>(ms / 1000), static_cast<suseconds_t>(ms % 1000 * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  int rc;
  do {
    rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    return Unavailable("session " + path + ": connect: " + ErrnoText(err) +
                       (err == ENOENT || err == ECONNREFUSED
                            ? " (hiqcached not running, or too old to serve sessions)"
                            : ""));
  }
  HIQ_RETURN_IF_ERROR(CheckPeerUid(fd, trusted, path));

  HIQ_ASSIGN_OR_RETURN(std::string greeting, RecvMessage(fd, deadline, path));
  if (greeting == "ERR" || std::string_view(greeting).starts_with("ERR ")) {
    const std::string why = "session " + path + ": hiqcached refused the session: " +
                            Quote(std::string_view(greeting).substr(greeting.size() > 4 ? 4 : 3));
    if (greeting.find("too many") != std::string::npos) return ResourceExhausted(why);
    return FailedPrecondition(why);
  }
  if (!std::string_view(greeting).starts_with(kSessionGreeting)) {
    return FailedPrecondition("session " + path + ": unexpected greeting " + Quote(greeting) +
                              " (want \"" + std::string(kSessionGreeting) + "...\")");
  }
  bool have_pid = false, have_uid = false, have_gid = false;
  for (std::string_view w : Words(std::string_view(greeting).substr(kSessionGreeting.size()))) {
    const size_t eq = w.find('=');
    if (eq == std::string_view::npos) continue;  // later versions may add bare words
    const std::string_view key = w.substr(0, eq), value = w.substr(eq + 1);
    uint64_t v = 0;
    if (key == "token") {
      session->token_ = std::string(value);
    } else if (key == "pid" || key == "uid" || key == "gid") {
      if (!ParseU64(value, &v) || v > UINT32_MAX) {
        return FailedPrecondition("session " + path + ": greeting field " + std::string(key) +
                                  " is not a number: " + Quote(greeting));
      }
      (key == "pid"   ? session->pid_
       : key == "uid" ? session->uid_
                      : session->gid_) = static_cast<uint32_t>(v);
      (key == "pid" ? have_pid : key == "uid" ? have_uid : have_gid) = true;
    }
  }
  if (session->token_.empty() || !have_pid || !have_uid || !have_gid) {
    return FailedPrecondition("session " + path +
                              ": greeting lacks token, pid, uid or gid: " + Quote(greeting));
  }
  return session;
}

StatusOr<std::vector<uint64_t>> Session::SendFds(std::span<const int> fds) {
  std::vector<uint64_t> ids;
  ids.reserve(fds.size());
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t first = 0; first < fds.size(); first += kMaxFdsPerMessage) {
    const size_t n = std::min(kMaxFdsPerMessage, fds.size() - first);
    static constexpr char kFds[] = "FDS";
    iovec iov{const_cast<char*>(kFds), sizeof(kFds) - 1};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * n);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * n);
    std::memcpy(CMSG_DATA(c), fds.data() + first, sizeof(int) * n);
    ssize_t sent;
    do {
      sent = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    if (sent < 0) {
      const int err = errno;
      if (err == EBADF) {
        return InvalidArgument("fds: one of fds[" + std::to_string(first) + ".." +
                               std::to_string(first + n - 1) + "] is not an open descriptor");
      }
      return Unavailable("session " + path_ + ": sendmsg: " + ErrnoText(err));
    }
    HIQ_ASSIGN_OR_RETURN(std::string answer, RecvMessage(fd_, Clock::now() + timeout_, path_));
    const std::string_view a(answer);
    if (a == "ERR" || a.starts_with("ERR ")) {
      const std::string why =
          "session " + path_ + ": hiqcached refused fds: " + Quote(a.size() > 4 ? a.substr(4) : "");
      // Refusals over a bound ("... at most N ...": held fds, fds per message) are exhaustion.
      if (a.find("at most") != std::string_view::npos ||
          a.find("too many") != std::string_view::npos) {
        return ResourceExhausted(why);
      }
      return FailedPrecondition(why);
    }
    std::vector<std::string_view> words = Words(a);
    if (words.empty() || words[0] != "OK" || words.size() != n + 1) {
      return Unavailable("session " + path_ + ": unexpected answer " + Quote(a) + " to " +
                         std::to_string(n) + " fds");
    }
    for (size_t i = 1; i < words.size(); ++i) {
      uint64_t id = 0;
      if (!ParseU64(words[i], &id) || id == 0) {
        return Unavailable("session " + path_ + ": bad fd id in answer " + Quote(a));
      }
      ids.push_back(id);
    }
  }
  return ids;
}

bool Session::alive() const {
  pollfd p{fd_, POLLRDHUP, 0};
  int n;
  do {
    n = ::poll(&p, 1, 0);
  } while (n < 0 && errno == EINTR);
  return n == 0 || (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)) == 0;
}

}  // namespace hiqcache
