// The L3 tier (server/core/l3_tier.h) in-process, over a real BlockStore and a real Redis
// Cluster, with several threads at once: what the daemon's gRPC threads, transfer workers and
// the tier's own writers do concurrently. Built for ThreadSanitizer too (deploy/run-tests.sh's
// tsan stage runs it). Label l3; skipped where redis-server is not installed.
#include "core/l3_tier.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <thread>
#include <vector>

#include "core/namespace_table.h"
#include "l3/l3_value.h"
#include "l3/redis_l3_tier.h"
#include "pool/block_store.h"
#include "redis_test_cluster.h"
#include "server_test_util.h"
#include "time_margin.h"

namespace hiqcache::server {
namespace {

using l3_test::RedisTestCluster;
using std::chrono::milliseconds;
using testing::AnonBuffer;
using testing::KeyOf;

kernels::BlockLayout SmallLayout() {
  kernels::BlockLayout l;
  l.row.num_heads = 2;
  l.row.head_dim = 64;
  l.row.dtype = kernels::DType::kBF16;
  l.row.codec = kernels::CodecKind::kInt8PerHead;
  l.num_layers = 2;
  l.kv_planes = 2;
  l.block_tokens = 16;
  return l;
}

// Block `id`'s payload byte b.
uint8_t PayloadByte(uint64_t id, uint64_t b) {
  return static_cast<uint8_t>((id * 131 + b * 7) ^ (b >> 8));
}

bool Eventually(const std::function<bool()>& pred, std::chrono::seconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(milliseconds(20));
  }
  return pred();
}

class L3TierTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kSlots = 40;
  void SetUp() override {
    if (!L3Available()) GTEST_SKIP() << "built without the L3 store (hiredis)";
    if (!RedisTestCluster::Available()) GTEST_SKIP() << "redis-server / redis-cli not installed";
    ASSERT_EQ(cluster_.Start(), "");
    layout_ = SmallLayout();
    payload_ = layout_.BlockBytes();
    pool_ =
        std::make_unique<AnonBuffer>(PoolMetaBytes(1 << 20) + kExtentHeaderBytes +
                                     kSlots * SlotBytesFor(payload_) + SlotBytesFor(payload_) / 2);
    store_ = std::make_unique<BlockStore>(pool_->data(), pool_->size());
    NamespaceDesc d;
    d.model = "l3-tier-test";
    d.layout = layout_;
    ns_ = &table_.Intern(d);
    store_->AddNamespace(ns_->ForStore());
  }
  L3Options Options(L3WritePolicy policy) const {
    L3Options o;
    o.seeds = cluster_.Seeds();
    o.policy = policy;
    o.lookup_deadline = milliseconds(1000);
    o.fetch_deadline = milliseconds(3000);
    o.connect_timeout = milliseconds(1000);  // loopback on a loaded machine
    o.command_timeout = milliseconds(1000);
    return o;
  }
  // Writes block `id` into the store (evicting the LRU block when full); false when no room.
  bool Put(uint64_t id) {
    const BlockKey k = KeyOf(id);
    auto r = store_->ReserveWrites(ns_->id, std::span<const BlockKey>(&k, 1));
    if (r[0].outcome != BlockStore::WriteOutcome::kReserved) {
      return r[0].outcome == BlockStore::WriteOutcome::kPresent;
    }
    for (uint64_t b = 0; b < payload_; ++b) r[0].payload[b] = PayloadByte(id, b);
    store_->CommitWrite(r[0].handle, XXH3_64bits(r[0].payload, payload_));
    return true;
  }
  // Whether a fetched block is block `id`'s payload.
  bool Matches(const L3Block& b, uint64_t id) const {
    for (uint64_t i = 0; i < payload_; ++i) {
      if (b.payload()[i] != PayloadByte(id, i)) return false;
    }
    return b.payload_checksum == XXH3_64bits(b.payload(), payload_);
  }
  long long KeysInCluster() const {
    long long n = 0;
    for (const auto* m : cluster_.Masters()) n += cluster_.Admin(m->port, {"DBSIZE"}).integer;
    return n;
  }

