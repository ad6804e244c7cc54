#include "pool/block_store.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <string_view>

#include "hiqcache/log.h"
#include "hiqcache/xxh3.h"
#include "pool/block_store_internal.h"

namespace hiqcache::server {
namespace {

constexpr uint64_t kFirstExtentBytes = 1ull << 20;
constexpr size_t kLookupProbesPerHold = 4096;

void StoreState(BlockHeader* h, BlockState s) {
  std::atomic_ref<uint32_t>(h->state).store(static_cast<uint32_t>(s), std::memory_order_release);
}

}  // namespace

size_t BlockStore::KeyHash::operator()(const std::pair<uint32_t, BlockKey>& k) const {
  uint64_t a, b;
  std::memcpy(&a, k.second.data(), 8);
  std::memcpy(&b, k.second.data() + 8, 8);
  return static_cast<size_t>(a ^ (b * 0x9E3779B97F4A7C15ull) ^ (uint64_t{k.first} << 47));
}

BlockStore::BlockStore(uint8_t* base, size_t bytes) : BlockStore(base, bytes, false, 1, nullptr) {}

namespace {
StoreOptions OptionsOf(bool reattach, unsigned threads, uint64_t granule) {
  StoreOptions o;
  o.reattach = reattach;
  o.rebuild_threads = threads;
  o.granule = granule;
  return o;
}
}  // namespace

BlockStore::BlockStore(uint8_t* base, size_t bytes, bool reattach, unsigned threads,
                       RebuildReport* report, uint64_t granule)
    : BlockStore(base, bytes, OptionsOf(reattach, threads, granule), report) {}

BlockStore::BlockStore(uint8_t* base, size_t bytes, const StoreOptions& options,
                       RebuildReport* report)
    : base_(base),
      bytes_(bytes),
      granule_(options.granule != 0 ? options.granule : kPoolRegisterChunkBytes),
      verify_reads_one_in_(options.verify_reads_one_in),
      meta_bytes_(PoolMetaBytes(bytes)),
      directory_(reinterpret_cast<ExtentDirEntry*>(base + kPoolHeaderBytes)),
      directory_entries_(DirectoryEntriesFor(bytes)),
      free_space_(granule_) {
  RebuildReport local;
  if (report == nullptr) report = &local;
  *report = RebuildReport();
  if (!options.reattach) {
    report->reason = "not asked to reattach";
  } else if (Rebuild(options.rebuild_threads, report)) {
    report->reattached = true;
    return;
  }
  Format();
}

void BlockStore::Format() {
  MutexLock lock(&mu_);
  extents_.clear();
  index_.clear();
  for (auto& [id, ns] : namespaces_) {
    ns->extents.clear();
    ns->partial.clear();
    ns->lru.clear();
    ns->counters.blocks = 0;
    ns->counters.bytes = 0;
  }
  used_bytes_ = 0;
  live_blocks_ = 0;
  free_space_.Clear();
  auto* ph = reinterpret_cast<PoolHeader*>(base_);
  std::memset(ph, 0, sizeof(PoolHeader));
  if (bytes_ <= meta_bytes_) return;
  std::memset(directory_, 0, directory_entries_ * sizeof(ExtentDirEntry));
  free_dir_slots_.clear();
  for (uint64_t i = directory_entries_; i-- > 0;)
    free_dir_slots_.push_back(static_cast<uint32_t>(i));
  free_space_.Add(meta_bytes_, bytes_ - meta_bytes_);
  ph->version = kPoolFormatVersion;
  ph->directory_entries = static_cast<uint32_t>(directory_entries_);
  ph->pool_bytes = bytes_;
  std::atomic_ref<uint64_t>(ph->magic).store(kPoolMagic, std::memory_order_release);
}

BlockStore::~BlockStore() = default;

BlockHeader* BlockStore::HeaderOf(const BlockEntry* e) const {
  return reinterpret_cast<BlockHeader*>(base_ + e->offset);
}

void BlockStore::IndexEntryLocked(NsState& ns, BlockEntry* e) {
  e->ns = ns.id;
  if (e->indexed) index_.emplace(std::make_pair(ns.id, e->key), e);
}

BlockStore::NsState* BlockStore::AdoptOrphanLocked(const StoreNamespace& info) {
  for (auto it = namespaces_.begin(); it != namespaces_.end(); ++it) {
    NsState& orphan = *it->second;
    if (orphan.id < kFirstOrphanId || orphan.hash != info.hash) continue;
    if (orphan.payload_bytes != info.payload_bytes) {
      // The hash names the geometry, so these blocks are of no namespace any registration can
      // make (a poisoned or foreign pool): drop them, or this namespace's next rebuild would
      // meet two payload sizes under one hash.
      DropOrphanLocked(it);
      return nullptr;
    }
    auto owned = std::move(it->second);
    namespaces_.erase(it);
    const uint32_t old_id = owned->id;
    owned->id = info.id;
    owned->text = info.text;
    owned->owner = info.owner;
    for (Extent* ext : owned->extents) {
      ext->ns = info.id;
      for (auto& e : ext->entries) {
        if (e.indexed) index_.erase({old_id, e.key});
        IndexEntryLocked(*owned, &e);
      }
    }
    NsState* raw = owned.get();
    namespaces_.emplace(info.id, std::move(owned));
    return raw;
  }
  return nullptr;
}

void BlockStore::DropOrphanLocked(
    std::unordered_map<uint32_t, std::unique_ptr<NsState>>::iterator it) {
  NsState& orphan = *it->second;
  for (Extent* ext : orphan.extents) {
    for (const auto& e : ext->entries) {
      if (e.pins != 0) return;  // no reader knows an orphan's id; kept if one ever did
    }
  }
  HIQ_LOG(WARN) << "event=pool_orphan_dropped blocks=" << orphan.counters.blocks
                << " payload_bytes=" << orphan.payload_bytes
                << " reason=\"its namespace hash is registered with another payload size\"";
  while (!orphan.extents.empty()) {
    Extent* ext = orphan.extents.back();
    for (auto& e : ext->entries) {
      if (e.state != BlockState::kFree) EvictEntryLocked(&e);
    }
    FreeExtentLocked(ext);
  }
  emptied_.erase(orphan.id);
  namespaces_.erase(it);
}

bool BlockStore::HoldsOrphan(const NamespaceHash& hash, uint64_t payload_bytes) const {
  MutexLock lock(&mu_);
  for (const auto& [id, ns] : namespaces_) {
    if (id >= kFirstOrphanId && ns->hash == hash) {
      return ns->payload_bytes == payload_bytes && ns->counters.blocks > 0;
    }
  }
  return false;
}

bool BlockStore::RemoveNamespace(uint32_t ns_id) {
  MutexLock lock(&mu_);
  auto it = namespaces_.find(ns_id);
  if (it == namespaces_.end()) return true;
  NsState& ns = *it->second;
  if (ns.counters.blocks != 0) return false;
  // Every slot is free, so no entry is indexed, in an LRU or pinned.
  while (!ns.extents.empty()) FreeExtentLocked(ns.extents.back());
  emptied_.erase(ns_id);
  namespaces_.erase(it);
  return true;
}

std::vector<uint32_t> BlockStore::TakeEmptiedNamespaces() {
  MutexLock lock(&mu_);
  std::vector<uint32_t> out;
  out.reserve(emptied_.size());
  for (uint32_t id : emptied_) {
    auto it = namespaces_.find(id);
    if (it == namespaces_.end()) continue;
    if (id >= kFirstOrphanId) {
      NsState& orphan = *it->second;
      if (orphan.counters.blocks != 0) continue;
      while (!orphan.extents.empty()) FreeExtentLocked(orphan.extents.back());
      namespaces_.erase(it);
      continue;
    }
    out.push_back(id);
  }
  emptied_.clear();
  return out;
}

bool BlockStore::AddNamespace(const StoreNamespace& info) {
  MutexLock lock(&mu_);
  if (namespaces_.count(info.id)) return false;
  if (AdoptOrphanLocked(info) != nullptr) return true;
  auto ns = std::make_unique<NsState>();
  ns->id = info.id;
  ns->payload_bytes = info.payload_bytes;
  ns->slot_bytes = SlotBytesFor(ns->payload_bytes);
  ns->slots_per_extent =
      static_cast<uint32_t>(std::max<uint64_t>(1, kTargetExtentBytes / ns->slot_bytes));
  ns->hash = info.hash;
  ns->text = info.text;
  ns->owner = info.owner;
  ns->counters.capacity_blocks = CapacityBlocks(ns->payload_bytes);
  namespaces_.emplace(info.id, std::move(ns));
  return false;
}

uint64_t BlockStore::CapacityBlocks(size_t payload_bytes) const {
  const uint64_t slot = SlotBytesFor(payload_bytes);
  const uint64_t per_extent = std::max<uint64_t>(1, kTargetExtentBytes / slot);
  const uint64_t extent_bytes = kExtentHeaderBytes + per_extent * slot;
  if (bytes_ <= meta_bytes_) return 0;
  const uint64_t usable = bytes_ - meta_bytes_;
  const uint64_t full = usable / extent_bytes;
  const uint64_t rem = usable % extent_bytes;
  uint64_t blocks = full * per_extent;
  if (rem > kExtentHeaderBytes) blocks += (rem - kExtentHeaderBytes) / slot;
  return blocks;
}

void BlockStore::TouchLocked(BlockEntry* e) {
  e->last_use = ++clock_;
  if (e->in_lru) {
    auto& lru = namespaces_.at(e->ns)->lru;
    lru.splice(lru.begin(), lru, e->lru_it);
  }
}

uint32_t BlockStore::LookupPrefix(std::span<const uint32_t> ns, std::span<const BlockKey> keys) {
  std::vector<uint32_t> ids(ns.begin(), ns.end());
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  // A lookup holds the lock for at most kLookupProbesPerHold index probes, then lets others in:
  // a group lookup of 64 namespaces x 65,536 keys must not stall every other caller's.
  const size_t keys_per_hold =
      std::max<size_t>(1, kLookupProbesPerHold / std::max<size_t>(1, ids.size()));
  MutexLock lock(&mu_);
  auto all_known = [&]() REQUIRES(mu_) {
    for (uint32_t id : ids) {
      if (namespaces_.count(id) == 0) return false;
    }
    return !ids.empty();
  };
  uint32_t n = 0;
  bool stopped = !all_known();
  std::vector<BlockEntry*> run;  // key-major: run[i * ids.size() + j] is key i in ids[j]
  while (!stopped && n < keys.size()) {
    const size_t end = std::min(keys.size(), size_t{n} + keys_per_hold);
    run.clear();
    for (size_t i = n; i < end && !stopped; ++i) {
      const size_t before = run.size();
      for (uint32_t id : ids) {
        auto it = index_.find({id, keys[i]});
        if (it == index_.end() || it->second->state != BlockState::kCommitted) break;
        run.push_back(it->second);
      }
      if (run.size() - before != ids.size()) {
        run.resize(before);
        stopped = true;
        break;
      }
      ++n;
    }
    for (BlockEntry* e : run) TouchLocked(e);
    if (stopped || n == keys.size()) break;
    lock.Unlock();
    lock.Lock();
    stopped = !all_known();  // a namespace removed meanwhile holds nothing more
  }
  for (uint32_t id : ids) {
    auto it = namespaces_.find(id);
    if (it == namespaces_.end()) continue;
    it->second->counters.hits += n;
    it->second->counters.misses += keys.size() - n;
  }
  return n;
}

BlockEntry* BlockStore::TakeFreeSlotLocked(NsState& ns) {
  while (!ns.partial.empty()) {
    Extent* ext = ns.partial.back();
    if (ext->free_slots.empty()) {
      ext->in_partial = false;
      ns.partial.pop_back();
      continue;
    }
    uint32_t slot = ext->free_slots.back();
    ext->free_slots.pop_back();
    return &ext->entries[slot];
  }
  return nullptr;
}

bool BlockStore::AllocateExtentLocked(NsState& ns) {
  // Sized to demand: a namespace's first extent holds kFirstExtentBytes of slots (at least one),
  // each later one as many slots as the namespace has already (its holdings double), up to
  // kTargetExtentBytes. So a namespace that stores one small block claims about 1 MiB of the
  // pool, not 64 MiB, and one that grows reaches full extents after a few.
  uint64_t have = 0;
  for (const Extent* e : ns.extents) have += e->entries.size();
  const uint64_t first = std::max<uint64_t>(1, kFirstExtentBytes / ns.slot_bytes);
  const uint64_t demand = std::min<uint64_t>(ns.slots_per_extent, std::max<uint64_t>(first, have));
  const uint64_t want = kExtentHeaderBytes + demand * ns.slot_bytes;
  const uint64_t min_bytes = kExtentHeaderBytes + ns.slot_bytes;
  const std::optional<FreeRange> pick = free_space_.Find(want, min_bytes);
  if (!pick || free_dir_slots_.empty()) return false;
  const uint64_t offset = pick->offset;
  const uint64_t avail = pick->bytes;
  const uint32_t slots = static_cast<uint32_t>(
      std::min<uint64_t>(demand, (avail - kExtentHeaderBytes) / ns.slot_bytes));
  const uint64_t bytes = kExtentHeaderBytes + uint64_t{slots} * ns.slot_bytes;
  free_space_.Take(*pick, bytes);

  auto ext = std::make_unique<Extent>();
  ext->offset = offset;
  ext->bytes = bytes;
  ext->ns = ns.id;
  ext->entries.resize(slots);
  ext->free_slots.reserve(slots);
  auto* eh = reinterpret_cast<ExtentHeader*>(base_ + offset);
  std::memset(eh, 0, sizeof(ExtentHeader));
  eh->extent_bytes = bytes;
  eh->slot_bytes = ns.slot_bytes;
  eh->payload_bytes = ns.payload_bytes;
  eh->num_slots = slots;
  std::memcpy(eh->namespace_hash, ns.hash.data(), 16);
  std::strncpy(eh->namespace_text, ns.text.c_str(), sizeof(eh->namespace_text) - 1);
  for (uint32_t i = 0; i < slots; ++i) {
    BlockEntry& e = ext->entries[i];
    e.extent = ext.get();
    e.slot = i;
    e.ns = ns.id;
    e.offset = offset + kExtentHeaderBytes + uint64_t{i} * ns.slot_bytes;
    auto* bh = HeaderOf(&e);
    std::memset(bh, 0, sizeof(BlockHeader));
    bh->magic = kBlockMagic;
    ext->free_slots.push_back(slots - 1 - i);
  }
  std::atomic_ref<uint64_t>(eh->magic).store(kExtentMagic, std::memory_order_release);
  ext->dir_slot = free_dir_slots_.back();
  free_dir_slots_.pop_back();
  directory_[ext->dir_slot].offset = offset;
  std::atomic_ref<uint64_t>(directory_[ext->dir_slot].bytes)
      .store(bytes, std::memory_order_release);
  Extent* raw = ext.get();
  extents_.push_front(std::move(ext));
  raw->self = extents_.begin();
  ns.extents.push_back(raw);
  raw->in_partial = true;
  ns.partial.push_back(raw);
  return true;
}

void BlockStore::FreeExtentLocked(Extent* ext) {
  NsState& ns = *namespaces_.at(ext->ns);
  std::erase(ns.extents, ext);
  std::erase(ns.partial, ext);
  std::atomic_ref<uint64_t>(directory_[ext->dir_slot].bytes).store(0, std::memory_order_release);
  free_dir_slots_.push_back(ext->dir_slot);
  std::atomic_ref<uint64_t>(reinterpret_cast<ExtentHeader*>(base_ + ext->offset)->magic)
      .store(0, std::memory_order_release);
  free_space_.Free(ext->offset, ext->bytes);
  extents_.erase(ext->self);
}

void BlockStore::FreeSlotLocked(BlockEntry* e) {
  NsState& ns = *namespaces_.at(e->ns);
  StoreState(HeaderOf(e), BlockState::kFree);
  e->state = BlockState::kFree;
  e->pins = 0;
  used_bytes_ -= ns.slot_bytes;
  --live_blocks_;
  ns.counters.blocks -= 1;
  ns.counters.bytes -= ns.slot_bytes;
  if (ns.counters.blocks == 0) emptied_.insert(ns.id);
  Extent* ext = e->extent;
  ext->free_slots.push_back(e->slot);
  if (!ext->in_partial) {
    ext->in_partial = true;
    ns.partial.push_back(ext);
  }
}

void BlockStore::UnindexLocked(BlockEntry* e) {
  if (e->indexed) {
    index_.erase({e->ns, e->key});
    e->indexed = false;
  }
  if (e->in_lru) {
    namespaces_.at(e->ns)->lru.erase(e->lru_it);
    e->in_lru = false;
  }
}

void BlockStore::EvictEntryLocked(BlockEntry* e) {
  UnindexLocked(e);
  namespaces_.at(e->ns)->counters.evictions += 1;
  // A pinned block leaves the index now and frees its slot on the last unpin.
  if (e->pins == 0) FreeSlotLocked(e);
}

void BlockStore::EvictForRoomLocked(BlockEntry* e) {
  if (sink_ && e->state == BlockState::kCommitted && !e->from_l3) {
    const NsState& ns = *namespaces_.at(e->ns);
    sink_(EvictedBlock{
        ns.hash, e->key,
        std::span<const uint8_t>(base_ + e->offset + kBlockHeaderBytes, ns.payload_bytes),
        HeaderOf(e)->checksum});
  }
  EvictEntryLocked(e);
}

void BlockStore::SetEvictionSink(EvictionSink sink) {
  MutexLock lock(&mu_);
  sink_ = std::move(sink);
}

bool BlockStore::ReclaimLocked(NsState& ns) {
  // Candidate 1: this namespace's least recently used unpinned block.
  BlockEntry* own = nullptr;
  for (auto it = ns.lru.rbegin(); it != ns.lru.rend(); ++it) {
    if ((*it)->pins == 0) {
      own = *it;
      break;
    }
  }
  // Candidate 2: another namespace's extent with nothing pinned, whose newest use is oldest. Each
  // owner (a uid, or a uid and pod) keeps its fair share of the pool, the capacity over the
  // owners holding extents: another owner's extent is a candidate only while that owner claims
  // more than its share (orphans of a rebuilt pool always are).
  auto& claimed = claimed_scratch_;  // reused: no allocation per reclaim once warm
  claimed.clear();
  claimed[ns.owner] += 0;
  for (const auto& ext : extents_) {
    const NsState& theirs = *namespaces_.at(ext->ns);
    if (theirs.id < kFirstOrphanId) claimed[theirs.owner] += ext->bytes;
  }
  const uint64_t share = CapacityBytes() / claimed.size();
  Extent* other = nullptr;
  uint64_t other_newest = 0;
  for (const auto& ext : extents_) {
    if (ext->ns == ns.id) continue;
    const NsState& theirs = *namespaces_.at(ext->ns);
    if (theirs.id < kFirstOrphanId && theirs.owner != ns.owner && claimed[theirs.owner] <= share) {
      continue;
    }
    uint64_t newest = 0;
    bool busy = false;
    for (const auto& e : ext->entries) {
      if (e.state == BlockState::kFree) continue;
      if (e.pins != 0) {
        busy = true;
        break;
      }
      newest = std::max(newest, e.last_use);
    }
    if (busy) continue;
    if (other == nullptr || newest < other_newest) {
      other = ext.get();
      other_newest = newest;
    }
  }
  if (own != nullptr && (other == nullptr || own->last_use <= other_newest)) {
    EvictForRoomLocked(own);
    return true;
  }
  if (other == nullptr) return false;
  for (auto& e : other->entries) {
    if (e.state != BlockState::kFree) EvictForRoomLocked(&e);
  }
  FreeExtentLocked(other);
  return true;
}

BlockEntry* BlockStore::AllocateSlotLocked(NsState& ns) {
  for (;;) {
    if (BlockEntry* e = TakeFreeSlotLocked(ns)) return e;
    if (AllocateExtentLocked(ns)) continue;
    if (!ReclaimLocked(ns)) return nullptr;
  }
}

std::vector<BlockStore::WriteReservation> BlockStore::ReserveWrites(
    uint32_t ns_id, std::span<const BlockKey> keys) {
  std::vector<WriteReservation> out(keys.size());
  MutexLock lock(&mu_);
  auto nit = namespaces_.find(ns_id);
  if (nit == namespaces_.end()) return out;  // unknown (or removed): every key kNoSpace
  NsState& ns = *nit->second;
  for (size_t i = 0; i < keys.size(); ++i) {
    auto it = index_.find({ns_id, keys[i]});
    if (it != index_.end()) {
      if (it->second->state == BlockState::kCommitted) TouchLocked(it->second);
      out[i].outcome = WriteOutcome::kPresent;
      continue;
    }
    BlockEntry* e = AllocateSlotLocked(ns);
    if (e == nullptr) {
      out[i].outcome = WriteOutcome::kNoSpace;
      ns.counters.rejected += 1;
      continue;
    }
    e->key = keys[i];
    e->state = BlockState::kWriting;
    e->from_l3 = false;
    e->pins = 1;
    e->indexed = true;
    e->last_use = ++clock_;
    index_.emplace(std::make_pair(ns_id, keys[i]), e);
    used_bytes_ += ns.slot_bytes;
    ++live_blocks_;
    ns.counters.blocks += 1;
    ns.counters.bytes += ns.slot_bytes;
    BlockHeader* h = HeaderOf(e);
    StoreState(h, BlockState::kWriting);
    std::memcpy(h->key, keys[i].data(), 16);
    std::memcpy(&h->namespace_tag, ns.hash.data(), 8);
    h->payload_bytes = ns.payload_bytes;
    h->checksum = 0;
    out[i].outcome = WriteOutcome::kReserved;
    out[i].handle = e;
    out[i].payload = base_ + e->offset + kBlockHeaderBytes;
  }
  return out;
}

void BlockStore::CommitWrite(BlockHandle e, uint64_t checksum, bool from_l3) {
  MutexLock lock(&mu_);
  NsState& ns = *namespaces_.at(e->ns);
  BlockHeader* h = HeaderOf(e);
  h->checksum = checksum;
  h->commit_seq = ++clock_;
  StoreState(h, BlockState::kCommitted);
  if (!from_l3) ns.counters.backups += 1;
  e->from_l3 = from_l3;
  if (--e->pins == 0 && !e->indexed) {  // evicted while being written
    FreeSlotLocked(e);
    return;
  }
  e->state = BlockState::kCommitted;
  if (e->indexed) {
    e->last_use = clock_;
    ns.lru.push_front(e);
    e->lru_it = ns.lru.begin();
    e->in_lru = true;
  }
}

void BlockStore::AbortWrite(BlockHandle e, bool rejected) {
  MutexLock lock(&mu_);
  NsState& ns = *namespaces_.at(e->ns);
  if (rejected) ns.counters.rejected += 1;
  if (e->indexed) {
    index_.erase({e->ns, e->key});
    e->indexed = false;
  }
  if (--e->pins == 0) FreeSlotLocked(e);
}

std::vector<BlockStore::ReadPin> BlockStore::PinReads(uint32_t ns_id,
                                                      std::span<const BlockKey> keys) {
  std::vector<ReadPin> out;
  std::vector<uint8_t> verify;  // per pin: hash it before handing it out
  NsState* ns = nullptr;
  {
    MutexLock lock(&mu_);
    auto nit = namespaces_.find(ns_id);
    if (nit == namespaces_.end()) return out;
    ns = nit->second.get();
    for (const auto& key : keys) {
      auto it = index_.find({ns_id, key});
      if (it == index_.end() || it->second->state != BlockState::kCommitted) break;
      BlockEntry* e = it->second;
      ++e->pins;
      TouchLocked(e);
      out.push_back({e, base_ + e->offset + kBlockHeaderBytes});
      ++reads_;
      verify.push_back(verify_reads_one_in_ != 0 && reads_ % verify_reads_one_in_ == 0);
    }
    ns->counters.restores += out.size();
    if (std::find(verify.begin(), verify.end(), 1) == verify.end()) return out;
  }
  // Hashed without the lock: a committed, pinned block's payload and header do not change (the
  // pin keeps its slot from reuse; a namespace holding a pinned block is never removed).
  const uint64_t payload_bytes = ns->payload_bytes;
  size_t good = out.size();
  for (size_t i = 0; i < out.size(); ++i) {
    if (verify[i] &&
        XXH3_64bits(out[i].payload, payload_bytes) != HeaderOf(out[i].handle)->checksum) {
      good = i;
      break;
    }
  }
  if (good == out.size()) return out;
  MutexLock lock(&mu_);
  BlockEntry* bad = out[good].handle;
  if (bad->indexed) {  // a concurrent read of the same block may have dropped it already
    HIQ_LOG(WARN) << "event=pool_block_corrupt ns=" << ns_id << " offset=" << bad->offset
                  << " reason=\"payload does not match its checksum\"";
    UnindexLocked(bad);
    corrupt_ += 1;
    ns->counters.corrupt += 1;
  }
  for (size_t i = good; i < out.size(); ++i) {
    BlockEntry* e = out[i].handle;
    if (--e->pins == 0 && !e->indexed) FreeSlotLocked(e);
  }
  ns->counters.restores -= out.size() - good;
  out.resize(good);
  return out;
}

bool BlockStore::PinCommitted(uint32_t ns_id, const BlockKey& key, uint64_t namespace_tag,
                              ReadPin* pin, uint64_t* checksum) {
  MutexLock lock(&mu_);
  auto it = index_.find({ns_id, key});
  if (it == index_.end() || it->second->state != BlockState::kCommitted) return false;
  BlockEntry* e = it->second;
  const BlockHeader* h = HeaderOf(e);
  if (h->namespace_tag != namespace_tag) return false;
  ++e->pins;
  pin->handle = e;
  pin->payload = base_ + e->offset + kBlockHeaderBytes;
  *checksum = h->checksum;
  return true;
}

void BlockStore::Unpin(BlockHandle e) {
  MutexLock lock(&mu_);
  if (--e->pins == 0 && !e->indexed) FreeSlotLocked(e);
}

uint32_t BlockStore::Evict(uint32_t ns_id, std::span<const BlockKey> keys) {
  MutexLock lock(&mu_);
  uint32_t n = 0;
  for (const auto& key : keys) {
    auto it = index_.find({ns_id, key});
    if (it == index_.end() || it->second->state != BlockState::kCommitted) continue;
    EvictEntryLocked(it->second);
    ++n;
  }
  return n;
}

StoreStats BlockStore::Stats() const {
  MutexLock lock(&mu_);
  StoreStats s;
  s.pool_bytes = bytes_;
  s.capacity_bytes = CapacityBytes();
  s.used_bytes = used_bytes_;
  for (const auto& e : extents_) s.claimed_bytes += e->bytes;
  s.blocks = live_blocks_;
  s.corrupt = corrupt_;
  for (const auto& [id, ns] : namespaces_) s.namespaces[id] = ns->counters;
  return s;
}

}  // namespace hiqcache::server
