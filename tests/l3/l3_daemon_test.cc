// L3 through real daemons (issue 15, phase 2): two hiqcached processes with separate pools (their
// own shm names and sockets) on one real Redis Cluster stand for two nodes. Node A's client backs
// up blocks, A writes them through to L3; node B's client finds them by Lookup (an L2 miss, an L3
// hit) and Restore promotes them into B's pool and restores them (RAW bit-exact, INT8 within
// DESIGN.md's bound); a second restore on B is an L2 hit. Also: a pool too small for its blocks
// gets them back from L3; Redis absent at start; a value corrupted in Redis (also as GetStats'
// l3 and `hiqctl stats` show it); a master killed mid-run. Label l3; skipped where redis-server
// is not installed.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <memory>
#include <sstream>

#include "daemon_process.h"
#include "it_util.h"
#ifdef HIQCTL_PATH
#include "process_util.h"
#endif
#include "l3_value.h"
#include "redis_cluster.h"
#include "redis_test_cluster.h"

namespace hiqcache::it {
namespace {

namespace l3 = ::hiqcache::server::l3;
namespace l3_test = ::hiqcache::l3_test;
using l3_test::RedisTestCluster;
using std::chrono::milliseconds;
using testing::DaemonProcess;

constexpr uint32_t kBt = 16;

int FreePort() {
  static int next = 41000 + (::getpid() % 500) * 20;
  while (!l3_test::PortFree(next)) ++next;
  return next++;
}

// GET /metrics of the daemon's metrics port ("" on failure).
std::string Scrape(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    ::close(fd);
    return "";
  }
  const std::string req = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
  (void)!::write(fd, req.data(), req.size());
  std::string out;
  char buf[8192];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
  ::close(fd);
  return out;
}

// The value of the sample `series` (name and labels as printed), or -1.
double Metric(const std::string& text, const std::string& series) {
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return -1;
}

// One daemon with L3 on and its metrics port.
struct Node {
  std::unique_ptr<DaemonProcess> daemon;
  int metrics_port = 0;
  std::unique_ptr<Client> client;
  double M(const std::string& series) const { return Metric(Scrape(metrics_port), series); }
};

Node StartNode(const std::vector<std::string>& seeds, const std::string& pool_bytes = "64MiB",
               std::vector<std::string> extra = {}) {
  Node n;
  n.metrics_port = FreePort();
  std::string list;
  for (const auto& s : seeds) list += (list.empty() ? "" : ",") + s;
  std::vector<std::string> args = {"--l3-seeds", list, "--metrics-listen",
                                   "127.0.0.1:" + std::to_string(n.metrics_port),
                                   // Loopback on a loaded 2-core CI machine: generous deadlines.
                                   "--l3-lookup-deadline-ms", "500", "--l3-fetch-deadline-ms",
                                   "2000", "--prefault", "false"};
  args.insert(args.end(), extra.begin(), extra.end());
  n.daemon = std::make_unique<DaemonProcess>(pool_bytes, args);
  if (!n.daemon->Start()) return n;
  n.client = Connect(n.daemon->target());
  return n;
}

PoolOptions Options(const std::string& model, Codec codec, uint32_t rows = 128) {
  PoolOptions o;
  o.model = model;
  o.geometry = Geom(4, 4, 64);
  o.block_tokens = kBt;
  o.num_rows = rows;
  o.codec = codec;
  return o;
}

class L3DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!RedisTestCluster::Available()) GTEST_SKIP() << "redis-server / redis-cli not installed";
    cluster_ = std::make_unique<RedisTestCluster>();
    const std::string err = cluster_->Start();
    ASSERT_EQ(err, "") << err;
  }
  // Waits until node `n` has written at least `writes` blocks to L3.
  static bool WaitWrites(const Node& n, double writes) {
    return Eventually([&] { return n.M("hiqcache_l3_writes_total") >= writes; },
                      std::chrono::seconds(20));
  }
  // Flips one payload byte of the value L3 holds for `key` of namespace `namespace_id` (hex) and
  // writes it back by hand. "" or what failed.
  std::string CorruptValue(const std::string& namespace_id, const BlockKey& key) {
    l3::NamespaceHash ns{};
    for (int i = 0; i < 16; ++i) {
      ns[i] = static_cast<uint8_t>(std::stoul(namespace_id.substr(2 * i, 2), nullptr, 16));
    }
    l3::L3BlockKey k;
    std::memcpy(k.data(), key.data(), 16);
    const std::string name = l3::L3Key("hiq:", ns, k);
    const l3_test::ClusterNode* master = cluster_->MasterOfSlot(l3::KeySlot(name));
    if (master == nullptr) return "no master for " + name;
    l3_test::AdminReply got = cluster_->Admin(master->port, {"GET", name});
    if (got.type != REDIS_REPLY_STRING) return "no value was written for " + name;
    std::string bad = got.str;
    bad[l3::kL3ValueHeaderBytes + 100] ^= 0x40;
    if (!cluster_->Admin(master->port, {"SET", name, bad}).ok()) return "SET " + name;
    return "";
  }
  std::unique_ptr<RedisTestCluster> cluster_;
};

