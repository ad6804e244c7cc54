// ClientWatcher: a watched process that exits is reported within a fraction of a second
// (docs/design.md "client death releases its mappings within 1 s"); live processes are not.
#include "core/client_watcher.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "time_margin.h"

namespace hiqcache::server {
namespace {

using namespace std::chrono_literals;

// Watches a mutable set of pids and records exits, removing them as CacheCore would.
struct Recorder {
  std::mutex mu;
  std::vector<uint32_t> watched;
  std::vector<uint32_t> exited;
  std::vector<uint32_t> Pids() {
    std::lock_guard<std::mutex> lock(mu);
    return watched;
  }
  void OnExit(uint32_t pid) {
    std::lock_guard<std::mutex> lock(mu);
    exited.push_back(pid);
    std::erase(watched, pid);
  }
  bool Exited(uint32_t pid) {
    std::lock_guard<std::mutex> lock(mu);
    return std::find(exited.begin(), exited.end(), pid) != exited.end();
  }
};

pid_t SpawnSleeper() {
  pid_t pid = ::fork();
  if (pid == 0) {
    for (;;) ::pause();
  }
  return pid;
}

TEST(ClientWatcherTest, ReportsAKilledProcessWithinOneSecond) {
  const pid_t child = SpawnSleeper();
  ASSERT_GT(child, 0);
  const uint32_t self = static_cast<uint32_t>(::getpid());
  Recorder rec;
  rec.watched = {static_cast<uint32_t>(child), self};
  {
    ClientWatcher watcher([&] { return rec.Pids(); }, [&](uint32_t p) { rec.OnExit(p); }, 50ms);
    std::this_thread::sleep_for(150ms);
    EXPECT_FALSE(rec.Exited(static_cast<uint32_t>(child)));
    ASSERT_EQ(::kill(child, SIGKILL), 0);
    const auto killed = std::chrono::steady_clock::now();
    while (!rec.Exited(static_cast<uint32_t>(child)) &&
           std::chrono::steady_clock::now() - killed < test_time::Margin(10s)) {
      std::this_thread::sleep_for(5ms);
    }
    EXPECT_TRUE(rec.Exited(static_cast<uint32_t>(child)));
    // The contract's 1 s (50 ms polls here), asserted with the margin of a loaded machine.
    EXPECT_LT(std::chrono::steady_clock::now() - killed, test_time::Margin(3s))
        << "a killed client is reported within 1 s";
  }
  ::waitpid(child, nullptr, 0);
  EXPECT_FALSE(rec.Exited(self));
  std::lock_guard<std::mutex> lock(rec.mu);
  EXPECT_EQ(std::count(rec.exited.begin(), rec.exited.end(), static_cast<uint32_t>(child)), 1);
}

TEST(ClientWatcherTest, ReportsAPidThatIsAlreadyGone) {
  const pid_t child = SpawnSleeper();
  ASSERT_GT(child, 0);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);  // reaped: the pid no longer exists
  Recorder rec;
  rec.watched = {static_cast<uint32_t>(child)};
  {
    ClientWatcher watcher([&] { return rec.Pids(); }, [&](uint32_t p) { rec.OnExit(p); }, 20ms);
    const auto start = std::chrono::steady_clock::now();
    while (!rec.Exited(static_cast<uint32_t>(child)) &&
           std::chrono::steady_clock::now() - start < 1s) {
      std::this_thread::sleep_for(5ms);
    }
  }
  EXPECT_TRUE(rec.Exited(static_cast<uint32_t>(child)));
}

TEST(ClientWatcherTest, StopsPromptly) {
  Recorder rec;
  rec.watched = {static_cast<uint32_t>(::getpid())};
  const auto start = std::chrono::steady_clock::now();
  {
    ClientWatcher watcher([&] { return rec.Pids(); }, [&](uint32_t p) { rec.OnExit(p); }, 100ms);
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
  EXPECT_TRUE(rec.exited.empty());
}

}  // namespace
}  // namespace hiqcache::server
