// Move-only RAII owners of the CUDA handles the daemon holds: streams, events (its own and those
// opened from a client's IPC handles), IPC mappings of client KV pools, device and pinned host
// buffers, plus DeviceGuard, which saves and restores the calling thread's current device.
//
// Every owner is made by a `static StatusOr<T> Create/Open(...)` and remembers its device;
// destructors switch to that device, release the handle, and on error log (HIQ_LOG(WARN)) and
// clear the CUDA error instead of throwing. A moved-from or default-constructed owner is empty
// and releases nothing. IPC handles travel as 64-byte strings (the proto `bytes` fields).
//
// Thread-safety: an owner may be used from any thread, but not destroyed or moved while another
// thread uses it. Methods do not change the calling thread's current device on return.
// This header includes no CUDA header (cudaStream_t == CUstream_st*, cudaEvent_t == CUevent_st*).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "hiqcache/status.h"

struct CUstream_st;
struct CUevent_st;

namespace hiqcache::kernels {

// Size of cudaIpcMemHandle_t and cudaIpcEventHandle_t (static_asserted in the .cc).
constexpr size_t kCudaIpcHandleBytes = 64;

// Makes `device` current for the calling thread for the guard's lifetime, then restores the
// previous current device. Check status() before relying on the switch.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  const Status& status() const { return status_; }

 private:
  int saved_ = -1;
  bool restore_ = false;
  Status status_;
};

class CudaStream {
 public:
  // non_blocking: does not synchronize with the legacy default stream (the daemon's choice).
  // priority: as cudaStreamCreateWithPriority (lower number = higher priority; clamped by CUDA).
  static StatusOr<CudaStream> Create(int device, bool non_blocking = true, int priority = 0);

  CudaStream() = default;
  ~CudaStream() { Reset(); }
  CudaStream(CudaStream&& other) noexcept;
  CudaStream& operator=(CudaStream&& other) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  CUstream_st* get() const { return stream_; }
  int device() const { return device_; }
  explicit operator bool() const { return stream_ != nullptr; }
  Status Synchronize() const;
  // Destroys the stream now (pending work still completes); leaves *this empty.
  void Reset();

 private:
  CudaStream(int device, CUstream_st* stream) : device_(device), stream_(stream) {}
  int device_ = -1;
  CUstream_st* stream_ = nullptr;
};

class CudaEvent {
 public:
  // interprocess: cudaEventInterprocess | cudaEventDisableTiming (exportable); otherwise
  // cudaEventDisableTiming.
  static StatusOr<CudaEvent> Create(int device, bool interprocess);
  // Opens an event another process exported (kCudaIpcHandleBytes bytes). The exporting process
  // owns the event; destroying this only drops the local reference.
  static StatusOr<CudaEvent> OpenIpc(int device, std::string_view handle);

  CudaEvent() = default;
  ~CudaEvent() { Reset(); }
  CudaEvent(CudaEvent&& other) noexcept;
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  CUevent_st* get() const { return event_; }
  int device() const { return device_; }
  explicit operator bool() const { return event_ != nullptr; }

  // REQUIRES: created with interprocess = true.
  StatusOr<std::string> ExportIpcHandle() const;
  // Records the event on `stream` (work enqueued so far on it).
  Status Record(CUstream_st* stream) const;
  // Makes future work on `stream` wait for the last recorded state of this event.
  Status EnqueueWait(CUstream_st* stream) const;
  // True when the recorded work has completed.
  StatusOr<bool> Query() const;
  Status Synchronize() const;
  void Reset();

 private:
  CudaEvent(int device, CUevent_st* event) : device_(device), event_(event) {}
  int device_ = -1;
  CUevent_st* event_ = nullptr;
};

// A mapping of another process's device allocation (cudaIpcOpenMemHandle), closed on
// destruction. The handle must be of the allocation base (docs/design.md "Wire contract",
// SharedBuffer: export the base plus an offset); Open checks that the allocation holds at least
// size_bytes.
class CudaIpcMapping {
 public:
  static StatusOr<CudaIpcMapping> Open(int device, std::string_view handle, uint64_t size_bytes);

  CudaIpcMapping() = default;
  ~CudaIpcMapping() { Reset(); }
  CudaIpcMapping(CudaIpcMapping&& other) noexcept;
  CudaIpcMapping& operator=(CudaIpcMapping&& other) noexcept;
  CudaIpcMapping(const CudaIpcMapping&) = delete;
  CudaIpcMapping& operator=(const CudaIpcMapping&) = delete;

  uint8_t* data() const { return data_; }
  // The size the caller asked for (<= the allocation's size).
  uint64_t size() const { return size_; }
  int device() const { return device_; }
  explicit operator bool() const { return data_ != nullptr; }
  void Reset();

 private:
  CudaIpcMapping(int device, uint8_t* data, uint64_t size)
      : device_(device), data_(data), size_(size) {}
  int device_ = -1;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// Device memory from cudaMalloc (256-byte aligned).
class DeviceBuffer {
 public:
  static StatusOr<DeviceBuffer> Create(int device, size_t bytes);

  DeviceBuffer() = default;
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  int device() const { return device_; }
  explicit operator bool() const { return data_ != nullptr; }
  // The IPC handle of this allocation (its base), for another process's CudaIpcMapping::Open.
  StatusOr<std::string> ExportIpcHandle() const;
  void Reset();

 private:
  DeviceBuffer(int device, uint8_t* data, size_t size)
      : device_(device), data_(data), size_(size) {}
  int device_ = -1;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Page-locked host memory from cudaMallocHost (for asynchronous copies, e.g. job staging).
class PinnedHostBuffer {
 public:
  static StatusOr<PinnedHostBuffer> Create(size_t bytes);

  PinnedHostBuffer() = default;
  ~PinnedHostBuffer() { Reset(); }
  PinnedHostBuffer(PinnedHostBuffer&& other) noexcept;
  PinnedHostBuffer& operator=(PinnedHostBuffer&& other) noexcept;
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  explicit operator bool() const { return data_ != nullptr; }
  void Reset();

 private:
  PinnedHostBuffer(uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace hiqcache::kernels
