// ThreadPool: every index runs exactly once, loops really run in parallel, concurrent callers
// are serialized without mixing their items, a loop ends once its items are done whatever its
// workers are doing, and pools start and stop cleanly.
#include "thread_pool.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace hiqcache::kernels {
namespace {

std::vector<int> RunAndCount(ThreadPool& pool, size_t n) {
  std::vector<std::atomic<int>> hits(n);
  pool.ParallelFor(n, [&](size_t i) { hits[i].fetch_add(1, std::memory_order_relaxed); });
  // ParallelFor has returned: every item must be complete and visible here.
  std::vector<int> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = hits[i].load(std::memory_order_relaxed);
  return out;
}

TEST(ThreadPool, CountsTheCaller) {
  EXPECT_EQ(ThreadPool(1).threads(), 1u);
  EXPECT_EQ(ThreadPool(4).threads(), 4u);
}

TEST(ThreadPool, EveryIndexExactlyOnce) {
  for (unsigned threads : {1u, 2u, 3u, 8u}) {
    ThreadPool pool(threads);
    for (size_t n : {0, 1, 2, 3, 7, 64, 1000, 100003}) {
      const std::vector<int> hits = RunAndCount(pool, n);
      size_t wrong = 0;
      for (int h : hits) wrong += h != 1;
      EXPECT_EQ(wrong, 0u) << threads << " threads, n = " << n;
    }
  }
}

TEST(ThreadPool, ManyShortLoopsBackToBack) {
  ThreadPool pool(3);
  for (int rep = 0; rep < 2000; ++rep) {
    const size_t n = 1 + rep % 9;
    std::atomic<size_t> sum{0};
    pool.ParallelFor(n, [&](size_t i) { sum.fetch_add(i + 1, std::memory_order_relaxed); });
    ASSERT_EQ(sum.load(), n * (n + 1) / 2) << "rep " << rep;
  }
}

// Item 0 waits until another thread has started a different item: passes only if workers run
// items at the same time as the thread holding item 0 (no timing assumptions, just a deadline).
TEST(ThreadPool, RunsItemsInParallel) {
  ThreadPool pool(2);
  std::atomic<bool> other_started{false};
  std::atomic<bool> timed_out{false};
  std::thread::id first_thread;
  std::set<std::thread::id> ids;
  std::mutex ids_mu;
  pool.ParallelFor(64, [&](size_t i) {
    bool other_thread = false;
    {
      std::lock_guard<std::mutex> lock(ids_mu);
      ids.insert(std::this_thread::get_id());
      if (i == 0) first_thread = std::this_thread::get_id();
      // Read under the lock: item 0 may be writing it on another thread right now.
      other_thread = first_thread != std::this_thread::get_id();
    }
    if (i == 0) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (!other_started.load()) {
        if (std::chrono::steady_clock::now() > deadline) {
          timed_out = true;
          return;
        }
        std::this_thread::yield();
      }
    } else if (other_thread) {
      other_started = true;
    }
  });
  EXPECT_FALSE(timed_out.load());
  EXPECT_EQ(ids.size(), 2u);
}

// Several threads share one pool; each checks its own loops' items. Items of concurrent loops
// must neither be lost, nor run twice, nor be handed to the other caller's function, and two
// callers' loops never run at the same time (except n == 1, which runs inline on the caller
// without touching the pool).
TEST(ThreadPool, ConcurrentCallersAreSerialized) {
  ThreadPool pool(3);
  constexpr int kCallers = 4;
  constexpr int kLoops = 150;
  std::atomic<int> inside[kCallers] = {};
  std::atomic<int> overlaps{0};
  std::vector<std::thread> callers;
  std::vector<int> failures(kCallers, 0);
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int loop = 0; loop < kLoops; ++loop) {
        const size_t n = 1 + (c * 37 + loop * 11) % 200;
        std::vector<std::atomic<int>> hits(n);
        pool.ParallelFor(n, [&](size_t i) {
          if (n > 1) {
            inside[c].fetch_add(1);
            for (int o = 0; o < kCallers; ++o) {
              if (o != c && inside[o].load() != 0) overlaps.fetch_add(1);
            }
          }
          hits[i].fetch_add(1, std::memory_order_relaxed);
          if (n > 1) inside[c].fetch_sub(1);
        });
        for (size_t i = 0; i < n; ++i) failures[c] += hits[i].load() != 1;
      }
    });
  }
  for (auto& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) EXPECT_EQ(failures[c], 0) << "caller " << c;
  EXPECT_EQ(overlaps.load(), 0);
}

