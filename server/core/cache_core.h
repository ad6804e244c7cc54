// CacheCore: the daemon without its transport. Owns the registered pools, turns validated
// requests into block-store reservations and transfer-engine tasks, and keeps the counters.
//
// Every public method validates its whole request before touching the store, a buffer or an
// event; a rejected request changes nothing. Includes neither gRPC nor CUDA. Thread-safe.
//
// Isolation:
//   - Ownership. A pool belongs to the caller that registered it (requests.h Caller). Backup,
//     Restore, Lookup(pool_id), Evict and ReleasePool on a pool the caller does not own answer
//     NOT_FOUND with the text of an unknown pool. An authenticated caller owns the pools its
//     process (same uid and pid) registered; a pool registered without a session (anonymous) is
//     usable by every anonymous caller and by no authenticated one; an admin may release any pool.
//   - Namespace scope. With CoreOptions::namespace_scope = kUid a namespace's identity includes
//     its caller's uid ("anonymous" without a session): blocks never flow between users. kPod
//     adds the caller's pod or container (Caller::pod), so pods that share a uid share nothing;
//     a caller also sees only its pod's pools in GetStats. kNode shares namespaces node-wide,
//     with the canonical text of daemons before scopes.
//   - Quotas (CoreOptions::quotas), per client: a uid for authenticated callers, all anonymous
//     callers together as one. Over a quota a request is RESOURCE_EXHAUSTED naming the quota's
//     config key, and changes nothing.
//   - Fair service. Each client's pools share the transfer workers as one group (round-robin
//     over clients, TransferEngine); on HOST pools a request is split into sub-tasks of at most
//     transfer_chunk_blocks blocks / transfer_chunk_bytes engine-side bytes on the pool's strand:
//     the first waits for wait_event, the last signals done_event with the request's ticket. A
//     restore with layer events goes layer-major (LayerMajorPieces), each layer's event signalled
//     by the sub-task that writes its last blocks, so an engine's forward pass starts on layer 0
//     while later layers are written; without them, block-major. A failure of any sub-task
//     reaches the events: the later ones write nothing, and the events not yet signalled get the
//     failure bit. A restore writes each row at most once and restores
//     a key named twice once: its leading run ends before the repeat.
//   - Reservations. A backup reserves its pool slots when a sub-task starts (HOST: after its
//     wait_event came), not when it is queued, so a backup whose wait_event never comes holds no
//     slot. The answer of an asynchronous HOST backup therefore cannot know each block's
//     outcome: BLOCK_STORED there means accepted (the daemon stores it when the work runs, unless
//     the block is present by then, holds NaN/Inf, or finds no room: a cache may drop it; Lookup
//     says what is held), BLOCK_ALREADY_PRESENT that the key repeats an earlier block of the same
//     request. A synchronous backup answers each block's outcome exactly; an asynchronous CUDA
//     backup answers after its work is enqueued, with the reservation outcomes. A key repeated
//     within one backup is reserved once.
//   - Namespace lifetime. A namespace lives while pools use it or the pool holds blocks of it;
//     the last of those going frees it (NamespaceTable), so churn with unique names stays
//     bounded in memory, snapshot size and metrics series.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/device_backend.h"
#include "core/l3_tier.h"
#include "core/namespace_table.h"
#include "core/quota_ledger.h"
#include "core/registration.h"
#include "core/requests.h"
#include "core/transfer_engine.h"
#include "hiqcache/mutex.h"
#include "hiqcache/status.h"
#include "pool/block_store.h"

