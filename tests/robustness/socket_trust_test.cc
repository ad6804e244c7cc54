// A squatted socket gets nothing (socket_trust.h). Under real separate uids (setpriv):
//  - another user creates the default directory /tmp/hiqcache-<victim uid>/ first and runs a
//    daemon there: the victim's engine (default target) registers nothing with it, passes it no
//    memory and no token, and says why; told HIQ_DAEMON_UID=<that uid> it does (the control);
//  - the victim's own daemon refuses that directory, and one others may write;
//  - the systemd layout (a directory owned by the daemon's user under a root-only parent, as
//    RuntimeDirectory makes /run/hiqcache) is trusted with no configuration.
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

constexpr uint32_t kVictim = 61301;
constexpr uint32_t kAttacker = 61302;
constexpr uint32_t kDaemonUser = 61303;

std::string DefaultDir(uint32_t uid) { return "/tmp/hiqcache-" + std::to_string(uid); }

// The victim's engine: hiq_it_peer as `uid` with the default target (no XDG_RUNTIME_DIR), so
// the fallback default directory is the one it uses; `env` adds NAME=VALUE words.
it::SpawnResult VictimBackup(uint32_t uid, const std::string& target,
                             std::vector<std::string> env = {}) {
  std::vector<std::string> argv = {"/usr/bin/env", "-u", "XDG_RUNTIME_DIR"};
  argv.insert(argv.end(), env.begin(), env.end());
  for (std::string a :
       {std::string(HIQ_IT_PEER_PATH), std::string("--target"), target, std::string("--mode"),
        std::string("backup"), std::string("--model"), std::string("victim-model")}) {
    argv.push_back(std::move(a));
  }
  return it::Spawn(it::AsUid(uid, argv), 60s);
}

class SocketTrustTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as three users";
    Clean();
  }
  void TearDown() override { Clean(); }
  static void Clean() {
    std::error_code ec;
    std::filesystem::remove_all(DefaultDir(kVictim), ec);
  }
};

TEST_F(SocketTrustTest, SquattedDefaultDirectoryGetsNoMemoryOrToken) {
  // The attacker's own hiqcached on the victim's default socket path, open to everyone.
  DaemonProcess squatter("16MiB", {"--socket-mode", "0666", "--prefault", "false"});
  squatter.set_socket_path(DefaultDir(kVictim) + "/hiqcached.sock");
  squatter.set_prefix(it::AsUid(kAttacker, {}));
  ASSERT_TRUE(squatter.Start());
  struct stat st;
  ASSERT_EQ(::stat(DefaultDir(kVictim).c_str(), &st), 0);
  ASSERT_EQ(st.st_uid, kAttacker);

  // The default target ("" = /tmp/hiqcache-<uid>/hiqcached.sock without XDG_RUNTIME_DIR).
  it::SpawnResult r = VictimBackup(kVictim, "");
  EXPECT_NE(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("PERMISSION_DENIED"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("belongs to uid " + std::to_string(kAttacker)), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("backup "), std::string::npos) << r.out;

  // The control: the same engine told that uid is its daemon's registers and backs up there, so
  // what refused it above was the trust rule.
  it::SpawnResult told = VictimBackup(kVictim, "", {"HIQ_DAEMON_UID=" + std::to_string(kAttacker)});
  EXPECT_EQ(told.exit_code, 0) << told.out;
  EXPECT_NE(told.out.find("backup 4"), std::string::npos) << told.out;
  EXPECT_EQ(squatter.Stop(), 0);
}

TEST_F(SocketTrustTest, DaemonRefusesADirectoryItDoesNotOwnOrOthersMayWrite) {
  // The attacker made the victim's default directory first.
  ASSERT_EQ(::mkdir(DefaultDir(kVictim).c_str(), 0755), 0);
  ASSERT_EQ(::chown(DefaultDir(kVictim).c_str(), kAttacker, kAttacker), 0);
  const std::vector<std::string> daemon = {
      "/usr/bin/env", "-u",         "XDG_RUNTIME_DIR",    HIQ_DAEMON_PATH, "--pool-bytes",
      "16MiB",        "--shm-name", "/hiq-trust-refused", "--prefault",    "false"};
  it::SpawnResult r = it::Spawn(it::AsUid(kVictim, daemon), 30s);
  EXPECT_EQ(r.exit_code, 1);
  struct stat st;
  EXPECT_NE(::stat((DefaultDir(kVictim) + "/hiqcached.sock").c_str(), &st), 0)
      << "the daemon listened in a directory another user owns";

  // The victim's own directory, but writable by others.
  ASSERT_EQ(::chown(DefaultDir(kVictim).c_str(), kVictim, kVictim), 0);
  ASSERT_EQ(::chmod(DefaultDir(kVictim).c_str(), 0777), 0);
  r = it::Spawn(it::AsUid(kVictim, daemon), 30s);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(::stat((DefaultDir(kVictim) + "/hiqcached.sock").c_str(), &st), 0)
      << "the daemon listened in a directory others may write";
  ::shm_unlink("/hiq-trust-refused");
}

TEST_F(SocketTrustTest, SystemdLayoutIsTrustedWithoutConfiguration) {
  // /run-like: a root-owned parent nobody else may write, holding the daemon user's directory.
  char tmpl[] = "/tmp/hiq-trust-run-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string run = tmpl;
  ASSERT_EQ(::chmod(run.c_str(), 0755), 0);
  const std::string dir = run + "/hiqcache";
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  ASSERT_EQ(::chown(dir.c_str(), kDaemonUser, kDaemonUser), 0);
  {
    DaemonProcess d("16MiB", {"--socket-mode", "0666", "--prefault", "false"});
    d.set_socket_path(dir + "/hiqcached.sock");
    d.set_prefix(it::AsUid(kDaemonUser, {}));
    ASSERT_TRUE(d.Start());
    it::SpawnResult r = VictimBackup(kVictim, d.target());
    EXPECT_EQ(r.exit_code, 0) << r.out;
    EXPECT_NE(r.out.find("backup 4"), std::string::npos) << r.out;
    EXPECT_EQ(d.Stop(), 0);
  }
  std::error_code ec;
  std::filesystem::remove_all(run, ec);
}

}  // namespace
}  // namespace hiqcache::rob
