// EngineModel: the serving engine the replay drives hiqcached with. A GPU L1 of fixed token
// capacity (the engine's KV pool, here a HOST shm pool registered with the daemon) holding a
// block-granular prefix cache with LRU eviction, backed by hiqcached as L2:
//
//   arrival   match the prompt's full blocks in L1 (longest prefix), Lookup the rest in L2,
//             allocate slots for prompt + output (evicting LRU L1 blocks, which are backed up to
//             L2 first), Restore the L2 hits into the new slots, "prefill" the remainder
//   finish    the output's full blocks join the cache; the request's blocks become evictable
//
// Blocks a running request uses are pinned. Unpinning walks a request's blocks from last to
// first, so a prefix is always more recent than its extensions and LRU evicts leaves first (as
// SGLang's radix cache does). L1 state depends only on the trace, never on L2's answers, so every
// L2 configuration sees the same L1 behaviour. All daemon calls are synchronous (sync = true).
// Not thread-safe.
#pragma once

#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

#include "hiqcache/client.h"
#include "hiqcache/host_shm.h"
#include "synthetic_kv.h"
#include "workload.h"

namespace hiqcache::replay {

struct ReplayCounters {
  uint64_t requests = 0;
  uint64_t prompt_tokens = 0;
  uint64_t l1_hit_tokens = 0;     // prompt tokens found in L1
  uint64_t l2_lookup_tokens = 0;  // full-block prompt tokens looked up in L2 (L1 misses)
  uint64_t l2_hit_tokens = 0;     // of those, restored from L2
  uint64_t computed_tokens = 0;   // prompt tokens prefilled
  uint64_t l1_evicted_blocks = 0;
  uint64_t backup_calls = 0;
  uint64_t backup_blocks_stored = 0;
  uint64_t backup_blocks_present = 0;
  uint64_t backup_blocks_rejected = 0;
  uint64_t restore_calls = 0;
  uint64_t restore_blocks = 0;
  uint64_t restore_short_blocks = 0;  // looked up, then gone before the restore
  uint64_t verified_restores = 0;
  VerifyResult verify;
  uint64_t daemon_errors = 0;
  double backup_seconds = 0;
  double restore_seconds = 0;
  double lookup_seconds = 0;
};

class EngineModel {
 public:
  struct Options {
    uint32_t l1_tokens = 16384;
    uint32_t block_tokens = 64;
    uint32_t verify_every = 8;          // verify restore calls 1, 1 + n, 1 + 2n, ...; 0 = never
    Codec codec = Codec::kInt8PerHead;  // the pool's: picks the bound restores are checked with
    uint64_t seed = 1;
  };

  // `client`, `kv` and `data` must outlive the model; `kv` has at least l1_tokens rows and is
  // registered as `pool`.
  EngineModel(Client* client, PoolHandle pool, const HostKvPool* kv, const SyntheticKv* data,
              const Options& options);

  // Admits `request` when L1 can hold its prompt and output now (else false: it waits). Runs the
  // arrival path above.
  bool Admit(const Request& request);
  // The request's output is complete: its blocks become cached and evictable.
  // REQUIRES: `request` was admitted and has not finished.
  void Finish(const Request& request);
  // True when L1 could hold `request` if nothing else were running.
  bool FitsAlone(const Request& request) const;

  const ReplayCounters& counters() const { return counters_; }

 private:
  struct KeyHash {
    size_t operator()(const BlockKey& k) const;
  };
  struct Slot {
    BlockKey key{};
    bool cached = false;  // in index_
    uint32_t pins = 0;
    std::list<uint32_t>::iterator lru;  // valid when cached and pins == 0
  };
  struct Running {
    std::vector<uint32_t> slots;  // one per SlotBlocks(), in sequence order
  };

  std::vector<uint32_t> Rows(std::span<const uint32_t> slots) const;
  void Pin(uint32_t slot);
  void Unpin(uint32_t slot);
  // Takes n slots: free ones first, then LRU evictions (backed up to L2 in one call).
  // REQUIRES: n <= free_.size() + lru_.size().
  std::vector<uint32_t> TakeSlots(uint32_t n);

  Client* client_;
  PoolHandle pool_;
  const HostKvPool* kv_;
  const SyntheticKv* data_;
  Options options_;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;
  std::list<uint32_t> lru_;  // unpinned cached slots, most recent first
  std::unordered_map<BlockKey, uint32_t, KeyHash> index_;
  std::unordered_map<uint32_t, Running> running_;  // by Request::id
  ReplayCounters counters_;
};

}  // namespace hiqcache::replay
