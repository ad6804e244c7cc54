// The real hiqcached with --metrics-listen: after backup, lookup, restore and rejected requests
// through the client library (and a raw stub), GET /metrics is valid Prometheus text
// (`promtool check metrics`) and its values agree with the work done and with GetStats.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <regex>
#include <set>

#include "daemon_process.h"
#include "hiqcache/block_keys.h"
#include "hiqcache/client.h"
#include "hiqcache/host_shm.h"
#include "hiqcache/session.h"
#include "hiqcache/session_protocol.h"
#include "hiqcache/v1/cache.grpc.pb.h"
#include "process_util.h"

#ifdef HIQ_HAVE_HTTPLIB
#include <httplib.h>
#endif

namespace hiqcache::deploy_test {
namespace {

using hiqcache::testing::DaemonProcess;

constexpr uint32_t kBlockTokens = 16;
constexpr uint32_t kBlocks = 4;
constexpr uint64_t kPoolBytes = 64ull << 20;
const char kModel[] = "metrics-model";

int FreeTcpPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sa.sin_port = 0;
  socklen_t len = sizeof(sa);
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) == 0) {
    port = ntohs(sa.sin_port);
  }
  ::close(fd);
  return port;
}

// A daemon serving metrics on a free loopback port, with `flags`; answers the port, or 0.
int StartWithMetrics(std::unique_ptr<DaemonProcess>* out, const std::vector<std::string>& flags) {
  return hiqcache::testing::StartOnFreePort(out, "64MiB", FreeTcpPort, [&](int port) {
    std::vector<std::string> all = {"--metrics-listen", "127.0.0.1:" + std::to_string(port)};
    all.insert(all.end(), flags.begin(), flags.end());
    return all;
  });
}

// Series ("name{labels}") -> value of a text exposition.
std::map<std::string, double> ParseExposition(const std::string& text) {
  std::map<std::string, double> out;
  for (const auto& line : Lines(text)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    if (sp == std::string::npos) continue;
    out[line.substr(0, sp)] = std::strtod(line.c_str() + sp + 1, nullptr);
  }
  return out;
}

class MetricsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::unique_ptr<DaemonProcess> daemon;
    port_ = StartWithMetrics(&daemon, {"--log-level", "warn"});
    daemon_ = daemon.release();
    ASSERT_GT(port_, 0) << "hiqcached did not start";
    ASSERT_NO_FATAL_FAILURE(DoWork());
    ASSERT_NO_FATAL_FAILURE(Scrape());
  }
  static void TearDownTestSuite() {
    client_.reset();
    kv_.reset();
    if (daemon_ != nullptr) EXPECT_EQ(daemon_->Stop(), 0);
    delete daemon_;
    daemon_ = nullptr;
  }

  static void DoWork() {
    ClientOptions o;
    o.target = daemon_->target();
    o.call_timeout = std::chrono::milliseconds(5000);
    auto c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client_ = std::move(c).value();

    Geometry g;
    g.num_layers = 2;
    g.num_kv_heads = 2;
    g.head_dim = 64;
    g.dtype = DType::kBF16;
    geometry_ = g;
    auto kv = HostKvPool::Create(g, KvLayout::kSglang, kBlocks * kBlockTokens);
    ASSERT_TRUE(kv.ok()) << kv.status().ToString();
    kv_ = std::make_unique<HostKvPool>(std::move(kv).value());
    PoolSpec spec = MakeHostPoolSpec(kModel, *kv_, kBlockTokens);
    auto handle = client_->RegisterPool(spec);
    ASSERT_TRUE(handle.ok()) << handle.status().ToString();
    handle_ = *handle;
    auto info = client_->PoolInfo(handle_);
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    registered_ = *info;

    std::vector<uint32_t> tokens(kBlocks * kBlockTokens), rows(kBlocks * kBlockTokens);
    std::iota(tokens.begin(), tokens.end(), 1000u);
    std::iota(rows.begin(), rows.end(), 0u);
    keys_ = ComputeBlockKeys(tokens, kBlockTokens, "metrics-test");
    ASSERT_EQ(keys_.size(), kBlocks);

    BackupResult b = client_->Backup(handle_, keys_, rows);
    ASSERT_TRUE(b.status.ok()) << b.status.ToString();
    ASSERT_EQ(b.held(), kBlocks);
    LookupResult l = client_->Lookup(handle_, keys_);
    ASSERT_TRUE(l.status.ok()) << l.status.ToString();
    ASSERT_EQ(l.prefix_blocks, kBlocks);
    RestoreResult r = client_->Restore(handle_, std::span(keys_).first(2),
                                       std::span(rows).first(2 * kBlockTokens));
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    ASSERT_EQ(r.restored_blocks, 2u);

    // Two rejected requests through a raw stub: an unknown pool and a malformed key. Named by a
    // session, as the daemon requires of pool calls.
    auto stub = hiqcache::v1::Cache::NewStub(
        grpc::CreateChannel(daemon_->target(), grpc::InsecureChannelCredentials()));
    auto session = Session::Open(daemon_->target(), std::chrono::seconds(5));
    ASSERT_TRUE(session.ok()) << session.status().ToString();
    const std::string token = (*session)->token();
    {
      grpc::ClientContext ctx;
      ctx.AddMetadata(std::string(kSessionMetadataKey), token);
      hiqcache::v1::LookupRequest req;
      hiqcache::v1::LookupResponse resp;
      req.set_pool_id(1);
      req.add_keys(std::string(16, 'k'));
      EXPECT_EQ(stub->Lookup(&ctx, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
    }
    {
      grpc::ClientContext ctx;
      ctx.AddMetadata(std::string(kSessionMetadataKey), token);
      hiqcache::v1::LookupRequest req;
      hiqcache::v1::LookupResponse resp;
      req.set_pool_id(registered_.pool_id);
      req.add_keys(std::string(15, 'k'));
      EXPECT_EQ(stub->Lookup(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    }
    auto stats = client_->GetStats();
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    stats_ = *stats;
  }

  static void Scrape() {
#ifdef HIQ_HAVE_HTTPLIB
    httplib::Client http("127.0.0.1", port_);
    http.set_connection_timeout(5, 0);
    http.set_read_timeout(5, 0);
    auto res = http.Get("/metrics");
    ASSERT_TRUE(res) << "GET /metrics failed: " << httplib::to_string(res.error());
    ASSERT_EQ(res->status, 200);
    content_type_ = res->get_header_value("Content-Type");
    exposition_ = res->body;
    series_ = ParseExposition(exposition_);
#endif
  }

  void SetUp() override {
#ifndef HIQ_HAVE_HTTPLIB
    GTEST_SKIP() << "cpp-httplib (libcpp-httplib-dev) not installed: no HTTP client to scrape";
#endif
    ASSERT_FALSE(exposition_.empty());
  }

  // The value of `series`; fails the test when it is absent.
  static double Value(const std::string& series) {
    auto it = series_.find(series);
    EXPECT_NE(it, series_.end()) << "no series " << series;
    return it == series_.end() ? -1 : it->second;
  }
  static std::string Ns(const std::string& extra = "") {
    return "namespace=\"" + registered_.namespace_id + "\",model=\"" + kModel + "\"" + extra;
  }

  static inline int port_ = 0;
  static inline DaemonProcess* daemon_ = nullptr;
  static inline std::unique_ptr<Client> client_;
  static inline std::unique_ptr<HostKvPool> kv_;
  static inline Geometry geometry_;
  static inline PoolHandle handle_;
  static inline RegisteredPool registered_;
  static inline std::vector<BlockKey> keys_;
  static inline DaemonStats stats_;
  static inline std::string content_type_;
  static inline std::string exposition_;
  static inline std::map<std::string, double> series_;
};

TEST_F(MetricsTest, PassesPromtoolCheckMetrics) {
  const std::string promtool = FindProgram("promtool");
  if (promtool.empty()) {
    GTEST_SKIP() << "promtool not installed (Debian package `prometheus`; "
                    "deploy/install-deps.sh installs it)";
  }
  TempDir dir("metrics");
  const std::string file = dir.path() + "/metrics.txt";
  {
    std::ofstream out(file);
    out << exposition_;
  }
  RunResult r = RunProgram({"/bin/sh", "-c", "\"$0\" check metrics < \"$1\"", promtool, file});
  EXPECT_EQ(r.exit_code, 0) << r.output << "\n--- exposition ---\n" << exposition_;
  EXPECT_EQ(r.output.find("problem"), std::string::npos) << r.output;
}

TEST_F(MetricsTest, ServesTheTextFormat) {
  EXPECT_EQ(content_type_.rfind("text/plain; version=0.0.4", 0), 0u) << content_type_;
  EXPECT_NE(exposition_.find("# TYPE hiqcache_pool_bytes gauge"), std::string::npos);
  EXPECT_NE(exposition_.find("# TYPE hiqcache_encode_duration_seconds histogram"),
            std::string::npos);
}

TEST_F(MetricsTest, PoolFiguresMatchThePoolAndGetStats) {
  EXPECT_EQ(Value("hiqcache_pool_bytes"), static_cast<double>(kPoolBytes));
  EXPECT_EQ(Value("hiqcache_pool_bytes"), static_cast<double>(stats_.pool_bytes));
  EXPECT_EQ(Value("hiqcache_pool_capacity_bytes"), static_cast<double>(stats_.capacity_bytes));
  EXPECT_EQ(Value("hiqcache_pool_used_bytes"), static_cast<double>(stats_.used_bytes));
  EXPECT_GT(Value("hiqcache_pool_used_bytes"), 0);
  // The extents holding those blocks: at least their slots, at most the pool's capacity.
  EXPECT_GE(Value("hiqcache_pool_claimed_bytes"), Value("hiqcache_pool_used_bytes"));
  EXPECT_LE(Value("hiqcache_pool_claimed_bytes"), static_cast<double>(stats_.capacity_bytes));
  EXPECT_EQ(Value("hiqcache_blocks"), kBlocks);
  // The pool's KV was never written (the backup stored zeros): the daemon faulted its pages in,
  // and counts them against the client, at most the whole buffer.
  EXPECT_GT(Value("hiqcache_client_faulted_bytes"), 0);
  EXPECT_LE(Value("hiqcache_client_faulted_bytes"), static_cast<double>(kv_->shm().size()));
  EXPECT_EQ(Value("hiqcache_clients"), 1);
  EXPECT_EQ(Value("hiqcache_registered_pools"), 1);
  EXPECT_EQ(Value("hiqcache_ready"), 1);
}

TEST_F(MetricsTest, NamespaceCountersMatchTheWork) {
  const NamespaceStats* ns = nullptr;
  for (const auto& n : stats_.namespaces) {
    if (n.namespace_id == registered_.namespace_id) ns = &n;
  }
  ASSERT_NE(ns, nullptr);
  const std::string l = "{" + Ns() + "}";
  EXPECT_EQ(Value("hiqcache_namespace_blocks" + l), kBlocks);
  EXPECT_EQ(Value("hiqcache_namespace_backups_total" + l), kBlocks);
  EXPECT_EQ(Value("hiqcache_namespace_restores_total" + l), 2);
  EXPECT_EQ(Value("hiqcache_namespace_rejected_blocks_total" + l), 0);
  EXPECT_EQ(Value("hiqcache_namespace_evictions_total" + l), 0);
  EXPECT_GE(Value("hiqcache_namespace_hits_total" + l), kBlocks);
  EXPECT_EQ(Value("hiqcache_namespace_hits_total" + l), static_cast<double>(ns->hits));
  EXPECT_EQ(Value("hiqcache_namespace_misses_total" + l), static_cast<double>(ns->misses));
  EXPECT_EQ(Value("hiqcache_namespace_used_bytes" + l), static_cast<double>(ns->bytes));
  EXPECT_EQ(Value("hiqcache_namespace_encoded_bytes_per_token" + l),
            static_cast<double>(registered_.encoded_bytes_per_token));
}

TEST_F(MetricsTest, BytesMovedAndCodecDurations) {
  const double block_bf16 = static_cast<double>(geometry_.BytesPerToken()) * kBlockTokens;
  const double block_stored = static_cast<double>(registered_.block_bytes);
  auto moved = [&](const char* dir, const char* form) {
    return Value("hiqcache_transferred_bytes_total{" + Ns() + ",direction=\"" + dir + "\",form=\"" +
                 form + "\"}");
  };
  EXPECT_EQ(moved("backup", "bf16_equivalent"), kBlocks * block_bf16);
  EXPECT_EQ(moved("backup", "stored"), kBlocks * block_stored);
  EXPECT_EQ(moved("restore", "bf16_equivalent"), 2 * block_bf16);
  EXPECT_EQ(moved("restore", "stored"), 2 * block_stored);
  // One backup task and one restore task, each observed once.
  EXPECT_EQ(Value("hiqcache_encode_duration_seconds_count"), 1);
  EXPECT_EQ(Value("hiqcache_decode_duration_seconds_count"), 1);
  EXPECT_EQ(Value("hiqcache_encode_duration_seconds_bucket{le=\"+Inf\"}"), 1);
  EXPECT_GT(Value("hiqcache_encode_duration_seconds_sum"), 0);
}

TEST_F(MetricsTest, RejectedRequestsByCode) {
  EXPECT_EQ(Value("hiqcache_rejected_requests_total{rpc=\"Lookup\",code=\"NOT_FOUND\"}"), 1);
  EXPECT_EQ(Value("hiqcache_rejected_requests_total{rpc=\"Lookup\",code=\"INVALID_ARGUMENT\"}"), 1);
}

// The metric families (their `# TYPE` lines) of an exposition.
std::set<std::string> Families(const std::string& text) {
  std::set<std::string> out;
  for (const auto& line : Lines(text)) {
    if (line.rfind("# TYPE ", 0) != 0) continue;
    const size_t end = line.find(' ', 7);
    out.insert(line.substr(7, end == std::string::npos ? std::string::npos : end - 7));
  }
  return out;
}

// deploy/grafana/hiqcache-dashboard.json names only metrics hiqcached exports: every
// `hiqcache_...` identifier in it (its queries and variables) is a family of a real daemon's
// /metrics (a histogram's _bucket/_sum/_count series included), scraped with an L3 tier
// configured (its families exist whether or not the cluster answers).
TEST(GrafanaDashboardTest, EveryExpressionNamesARealMetric) {
#ifndef HIQ_HAVE_HTTPLIB
  GTEST_SKIP() << "cpp-httplib (libcpp-httplib-dev) not installed: no HTTP client to scrape";
#else
  std::vector<std::string> flags = {"--log-level", "error"};
#ifdef HIQ_HAVE_L3
  // A cluster nobody serves: the tier exists (its metrics are rendered), every call a miss.
  flags.insert(flags.end(), {"--l3_seeds", "127.0.0.1:1"});
#endif
  std::unique_ptr<DaemonProcess> daemon;
  const int port = StartWithMetrics(&daemon, flags);
  ASSERT_GT(port, 0) << "hiqcached did not start";
  httplib::Client http("127.0.0.1", port);
  http.set_connection_timeout(5, 0);
  http.set_read_timeout(5, 0);
  auto res = http.Get("/metrics");
  ASSERT_TRUE(res) << "GET /metrics failed: " << httplib::to_string(res.error());
  const std::set<std::string> families = Families(res->body);
  ASSERT_GT(families.size(), 10u) << res->body;

  const std::string dashboard = ReadFile(HIQ_SOURCE_DIR "/deploy/grafana/hiqcache-dashboard.json");
  ASSERT_FALSE(dashboard.empty());
  size_t exprs = 0;
  for (size_t at = dashboard.find("\"expr\""); at != std::string::npos;
       at = dashboard.find("\"expr\"", at + 1)) {
    ++exprs;
  }
  EXPECT_GE(exprs, 20u) << "the dashboard lost its queries";
  const std::regex ident("hiqcache_[A-Za-z0-9_]+");
  std::set<std::string> named;
  for (auto it = std::sregex_iterator(dashboard.begin(), dashboard.end(), ident);
       it != std::sregex_iterator(); ++it) {
    named.insert(it->str());
  }
  for (const std::string& name : named) {
    std::string family = name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      if (family.ends_with(suffix) &&
          families.count(family.substr(0, family.size() - std::strlen(suffix)))) {
        family = family.substr(0, family.size() - std::strlen(suffix));
      }
    }
#ifndef HIQ_HAVE_L3
    if (family.starts_with("hiqcache_l3_")) continue;  // no L3 tier in this build
#endif
    EXPECT_TRUE(families.count(family))
        << "the dashboard names " << name << ", which hiqcached does not export";
  }
  EXPECT_GT(named.size(), 30u);
  EXPECT_EQ(daemon->Stop(), 0);
#endif
}

}  // namespace
}  // namespace hiqcache::deploy_test
