// HostBackend: the HOST device kind. An engine's "device" KV buffers are POSIX shared-memory
// objects mapped into the daemon, its events are 64-bit counters in another shm object (slot i at
// byte 64*i; the daemon stores ticket T there with release order when work T completes), and the
// codec runs on the SIMD CPU executor. Serves CPU-only inference and lets CI run every part of the
// daemon but the CUDA kernels. Thread-safe as DeviceBackend says.
#pragma once

#include <chrono>
#include <memory>

#include "codec_cpu.h"
#include "device_backend.h"

namespace hiqcache::server {

// Bit 63 of a HOST event slot: the work of the ticket in bits 0..62 failed and wrote nothing
// (e.g. its wait_event never came). Waiters are released, but must not use the rows.
constexpr uint64_t kHostEventFailedBit = 1ull << 63;

class HostBackend : public DeviceBackend {
 public:
  // `codec` must outlive the backend and every binding it returns.
  HostBackend(kernels::CpuCodec* codec, std::chrono::milliseconds wait_timeout);
  const char* name() const override { return "host"; }
  StatusOr<std::unique_ptr<PoolBinding>> Bind(const RegisterSpec& spec,
                                              const kernels::BlockLayout& layout) override;

 private:
  kernels::CpuCodec* codec_;
  std::chrono::milliseconds wait_timeout_;
};

// Opens the POSIX shm object `name` ("/" optional) read-write and maps its first `bytes` bytes.
// `field` names the request field in error messages.
class ShmMapping {
 public:
  static StatusOr<std::unique_ptr<ShmMapping>> Open(const std::string& name, uint64_t bytes,
                                                    const std::string& field);
  ~ShmMapping();
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  ShmMapping(uint8_t* data, uint64_t size) : data_(data), size_(size) {}
  uint8_t* data_;
  uint64_t size_;
};

}  // namespace hiqcache::server
