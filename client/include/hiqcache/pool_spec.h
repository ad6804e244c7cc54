// What an engine tells hiqcached about its KV pool: geometry, shared buffers, per-layer views and
// events. Plain C++ mirrors of RegisterPoolRequest's pieces (docs/design.md "Wire contract"), so
// that engine code includes no protobuf headers. Value types; thread-safe to copy between threads.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hiqcache/codec_names.h"

namespace hiqcache {

enum class DType : uint8_t { kBF16 = 0, kFP16 = 1 };
enum class Attention : uint8_t {
  kMHA = 0,  // K and V rows per token and layer
  kMLA = 1,  // one latent row per token and layer, no V
};
enum class Codec : uint8_t {
  kInt8PerHead = 0,     // INT8 codes + one BF16 scale per (token, layer, K|V, head)
  kRaw = 1,             // input dtype stored as-is (bit-exact control)
  kFp8E4m3PerHead = 2,  // FP8 E4M3 codes + one BF16 scale per (token, layer, K|V, head)
  kInt4G32PerHead = 3,  // int4 codes + one BF16 scale per 32 elements of a head (D % 32 == 0)
  kInt4Kivi = 4,        // int4: K per channel over a block, V as kInt4G32PerHead (D % 32 == 0)
  // int4 after a per-head Walsh-Hadamard rotation, each block's first token as an INT8 row: K per
  // channel over the block's other tokens, V per group of 32 (zero point + scale; D % 32 == 0)
  kInt4Hadamard = 5,
  // Keys turned back by RoPE within the block (Geometry::rope_theta) at 2-8 bits per channel
  // allotted by range (5.25 on average), values Hadamard-rotated at 5 bits per head, each block's
  // first token as an INT8 row. D % 32 == 0; K and V planes (not kMLA); CUDA pools up to D 256.
  kInt5Allot = 6,
  // kInt5Allot's format with values at 6 bits (its keys at 5.25 bits on average).
  kInt6Allot = 7,
  // kInt5Allot's format with keys at 4.4375 bits on average and values at 4 bits.
  kInt4Allot = 8,
};
enum class DeviceKind : uint8_t { kHost = 0, kCuda = 1 };

// Codec's values are the wire's Codec numbers, 0 to kCodecCount - 1 (hiqcache/codec_names.h). A
// codec this library does not know (a newer daemon's, in its statistics) reads as a value >=
// kCodecCount.
static_assert(static_cast<uint32_t>(Codec::kInt4Allot) + 1 == kCodecCount,
              "a new Codec needs its row in kCodecNames (hiqcache/codec_names.h)");

const char* DTypeName(DType dtype);  // "bf16", "fp16"
// "int8_per_head", "raw", "fp8_e4m3_per_head", "int4_g32_per_head", "int4_kivi", "int4_hadamard",
// "int5_allot", "int6_allot", "int4_allot"; "unknown" for a value >= kCodecCount
const char* CodecName(Codec codec);
// The wire enum's name: "CODEC_INT8_PER_HEAD", ...; "CODEC_UNKNOWN" for a value >= kCodecCount
const char* CodecContractName(Codec codec);
const char* DeviceKindName(DeviceKind kind);  // "host", "cuda"

struct Geometry {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;  // heads local to this rank
  uint32_t head_dim = 0;
  DType dtype = DType::kBF16;
  Attention attention = Attention::kMHA;
  uint32_t tp_rank = 0;
  uint32_t tp_size = 1;
  // The model's rotary embedding (Geometry.rope): used only by codecs that turn keys
  // (Codec::kInt4Allot, kInt5Allot, kInt6Allot), and then part of the namespace. rope_theta is the
  // model's RoPE base (rope_theta: 1e6 for Qwen3), 0 = none or unknown (no turn); rope_interleaved
  // pairs (2i, 2i+1) as GPT-J, else rotate-half pairs (i, i + head_dim/2) as Llama, Qwen and NeoX.
  double rope_theta = 0;
  bool rope_interleaved = false;

  static constexpr uint64_t kElementBytes = 2;  // BF16 and FP16
  uint64_t HeadBytes() const { return uint64_t{head_dim} * kElementBytes; }
  uint64_t RowBytes() const { return uint64_t{num_kv_heads} * HeadBytes(); }
  uint32_t Planes() const { return attention == Attention::kMLA ? 1 : 2; }
  // Engine-side (BF16/FP16) bytes of one token across all layers: 147,456 for Qwen3-8B.
  uint64_t BytesPerToken() const { return uint64_t{num_layers} * Planes() * RowBytes(); }
};

// A strided view of one K, V or latent tensor (docs/design.md TensorView). Row r is page
// p = r / page_rows, t = r % page_rows when paged (page_rows > 0), else p = 0, t = r. Slot t is
// at t * row_stride_bytes, or, with slots grouped (row_group > 0), at
// (t / row_group) * row_group_stride_bytes + (t % row_group) * row_stride_bytes. Head h of row r
// starts at base(buffer) + offset_bytes + p * page_stride_bytes + (slot t's offset) +
// h * head_stride_bytes (head_stride_bytes 0 = head_dim elements) and holds head_dim contiguous
// elements, or, with the head split (dim_run > 0, a divisor of head_dim), head_dim / dim_run
// runs of dim_run elements, run j at j * dim_run_stride_bytes from the head's start, element i
// of a run at i * dim_stride_bytes from the run's start (0 = 2 bytes: contiguous). Split views
// (row_group, dim_run, dim_stride_bytes: an engine's tiles) are for HOST pools; the daemon
// validates every field at registration (INVALID_ARGUMENT naming the field).
struct TensorView {
  uint32_t buffer = 0;  // index into PoolSpec::buffers
  uint64_t offset_bytes = 0;
  uint64_t row_stride_bytes = 0;
  uint32_t num_rows = 0;
  uint64_t head_stride_bytes = 0;
  uint64_t page_rows = 0;
  uint64_t page_stride_bytes = 0;
  uint32_t row_group = 0;  // 0 = slots not grouped
  uint64_t row_group_stride_bytes = 0;
  uint32_t dim_run = 0;  // 0 = a head's elements contiguous
  uint64_t dim_run_stride_bytes = 0;
  uint64_t dim_stride_bytes = 0;  // 0 = a run's elements contiguous