  RedisTestCluster cluster_;
  kernels::BlockLayout layout_;
  uint64_t payload_ = 0;
  std::unique_ptr<AnonBuffer> pool_;
  std::unique_ptr<BlockStore> store_;
  NamespaceTable table_;
  const NamespaceInfo* ns_ = nullptr;
};

// on_evict: two threads back up 150 blocks each into a 40-block store while a third probes and
// fetches what was evicted and a fourth reads the stats. Every evicted block reaches L3 intact;
// blocks still in the store do not; once the tier is gone, evictions go on without it.
TEST_F(L3TierTest, OnEvictUnderConcurrentBackupsAndReads) {
  auto tier = CreateRedisL3Tier(Options(L3WritePolicy::kOnEvict), store_.get());
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  constexpr uint64_t kPerThread = 150;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> wrong{0}, fetched{0}, probes{0};
  std::vector<std::thread> writers;
  for (uint64_t t = 0; t < 2; ++t) {
    writers.emplace_back([&, t] {
      for (uint64_t i = 0; i < kPerThread; ++i) EXPECT_TRUE(Put(t * 1000 + i));
    });
  }
  std::thread reader([&] {
    for (uint64_t i = 0; !stop.load(); ++i) {
      const uint64_t id = (i % 2) * 1000 + (i / 2) % 40;  // early blocks: evicted soonest
      const BlockKey k = KeyOf(id);
      probes += (*tier)->Probe(std::span<const NamespaceHash>(&ns_->hash, 1),
                               std::span<const BlockKey>(&k, 1));
      const std::span<const BlockKey> one(&k, 1);
      for (const L3Block& b : (*tier)->Fetch(ns_->hash, payload_, one)) {
        ++fetched;
        if (!Matches(b, id)) ++wrong;
      }
    }
  });
  std::thread stats([&] {
    while (!stop.load()) {
      const L3Stats s = (*tier)->Stats();
      EXPECT_LE(s.writes, s.spilled_blocks);
      std::this_thread::sleep_for(milliseconds(1));
    }
  });
  for (auto& w : writers) w.join();
  ASSERT_TRUE(Eventually(
      [&] {
        const L3Stats s = (*tier)->Stats();
        return s.write_queue_blocks == 0 && s.writes + s.write_errors >= s.spilled_blocks;
      },
      std::chrono::seconds(30)));
  stop = true;
  reader.join();
  stats.join();
  const L3Stats s = (*tier)->Stats();
  EXPECT_TRUE(s.on_evict);
  EXPECT_EQ(s.write_errors + s.dropped_writes + s.corrupt_values, 0u);
  const uint64_t evictions = store_->Stats().namespaces.at(ns_->id).evictions;
  EXPECT_EQ(evictions, 2 * kPerThread - kSlots);
  EXPECT_EQ(s.spilled_blocks, evictions);
  EXPECT_EQ(s.writes, evictions);
  EXPECT_EQ(KeysInCluster(), static_cast<long long>(evictions));
  EXPECT_EQ(wrong.load(), 0u);
  std::cout << "reader: " << probes.load() << " probe hits, " << fetched.load()
            << " blocks fetched while the writers ran\n";
  // Each evicted block comes back intact; the blocks the store still holds are not in L3.
  uint64_t in_l3 = 0, in_store = 0;
  for (uint64_t t = 0; t < 2; ++t) {
    for (uint64_t i = 0; i < kPerThread; ++i) {
      const uint64_t id = t * 1000 + i;
      const BlockKey k = KeyOf(id);
      const bool held = store_->LookupPrefix(ns_->id, std::span<const BlockKey>(&k, 1)) == 1;
      auto got = (*tier)->Fetch(ns_->hash, payload_, std::span<const BlockKey>(&k, 1));
      if (held) {
        ++in_store;
        EXPECT_TRUE(got.empty()) << id << " is in the store and was never evicted";
      } else {
        ++in_l3;
        ASSERT_EQ(got.size(), 1u) << id;
        EXPECT_TRUE(Matches(got[0], id)) << id;
      }
    }
  }
  EXPECT_EQ(in_store, kSlots);
  EXPECT_EQ(in_l3, evictions);
  // The tier goes; the store evicts on without a sink.
  tier->reset();
  for (uint64_t i = 0; i < 60; ++i) ASSERT_TRUE(Put(5000 + i));
  EXPECT_EQ(KeysInCluster(), static_cast<long long>(evictions));
}

