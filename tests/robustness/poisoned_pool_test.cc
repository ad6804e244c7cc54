// A poisoned pool cannot stop a restart (README: "the pool cannot be poisoned").
//
// PoisonedHeadersAreDroppedAndTheRestIsKept: a real daemon fills three namespaces (one ~64 MiB
// extent each) and is stopped. Header fields are then corrupted directly in /dev/shm/<pool>:
//  - extent A: payload_bytes = 2^64-1 in the extent header (slot_bytes = 64, which is what
//    SlotBytesFor wraps to, and num_slots to match) and in its first block's header: the old
//    rebuild accepted it and hashed 2^64-1 bytes, SIGSEGV on every restart;
//  - extent B: num_slots * slot_bytes wraps (2^62-byte payloads, 4 slots in a 512-byte extent):
//    slots far past the pool;
//  - a spare directory entry naming an extent past the end of the pool;
//  - one block header of extent C: payload_bytes = 2^64-1.
// The restarted daemon starts, keeps every other block of C (restored within the INT8 bound),
// holds nothing of A and B, serves new backups and restores in A's namespace, and restarts once
// more with nothing left to drop.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "daemon_process.h"
#include "rob_util.h"

namespace hiqcache::rob {
namespace {

using testing::DaemonProcess;
using namespace std::chrono_literals;

constexpr uint32_t kBt = 16;
constexpr uint32_t kBlocks = 8;  // per namespace
constexpr uint64_t kSeed = 7331;

it::PoolOptions Options(const std::string& model) {
  it::PoolOptions o;
  o.model = model;
  o.geometry = it::Geom(4, 4, 64);
  o.block_tokens = kBt;
  o.num_rows = 2 * kBlocks * kBt;
  return o;
}

// Blocks [first, first + n) of kSeed: backed up from rows [0, n * kBt) of `pool`.
void BackUp(Client& client, const it::TestPool& pool, uint64_t first, uint32_t n) {
  const auto src = it::RowRange(0, n * kBt);
  it::FillRows(pool.kv, kSeed, src, kBt, static_cast<uint32_t>(first));
  ASSERT_EQ(client.Backup(pool.handle, IndependentKeys(kSeed, first, n), src).held(), n);
}

// Restores block `i` alone into rows [kBlocks * kBt, ...): 1 if it came back within the bound,
// 0 if it was missing; a block that comes back wrong fails the test.
uint32_t RestoredIntact(Client& client, const it::TestPool& pool, uint64_t i) {
  const auto dst = it::RowRange(kBlocks * kBt, kBt);
  it::SentinelRows(pool.kv, dst);
  RestoreResult r = client.Restore(pool.handle, IndependentKeys(kSeed, i, 1), dst);
  EXPECT_TRUE(r.status.ok()) << r.status.ToString();
  if (r.restored_blocks == 0) return 0;
  it::CheckResult c = it::CheckRows(pool.kv, kSeed, dst, kBt, false, static_cast<uint32_t>(i));
  EXPECT_EQ(c.bad_heads, 0u) << "block " << i << ": " << c.first;
  return 1;
}

// The directory slot of the extent whose namespace text names `model`.
int ExtentOf(const PoolFile& file, uint64_t pool_size, const std::string& model) {
  using namespace hiqcache::server;
  const auto* ph = reinterpret_cast<const PoolHeader*>(file.data());
  const auto* dir = reinterpret_cast<const ExtentDirEntry*>(file.data() + kPoolHeaderBytes);
  for (uint32_t i = 0; i < ph->directory_entries; ++i) {
    if (dir[i].bytes == 0 || dir[i].offset + kExtentHeaderBytes > pool_size) continue;
    const auto* eh = reinterpret_cast<const ExtentHeader*>(file.data() + dir[i].offset);
    const std::string text(eh->namespace_text,
                           strnlen(eh->namespace_text, sizeof(eh->namespace_text)));
    // CanonicalText: ";model=<length>:<model>;tenant=..."
    if (text.find(":" + model + ";") != std::string::npos) return static_cast<int>(i);
  }
  return -1;
}

TEST(PoisonedPoolTest, PoisonedHeadersAreDroppedAndTheRestIsKept) {
  constexpr uint64_t kPoolBytes = 192ull << 20;  // one ~64 MiB extent per namespace
  DaemonProcess daemon("192MiB");
  ASSERT_TRUE(daemon.Start()) << "hiqcached did not start";
  auto client = RestartingClient(daemon.target());
  ASSERT_NE(client, nullptr);
  std::vector<it::TestPool> pools;
  for (const char* model : {"poison-a", "poison-b", "poison-c"}) {
    auto p = it::MakePool(*client, Options(model));
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    pools.push_back(std::move(p).value());
    BackUp(*client, pools.back(), 0, kBlocks);
  }
  ASSERT_EQ(daemon.Stop(), 0);

  uint64_t victim_index = UINT64_MAX;  // the block of C whose header is poisoned
  {
    using namespace hiqcache::server;
    auto file = PoolFile::Open(daemon.shm_name());
    ASSERT_TRUE(file.has_value()) << "cannot open " << daemon.shm_name();
    ASSERT_EQ(file->CommittedBlocks().size(), 3 * kBlocks);
    const int a = ExtentOf(*file, kPoolBytes, "poison-a");
    const int b = ExtentOf(*file, kPoolBytes, "poison-b");
    const int c = ExtentOf(*file, kPoolBytes, "poison-c");
    ASSERT_GE(a, 0);
    ASSERT_GE(b, 0);
    ASSERT_GE(c, 0);
    ASSERT_TRUE(a != b && b != c && a != c);
    auto* dir = reinterpret_cast<ExtentDirEntry*>(file->data() + kPoolHeaderBytes);
    auto ext = [&](int i) { return reinterpret_cast<ExtentHeader*>(file->data() + dir[i].offset); };
    auto block = [&](int i, uint32_t slot, uint64_t slot_bytes) {
      return reinterpret_cast<BlockHeader*>(file->data() + dir[i].offset + kExtentHeaderBytes +
                                            slot * slot_bytes);
    };
    const uint64_t slot_bytes = ext(c)->slot_bytes;

    // C: one block's payload_bytes (find a committed one, remember which key it holds).
    for (uint32_t s = 0, seen = 0; s < ext(c)->num_slots; ++s) {
      BlockHeader* bh = block(c, s, slot_bytes);
      if (bh->state != static_cast<uint32_t>(BlockState::kCommitted) || ++seen != 3) continue;
      BlockKey key;
      std::memcpy(key.data(), bh->key, 16);
      for (uint64_t i = 0; i < kBlocks; ++i) {
        if (IndependentKey(kSeed, i) == key) victim_index = i;
      }
      bh->payload_bytes = ~uint64_t{0};
      break;
    }
    ASSERT_NE(victim_index, UINT64_MAX);

    // A: payload_bytes = 2^64-1, with the slot size it wraps to.
    const uint64_t huge = ~uint64_t{0};
    ASSERT_EQ(SlotBytesFor(huge), 64u);
    block(a, 0, ext(a)->slot_bytes)->payload_bytes = huge;
    ext(a)->payload_bytes = huge;
    ext(a)->slot_bytes = SlotBytesFor(huge);
    ext(a)->num_slots = static_cast<uint32_t>((dir[a].bytes - kExtentHeaderBytes) / 64);

    // B: 4 slots of 2^62 + 64 bytes "fit" in 512 bytes once the product wraps.
    ext(b)->payload_bytes = 1ull << 62;
    ext(b)->slot_bytes = SlotBytesFor(1ull << 62);
    ext(b)->num_slots = 4;
    dir[b].bytes = ext(b)->extent_bytes = kExtentHeaderBytes + 256;

    // A spare directory entry: an extent running 1 GiB past the end of the pool.
    for (uint32_t i = 0; i < 64; ++i) {
      if (dir[i].bytes != 0) continue;
      dir[i].offset = kPoolBytes - (1 << 20);
      dir[i].bytes = 1ull << 30;
      break;
    }
  }

  ASSERT_TRUE(daemon.Start()) << "hiqcached did not restart over the poisoned pool";
  ASSERT_TRUE(it::Eventually(
      [&] {
        for (const auto& p : pools) {
          if (!client->Lookup(p.handle, IndependentKeys(kSeed, 0, 1)).status.ok()) return false;
        }
        return true;
      },
      10s));
  auto stats = client->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->blocks, kBlocks - 1) << it::StatsText(*stats);

