// The real hiqcached under a fake service manager (a datagram socket named by NOTIFY_SOCKET):
// STATUS= lines while it starts, READY=1 only once its unix socket accepts connections and the
// health service says SERVING, WATCHDOG=1 every WATCHDOG_USEC/2, STOPPING=1 on SIGTERM (health
// no longer SERVING), exit 0. While it pre-faults its pool it already answers: health
// NOT_SERVING, Cache RPCs UNAVAILABLE with the phase and its progress; SIGTERM then stops it
// before the pool is resident.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <cstddef>
#include <cstring>

#include "fake_notify_manager.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "hiqcache/v1/cache.grpc.pb.h"
#include "process_util.h"
#include "time_margin.h"

namespace hiqcache::deploy_test {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

using NotifySocket = FakeManager;  // the service manager that hiqcached notifies

bool Connectable(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::strncpy(sa.sun_path, path.c_str(), sizeof(sa.sun_path) - 1);
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0;
  ::close(fd);
  return ok;
}

// grpc.health.v1 status of `service` ("": the server as a whole), or -1 when the call fails
// (NOT_FOUND for a service the daemon does not name).
int HealthStatus(const std::string& target, const std::string& service = "") {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  if (!stub->Check(&ctx, req, &resp).ok()) return -1;
  return resp.status();
}

bool HasLine(const std::string& msg, const std::string& line) {
  for (const auto& l : Lines(msg)) {
    if (l == line) return true;
  }
  return false;
}

// One daemon started with NOTIFY_SOCKET (and WATCHDOG_USEC) in its environment.
class NotifiedDaemon {
 public:
  NotifiedDaemon(const std::string& notify_address, const std::string& watchdog_usec,
                 const std::string& pool_bytes = "128MiB")
      : dir_("notify-daemon"),
        socket_path_(dir_.path() + "/hiqcached.sock"),
        shm_name_("/hiq-notify-" + std::to_string(::getpid()) + "-" + std::to_string(counter_++)) {
    std::vector<std::string> env = {"NOTIFY_SOCKET=" + notify_address};
    if (!watchdog_usec.empty()) env.push_back("WATCHDOG_USEC=" + watchdog_usec);
    pid_ = SpawnProcess({HIQ_DAEMON_PATH, "--listen", target(), "--pool-bytes", pool_bytes,
                         "--shm-name", shm_name_, "--log-level", "warn"},
                        EnvWith(env));
  }
  ~NotifiedDaemon() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      int st;
      ::waitpid(pid_, &st, 0);
    }
    ::shm_unlink(shm_name_.c_str());
  }
  pid_t pid() const { return pid_; }
  std::string target() const { return "unix://" + socket_path_; }
  const std::string& socket_path() const { return socket_path_; }
  // Bytes of the pool object that are resident (allocated in /dev/shm).
  uint64_t PoolResidentBytes() const {
    struct stat st {};
    if (::stat(("/dev/shm" + shm_name_).c_str(), &st) != 0) return 0;
    return static_cast<uint64_t>(st.st_blocks) * 512;
  }
  // Waits for exit; the exit code, or -1.
  int Wait(milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
      }
      std::this_thread::sleep_for(milliseconds(10));
    }
    return -1;
  }

 private:
  static inline int counter_ = 0;
  TempDir dir_;
  std::string socket_path_;
  std::string shm_name_;
  pid_t pid_ = -1;
};

