// TransferEngine: per-strand FIFO without overlap, concurrency across strands, WaitIdle, and a
// destructor that drains the queue.
#include "core/transfer_engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "time_margin.h"

// Allocation failure on demand: while g_fail_after >= 0 on a thread, that thread's
// (g_fail_after + 1)-th allocation by operator new throws std::bad_alloc.
namespace {
thread_local int g_fail_after = -1;
}  // namespace

void* operator new(std::size_t n) {
  if (g_fail_after == 0) {
    g_fail_after = -1;
    throw std::bad_alloc();
  }
  if (g_fail_after > 0) --g_fail_after;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace hiqcache::server {
namespace {

using namespace std::chrono_literals;

// Spins (with short sleeps) until `pred` holds or `timeout` passes; returns pred().
template <typename Pred>
bool WaitUntil(Pred pred, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return pred();
    std::this_thread::sleep_for(100us);
  }
  return true;
}

TEST(TransferEngineTest, OneStrandRunsInFifoOrderNeverConcurrently) {
  TransferEngine engine(4);
  auto strand = engine.NewStrand();
  std::mutex mu;
  std::vector<int> order;
  std::atomic<int> running{0};
  std::atomic<int> max_running{0};
  constexpr int kTasks = 300;
  for (int i = 0; i < kTasks; ++i) {
    engine.Post(strand, [&, i] {
      int now = running.fetch_add(1) + 1;
      int prev = max_running.load();
      while (now > prev && !max_running.compare_exchange_weak(prev, now)) {
      }
      if (i % 50 == 0) std::this_thread::sleep_for(1ms);  // give others a chance to overlap
      {
        std::lock_guard<std::mutex> lock(mu);
        order.push_back(i);
      }
      running.fetch_sub(1);
    });
  }
  engine.WaitIdle();
  EXPECT_EQ(max_running.load(), 1);
  ASSERT_EQ(order.size(), static_cast<size_t>(kTasks));
  for (int i = 0; i < kTasks; ++i) ASSERT_EQ(order[i], i);
  EXPECT_EQ(engine.Pending(), 0u);
}

TEST(TransferEngineTest, StrandsKeepTheirOwnOrderWhenInterleaved) {
  TransferEngine engine(3);
  constexpr int kStrands = 5, kTasks = 100;
  std::vector<std::shared_ptr<TransferEngine::Strand>> strands;
  for (int s = 0; s < kStrands; ++s) strands.push_back(engine.NewStrand());
  std::mutex mu;
  std::vector<std::vector<int>> order(kStrands);
  std::vector<std::atomic<int>> running(kStrands);
  std::atomic<bool> overlap{false};
  for (int i = 0; i < kTasks; ++i) {
    for (int s = 0; s < kStrands; ++s) {
      engine.Post(strands[s], [&, s, i] {
        if (running[s].fetch_add(1) != 0) overlap = true;
        {
          std::lock_guard<std::mutex> lock(mu);
          order[s].push_back(i);
        }
        running[s].fetch_sub(1);
      });
    }
  }
  engine.WaitIdle();
  EXPECT_FALSE(overlap.load());
  for (int s = 0; s < kStrands; ++s) {
    ASSERT_EQ(order[s].size(), static_cast<size_t>(kTasks));
    for (int i = 0; i < kTasks; ++i) ASSERT_EQ(order[s][i], i) << "strand " << s;
  }
}

TEST(TransferEngineTest, DifferentStrandsRunConcurrently) {
  // Each task waits for the other to start: with 2 workers both must be running at once.
  TransferEngine engine(2);
  auto a = engine.NewStrand();
  auto b = engine.NewStrand();
  std::atomic<int> arrived{0};
  std::atomic<int> met{0};
  auto task = [&] {
    arrived.fetch_add(1);
    if (WaitUntil([&] { return arrived.load() >= 2; }, 5000ms)) met.fetch_add(1);
  };
  engine.Post(a, task);
  engine.Post(b, task);
  engine.WaitIdle();
  EXPECT_EQ(met.load(), 2);
}

TEST(TransferEngineTest, ABlockedStrandDoesNotStallAnother) {
  TransferEngine engine(2);
  auto slow = engine.NewStrand();
  auto fast = engine.NewStrand();
  std::atomic<bool> release{false};
  std::atomic<int> fast_done{0};
  engine.Post(slow, [&] { WaitUntil([&] { return release.load(); }, 5000ms); });
  engine.Post(slow, [&] {});  // queued behind the blocked task on the same strand
  for (int i = 0; i < 20; ++i) engine.Post(fast, [&] { fast_done.fetch_add(1); });
  EXPECT_TRUE(WaitUntil([&] { return fast_done.load() == 20; }, 5000ms));
  EXPECT_EQ(engine.Pending(), 2u);  // the blocked task and its successor
  release = true;
  engine.WaitIdle();
  EXPECT_EQ(engine.Pending(), 0u);
}

TEST(TransferEngineTest, WaitIdleWaitsForRunningAndQueuedTasks) {
  TransferEngine engine(1);
  auto s = engine.NewStrand();
  std::atomic<int> done{0};
  engine.Post(s, [&] {
    std::this_thread::sleep_for(100ms);
    done.fetch_add(1);
  });
  engine.Post(s, [&] { done.fetch_add(1); });
  auto start = std::chrono::steady_clock::now();
  engine.WaitIdle();
  EXPECT_EQ(done.load(), 2);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 50ms);
  EXPECT_EQ(engine.Pending(), 0u);
  engine.WaitIdle();  // idle: returns at once
}

TEST(TransferEngineTest, TasksMayPostMoreWork) {
  TransferEngine engine(2);
  auto s = engine.NewStrand();
  std::atomic<int> n{0};
  std::function<void()> step = [&] {
    if (n.fetch_add(1) < 9) engine.Post(s, step);
  };
  engine.Post(s, step);
  // WaitIdle may return only when the chain has finished: pending never drops to 0 in between.
  engine.WaitIdle();
  EXPECT_EQ(n.load(), 10);
}

TEST(TransferEngineTest, DestructorRunsQueuedTasks) {
  std::atomic<int> done{0};
  std::atomic<bool> release{false};
  {
    TransferEngine engine(1);
    auto s1 = engine.NewStrand();
    auto s2 = engine.NewStrand();
    engine.Post(s1, [&] {
      WaitUntil([&] { return release.load(); }, 5000ms);
      done.fetch_add(1);
    });
    for (int i = 0; i < 50; ++i) engine.Post(i % 2 ? s1 : s2, [&] { done.fetch_add(1); });
    release = true;
  }
  EXPECT_EQ(done.load(), 51);
}

// A detached task frees its worker at once; its strand's next task starts only after Resume, and
// the continuation runs first. The engine counts it as pending until then.
TEST(TransferEngineTest, DetachedTaskHoldsItsStrandButNoWorker) {
  TransferEngine engine(1);
  auto device = engine.NewStrand();
  auto other = engine.NewStrand();
  std::mutex mu;
  std::vector<std::string> order;
  auto log = [&](std::string s) {
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(std::move(s));
  };
  engine.PostStep(device, [&] {
    log("enqueue 1");
    return TransferEngine::StepResult::kDetached;
  });
  engine.Post(device, [&] { log("task 2"); });
  std::atomic<int> other_done{0};
  for (int i = 0; i < 5; ++i) engine.Post(other, [&] { other_done.fetch_add(1); });
  // One worker: the other strand runs although task 1's device work has not completed.
  EXPECT_TRUE(WaitUntil([&] { return other_done.load() == 5; }, 5000ms));
  std::this_thread::sleep_for(20ms);
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(order, std::vector<std::string>{"enqueue 1"});  // task 2 waits for the Resume
  }
  EXPECT_EQ(engine.Pending(), 2u);
  EXPECT_FALSE(engine.WaitIdleFor(20ms));
  std::thread completion([&] { engine.Resume(device, [&] { log("complete 1"); }); });
  completion.join();
  engine.WaitIdle();
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(order, (std::vector<std::string>{"enqueue 1", "complete 1", "task 2"}));
}

