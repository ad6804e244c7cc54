// The isolation unit beyond the uid (peer_placement.h), under real separate processes:
//  - uid 0 inside a container (a pid namespace of its own, `unshare --pid`) or in an engine's pod
//    (a cgroup kubelet would name, host pid namespace) is no admin: it may not Drain, and
//    GetStats shows it none of another user's pools, which the node's root sees;
//  - with namespace_scope = pod, engines of one uid in two Kubernetes pods (real cgroups named as
//    kubelet names them) share nothing, while two containers of one pod share their blocks; with
//    the default scope (uid) the same two pods share, which is what "pod" changes.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include "daemon_process.h"
#include "rob_util.h"

namespace hiqcache::rob {
namespace {

using testing::DaemonProcess;
using namespace std::chrono_literals;

constexpr uint32_t kVictim = 61321;
constexpr uint32_t kTenant = 61322;

// `argv` as root in a pid namespace of its own (util-linux unshare): a container's view.
std::vector<std::string> InContainer(std::vector<std::string> argv) {
  // With the namespace's own /proc, as a container has, and as a child of its PID 1, a shell.
  // Without them an ASan build's hiqctl failed now and then at exit: LeakSanitizer lists the
  // threads to stop under /proc/<its pid>, the host's /proc/1 there, so it reported what gRPC's
  // threads held as leaked; then its abort crashed (a PID 1 ignores its own SIGABRT).
  std::vector<std::string> out = {
      "/usr/bin/unshare", "--pid", "--fork", "--mount-proc", "--", "/bin/sh", "-c",
      "\"$@\"; exit $?",  "sh"};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

class PodIsolationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as other users and containers";
  }
};

// Two Kubernetes pods as kubelet lays them out (cgroupfs driver) under a cgroup of this test.
class PodCgroups {
 public:
  PodCgroups() {
    for (const char* root : {"/sys/fs/cgroup/unified", "/sys/fs/cgroup"}) {
      struct stat st;
      const std::string procs = std::string(root) + "/cgroup.procs";
      if (::stat(procs.c_str(), &st) == 0 && ::access(root, W_OK) == 0) {
        base_ = std::string(root) + "/hiq-pod-test-" + std::to_string(::getpid());
        break;
      }
    }
    if (base_.empty()) return;
    std::error_code ec;
    for (const char* c : {kPodA, kPodB}) {
      for (const char* container : {"/c1", "/c2"}) {
        std::filesystem::create_directories(Container(c, container), ec);
      }
    }
    if (ec) base_.clear();
  }
  ~PodCgroups() {
    if (base_.empty()) return;
    for (const char* c : {kPodA, kPodB}) {
      for (const char* container : {"/c1", "/c2"}) ::rmdir(Container(c, container).c_str());
      ::rmdir((base_ + "/kubepods/besteffort/pod" + c).c_str());
    }
    ::rmdir((base_ + "/kubepods/besteffort").c_str());
    ::rmdir((base_ + "/kubepods").c_str());
    ::rmdir(base_.c_str());
  }
  bool ok() const { return !base_.empty(); }
  std::string Container(const char* pod, const char* container) const {
    return base_ + "/kubepods/besteffort/pod" + pod + container;
  }
  // `argv` as `uid`, started inside the cgroup `dir`.
  static std::vector<std::string> Run(const std::string& dir, uint32_t uid,
                                      std::vector<std::string> argv) {
    std::vector<std::string> out = {
        "/bin/sh", "-c", "echo $$ > \"$0/cgroup.procs\" && shift && exec \"$@\"", dir, "--"};
    for (auto& a : it::AsUid(uid, argv)) out.push_back(a);
    return out;
  }
  static constexpr const char* kPodA = "0a1b2c3d-1111-2222-3333-444455556666";
  static constexpr const char* kPodB = "9f8e7d6c-1111-2222-3333-444455556666";

