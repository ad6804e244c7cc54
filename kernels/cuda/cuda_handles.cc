#include "cuda_handles.h"

#include <cuda.h>  // CUresult / CUdeviceptr types only: the driver is reached through the runtime
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>

#include "hiqcache/cuda_status.h"
#include "hiqcache/log.h"

namespace hiqcache::kernels {

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes,
              "cudaIpcMemHandle_t size changed: the wire format carries 64 bytes");
static_assert(sizeof(cudaIpcEventHandle_t) == kCudaIpcHandleBytes,
              "cudaIpcEventHandle_t size changed: the wire format carries 64 bytes");
static_assert(std::is_same_v<cudaStream_t, CUstream_st*>);
static_assert(std::is_same_v<cudaEvent_t, CUevent_st*>);

namespace {

// For destructors: never throws; logs and clears.
void LogIfError(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  cudaGetLastError();
  // At process exit the runtime may be torn down before a static owner: the driver releases
  // everything anyway, so that is not worth a warning.
  if (err == cudaErrorCudartUnloading) return;
  HIQ_LOG(WARN) << what << " failed: " << CudaErrorText(err);
}

template <typename Handle>
Status HandleFromBytes(std::string_view bytes, Handle* handle, const char* what) {
  if (bytes.size() != sizeof(Handle)) {
    return InvalidArgument(std::string(what) + ": IPC handle must be " +
                           std::to_string(sizeof(Handle)) + " bytes, got " +
                           std::to_string(bytes.size()));
  }
  std::memcpy(handle, bytes.data(), sizeof(Handle));
  return Status::Ok();
}

template <typename Handle>
std::string HandleToBytes(const Handle& handle) {
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(Handle));
}

// cuMemGetAddressRange through the runtime's driver entry point, so no binary links libcuda
// directly (a test binary must start on a machine without the driver).
using MemGetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

StatusOr<MemGetAddressRangeFn> GetMemGetAddressRange() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                                     cudaEnableDefault, &found);
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
    if (err != cudaSuccess) cudaGetLastError();
    return Internal("cuMemGetAddressRange is not available from the driver");
  }
  return reinterpret_cast<MemGetAddressRangeFn>(fn);
}

}  // namespace

// --- DeviceGuard ---------------------------------------------------------------------------

DeviceGuard::DeviceGuard(int device) {
  cudaError_t err = cudaGetDevice(&saved_);
  if (err != cudaSuccess) {
    status_ = FromCuda(err, "cudaGetDevice");
    return;
  }
  if (saved_ == device) return;
  err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    status_ = FromCuda(err, ("cudaSetDevice(" + std::to_string(device) + ")").c_str());
    return;
  }
  restore_ = true;
}

DeviceGuard::~DeviceGuard() {
  if (restore_) LogIfError(cudaSetDevice(saved_), "DeviceGuard: cudaSetDevice(restore)");
}

// --- CudaStream ----------------------------------------------------------------------------

StatusOr<CudaStream> CudaStream::Create(int device, bool non_blocking, int priority) {
  DeviceGuard guard(device);
  HIQ_RETURN_IF_ERROR(guard.status());
  cudaStream_t stream = nullptr;
  HIQ_RETURN_IF_ERROR(
      FromCuda(cudaStreamCreateWithPriority(
                   &stream, non_blocking ? cudaStreamNonBlocking : cudaStreamDefault, priority),
               "cudaStreamCreateWithPriority"));
  return CudaStream(device, stream);
}

CudaStream::CudaStream(CudaStream&& other) noexcept
    : device_(other.device_), stream_(std::exchange(other.stream_, nullptr)) {}

CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = other.device_;
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

