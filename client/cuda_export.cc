#include "hiqcache/cuda_export.h"

#include <cuda.h>  // CUresult / CUdeviceptr types only: the driver is reached through the runtime
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

#include "hiqcache/cuda_status.h"
#include "hiqcache/log.h"

namespace hiqcache {

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes,
              "cudaIpcMemHandle_t size changed: the wire format carries 64 bytes");
static_assert(sizeof(cudaUUID_t) == 16);
static_assert(std::is_same_v<cudaStream_t, CUstream_st*>);
static_assert(std::endian::native == std::endian::little,
              "StreamWait waits on a slot's low 32-bit word at its first byte");

namespace {

void LogIfError(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();
  if (err == cudaErrorCudartUnloading) return;  // process exit: the driver frees everything
  HIQ_LOG(WARN) << "hiqcache client: " << what << " failed: " << CudaErrorText(err);
}

// Makes `device` current for the scope, then restores the caller's device.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    cudaError_t err = cudaGetDevice(&saved_);
    if (err == cudaSuccess && saved_ != device) {
      err = cudaSetDevice(device);
      restore_ = err == cudaSuccess;
    }
    status_ = FromCuda(err, "cudaSetDevice(" + std::to_string(device) + ")");
  }
  ~ScopedDevice() {
    if (restore_) LogIfError(cudaSetDevice(saved_), "cudaSetDevice(restore)");
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  const Status& status() const { return status_; }

 private:
  int saved_ = 0;
  bool restore_ = false;
  Status status_;
};

// A driver function (its CUDA 12.0 ABI) through the runtime's driver entry point, so that nothing
// links libcuda and a binary starts (and reports "no GPU") on a machine without the driver.
StatusOr<void*> DriverFunction(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
  if (err != cudaSuccess) return FromCuda(err, "cudaGetDriverEntryPointByVersion");
  if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
    return FailedPrecondition(std::string(name) + " is not available from the CUDA driver");
  }
  return fn;
}

using MemGetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

StatusOr<MemGetAddressRangeFn> MemGetAddressRange() {
  HIQ_ASSIGN_OR_RETURN(void* fn, DriverFunction("cuMemGetAddressRange"));
  return reinterpret_cast<MemGetAddressRangeFn>(fn);
}

// cuPointerGetAttribute; null when the driver lacks it.
using PointerGetAttributeFn = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);

PointerGetAttributeFn PointerGetAttribute() {
  StatusOr<void*> fn = DriverFunction("cuPointerGetAttribute");
  return fn.ok() ? reinterpret_cast<PointerGetAttributeFn>(*fn) : nullptr;
}

// The stream memory operations the ticket slots use, and cuGetErrorName for their errors.
using StreamWaitValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using StreamWriteValue64Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using GetErrorNameFn = CUresult (*)(CUresult, const char**);

struct StreamMemOps {
  Status status;  // why the functions below are missing
  StreamWaitValue32Fn wait32 = nullptr;
  StreamWriteValue64Fn write64 = nullptr;
  GetErrorNameFn error_name = nullptr;
};

const StreamMemOps& MemOps() {
  static const StreamMemOps* ops = [] {
    auto* o = new StreamMemOps();  // never destroyed: used at exit
    StatusOr<void*> wait = DriverFunction("cuStreamWaitValue32");
    StatusOr<void*> write = DriverFunction("cuStreamWriteValue64");
    StatusOr<void*> name = DriverFunction("cuGetErrorName");
    if (!wait.ok()) o->status = wait.status();
    if (!write.ok()) o->status = write.status();
    if (o->status.ok()) {
      o->wait32 = reinterpret_cast<StreamWaitValue32Fn>(*wait);
      o->write64 = reinterpret_cast<StreamWriteValue64Fn>(*write);
    }
    if (name.ok()) o->error_name = reinterpret_cast<GetErrorNameFn>(*name);
    return o;
  }();
  return *ops;
}

// A failed driver call as a Status.
Status FromDriver(CUresult res, const std::string& what) {
  if (res == CUDA_SUCCESS) return Status::Ok();
  const char* name = nullptr;
  if (MemOps().error_name != nullptr) MemOps().error_name(res, &name);
  const std::string text = what + ": CUresult " + std::to_string(static_cast<int>(res)) +
                           (name != nullptr ? std::string(" (") + name + ")" : "");
  if (res == CUDA_ERROR_INVALID_VALUE || res == CUDA_ERROR_INVALID_HANDLE) {
    return InvalidArgument(text);
  }
  if (res == CUDA_ERROR_NOT_SUPPORTED) return FailedPrecondition(text);
  return Internal(text);
}

