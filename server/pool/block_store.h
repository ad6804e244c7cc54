// BlockStore: the pool's blocks, their index and their eviction (the "pool: shared memory, L2"
// box of docs/design.md's data flow).
//
// The pool is carved into extents; each extent holds fixed-size slots of one namespace (one slot =
// a 64-byte BlockHeader + the block payload). Extents are sized to demand (a namespace's first
// holds 1 MiB of slots, each later one as many slots as the namespace has, up to 64 MiB),
// allocated first-fit from free ranges, and the last one is truncated to what is left, so a pool
// filled by one namespace has all but less than one slot of its bytes in slots. Index: (namespace,
// key) -> block. Eviction: LRU of unpinned blocks; when a namespace needs room it either evicts its
// own least recently used block or, if another namespace's extent went unused for longer, frees
// that whole extent, provided the extent's owner (NamespaceDesc::scope: a uid, or a uid and pod)
// claims more than its fair share of the pool (the capacity over the owners holding extents): no
// owner loses blocks to another while it holds no more than its share. Blocks being written or read
// are pinned and never evicted; a block evicted while pinned leaves the index at once and gives its
// slot back on the last unpin.
//
// Block headers are written as blocks change state so that a restarted daemon can rebuild the
// index from the pool (pool_format.h). Thread-safe: one mutex guards the metadata; payload bytes
// are written and read outside it, protected by pins.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "hiqcache/block_id.h"
#include "hiqcache/mutex.h"
#include "pool/extent_allocator.h"
#include "pool/pool_format.h"

namespace hiqcache::server {

// What the store keeps of a namespace: the core's NamespaceInfo::ForStore().
struct StoreNamespace {
  uint32_t id = 0;
  NamespaceHash hash{};
  uint64_t payload_bytes = 0;  // one block as stored
  std::string text;            // its canonical text (GetStats, logs)
  std::string owner;           // its scope: extents are shared fairly between owners
};

struct BlockEntry;  // opaque to callers
struct StoreExtent;
using BlockHandle = BlockEntry*;

struct NamespaceCounters {
  uint64_t blocks = 0;
  uint64_t bytes = 0;  // slot bytes held by live blocks
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t backups = 0;
  uint64_t restores = 0;
  uint64_t evictions = 0;
  uint64_t rejected = 0;
  uint64_t corrupt = 0;  // as StoreStats::corrupt, for this namespace
  uint64_t capacity_blocks = 0;
};

struct StoreOptions {
  // Keep the blocks a previous daemon left in the pool (see the constructor); false formats it.
  bool reattach = false;
  unsigned rebuild_threads = 1;  // verify checksums at rebuild in parallel
  // No extent crosses a multiple of `granule` bytes from the pool base (kPoolRegisterChunkBytes:
  // the CUDA backend's registration chunks); a rebuilt extent that does is dropped.
  uint64_t granule = kPoolRegisterChunkBytes;
  // PinReads hashes a block's payload (XXH3-64) and compares it with its header's checksum
  // before handing it out, for one block read in `verify_reads_one_in`: 1 = every read, N > 1 =
  // every Nth block read store-wide, 0 = never. A block that fails is dropped from the index and
  // counted (StoreStats::corrupt); the read stops before it. Default: one read in 32. Measured
  // (AMD EPYC, AVX3, one thread, medians of 15): XXH3 over a Qwen3-8B 16-token block
  // (1,198,080 B) takes 57 us from DRAM and 55 us from cache, against 225 us and 96 us for the
  // block's INT8 decode, i.e. 25-57% of a HOST restore, and more than the ~48 us its PCIe copy
  // takes on a CUDA restore; verifying every read would cost far more than the 5% budget, one in
  // 32 costs 0.8-1.8%. The pool is written by the daemon only, and Rebuild verifies every block
  // at start-up, so what sampling can miss is corruption of a live block between start-up and
  // its reads; a deployment that wants every read checked sets 1.
  uint32_t verify_reads_one_in = 32;
};

struct StoreStats {
  uint64_t pool_bytes = 0;
  uint64_t capacity_bytes = 0;  // bytes available to extents
  uint64_t used_bytes = 0;      // slot bytes of live blocks
  // Bytes the namespaces' extents hold, free slots included: what is not free for the others.
  uint64_t claimed_bytes = 0;
  uint64_t blocks = 0;
  // Blocks PinReads found whose payload no longer matches its checksum: dropped, never read.
  uint64_t corrupt = 0;
  std::map<uint32_t, NamespaceCounters> namespaces;
};

// What a store found in a pool it reattached to.
struct RebuildReport {
  bool reattached = false;  // false: the pool was (re)formatted
  std::string reason;       // why it was formatted, when it was
  uint64_t extents = 0;
  uint64_t blocks_kept = 0;        // committed, checksum verified
  uint64_t blocks_incomplete = 0;  // being written when the previous daemon stopped: dropped
  uint64_t blocks_corrupt = 0;     // bad header or checksum: dropped
  // Extents whose directory entry or header does not fit the pool geometry (bounds, sizes,
  // counts, alignment, namespace): dropped with every block they held, space freed. The first
  // few are logged with the field that did not fit (event=pool_extent_dropped).
  uint64_t extents_corrupt = 0;
  uint64_t namespaces = 0;
};

class BlockStore {
 public:
  // Formats the pool at `base` (`bytes` long, mapped and writable for the store's lifetime).
  BlockStore(uint8_t* base, size_t bytes);
  // With `reattach`, keeps the blocks a previous daemon left in the pool: every committed block
  // whose header and checksum verify is indexed again (recency from its commit order) under its
  // namespace, which AddNamespace adopts by namespace hash; anything else is dropped. Falls back
  // to formatting when the pool header does not match. `threads` verify checksums in parallel.
  // No extent crosses a multiple of `granule` bytes from `base` (kPoolRegisterChunkBytes: the
  // CUDA backend's registration chunks); a rebuilt extent that does is dropped.
  BlockStore(uint8_t* base, size_t bytes, bool reattach, unsigned threads, RebuildReport* report,
             uint64_t granule = kPoolRegisterChunkBytes);
  // The same, with every option (StoreOptions); the constructors above keep its defaults.
  BlockStore(uint8_t* base, size_t bytes, const StoreOptions& options, RebuildReport* report);
  ~BlockStore();
  BlockStore(const BlockStore&) = delete;
  BlockStore& operator=(const BlockStore&) = delete;