namespace hiqcache::server {

// One finished backup or restore request (all of its sub-tasks), as the daemon's metrics
// (metrics.h) see it.
struct TransferSample {
  bool restore = false;
  std::string_view namespace_id;  // valid during the OnTransfer call only: copy what you keep
  std::string_view model;
  uint64_t blocks = 0;
  uint64_t input_bytes = 0;   // engine-side BF16/FP16 bytes of those blocks
  uint64_t stored_bytes = 0;  // encoded bytes of those blocks in the pool
  // From the start of the task to its completion: wait_event, gather/encode/copy (backup) or
  // copy/decode/scatter (restore), event signalling (CUDA: until the completion thread saw it).
  std::chrono::nanoseconds duration{0};
  bool ok = true;
};

// Hooks through which the daemon observes the core for its metrics. Called from transfer workers
// and RPC threads concurrently, with no core lock held: implementations are thread-safe and
// cheap. Tasks that move no block are not reported.
class CoreObserver {
 public:
  virtual ~CoreObserver() = default;
  virtual void OnTransfer(const TransferSample& sample) = 0;
  // An RPC answered with an error (`code` != OK), counted by the gRPC adapter.
  virtual void OnRequestRejected(std::string_view rpc, StatusCode code) = 0;
  // The namespace is gone (no pool uses it, the pool holds no block of it): drop what is kept
  // per namespace. `namespace_id` is valid during the call only.
  virtual void OnNamespaceRemoved(std::string_view namespace_id) { (void)namespace_id; }
};

// Who shares a namespace (DaemonConfig::namespace_scope): callers of one uid; of one uid and one
// pod or container (Caller::pod; processes of the host itself share by uid); every caller.
enum class NamespaceScope { kUid, kPod, kNode };

struct CoreOptions {
  Limits limits;
  Quotas quotas;
  NamespaceScope namespace_scope = NamespaceScope::kUid;
  // HOST requests run as sub-tasks of at most this many blocks and engine-side bytes each (at
  // least one block), so that workers alternate between clients' strands.
  uint32_t transfer_chunk_blocks = 64;
  uint64_t transfer_chunk_bytes = 16ull << 20;
  unsigned transfer_workers = 2;
  CoreObserver* observer = nullptr;  // optional; must outlive the core
  // The store beyond the node (docs/design.md "Beyond one node (L3)"); optional, must outlive the
  // core. With it, Lookup extends the pool's prefix by the run L3 holds, Restore promotes the
  // blocks after the pool's run from L3 into the pool before restoring them as pool blocks,
  // and every block a backup publishes is handed to it (write-through).
  L3Tier* l3 = nullptr;
  // How long ReleasePool waits for a pool's queued and device work before it answers
  // DEADLINE_EXCEEDED (the mappings then close once that work completes).
  std::chrono::milliseconds release_timeout{5000};
};

struct RegisterResult {
  uint64_t pool_id = 0;
  std::string namespace_id;
  uint64_t encoded_bytes_per_token = 0;
  uint64_t block_bytes = 0;
  uint64_t capacity_tokens = 0;
};

enum class BlockResult { kStored = 0, kAlreadyPresent = 1, kRejected = 2 };

struct BackupResult {
  std::vector<BlockResult> results;
  uint64_t ticket = 0;
};

struct RestoreResult {
  uint32_t restored_blocks = 0;
  uint64_t ticket = 0;
};

struct PoolSnapshot {
  uint64_t pool_id = 0;  // 0 unless the snapshot's caller owns the pool or is an admin
  std::string namespace_id;
  std::string model;
  std::string tenant;
  bool cuda = false;
  uint32_t client_pid = 0;
  uint32_t uid = 0;    // the registering caller's uid (0 when it was anonymous)
  bool owned = false;  // usable by the snapshot's caller
  std::string peer;
  uint64_t backups = 0;
  uint64_t restores = 0;
  // Bytes of the client's memory the daemon faulted in for this pool (FaultBudget).
  uint64_t faulted_bytes = 0;
};

struct NamespaceSnapshot {
  std::string namespace_id;
  std::string model;
  std::string tenant;
  kernels::CodecKind codec = kernels::CodecKind::kInt8PerHead;
  uint64_t encoded_bytes_per_token = 0;
  uint32_t pools = 0;
  NamespaceCounters counters;
};

struct CoreSnapshot {
  StoreStats store;
  std::vector<PoolSnapshot> pools;
  std::vector<NamespaceSnapshot> namespaces;  // in namespace_id order, the requested page
  uint32_t namespaces_total = 0;              // namespaces there are, all pages
  uint64_t clients = 0;
  uint64_t uptime_seconds = 0;
  // GPU memory the CUDA backend holds for staging and job arrays (0 without CUDA).
  uint64_t staging_device_bytes = 0;
  // Bytes of clients' memory the daemon faulted in on their behalf, every pool (FaultBudget).
  uint64_t faulted_bytes = 0;
  L3Stats l3;  // enabled = false without an L3 tier
};

class CacheCore {
 public:
  // `store` and the backends must outlive the core. `cuda` may be null (no CUDA available).
  CacheCore(const CoreOptions& options, BlockStore* store, DeviceBackend* host,
            DeviceBackend* cuda);
  // Finishes queued work first.
  ~CacheCore();

  // The pool belongs to spec.caller. RESOURCE_EXHAUSTED when it would exceed the caller's
  // quota of pools, buffers or mapped bytes (nothing is opened then).
  StatusOr<RegisterResult> RegisterPool(const RegisterSpec& spec);
  // Removes the pool (new requests naming it get NOT_FOUND), stops its queued work from touching
  // the engine's buffers and events, waits (at most options.release_timeout) until its work
  // queued before and on the device has completed, then closes its mappings and events. OK means
  // they are closed; DEADLINE_EXCEEDED that device work was still pending (they close when it
  // completes). NOT_FOUND, as for an unknown id, unless `caller` owns the pool or is an admin.
  // Blocks the caller: never call it from a transfer worker. (The default caller is anonymous:
  // it releases only pools registered without a session.)
  Status ReleasePool(uint64_t pool_id, const Caller& caller = Caller{});
  // Releases every pool registered by process `pid` (the kernel's pid of an authenticated
  // registration, else the client_pid it reported); returns how many.
  size_t ReleasePoolsOfClient(uint32_t pid);
  // Releases every pool registered over session `session` (its socket closed: the client died
  // or left); returns how many. Session 0 (anonymous) releases nothing.
  size_t ReleasePoolsOfSession(uint64_t session);

