// CUDA-backend helpers for engines whose KV pool lives in GPU memory (DESIGN.md "Data flow"):
// export the KV buffers and completion events to hiqcached through CUDA IPC.
//
//   CudaRuntimeMemory()  the CudaMemoryInfo of this process's CUDA runtime: allocation bases
//                        (cuMemGetAddressRange, reached through cudaGetDriverEntryPointByVersion),
//                        base IPC handles (cudaIpcGetMemHandle), GPU UUIDs (cudaDeviceProp::uuid).
//   ExportCudaTensors    ResolveCudaTensors (hiqcache/cuda_ipc.h) with the runtime's answers:
//                        views over arbitrary device tensors -> allocation bases + offsets.
//   CudaKvPool           SGLang / vLLM KV layouts over device pointers (the engine's own tensors,
//                        or memory the pool allocates itself, like HostKvPool for HOST).
//   CudaEventPool        interprocess events (cudaEventInterprocess | cudaEventDisableTiming):
//                        their handles go into EventPoolSpec; the engine's stream waits on event
//                        i (cudaStreamWaitEvent) before reading what the daemon wrote.
//
// Event rules (DESIGN.md "CUDA completion and event rules"). A CUDA event carries no ticket:
// cudaStreamWaitEvent and cudaEventQuery see the event's most recent record at the time of the
// call, so the order of records and waits is the whole protocol.
//   1. wait_event: record it on the stream whose work must precede the daemon's (Record) BEFORE
//      sending the request, and do not record it again until the reply has arrived. The daemon
//      never waits for it on the host: its own stream waits for it on the device, so a record
//      that completes late (the stream is behind, or waits for another TP rank) holds no daemon
//      thread.
//   2. Layer and done events: an asynchronous request (sync = false) is answered once the
//      daemon's stream waits and event records are enqueued (after the pool's previous request
//      completed on the device: a pool's requests run in order, one at a time). Right after an
//      OK reply, make the consuming streams wait on them (StreamWait), then launch what reads
//      the restored layer. Make every stream that must see this request's records wait before
//      sending another request that names the same events: the next request's records replace
//      them.
//   3. Do not poll Query() to decide when to wait: before the reply it reports the PREVIOUS
//      record (or "complete" for an event never recorded). After a sync = true reply the work is
//      complete; Query then reports this request's records.
//   4. An error reply (also for an asynchronous request whose enqueue failed) means the rows it
//      names hold garbage: the daemon still records every event it names, so nothing waiting on
//      them hangs, and the engine must treat those tokens as a miss (recompute).
//   5. Free KV buffers or destroy events only after ReleasePool returned OK (the daemon closes
//      its mappings once its device work on them has completed); a process that exits is
//      released the same way.
//
// Library hiq_client_cuda, which exists only when hiqcache is built with CUDA; it defines
// HIQ_CLIENT_HAVE_CUDA=1 for its users. The header includes no CUDA header: cudaStream_t is
// CUstream_st*, cudaEvent_t is CUevent_st*. Memory must come from cudaMalloc (or an allocator
// on top of it, such as PyTorch's caching allocator without expandable_segments): IPC cannot
// export cudaMallocAsync pools, VMM (cuMemCreate) or managed memory. FindCudaAllocation refuses
// such memory up front (CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE), saying what to change
// (PyTorch: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False). cuda_device_uuid must name the
// GPU that holds the buffers: the daemon rejects a registration whose buffers live on another
// GPU (it would otherwise map them as peer memory, over NVLink).
//
// Thread-safety: free functions are thread-safe. CudaKvPool and CudaEventPool are move-only
// owners; their const methods may be called from any thread. No call changes the calling
// thread's current device on return.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "hiqcache/cuda_ipc.h"
#include "hiqcache/host_shm.h"  // KvLayout
#include "hiqcache/layouts.h"
#include "hiqcache/pool_spec.h"
#include "hiqcache/status.h"

struct CUstream_st;  // cudaStream_t
struct CUevent_st;   // cudaEvent_t

namespace hiqcache {

// True when a CUDA device is visible and usable by this process; otherwise false with a
// one-line reason in *why (e.g. "cudaGetDeviceCount: cudaErrorInsufficientDriver (...)").
bool CudaClientAvailable(std::string* why);

// The real CudaMemoryInfo (a process-wide singleton).
const CudaMemoryInfo& CudaRuntimeMemory();
// "GPU-xxxxxxxx-..." of CUDA device `device` (this process's ordinal).
StatusOr<std::string> CudaDeviceUuid(int device);
// The allocation holding device address `ptr`.
StatusOr<CudaAllocation> FindCudaAllocation(const void* ptr);
// ResolveCudaTensors(tensors, CudaRuntimeMemory(), spec).
Status ExportCudaTensors(std::span<const CudaTensor> tensors, PoolSpec* spec);

class CudaEventPool {
 public:
  // `count` interprocess events on `device`. The pool owns them; destroy them only after
  // ReleasePool returned OK (the daemon's opened copies stay valid until then).
  static StatusOr<CudaEventPool> Create(int device, uint32_t count);

  CudaEventPool() = default;
  ~CudaEventPool();
  CudaEventPool(CudaEventPool&& other) noexcept;
  CudaEventPool& operator=(CudaEventPool&& other) noexcept;
  CudaEventPool(const CudaEventPool&) = delete;
  CudaEventPool& operator=(const CudaEventPool&) = delete;

  uint32_t count() const { return static_cast<uint32_t>(events_.size()); }
  int device() const { return device_; }
  // Wire forms (64 bytes each), in event order.
  const std::vector<std::string>& handles() const { return handles_; }
  // The EventPool piece of RegisterPool (cuda_ipc_event_handles).
  EventPoolSpec Spec() const;
  // REQUIRES: i < count().
  CUevent_st* event(uint32_t i) const { return events_[i]; }