#ifdef HIQCTL_PATH
// `hiqctl --target T stats [--json]`: its exit code and output.
deploy_test::RunResult Hiqctl(const std::string& target, bool json) {
  std::vector<std::string> argv = {HIQCTL_PATH, "--target", target, "stats"};
  if (json) argv.push_back("--json");
  return deploy_test::RunProgram(argv);
}
#endif

TEST_F(L3DaemonTest, TwoNodesShareBlocksThroughL3) {
  Node a = StartNode(cluster_->Seeds());
  Node b = StartNode(cluster_->Seeds());
  ASSERT_NE(a.client, nullptr);
  ASSERT_NE(b.client, nullptr);
  constexpr uint32_t kBlocks = 5;
  double writes = 0;
  for (Codec codec : {Codec::kRaw, Codec::kInt8PerHead}) {
    const bool raw = codec == Codec::kRaw;
    SCOPED_TRACE(raw ? "raw" : "int8");
    const uint64_t seed = raw ? 501 : 502;
    auto pa = MakePool(*a.client, Options("l3-two", codec));
    auto pb = MakePool(*b.client, Options("l3-two", codec));
    ASSERT_TRUE(pa.ok()) << pa.status().ToString();
    ASSERT_TRUE(pb.ok()) << pb.status().ToString();
    ASSERT_EQ(pa->info.namespace_id, pb->info.namespace_id) << "the nodes must agree";
    const std::vector<BlockKey> keys = Keys(seed, kBlocks, kBt);
    const std::vector<uint32_t> rows = RowRange(0, kBlocks * kBt);
    FillRows(pa->kv, seed, rows, kBt);
    BackupResult bk = a.client->Backup(pa->handle, keys, rows);
    ASSERT_TRUE(bk.status.ok()) << bk.status.ToString();
    ASSERT_EQ(bk.held(), kBlocks);
    writes += kBlocks;
    ASSERT_TRUE(WaitWrites(a, writes)) << Scrape(a.metrics_port);

    // B: an L2 miss, an L3 hit.
    LookupResult l = b.client->Lookup(pb->handle, keys);
    ASSERT_TRUE(l.status.ok()) << l.status.ToString();
    EXPECT_EQ(l.prefix_blocks, kBlocks);
    // Keys A never stored end the run.
    std::vector<BlockKey> longer = keys;
    for (const BlockKey& k : Keys(seed + 1000, 2, kBt)) longer.push_back(k);
    EXPECT_EQ(b.client->Lookup(pb->handle, longer).prefix_blocks, kBlocks);

    const double promoted0 = b.M("hiqcache_l3_promoted_blocks_total");
    const double fetches0 = b.M("hiqcache_l3_fetches_total");
    FillSentinel(pb->kv);
    const std::vector<uint32_t> rows_b = PickRows(128, kBlocks * kBt, seed);
    RestoreResult r = b.client->Restore(pb->handle, keys, rows_b);
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_EQ(r.restored_blocks, kBlocks);
    CheckResult c = CheckRowsOf(codec, pb->kv, seed, rows_b, kBt);
    EXPECT_TRUE(c.ok()) << c.bad_heads << " of " << c.heads_checked << " wrong: " << c.first;
    EXPECT_EQ(ChangedOutside(pb->kv, rows_b), 0u);
    EXPECT_EQ(b.M("hiqcache_l3_promoted_blocks_total"), promoted0 + kBlocks);
    EXPECT_EQ(b.M("hiqcache_l3_fetches_total"), fetches0 + 1);

    // A second restore on B is served by B's pool: no further fetch.
    FillSentinel(pb->kv);
    RestoreResult r2 = b.client->Restore(pb->handle, keys, rows_b);
    ASSERT_TRUE(r2.status.ok());
    EXPECT_EQ(r2.restored_blocks, kBlocks);
    EXPECT_TRUE(CheckRowsOf(codec, pb->kv, seed, rows_b, kBt).ok());
    EXPECT_EQ(b.M("hiqcache_l3_fetches_total"), fetches0 + 1);
    auto stats = b.client->GetStats();
    ASSERT_TRUE(stats.ok());
    const NamespaceStats* ns = FindNamespace(*stats, pb->info.namespace_id);
    ASSERT_NE(ns, nullptr);
    EXPECT_EQ(ns->blocks, kBlocks);
  }
  EXPECT_EQ(b.M("hiqcache_l3_corrupt_values_total"), 0);
  EXPECT_GT(b.M("hiqcache_l3_transferred_bytes_total{direction=\"in\"}"), 0);
  EXPECT_GT(a.M("hiqcache_l3_transferred_bytes_total{direction=\"out\"}"), 0);
  EXPECT_GT(b.M("hiqcache_l3_fetch_duration_seconds_count"), 0);
  EXPECT_EQ(a.daemon->Stop(), 0);
  EXPECT_EQ(b.daemon->Stop(), 0);
}

