// The files that install hiqcached as a node service: the systemd unit passes
// `systemd-analyze verify` and keeps the settings the service depends on; the shipped
// configuration is accepted by the daemon and lists every setting; `cmake --install` puts
// binaries, unit and configuration where packagers expect them.
#include <gtest/gtest.h>
#include <sys/statvfs.h>

#include <filesystem>
#include <regex>
#include <set>
#include <string>

#include "process_util.h"

namespace hiqcache::deploy_test {
namespace {

const std::string kSource = HIQ_SOURCE_DIR;
const std::string kUnit = kSource + "/deploy/hiqcached.service";
const std::string kToml = kSource + "/deploy/hiqcached.toml";

// "Key=value" lines of a unit (comments and section headers dropped).
std::vector<std::string> Directives(const std::string& unit_text) {
  std::vector<std::string> out;
  for (const auto& line : Lines(unit_text)) {
    if (line.empty() || line[0] == '#' || line[0] == ';' || line[0] == '[') continue;
    out.push_back(line);
  }
  return out;
}

bool Has(const std::vector<std::string>& directives, const std::string& line) {
  for (const auto& d : directives) {
    if (d == line) return true;
  }
  return false;
}

bool HasKey(const std::vector<std::string>& directives, const std::string& key) {
  for (const auto& d : directives) {
    if (d.rfind(key + "=", 0) == 0) return true;
  }
  return false;
}

std::string Replace(std::string s, const std::string& from, const std::string& to) {
  for (size_t pos = 0; (pos = s.find(from, pos)) != std::string::npos; pos += to.size()) {
    s.replace(pos, from.size(), to);
  }
  return s;
}

TEST(SystemdUnitTest, KeepsTheSettingsTheServiceDependsOn) {
  const auto d = Directives(ReadFile(kUnit));
  ASSERT_FALSE(d.empty()) << kUnit;
  for (const char* line :
       {"Type=notify", "Restart=on-failure", "LimitMEMLOCK=infinity", "RuntimeDirectory=hiqcache",
        "User=hiqcache", "Group=hiqcache", "NoNewPrivileges=yes", "ProtectSystem=strict",
        "ProtectHome=yes", "RemoveIPC=no",
        "ExecStart=/usr/bin/hiqcached --config /etc/hiqcache/hiqcached.toml"}) {
    EXPECT_TRUE(Has(d, line)) << "missing: " << line;
  }
  EXPECT_TRUE(HasKey(d, "WatchdogSec"));
  // Settings that would break CUDA or the cache must stay off.
  for (const char* key : {"PrivateDevices", "MemoryDenyWriteExecute", "DevicePolicy",
                          "ProtectClock", "PrivateIPC", "DynamicUser", "ProtectProc"}) {
    EXPECT_FALSE(HasKey(d, key)) << key << " breaks CUDA or the warm pool; see the unit's notes";
  }
}

TEST(SystemdUnitTest, PassesSystemdAnalyzeVerify) {
  const std::string analyze = FindProgram("systemd-analyze");
  if (analyze.empty()) {
    GTEST_SKIP() << "systemd-analyze not installed (Debian package `systemd`; "
                    "deploy/install-deps.sh installs it)";
  }
  // A copy whose ExecStart names the built binary, so verify can check the command exists.
  TempDir dir("unit");
  std::string text = ReadFile(kUnit);
  text = Replace(text, "/usr/bin/hiqcached", HIQ_DAEMON_PATH);
  text = Replace(text, "/etc/hiqcache/hiqcached.toml", kToml);
  const std::string copy = dir.path() + "/hiqcached.service";
  {
    std::ofstream out(copy);
    out << text;
  }
  RunResult r = RunProgram({analyze, "verify", "--man=no", copy}, {"SYSTEMD_LOG_COLOR=0"});
  // In a container verify may also complain about the host (no running manager, other units):
  // only lines about this unit count.
  std::string problems;
  for (const auto& line : Lines(r.output)) {
    if (line.find("hiqcached.service") != std::string::npos) problems += line + "\n";
  }
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(problems, "") << "systemd-analyze verify reported problems with the unit";
}

TEST(ConfigFileTest, DaemonAcceptsTheShippedConfiguration) {
  RunResult r = RunProgram({HIQ_DAEMON_PATH, "--config", kToml, "--check-config"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("listen = [\"unix:///run/hiqcache/hiqcached.sock\"]"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("socket_mode = \"0660\""), std::string::npos) << r.output;
}

TEST(ConfigFileTest, ListsEverySettingOfTheEmbeddedDefault) {
  RunResult def = RunProgram({HIQ_DAEMON_PATH, "--print-default-config"});
  ASSERT_EQ(def.exit_code, 0) << def.output;
  const std::regex setting(R"(^\s*([a-z_]+)\s*=)");
  std::set<std::string> shipped, embedded;
  for (const auto& line : Lines(ReadFile(kToml))) {
    std::smatch m;
    if (std::regex_search(line, m, setting)) shipped.insert(m[1]);
  }
  for (const auto& line : Lines(def.output)) {
    std::smatch m;
    if (std::regex_search(line, m, setting)) embedded.insert(m[1]);
  }
  ASSERT_FALSE(embedded.empty());
  for (const auto& key : embedded) {
    EXPECT_TRUE(shipped.count(key)) << "deploy/hiqcached.toml does not list '" << key << "'";
  }
  // Each setting has a comment right above it (a blank line separates settings).
  const auto lines = Lines(ReadFile(kToml));
  for (size_t i = 0; i < lines.size(); ++i) {
    std::smatch m;
    if (!std::regex_search(lines[i], m, setting)) continue;
    ASSERT_GT(i, 0u);
    EXPECT_EQ(lines[i - 1].rfind("#", 0), 0u) << "no comment above '" << m[1] << "'";
  }
}

TEST(ConfigFileTest, RejectsAnUnknownSocketGroupAtStart) {
  TempDir dir("grp");
  RunResult r =
      RunProgram({HIQ_DAEMON_PATH, "--listen", "unix://" + dir.path() + "/s.sock", "--pool-bytes",
                  "16MiB", "--shm-name", "/hiq-grp-test-" + std::to_string(::getpid()),
                  "--prefault", "false", "--socket-group", "no-such-group-hiq"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("no-such-group-hiq"), std::string::npos) << r.output;
}

// A pool larger than /dev/shm can hold (a 64 MB Docker /dev/shm) used to map as a sparse object
// and SIGBUS when pre-faulted; the daemon refuses it at start, naming pool_bytes and the free
// space. Asked for more than the whole filesystem, so nothing is ever filled.
TEST(ConfigFileTest, RefusesAPoolLargerThanDevShm) {
  struct statvfs fs {};
  ASSERT_EQ(::statvfs("/dev/shm", &fs), 0);
  const uint64_t bytes = static_cast<uint64_t>(fs.f_blocks) * fs.f_frsize + (uint64_t{1} << 30);
  TempDir dir("shm");
  const std::string shm = "hiq-shm-room-test-" + std::to_string(::getpid());
  RunResult r =
      RunProgram({HIQ_DAEMON_PATH, "--listen", "unix://" + dir.path() + "/s.sock", "--pool-bytes",
                  std::to_string(bytes), "--shm-name", "/" + shm, "--prefault", "true"});
  const bool created = std::filesystem::exists("/dev/shm/" + shm);
  std::filesystem::remove("/dev/shm/" + shm);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("pool_bytes " + std::to_string(bytes)), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("does not fit in /dev/shm"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("free of"), std::string::npos) << r.output;
  EXPECT_FALSE(created) << "the refused pool's shm object was left in /dev/shm";
}

TEST(InstallTest, PutsFilesWherePackagersExpect) {
#ifndef HIQ_HAVE_HIQCTL
  GTEST_SKIP() << "hiqctl is not part of this build";
#endif
  TempDir dest("install");
  RunResult r = RunProgram({HIQ_CMAKE_COMMAND, "--install", HIQ_BINARY_DIR},
                           {"DESTDIR=" + dest.path()}, std::chrono::seconds(60));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string prefix = dest.path() + HIQ_INSTALL_PREFIX;
  const std::string bindir = dest.path() + HIQ_INSTALL_FULL_BINDIR;
  const std::string unitdir = std::string(HIQ_SYSTEMD_UNITDIR).rfind("/", 0) == 0
                                  ? dest.path() + HIQ_SYSTEMD_UNITDIR
                                  : prefix + "/" + HIQ_SYSTEMD_UNITDIR;
  const std::string confdir = dest.path() + HIQ_INSTALL_CONFIG_DIR;
  for (const std::string& f : {bindir + "/hiqcached", bindir + "/hiqctl"}) {
    EXPECT_EQ(::access(f.c_str(), X_OK), 0) << f;
  }
  EXPECT_TRUE(std::filesystem::exists(confdir + "/hiqcached.toml")) << confdir;
  EXPECT_TRUE(std::filesystem::exists(prefix + "/lib/sysusers.d/hiqcache.conf"));
  const std::string unit = ReadFile(unitdir + "/hiqcached.service");
  ASSERT_FALSE(unit.empty()) << unitdir;
  // The installed unit names the installed binary and configuration.
  EXPECT_TRUE(Has(Directives(unit), std::string("ExecStart=") + HIQ_INSTALL_FULL_BINDIR +
                                        "/hiqcached --config " + HIQ_INSTALL_CONFIG_DIR +
                                        "/hiqcached.toml"))
      << unit;
  EXPECT_EQ(ReadFile(confdir + "/hiqcached.toml"), ReadFile(kToml));
}

}  // namespace
}  // namespace hiqcache::deploy_test