  // Makes work enqueued later on `stream` wait until the most recent record of event i, at the
  // time of this call, has completed (cudaStreamWaitEvent). A CUDA event carries no ticket:
  // call this after the reply to the request that named the event (rule 2 above), never
  // earlier, or it waits for the previous record. INVALID_ARGUMENT for a bad index.
  Status StreamWait(CUstream_st* stream, uint32_t i) const;
  // Records event i on `stream`, e.g. as a request's wait_event, before sending the request
  // (the daemon's stream waits on it; rule 1 above).
  Status Record(uint32_t i, CUstream_st* stream) const;
  // True once the most recent record of event i has completed (also true if it was never
  // recorded). Before a request's reply this is the PREVIOUS record: not a way to learn that the
  // daemon's work is done (rule 3 above).
  StatusOr<bool> Query(uint32_t i) const;
  Status Synchronize(uint32_t i) const;

 private:
  void Reset();
  int device_ = -1;
  std::vector<CUevent_st*> events_;
  std::vector<std::string> handles_;
};

// An engine-style KV pool in device memory: the views of every layer over device tensors, the
// tensors' allocations as SharedBuffers (deduplicated), and the GPU's UUID.
class CudaKvPool {
 public:
  // Allocates with cudaMalloc, as engines do, one tensor per layer and plane ([rows, heads, dim]
  // K and V for kSglang; [blocks, page_rows, heads, dim] K and V for kVllmPaged; one
  // [blocks, heads, page_rows, 2*dim] for kVllmPackedKv), zero-filled, freed on destruction.
  // Paged layouts round num_rows up to whole pages. MLA only with kSglang.
  static StatusOr<CudaKvPool> Allocate(int device, const Geometry& geometry, KvLayout layout,
                                       uint32_t num_rows, uint32_t page_rows = 16);
  // Engine-owned tensors (not freed here), one pointer per layer. SGLang MHATokenToKVPool:
  // k[l], v[l] are [num_slots, heads, dim] (MLA: `v` empty, k[l] the latent buffer).
  static StatusOr<CudaKvPool> Sglang(const Geometry& geometry, uint32_t num_slots,
                                     std::span<void* const> k, std::span<void* const> v);
  // vLLM paged: k[l], v[l] are [num_blocks, block_size, heads, dim]; page_stride_bytes 0 = packed
  // pages (FlashInfer's [blocks, 2, block_size, heads, dim]: v[l] = k[l] + one page, page stride
  // two pages).
  static StatusOr<CudaKvPool> VllmPaged(const Geometry& geometry, uint32_t num_blocks,
                                        uint32_t block_size, std::span<void* const> k,
                                        std::span<void* const> v, uint64_t page_stride_bytes = 0);
  // vLLM packed K|V: kv[l] is [num_blocks, heads, block_size, 2 * dim].
  static StatusOr<CudaKvPool> VllmPackedKv(const Geometry& geometry, uint32_t num_blocks,
                                           uint32_t block_size, std::span<void* const> kv);

  CudaKvPool() = default;
  CudaKvPool(CudaKvPool&&) noexcept = default;
  CudaKvPool& operator=(CudaKvPool&&) noexcept = default;
  CudaKvPool(const CudaKvPool&) = delete;
  CudaKvPool& operator=(const CudaKvPool&) = delete;

  const Geometry& geometry() const { return geometry_; }
  KvLayout layout() const { return layout_; }
  uint32_t num_rows() const { return num_rows_; }
  int device() const { return device_; }
  const std::string& device_uuid() const { return device_uuid_; }
  // Deduplicated allocations (base handle, allocation size) and views relative to their bases.
  const std::vector<SharedBuffer>& buffers() const { return buffers_; }
  const std::vector<LayerView>& layers() const { return layers_; }
  // Device address of each buffer's allocation base (parallel to buffers()).
  const std::vector<uint64_t>& buffer_bases() const { return bases_; }

  // Appends buffers and views (buffer indices rebased) to *spec; sets geometry, device = kCuda
  // and cuda_device_uuid.
  void AddTo(PoolSpec* spec) const;
  // Device address of head_dim elements of (layer, plane 0 = K / 1 = V, row, head).
  // REQUIRES: indices in range.
  uint16_t* Head(uint32_t layer, uint32_t plane, uint32_t row, uint32_t head) const;

 private:
  // Views over `tensors` (TensorView::buffer = tensor index) -> wire form.
  static StatusOr<CudaKvPool> Build(const Geometry& geometry, KvLayout layout, uint32_t num_rows,
                                    std::vector<CudaTensor> tensors, std::vector<LayerView> views);

  Geometry geometry_;
  KvLayout layout_ = KvLayout::kSglang;
  uint32_t num_rows_ = 0;
  int device_ = -1;
  std::string device_uuid_;
  std::vector<SharedBuffer> buffers_;
  std::vector<uint64_t> bases_;
  std::vector<LayerView> layers_;
  // cudaFree on `device` (errors are logged, never thrown).
  struct DeviceFree {
    int device = -1;
    void operator()(void* ptr) const;
  };
  std::vector<std::unique_ptr<void, DeviceFree>> owned_;  // cudaMalloc'ed by Allocate
};

// A CUDA PoolSpec for `kv` (and `events`, when not null), ready for Client::RegisterPool.
PoolSpec MakeCudaPoolSpec(std::string model, const CudaKvPool& kv, uint32_t block_tokens,
                          const CudaEventPool* events = nullptr, Codec codec = Codec::kInt8PerHead);

}  // namespace hiqcache
