#include "cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>

#include "codec_cuda.h"
#include "cuda_handles.h"
#include "hiqcache/log.h"
#include "registration.h"

namespace hiqcache::server {
namespace {

constexpr uint64_t kRegisterChunk = 64ull << 30;

Status CudaError(cudaError_t err, const std::string& what) {
  (void)cudaGetLastError();
  return Internal(what + ": " + cudaGetErrorString(err));
}

#define HIQ_CUDA_RETURN(call, what)                        \
  do {                                                     \
    cudaError_t hiq_err_ = (call);                         \
    if (hiq_err_ != cudaSuccess) return CudaError(hiq_err_, what); \
  } while (0)

// Copies count chunks on `stream` with the copy engines: one batched call where available.
Status CopyChunks(std::vector<void*>& dst, std::vector<const void*>& src,
                  std::vector<size_t>& sizes, cudaStream_t stream, cudaMemcpyKind kind) {
  if (dst.empty()) return Status::Ok();
#if CUDART_VERSION >= 13000
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attr_idx = 0;
  cudaError_t err = cudaMemcpyBatchAsync(dst.data(), const_cast<const void* const*>(src.data()),
                                         sizes.data(), dst.size(), &attr, &attr_idx, 1, stream);
  if (err == cudaSuccess) return Status::Ok();
  (void)cudaGetLastError();  // fall back to one call per chunk
#endif
  for (size_t i = 0; i < dst.size(); ++i) {
    HIQ_CUDA_RETURN(cudaMemcpyAsync(dst[i], src[i], sizes[i], kind, stream), "cudaMemcpyAsync");
  }
  return Status::Ok();
}

}  // namespace

bool NormalizeCudaUuid(const std::string& in, std::string* out) {
  std::string s = in;
  if (s.rfind("GPU-", 0) == 0 || s.rfind("gpu-", 0) == 0) s = s.substr(4);
  std::string hex;
  for (char c : s) {
    if (c == '-') continue;
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
    hex += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  if (hex.size() != 32) return false;
  *out = hex;
  return true;
}

struct CudaBackend::Mapping {
  kernels::CudaIpcMapping mapping;
};

namespace {

// Device and pinned buffers of one direction of one pool, grown on demand. Work using them has
// completed whenever Run* returns (it waits for its stream), so growing never frees memory that
// queued work still uses.
struct DirectionBuffers {
  kernels::CudaStream stream;
  kernels::DeviceBuffer staging;
  kernels::DeviceBuffer scratch;
  kernels::PinnedHostBuffer host_scratch;
  kernels::DeviceBuffer flags;
  kernels::PinnedHostBuffer host_flags;

  Status Ensure(int device, size_t staging_bytes, size_t scratch_bytes, size_t flag_bytes) {
    if (staging.size() < staging_bytes) {
      staging.Reset();
      HIQ_ASSIGN_OR_RETURN(staging, kernels::DeviceBuffer::Create(device, staging_bytes));
    }
    if (scratch.size() < scratch_bytes) {
      scratch.Reset();
      host_scratch.Reset();
      HIQ_ASSIGN_OR_RETURN(scratch, kernels::DeviceBuffer::Create(device, scratch_bytes));
      HIQ_ASSIGN_OR_RETURN(host_scratch, kernels::PinnedHostBuffer::Create(scratch_bytes));
    }
    if (flag_bytes > 0 && flags.size() < flag_bytes) {
      flags.Reset();
      host_flags.Reset();
      HIQ_ASSIGN_OR_RETURN(flags, kernels::DeviceBuffer::Create(device, flag_bytes));
      HIQ_ASSIGN_OR_RETURN(host_flags, kernels::PinnedHostBuffer::Create(flag_bytes));
    }
    return Status::Ok();
  }
};

class CudaBinding : public PoolBinding {
 public:
  CudaBinding(int device, kernels::BlockLayout layout,
              std::vector<std::shared_ptr<CudaBackend::Mapping>> buffers,
              std::vector<kernels::CudaEvent> events, std::vector<kernels::LayerViews> views,
              uint32_t num_rows, kernels::CudaStream backup_stream,
              kernels::CudaStream restore_stream)
      : device_(device),
        layout_(layout),
        buffers_(std::move(buffers)),
        events_(std::move(events)),
        views_(std::move(views)),
        num_rows_(num_rows) {
    backup_.stream = std::move(backup_stream);
    restore_.stream = std::move(restore_stream);
  }

  uint32_t event_count() const override { return static_cast<uint32_t>(events_.size()); }
  uint32_t num_rows() const override { return num_rows_; }
  bool SignalsOnDevice() const override { return true; }

  Status RunBackup(BackupTask& task) override {
    std::vector<uint8_t> nonfinite(task.payloads.size(), 0);
    Status st = EnqueueBackup(task);
    if (task.done_event >= 0) Record(task.done_event, backup_.stream.get());
    if (task.on_enqueued) task.on_enqueued();
    Status sync = backup_.stream.Synchronize();
    if (st.ok()) st = sync;
    if (st.ok() && !task.payloads.empty()) {
      std::memcpy(nonfinite.data(), backup_.host_flags.data(), nonfinite.size());
    }
    task.on_written(nonfinite, st);
    return st;
  }

  Status RunRestore(RestoreTask& task) override {
    Status st = EnqueueRestore(task);
    if (!st.ok() && task.layer_event_base >= 0) {
      // Never leave an engine waiting on a layer that will not come.
      for (uint32_t l = 0; l < layout_.num_layers; ++l) {
        Record(task.layer_event_base + static_cast<int32_t>(l), restore_.stream.get());
      }
    }
    if (task.done_event >= 0) Record(task.done_event, restore_.stream.get());
    if (task.on_enqueued) task.on_enqueued();
    Status sync = restore_.stream.Synchronize();
    return st.ok() ? sync : st;
  }

  void Signal(int32_t event, uint64_t) override {
    // CUDA events carry no value: recording one on the idle restore stream completes it.
    Record(event, restore_.stream.get());
  }

 private:
  void Record(int32_t event, CUstream_st* stream) {
    if (event < 0 || static_cast<size_t>(event) >= events_.size()) return;
    Status st = events_[event].Record(stream);
    if (!st.ok()) HIQ_LOG(WARN) << "recording event " << event << ": " << st.ToString();
  }

  Status Wait(int32_t event, CUstream_st* stream) {
    if (event < 0) return Status::Ok();
    return events_[event].EnqueueWait(stream);
  }

  Status EnqueueBackup(BackupTask& task) {
    kernels::DeviceGuard guard(device_);
    HIQ_RETURN_IF_ERROR(guard.status());
    const uint32_t n = static_cast<uint32_t>(task.payloads.size());
    HIQ_RETURN_IF_ERROR(Wait(task.wait_event, backup_.stream.get()));
    if (n == 0) return Status::Ok();
    const size_t block_bytes = layout_.BlockBytes();
    const size_t scratch =
        kernels::JobArraysBytes(layout_.num_layers, n, layout_.block_tokens);
    HIQ_RETURN_IF_ERROR(backup_.Ensure(device_, block_bytes * n, scratch, n));
    std::vector<uint8_t*> staging(n);
    for (uint32_t b = 0; b < n; ++b) staging[b] = backup_.staging.data() + b * block_bytes;
    kernels::EncodeJob host_job;
    host_job.layout = layout_;
    host_job.layers = views_.data();
    host_job.rows = task.rows.data();
    host_job.blocks = staging.data();
    host_job.num_blocks = n;
    host_job.nonfinite = backup_.flags.data();
    kernels::EncodeJob dev_job;
    HIQ_RETURN_IF_ERROR(kernels::StageEncodeJob(host_job, backup_.host_scratch.data(),
                                                backup_.scratch.data(), scratch,
                                                backup_.stream.get(), &dev_job));
    HIQ_RETURN_IF_ERROR(kernels::LaunchEncode(dev_job, backup_.stream.get()));
    std::vector<void*> dst(n);
    std::vector<const void*> src(n);
    std::vector<size_t> sizes(n, block_bytes);
    for (uint32_t b = 0; b < n; ++b) {
      dst[b] = task.payloads[b];
      src[b] = staging[b];
    }
    auto stream = reinterpret_cast<cudaStream_t>(backup_.stream.get());
    HIQ_RETURN_IF_ERROR(CopyChunks(dst, src, sizes, stream, cudaMemcpyDeviceToHost));
    HIQ_CUDA_RETURN(cudaMemcpyAsync(backup_.host_flags.data(), backup_.flags.data(), n,
                                    cudaMemcpyDeviceToHost, stream),
                    "copying non-finite flags");
    return Status::Ok();
  }

  Status EnqueueRestore(RestoreTask& task) {
    kernels::DeviceGuard guard(device_);
    HIQ_RETURN_IF_ERROR(guard.status());
    const uint32_t n = static_cast<uint32_t>(task.payloads.size());
    HIQ_RETURN_IF_ERROR(Wait(task.wait_event, restore_.stream.get()));
    if (n == 0) {
      if (task.layer_event_base >= 0) {
        for (uint32_t l = 0; l < layout_.num_layers; ++l) {
          Record(task.layer_event_base + static_cast<int32_t>(l), restore_.stream.get());
        }
      }
      return Status::Ok();
    }
    const size_t block_bytes = layout_.BlockBytes();
    const size_t layer_bytes = layout_.LayerBytes();
    const size_t scratch =
        kernels::JobArraysBytes(layout_.num_layers, n, layout_.block_tokens);
    HIQ_RETURN_IF_ERROR(restore_.Ensure(device_, block_bytes * n, scratch, 0));
    std::vector<const uint8_t*> staging(n);
    for (uint32_t b = 0; b < n; ++b) staging[b] = restore_.staging.data() + b * block_bytes;
    kernels::DecodeJob host_job;
    host_job.layout = layout_;
    host_job.layers = views_.data();
    host_job.rows = task.rows.data();
    host_job.blocks = staging.data();
    host_job.num_blocks = n;
    kernels::DecodeJob dev_job;
    HIQ_RETURN_IF_ERROR(kernels::StageDecodeJob(host_job, restore_.host_scratch.data(),
                                                restore_.scratch.data(), scratch,
                                                restore_.stream.get(), &dev_job));
    auto stream = reinterpret_cast<cudaStream_t>(restore_.stream.get());
    std::vector<void*> dst(n);
    std::vector<const void*> src(n);
    std::vector<size_t> sizes(n, layer_bytes);
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      // Copy, decode and scatter of layer l are enqueued before its event is recorded.
      for (uint32_t b = 0; b < n; ++b) {
        dst[b] = const_cast<uint8_t*>(staging[b]) + l * layer_bytes;
        src[b] = task.payloads[b] + l * layer_bytes;
      }
      HIQ_RETURN_IF_ERROR(CopyChunks(dst, src, sizes, stream, cudaMemcpyHostToDevice));
      HIQ_RETURN_IF_ERROR(kernels::LaunchDecodeLayer(dev_job, l, restore_.stream.get()));
      if (task.layer_event_base >= 0) {
        Record(task.layer_event_base + static_cast<int32_t>(l), restore_.stream.get());
      }
    }
    return Status::Ok();
  }

  const int device_;
  const kernels::BlockLayout layout_;
  std::vector<std::shared_ptr<CudaBackend::Mapping>> buffers_;
  std::vector<kernels::CudaEvent> events_;
  std::vector<kernels::LayerViews> views_;
  const uint32_t num_rows_;
  DirectionBuffers backup_;
  DirectionBuffers restore_;
};

}  // namespace

CudaBackend::CudaBackend(uint8_t* pool, std::vector<std::pair<uint8_t*, uint64_t>> registered)
    : pool_(pool), registered_(std::move(registered)) {}

StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(uint8_t* pool, uint64_t pool_bytes) {
  std::vector<std::pair<uint8_t*, uint64_t>> done;
  for (uint64_t off = 0; off < pool_bytes; off += kRegisterChunk) {
    const uint64_t len = std::min(kRegisterChunk, pool_bytes - off);
    cudaError_t err = cudaHostRegister(pool + off, len, cudaHostRegisterPortable);
    if (err != cudaSuccess) {
      Status st = CudaError(err, "cudaHostRegister of the pool (is LimitMEMLOCK unlimited?)");
      for (auto& [p, l] : done) (void)cudaHostUnregister(p);
      return FailedPrecondition(st.message());
    }
    done.emplace_back(pool + off, len);
  }
  return std::unique_ptr<CudaBackend>(new CudaBackend(pool, std::move(done)));
}

CudaBackend::~CudaBackend() {
  for (auto& [p, l] : registered_) {
    cudaError_t err = cudaHostUnregister(p);
    if (err != cudaSuccess) {
      HIQ_LOG(WARN) << "cudaHostUnregister: " << cudaGetErrorString(err);
      (void)cudaGetLastError();
    }
  }
}

StatusOr<int> CudaBackend::DeviceForUuid(const std::string& uuid) const {
  std::string want;
  if (!NormalizeCudaUuid(uuid, &want)) {
    return InvalidArgument("device.cuda_device_uuid: expected a GPU UUID like GPU-xxxxxxxx-..., "
                           "got '" + uuid.substr(0, 64) + "'");
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return FailedPrecondition("device.kind: no CUDA device is visible to hiqcached");
  }
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    char hex[33];
    for (int i = 0; i < 16; ++i) {
      std::snprintf(hex + 2 * i, 3, "%02x", static_cast<unsigned char>(prop.uuid.bytes[i]));
    }
    if (want == hex) return d;
  }
  return FailedPrecondition("device.cuda_device_uuid: no visible GPU has UUID " + uuid.substr(0, 64));
}

