#include "core/client_watcher.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <map>

namespace hiqcache::server {
namespace {

int PidfdOpen(uint32_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
#else
  errno = ENOSYS;
  return -1;
#endif
}

}  // namespace

ClientWatcher::ClientWatcher(PidsFn pids, ExitFn on_exit, std::chrono::milliseconds period)
    : pids_(std::move(pids)), on_exit_(std::move(on_exit)), period_(period) {
  thread_ = std::thread([this] { Loop(); });
}

ClientWatcher::~ClientWatcher() {
  stop_.store(true);
  thread_.join();
}

void ClientWatcher::Loop() {
  std::map<uint32_t, int> fds;  // pid -> pidfd (-1: use kill(pid, 0))
  while (!stop_.load()) {
    std::vector<uint32_t> pids = pids_();
    std::map<uint32_t, int> next;
    std::vector<uint32_t> dead;
    for (uint32_t pid : pids) {
      auto it = fds.find(pid);
      int fd;
      if (it != fds.end()) {
        fd = it->second;
        fds.erase(it);
      } else {
        fd = PidfdOpen(pid);
        if (fd < 0 && errno == ESRCH) {
          dead.push_back(pid);
          continue;
        }
      }
      next[pid] = fd;
    }
    for (auto& [pid, fd] : fds) {
      if (fd >= 0) ::close(fd);  // no longer watched
    }
    fds.swap(next);
    std::vector<pollfd> pfds;
    std::vector<uint32_t> order;
    for (auto& [pid, fd] : fds) {
      if (fd >= 0) {
        pfds.push_back({fd, POLLIN, 0});
        order.push_back(pid);
      } else if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
        dead.push_back(pid);
      }
    }
    for (uint32_t pid : dead) {
      auto it = fds.find(pid);
      if (it != fds.end()) {
        if (it->second >= 0) ::close(it->second);
        fds.erase(it);
      }
      on_exit_(pid);
    }
    int timeout = static_cast<int>(period_.count());
    if (!pfds.empty()) {
      int n = ::poll(pfds.data(), pfds.size(), timeout);
      if (n > 0) {
        for (size_t i = 0; i < pfds.size(); ++i) {
          if (pfds[i].revents != 0) {
            ::close(pfds[i].fd);
            fds.erase(order[i]);
            on_exit_(order[i]);
          }
        }
      }
    } else {
      ::usleep(static_cast<useconds_t>(timeout) * 1000);
    }
  }
  for (auto& [pid, fd] : fds) {
    if (fd >= 0) ::close(fd);
  }
}

}  // namespace hiqcache::server
