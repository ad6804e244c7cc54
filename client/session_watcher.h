// SessionWatcher: releases an engine's waiters when its daemon dies (docs/design.md "A dead daemon
// releases the engine").
//
// One thread per Client blocks in poll() on the sessions its pools were registered through and on
// an eventfd that wakes it for a new watch or for shutdown. When a watched session's connection
// ends without the client closing it (the daemon exited, was killed or restarts), it takes each
// pool's highest answered ticket H at that moment and stores H | failed into the pool's daemon
// slots below H (PoolSlots::FailBelow), then once more kSecondPass later with the same H, since a
// device store of the dead daemon still in flight may land after the first pass.
//
// The client closes a session only by dropping it, and a watched session is held here, so a
// session ending while watched is always the daemon's doing. Destroying the watcher writes
// nothing.
//
// Fork: the thread holds no lock while it blocks, and its descriptors are CLOEXEC. A forked child
// has no thread: its copy watches nothing, and its destructor leaves the parent's thread alone.
//
// Thread-safety: Watch may be called from any thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "hiqcache/mutex.h"
#include "hiqcache/session.h"
#include "hiqcache/status.h"
#include "pool_slots.h"

namespace hiqcache::client_internal {

class SessionWatcher {
 public:
  static constexpr std::chrono::milliseconds kSecondPass{1000};

  // Starts the thread. `target` names the daemon in logs.
  static StatusOr<std::unique_ptr<SessionWatcher>> Start(std::string target);
  ~SessionWatcher();
  SessionWatcher(const SessionWatcher&) = delete;
  SessionWatcher& operator=(const SessionWatcher&) = delete;

  // Releases `slots` when `session` ends without the client closing it. Watching the same pair
  // again does nothing. Pools whose slots were forgotten (PoolSlots::Forget) are dropped.
  void Watch(std::shared_ptr<Session> session, std::shared_ptr<PoolSlots> slots);

 private:
  struct Entry {
    std::shared_ptr<Session> session;
    std::vector<std::shared_ptr<PoolSlots>> pools;
    std::vector<uint64_t> highest;  // per pool, taken when the session ended
    bool ended = false;
    std::chrono::steady_clock::time_point second_pass;
  };

  SessionWatcher(std::string target, int wake_fd);
  void Wake() const;
  void Run();
  // Stores the failed values of `entry`'s pools (its first or second pass). REQUIRES:
  // entry.ended.
  void Release(const Entry& entry, bool first) const REQUIRES(mu_);

  const std::string target_;
  const int wake_fd_;      // eventfd, CLOEXEC
  const pid_t owner_pid_;  // the process that runs the thread
  Mutex mu_;
  std::vector<Entry> entries_ GUARDED_BY(mu_);  // removed only by the thread
  bool stop_ GUARDED_BY(mu_) = false;
  std::unique_ptr<std::thread> thread_;
};

}  // namespace hiqcache::client_internal