  // Makes `ns` known to the store (payload size, extent sizing). Idempotent. When the rebuild
  // found blocks under ns.hash with ns's payload size, `ns` adopts them (and their counters);
  // returns whether this call did. Blocks found under ns.hash with another payload size belong
  // to no namespace a registration can make: they are dropped.
  bool AddNamespace(const StoreNamespace& ns);
  // Whether the rebuild found blocks under `hash` with `payload_bytes` payloads that no
  // AddNamespace has adopted yet, and at least one of them is still held: what AddNamespace of a
  // namespace with that hash would adopt. Lets a caller that must not create namespaces for
  // nothing (a lookup) create one only when the pool holds its blocks.
  bool HoldsOrphan(const NamespaceHash& hash, uint64_t payload_bytes) const;
  // Forgets namespace `ns_id` (the entry AddNamespace created, with its counters) when it holds
  // no block: none committed, none reserved for a write, none evicted but still pinned. Its
  // extents, all slots free, go back to the pool's free space, so the id may later be added
  // again with another geometry. Returns true when the namespace is gone (also when the store
  // never knew `ns_id`); false, changing nothing, while it holds a block. A namespace whose
  // blocks are all evicted is not removed by the store itself: its owner (the namespace table's
  // keeper) decides, since only it knows whether pools still use the namespace.
  bool RemoveNamespace(uint32_t ns_id);
  // The namespaces (ids AddNamespace was given) whose block count dropped to 0 since the last
  // call, each once, in no particular order: how the owner of a namespace that no pool uses any
  // more learns that RemoveNamespace would now succeed. A namespace listed may have gained
  // blocks again since (RemoveNamespace then returns false; it is listed again when it next
  // empties); one removed since is not listed. Namespaces the rebuild found and no AddNamespace
  // adopted are removed by this call itself once empty (they have no pools) and never listed.
  // Calling it lazily (e.g. after ReleasePool, or once a second) is enough: the list is bounded
  // by the number of namespaces.
  std::vector<uint32_t> TakeEmptiedNamespaces();
  // Bytes available to extents (StoreStats::capacity_bytes); constant, lock-free.
  uint64_t CapacityBytes() const { return bytes_ > meta_bytes_ ? bytes_ - meta_bytes_ : 0; }
  // Blocks of a namespace with this payload size that the whole pool holds, alone.
  uint64_t CapacityBlocks(size_t payload_bytes) const;

