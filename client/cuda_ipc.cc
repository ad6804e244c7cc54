#include "hiqcache/cuda_ipc.h"

#include <cstring>
#include <utility>

#include "hiqcache/split_view.h"

namespace hiqcache {
namespace {

constexpr char kHexDigits[] = "0123456789abcdef";

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string Quoted(std::string_view s) {
  constexpr size_t kMax = 80;
  std::string out = "'" + std::string(s.substr(0, kMax)) + "'";
  if (s.size() > kMax) out += "...";
  return out;
}

}  // namespace

// --- CudaIpcHandle -----------------------------------------------------------------------------

std::string CudaIpcHandle::ToBytes() const {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

StatusOr<CudaIpcHandle> CudaIpcHandle::FromBytes(std::string_view wire, std::string_view field) {
  if (wire.size() != kCudaIpcHandleBytes) {
    return InvalidArgument(std::string(field) + ": a CUDA IPC handle is " +
                           std::to_string(kCudaIpcHandleBytes) + " bytes, got " +
                           std::to_string(wire.size()));
  }
  CudaIpcHandle h;
  std::memcpy(h.bytes.data(), wire.data(), kCudaIpcHandleBytes);
  return h;
}

std::string CudaIpcHandle::ToHex() const {
  std::string out;
  out.reserve(2 * bytes.size());
  for (uint8_t b : bytes) {
    out += kHexDigits[b >> 4];
    out += kHexDigits[b & 15];
  }
  return out;
}

StatusOr<CudaIpcHandle> CudaIpcHandle::FromHex(std::string_view hex) {
  if (hex.size() != 2 * kCudaIpcHandleBytes) {
    return InvalidArgument("CUDA IPC handle: expected " + std::to_string(2 * kCudaIpcHandleBytes) +
                           " hex digits, got " + std::to_string(hex.size()));
  }
  CudaIpcHandle h;
  for (size_t i = 0; i < kCudaIpcHandleBytes; ++i) {
    const int hi = HexValue(hex[2 * i]);
    const int lo = HexValue(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return InvalidArgument("CUDA IPC handle: not a hex digit");
    h.bytes[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return h;
}

// --- UUIDs -------------------------------------------------------------------------------------

std::string FormatCudaUuid(std::span<const uint8_t, 16> bytes) {
  std::string out = "GPU-";
  for (size_t i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    out += kHexDigits[bytes[i] >> 4];
    out += kHexDigits[bytes[i] & 15];
  }
  return out;
}

StatusOr<std::string> NormalizeCudaUuid(std::string_view uuid) {
  std::string_view s = uuid;
  if (s.size() >= 4 && (s.substr(0, 4) == "GPU-" || s.substr(0, 4) == "gpu-")) s.remove_prefix(4);
  std::array<uint8_t, 16> bytes{};
  size_t digits = 0;
  for (char c : s) {
    if (c == '-') continue;
    const int v = HexValue(c);
    if (v < 0 || digits == 32) {
      return InvalidArgument(
          "cuda_device_uuid: expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx "
          "or 32 hex digits, got " +
          Quoted(uuid));
    }
    bytes[digits / 2] = static_cast<uint8_t>(bytes[digits / 2] << 4 | v);
    ++digits;
  }
  if (digits != 32) {
    return InvalidArgument("cuda_device_uuid: expected 32 hex digits, got " +
                           std::to_string(digits) + " in " + Quoted(uuid));
  }
  return FormatCudaUuid(bytes);
}

// --- CudaBufferSet -----------------------------------------------------------------------------

StatusOr<BufferRef> CudaBufferSet::Add(const void* ptr, uint64_t bytes) {
  if (ptr == nullptr) return InvalidArgument("CUDA tensor: null device pointer");
  if (bytes == 0) return InvalidArgument("CUDA tensor: size is 0 bytes");
  const uint64_t addr = reinterpret_cast<uintptr_t>(ptr);
  // Tensors of one pool mostly share a few allocations: look among the known ones first, which
  // also keeps the runtime's cost (and the handle export) at one call per allocation.
  size_t index = allocations_.size();
  for (size_t i = 0; i < allocations_.size(); ++i) {
    const CudaAllocation& a = allocations_[i];
    if (addr >= a.base && addr - a.base < a.size) {
      index = i;
      break;
    }
  }
  if (index == allocations_.size()) {
    HIQ_ASSIGN_OR_RETURN(CudaAllocation a, memory_->Find(addr));
    if (a.size == 0 || addr < a.base || addr - a.base >= a.size) {
      return Internal("CUDA tensor: the runtime placed address " + std::to_string(addr) +
                      " outside the allocation it reported");
    }
    if (device_ >= 0 && a.device != device_) {
      return FailedPrecondition("CUDA tensor on device " + std::to_string(a.device) +
                                ", but earlier tensors of this pool are on device " +
                                std::to_string(device_) + ": one pool is one GPU");
    }
    HIQ_ASSIGN_OR_RETURN(CudaIpcHandle handle, memory_->ExportBase(a));
    SharedBuffer buffer;
    buffer.cuda_ipc_handle = handle.ToBytes();
    buffer.size_bytes = a.size;
    device_ = a.device;
    buffers_.push_back(std::move(buffer));
    allocations_.push_back(a);
  }
  const CudaAllocation& a = allocations_[index];
  const uint64_t offset = addr - a.base;
  if (bytes > a.size - offset) {
    return InvalidArgument("CUDA tensor of " + std::to_string(bytes) + " bytes at offset " +
                           std::to_string(offset) + " runs past the end of its allocation (" +
                           std::to_string(a.size) + " bytes)");
  }
  return BufferRef{static_cast<uint32_t>(index), offset};
}

Status ResolveCudaTensors(std::span<const CudaTensor> tensors, const CudaMemoryInfo& memory,
                          PoolSpec* spec, std::vector<CudaAllocation>* allocations) {
  if (!spec->buffers.empty()) {
    return InvalidArgument("ResolveCudaTensors: spec->buffers must be empty (views index tensors)");
  }
  if (tensors.empty()) return InvalidArgument("ResolveCudaTensors: no tensors");
  CudaBufferSet set(&memory);
  std::vector<BufferRef> refs;
  refs.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto ref = set.Add(tensors[i].ptr, tensors[i].bytes);
    if (!ref.ok()) {
      return Status(ref.status().code(),
                    "tensors[" + std::to_string(i) + "]: " + ref.status().message());
    }
    refs.push_back(*ref);
  }
  std::vector<LayerView> layers = spec->layers;
  const uint64_t head_bytes = spec->geometry.HeadBytes();
  for (size_t l = 0; l < layers.size(); ++l) {
    for (int p = 0; p < 2; ++p) {
      if (p == 1 && !layers[l].v) continue;
      TensorView& v = p == 0 ? layers[l].k : *layers[l].v;
      const std::string field = "layers[" + std::to_string(l) + "]." + (p == 0 ? "k" : "v");
      if (v.buffer >= tensors.size()) {
        return InvalidArgument(field + ".buffer: tensor index " + std::to_string(v.buffer) +
                               " out of range (" + std::to_string(tensors.size()) + " tensors)");
      }
      // Split views are HOST-only (the daemon refuses them for CUDA pools too); refused here
      // before EndOffset, which assumes a dim_run that divides head_dim.
      if (const char* split = SplitViewField(v)) {
        return InvalidArgument(field + "." + split + ": split views are for HOST pools only");
      }
      const uint64_t end = v.EndOffset(spec->geometry.num_kv_heads, head_bytes);
      if (end > tensors[v.buffer].bytes) {
        return InvalidArgument(field + ": addresses up to byte " + std::to_string(end) +
                               " of tensors[" + std::to_string(v.buffer) + "], which holds " +
                               std::to_string(tensors[v.buffer].bytes));
      }
      const BufferRef& ref = refs[v.buffer];
      v.buffer = ref.buffer;
      v.offset_bytes += ref.offset_bytes;
    }
  }
  HIQ_ASSIGN_OR_RETURN(std::string uuid, memory.DeviceUuid(set.device()));
  spec->buffers = set.buffers();
  spec->layers = std::move(layers);
  spec->device = DeviceKind::kCuda;
  spec->cuda_device_uuid = std::move(uuid);
  if (allocations != nullptr) *allocations = set.allocations();
  return Status::Ok();
}

}  // namespace hiqcache
