#include "core/transfer_engine.h"

#include <algorithm>
#include <exception>
#include <new>

#include "hiqcache/log.h"

namespace hiqcache::server {

TransferEngine::TransferEngine(unsigned workers) {
  if (workers == 0) workers = 1;
  for (unsigned i = 0; i < workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

TransferEngine::~TransferEngine() {
  WaitIdle();
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  ready_cv_.NotifyAll();
  for (auto& t : workers_) t.join();
}

std::shared_ptr<TransferEngine::Strand> TransferEngine::NewStrand(uint64_t group) {
  auto strand = std::make_shared<Strand>();
  strand->group = group;
  return strand;
}

void TransferEngine::Post(const std::shared_ptr<Strand>& strand, Task task) {
  PostStep(strand, [task = std::move(task)] {
    task();
    return StepResult::kDone;
  });
}

void TransferEngine::PostRetryable(const std::shared_ptr<Strand>& strand, RetryableTask task) {
  PostStep(strand,
           [task = std::move(task)] { return task() ? StepResult::kDone : StepResult::kNotReady; });
}

void TransferEngine::ScheduleLocked(std::shared_ptr<Strand> strand) {
  strand->scheduled = true;
  PushReadyLocked(std::move(strand));
  ready_cv_.NotifyOne();
}

void TransferEngine::PushReadyLocked(std::shared_ptr<Strand> strand) {
  auto& q = ready_[strand->group];
  if (q.empty()) ready_groups_.push_back(strand->group);
  q.push_back(std::move(strand));
}

std::shared_ptr<TransferEngine::Strand> TransferEngine::PopReadyLocked() {
  const uint64_t group = ready_groups_.front();
  ready_groups_.pop_front();
  auto it = ready_.find(group);
  std::shared_ptr<Strand> strand = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) {
    ready_.erase(it);
  } else {
    ready_groups_.push_back(group);  // its other strands wait for the other groups' turns
  }
  return strand;
}

TransferEngine::StepResult TransferEngine::RunTask(StepTask& task) {
  try {
    return task();
  } catch (const std::bad_alloc&) {
    HIQ_LOG(ERROR) << "event=transfer_task_failed error=\"out of memory\" (task dropped)";
  } catch (const std::exception& e) {
    HIQ_LOG(ERROR) << "event=transfer_task_failed error=\"" << LogSafe(e.what())
                   << "\" (task dropped)";
  } catch (...) {
    HIQ_LOG(ERROR) << "event=transfer_task_failed error=\"unknown exception\" (task dropped)";
  }
  return StepResult::kDone;
}

void TransferEngine::PostStep(const std::shared_ptr<Strand>& strand, StepTask task) {
  MutexLock lock(&mu_);
  strand->tasks.push_back(std::move(task));
  ++pending_;
  if (!strand->scheduled) ScheduleLocked(strand);
}

void TransferEngine::PostSteps(const std::shared_ptr<Strand>& strand, std::vector<StepTask> tasks) {
  if (tasks.empty()) return;
  MutexLock lock(&mu_);
  const size_t before = strand->tasks.size();
  try {
    for (auto& t : tasks) strand->tasks.push_back(std::move(t));
  } catch (const std::bad_alloc&) {
    while (strand->tasks.size() > before) strand->tasks.pop_back();  // never allocates
    throw;
  }
  pending_ += tasks.size();
  if (!strand->scheduled) ScheduleLocked(strand);
}

void TransferEngine::Resume(const std::shared_ptr<Strand>& strand, Task continuation) {
  MutexLock lock(&mu_);
  if (strand->running) {
    // The detaching task has not returned yet: its worker picks the continuation up.
    strand->early_continuation = std::move(continuation);
    strand->has_early_continuation = true;
    return;
  }
  strand->detached = false;
  // The continuation finishes the detached task: it takes that task's place (and its pending
  // count) at the front of the strand.
  strand->tasks.push_front([c = std::move(continuation)] {
    c();
    return StepResult::kDone;
  });
  ScheduleLocked(strand);
}

void TransferEngine::WorkerLoop() {
  using Clock = std::chrono::steady_clock;
  MutexLock lock(&mu_);
  for (;;) {
    // Parked strands whose retry time has come go back to the ready queue.
    const auto now = Clock::now();
    for (auto it = parked_.begin(); it != parked_.end();) {
      if (it->first <= now) {
        PushReadyLocked(std::move(it->second));
        it = parked_.erase(it);
      } else {
        ++it;
      }
    }
    if (ready_.empty()) {
      if (stop_ && parked_.empty()) return;
      if (parked_.empty()) {
        ready_cv_.Wait(&mu_);
      } else {
        auto next = parked_.front().first;
        for (const auto& p : parked_) next = std::min(next, p.first);
        ready_cv_.WaitUntil(&mu_, next);
      }
      continue;
    }
    std::shared_ptr<Strand> strand = PopReadyLocked();
    StepTask task = std::move(strand->tasks.front());
    strand->tasks.pop_front();
    strand->running = true;
    lock.Unlock();
    const StepResult result = RunTask(task);
    if (result != StepResult::kNotReady) task = nullptr;
    lock.Lock();
    strand->running = false;
    if (result == StepResult::kNotReady) {
      // Not ready: keep it first in its strand and look again after a short, growing delay.
      strand->tasks.push_front(std::move(task));
      strand->backoff = std::min(std::chrono::microseconds(1000),
                                 std::max(std::chrono::microseconds(20), strand->backoff * 2));
      parked_.emplace_back(Clock::now() + strand->backoff, std::move(strand));
      ready_cv_.NotifyOne();  // a worker sleeping without a deadline now needs one
      continue;
    }
    strand->backoff = std::chrono::microseconds(0);
    if (result == StepResult::kDetached) {
      if (!strand->has_early_continuation) {
        strand->detached = true;  // busy until Resume; still pending
        continue;
      }
      strand->has_early_continuation = false;
      Task c = std::move(strand->early_continuation);
      strand->early_continuation = nullptr;
      strand->tasks.push_front([c = std::move(c)] {
        c();
        return StepResult::kDone;
      });
      PushReadyLocked(std::move(strand));
      ready_cv_.NotifyOne();
      continue;
    }
    --pending_;
    if (!strand->tasks.empty()) {
      PushReadyLocked(std::move(strand));
      ready_cv_.NotifyOne();
    } else {
      strand->scheduled = false;
    }
    if (pending_ == 0) idle_cv_.NotifyAll();
  }
}

void TransferEngine::WaitIdle() {
  MutexLock lock(&mu_);
  idle_cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return pending_ == 0; });
}

bool TransferEngine::WaitIdleFor(std::chrono::milliseconds timeout) {
  MutexLock lock(&mu_);
  return idle_cv_.WaitFor(&mu_, timeout, [&]() REQUIRES(mu_) { return pending_ == 0; });
}

size_t TransferEngine::Pending() const {
  MutexLock lock(&mu_);
  return pending_;
}

}  // namespace hiqcache::server
