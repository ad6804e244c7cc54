#include "thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace hiqcache::kernels {

namespace {

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins until done() or kSpinBeforeSleep has passed; true when done() held.
template <typename Done>
bool SpinFor(Done done) {
  const auto deadline = std::chrono::steady_clock::now() + ThreadPool::kSpinBeforeSleep;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      CpuRelax();
    }
    if (std::chrono::steady_clock::now() >= deadline) return done();
  }
}

}  // namespace

ThreadPool::ThreadPool(unsigned threads) {
  for (unsigned i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    MutexLock lock(&mu_);
    stop_.store(true, std::memory_order_seq_cst);
  }
  wake_.NotifyAll();
  for (auto& t : workers_) t.join();
}

void ThreadPool::RunItems() {
  for (size_t i = next_.fetch_add(1, std::memory_order_relaxed); i < n_;
       i = next_.fetch_add(1, std::memory_order_relaxed)) {
    (*fn_)(i);
  }
}

// The sleeps pair a seq_cst flag with a seq_cst check on the other side (a Dekker handshake):
// a sleeper raises its flag before it tests the condition; the waker changes the condition
// before it reads the flag. Either the sleeper sees the change, or the waker sees the flag and
// notifies under mu_, which the sleeper holds from raising its flag until it waits.
void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    auto ready = [&] {
      return stop_.load(std::memory_order_acquire) ||
             generation_.load(std::memory_order_acquire) != seen;
    };
    if (!SpinFor(ready)) {
      MutexLock lock(&mu_);
      sleeping_workers_.fetch_add(1, std::memory_order_seq_cst);
      wake_.Wait(&mu_, [&] {
        return stop_.load(std::memory_order_seq_cst) ||
               generation_.load(std::memory_order_seq_cst) != seen;
      });
      sleeping_workers_.fetch_sub(1, std::memory_order_relaxed);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = generation_.load(std::memory_order_acquire);
    RunItems();
    if (active_.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
        caller_sleeping_.load(std::memory_order_seq_cst)) {
      MutexLock lock(&mu_);
      done_.NotifyOne();
    }
  }
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (workers_.empty() || n == 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  MutexLock loop_lock(&loop_mu_);
  fn_ = &fn;
  n_ = n;
  next_.store(0, std::memory_order_relaxed);
  active_.store(static_cast<unsigned>(workers_.size()), std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_seq_cst);  // publishes the loop
  if (sleeping_workers_.load(std::memory_order_seq_cst) > 0) {
    MutexLock lock(&mu_);
    wake_.NotifyAll();
  }
  RunItems();
  auto finished = [&] { return active_.load(std::memory_order_acquire) == 0; };
  if (!SpinFor(finished)) {
    MutexLock lock(&mu_);
    caller_sleeping_.store(true, std::memory_order_seq_cst);
    done_.Wait(&mu_, [&] { return active_.load(std::memory_order_seq_cst) == 0; });
    caller_sleeping_.store(false, std::memory_order_relaxed);
  }
  fn_ = nullptr;
}

}  // namespace hiqcache::kernels