// Lookups that always miss their deadline (0 ms: the cluster is live, only slower than that) are
// late, not dead: a few in a row suspend lookups, while fetches, whose deadline the cluster meets,
// go on being served, and spills go on being written.
TEST_F(L3TierTest, LateLookupsDoNotSuspendFetches) {
  L3Options o = Options(L3WritePolicy::kOnEvict);
  o.lookup_deadline = milliseconds(0);
  auto tier = CreateRedisL3Tier(o, store_.get());
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  for (uint64_t id = 0; id < kSlots + 4; ++id) ASSERT_TRUE(Put(id));  // blocks 0-3 spill
  ASSERT_TRUE(Eventually([&] { return (*tier)->Stats().writes == 4; }, std::chrono::seconds(20)));
  const BlockKey k = KeyOf(0);
  const std::span<const BlockKey> one(&k, 1);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ((*tier)->Probe(std::span<const NamespaceHash>(&ns_->hash, 1), one), 0u);
  }
  EXPECT_GE((*tier)->Stats().lookup_errors, 8u);
  auto got = (*tier)->Fetch(ns_->hash, payload_, one);
  ASSERT_EQ(got.size(), 1u) << "late lookups suspended fetches too";
  EXPECT_TRUE(Matches(got[0], 0));
  ASSERT_TRUE(Put(kSlots + 4));  // block 4 spills: writes are not suspended either
  EXPECT_TRUE(Eventually([&] { return (*tier)->Stats().writes == 5; }, std::chrono::seconds(20)));
}

// on_evict while every node is stopped (SIGSTOP) for longer than a write's deadline (2 x 100 ms
// here): the writers try again, and every block evicted meanwhile reaches L3 once the cluster
// goes on. Without retries each such block was lost.
TEST_F(L3TierTest, SpillsOutlastAClusterPause) {
  L3Options o = Options(L3WritePolicy::kOnEvict);
  o.command_timeout = milliseconds(100);
  auto tier = CreateRedisL3Tier(o, store_.get());
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  for (uint64_t id = 0; id < kSlots + 1; ++id) ASSERT_TRUE(Put(id));  // block 0 spills
  ASSERT_TRUE(Eventually([&] { return (*tier)->Stats().writes == 1; }, std::chrono::seconds(20)));
  for (const auto& n : cluster_.nodes()) ASSERT_EQ(::kill(n.pid, SIGSTOP), 0);
  for (uint64_t id = kSlots + 1; id < kSlots + 7; ++id) ASSERT_TRUE(Put(id));  // 1-6 spill
  std::this_thread::sleep_for(milliseconds(500));
  for (const auto& n : cluster_.nodes()) ASSERT_EQ(::kill(n.pid, SIGCONT), 0);
  ASSERT_TRUE(Eventually(
      [&] {
        const L3Stats s = (*tier)->Stats();
        return s.write_queue_blocks == 0 && s.writes + s.write_errors >= 7;
      },
      std::chrono::seconds(30)));
  const L3Stats s = (*tier)->Stats();
  EXPECT_EQ(s.spilled_blocks, 7u);
  EXPECT_EQ(s.write_errors, 0u);
  EXPECT_EQ(s.writes, 7u);
  for (uint64_t id = 0; id < 7; ++id) {
    const BlockKey k = KeyOf(id);
    std::vector<L3Block> got;
    ASSERT_TRUE(Eventually(
        [&] {
          got = (*tier)->Fetch(ns_->hash, payload_, std::span<const BlockKey>(&k, 1));
          return got.size() == 1;
        },
        std::chrono::seconds(10)))
        << id;
    EXPECT_TRUE(Matches(got[0], id)) << id;
  }
}

