// CompletionThread: one per daemon stream whose completion the backend observes (CudaBackend:
// one per pool and direction). It waits for the events the daemon recorded after its work on
// that stream, in the order they were watched, by blocking in DeviceApi::SynchronizeEvent on
// events created with CreateBlockingEvent (cudaEventSynchronize on a cudaEventBlockingSync
// event: the thread sleeps until the device signals the event; nothing is polled), and then runs
// what was waiting for them, so that no transfer worker ever waits on device work
// (docs/design.md "Completion: ticket slots").
//
// The events of one thread must be recorded on one stream, in the order they are watched: they
// then complete in that order, and waiting for the oldest first delays no completion. Events of
// other streams go to other threads, so that a long backup never delays the observed completion
// of a restore.
//
// Callbacks run on this thread and must be short: they release staging and hand the rest of the
// task to a transfer worker (TaskHooks::defer); they never block. A wait that reports a sticky
// device error fails the device: `on_sticky` runs once per thread that saw it (the device's
// failure runs once: CudaBackend), and every entry watched or yet to be watched completes with
// that failure. FailAll (another call saw the device fail) does the same, at once for every entry
// but the one whose wait is in progress, which completes with the failure when its wait returns
// (on a lost context every wait returns the error).
// Thread-safe.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <thread>

#include "backends/device_api.h"
#include "hiqcache/mutex.h"
#include "hiqcache/status.h"
#include "hiqcache/thread_annotations.h"

namespace hiqcache::server {

class CompletionThread {
 public:
  using Done = std::function<void(const Status&)>;
  // `api` must outlive the thread. `on_sticky(status)` runs on this thread; it returns the status
  // the failed entries complete with.
  CompletionThread(DeviceApi* api, int device, std::function<Status(const Status&)> on_sticky);
  // REQUIRES: no entry is watched any more (the pool's tasks completed). Entries still watched
  // (device work that never completed) are leaked with a warning, and so is the thread, which may
  // be blocked in a wait for them: their callbacks never run, and what they hold is left to the
  // process's exit.
  ~CompletionThread();
  CompletionThread(const CompletionThread&) = delete;
  CompletionThread& operator=(const CompletionThread&) = delete;

  // Runs done(OK) once the most recent record of `event` (a CreateBlockingEvent event), which
  // the caller made just before, has completed; done(error) when the wait fails. `event` must
  // stay valid until `done` ran, and must not be recorded again before that.
  void Watch(DeviceEvent event, Done done);
  // Completes every entry now and from now on with `failure` (another call saw a sticky error).
  void FailAll(const Status& failure);
  size_t watched() const;

 private:
  struct Entry {
    DeviceEvent event;
    Done done;
  };
  // What the thread uses: shared with it, so that a thread left blocked in a wait that never
  // returns (the destructor's leak) never touches freed memory.
  struct State {
    DeviceApi* api = nullptr;
    int device = -1;
    std::function<Status(const Status&)> on_sticky;
    mutable Mutex mu;
    CondVar cv;
    std::deque<Entry> entries GUARDED_BY(mu);  // in watch order; the first may be in a wait
    bool stop GUARDED_BY(mu) = false;
    Status failure GUARDED_BY(mu);  // set once the device failed
  };
  static void Loop(const std::shared_ptr<State>& state);

  std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace hiqcache::server
