// libFuzzer target over pool images (README: "the pool cannot be poisoned"): whatever bytes a
// pool holds when the daemon starts, the rebuild neither crashes nor reads or writes outside the
// pool, drops what does not fit, and leaves a store that serves.
//
// Input: a compact pool image (pool_image.h), decoded into a kPoolBytes mapping between
// PROT_NONE guard pages (a stray access faults). The harness then
//  1. rebuilds a BlockStore from it (reattach), registers the seeds' namespaces (pool_image.h)
//     and one made from the first directory entry's extent header, so that fuzzed namespaces are
//     adopted too;
//  2. looks up and pins the seeds' keys in each, checking every pinned payload lies inside the
//     pool's extent area and matches its checksum (reads are verified every time here);
//  3. backs up a few new blocks, evicts one, frees emptied namespaces, and checks the store's
//     accounting (used bytes = live slots, within capacity; per-namespace sums);
//  4. rebuilds a second store from the image the first one left: it must find nothing to drop
//     (the first rebuild normalized the pool) and keep exactly the blocks the first one held.
// Any failed check aborts, so libFuzzer records the input.
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "hiqcache/log.h"
#include "pool/block_store.h"
#include "pool_image.h"

namespace hiqcache::fuzz {
namespace {

using hiqcache::BlockKey;
using server::BlockStore;
using server::NamespaceInfo;

constexpr uint64_t kSeedKeys = 8;

uint8_t* pool = nullptr;
std::vector<NamespaceInfo>* known = nullptr;

#define FUZZ_CHECK(cond)                                                                        \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      std::fprintf(stderr, "pool_image_fuzzer: check failed: %s (line %d)\n", #cond, __LINE__); \
      std::abort();                                                                             \
    }                                                                                           \
  } while (0)

// A namespace whose payload is `payload_bytes` (one head of payload - 2 dims, one row per
// block) and whose hash is `hash`: what the rebuild adopts for an extent with that header.
NamespaceInfo NamespaceFor(uint32_t id, const uint8_t* hash, uint64_t payload_bytes) {
  NamespaceInfo info;
  info.id = id;
  info.desc.model = "fuzzed";
  kernels::BlockLayout& l = info.desc.layout;
  l.row.num_heads = 1;
  l.row.head_dim = static_cast<uint32_t>(payload_bytes - 2);
  l.row.dtype = kernels::DType::kBF16;
  l.row.codec = kernels::CodecKind::kInt8PerHead;
  l.num_layers = 1;
  l.kv_planes = 1;
  l.block_tokens = 1;
  std::memcpy(info.hash.data(), hash, 16);
  return info;
}

void CheckStats(const BlockStore& store) {
  server::StoreStats s = store.Stats();
  FUZZ_CHECK(s.used_bytes <= s.capacity_bytes);
  uint64_t blocks = 0, bytes = 0;
  for (const auto& [id, c] : s.namespaces) {
    blocks += c.blocks;
    bytes += c.bytes;
  }
  FUZZ_CHECK(blocks == s.blocks);
  FUZZ_CHECK(bytes == s.used_bytes);
}

// The payload and its header lie in the pool's extent area; its header says its size.
void CheckBounds(const uint8_t* payload, uint64_t payload_bytes) {
  const uint8_t* lo = pool + server::PoolMetaBytes(kPoolBytes) + server::kExtentHeaderBytes +
                      server::kBlockHeaderBytes;
  FUZZ_CHECK(payload >= lo);
  FUZZ_CHECK(payload <= pool + kPoolBytes);
  FUZZ_CHECK(payload_bytes <= static_cast<uint64_t>(pool + kPoolBytes - payload));
  const auto* bh =
      reinterpret_cast<const server::BlockHeader*>(payload - server::kBlockHeaderBytes);
  FUZZ_CHECK(bh->payload_bytes == payload_bytes);
}

