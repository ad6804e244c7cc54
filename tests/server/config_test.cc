// hiqcached's configuration (config.h): sizes, the embedded default, config files and flags
// (docs/design.md "Command line").
#include "core/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "core/cache_core.h"
#include "hiqcache/paths.h"
#include "server_test_util.h"

namespace hiqcache::server {
namespace {

// argv for LoadConfig, owning its strings.
class Args {
 public:
  Args(std::initializer_list<std::string> args) : strings_{"hiqcached"} {
    strings_.insert(strings_.end(), args);
    for (auto& s : strings_) ptrs_.push_back(s.data());
    ptrs_.push_back(nullptr);
  }
  int argc() const { return static_cast<int>(strings_.size()); }
  char** argv() { return ptrs_.data(); }

 private:
  std::vector<std::string> strings_;
  std::vector<char*> ptrs_;
};

StatusOr<DaemonConfig> Load(Args args, bool* exit_now = nullptr, std::string* message = nullptr) {
  bool e = false;
  std::string m;
  auto r = LoadConfig(args.argc(), args.argv(), exit_now ? exit_now : &e, message ? message : &m);
  return r;
}

class ConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/hiq-config-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    for (const auto& f : files_) ::unlink(f.c_str());
    ::rmdir(dir_.c_str());
  }
  std::string Write(const std::string& name, const std::string& text) {
    std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    files_.push_back(path);
    return path;
  }
  std::string dir_;
  std::vector<std::string> files_;
};

// Expects INVALID_ARGUMENT whose message contains `where`.
template <typename T>
void ExpectErrorNaming(const StatusOr<T>& r, const std::string& where) {
  ASSERT_FALSE(r.ok()) << "accepted; expected an error naming " << where;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(where), std::string::npos)
      << "'" << r.status().message() << "' does not name " << where;
}
void ExpectErrorNaming(const Status& st, const std::string& where) {
  ASSERT_FALSE(st.ok()) << "accepted; expected an error naming " << where;
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find(where), std::string::npos)
      << "'" << st.message() << "' does not name " << where;
}

TEST(ParseSizeTest, BinaryDecimalAndPlain) {
  EXPECT_EQ(ParseSize("8GiB").value(), 8ull << 30);
  EXPECT_EQ(ParseSize("8GB").value(), 8000000000ull);
  EXPECT_EQ(ParseSize("8589934592").value(), 8589934592ull);
  EXPECT_EQ(ParseSize("512MiB").value(), 512ull << 20);
  EXPECT_EQ(ParseSize("512mib").value(), 512ull << 20);
  EXPECT_EQ(ParseSize("4KiB").value(), 4096u);
  EXPECT_EQ(ParseSize("4kb").value(), 4000u);
  EXPECT_EQ(ParseSize("2TiB").value(), 2ull << 40);
  EXPECT_EQ(ParseSize("3TB").value(), 3000000000000ull);
  EXPECT_EQ(ParseSize("1G").value(), 1ull << 30);
  EXPECT_EQ(ParseSize("100B").value(), 100u);
  EXPECT_EQ(ParseSize(" 8 GiB ").value(), 8ull << 30);
  EXPECT_EQ(ParseSize("0").value(), 0u);
}

