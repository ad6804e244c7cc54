// The daemon's requests as plain structs, independent of gRPC: the transport converts protobuf
// messages into these field by field (no checks), and the core validates them in full before it
// reads or writes anything (registration.h). Value types.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace hiqcache::server {

// When the caller of a request gave up (its gRPC deadline): work that has not started by then
// never touches the engine's memory. time_point::max() = no deadline.
using CallerDeadline = std::chrono::steady_clock::time_point;

// Who sent a request, as the kernel reported it: SO_PEERCRED of the caller's session socket
// (session_listener.h), named on each RPC by the session token in its metadata. A caller without
// a valid session is anonymous: it owns no pool and may register none.
struct Caller {
  uint64_t session = 0;  // daemon-local session id; 0 = anonymous
  uint32_t pid = 0;
  uint32_t uid = 0;
  uint32_t gid = 0;
  // uid 0, the daemon's own uid, or a configured admin uid/group, running in the daemon's pid
  // namespace (not inside a container: session_listener.h).
  bool admin = false;
  // The caller's pod or container (peer_placement.h): "" for a process of the host itself.
  std::string pod;
  bool authenticated() const { return session != 0; }
  // The node's operator (metrics, the daemon itself): an admin who is no session.
  static Caller Operator() {
    Caller c;
    c.admin = true;
    return c;
  }
};

enum class DeviceKind : uint8_t { kUnspecified = 0, kHost = 1, kCuda = 2, kInvalid = 255 };

struct BufferSpec {
  bool has_host_shm_name = false;
  std::string host_shm_name;
  bool has_cuda_ipc_handle = false;
  std::string cuda_ipc_handle;
  // HOST: an fd the caller passed over its session (SharedBuffer.host_fd_id). The transport
  // resolves the id into `fd`, borrowed for the duration of RegisterPool (a binding dups or maps
  // it; it never closes it); -1 when the id named no fd of the caller's session.
  bool has_host_fd = false;
  uint64_t host_fd_id = 0;
  int fd = -1;
  uint64_t size_bytes = 0;
};

struct ViewSpec {
  bool present = false;
  uint32_t buffer = 0;
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
  uint64_t dim_stride_bytes = 0;  // 0 = a run's elements contiguous (2 bytes apart)
};

struct LayerSpec {
  ViewSpec k;
  ViewSpec v;
};

struct EventsSpec {
  std::string host_shm_name;
  // As BufferSpec's: EventPool.host_fd_id (0 = none) and the fd it resolved to (-1 = none).
  uint64_t host_fd_id = 0;
  int fd = -1;
  uint32_t count = 0;
  std::vector<std::string> cuda_ipc_event_handles;
};

// The wire's enum values (hiqcache.v1: DType, Attention, DeviceKind) that the specs below carry
// as ints, so that the core needs no protobuf include; cache_service.cc asserts each against the
// proto. Codec values are named by hiqcache/codec_names.h and kernels::CodecKind.
namespace wire {
inline constexpr int kDTypeBf16 = 1;
inline constexpr int kDTypeFp16 = 2;
inline constexpr int kAttentionMha = 1;
inline constexpr int kAttentionMla = 2;
inline constexpr int kDeviceHost = 1;
inline constexpr int kDeviceCuda = 2;
}  // namespace wire

// The parts a namespace is derived from: RegisterPoolRequest's model, tenant, geometry,
// block_tokens and codec, which a NamespaceRef repeats for callers that hold no pool.
struct NamespaceSpec {
  std::string model;
  std::string tenant;
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  int dtype = 0;      // proto DType value
  int attention = 0;  // proto Attention value
  uint32_t tp_rank = 0;
  uint32_t tp_size = 0;
  uint32_t block_tokens = 0;
  int codec = 0;  // proto Codec value
  // geometry.rope: part of the namespace only for codecs that turn keys (CODEC_INT4_ALLOT,
  // CODEC_INT5_ALLOT, CODEC_INT6_ALLOT).
  double rope_theta = 0;  // 0 = no rotary embedding / unknown
  bool rope_interleaved = false;
};

struct RegisterSpec : NamespaceSpec {
  int device_kind = 0;
  std::string cuda_device_uuid;
  std::vector<BufferSpec> buffers;
  std::vector<LayerSpec> layers;
  EventsSpec events;
  uint32_t client_pid = 0;  // as the client reported it; ownership uses caller.pid
  std::string peer;         // transport's description of the caller, for logs and stats
  Caller caller;
};

// At most this many NamespaceRefs in one LookupRequest (a TP group, with room to spare).
inline constexpr uint32_t kMaxLookupNamespaces = 64;

// A Lookup: the keys' longest leading run present in every listed namespace, and also in the
// pool's namespace when pool_id != 0. At least one of pool_id and namespaces must be given.
struct LookupSpec {
  uint64_t pool_id = 0;  // 0 = none
  std::vector<std::string> keys;
  std::vector<NamespaceSpec> namespaces;
  Caller caller;
};

struct BlockSpec {
  std::string key;
  std::vector<uint32_t> rows;
};

struct TransferSpec {
  uint64_t pool_id = 0;
  std::vector<BlockSpec> blocks;
  int32_t wait_event = -1;
  uint64_t wait_value = 0;
  int32_t layer_event_base = -1;  // restore only
  int32_t done_event = -1;
  bool sync = false;
  Caller caller;
  // When the caller gives up (its gRPC deadline, on this host's steady clock): work not started
  // by then never touches the engine's memory. max() = none.
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
};

}  // namespace hiqcache::server