  // C keeps everything but the poisoned block; A and B hold nothing.
  uint32_t kept_c = 0;
  for (uint64_t i = 0; i < kBlocks; ++i) {
    const uint32_t got = RestoredIntact(*client, pools[2], i);
    if (i == victim_index) EXPECT_EQ(got, 0u) << "the poisoned block is still served";
    kept_c += got;
  }
  EXPECT_EQ(kept_c, kBlocks - 1);
  for (int p = 0; p < 2; ++p) {
    EXPECT_EQ(client->Lookup(pools[p].handle, IndependentKeys(kSeed, 0, kBlocks)).prefix_blocks, 0u)
        << "pool " << p;
  }

  // New traffic: A's namespace backs up and restores again.
  BackUp(*client, pools[0], 100, kBlocks);
  uint32_t restored_a = 0;
  for (uint64_t i = 100; i < 100 + kBlocks; ++i) restored_a += RestoredIntact(*client, pools[0], i);
  EXPECT_EQ(restored_a, kBlocks);

  // The pool the restarted daemon left is clean: another restart keeps all of it.
  ASSERT_EQ(daemon.Stop(), 0);
  ASSERT_TRUE(daemon.Start()) << "hiqcached did not restart a second time";
  ASSERT_TRUE(it::Eventually(
      [&] { return client->Lookup(pools[0].handle, IndependentKeys(kSeed, 100, 1)).status.ok(); },
      10s));
  stats = client->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->blocks, 2 * kBlocks - 1) << it::StatsText(*stats);
  EXPECT_EQ(client->Lookup(pools[0].handle, IndependentKeys(kSeed, 100, kBlocks)).prefix_blocks,
            kBlocks);
  EXPECT_EQ(daemon.Stop(), 0);
}

}  // namespace
}  // namespace hiqcache::rob
