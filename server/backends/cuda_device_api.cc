#include "backends/cuda_device_api.h"

#include <cuda.h>  // CUresult / CUdeviceptr / CUpointer_attribute only: the driver is reached
                   // through the runtime's entry points, never linked directly
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <type_traits>

#include "codec_cuda.h"
#include "cuda_handles.h"
#include "hiqcache/cuda_status.h"
#include "hiqcache/log.h"

namespace hiqcache::server {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == 64, "the wire format carries 64-byte IPC handles");

cudaStream_t S(DeviceStream s) { return static_cast<cudaStream_t>(s.ptr); }
cudaEvent_t E(DeviceEvent e) { return static_cast<cudaEvent_t>(e.ptr); }

// A launcher's Status (kernels/cuda/codec_cuda.h) with a sticky launch error reclassified.
Status FromLauncher(const Status& st) {
  if (st.ok()) return st;
  const cudaError_t last = cudaPeekAtLastError();
  if (IsStickyCudaError(last)) return DataLoss(st.message());
  return st;
}

void LogIfError(cudaError_t err, const char* what) {
  if (err == cudaSuccess || err == cudaErrorCudartUnloading) return;
  (void)cudaGetLastError();
  HIQ_LOG(WARN) << what << " failed: " << cudaGetErrorName(err);
}

using MemGetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
using StreamWriteValue64Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

// The driver's errors after which the context is lost, as FromCuda's (hiqcache/cuda_status.h)
// runtime ones.
Status FromDriver(CUresult res, const char* what) {
  if (res == CUDA_SUCCESS) return Status::Ok();
  const std::string text =
      std::string(what) + " failed with CUresult " + std::to_string(static_cast<int>(res));
  switch (res) {
    case CUDA_ERROR_ILLEGAL_ADDRESS:
    case CUDA_ERROR_LAUNCH_FAILED:
    case CUDA_ERROR_ECC_UNCORRECTABLE:
    case CUDA_ERROR_CONTEXT_IS_DESTROYED:
    case CUDA_ERROR_UNKNOWN:
      return DataLoss(text);
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
      return InvalidArgument(text);
    default:
      return Internal(text);
  }
}

// A driver entry point of at least CUDA 12.0's ABI, or null.
void* DriverEntryPoint(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return fn;
}

class CudaDeviceApi : public DeviceApi {
 public:
  CudaDeviceApi(MemGetAddressRangeFn range, StreamWriteValue64Fn write_value)
      : range_(range), write_value_(write_value) {}

  StatusOr<std::vector<std::string>> DeviceUuids() override {
    int count = 0;
    HIQ_RETURN_IF_ERROR(FromCuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount"));
    std::vector<std::string> out;
    for (int d = 0; d < count; ++d) {
      cudaDeviceProp prop;
      Status st = FromCuda(cudaGetDeviceProperties(&prop, d), "cudaGetDeviceProperties");
      if (!st.ok()) {
        out.emplace_back();  // keeps ordinals aligned; matches no UUID
        continue;
      }
      char hex[33];
      for (int i = 0; i < 16; ++i) {
        std::snprintf(hex + 2 * i, 3, "%02x", static_cast<unsigned char>(prop.uuid.bytes[i]));
      }
      out.emplace_back(hex, 32);
    }
    return out;
  }

  StatusOr<DeviceStream> CreateStream(int device, Priority priority) override {
    kernels::DeviceGuard g(device);
    HIQ_RETURN_IF_ERROR(g.status());
    // Lower numbers are greater priorities; [greatest, least] is the device's range (0, the
    // default, is its least on current GPUs). cudaStreamCreateWithPriority clamps a value outside
    // the range; only kernels are scheduled by priority, never copies (CUDA runtime API).
    int least = 0, greatest = 0;
    HIQ_RETURN_IF_ERROR(FromCuda(cudaDeviceGetStreamPriorityRange(&least, &greatest),
                                 "cudaDeviceGetStreamPriorityRange"));
    cudaStream_t s = nullptr;
    HIQ_RETURN_IF_ERROR(
        FromCuda(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking,
                                              priority == Priority::kHigh ? greatest : least),
                 "cudaStreamCreateWithPriority"));
    return DeviceStream{s};
  }
  void DestroyStream(int device, DeviceStream stream) override {
    kernels::DeviceGuard g(device);
    LogIfError(cudaStreamDestroy(S(stream)), "cudaStreamDestroy");
  }

