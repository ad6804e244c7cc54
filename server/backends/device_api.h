// DeviceApi: the CUDA runtime as the CUDA backend uses it, behind a narrow interface: streams,
// the daemon's own events, IPC buffers, staging memory, host registration (the pool and the
// engines' ticket slots), and the enqueue of copies, codec launches and slot stores.
//
// It is the backend's test seam (STYLE.md #3): CudaBackend's scheduling (what is enqueued on
// which stream, in which order, when completion is observed, what an error does) runs against
// the real runtime in hiqcached (cuda_device_api.h, built with CUDA) and against a fake device
// whose streams complete only when a test says so (tests/server/fake_device.h), in CI.
//
// Semantics are the CUDA runtime's, in particular: StreamWaitEvent captures the most recent
// record of the event at the time of the call (a record made later is not waited for; an event
// never recorded is no wait at all), and QueryEvent reports on that most recent record.
// Nothing here but SynchronizeEvent waits for device work: enqueue calls return once the work is
// queued.
//
// Errors: a failed call returns its Status. An error after which the device's context is unusable
// for the rest of the process (illegal address, launch failure, uncorrectable ECC, ... : CUDA's
// "sticky" errors) comes back as StatusCode::kDataLoss, see IsStickyDeviceError; any other code
// means the call failed and the device is still usable.
//
// Thread-safety: every method may be called from any thread; no call changes the calling
// thread's current device on return. This header includes no CUDA header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "codec_job.h"
#include "hiqcache/status.h"

namespace hiqcache::server {

// Opaque handles (cudaStream_t / cudaEvent_t in the real runtime). Empty = null.
struct DeviceStream {
  void* ptr = nullptr;
  explicit operator bool() const { return ptr != nullptr; }
};
struct DeviceEvent {
  void* ptr = nullptr;
  explicit operator bool() const { return ptr != nullptr; }
};

// Whether `st` (from a DeviceApi call) says the device's context is lost for good.
inline bool IsStickyDeviceError(const Status& st) { return st.code() == StatusCode::kDataLoss; }

class DeviceApi {
 public:
  virtual ~DeviceApi() = default;

  // The visible devices' UUIDs (32 lowercase hex digits), by ordinal.
  virtual StatusOr<std::vector<std::string>> DeviceUuids() = 0;

  // A stream's scheduling priority. Restores are on the engine's critical path (its forward pass
  // waits on their layer slots), backups are not.
  enum class Priority { kLow, kHigh };
  // A non-blocking stream (no implicit synchronization with the legacy default stream), created
  // with the device's least (kLow) or greatest (kHigh) priority (cudaDeviceGetStreamPriorityRange,
  // cudaStreamCreateWithPriority). Per the CUDA runtime API, a priority is a hint for scheduling
  // kernels only: pending kernels of a higher-priority stream are preferred when SMs free up,
  // running blocks are not preempted, and copies (H2D, D2H) are not affected at all.
  virtual StatusOr<DeviceStream> CreateStream(int device, Priority priority) = 0;
  // Pending work still completes; never waits for it.
  virtual void DestroyStream(int device, DeviceStream stream) = 0;
  // A daemon-owned event (cudaEventDisableTiming). Engines' completion never uses events: an
  // event carries no value and cannot be released by the host (ticket_slots.h).
  virtual StatusOr<DeviceEvent> CreateEvent(int device) = 0;
  // A daemon-owned event that a host thread waits for with SynchronizeEvent
  // (cudaEventDisableTiming | cudaEventBlockingSync: per cudaEventSynchronize's documentation, the
  // waiting thread then blocks until the device completed the event instead of busy-waiting).
  virtual StatusOr<DeviceEvent> CreateBlockingEvent(int device) = 0;
  virtual void DestroyEvent(int device, DeviceEvent event) = 0;

  // Captures the work enqueued on `stream` so far.
  virtual Status RecordEvent(int device, DeviceEvent event, DeviceStream stream) = 0;
  // Work enqueued on `stream` later waits for the event's most recent record (see above).
  virtual Status StreamWaitEvent(int device, DeviceStream stream, DeviceEvent event) = 0;
  // true once the most recent record has completed (or there was none), false while pending.
  virtual StatusOr<bool> QueryEvent(int device, DeviceEvent event) = 0;
  // Blocks the calling thread until the most recent record of `event` completed (none: returns
  // at once), as cudaEventSynchronize. Returns the error of the device work when it failed (a
  // sticky one as kDataLoss, see below). The only DeviceApi call that waits for device work: it
  // is made by the completion threads alone (device_completion.h).
  virtual Status SynchronizeEvent(int device, DeviceEvent event) = 0;

  // An engine's device allocation opened from its 64-byte IPC handle.
  struct IpcBuffer {
    uint8_t* data = nullptr;
    // Ordinal of the device whose memory it is (may differ from the device it was opened on:
    // then it is a peer mapping, e.g. over NVLink).
    int memory_device = -1;
  };
  // Opens `handle` on `device` and checks that the allocation holds `size_bytes` from its base.
  virtual StatusOr<IpcBuffer> OpenIpcBuffer(int device, std::string_view handle,
                                            uint64_t size_bytes) = 0;
  virtual void CloseIpcBuffer(int device, uint8_t* data) = 0;

  // Device memory (cudaMalloc). Only at bind time: never on the request path.
  virtual StatusOr<uint8_t*> AllocDevice(int device, size_t bytes) = 0;
  virtual void FreeDevice(int device, uint8_t* data) = 0;
  // Page-locked host memory (cudaMallocHost), for asynchronous copies of job arrays and flags.
  virtual StatusOr<uint8_t*> AllocPinned(size_t bytes) = 0;
  virtual void FreePinned(uint8_t* data) = 0;
  // Page-locks [data, data + bytes) for DMA with every device and maps it into their address
  // space (cudaHostRegister, portable | mapped). `data` must be page-aligned.
  virtual Status RegisterHost(uint8_t* data, size_t bytes) = 0;
  virtual void UnregisterHost(uint8_t* data) = 0;

  // Enqueues on `stream` a store of `value` into the 8-byte aligned `slot`, host memory inside a
  // RegisterHost registration (cuStreamWriteValue64 on its device address): it lands once
  // everything enqueued on `stream` before it completed, and is then visible to the host and to
  // other processes mapping the same memory.
  virtual Status WriteValue64(int device, DeviceStream stream, uint64_t* slot, uint64_t value) = 0;

  struct Copy {
    void* dst = nullptr;
    const void* src = nullptr;
    size_t bytes = 0;
  };
  // Enqueues the copies on `stream` (copy engines; the direction follows from the addresses).
  virtual Status CopyAsync(int device, std::span<const Copy> copies, DeviceStream stream) = 0;
  // The codec kernels (kernels/cuda/codec_cuda.h): every array of `job` must be device-accessible.
  virtual Status LaunchEncode(int device, const kernels::EncodeJob& job, DeviceStream stream) = 0;
  virtual Status LaunchDecode(int device, const kernels::DecodeJob& job, uint32_t first_layer,
                              uint32_t num_layers, DeviceStream stream) = 0;
};

}  // namespace hiqcache::server
