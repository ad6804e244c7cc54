// RedisCluster (server/l3/redis_cluster.h) against real Redis Cluster processes on loopback
// (redis_test_cluster.h: 3 masters + 3 replicas): slot math, commands on every master, pipelined
// multi-key reads, MOVED while a slot migrates under a working client, ASK during a migration, a
// master killed until its replica is promoted, reconnects, deadlines, AUTH, and blocks in the L3
// value format travelling through the cluster.
#include "l3/redis_cluster.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <thread>

#include "l3/l3_value.h"
#include "redis_test_cluster.h"
#include "time_margin.h"

#define HIQ_ASSERT_OK(expr)                                           \
  do {                                                                \
    const ::hiqcache::Status hiq_st_ = (expr);                        \
    ASSERT_TRUE(hiq_st_.ok()) << #expr << ": " << hiq_st_.ToString(); \
  } while (0)

namespace hiqcache::server::l3 {
namespace {

using l3_test::RedisTestCluster;
using std::chrono::milliseconds;

#define HIQ_SKIP_WITHOUT_REDIS()                                                          \
  do {                                                                                    \
    if (!RedisTestCluster::Available()) {                                                 \
      GTEST_SKIP() << "redis-server or redis-cli not installed (deploy/install-deps.sh)"; \
    }                                                                                     \
  } while (0)

RedisClusterOptions OptionsFor(const RedisTestCluster& c) {
  RedisClusterOptions o;
  o.seeds = {c.Seeds()[0], c.Seeds()[1]};
  // Loopback on a loaded machine: a connection or a command that takes longer is a failure
  // these tests do not look for (FailoverTest's calls end by their own 300 ms deadline).
  o.connect_timeout = hiqcache::test_time::Margin(milliseconds(2000));
  o.command_timeout = hiqcache::test_time::Margin(milliseconds(2000));
  o.default_deadline = hiqcache::test_time::Margin(milliseconds(4000));
  return o;
}

// Declares `RedisCluster var` opened with `options`, or fails the test.
#define HIQ_OPEN_OR_FAIL(var, options)                                                \
  auto HIQ_CONCAT(var, _or) = RedisCluster::Open(options);                            \
  ASSERT_TRUE(HIQ_CONCAT(var, _or).ok()) << HIQ_CONCAT(var, _or).status().ToString(); \
  RedisCluster var = std::move(HIQ_CONCAT(var, _or)).value()

std::string ValueOf(const std::string& key) { return "value-of-" + key + std::string(100, 'x'); }

// A key per slot class: keys "k<i>" for i in [0, n).
std::vector<std::string> Keys(const std::string& prefix, int n) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back(prefix + std::to_string(i));
  return out;
}

// ----------------------------------------------------------------------------------------------
// Slot math, without a cluster: the spec's test vector and hash tags.

TEST(KeySlotTest, SpecVectorsAndHashTags) {
  EXPECT_EQ(KeySlot("123456789"), 0x31C3);  // CRC16-XMODEM check value
  EXPECT_EQ(KeySlot("foo"), 12182);
  EXPECT_EQ(KeySlot("{user1000}.following"), KeySlot("user1000"));
  EXPECT_EQ(KeySlot("{user1000}.followers"), KeySlot("user1000"));
  EXPECT_EQ(KeySlot("foo{}{bar}"), KeySlot("foo{}{bar}"));  // empty tag: the whole key
  EXPECT_NE(KeySlot("foo{}{bar}"), KeySlot("bar"));
  EXPECT_EQ(KeySlot("foo{{bar}}zap"), KeySlot("{bar"));
  EXPECT_EQ(KeySlot("foo{bar}{zap}"), KeySlot("bar"));
  EXPECT_EQ(KeySlot(""), 0);
}

// ----------------------------------------------------------------------------------------------
// One cluster shared by the tests that leave its topology alone.

class ClusterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!RedisTestCluster::Available()) return;
    cluster_ = new RedisTestCluster();
    start_error_ = new std::string(cluster_->Start());
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
    delete start_error_;
    start_error_ = nullptr;
  }
  void SetUp() override {
    HIQ_SKIP_WITHOUT_REDIS();
    ASSERT_EQ(*start_error_, "");
  }
  static RedisTestCluster* cluster_;
  static std::string* start_error_;
};
RedisTestCluster* ClusterTest::cluster_ = nullptr;
std::string* ClusterTest::start_error_ = nullptr;