  StatusOr<DeviceEvent> CreateEvent(int device) override {
    kernels::DeviceGuard g(device);
    HIQ_RETURN_IF_ERROR(g.status());
    cudaEvent_t e = nullptr;
    HIQ_RETURN_IF_ERROR(
        FromCuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags"));
    return DeviceEvent{e};
  }
  StatusOr<DeviceEvent> CreateBlockingEvent(int device) override {
    kernels::DeviceGuard g(device);
    HIQ_RETURN_IF_ERROR(g.status());
    cudaEvent_t e = nullptr;
    // cudaEventBlockingSync: cudaEventSynchronize on it blocks the calling thread until the event
    // completed instead of busy-waiting (CUDA runtime API, cudaEventCreateWithFlags and
    // cudaEventSynchronize), so a completion thread costs no CPU while the device works.
    HIQ_RETURN_IF_ERROR(
        FromCuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync),
                 "cudaEventCreateWithFlags"));
    return DeviceEvent{e};
  }
  void DestroyEvent(int device, DeviceEvent event) override {
    kernels::DeviceGuard g(device);
    LogIfError(cudaEventDestroy(E(event)), "cudaEventDestroy");
  }

  Status RecordEvent(int device, DeviceEvent event, DeviceStream stream) override {
    kernels::DeviceGuard g(device);
    HIQ_RETURN_IF_ERROR(g.status());
    return FromCuda(cudaEventRecord(E(event), S(stream)), "cudaEventRecord");
  }
  Status StreamWaitEvent(int device, DeviceStream stream, DeviceEvent event) override {
    kernels::DeviceGuard g(device);
    HIQ_RETURN_IF_ERROR(g.status());
    return FromCuda(cudaStreamWaitEvent(S(stream), E(event), 0), "cudaStreamWaitEvent");
  }
  StatusOr<bool> QueryEvent(int device, DeviceEvent event) override {
    kernels::DeviceGuard g(device);
    HIQ_RETURN_IF_ERROR(g.status());
    const cudaError_t err = cudaEventQuery(E(event));
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    return FromCuda(err, "cudaEventQuery");
  }

  Status SynchronizeEvent(int device, DeviceEvent event) override {
    kernels::DeviceGuard g(device);
    HIQ_RETURN_IF_ERROR(g.status());
    // Returns cudaSuccess at once for an event never recorded, else once the work captured by
    // its most recent record completed; it may return the error of earlier asynchronous work
    // (a sticky one once the context is lost: FromCuda makes it kDataLoss).
    return FromCuda(cudaEventSynchronize(E(event)), "cudaEventSynchronize");
  }

  StatusOr<IpcBuffer> OpenIpcBuffer(int device, std::string_view handle,
                                    uint64_t size_bytes) override {
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return InvalidArgument("IPC memory handle must be 64 bytes");
    }
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    kernels::DeviceGuard g(device);
    HIQ_RETURN_IF_ERROR(g.status());
    void* ptr = nullptr;
    HIQ_RETURN_IF_ERROR(FromCuda(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess),
                                 "cudaIpcOpenMemHandle"));
    auto close = [&] { LogIfError(cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle"); };
    // Where the memory lives: a UUID naming another GPU than the buffer's opens a peer
    // mapping (e.g. over NVLink) instead of failing.
    cudaPointerAttributes attr{};
    Status st = FromCuda(cudaPointerGetAttributes(&attr, ptr), "cudaPointerGetAttributes");
    if (!st.ok()) {
      close();
      return st;
    }
    CUdeviceptr base = 0;
    size_t alloc_bytes = 0;
    const CUresult res = range_(&base, &alloc_bytes, reinterpret_cast<CUdeviceptr>(ptr));
    if (res != CUDA_SUCCESS) {
      close();
      return Internal("cuMemGetAddressRange failed with CUresult " +
                      std::to_string(static_cast<int>(res)));
    }
    const uint64_t offset = reinterpret_cast<CUdeviceptr>(ptr) - base;
    if (alloc_bytes < offset || alloc_bytes - offset < size_bytes) {
      close();
      return InvalidArgument("size_bytes " + std::to_string(size_bytes) +
                             " exceeds the shared allocation (" +
                             std::to_string(alloc_bytes > offset ? alloc_bytes - offset : 0) +
                             " bytes from the handle's base)");
    }
    return IpcBuffer{static_cast<uint8_t*>(ptr), attr.device};
  }
  void CloseIpcBuffer(int device, uint8_t* data) override {
    kernels::DeviceGuard g(device);
    LogIfError(cudaIpcCloseMemHandle(data), "cudaIpcCloseMemHandle");
  }

  StatusOr<uint8_t*> AllocDevice(int device, size_t bytes) override {
    kernels::DeviceGuard g(device);
    HIQ_RETURN_IF_ERROR(g.status());
    void* p = nullptr;
    HIQ_RETURN_IF_ERROR(FromCuda(cudaMalloc(&p, bytes), "cudaMalloc"));
    return static_cast<uint8_t*>(p);
  }
  void FreeDevice(int device, uint8_t* data) override {
    kernels::DeviceGuard g(device);
    LogIfError(cudaFree(data), "cudaFree");
  }
  StatusOr<uint8_t*> AllocPinned(size_t bytes) override {
    void* p = nullptr;
    HIQ_RETURN_IF_ERROR(FromCuda(cudaHostAlloc(&p, bytes, cudaHostAllocPortable), "cudaHostAlloc"));
    return static_cast<uint8_t*>(p);
  }
  void FreePinned(uint8_t* data) override { LogIfError(cudaFreeHost(data), "cudaFreeHost"); }
  Status RegisterHost(uint8_t* data, size_t bytes) override {
    return FromCuda(
        cudaHostRegister(data, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped),
        "cudaHostRegister");
  }
  Status WriteValue64(int device, DeviceStream stream, uint64_t* slot, uint64_t value) override {
    kernels::DeviceGuard g(device);
    HIQ_RETURN_IF_ERROR(g.status());
    // The slot's address in the device's space (registered mapped; equal to the host address
    // where the device can use host pointers for registered memory).
    void* dptr = nullptr;
    HIQ_RETURN_IF_ERROR(
        FromCuda(cudaHostGetDevicePointer(&dptr, slot, 0), "cudaHostGetDevicePointer"));
    // Default flags: a memory barrier before the store, so the work before it is visible first.
    return FromDriver(write_value_(static_cast<CUstream>(stream.ptr),
                                   reinterpret_cast<CUdeviceptr>(dptr), value, 0),
                      "cuStreamWriteValue64");
  }
  void UnregisterHost(uint8_t* data) override {
    LogIfError(cudaHostUnregister(data), "cudaHostUnregister");
  }

  Status CopyAsync(int device, std::span<const Copy> copies, DeviceStream stream) override {
    if (copies.empty()) return Status::Ok();
    kernels::DeviceGuard g(device);
    HIQ_RETURN_IF_ERROR(g.status());
#if CUDART_VERSION >= 13000
    if (copies.size() > 1) {
      std::vector<void*> dst(copies.size());
      std::vector<const void*> src(copies.size());
      std::vector<size_t> sizes(copies.size());
      for (size_t i = 0; i < copies.size(); ++i) {
        dst[i] = copies[i].dst;
        src[i] = copies[i].src;
        sizes[i] = copies[i].bytes;
      }
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      size_t attr_idx = 0;
      const cudaError_t err = cudaMemcpyBatchAsync(dst.data(), src.data(), sizes.data(), dst.size(),
                                                   &attr, &attr_idx, 1, S(stream));
      if (err == cudaSuccess) return Status::Ok();
      Status st = FromCuda(err, "cudaMemcpyBatchAsync");
      if (IsStickyDeviceError(st)) return st;
      // Not supported here: one call per copy.
    }
#endif
    for (const Copy& c : copies) {
      HIQ_RETURN_IF_ERROR(FromCuda(
          cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, S(stream)), "cudaMemcpyAsync"));
    }
    return Status::Ok();
  }
  Status LaunchEncode(int device, const kernels::EncodeJob& job, DeviceStream stream) override {
    kernels::DeviceGuard g(device);
    HIQ_RETURN_IF_ERROR(g.status());
    return FromLauncher(kernels::LaunchEncode(job, S(stream)));
  }
  Status LaunchDecode(int device, const kernels::DecodeJob& job, uint32_t first_layer,
                      uint32_t num_layers, DeviceStream stream) override {
    kernels::DeviceGuard g(device);
    HIQ_RETURN_IF_ERROR(g.status());
    return FromLauncher(kernels::LaunchDecodeLayers(job, first_layer, num_layers, S(stream)));
  }

 private:
  const MemGetAddressRangeFn range_;
  const StreamWriteValue64Fn write_value_;
};

}  // namespace