TEST(ParseSizeTest, RejectsBadUnitsAndOverflow) {
  for (const char* bad :
       {"", "GiB", "8XB", "8 gigabytes", "1.5GiB", "-1", "0x10", "8GiBs", "99999999999999999999",
        "17179869184GiB", "18446744073709551616", "20000000TB"}) {
    auto r = ParseSize(bad);
    EXPECT_FALSE(r.ok()) << "'" << bad << "' parsed as " << (r.ok() ? r.value() : 0);
    if (!r.ok()) EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
  // The largest values still fit.
  EXPECT_EQ(ParseSize("16777215TiB").value(), 16777215ull << 40);
  EXPECT_EQ(ParseSize("9999999999999999999").value(), 9999999999999999999ull);
}

TEST(EmbeddedDefaultTest, ParsesToTheDocumentedValues) {
  DaemonConfig c;
  HIQ_ASSERT_OK(ApplyConfigText(EmbeddedDefaultConfig(), "<embedded>", &c));
  EXPECT_TRUE(c.listen.empty());
  EXPECT_EQ(c.pool_bytes, 4ull << 30);
  EXPECT_EQ(c.shm_name, "/hiqcache-pool");
  EXPECT_EQ(c.device, "auto");
  EXPECT_EQ(c.max_message_bytes, 64ull << 20);
  EXPECT_TRUE(c.prefault);
  EXPECT_EQ(c.cuda_staging_bytes, 128ull << 20);
  EXPECT_EQ(c.release_timeout_ms, 5000u);
}

TEST(EmbeddedDefaultTest, QuotasScopeAndSubTasks) {
  DaemonConfig c;
  HIQ_ASSERT_OK(ApplyConfigText(EmbeddedDefaultConfig(), "<embedded>", &c));
  EXPECT_EQ(c.namespace_scope, "uid");
  EXPECT_EQ(c.max_pools_per_client, 256u);
  EXPECT_EQ(c.max_buffers_per_client, 8192u);
  EXPECT_EQ(c.max_mapped_bytes_per_client, 16ull << 40);
  EXPECT_EQ(c.max_pending_bytes_per_client, 64ull << 30);
  EXPECT_EQ(c.max_reserved_slots_per_client, 16384u);
  EXPECT_EQ(c.max_faulted_bytes_per_client, 4ull << 30);
  EXPECT_EQ(c.max_repeated_rows_per_request, 1024u);
  EXPECT_EQ(c.transfer_chunk_blocks, 64u);
  EXPECT_EQ(c.transfer_chunk_bytes, 16ull << 20);
  // The core's defaults agree with the embedded file.
  CoreOptions o, defaults;
  ApplyCoreSettings(c, &o);
  EXPECT_EQ(o.quotas.max_pools_per_client, defaults.quotas.max_pools_per_client);
  EXPECT_EQ(o.quotas.max_buffers_per_client, defaults.quotas.max_buffers_per_client);
  EXPECT_EQ(o.quotas.max_mapped_bytes_per_client, defaults.quotas.max_mapped_bytes_per_client);
  EXPECT_EQ(o.quotas.max_pending_bytes_per_client, defaults.quotas.max_pending_bytes_per_client);
  EXPECT_EQ(o.quotas.max_reserved_slots_per_client, defaults.quotas.max_reserved_slots_per_client);
  EXPECT_EQ(o.quotas.max_faulted_bytes_per_client, defaults.quotas.max_faulted_bytes_per_client);
  EXPECT_EQ(o.limits.max_repeated_rows_per_request, defaults.limits.max_repeated_rows_per_request);
  EXPECT_EQ(o.transfer_chunk_blocks, defaults.transfer_chunk_blocks);
  EXPECT_EQ(o.transfer_chunk_bytes, defaults.transfer_chunk_bytes);
  EXPECT_EQ(o.namespace_scope, NamespaceScope::kUid);
}

TEST(LoadConfigTest, QuotaFlagsAndScope) {
  std::vector<std::string> args = {"hiqcached",
                                   "--namespace-scope",
                                   "node",
                                   "--max-pools-per-client",
                                   "3",
                                   "--max-buffers-per-client=40",
                                   "--max-mapped-bytes-per-client",
                                   "2GiB",
                                   "--max-pending-bytes-per-client",
                                   "1GiB",
                                   "--max-reserved-slots-per-client",
                                   "77",
                                   "--max-faulted-bytes-per-client",
                                   "3MiB",
                                   "--max-repeated-rows-per-request",
                                   "0",
                                   "--transfer-chunk-blocks",
                                   "8",
                                   "--transfer-chunk-bytes",
                                   "4MiB"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  bool exit_now = false;
  std::string message;
  auto c = LoadConfig(static_cast<int>(argv.size()), argv.data(), &exit_now, &message);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->namespace_scope, "node");
  EXPECT_EQ(c->max_pools_per_client, 3u);
  EXPECT_EQ(c->max_buffers_per_client, 40u);
  EXPECT_EQ(c->max_mapped_bytes_per_client, 2ull << 30);
  EXPECT_EQ(c->max_pending_bytes_per_client, 1ull << 30);
  EXPECT_EQ(c->max_reserved_slots_per_client, 77u);
  EXPECT_EQ(c->max_faulted_bytes_per_client, 3ull << 20);
  EXPECT_EQ(c->max_repeated_rows_per_request, 0u);  // no repeated row at all
  EXPECT_EQ(c->transfer_chunk_blocks, 8u);
  EXPECT_EQ(c->transfer_chunk_bytes, 4ull << 20);
  CoreOptions o;
  ApplyCoreSettings(*c, &o);
  EXPECT_EQ(o.namespace_scope, NamespaceScope::kNode);
  EXPECT_EQ(o.quotas.max_pools_per_client, 3u);
  EXPECT_EQ(o.transfer_chunk_bytes, 4ull << 20);
  // The file spells the same keys with underscores.
  DaemonConfig f;
  HIQ_ASSERT_OK(ApplyConfigText(EmbeddedDefaultConfig(), "<embedded>", &f));
  HIQ_ASSERT_OK(
      ApplyConfigText("max_pools_per_client = 5\nnamespace_scope = \"node\"\n"
                      "max_pending_bytes_per_client = \"3GiB\"\n",
                      "f", &f));
  EXPECT_EQ(f.max_pools_per_client, 5u);
  EXPECT_EQ(f.namespace_scope, "node");
  EXPECT_EQ(f.max_pending_bytes_per_client, 3ull << 30);
  // Bad values name the setting.
  for (std::vector<std::string> bad : {std::vector<std::string>{"--namespace-scope", "tenant"},
                                       std::vector<std::string>{"--max-pools-per-client", "0"},
                                       std::vector<std::string>{"--transfer-chunk-bytes", "0"}}) {
    std::vector<std::string> a = {"hiqcached", bad[0], bad[1]};
    std::vector<char*> av;
    for (auto& x : a) av.push_back(x.data());
    auto r = LoadConfig(static_cast<int>(av.size()), av.data(), &exit_now, &message);
    ASSERT_FALSE(r.ok()) << bad[0];
    std::string key = bad[0].substr(2);
    for (char& ch : key) ch = ch == '-' ? '_' : ch;
    EXPECT_NE(r.status().message().find(key), std::string::npos) << r.status().ToString();
  }
}

TEST(LoadConfigTest, ConnectionGrpcBoundsAndPodScope) {
  DaemonConfig d;
  HIQ_ASSERT_OK(ApplyConfigText(EmbeddedDefaultConfig(), "<embedded>", &d));
  EXPECT_EQ(d.max_connections, 4096u);
  EXPECT_EQ(d.max_connections_per_uid, 128u);
  EXPECT_EQ(d.max_streams_per_connection, 32u);
  EXPECT_EQ(d.grpc_memory_bytes, 256ull << 20);
  EXPECT_EQ(d.sessionless_message_bytes, 1ull << 20);
  auto load = [](std::vector<std::string> args) {
    args.insert(args.begin(), "hiqcached");
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    bool exit_now = false;
    std::string message;
    return LoadConfig(static_cast<int>(argv.size()), argv.data(), &exit_now, &message);
  };
  auto pod = load({"--namespace-scope", "pod"});
  ASSERT_TRUE(pod.ok()) << pod.status().ToString();
  CoreOptions o;
  ApplyCoreSettings(*pod, &o);
  EXPECT_EQ(o.namespace_scope, NamespaceScope::kPod);
  auto c = load({"--max-connections", "100", "--max-connections-per-uid=7",
                 "--max-streams-per-connection", "4", "--grpc-memory-bytes", "64MiB",
                 "--sessionless-message-bytes", "64KiB"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->max_connections, 100u);
  EXPECT_EQ(c->max_connections_per_uid, 7u);
  EXPECT_EQ(c->max_streams_per_connection, 4u);
  EXPECT_EQ(c->grpc_memory_bytes, 64ull << 20);
  EXPECT_EQ(c->sessionless_message_bytes, 64ull << 10);
  for (std::vector<std::string> bad :
       {std::vector<std::string>{"--max-connections", "0"},
        std::vector<std::string>{"--max-connections-per-uid", "0"},
        std::vector<std::string>{"--max-streams-per-connection", "0"},
        std::vector<std::string>{"--grpc-memory-bytes", "1MiB"},
        std::vector<std::string>{"--sessionless-message-bytes", "1KiB"},
        std::vector<std::string>{"--sessionless-message-bytes", "1GiB"}}) {
    auto r = load(bad);
    ASSERT_FALSE(r.ok()) << bad[0];
    std::string key = bad[0].substr(2);
    for (char& ch : key) ch = ch == '-' ? '_' : ch;
    EXPECT_NE(r.status().message().find(key), std::string::npos) << r.status().ToString();
  }
}

TEST(LoadConfigTest, NoArgumentsGivesTheDefault) {
  bool exit_now = true;
  std::string message;
  auto r = Load({}, &exit_now, &message);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(exit_now);
  ASSERT_EQ(r->listen.size(), 1u);
  EXPECT_EQ(r->listen[0], hiqcache::DefaultTarget());
  EXPECT_EQ(r->listen[0].rfind("unix:///", 0), 0u) << r->listen[0];
  EXPECT_EQ(r->pool_bytes, 4ull << 30);
  EXPECT_EQ(r->shm_name, "/hiqcache-pool");
  EXPECT_EQ(r->device, "auto");
  EXPECT_EQ(r->log_level, "info");
  EXPECT_EQ(r->socket_mode, 0660u);
  EXPECT_EQ(r->transfer_workers, 2u);
  EXPECT_EQ(r->wait_timeout_ms, 10000u);
  EXPECT_EQ(r->max_blocks_per_request, 4096u);
}

TEST(LoadConfigTest, Flags) {
  auto r = Load({"--pool-bytes", "8GB", "--shm-name=/other", "--device", "host", "--metrics-listen",
                 "127.0.0.1:9400", "--listen", "unix:///tmp/x.sock", "--listen", "127.0.0.1:7000",
                 "--log-level", "debug"});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->pool_bytes, 8000000000ull);
  EXPECT_EQ(r->shm_name, "/other");
  EXPECT_EQ(r->device, "host");
  EXPECT_EQ(r->metrics_listen, "127.0.0.1:9400");
  EXPECT_EQ(r->log_level, "debug");
  EXPECT_EQ(r->listen, (std::vector<std::string>{"unix:///tmp/x.sock", "127.0.0.1:7000"}));
}

TEST(LoadConfigTest, HelpAndPrintDefaultExitNow) {
  bool exit_now = false;
  std::string message;
  auto r = Load({"--pool-bytes", "1GiB", "--help"}, &exit_now, &message);
  EXPECT_TRUE(r.ok());
  EXPECT_TRUE(exit_now);
  EXPECT_NE(message.find("usage"), std::string::npos) << message;
  EXPECT_NE(message.find("--listen"), std::string::npos);
  exit_now = false;
  r = Load({"-h"}, &exit_now, &message);
  EXPECT_TRUE(exit_now);
  exit_now = false;
  r = Load({"--print-default-config"}, &exit_now, &message);
  EXPECT_TRUE(exit_now);
  EXPECT_EQ(message, EmbeddedDefaultConfig());
}

TEST(LoadConfigTest, CheckConfigPrintsTheEffectiveSettings) {
  bool exit_now = false;
  std::string message;
  auto r = Load({"--check-config", "--pool-bytes", "1GiB", "--socket-group", "hiq"}, &exit_now,
                &message);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(exit_now);
  EXPECT_EQ(r->socket_group, "hiq");
  EXPECT_NE(message.find("pool_bytes = 1073741824"), std::string::npos) << message;
  EXPECT_NE(message.find("socket_group = \"hiq\""), std::string::npos) << message;
  // An invalid configuration is an error, not a report.
  exit_now = false;
  r = Load({"--check-config", "--pool-bytes", "1KiB"}, &exit_now, &message);
  EXPECT_FALSE(r.ok());
}

TEST(RenderConfigTest, RoundTripsThroughTheParser) {
  auto r = Load({"--listen",
                 "unix:///tmp/r.sock",
                 "--listen",
                 "10.0.0.1:7000",
                 "--pool-bytes",
                 "3GiB",
                 "--shm-name",
                 "/pool#1",
                 "--device",
                 "host",
                 "--socket-mode",
                 "0600",
                 "--socket-group",
                 "kv",
                 "--codec-threads",
                 "5",
                 "--wait-timeout-ms",
                 "77",
                 "--max-message-bytes",
                 "2MiB",
                 "--prefault",
                 "false",
                 "--log-level",
                 "warn",
                 "--metrics-listen",
                 "127.0.0.1:9400",
                 "--transfer-workers",
                 "3",
                 "--max-blocks-per-request",
                 "99",
                 "--tls-cert-file",
                 "/etc/hiqcache/tls/cert.pem",
                 "--tls-key-file",
                 "/etc/hiqcache/tls/key.pem"});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const DaemonConfig& c = *r;
  DaemonConfig back;
  HIQ_ASSERT_OK(ApplyConfigText(RenderConfig(c), "<rendered>", &back));
  EXPECT_EQ(back.listen, c.listen);
  EXPECT_EQ(back.pool_bytes, c.pool_bytes);
  EXPECT_EQ(back.shm_name, "/pool#1");
  EXPECT_EQ(back.device, c.device);
  EXPECT_EQ(back.metrics_listen, c.metrics_listen);
  EXPECT_EQ(back.log_level, c.log_level);
  EXPECT_EQ(back.socket_mode, 0600u);
  EXPECT_EQ(back.socket_group, "kv");
  EXPECT_EQ(back.transfer_workers, 3u);
  EXPECT_EQ(back.codec_threads, 5u);
  EXPECT_EQ(back.wait_timeout_ms, 77u);
  EXPECT_EQ(back.max_blocks_per_request, 99u);
  EXPECT_EQ(back.max_message_bytes, 2ull << 20);
  EXPECT_FALSE(back.prefault);
  EXPECT_EQ(back.tls_cert_file, "/etc/hiqcache/tls/cert.pem");
  EXPECT_EQ(back.tls_key_file, "/etc/hiqcache/tls/key.pem");
  EXPECT_EQ(back.tls_client_ca_file, "");
}

// A TCP address other nodes can reach is served over TLS or not at all: the daemon refuses to
// start with one and no certificate, naming the address.
TEST(LoadConfigTest, NonLoopbackTcpNeedsTls) {
  for (const char* addr : {"0.0.0.0:7000", "10.0.0.1:7000", "[::]:7000", "node7:7000",
                           "127.0.0.1.evil.example:7000", "ipv4:10.1.1.1:7000"}) {
    auto r = Load({"--listen", addr});
    ASSERT_FALSE(r.ok()) << addr;
    EXPECT_NE(r.status().message().find(addr), std::string::npos) << r.status().ToString();
    EXPECT_NE(r.status().message().find("tls_cert_file"), std::string::npos);
  }
  for (const char* addr : {"127.0.0.1:7000", "127.1.2.3:7000", "localhost:7000", "[::1]:7000",
                           "unix:///run/hiqcache/hiqcached.sock"}) {
    EXPECT_TRUE(IsLocalAddress(addr)) << addr;
    auto r = Load({"--listen", addr});
    EXPECT_TRUE(r.ok()) << addr << ": " << r.status().ToString();
  }
  EXPECT_TRUE(Load({"--listen", "0.0.0.0:7000", "--tls-cert-file", "c.pem", "--tls-key-file",
                    "k.pem", "--tls-client-ca-file", "ca.pem"})
                  .ok());
  ExpectErrorNaming(Load({"--listen", "0.0.0.0:7000", "--tls-cert-file", "c.pem"}), "tls_key_file");
  ExpectErrorNaming(Load({"--tls-client-ca-file", "ca.pem"}), "tls_client_ca_file");
}

TEST(LoadConfigTest, CudaStagingAndReleaseTimeout) {
  auto r = Load({"--cuda-staging-bytes", "64MiB", "--release-timeout-ms", "1500"});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->cuda_staging_bytes, 64ull << 20);
  EXPECT_EQ(r->release_timeout_ms, 1500u);
  DaemonConfig back;
  HIQ_ASSERT_OK(ApplyConfigText(RenderConfig(*r), "<rendered>", &back));
  EXPECT_EQ(back.cuda_staging_bytes, 64ull << 20);
  EXPECT_EQ(back.release_timeout_ms, 1500u);
  ExpectErrorNaming(Load({"--cuda-staging-bytes", "1MiB"}), "cuda_staging_bytes");
  ExpectErrorNaming(Load({"--cuda-staging-bytes", "lots"}), "--cuda-staging-bytes");
}