// Resume may come before the detaching task has returned (the device finished at once, or the
// enqueue failed and completion was reported inline).
TEST(TransferEngineTest, ResumeBeforeTheDetachingTaskReturned) {
  TransferEngine engine(2);
  auto s = engine.NewStrand();
  std::atomic<int> step{0};
  for (int i = 0; i < 100; ++i) {
    engine.PostStep(s, [&, i] {
      EXPECT_EQ(step.load(), 2 * i);
      step.fetch_add(1);
      engine.Resume(s, [&, i] {
        EXPECT_EQ(step.load(), 2 * i + 1);
        step.fetch_add(1);
      });
      return TransferEngine::StepResult::kDetached;
    });
  }
  engine.WaitIdle();
  EXPECT_EQ(step.load(), 200);
  EXPECT_EQ(engine.Pending(), 0u);
}

TEST(TransferEngineTest, ZeroWorkersStillRuns) {
  TransferEngine engine(0);
  auto s = engine.NewStrand();
  std::atomic<int> done{0};
  engine.Post(s, [&] { done = 1; });
  engine.WaitIdle();
  EXPECT_EQ(done.load(), 1);
}

TEST(TransferEngineTest, GroupsShareTheWorkersRoundRobin) {
  // One worker, held while everything is queued: group 1 has three strands with three tasks
  // each, group 2 one strand with three. Groups alternate; so do the strands within a group.
  TransferEngine engine(1);
  std::atomic<bool> go{false};
  auto gate = engine.NewStrand(9);
  engine.Post(gate, [&] {
    while (!go.load()) std::this_thread::sleep_for(100us);
  });
  ASSERT_TRUE(WaitUntil([&] { return engine.Pending() == 1; }, test_time::Margin(5000ms)));
  std::this_thread::sleep_for(5ms);  // the gate task is running
  std::mutex mu;
  std::string order;
  auto post = [&](const std::shared_ptr<TransferEngine::Strand>& s, char name) {
    engine.Post(s, [&, name] {
      std::lock_guard<std::mutex> lock(mu);
      order += name;
    });
  };
  auto a = engine.NewStrand(1), b = engine.NewStrand(1), c = engine.NewStrand(1);
  auto x = engine.NewStrand(2);
  for (int i = 0; i < 3; ++i) {
    post(a, 'a');
    post(b, 'b');
    post(c, 'c');
  }
  for (int i = 0; i < 3; ++i) post(x, 'x');
  go.store(true);
  engine.WaitIdle();
  // Round-robin over strands alone (the old engine) would give "abcxabcxabcx": group 2 a
  // quarter of the worker instead of half while both have work.
  EXPECT_EQ(order, "axbxcxabcabc");
}

