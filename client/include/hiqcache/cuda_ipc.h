// The CUDA pieces of a RegisterPool request that need no CUDA to build or test: the 64-byte wire
// form of IPC handles, GPU UUID strings, and the bookkeeping that turns tensors given as device
// pointers into SharedBuffers of allocation bases plus view offsets (docs/design.md "Wire
// contract", STYLE.md 7: export the allocation base plus an offset).
//
// Part of hiq_client in every build. The CUDA runtime's answers come through CudaMemoryInfo;
// hiqcache/cuda_export.h (library hiq_client_cuda, built only with CUDA) provides the real one,
// tests provide fakes. Pure functions and value types are thread-safe; a CudaBufferSet is not
// (one builder per thread).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hiqcache/layouts.h"
#include "hiqcache/pool_spec.h"
#include "hiqcache/status.h"

namespace hiqcache {

// sizeof(cudaIpcMemHandle_t) == sizeof(cudaIpcEventHandle_t) (static_asserted where CUDA is).
inline constexpr size_t kCudaIpcHandleBytes = 64;

// A cudaIpcMemHandle_t or cudaIpcEventHandle_t as opaque bytes.
struct CudaIpcHandle {
  std::array<uint8_t, kCudaIpcHandleBytes> bytes{};

  // The wire form (SharedBuffer::cuda_ipc_handle, EventPoolSpec::cuda_ipc_event_handles): the
  // handle's 64 bytes, unchanged.
  std::string ToBytes() const;
  // INVALID_ARGUMENT naming `field` unless `wire` holds exactly 64 bytes.
  static StatusOr<CudaIpcHandle> FromBytes(std::string_view wire,
                                           std::string_view field = "cuda_ipc_handle");
  // 128 lowercase hex digits, for command lines and environment variables.
  std::string ToHex() const;
  static StatusOr<CudaIpcHandle> FromHex(std::string_view hex);

  friend bool operator==(const CudaIpcHandle& a, const CudaIpcHandle& b) {
    return a.bytes == b.bytes;
  }
};

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (lowercase hex; the form nvidia-smi -L prints)
// from the 16 bytes of cudaDeviceProp::uuid. A MIG instance's bytes are formatted the same way:
// hiqcached matches the bytes its own cudaGetDeviceProperties reports, not the prefix.
std::string FormatCudaUuid(std::span<const uint8_t, 16> bytes);
// Accepts "GPU-" (any case) followed by 32 hex digits, or bare 32 hex digits; dashes anywhere
// and either case. Returns the FormatCudaUuid form; INVALID_ARGUMENT for anything else.
StatusOr<std::string> NormalizeCudaUuid(std::string_view uuid);

// One device allocation as cuMemGetAddressRange reports it.
struct CudaAllocation {
  uint64_t base = 0;  // device address of its first byte
  uint64_t size = 0;  // bytes
  int device = -1;    // CUDA ordinal in this process
};

// What the client asks the CUDA runtime while building a registration.
class CudaMemoryInfo {
 public:
  virtual ~CudaMemoryInfo() = default;
  // The allocation holding device address `ptr`. FAILED_PRECONDITION when `ptr` is not device
  // memory that cudaIpcGetMemHandle can export (host, managed, or not CUDA memory).
  virtual StatusOr<CudaAllocation> Find(uint64_t ptr) const = 0;
  // The IPC handle of `allocation`'s base.
  virtual StatusOr<CudaIpcHandle> ExportBase(const CudaAllocation& allocation) const = 0;
  // FormatCudaUuid of device `device`.
  virtual StatusOr<std::string> DeviceUuid(int device) const = 0;
};

// A tensor in device memory: [ptr, ptr + bytes).
struct CudaTensor {
  const void* ptr = nullptr;
  uint64_t bytes = 0;
};

// Collects tensors into the SharedBuffers of a CUDA registration: one buffer per distinct
// allocation (the IPC handle of its base, size_bytes = the allocation's size), however many
// tensors lie in it, so that hiqcached opens each allocation once.
class CudaBufferSet {
 public:
  // `memory` is not owned and must outlive the set.
  explicit CudaBufferSet(const CudaMemoryInfo* memory) : memory_(memory) {}

  // Where tensor [ptr, ptr + bytes) lies: the index of its allocation's buffer (added on first
  // use) and its offset from the allocation base. INVALID_ARGUMENT for a null pointer, zero
  // bytes, or a tensor running past its allocation's end; FAILED_PRECONDITION when it is on
  // another device than the tensors before it, or is not exportable device memory.
  StatusOr<BufferRef> Add(const void* ptr, uint64_t bytes);

  // The device every tensor added so far lives on; -1 before the first Add.
  int device() const { return device_; }
  const std::vector<SharedBuffer>& buffers() const { return buffers_; }
  const std::vector<CudaAllocation>& allocations() const { return allocations_; }

 private:
  const CudaMemoryInfo* memory_;
  int device_ = -1;
  std::vector<SharedBuffer> buffers_;
  std::vector<CudaAllocation> allocations_;  // parallel to buffers_
};

// Rewrites a PoolSpec whose views address tensors instead of buffers into the wire form:
// on entry spec->buffers is empty and every view's `buffer` indexes `tensors` with offset_bytes
// counted from that tensor's start; on return spec->buffers holds one entry per allocation
// (CudaBufferSet), each view names its allocation's buffer with offset_bytes counted from the
// allocation base, spec->device is kCuda and spec->cuda_device_uuid names the tensors' GPU.
// Errors name the offending tensor or view; *spec is unchanged on error. When `allocations` is
// set it receives the allocation of each new buffer (parallel to spec->buffers).
Status ResolveCudaTensors(std::span<const CudaTensor> tensors, const CudaMemoryInfo& memory,
                          PoolSpec* spec, std::vector<CudaAllocation>* allocations = nullptr);

}  // namespace hiqcache
