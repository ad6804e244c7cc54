// BlockStore: capacity accounting, LRU eviction, pins, namespaces sharing the pool, and the block
// headers it writes into the pool memory (pool_format.h).
#include "pool/block_store.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/namespace_table.h"
#include "pool/pool_format.h"
#include "record_format.h"
#include "server_test_util.h"

namespace hiqcache::server {
namespace {

using testing::AnonBuffer;
using testing::KeyOf;
using Outcome = BlockStore::WriteOutcome;

kernels::BlockLayout Layout(uint32_t layers, uint32_t heads, uint32_t dim, uint32_t block_tokens,
                            kernels::CodecKind codec = kernels::CodecKind::kInt8PerHead) {
  kernels::BlockLayout l;
  l.row.num_heads = heads;
  l.row.head_dim = dim;
  l.row.dtype = kernels::DType::kBF16;
  l.row.codec = codec;
  l.num_layers = layers;
  l.kv_planes = 2;
  l.block_tokens = block_tokens;
  return l;
}

const NamespaceInfo& Intern(NamespaceTable& table, const std::string& model,
                            const kernels::BlockLayout& layout) {
  NamespaceDesc d;
  d.model = model;
  d.layout = layout;
  return table.Intern(d);
}

BlockState HeaderState(const uint8_t* payload) {
  const auto* h = reinterpret_cast<const BlockHeader*>(payload - kBlockHeaderBytes);
  return static_cast<BlockState>(
      std::atomic_ref<const uint32_t>(h->state).load(std::memory_order_acquire));
}
const BlockHeader* HeaderOfPayload(const uint8_t* payload) {
  return reinterpret_cast<const BlockHeader*>(payload - kBlockHeaderBytes);
}

// Reserves and commits one key, with the checksum of whatever its payload holds unless told
// another one; returns its payload pointer (null on failure).
uint8_t* Put(BlockStore& store, uint32_t ns, const BlockKey& key,
             std::optional<uint64_t> checksum = std::nullopt) {
  auto r = store.ReserveWrites(ns, std::span<const BlockKey>(&key, 1));
  if (r.size() != 1 || r[0].outcome != Outcome::kReserved) return nullptr;
  const uint64_t payload_bytes =
      reinterpret_cast<const BlockHeader*>(r[0].payload - kBlockHeaderBytes)->payload_bytes;
  store.CommitWrite(r[0].handle, checksum ? *checksum : XXH3_64bits(r[0].payload, payload_bytes));
  return r[0].payload;
}

uint32_t Has(BlockStore& store, uint32_t ns, const BlockKey& key) {
  return store.LookupPrefix(ns, std::span<const BlockKey>(&key, 1));
}

// A pool whose single extent holds `slots` slots of `slot` bytes, plus half a slot that is too
// small to use. Small pools all have the minimum directory, so the metadata size is fixed.
size_t PoolBytesFor(uint64_t slots, uint64_t slot) {
  return PoolMetaBytes(1 << 20) + kExtentHeaderBytes + slots * slot + slot / 2;
}

// used_bytes is the slot bytes of the live blocks and never exceeds what extents can use.
void ExpectConsistent(const BlockStore& store, uint64_t slot_bytes) {
  StoreStats s = store.Stats();
  EXPECT_EQ(s.used_bytes, s.blocks * slot_bytes);
  EXPECT_LE(s.used_bytes, s.capacity_bytes);
  EXPECT_EQ(s.capacity_bytes, s.pool_bytes - PoolMetaBytes(s.pool_bytes));
}

TEST(BlockLayoutTest, Qwen3_8BBytes) {
  kernels::BlockLayout q = Layout(36, 8, 128, 64);
  EXPECT_EQ(q.row.RowBytes(), 1040u);
  EXPECT_EQ(q.BytesPerToken(), 74880u);
  EXPECT_EQ(q.BlockBytes(), 4792320u);
  EXPECT_EQ(Layout(36, 8, 128, 64, kernels::CodecKind::kRaw).BytesPerToken(), 147456u);
  EXPECT_EQ(SlotBytesFor(4792320), 4792320u + 64u);
  EXPECT_EQ(SlotBytesFor(1), 128u);
}

TEST(BlockStoreTest, PoolHeaderIsFormatted) {
  AnonBuffer pool(1 << 20);
  BlockStore store(pool.data(), pool.size());
  const auto* ph = reinterpret_cast<const PoolHeader*>(pool.data());
  EXPECT_EQ(ph->magic, kPoolMagic);
  EXPECT_EQ(ph->version, kPoolFormatVersion);
  EXPECT_EQ(ph->pool_bytes, pool.size());
  EXPECT_EQ(ph->directory_entries, DirectoryEntriesFor(pool.size()));
  EXPECT_EQ(PoolMetaBytes(pool.size()),
            AlignUp(kPoolHeaderBytes + 4096 * sizeof(ExtentDirEntry), 4096));
  // Big pools get one directory slot per 16 MiB.
  EXPECT_EQ(DirectoryEntriesFor(1ull << 40), (1ull << 40) / (16ull << 20));
}

// Fills exactly CapacityBlocks() blocks: nothing is evicted, >= 98% of the pool holds payload,
// and the next reservation evicts exactly the least recently used block.
void FillToCapacity(const kernels::BlockLayout& layout, size_t pool_bytes) {
  AnonBuffer pool(pool_bytes);
  ASSERT_NE(pool.data(), nullptr);
  BlockStore store(pool.data(), pool.size());
  NamespaceTable table;
  const NamespaceInfo& ns = Intern(table, "m", layout);
  store.AddNamespace(ns.ForStore());
  const uint64_t payload = layout.BlockBytes();
  const uint64_t slot = SlotBytesFor(payload);
  const uint64_t cap = store.CapacityBlocks(payload);
  ASSERT_GT(cap, 2u);
  EXPECT_GE(static_cast<double>(cap * payload) / static_cast<double>(pool_bytes), 0.98)
      << cap << " blocks of " << payload << " B in " << pool_bytes << " B";

  for (uint64_t i = 0; i < cap; ++i) {
    ASSERT_NE(Put(store, ns.id, KeyOf(i)), nullptr) << "block " << i << " of " << cap;
  }
  StoreStats s = store.Stats();
  EXPECT_EQ(s.blocks, cap);
  EXPECT_EQ(s.used_bytes, cap * slot);
  EXPECT_EQ(s.namespaces.at(ns.id).evictions, 0u);
  EXPECT_EQ(s.namespaces.at(ns.id).blocks, cap);
  EXPECT_EQ(s.namespaces.at(ns.id).capacity_blocks, cap);
  ExpectConsistent(store, slot);
  // Every block is still there.
  std::vector<BlockKey> all;
  for (uint64_t i = 0; i < cap; ++i) all.push_back(KeyOf(i));
  EXPECT_EQ(store.LookupPrefix(ns.id, all), cap);

  // The lookup above touched 0..cap-1 in order, so key 0 is still the LRU one.
  ASSERT_NE(Put(store, ns.id, KeyOf(cap)), nullptr);
  s = store.Stats();
  EXPECT_EQ(s.namespaces.at(ns.id).evictions, 1u);
  EXPECT_EQ(s.blocks, cap);
  EXPECT_EQ(Has(store, ns.id, KeyOf(0)), 0u);
  EXPECT_EQ(Has(store, ns.id, KeyOf(1)), 1u);
  EXPECT_EQ(Has(store, ns.id, KeyOf(cap)), 1u);
  ExpectConsistent(store, slot);
}

TEST(BlockStoreTest, CapacitySmallGeometryOneExtent) {
  // 4 layers, 8x128, 16-token blocks: 133,120 B payload; 64 MiB pool.
  FillToCapacity(Layout(4, 8, 128, 16), 64ull << 20);
}

TEST(BlockStoreTest, CapacityQwen3_8BManyExtents) {
  // Qwen3-8B geometry (4,792,320 B blocks) in 1 GiB: 16 full extents plus a truncated tail.
  // Only headers are written, so the anonymous mapping stays mostly untouched.
  FillToCapacity(Layout(36, 8, 128, 64), 1ull << 30);
}

TEST(BlockStoreTest, CapacityBlocksMatchesHandComputation) {
  AnonBuffer pool(64ull << 20);
  BlockStore store(pool.data(), pool.size());
  // One extent (the pool is smaller than the 64 MiB extent target): header + slots.
  const uint64_t payload = Layout(4, 8, 128, 16).BlockBytes();
  EXPECT_EQ(payload, 133120u);
  EXPECT_EQ(
      store.CapacityBlocks(payload),
      ((64ull << 20) - PoolMetaBytes(64ull << 20) - kExtentHeaderBytes) / SlotBytesFor(payload));
  AnonBuffer tiny(PoolMetaBytes(1 << 20));
  BlockStore none(tiny.data(), tiny.size());
  EXPECT_EQ(none.CapacityBlocks(payload), 0u);
}

// A small store that holds exactly kBlocks blocks of a tiny geometry.
class SmallStoreTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kBlocks = 4;
  SmallStoreTest()
      : layout_(Layout(1, 1, 64, 4)),
        slot_(SlotBytesFor(layout_.BlockBytes())),
        pool_(PoolBytesFor(kBlocks, slot_)),
        store_(pool_.data(), pool_.size()) {
    ns_ = Intern(table_, "small", layout_).id;
    store_.AddNamespace(table_.Get(ns_).ForStore());
  }
  void FillAll() {
    ASSERT_EQ(store_.CapacityBlocks(layout_.BlockBytes()), kBlocks);
    for (uint64_t i = 0; i < kBlocks; ++i) ASSERT_NE(Put(store_, ns_, KeyOf(i)), nullptr);
    ASSERT_EQ(store_.Stats().blocks, kBlocks);
  }
  NamespaceCounters Counters() { return store_.Stats().namespaces.at(ns_); }
  uint64_t Meta() const { return PoolMetaBytes(pool_.size()); }

