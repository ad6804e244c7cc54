// L3 through real daemons: two hiqcached processes with separate pools (their
// own shm names and sockets) on one real Redis Cluster stand for two nodes. Node A's client backs
// up blocks, A writes them through to L3; node B's client finds them by Lookup (an L2 miss, an L3
// hit) and Restore promotes them into B's pool and restores them (RAW bit-exact, INT8 within
// docs/design.md's bound); a second restore on B is an L2 hit. Also: a pool too small for its
// blocks gets them back from L3; Redis absent at start; a value corrupted in Redis (also as
// GetStats' l3 and `hiqctl stats` show it); a master killed mid-run. Label l3; skipped where
// redis-server is not installed.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <thread>

#include "daemon_process.h"
#include "it_util.h"
#ifdef HIQCTL_PATH
#include "process_util.h"
#endif
#include "l3/l3_value.h"
#include "l3/redis_cluster.h"
#include "redis_test_cluster.h"
#include "time_margin.h"

namespace hiqcache::it {
namespace {

namespace l3 = ::hiqcache::server::l3;
namespace l3_test = ::hiqcache::l3_test;
using l3_test::RedisTestCluster;
using std::chrono::milliseconds;
using test_time::Margin;
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
  std::string list;
  for (const auto& s : seeds) list += (list.empty() ? "" : ",") + s;
  n.metrics_port =
      hiqcache::testing::StartOnFreePort(&n.daemon, pool_bytes, FreePort, [&](int port) {
        std::vector<std::string> args = {
            "--l3-seeds", list, "--metrics-listen", "127.0.0.1:" + std::to_string(port),
            // Loopback on a loaded 2-core CI machine: generous deadlines, and connections and
            // commands that may wait their turn for a core.
            "--l3-lookup-deadline-ms", "500", "--l3-fetch-deadline-ms", "2000",
            "--l3-connect-timeout-ms", "2000", "--l3-command-timeout-ms", "2000", "--prefault",
            "false"};
        args.insert(args.end(), extra.begin(), extra.end());
        return args;
      });
  if (n.metrics_port == 0) return n;
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
  // Two nodes on the cluster, a pool of `model` (int8, `pool_rows` rows) on each, and `blocks`
  // blocks of `seed` backed up on A and written to L3.
  struct TwoNodes {
    Node a, b;
    TestPool pa, pb;
    std::vector<BlockKey> keys;
    std::vector<uint32_t> rows;
  };
  void StartTwoNodes(const std::string& model, uint64_t seed, uint32_t blocks, TwoNodes* t,
                     uint32_t pool_rows = 128, const std::vector<std::string>& extra = {}) {
    t->a = StartNode(cluster_->Seeds(), "64MiB", extra);
    t->b = StartNode(cluster_->Seeds(), "64MiB", extra);
    ASSERT_NE(t->a.client, nullptr);
    ASSERT_NE(t->b.client, nullptr);
    auto pa = MakePool(*t->a.client, Options(model, Codec::kInt8PerHead, pool_rows));
    auto pb = MakePool(*t->b.client, Options(model, Codec::kInt8PerHead, pool_rows));
    ASSERT_TRUE(pa.ok()) << pa.status().ToString();
    ASSERT_TRUE(pb.ok()) << pb.status().ToString();
    t->pa = std::move(pa).value();
    t->pb = std::move(pb).value();
    t->keys = Keys(seed, blocks, kBt);
    t->rows = RowRange(0, blocks * kBt);
    FillRows(t->pa.kv, seed, t->rows, kBt);
    ASSERT_EQ(t->a.client->Backup(t->pa.handle, t->keys, t->rows).held(), blocks);
    ASSERT_TRUE(WaitWrites(t->a, blocks)) << Scrape(t->a.metrics_port);
  }
  // Waits until node `n` has written at least `writes` blocks to L3.
  static bool WaitWrites(const Node& n, double writes) {
    return Eventually([&] { return n.M("hiqcache_l3_writes_total") >= writes; },
                      std::chrono::seconds(20));
  }
  // Flips one payload byte of the value L3 holds for `key` of namespace `namespace_id` (hex) and
  // writes it back by hand. "" or what failed.
  // The Redis key of block `key` of namespace `namespace_id` (hex), default prefix.
  static std::string L3Name(const std::string& namespace_id, const BlockKey& key) {
    hiqcache::NamespaceHash ns{};
    for (int i = 0; i < 16; ++i) {
      ns[i] = static_cast<uint8_t>(std::stoul(namespace_id.substr(2 * i, 2), nullptr, 16));
    }
    hiqcache::BlockKey k;
    std::memcpy(k.data(), key.data(), 16);
    return l3::L3Key("hiq:", ns, k);
  }
  std::string CorruptValue(const std::string& namespace_id, const BlockKey& key) {
    const std::string name = L3Name(namespace_id, key);
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
    BackupResult bk = a.client->Backup(p->handle, std::span(keys).subspan(r * kPer, kPer), rows);
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
  const uint64_t seed = 700;
  TwoNodes t;
  ASSERT_NO_FATAL_FAILURE(StartTwoNodes("l3-corrupt", seed, 3, &t));
  Node &a = t.a, &b = t.b;
  TestPool* pb = &t.pb;
  const std::vector<BlockKey>& keys = t.keys;
  const std::vector<uint32_t>& rows = t.rows;
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

  // Block 2's value replaced by 64 MiB under the same key (a stranger's value, say): refused
  // before it is received, counted, a miss; the fetch ends in time.
  ASSERT_TRUE(b.client->Evict(pb->handle, keys).ok());
  ASSERT_EQ(CorruptValue(pb->info.namespace_id, keys[1]), "");  // the same byte: flipped back
  const std::string name = L3Name(pb->info.namespace_id, keys[2]);
  const l3_test::ClusterNode* master = cluster_->MasterOfSlot(l3::KeySlot(name));
  ASSERT_NE(master, nullptr);
  ASSERT_TRUE(cluster_->Admin(master->port, {"SET", name, std::string(64 << 20, 'x')}).ok());
  const auto t0 = std::chrono::steady_clock::now();
  FillSentinel(pb->kv);
  RestoreResult r2 = b.client->Restore(pb->handle, keys, rows);
  ASSERT_TRUE(r2.status.ok()) << r2.status.ToString();
  EXPECT_EQ(r2.restored_blocks, 2u);
  // The fetch deadline (2 s) not waited out is what fetch errors == 0 below says; the time
  // only catches a hang.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(2000) + Margin(milliseconds(2000)));
  EXPECT_TRUE(CheckRows(pb->kv, seed, std::span(rows).first(2 * kBt), kBt, false).ok());
  EXPECT_EQ(b.M("hiqcache_l3_corrupt_values_total"), 2);
  EXPECT_EQ(b.M("hiqcache_l3_errors_total{op=\"fetch\"}"), 0);
  EXPECT_EQ(a.daemon->Stop(), 0);
  EXPECT_EQ(b.daemon->Stop(), 0);
}

// Checksums find corruption, not forgery. Whoever can write to the cluster plants a value with
// valid XXH3 checksums over a payload of its choosing: a daemon without a fleet key restores it
// as KV (the attack, shown on node D); daemons holding the fleet key (l3_mac_key_file) share
// their own blocks, and refuse, count and miss the planted value and a tampered keyed one.
TEST_F(L3DaemonTest, PlantedValuesAreNotRestoredUnderAFleetKey) {
  char dir[] = "/tmp/hiq-l3-mac-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string key_file = std::string(dir) + "/l3.mac";
  {
    std::ofstream out(key_file, std::ios::binary);
    out << "fleet-secret-of-at-least-32-bytes-0123456789";
  }
  ASSERT_EQ(::chmod(key_file.c_str(), 0600), 0);
  const uint64_t seed = 710;
  TwoNodes t;
  ASSERT_NO_FATAL_FAILURE(
      StartTwoNodes("l3-mac", seed, 3, &t, 128, {"--l3-mac-key-file", key_file}));
  Node& b = t.b;
  TestPool* pb = &t.pb;
  const std::vector<BlockKey>& keys = t.keys;
  const std::vector<uint32_t>& rows = t.rows;
  // Keyed daemons share: B restores what A wrote.
  RestoreResult shared = b.client->Restore(pb->handle, keys, rows);
  ASSERT_TRUE(shared.status.ok()) << shared.status.ToString();
  EXPECT_EQ(shared.restored_blocks, 3u);
  EXPECT_TRUE(CheckRows(pb->kv, seed, rows, kBt, false).ok());
  ASSERT_TRUE(b.client->Evict(pb->handle, keys).ok());

  // Block 1: the attacker's payload (A's with one byte changed) as an unkeyed value with valid
  // checksums. Block 2: A's keyed value with a payload byte and both checksums changed.
  const std::string ns_hex = pb->info.namespace_id;
  hiqcache::NamespaceHash ns{};
  for (int i = 0; i < 16; ++i) {
    ns[i] = static_cast<uint8_t>(std::stoul(ns_hex.substr(2 * i, 2), nullptr, 16));
  }
  auto plant = [&](int block, bool keep_tag) {
    const std::string name = L3Name(ns_hex, keys[block]);
    const l3_test::ClusterNode* master = cluster_->MasterOfSlot(l3::KeySlot(name));
    ASSERT_NE(master, nullptr);
    l3_test::AdminReply got = cluster_->Admin(master->port, {"GET", name});
    ASSERT_EQ(got.type, REDIS_REPLY_STRING);
    ASSERT_GT(got.str.size(), l3::kL3ValueHeaderBytes + l3::kL3MacBytes);
    std::vector<uint8_t> payload(got.str.begin() + l3::kL3ValueHeaderBytes,
                                 got.str.end() - l3::kL3MacBytes);
    payload[100] ^= 0x40;
    hiqcache::BlockKey k;
    std::memcpy(k.data(), keys[block].data(), 16);
    std::string forged = l3::EncodeL3Value(ns, k, payload);
    if (keep_tag) forged += got.str.substr(got.str.size() - l3::kL3MacBytes);
    if (keep_tag) {  // a version-2 header over the changed payload, the old tag after it
      l3::L3ValueHeader h;
      std::memcpy(&h, forged.data(), sizeof(h));
      h.version = l3::kL3ValueVersionMac;
      h.header_checksum = l3::L3Checksum(std::span<const uint8_t>(
          reinterpret_cast<const uint8_t*>(&h), offsetof(l3::L3ValueHeader, header_checksum)));
      std::memcpy(forged.data(), &h, sizeof(h));
    }
    ASSERT_TRUE(cluster_->Admin(master->port, {"SET", name, forged}).ok());
  };
  ASSERT_NO_FATAL_FAILURE(plant(1, false));
  ASSERT_NO_FATAL_FAILURE(plant(2, true));

  // The attack, where no key is held: node D restores the planted block 1 as KV.
  Node d = StartNode(cluster_->Seeds());
  ASSERT_NE(d.client, nullptr);
  auto pd = MakePool(*d.client, Options("l3-mac", Codec::kInt8PerHead));
  ASSERT_TRUE(pd.ok()) << pd.status().ToString();
  const std::span<const uint32_t> block_rows = std::span(rows).subspan(kBt, kBt);
  FillSentinel(pd->kv);
  RestoreResult fooled = d.client->Restore(pd->handle, std::span(keys).subspan(1, 1), block_rows);
  ASSERT_TRUE(fooled.status.ok()) << fooled.status.ToString();
  EXPECT_EQ(fooled.restored_blocks, 1u);
  EXPECT_FALSE(CheckRows(pd->kv, seed, block_rows, kBt, false).ok())
      << "the planted payload should differ from the real block";

  // Under the key: block 0 restores, block 1 is refused (unauthenticated), and so is block 2
  // alone (its tag does not cover the changed payload); each counted.
  FillSentinel(pb->kv);
  RestoreResult r = b.client->Restore(pb->handle, keys, rows);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.restored_blocks, 1u);
  EXPECT_EQ(b.M("hiqcache_l3_corrupt_values_total"), 1);
  RestoreResult r2 = b.client->Restore(pb->handle, std::span(keys).subspan(2, 1),
                                       std::span(rows).subspan(2 * kBt));
  ASSERT_TRUE(r2.status.ok()) << r2.status.ToString();
  EXPECT_EQ(r2.restored_blocks, 0u);
  EXPECT_EQ(b.M("hiqcache_l3_corrupt_values_total"), 2);
  EXPECT_TRUE(CheckRows(pb->kv, seed, std::span(rows).first(kBt), kBt, false).ok());
  EXPECT_EQ(t.a.daemon->Stop(), 0);
  EXPECT_EQ(b.daemon->Stop(), 0);
  EXPECT_EQ(d.daemon->Stop(), 0);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// GetStats' l3 (and `hiqctl stats`, text and --json) after B promoted two blocks from L3 and
// dropped a corrupt third; A's side shows the writes. A daemon without L3 says so.
TEST_F(L3DaemonTest, GetStatsAndHiqctlShowL3) {
  TwoNodes t;
  ASSERT_NO_FATAL_FAILURE(StartTwoNodes("l3-stats", 750, 3, &t));
  Node &a = t.a, &b = t.b;
  TestPool* pb = &t.pb;
  const std::vector<BlockKey>& keys = t.keys;
  const std::vector<uint32_t>& rows = t.rows;
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
  EXPECT_EQ(lb.write_policy, "write_through");
  EXPECT_EQ(lb.budget_bytes + lb.budget_used_bytes + lb.budget_deletes + lb.spilled_blocks, 0u);
  // Promoted blocks are restores of B's namespace, not backups.
  const NamespaceStats* nsb = FindNamespace(*sb, pb->info.namespace_id);
  ASSERT_NE(nsb, nullptr);
  EXPECT_EQ(nsb->blocks, 2u);
  EXPECT_EQ(nsb->backups, 0u);
  EXPECT_EQ(nsb->restores, 2u);
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
  EXPECT_NE(text.output.find("  l3 write  write_through: 0 written (0 B), 0 dropped, 0 skipped, "
                             "0 errors; queue 0 blocks (0 B)\n"),
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
  EXPECT_NE(json_a.output.find("\"write_policy\": \"write_through\", \"spilled_blocks\": 0, "
                               "\"budget_bytes\": 0, "),
            std::string::npos)
      << json_a.output;
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
  const uint64_t seed = 800;
  constexpr uint32_t kBlocks = 6;
  TwoNodes t;
  ASSERT_NO_FATAL_FAILURE(StartTwoNodes("l3-failover", seed, kBlocks, &t));
  Node &a = t.a, &b = t.b;
  TestPool* pb = &t.pb;
  const std::vector<BlockKey>& keys = t.keys;
  const std::vector<uint32_t>& rows = t.rows;
  const auto t_end = std::chrono::steady_clock::now() + std::chrono::seconds(8);
  bool killed = false;
  int rounds = 0, full = 0;
  // 8 s, and at least 8 rounds (5 after the kill) however slow the machine.
  while (rounds < 8 || std::chrono::steady_clock::now() < t_end) {
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
      CheckResult c =
          CheckRows(pb->kv, seed, std::span(rows).first(r.restored_blocks * kBt), kBt, false);
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

// l3_write_policy = on_evict: nothing reaches L3 while the pool holds it; what the pool evicts to
// make room is copied out and written, so another node restores it; blocks that came from L3 are
// not written back when they are evicted again.
TEST_F(L3DaemonTest, OnEvictSpillsWhatThePoolEvicts) {
  // 16 MiB pool, 266,240-byte blocks: about 60 blocks; 96 are backed up.
  Node a = StartNode(cluster_->Seeds(), "16MiB", {"--l3-write-policy", "on_evict"});
  Node b = StartNode(cluster_->Seeds());
  ASSERT_NE(a.client, nullptr);
  ASSERT_NE(b.client, nullptr);
  PoolOptions o = Options("l3-on-evict", Codec::kInt8PerHead);
  o.geometry = Geom(8, 8, 128);
  auto pa = MakePool(*a.client, o);
  auto pb = MakePool(*b.client, o);
  ASSERT_TRUE(pa.ok()) << pa.status().ToString();
  ASSERT_TRUE(pb.ok()) << pb.status().ToString();
  constexpr uint32_t kRounds = 12, kPer = 8;
  const uint64_t seed = 1100;
  const std::vector<BlockKey> keys = Keys(seed, kRounds * kPer, kBt);
  const std::vector<uint32_t> rows = RowRange(0, kPer * kBt);
  auto l3_of = [](Node& n) {
    auto s = n.client->GetStats();
    return s.ok() ? s->l3 : L3Stats{};
  };
  auto evictions_of = [&](Node& n) -> uint64_t {
    auto s = n.client->GetStats();
    const NamespaceStats* ns = s.ok() ? FindNamespace(*s, pa->info.namespace_id) : nullptr;
    return ns == nullptr ? 0 : ns->evictions;
  };
  auto backup_round = [&](uint32_t r, uint64_t round_seed, const std::vector<BlockKey>& ks) {
    FillRows(pa->kv, round_seed, rows, kBt, r * kPer);
    BackupResult bk = a.client->Backup(pa->handle, std::span(ks).subspan(r * kPer, kPer), rows);
    ASSERT_TRUE(bk.status.ok()) << bk.status.ToString();
    ASSERT_EQ(bk.held(), kPer);
  };
  backup_round(0, seed, keys);
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_EQ(l3_of(a).write_policy, "on_evict");
  EXPECT_EQ(l3_of(a).writes, 0u) << "nothing is evicted yet, so nothing goes to L3";
  for (uint32_t r = 1; r < kRounds; ++r) backup_round(r, seed, keys);
  // Every block evicted for room was spilled (the queue is far from full) and written.
  const uint64_t evicted = evictions_of(a);
  ASSERT_GT(evicted, 0u) << "the pool was meant to be too small";
  ASSERT_TRUE(Eventually(
      [&] {
        const L3Stats l = l3_of(a);
        return l.writes == evicted && l.write_queue_blocks == 0;
      },
      std::chrono::seconds(20)))
      << Scrape(a.metrics_port);
  L3Stats la = l3_of(a);
  EXPECT_EQ(la.spilled_blocks, evicted);
  EXPECT_EQ(la.dropped_writes + la.write_errors + la.skipped_writes, 0u);
  // B restores A's oldest blocks (evicted from A) from L3; A's newest (never evicted) are not
  // in L3.
  LookupResult l = b.client->Lookup(pb->handle, std::span(keys).first(kPer));
  ASSERT_TRUE(l.status.ok());
  EXPECT_EQ(l.prefix_blocks, kPer);
  EXPECT_EQ(b.client->Lookup(pb->handle, std::span(keys).last(kPer)).prefix_blocks, 0u);
  FillSentinel(pb->kv);
  RestoreResult rb = b.client->Restore(pb->handle, std::span(keys).first(kPer), rows);
  ASSERT_TRUE(rb.status.ok()) << rb.status.ToString();
  EXPECT_EQ(rb.restored_blocks, kPer);
  CheckResult c = CheckRows(pb->kv, seed, rows, kBt, /*exact=*/false);
  EXPECT_TRUE(c.ok()) << c.bad_heads << " of " << c.heads_checked << " wrong: " << c.first;

  // A promotes its first kPer blocks back from L3, then backs up a pool's worth of new blocks:
  // everything it held is evicted again, the promoted blocks without a second write.
  FillSentinel(pa->kv);
  RestoreResult ra = a.client->Restore(pa->handle, std::span(keys).first(kPer), rows);
  ASSERT_TRUE(ra.status.ok()) << ra.status.ToString();
  ASSERT_EQ(ra.restored_blocks, kPer);
  EXPECT_TRUE(CheckRows(pa->kv, seed, rows, kBt, false).ok());
  const uint64_t evicted_before = evictions_of(a);
  const uint64_t spilled_before = l3_of(a).spilled_blocks;
  const uint64_t seed2 = 1200;
  const std::vector<BlockKey> keys2 = Keys(seed2, kRounds * kPer, kBt);
  for (uint32_t r = 0; r < kRounds; ++r) backup_round(r, seed2, keys2);
  EXPECT_EQ(a.client->Lookup(pa->handle, std::span(keys).first(1)).prefix_blocks, 1u)
      << "still in L3";
  la = l3_of(a);
  const uint64_t evicted_now = evictions_of(a) - evicted_before;
  ASSERT_GE(evicted_now, kPer);
  EXPECT_EQ(la.spilled_blocks - spilled_before, evicted_now - kPer)
      << "the " << kPer << " promoted blocks are not written back";
  EXPECT_EQ(a.daemon->Stop(), 0);
  EXPECT_EQ(b.daemon->Stop(), 0);
}

// l3_budget_bytes: the daemon deletes its oldest writes so that what it keeps in L3 stays within
// the budget; the cluster then holds exactly the newest blocks that fit.
TEST_F(L3DaemonTest, BudgetKeepsTheNewestBlocksWithinIt) {
  // One value's size, from a first daemon without a budget.
  uint64_t value_bytes = 0;
  {
    Node probe = StartNode(cluster_->Seeds());
    ASSERT_NE(probe.client, nullptr);
    auto p = MakePool(*probe.client, Options("l3-budget-probe", Codec::kInt8PerHead));
    ASSERT_TRUE(p.ok());
    const std::vector<BlockKey> k = Keys(1300, 1, kBt);
    FillRows(p->kv, 1300, RowRange(0, kBt), kBt);
    ASSERT_EQ(probe.client->Backup(p->handle, k, RowRange(0, kBt)).held(), 1u);
    ASSERT_TRUE(WaitWrites(probe, 1));
    value_bytes = probe.client->GetStats()->l3.bytes_out;
    EXPECT_EQ(probe.daemon->Stop(), 0);
  }
  ASSERT_GT(value_bytes, 0u);
  for (const auto* m : cluster_->Masters())
    ASSERT_TRUE(cluster_->Admin(m->port, {"FLUSHALL"}).ok());
  constexpr uint32_t kFit = 10, kRounds = 3;
  const uint64_t budget = kFit * value_bytes + value_bytes / 2;
  Node a = StartNode(cluster_->Seeds(), "64MiB", {"--l3-budget-bytes", std::to_string(budget)});
  Node b = StartNode(cluster_->Seeds());
  ASSERT_NE(a.client, nullptr);
  ASSERT_NE(b.client, nullptr);
  auto pa = MakePool(*a.client, Options("l3-budget", Codec::kInt8PerHead, kFit * kBt));
  auto pb = MakePool(*b.client, Options("l3-budget", Codec::kInt8PerHead, kFit * kBt));
  ASSERT_TRUE(pa.ok() && pb.ok());
  const uint64_t seed = 1310;
  const std::vector<BlockKey> keys = Keys(seed, kRounds * kFit, kBt);
  const std::vector<uint32_t> rows = RowRange(0, kFit * kBt);
  for (uint32_t r = 0; r < kRounds; ++r) {
    FillRows(pa->kv, seed, rows, kBt, r * kFit);
    ASSERT_EQ(a.client->Backup(pa->handle, std::span(keys).subspan(r * kFit, kFit), rows).held(),
              kFit);
    ASSERT_TRUE(WaitWrites(a, (r + 1) * kFit)) << Scrape(a.metrics_port);
  }
  const L3Stats la = a.client->GetStats()->l3;
  EXPECT_EQ(la.budget_bytes, budget);
  EXPECT_EQ(la.budget_used_bytes, kFit * value_bytes);
  EXPECT_EQ(la.budget_deletes, (kRounds - 1) * kFit);
  EXPECT_EQ(la.write_errors + la.dropped_writes, 0u);
  EXPECT_EQ(a.M("hiqcache_l3_budget_used_bytes"), static_cast<double>(kFit * value_bytes));
  // The cluster holds the newest kFit values, nothing else.
  long long keys_held = 0;
  for (const auto* m : cluster_->Masters())
    keys_held += cluster_->Admin(m->port, {"DBSIZE"}).integer;
  EXPECT_EQ(keys_held, kFit);
  EXPECT_EQ(b.client->Lookup(pb->handle, std::span(keys).last(kFit)).prefix_blocks, kFit);
  EXPECT_EQ(b.client->Lookup(pb->handle, std::span(keys).first(1)).prefix_blocks, 0u);
  EXPECT_EQ(b.client->Lookup(pb->handle, std::span(keys).subspan((kRounds - 1) * kFit - 1, 2))
                .prefix_blocks,
            0u);
  // A value larger than the whole budget is not written (a dropped write), nothing deleted.
  PoolOptions big = Options("l3-budget-big", Codec::kInt8PerHead);
  big.geometry = Geom(16, 8, 128);
  auto pbig = MakePool(*a.client, big);
  ASSERT_TRUE(pbig.ok());
  const std::vector<BlockKey> kbig = Keys(1320, 1, kBt);
  FillRows(pbig->kv, 1320, RowRange(0, kBt), kBt);
  ASSERT_EQ(a.client->Backup(pbig->handle, kbig, RowRange(0, kBt)).held(), 1u);
  ASSERT_TRUE(Eventually([&] { return a.client->GetStats()->l3.dropped_writes == 1; },
                         std::chrono::seconds(10)));
  EXPECT_EQ(a.client->GetStats()->l3.budget_deletes, (kRounds - 1) * kFit);
  EXPECT_EQ(a.daemon->Stop(), 0);
  EXPECT_EQ(b.daemon->Stop(), 0);
}

// Slots move between masters (redis-cli --cluster reshard, keys migrated) while node A keeps
// backing up and node B keeps looking up and restoring: every restore is correct or a miss,
// every write lands, and B restores everything once the move is done.
TEST_F(L3DaemonTest, ReshardWhileEnginesRun) {
  constexpr uint32_t kBlocks = 8, kNew = 2;
  const uint64_t seed = 1400;
  TwoNodes t;
  ASSERT_NO_FATAL_FAILURE(StartTwoNodes("l3-reshard", seed, kBlocks, &t, 512));
  Node &a = t.a, &b = t.b;
  TestPool *pa = &t.pa, *pb = &t.pb;
  const std::vector<BlockKey>& keys = t.keys;
  const std::vector<uint32_t>& rows = t.rows;
  // Which master holds each block before the move. The move takes every slot of the master of
  // block 0 to another master.
  std::vector<int> port_before;
  for (const BlockKey& k : keys) {
    port_before.push_back(
        cluster_->MasterOfSlot(l3::KeySlot(L3Name(pa->info.namespace_id, k)))->port);
  }
  const l3_test::ClusterNode* from = nullptr;
  const l3_test::ClusterNode* to = nullptr;
  for (const auto* m : cluster_->Masters()) {
    if (m->port == port_before[0]) {
      from = m;
    } else if (to == nullptr) {
      to = m;
    }
  }
  ASSERT_TRUE(from != nullptr && to != nullptr);
  std::atomic<bool> done{false};
  std::thread reshard([&] {
    const std::vector<std::string> argv = {l3_test::FindProgram("redis-cli"),
                                           "--cluster",
                                           "reshard",
                                           from->addr(),
                                           "--cluster-from",
                                           from->id,
                                           "--cluster-to",
                                           to->id,
                                           "--cluster-slots",
                                           std::to_string(l3::kClusterSlots),
                                           "--cluster-yes",
                                           "--cluster-pipeline",
                                           "5"};
    std::string cmd;
    for (const auto& arg : argv) cmd += "'" + arg + "' ";
    EXPECT_EQ(std::system((cmd + ">/dev/null 2>&1").c_str()), 0);
    done = true;
  });
  uint32_t rounds = 0, full = 0, partial = 0, after = 0;
  uint64_t written = kBlocks;
  const std::vector<uint32_t> new_rows = RowRange(kBlocks * kBt, kNew * kBt);
  while (!done.load() || after < 2) {
    if (done.load()) ++after;
    // A: new blocks each round (their slots may be moving).
    const std::vector<BlockKey> fresh = Keys(seed + 100 + rounds, kNew, kBt);
    FillRows(pa->kv, seed + 100 + rounds, new_rows, kBt);
    ASSERT_EQ(a.client->Backup(pa->handle, fresh, new_rows).held(), kNew);
    written += kNew;
    // B: from L3 every round.
    ASSERT_TRUE(b.client->Evict(pb->handle, keys).ok());
    LookupResult l = b.client->Lookup(pb->handle, keys);
    ASSERT_TRUE(l.status.ok()) << l.status.ToString();
    FillSentinel(pb->kv);
    RestoreResult r = b.client->Restore(pb->handle, keys, rows);
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    ASSERT_LE(r.restored_blocks, kBlocks);
    CheckResult c =
        CheckRows(pb->kv, seed, std::span(rows).first(r.restored_blocks * kBt), kBt, false);
    ASSERT_TRUE(c.ok()) << "round " << rounds << ": " << c.first;
    EXPECT_EQ(ChangedOutside(pb->kv, std::span(rows).first(r.restored_blocks * kBt)), 0u)
        << "rows past the restored run are untouched";
    full += r.restored_blocks == kBlocks;
    partial += r.restored_blocks < kBlocks;
    ++rounds;
  }
  reshard.join();
  // After the move: the whole prefix comes back, and every write A made landed.
  ASSERT_TRUE(Eventually([&] { return a.M("hiqcache_l3_writes_total") >= written; },
                         std::chrono::seconds(20)))
      << Scrape(a.metrics_port);
  ASSERT_TRUE(b.client->Evict(pb->handle, keys).ok());
  FillSentinel(pb->kv);
  RestoreResult r = b.client->Restore(pb->handle, keys, rows);
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.restored_blocks, kBlocks);
  EXPECT_TRUE(CheckRows(pb->kv, seed, rows, kBt, false).ok());
  uint32_t moved = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const int now =
        cluster_->MasterOfSlot(l3::KeySlot(L3Name(pa->info.namespace_id, keys[i])))->port;
    moved += now != port_before[i];
  }
  std::cout << "reshard: " << rounds << " rounds, " << full << " full restores, " << partial
            << " partial; " << moved << " of " << kBlocks << " blocks changed master\n";
  EXPECT_NE(port_before[0],
            cluster_->MasterOfSlot(l3::KeySlot(L3Name(pa->info.namespace_id, keys[0])))->port)
      << "block 0 was meant to change master";
  EXPECT_GT(full, 0u);
  EXPECT_EQ(a.M("hiqcache_l3_errors_total{op=\"write\"}"), 0);
  EXPECT_EQ(b.M("hiqcache_l3_corrupt_values_total"), 0);
  EXPECT_EQ(a.daemon->Stop(), 0);
  EXPECT_EQ(b.daemon->Stop(), 0);
}

// The whole cluster goes away mid-run: blocks in the pool are still served, blocks only L3
// held are misses answered within the deadlines, no call fails, and the metrics show it.
TEST_F(L3DaemonTest, ClusterGoneMidRunServesFromL2) {
  const uint64_t seed = 1500;
  constexpr uint32_t kBlocks = 4;
  TwoNodes t;
  ASSERT_NO_FATAL_FAILURE(StartTwoNodes("l3-gone", seed, kBlocks, &t));
  Node &a = t.a, &b = t.b;
  TestPool *pa = &t.pa, *pb = &t.pb;
  const std::vector<BlockKey>& keys = t.keys;
  const std::vector<uint32_t>& rows = t.rows;
  // B takes the first two blocks into its pool while the cluster is up.
  RestoreResult first =
      b.client->Restore(pb->handle, std::span(keys).first(2), std::span(rows).first(2 * kBt));
  ASSERT_TRUE(first.status.ok()) << first.status.ToString();
  ASSERT_EQ(first.restored_blocks, 2u);
  cluster_->Stop();
  for (int round = 0; round < 5; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    LookupResult l = b.client->Lookup(pb->handle, keys);
    ASSERT_TRUE(l.status.ok()) << l.status.ToString();
    EXPECT_EQ(l.prefix_blocks, 2u) << "round " << round;
    FillSentinel(pb->kv);
    RestoreResult r = b.client->Restore(pb->handle, keys, rows);
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_EQ(r.restored_blocks, 2u);
    EXPECT_TRUE(CheckRows(pb->kv, seed, std::span(rows).first(2 * kBt), kBt, false).ok());
    EXPECT_EQ(ChangedOutside(pb->kv, std::span(rows).first(2 * kBt)), 0u);
    // Both calls within their deadlines (500 ms lookup, 2 s fetch here) plus the margin.
    EXPECT_LT(std::chrono::steady_clock::now() - t0,
              milliseconds(2500) + Margin(milliseconds(2000)))
        << round;
    // A's pool still serves everything it holds.
    EXPECT_EQ(a.client->Restore(pa->handle, keys, rows).restored_blocks, kBlocks);
    // New backups on A succeed; their L3 writes fail and are counted.
    const std::vector<BlockKey> fresh = Keys(seed + 10 + round, 1, kBt);
    FillRows(pa->kv, seed + 10 + round, RowRange(0, kBt), kBt);
    EXPECT_EQ(a.client->Backup(pa->handle, fresh, RowRange(0, kBt)).held(), 1u);
  }
  EXPECT_GT(b.M("hiqcache_l3_errors_total{op=\"lookup\"}") +
                b.M("hiqcache_l3_errors_total{op=\"fetch\"}"),
            0);
  EXPECT_TRUE(Eventually([&] { return a.M("hiqcache_l3_errors_total{op=\"write\"}") >= 5; },
                         std::chrono::seconds(20)));
  EXPECT_EQ(b.M("hiqcache_l3_corrupt_values_total"), 0);
  EXPECT_EQ(a.daemon->Stop(), 0);
  EXPECT_EQ(b.daemon->Stop(), 0);
}

// Every server hangs (SIGSTOP: connections still open, nothing answers) while node C's socket
// timeouts are 30 s: its lookups and restores still return within their own deadlines, with what
// its pool holds, and after two calls of a kind that nobody answered in time, calls of that kind
// are suspended (backoff), so the calls after them do not each wait out their deadline; once the
// servers go on (SIGCONT), C gets L3 hits again.
TEST_F(L3DaemonTest, HungClusterNeverHoldsACallPastItsDeadline) {
  const uint64_t seed = 1600;
  constexpr uint32_t kBlocks = 4;
  TwoNodes t;
  ASSERT_NO_FATAL_FAILURE(StartTwoNodes("l3-hung", seed, kBlocks, &t));
  Node c = StartNode(cluster_->Seeds(), "64MiB",
                     {"--l3-command-timeout-ms", "30000", "--l3-connect-timeout-ms", "30000",
                      "--l3-lookup-deadline-ms", "200", "--l3-fetch-deadline-ms", "1000"});
  ASSERT_NE(c.client, nullptr);
  auto pc = MakePool(*c.client, Options("l3-hung", Codec::kInt8PerHead));
  ASSERT_TRUE(pc.ok());
  // C holds the first block in its pool; the cluster holds all four. (Until C's first
  // connections are up, a loaded machine may miss the short deadlines: tried until it does not.)
  ASSERT_TRUE(Eventually([&] {
    return c.client->Restore(pc->handle, std::span(t.keys).first(1), std::span(t.rows).first(kBt))
               .restored_blocks == 1;
  }));
  ASSERT_TRUE(
      Eventually([&] { return c.client->Lookup(pc->handle, t.keys).prefix_blocks == kBlocks; }));
  for (const auto& n : cluster_->nodes()) ASSERT_EQ(::kill(n.pid, SIGSTOP), 0);
  using Clock = std::chrono::steady_clock;
  Clock::duration total{};
  // A call that took its deadline or longer waited it out (a loaded machine only makes calls
  // slower); one that was suspended answers at once.
  constexpr auto kLookupDeadline = milliseconds(200), kFetchDeadline = milliseconds(1000);
  int late_lookups = 0, late_restores = 0;
  constexpr int kRounds = 6;
  for (int round = 0; round < kRounds; ++round) {
    auto t0 = Clock::now();
    LookupResult l = c.client->Lookup(pc->handle, t.keys);
    const auto lookup_took = Clock::now() - t0;
    ASSERT_TRUE(l.status.ok()) << l.status.ToString();
    EXPECT_EQ(l.prefix_blocks, 1u);
    // The deadline (200 ms) with room for a loaded machine; the socket timeout would be 30 s.
    EXPECT_LT(lookup_took, Margin(milliseconds(2000))) << round;
    late_lookups += lookup_took >= kLookupDeadline;
    FillSentinel(pc->kv);
    t0 = Clock::now();
    RestoreResult r = c.client->Restore(pc->handle, t.keys, t.rows);
    const auto restore_took = Clock::now() - t0;
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_EQ(r.restored_blocks, 1u);
    EXPECT_TRUE(CheckRows(pc->kv, seed, std::span(t.rows).first(kBt), kBt, false).ok());
    EXPECT_LT(restore_took, Margin(milliseconds(4000))) << round;  // deadline 1 s
    late_restores += restore_took >= kFetchDeadline;
    total += lookup_took + restore_took;
    std::cout << "hung cluster, round " << round << ": lookup "
              << std::chrono::duration_cast<milliseconds>(lookup_took).count() << " ms, restore "
              << std::chrono::duration_cast<milliseconds>(restore_took).count() << " ms\n";
  }
  // Two calls of each kind wait out their deadline, then the kind is suspended for at least
  // 2.4 s (twice both deadlines); a machine slow enough to outlast that may see one more. Without
  // the suspension every call would.
  std::cout << "hung cluster: " << late_lookups << " of " << kRounds << " lookups and "
            << late_restores << " restores waited out their deadline, "
            << std::chrono::duration_cast<milliseconds>(total).count() << " ms in all\n";
  EXPECT_LE(late_lookups, 3);
  EXPECT_LE(late_restores, 3);
  EXPECT_GT(c.M("hiqcache_l3_errors_total{op=\"lookup\"}"), 0);
  EXPECT_GT(c.M("hiqcache_l3_errors_total{op=\"fetch\"}"), 0);
  for (const auto& n : cluster_->nodes()) ASSERT_EQ(::kill(n.pid, SIGCONT), 0);
  // The servers answer again: the whole prefix comes back (the stalled connections are
  // replaced once their calls ran out of time).
  EXPECT_TRUE(Eventually(
      [&] {
        FillSentinel(pc->kv);
        RestoreResult r = c.client->Restore(pc->handle, t.keys, t.rows);
        return r.status.ok() && r.restored_blocks == kBlocks &&
               CheckRows(pc->kv, seed, t.rows, kBt, false).ok();
      },
      Margin(std::chrono::seconds(40))));
  EXPECT_EQ(c.M("hiqcache_l3_corrupt_values_total"), 0);
  EXPECT_EQ(c.daemon->Stop(), 0);
  EXPECT_EQ(t.b.daemon->Stop(), 0);
  EXPECT_EQ(t.a.daemon->Stop(), 0);
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