TEST_F(L3DaemonTest, EvictedBlocksComeBackFromL3) {
  // 16 MiB pool, 266,240-byte blocks: about 60 blocks; 96 are backed up.
  Node a = StartNode(cluster_->Seeds(), "16MiB");
  ASSERT_NE(a.client, nullptr);
  PoolOptions o = Options("l3-evict", Codec::kInt8PerHead);
  o.geometry = Geom(8, 8, 128);
  auto p = MakePool(*a.client, o);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  constexpr uint32_t kRounds = 12, kPer = 8;
  const uint64_t seed = 600;
  const std::vector<BlockKey> keys = Keys(seed, kRounds * kPer, kBt);
  const std::vector<uint32_t> rows = RowRange(0, kPer * kBt);
  for (uint32_t r = 0; r < kRounds; ++r) {
    FillRows(p->kv, seed, rows, kBt, r * kPer);
    BackupResult bk =
        a.client->Backup(p->handle, std::span(keys).subspan(r * kPer, kPer), rows);
    ASSERT_TRUE(bk.status.ok()) << bk.status.ToString();
    ASSERT_TRUE(WaitWrites(a, (r + 1) * kPer)) << Scrape(a.metrics_port);
  }
  auto stats = a.client->GetStats();
  ASSERT_TRUE(stats.ok());
  const NamespaceStats* ns = FindNamespace(*stats, p->info.namespace_id);
  ASSERT_NE(ns, nullptr);
  ASSERT_GT(ns->evictions, 0u) << "the pool was meant to be too small";
  ASSERT_LT(ns->blocks, kRounds * kPer);
  // The first blocks left A's pool; L3 still has every block.
  LookupResult l = a.client->Lookup(p->handle, keys);
  ASSERT_TRUE(l.status.ok());
  EXPECT_EQ(l.prefix_blocks, kRounds * kPer);
  FillSentinel(p->kv);
  RestoreResult rr = a.client->Restore(p->handle, std::span(keys).first(kPer), rows);
  ASSERT_TRUE(rr.status.ok()) << rr.status.ToString();
  EXPECT_EQ(rr.restored_blocks, kPer);
  CheckResult c = CheckRows(p->kv, seed, rows, kBt, /*exact=*/false);
  EXPECT_TRUE(c.ok()) << c.bad_heads << " of " << c.heads_checked << " wrong: " << c.first;
  EXPECT_GE(a.M("hiqcache_l3_promoted_blocks_total"), kPer);
  EXPECT_EQ(a.daemon->Stop(), 0);
}