  kernels::BlockLayout layout_;
  uint64_t slot_;
  AnonBuffer pool_;
  BlockStore store_;
  NamespaceTable table_;
  uint32_t ns_ = 0;
};

TEST_F(SmallStoreTest, EvictsLeastRecentlyUsed) {
  FillAll();
  ASSERT_NE(Put(store_, ns_, KeyOf(10)), nullptr);
  EXPECT_EQ(Has(store_, ns_, KeyOf(0)), 0u);  // oldest commit
  for (uint64_t i = 1; i < kBlocks; ++i) EXPECT_EQ(Has(store_, ns_, KeyOf(i)), 1u);
  EXPECT_EQ(Counters().evictions, 1u);
  ExpectConsistent(store_, slot_);
}

TEST_F(SmallStoreTest, LookupRefreshesRecency) {
  FillAll();
  EXPECT_EQ(Has(store_, ns_, KeyOf(0)), 1u);  // 0 becomes the most recent: 1 is now LRU
  ASSERT_NE(Put(store_, ns_, KeyOf(10)), nullptr);
  EXPECT_EQ(Has(store_, ns_, KeyOf(1)), 0u);
  EXPECT_EQ(Has(store_, ns_, KeyOf(0)), 1u);
  EXPECT_EQ(Has(store_, ns_, KeyOf(2)), 1u);
}

TEST_F(SmallStoreTest, ReadPinnedBlocksAreNeverEvicted) {
  FillAll();
  BlockKey k0 = KeyOf(0), k1 = KeyOf(1);
  auto pin0 = store_.PinReads(ns_, std::span<const BlockKey>(&k0, 1));
  auto pin1 = store_.PinReads(ns_, std::span<const BlockKey>(&k1, 1));
  ASSERT_EQ(pin0.size(), 1u);
  ASSERT_EQ(pin1.size(), 1u);
  // 0 and 1 are the two LRU blocks but pinned: 2 and 3 go instead.
  ASSERT_NE(Put(store_, ns_, KeyOf(10)), nullptr);
  ASSERT_NE(Put(store_, ns_, KeyOf(11)), nullptr);
  EXPECT_EQ(Has(store_, ns_, KeyOf(2)), 0u);
  EXPECT_EQ(Has(store_, ns_, KeyOf(3)), 0u);
  EXPECT_EQ(Has(store_, ns_, KeyOf(0)), 1u);
  EXPECT_EQ(Has(store_, ns_, KeyOf(1)), 1u);
  EXPECT_EQ(HeaderState(pin0[0].payload), BlockState::kCommitted);
  store_.Unpin(pin0[0].handle);
  store_.Unpin(pin1[0].handle);
  ExpectConsistent(store_, slot_);
}

TEST_F(SmallStoreTest, UncommittedReservationsAreNeverEvicted) {
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < kBlocks; ++i) keys.push_back(KeyOf(i));
  auto res = store_.ReserveWrites(ns_, keys);
  for (const auto& r : res) ASSERT_EQ(r.outcome, Outcome::kReserved);
  for (const auto& r : res) EXPECT_EQ(HeaderState(r.payload), BlockState::kWriting);
  EXPECT_EQ(store_.LookupPrefix(ns_, keys), 0u);  // invisible until committed
  BlockKey extra = KeyOf(10);
  auto more = store_.ReserveWrites(ns_, std::span<const BlockKey>(&extra, 1));
  ASSERT_EQ(more.size(), 1u);
  EXPECT_EQ(more[0].outcome, Outcome::kNoSpace);
  EXPECT_EQ(more[0].handle, nullptr);
  EXPECT_EQ(Counters().rejected, 1u);
  EXPECT_EQ(Counters().evictions, 0u);
  for (const auto& r : res) store_.CommitWrite(r.handle, 7);
  EXPECT_EQ(store_.LookupPrefix(ns_, keys), kBlocks);
}

TEST_F(SmallStoreTest, AllPinnedMeansNoSpace) {
  FillAll();
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < kBlocks; ++i) keys.push_back(KeyOf(i));
  auto pins = store_.PinReads(ns_, keys);
  ASSERT_EQ(pins.size(), kBlocks);
  std::vector<BlockKey> fresh = {KeyOf(10), KeyOf(11)};
  auto res = store_.ReserveWrites(ns_, fresh);
  ASSERT_EQ(res.size(), 2u);
  EXPECT_EQ(res[0].outcome, Outcome::kNoSpace);
  EXPECT_EQ(res[1].outcome, Outcome::kNoSpace);
  EXPECT_EQ(Counters().rejected, 2u);
  EXPECT_EQ(Counters().evictions, 0u);
  EXPECT_EQ(store_.LookupPrefix(ns_, keys), kBlocks);
  for (const auto& p : pins) store_.Unpin(p.handle);
  // Unpinned, the same request succeeds by evicting.
  res = store_.ReserveWrites(ns_, fresh);
  EXPECT_EQ(res[0].outcome, Outcome::kReserved);
  EXPECT_EQ(res[1].outcome, Outcome::kReserved);
  for (const auto& r : res) store_.AbortWrite(r.handle, false);
}

TEST_F(SmallStoreTest, EvictPinnedBlockFreesSlotOnUnpin) {
  FillAll();
  BlockKey k = KeyOf(2);
  auto pin = store_.PinReads(ns_, std::span<const BlockKey>(&k, 1));
  ASSERT_EQ(pin.size(), 1u);
  const StoreStats before = store_.Stats();
  EXPECT_EQ(store_.Evict(ns_, std::span<const BlockKey>(&k, 1)), 1u);
  EXPECT_EQ(Has(store_, ns_, k), 0u);  // gone from lookups at once
  EXPECT_TRUE(store_.PinReads(ns_, std::span<const BlockKey>(&k, 1)).empty());
  StoreStats mid = store_.Stats();
  EXPECT_EQ(mid.blocks, before.blocks);  // slot still held by the reader
  EXPECT_EQ(mid.used_bytes, before.used_bytes);
  EXPECT_EQ(mid.namespaces.at(ns_).evictions, 1u);
  // The reader's payload is not reused while pinned: the header still says committed.
  EXPECT_EQ(HeaderState(pin[0].payload), BlockState::kCommitted);
  store_.Unpin(pin[0].handle);
  StoreStats after = store_.Stats();
  EXPECT_EQ(after.blocks, before.blocks - 1);
  EXPECT_EQ(after.used_bytes, before.used_bytes - slot_);
  EXPECT_EQ(HeaderState(pin[0].payload), BlockState::kFree);
  // The freed slot is reused without evicting anyone.
  ASSERT_NE(Put(store_, ns_, KeyOf(10)), nullptr);
  EXPECT_EQ(store_.Stats().namespaces.at(ns_).evictions, 1u);
  ExpectConsistent(store_, slot_);
}

TEST_F(SmallStoreTest, EvictedPinnedSlotIsNotHandedOutBeforeUnpin) {
  FillAll();
  BlockKey k = KeyOf(0);
  auto pin = store_.PinReads(ns_, std::span<const BlockKey>(&k, 1));
  ASSERT_EQ(pin.size(), 1u);
  std::vector<uint8_t> snapshot(pin[0].payload, pin[0].payload + 16);
  EXPECT_EQ(store_.Evict(ns_, std::span<const BlockKey>(&k, 1)), 1u);
  // Pool full: a new block must evict an unpinned one, not take the evicted-but-pinned slot.
  BlockKey fresh = KeyOf(10);
  auto res = store_.ReserveWrites(ns_, std::span<const BlockKey>(&fresh, 1));
  ASSERT_EQ(res[0].outcome, Outcome::kReserved);
  EXPECT_NE(res[0].payload, pin[0].payload);
  store_.CommitWrite(res[0].handle, 0);
  EXPECT_EQ(Has(store_, ns_, KeyOf(1)), 0u);  // the LRU unpinned block made room
  store_.Unpin(pin[0].handle);
  ExpectConsistent(store_, slot_);
}

TEST_F(SmallStoreTest, AbortWriteLeavesNothingVisible) {
  BlockKey k = KeyOf(5);
  auto res = store_.ReserveWrites(ns_, std::span<const BlockKey>(&k, 1));
  ASSERT_EQ(res[0].outcome, Outcome::kReserved);
  EXPECT_EQ(store_.Stats().blocks, 1u);
  store_.AbortWrite(res[0].handle, /*rejected=*/true);
  EXPECT_EQ(Has(store_, ns_, k), 0u);
  EXPECT_TRUE(store_.PinReads(ns_, std::span<const BlockKey>(&k, 1)).empty());
  EXPECT_EQ(store_.Evict(ns_, std::span<const BlockKey>(&k, 1)), 0u);
  StoreStats s = store_.Stats();
  EXPECT_EQ(s.blocks, 0u);
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_EQ(s.namespaces.at(ns_).rejected, 1u);
  EXPECT_EQ(s.namespaces.at(ns_).backups, 0u);
  EXPECT_EQ(HeaderState(res[0].payload), BlockState::kFree);
  // The key can be written again (it is not "present").
  res = store_.ReserveWrites(ns_, std::span<const BlockKey>(&k, 1));
  EXPECT_EQ(res[0].outcome, Outcome::kReserved);
  store_.AbortWrite(res[0].handle, /*rejected=*/false);
  EXPECT_EQ(store_.Stats().namespaces.at(ns_).rejected, 1u);
}

TEST_F(SmallStoreTest, DuplicateKeyInOneRequestIsPresentTheSecondTime) {
  std::vector<BlockKey> keys = {KeyOf(1), KeyOf(2), KeyOf(1)};
  auto res = store_.ReserveWrites(ns_, keys);
  ASSERT_EQ(res.size(), 3u);
  EXPECT_EQ(res[0].outcome, Outcome::kReserved);
  EXPECT_EQ(res[1].outcome, Outcome::kReserved);
  EXPECT_EQ(res[2].outcome, Outcome::kPresent);
  EXPECT_EQ(res[2].handle, nullptr);
  EXPECT_EQ(store_.Stats().blocks, 2u);
  store_.CommitWrite(res[0].handle, 1);
  store_.CommitWrite(res[1].handle, 2);
  // Committed keys are present too.
  res = store_.ReserveWrites(ns_, keys);
  for (const auto& r : res) EXPECT_EQ(r.outcome, Outcome::kPresent);
  EXPECT_EQ(store_.Stats().blocks, 2u);
  ExpectConsistent(store_, slot_);
}