TEST(DaemonNotifyTest, ReadyOnlyWhenServingWatchdogAndStopping) {
  TempDir dir("notify");
  NotifySocket manager(dir.path() + "/notify.sock");
  ASSERT_TRUE(manager.bound());
  NotifiedDaemon daemon(manager.address(), "200000");
  ASSERT_GT(daemon.pid(), 0);

  // Until READY=1: STATUS= lines only, and READY=1 finds the socket serving.
  bool ready = false, saw_status = false;
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (!ready && Clock::now() < deadline) {
    std::string msg = manager.Receive(milliseconds(200));
    if (msg.empty()) continue;
    if (HasLine(msg, "READY=1")) {
      ready = true;
      EXPECT_TRUE(Connectable(daemon.socket_path())) << "READY=1 before the socket listens";
      EXPECT_EQ(HealthStatus(daemon.target()), grpc::health::v1::HealthCheckResponse::SERVING)
          << "READY=1 before the health service serves";
      // By its service name too, as Kubernetes gRPC probes and grpc_health_probe -service ask.
      EXPECT_EQ(HealthStatus(daemon.target(), "hiqcache.v1.Cache"),
                grpc::health::v1::HealthCheckResponse::SERVING);
      EXPECT_NE(msg.find("STATUS=serving on " + daemon.target()), std::string::npos) << msg;
    } else if (msg.rfind("STATUS=", 0) == 0) {
      saw_status = true;
    } else {
      EXPECT_EQ(msg, "WATCHDOG=1") << "unexpected message before READY=1";
    }
  }
  ASSERT_TRUE(ready) << "no READY=1 within 20 s";
  EXPECT_TRUE(saw_status) << "no STATUS= line while starting";

  // WATCHDOG_USEC=200000: a ping every 100 ms.
  int pings = 0;
  const auto t0 = Clock::now();
  const auto ping_margin = hiqcache::test_time::Margin(milliseconds(1500));
  while (pings < 4 && Clock::now() - t0 < 2 * ping_margin) {
    if (manager.Receive(milliseconds(500)) == "WATCHDOG=1") ++pings;
  }
  EXPECT_EQ(pings, 4);
  // About 400 ms where the machine is idle; the margin holds on a loaded one.
  EXPECT_LT(Clock::now() - t0, ping_margin) << "pings slower than WATCHDOG_USEC/2";

  // SIGTERM: STOPPING=1 once health stops serving; then exit 0.
  ASSERT_EQ(::kill(daemon.pid(), SIGTERM), 0);
  bool stopping = false;
  const auto stop_deadline = Clock::now() + std::chrono::seconds(10);
  while (!stopping && Clock::now() < stop_deadline) {
    std::string msg = manager.Receive(milliseconds(200));
    if (HasLine(msg, "STOPPING=1")) {
      stopping = true;
      EXPECT_NE(HealthStatus(daemon.target()), grpc::health::v1::HealthCheckResponse::SERVING);
      EXPECT_NE(HealthStatus(daemon.target(), "hiqcache.v1.Cache"),
                grpc::health::v1::HealthCheckResponse::SERVING);
    }
  }
  EXPECT_TRUE(stopping) << "no STOPPING=1 after SIGTERM";
  EXPECT_EQ(daemon.Wait(std::chrono::seconds(10)), 0);
}

TEST(DaemonNotifyTest, AbstractSocketAndNoWatchdogWithoutWatchdogUsec) {
  NotifySocket manager("@hiq-notify-test-" + std::to_string(::getpid()));
  ASSERT_TRUE(manager.bound());
  NotifiedDaemon daemon(manager.address(), "");
  ASSERT_GT(daemon.pid(), 0);
  bool ready = false;
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (!ready && Clock::now() < deadline) {
    std::string msg = manager.Receive(milliseconds(200));
    EXPECT_NE(msg, "WATCHDOG=1");
    ready = HasLine(msg, "READY=1");
  }
  ASSERT_TRUE(ready);
  EXPECT_TRUE(Connectable(daemon.socket_path()));
  // No WATCHDOG_USEC: no pings.
  const auto t0 = Clock::now();
  while (Clock::now() - t0 < milliseconds(300)) {
    EXPECT_NE(manager.Receive(milliseconds(100)), "WATCHDOG=1");
  }
  ASSERT_EQ(::kill(daemon.pid(), SIGTERM), 0);
  EXPECT_EQ(daemon.Wait(std::chrono::seconds(10)), 0);
}

// A GetStats call's status (anonymous: the daemon answers it once ready).
grpc::Status CacheStatus(const std::string& target) {
  auto stub =
      hiqcache::v1::Cache::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  hiqcache::v1::GetStatsRequest req;
  hiqcache::v1::GetStatsResponse resp;
  return stub->GetStats(&ctx, req, &resp);
}