  // Length of the longest leading run of keys committed in `ns`; refreshes their recency and
  // counts hits (the run) and misses (the rest).
  uint32_t LookupPrefix(uint32_t ns, std::span<const BlockKey> keys) {
    return LookupPrefix(std::span<const uint32_t>(&ns, 1), keys);
  }
  // Length of the longest leading run of keys committed in every namespace of `ns` (a TP group),
  // each key seen in all of them at once. The lock is let go every 4,096 index probes, so a long
  // group lookup does not stall other callers; a key evicted after it was seen may make the run
  // stale by the time it is answered, as it may once any lookup returns. An id the store does
  // not know (kNoNamespace) holds nothing, so it makes the answer 0; an empty `ns` answers 0. In
  // each known namespace (a repeated id counts once), refreshes the recency of that run only and
  // counts hits (the run) and misses (the rest), as the one-namespace lookup does.
  uint32_t LookupPrefix(std::span<const uint32_t> ns, std::span<const BlockKey> keys);

  enum class WriteOutcome { kReserved, kPresent, kNoSpace };
  struct WriteReservation {
    WriteOutcome outcome = WriteOutcome::kNoSpace;
    BlockHandle handle = nullptr;  // kReserved only: pinned, state kWriting
    uint8_t* payload = nullptr;
  };
  // Reserves a slot for every key not yet present (a key repeated in `keys` is kPresent the
  // second time). Reserved blocks are invisible to lookups until CommitWrite. A namespace the
  // store does not know (never added, or removed) gets every key kNoSpace.
  std::vector<WriteReservation> ReserveWrites(uint32_t ns, std::span<const BlockKey> keys);
  // Publishes a fully written block (checksum of its payload) and unpins it. A backup counts in
  // its namespace's `backups`; a block promoted from L3 (`from_l3`) does not, and is not offered
  // to the eviction sink when it leaves (L3 holds it already).
  void CommitWrite(BlockHandle handle, uint64_t checksum, bool from_l3 = false);
  // Drops a reserved block (its payload is not valid); `rejected` counts it as rejected.
  void AbortWrite(BlockHandle handle, bool rejected);

  struct ReadPin {
    BlockHandle handle = nullptr;
    const uint8_t* payload = nullptr;
  };
  // Pins the leading run of committed keys for reading and returns it (possibly empty). Each
  // block is first checked against its checksum (StoreOptions::verify_reads_one_in), outside
  // the store's lock: the run ends before the first block whose payload does not match, which
  // leaves the index (StoreStats::corrupt counts it), so no altered payload is ever handed out.
  // Costs one pass over the payload bytes per verified block, on the calling thread.
  std::vector<ReadPin> PinReads(uint32_t ns, std::span<const BlockKey> keys);
  // Pins committed block `key` of `ns` to copy it out (the L3 writer): no restore is counted and
  // its recency is not refreshed. False (nothing pinned) when the block is not committed there,
  // or its header's namespace tag is not `namespace_tag` (an id reused by another namespace).
  // `*checksum` receives the block header's payload checksum. Unpin when done.
  bool PinCommitted(uint32_t ns, const BlockKey& key, uint64_t namespace_tag, ReadPin* pin,
                    uint64_t* checksum);
  void Unpin(BlockHandle handle);

  // Removes the keys of `ns` from the cache; returns how many were present. (Not offered to the
  // eviction sink: the caller asked for them to go.)
  uint32_t Evict(uint32_t ns, std::span<const BlockKey> keys);

  // A committed block the store is about to evict to make room (the L3 tier's on_evict policy
  // copies it out). `payload` is valid only during the call.
  struct EvictedBlock {
    const NamespaceHash& ns_hash;  // StoreNamespace::hash
    const BlockKey& key;
    std::span<const uint8_t> payload;
    uint64_t checksum;  // the block header's payload checksum (XXH3-64)
  };
  // Called with the store's lock held for every block evicted to make room (not for Evict, nor
  // for blocks dropped as corrupt or orphaned, nor for blocks promoted from L3), before its slot
  // is reused: it must not call the store and should return quickly (copy or drop). Setting it
  // (or clearing it with an empty function) waits for a call in progress. Default: none.
  using EvictionSink = std::function<void(const EvictedBlock&)>;
  void SetEvictionSink(EvictionSink sink);