TEST_F(SmallStoreTest, LookupPrefixStopsAtFirstMissingKey) {
  ASSERT_NE(Put(store_, ns_, KeyOf(0)), nullptr);
  ASSERT_NE(Put(store_, ns_, KeyOf(2)), nullptr);
  std::vector<BlockKey> keys = {KeyOf(0), KeyOf(1), KeyOf(2)};
  EXPECT_EQ(store_.LookupPrefix(ns_, keys), 1u);
  NamespaceCounters c = Counters();
  EXPECT_EQ(c.hits, 1u);
  EXPECT_EQ(c.misses, 2u);
  std::vector<BlockKey> two = {KeyOf(0), KeyOf(2)};
  EXPECT_EQ(store_.LookupPrefix(ns_, two), 2u);
  c = Counters();
  EXPECT_EQ(c.hits, 3u);
  EXPECT_EQ(c.misses, 2u);
  // PinReads follows the same rule.
  auto pins = store_.PinReads(ns_, keys);
  ASSERT_EQ(pins.size(), 1u);
  store_.Unpin(pins[0].handle);
  EXPECT_EQ(store_.LookupPrefix(ns_, {}), 0u);
  // An unknown namespace has nothing.
  EXPECT_EQ(store_.LookupPrefix(ns_ + 100, keys), 0u);
}

TEST_F(SmallStoreTest, KeysAreScopedByNamespace) {
  const NamespaceInfo& other = Intern(table_, "other-model", layout_);
  ASSERT_NE(other.id, ns_);
  store_.AddNamespace(other.ForStore());
  ASSERT_NE(Put(store_, ns_, KeyOf(0)), nullptr);
  EXPECT_EQ(Has(store_, other.id, KeyOf(0)), 0u);
  EXPECT_EQ(store_.Evict(other.id, std::vector<BlockKey>{KeyOf(0)}), 0u);
  EXPECT_EQ(Has(store_, ns_, KeyOf(0)), 1u);
}

TEST_F(SmallStoreTest, HeadersRecordCommitAndEviction) {
  BlockKey k = KeyOf(3);
  auto res = store_.ReserveWrites(ns_, std::span<const BlockKey>(&k, 1));
  ASSERT_EQ(res[0].outcome, Outcome::kReserved);
  const BlockHeader* h = HeaderOfPayload(res[0].payload);
  EXPECT_EQ(h->magic, kBlockMagic);
  EXPECT_EQ(HeaderState(res[0].payload), BlockState::kWriting);
  EXPECT_EQ(std::memcmp(h->key, k.data(), 16), 0);
  store_.CommitWrite(res[0].handle, 0x1234567890ABCDEFull);
  EXPECT_EQ(HeaderState(res[0].payload), BlockState::kCommitted);
  EXPECT_EQ(std::memcmp(h->key, k.data(), 16), 0);
  EXPECT_EQ(h->checksum, 0x1234567890ABCDEFull);
  EXPECT_EQ(h->payload_bytes, layout_.BlockBytes());
  uint64_t tag;
  std::memcpy(&tag, table_.Get(ns_).hash.data(), 8);
  EXPECT_EQ(h->namespace_tag, tag);
  EXPECT_GT(h->commit_seq, 0u);
  // The header sits inside the pool, after the pool header and an extent header.
  const uint8_t* hb = reinterpret_cast<const uint8_t*>(h);
  EXPECT_GE(hb, pool_.data() + Meta() + kExtentHeaderBytes);
  EXPECT_LE(res[0].payload + layout_.BlockBytes(), pool_.data() + pool_.size());
  EXPECT_EQ(static_cast<uint64_t>(hb - pool_.data() - Meta() - kExtentHeaderBytes) % slot_, 0u);
  const auto* eh = reinterpret_cast<const ExtentHeader*>(pool_.data() + Meta());
  EXPECT_EQ(eh->magic, kExtentMagic);
  EXPECT_EQ(eh->slot_bytes, slot_);
  EXPECT_EQ(eh->payload_bytes, layout_.BlockBytes());
  EXPECT_EQ(eh->num_slots, kBlocks);
  // The extent directory after the pool header names the extent.
  const auto* dir = reinterpret_cast<const ExtentDirEntry*>(pool_.data() + kPoolHeaderBytes);
  EXPECT_EQ(dir[0].offset, Meta());
  EXPECT_EQ(dir[0].bytes, kExtentHeaderBytes + kBlocks * slot_);
  EXPECT_EQ(dir[1].bytes, 0u);

  // A later commit has a larger sequence number.
  uint8_t* p2 = Put(store_, ns_, KeyOf(4));
  ASSERT_NE(p2, nullptr);
  EXPECT_GT(HeaderOfPayload(p2)->commit_seq, h->commit_seq);

  EXPECT_EQ(store_.Evict(ns_, std::span<const BlockKey>(&k, 1)), 1u);
  EXPECT_EQ(HeaderState(res[0].payload), BlockState::kFree);
  EXPECT_EQ(HeaderState(p2), BlockState::kCommitted);
}

TEST_F(SmallStoreTest, LruEvictionMarksHeaderFree) {
  FillAll();
  BlockKey k0 = KeyOf(0);
  auto pin = store_.PinReads(ns_, std::span<const BlockKey>(&k0, 1));
  ASSERT_EQ(pin.size(), 1u);
  const uint8_t* p0 = pin[0].payload;
  store_.Unpin(pin[0].handle);
  // PinReads touched 0, then 1: order (LRU first) is 2, 3, 0, 1.
  BlockKey k1 = KeyOf(1);
  auto pin1 = store_.PinReads(ns_, std::span<const BlockKey>(&k1, 1));
  const uint8_t* p1 = pin1[0].payload;
  store_.Unpin(pin1[0].handle);
  // Touch 0 again: still 2 is the LRU one.
  EXPECT_EQ(Has(store_, ns_, k0), 1u);
  uint8_t* p10 = Put(store_, ns_, KeyOf(10));
  ASSERT_NE(p10, nullptr);
  EXPECT_EQ(Has(store_, ns_, KeyOf(2)), 0u);
  EXPECT_EQ(HeaderState(p0), BlockState::kCommitted);
  EXPECT_EQ(HeaderState(p1), BlockState::kCommitted);
  EXPECT_EQ(HeaderState(p10), BlockState::kCommitted);
  // Exactly one committed header per live block.
  int committed = 0;
  for (uint64_t i = 0; i < kBlocks; ++i) {
    const uint8_t* slot = pool_.data() + Meta() + kExtentHeaderBytes + i * slot_;
    if (HeaderState(slot + kBlockHeaderBytes) == BlockState::kCommitted) ++committed;
  }
  EXPECT_EQ(committed, static_cast<int>(kBlocks));
}

TEST_F(SmallStoreTest, EvictCountsOnlyCommittedKeys) {
  FillAll();
  BlockKey w = KeyOf(20);
  std::vector<BlockKey> keys = {KeyOf(0), KeyOf(1), KeyOf(99), KeyOf(0)};
  EXPECT_EQ(store_.Evict(ns_, keys), 2u);
  EXPECT_EQ(Counters().evictions, 2u);
  auto res = store_.ReserveWrites(ns_, std::span<const BlockKey>(&w, 1));
  ASSERT_EQ(res[0].outcome, Outcome::kReserved);
  EXPECT_EQ(store_.Evict(ns_, std::span<const BlockKey>(&w, 1)), 0u);  // being written
  store_.CommitWrite(res[0].handle, 0);
  EXPECT_EQ(Has(store_, ns_, w), 1u);
  ExpectConsistent(store_, slot_);
}

// The eviction sink (L3's on_evict) sees every block evicted for room, with its payload and
// checksum, before the slot is reused; not the blocks Evict removes, nor blocks promoted from L3.
TEST_F(SmallStoreTest, EvictionSinkSeesBlocksEvictedForRoomOnly) {
  struct Seen {
    BlockKey key;
    std::vector<uint8_t> payload;
    uint64_t checksum;
  };
  std::vector<Seen> seen;
  store_.SetEvictionSink([&](const BlockStore::EvictedBlock& b) {
    EXPECT_EQ(b.ns_hash, table_.Get(ns_).hash);
    seen.push_back({b.key, std::vector<uint8_t>(b.payload.begin(), b.payload.end()), b.checksum});
  });
  const uint64_t payload_bytes = layout_.BlockBytes();
  std::vector<std::vector<uint8_t>> written;
  for (uint64_t i = 0; i < kBlocks; ++i) {
    const BlockKey k = KeyOf(i);
    auto r = store_.ReserveWrites(ns_, std::span<const BlockKey>(&k, 1));
    ASSERT_EQ(r[0].outcome, Outcome::kReserved);
    for (uint64_t b = 0; b < payload_bytes; ++b) r[0].payload[b] = static_cast<uint8_t>(i * 31 + b);
    written.emplace_back(r[0].payload, r[0].payload + payload_bytes);
    // Block 1 came from L3: it is not offered back, and not counted as a backup.
    store_.CommitWrite(r[0].handle, XXH3_64bits(r[0].payload, payload_bytes), /*from_l3=*/i == 1);
  }
  EXPECT_EQ(Counters().backups, kBlocks - 1);
  const BlockKey gone = KeyOf(2);
  ASSERT_EQ(store_.Evict(ns_, std::span<const BlockKey>(&gone, 1)), 1u);  // asked: not offered
  EXPECT_TRUE(seen.empty());
  // Three more blocks: the free slot, then the LRU blocks 0 and 1 (1 from L3: not offered) go.
  for (uint64_t i = 10; i < 13; ++i) ASSERT_NE(Put(store_, ns_, KeyOf(i)), nullptr);
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].key, KeyOf(0));
  EXPECT_EQ(seen[0].payload, written[0]);
  EXPECT_EQ(seen[0].checksum, XXH3_64bits(written[0].data(), payload_bytes));
  EXPECT_EQ(Counters().evictions, 3u);
  // Cleared: evictions go on, unseen.
  store_.SetEvictionSink({});
  ASSERT_NE(Put(store_, ns_, KeyOf(13)), nullptr);
  EXPECT_EQ(seen.size(), 1u);
  EXPECT_EQ(Counters().evictions, 4u);
  ExpectConsistent(store_, slot_);
}

