#include "connection_gate.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <unordered_set>

#include "hiqcache/log.h"
#include "unix_listen.h"

namespace hiqcache::server {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kRecountEvery = std::chrono::milliseconds(200);
constexpr auto kRefusalLogEvery = std::chrono::seconds(10);
constexpr size_t kMaxDeferred = 64;
constexpr size_t kMaxDeferredPerUid = 2;

// The inodes of the sockets this process holds open ("socket:[N]" links in /proc/self/fd).
std::unordered_set<uint64_t> HeldSocketInodes() {
  std::unordered_set<uint64_t> inodes;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return inodes;
  const int dfd = ::dirfd(dir);
  char link[64];
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    const ssize_t n = ::readlinkat(dfd, e->d_name, link, sizeof(link) - 1);
    if (n <= 8 || std::memcmp(link, "socket:[", 8) != 0) continue;
    link[n] = '\0';
    inodes.insert(std::strtoull(link + 8, nullptr, 10));
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
  g->wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  g->reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (g->wake_fd_ < 0 || g->reserve_fd_ < 0) {
    return Internal(std::string("connection gate: ") + std::strerror(errno));
  }
  for (const std::string& path : paths) {
    // Owner-only until ListenUnix gives it the group and mode; accepted only after Start.
    HIQ_ASSIGN_OR_RETURN(int fd, ListenUnix(path, SOCK_STREAM, 1024, mode, gid));
    g->listen_fds_.push_back(fd);
    g->paths_.push_back(path);
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
  if (wake_fd_ >= 0) ::close(wake_fd_);
  if (reserve_fd_ >= 0) ::close(reserve_fd_);
}

void ConnectionGate::Start(HandOff hand_off) {
  hand_off_ = std::move(hand_off);
  loop_ = std::thread([this] { Loop(); });
}

size_t ConnectionGate::Open() const {
  std::lock_guard<std::mutex> lock(mu_);
  return open_.size();
}

void ConnectionGate::Loop() {
  std::vector<pollfd> pfds;
  pfds.push_back({wake_fd_, POLLIN, 0});
  for (int fd : listen_fds_) pfds.push_back({fd, POLLIN, 0});
  for (;;) {
    int timeout_ms = -1;
    if (!deferred_.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          last_recount_ + kRecountEvery - Clock::now());
      timeout_ms = static_cast<int>(std::max<int64_t>(1, left.count() + 1));
    }
    for (auto& p : pfds) p.revents = 0;
    if (::poll(pfds.data(), pfds.size(), timeout_ms) < 0 && errno != EINTR) {
      HIQ_LOG(ERROR) << "connection gate: poll: " << std::strerror(errno);
      return;
    }
    if (pfds[0].revents != 0) {
      for (const Pending& p : deferred_) ::close(p.fd);
      return;
    }
    if (!deferred_.empty()) DecideDeferred();
    for (size_t i = 1; i < pfds.size(); ++i) {
      if (pfds[i].revents & POLLIN) Accept(pfds[i].fd);
    }
  }
}

void ConnectionGate::RecountLocked() {
  last_recount_ = Clock::now();
  const std::unordered_set<uint64_t> held = HeldSocketInodes();
  for (auto it = open_.begin(); it != open_.end();) {
    if (held.count(it->first) != 0) {
      ++it;
      continue;
    }
    auto u = per_uid_.find(it->second);
    if (u != per_uid_.end() && --u->second == 0) per_uid_.erase(u);
    it = open_.erase(it);
  }
}

bool ConnectionGate::FitsLocked(const ucred& peer, bool* admin_checked, bool* admin) {
  auto it = per_uid_.find(peer.uid);
  const size_t of_uid = it == per_uid_.end() ? 0 : it->second;
  if (of_uid >= limits_.max_connections_per_uid) return false;
  if (open_.size() < limits_.max_connections) return true;
  if (open_.size() >= limits_.max_connections + limits_.admin_reserve) return false;
  if (!*admin_checked) {  // asked only here: it may read the user's groups
    *admin = is_admin_ && is_admin_(peer);
    *admin_checked = true;
  }
  return *admin;
}

void ConnectionGate::Refuse(const Pending& p) {
  refused_.fetch_add(1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = per_uid_.find(p.cred.uid);
    const size_t of_uid = it == per_uid_.end() ? 0 : it->second;
    auto& last = last_refusal_log_[p.cred.uid];
    uint64_t& unlogged = unlogged_refusals_[p.cred.uid];
    ++unlogged;
    if (Clock::now() - last >= kRefusalLogEvery) {
      HIQ_LOG(WARN) << "event=connection_refused pid=" << p.cred.pid << " uid=" << p.cred.uid
                    << " of_uid=" << of_uid << " open=" << open_.size()
                    << " refused_since_last_log=" << unlogged << " (max_connections_per_uid "
                    << limits_.max_connections_per_uid << ", max_connections "
                    << limits_.max_connections << ")";
      last = Clock::now();
      unlogged = 0;
    }
  }
  ::close(p.fd);
}

void ConnectionGate::Admit(const Pending& p) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    open_[p.inode] = p.cred.uid;
    per_uid_[p.cred.uid] += 1;
  }
  hand_off_(p.fd);
}