TEST_F(ClusterTest, KeySlotMatchesClusterKeyslot) {
  const int port = cluster_->nodes()[0].port;
  std::vector<std::string> keys = {"",
                                   "a",
                                   "{",
                                   "}",
                                   "{}",
                                   "{a}",
                                   "x{a}y",
                                   "{a}{b}",
                                   "{{a}}",
                                   "a{b",
                                   "hiq:0123:4567",
                                   std::string("\0\xff\x80{\x01}", 6)};
  for (int i = 0; i < 300; ++i) {
    std::string k;
    for (int j = 0; j <= i % 40; ++j) k += static_cast<char>((i * 31 + j * 17) & 0xff);
    keys.push_back(k);
  }
  for (const auto& k : keys) {
    const auto r = cluster_->Admin(port, {"CLUSTER", "KEYSLOT", k});
    ASSERT_EQ(r.type, REDIS_REPLY_INTEGER) << r.str;
    EXPECT_EQ(KeySlot(k), r.integer) << "key of " << k.size() << " bytes";
  }
}

TEST_F(ClusterTest, SetGetExistsDelOnEveryMaster) {
  HIQ_OPEN_OR_FAIL(c, OptionsFor(*cluster_));
  const auto keys = Keys("sged-", 200);
  std::set<std::string> masters_used;
  for (const auto& k : keys) {
    HIQ_ASSERT_OK(c.Set(k, ValueOf(k)));
    masters_used.insert(c.MasterOf(KeySlot(k)));
  }
  EXPECT_EQ(masters_used.size(), 3u);
  for (const auto& k : keys) {
    auto v = c.Get(k);
    ASSERT_TRUE(v.ok()) << v.status().ToString();
    ASSERT_TRUE(v->has_value()) << k;
    EXPECT_EQ(**v, ValueOf(k));
    // Each key is on the master the client's map names, as the cluster says.
    EXPECT_EQ(cluster_->MasterOfSlot(KeySlot(k))->addr(), c.MasterOf(KeySlot(k)));
  }
  auto e = c.Exists(keys[0]);
  ASSERT_TRUE(e.ok());
  EXPECT_TRUE(*e);
  auto d = c.Del(keys[0]);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(*d);
  d = c.Del(keys[0]);
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(*d);
  e = c.Exists(keys[0]);
  ASSERT_TRUE(e.ok());
  EXPECT_FALSE(*e);
  auto g = c.Get(keys[0]);
  ASSERT_TRUE(g.ok());
  EXPECT_FALSE(g->has_value());
  EXPECT_EQ(c.stats().moved, 0u);  // the map was right from the start
  EXPECT_EQ(c.stats().errors, 0u);
}

