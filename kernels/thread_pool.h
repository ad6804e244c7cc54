// A small fixed pool of worker threads for data-parallel loops (the CPU codec executor).
//
// ParallelFor(n, fn) runs fn(i) for every i in [0, n) on the workers and the calling thread and
// returns when all are done. Thread-safe: concurrent ParallelFor calls from different threads
// are serialized (one loop at a time owns the workers); fn must not call ParallelFor itself.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace hiqcache::kernels {

class ThreadPool {
 public:
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

  std::mutex loop_mu_;  // serializes ParallelFor calls
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(size_t)>* fn_ = nullptr;  // GUARDED_BY(mu_) for publication
  size_t n_ = 0;
  std::atomic<size_t> next_{0};
  unsigned active_ = 0;     // GUARDED_BY(mu_): workers still inside the current loop
  uint64_t generation_ = 0;  // GUARDED_BY(mu_)
  bool stop_ = false;        // GUARDED_BY(mu_)
  std::vector<std::thread> workers_;
};

}  // namespace hiqcache::kernels
