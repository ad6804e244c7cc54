// A small fixed pool of worker threads for data-parallel loops (the CPU codec executor).
//
// ParallelFor(n, fn) runs fn(i) for every i in [0, n) on the workers and the calling thread and
// returns when all are done. Thread-safe: concurrent ParallelFor calls from different threads
// are serialized (one loop at a time owns the workers); fn must not call ParallelFor itself.
//
// Loops come in bursts (a restore runs one per layer, tens of microseconds apart), so a worker
// that finished a loop, and a caller waiting for its workers, spin for a short while
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
  void WorkerLoop();
  void RunItems();

  Mutex loop_mu_;  // serializes ParallelFor calls
  Mutex mu_;       // only for the condition variables' sleeps and wake-ups
  CondVar wake_;
  CondVar done_;
  // Published to the workers by the release store of generation_ (written only while no worker
  // is inside a loop).
  const std::function<void(size_t)>* fn_ = nullptr;
  size_t n_ = 0;
  std::atomic<size_t> next_{0};
  std::atomic<unsigned> active_{0};      // workers still inside the current loop
  std::atomic<uint64_t> generation_{0};  // one per loop
  std::atomic<bool> stop_{false};
  std::atomic<unsigned> sleeping_workers_{0};  // workers blocked (or about to) on wake_
  std::atomic<bool> caller_sleeping_{false};   // the caller blocked (or about to) on done_
  std::vector<std::thread> workers_;
};

}  // namespace hiqcache::kernels