TEST_F(L3DaemonTest, CorruptValueIsDroppedCountedAndAMiss) {
  Node a = StartNode(cluster_->Seeds());
  Node b = StartNode(cluster_->Seeds());
  ASSERT_NE(a.client, nullptr);
  ASSERT_NE(b.client, nullptr);
  auto pa = MakePool(*a.client, Options("l3-corrupt", Codec::kInt8PerHead));
  auto pb = MakePool(*b.client, Options("l3-corrupt", Codec::kInt8PerHead));
  ASSERT_TRUE(pa.ok() && pb.ok());
  const uint64_t seed = 700;
  const std::vector<BlockKey> keys = Keys(seed, 3, kBt);
  const std::vector<uint32_t> rows = RowRange(0, 3 * kBt);
  FillRows(pa->kv, seed, rows, kBt);
  ASSERT_EQ(a.client->Backup(pa->handle, keys, rows).held(), 3u);
  ASSERT_TRUE(WaitWrites(a, 3));
  // Block 1's value, one payload byte flipped, written back by hand.
  ASSERT_EQ(CorruptValue(pb->info.namespace_id, keys[1]), "");

  // Lookup sees the key (EXISTS); Restore verifies, drops the bad value and stops before it.
  EXPECT_EQ(b.client->Lookup(pb->handle, keys).prefix_blocks, 3u);
  RestoreResult r = b.client->Restore(pb->handle, keys, rows);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.restored_blocks, 1u);
  CheckResult c = CheckRows(pb->kv, seed, std::span(rows).first(kBt), kBt, false);
  EXPECT_TRUE(c.ok()) << c.first;
  EXPECT_EQ(b.M("hiqcache_l3_corrupt_values_total"), 1);
  EXPECT_EQ(b.M("hiqcache_l3_promoted_blocks_total"), 1);
  EXPECT_EQ(a.daemon->Stop(), 0);
  EXPECT_EQ(b.daemon->Stop(), 0);
}

// GetStats' l3 (and `hiqctl stats`, text and --json) after B promoted two blocks from L3 and
// dropped a corrupt third; A's side shows the writes. A daemon without L3 says so.
TEST_F(L3DaemonTest, GetStatsAndHiqctlShowL3) {
  Node a = StartNode(cluster_->Seeds());
  Node b = StartNode(cluster_->Seeds());
  ASSERT_NE(a.client, nullptr);
  ASSERT_NE(b.client, nullptr);
  auto pa = MakePool(*a.client, Options("l3-stats", Codec::kInt8PerHead));
  auto pb = MakePool(*b.client, Options("l3-stats", Codec::kInt8PerHead));
  ASSERT_TRUE(pa.ok() && pb.ok());
  const uint64_t seed = 750;
  const std::vector<BlockKey> keys = Keys(seed, 3, kBt);
  const std::vector<uint32_t> rows = RowRange(0, 3 * kBt);
  FillRows(pa->kv, seed, rows, kBt);
  ASSERT_EQ(a.client->Backup(pa->handle, keys, rows).held(), 3u);
  ASSERT_TRUE(Eventually(
      [&] {
        auto s = a.client->GetStats();
        return s.ok() && s->l3.writes >= 3;
      },
      std::chrono::seconds(20)));
  ASSERT_EQ(CorruptValue(pb->info.namespace_id, keys[2]), "");
  EXPECT_EQ(b.client->Lookup(pb->handle, keys).prefix_blocks, 3u);
  RestoreResult r = b.client->Restore(pb->handle, keys, rows);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.restored_blocks, 2u);

  auto sa = a.client->GetStats();
  ASSERT_TRUE(sa.ok()) << sa.status().ToString();
  const L3Stats& la = sa->l3;
  EXPECT_TRUE(la.enabled);
  EXPECT_EQ(la.writes, 3u);
  EXPECT_GT(la.bytes_out, 3u * kBt * 4 * 2 * 4 * 64);  // more than the codes alone
  EXPECT_EQ(la.write_queue_blocks, 0u);
  EXPECT_EQ(la.write_queue_bytes, 0u);
  EXPECT_EQ(la.dropped_writes + la.write_errors + la.fetches + la.promoted_blocks, 0u);

  auto sb = b.client->GetStats();
  ASSERT_TRUE(sb.ok()) << sb.status().ToString();
  const L3Stats& lb = sb->l3;
  EXPECT_TRUE(lb.enabled);
  EXPECT_EQ(lb.lookup_hits, 3u);
  EXPECT_EQ(lb.lookup_misses, 0u);
  EXPECT_EQ(lb.lookup_errors, 0u);
  EXPECT_EQ(lb.fetches, 1u);
  EXPECT_EQ(lb.fetched_blocks, 2u);
  EXPECT_EQ(lb.promoted_blocks, 2u);
  EXPECT_EQ(lb.corrupt_values, 1u);
  EXPECT_EQ(lb.fetch_errors, 0u);
  EXPECT_EQ(lb.writes, 0u);
  EXPECT_EQ(lb.bytes_in, la.bytes_out);  // the corrupt third value was read too
  EXPECT_EQ(lb.fetch_latency_samples, 1u);
  EXPECT_GT(lb.fetch_p50_us, 0u);
  EXPECT_EQ(lb.fetch_p99_us, lb.fetch_p50_us);  // one sample
  // The same counts as /metrics.
  EXPECT_EQ(b.M("hiqcache_l3_promoted_blocks_total"), lb.promoted_blocks);
  EXPECT_EQ(b.M("hiqcache_l3_corrupt_values_total"), lb.corrupt_values);
  EXPECT_EQ(b.M("hiqcache_l3_fetch_duration_seconds_count"), lb.fetches);

