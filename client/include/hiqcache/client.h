// hiqcache::Client: what an inference engine links to talk to hiqcached (docs/design.md).
//
// The client is fail-open: hiqcached is a cache, and its absence must never stop inference.
// Every call carries a deadline (ClientOptions). When the daemon is unreachable or answers with
// an error, Lookup and LookupGroup report 0 prefix blocks, Backup reports every block kNotStored
// and Restore reports 0 restored blocks, each with the Status set so the caller can log it;
// nothing throws.
//
// Identity and memory. For a unix target the client opens a session with the daemon
// (hiqcache/session.h) on first use: the kernel's credentials of that connection name the caller,
// every call carries its token, and the pools registered through it belong to this process; the
// session closing (the Client destroyed, or the process dying) releases them. HOST buffers and the
// event slot object (both device kinds) are passed as file descriptors over the session: the
// client opens each host_shm_name itself (O_RDWR, with its own rights), or uses
// SharedBuffer::host_fd / EventPoolSpec::host_fd, and sends the daemon fd ids instead of names, so
// the daemon never opens a client's memory by name. CUDA buffers go as IPC handles. Without a
// session -- a TCP target, a daemon that predates sessions, or one whose session socket cannot be
// reached -- calls are anonymous and HOST objects are sent by name (logged once); an object given
// only by host_fd then cannot be registered.
//
// A dead daemon releases the engine (docs/design.md "Completion: ticket slots"). The client maps
// each pool's event slots itself (the object its EventPoolSpec names) and keeps the highest ticket
// the daemon answered for the pool (Backup, Restore). A thread watches the session connection;
// when it ends without the client closing it (the daemon exited, was killed, or restarts), the
// client stores H | kEventFailedBit (host_shm.h), H being that highest ticket, into every slot a
// request named for the daemon's tickets (done_event, layer_event_base + l) whose ticket part is
// below H -- compare-and-swap, never lowering a slot -- and once more a second later. Every waiter,
// host or CUDA stream, is then released, and a host Wait reports ABORTED: recompute those blocks.
// Slots named only as wait_event are the engine's and are left alone. A pool released with
// ReleasePool, or a Client destroyed, writes nothing.
//
// The client keeps every registration's PoolSpec. PoolHandle is the client's own id and stays
// valid across daemon restarts: when the session dies (the daemon restarted), a call answers
// NOT_FOUND (unknown pool), or -- for a pool registered without a session -- the connection
// breaks or a call answers UNAVAILABLE, the client opens a new session, registers the pool again
// (at most once per ClientOptions::reregister_interval per pool) and retries the call once. While
// the pool's session is alive the daemon has not restarted, so a broken connection or an
// UNAVAILABLE answer keeps the pool id. A pool registered with pending_if_unavailable while the
// daemon was down is registered by the first call after the daemon is back. After a
// re-registration of a HOST pool the client zeroes its event slots; the daemon has taken its
// ticket floor from them by then, so its tickets continue above every value they held.
//
// Thread-safety: one Client may be shared by any number of threads; all methods are safe to call
// concurrently. A PoolHandle must not be used after ReleasePool on it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hiqcache/block_keys.h"
#include "hiqcache/pool_spec.h"
#include "hiqcache/status.h"

