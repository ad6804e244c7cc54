#include "transport/connection_gate.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "hiqcache/log.h"
#include "transport/unix_listen.h"

namespace hiqcache::server {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kRecountEvery = std::chrono::seconds(1);
constexpr auto kRefusalLogEvery = std::chrono::seconds(10);
// epoll tags of the wake and listen fds (duplicates are tagged with their fd, below 2^31).
constexpr uint64_t kWakeTag = uint64_t{1} << 62;
constexpr uint64_t kListenTag = uint64_t{1} << 63;

// How many of this process's fds name each socket inode ("socket:[N]" in /proc/self/fd).
std::unordered_map<uint64_t, uint32_t> HeldSocketInodes() {
  std::unordered_map<uint64_t, uint32_t> inodes;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return inodes;
  const int dfd = ::dirfd(dir);
  char link[64];
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    const ssize_t n = ::readlinkat(dfd, e->d_name, link, sizeof(link) - 1);
    if (n <= 8 || std::memcmp(link, "socket:[", 8) != 0) continue;
    link[n] = '\0';
    inodes[std::strtoull(link + 8, nullptr, 10)] += 1;
  }
  ::closedir(dir);
  return inodes;
}

}  // namespace

ConnectionGate::ConnectionGate(const ConnectionLimits& limits, IsAdmin is_admin)
    : limits_(limits), is_admin_(std::move(is_admin)) {}

StatusOr<std::unique_ptr<ConnectionGate>> ConnectionGate::Listen(
    const std::vector<std::string>& paths, const ConnectionLimits& limits, mode_t mode, gid_t gid,
    IsAdmin is_admin) {
  std::unique_ptr<ConnectionGate> g(new ConnectionGate(limits, std::move(is_admin)));
  g->epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  g->wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  g->reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (g->epoll_fd_ < 0 || g->wake_fd_ < 0 || g->reserve_fd_ < 0) {
    return Internal(std::string("connection gate: ") + std::strerror(errno));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kWakeTag;
  if (::epoll_ctl(g->epoll_fd_, EPOLL_CTL_ADD, g->wake_fd_, &ev) != 0) {
    return Internal(std::string("connection gate: epoll_ctl: ") + std::strerror(errno));
  }
  for (const std::string& path : paths) {
    // Owner-only until ListenUnix gives it the group and mode; accepted only after Start.
    HIQ_ASSIGN_OR_RETURN(int fd, ListenUnix(path, SOCK_STREAM, 1024, mode, gid));
    g->listen_fds_.push_back(fd);
    g->paths_.push_back(path);
    ev.events = EPOLLIN;
    ev.data.u64 = kListenTag | static_cast<uint32_t>(fd);
    if (::epoll_ctl(g->epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      return Internal(std::string("connection gate: epoll_ctl: ") + std::strerror(errno));
    }
  }
  return g;
}

ConnectionGate::~ConnectionGate() {
  if (wake_fd_ >= 0) {
    uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
  }
  if (loop_.joinable()) loop_.join();
  for (int fd : listen_fds_) ::close(fd);
  for (const auto& p : paths_) ::unlink(p.c_str());
  // The duplicates only: the connections themselves stay gRPC's.
  for (const auto& [dup, t] : open_) ::close(dup);
  for (int fd : {wake_fd_, reserve_fd_, epoll_fd_}) {
    if (fd >= 0) ::close(fd);
  }
}

void ConnectionGate::Start(HandOff hand_off, HasSession has_session) {
  hand_off_ = std::move(hand_off);
  has_session_ = std::move(has_session);
  loop_ = std::thread([this] { Loop(); });
}

void ConnectionGate::Loop() {
  std::vector<epoll_event> events(256);
  std::vector<int> ready;
  for (;;) {
    const int n = ::epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      HIQ_LOG(ERROR) << "connection gate: epoll_wait: " << std::strerror(errno);
      return;
    }
    // Hang-ups first, so that a connection accepted in this round sees them counted.
    ready.clear();
    {
      MutexLock lock(&mu_);
      for (int i = 0; i < n; ++i) {
        const uint64_t tag = events[i].data.u64;
        if (tag == kWakeTag) return;
        if (tag & kListenTag) {
          ready.push_back(static_cast<int>(tag & 0xffffffffu));
        } else {
          ForgetLocked(static_cast<int>(tag));
        }
      }
    }
    for (int fd : ready) Accept(fd);
  }
}

void ConnectionGate::ForgetLocked(int dup) {
  auto it = open_.find(dup);
  if (it == open_.end()) return;
  auto u = per_uid_.find(it->second.uid);
  if (u != per_uid_.end() && --u->second == 0) per_uid_.erase(u);
  open_.erase(it);
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, dup, nullptr);
  ::close(dup);
}

