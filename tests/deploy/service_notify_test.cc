// ServiceNotifier in-process: datagrams to a path and to an abstract socket, the watchdog's
// period and its liveness probe, the environment (WATCHDOG_PID), and no-ops without a socket.
#include "ops/service_notify.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "fake_notify_manager.h"
#include "time_margin.h"

namespace hiqcache::server {
namespace {

using std::chrono::milliseconds;

using deploy_test::FakeManager;

std::string TempPath(const std::string& leaf) {
  return (std::filesystem::temp_directory_path() /
          ("hiq-sn-" + std::to_string(::getpid()) + "-" + leaf))
      .string();
}

TEST(ServiceNotifierTest, DisabledWithoutSocketIsANoOp) {
  ServiceNotifier n("", std::chrono::microseconds(100000));
  EXPECT_FALSE(n.enabled());
  EXPECT_EQ(n.watchdog_timeout().count(), 0);
  EXPECT_TRUE(n.Ready("x").ok());
  n.StartWatchdog();
  n.StopWatchdog();
}

TEST(ServiceNotifierTest, SendsToAPathSocket) {
  FakeManager m(TempPath("path.sock"));
  ASSERT_TRUE(m.bound());
  ServiceNotifier n(m.address(), std::chrono::microseconds(0));
  ASSERT_TRUE(n.Ready("serving on\nsomewhere").ok());
  // STATUS= stays one line: the newline would start another assignment.
  EXPECT_EQ(m.Receive(milliseconds(1000)), "READY=1\nSTATUS=serving on somewhere");
  ASSERT_TRUE(n.Stopping("draining").ok());
  EXPECT_EQ(m.Receive(milliseconds(1000)), "STOPPING=1\nSTATUS=draining");
  ASSERT_TRUE(n.SetStatus("phase").ok());
  EXPECT_EQ(m.Receive(milliseconds(1000)), "STATUS=phase");
}

TEST(ServiceNotifierTest, SendsToAnAbstractSocket) {
  FakeManager m("@hiq-sn-" + std::to_string(::getpid()) + "-abstract");
  ASSERT_TRUE(m.bound());
  ServiceNotifier n(m.address(), std::chrono::microseconds(0));
  ASSERT_TRUE(n.Notify("READY=1").ok());
  EXPECT_EQ(m.Receive(milliseconds(1000)), "READY=1");
}

TEST(ServiceNotifierTest, UnreachableSocketIsAnErrorNotACrash) {
  ServiceNotifier n(TempPath("nobody.sock"), std::chrono::microseconds(0));
  EXPECT_FALSE(n.Ready("x").ok());
}

TEST(ServiceNotifierTest, WatchdogPingsAtHalfTheTimeout) {
  FakeManager m(TempPath("wd.sock"));
  ASSERT_TRUE(m.bound());
  ServiceNotifier n(m.address(), std::chrono::microseconds(100000));  // pings every 50 ms
  const auto t0 = std::chrono::steady_clock::now();
  n.StartWatchdog();
  int pings = 0;
  while (pings < 5) {
    std::string msg = m.Receive(milliseconds(1000));
    ASSERT_EQ(msg, "WATCHDOG=1") << "after " << pings << " pings";
    ++pings;
  }
  const auto elapsed = std::chrono::steady_clock::now() - t0;
  n.StopWatchdog();
  // 5 pings: the first at once, then 4 periods of 50 ms; far less than 4 timeouts (400 ms)
  // where the machine is idle, and within the margin on a loaded one.
  EXPECT_GE(elapsed, milliseconds(180));
  EXPECT_LT(elapsed, hiqcache::test_time::Margin(milliseconds(1000)));
  // Stopped: no more pings.
  while (!m.Receive(milliseconds(0)).empty()) {
  }
  EXPECT_EQ(m.Receive(milliseconds(150)), "");
}

TEST(ServiceNotifierTest, WatchdogWithholdsPingsWhileNotAlive) {
  FakeManager m(TempPath("wd-dead.sock"));
  ASSERT_TRUE(m.bound());
  ServiceNotifier n(m.address(), std::chrono::microseconds(40000));
  std::atomic<bool> alive{false};
  n.StartWatchdog([&] { return alive.load(); });
  EXPECT_EQ(m.Receive(milliseconds(120)), "");
  alive = true;
  EXPECT_EQ(m.Receive(milliseconds(1000)), "WATCHDOG=1");
}

TEST(ServiceNotifierTest, FromEnvironmentHonoursWatchdogPid) {
  const std::string path = TempPath("env.sock");
  ::setenv("NOTIFY_SOCKET", path.c_str(), 1);
  ::setenv("WATCHDOG_USEC", "200000", 1);
  ::unsetenv("WATCHDOG_PID");
  {
    ServiceNotifier n = ServiceNotifier::FromEnvironment();
    EXPECT_EQ(n.socket(), path);
    EXPECT_EQ(n.watchdog_timeout(), std::chrono::microseconds(200000));
  }
  ::setenv("WATCHDOG_PID", std::to_string(::getpid()).c_str(), 1);
  EXPECT_EQ(ServiceNotifier::FromEnvironment().watchdog_timeout().count(), 200000);
  // Pings are meant for another process (e.g. inherited environment): none from here.
  ::setenv("WATCHDOG_PID", std::to_string(::getpid() + 1).c_str(), 1);
  EXPECT_EQ(ServiceNotifier::FromEnvironment().watchdog_timeout().count(), 0);
  // A relative path is not a valid address.
  ::setenv("NOTIFY_SOCKET", "relative.sock", 1);
  EXPECT_FALSE(ServiceNotifier::FromEnvironment().enabled());
  ::unsetenv("NOTIFY_SOCKET");
  ::unsetenv("WATCHDOG_USEC");
  ::unsetenv("WATCHDOG_PID");
  EXPECT_FALSE(ServiceNotifier::FromEnvironment().enabled());
}

}  // namespace
}  // namespace hiqcache::server