TEST(LoadConfigTest, BadFlags) {
  ExpectErrorNaming(Load({"--bogus", "1"}), "bogus");
  ExpectErrorNaming(Load({"--listen"}), "--listen");
  ExpectErrorNaming(Load({"serve"}), "serve");
  ExpectErrorNaming(Load({"--device", "tpu"}), "device");
  ExpectErrorNaming(Load({"--pool-bytes", "1MiB"}), "pool_bytes");  // below the 16 MiB floor
  ExpectErrorNaming(Load({"--config", "/nonexistent/hiq.toml"}), "--config");
  ExpectErrorNaming(Load({"--transfer-workers", "x"}), "--transfer-workers");
}

TEST(LoadConfigTest, BadSizeFlagNamesTheFlag) {
  auto r = Load({"--pool-bytes", "8XB"});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  if (r.status().message().find("--pool-bytes") == std::string::npos) {
    FAIL() << "regression: config.cc ApplyKey (pool_bytes/max_message_bytes) returns ParseSize's "
              "error without `where`: '"
           << r.status().message() << "' does not name --pool-bytes";
  }
}

TEST_F(ConfigFileTest, FlagsOverrideTheFileInAnyOrder) {
  std::string path = Write("a.toml",
                           "# test\n"
                           "pool_bytes = \"1GiB\"\n"
                           "shm_name = \"/from-file\"   # trailing comment\n"
                           "device = \"host\"\n");
  for (bool config_first : {true, false}) {
    SCOPED_TRACE(config_first ? "--config first" : "--config last");
    auto r = config_first ? Load({"--config", path, "--pool-bytes", "2GiB"})
                          : Load({"--pool-bytes=2GiB", "--config=" + path});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->pool_bytes, 2ull << 30);
    EXPECT_EQ(r->shm_name, "/from-file");  // not overridden: the file wins over the default
    EXPECT_EQ(r->device, "host");
    EXPECT_EQ(r->listen, std::vector<std::string>{hiqcache::DefaultTarget()});
  }
}