  // Byte offset from the buffer base of head `head` of row `row` (its first element).
  // `head_bytes` (head_dim * element size) is the head stride used when head_stride_bytes is 0.
  uint64_t HeadOffset(uint32_t row, uint32_t head, uint64_t head_bytes) const;
  // Byte offset from the buffer base of element `d` of head `head` of row `row`.
  uint64_t ElementOffset(uint32_t row, uint32_t head, uint32_t d, uint64_t head_bytes) const;
  // One past the last byte the view addresses for `num_heads` heads (0 when num_rows is 0):
  // the buffer must be at least this large.
  uint64_t EndOffset(uint32_t num_heads, uint64_t head_bytes) const;
};

struct LayerView {
  TensorView k;
  std::optional<TensorView> v;  // unset for MLA
};

// One registered memory object. HOST: host_fd or host_shm_name (a POSIX shm name, leading "/"
// optional), or both; CUDA: cuda_ipc_handle (the 64-byte cudaIpcMemHandle_t of the allocation
// base).
//
// A HOST buffer reaches the daemon as a file descriptor over the client's session
// (hiqcache/session.h) whenever there is one: host_fd when set, else the client opens
// host_shm_name itself (O_RDWR, with the caller's own rights) and passes that fd. Only without a
// session (a TCP target, a daemon that predates sessions) is the name sent, and the daemon then
// opens it, accepting only objects the caller owns.
struct SharedBuffer {
  std::string host_shm_name;
  std::string cuda_ipc_handle;
  uint64_t size_bytes = 0;
  // HOST: an open read-write fd of the buffer (a memfd, ideally sealed with F_SEAL_SHRINK, or a
  // shm object's fd), -1 = none. Borrowed: the caller keeps it open for as long as the pool is
  // registered, since a re-registration (daemon restart) passes it again. A buffer with only an
  // fd cannot be registered without a session (FAILED_PRECONDITION).
  int host_fd = -1;
};

// Ticket slots, for both device kinds (docs/design.md "Completion: ticket slots"): a shared
// memory object of `count` 64-byte slots (slot i = little-endian uint64 at byte 64*i), by fd or
// named as for SharedBuffer: HostEventPool::Spec, CudaTicketSlots::Spec (hiqcache/cuda_export.h).
struct EventPoolSpec {
  std::string host_shm_name;
  int host_fd = -1;  // as SharedBuffer::host_fd
  uint32_t count = 0;
  // Sent as given; the daemon refuses them (FAILED_PRECONDITION naming the field): completion
  // uses the slots above.
  std::vector<std::string> cuda_ipc_event_handles;
};

// Everything RegisterPool sends. client_pid is filled in by the client library.
struct PoolSpec {
  std::string model;   // model name + revision
  std::string tenant;  // may be empty
  Geometry geometry;
  uint32_t block_tokens = 0;
  Codec codec = Codec::kInt8PerHead;
  DeviceKind device = DeviceKind::kHost;
  std::string cuda_device_uuid;
  std::vector<SharedBuffer> buffers;
  std::vector<LayerView> layers;  // one per geometry.num_layers
  EventPoolSpec events;
};

// A namespace named by its parts, for callers that hold no pool (a scheduler asking what every TP
// rank of an engine holds): the model, tenant, geometry, block_tokens and codec a PoolSpec
// registers with. The daemon maps it to a namespace exactly as it maps a registration, so a ref
// with a pool's parts names that pool's namespace; for Attention::kMLA, tp_rank and tp_size are
// not part of the namespace.
struct NamespaceRef {
  std::string model;
  std::string tenant;
  Geometry geometry;
  uint32_t block_tokens = 0;
  Codec codec = Codec::kInt8PerHead;
};

// The daemon's answer to RegisterPool.
struct RegisteredPool {
  uint64_t pool_id = 0;  // the daemon's id; changes when the client re-registers
  std::string namespace_id;
  uint64_t encoded_bytes_per_token = 0;
  uint64_t block_bytes = 0;
  uint64_t capacity_tokens = 0;
};

}  // namespace hiqcache