void ConnectionGate::DecideDeferred() {
  std::vector<Pending> admit, refuse;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (Clock::now() - last_recount_ < kRecountEvery) return;
    RecountLocked();
    for (Pending& p : deferred_) {
      if (FitsLocked(p.cred, &p.admin_checked, &p.admin)) {
        // Counted now, so that the next deferred one of the same uid sees it.
        open_[p.inode] = p.cred.uid;
        per_uid_[p.cred.uid] += 1;
        admit.push_back(p);
      } else {
        refuse.push_back(p);
      }
    }
  }
  deferred_.clear();
  deferred_per_uid_.clear();
  for (const Pending& p : admit) hand_off_(p.fd);
  for (const Pending& p : refuse) Refuse(p);
}

void ConnectionGate::Accept(int listen_fd) {
  for (;;) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if ((errno == EMFILE || errno == ENFILE) && reserve_fd_ >= 0) {
        // Out of descriptors: take the connection off the backlog with the reserve and close
        // it, rather than leave it queued (and poll ready) until something else closes.
        ::close(reserve_fd_);
        reserve_fd_ = -1;
        int shed = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
        if (shed >= 0) ::close(shed);
        reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
        refused_.fetch_add(1, std::memory_order_relaxed);
        HIQ_LOG(WARN) << "event=connection_refused reason=out_of_descriptors";
        continue;
      }
      if (reserve_fd_ < 0) reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      return;  // EAGAIN: the backlog is empty (or an error this loop cannot fix)
    }
    Pending p;
    p.fd = fd;
    socklen_t len = sizeof(p.cred);
    struct stat st;
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &p.cred, &len) != 0 || ::fstat(fd, &st) != 0) {
      ::close(fd);
      continue;
    }
    p.inode = static_cast<uint64_t>(st.st_ino);
    bool fits, may_recount;
    {
      std::lock_guard<std::mutex> lock(mu_);
      fits = FitsLocked(p.cred, &p.admin_checked, &p.admin);
      may_recount = Clock::now() - last_recount_ >= kRecountEvery;
      if (!fits && may_recount) {
        RecountLocked();
        fits = FitsLocked(p.cred, &p.admin_checked, &p.admin);
      }
    }
    if (fits) {
      Admit(p);
    } else if (!may_recount && deferred_.size() < kMaxDeferred &&
               deferred_per_uid_[p.cred.uid] < kMaxDeferredPerUid) {
      // Counted too recently to know whether others closed since: decided at the next count.
      deferred_per_uid_[p.cred.uid] += 1;
      deferred_.push_back(p);
    } else {
      Refuse(p);
    }
  }
}

}  // namespace hiqcache::server