TEST_F(ConfigFileTest, ListenFlagsReplaceFileListeners) {
  std::string path = Write("l.toml", "listen = [\"unix:///tmp/hiq-a.sock\", \"127.0.0.1:7001\"]\n");
  auto r = Load({"--config", path});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->listen, (std::vector<std::string>{"unix:///tmp/hiq-a.sock", "127.0.0.1:7001"}));
  r = Load({"--listen", "127.0.0.1:7002", "--config", path, "--listen", "unix:///tmp/b.sock"});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->listen, (std::vector<std::string>{"127.0.0.1:7002", "unix:///tmp/b.sock"}));
}

TEST_F(ConfigFileTest, AllKeysOfTheFile) {
  std::string path = Write("all.toml",
                           "[hiqcached]\n"
                           "listen = [\"localhost:1\"]\n"
                           "pool_bytes = 33554432\n"
                           "shm_name = \"/s\"\n"
                           "device = \"cuda\"\n"
                           "metrics_listen = \"0.0.0.0:9400\"\n"
                           "log_level = \"warn\"\n"
                           "socket_mode = \"0600\"\n"
                           "transfer_workers = 4\n"
                           "codec_threads = 3\n"
                           "wait_timeout_ms = 250\n"
                           "max_blocks_per_request = 17\n"
                           "max_message_bytes = \"1MiB\"\n"
                           "prefault = false\n");
  auto r = Load({"--config", path});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->listen, std::vector<std::string>{"localhost:1"});
  EXPECT_EQ(r->pool_bytes, 32ull << 20);
  EXPECT_EQ(r->shm_name, "/s");
  EXPECT_EQ(r->device, "cuda");
  EXPECT_EQ(r->metrics_listen, "0.0.0.0:9400");
  EXPECT_EQ(r->log_level, "warn");
  EXPECT_EQ(r->socket_mode, 0600u);
  EXPECT_EQ(r->transfer_workers, 4u);
  EXPECT_EQ(r->codec_threads, 3u);
  EXPECT_EQ(r->wait_timeout_ms, 250u);
  EXPECT_EQ(r->max_blocks_per_request, 17u);
  EXPECT_EQ(r->max_message_bytes, 1ull << 20);
  EXPECT_FALSE(r->prefault);
}