TEST(BlockStoreNamespacesTest, DifferentSlotSizesShareThePool) {
  // Pool for ~6 slots of A; B's slots are about twice as large.
  const kernels::BlockLayout la = Layout(1, 1, 64, 4);  // 528 B payload
  const kernels::BlockLayout lb = Layout(2, 1, 64, 4);  // 1,056 B payload
  const uint64_t sa = SlotBytesFor(la.BlockBytes());
  const uint64_t sb = SlotBytesFor(lb.BlockBytes());
  ASSERT_NE(sa, sb);
  AnonBuffer pool(PoolBytesFor(6, sa));
  BlockStore store(pool.data(), pool.size());
  NamespaceTable table;
  const uint32_t a = Intern(table, "a", la).id;
  const uint32_t b = Intern(table, "b", lb).id;
  store.AddNamespace(table.Get(a).ForStore());
  store.AddNamespace(table.Get(b).ForStore());
  store.AddNamespace(table.Get(a).ForStore());  // idempotent
  const uint64_t cap_a = store.CapacityBlocks(la.BlockBytes());
  ASSERT_EQ(cap_a, 6u);

  // The pool full of A's idle blocks.
  for (uint64_t i = 0; i < cap_a; ++i) ASSERT_NE(Put(store, a, KeyOf(i)), nullptr);
  StoreStats s = store.Stats();
  EXPECT_EQ(s.used_bytes, cap_a * sa);
  EXPECT_EQ(s.namespaces.at(a).evictions, 0u);

  // B can still store: A's extent is reclaimed.
  uint8_t* pb = Put(store, b, KeyOf(100));
  ASSERT_NE(pb, nullptr);
  EXPECT_EQ(HeaderState(pb), BlockState::kCommitted);
  s = store.Stats();
  EXPECT_EQ(s.namespaces.at(b).blocks, 1u);
  EXPECT_EQ(s.namespaces.at(a).blocks, 0u);
  EXPECT_EQ(s.namespaces.at(a).evictions, cap_a);
  EXPECT_EQ(s.used_bytes, s.namespaces.at(a).bytes + s.namespaces.at(b).bytes);
  EXPECT_EQ(s.used_bytes, sb);
  EXPECT_LE(s.used_bytes, s.capacity_bytes);
  for (uint64_t i = 0; i < cap_a; ++i) EXPECT_EQ(Has(store, a, KeyOf(i)), 0u);
  EXPECT_EQ(Has(store, b, KeyOf(100)), 1u);

  // B's extent takes what the pool has: fill it, then A reclaims the space back the same way.
  uint64_t nb = 1;
  while (nb < 100) {
    StoreStats before = store.Stats();
    ASSERT_NE(Put(store, b, KeyOf(100 + nb)), nullptr);
    if (store.Stats().namespaces.at(b).evictions > before.namespaces.at(b).evictions) break;
    ++nb;
  }
  EXPECT_EQ(nb, (pool.size() - PoolMetaBytes(pool.size()) - kExtentHeaderBytes) / sb);
  ASSERT_NE(Put(store, a, KeyOf(0)), nullptr);
  s = store.Stats();
  EXPECT_EQ(s.namespaces.at(a).blocks, 1u);
  EXPECT_EQ(s.namespaces.at(b).blocks, 0u);
  EXPECT_EQ(s.used_bytes, sa);
}

TEST(BlockStoreNamespacesTest, TwoNamespacesCoexistInALargePool) {
  // Larger than two 64 MiB extents: each namespace gets its own extent, nobody is evicted.
  const kernels::BlockLayout la = Layout(4, 8, 128, 16);  // 133,120 B
  const kernels::BlockLayout lb = Layout(2, 8, 128, 16);  // 66,560 B
  const uint64_t sa = SlotBytesFor(la.BlockBytes());
  const uint64_t sb = SlotBytesFor(lb.BlockBytes());
  AnonBuffer pool(256ull << 20);
  ASSERT_NE(pool.data(), nullptr);
  BlockStore store(pool.data(), pool.size());
  NamespaceTable table;
  const uint32_t a = Intern(table, "a", la).id;
  const uint32_t b = Intern(table, "b", lb).id;
  store.AddNamespace(table.Get(a).ForStore());
  store.AddNamespace(table.Get(b).ForStore());
  for (uint64_t i = 0; i < 10; ++i) {
    ASSERT_NE(Put(store, a, KeyOf(i)), nullptr);
    ASSERT_NE(Put(store, b, KeyOf(i)), nullptr);  // same key, other namespace
  }
  StoreStats s = store.Stats();
  EXPECT_EQ(s.namespaces.at(a).blocks, 10u);
  EXPECT_EQ(s.namespaces.at(b).blocks, 10u);
  EXPECT_EQ(s.namespaces.at(a).evictions + s.namespaces.at(b).evictions, 0u);
  EXPECT_EQ(s.used_bytes, 10 * sa + 10 * sb);
  EXPECT_EQ(s.namespaces.at(a).bytes, 10 * sa);
  EXPECT_EQ(s.blocks, 20u);
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < 10; ++i) keys.push_back(KeyOf(i));
  EXPECT_EQ(store.LookupPrefix(a, keys), 10u);
  EXPECT_EQ(store.LookupPrefix(b, keys), 10u);
  // Evicting from one namespace leaves the other alone.
  EXPECT_EQ(store.Evict(a, keys), 10u);
  EXPECT_EQ(store.LookupPrefix(b, keys), 10u);
  EXPECT_EQ(store.Stats().used_bytes, 10 * sb);
}

// One tiny block in each of 20 namespaces claims about 1 MiB each (a first extent sized to
// demand), not a 64 MiB extent each: the pool's other user, which holds most of it, loses
// nothing, and claimed_bytes says what the namespaces hold. (With 64 MiB first extents the 20
// blocks took 1.25 GiB of this 1 GiB pool and evicted every block of the other user.)
TEST(BlockStoreNamespacesTest, TinyNamespacesClaimWhatTheyUse) {
  const kernels::BlockLayout big = Layout(4, 8, 128, 16);  // 133,120 B
  const kernels::BlockLayout tiny = Layout(1, 1, 1, 1);
  AnonBuffer pool(1ull << 30);
  ASSERT_NE(pool.data(), nullptr);
  BlockStore store(pool.data(), pool.size());
  NamespaceTable table;
  const uint32_t victim = Intern(table, "victim", big).id;
  store.AddNamespace(table.Get(victim).ForStore());
  constexpr uint64_t kVictimBlocks = 5000;  // ~650 MiB of the pool
  for (uint64_t i = 0; i < kVictimBlocks; ++i) ASSERT_NE(Put(store, victim, KeyOf(i)), nullptr);
  const uint64_t claimed_before = store.Stats().claimed_bytes;
  EXPECT_GE(claimed_before, store.Stats().used_bytes);
  for (int n = 0; n < 20; ++n) {
    const uint32_t id = Intern(table, "tiny-" + std::to_string(n), tiny).id;
    store.AddNamespace(table.Get(id).ForStore());
    ASSERT_NE(Put(store, id, KeyOf(1)), nullptr) << n;
  }
  const StoreStats s = store.Stats();
  EXPECT_EQ(s.namespaces.at(victim).blocks, kVictimBlocks);
  EXPECT_EQ(s.namespaces.at(victim).evictions, 0u);
  EXPECT_LE(s.claimed_bytes - claimed_before, 20 * ((1ull << 20) + kExtentHeaderBytes));
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < kVictimBlocks; ++i) keys.push_back(KeyOf(i));
  EXPECT_EQ(store.LookupPrefix(victim, keys), kVictimBlocks);
}

// A group lookup longer than one hold of the lock (4,096 index probes) answers the same run as
// one that fits: across the holds, up to the first key some namespace lacks.
TEST(BlockStoreNamespacesTest, LongGroupLookupsAcrossLockHolds) {
  const kernels::BlockLayout tiny = Layout(1, 1, 1, 1);
  AnonBuffer pool(64ull << 20);
  ASSERT_NE(pool.data(), nullptr);
  BlockStore store(pool.data(), pool.size());
  NamespaceTable table;
  std::vector<uint32_t> ids;
  for (int r = 0; r < 3; ++r) {
    ids.push_back(Intern(table, "rank-" + std::to_string(r), tiny).id);
    store.AddNamespace(table.Get(ids.back()).ForStore());
  }
  constexpr uint64_t kKeys = 10000;  // 3 x 10,000 probes: 8 holds
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < kKeys; ++i) {
    keys.push_back(KeyOf(i));
    for (uint32_t id : ids) {
      if (id == ids[2] && i == 7000) continue;  // rank 2 lacks key 7000
      ASSERT_NE(Put(store, id, KeyOf(i)), nullptr);
    }
  }
  EXPECT_EQ(store.LookupPrefix(ids, keys), 7000u);
  EXPECT_EQ(store.LookupPrefix(std::span<const uint32_t>(ids).first(2), keys), kKeys);
  const StoreStats s = store.Stats();
  EXPECT_EQ(s.namespaces.at(ids[2]).hits, 7000u);
  EXPECT_EQ(s.namespaces.at(ids[2]).misses, kKeys - 7000);
  EXPECT_EQ(s.namespaces.at(ids[0]).hits, 7000u + kKeys);
}

// Each owner keeps its fair share: uid 1 fills the pool, then uid 2 writes twice the pool's
// worth. uid 2 takes uid 1's extents only while uid 1 claims more than half the pool, then
// evicts its own blocks; a third namespace of uid 2 takes from uid 2 alone. (Before shares,
// uid 2 evicted every block of uid 1's: they were all older.)
TEST(BlockStoreNamespacesTest, EachOwnerKeepsItsFairShare) {
  const kernels::BlockLayout la = Layout(4, 8, 128, 16);  // 133,120 B
  AnonBuffer pool(256ull << 20);
  ASSERT_NE(pool.data(), nullptr);
  BlockStore store(pool.data(), pool.size());
  NamespaceTable table;
  auto scoped = [&](const std::string& model, const std::string& scope) -> const NamespaceInfo& {
    NamespaceDesc d;
    d.model = model;
    d.layout = la;
    d.scope = scope;
    return table.Intern(d);
  };
  const uint32_t a = scoped("m", "uid:1").id;
  const uint32_t b = scoped("m", "uid:2").id;
  const uint32_t b2 = scoped("m2", "uid:2").id;
  for (uint32_t id : {a, b, b2}) store.AddNamespace(table.Get(id).ForStore());
  const uint64_t fits = store.CapacityBlocks(la.BlockBytes());
  for (uint64_t i = 0; i < fits; ++i) ASSERT_NE(Put(store, a, KeyOf(i)), nullptr);
  EXPECT_EQ(store.Stats().namespaces.at(a).blocks, fits);
  for (uint64_t i = 0; i < 2 * fits; ++i) ASSERT_NE(Put(store, b, KeyOf(i)), nullptr) << i;
  const uint64_t slot = SlotBytesFor(la.BlockBytes());
  StoreStats s = store.Stats();
  const uint64_t half = store.CapacityBytes() / 2;
  // uid 1 keeps at least half the pool less one extent (extents go whole).
  EXPECT_GE(s.namespaces.at(a).blocks * slot + (64ull << 20), half) << s.namespaces.at(a).blocks;
  EXPECT_GT(s.namespaces.at(b).evictions, 0u);  // uid 2 made room from its own blocks
  const uint64_t a_blocks = s.namespaces.at(a).blocks;
  for (uint64_t i = 0; i < fits / 4; ++i) ASSERT_NE(Put(store, b2, KeyOf(i)), nullptr);
  s = store.Stats();
  EXPECT_EQ(s.namespaces.at(a).blocks, a_blocks) << "uid 2's second model took uid 1's share";
  EXPECT_GT(s.namespaces.at(b2).blocks, 0u);
}