StatusOr<std::unique_ptr<DeviceApi>> CreateCudaDeviceApi() {
  void* range = DriverEntryPoint("cuMemGetAddressRange");
  if (range == nullptr) {
    return FailedPrecondition("cuMemGetAddressRange is not available from the CUDA driver");
  }
  // Stream memory operations (CUDA driver API "Stream Memory Operations"): how the daemon's
  // streams store tickets into the engines' slots.
  void* write_value = DriverEntryPoint("cuStreamWriteValue64");
  if (write_value == nullptr) {
    return FailedPrecondition(
        "cuStreamWriteValue64 is not available from the CUDA driver "
        "(stream memory operations need driver 12.0 or later)");
  }
  int count = 0;
  HIQ_RETURN_IF_ERROR(FromCuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount"));
  for (int d = 0; d < count; ++d) {
    kernels::DeviceGuard g(d);
    if (!g.status().ok()) continue;
    // Overwrites the flags of an already initialized primary context (CUDA >= 11).
    const cudaError_t set = cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync);
    if (set != cudaSuccess) {
      HIQ_LOG(WARN) << "device " << d << ": cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync): "
                    << cudaGetErrorName(set);
      (void)cudaGetLastError();
    }
  }
  return std::unique_ptr<DeviceApi>(
      new CudaDeviceApi(reinterpret_cast<MemGetAddressRangeFn>(range),
                        reinterpret_cast<StreamWriteValue64Fn>(write_value)));
}

}  // namespace hiqcache::server
