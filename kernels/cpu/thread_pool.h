// A small fixed pool of worker threads for data-parallel loops (the CPU codec executor).
//
// ParallelFor(n, fn) runs fn(i) for every i in [0, n) on the workers and the calling thread and
// returns as soon as every item is done: it waits for the items a worker has claimed, never for
// a worker to show up. A worker that is preempted or late (on a machine with more runnable
// threads than cores) takes nothing of a loop the caller has already finished, and takes no item
// of a later loop by mistake: the loop number and the next index share one atomic word, and an
// item is claimed by a compare-and-swap on that word. Thread-safe: concurrent ParallelFor calls
// from different threads are serialized (one loop at a time owns the workers); fn must not call
// ParallelFor itself.
//
// Loops come in bursts (a restore runs one per layer, tens of microseconds apart), so a worker
// that finished a loop, and a caller waiting for claimed items, spin for a short while
// (kSpinBeforeSleep) before sleeping on a condition variable; the futex calls are only made
// when someone actually sleeps. Without this, the wake-up and hand-off of a sleeping worker
// cost about as much as a 2-item loop of codec work, and a second thread gained nothing.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "hiqcache/mutex.h"

namespace hiqcache::kernels {

class ThreadPool {
 public:
  // How long an idle worker (or a caller waiting for workers) spins before it sleeps.
  static constexpr std::chrono::microseconds kSpinBeforeSleep{50};

  // `threads` counts the caller: ThreadPool(1) runs everything on the calling thread.
  explicit ThreadPool(unsigned threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  unsigned threads() const { return static_cast<unsigned>(workers_.size()) + 1; }
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

 private:
  // The loop word: loop number << kIndexBits | next unclaimed index.
  static constexpr int kIndexBits = 24;
  static constexpr uint64_t kIndexMask = (uint64_t{1} << kIndexBits) - 1;
  // A loop's function and size, in the slot of its number's parity: a loop's slot is written
  // again two loops later, after every item of it is done.
  struct LoopSlot {
    std::atomic<const std::function<void(size_t)>*> fn{nullptr};
    std::atomic<size_t> n{0};
  };

  void WorkerLoop();
  // Claims and runs items of loop `loop` until it has none left or a later loop is published.
  void RunItems(uint64_t loop);
  // One loop of n <= kIndexMask items.
  void RunLoop(size_t n, const std::function<void(size_t)>& fn) REQUIRES(loop_mu_);

  Mutex loop_mu_;  // serializes ParallelFor calls
  Mutex mu_;       // only for the condition variables' sleeps and wake-ups
  CondVar wake_;
  CondVar done_cv_;
  uint64_t loops_ GUARDED_BY(loop_mu_) = 0;  // loops published
  LoopSlot slots_[2];
  std::atomic<uint64_t> word_{0};  // the loop word (loop 0: none yet)
  std::atomic<size_t> done_{0};    // items of the current loop finished
  std::atomic<bool> stop_{false};
  std::atomic<unsigned> sleeping_workers_{0};  // workers blocked (or about to) on wake_
  std::atomic<bool> caller_sleeping_{false};   // the caller blocked (or about to) on done_cv_
  std::vector<std::thread> workers_;
};

}  // namespace hiqcache::kernels