TEST_F(ConfigFileTest, ErrorsNameTheLine) {
  struct Case {
    std::string text;
    std::string where;  // file:line
  };
  const std::vector<Case> cases = {
      {"pool_bytes = \"1GiB\"\n\nbogus = 1\n", ":3"},
      {"# c\ntransfer_workers = abc\n", ":2"},
      {"shm_name = unquoted\n", ":1"},
      {"device = \"host\"\nprefault = maybe\n", ":2"},
      {"listen = \"a:1\"\n", ":1"},
      {"\n\n\n\njust text\n", ":5"},
      {"socket_mode = \"0999\"\n", ":1"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].text);
    std::string path = Write("bad" + std::to_string(i) + ".toml", cases[i].text);
    ExpectErrorNaming(Load({"--config", path}), path + cases[i].where);
  }
  // Without a file: ApplyConfigText names the source it is given.
  DaemonConfig c;
  ExpectErrorNaming(ApplyConfigText("a = 1\n", "src", &c), "src:1");
}

TEST_F(ConfigFileTest, BadSizeValueNamesTheLine) {
  std::string path = Write("size.toml", "device = \"host\"\npool_bytes = \"8XB\"\n");
  auto r = Load({"--config", path});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  if (r.status().message().find(path + ":2") == std::string::npos) {
    FAIL() << "regression: config.cc ApplyKey (pool_bytes/max_message_bytes) returns ParseSize's "
              "error without `where`: '"
           << r.status().message() << "' does not name " << path << ":2";
  }
}

}  // namespace
}  // namespace hiqcache::server