// Memory that cudaIpcGetMemHandle cannot export (VMM: cuMemCreate, PyTorch's expandable
// segments), refused with what to change before anything tries to share it. A driver that does
// not know the attribute answers nothing, and the export itself reports the error later.
Status CheckLegacyIpcCapable(uint64_t ptr) {
  static const PointerGetAttributeFn get = PointerGetAttribute();
  if (get == nullptr) return Status::Ok();
  int capable = 1;
  const CUresult res =
      get(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, static_cast<CUdeviceptr>(ptr));
  if (res != CUDA_SUCCESS || capable != 0) return Status::Ok();
  return FailedPrecondition(
      "CUDA tensor: its memory is a VMM allocation (cuMemCreate, e.g. PyTorch's expandable "
      "segments), which CUDA IPC (cudaIpcGetMemHandle) cannot share with hiqcached: allocate the "
      "KV cache with cudaMalloc; with PyTorch start the engine with "
      "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False");
}

class RuntimeMemory final : public CudaMemoryInfo {
 public:
  StatusOr<CudaAllocation> Find(uint64_t ptr) const override {
    cudaPointerAttributes attr{};
    const cudaError_t err = cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(ptr));
    HIQ_RETURN_IF_ERROR(FromCuda(err, "cudaPointerGetAttributes"));
    if (attr.type != cudaMemoryTypeDevice) {
      const char* kind = attr.type == cudaMemoryTypeManaged ? "managed memory"
                         : attr.type == cudaMemoryTypeHost  ? "pinned host memory"
                                                            : "not CUDA memory";
      return FailedPrecondition(std::string("CUDA tensor: the pointer is ") + kind +
                                "; CUDA IPC exports device memory from cudaMalloc only");
    }
    HIQ_ASSIGN_OR_RETURN(MemGetAddressRangeFn range, MemGetAddressRange());
    ScopedDevice guard(attr.device);
    HIQ_RETURN_IF_ERROR(guard.status());
    HIQ_RETURN_IF_ERROR(CheckLegacyIpcCapable(ptr));
    CUdeviceptr base = 0;
    size_t size = 0;
    const CUresult res = range(&base, &size, static_cast<CUdeviceptr>(ptr));
    if (res != CUDA_SUCCESS) {
      return FailedPrecondition("cuMemGetAddressRange failed with CUresult " +
                                std::to_string(static_cast<int>(res)));
    }
    return CudaAllocation{static_cast<uint64_t>(base), static_cast<uint64_t>(size), attr.device};
  }

  StatusOr<CudaIpcHandle> ExportBase(const CudaAllocation& a) const override {
    ScopedDevice guard(a.device);
    HIQ_RETURN_IF_ERROR(guard.status());
    cudaIpcMemHandle_t h;
    const cudaError_t err = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(a.base));
    if (err != cudaSuccess) {
      Status s = FromCuda(err, "cudaIpcGetMemHandle of the allocation base");
      return FailedPrecondition(s.message() +
                                " (IPC needs cudaMalloc memory: not cudaMallocAsync pools, "
                                "cuMemCreate/VMM such as PyTorch expandable_segments, or "
                                "managed memory)");
    }
    CudaIpcHandle out;
    std::memcpy(out.bytes.data(), &h, sizeof(h));
    return out;
  }

  StatusOr<std::string> DeviceUuid(int device) const override {
    cudaDeviceProp prop;
    HIQ_RETURN_IF_ERROR(FromCuda(cudaGetDeviceProperties(&prop, device),
                                 "cudaGetDeviceProperties(" + std::to_string(device) + ")"));
    std::array<uint8_t, 16> bytes;
    std::memcpy(bytes.data(), prop.uuid.bytes, bytes.size());
    return FormatCudaUuid(bytes);
  }
};

}  // namespace

// --- free functions ----------------------------------------------------------------------------