TEST(BlockStoreNamespacesTest, PinnedExtentIsNotReclaimed) {
  const kernels::BlockLayout la = Layout(1, 1, 64, 4);
  const kernels::BlockLayout lb = Layout(2, 1, 64, 4);
  const uint64_t sa = SlotBytesFor(la.BlockBytes());
  AnonBuffer pool(PoolBytesFor(6, sa));
  BlockStore store(pool.data(), pool.size());
  NamespaceTable table;
  const uint32_t a = Intern(table, "a", la).id;
  const uint32_t b = Intern(table, "b", lb).id;
  store.AddNamespace(table.Get(a).ForStore());
  store.AddNamespace(table.Get(b).ForStore());
  for (uint64_t i = 0; i < 6; ++i) ASSERT_NE(Put(store, a, KeyOf(i)), nullptr);
  BlockKey k3 = KeyOf(3);
  auto pin = store.PinReads(a, std::span<const BlockKey>(&k3, 1));
  ASSERT_EQ(pin.size(), 1u);
  BlockKey kb = KeyOf(100);
  auto res = store.ReserveWrites(b, std::span<const BlockKey>(&kb, 1));
  EXPECT_EQ(res[0].outcome, Outcome::kNoSpace);
  EXPECT_EQ(store.Stats().namespaces.at(b).rejected, 1u);
  EXPECT_EQ(store.Stats().namespaces.at(a).blocks, 6u);
  store.Unpin(pin[0].handle);
  res = store.ReserveWrites(b, std::span<const BlockKey>(&kb, 1));
  EXPECT_EQ(res[0].outcome, Outcome::kReserved);
  store.CommitWrite(res[0].handle, 0);
}

// ---------------------------------------------------------------------------------------------
// Reattach: a restarted daemon rebuilds the index from the headers in the pool.

// Fills the payload of block `i` with a pattern and commits it with its real checksum.
void PutWithData(BlockStore& store, uint32_t ns, uint64_t i, size_t payload_bytes) {
  BlockKey k = KeyOf(i);
  auto r = store.ReserveWrites(ns, std::span<const BlockKey>(&k, 1));
  ASSERT_EQ(r[0].outcome, Outcome::kReserved);
  for (size_t b = 0; b < payload_bytes; ++b) r[0].payload[b] = static_cast<uint8_t>(i * 31 + b);
  store.CommitWrite(r[0].handle, XXH3_64bits(r[0].payload, payload_bytes));
}

bool PayloadIntact(const uint8_t* p, uint64_t i, size_t payload_bytes) {
  for (size_t b = 0; b < payload_bytes; ++b) {
    if (p[b] != static_cast<uint8_t>(i * 31 + b)) return false;
  }
  return true;
}

class ReattachTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kBlocks = 8;
  ReattachTest()
      : layout_(Layout(1, 1, 64, 4)),
        payload_(layout_.BlockBytes()),
        slot_(SlotBytesFor(payload_)),
        pool_(PoolBytesFor(kBlocks, slot_)) {}

  // The first daemon: blocks 0..4 committed with data, 5 left being written, 6 committed with a
  // wrong checksum (torn payload).
  void FirstLife() {
    BlockStore store(pool_.data(), pool_.size());
    NamespaceTable table;
    const NamespaceInfo& ns = Intern(table, "m", layout_);
    store.AddNamespace(ns.ForStore());
    for (uint64_t i = 0; i < 5; ++i) PutWithData(store, ns.id, i, payload_);
    BlockKey writing = KeyOf(5);
    auto r = store.ReserveWrites(ns.id, std::span<const BlockKey>(&writing, 1));
    ASSERT_EQ(r[0].outcome, Outcome::kReserved);
    writing_payload_ = r[0].payload;
    ASSERT_NE(Put(store, ns.id, KeyOf(6), /*checksum=*/12345), nullptr);
    // The store goes away without cleanup, as with kill -9.
  }

  kernels::BlockLayout layout_;
  size_t payload_;
  uint64_t slot_;
  AnonBuffer pool_;
  uint8_t* writing_payload_ = nullptr;
};

TEST_F(ReattachTest, KeepsVerifiedBlocksAndDropsTheRest) {
  FirstLife();
  RebuildReport report;
  BlockStore store(pool_.data(), pool_.size(), /*reattach=*/true, 2, &report);
  EXPECT_TRUE(report.reattached) << report.reason;
  EXPECT_EQ(report.extents, 1u);
  EXPECT_EQ(report.blocks_kept, 5u);
  EXPECT_EQ(report.blocks_incomplete, 1u);
  EXPECT_EQ(report.blocks_corrupt, 1u);
  EXPECT_EQ(report.namespaces, 1u);
  EXPECT_EQ(store.Stats().blocks, 5u);
  EXPECT_EQ(store.Stats().used_bytes, 5 * slot_);
  EXPECT_EQ(HeaderState(writing_payload_), BlockState::kFree);

  // A registration of the same namespace (same hash) adopts the blocks, whatever its id.
  NamespaceTable table;
  Intern(table, "unrelated", layout_);  // shifts ids: the adopted namespace gets id 1
  const NamespaceInfo& ns = Intern(table, "m", layout_);
  ASSERT_EQ(ns.id, 1u);
  store.AddNamespace(ns.ForStore());
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < 5; ++i) keys.push_back(KeyOf(i));
  EXPECT_EQ(store.LookupPrefix(ns.id, keys), 5u);
  EXPECT_EQ(Has(store, ns.id, KeyOf(5)), 0u);
  EXPECT_EQ(Has(store, ns.id, KeyOf(6)), 0u);
  auto pins = store.PinReads(ns.id, keys);
  ASSERT_EQ(pins.size(), 5u);
  for (uint64_t i = 0; i < 5; ++i) {
    EXPECT_TRUE(PayloadIntact(pins[i].payload, i, payload_)) << i;
    store.Unpin(pins[i].handle);
  }
  StoreStats s = store.Stats();
  EXPECT_EQ(s.namespaces.at(ns.id).blocks, 5u);
  EXPECT_EQ(s.namespaces.size(), 1u);  // the orphan became ns
  ExpectConsistent(store, slot_);

  // The dropped blocks' slots are free again: 3 more blocks fit without evicting. Then the
  // least recent block (0: the lookups above touched 0..4 in order) makes room.
  for (uint64_t i = 10; i < 13; ++i) ASSERT_NE(Put(store, ns.id, KeyOf(i)), nullptr);
  EXPECT_EQ(store.Stats().namespaces.at(ns.id).evictions, 0u);
  ASSERT_NE(Put(store, ns.id, KeyOf(13)), nullptr);
  EXPECT_EQ(Has(store, ns.id, KeyOf(0)), 0u);
  EXPECT_EQ(Has(store, ns.id, KeyOf(1)), 1u);
  EXPECT_EQ(store.Stats().namespaces.at(ns.id).evictions, 1u);
}

TEST_F(ReattachTest, CommitOrderIsTheLruOrder) {
  FirstLife();
  BlockStore store(pool_.data(), pool_.size(), /*reattach=*/true, 1, nullptr);
  NamespaceTable table;
  const NamespaceInfo& ns = Intern(table, "m", layout_);
  store.AddNamespace(ns.ForStore());
  // 5 blocks kept, 3 slots free: the 4th new block evicts the oldest commit (0), then 1.
  for (uint64_t i = 10; i < 14; ++i) ASSERT_NE(Put(store, ns.id, KeyOf(i)), nullptr);
  EXPECT_EQ(Has(store, ns.id, KeyOf(0)), 0u);
  for (uint64_t i = 1; i < 5; ++i) EXPECT_EQ(Has(store, ns.id, KeyOf(i)), 1u) << i;
  ASSERT_NE(Put(store, ns.id, KeyOf(14)), nullptr);
  EXPECT_EQ(Has(store, ns.id, KeyOf(10)), 0u);  // 1..4 were just touched; 10 is now oldest
}

TEST_F(ReattachTest, OrphanExtentsCanBeReclaimed) {
  FirstLife();
  BlockStore store(pool_.data(), pool_.size(), /*reattach=*/true, 1, nullptr);
  // Another namespace needs the whole pool; the orphaned extent (never re-registered) yields.
  NamespaceTable table;
  const NamespaceInfo& other = Intern(table, "other", layout_);
  store.AddNamespace(other.ForStore());
  for (uint64_t i = 0; i < kBlocks; ++i) {
    ASSERT_NE(Put(store, other.id, KeyOf(i, 7)), nullptr) << i;
  }
  StoreStats s = store.Stats();
  EXPECT_EQ(s.namespaces.at(other.id).blocks, kBlocks);
  EXPECT_EQ(s.blocks, kBlocks);
  ExpectConsistent(store, slot_);
}

TEST_F(ReattachTest, FormatsWhenThePoolDoesNotMatch) {
  FirstLife();
  {
    // Same memory, announced with another size: the header does not match.
    RebuildReport report;
    BlockStore store(pool_.data(), pool_.size() - 4096, /*reattach=*/true, 1, &report);
    EXPECT_FALSE(report.reattached);
    EXPECT_FALSE(report.reason.empty());
    EXPECT_EQ(store.Stats().blocks, 0u);
  }
  // That store formatted the pool: nothing is left to reattach to at the old size either.
  RebuildReport report;
  BlockStore again(pool_.data(), pool_.size(), /*reattach=*/true, 1, &report);
  EXPECT_FALSE(report.reattached);
  EXPECT_EQ(again.Stats().blocks, 0u);
}

TEST(ReattachFreshPoolTest, ZeroedPoolIsFormatted) {
  AnonBuffer pool(1 << 20);
  RebuildReport report;
  BlockStore store(pool.data(), pool.size(), /*reattach=*/true, 1, &report);
  EXPECT_FALSE(report.reattached);
  EXPECT_FALSE(report.reason.empty());
  EXPECT_EQ(reinterpret_cast<const PoolHeader*>(pool.data())->magic, kPoolMagic);
  // Without reattach the pool is formatted even when it holds blocks.
  RebuildReport r2;
  BlockStore store2(pool.data(), pool.size(), /*reattach=*/false, 1, &r2);
  EXPECT_FALSE(r2.reattached);
}