// A value longer than the caller takes fails its key alone (nothing is allocated for it); the
// other keys of the call, on that node too, are answered; the node is not failed.
TEST_F(ClusterTest, ValuesLongerThanAskedFailTheirKeyOnly) {
  RedisClusterOptions o = OptionsFor(*cluster_);
  o.max_value_bytes = 200;
  HIQ_OPEN_OR_FAIL(c, o);
  const auto keys = Keys("long-", 60);
  for (size_t i = 0; i < keys.size(); ++i) {
    HIQ_ASSERT_OK(c.Set(keys[i], i % 5 == 2 ? std::string(150'000, 'L') : ValueOf(keys[i])));
  }
  const auto got = c.MultiGet(keys, std::nullopt, 150);
  ASSERT_EQ(got.size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i % 5 == 2) {
      EXPECT_EQ(got[i].status.code(), StatusCode::kResourceExhausted) << keys[i];
      EXPECT_NE(got[i].status.message().find("150000 bytes"), std::string::npos)
          << got[i].status.message();
    } else {
      ASSERT_TRUE(got[i].status.ok()) << keys[i] << ": " << got[i].status.ToString();
      EXPECT_EQ(got[i].value, ValueOf(keys[i]));
    }
  }
  EXPECT_EQ(c.stats().node_failures, 0u);
  // A single GET takes options.max_value_bytes.
  auto one = c.Get(keys[2]);
  EXPECT_EQ(one.status().code(), StatusCode::kResourceExhausted);
  auto fine = c.Get(keys[3]);
  ASSERT_TRUE(fine.ok()) << fine.status().ToString();
  EXPECT_EQ(**fine, ValueOf(keys[3]));
}

TEST_F(ClusterTest, SetWithTtlExpires) {
  HIQ_OPEN_OR_FAIL(c, OptionsFor(*cluster_));
  HIQ_ASSERT_OK(c.Set("ttl-key", "v", milliseconds(1000)));
  const auto slot_master = cluster_->MasterOfSlot(KeySlot("ttl-key"));
  const auto pttl = cluster_->Admin(slot_master->port, {"PTTL", "ttl-key"});
  EXPECT_GT(pttl.integer, 0);
  EXPECT_LE(pttl.integer, 1000);
  std::this_thread::sleep_for(milliseconds(1100));
  auto g = c.Get("ttl-key");
  ASSERT_TRUE(g.ok());
  EXPECT_FALSE(g->has_value());
}

TEST_F(ClusterTest, PipelinedMultiGetSpreadOverTheCluster) {
  HIQ_OPEN_OR_FAIL(c, OptionsFor(*cluster_));
  const auto keys = Keys("mget-", 500);
  for (size_t i = 0; i < keys.size(); i += 2) HIQ_ASSERT_OK(c.Set(keys[i], ValueOf(keys[i])));
  const uint64_t before = c.stats().commands;
  const auto got = c.MultiGet(keys);
  ASSERT_EQ(got.size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(got[i].status.ok()) << keys[i] << ": " << got[i].status.ToString();
    EXPECT_EQ(got[i].found, i % 2 == 0) << keys[i];
    if (i % 2 == 0) EXPECT_EQ(got[i].value, ValueOf(keys[i]));
  }
  EXPECT_EQ(c.stats().commands - before, keys.size());  // one GET per key, no retries
  const auto ex = c.MultiExists(keys);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(ex[i].status.ok());
    EXPECT_EQ(ex[i].found, i % 2 == 0);
  }
  EXPECT_TRUE(c.MultiGet({}).empty());
}

TEST_F(ClusterTest, BlocksInTheValueFormatSurviveTheTrip) {
  HIQ_OPEN_OR_FAIL(c, OptionsFor(*cluster_));
  NamespaceHash ns{};
  ns[0] = 0x42;
  std::vector<std::string> keys;
  std::vector<std::vector<uint8_t>> payloads;
  for (int b = 0; b < 8; ++b) {
    BlockKey key{};
    key[0] = static_cast<uint8_t>(b);
    std::vector<uint8_t> payload(256 << 10);  // 256 KiB blocks, binary
    for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * b + 3);
    keys.push_back(L3Key("hiq:", ns, key));
    HIQ_ASSERT_OK(c.Set(keys.back(), EncodeL3Value(ns, key, payload)));
    payloads.push_back(std::move(payload));
  }
  const auto got = c.MultiGet(keys);
  for (int b = 0; b < 8; ++b) {
    ASSERT_TRUE(got[b].status.ok() && got[b].found);
    BlockKey key{};
    key[0] = static_cast<uint8_t>(b);
    auto p = DecodeL3Value(got[b].value, ns, key, payloads[b].size());
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_TRUE(std::equal(p->begin(), p->end(), payloads[b].begin()));
    // Block b+1's value read as block b: foreign key.
    BlockKey other{};
    other[0] = static_cast<uint8_t>(b + 1);
    EXPECT_EQ(DecodeL3Value(got[b].value, ns, other).status().code(), StatusCode::kDataLoss);
  }
}