// A 2 GiB pool takes a few hundred ms or more to pre-fault (clearing its pages alone, at memory
// bandwidth):
// long enough to be seen, whatever the machine's load, which only lengthens it.
constexpr const char* kBigPool = "2GiB";
constexpr uint64_t kBigPoolBytes = 2ull << 30;
// The stop test needs the pre-fault to outlast the first answer, the signal and the daemon's
// reaction (a 100 ms tick at most) with room to spare on an idle machine (about 4 GiB/s here).
constexpr const char* kStopPool = "6GiB";
constexpr uint64_t kStopPoolBytes = 6ull << 30;

// Polls the daemon until it answers NOT_SERVING with its pre-fault progress (true), or READY
// came first / `deadline` passed (false). `*ready` tells READY=1 was seen.
bool SeenPrefaulting(NotifiedDaemon& daemon, NotifySocket& manager, Clock::time_point deadline,
                     bool* ready, std::string* message) {
  while (Clock::now() < deadline) {
    if (HasLine(manager.Receive(milliseconds(5)), "READY=1")) {
      *ready = true;
      return false;
    }
    if (!Connectable(daemon.socket_path())) continue;
    if (HealthStatus(daemon.target()) != grpc::health::v1::HealthCheckResponse::NOT_SERVING) {
      continue;
    }
    grpc::Status st = CacheStatus(daemon.target());
    if (st.error_code() == grpc::StatusCode::UNAVAILABLE &&
        st.error_message().find("starting: pre-faulting pool") != std::string::npos) {
      *message = st.error_message();
      return true;
    }
  }
  return false;
}

TEST(DaemonNotifyTest, AnswersNotServingWithProgressWhilePrefaulting) {
  TempDir dir("notify-prefault");
  NotifySocket manager(dir.path() + "/notify.sock");
  ASSERT_TRUE(manager.bound());
  NotifiedDaemon daemon(manager.address(), "", kBigPool);
  ASSERT_GT(daemon.pid(), 0);
  bool ready = false;
  std::string message;
  ASSERT_TRUE(
      SeenPrefaulting(daemon, manager, Clock::now() + std::chrono::seconds(60), &ready, &message))
      << (ready ? "READY=1 came before the daemon ever answered NOT_SERVING while pre-faulting"
                : "the daemon never answered while it pre-faulted");
  EXPECT_NE(message.find(" GiB ("), std::string::npos) << message;  // "0.5 of 4.0 GiB (12%)"
  EXPECT_NE(HealthStatus(daemon.target(), "hiqcache.v1.Cache"),
            grpc::health::v1::HealthCheckResponse::SERVING);
  // Then it becomes ready and serves, on the same socket.
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  while (!ready && Clock::now() < deadline) {
    ready = HasLine(manager.Receive(milliseconds(200)), "READY=1");
  }
  ASSERT_TRUE(ready) << "no READY=1 within 120 s";
  EXPECT_EQ(HealthStatus(daemon.target()), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_TRUE(CacheStatus(daemon.target()).ok());
  EXPECT_GE(daemon.PoolResidentBytes(), kBigPoolBytes);
  ASSERT_EQ(::kill(daemon.pid(), SIGTERM), 0);
  EXPECT_EQ(daemon.Wait(std::chrono::seconds(10)), 0);
}

TEST(DaemonNotifyTest, SigtermWhilePrefaultingStopsBeforeThePoolIsResident) {
  TempDir dir("notify-prefault-stop");
  NotifySocket manager(dir.path() + "/notify.sock");
  ASSERT_TRUE(manager.bound());
  NotifiedDaemon daemon(manager.address(), "", kStopPool);
  ASSERT_GT(daemon.pid(), 0);
  bool ready = false;
  std::string message;
  ASSERT_TRUE(
      SeenPrefaulting(daemon, manager, Clock::now() + std::chrono::seconds(60), &ready, &message));
  ASSERT_EQ(::kill(daemon.pid(), SIGTERM), 0);
  EXPECT_EQ(daemon.Wait(std::chrono::seconds(20)), 0);
  // It stopped within a step of the signal: the pool was left partly resident.
  EXPECT_LT(daemon.PoolResidentBytes(), kStopPoolBytes) << message;
  EXPECT_FALSE(Connectable(daemon.socket_path()));
}

}  // namespace
}  // namespace hiqcache::deploy_test