namespace hiqcache::server {
namespace {

TEST(LoadConfigL3Test, OffByDefaultAndTheDefaultsHold) {
  auto r = Load({});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->l3_seeds.empty());
  EXPECT_EQ(r->l3_key_prefix, "hiq:");
  EXPECT_EQ(r->l3_write_policy, "write_through");
  EXPECT_EQ(r->l3_lookup_deadline_ms, 5u);
  EXPECT_EQ(std::string(EmbeddedDefaultConfig()).find("l3_"), std::string::npos)
      << "the embedded default stays as it was";
}

TEST(LoadConfigL3Test, KeysFlagsRenderAndErrors) {
  auto r =
      Load({"--l3-seeds", "127.0.0.1:7000, 10.0.0.2:7001", "--l3-key-prefix", "fleet1:", "--l3-ttl",
            "3600", "--l3-lookup-deadline-ms", "3", "--l3-writer-threads", "4",
            "--l3-write-queue-bytes", "64MiB", "--l3-user", "hiq"});
  if (!L3Available()) {
    ExpectErrorNaming(r, "l3_seeds");
    return;
  }
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->l3_seeds, (std::vector<std::string>{"127.0.0.1:7000", "10.0.0.2:7001"}));
  EXPECT_EQ(r->l3_ttl, 3600u);
  EXPECT_EQ(r->l3_write_queue_bytes, 64ull << 20);
  DaemonConfig back;
  HIQ_ASSERT_OK(ApplyConfigText(RenderConfig(*r), "<rendered>", &back));
  EXPECT_EQ(back.l3_seeds, r->l3_seeds);
  EXPECT_EQ(back.l3_key_prefix, "fleet1:");
  EXPECT_EQ(back.l3_user, "hiq");
  EXPECT_EQ(back.l3_lookup_deadline_ms, 3u);
  EXPECT_EQ(back.l3_writer_threads, 4u);
  L3Options o;
  HIQ_ASSERT_OK(L3OptionsFromConfig(*r, &o));
  EXPECT_EQ(o.ttl, std::chrono::milliseconds(3600000));
  EXPECT_EQ(o.lookup_deadline, std::chrono::milliseconds(3));
  EXPECT_EQ(o.policy, L3WritePolicy::kWriteThrough);
  EXPECT_EQ(o.budget_bytes, 0u);
  auto evict = Load({"--l3-seeds", "127.0.0.1:7000", "--l3-write-policy", "on_evict",
                     "--l3-budget-bytes", "2GiB"});
  ASSERT_TRUE(evict.ok()) << evict.status().ToString();
  DaemonConfig evict_back;
  HIQ_ASSERT_OK(ApplyConfigText(RenderConfig(*evict), "<rendered>", &evict_back));
  EXPECT_EQ(evict_back.l3_write_policy, "on_evict");
  EXPECT_EQ(evict_back.l3_budget_bytes, 2ull << 30);
  HIQ_ASSERT_OK(L3OptionsFromConfig(evict_back, &o));
  EXPECT_EQ(o.policy, L3WritePolicy::kOnEvict);
  EXPECT_EQ(o.budget_bytes, 2ull << 30);

