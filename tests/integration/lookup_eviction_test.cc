// Prefix lookup semantics, namespace sharing with a second client process (hiq_it_peer), group
// lookups over the namespaces of a TP group (LookupGroup), and eviction of a small pool: LRU
// order, pinned blocks survive, statistics match what was done.
#include <gtest/gtest.h>

#include <memory>

#include "daemon_process.h"
#include "it_util.h"
#include "time_margin.h"

#ifndef HIQ_IT_PEER_PATH
#error "HIQ_IT_PEER_PATH must name the hiq_it_peer binary"
#endif

namespace hiqcache::it {
namespace {

using std::chrono::milliseconds;
using testing::DaemonProcess;

// ---------------------------------------------------------------------------------------------
// Lookup and namespaces (one daemon for the suite; each test has its own model).

// Geometry of hiq_it_peer's defaults.
constexpr uint32_t kBt = 16;

class LookupTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    daemon_ = new DaemonProcess("64MiB");
    ASSERT_TRUE(daemon_->Start()) << "hiqcached did not start";
  }
  static void TearDownTestSuite() {
    if (daemon_ != nullptr) {
      EXPECT_EQ(daemon_->Stop(), 0) << "hiqcached did not exit 0 on SIGTERM";
    }
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override {
    client_ = Connect(daemon_->target());
    ASSERT_NE(client_, nullptr);
  }
  PoolOptions Options(const std::string& model) {
    PoolOptions o;
    o.model = model;
    o.geometry = Geom(4, 4, 64);
    o.block_tokens = kBt;
    o.num_rows = 128;
    return o;
  }
  SpawnResult Peer(const std::string& mode, const std::string& model, uint64_t seed,
                   const std::string& layout = "sglang", const std::string& tenant = "") {
    return Spawn({HIQ_IT_PEER_PATH, "--target", daemon_->target(), "--mode", mode, "--model", model,
                  "--tenant", tenant, "--layout", layout, "--seed", std::to_string(seed),
                  "--blocks", "4"});
  }
  NamespaceStats Ns(const std::string& id) {
    auto s = client_->GetStats();
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    const NamespaceStats* n = s.ok() ? FindNamespace(*s, id) : nullptr;
    EXPECT_NE(n, nullptr);
    return n ? *n : NamespaceStats{};
  }

  static DaemonProcess* daemon_;
  std::unique_ptr<Client> client_;
};
DaemonProcess* LookupTest::daemon_ = nullptr;

TEST_F(LookupTest, LongestLeadingRun) {
  auto p = MakePool(*client_, Options("lk-prefix"));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const std::vector<BlockKey> k = Keys(100, 6, kBt);
  const std::vector<BlockKey> unknown = Keys(101, 3, kBt);
  const std::vector<uint32_t> rows = RowRange(0, 6 * kBt);
  FillRows(p->kv, 100, rows, kBt);
  auto span_rows = [&](uint32_t first, uint32_t n) {
    return std::span<const uint32_t>(rows).subspan(first * kBt, n * kBt);
  };
  auto span_keys = [&](uint32_t first, uint32_t n) {
    return std::span<const BlockKey>(k).subspan(first, n);
  };
  // Blocks 0, 1, 2, 4, 5: a hole at 3.
  ASSERT_EQ(client_->Backup(p->handle, span_keys(0, 3), span_rows(0, 3)).held(), 3u);
  ASSERT_EQ(client_->Backup(p->handle, span_keys(4, 2), span_rows(4, 2)).held(), 2u);

  auto lookup = [&](std::vector<BlockKey> keys) {
    LookupResult r = client_->Lookup(p->handle, keys);
    EXPECT_TRUE(r.status.ok()) << r.status.ToString();
    return r.prefix_blocks;
  };
  EXPECT_EQ(lookup(k), 3u);                         // h3 m3
  EXPECT_EQ(lookup({k[0], k[1]}), 2u);              // h2
  EXPECT_EQ(lookup({k[4], k[5]}), 2u);              // h2
  EXPECT_EQ(lookup({k[3], k[4], k[5]}), 0u);        // m3
  EXPECT_EQ(lookup(unknown), 0u);                   // m3
  EXPECT_EQ(lookup({k[0], unknown[0], k[1]}), 1u);  // h1 m2
  EXPECT_EQ(lookup({unknown[1], k[0]}), 0u);        // m2
  EXPECT_EQ(client_->Lookup(p->handle, {}).prefix_blocks, 0u);

  // A key repeated in one request is stored once.
  const std::vector<BlockKey> twice = {k[3], k[3]};
  const std::vector<uint32_t> rows2 = {span_rows(3, 1).begin(), span_rows(3, 1).end()};
  std::vector<uint32_t> rows_twice = rows2;
  rows_twice.insert(rows_twice.end(), rows2.begin(), rows2.end());
  BackupResult b = client_->Backup(p->handle, twice, rows_twice);
  ASSERT_TRUE(b.status.ok()) << b.status.ToString();
  EXPECT_EQ(b.blocks[0], BlockStatus::kStored);
  EXPECT_EQ(b.blocks[1], BlockStatus::kAlreadyPresent);
  EXPECT_EQ(lookup(k), 6u);  // h6

  NamespaceStats n = Ns(p->info.namespace_id);
  EXPECT_EQ(n.hits, 14u);
  EXPECT_EQ(n.misses, 13u);
  EXPECT_EQ(n.blocks, 6u);
  EXPECT_EQ(n.backups, 6u);
}

TEST_F(LookupTest, PeerProcessRestoresOurBlocks) {
  auto p = MakePool(*client_, Options("lk-peer-a"));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const std::vector<uint32_t> rows = PickRows(128, 4 * kBt, 1);
  FillRows(p->kv, 7, rows, kBt);
  ASSERT_EQ(client_->Backup(p->handle, Keys(7, 4, kBt), rows).held(), 4u);
  for (const char* layout : {"packed", "paged"}) {
    SpawnResult r = Peer("restore", "lk-peer-a", 7, layout);
    EXPECT_EQ(r.exit_code, 0) << layout << ": peer said: " << r.out;
    EXPECT_EQ(r.out, "restore 4\n") << layout;
  }
}

TEST_F(LookupTest, WeRestorePeerBlocksAndPeerPoolIsReleasedOnExit) {
  SpawnResult r = Peer("backup", "lk-peer-b", 8, "paged");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out, "backup 4\n");
  // The daemon notices the peer's exit and releases its registration (DESIGN: within 1 s).
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(Eventually(
      [&] {
        auto s = client_->GetStats();
        if (!s.ok()) return false;
        for (const auto& pool : s->pools) {
          if (pool.client_pid == static_cast<uint32_t>(r.pid)) return false;
        }
        return true;
      },
      test_time::Margin(milliseconds(10000))))
      << "peer pool still registered after its exit";
  // The contract's 1 s, asserted with the margin of a loaded machine.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, test_time::Margin(milliseconds(3000)))
      << "docs/design.md: the daemon releases a dead client's pools within 1 s";

