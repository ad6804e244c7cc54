// CUDA-backend helpers for engines whose KV pool lives in GPU memory (docs/design.md "Data flow"):
// export the KV buffers to hiqcached through CUDA IPC, and complete work through ticket slots.
//
//   CudaRuntimeMemory()  the CudaMemoryInfo of this process's CUDA runtime: allocation bases
//                        (cuMemGetAddressRange, reached through cudaGetDriverEntryPointByVersion),
//                        base IPC handles (cudaIpcGetMemHandle), GPU UUIDs (cudaDeviceProp::uuid).
//   ExportCudaTensors    ResolveCudaTensors (hiqcache/cuda_ipc.h) with the runtime's answers:
//                        views over arbitrary device tensors -> allocation bases + offsets.
//   CudaKvPool           SGLang / vLLM KV layouts over device pointers (the engine's own tensors,
//                        or memory the pool allocates itself, like HostKvPool for HOST).
//   CudaTicketSlots      ticket slots in a sealed memfd, page-locked and mapped for the GPU: the
//                        engine's streams wait on them (cuStreamWaitValue32) and write them
//                        (cuStreamWriteValue64); its EventPoolSpec goes into the PoolSpec.
//
// Slot rules (docs/design.md "Completion: ticket slots"). Slot i is a uint64 in host memory that
// the engine, its client library and the daemon all map: bits 0..62 a ticket, bit 63 the failed
// bit (kEventFailedBit). A slot's ticket part only grows.
//   1. wait_event, wait_value: the daemon touches the request's rows only once the slot holds
//      >= wait_value, and it watches from the host, so a late write holds no daemon stream.
//      StreamWrite(stream, slot, value) on the stream that writes (backup) or last reads
//      (restore) those rows, before or after sending the request. Use a fresh, increasing value
//      per request on a slot, and slots of their own for wait values.
//   2. done_event, layer_event_base + l: once the reply gives ticket T, StreamWait(stream, slot,
//      T) before the work that reads what the daemon wrote (or Wait on the host). T, a later
//      ticket, or a value with the failed bit releases the wait: the failed bit means the work
//      failed, or the daemon died and the client released the slot (client.h). A host Wait then
//      answers ABORTED; a stream cannot tell, so read the slot (Read) before trusting what was
//      computed from those rows, and treat them as a miss when the bit is set.
//   3. An error reply means the rows it names hold garbage; the daemon still stores T | failed in
//      every slot the request names, so nothing waiting hangs.
//   4. Free KV buffers only after ReleasePool returned OK (the daemon closes its mappings once its
//      device work on them has completed); a process that exits is released the same way.
//      Destroy CudaTicketSlots only once no stream waits on or writes its slots.
//
// Library hiq_client_cuda, which exists only when hiqcache is built with CUDA; it defines
// HIQ_CLIENT_HAVE_CUDA=1 for its users. The header includes no CUDA header: cudaStream_t is
// CUstream_st*. Memory must come from cudaMalloc (or an allocator on top of it, such as
// PyTorch's caching allocator without expandable_segments): IPC cannot export cudaMallocAsync
// pools, VMM (cuMemCreate) or managed memory. FindCudaAllocation refuses such memory up front
// (CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE), saying what to change (PyTorch:
// PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False). cuda_device_uuid must name the GPU that
// holds the buffers: the daemon rejects a registration whose buffers live on another GPU (it
// would otherwise map them as peer memory, over NVLink).
//
// Thread-safety: free functions are thread-safe. CudaKvPool and CudaTicketSlots are move-only
// owners; their const methods may be called from any thread. No call changes the calling
// thread's current device on return.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "hiqcache/cuda_ipc.h"
#include "hiqcache/host_shm.h"  // KvLayout, HostShm, WaitForTicket
#include "hiqcache/layouts.h"
#include "hiqcache/pool_spec.h"
#include "hiqcache/status.h"

struct CUstream_st;  // cudaStream_t

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

class CudaTicketSlots {
 public:
  static constexpr size_t kSlotBytes = HostEventPool::kSlotBytes;

  // `count` zeroed slots for device `device`: a memfd sealed against shrinking and growing,
  // mapped, page-locked (cudaHostRegister, portable and mapped) with its device address.
  static StatusOr<CudaTicketSlots> Create(int device, uint32_t count);

  CudaTicketSlots() = default;
  ~CudaTicketSlots();  // unregisters and unmaps (errors are logged)
  CudaTicketSlots(CudaTicketSlots&& other) noexcept;
  CudaTicketSlots& operator=(CudaTicketSlots&& other) noexcept;
  CudaTicketSlots(const CudaTicketSlots&) = delete;
  CudaTicketSlots& operator=(const CudaTicketSlots&) = delete;

  uint32_t count() const { return count_; }
  int device() const { return device_; }
  bool valid() const { return count_ != 0; }
  // The memfd and its host mapping.
  const HostShm& shm() const { return shm_; }
  // The EventPool piece of RegisterPool: host_fd (the memfd, passed over the session) and
  // count. The spec borrows the fd: keep this object alive while the pool is registered.
  EventPoolSpec Spec() const;
  // Device address of slot `slot` (for kernels of the engine's own). REQUIRES: slot < count().
  uint64_t device_address(uint32_t slot) const { return device_ptr_ + slot * kSlotBytes; }

  // Acquire load / release store from the host. REQUIRES: slot < count().
  uint64_t Read(uint32_t slot) const;
  void Store(uint32_t slot, uint64_t value) const;
  // Host wait, as HostEventPool::Wait: OK once the slot holds a ticket >= ticket, ABORTED when
  // that value carries the failed bit, DEADLINE_EXCEEDED after `timeout`, INVALID_ARGUMENT for a
  // bad slot.
  Status Wait(uint32_t slot, uint64_t ticket, std::chrono::nanoseconds timeout) const;

  // Makes work enqueued later on `stream` wait until slot `slot` holds ticket `ticket` or later,
  // failed or not. A 64-bit CU_STREAM_WAIT_VALUE_GEQ compares cyclically and would never accept
  // a value with bit 63, so this waits with cuStreamWaitValue32 GEQ (cyclic) on the slot's low
  // word: the slot's ticket part must stay within 2^31 of `ticket`.
  // INVALID_ARGUMENT for a bad slot; the driver's error otherwise.
  Status StreamWait(CUstream_st* stream, uint32_t slot, uint64_t ticket) const;
  // Stores `value` into slot `slot` once the work enqueued on `stream` before it has completed
  // (cuStreamWriteValue64, with its memory barrier): a request's wait_value.
  Status StreamWrite(CUstream_st* stream, uint32_t slot, uint64_t value) const;

 private:
  Status CheckSlot(uint32_t slot) const;
  void Reset();

  HostShm shm_;
  int device_ = -1;
  uint32_t count_ = 0;
  uint64_t device_ptr_ = 0;
  bool registered_ = false;  // shm_.data() is page-locked with cudaHostRegister
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

// A CUDA PoolSpec for `kv` (and `slots`, when not null), ready for Client::RegisterPool.
PoolSpec MakeCudaPoolSpec(std::string model, const CudaKvPool& kv, uint32_t block_tokens,
                          const CudaTicketSlots* slots = nullptr,
                          Codec codec = Codec::kInt8PerHead);

}  // namespace hiqcache
