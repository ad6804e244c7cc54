// TransferEngine: runs queued backup/restore work on a few worker threads, in order per pool.
//
// Each pool gets a Strand: tasks posted to one strand run one at a time in FIFO order (tickets of
// a pool complete in order, so a slot reaching T means every earlier ticket of it is done too);
// different strands run concurrently. A step task answers how far it got:
//   - kDone: finished; the strand's next task may start.
//   - kNotReady: it cannot start yet (its pool waits for an engine's HOST event, or for device
//     staging): its strand is parked and the task retried shortly, still first in its strand;
//     the worker serves other strands meanwhile, so pools that wait never hold workers.
//   - kDetached: it enqueued device work and returned; the strand stays busy (its next task does
//     not start) until someone (a device completion thread) calls Resume(strand, continuation).
//     The continuation then runs on a worker as the end of that task. No worker waits for the
//     device in between.
// A detached task counts as pending (WaitIdle, Pending) until its continuation has run.
//
// Fair service: each strand belongs to a group (CacheCore: the client, one uid). Ready strands
// are served round-robin over groups, and round-robin over the strands of a group: after each
// task its strand goes to the back of its group, and the group to the back of the groups. So a
// client's long queue of tasks delays another client's task by at most one task per worker and
// per other ready group; callers keep tasks short (CacheCore splits big requests).
// A task that throws is dropped (logged) as if it had completed: no exception leaves a worker.
// Thread-safe.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "hiqcache/mutex.h"

namespace hiqcache::server {

class TransferEngine {
 public:
  using Task = std::function<void()>;
  // Returns false when it cannot start yet; it is then run again later, still first in its strand.
  using RetryableTask = std::function<bool()>;
  enum class StepResult { kDone, kNotReady, kDetached };
  using StepTask = std::function<StepResult()>;
  class Strand;

  explicit TransferEngine(unsigned workers);
  // Runs every task already posted (detached ones included: it waits for their Resume), then
  // stops the workers.
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  // A strand of `group`: strands of one group share the workers as one (see above).
  std::shared_ptr<Strand> NewStrand(uint64_t group = 0);
  void Post(const std::shared_ptr<Strand>& strand, Task task);
  void PostRetryable(const std::shared_ptr<Strand>& strand, RetryableTask task);
  void PostStep(const std::shared_ptr<Strand>& strand, StepTask task);
  // Posts `tasks` in order as one unit: no task posted concurrently to `strand` lands between
  // them (a request's sub-tasks stay contiguous, so tickets of a pool complete in order). All or
  // nothing: when queueing cannot allocate, it throws std::bad_alloc with none of them queued.
  void PostSteps(const std::shared_ptr<Strand>& strand, std::vector<StepTask> tasks);
  // Ends the detached task of `strand`: `continuation` runs on a worker, then the strand's next
  // task may start. REQUIRES: called exactly once per kDetached answer; may be called from any
  // thread, even before the detaching task has returned. Never blocks on a worker.
  void Resume(const std::shared_ptr<Strand>& strand, Task continuation);
  // Blocks until no task is queued, running or detached.
  void WaitIdle();
  // Like WaitIdle, for at most `timeout`; returns whether the engine is idle.
  bool WaitIdleFor(std::chrono::milliseconds timeout);
  // Tasks queued, running or detached now.
  size_t Pending() const;

 private:
  void WorkerLoop();
  // Puts `strand` (not scheduled) on the ready queue.
  void ScheduleLocked(std::shared_ptr<Strand> strand) REQUIRES(mu_);
  // Appends `strand` to its group's ready strands.
  void PushReadyLocked(std::shared_ptr<Strand> strand) REQUIRES(mu_);
  // REQUIRES: a strand ready. The next strand in round-robin order.
  std::shared_ptr<Strand> PopReadyLocked() REQUIRES(mu_);
  // Runs one task, turning an exception into kDone (logged).
  static StepResult RunTask(StepTask& task);

  mutable Mutex mu_;
  CondVar ready_cv_;
  CondVar idle_cv_;
  // Ready strands per group, and the groups with ready strands in service order.
  std::map<uint64_t, std::deque<std::shared_ptr<Strand>>> ready_ GUARDED_BY(mu_);
  std::deque<uint64_t> ready_groups_ GUARDED_BY(mu_);
  // Strands whose first task was not ready, with when to try again.
  std::deque<std::pair<std::chrono::steady_clock::time_point, std::shared_ptr<Strand>>> parked_
      GUARDED_BY(mu_);
  size_t pending_ GUARDED_BY(mu_) = 0;
  bool stop_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

// Every member but `group` is guarded by the engine's mu_: a lock of another object, which the
// thread-safety analysis cannot name here, so these are not annotated.
class TransferEngine::Strand {
 private:
  friend class TransferEngine;
  uint64_t group = 0;
  std::deque<StepTask> tasks;
  std::chrono::microseconds backoff{0};  // retry delay of the first task
  bool scheduled = false;  // in ready_, parked_ or running, or detached (busy until Resume)
  bool running = false;    // a worker is inside its first task
  bool detached = false;   // its task returned kDetached, no Resume yet
  // A Resume that came while the detaching task was still running.
  Task early_continuation;
  bool has_early_continuation = false;
};

}  // namespace hiqcache::server