TEST_F(ReattachTest, CorruptPayloadIsDropped) {
  FirstLife();
  // Flip a payload byte of block 2 behind the store's back.
  {
    BlockStore probe(pool_.data(), pool_.size(), /*reattach=*/true, 1, nullptr);
    NamespaceTable table;
    const NamespaceInfo& ns = Intern(table, "m", layout_);
    probe.AddNamespace(ns.ForStore());
    BlockKey k2 = KeyOf(2);
    auto pin = probe.PinReads(ns.id, std::span<const BlockKey>(&k2, 1));
    ASSERT_EQ(pin.size(), 1u);
    const_cast<uint8_t*>(pin[0].payload)[payload_ - 1] ^= 0x40;
    probe.Unpin(pin[0].handle);
  }
  RebuildReport report;
  BlockStore store(pool_.data(), pool_.size(), /*reattach=*/true, 1, &report);
  EXPECT_TRUE(report.reattached);
  EXPECT_EQ(report.blocks_kept, 4u);
  EXPECT_EQ(report.blocks_corrupt, 1u);
  NamespaceTable table;
  const NamespaceInfo& ns = Intern(table, "m", layout_);
  store.AddNamespace(ns.ForStore());
  EXPECT_EQ(Has(store, ns.id, KeyOf(1)), 1u);
  EXPECT_EQ(Has(store, ns.id, KeyOf(2)), 0u);
  EXPECT_EQ(Has(store, ns.id, KeyOf(3)), 1u);
}

}  // namespace
}  // namespace hiqcache::server

namespace hiqcache::server {
namespace {

// No extent, and so no block slot, crosses a multiple of the registration granule (the CUDA
// backend page-locks the pool in chunks of it), also after extents are freed and coalesced;
// a rebuilt pool keeps the rule.
TEST(BlockStoreGranuleTest, NoBlockStraddlesAGranuleBoundary) {
  constexpr uint64_t kGranule = 256 << 10;
  AnonBuffer mem(4 << 20);
  NamespaceTable table;
  const NamespaceInfo& a = Intern(table, "a", Layout(3, 2, 64, 4));   // 3,168-byte payloads
  const NamespaceInfo& b = Intern(table, "b", Layout(5, 2, 64, 16));  // 21,120-byte payloads
  auto check = [&](const uint8_t* payload, size_t bytes) {
    const uint64_t lo = payload - kBlockHeaderBytes - mem.data();
    const uint64_t hi = payload + bytes - 1 - mem.data();
    EXPECT_EQ(lo / kGranule, hi / kGranule) << "slot at " << lo << " crosses a granule boundary";
  };
  {
    BlockStore store(mem.data(), mem.size(), false, 1, nullptr, kGranule);
    store.AddNamespace(a.ForStore());
    store.AddNamespace(b.ForStore());
    uint64_t stored = 0;
    // Fill the pool from both namespaces (evicting), so that extents are freed and reused.
    for (uint64_t i = 0; i < 3000; ++i) {
      const NamespaceInfo& ns = i % 3 == 0 ? b : a;
      uint8_t* p = Put(store, ns.id, KeyOf(i), 0);
      if (p == nullptr) continue;
      ++stored;
      check(p, ns.desc.layout.BlockBytes());
    }
    EXPECT_GT(stored, 1000u);
  }
  BlockStore again(mem.data(), mem.size(), true, 1, nullptr, kGranule);
  again.AddNamespace(a.ForStore());
  for (uint64_t i = 10000; i < 10500; ++i) {
    uint8_t* p = Put(again, a.id, KeyOf(i), 0);
    if (p != nullptr) check(p, a.desc.layout.BlockBytes());
  }
}

}  // namespace
}  // namespace hiqcache::server

namespace hiqcache::server {
namespace {

// RemoveNamespace forgets a namespace only while it holds no block, and gives its extents back;
// TakeEmptiedNamespaces says when the last block went.
TEST(BlockStoreRemoveNamespaceTest, OnlyWhenEmptyAndTheSpaceComesBack) {
  const kernels::BlockLayout layout = Layout(1, 1, 64, 4);
  const uint64_t slot = SlotBytesFor(layout.BlockBytes());
  AnonBuffer pool(PoolBytesFor(4, slot));
  BlockStore store(pool.data(), pool.size());
  NamespaceTable table;
  const NamespaceInfo& a = Intern(table, "a", layout);
  const NamespaceInfo& b = Intern(table, "b", layout);
  store.AddNamespace(a.ForStore());
  store.AddNamespace(b.ForStore());
  EXPECT_TRUE(store.TakeEmptiedNamespaces().empty());
  EXPECT_TRUE(store.RemoveNamespace(12345));  // unknown: nothing held

  ASSERT_NE(Put(store, a.id, KeyOf(0)), nullptr);
  ASSERT_NE(Put(store, a.id, KeyOf(1)), nullptr);
  EXPECT_FALSE(store.RemoveNamespace(a.id));  // committed blocks
  EXPECT_EQ(store.Stats().namespaces.count(a.id), 1u);
  EXPECT_EQ(Has(store, a.id, KeyOf(0)), 1u);  // unchanged

  // A reserved block holds the namespace too.
  BlockKey k2 = KeyOf(2);
  EXPECT_EQ(store.Evict(a.id, std::vector<BlockKey>{KeyOf(0), KeyOf(1)}), 2u);
  auto r = store.ReserveWrites(a.id, std::span<const BlockKey>(&k2, 1));
  ASSERT_EQ(r[0].outcome, Outcome::kReserved);
  // It emptied (the evictions) and holds a block again: listed, but not removable.
  EXPECT_EQ(store.TakeEmptiedNamespaces(), std::vector<uint32_t>{a.id});
  EXPECT_FALSE(store.RemoveNamespace(a.id));
  store.CommitWrite(r[0].handle, XXH3_64bits(r[0].payload, layout.BlockBytes()));

  // A block evicted while pinned still holds it, until the last unpin.
  auto pin = store.PinReads(a.id, std::span<const BlockKey>(&k2, 1));
  ASSERT_EQ(pin.size(), 1u);
  EXPECT_EQ(store.Evict(a.id, std::span<const BlockKey>(&k2, 1)), 1u);
  EXPECT_EQ(Has(store, a.id, k2), 0u);
  EXPECT_TRUE(store.TakeEmptiedNamespaces().empty());
  EXPECT_FALSE(store.RemoveNamespace(a.id));
  store.Unpin(pin[0].handle);
  EXPECT_EQ(store.TakeEmptiedNamespaces(), std::vector<uint32_t>{a.id});
  EXPECT_TRUE(store.TakeEmptiedNamespaces().empty());  // each emptying is reported once

  EXPECT_TRUE(store.RemoveNamespace(a.id));
  StoreStats s = store.Stats();
  EXPECT_EQ(s.namespaces.count(a.id), 0u);
  EXPECT_EQ(s.namespaces.count(b.id), 1u);
  EXPECT_EQ(s.blocks, 0u);
  EXPECT_TRUE(store.RemoveNamespace(a.id));  // idempotent
  // A removed namespace takes no writes, and holds nothing.
  BlockKey k9 = KeyOf(9);
  auto none = store.ReserveWrites(a.id, std::span<const BlockKey>(&k9, 1));
  ASSERT_EQ(none.size(), 1u);
  EXPECT_EQ(none[0].outcome, Outcome::kNoSpace);
  EXPECT_EQ(Has(store, a.id, k9), 0u);
  EXPECT_TRUE(store.PinReads(a.id, std::span<const BlockKey>(&k9, 1)).empty());

  // Its extent went back: b fills the whole pool without evicting anything of a's.
  for (uint64_t i = 0; i < 4; ++i) ASSERT_NE(Put(store, b.id, KeyOf(i, 1)), nullptr) << i;
  EXPECT_EQ(store.Stats().namespaces.at(b.id).evictions, 0u);
  ExpectConsistent(store, slot);

  // Added again (the table may reuse the id), it starts from zero counters.
  store.AddNamespace(a.ForStore());
  EXPECT_EQ(store.Stats().namespaces.at(a.id).backups, 0u);
  ASSERT_NE(Put(store, a.id, KeyOf(0)), nullptr);  // evicts one of b's
  EXPECT_EQ(Has(store, a.id, KeyOf(0)), 1u);
  ExpectConsistent(store, slot);
}

// Namespaces created and emptied over and over do not accumulate in the store.
TEST(BlockStoreRemoveNamespaceTest, ChurnLeavesNothingBehind) {
  const kernels::BlockLayout layout = Layout(1, 1, 64, 4);
  AnonBuffer pool(PoolBytesFor(4, SlotBytesFor(layout.BlockBytes())));
  BlockStore store(pool.data(), pool.size());
  NamespaceTable table;
  for (int i = 0; i < 200; ++i) {
    const NamespaceInfo& ns = Intern(table, "m" + std::to_string(i), layout);
    store.AddNamespace(ns.ForStore());
    ASSERT_NE(Put(store, ns.id, KeyOf(i)), nullptr) << i;  // evicts the previous one's block
    for (uint32_t id : store.TakeEmptiedNamespaces()) EXPECT_TRUE(store.RemoveNamespace(id));
  }
  StoreStats s = store.Stats();
  EXPECT_LE(s.namespaces.size(), 2u);
  EXPECT_EQ(s.blocks, s.namespaces.size());
}

// An orphan the rebuild found (never adopted) is removed once its last block goes.
TEST(BlockStoreRemoveNamespaceTest, EmptiedOrphansAreRemovedByTheStore) {
  const kernels::BlockLayout layout = Layout(1, 1, 64, 4);
  const uint64_t slot = SlotBytesFor(layout.BlockBytes());
  AnonBuffer pool(PoolBytesFor(4, slot));
  NamespaceTable table;
  const NamespaceInfo& old_ns = Intern(table, "old", layout);
  const NamespaceInfo& fresh = Intern(table, "fresh", layout);
  {
    BlockStore first(pool.data(), pool.size());
    first.AddNamespace(old_ns.ForStore());
    PutWithData(first, old_ns.id, 0, layout.BlockBytes());
  }
  BlockStore store(pool.data(), pool.size(), /*reattach=*/true, 1, nullptr);
  EXPECT_EQ(store.Stats().namespaces.size(), 1u);  // the orphan
  store.AddNamespace(fresh.ForStore());
  for (uint64_t i = 0; i < 4; ++i) ASSERT_NE(Put(store, fresh.id, KeyOf(i, 2)), nullptr);
  EXPECT_TRUE(store.TakeEmptiedNamespaces().empty());  // the orphan is not listed...
  StoreStats s = store.Stats();
  EXPECT_EQ(s.namespaces.size(), 1u);  // ...but gone
  EXPECT_EQ(s.namespaces.count(fresh.id), 1u);
}

}  // namespace
}  // namespace hiqcache::server

