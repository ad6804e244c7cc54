// L3Tier: the core's seam to the store beyond one node (docs/design.md "Beyond one node (L3)"). The
// core asks it, after the pool (L2), which further blocks of a lookup or restore it holds, fetches
// them to promote them into the pool, and tells it which blocks a backup published so that it
// copies them out. The Redis Cluster implementation (l3/redis_l3_tier.h) lives behind this
// interface, in the layer above: the core includes no hiredis; tests may substitute their own.
//
// Contract: every call returns within its deadline (plus one socket timeout at most) and never
// fails: an error or a deadline is an answer of "not held" (counted in L3Stats), so L3 can only
// extend an L2 answer, never shorten it. Thread-safe: the core calls it from gRPC threads and
// transfer workers concurrently.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "hiqcache/status.h"
#include "pool/block_store.h"

namespace hiqcache::server {

struct L3Stats {
  bool enabled = false;
  uint64_t lookup_hits = 0;         // blocks a Lookup found in L3 after its L2 prefix
  uint64_t lookup_misses = 0;       // keys a Lookup asked L3 for after that run
  uint64_t lookup_errors = 0;       // Lookup probes that failed or ran out of time (a miss)
  uint64_t fetches = 0;             // Restore fetches (one per restore that went to L3)
  uint64_t fetched_blocks = 0;      // values fetched and verified
  uint64_t fetch_errors = 0;        // fetches that failed or ran out of time (a miss)
  uint64_t corrupt_values = 0;      // fetched values that failed to decode: dropped, a miss
  uint64_t promotions = 0;          // fetched blocks written into the pool
  uint64_t writes = 0;              // blocks SET in L3
  uint64_t write_errors = 0;        // SETs that failed
  uint64_t dropped_writes = 0;      // writes not queued: the queue was full
  uint64_t skipped_writes = 0;      // queued writes whose block had left the pool meanwhile
  uint64_t spilled_blocks = 0;      // on_evict: evicted blocks copied into the write queue
  uint64_t write_queue_bytes = 0;   // payload bytes queued now
  uint64_t write_queue_blocks = 0;  // blocks queued now
  uint64_t bytes_in = 0;            // value bytes fetched
  uint64_t bytes_out = 0;           // value bytes written
  // Duration of the restores' fetches (MultiGet and verification) over the last
  // kL3FetchLatencySamples of them, in microseconds; 0 before the first fetch.
  uint64_t fetch_latency_samples = 0;
  uint64_t fetch_p50_us = 0;
  uint64_t fetch_p99_us = 0;
  // l3_budget_bytes: value bytes this daemon wrote that its ledger still counts (written, not
  // expired, not deleted), and the blocks it deleted to stay within the budget.
  uint64_t budget_bytes = 0;  // the budget; 0 = none
  uint64_t budget_used_bytes = 0;
  uint64_t budget_deletes = 0;
  bool on_evict = false;  // the write policy: on_evict, else write_through
};
constexpr size_t kL3FetchLatencySamples = 1024;

// One block fetched from L3 and verified (header, namespace, key, length, checksum).
struct L3Block {
  std::string value;               // header + payload, as stored
  size_t payload_offset = 0;       // where the payload starts in `value`
  uint64_t payload_checksum = 0;   // XXH3-64 of the payload (checked): the pool's block checksum
  const uint8_t* payload() const;  // value's payload bytes
};

class L3Tier {
 public:
  virtual ~L3Tier() = default;
  // Length of the leading run of `keys` that L3 holds in every namespace of `ns`, asked within
  // the lookup deadline. An error or the deadline ends the run there.
  virtual uint32_t Probe(std::span<const NamespaceHash> ns, std::span<const BlockKey> keys) = 0;
  // The values of the leading run of `keys` of `ns` that L3 holds and that verify (payloads of
  // `payload_bytes`), fetched within the fetch deadline; a value that does not verify is
  // dropped (counted) and ends the run.
  virtual std::vector<L3Block> Fetch(const NamespaceHash& ns, uint64_t payload_bytes,
                                     std::span<const BlockKey> keys) = 0;
  // Counts blocks the core promoted into the pool.
  virtual void CountPromoted(uint64_t blocks) = 0;
  // Block `key` of namespace `ns_id` (hash `ns`, payloads of `payload_bytes`) was published in
  // the pool: under write_through, queue its copy to L3 (under on_evict, nothing: the tier
  // copies blocks out as the pool evicts them). Never blocks; a full queue drops it (counted).
  virtual void Published(uint32_t ns_id, const NamespaceHash& ns, uint64_t payload_bytes,
                         const BlockKey& key) = 0;
  virtual L3Stats Stats() const = 0;
};

enum class L3WritePolicy {
  kWriteThrough,  // every block a backup publishes is copied to L3 (other nodes see it at once)
  kOnEvict,       // a block is copied to L3 when the pool evicts it to make room
};

// Options of the Redis Cluster tier (DaemonConfig's l3_* keys).
struct L3Options {
  std::vector<std::string> seeds;  // host:port
  std::string user;
  std::string password;
  std::string key_prefix = "hiq:";
  // The fleet's HMAC-SHA-256 keys for values (l3_value.h, L3MacKeys): written with `mac_key`,
  // restored when the tag verifies under it or `mac_previous_key`; "" = none (version 1 values,
  // unauthenticated).
  std::string mac_key;
  std::string mac_previous_key;
  L3WritePolicy policy = L3WritePolicy::kWriteThrough;
  std::chrono::milliseconds ttl{0};  // 0 = no expiry
  // Value bytes this daemon keeps in L3 at most (0 = no budget: the cluster's maxmemory and the
  // TTL bound it). The tier keeps a ledger of its own writes (about 100 bytes of memory per block)
  // and DELs its oldest before a write would pass the budget. The ledger is this process's: what
  // a previous daemon wrote is bounded by the TTL only.
  uint64_t budget_bytes = 0;
  std::chrono::milliseconds connect_timeout{200};
  std::chrono::milliseconds command_timeout{200};
  std::chrono::milliseconds lookup_deadline{5};
  std::chrono::milliseconds fetch_deadline{500};
  uint64_t write_queue_bytes = 1ull << 30;
  uint32_t write_queue_blocks = 4096;
  uint32_t writer_threads = 2;
  // Connections kept open for lookups and fetches (each a RedisCluster, used by one call at a
  // time); a call that finds none idle is a miss and asks for one more, up to `max_readers`.
  uint32_t min_readers = 2;
  uint32_t max_readers = 16;
  // Called (from the tier's threads or the caller's) with each fetch's duration.
  std::function<void(std::chrono::nanoseconds, bool ok)> on_fetch;
};

// Whether this build has the Redis Cluster tier (hiredis found at build time): l3/ is built and
// l3/redis_l3_tier.h's CreateRedisL3Tier exists.
bool L3Available();

}  // namespace hiqcache::server
