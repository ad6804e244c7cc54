// Private to hiq_pool's block_store*.cc files: the store's records of blocks, extents and
// namespaces (guarded by BlockStore::mu_, as the store's header says) and the extent sizing that
// allocation (block_store.cc) and rebuild (block_store_rebuild.cc) share.
#pragma once

#include <algorithm>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "pool/block_store.h"

namespace hiqcache::server {

// Extents are sized to about this many bytes (at least one slot): large enough that extent
// headers cost nothing, small enough that namespaces can trade space at a useful granularity.
inline constexpr uint64_t kTargetExtentBytes = 64ull << 20;

// Slots an extent of `slot_bytes` slots holds at most: what AllocateExtentLocked ever makes.
inline uint64_t MaxSlotsPerExtent(uint64_t slot_bytes) {
  return std::max<uint64_t>(1, kTargetExtentBytes / slot_bytes);
}

struct BlockEntry {
  StoreExtent* extent = nullptr;
  uint64_t offset = 0;  // of the slot (its header) from the pool base
  uint32_t slot = 0;
  uint32_t ns = 0;
  BlockKey key{};
  BlockState state = BlockState::kFree;
  uint32_t pins = 0;
  bool indexed = false;
  bool in_lru = false;
  bool from_l3 = false;  // promoted from L3: not offered to the eviction sink
  uint64_t last_use = 0;
  std::list<BlockEntry*>::iterator lru_it;
};

struct StoreExtent {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint32_t dir_slot = 0;
  uint32_t ns = 0;
  std::vector<BlockEntry> entries;
  std::vector<uint32_t> free_slots;
  bool in_partial = false;
  std::list<std::unique_ptr<StoreExtent>>::iterator self;
};

struct BlockStore::NsState {
  uint32_t id = 0;
  uint64_t payload_bytes = 0;
  uint64_t slot_bytes = 0;
  uint32_t slots_per_extent = 0;
  NamespaceHash hash{};
  std::string text;
  // Whose the blocks are (NamespaceDesc::scope: a uid, or a uid and pod; "" when namespaces are
  // node-wide); an orphan of a rebuilt pool, not yet adopted, has none (kOrphanOwner).
  std::string owner;
  std::vector<Extent*> extents;
  std::vector<Extent*> partial;  // extents with at least one free slot
  std::list<BlockEntry*> lru;    // committed blocks, most recent first
  NamespaceCounters counters;
};

}  // namespace hiqcache::server
