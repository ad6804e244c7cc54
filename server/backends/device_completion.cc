#include "backends/device_completion.h"

#include <utility>

#include "hiqcache/log.h"

namespace hiqcache::server {

CompletionThread::CompletionThread(DeviceApi* api, int device,
                                   std::function<Status(const Status&)> on_sticky)
    : state_(std::make_shared<State>()) {
  state_->api = api;
  state_->device = device;
  state_->on_sticky = std::move(on_sticky);
  thread_ = std::thread([state = state_] { Loop(state); });
}

CompletionThread::~CompletionThread() {
  size_t pending = 0;
  {
    MutexLock lock(&state_->mu);
    state_->stop = true;
    pending = state_->entries.size();
  }
  state_->cv.NotifyAll();
  if (pending == 0 && std::this_thread::get_id() != thread_.get_id()) {
    thread_.join();
    return;
  }
  if (pending == 0) {
    thread_.detach();  // destroyed from a callback of its own thread: it returns on its own
    return;
  }
  HIQ_LOG(WARN) << "device " << state_->device << ": completion thread stops with " << pending
                << " completion(s) still pending (device work that never completed)";
  // Their callbacks hold tasks whose pools use this device: destroying them here would tear
  // those down in the middle of the backend's destruction, and the thread may be blocked in a
  // wait for them. Both are left to the process's exit (the thread holds the state).
  thread_.detach();
}

void CompletionThread::Watch(DeviceEvent event, Done done) {
  Status failed;
  {
    MutexLock lock(&state_->mu);
    if (state_->failure.ok()) {
      state_->entries.push_back({event, std::move(done)});
      state_->cv.NotifyAll();
      return;
    }
    failed = state_->failure;
  }
  done(failed);
}

void CompletionThread::FailAll(const Status& failure) {
  MutexLock lock(&state_->mu);
  if (state_->failure.ok()) state_->failure = failure;
  state_->cv.NotifyAll();
}

size_t CompletionThread::watched() const {
  MutexLock lock(&state_->mu);
  return state_->entries.size();
}

void CompletionThread::Loop(const std::shared_ptr<State>& state) {
  State& s = *state;
  MutexLock lock(&s.mu);
  for (;;) {
    s.cv.Wait(&s.mu, [&]() REQUIRES(s.mu) { return s.stop || !s.entries.empty(); });
    if (s.stop) return;
    Status st = s.failure;
    if (st.ok()) {
      // Wait outside the lock: Watch and FailAll never wait behind the device.
      const DeviceEvent event = s.entries.front().event;
      lock.Unlock();
      st = s.api->SynchronizeEvent(s.device, event);
      if (!st.ok() && IsStickyDeviceError(st)) st = s.on_sticky(st);
      lock.Lock();
      if (!st.ok() && IsStickyDeviceError(st) && s.failure.ok()) s.failure = st;
      // FailAll while this wait was in progress: the device failed, whatever this wait saw.
      if (!s.failure.ok()) st = s.failure;
    }
    Done done = std::move(s.entries.front().done);
    s.entries.pop_front();
    lock.Unlock();
    done(st);
    lock.Lock();
  }
}

}  // namespace hiqcache::server
