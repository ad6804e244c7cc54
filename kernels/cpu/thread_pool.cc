#include "thread_pool.h"

#include <algorithm>

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

void ThreadPool::RunItems(uint64_t loop) {
  const LoopSlot& slot = slots_[loop & 1];
  uint64_t w = word_.load(std::memory_order_acquire);
  for (;;) {
    if ((w >> kIndexBits) != loop) return;  // a later loop: this one is done
    const size_t i = static_cast<size_t>(w & kIndexMask);
    // Read before the claim: when the claim succeeds the loop is still `loop` (its slot is only
    // rewritten two loops later, after this item is done), so these are its values; when it
    // fails they are discarded.
    const size_t n = slot.n.load(std::memory_order_relaxed);
    if (i >= n) return;
    if (!word_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel,
                                     std::memory_order_acquire)) {
      continue;  // w now holds the current word
    }
    (*slot.fn.load(std::memory_order_relaxed))(i);
    if (done_.fetch_add(1, std::memory_order_seq_cst) + 1 == n &&
        caller_sleeping_.load(std::memory_order_seq_cst)) {
      MutexLock lock(&mu_);
      done_cv_.NotifyOne();
    }
    w = word_.load(std::memory_order_acquire);
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
             (word_.load(std::memory_order_acquire) >> kIndexBits) != seen;
    };
    if (!SpinFor(ready)) {
      MutexLock lock(&mu_);
      sleeping_workers_.fetch_add(1, std::memory_order_seq_cst);
      wake_.Wait(&mu_, [&] {
        return stop_.load(std::memory_order_seq_cst) ||
               (word_.load(std::memory_order_seq_cst) >> kIndexBits) != seen;
      });
      sleeping_workers_.fetch_sub(1, std::memory_order_relaxed);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = word_.load(std::memory_order_acquire) >> kIndexBits;
    RunItems(seen);
  }
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (workers_.empty() || n == 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  MutexLock loop_lock(&loop_mu_);
  if (n <= kIndexMask) return RunLoop(n, fn);
  // More items than the loop word's index holds: loops of kIndexMask items each.
  for (size_t base = 0; base < n; base += kIndexMask) {
    const size_t count = std::min<size_t>(kIndexMask, n - base);
    const std::function<void(size_t)> shifted = [&fn, base](size_t i) { fn(base + i); };
    RunLoop(count, shifted);
  }
}

void ThreadPool::RunLoop(size_t n, const std::function<void(size_t)>& fn) {
  const uint64_t loop = ++loops_;
  LoopSlot& slot = slots_[loop & 1];
  slot.fn.store(&fn, std::memory_order_relaxed);
  slot.n.store(n, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  word_.store(loop << kIndexBits, std::memory_order_seq_cst);  // publishes the loop
  if (sleeping_workers_.load(std::memory_order_seq_cst) > 0) {
    MutexLock lock(&mu_);
    wake_.NotifyAll();
  }
  RunItems(loop);
  auto finished = [&] { return done_.load(std::memory_order_acquire) == n; };
  if (!SpinFor(finished)) {
    MutexLock lock(&mu_);
    caller_sleeping_.store(true, std::memory_order_seq_cst);
    done_cv_.Wait(&mu_, [&] { return done_.load(std::memory_order_seq_cst) == n; });
    caller_sleeping_.store(false, std::memory_order_relaxed);
  }
}

}  // namespace hiqcache::kernels