  // Longest leading run of spec.keys present and readable in every namespace of spec.namespaces
  // and, when spec.pool_id != 0, in the pool's namespace (LookupSpec). Each entry is validated as
  // RegisterPool validates those parts (errors name "namespaces[i].<field>"). A namespace whose
  // blocks a warm restart found in the pool, and that no pool has registered again, is adopted
  // as RegisterPool adopts it (it then exists as if registered, with no pool) and answers from
  // those blocks; any other namespace no pool registered answers 0 and is not created. Nothing
  // is adopted by a rejected request. Each distinct namespace involved counts the answer as hits
  // and the other keys as misses, and refreshes the answered run only.
  // A namespace ref resolves in the caller's scope (namespace_scope).
  StatusOr<uint32_t> Lookup(const LookupSpec& spec);
  // Lookup of one pool's namespace.
  StatusOr<uint32_t> Lookup(uint64_t pool_id, const std::vector<std::string>& keys,
                            const Caller& caller = Caller{});
  // Removes the keys from the pool's namespace; NOT_FOUND unless `caller` owns the pool or is an
  // admin (an operator evicting a tenant's blocks: `hiqctl pools` shows admins every pool id).
  StatusOr<uint32_t> Evict(uint64_t pool_id, const std::vector<std::string>& keys,
                           const Caller& caller = Caller{});

  // `done` runs exactly once: with the error if the request is rejected (nothing changed), else
  // after the work is queued (sync = false: its outcome reaches the engine through the ticket
  // slots, the failed bit for an error) or completed (sync = true), possibly on a worker.
  // What an asynchronous backup's BLOCK_STORED means: see the header comment (Reservations).
  // RESOURCE_EXHAUSTED when the caller's pending work would exceed its quota.
  using BackupDone = std::function<void(StatusOr<BackupResult>)>;
  using RestoreDone = std::function<void(StatusOr<RestoreResult>)>;
  void Backup(TransferSpec spec, BackupDone done);
  void Restore(TransferSpec spec, RestoreDone done);

  // What `caller` may see (an admin: everything; an authenticated caller: the pools of its uid
  // and the namespaces of its scope or holding a pool of its uid; an anonymous caller: totals
  // only), pool_id only where `caller` owns the pool or is an admin; the namespaces in
  // namespace_id order from `ns_offset`, at most `ns_limit` of them.
  CoreSnapshot Snapshot(const Caller& caller = Caller::Operator(), uint32_t ns_offset = 0,
                        uint32_t ns_limit = UINT32_MAX);
  // Namespaces the core knows now (GetStats' namespaces_total, without building a snapshot).
  size_t NamespaceCount() const { return namespaces_.size(); }
  // Processes that have pools registered (client_pid != 0).
  std::vector<uint32_t> ClientPids() const;

  // After this, new work is refused with UNAVAILABLE; queued work still completes.
  void StartDraining() { draining_.store(true); }
  bool draining() const { return draining_.load(); }
  // The observer of CoreOptions, or null.
  CoreObserver* observer() const { return options_.observer; }
  void WaitIdle() { engine_.WaitIdle(); }
  bool WaitIdleFor(std::chrono::milliseconds timeout) { return engine_.WaitIdleFor(timeout); }
  // Backups and restores queued or running.
  size_t PendingTasks() const { return engine_.Pending(); }

