#include "backends/device_completion.h"

#include <algorithm>

#include "hiqcache/log.h"

namespace hiqcache::server {
namespace {

// Polling backoff: a completion is seen within ~kMinPoll of the device finishing while work
// completes steadily, and an idle wait costs at most one query per kMaxPoll per entry.
constexpr auto kMinPoll = std::chrono::microseconds(10);
constexpr auto kMaxPoll = std::chrono::microseconds(1000);

}  // namespace

CompletionThread::CompletionThread(DeviceApi* api, int device,
                                   std::function<Status(const Status&)> on_sticky)
    : api_(api), device_(device), on_sticky_(std::move(on_sticky)) {
  thread_ = std::thread([this] { Loop(); });
}

CompletionThread::~CompletionThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  if (!entries_.empty()) {
    HIQ_LOG(WARN) << "device " << device_ << ": completion thread stops with " << entries_.size()
                  << " completion(s) still pending (device work that never completed)";
    // Their callbacks hold tasks whose pools use this device: destroying them here would tear
    // those down in the middle of the backend's destruction. They are left to the process exit.
    new std::vector<Entry>(std::move(entries_));
  }
}

void CompletionThread::Watch(DeviceEvent event, Done done) {
  Status failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.ok()) {
      entries_.push_back({event, std::move(done)});
      kicked_ = true;
      cv_.notify_all();
      return;
    }
    failed = failure_;
  }
  done(failed);
}

void CompletionThread::FailAll(const Status& failure) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_.ok()) failure_ = failure;
  kicked_ = true;
  cv_.notify_all();
}

size_t CompletionThread::watched() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

void CompletionThread::Loop() {
  auto poll = kMinPoll;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (stop_) return;
    if (entries_.empty()) {
      cv_.wait(lock, [&] { return stop_ || !entries_.empty(); });
      poll = kMinPoll;
      continue;
    }
    std::vector<Entry> batch;
    batch.swap(entries_);
    kicked_ = false;
    Status failure = failure_;
    lock.unlock();
    // Query outside the lock: Watch never waits behind a driver call.
    std::vector<std::pair<Done, Status>> ready;
    std::vector<Entry> still;
    for (Entry& e : batch) {
      if (!failure.ok()) {
        ready.emplace_back(std::move(e.done), failure);
        continue;
      }
      StatusOr<bool> q = api_->QueryEvent(device_, e.event);
      if (q.ok() && !*q) {
        still.push_back(std::move(e));
        continue;
      }
      Status st = q.status();
      if (!q.ok() && IsStickyDeviceError(st)) {
        failure = on_sticky_(st);
        st = failure;
      }
      ready.emplace_back(std::move(e.done), st);
    }
    for (auto& [done, st] : ready) done(st);
    lock.lock();
    if (!failure.ok() && failure_.ok()) failure_ = failure;
    // Entries watched meanwhile came after these: keep the order (each pool has at most one).
    still.insert(still.end(), std::make_move_iterator(entries_.begin()),
                 std::make_move_iterator(entries_.end()));
    entries_.swap(still);
    if (!ready.empty() || kicked_ || !failure_.ok()) {
      poll = kMinPoll;
      continue;
    }
    cv_.wait_for(lock, poll, [&] { return stop_ || kicked_; });
    poll = std::min(kMaxPoll, poll * 2);
  }
}

}  // namespace hiqcache::server