TEST_F(ClusterTest, DeadlineIsKept) {
  HIQ_OPEN_OR_FAIL(c, OptionsFor(*cluster_));
  const auto keys = Keys("dl-", 50);
  const auto past = Clock::now() - milliseconds(1);
  const auto got = c.MultiGet(keys, past);
  for (const auto& r : got) EXPECT_EQ(r.status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(c.Get("dl-0", past).status().code(), StatusCode::kDeadlineExceeded);
  // A later call with time left works again.
  EXPECT_TRUE(c.Get("dl-0").ok());
}

// Values from empty to several MiB (bulk strings received in place past the read chunk, binary
// bytes that look like RESP, missing keys between them) come back whole, with the smallest
// window (pipeline_bytes 1: two in flight per node) and with a wide one.
TEST_F(ClusterTest, LargeValuesThroughThePipelineWindow) {
  std::vector<std::string> keys = Keys("big-", 30);
  std::vector<std::string> values(keys.size());
  const size_t sizes[] = {
      0, 1, 100, (256 << 10) - 1, 256 << 10, (256 << 10) + 1, 3 << 20, (5 << 20) + 7, 64 << 10, 2};
  {
    HIQ_OPEN_OR_FAIL(w, OptionsFor(*cluster_));
    for (size_t i = 0; i < keys.size(); ++i) {
      if (i % 5 == 4) continue;  // missing
      std::string v(sizes[i % std::size(sizes)], '\0');
      for (size_t j = 0; j < v.size(); ++j) v[j] = "\r\n$-1:+-\x00\xff"[(i + j * 7) % 11];
      values[i] = v;
      HIQ_ASSERT_OK(w.Set(keys[i], v, milliseconds(0), Clock::now() + std::chrono::seconds(5)));
    }
  }
  for (size_t pipeline_bytes : {size_t{1}, size_t{64} << 20}) {
    RedisClusterOptions o = OptionsFor(*cluster_);
    o.pipeline_bytes = pipeline_bytes;
    HIQ_OPEN_OR_FAIL(c, o);
    for (int round = 0; round < 2; ++round) {
      const uint64_t before = c.stats().commands;
      const auto got = c.MultiGet(keys, Clock::now() + std::chrono::seconds(5));
      ASSERT_EQ(got.size(), keys.size());
      for (size_t i = 0; i < keys.size(); ++i) {
        ASSERT_TRUE(got[i].status.ok()) << keys[i] << ": " << got[i].status.ToString();
        EXPECT_EQ(got[i].found, i % 5 != 4) << keys[i];
        EXPECT_TRUE(got[i].value == values[i])
            << keys[i] << ": " << got[i].value.size() << " bytes, want " << values[i].size();
      }
      EXPECT_EQ(c.stats().commands - before, keys.size());  // no retries
      const auto ex = c.MultiExists(keys);
      for (size_t i = 0; i < keys.size(); ++i) {
        ASSERT_TRUE(ex[i].status.ok()) << ex[i].status.ToString();
        EXPECT_EQ(ex[i].found, i % 5 != 4);
      }
    }
    EXPECT_EQ(c.stats().node_failures, 0u);
  }
  HIQ_OPEN_OR_FAIL(d, OptionsFor(*cluster_));
  for (const auto& k : keys) (void)d.Del(k);
}

// A deadline that passes while large values are still arriving ends the call then: the values
// read so far are answered, the rest are DEADLINE_EXCEEDED, and the connections left out of
// step are reopened by the next call without counting against the nodes.
TEST_F(ClusterTest, DeadlineEndsALargeMultiGetMidway) {
  RedisClusterOptions o = OptionsFor(*cluster_);
  // Only the deadline can end the reads: the socket timeout is 4 times the margin asserted.
  const auto margin = hiqcache::test_time::Margin(milliseconds(1500));
  o.command_timeout = 4 * margin;
  HIQ_OPEN_OR_FAIL(c, o);
  const auto keys = Keys("slow-", 6);
  const std::string big(16 << 20, 's');
  for (const auto& k : keys) {
    HIQ_ASSERT_OK(c.Set(k, big, milliseconds(0), Clock::now() + std::chrono::seconds(10)));
  }
  const uint64_t failures = c.stats().node_failures;
  const auto t0 = Clock::now();
  const auto got = c.MultiGet(keys, t0 + milliseconds(2));  // 96 MiB cannot arrive in 2 ms
  const auto took = Clock::now() - t0;
  EXPECT_LT(took, margin);  // where idle, about 2 ms
  size_t late = 0;
  for (const auto& r : got) {
    if (r.status.ok()) {
      EXPECT_TRUE(r.found && r.value == big);
    } else {
      EXPECT_EQ(r.status.code(), StatusCode::kDeadlineExceeded) << r.status.ToString();
      ++late;
    }
  }
  EXPECT_GT(late, 0u);
  const auto again = c.MultiGet(keys, Clock::now() + std::chrono::seconds(10));
  for (const auto& r : again) {
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_TRUE(r.found && r.value == big);
  }
  EXPECT_EQ(c.stats().node_failures, failures);
  for (const auto& k : keys) (void)c.Del(k);
}

TEST_F(ClusterTest, ReconnectsAfterTheServerClosedTheConnections) {
  HIQ_OPEN_OR_FAIL(c, OptionsFor(*cluster_));
  const auto keys = Keys("rc-", 60);
  for (const auto& k : keys) HIQ_ASSERT_OK(c.Set(k, ValueOf(k)));
  const uint64_t connects = c.stats().connects;
  for (const auto* m : cluster_->Masters()) {
    cluster_->Admin(m->port, {"CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"});
  }
  const auto got = c.MultiGet(keys);  // every connection is dead: reopened, not backed off
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(got[i].status.ok()) << got[i].status.ToString();
    EXPECT_EQ(got[i].value, ValueOf(keys[i]));
  }
  EXPECT_GE(c.stats().connects, connects + 3);
  // A large write into a connection the server closed meets EPIPE: the call retries on a new
  // connection, and the SIGPIPE it raised does not end the process.
  for (const auto* m : cluster_->Masters()) {
    cluster_->Admin(m->port, {"CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"});
  }
  std::this_thread::sleep_for(milliseconds(20));
  const std::string big(8 << 20, 'b');
  for (const auto& k : {keys[0], keys[1], keys[2]}) HIQ_ASSERT_OK(c.Set(k, big));
  auto back = c.Get(keys[0]);
  ASSERT_TRUE(back.ok() && back->has_value());
  EXPECT_EQ((*back)->size(), big.size());
}

