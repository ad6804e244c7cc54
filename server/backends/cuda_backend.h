// CudaBackend: the CUDA device kind. Engines share their GPU KV buffers through cudaIpcMemHandles
// of the allocation base (plus view offsets) and their ticket slots as a memfd the daemon maps
// and page-locks (ticket_slots.h); the daemon quantizes and dequantizes on its own streams and
// moves the compressed bytes between a device staging slab and the page-locked pool with the copy
// engines, so the engine's SMs are held only for the short codec kernels.
//
// A pool has two lanes, one per direction, each with a compute and a copy stream, its own events,
// job arrays and completion thread: restores on streams of the device's greatest priority,
// backups on streams of its least. A restore is therefore never queued behind its pool's backup:
// both may be on the device together (each holding a staging pair), the restore's decode kernels
// are scheduled before pending backup kernels, and its H2D copies run beside the backup's D2H
// copies on the other copy engine (stream priorities order kernels only, never copies: CUDA
// runtime API, cudaStreamCreateWithPriority). A backup leaves a device's last free staging pair
// to restores when the device has more than one (a staging budget of at least 64 MiB: with a
// single pair a restore still waits for the running backup's pair).
//
// Every device call goes through DeviceApi (device_api.h): the real CUDA runtime in hiqcached,
// a fake device in the unit tests. This file includes no CUDA header.
//
// A task of a pool (docs/design.md "Completion: ticket slots"):
//   1. A transfer worker checks the task's wait on the host: until the engine's wait_event slot
//      holds wait_value the task is not ready (the worker moves on; past wait_timeout it fails
//      with DEADLINE_EXCEEDED, and once its caller's deadline passed with DEADLINE_EXCEEDED too,
//      touching nothing). No daemon stream ever waits on memory an engine controls. Then it
//      takes one staging slab pair of the pool's device (none free: retried later) and
//      enqueues, without waiting:
//        Backup:  per chunk k (blocks x layers that fit a slab): encode kernel into slab k%2 ->
//                 copy stream waits for it -> D2H copies into the reserved pool payloads; slab
//                 k%2 is encoded into again only after the copy stream finished reading it
//                 (events) -> non-finite flags D2H -> ticket into done_event's slot. Once the
//                 work completed, the payloads are hashed for the pool headers on
//                 hash_threads threads (BackupTask::checksums) before the blocks are published.
//        Restore: per unit k (group of consecutive layers, chunk of blocks): copy stream H2D
//                 copies into slab k%2 (after the decodes that last read it) -> compute waits
//                 for them -> per layer of the group a decode+scatter kernel, and after the
//                 last chunk's decode of layer l the ticket into slot layer_event_base + l ->
//                 the ticket into done_event's slot. When every block of the request fits a slab
//                 with at least one layer, a unit is all blocks x as many layers as fit, laid
//                 out block-major in the slab, so each block's layers of the unit (contiguous in
//                 its pool payload) arrive with one copy: n x ceil(layers / group) DMAs, not
//                 n x layers (2,048 tokens of Qwen3-8B in 16-token blocks through 16 MiB slabs:
//                 3 layers per unit, 1,536 copies instead of 4,608). Else a unit is one layer of
//                 as many blocks as fit.
//      The slot stores are cuStreamWriteValue64 on the compute stream (DeviceApi::WriteValue64),
//      so each lands only after the work it signals. Then it records the lane's completion event
//      on the compute stream. (An asynchronous request was answered when it was queued: its
//      outcome reaches the engine through the slots.)
//   2. The lane's CompletionThread (device_completion.h), blocked in cudaEventSynchronize on the
//      completion event (created with cudaEventBlockingSync: the thread sleeps, nothing polls),
//      wakes when the device completed the task's work, returns the slabs and
//      defers the rest to a worker: publish the backed-up blocks (visible to Lookup only from
//      then on) or drop the restore's pins, then the pool's next task of that direction starts.
//      A pool therefore has at most one backup and one restore on the device; each direction's
//      tasks run in request order, and the core holds back a task that conflicts with an
//      earlier one of the other direction (CacheCore: same rows or slots).
//   A task that fails stores `ticket | failed` into every slot it names from the host: at once
//   when nothing of it reached the device, else once its device work stopped (completed, or the
//   device was lost), so that an engine released by the failed bit never races a kernel still
//   writing its rows. No slot is left without its ticket, whatever fails.
// Staging is a fixed budget per device (CudaBackendOptions::staging_bytes), allocated when the
// first pool binds to the device; per-pool job arrays are allocated at bind. Nothing is
// allocated or freed on the request path, and nothing freed while the daemon runs (cudaFree
// synchronizes the device): released pools' arrays are kept for later binds. Bind enqueues no
// device work (the pool's views reach the device with its first task's job arrays): all device
// work of a pool belongs to a task, so once its tasks completed (what ReleasePool and shutdown
// wait for) nothing queued touches its arrays, and they may be reused or freed.
//
// A sticky device error (DeviceApi kDataLoss) fails the device: its requests fail with
// UNAVAILABLE from then on, and on_device_failed runs once, so that hiqcached exits and its
// service manager restarts it (the pool survives in shared memory). Any other error fails the
// one request.
//
// Thread-safety: as DeviceBackend says (a pool's StartBackup and StartRestore may run
// concurrently: they use separate lanes); Bind may run concurrently with tasks of other pools.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backends/device_api.h"
#include "backends/host_backend.h"
#include "core/device_backend.h"
#include "hiqcache/mutex.h"
#include "hiqcache/thread_annotations.h"
#include "thread_pool.h"