#ifdef HIQCTL_PATH
  deploy_test::RunResult text = Hiqctl(b.daemon->target(), false);
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("  l3 lookup 3 hits, 0 misses, 0 errors\n"), std::string::npos)
      << text.output;
  EXPECT_NE(text.output.find("  l3 fetch  1 fetches, 2 blocks ("), std::string::npos)
      << text.output;
  EXPECT_NE(text.output.find(" 2 promoted, 1 corrupt, 0 errors; p50 "), std::string::npos)
      << text.output;
  EXPECT_NE(text.output.find("  l3 write  0 written (0 B), 0 dropped, 0 skipped, 0 errors; "
                             "queue 0 blocks (0 B)\n"),
            std::string::npos)
      << text.output;
  deploy_test::RunResult json = Hiqctl(b.daemon->target(), true);
  ASSERT_EQ(json.exit_code, 0) << json.output;
  for (const std::string& want :
       {std::string("\"l3\": {\"enabled\": true, \"lookup_hits\": 3, \"lookup_misses\": 0, "),
        std::string("\"fetches\": 1, \"fetched_blocks\": 2, \"fetch_errors\": 0, "
                    "\"corrupt_values\": 1, \"promoted_blocks\": 2, \"writes\": 0, "),
        "\"bytes_in\": " + std::to_string(lb.bytes_in) + ", ",
        "\"fetch_latency_samples\": 1, \"fetch_p50_us\": " + std::to_string(lb.fetch_p50_us)}) {
    EXPECT_NE(json.output.find(want), std::string::npos) << want << "\n" << json.output;
  }
  deploy_test::RunResult json_a = Hiqctl(a.daemon->target(), true);
  EXPECT_NE(json_a.output.find("\"writes\": 3, "), std::string::npos) << json_a.output;
#endif

  // Without L3: enabled false, no l3 lines, {"enabled": false}.
  DaemonProcess plain("16MiB", {"--prefault", "false"});
  ASSERT_TRUE(plain.Start());
  auto cp = Connect(plain.target());
  auto sp = cp->GetStats();
  ASSERT_TRUE(sp.ok());
  EXPECT_FALSE(sp->l3.enabled);
  EXPECT_EQ(sp->l3.writes + sp->l3.lookup_hits + sp->l3.fetches, 0u);
#ifdef HIQCTL_PATH
  deploy_test::RunResult pt = Hiqctl(plain.target(), false);
  ASSERT_EQ(pt.exit_code, 0) << pt.output;
  EXPECT_EQ(pt.output.find("l3 "), std::string::npos) << pt.output;
  deploy_test::RunResult pj = Hiqctl(plain.target(), true);
  EXPECT_NE(pj.output.find("\"l3\": {\"enabled\": false}\n}"), std::string::npos) << pj.output;
#endif
  EXPECT_EQ(plain.Stop(), 0);
  EXPECT_EQ(a.daemon->Stop(), 0);
  EXPECT_EQ(b.daemon->Stop(), 0);
}

