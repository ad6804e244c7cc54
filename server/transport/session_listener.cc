#include "transport/session_listener.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pwd.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "hiqcache/log.h"
#include "hiqcache/session_protocol.h"
#include "transport/peer_placement.h"
#include "transport/unix_listen.h"

namespace hiqcache::server {
namespace {

void CloseAll(const std::map<uint64_t, int>& fds) {
  for (const auto& [id, fd] : fds) ::close(fd);
}

std::string HexToken() {
  uint8_t raw[16];
  size_t got = 0;
  while (got < sizeof(raw)) {
    ssize_t n = ::getrandom(raw + got, sizeof(raw) - got, 0);
    if (n > 0)
      got += static_cast<size_t>(n);
    else if (errno != EINTR)
      break;
  }
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (uint8_t b : raw) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}

// The supplementary groups of `uid`'s user (empty when it has no passwd entry).
std::vector<gid_t> GroupsOf(uid_t uid, gid_t gid) {
  std::vector<char> buf(16384);
  struct passwd pw;
  struct passwd* found = nullptr;
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) != 0 || found == nullptr) return {};
  int n = 64;
  std::vector<gid_t> groups(n);
  if (::getgrouplist(found->pw_name, gid, groups.data(), &n) < 0) {
    groups.resize(n);
    if (::getgrouplist(found->pw_name, gid, groups.data(), &n) < 0) return {};
  }
  groups.resize(n);
  return groups;
}

}  // namespace

SessionListener::TakenFds::~TakenFds() { CloseAll(fds_); }

int SessionListener::TakenFds::Get(uint64_t id) const {
  auto it = fds_.find(id);
  return it == fds_.end() ? -1 : it->second;
}

SessionListener::SessionListener(SessionOptions options, EndFn on_end)
    : options_(std::move(options)),
      on_end_(std::move(on_end)),
      own_pod_(PlacementOf(::getpid()).pod) {}

StatusOr<std::unique_ptr<SessionListener>> SessionListener::Bind(
    const std::vector<std::string>& paths, const SessionOptions& options, EndFn on_end) {
  std::unique_ptr<SessionListener> l(new SessionListener(options, std::move(on_end)));
  l->wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (l->wake_fd_ < 0)
    return Internal(std::string("session socket: eventfd: ") + std::strerror(errno));
  for (const std::string& path : paths) {
    // The gRPC socket beside it was checked not to be served by another daemon: a socket file
    // here is a stale one.
    HIQ_ASSIGN_OR_RETURN(int fd,
                         BindUnix(path, SOCK_SEQPACKET, options.socket_mode, options.socket_gid));
    l->listen_fds_.push_back(fd);
    l->paths_.push_back(path);
  }
  return l;
}

Status SessionListener::Open() {
  if (loop_.joinable()) return FailedPrecondition("session socket: already open");
  for (size_t i = 0; i < listen_fds_.size(); ++i) {
    if (::listen(listen_fds_[i], 128) != 0) {
      return FailedPrecondition("listen: " + paths_[i] + ": " + std::strerror(errno));
    }
  }
  loop_ = std::thread([this] { Loop(); });
  releaser_ = std::thread([this] { ReleaseLoop(); });
  return Status::Ok();
}

StatusOr<std::unique_ptr<SessionListener>> SessionListener::Start(
    const std::vector<std::string>& paths, const SessionOptions& options, EndFn on_end) {
  HIQ_ASSIGN_OR_RETURN(auto l, Bind(paths, options, std::move(on_end)));
  HIQ_RETURN_IF_ERROR(l->Open());
  return l;
}

SessionListener::~SessionListener() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  ended_cv_.NotifyAll();
  if (wake_fd_ >= 0) {
    uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
  }
  if (loop_.joinable()) loop_.join();
  if (releaser_.joinable()) releaser_.join();
  for (auto& [id, s] : sessions_) {
    CloseAll(s->fds);
    ::close(s->fd);
  }
  for (int fd : listen_fds_) ::close(fd);
  for (const auto& p : paths_) ::unlink(p.c_str());
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

bool SessionListener::IsAdmin(uid_t uid, gid_t gid) const {
  if (uid == 0 || uid == ::geteuid()) return true;
  const auto& u = options_.admin_uids;
  if (std::find(u.begin(), u.end(), uid) != u.end()) return true;
  if (options_.admin_gids.empty()) return false;
  std::vector<gid_t> groups = GroupsOf(uid, gid);
  groups.push_back(gid);
  for (gid_t g : groups) {
    const auto& a = options_.admin_gids;
    if (std::find(a.begin(), a.end(), g) != a.end()) return true;
  }
  return false;
}