 private:
  std::string base_;
};

TEST_F(PodIsolationTest, RootInsideAContainerIsNoAdmin) {
  DaemonProcess daemon("16MiB", {"--socket-mode", "0666", "--prefault", "false"});
  ASSERT_TRUE(daemon.Start());
  // Another user's engine, holding its pools.
  Child victim(it::AsUid(kVictim, {HIQ_ROB_WORKER_PATH, "--target", daemon.target(), "--mode",
                                   "hold", "--pin-blocks", "4"}));
  ASSERT_TRUE(victim.WaitLine("holding", 60s));
  // The node's root sees the victim's pools, with their ids.
  auto root = it::Connect(daemon.target());
  ASSERT_NE(root, nullptr);
  auto stats = root->GetStats();
  ASSERT_TRUE(stats.ok());
  size_t seen = 0;
  for (const auto& p : stats->pools) seen += p.uid == kVictim && p.pool_id != 0;
  EXPECT_EQ(seen, 2u);

  // Root in a container: no pool of the victim's, and no Drain.
  it::SpawnResult s =
      it::Spawn(InContainer({HIQCTL_PATH, "--target", daemon.target(), "stats", "--json"}), 30s);
  EXPECT_EQ(s.exit_code, 0) << s.out;
  EXPECT_NE(s.out.find("\"pools\""), std::string::npos) << s.out;
  EXPECT_EQ(s.out.find("\"uid\": " + std::to_string(kVictim)), std::string::npos) << s.out;
  it::SpawnResult d =
      it::Spawn(InContainer({HIQCTL_PATH, "--target", daemon.target(), "drain"}), 30s);
  EXPECT_NE(d.exit_code, 0) << d.out;
  // Root in an engine's pod that shares the host's pid namespace (hostPID): its cgroup names a
  // pod that is not the daemon's.
  PodCgroups pods;
  if (pods.ok()) {
    it::SpawnResult p = it::Spawn(
        {"/bin/sh", "-c", "echo $$ > \"$0/cgroup.procs\" && exec \"$1\" --target \"$2\" drain",
         pods.Container(PodCgroups::kPodA, "/c1"), HIQCTL_PATH, daemon.target()},
        30s);
    EXPECT_NE(p.exit_code, 0) << p.out;
  }
  // Not draining: new work is still taken.
  it::PoolOptions o;
  o.model = "after-container-drain";
  o.geometry = it::Geom(2, 2, 64);
  auto pool = it::MakePool(*root, o);
  EXPECT_TRUE(pool.ok()) << "root inside a container drained the daemon: "
                         << pool.status().ToString();
  // The control: the node's root may.
  it::SpawnResult h = it::Spawn({HIQCTL_PATH, "--target", daemon.target(), "drain"}, 30s);
  EXPECT_EQ(h.exit_code, 0) << h.out;
  victim.Kill();
  EXPECT_EQ(daemon.Stop(), 0);
}

it::SpawnResult Peer(const DaemonProcess& d, const std::string& cgroup, const std::string& mode) {
  return it::Spawn(PodCgroups::Run(cgroup, kTenant,
                                   {HIQ_IT_PEER_PATH, "--target", d.target(), "--mode", mode,
                                    "--model", "pod-model"}),
                   60s);
}

TEST_F(PodIsolationTest, PodsThatShareAUidShareNothingUnderPodScope) {
  PodCgroups pods;
  if (!pods.ok()) GTEST_SKIP() << "no writable cgroup v2 hierarchy";
  const std::string a1 = pods.Container(PodCgroups::kPodA, "/c1");
  const std::string a2 = pods.Container(PodCgroups::kPodA, "/c2");
  const std::string b1 = pods.Container(PodCgroups::kPodB, "/c1");
  for (const char* scope : {"uid", "pod"}) {
    SCOPED_TRACE(scope);
    DaemonProcess daemon(
        "16MiB", {"--socket-mode", "0666", "--prefault", "false", "--namespace-scope", scope});
    ASSERT_TRUE(daemon.Start());
    it::SpawnResult backup = Peer(daemon, a1, "backup");
    ASSERT_EQ(backup.exit_code, 0) << backup.out;
    ASSERT_NE(backup.out.find("backup 4"), std::string::npos) << backup.out;
    // Another container of the same pod shares the pod's blocks under either scope.
    it::SpawnResult same_pod = Peer(daemon, a2, "lookup");
    EXPECT_NE(same_pod.out.find("lookup 4"), std::string::npos) << same_pod.out;
    // Another pod of the same uid: everything under "uid", nothing under "pod".
    it::SpawnResult other_pod = Peer(daemon, b1, "lookup");
    EXPECT_EQ(other_pod.exit_code, 0) << other_pod.out;
    const bool shared = other_pod.out.find("lookup 4") != std::string::npos;
    EXPECT_EQ(shared, std::string(scope) == "uid") << other_pod.out;
    EXPECT_EQ(daemon.Stop(), 0);
  }
}

}  // namespace
}  // namespace hiqcache::rob