namespace hiqcache {

struct ClientOptions {
  // "unix:///path/to.sock", "unix:/path", "host:port", or an absolute socket path.
  // Empty = DefaultTarget() (common/hiqcache/paths.h).
  std::string target;
  // Deadline of each data call (Lookup, LookupGroup, Backup, Restore, Evict, ReleasePool,
  // GetStats), re-registration and retry included.
  std::chrono::milliseconds call_timeout{2000};
  // Deadline of an explicit RegisterPool (the daemon opens the engine's buffers).
  std::chrono::milliseconds register_timeout{10000};
  // Minimum time between two re-registration attempts of one pool.
  std::chrono::milliseconds reregister_interval{500};
};

// The client's handle of a registered pool. 0 is never a valid handle.
struct PoolHandle {
  uint64_t id = 0;
  bool valid() const { return id != 0; }
  friend bool operator==(PoolHandle a, PoolHandle b) { return a.id == b.id; }
};

enum class BlockStatus : uint8_t {
  kStored = 0,          // the daemon stored the block
  kAlreadyPresent = 1,  // the namespace held it already
  kRejected = 2,        // non-finite input, or no room
  kNotStored = 3,       // client side: the call failed (see BackupResult::status)
};

// Event arguments: indices into the registered EventPool's ticket slots (both device kinds).
// With sync = true the reply comes after completion; with sync = false once the work is
// enqueued, and completion is signalled by the slots (slot value >= ticket).
struct BackupOptions {
  int32_t wait_event = -1;  // start once this slot holds >= wait_value (-1 = none)
  uint64_t wait_value = 0;  // 0 means 1
  int32_t done_event = -1;
  bool sync = true;
};
struct RestoreOptions {
  int32_t wait_event = -1;
  uint64_t wait_value = 0;
  int32_t layer_event_base = -1;  // slot base + l gets the ticket once layer l is written
  int32_t done_event = -1;
  bool sync = true;
};

struct LookupResult {
  uint32_t prefix_blocks = 0;  // 0 on any failure
  Status status;
};
struct BackupResult {
  std::vector<BlockStatus> blocks;  // one per key; all kNotStored on failure
  uint64_t ticket = 0;
  Status status;
  // Blocks the namespace now holds (stored or already present).
  uint32_t held() const;
};
struct RestoreResult {
  // Leading blocks restored; 0 on failure. After a failed async call the daemon may still write
  // the rows: do not hand them to another request before the call's deadline has passed.
  uint32_t restored_blocks = 0;
  uint64_t ticket = 0;
  Status status;
};

struct NamespaceStats {
  std::string namespace_id;
  std::string model;
  std::string tenant;
  Codec codec = Codec::kInt8PerHead;
  uint64_t encoded_bytes_per_token = 0;
  uint64_t blocks = 0;
  uint64_t bytes = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t backups = 0;
  uint64_t restores = 0;
  uint64_t evictions = 0;
  uint64_t rejected = 0;
  uint32_t pools = 0;
  uint64_t capacity_blocks = 0;
};
struct PoolStats {
  uint64_t pool_id = 0;
  std::string namespace_id;
  std::string model;
  std::string tenant;
  DeviceKind device = DeviceKind::kHost;
  uint32_t client_pid = 0;
  uint64_t backups = 0;
  uint64_t restores = 0;
  std::string peer;
  uint32_t uid = 0;    // of the registering process (SO_PEERCRED of its session)
  bool owned = false;  // registered by the calling process; pool_id is 0 in other callers' pools
};
// The daemon's L3 store (docs/design.md "Beyond one node (L3)"), counted since start (GetStats).
// enabled is false, and every field 0, when the daemon has no L3.
struct L3Stats {
  bool enabled = false;
  uint64_t lookup_hits = 0;         // blocks Lookup found in L3 after the pool's leading run
  uint64_t lookup_misses = 0;       // keys Lookup asked L3 for after the run L3 held
  uint64_t lookup_errors = 0;       // probes that failed or ran out of their deadline (a miss)
  uint64_t fetches = 0;             // restores that fetched from L3
  uint64_t fetched_blocks = 0;      // values fetched and verified
  uint64_t fetch_errors = 0;        // fetches that failed or ran out of their deadline
  uint64_t corrupt_values = 0;      // fetched values that failed to verify: dropped, a miss
  uint64_t promoted_blocks = 0;     // fetched blocks written into the pool
  uint64_t writes = 0;              // blocks written to L3
  uint64_t write_errors = 0;        // writes that failed
  uint64_t dropped_writes = 0;      // not queued: the write queue was full
  uint64_t skipped_writes = 0;      // queued, but the block left the pool before its turn
  uint64_t write_queue_bytes = 0;   // payload bytes queued now
  uint64_t write_queue_blocks = 0;  // blocks queued now
  uint64_t bytes_in = 0;            // value bytes fetched
  uint64_t bytes_out = 0;           // value bytes written
  // Fetch duration over the last fetch_latency_samples fetches (at most 1024), microseconds.
  uint64_t fetch_latency_samples = 0;
  uint64_t fetch_p50_us = 0;
  uint64_t fetch_p99_us = 0;
  std::string write_policy;        // "write_through" or "on_evict"
  uint64_t spilled_blocks = 0;     // on_evict: evicted blocks copied into the write queue
  uint64_t budget_bytes = 0;       // l3_budget_bytes; 0 = none
  uint64_t budget_used_bytes = 0;  // value bytes this daemon's ledger counts in L3 now
  uint64_t budget_deletes = 0;     // blocks deleted from L3 to stay within the budget
};

struct DaemonStats {
  uint64_t pool_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t capacity_bytes = 0;
  uint64_t cuda_staging_bytes = 0;  // GPU memory of the CUDA backend's staging (GetStats)
  uint64_t blocks = 0;
  uint64_t clients = 0;
  uint64_t uptime_seconds = 0;
  std::string device;
  std::string shm_name;
  // One page of the namespaces (GetStats(offset, limit)); namespaces_total counts them all.
  std::vector<NamespaceStats> namespaces;
  uint32_t namespaces_total = 0;
  std::vector<PoolStats> pools;
  // The caller as the daemon identified it (0 / false for an anonymous caller).
  uint32_t caller_uid = 0;
  bool caller_admin = false;
  L3Stats l3;  // enabled = false when the daemon has no L3 store
};

class Client {
 public:
  // Creates a client for options.target. Does not wait for the daemon (fail-open): a daemon that
  // is down makes calls miss, not Connect fail. INVALID_ARGUMENT for a malformed target.
  static StatusOr<std::unique_ptr<Client>> Connect(ClientOptions options = {});
  static StatusOr<std::unique_ptr<Client>> Connect(std::string_view target);

  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // The gRPC target in use ("unix:///...").
  const std::string& target() const;