// ----------------------------------------------------------------------------------------------
// Slot migration: ASK while it runs, MOVED after it, and a second client working throughout.

// Node ids and ports of a slot's migration from its master to another master.
struct Migration {
  int slot;
  const l3_test::ClusterNode* from;
  const l3_test::ClusterNode* to;
};

Migration StartMigration(RedisTestCluster& cluster, int slot) {
  Migration m{slot, cluster.MasterOfSlot(slot), nullptr};
  for (const auto* n : cluster.Masters()) {
    if (n->port != m.from->port) m.to = n;
  }
  const std::string s = std::to_string(slot);
  EXPECT_TRUE(cluster.Admin(m.to->port, {"CLUSTER", "SETSLOT", s, "IMPORTING", m.from->id}).ok());
  EXPECT_TRUE(cluster.Admin(m.from->port, {"CLUSTER", "SETSLOT", s, "MIGRATING", m.to->id}).ok());
  return m;
}

void MigrateKeys(RedisTestCluster& cluster, const Migration& m,
                 const std::vector<std::string>& keys) {
  for (const auto& k : keys) {
    const auto r = cluster.Admin(
        m.from->port, {"MIGRATE", "127.0.0.1", std::to_string(m.to->port), k, "0", "5000"});
    EXPECT_TRUE(r.ok()) << r.str;
  }
}

void FinishMigration(RedisTestCluster& cluster, const Migration& m) {
  const std::string s = std::to_string(m.slot);
  // The importing node first, then the source, then everyone else (what redis-cli does).
  EXPECT_TRUE(cluster.Admin(m.to->port, {"CLUSTER", "SETSLOT", s, "NODE", m.to->id}).ok());
  EXPECT_TRUE(cluster.Admin(m.from->port, {"CLUSTER", "SETSLOT", s, "NODE", m.to->id}).ok());
  for (const auto* n : cluster.Masters()) {
    cluster.Admin(n->port, {"CLUSTER", "SETSLOT", s, "NODE", m.to->id});
  }
}

