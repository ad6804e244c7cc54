// TransferEngine: runs queued backup/restore work on a few worker threads, in order per pool.
//
// Each pool gets a Strand: tasks posted to one strand run one at a time in FIFO order (tickets of
// a pool complete in order, so a slot reaching T means every earlier ticket of it is done too);
// different strands run concurrently. A task that is not ready yet (its pool waits for an engine's
// event) returns false: its strand is parked and retried shortly, and the worker serves other
// strands meanwhile, so pools waiting on events never hold workers. Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace hiqcache::server {

class TransferEngine {
 public:
  using Task = std::function<void()>;
  // Returns false when it cannot start yet; it is then run again later, still first in its strand.
  using RetryableTask = std::function<bool()>;
  class Strand;

  explicit TransferEngine(unsigned workers);
  // Runs every task already posted, then stops the workers.
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  std::shared_ptr<Strand> NewStrand();
  void Post(const std::shared_ptr<Strand>& strand, Task task);
  void PostRetryable(const std::shared_ptr<Strand>& strand, RetryableTask task);
  // Blocks until no task is queued or running.
  void WaitIdle();
  // Tasks queued or running now.
  size_t Pending() const;

 private:
  void WorkerLoop();

  mutable std::mutex mu_;
  std::condition_variable ready_cv_;
  std::condition_variable idle_cv_;
  std::deque<std::shared_ptr<Strand>> ready_;  // GUARDED_BY(mu_)
  // Strands whose first task was not ready, with when to try again.
  std::deque<std::pair<std::chrono::steady_clock::time_point, std::shared_ptr<Strand>>>
      parked_;  // GUARDED_BY(mu_)
  size_t pending_ = 0;                         // GUARDED_BY(mu_)
  bool stop_ = false;                          // GUARDED_BY(mu_)
  std::vector<std::thread> workers_;
};

class TransferEngine::Strand {
 private:
  friend class TransferEngine;
  std::deque<RetryableTask> tasks;  // GUARDED_BY(engine mu_)
  std::chrono::microseconds backoff{0};  // GUARDED_BY(engine mu_): retry delay of the first task
  bool scheduled = false;  // GUARDED_BY(engine mu_): in ready_ or running
};

}  // namespace hiqcache::server