TEST_F(L3DaemonTest, MasterKilledMidRunGivesMissesOnly) {
  Node a = StartNode(cluster_->Seeds());
  Node b = StartNode(cluster_->Seeds());
  ASSERT_NE(a.client, nullptr);
  ASSERT_NE(b.client, nullptr);
  auto pa = MakePool(*a.client, Options("l3-failover", Codec::kInt8PerHead));
  auto pb = MakePool(*b.client, Options("l3-failover", Codec::kInt8PerHead));
  ASSERT_TRUE(pa.ok() && pb.ok());
  const uint64_t seed = 800;
  constexpr uint32_t kBlocks = 6;
  const std::vector<BlockKey> keys = Keys(seed, kBlocks, kBt);
  const std::vector<uint32_t> rows = RowRange(0, kBlocks * kBt);
  FillRows(pa->kv, seed, rows, kBt);
  ASSERT_EQ(a.client->Backup(pa->handle, keys, rows).held(), kBlocks);
  ASSERT_TRUE(WaitWrites(a, kBlocks));
  const auto t_end = std::chrono::steady_clock::now() + std::chrono::seconds(8);
  bool killed = false;
  int rounds = 0, full = 0;
  while (std::chrono::steady_clock::now() < t_end) {
    if (!killed && rounds == 3) {
      cluster_->Kill(*cluster_->Masters()[0]);
      killed = true;
    }
    ASSERT_TRUE(b.client->Evict(pb->handle, keys).ok());
    LookupResult l = b.client->Lookup(pb->handle, keys);
    ASSERT_TRUE(l.status.ok()) << l.status.ToString();
    FillSentinel(pb->kv);
    RestoreResult r = b.client->Restore(pb->handle, keys, rows);
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    ASSERT_LE(r.restored_blocks, kBlocks);
    if (r.restored_blocks > 0) {
      CheckResult c = CheckRows(pb->kv, seed, std::span(rows).first(r.restored_blocks * kBt),
                                kBt, false);
      ASSERT_TRUE(c.ok()) << "round " << rounds << ": " << c.first;
    }
    full += r.restored_blocks == kBlocks;
    ++rounds;
  }
  EXPECT_TRUE(killed);
  EXPECT_GT(full, 0);
  EXPECT_EQ(b.M("hiqcache_l3_corrupt_values_total"), 0);
  EXPECT_EQ(a.daemon->Stop(), 0);
  EXPECT_EQ(b.daemon->Stop(), 0);
}

// No cluster at all: the daemon starts, serves from its pool, and counts L3 errors.
TEST(L3AbsentTest, ServesFromL2AndCountsErrors) {
  Node a = StartNode({"127.0.0.1:" + std::to_string(FreePort())});
  ASSERT_NE(a.client, nullptr) << "hiqcached did not start without its L3 cluster";
  auto p = MakePool(*a.client, Options("l3-absent", Codec::kInt8PerHead));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const uint64_t seed = 900;
  const std::vector<BlockKey> keys = Keys(seed, 4, kBt);
  const std::vector<uint32_t> rows = RowRange(0, 2 * kBt);
  FillRows(p->kv, seed, rows, kBt);
  ASSERT_EQ(a.client->Backup(p->handle, std::span(keys).first(2), rows).held(), 2u);
  LookupResult l = a.client->Lookup(p->handle, keys);
  ASSERT_TRUE(l.status.ok());
  EXPECT_EQ(l.prefix_blocks, 2u);
  FillSentinel(p->kv);
  RestoreResult r = a.client->Restore(p->handle, keys, RowRange(0, 4 * kBt));
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.restored_blocks, 2u);
  EXPECT_TRUE(CheckRows(p->kv, seed, rows, kBt, false).ok());
  EXPECT_GT(a.M("hiqcache_l3_errors_total{op=\"lookup\"}"), 0);
  EXPECT_GT(a.M("hiqcache_l3_errors_total{op=\"fetch\"}"), 0);
  EXPECT_TRUE(Eventually([&] { return a.M("hiqcache_l3_errors_total{op=\"write\"}") > 0; },
                         std::chrono::seconds(10)));
  EXPECT_EQ(a.daemon->Stop(), 0);
}

}  // namespace
}  // namespace hiqcache::it