// `n` keys in one slot (a hash tag), and that slot.
std::vector<std::string> SlotKeys(const std::string& tag, int n, int* slot) {
  *slot = KeySlot(tag);
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back("{" + tag + "}-" + std::to_string(i));
  return out;
}

TEST(MigrationTest, AskDuringAndMovedAfterWhileAClientKeepsWorking) {
  HIQ_SKIP_WITHOUT_REDIS();
  RedisTestCluster cluster;
  ASSERT_EQ(cluster.Start(), "");
  HIQ_OPEN_OR_FAIL(c, OptionsFor(cluster));
  int slot = 0;
  const auto keys = SlotKeys("mig", 40, &slot);
  const auto others = Keys("bystander-", 60);  // other slots, unaffected
  for (const auto& k : keys) HIQ_ASSERT_OK(c.Set(k, ValueOf(k)));
  for (const auto& k : others) HIQ_ASSERT_OK(c.Set(k, ValueOf(k)));

  // A second client (its own instance: one per thread) reads everything in a loop throughout.
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> reads{0}, wrong{0}, missing{0}, failed{0};
  std::string first_failure;
  std::thread reader([&] {
    HIQ_OPEN_OR_FAIL(r, OptionsFor(cluster));
    std::vector<std::string> all = keys;
    all.insert(all.end(), others.begin(), others.end());
    while (!stop.load()) {
      const auto got = r.MultiGet(all);
      for (size_t i = 0; i < all.size(); ++i) {
        ++reads;
        if (!got[i].status.ok()) {
          if (failed++ == 0) first_failure = got[i].status.ToString();
        } else if (!got[i].found) {
          ++missing;
        } else if (got[i].value != ValueOf(all[i])) {
          ++wrong;
        }
      }
    }
  });

  const Migration m = StartMigration(cluster, slot);
  ASSERT_NE(m.to, nullptr);
  // Half the keys moved: those answer ASK at the source, the rest are still served there.
  const std::vector<std::string> moved_half(keys.begin(), keys.begin() + 20);
  MigrateKeys(cluster, m, moved_half);
  const uint64_t ask_before = c.stats().ask;
  auto got = c.MultiGet(keys);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(got[i].status.ok()) << keys[i] << ": " << got[i].status.ToString();
    ASSERT_TRUE(got[i].found) << keys[i];
    EXPECT_EQ(got[i].value, ValueOf(keys[i]));
  }
  EXPECT_EQ(c.stats().ask - ask_before, 20u);
  EXPECT_EQ(c.MasterOf(slot), m.from->addr());  // ASK does not remap the slot
  // A new key of the migrating slot goes to the target (ASK), and a missing one is a miss there.
  HIQ_ASSERT_OK(c.Set("{mig}-new", ValueOf("{mig}-new")));
  auto miss = c.Get("{mig}-absent");
  ASSERT_TRUE(miss.ok()) << miss.status().ToString();
  EXPECT_FALSE(miss->has_value());

  // The rest of the keys, then the slot itself.
  MigrateKeys(cluster, m, std::vector<std::string>(keys.begin() + 20, keys.end()));
  FinishMigration(cluster, m);
  const uint64_t moved_before = c.stats().moved;
  got = c.MultiGet(keys);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(got[i].status.ok()) << got[i].status.ToString();
    EXPECT_EQ(got[i].value, ValueOf(keys[i]));
  }
  EXPECT_GE(c.stats().moved - moved_before, 1u);  // the first key remapped the slot...
  EXPECT_EQ(c.MasterOf(slot), m.to->addr());      // ...for the rest of them
  auto fresh = c.Get("{mig}-new");
  ASSERT_TRUE(fresh.ok() && fresh->has_value());

  std::this_thread::sleep_for(milliseconds(100));
  stop = true;
  reader.join();
  EXPECT_GT(reads.load(), 0u);
  EXPECT_EQ(wrong.load(), 0u);
  EXPECT_EQ(missing.load(), 0u);
  EXPECT_EQ(failed.load(), 0u) << first_failure;
}