bool CudaClientAvailable(std::string* why) {
  std::string reason;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorNoDevice || (err == cudaSuccess && count == 0)) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    reason = "no CUDA device visible";
    if (visible != nullptr) reason += std::string(" (CUDA_VISIBLE_DEVICES='") + visible + "')";
  } else if (err != cudaSuccess) {
    reason = "cudaGetDeviceCount: " + CudaErrorText(err);
  } else if ((err = cudaFree(nullptr)) != cudaSuccess) {
    reason = "cannot create a CUDA context: " + CudaErrorText(err);
  }
  if (reason.empty()) return true;
  (void)cudaGetLastError();
  if (why != nullptr) *why = reason;
  return false;
}

const CudaMemoryInfo& CudaRuntimeMemory() {
  static const RuntimeMemory* memory = new RuntimeMemory();  // never destroyed: used at exit
  return *memory;
}

StatusOr<std::string> CudaDeviceUuid(int device) { return CudaRuntimeMemory().DeviceUuid(device); }

StatusOr<CudaAllocation> FindCudaAllocation(const void* ptr) {
  return CudaRuntimeMemory().Find(reinterpret_cast<uintptr_t>(ptr));
}

Status ExportCudaTensors(std::span<const CudaTensor> tensors, PoolSpec* spec) {
  return ResolveCudaTensors(tensors, CudaRuntimeMemory(), spec);
}

// --- CudaTicketSlots ---------------------------------------------------------------------------

StatusOr<CudaTicketSlots> CudaTicketSlots::Create(int device, uint32_t count) {
  if (count == 0) return InvalidArgument("CudaTicketSlots: count must be > 0");
  // Whole pages: cudaHostRegister page-locks whole pages anyway.
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t bytes = (size_t{count} * kSlotBytes + page - 1) / page * page;
  ScopedDevice guard(device);
  HIQ_RETURN_IF_ERROR(guard.status());
  HIQ_RETURN_IF_ERROR(MemOps().status);
  CudaTicketSlots slots;
  HIQ_ASSIGN_OR_RETURN(slots.shm_, HostShm::CreateMemfd("cuda-slots", bytes, /*fixed_size=*/true));
  slots.device_ = device;
  slots.count_ = count;
  HIQ_RETURN_IF_ERROR(FromCuda(
      cudaHostRegister(slots.shm_.data(), bytes, cudaHostRegisterPortable | cudaHostRegisterMapped),
      "cudaHostRegister(ticket slots)"));
  slots.registered_ = true;
  void* device_ptr = nullptr;
  HIQ_RETURN_IF_ERROR(FromCuda(cudaHostGetDevicePointer(&device_ptr, slots.shm_.data(), 0),
                               "cudaHostGetDevicePointer(ticket slots)"));
  slots.device_ptr_ = reinterpret_cast<uintptr_t>(device_ptr);
  return slots;
}

CudaTicketSlots::~CudaTicketSlots() { Reset(); }

CudaTicketSlots::CudaTicketSlots(CudaTicketSlots&& other) noexcept
    : shm_(std::move(other.shm_)),
      device_(std::exchange(other.device_, -1)),
      count_(std::exchange(other.count_, 0)),
      device_ptr_(std::exchange(other.device_ptr_, 0)),
      registered_(std::exchange(other.registered_, false)) {}

CudaTicketSlots& CudaTicketSlots::operator=(CudaTicketSlots&& other) noexcept {
  if (this != &other) {
    Reset();
    shm_ = std::move(other.shm_);
    device_ = std::exchange(other.device_, -1);
    count_ = std::exchange(other.count_, 0);
    device_ptr_ = std::exchange(other.device_ptr_, 0);
    registered_ = std::exchange(other.registered_, false);
  }
  return *this;
}

void CudaTicketSlots::Reset() {
  if (registered_) {
    ScopedDevice guard(device_);
    LogIfError(cudaHostUnregister(shm_.data()), "cudaHostUnregister(ticket slots)");
    registered_ = false;
  }
  shm_ = HostShm();
  device_ = -1;
  count_ = 0;
  device_ptr_ = 0;
}

EventPoolSpec CudaTicketSlots::Spec() const {
  EventPoolSpec spec;
  spec.host_fd = shm_.fd();
  spec.count = count_;
  return spec;
}