  // Registers an engine's KV pool (client_pid = getpid() is added). Errors the daemon reports
  // (INVALID_ARGUMENT, FAILED_PRECONDITION, ...) are returned. When the daemon is unreachable
  // and `pending_if_unavailable` is true, the spec is kept and a handle is returned anyway: the
  // pool registers on first use once the daemon is back (PoolInfo tells whether it has).
  StatusOr<PoolHandle> RegisterPool(const PoolSpec& spec, bool pending_if_unavailable = false);
  // The daemon's answer to the pool's current registration; UNAVAILABLE while unregistered.
  StatusOr<RegisteredPool> PoolInfo(PoolHandle pool) const;
  // Releases the registration on the daemon (best effort) and forgets the handle.
  Status ReleasePool(PoolHandle pool);

  // Length of the longest leading run of `keys` the pool's namespace holds.
  LookupResult Lookup(PoolHandle pool, std::span<const BlockKey> keys);
  // For callers that hold no pool: length of the longest leading run of `keys` held by EVERY
  // namespace of `namespaces` (e.g. one ref per TP rank of an engine). A namespace no pool
  // registered answers 0, except one whose blocks a restarted daemon kept in its pool: those
  // answer before any worker registers again. At most 64 namespaces per call (else
  // RESOURCE_EXHAUSTED); an empty `namespaces` is INVALID_ARGUMENT, nothing sent. Fail-open like
  // Lookup.
  LookupResult LookupGroup(std::span<const NamespaceRef> namespaces,
                           std::span<const BlockKey> keys);
  // Stores keys.size() blocks; block i is made of rows[i*block_tokens, (i+1)*block_tokens).
  // REQUIRES (else INVALID_ARGUMENT, nothing sent): rows.size() == keys.size() * block_tokens.
  BackupResult Backup(PoolHandle pool, std::span<const BlockKey> keys,
                      std::span<const uint32_t> rows, const BackupOptions& options = {});
  // Writes the stored blocks into rows laid out as for Backup; stops at the first missing key.
  RestoreResult Restore(PoolHandle pool, std::span<const BlockKey> keys,
                        std::span<const uint32_t> rows, const RestoreOptions& options = {});
  // Drops blocks from the pool's namespace; returns how many were present.
  StatusOr<uint32_t> Evict(PoolHandle pool, std::span<const BlockKey> keys);
  // Daemon-wide statistics with the daemon's default page of namespaces (the first 256).
  StatusOr<DaemonStats> GetStats();
  // The same with namespaces [offset, offset + limit) in namespace_id order (limit 0 = the
  // daemon's default; it caps the limit at 4096).
  StatusOr<DaemonStats> GetStats(uint32_t namespaces_offset, uint32_t namespaces_limit);

 private:
  class Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hiqcache
