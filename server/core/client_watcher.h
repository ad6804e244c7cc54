// ClientWatcher: notices engine processes that exit (or are killed) so their pools, mappings
// and pins are released within a fraction of a second, not at daemon shutdown.
//
// Polls pidfds (pidfd_open) of the processes that hold pools; where pidfds are unavailable it
// falls back to kill(pid, 0). Runs one background thread; thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <vector>

namespace hiqcache::server {

class ClientWatcher {
 public:
  using PidsFn = std::function<std::vector<uint32_t>()>;
  using ExitFn = std::function<void(uint32_t pid)>;
  // `pids` lists the processes to watch now; `on_exit` runs on the watcher thread.
  ClientWatcher(PidsFn pids, ExitFn on_exit, std::chrono::milliseconds period);
  ~ClientWatcher();

 private:
  void Loop();
  PidsFn pids_;
  ExitFn on_exit_;
  std::chrono::milliseconds period_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace hiqcache::server
