// hiq_pool_image_seeds DIR: writes the pool image fuzzer's seed corpus into DIR: real images of
// small pools (pool_image.h's kPoolBytes) that a BlockStore wrote, encoded as the fuzzer reads
// them. The committed corpus (tests/fuzz/pool_corpus/) is this program's output; rerun it when
// pool_format.h, the store's layout or pool_image.h changes.
#include <sys/mman.h>
#include <xxhash.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "pool/block_store.h"
#include "pool_image.h"

namespace {

using hiqcache::fuzz::kPoolBytes;
using hiqcache::server::BlockStore;
using hiqcache::server::NamespaceInfo;

std::vector<NamespaceInfo> known;

void Put(BlockStore& store, const NamespaceInfo& ns, uint64_t key, bool commit = true) {
  const hiqcache::BlockKey k = hiqcache::fuzz::SeedKey(key);
  auto r = store.ReserveWrites(ns.id, std::span<const hiqcache::BlockKey>(&k, 1));
  if (r[0].outcome != BlockStore::WriteOutcome::kReserved) return;
  const size_t n = ns.desc.layout.BlockBytes();
  for (size_t b = 0; b < n; ++b) r[0].payload[b] = static_cast<uint8_t>(key * 13 + b);
  if (commit) store.CommitWrite(r[0].handle, XXH3_64bits(r[0].payload, n));
}

bool Write(const std::string& dir, const char* name, unsigned granule_code,
           void (*fill)(BlockStore&)) {
  std::vector<uint8_t> pool(kPoolBytes, 0);
  {
    hiqcache::server::StoreOptions o;
    o.granule = hiqcache::fuzz::kGranules[granule_code];
    BlockStore store(pool.data(), pool.size(), o, nullptr);
    for (const auto& ns : known) store.AddNamespace(ns.ForStore());
    fill(store);
  }  // dropped without cleanup, as a killed daemon leaves its pool
  const std::string bytes = hiqcache::fuzz::EncodePoolImage(pool.data(), granule_code);
  std::ofstream out(dir + "/" + name, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  std::printf("%s: %zu bytes\n", name, bytes.size());
  return out.good();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  known = hiqcache::fuzz::KnownNamespaces();
  const std::string dir = argv[1];
  bool ok = true;
  // A formatted pool with nothing in it.
  ok &= Write(dir, "empty", 2, [](BlockStore&) {});
  // One namespace, the seed keys 0..7 (16 KiB granules keep extents, and seeds, small).
  ok &= Write(dir, "one_namespace", 0, [](BlockStore& s) {
    for (uint64_t i = 0; i < 8; ++i) Put(s, known[0], i);
  });
  // Three namespaces in 16 KiB granules (one extent each), one block left being written.
  ok &= Write(dir, "three_namespaces", 0, [](BlockStore& s) {
    for (uint64_t i = 0; i < 8; ++i) {
      Put(s, known[0], i);
      Put(s, known[1], i);
      Put(s, known[2], i, /*commit=*/i != 5);
    }
  });
  // Churn: a namespace's blocks evicted and the namespace removed, its extents reused by
  // another; blocks written over evicted ones.
  ok &= Write(dir, "churn", 0, [](BlockStore& s) {
    std::vector<hiqcache::BlockKey> keys;
    for (uint64_t i = 0; i < 120; ++i) {
      Put(s, known[0], i);
      Put(s, known[1], 1000 + i);
      keys.push_back(hiqcache::fuzz::SeedKey(1000 + i));
    }
    s.Evict(known[1].id, keys);
    s.RemoveNamespace(known[1].id);
    for (uint64_t i = 0; i < 60; ++i) Put(s, known[2], i % 3 == 0 ? i % 8 : 2000 + i);
    std::vector<hiqcache::BlockKey> some;
    for (uint64_t i = 8; i < 40; ++i) some.push_back(hiqcache::fuzz::SeedKey(i));
    s.Evict(known[0].id, some);
  });
  return ok ? 0 : 1;
}