Status CudaStream::Synchronize() const {
  return FromCuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

void CudaStream::Reset() {
  if (stream_ == nullptr) return;
  DeviceGuard guard(device_);
  LogIfError(cudaStreamDestroy(std::exchange(stream_, nullptr)), "cudaStreamDestroy");
}

// --- CudaEvent -----------------------------------------------------------------------------

StatusOr<CudaEvent> CudaEvent::Create(int device, bool interprocess) {
  DeviceGuard guard(device);
  HIQ_RETURN_IF_ERROR(guard.status());
  cudaEvent_t event = nullptr;
  const unsigned flags =
      cudaEventDisableTiming | (interprocess ? static_cast<unsigned>(cudaEventInterprocess) : 0u);
  HIQ_RETURN_IF_ERROR(
      FromCuda(cudaEventCreateWithFlags(&event, flags), "cudaEventCreateWithFlags"));
  return CudaEvent(device, event);
}

StatusOr<CudaEvent> CudaEvent::OpenIpc(int device, std::string_view handle) {
  cudaIpcEventHandle_t h;
  HIQ_RETURN_IF_ERROR(HandleFromBytes(handle, &h, "CudaEvent::OpenIpc"));
  DeviceGuard guard(device);
  HIQ_RETURN_IF_ERROR(guard.status());
  cudaEvent_t event = nullptr;
  HIQ_RETURN_IF_ERROR(FromCuda(cudaIpcOpenEventHandle(&event, h), "cudaIpcOpenEventHandle"));
  return CudaEvent(device, event);
}

CudaEvent::CudaEvent(CudaEvent&& other) noexcept
    : device_(other.device_), event_(std::exchange(other.event_, nullptr)) {}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = other.device_;
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

StatusOr<std::string> CudaEvent::ExportIpcHandle() const {
  cudaIpcEventHandle_t h;
  DeviceGuard guard(device_);
  HIQ_RETURN_IF_ERROR(guard.status());
  HIQ_RETURN_IF_ERROR(FromCuda(cudaIpcGetEventHandle(&h, event_), "cudaIpcGetEventHandle"));
  return HandleToBytes(h);
}

Status CudaEvent::Record(CUstream_st* stream) const {
  return FromCuda(cudaEventRecord(event_, stream), "cudaEventRecord");
}

Status CudaEvent::EnqueueWait(CUstream_st* stream) const {
  return FromCuda(cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent");
}

StatusOr<bool> CudaEvent::Query() const {
  const cudaError_t err = cudaEventQuery(event_);
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  return FromCuda(err, "cudaEventQuery");
}

Status CudaEvent::Synchronize() const {
  return FromCuda(cudaEventSynchronize(event_), "cudaEventSynchronize");
}

void CudaEvent::Reset() {
  if (event_ == nullptr) return;
  DeviceGuard guard(device_);
  LogIfError(cudaEventDestroy(std::exchange(event_, nullptr)), "cudaEventDestroy");
}

// --- CudaIpcMapping ------------------------------------------------------------------------

StatusOr<CudaIpcMapping> CudaIpcMapping::Open(int device, std::string_view handle,
                                              uint64_t size_bytes) {
  cudaIpcMemHandle_t h;
  HIQ_RETURN_IF_ERROR(HandleFromBytes(handle, &h, "CudaIpcMapping::Open"));
  if (size_bytes == 0) return InvalidArgument("CudaIpcMapping::Open: size_bytes is 0");
  HIQ_ASSIGN_OR_RETURN(MemGetAddressRangeFn range_fn, GetMemGetAddressRange());
  DeviceGuard guard(device);
  HIQ_RETURN_IF_ERROR(guard.status());
  void* ptr = nullptr;
  HIQ_RETURN_IF_ERROR(FromCuda(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess),
                               "cudaIpcOpenMemHandle"));
  // From here on the mapping is owned: an early return closes it.
  CudaIpcMapping mapping(device, static_cast<uint8_t*>(ptr), size_bytes);
  CUdeviceptr base = 0;
  size_t alloc_bytes = 0;
  const CUresult res = range_fn(&base, &alloc_bytes, reinterpret_cast<CUdeviceptr>(ptr));
  if (res != CUDA_SUCCESS) {
    return Internal("CudaIpcMapping::Open: cuMemGetAddressRange failed with CUresult " +
                    std::to_string(static_cast<int>(res)));
  }
  const uint64_t offset = reinterpret_cast<CUdeviceptr>(ptr) - base;
  if (alloc_bytes < offset || alloc_bytes - offset < size_bytes) {
    return InvalidArgument("CudaIpcMapping::Open: size_bytes " + std::to_string(size_bytes) +
                           " exceeds the shared allocation (" +
                           std::to_string(alloc_bytes - std::min<uint64_t>(offset, alloc_bytes)) +
                           " bytes from the handle's base)");
  }
  return mapping;
}

CudaIpcMapping::CudaIpcMapping(CudaIpcMapping&& other) noexcept
    : device_(other.device_),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

CudaIpcMapping& CudaIpcMapping::operator=(CudaIpcMapping&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = other.device_;
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void CudaIpcMapping::Reset() {
  if (data_ == nullptr) return;
  DeviceGuard guard(device_);
  size_ = 0;
  LogIfError(cudaIpcCloseMemHandle(std::exchange(data_, nullptr)), "cudaIpcCloseMemHandle");
}

// --- DeviceBuffer --------------------------------------------------------------------------

StatusOr<DeviceBuffer> DeviceBuffer::Create(int device, size_t bytes) {
  if (bytes == 0) return InvalidArgument("DeviceBuffer::Create: bytes is 0");
  DeviceGuard guard(device);
  HIQ_RETURN_IF_ERROR(guard.status());
  void* ptr = nullptr;
  HIQ_RETURN_IF_ERROR(
      FromCuda(cudaMalloc(&ptr, bytes), ("cudaMalloc(" + std::to_string(bytes) + ")").c_str()));
  return DeviceBuffer(device, static_cast<uint8_t*>(ptr), bytes);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : device_(other.device_),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = other.device_;
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

StatusOr<std::string> DeviceBuffer::ExportIpcHandle() const {
  cudaIpcMemHandle_t h;
  DeviceGuard guard(device_);
  HIQ_RETURN_IF_ERROR(guard.status());
  HIQ_RETURN_IF_ERROR(FromCuda(cudaIpcGetMemHandle(&h, data_), "cudaIpcGetMemHandle"));
  return HandleToBytes(h);
}

void DeviceBuffer::Reset() {
  if (data_ == nullptr) return;
  DeviceGuard guard(device_);
  size_ = 0;
  LogIfError(cudaFree(std::exchange(data_, nullptr)), "cudaFree");
}

// --- PinnedHostBuffer ----------------------------------------------------------------------

StatusOr<PinnedHostBuffer> PinnedHostBuffer::Create(size_t bytes) {
  if (bytes == 0) return InvalidArgument("PinnedHostBuffer::Create: bytes is 0");
  void* ptr = nullptr;
  HIQ_RETURN_IF_ERROR(FromCuda(cudaMallocHost(&ptr, bytes),
                               ("cudaMallocHost(" + std::to_string(bytes) + ")").c_str()));
  return PinnedHostBuffer(static_cast<uint8_t*>(ptr), bytes);
}

PinnedHostBuffer::PinnedHostBuffer(PinnedHostBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

PinnedHostBuffer& PinnedHostBuffer::operator=(PinnedHostBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void PinnedHostBuffer::Reset() {
  if (data_ == nullptr) return;
  size_ = 0;
  LogIfError(cudaFreeHost(std::exchange(data_, nullptr)), "cudaFreeHost");
}

}  // namespace hiqcache::kernels
