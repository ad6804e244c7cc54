// CudaBackend: the CUDA device kind. Engines share their GPU KV buffers through cudaIpcMemHandles
// of the allocation base (plus view offsets) and their completion events through IPC event
// handles; the daemon quantizes and dequantizes on its own streams (one per direction per pool)
// and moves the compressed bytes between a device staging buffer and the page-locked pool with
// the copy engines, so the engine's SMs are held only for the short codec kernels.
//
//   Backup:  stream waits wait_event -> gather+encode kernel into staging -> D2H copies into the
//            pool payloads (+ non-finite flags) -> done_event recorded -> the worker waits for the
//            stream, then the core publishes the blocks (never before the device finished).
//   Restore: stream waits wait_event -> for each layer l: H2D copies of layer l of every block
//            into staging -> decode+scatter kernel for layer l -> layer event base+l recorded ->
//            done_event; pins are held until the stream completes.
//
// Built only with CUDA (HIQ_HAVE_CUDA); the header includes no CUDA header. Thread-safe as
// DeviceBackend says: each binding is used by one pool's strand at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "device_backend.h"

namespace hiqcache::server {

// "GPU-8c1f0a8e-...", "8c1f0a8e..." (32 hex digits, dashes ignored, any case) -> 32 lowercase
// hex digits. Returns false for anything else. Pure; used for cuda_device_uuid.
bool NormalizeCudaUuid(const std::string& in, std::string* out);

class CudaBackend : public DeviceBackend {
 public:
  // Registers [pool, pool + pool_bytes) for DMA with every device (cudaHostRegister, chunks of at
  // most 64 GiB; rolled back on failure) and unregisters it on destruction.
  static StatusOr<std::unique_ptr<CudaBackend>> Create(uint8_t* pool, uint64_t pool_bytes);
  ~CudaBackend() override;

  const char* name() const override { return "cuda"; }
  StatusOr<std::unique_ptr<PoolBinding>> Bind(const RegisterSpec& spec,
                                              const kernels::BlockLayout& layout) override;

  struct Mapping;  // an opened IPC allocation, shared by every binding that names it

 private:
  CudaBackend(uint8_t* pool, std::vector<std::pair<uint8_t*, uint64_t>> registered);
  StatusOr<int> DeviceForUuid(const std::string& uuid) const;
  StatusOr<std::shared_ptr<Mapping>> OpenMapping(int device, const std::string& handle,
                                                 uint64_t size_bytes, const std::string& field);

  uint8_t* pool_;
  std::vector<std::pair<uint8_t*, uint64_t>> registered_;  // host-registered chunks
  std::mutex mu_;
  // Each handle is opened once per device (opening it twice fails); bindings share it.
  std::map<std::pair<int, std::string>, std::weak_ptr<Mapping>> mappings_;  // GUARDED_BY(mu_)
};

}  // namespace hiqcache::server