bool SessionListener::MayAdminister(const PeerPlacement& where) const {
  return where.known && ((!where.in_container && where.pod.empty()) ||
                         (!own_pod_.empty() && where.pod == own_pod_));
}

bool SessionListener::IsAdminPeer(const ucred& cred) const {
  return IsAdmin(cred.uid, cred.gid) && MayAdminister(PlacementOf(cred.pid));
}

void SessionListener::Reply(int fd, const std::string& text) {
  // SEQPACKET: one message, never split; a full socket buffer (a client that reads nothing)
  // drops the reply rather than blocking the loop.
  (void)::send(fd, text.data(), text.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

void SessionListener::Accept(int listen_fd) {
  int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) return;
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    Reply(fd, "ERR SO_PEERCRED failed");
    ::close(fd);
    return;
  }
  const PeerPlacement where = PlacementOf(cred.pid);
  const bool admin = IsAdmin(cred.uid, cred.gid) && MayAdminister(where);
  MutexLock lock(&mu_);
  if (sessions_.size() >= options_.max_sessions ||
      per_uid_[cred.uid] >= options_.max_sessions_per_uid) {
    HIQ_LOG(WARN) << "event=session_refused pid=" << cred.pid << " uid=" << cred.uid
                  << " sessions=" << sessions_.size() << " of_uid=" << per_uid_[cred.uid];
    Reply(fd, "ERR too many sessions (max_sessions " + std::to_string(options_.max_sessions) +
                  ", per uid " + std::to_string(options_.max_sessions_per_uid) + ")");
    ::close(fd);
    return;
  }
  auto s = std::make_unique<Session>();
  s->id = next_session_++;
  s->fd = fd;
  s->caller.session = s->id;
  s->caller.pid = static_cast<uint32_t>(cred.pid);
  s->caller.uid = cred.uid;
  s->caller.gid = cred.gid;
  s->caller.admin = admin;
  s->caller.pod = where.pod;
  do {
    s->token = HexToken();
  } while (by_token_.count(s->token) != 0);
  Reply(fd, std::string(kSessionGreeting) + "token=" + s->token +
                " pid=" + std::to_string(cred.pid) + " uid=" + std::to_string(cred.uid) +
                " gid=" + std::to_string(cred.gid));
  HIQ_LOG(DEBUG) << "event=session_open session=" << s->id << " pid=" << cred.pid
                 << " uid=" << cred.uid << " admin=" << admin << " pod=\"" << LogSafe(where.pod)
                 << "\"";
  per_uid_[cred.uid] += 1;
  per_process_[{cred.uid, cred.pid}] += 1;
  by_token_[s->token] = s->id;
  sessions_[s->id] = std::move(s);
}

bool SessionListener::Serve(Session* s) {
  char buf[kMaxSessionMessageBytes];
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  iovec iov{buf, sizeof(buf)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n = ::recvmsg(s->fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (n < 0) return errno == EAGAIN || errno == EINTR;
  std::vector<int> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds.push_back(fd);
    }
  }
  auto refuse = [&](const std::string& why) {
    for (int fd : fds) ::close(fd);
    Reply(s->fd, "ERR " + why);
    return true;
  };
  if (n == 0 && fds.empty()) return false;  // orderly close
  if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
    return refuse("message or fds truncated: at most " + std::to_string(kMaxFdsPerMessage) +
                  " fds and " + std::to_string(kMaxSessionMessageBytes) + " bytes per message");
  }
  std::string_view text(buf, static_cast<size_t>(n));
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.remove_suffix(1);
  if (text != "FDS") return refuse("unknown message (expected \"FDS\" with fds attached)");
  if (fds.empty()) return refuse("FDS: no fds attached (SCM_RIGHTS)");
  MutexLock lock(&mu_);
  if (s->fds.size() + fds.size() > kMaxHeldFdsPerSession) {
    return refuse("FDS: this session would hold " + std::to_string(s->fds.size() + fds.size()) +
                  " unconsumed fds, at most " + std::to_string(kMaxHeldFdsPerSession) +
                  " (RegisterPool consumes the fds it names)");
  }
  size_t& uid_held = held_fds_per_uid_[s->caller.uid];
  if (uid_held + fds.size() > options_.max_held_fds_per_uid) {
    return refuse("FDS: uid " + std::to_string(s->caller.uid) + "'s sessions would hold " +
                  std::to_string(uid_held + fds.size()) + " unconsumed fds, at most " +
                  std::to_string(options_.max_held_fds_per_uid));
  }
  uid_held += fds.size();
  std::string reply = "OK";
  for (int fd : fds) {
    const uint64_t id = s->next_fd_id++;
    s->fds[id] = fd;
    reply += " " + std::to_string(id);
  }
  Reply(s->fd, reply);
  return true;
}