Status CudaTicketSlots::CheckSlot(uint32_t slot) const {
  if (slot < count_) return Status::Ok();
  return InvalidArgument("CudaTicketSlots: slot " + std::to_string(slot) + " out of range (" +
                         std::to_string(count_) + " slots)");
}

uint64_t CudaTicketSlots::Read(uint32_t slot) const {
  auto* p = reinterpret_cast<uint64_t*>(static_cast<char*>(shm_.data()) + slot * kSlotBytes);
  return std::atomic_ref<uint64_t>(*p).load(std::memory_order_acquire);
}

void CudaTicketSlots::Store(uint32_t slot, uint64_t value) const {
  auto* p = reinterpret_cast<uint64_t*>(static_cast<char*>(shm_.data()) + slot * kSlotBytes);
  std::atomic_ref<uint64_t>(*p).store(value, std::memory_order_release);
}

Status CudaTicketSlots::Wait(uint32_t slot, uint64_t ticket,
                             std::chrono::nanoseconds timeout) const {
  HIQ_RETURN_IF_ERROR(CheckSlot(slot));
  return WaitForTicket(
      reinterpret_cast<const uint64_t*>(static_cast<char*>(shm_.data()) + slot * kSlotBytes),
      ticket, timeout);
}

Status CudaTicketSlots::StreamWait(CUstream_st* stream, uint32_t slot, uint64_t ticket) const {
  HIQ_RETURN_IF_ERROR(CheckSlot(slot));
  const StreamMemOps& ops = MemOps();
  HIQ_RETURN_IF_ERROR(ops.status);
  ScopedDevice guard(device_);
  HIQ_RETURN_IF_ERROR(guard.status());
  return FromDriver(ops.wait32(stream, static_cast<CUdeviceptr>(device_address(slot)),
                               static_cast<cuuint32_t>(ticket), CU_STREAM_WAIT_VALUE_GEQ),
                    "cuStreamWaitValue32(slot " + std::to_string(slot) + ", ticket " +
                        std::to_string(ticket) + ")");
}

Status CudaTicketSlots::StreamWrite(CUstream_st* stream, uint32_t slot, uint64_t value) const {
  HIQ_RETURN_IF_ERROR(CheckSlot(slot));
  const StreamMemOps& ops = MemOps();
  HIQ_RETURN_IF_ERROR(ops.status);
  ScopedDevice guard(device_);
  HIQ_RETURN_IF_ERROR(guard.status());
  return FromDriver(ops.write64(stream, static_cast<CUdeviceptr>(device_address(slot)), value,
                                CU_STREAM_WRITE_VALUE_DEFAULT),
                    "cuStreamWriteValue64(slot " + std::to_string(slot) + ")");
}

// --- CudaKvPool --------------------------------------------------------------------------------

void CudaKvPool::DeviceFree::operator()(void* ptr) const {
  if (ptr == nullptr) return;
  ScopedDevice guard(device);
  LogIfError(cudaFree(ptr), "cudaFree");
}

namespace {

Status CheckGeometry(const Geometry& g, size_t num_layers_given, const char* what) {
  if (g.num_layers == 0 || g.num_kv_heads == 0 || g.head_dim == 0) {
    return InvalidArgument(std::string(what) + ": geometry must be non-zero");
  }
  if (num_layers_given != g.num_layers) {
    return InvalidArgument(std::string(what) + ": expected " + std::to_string(g.num_layers) +
                           " tensors per plane (geometry.num_layers), got " +
                           std::to_string(num_layers_given));
  }
  return Status::Ok();
}

}  // namespace

StatusOr<CudaKvPool> CudaKvPool::Build(const Geometry& geometry, KvLayout layout, uint32_t num_rows,
                                       std::vector<CudaTensor> tensors,
                                       std::vector<LayerView> views) {
  PoolSpec spec;
  spec.geometry = geometry;
  spec.layers = std::move(views);
  std::vector<CudaAllocation> allocations;
  HIQ_RETURN_IF_ERROR(ResolveCudaTensors(tensors, CudaRuntimeMemory(), &spec, &allocations));
  CudaKvPool pool;
  pool.geometry_ = geometry;
  pool.layout_ = layout;
  pool.num_rows_ = num_rows;
  pool.device_ = allocations.front().device;
  pool.device_uuid_ = spec.cuda_device_uuid;
  pool.buffers_ = std::move(spec.buffers);
  pool.layers_ = std::move(spec.layers);
  for (const CudaAllocation& a : allocations) pool.bases_.push_back(a.base);
  return pool;
}

