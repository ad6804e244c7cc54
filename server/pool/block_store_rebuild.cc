// BlockStore::Rebuild: the index rebuilt from a pool a previous daemon left (pool_format.h), with
// every directory entry and extent header checked against the pool geometry first.

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "hiqcache/log.h"
#include "hiqcache/xxh3.h"
#include "pool/block_store.h"
#include "pool/block_store_internal.h"

namespace hiqcache::server {
namespace {

// Dropped extents logged one by one at rebuild; the rest only in the count.
constexpr uint64_t kMaxLoggedDrops = 8;

}  // namespace

const char* BlockStore::CheckExtent(const ExtentDirEntry& d, uint64_t offset,
                                    uint64_t cursor) const {
  // The directory entry first: the extent lies in the pool, after the metadata and the extent
  // before it, within one registration granule, and holds at least its header.
  if (offset < cursor) return "offset overlaps the pool metadata or the previous extent";
  if (offset % kSlotAlign != 0) return "offset not 64-byte aligned";
  if (offset >= bytes_ || d.bytes > bytes_ - offset) return "extent past the end of the pool";
  if (d.bytes < kExtentHeaderBytes + kBlockHeaderBytes + kSlotAlign) return "extent too small";
  // An extent across a registration chunk (granule_) cannot be one DMA copy.
  if (offset / granule_ != (offset + d.bytes - 1) / granule_) return "extent crosses a granule";
  // Then its header, now known to be inside the pool. Every product and sum below is bounded by
  // d.bytes (< pool size), so none wraps.
  const auto* eh = reinterpret_cast<const ExtentHeader*>(base_ + offset);
  if (eh->magic != kExtentMagic) return "bad extent magic";
  if (eh->extent_bytes != d.bytes) return "extent_bytes differs from the directory";
  const uint64_t room = d.bytes - kExtentHeaderBytes;
  if (eh->payload_bytes == 0 || eh->payload_bytes > room - kBlockHeaderBytes) {
    return "payload_bytes does not fit in the extent";
  }
  if (eh->slot_bytes != SlotBytesFor(eh->payload_bytes)) return "slot_bytes != its payload's";
  if (eh->slot_bytes > room) return "slot_bytes does not fit in the extent";
  if (eh->num_slots == 0 || eh->num_slots > room / eh->slot_bytes) {
    return "num_slots does not fit in the extent";
  }
  if (uint64_t{eh->num_slots} * eh->slot_bytes != room) return "num_slots * slot_bytes != size";
  if (eh->num_slots > MaxSlotsPerExtent(eh->slot_bytes)) return "more slots than extents hold";
  return nullptr;
}

void BlockStore::DropExtentLocked(RebuildReport* report, uint32_t dir_slot, uint64_t offset,
                                  const char* why) {
  if (report->extents_corrupt < kMaxLoggedDrops) {
    HIQ_LOG(WARN) << "event=pool_extent_dropped dir_slot=" << dir_slot << " offset=" << offset
                  << " bytes=" << directory_[dir_slot].bytes << " reason=\"" << why << "\"";
  }
  report->extents_corrupt += 1;
  directory_[dir_slot] = ExtentDirEntry{};
  free_dir_slots_.push_back(dir_slot);
}

bool BlockStore::Rebuild(unsigned threads, RebuildReport* report) {
  const auto* ph = reinterpret_cast<const PoolHeader*>(base_);
  if (bytes_ <= meta_bytes_ || ph->magic != kPoolMagic) {
    report->reason = "no pool header (new pool)";
    return false;
  }
  if (ph->version != kPoolFormatVersion || ph->pool_bytes != bytes_ ||
      ph->directory_entries != directory_entries_) {
    report->reason = "pool header of another format or size";
    return false;
  }
  MutexLock lock(&mu_);
  // Extents named by the directory, checked against the pool bounds and each other.
  std::vector<std::pair<uint64_t, uint32_t>> order;  // offset, dir slot
  for (uint64_t i = 0; i < directory_entries_; ++i) {
    const ExtentDirEntry& d = directory_[i];
    if (d.bytes == 0) {
      free_dir_slots_.push_back(static_cast<uint32_t>(i));
      continue;
    }
    order.emplace_back(d.offset, static_cast<uint32_t>(i));
  }
  std::reverse(free_dir_slots_.begin(), free_dir_slots_.end());
  std::sort(order.begin(), order.end());
  std::map<NamespaceHash, NsState*> by_hash;
  std::vector<BlockEntry*> candidates;
  uint64_t cursor = meta_bytes_;
  for (const auto& [offset, slot] : order) {
    ExtentDirEntry& d = directory_[slot];
    const char* why = CheckExtent(d, offset, cursor);
    if (why != nullptr) {
      DropExtentLocked(report, slot, offset, why);
      continue;
    }
    const auto* eh = reinterpret_cast<const ExtentHeader*>(base_ + offset);
    NamespaceHash hash;
    std::memcpy(hash.data(), eh->namespace_hash, 16);
    NsState*& ns = by_hash[hash];
    if (ns == nullptr) {
      auto created = std::make_unique<NsState>();
      created->id = next_orphan_id_++;
      created->hash = hash;
      created->payload_bytes = eh->payload_bytes;
      created->slot_bytes = eh->slot_bytes;
      created->slots_per_extent = static_cast<uint32_t>(MaxSlotsPerExtent(created->slot_bytes));
      // Shown in stats and logs until a registration adopts it: printable ASCII only.
      created->text.assign(eh->namespace_text,
                           strnlen(eh->namespace_text, sizeof(eh->namespace_text)));
      for (char& c : created->text) {
        if (c < 0x20 || c > 0x7e) c = '?';
      }
      created->counters.capacity_blocks = CapacityBlocks(created->payload_bytes);
      ns = created.get();
      namespaces_.emplace(created->id, std::move(created));
    } else if (ns->payload_bytes != eh->payload_bytes) {
      DropExtentLocked(report, slot, offset, "payload_bytes differs from its namespace's");
      continue;
    }
    if (offset > cursor) free_space_.Add(cursor, offset - cursor);
    cursor = offset + d.bytes;
    auto ext = std::make_unique<StoreExtent>();
    ext->offset = offset;
    ext->bytes = d.bytes;
    ext->dir_slot = slot;
    ext->ns = ns->id;
    ext->entries.resize(eh->num_slots);
    for (uint32_t i = 0; i < eh->num_slots; ++i) {
      BlockEntry& e = ext->entries[i];
      e.extent = ext.get();
      e.slot = i;
      e.ns = ns->id;
      e.offset = offset + kExtentHeaderBytes + uint64_t{i} * eh->slot_bytes;
      const BlockHeader* bh = HeaderOf(&e);
      const auto state = static_cast<BlockState>(bh->state);
      if (bh->magic == kBlockMagic && state == BlockState::kCommitted &&
          bh->payload_bytes == ns->payload_bytes &&
          std::memcmp(&bh->namespace_tag, hash.data(), 8) == 0) {
        candidates.push_back(&e);
      } else if (bh->magic == kBlockMagic && state == BlockState::kWriting) {
        report->blocks_incomplete += 1;
      } else if (bh->magic != kBlockMagic || state != BlockState::kFree) {
        report->blocks_corrupt += 1;
      }
    }
    Extent* raw = ext.get();
    extents_.push_front(std::move(ext));
    raw->self = extents_.begin();
    ns->extents.push_back(raw);
    report->extents += 1;
  }
  if (cursor < bytes_) free_space_.Add(cursor, bytes_ - cursor);

  // Verify payload checksums in parallel: a pool of hundreds of GiB is read once at start.
  std::vector<uint8_t> good(candidates.size(), 0);
  {
    std::atomic<size_t> next{0};
    std::vector<std::thread> workers;
    for (unsigned t = 0; t < std::max(1u, threads); ++t) {
      workers.emplace_back([&] {
        for (size_t i = next++; i < candidates.size(); i = next++) {
          const BlockHeader* bh = HeaderOf(candidates[i]);
          good[i] = XXH3_64bits(reinterpret_cast<const uint8_t*>(bh) + kBlockHeaderBytes,
                                bh->payload_bytes) == bh->checksum;
        }
      });
    }
    for (auto& w : workers) w.join();
  }
  std::vector<BlockEntry*> kept;
  for (size_t i = 0; i < candidates.size(); ++i) {
    BlockEntry* e = candidates[i];
    const BlockHeader* bh = HeaderOf(e);
    BlockKey key;
    std::memcpy(key.data(), bh->key, 16);
    if (!good[i] || index_.count({e->ns, key})) {
      report->blocks_corrupt += 1;  // payload torn or altered, or a key held twice
      continue;
    }
    e->key = key;
    e->state = BlockState::kCommitted;
    e->indexed = true;
    e->last_use = bh->commit_seq;
    index_.emplace(std::make_pair(e->ns, key), e);
    kept.push_back(e);
  }
  // Recency: most recently committed first. The commit sequences are renumbered 1..n in that
  // order (headers too), so that the clock starts from the number of blocks kept, whatever
  // sequence numbers the headers held: one near 2^64 would otherwise wrap it.
  std::sort(kept.begin(), kept.end(), [](const BlockEntry* a, const BlockEntry* b) {
    return a->last_use != b->last_use ? a->last_use > b->last_use : a->offset < b->offset;
  });
  clock_ = kept.size();
  for (size_t i = 0; i < kept.size(); ++i) {
    kept[i]->last_use = kept.size() - i;
    HeaderOf(kept[i])->commit_seq = kept[i]->last_use;
  }
  for (BlockEntry* e : kept) {
    NsState& ns = *namespaces_.at(e->ns);
    ns.lru.push_back(e);
    e->lru_it = std::prev(ns.lru.end());
    e->in_lru = true;
    ns.counters.blocks += 1;
    ns.counters.bytes += ns.slot_bytes;
    used_bytes_ += ns.slot_bytes;
    ++live_blocks_;
  }
  // Every other slot is free (headers of dropped blocks say so from now on).
  for (auto& ext : extents_) {
    NsState& ns = *namespaces_.at(ext->ns);
    for (uint32_t i = ext->entries.size(); i-- > 0;) {
      BlockEntry& e = ext->entries[i];
      if (e.state == BlockState::kCommitted) continue;
      BlockHeader* bh = HeaderOf(&e);
      if (bh->magic != kBlockMagic || bh->state != static_cast<uint32_t>(BlockState::kFree)) {
        std::memset(bh, 0, sizeof(BlockHeader));
        bh->magic = kBlockMagic;
      }
      ext->free_slots.push_back(i);
    }
    if (!ext->free_slots.empty()) {
      ext->in_partial = true;
      ns.partial.push_back(ext.get());
    }
  }
  report->blocks_kept = kept.size();
  report->namespaces = by_hash.size();
  return true;
}

}  // namespace hiqcache::server