namespace hiqcache::server {

// "GPU-8c1f0a8e-...", "8c1f0a8e..." (32 hex digits, dashes ignored, any case) -> 32 lowercase
// hex digits. Returns false for anything else. Pure; used for cuda_device_uuid.
bool NormalizeCudaUuid(const std::string& in, std::string* out);

struct CudaBackendOptions {
  // Device memory for staging slabs, per device that has a pool (see StagingPlan).
  uint64_t staging_bytes = 128ull << 20;
  // Sizes the per-pool job arrays (rows and flags of one request).
  uint32_t max_blocks_per_request = 4096;
  // The pool is page-locked in chunks of this many bytes (the block store never lets an extent
  // cross a multiple of it, so no block straddles two registrations).
  uint64_t register_chunk_bytes = 64ull << 30;
  // Runs once, on the thread that saw it, when a device reports a sticky error. Must not block.
  std::function<void(int device, const Status&)> on_device_failed;
  // How long a task waits for its wait_event slot to reach wait_value before it fails.
  std::chrono::milliseconds wait_timeout{2000};
  // The rules for the engines' slot objects (the daemon's pool object refused); null = only the
  // caller's ownership of named objects is checked.
  const HostBackend* client_objects = nullptr;
  // Threads (the finishing transfer worker included) that hash a completed backup's payloads
  // (XXH3-64, the pool headers' checksums) in parallel, shared by the backend's pools; at most
  // the machine's hardware threads.
  unsigned hash_threads = 4;
};

// How a device's staging budget is cut: `pairs` pairs of slabs of `slab_bytes` each (every task
// holds one pair while it is on the device). Pure.
struct StagingPlan {
  uint32_t pairs = 0;
  uint64_t slab_bytes = 0;
  static StagingPlan For(uint64_t staging_bytes);
};

class CudaBackend : public DeviceBackend {
 public:
  // Page-locks [pool, pool + pool_bytes) for DMA with every device (RegisterHost in chunks of
  // options.register_chunk_bytes; rolled back on failure) and unregisters it on destruction.
  // `api` must outlive the backend.
  static StatusOr<std::unique_ptr<CudaBackend>> Create(DeviceApi* api, uint8_t* pool,
                                                       uint64_t pool_bytes,
                                                       CudaBackendOptions options);
  // REQUIRES: every binding was destroyed (the core is gone).
  ~CudaBackend() override;

  const char* name() const override { return "cuda"; }
  // The engine's buffers are device memory; its event slots are page-locked for the device at
  // registration, which faults every page in: the ones that were not resident are charged to
  // `fault_budget`, and a registration over it is refused.
  StatusOr<std::unique_ptr<PoolBinding>> Bind(const RegisterSpec& spec,
                                              const kernels::BlockLayout& layout,
                                              std::shared_ptr<FaultBudget> fault_budget) override;
  uint64_t StagingDeviceBytes() const override EXCLUDES(mu_);
  // OK, or the failure of the first device that failed.
  Status DeviceFailure() const EXCLUDES(mu_);

  struct Mapping;      // an opened IPC allocation, shared by every binding that names it
  struct DeviceState;  // staging, arenas and failure state of one device

 private:
  CudaBackend(DeviceApi* api, CudaBackendOptions options,
              std::vector<std::pair<uint8_t*, uint64_t>> registered);
  StatusOr<int> DeviceForUuid(const std::string& uuid) EXCLUDES(mu_);
  StatusOr<std::shared_ptr<DeviceState>> Device(int device) EXCLUDES(mu_);
  StatusOr<std::shared_ptr<Mapping>> OpenMapping(int device, const std::string& handle,
                                                 uint64_t size_bytes, const std::string& field)
      EXCLUDES(mu_);

  DeviceApi* const api_;
  const CudaBackendOptions options_;
  std::unique_ptr<kernels::ThreadPool> hash_pool_;
  std::vector<std::pair<uint8_t*, uint64_t>> registered_;  // host-registered chunks
  mutable Mutex mu_;
  std::vector<std::string> uuids_ GUARDED_BY(mu_);  // filled on first Bind
  std::map<int, std::shared_ptr<DeviceState>> devices_ GUARDED_BY(mu_);
  // Each handle is opened once per device (opening it twice fails); bindings share it.
  std::map<std::pair<int, std::string>, std::weak_ptr<Mapping>> mappings_ GUARDED_BY(mu_);
};

}  // namespace hiqcache::server