void ConnectionGate::RecountLocked() {
  last_recount_ = Clock::now();
  const auto held = HeldSocketInodes();
  std::vector<int> gone;
  for (const auto& [dup, t] : open_) {
    auto it = held.find(t.inode);
    if (it == held.end() || it->second < 2) gone.push_back(dup);  // only our duplicate left
  }
  for (int dup : gone) ForgetLocked(dup);
}

bool ConnectionGate::FitsLocked(const ucred& peer, bool* admin_checked, bool* admin) {
  auto it = per_uid_.find(peer.uid);
  const size_t of_uid = it == per_uid_.end() ? 0 : it->second;
  if (of_uid >= limits_.max_connections_per_uid) return false;
  if (open_.size() < limits_.max_connections) return true;
  if (open_.size() >= limits_.max_connections + limits_.admin_reserve) return false;
  if (!*admin_checked) {  // asked only here: it reads /proc and may read the user's groups
    *admin = is_admin_ && is_admin_(peer);
    *admin_checked = true;
  }
  return *admin;
}

void ConnectionGate::Refuse(int fd, const ucred& peer) {
  {
    MutexLock lock(&mu_);
    auto it = per_uid_.find(peer.uid);
    const size_t of_uid = it == per_uid_.end() ? 0 : it->second;
    auto& last = last_refusal_log_[peer.uid];
    uint64_t& unlogged = unlogged_refusals_[peer.uid];
    ++unlogged;
    if (Clock::now() - last >= kRefusalLogEvery) {
      HIQ_LOG(WARN) << "event=connection_refused pid=" << peer.pid << " uid=" << peer.uid
                    << " of_uid=" << of_uid << " open=" << open_.size()
                    << " refused_since_last_log=" << unlogged << " (max_connections_per_uid "
                    << limits_.max_connections_per_uid << ", max_connections "
                    << limits_.max_connections << ")";
      last = Clock::now();
      unlogged = 0;
    }
  }
  ::close(fd);
}

void ConnectionGate::Accept(int listen_fd) {
  for (;;) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if ((errno == EMFILE || errno == ENFILE) && reserve_fd_ >= 0) {
        // Out of descriptors: take the connection off the backlog with the reserve and close
        // it, rather than leave it queued (and the listen fd ready) until something closes.
        ::close(reserve_fd_);
        reserve_fd_ = -1;
        int shed = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
        if (shed >= 0) ::close(shed);
        reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
        HIQ_LOG(WARN) << "event=connection_refused reason=out_of_descriptors";
        continue;
      }
      if (reserve_fd_ < 0) reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      return;  // EAGAIN: the backlog is empty (or an error this loop cannot fix)
    }
    ucred peer{};
    socklen_t len = sizeof(peer);
    struct stat st;
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0 || ::fstat(fd, &st) != 0) {
      ::close(fd);
      continue;
    }
    bool admin_checked = false, admin = false;
    int dup = -1;
    {
      MutexLock lock(&mu_);
      bool fits = FitsLocked(peer, &admin_checked, &admin);
      if (!fits && Clock::now() - last_recount_ >= kRecountEvery) {
        RecountLocked();
        fits = FitsLocked(peer, &admin_checked, &admin);
      }
      if (fits) dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (dup >= 0) {
        epoll_event ev{};
        ev.events = EPOLLRDHUP;  // EPOLLHUP and EPOLLERR come anyway; never EPOLLIN (gRPC reads)
        ev.data.u64 = static_cast<uint32_t>(dup);
        if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, dup, &ev) != 0) {
          ::close(dup);
          dup = -1;
        } else {
          open_[dup] = Tracked{static_cast<uint64_t>(st.st_ino), peer.uid};
          per_uid_[peer.uid] += 1;
        }
      }
    }
    if (dup < 0) {
      Refuse(fd, peer);
      continue;
    }
    hand_off_(fd, has_session_ && !has_session_(peer));
  }
}

}  // namespace hiqcache::server