namespace hiqcache::server {
namespace {

// ---------------------------------------------------------------------------------------------
// A poisoned pool: every header field Rebuild reads is checked against the extent and pool
// geometry first; what does not fit is dropped and counted, the rest is kept, nothing crashes.

class PoisonedPoolTest : public ::testing::Test {
 protected:
  // Small granules split the pool so that each namespace gets its own extent: A's in the first
  // granule after the metadata (directory slot 0), B's in the next (slot 1).
  static constexpr uint64_t kGranule = 64 << 10;
  static constexpr uint64_t kBlocks = 4;
  PoisonedPoolTest()
      : layout_(Layout(1, 1, 64, 4)), payload_(layout_.BlockBytes()), pool_(4 * kGranule) {
    a_ = &Intern(table_, "a", layout_);
    b_ = &Intern(table_, "b", layout_);
    BlockStore store(pool_.data(), pool_.size(), false, 1, nullptr, kGranule);
    store.AddNamespace(a_->ForStore());
    store.AddNamespace(b_->ForStore());
    for (uint64_t i = 0; i < kBlocks; ++i) {
      PutWithData(store, a_->id, i, payload_);
      PutWithData(store, b_->id, 100 + i, payload_);
    }
  }
  ExtentDirEntry& Dir(uint32_t i) {
    return reinterpret_cast<ExtentDirEntry*>(pool_.data() + kPoolHeaderBytes)[i];
  }
  ExtentHeader& Ext(uint32_t i) {
    return *reinterpret_cast<ExtentHeader*>(pool_.data() + Dir(i).offset);
  }
  BlockHeader& Blk(uint32_t ext, uint32_t slot) {
    return *reinterpret_cast<BlockHeader*>(pool_.data() + Dir(ext).offset + kExtentHeaderBytes +
                                           uint64_t{slot} * SlotBytesFor(payload_));
  }
  // Reattaches (the store replaces store_, verifying every read) and adopts both namespaces.
  void Reattach() {
    store_.reset();
    StoreOptions o;
    o.reattach = true;
    o.rebuild_threads = 2;
    o.granule = kGranule;
    o.verify_reads_one_in = 1;
    store_ = std::make_unique<BlockStore>(pool_.data(), pool_.size(), o, &report_);
    ASSERT_TRUE(report_.reattached) << report_.reason;
    store_->AddNamespace(a_->ForStore());
    store_->AddNamespace(b_->ForStore());
  }
  // How many of namespace ns's original blocks (keys first..first+kBlocks) the store holds and
  // can read back intact.
  uint64_t Held(const NamespaceInfo* ns, uint64_t first) {
    uint64_t n = 0;
    for (uint64_t i = first; i < first + kBlocks; ++i) {
      BlockKey k = KeyOf(i);
      auto pins = store_->PinReads(ns->id, std::span<const BlockKey>(&k, 1));
      if (pins.empty()) continue;
      n += PayloadIntact(pins[0].payload, i, payload_);
      store_->Unpin(pins[0].handle);
    }
    return n;
  }
  // The store serves new traffic: a full pool's worth of new blocks in A (reclaiming whatever
  // was dropped), each readable.
  void ExpectServes() {
    const uint64_t cap = store_->CapacityBlocks(payload_);
    uint64_t stored = 0;
    for (uint64_t i = 0; i < cap; ++i) {
      BlockKey k = KeyOf(i, 99);
      auto r = store_->ReserveWrites(a_->id, std::span<const BlockKey>(&k, 1));
      if (r[0].outcome != Outcome::kReserved) continue;
      std::memset(r[0].payload, static_cast<int>(i), payload_);
      store_->CommitWrite(r[0].handle, XXH3_64bits(r[0].payload, payload_));
      ++stored;
    }
    EXPECT_GT(stored, kBlocks);
    BlockKey last = KeyOf(cap - 1, 99);
    EXPECT_EQ(store_->LookupPrefix(a_->id, std::span<const BlockKey>(&last, 1)), 1u);
    StoreStats s = store_->Stats();
    EXPECT_LE(s.used_bytes, s.capacity_bytes);
    EXPECT_EQ(s.used_bytes, s.blocks * SlotBytesFor(payload_));
  }
  // A's extent is dropped whole, B's blocks are all kept, and the store then serves.
  void ExpectExtentADropped() {
    Reattach();
    EXPECT_EQ(report_.extents_corrupt, 1u);
    EXPECT_EQ(report_.extents, 1u);
    EXPECT_EQ(report_.blocks_kept, kBlocks);
    EXPECT_EQ(Held(a_, 0), 0u);
    EXPECT_EQ(Held(b_, 100), kBlocks);
    EXPECT_EQ(Dir(0).bytes, 0u);  // the directory forgets it
    ExpectServes();
  }