StatusOr<CudaKvPool> CudaKvPool::Sglang(const Geometry& g, uint32_t num_slots,
                                        std::span<void* const> k, std::span<void* const> v) {
  HIQ_RETURN_IF_ERROR(CheckGeometry(g, k.size(), "CudaKvPool::Sglang k"));
  const bool mla = g.attention == Attention::kMLA;
  if (!mla) HIQ_RETURN_IF_ERROR(CheckGeometry(g, v.size(), "CudaKvPool::Sglang v"));
  if (num_slots == 0) return InvalidArgument("CudaKvPool::Sglang: num_slots must be > 0");
  const uint64_t bytes = SlotMajorBytes(g, num_slots);
  std::vector<CudaTensor> tensors;
  std::vector<LayerView> views;
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    const uint32_t ki = static_cast<uint32_t>(tensors.size());
    tensors.push_back({k[l], bytes});
    uint32_t vi = ki;
    if (!mla) {
      vi = static_cast<uint32_t>(tensors.size());
      tensors.push_back({v[l], bytes});
    }
    views.push_back(SglangLayerView(g, num_slots, {ki, 0}, {vi, 0}));
  }
  return Build(g, KvLayout::kSglang, num_slots, std::move(tensors), std::move(views));
}

StatusOr<CudaKvPool> CudaKvPool::VllmPaged(const Geometry& g, uint32_t num_blocks,
                                           uint32_t block_size, std::span<void* const> k,
                                           std::span<void* const> v, uint64_t page_stride_bytes) {
  HIQ_RETURN_IF_ERROR(CheckGeometry(g, k.size(), "CudaKvPool::VllmPaged k"));
  HIQ_RETURN_IF_ERROR(CheckGeometry(g, v.size(), "CudaKvPool::VllmPaged v"));
  if (g.attention == Attention::kMLA) return InvalidArgument("CudaKvPool::VllmPaged: MHA only");
  if (num_blocks == 0 || block_size == 0) {
    return InvalidArgument("CudaKvPool::VllmPaged: num_blocks and block_size must be > 0");
  }
  const uint64_t page = uint64_t{block_size} * g.RowBytes();
  const uint64_t stride = page_stride_bytes != 0 ? page_stride_bytes : page;
  const uint64_t bytes = (uint64_t{num_blocks} - 1) * stride + page;  // what the views address
  std::vector<CudaTensor> tensors;
  std::vector<LayerView> views;
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    const uint32_t ki = static_cast<uint32_t>(tensors.size());
    tensors.push_back({k[l], bytes});
    tensors.push_back({v[l], bytes});
    views.push_back(
        VllmPagedLayerView(g, num_blocks, block_size, {ki, 0}, {ki + 1, 0}, page_stride_bytes));
  }
  return Build(g, KvLayout::kVllmPaged, num_blocks * block_size, std::move(tensors),
               std::move(views));
}

StatusOr<CudaKvPool> CudaKvPool::VllmPackedKv(const Geometry& g, uint32_t num_blocks,
                                              uint32_t block_size, std::span<void* const> kv) {
  HIQ_RETURN_IF_ERROR(CheckGeometry(g, kv.size(), "CudaKvPool::VllmPackedKv"));
  if (g.attention == Attention::kMLA)
    return InvalidArgument("CudaKvPool::VllmPackedKv: no V in MLA");
  if (num_blocks == 0 || block_size == 0) {
    return InvalidArgument("CudaKvPool::VllmPackedKv: num_blocks and block_size must be > 0");
  }
  const uint64_t bytes = VllmPackedKvBytes(g, num_blocks, block_size);
  std::vector<CudaTensor> tensors;
  std::vector<LayerView> views;
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    tensors.push_back({kv[l], bytes});
    views.push_back(VllmPackedKvLayerView(g, num_blocks, block_size, {l, 0}));
  }
  return Build(g, KvLayout::kVllmPackedKv, num_blocks * block_size, std::move(tensors),
               std::move(views));
}