// A pinned block: in bounds and intact.
void CheckPayload(const uint8_t* payload, uint64_t payload_bytes) {
  CheckBounds(payload, payload_bytes);
  const auto* bh =
      reinterpret_cast<const server::BlockHeader*>(payload - server::kBlockHeaderBytes);
  FUZZ_CHECK(XXH3_64bits(payload, payload_bytes) == bh->checksum);
}

}  // namespace
}  // namespace hiqcache::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  using namespace hiqcache::fuzz;
  hiqcache::SetLogLevel(hiqcache::LogLevel::kError);  // dropped extents log WARN lines
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  void* region = ::mmap(nullptr, kPoolBytes + 2 * page, PROT_NONE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (region == MAP_FAILED) std::abort();
  pool = static_cast<uint8_t*>(region) + page;
  if (::mprotect(pool, kPoolBytes, PROT_READ | PROT_WRITE) != 0) std::abort();
  known = new std::vector<hiqcache::server::NamespaceInfo>(KnownNamespaces());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace hiqcache::fuzz;
  namespace server = hiqcache::server;
  std::memset(pool, 0, kPoolBytes);
  const uint64_t granule = DecodePoolImage(data, size, pool);

  server::StoreOptions options;
  options.reattach = true;
  options.rebuild_threads = 1 + (size & 1);
  options.granule = granule;
  options.verify_reads_one_in = 1;
  server::RebuildReport report;
  auto store = std::make_unique<BlockStore>(pool, kPoolBytes, options, &report);
  CheckStats(*store);
  FUZZ_CHECK(!report.reattached || store->Stats().blocks == report.blocks_kept);

  std::vector<NamespaceInfo> spaces = *known;
  // The first directory entry's extent, if its header lies in the pool: register a namespace
  // with its hash and payload size (its blocks, if kept, are adopted). Not under a hash of the
  // seeds' namespaces: a namespace table never gives one hash two geometries.
  const auto* dir =
      reinterpret_cast<const server::ExtentDirEntry*>(pool + server::kPoolHeaderBytes);
  for (uint64_t i = 0; i < server::DirectoryEntriesFor(kPoolBytes); ++i) {
    if (dir[i].bytes == 0) continue;
    if (dir[i].offset <= kPoolBytes - server::kExtentHeaderBytes) {
      const auto* eh = reinterpret_cast<const server::ExtentHeader*>(pool + dir[i].offset);
      bool seed_hash = false;
      for (const auto& k : *known) {
        seed_hash = seed_hash || std::memcmp(k.hash.data(), eh->namespace_hash, 16) == 0;
      }
      if (!seed_hash && eh->payload_bytes >= 3 && eh->payload_bytes <= kPoolBytes) {
        spaces.push_back(NamespaceFor(10, eh->namespace_hash, eh->payload_bytes));
      }
    }
    break;
  }
  for (const auto& ns : spaces) store->AddNamespace(ns.ForStore());
  CheckStats(*store);

  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < kSeedKeys; ++i) keys.push_back(SeedKey(i));
  for (const auto& ns : spaces) {
    const uint64_t payload_bytes = ns.desc.layout.BlockBytes();
    const uint32_t found = store->LookupPrefix(ns.id, keys);
    auto pins = store->PinReads(ns.id, keys);
    FUZZ_CHECK(pins.size() <= found);  // a pin may only stop earlier (a corrupt block)
    for (const auto& p : pins) {
      CheckPayload(p.payload, payload_bytes);
      store->Unpin(p.handle);
    }
    // A few new blocks, then an eviction.
    std::vector<BlockKey> fresh;
    for (uint64_t i = 0; i < 3; ++i) fresh.push_back(SeedKey(100 + ns.id * 8 + i));
    auto res = store->ReserveWrites(ns.id, fresh);
    FUZZ_CHECK(res.size() == fresh.size());
    for (const auto& r : res) {
      if (r.outcome != BlockStore::WriteOutcome::kReserved) continue;
      CheckBounds(r.payload, payload_bytes);
      std::memset(r.payload, static_cast<int>(ns.id), payload_bytes);
      store->CommitWrite(r.handle, XXH3_64bits(r.payload, payload_bytes));
    }
    store->Evict(ns.id, std::span<const BlockKey>(&fresh[0], 1));
    auto again = store->PinReads(ns.id, std::span<const BlockKey>(&fresh[1], 2));
    for (const auto& p : again) {
      CheckPayload(p.payload, payload_bytes);
      store->Unpin(p.handle);
    }
    CheckStats(*store);
  }
  for (uint32_t id : store->TakeEmptiedNamespaces()) store->RemoveNamespace(id);
  CheckStats(*store);

  // The image the first store left rebuilds to the same blocks, with nothing to drop.
  const uint64_t held = store->Stats().blocks;
  store.reset();
  server::RebuildReport second;
  BlockStore again(pool, kPoolBytes, options, &second);
  FUZZ_CHECK(second.reattached);
  FUZZ_CHECK(second.extents_corrupt == 0);
  FUZZ_CHECK(second.blocks_corrupt == 0);
  FUZZ_CHECK(second.blocks_incomplete == 0);
  FUZZ_CHECK(second.blocks_kept == held);
  return 0;
}