  ExpectErrorNaming(Load({"--l3-seeds", "nohost"}), "l3_seeds");
  ExpectErrorNaming(Load({"--l3-seeds", "h:99999"}), "l3_seeds");
  ExpectErrorNaming(Load({"--l3-write-policy", "on_write"}), "l3_write_policy");
  ExpectErrorNaming(Load({"--l3-budget-bytes", "lots"}), "--l3-budget-bytes");
  ExpectErrorNaming(Load({"--l3-lookup-deadline-ms", "0"}), "l3_lookup_deadline_ms");
  ExpectErrorNaming(Load({"--l3-writer-threads", "0"}), "l3_writer_threads");
  ExpectErrorNaming(Load({"--l3-ttl", "soon"}), "--l3-ttl");
  DaemonConfig c = *r;
  c.l3_password_file = "/nonexistent/hiq-l3-password";
  ExpectErrorNaming(L3OptionsFromConfig(c, &o), "l3_password_file");
}

// The fleet's L3 MAC key: read whole (a trailing newline dropped), at least 32 bytes, and refused
// when group or others may read it; the previous key only beside a current one.
TEST_F(ConfigFileTest, L3MacKeyFiles) {
  const std::string good = Write("mac", std::string(40, 'k') + "\n");
  const std::string old = Write("mac.old", std::string(32, 'o'));
  const std::string shared = Write("mac.shared", std::string(32, 's'));
  const std::string short_key = Write("mac.short", "tooshort");
  for (const auto& f : {good, old, short_key}) ASSERT_EQ(::chmod(f.c_str(), 0600), 0);
  ASSERT_EQ(::chmod(shared.c_str(), 0640), 0);
  auto r = Load({"--l3-seeds", "127.0.0.1:7000", "--l3-mac-key-file", good,
                 "--l3-mac-previous-key-file", old});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  L3Options o;
  HIQ_ASSERT_OK(L3OptionsFromConfig(*r, &o));
  EXPECT_EQ(o.mac_key, std::string(40, 'k'));
  EXPECT_EQ(o.mac_previous_key, std::string(32, 'o'));
  DaemonConfig back;
  HIQ_ASSERT_OK(ApplyConfigText(RenderConfig(*r), "<rendered>", &back));
  EXPECT_EQ(back.l3_mac_key_file, good);
  EXPECT_EQ(back.l3_mac_previous_key_file, old);
  DaemonConfig c = *r;
  c.l3_mac_key_file = shared;
  ExpectErrorNaming(L3OptionsFromConfig(c, &o), "may be read by group or others");
  c.l3_mac_key_file = short_key;
  ExpectErrorNaming(L3OptionsFromConfig(c, &o), "at least 32");
  c.l3_mac_key_file = "/nonexistent/l3.mac";
  ExpectErrorNaming(L3OptionsFromConfig(c, &o), "l3_mac_key_file");
  c.l3_mac_key_file = "";
  ExpectErrorNaming(L3OptionsFromConfig(c, &o), "needs l3_mac_key_file");
}

