// CacheCore: the daemon without its transport. Owns the registered pools, turns validated
// requests into block-store reservations and transfer-engine tasks, and keeps the counters.
//
// Every public method validates its whole request before touching the store, a buffer or an
// event; a rejected request changes nothing. Includes neither gRPC nor CUDA. Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "block_store.h"
#include "device_backend.h"
#include "hiqcache/status.h"
#include "namespace_table.h"
#include "registration.h"
#include "requests.h"
#include "transfer_engine.h"

namespace hiqcache::server {

// One finished backup or restore task, as the daemon's metrics (metrics.h) see it.
struct TransferSample {
  bool restore = false;
  std::string_view namespace_id;  // valid for the core's lifetime
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
};

struct CoreOptions {
  Limits limits;
  unsigned transfer_workers = 2;
  CoreObserver* observer = nullptr;  // optional; must outlive the core
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
  uint64_t pool_id = 0;
  std::string namespace_id;
  std::string model;
  std::string tenant;
  bool cuda = false;
  uint32_t client_pid = 0;
  std::string peer;
  uint64_t backups = 0;
  uint64_t restores = 0;
};

struct NamespaceSnapshot {
  std::string namespace_id;
  std::string model;
  std::string tenant;
  bool raw_codec = false;
  uint64_t encoded_bytes_per_token = 0;
  uint32_t pools = 0;
  NamespaceCounters counters;
};

struct CoreSnapshot {
  StoreStats store;
  std::vector<PoolSnapshot> pools;
  std::vector<NamespaceSnapshot> namespaces;
  uint64_t clients = 0;
  uint64_t uptime_seconds = 0;
  // GPU memory the CUDA backend holds for staging and job arrays (0 without CUDA).
  uint64_t staging_device_bytes = 0;
};

class CacheCore {
 public:
  // `store` and the backends must outlive the core. `cuda` may be null (no CUDA available).
  CacheCore(const CoreOptions& options, BlockStore* store, DeviceBackend* host,
            DeviceBackend* cuda);
  // Finishes queued work first.
  ~CacheCore();

  StatusOr<RegisterResult> RegisterPool(const RegisterSpec& spec);
  // Removes the pool (new requests naming it get NOT_FOUND), stops its queued work from touching
  // the engine's buffers and events, waits (at most options.release_timeout) until its work
  // queued before and on the device has completed, then closes its mappings and events. OK means
  // they are closed; DEADLINE_EXCEEDED that device work was still pending (they close when it
  // completes). Blocks the caller: never call it from a transfer worker.
  Status ReleasePool(uint64_t pool_id);
  // Releases every pool registered by process `pid`; returns how many.
  size_t ReleasePoolsOfClient(uint32_t pid);

  // Longest leading run of spec.keys present and readable in every namespace of spec.namespaces
  // and, when spec.pool_id != 0, in the pool's namespace (LookupSpec). Each entry is validated as
  // RegisterPool validates those parts (errors name "namespaces[i].<field>"). A namespace whose
  // blocks a warm restart found in the pool, and that no pool has registered again, is adopted
  // as RegisterPool adopts it (it then exists as if registered, with no pool) and answers from
  // those blocks; any other namespace no pool registered answers 0 and is not created. Nothing
  // is adopted by a rejected request. Each distinct namespace involved counts the answer as hits
  // and the other keys as misses, and refreshes the answered run only.
  StatusOr<uint32_t> Lookup(const LookupSpec& spec);
  // Lookup of one pool's namespace.
  StatusOr<uint32_t> Lookup(uint64_t pool_id, const std::vector<std::string>& keys);
  StatusOr<uint32_t> Evict(uint64_t pool_id, const std::vector<std::string>& keys);

  // `done` runs exactly once: with the error if the request is rejected (nothing changed), else
  // after the work is queued (sync = false, HOST), enqueued on the device (sync = false, CUDA:
  // an enqueue failure answers the error) or completed (sync = true), possibly on a worker.
  using BackupDone = std::function<void(StatusOr<BackupResult>)>;
  using RestoreDone = std::function<void(StatusOr<RestoreResult>)>;
  void Backup(TransferSpec spec, BackupDone done);
  void Restore(TransferSpec spec, RestoreDone done);

  CoreSnapshot Snapshot() const;
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
  StatusOr<std::shared_ptr<Pool>> FindPool(uint64_t pool_id) const;
  // The namespace of `desc` if interned; else, when the store holds rebuilt blocks of it, interns
  // it and lets the store adopt them; else null (and nothing is created).
  const NamespaceInfo* FindOrAdoptNamespace(const NamespaceDesc& desc);
  // What a task's `defer` does: runs the work on a worker as the end of the strand's detached task.
  std::function<void(std::function<void()>)> DeferOnStrand(
      const std::shared_ptr<TransferEngine::Strand>& strand);
  // The keys of a Lookup/Evict, validated (16 bytes each, within the per-request limit).
  StatusOr<std::vector<BlockKey>> CheckedKeys(const std::vector<std::string>& keys) const;

  const CoreOptions options_;
  BlockStore* const store_;
  DeviceBackend* const host_;
  DeviceBackend* const cuda_;
  NamespaceTable namespaces_;
  const std::chrono::steady_clock::time_point start_;
  std::atomic<bool> draining_{false};

  mutable std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<Pool>> pools_;  // GUARDED_BY(mu_)

  TransferEngine engine_;  // last: destroyed (drained) first
};

}  // namespace hiqcache::server