TEST(TransferEngineTest, AThrowingTaskIsDroppedAndTheWorkerLives) {
  TransferEngine engine(1);
  auto strand = engine.NewStrand();
  std::atomic<int> ran{0};
  engine.Post(strand, [] { throw std::bad_alloc(); });
  engine.PostStep(strand, []() -> TransferEngine::StepResult {
    throw std::runtime_error("boom\nforged log line");
  });
  engine.Post(strand, [&] { ran.fetch_add(1); });
  engine.WaitIdle();
  EXPECT_EQ(ran.load(), 1);
  EXPECT_EQ(engine.Pending(), 0u);
}

TEST(TransferEngineTest, PostStepsThatCannotAllocateQueuesNothing) {
  TransferEngine engine(1);
  auto strand = engine.NewStrand();
  std::atomic<int> ran{0};
  std::vector<TransferEngine::StepTask> steps;
  for (int i = 0; i < 200; ++i) {
    steps.push_back([&] {
      ran.fetch_add(1);
      return TransferEngine::StepResult::kDone;
    });
  }
  // The strand's queue grows by blocks: its third allocation fails, part-way through the steps.
  g_fail_after = 2;
  EXPECT_THROW(engine.PostSteps(strand, std::move(steps)), std::bad_alloc);
  g_fail_after = -1;
  EXPECT_TRUE(engine.WaitIdleFor(test_time::Margin(5s)));
  EXPECT_EQ(ran.load(), 0) << "steps of a post that failed ran";
  EXPECT_EQ(engine.Pending(), 0u);
  engine.Post(strand, [&] { ran.fetch_add(1); });
  EXPECT_TRUE(engine.WaitIdleFor(test_time::Margin(5s)));
  EXPECT_EQ(ran.load(), 1);
  EXPECT_EQ(engine.Pending(), 0u);
}

TEST(TransferEngineTest, PostStepsKeepsARequestsTasksContiguous) {
  TransferEngine engine(2);
  auto strand = engine.NewStrand();
  std::mutex mu;
  std::vector<int> order;
  std::vector<std::thread> posters;
  for (int p = 0; p < 4; ++p) {
    posters.emplace_back([&, p] {
      for (int r = 0; r < 50; ++r) {
        std::vector<TransferEngine::StepTask> steps;
        for (int k = 0; k < 3; ++k) {
          steps.push_back([&, p] {
            std::lock_guard<std::mutex> lock(mu);
            order.push_back(p);
            return TransferEngine::StepResult::kDone;
          });
        }
        engine.PostSteps(strand, std::move(steps));
      }
    });
  }
  for (auto& t : posters) t.join();
  engine.WaitIdle();
  ASSERT_EQ(order.size(), 4u * 50 * 3);
  for (size_t i = 0; i < order.size(); i += 3) {
    EXPECT_EQ(order[i], order[i + 1]);
    EXPECT_EQ(order[i], order[i + 2]);
  }
}

}  // namespace
}  // namespace hiqcache::server
