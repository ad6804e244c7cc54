// CompletionThread: one per device. Observes when events the daemon recorded after its work
// complete (DeviceApi::QueryEvent, polled with a short backoff) and then runs what was waiting for
// them, so that no transfer worker ever waits on device work (docs/design.md "Completion: ticket
// slots" and event rules").
//
// Callbacks run on this thread and must be short: they release staging and hand the rest of the
// task to a transfer worker (TaskHooks::defer); they never block. A query that reports a sticky
// device error fails the device: `on_sticky` runs once, and every entry, watched or yet to be
// watched, completes at once with that failure (no later query is made).
// Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "backends/device_api.h"
#include "hiqcache/status.h"

namespace hiqcache::server {

class CompletionThread {
 public:
  using Done = std::function<void(const Status&)>;
  // `api` must outlive the thread. `on_sticky(status)` runs on this thread, at most once; it
  // returns the status the failed entries complete with.
  CompletionThread(DeviceApi* api, int device, std::function<Status(const Status&)> on_sticky);
  // REQUIRES: no entry is watched any more (the pools of this device are closed). Entries still
  // watched (device work that never completed) are leaked with a warning: their callbacks never
  // run, and what they hold is left to the process's exit.
  ~CompletionThread();
  CompletionThread(const CompletionThread&) = delete;
  CompletionThread& operator=(const CompletionThread&) = delete;

  // Runs done(OK) once the most recent record of `event`, which the caller made just before, has
  // completed; done(error) when the query fails. `event` must stay valid until `done` ran, and
  // must not be recorded again before that.
  void Watch(DeviceEvent event, Done done);
  // Completes every entry now and from now on with `failure` (another call saw a sticky error).
  void FailAll(const Status& failure);
  size_t watched() const;

 private:
  struct Entry {
    DeviceEvent event;
    Done done;
  };
  void Loop();

  DeviceApi* const api_;
  const int device_;
  const std::function<Status(const Status&)> on_sticky_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Entry> entries_;  // GUARDED_BY(mu_)
  bool stop_ = false;           // GUARDED_BY(mu_)
  bool kicked_ = false;         // GUARDED_BY(mu_): a new entry came; poll at once
  Status failure_;              // GUARDED_BY(mu_): set once the device failed
  std::thread thread_;
};

}  // namespace hiqcache::server