 private:
  struct Pool;
  struct BackupRequest;
  struct RestoreRequest;
  // The pool if it exists and `caller` may use it; else NOT_FOUND (one text for both).
  // The pool a Backup/Restore names, checked: not draining, owned by spec.caller, not failed,
  // and the request valid against it (ValidateTransfer).
  StatusOr<std::shared_ptr<Pool>> PoolForTransfer(const TransferSpec& spec, bool restore) const;
  // The pool `caller` owns (or, with `admin_may`, any pool when caller.admin), else NOT_FOUND.
  StatusOr<std::shared_ptr<Pool>> FindPool(uint64_t pool_id, const Caller& caller,
                                           bool admin_may = false) const;
  static bool Owns(const Pool& pool, const Caller& caller);
  // The quota key of `caller`: its uid, or one key for every anonymous caller.
  static uint64_t ClientOf(const Caller& caller);
  // `desc` in the scope of `caller` (options.namespace_scope).
  NamespaceDesc Scoped(NamespaceDesc desc, const Caller& caller) const;
  // The namespace of `desc` if interned; else, when the store holds rebuilt blocks of it, interns
  // it and lets the store adopt them; else null (and nothing is created).
  std::shared_ptr<const NamespaceInfo> FindOrAdoptNamespace(const NamespaceDesc& desc);
  // Ends the pool's use of its namespace and gives its quota back; idempotent (the release
  // does it once the mappings are closed, the pool's destruction at the latest).
  void RetirePool(Pool& pool);
  // Frees the namespaces that no pool uses and whose blocks are gone (BlockStore's
  // TakeEmptiedNamespaces).
  void SweepNamespaces();
  // Tells the observer a namespace is gone.
  void NamespaceRemoved(const NamespaceInfo& ns);
  // The Backup/Restore bodies; may throw std::bad_alloc before anything is queued.
  void BackupImpl(TransferSpec spec, BackupDone* done);
  void RestoreImpl(TransferSpec spec, RestoreDone* done);
  // The sub-tasks' step functions.
  // The step of sub-task `chunk`; `*task` holds its task once built (a step may run again).
  TransferEngine::StepResult BackupStep(const std::shared_ptr<BackupRequest>& req, size_t chunk,
                                        std::shared_ptr<BackupTask>* task);
  TransferEngine::StepResult RestoreStep(const std::shared_ptr<RestoreRequest>& req, size_t chunk,
                                         std::shared_ptr<RestoreTask>* task);
  void FinishBackup(const std::shared_ptr<BackupRequest>& req);
  void FinishRestore(const std::shared_ptr<RestoreRequest>& req);
  // What both finishes end with (cache_core_internal.h): `kind` is "backup" or "restore".
  template <typename Request>
  void EndRequest(Request& req, const char* kind);
  // Charges a new request's pending bytes to its pool's client and counts it on the pool
  // (BeginTask). On failure nothing stays charged, and the status is the caller's answer.
  template <typename Request>
  Status Admit(Request& req, uint64_t pool_id);
  // What every sub-task's step does first: notes when the request started and, for the first
  // sub-task of a two-strand pool before its task exists (`new_task`), whether it must still
  // wait for an earlier conflicting request of the other direction.
  template <typename Request>
  bool WaitsToStart(Request& req, size_t chunk, bool new_task);
  // Gives an accepted request (Admit done) its ticket, notes it in its pool's in-flight list, posts
  // its sub-tasks to `strand` and answers an asynchronous caller, in ticket order
  // (cache_core_internal.h). When the daemon cannot allocate for that, none of it happened: the
  // ticket, the in-flight entry, the pending bytes and the task are given back, the caller is
  // answered RESOURCE_EXHAUSTED and it returns false (the caller drops what else it holds, e.g. a
  // restore's pins).
  template <typename Request, typename InFlight>
  bool PostRequest(Request& req, const std::shared_ptr<TransferEngine::Strand>& strand,
                   InFlight touches, std::vector<TransferEngine::StepTask> steps, const char* rpc);
  // Blocks per sub-task for this layout (HOST), at least 1.
  size_t ChunkBlocks(const kernels::BlockLayout& layout) const;
  // What a task's `defer` does: runs the work on a worker as the end of the strand's detached task.
  std::function<void(std::function<void()>)> DeferOnStrand(
      const std::shared_ptr<TransferEngine::Strand>& strand);
  // Fetches the leading run of `keys` (the pool's namespace) that L3 holds and verifies, and
  // writes it into the pool as committed blocks; returns how many leading keys are now
  // committed (or were present already). Runs on the caller's thread within the fetch deadline.
  size_t PromoteFromL3(const Pool& pool, std::span<const BlockKey> keys);
  // The keys of a Lookup/Evict, validated (16 bytes each, within the per-request limit).
  StatusOr<std::vector<BlockKey>> CheckedKeys(const std::vector<std::string>& keys) const;

  const CoreOptions options_;
  BlockStore* const store_;
  DeviceBackend* const host_;
  DeviceBackend* const cuda_;
  NamespaceTable namespaces_;
  const std::chrono::steady_clock::time_point start_;
  std::atomic<bool> draining_{false};

  std::atomic<bool> destroying_{false};

  QuotaLedger quotas_;  // declared before pools_: a pool gives its quota back as it goes

  mutable Mutex mu_;
  std::map<uint64_t, std::shared_ptr<Pool>> pools_ GUARDED_BY(mu_);

  TransferEngine engine_;  // last: destroyed (drained) first
};

}  // namespace hiqcache::server