// write_through with a budget of 10 values: four threads publish 25 blocks each; the tier's two
// writers keep the cluster at the newest 10 of its writes, and its ledger agrees.
TEST_F(L3TierTest, BudgetUnderConcurrentPublishers) {
  // A store big enough to hold every block (no eviction).
  pool_ = std::make_unique<AnonBuffer>(PoolMetaBytes(1 << 20) + kExtentHeaderBytes +
                                       200 * SlotBytesFor(payload_));
  store_ = std::make_unique<BlockStore>(pool_->data(), pool_->size());
  store_->AddNamespace(ns_->ForStore());
  const uint64_t value_bytes = l3::kL3ValueHeaderBytes + payload_;
  L3Options o = Options(L3WritePolicy::kWriteThrough);
  o.budget_bytes = 10 * value_bytes + value_bytes / 2;
  auto tier = CreateRedisL3Tier(o, store_.get());
  ASSERT_TRUE(tier.ok());
  std::vector<std::thread> publishers;
  for (uint64_t t = 0; t < 4; ++t) {
    publishers.emplace_back([&, t] {
      for (uint64_t i = 0; i < 25; ++i) {
        const uint64_t id = t * 1000 + i;
        ASSERT_TRUE(Put(id));
        (*tier)->Published(ns_->id, ns_->hash, payload_, KeyOf(id));
      }
    });
  }
  for (auto& p : publishers) p.join();
  ASSERT_TRUE(Eventually(
      [&] {
        const L3Stats s = (*tier)->Stats();
        return s.writes + s.write_errors + s.dropped_writes + s.skipped_writes == 100;
      },
      std::chrono::seconds(30)));
  const L3Stats s = (*tier)->Stats();
  EXPECT_EQ(s.writes, 100u);
  EXPECT_EQ(s.budget_deletes, 90u);
  EXPECT_EQ(s.budget_used_bytes, 10 * value_bytes);
  EXPECT_EQ(KeysInCluster(), 10);
  // What L3 holds is what the ledger kept, intact.
  uint64_t held = 0;
  for (uint64_t t = 0; t < 4; ++t) {
    for (uint64_t i = 0; i < 25; ++i) {
      const BlockKey k = KeyOf(t * 1000 + i);
      auto got = (*tier)->Fetch(ns_->hash, payload_, std::span<const BlockKey>(&k, 1));
      if (!got.empty()) {
        ++held;
        EXPECT_TRUE(Matches(got[0], t * 1000 + i));
      }
    }
  }
  EXPECT_EQ(held, 10u);
}

// A tier destroyed with writes queued and the cluster slow to drain returns promptly and drops
// them; nothing touches the store afterwards.
TEST_F(L3TierTest, DestroyedWithAFullQueue) {
  pool_ = std::make_unique<AnonBuffer>(PoolMetaBytes(1 << 20) + kExtentHeaderBytes +
                                       600 * SlotBytesFor(payload_));
  store_ = std::make_unique<BlockStore>(pool_->data(), pool_->size());
  store_->AddNamespace(ns_->ForStore());
  L3Options o = Options(L3WritePolicy::kWriteThrough);
  o.writer_threads = 1;
  auto tier = CreateRedisL3Tier(o, store_.get());
  ASSERT_TRUE(tier.ok());
  for (uint64_t i = 0; i < 500; ++i) {
    ASSERT_TRUE(Put(i));
    (*tier)->Published(ns_->id, ns_->hash, payload_, KeyOf(i));
  }
  const auto t0 = std::chrono::steady_clock::now();
  tier->reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0,
            hiqcache::test_time::Margin(std::chrono::seconds(5)));
  EXPECT_LE(KeysInCluster(), 500);
}

}  // namespace
}  // namespace hiqcache::server