  kernels::BlockLayout layout_;
  size_t payload_;
  AnonBuffer pool_;
  NamespaceTable table_;
  const NamespaceInfo* a_ = nullptr;
  const NamespaceInfo* b_ = nullptr;
  RebuildReport report_;
  std::unique_ptr<BlockStore> store_;
};

TEST_F(PoisonedPoolTest, UntouchedPoolKeepsEverything) {
  Reattach();
  EXPECT_EQ(report_.extents, 2u);
  EXPECT_EQ(report_.extents_corrupt, 0u);
  EXPECT_EQ(report_.blocks_corrupt, 0u);
  EXPECT_EQ(Held(a_, 0), kBlocks);
  EXPECT_EQ(Held(b_, 100), kBlocks);
}

// payload_bytes = 2^64-1 would make SlotBytesFor wrap to 64: an extent of 64-byte "slots" that
// a size check alone passes, whose first block would be hashed over 2^64-1 bytes.
TEST_F(PoisonedPoolTest, PayloadBytesThatWrapTheSlotSize) {
  const uint64_t huge = ~uint64_t{0};
  ASSERT_EQ(SlotBytesFor(huge), kBlockHeaderBytes);  // the wrap the check must not trust
  Ext(0).payload_bytes = huge;
  Ext(0).slot_bytes = SlotBytesFor(huge);
  Ext(0).num_slots = static_cast<uint32_t>((Dir(0).bytes - kExtentHeaderBytes) / 64);
  Blk(0, 0).payload_bytes = huge;
  ExpectExtentADropped();
}

// A block count whose product with the slot size wraps: slots would lie far past the pool.
TEST_F(PoisonedPoolTest, SlotCountTimesSlotSizeOverflows) {
  const uint64_t payload = 1ull << 62;
  Ext(0).payload_bytes = payload;
  Ext(0).slot_bytes = SlotBytesFor(payload);
  Ext(0).num_slots = 4;  // 4 * (2^62 + 64) wraps to 256
  Dir(0).bytes = Ext(0).extent_bytes = kExtentHeaderBytes + 256;
  ExpectExtentADropped();
}

TEST_F(PoisonedPoolTest, ExtentPastTheEndOfThePool) {
  Dir(0).bytes = Ext(0).extent_bytes = pool_.size();
  ExpectExtentADropped();
}

TEST_F(PoisonedPoolTest, DirectoryOffsetPastThePool) {
  Dir(0).offset = pool_.size() - 64;  // header would be read past the end
  Dir(0).bytes = 64 << 10;
  ExpectExtentADropped();
}

TEST_F(PoisonedPoolTest, DirectoryOffsetNearTheTopOfTheAddressSpace) {
  Dir(0).offset = ~uint64_t{0} - 63;  // offset + bytes wraps
  ExpectExtentADropped();
}

TEST_F(PoisonedPoolTest, DirectoryEntryTooSmallForAHeader) {
  Dir(0).offset = pool_.size() - 128;
  Dir(0).bytes = 128;
  ExpectExtentADropped();
}

TEST_F(PoisonedPoolTest, MisalignedOffset) {
  Dir(0).offset += 8;
  ExpectExtentADropped();
}

TEST_F(PoisonedPoolTest, ExtentInsideThePoolMetadata) {
  Dir(0).offset = kPoolHeaderBytes;  // over the directory itself
  ExpectExtentADropped();
}

TEST_F(PoisonedPoolTest, ExtentBytesDisagreeWithTheDirectory) {
  Ext(0).extent_bytes -= 64;
  ExpectExtentADropped();
}

TEST_F(PoisonedPoolTest, SlotBytesDisagreeWithPayloadBytes) {
  Ext(0).slot_bytes += 64;
  ExpectExtentADropped();
}

TEST_F(PoisonedPoolTest, ZeroPayloadBytes) {
  Ext(0).payload_bytes = 0;
  Ext(0).slot_bytes = SlotBytesFor(0);
  ExpectExtentADropped();
}

TEST_F(PoisonedPoolTest, NumSlotsZero) {
  Ext(0).num_slots = 0;
  ExpectExtentADropped();
}

TEST_F(PoisonedPoolTest, NumSlotsTooMany) {
  Ext(0).num_slots = 0xFFFFFFFFu;
  ExpectExtentADropped();
}

TEST_F(PoisonedPoolTest, BadExtentMagic) {
  Ext(0).magic ^= 1;
  ExpectExtentADropped();
}

// An extent claiming more slots of its size than the allocator ever puts in one (a tiny slot
// size over a huge extent would make the rebuild allocate an index entry per 128 bytes).
TEST_F(PoisonedPoolTest, MoreSlotsThanAnExtentEverHolds) {
  // One granule of 64 MiB + 128 B slots: consistent in itself, but > kTargetExtentBytes / slot.
  constexpr uint64_t kBig = 256ull << 20;
  AnonBuffer pool(kBig);
  NamespaceTable table;
  kernels::BlockLayout tiny = Layout(1, 1, 4, 1);  // 1 * 2 * 1 * (4 + 2) = 12 B payloads
  const NamespaceInfo& ns = Intern(table, "tiny", tiny);
  {
    BlockStore first(pool.data(), pool.size());
    first.AddNamespace(ns.ForStore());
    PutWithData(first, ns.id, 0, tiny.BlockBytes());
  }
  auto& dir = *reinterpret_cast<ExtentDirEntry*>(pool.data() + kPoolHeaderBytes);
  auto& eh = *reinterpret_cast<ExtentHeader*>(pool.data() + dir.offset);
  const uint64_t slot = SlotBytesFor(tiny.BlockBytes());
  ASSERT_EQ(eh.num_slots, (1ull << 20) / slot);  // what the allocator makes first (demand)
  eh.num_slots = static_cast<uint32_t>((kBig - dir.offset - kExtentHeaderBytes) / slot);
  dir.bytes = eh.extent_bytes = kExtentHeaderBytes + uint64_t{eh.num_slots} * slot;
  RebuildReport report;
  BlockStore store(pool.data(), pool.size(), true, 1, &report);
  EXPECT_TRUE(report.reattached);
  EXPECT_EQ(report.extents_corrupt, 1u);
  EXPECT_EQ(report.blocks_kept, 0u);
}

// Two directory entries naming the same extent: the second overlaps the first and is dropped;
// the blocks are indexed once.
TEST_F(PoisonedPoolTest, TwoDirectoryEntriesForOneExtent) {
  Dir(7) = Dir(0);
  Reattach();
  EXPECT_EQ(report_.extents, 2u);
  EXPECT_EQ(report_.extents_corrupt, 1u);
  EXPECT_EQ(Held(a_, 0), kBlocks);
  EXPECT_EQ(Held(b_, 100), kBlocks);
  ExpectServes();
}

// Two extents of one namespace hash whose payload sizes differ (same slot size): the later one
// does not fit its namespace and is dropped.
TEST_F(PoisonedPoolTest, NamespaceRecordsThatDisagree) {
  std::memcpy(Ext(1).namespace_hash, Ext(0).namespace_hash, 16);
  Ext(1).payload_bytes -= 8;
  ASSERT_EQ(SlotBytesFor(Ext(1).payload_bytes), Ext(1).slot_bytes);
  Reattach();
  EXPECT_EQ(report_.extents, 1u);
  EXPECT_EQ(report_.extents_corrupt, 1u);
  EXPECT_EQ(Held(a_, 0), kBlocks);
  EXPECT_EQ(Held(b_, 100), 0u);
  ExpectServes();
}

// The namespace text is diagnostics only: unterminated or unprintable, it is bounded and kept.
TEST_F(PoisonedPoolTest, NamespaceTextWithoutTerminator) {
  Ext(0).namespace_text[0] = '\n';
  Ext(0).namespace_text[1] = '\x1b';
  std::memset(Ext(0).namespace_text + 2, 'x', sizeof(Ext(0).namespace_text) - 2);  // no NUL
  store_ = std::make_unique<BlockStore>(pool_.data(), pool_.size(), true, 1, &report_, kGranule);
  EXPECT_EQ(report_.extents, 2u);
  EXPECT_EQ(report_.extents_corrupt, 0u);
  EXPECT_EQ(report_.blocks_kept, 2 * kBlocks);
}

// Block headers: each field that does not fit drops that block only.
TEST_F(PoisonedPoolTest, BlockFieldsThatDoNotFitDropTheBlock) {
  Blk(0, 0).payload_bytes = ~uint64_t{0};
  Blk(0, 1).commit_seq = ~uint64_t{0};  // kept: the rebuild renumbers commit sequences
  Blk(0, 2).namespace_tag ^= 1;
  Blk(1, 0).magic ^= 1;
  Blk(1, 1).state = 7;
  std::memcpy(Blk(1, 3).key, Blk(1, 2).key, 16);  // a key held twice
  Blk(1, 3).checksum = Blk(1, 2).checksum;
  Reattach();
  EXPECT_EQ(report_.extents, 2u);
  EXPECT_EQ(report_.extents_corrupt, 0u);
  EXPECT_EQ(report_.blocks_kept, 3u);  // a's 1 and 3, one of b's 102 / 103
  EXPECT_EQ(report_.blocks_corrupt, 5u);
  EXPECT_EQ(Held(a_, 0), 2u);
  BlockKey k3 = KeyOf(3);
  EXPECT_EQ(store_->LookupPrefix(a_->id, std::span<const BlockKey>(&k3, 1)), 1u);
  // Block 1 claimed the newest commit: renumbered to the top of the 3 kept, and the clock goes
  // on from there (no wrap: new commits are newer still).
  EXPECT_EQ(Blk(0, 1).commit_seq, 3u);
  ExpectServes();
  // The dropped slots were marked free: a second restart finds nothing corrupt.
  store_.reset();
  store_ = std::make_unique<BlockStore>(pool_.data(), pool_.size(), true, 1, &report_, kGranule);
  EXPECT_EQ(report_.blocks_corrupt, 0u);
  EXPECT_EQ(report_.extents_corrupt, 0u);
}

// Restore reads: a block whose payload changed after its commit is never handed out.
TEST_F(PoisonedPoolTest, PinReadsStopsBeforeACorruptBlock) {
  Reattach();
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < kBlocks; ++i) keys.push_back(KeyOf(i));
  uint8_t* payload1 = reinterpret_cast<uint8_t*>(&Blk(0, 1)) + kBlockHeaderBytes;
  payload1[payload_ / 2] ^= 0x01;
  EXPECT_EQ(store_->LookupPrefix(a_->id, keys), kBlocks);  // lookups do not hash
  auto pins = store_->PinReads(a_->id, keys);
  ASSERT_EQ(pins.size(), 1u);  // block 0 only: the run ends before the corrupt block 1
  EXPECT_TRUE(PayloadIntact(pins[0].payload, 0, payload_));
  store_->Unpin(pins[0].handle);
  StoreStats s = store_->Stats();
  EXPECT_EQ(s.corrupt, 1u);
  EXPECT_EQ(s.namespaces.at(a_->id).corrupt, 1u);
  EXPECT_EQ(s.namespaces.at(a_->id).restores, 1u);
  EXPECT_EQ(s.namespaces.at(a_->id).blocks, kBlocks - 1);  // its slot is free again
  EXPECT_EQ(s.namespaces.at(a_->id).evictions, 0u);
  EXPECT_EQ(store_->LookupPrefix(a_->id, keys), 1u);
  // The blocks after it are still there and intact.
  std::vector<BlockKey> rest(keys.begin() + 2, keys.end());
  auto more = store_->PinReads(a_->id, rest);
  ASSERT_EQ(more.size(), 2u);
  for (size_t i = 0; i < more.size(); ++i) {
    EXPECT_TRUE(PayloadIntact(more[i].payload, 2 + i, payload_));
    store_->Unpin(more[i].handle);
  }
  EXPECT_EQ(store_->Stats().corrupt, 1u);
  EXPECT_EQ(BlockState(Blk(0, 1).state), BlockState::kFree);  // not reloaded by a restart
}

// Verification after the rebuild (the rebuild itself always verifies): off hands a block out
// unchecked, so does one read in three (it hashes the third block read); one read in two
// catches it on the second block read.
TEST_F(PoisonedPoolTest, ReadVerificationCanBeSampledOrTurnedOff) {
  EXPECT_EQ(StoreOptions().verify_reads_one_in, 32u);  // the default (see StoreOptions)
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < kBlocks; ++i) keys.push_back(KeyOf(i));
  uint8_t* payload1 = reinterpret_cast<uint8_t*>(&Blk(0, 1)) + kBlockHeaderBytes;
  auto reads_with = [&](uint32_t one_in) {
    StoreOptions o;
    o.reattach = true;
    o.granule = kGranule;
    o.verify_reads_one_in = one_in;
    BlockStore store(pool_.data(), pool_.size(), o, nullptr);
    store.AddNamespace(a_->ForStore());
    payload1[0] ^= 0x01;  // after the rebuild
    auto pins = store.PinReads(a_->id, keys);
    for (const auto& p : pins) store.Unpin(p.handle);
    payload1[0] ^= 0x01;  // intact again for the next store
    return std::make_pair(pins.size(), store.Stats().corrupt);
  };
  EXPECT_EQ(reads_with(0), std::make_pair(size_t{kBlocks}, uint64_t{0}));
  EXPECT_EQ(reads_with(3), std::make_pair(size_t{kBlocks}, uint64_t{0}));  // 3rd read: block 2
  // One in two drops block 1 for good.
  EXPECT_EQ(reads_with(2), std::make_pair(size_t{1}, uint64_t{1}));
}

}  // namespace
}  // namespace hiqcache::server

namespace hiqcache::server {
namespace {

// Blocks found under a namespace hash that is then registered with another payload size belong
// to no namespace a registration can make: the registration drops them (their space comes back)
// instead of leaving two payload sizes under one hash for the next rebuild to trip over.
TEST(BlockStoreOrphanTest, SameHashOtherPayloadIsDropped) {
  const kernels::BlockLayout small = Layout(1, 1, 64, 4);
  const uint64_t slot = SlotBytesFor(small.BlockBytes());
  AnonBuffer pool(PoolBytesFor(4, slot));
  NamespaceTable table;
  const NamespaceInfo& ns = Intern(table, "m", small);
  {
    BlockStore first(pool.data(), pool.size());
    first.AddNamespace(ns.ForStore());
    for (uint64_t i = 0; i < 4; ++i) PutWithData(first, ns.id, i, small.BlockBytes());
  }
  BlockStore store(pool.data(), pool.size(), /*reattach=*/true, 1, nullptr);
  ASSERT_EQ(store.Stats().blocks, 4u);
  NamespaceInfo other = ns;  // same hash, twice the payload
  other.desc.layout.num_layers = 2;
  EXPECT_FALSE(store.AddNamespace(other.ForStore()));
  StoreStats s = store.Stats();
  EXPECT_EQ(s.blocks, 0u);
  EXPECT_EQ(s.used_bytes, 0u);
  ASSERT_EQ(s.namespaces.size(), 1u);
  EXPECT_EQ(s.namespaces.count(other.id), 1u);
  // The pool is all free: the new namespace fills it without evicting.
  const uint64_t cap = store.CapacityBlocks(other.desc.layout.BlockBytes());
  for (uint64_t i = 0; i < cap; ++i) ASSERT_NE(Put(store, other.id, KeyOf(i, 3)), nullptr) << i;
  EXPECT_EQ(store.Stats().namespaces.at(other.id).evictions, 0u);
}

}  // namespace
}  // namespace hiqcache::server