StatusOr<std::shared_ptr<CudaBackend::Mapping>> CudaBackend::OpenMapping(
    int device, const std::string& handle, uint64_t size_bytes, const std::string& field) {
  std::lock_guard<std::mutex> lock(mu_);
  auto key = std::make_pair(device, handle);
  auto it = mappings_.find(key);
  if (it != mappings_.end()) {
    if (auto existing = it->second.lock()) {
      if (existing->mapping.size() < size_bytes) {
        return InvalidArgument(field + ": size_bytes exceeds the allocation opened earlier");
      }
      return existing;
    }
    mappings_.erase(it);
  }
  auto opened = kernels::CudaIpcMapping::Open(device, handle, size_bytes);
  if (!opened.ok()) {
    return FailedPrecondition(field + ": cannot open the CUDA IPC handle: " +
                              opened.status().message());
  }
  auto m = std::make_shared<Mapping>();
  m->mapping = std::move(opened).value();
  mappings_[key] = m;
  return m;
}

StatusOr<std::unique_ptr<PoolBinding>> CudaBackend::Bind(const RegisterSpec& spec,
                                                         const kernels::BlockLayout& layout) {
  HIQ_ASSIGN_OR_RETURN(int device, DeviceForUuid(spec.cuda_device_uuid));
  std::vector<std::shared_ptr<Mapping>> buffers;
  std::vector<uint8_t*> bases;
  for (size_t i = 0; i < spec.buffers.size(); ++i) {
    const std::string field = "buffers[" + std::to_string(i) + "].cuda_ipc_handle";
    HIQ_ASSIGN_OR_RETURN(auto m, OpenMapping(device, spec.buffers[i].cuda_ipc_handle,
                                             spec.buffers[i].size_bytes, field));
    bases.push_back(m->mapping.data());
    buffers.push_back(std::move(m));
  }
  std::vector<kernels::CudaEvent> events;
  for (size_t i = 0; i < spec.events.cuda_ipc_event_handles.size(); ++i) {
    auto ev = kernels::CudaEvent::OpenIpc(device, spec.events.cuda_ipc_event_handles[i]);
    if (!ev.ok()) {
      return FailedPrecondition("events.cuda_ipc_event_handles[" + std::to_string(i) +
                                "]: cannot open: " + ev.status().message());
    }
    events.push_back(std::move(ev).value());
  }
  HIQ_ASSIGN_OR_RETURN(auto backup_stream, kernels::CudaStream::Create(device));
  HIQ_ASSIGN_OR_RETURN(auto restore_stream, kernels::CudaStream::Create(device));
  std::vector<kernels::LayerViews> views = ResolveViews(spec, layout, bases);
  return std::unique_ptr<PoolBinding>(new CudaBinding(
      device, layout, std::move(buffers), std::move(events), std::move(views), MinRows(spec),
      std::move(backup_stream), std::move(restore_stream)));
}

}  // namespace hiqcache::server