TEST(MigrationTest, ReshardWithRedisCliWhileWriting) {
  HIQ_SKIP_WITHOUT_REDIS();
  RedisTestCluster cluster;
  ASSERT_EQ(cluster.Start(), "");
  HIQ_OPEN_OR_FAIL(c, OptionsFor(cluster));
  const auto keys = Keys("reshard-", 300);
  for (const auto& k : keys) HIQ_ASSERT_OK(c.Set(k, ValueOf(k)));
  const auto masters = cluster.Masters();
  // Move 2,000 slots (with their keys) from one master to another with redis-cli, while this
  // thread keeps reading and rewriting the keys.
  std::atomic<bool> done{false};
  std::string out;
  std::thread reshard([&] {
    std::vector<std::string> argv = {l3_test::FindProgram("redis-cli"),
                                     "--cluster",
                                     "reshard",
                                     masters[0]->addr(),
                                     "--cluster-from",
                                     masters[0]->id,
                                     "--cluster-to",
                                     masters[1]->id,
                                     "--cluster-slots",
                                     "2000",
                                     "--cluster-yes",
                                     "--cluster-pipeline",
                                     "10"};
    std::string cmd;
    for (const auto& a : argv) cmd += "'" + a + "' ";
    const int rc = std::system((cmd + ">/dev/null 2>&1").c_str());
    EXPECT_EQ(rc, 0);
    done = true;
  });
  uint64_t wrong = 0, failed = 0, rounds = 0;
  std::string first_failure;
  while (!done.load() || rounds < 2) {
    const auto got = c.MultiGet(keys);
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!got[i].status.ok()) {
        if (failed++ == 0) first_failure = got[i].status.ToString();
      } else if (!got[i].found || got[i].value != ValueOf(keys[i])) {
        ++wrong;
      }
    }
    for (size_t i = rounds % 7; i < keys.size(); i += 7) {
      const Status st = c.Set(keys[i], ValueOf(keys[i]));
      if (!st.ok() && failed++ == 0) first_failure = st.ToString();
    }
    ++rounds;
  }
  reshard.join();
  EXPECT_EQ(wrong, 0u);
  // Redirections are followed: no call fails.
  EXPECT_EQ(failed, 0u) << first_failure;
  EXPECT_GT(c.stats().moved + c.stats().ask, 0u);
  // The client's map now agrees with the cluster.
  for (const auto& k : keys) {
    EXPECT_EQ(c.MasterOf(KeySlot(k)), cluster.MasterOfSlot(KeySlot(k))->addr()) << k;
  }
}

// ----------------------------------------------------------------------------------------------
// A master killed: its slots fail fast until the replica is promoted, then serve what was
// replicated.