// The [l3] table: its keys are the l3_* settings without the prefix; top-level keys before it
// stay top-level; no other table exists.
TEST(LoadConfigL3Test, TheL3Table) {
  DaemonConfig c;
  HIQ_ASSERT_OK(
      ApplyConfigText("pool_bytes = \"1GiB\"\n"
                      "[l3]\n"
                      "key_prefix = \"fleet2:\"   # a comment\n"
                      "ttl = 60\n"
                      "write_policy = \"on_evict\"\n"
                      "budget_bytes = \"3GiB\"\n",
                      "<text>", &c));
  EXPECT_EQ(c.pool_bytes, 1ull << 30);
  EXPECT_EQ(c.l3_key_prefix, "fleet2:");
  EXPECT_EQ(c.l3_ttl, 60u);
  EXPECT_EQ(c.l3_write_policy, "on_evict");
  EXPECT_EQ(c.l3_budget_bytes, 3ull << 30);
  // A top-level key inside [l3] is an l3 key that does not exist, named with its table.
  DaemonConfig d;
  Status st = ApplyConfigText("[l3]\npool_bytes = \"1GiB\"\n", "<text>", &d);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("[l3]"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("l3_pool_bytes"), std::string::npos) << st.message();
  // [hiqcached] holds the top-level settings again.
  DaemonConfig e;
  HIQ_ASSERT_OK(ApplyConfigText("[l3]\nttl = 5\n[hiqcached]\npool_bytes = 1024\n", "<text>", &e));
  EXPECT_EQ(e.l3_ttl, 5u);
  EXPECT_EQ(e.pool_bytes, 1024u);
  // Other tables, and malformed headers, are refused naming the line.
  st = ApplyConfigText("[pool]\nbytes = 1\n", "<text>", &d);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("<text>:1: unknown table [pool]"), std::string::npos) << st.message();
  st = ApplyConfigText("[l3\n", "<text>", &d);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("malformed table header"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace hiqcache::server