  StoreStats Stats() const;

 private:
  using Extent = StoreExtent;
  struct NsState;
  struct KeyHash {
    size_t operator()(const std::pair<uint32_t, BlockKey>& k) const;
  };

  // Each returns a free slot's entry, or null.
  BlockEntry* AllocateSlotLocked(NsState& ns) REQUIRES(mu_);
  BlockEntry* TakeFreeSlotLocked(NsState& ns) REQUIRES(mu_);
  bool AllocateExtentLocked(NsState& ns) REQUIRES(mu_);
  bool ReclaimLocked(NsState& ns) REQUIRES(mu_);
  // Leaves the index; the slot is freed now or on the last unpin.
  void EvictEntryLocked(BlockEntry* e) REQUIRES(mu_);
  // EvictEntryLocked for room: the sink sees the block first.
  void EvictForRoomLocked(BlockEntry* e) REQUIRES(mu_);
  void UnindexLocked(BlockEntry* e) REQUIRES(mu_);  // leaves the index and the LRU (no counter)
  void FreeSlotLocked(BlockEntry* e) REQUIRES(mu_);
  void FreeExtentLocked(Extent* ext) REQUIRES(mu_);
  void TouchLocked(BlockEntry* e) REQUIRES(mu_);
  BlockHeader* HeaderOf(const BlockEntry* e) const;
  void Format();
  bool Rebuild(unsigned threads, RebuildReport* report);
  // Null when directory entry `d` (at `offset`, the previous kept extent ending at `cursor`) and
  // the extent header it names fit the pool geometry; else which field does not.
  const char* CheckExtent(const ExtentDirEntry& d, uint64_t offset, uint64_t cursor) const;
  // Clears directory slot `dir_slot`, counts and logs the drop.
  void DropExtentLocked(RebuildReport* report, uint32_t dir_slot, uint64_t offset, const char* why)
      REQUIRES(mu_);
  NsState* AdoptOrphanLocked(const StoreNamespace& info) REQUIRES(mu_);
  // Evicts an orphan's blocks, frees its extents and forgets it.
  void DropOrphanLocked(std::unordered_map<uint32_t, std::unique_ptr<NsState>>::iterator it)
      REQUIRES(mu_);
  void IndexEntryLocked(NsState& ns, BlockEntry* e) REQUIRES(mu_);

  uint8_t* const base_;
  const size_t bytes_;
  const uint64_t granule_;
  const uint32_t verify_reads_one_in_;
  const uint64_t meta_bytes_;  // header + extent directory
  ExtentDirEntry* const directory_;
  const uint64_t directory_entries_;
  std::vector<uint32_t> free_dir_slots_ GUARDED_BY(mu_);
  // Ids of the namespaces Rebuild finds, until AddNamespace adopts them: above any table id.
  static constexpr uint32_t kFirstOrphanId = 0x80000000u;
  uint32_t next_orphan_id_ GUARDED_BY(mu_) = kFirstOrphanId;
  mutable Mutex mu_;
  uint64_t clock_ GUARDED_BY(mu_) = 0;          // recency stamps and commit sequence
  ExtentAllocator free_space_ GUARDED_BY(mu_);  // the pool's bytes outside extents
  std::list<std::unique_ptr<Extent>> extents_ GUARDED_BY(mu_);
  // ReclaimLocked's bytes claimed per owner, kept to reuse its buckets.
  std::unordered_map<std::string_view, uint64_t> claimed_scratch_ GUARDED_BY(mu_);
  std::unordered_map<uint32_t, std::unique_ptr<NsState>> namespaces_ GUARDED_BY(mu_);
  std::unordered_map<std::pair<uint32_t, BlockKey>, BlockEntry*, KeyHash> index_ GUARDED_BY(mu_);
  uint64_t used_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t live_blocks_ GUARDED_BY(mu_) = 0;
  uint64_t corrupt_ GUARDED_BY(mu_) = 0;
  uint64_t reads_ GUARDED_BY(mu_) = 0;                    // block reads, for verify_reads_one_in_
  std::unordered_set<uint32_t> emptied_ GUARDED_BY(mu_);  // block count dropped to 0
  EvictionSink sink_ GUARDED_BY(mu_);
};

}  // namespace hiqcache::server