// While one caller's loop runs on the workers, another caller's ParallelFor waits for it.
TEST(ThreadPool, SecondCallerWaitsForTheFirstLoop) {
  ThreadPool pool(2);
  std::atomic<bool> first_running{false};
  std::atomic<bool> release{false};
  std::atomic<bool> second_ran_early{false};
  std::thread first([&] {
    pool.ParallelFor(2, [&](size_t) {
      first_running = true;
      while (!release.load()) std::this_thread::yield();
    });
  });
  while (!first_running.load()) std::this_thread::yield();
  std::atomic<bool> second_done{false};
  std::thread second([&] {
    pool.ParallelFor(4, [&](size_t) {
      if (!release.load()) second_ran_early = true;
    });
    second_done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(second_done.load());
  release = true;
  first.join();
  second.join();
  EXPECT_TRUE(second_done.load());
  EXPECT_FALSE(second_ran_early.load());
}

// A worker held in a signal handler (it never reaches the loop) must not hold up a loop whose
// items the caller can run alone: ParallelFor returns once every item is done. Passes only if
// ParallelFor returns while the worker is still held; a pool that waits for every worker to
// check in returns only after the watchdog lets the worker go (a deadline, not a timing).
std::atomic<bool> g_hold_worker{false};
std::atomic<bool> g_worker_held{false};

void HoldWorker(int) {
  g_worker_held.store(true);
  const timespec nap{0, 1000000};
  while (g_hold_worker.load()) nanosleep(&nap, nullptr);
  g_worker_held.store(false);
}

TEST(ThreadPool, ReturnsWhenItemsAreDoneWithoutWaitingForWorkers) {
#if defined(__SANITIZE_THREAD__)
  // TSan runs a signal's handler when the thread leaves its blocking call, after
  // pthread_cond_wait has taken the pool's mutex back: the held worker would hold that mutex,
  // which no pool can do without. The test needs the kernel's delivery (the uninstrumented
  // builds run it).
  GTEST_SKIP() << "TSan defers signal handlers until the pool's mutex is held again";
#endif
  ThreadPool pool(2);
  // One loop that needs both threads at once: item 0 and item 1 each wait for the other, so the
  // worker runs one of them; it records its pthread id.
  std::atomic<int> arrived{0};
  pthread_t worker{};
  std::atomic<bool> have_worker{false};
  const pthread_t caller = pthread_self();
  pool.ParallelFor(2, [&](size_t) {
    if (!pthread_equal(pthread_self(), caller)) {
      worker = pthread_self();
      have_worker = true;
    }
    arrived.fetch_add(1);
    while (arrived.load() < 2) std::this_thread::yield();
  });
  ASSERT_TRUE(have_worker.load());

  struct sigaction sa = {};
  struct sigaction old_sa = {};
  sa.sa_handler = HoldWorker;
  sigemptyset(&sa.sa_mask);
  ASSERT_EQ(sigaction(SIGUSR1, &sa, &old_sa), 0);
  g_hold_worker = true;
  ASSERT_EQ(pthread_kill(worker, SIGUSR1), 0);
  while (!g_worker_held.load()) std::this_thread::yield();

  std::atomic<bool> watchdog_fired{false};
  std::atomic<bool> loop_returned{false};
  std::thread watchdog([&] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!loop_returned.load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (!loop_returned.load()) watchdog_fired = true;
    g_hold_worker = false;
  });
  for (int rep = 0; rep < 3; ++rep) {
    const std::vector<int> hits = RunAndCount(pool, 64);
    for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i], 1) << "item " << i;
  }
  const bool held_throughout = g_hold_worker.load();
  loop_returned = true;
  watchdog.join();
  while (g_worker_held.load()) std::this_thread::yield();
  EXPECT_FALSE(watchdog_fired.load());
  EXPECT_TRUE(held_throughout);
  ASSERT_EQ(sigaction(SIGUSR1, &old_sa, nullptr), 0);

  // The worker comes back to later loops: each item exactly once, and it takes part again.
  for (int rep = 0; rep < 100; ++rep) {
    const std::vector<int> hits = RunAndCount(pool, 32);
    for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i], 1) << "rep " << rep;
  }
  arrived = 0;
  have_worker = false;
  pool.ParallelFor(2, [&](size_t) {
    if (!pthread_equal(pthread_self(), caller)) have_worker = true;
    arrived.fetch_add(1);
    while (arrived.load() < 2) std::this_thread::yield();
  });
  EXPECT_TRUE(have_worker.load());
}

// Loops of more items than one loop word indexes (2^24 - 1) still run every index once.
TEST(ThreadPool, LoopsBeyondTheIndexWidth) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "16M instrumented items take about 20 s under ThreadSanitizer";
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
  GTEST_SKIP() << "16M instrumented items take about 20 s under ThreadSanitizer";
#endif
#endif
  ThreadPool pool(2);
  const size_t n = (size_t{1} << 24) + 5;
  std::vector<uint8_t> hits(n, 0);
  pool.ParallelFor(n, [&](size_t i) { ++hits[i]; });
  size_t wrong = 0;
  for (uint8_t h : hits) wrong += h != 1;
  EXPECT_EQ(wrong, 0u);
}

TEST(ThreadPool, StartsAndStopsCleanly) {
  for (int i = 0; i < 200; ++i) {
    auto pool = std::make_unique<ThreadPool>(1 + i % 5);
    if (i % 2) RunAndCount(*pool, 10);
    pool.reset();  // joins idle workers without hanging
  }
  SUCCEED();
}

}  // namespace
}  // namespace hiqcache::kernels
