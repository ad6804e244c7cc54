#include "session_watcher.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <utility>

#include "hiqcache/log.h"

namespace hiqcache::client_internal {
namespace {

using Clock = std::chrono::steady_clock;

constexpr short kEnded = POLLHUP | POLLRDHUP | POLLERR | POLLNVAL;

}  // namespace

StatusOr<std::unique_ptr<SessionWatcher>> SessionWatcher::Start(std::string target) {
  const int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (fd < 0) return Internal(std::string("session watcher: eventfd: ") + std::strerror(errno));
  std::unique_ptr<SessionWatcher> watcher(new SessionWatcher(std::move(target), fd));
  try {
    watcher->thread_ = std::make_unique<std::thread>([w = watcher.get()] { w->Run(); });
  } catch (const std::system_error& e) {
    return Internal(std::string("session watcher: cannot start its thread: ") + e.what());
  }
  return watcher;
}

SessionWatcher::SessionWatcher(std::string target, int wake_fd)
    : target_(std::move(target)), wake_fd_(wake_fd), owner_pid_(::getpid()) {}

SessionWatcher::~SessionWatcher() {
  if (thread_ != nullptr && ::getpid() != owner_pid_) {
    // A forked child: the thread exists only in the parent, which still owns it.
    (void)thread_.release();
  } else if (thread_ != nullptr) {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    Wake();
    thread_->join();
  }
  ::close(wake_fd_);
}

void SessionWatcher::Wake() const {
  const uint64_t one = 1;
  ssize_t n;
  do {
    n = ::write(wake_fd_, &one, sizeof(one));
  } while (n < 0 && errno == EINTR);
  // EAGAIN: the counter is saturated, so the thread is woken anyway.
}

void SessionWatcher::Watch(std::shared_ptr<Session> session, std::shared_ptr<PoolSlots> slots) {
  if (session == nullptr || slots == nullptr) return;
  {
    MutexLock lock(&mu_);
    auto it = std::find_if(entries_.begin(), entries_.end(),
                           [&](const Entry& e) { return e.session == session; });
    if (it == entries_.end()) {
      entries_.push_back(Entry{std::move(session), {}, {}, false, {}});
      it = std::prev(entries_.end());
    }
    if (std::find(it->pools.begin(), it->pools.end(), slots) != it->pools.end()) return;
    // An entry that has ended already releases the pool in its second pass.
    it->highest.push_back(slots->highest());
    it->pools.push_back(std::move(slots));
  }
  Wake();
}

void SessionWatcher::Release(const Entry& entry, bool first) const {
  uint32_t written = 0;
  size_t pools = 0;
  uint64_t top = 0;
  for (size_t i = 0; i < entry.pools.size(); ++i) {
    if (entry.pools[i]->forgotten()) continue;
    written += entry.pools[i]->FailBelow(entry.highest[i]);
    top = std::max(top, entry.highest[i]);
    ++pools;
  }
  if (written > 0 || first) {
    HIQ_LOG(WARN) << "hiqcache client: session with hiqcached at " << target_ << " ended; "
                  << (first ? "first" : "second") << " pass stored the failed bit into " << written
                  << " slots of " << pools << " pools (highest ticket " << top
                  << "): their waiters treat the rows as a miss";
  }
}

void SessionWatcher::Run() {
  std::vector<pollfd> fds;
  std::vector<std::shared_ptr<Session>> polled;  // keeps each polled fd open during poll()
  for (;;) {
    fds.assign(1, pollfd{wake_fd_, POLLIN, 0});
    polled.clear();
    int timeout_ms = -1;
    {
      MutexLock lock(&mu_);
      if (stop_) return;
      const auto now = Clock::now();
      for (Entry& e : entries_) {
        for (size_t i = e.pools.size(); i-- > 0;) {
          if (e.pools[i]->forgotten()) {
            e.pools.erase(e.pools.begin() + static_cast<std::ptrdiff_t>(i));
            e.highest.erase(e.highest.begin() + static_cast<std::ptrdiff_t>(i));
          }
        }
      }
      std::erase_if(entries_, [](const Entry& e) { return e.pools.empty(); });
      for (const Entry& e : entries_) {
        if (e.ended) {
          const auto left =
              std::chrono::ceil<std::chrono::milliseconds>(e.second_pass - now).count();
          const int ms = static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
          timeout_ms = timeout_ms < 0 ? ms : std::min(timeout_ms, ms);
        } else {
          fds.push_back(pollfd{e.session->poll_fd(), POLLRDHUP, 0});
          polled.push_back(e.session);
        }
      }
    }
    const int n = ::poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) {
      HIQ_LOG(WARN) << "hiqcache client: session watcher: poll: " << std::strerror(errno);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    if (n > 0 && (fds[0].revents & POLLIN) != 0) {
      uint64_t count;
      (void)::read(wake_fd_, &count, sizeof(count));
    }
    MutexLock lock(&mu_);
    if (stop_) return;
    const auto now = Clock::now();
    for (size_t k = 1; n > 0 && k < fds.size(); ++k) {
      if ((fds[k].revents & kEnded) == 0) continue;
      for (Entry& e : entries_) {
        if (e.session != polled[k - 1] || e.ended) continue;
        e.ended = true;
        e.second_pass = now + kSecondPass;
        for (size_t i = 0; i < e.pools.size(); ++i) e.highest[i] = e.pools[i]->highest();
        Release(e, /*first=*/true);
      }
    }
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->ended && now >= it->second_pass) {
        Release(*it, /*first=*/false);
        it = entries_.erase(it);
      } else {
        ++it;
      }
    }
  }
}

}  // namespace hiqcache::client_internal