StatusOr<CudaKvPool> CudaKvPool::Allocate(int device, const Geometry& g, KvLayout layout,
                                          uint32_t num_rows, uint32_t page_rows) {
  if (g.num_layers == 0 || g.num_kv_heads == 0 || g.head_dim == 0 || num_rows == 0) {
    return InvalidArgument("CudaKvPool::Allocate: geometry and num_rows must be non-zero");
  }
  if (layout != KvLayout::kSglang && page_rows == 0) {
    return InvalidArgument("CudaKvPool::Allocate: page_rows must be > 0 for paged layouts");
  }
  if (layout != KvLayout::kSglang && g.attention == Attention::kMLA) {
    return InvalidArgument("CudaKvPool::Allocate: MLA only with the SGLang layout");
  }
  const uint32_t num_blocks =
      layout == KvLayout::kSglang ? 0 : (num_rows + page_rows - 1) / page_rows;
  uint64_t bytes = 0;
  switch (layout) {
    case KvLayout::kSglang:
      bytes = SlotMajorBytes(g, num_rows);
      break;
    case KvLayout::kVllmPaged:
      bytes = VllmPagedBytes(g, num_blocks, page_rows);
      break;
    case KvLayout::kVllmPackedKv:
      bytes = VllmPackedKvBytes(g, num_blocks, page_rows);
      break;
  }
  const uint32_t tensors_per_layer =
      layout == KvLayout::kVllmPackedKv || g.attention == Attention::kMLA ? 1 : 2;
  std::vector<std::unique_ptr<void, DeviceFree>> owned;
  {
    ScopedDevice guard(device);
    HIQ_RETURN_IF_ERROR(guard.status());
    for (uint32_t i = 0; i < g.num_layers * tensors_per_layer; ++i) {
      void* ptr = nullptr;
      HIQ_RETURN_IF_ERROR(
          FromCuda(cudaMalloc(&ptr, bytes), "cudaMalloc(" + std::to_string(bytes) + ")"));
      owned.emplace_back(ptr, DeviceFree{device});
      HIQ_RETURN_IF_ERROR(FromCuda(cudaMemset(ptr, 0, bytes), "cudaMemset"));
    }
  }
  std::vector<void*> k, v;
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    k.push_back(owned[l * tensors_per_layer].get());
    if (tensors_per_layer == 2) v.push_back(owned[l * tensors_per_layer + 1].get());
  }
  StatusOr<CudaKvPool> pool = Status(StatusCode::kInternal, "unreachable");
  switch (layout) {
    case KvLayout::kSglang:
      pool = Sglang(g, num_rows, k, v);
      break;
    case KvLayout::kVllmPaged:
      pool = VllmPaged(g, num_blocks, page_rows, k, v);
      break;
    case KvLayout::kVllmPackedKv:
      pool = VllmPackedKv(g, num_blocks, page_rows, k);
      break;
  }
  if (!pool.ok()) return pool.status();
  pool->owned_ = std::move(owned);
  return pool;
}

void CudaKvPool::AddTo(PoolSpec* spec) const {
  const uint32_t index = static_cast<uint32_t>(spec->buffers.size());
  spec->buffers.insert(spec->buffers.end(), buffers_.begin(), buffers_.end());
  for (LayerView layer : layers_) {
    layer.k.buffer += index;
    if (layer.v) layer.v->buffer += index;
    spec->layers.push_back(layer);
  }
  spec->geometry = geometry_;
  spec->device = DeviceKind::kCuda;
  spec->cuda_device_uuid = device_uuid_;
}

uint16_t* CudaKvPool::Head(uint32_t layer, uint32_t plane, uint32_t row, uint32_t head) const {
  const LayerView& view = layers_[layer];
  const TensorView& t = plane == 0 ? view.k : *view.v;
  return reinterpret_cast<uint16_t*>(bases_[t.buffer] +
                                     t.HeadOffset(row, head, geometry_.HeadBytes()));
}

PoolSpec MakeCudaPoolSpec(std::string model, const CudaKvPool& kv, uint32_t block_tokens,
                          const CudaTicketSlots* slots, Codec codec) {
  PoolSpec spec;
  spec.model = std::move(model);
  spec.block_tokens = block_tokens;
  spec.codec = codec;
  kv.AddTo(&spec);
  if (slots != nullptr) spec.events = slots->Spec();
  return spec;
}

}  // namespace hiqcache