  auto p = MakePool(*client_, Options("lk-peer-b"));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  FillSentinel(p->kv);
  const std::vector<BlockKey> keys = Keys(8, 4, kBt);
  EXPECT_EQ(client_->Lookup(p->handle, keys).prefix_blocks, 4u);
  const std::vector<uint32_t> rows = PickRows(128, 4 * kBt, 2);
  RestoreResult rr = client_->Restore(p->handle, keys, rows);
  ASSERT_TRUE(rr.status.ok()) << rr.status.ToString();
  EXPECT_EQ(rr.restored_blocks, 4u);
  CheckResult c = CheckRows(p->kv, 8, rows, kBt, false);
  EXPECT_TRUE(c.ok()) << c.first;
  EXPECT_EQ(ChangedOutside(p->kv, rows), 0u);
}

TEST_F(LookupTest, OtherTenantOrModelIsAnotherNamespace) {
  auto p = MakePool(*client_, Options("lk-ns"));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const std::vector<uint32_t> rows = RowRange(0, 4 * kBt);
  FillRows(p->kv, 9, rows, kBt);
  const std::vector<BlockKey> keys = Keys(9, 4, kBt);
  ASSERT_EQ(client_->Backup(p->handle, keys, rows).held(), 4u);

  SpawnResult same = Peer("lookup", "lk-ns", 9);
  EXPECT_EQ(same.exit_code, 0);
  EXPECT_EQ(same.out, "lookup 4\n");
  SpawnResult tenant = Peer("lookup", "lk-ns", 9, "sglang", "other-tenant");
  EXPECT_EQ(tenant.exit_code, 0);
  EXPECT_EQ(tenant.out, "lookup 0\n");
  SpawnResult model = Peer("lookup", "lk-ns-2", 9);
  EXPECT_EQ(model.exit_code, 0);
  EXPECT_EQ(model.out, "lookup 0\n");
  SpawnResult restore = Peer("restore", "lk-ns", 9, "sglang", "other-tenant");
  EXPECT_EQ(restore.exit_code, 0);
  EXPECT_EQ(restore.out, "restore 0\n");

  PoolOptions o = Options("lk-ns");
  o.tenant = "other-tenant";
  auto q = MakePool(*client_, o);
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_NE(q->info.namespace_id, p->info.namespace_id);
  EXPECT_EQ(client_->Lookup(q->handle, keys).prefix_blocks, 0u);
  o.tenant = "";
  o.block_tokens = 8;  // block size is part of the namespace too
  auto r = MakePool(*client_, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_NE(r->info.namespace_id, p->info.namespace_id);
  EXPECT_EQ(client_->Lookup(r->handle, keys).prefix_blocks, 0u);
}

// ---------------------------------------------------------------------------------------------
// Group lookup: a scheduler holds no pool; it asks whether every TP rank of an engine holds a
// prefix, naming the ranks' namespaces by their parts (LookupGroup). Its own daemon, with room for
// one extent (64 MiB) per rank: in a smaller pool the ranks' namespaces would take the whole pool
// from each other.

// A test with a daemon of its own, of `pool_bytes`, and a client connected to it.
class OwnDaemonTest : public ::testing::Test {
 protected:
  explicit OwnDaemonTest(const char* pool_bytes) : daemon_(pool_bytes) {}
  void SetUp() override {
    ASSERT_TRUE(daemon_.Start()) << "hiqcached did not start";
    client_ = Connect(daemon_.target());
    ASSERT_NE(client_, nullptr);
  }
  void TearDown() override {
    client_.reset();
    EXPECT_EQ(daemon_.Stop(), 0);
  }

  DaemonProcess daemon_;
  std::unique_ptr<Client> client_;
};

class GroupLookupTest : public OwnDaemonTest {
 protected:
  GroupLookupTest() : OwnDaemonTest("192MiB") {}
};

TEST_F(GroupLookupTest, AnswersWhatEveryTpRankHolds) {
  PoolOptions o0;
  o0.model = "lk-group";
  o0.geometry = Geom(4, 4, 64);
  o0.block_tokens = kBt;
  o0.num_rows = 128;
  o0.geometry.tp_rank = 0;
  o0.geometry.tp_size = 2;
  PoolOptions o1 = o0;
  o1.geometry.tp_rank = 1;
  auto r0 = MakePool(*client_, o0);
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  auto r1 = MakePool(*client_, o1);
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  ASSERT_NE(r0->info.namespace_id, r1->info.namespace_id);

  const std::vector<BlockKey> keys = Keys(12, 4, kBt);
  const std::vector<uint32_t> rows = RowRange(0, 4 * kBt);
  FillRows(r0->kv, 12, rows, kBt);
  FillRows(r1->kv, 13, rows, kBt);
  ASSERT_EQ(client_->Backup(r0->handle, keys, rows).held(), 4u);
  ASSERT_EQ(
      client_->Backup(r1->handle, std::span(keys).first(2), std::span(rows).first(2 * kBt)).held(),
      2u);
  ASSERT_EQ(client_->Lookup(r0->handle, keys).prefix_blocks, 4u);
  ASSERT_EQ(client_->Lookup(r1->handle, keys).prefix_blocks, 2u);

  // What a scheduler knows: the parts the workers register with, not their pools.
  const NamespaceRef ref0 = RefOf(r0->spec), ref1 = RefOf(r1->spec);
  auto group = [&](std::vector<NamespaceRef> refs) {
    LookupResult r = client_->LookupGroup(refs, keys);
    EXPECT_TRUE(r.status.ok()) << r.status.ToString();
    return r.prefix_blocks;
  };
  const auto before = client_->GetStats();
  ASSERT_TRUE(before.ok()) << before.status().ToString();
  EXPECT_EQ(group({ref0, ref1}), 2u);
  EXPECT_EQ(group({ref1, ref0}), 2u);
  EXPECT_EQ(group({ref0}), 4u);
  EXPECT_EQ(group({ref1}), 2u);
  NamespaceRef unknown = ref0;
  unknown.model = "lk-group-never-registered";
  EXPECT_EQ(group({unknown}), 0u);
  EXPECT_EQ(group({ref0, unknown}), 0u);
  NamespaceRef rank2 = ref0;  // rank 0 of another TP size: another namespace
  rank2.geometry.tp_size = 4;
  EXPECT_EQ(group({rank2}), 0u);

  // Counted like pool lookups (hits = the answer, misses = the rest, in each namespace), and no
  // namespace was created by looking up unknown ones.
  const auto after = client_->GetStats();
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_EQ(after->namespaces.size(), before->namespaces.size());
  const NamespaceStats* a0 = FindNamespace(*before, r0->info.namespace_id);
  const NamespaceStats* b0 = FindNamespace(*after, r0->info.namespace_id);
  const NamespaceStats* a1 = FindNamespace(*before, r1->info.namespace_id);
  const NamespaceStats* b1 = FindNamespace(*after, r1->info.namespace_id);
  ASSERT_TRUE(a0 && b0 && a1 && b1);
  // rank 0: {0,1}x2 -> h4 m4, {0} h4, {1} -, {0,unknown} m4 -> h8 m8.
  EXPECT_EQ(b0->hits - a0->hits, 8u);
  EXPECT_EQ(b0->misses - a0->misses, 8u);
  // rank 1: {0,1}x2 -> h4 m4, {1} h2 m2.
  EXPECT_EQ(b1->hits - a1->hits, 6u);
  EXPECT_EQ(b1->misses - a1->misses, 6u);

  // Malformed refs are errors that name the field; the client still answers 0 (fail-open).
  NamespaceRef bad = ref1;
  bad.geometry.num_kv_heads = 0;
  LookupResult r = client_->LookupGroup(std::vector<NamespaceRef>{ref0, bad}, keys);
  EXPECT_EQ(r.prefix_blocks, 0u);
  EXPECT_EQ(r.status.code(), StatusCode::kInvalidArgument) << r.status.ToString();
  EXPECT_NE(r.status.message().find("namespaces[1].geometry.num_kv_heads"), std::string::npos)
      << r.status.message();
  r = client_->LookupGroup(std::vector<NamespaceRef>(65, ref0), keys);
  EXPECT_EQ(r.prefix_blocks, 0u);
  EXPECT_EQ(r.status.code(), StatusCode::kResourceExhausted) << r.status.ToString();
  r = client_->LookupGroup({}, keys);
  EXPECT_EQ(r.prefix_blocks, 0u);
  EXPECT_EQ(r.status.code(), StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// Eviction: a 16 MiB pool and ~0.5 MB blocks (16 layers x 8 heads x 128 dims x 16 tokens), about
// 31 blocks. Each test starts its own daemon so the counters are exactly its own.

constexpr uint32_t kEvBt = 16;
constexpr uint32_t kGroupRows = 4 * kEvBt;  // rows a batch of 4 blocks is backed up from

class EvictionTest : public OwnDaemonTest {
 protected:
  EvictionTest() : OwnDaemonTest("16MiB") {}
  PoolOptions Options(const std::string& model, uint32_t rows, uint32_t events = 0) {
    PoolOptions o;
    o.model = model;
    o.geometry = Geom(16, 8, 128);
    o.block_tokens = kEvBt;
    o.num_rows = rows;
    o.event_slots = events;
    return o;
  }
  // Backs up `keys` from rows [0, 64) in batches of 4 blocks; every block must be stored.
  void BackupAll(const TestPool& p, std::span<const BlockKey> keys) {
    const std::vector<uint32_t> rows = RowRange(0, kGroupRows);
    for (size_t i = 0; i < keys.size(); i += 4) {
      const size_t n = std::min<size_t>(4, keys.size() - i);
      BackupResult b =
          client_->Backup(p.handle, keys.subspan(i, n), std::span(rows).subspan(0, n * kEvBt));
      ASSERT_TRUE(b.status.ok()) << b.status.ToString();
      for (size_t j = 0; j < n; ++j) {
        ASSERT_EQ(b.blocks[j], BlockStatus::kStored) << "block " << i + j;
      }
    }
  }
  uint32_t Prefix(const TestPool& p, std::vector<BlockKey> keys) {
    LookupResult r = client_->Lookup(p.handle, keys);
    EXPECT_TRUE(r.status.ok()) << r.status.ToString();
    return r.prefix_blocks;
  }
  struct Snapshot {
    DaemonStats daemon;
    NamespaceStats ns;
  };
  Snapshot Stats(const std::string& ns) {
    Snapshot s;
    auto st = client_->GetStats();
    EXPECT_TRUE(st.ok()) << st.status().ToString();
    if (!st.ok()) return s;
    s.daemon = *st;
    const NamespaceStats* n = FindNamespace(*st, ns);
    EXPECT_NE(n, nullptr);
    if (n) s.ns = *n;
    // Invariants that hold at any time.
    EXPECT_LE(s.daemon.used_bytes, s.daemon.capacity_bytes);
    EXPECT_LE(s.daemon.capacity_bytes, s.daemon.pool_bytes);
    EXPECT_EQ(s.daemon.pool_bytes, 16ull << 20);
    EXPECT_EQ(s.daemon.blocks, s.ns.blocks);  // one namespace per daemon here
    EXPECT_EQ(s.daemon.used_bytes, s.ns.bytes);
    if (s.ns.blocks > 0) {
      EXPECT_GE(s.ns.bytes / s.ns.blocks, 532480u);
    }
    return s;
  }
};

TEST_F(EvictionTest, LeastRecentlyUsedGoesFirst) {
  auto p = MakePool(*client_, Options("ev-lru", kGroupRows));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->info.block_bytes, 16u * 2 * 16 * (8 * 128 + 2 * 8));
  const uint32_t cap = static_cast<uint32_t>(p->info.capacity_tokens / kEvBt);
  ASSERT_GE(cap, 24u);
  ASSERT_LE(cap, 32u);  // 16 MiB / 532,480 B
  FillRows(p->kv, 200, RowRange(0, kGroupRows), kEvBt);
  const std::vector<BlockKey> k = Keys(200, cap + 2, kEvBt);

  ASSERT_NO_FATAL_FAILURE(BackupAll(*p, std::span(k).first(cap)));
  Snapshot s = Stats(p->info.namespace_id);
  EXPECT_EQ(s.ns.blocks, cap) << "the pool does not hold capacity_tokens";
  EXPECT_EQ(s.ns.evictions, 0u);
  EXPECT_EQ(s.ns.backups, cap);
  EXPECT_EQ(s.ns.capacity_blocks, cap);

  // Touch blocks 0 and 1: blocks 2 and 3 are now the least recently used.
  EXPECT_EQ(Prefix(*p, {k[0]}), 1u);
  EXPECT_EQ(Prefix(*p, {k[1]}), 1u);
  ASSERT_NO_FATAL_FAILURE(BackupAll(*p, std::span(k).subspan(cap, 2)));
  s = Stats(p->info.namespace_id);
  EXPECT_EQ(s.ns.evictions, 2u);
  EXPECT_EQ(s.ns.blocks, cap);

  EXPECT_EQ(Prefix(*p, {k[2]}), 0u) << "LRU block 2 survived";
  EXPECT_EQ(Prefix(*p, {k[3]}), 0u) << "LRU block 3 survived";
  EXPECT_EQ(Prefix(*p, {k[0]}), 1u) << "touched block 0 was evicted";
  EXPECT_EQ(Prefix(*p, {k[1]}), 1u) << "touched block 1 was evicted";
  EXPECT_EQ(Prefix(*p, {k[4]}), 1u);
  EXPECT_EQ(Prefix(*p, {k[cap], k[cap + 1]}), 2u);
  EXPECT_EQ(Prefix(*p, k), 2u);  // stops at the evicted block 2
  // hits: 2 + 3 + 2 + 2 = 9; misses: 2 + cap (the full lookup)

  RestoreResult miss = client_->Restore(p->handle, std::span(&k[2], 1), RowRange(0, kEvBt));
  ASSERT_TRUE(miss.status.ok());
  EXPECT_EQ(miss.restored_blocks, 0u);
  FillSentinel(p->kv);
  const std::vector<uint32_t> dst = RowRange(0, 2 * kEvBt);
  RestoreResult hit = client_->Restore(p->handle, std::span(k).first(2), dst);
  ASSERT_TRUE(hit.status.ok()) << hit.status.ToString();
  EXPECT_EQ(hit.restored_blocks, 2u);
  CheckResult c = CheckRows(p->kv, 200, dst, kEvBt, false);  // from rows 0..31: blocks 0, 1
  EXPECT_TRUE(c.ok()) << c.first;

  auto evicted = client_->Evict(p->handle, std::vector<BlockKey>{k[4], k[2]});
  ASSERT_TRUE(evicted.ok()) << evicted.status().ToString();
  EXPECT_EQ(*evicted, 1u);

  s = Stats(p->info.namespace_id);
  EXPECT_EQ(s.ns.blocks, cap - 1);
  EXPECT_EQ(s.ns.evictions, 3u);
  EXPECT_EQ(s.ns.backups, cap + 2);
  EXPECT_EQ(s.ns.restores, 2u);
  EXPECT_EQ(s.ns.hits, 9u);
  EXPECT_EQ(s.ns.misses, 2u + cap);
  EXPECT_EQ(s.ns.rejected, 0u);
}

TEST_F(EvictionTest, PinnedBlocksSurviveOverflow) {
  // Pool A restores the pinned blocks; pool B (same namespace, its own strand) overflows the
  // pool while A's restore waits for its wait_event.
  auto a = MakePool(*client_, Options("ev-pin", 2 * kGroupRows, 4));
  auto b = MakePool(*client_, Options("ev-pin", kGroupRows));
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  ASSERT_EQ(a->info.namespace_id, b->info.namespace_id);
  const std::string ns = a->info.namespace_id;
  const uint32_t cap = static_cast<uint32_t>(a->info.capacity_tokens / kEvBt);
  ASSERT_GE(cap, 8u);

  FillSentinel(a->kv);
  const std::vector<uint32_t> src = RowRange(0, 3 * kEvBt);
  FillRows(a->kv, 300, src, kEvBt);
  const std::vector<BlockKey> pinned = Keys(300, 3, kEvBt);
  ASSERT_EQ(client_->Backup(a->handle, pinned, src).held(), 3u);

  const std::vector<uint32_t> dst = RowRange(kGroupRows, 3 * kEvBt);
  RestoreOptions ro;
  ro.wait_event = 0;
  ro.wait_value = 1;
  ro.done_event = 1;
  ro.sync = false;
  RestoreResult r = client_->Restore(a->handle, pinned, dst, ro);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  ASSERT_EQ(r.restored_blocks, 3u);

  FillRows(b->kv, 301, RowRange(0, kGroupRows), kEvBt);
  const std::vector<BlockKey> q = Keys(301, 3 * cap + 1, kEvBt);
  ASSERT_NO_FATAL_FAILURE(BackupAll(*b, std::span(q).first(2 * cap)));
  Snapshot s = Stats(ns);
  EXPECT_EQ(s.ns.blocks, cap);
  EXPECT_EQ(s.ns.evictions, cap + 3);  // 2 cap + 3 stored, cap held
  EXPECT_EQ(s.ns.backups, 2 * cap + 3);
  EXPECT_EQ(s.ns.restores, 3u);
  EXPECT_EQ(Prefix(*a, pinned), 3u) << "a pinned block was evicted";
  EXPECT_EQ(a->events.Read(1), 0u);
  EXPECT_EQ(ChangedOutside(a->kv, src), 0u) << "restore ran before its wait_event";

  // Evicting a pinned block removes it from the index at once; its slot stays until unpinned,
  // so the waiting restore still reads intact data even while the pool keeps overflowing.
  auto ev = client_->Evict(a->handle, std::span(pinned).first(1));
  ASSERT_TRUE(ev.ok());
  EXPECT_EQ(*ev, 1u);
  EXPECT_EQ(Prefix(*a, pinned), 0u);
  ASSERT_NO_FATAL_FAILURE(BackupAll(*b, std::span(q).subspan(2 * cap, cap)));
  EXPECT_EQ(Prefix(*a, {pinned[1], pinned[2]}), 2u);

  a->events.Store(0, 1);
  Status w = a->events.Wait(1, r.ticket, std::chrono::seconds(10));
  ASSERT_TRUE(w.ok()) << w.ToString();
  CheckResult c = CheckRows(a->kv, 300, dst, kEvBt, false);
  EXPECT_TRUE(c.ok()) << c.first;
  std::vector<uint32_t> both = src;
  both.insert(both.end(), dst.begin(), dst.end());
  EXPECT_EQ(ChangedOutside(a->kv, both), 0u);

  // After the unpin the evicted block's slot is free again: one more block fits without
  // evicting anything.
  EXPECT_TRUE(Eventually([&] {
    auto st = client_->GetStats();
    const NamespaceStats* n = st.ok() ? FindNamespace(*st, ns) : nullptr;
    return n != nullptr && n->blocks == cap - 1;
  })) << "the evicted pinned block's slot was not freed after the restore";
  s = Stats(ns);
  EXPECT_EQ(s.ns.evictions, 2 * cap + 4);
  ASSERT_NO_FATAL_FAILURE(BackupAll(*b, std::span(q).subspan(3 * cap, 1)));
  s = Stats(ns);
  EXPECT_EQ(s.ns.blocks, cap);
  EXPECT_EQ(s.ns.evictions, 2 * cap + 4);
  EXPECT_EQ(s.ns.backups, 3 * cap + 4);
  EXPECT_EQ(s.ns.hits, 5u);
  EXPECT_EQ(s.ns.misses, 3u);
  EXPECT_EQ(Prefix(*a, {pinned[1], pinned[2]}), 2u);
}

}  // namespace
}  // namespace hiqcache::it