void SessionListener::ForgetHeldLocked(uid_t uid, size_t n) {
  auto it = held_fds_per_uid_.find(uid);
  if (it == held_fds_per_uid_.end()) return;
  it->second -= std::min(it->second, n);
  if (it->second == 0) held_fds_per_uid_.erase(it);
}

void SessionListener::EndLocked(uint64_t id) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  Session* s = it->second.get();
  CloseAll(s->fds);
  ForgetHeldLocked(s->caller.uid, s->fds.size());
  ::close(s->fd);
  by_token_.erase(s->token);
  if (--per_uid_[s->caller.uid] == 0) per_uid_.erase(s->caller.uid);
  const std::pair<uid_t, pid_t> process{s->caller.uid, static_cast<pid_t>(s->caller.pid)};
  if (--per_process_[process] == 0) per_process_.erase(process);
  HIQ_LOG(DEBUG) << "event=session_end session=" << id << " pid=" << s->caller.pid;
  sessions_.erase(it);
  ended_.push_back(id);
  ended_cv_.NotifyOne();
}

void SessionListener::Loop() {
  std::vector<pollfd> pfds;
  std::vector<uint64_t> ids;  // session id of pfds[i] beyond the listen fds and wake fd
  for (;;) {
    pfds.clear();
    ids.clear();
    pfds.push_back({wake_fd_, POLLIN, 0});
    for (int fd : listen_fds_) pfds.push_back({fd, POLLIN, 0});
    {
      MutexLock lock(&mu_);
      if (stop_) return;
      for (const auto& [id, s] : sessions_) {
        pfds.push_back({s->fd, POLLIN, 0});
        ids.push_back(id);
      }
    }
    int rc = ::poll(pfds.data(), pfds.size(), 1000);
    if (rc < 0 && errno != EINTR) {
      HIQ_LOG(ERROR) << "session sockets: poll: " << std::strerror(errno);
      return;
    }
    if (rc <= 0) continue;
    if (pfds[0].revents != 0) {
      MutexLock lock(&mu_);
      if (stop_) return;
    }
    const size_t first_session = 1 + listen_fds_.size();
    for (size_t i = 1; i < first_session; ++i) {
      if (pfds[i].revents & POLLIN) Accept(pfds[i].fd);
    }
    for (size_t i = first_session; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      const uint64_t id = ids[i - first_session];
      Session* s;
      {
        MutexLock lock(&mu_);
        auto it = sessions_.find(id);
        if (it == sessions_.end()) continue;
        s = it->second.get();  // only this thread ends sessions: stays valid below
      }
      bool keep = (pfds[i].revents & POLLIN) ? Serve(s) : false;
      if (keep && (pfds[i].revents & (POLLHUP | POLLERR)) && !(pfds[i].revents & POLLIN)) {
        keep = false;
      }
      if (!keep) {
        MutexLock lock(&mu_);
        EndLocked(id);
      }
    }
  }
}

void SessionListener::ReleaseLoop() {
  MutexLock lock(&mu_);
  for (;;) {
    ended_cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return stop_ || !ended_.empty(); });
    if (stop_) return;
    const uint64_t id = ended_.front();
    ended_.pop_front();
    lock.Unlock();
    if (on_end_) on_end_(id);
    lock.Lock();
  }
}

Caller SessionListener::Authenticate(std::string_view token) const {
  MutexLock lock(&mu_);
  auto it = by_token_.find(std::string(token));
  if (it == by_token_.end()) return Caller{};
  return sessions_.at(it->second)->caller;
}

SessionListener::TakenFds SessionListener::TakeFds(uint64_t session,
                                                   const std::vector<uint64_t>& ids) {
  TakenFds out;
  MutexLock lock(&mu_);
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return out;
  for (uint64_t id : ids) {
    auto f = it->second->fds.find(id);
    if (f == it->second->fds.end()) continue;
    out.fds_[id] = f->second;
    it->second->fds.erase(f);
  }
  ForgetHeldLocked(it->second->caller.uid, out.fds_.size());
  return out;
}

size_t SessionListener::SessionCount() const {
  MutexLock lock(&mu_);
  return sessions_.size();
}

bool SessionListener::HasSession(const ucred& peer) const {
  MutexLock lock(&mu_);
  return per_process_.count({peer.uid, peer.pid}) != 0;
}

}  // namespace hiqcache::server