TEST(FailoverTest, MasterKilledReplicaPromoted) {
  HIQ_SKIP_WITHOUT_REDIS();
  RedisTestCluster cluster;
  ASSERT_EQ(cluster.Start(), "");
  RedisClusterOptions o = OptionsFor(cluster);
  o.seeds = cluster.Seeds();
  HIQ_OPEN_OR_FAIL(c, o);
  const auto keys = Keys("fo-", 300);
  for (const auto& k : keys) HIQ_ASSERT_OK(c.Set(k, ValueOf(k)));
  for (const auto* m : cluster.Masters()) {  // every write is on the replicas
    const auto r = cluster.Admin(m->port, {"WAIT", "1", "2000"});
    ASSERT_EQ(r.integer, 1) << r.str;
  }
  const l3_test::ClusterNode victim = *cluster.Masters()[0];
  const l3_test::ClusterNode replica = *cluster.ReplicaOf(victim);
  std::string victim_key;
  for (const auto& k : keys) {
    if (c.MasterOf(KeySlot(k)) == victim.addr()) victim_key = k;
  }
  ASSERT_NE(victim_key, "");
  // WAIT counts a replica that acknowledged the offset; on a loaded machine a replica that
  // attached late may still be loading its first full copy. The replica must hold every key
  // of its master before the master dies, or the test would measure a lost write it caused.
  const long long victim_keys = cluster.Admin(victim.port, {"DBSIZE"}).integer;
  const auto synced_by = Clock::now() + hiqcache::test_time::Margin(milliseconds(10000));
  long long replica_keys = 0;
  while ((replica_keys = cluster.Admin(replica.port, {"DBSIZE"}).integer) != victim_keys &&
         Clock::now() < synced_by) {
    std::this_thread::sleep_for(milliseconds(50));
  }
  ASSERT_EQ(replica_keys, victim_keys) << "the replica did not copy its master's keys";
  cluster.Kill(victim);

  const auto killed_at = Clock::now();
  int failures = 0;
  bool served = false;
  while (Clock::now() - killed_at < std::chrono::seconds(20)) {
    const auto start = Clock::now();
    auto v = c.Get(victim_key, start + milliseconds(300));
    const auto took = Clock::now() - start;
    // Each failed call returns by its deadline (plus the margin of a loaded machine), never
    // waits for a connection's or a command's timeout.
    EXPECT_LT(took, milliseconds(300) + hiqcache::test_time::Margin(milliseconds(700)));
    if (v.ok()) {
      ASSERT_TRUE(v->has_value());
      EXPECT_EQ(**v, ValueOf(victim_key));
      served = true;
      break;
    }
    ++failures;
    EXPECT_TRUE(v.status().code() == StatusCode::kUnavailable ||
                v.status().code() == StatusCode::kDeadlineExceeded)
        << v.status().ToString();
    std::this_thread::sleep_for(milliseconds(50));
  }
  ASSERT_TRUE(served) << "the replica was not promoted within 20 s";
  EXPECT_GT(failures, 0);
  const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - killed_at);
  std::printf("failover: %d failed calls, served again after %lld ms\n", failures,
              static_cast<long long>(took.count()));
  EXPECT_EQ(c.MasterOf(KeySlot(victim_key)), replica.addr());
  // Every key that was replicated is there, on the promoted replica for the victim's slots
  // (once every master has seen the promotion: until then some answer CLUSTERDOWN).
  std::vector<KeyResult> got;
  const auto settle = Clock::now() + std::chrono::seconds(5);
  do {
    got = c.MultiGet(keys);
  } while (std::any_of(got.begin(), got.end(), [](const KeyResult& r) { return !r.status.ok(); }) &&
           Clock::now() < settle && (std::this_thread::sleep_for(milliseconds(50)), true));
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(got[i].status.ok()) << keys[i] << ": " << got[i].status.ToString();
    ASSERT_TRUE(got[i].found) << keys[i];
    EXPECT_EQ(got[i].value, ValueOf(keys[i]));
  }
  EXPECT_GT(c.stats().node_failures, 0u);
  EXPECT_GT(c.stats().slot_refreshes, 1u);
}

// ----------------------------------------------------------------------------------------------
// AUTH with an ACL user (the default user switched off).

TEST(AuthTest, AclUserIsRequired) {
  HIQ_SKIP_WITHOUT_REDIS();
  l3_test::ClusterOptions co;
  co.user = "hiq";
  co.password = "s3cret-l3";
  RedisTestCluster cluster(co);
  ASSERT_EQ(cluster.Start(), "");
  RedisClusterOptions o = OptionsFor(cluster);

  auto anonymous = RedisCluster::Open(o);
  EXPECT_EQ(anonymous.status().code(), StatusCode::kUnauthenticated)
      << anonymous.status().ToString();
  o.user = "hiq";
  o.password = "wrong";
  auto wrong = RedisCluster::Open(o);
  EXPECT_EQ(wrong.status().code(), StatusCode::kUnauthenticated) << wrong.status().ToString();

  o.password = co.password;
  HIQ_OPEN_OR_FAIL(c, o);
  const auto keys = Keys("auth-", 60);
  for (const auto& k : keys) HIQ_ASSERT_OK(c.Set(k, ValueOf(k)));
  const auto got = c.MultiGet(keys);  // connections to every master, each authenticated
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(got[i].status.ok()) << got[i].status.ToString();
    EXPECT_EQ(got[i].value, ValueOf(keys[i]));
  }
  EXPECT_GE(c.stats().connects, 3u);
}

}  // namespace
}  // namespace hiqcache::server::l3
