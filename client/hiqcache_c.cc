// The C ABI (hiqcache/hiqcache_c.h) over hiqcache::Client. Each entry point converts flat C
// arguments into the C++ types, calls the client, and turns the Status into a code plus the
// thread's last-error message. No exception crosses the boundary.
#include "hiqcache/hiqcache_c.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "hiqcache/block_keys.h"
#include "hiqcache/client.h"
#include "hiqcache/host_shm.h"
#include "hiqcache/pool_spec.h"
#include "hiqcache/status.h"
#if defined(HIQ_CLIENT_HAVE_CUDA)
#include "hiqcache/cuda_export.h"
#endif

struct hiq_client {
  std::unique_ptr<hiqcache::Client> client;
};

struct hiq_host_pool {
  hiqcache::HostKvPool kv;
  std::optional<hiqcache::HostEventPool> events;
};

#if defined(HIQ_CLIENT_HAVE_CUDA)
struct hiq_cuda_slots {
  hiqcache::CudaTicketSlots slots;
};
#else
struct hiq_cuda_slots {};
#endif

namespace {

using hiqcache::BlockKey;
using hiqcache::Status;
using hiqcache::StatusCode;

thread_local std::string g_last_error;

int Fail(const Status& s) {
  g_last_error = s.message().empty() ? hiqcache::StatusCodeName(s.code()) : s.message();
  return static_cast<int>(s.code());
}

int Fail(StatusCode code, std::string message) { return Fail(Status(code, std::move(message))); }

int Result(const Status& s) {
  if (s.ok()) return HIQ_OK;
  return Fail(s);
}

#define HIQ_C_REQUIRE(cond, message)                                   \
  do {                                                                 \
    if (!(cond)) return Fail(StatusCode::kInvalidArgument, (message)); \
  } while (0)

// Runs `body` (returning int) and maps anything it throws to HIQ_INTERNAL.
template <typename Body>
int Guarded(Body&& body) {
  try {
    g_last_error.clear();
    return body();
  } catch (const std::exception& e) {
    return Fail(StatusCode::kInternal, std::string("hiqcache C ABI: ") + e.what());
  } catch (...) {
    return Fail(StatusCode::kInternal, "hiqcache C ABI: unknown exception");
  }
}

std::vector<BlockKey> Keys(const uint8_t* keys, uint32_t n) {
  std::vector<BlockKey> out(n);
  for (uint32_t i = 0; i < n; ++i) std::memcpy(out[i].data(), keys + size_t{i} * 16, 16);
  return out;
}

hiqcache::Geometry ToGeometry(const hiq_geometry& g) {
  hiqcache::Geometry out;
  out.num_layers = g.num_layers;
  out.num_kv_heads = g.num_kv_heads;
  out.head_dim = g.head_dim;
  out.dtype = g.dtype == HIQ_DTYPE_FP16 ? hiqcache::DType::kFP16 : hiqcache::DType::kBF16;
  out.attention =
      g.attention == HIQ_ATTENTION_MLA ? hiqcache::Attention::kMLA : hiqcache::Attention::kMHA;
  out.tp_rank = g.tp_rank;
  out.tp_size = g.tp_size == 0 ? 1 : g.tp_size;
  return out;
}

Status CheckEnums(const hiq_geometry& g, uint32_t codec) {
  if (g.dtype > HIQ_DTYPE_FP16) return hiqcache::InvalidArgument("geometry.dtype: unknown value");
  if (g.attention > HIQ_ATTENTION_MLA) {
    return hiqcache::InvalidArgument("geometry.attention: unknown value");
  }
  if (codec > HIQ_CODEC_INT4_ALLOT) {
    return hiqcache::InvalidArgument("codec: unknown value");
  }
  return Status::Ok();
}

// hiq_codec is numbered as hiqcache::Codec and the wire (codec_names_test checks the names).
static_assert(HIQ_CODEC_INT4_ALLOT + 1 == hiqcache::kCodecCount,
              "a new hiq_codec needs its hiqcache::Codec");

// REQUIRES: codec <= HIQ_CODEC_INT4_ALLOT (checked by the caller).
hiqcache::Codec ToCodec(uint32_t codec) { return static_cast<hiqcache::Codec>(codec); }

hiqcache::TensorView ToView(const hiq_tensor_view& v) {
  hiqcache::TensorView out;
  out.buffer = v.buffer;
  out.offset_bytes = v.offset_bytes;
  out.row_stride_bytes = v.row_stride_bytes;
  out.num_rows = v.num_rows;
  out.head_stride_bytes = v.head_stride_bytes;
  out.page_rows = v.page_rows;
  out.page_stride_bytes = v.page_stride_bytes;
  out.row_group = v.row_group;
  out.row_group_stride_bytes = v.row_group_stride_bytes;
  out.dim_run = v.dim_run;
  out.dim_run_stride_bytes = v.dim_run_stride_bytes;
  out.dim_stride_bytes = v.dim_stride_bytes;
  return out;
}

void FillInfo(const hiqcache::RegisteredPool& p, hiq_pool_info* info) {
  if (info == nullptr) return;
  std::memset(info, 0, sizeof(*info));
  info->pool_id = p.pool_id;
  info->encoded_bytes_per_token = p.encoded_bytes_per_token;
  info->block_bytes = p.block_bytes;
  info->capacity_tokens = p.capacity_tokens;
  const size_t n = std::min(p.namespace_id.size(), sizeof(info->namespace_id) - 1);
  std::memcpy(info->namespace_id, p.namespace_id.data(), n);
}

// Registers `spec` and fills *out / *info.
int Register(hiq_client* client, const hiqcache::PoolSpec& spec, bool pending, hiq_pool* out,
             hiq_pool_info* info) {
  auto handle = client->client->RegisterPool(spec, pending);
  if (!handle.ok()) return Fail(handle.status());
  *out = handle->id;
  if (info != nullptr) {
    std::memset(info, 0, sizeof(*info));
    auto registered = client->client->PoolInfo(*handle);
    if (registered.ok()) FillInfo(*registered, info);  // a pending pool has no info yet
  }
  return HIQ_OK;
}

}  // namespace

extern "C" {

int hiq_abi_version(void) { return HIQ_C_ABI_VERSION; }

// HIQ_VERSION: the project version, defined for this target by client/CMakeLists.txt.
const char* hiq_version(void) { return HIQ_VERSION; }

const char* hiq_last_error(void) { return g_last_error.c_str(); }

int hiq_connect(const char* target, int64_t timeout_ms, hiq_client** out) {
  return Guarded([&]() -> int {
    HIQ_C_REQUIRE(out != nullptr, "hiq_connect: out is NULL");
    *out = nullptr;
    hiqcache::ClientOptions options;
    if (target != nullptr) options.target = target;
    if (timeout_ms > 0) options.call_timeout = std::chrono::milliseconds(timeout_ms);
    options.register_timeout = std::max(options.register_timeout, options.call_timeout);
    auto client = hiqcache::Client::Connect(std::move(options));
    if (!client.ok()) return Fail(client.status());
    *out = new hiq_client{std::move(client).value()};
    return HIQ_OK;
  });
}

void hiq_close(hiq_client* client) {
  try {
    delete client;
  } catch (...) {
  }
}

int hiq_register_pool(hiq_client* client, const hiq_pool_desc* desc, int pending_if_unavailable,
                      hiq_pool* out, hiq_pool_info* info) {
  return Guarded([&]() -> int {
    HIQ_C_REQUIRE(client != nullptr && desc != nullptr && out != nullptr,
                  "hiq_register_pool: client, desc and out must not be NULL");
    *out = 0;
    HIQ_C_REQUIRE(desc->model != nullptr, "model: must not be NULL");
    HIQ_C_REQUIRE(desc->num_buffers == 0 || desc->buffers != nullptr, "buffers: NULL");
    HIQ_C_REQUIRE(desc->geometry.num_layers == 0 || desc->layers != nullptr, "layers: NULL");
    HIQ_C_REQUIRE(desc->reserved_events == 0, "reserved_events: must be 0");
    HIQ_C_REQUIRE(
        desc->cuda_slots == nullptr || (desc->event_shm_name == nullptr && desc->event_count == 0),
        "cuda_slots: give either cuda_slots or event_shm_name and event_count");
    HIQ_C_REQUIRE(desc->device_kind <= HIQ_DEVICE_CUDA, "device.kind: unknown value");
    if (Status s = CheckEnums(desc->geometry, desc->codec); !s.ok()) return Fail(s);
    hiqcache::PoolSpec spec;
    spec.model = desc->model;
    if (desc->tenant != nullptr) spec.tenant = desc->tenant;
    spec.geometry = ToGeometry(desc->geometry);
    spec.block_tokens = desc->block_tokens;
    spec.codec = ToCodec(desc->codec);
    spec.device = desc->device_kind == HIQ_DEVICE_CUDA ? hiqcache::DeviceKind::kCuda
                                                       : hiqcache::DeviceKind::kHost;
    if (desc->cuda_device_uuid != nullptr) spec.cuda_device_uuid = desc->cuda_device_uuid;
    for (uint32_t i = 0; i < desc->num_buffers; ++i) {
      const hiq_buffer& b = desc->buffers[i];
      hiqcache::SharedBuffer out_buffer;
      if (b.host_shm_name != nullptr) out_buffer.host_shm_name = b.host_shm_name;
      if (b.cuda_ipc_handle != nullptr) {
        // Passed through as given: the daemon names the buffer when the length is wrong.
        out_buffer.cuda_ipc_handle.assign(reinterpret_cast<const char*>(b.cuda_ipc_handle),
                                          b.cuda_ipc_handle_len);
      }
      out_buffer.size_bytes = b.size_bytes;
      spec.buffers.push_back(std::move(out_buffer));
    }
    for (uint32_t l = 0; l < desc->geometry.num_layers; ++l) {
      hiqcache::LayerView layer;
      layer.k = ToView(desc->layers[l].k);
      if (desc->layers[l].has_v) layer.v = ToView(desc->layers[l].v);
      spec.layers.push_back(layer);
    }
    if (desc->event_shm_name != nullptr) spec.events.host_shm_name = desc->event_shm_name;
    spec.events.count = desc->event_count;
    if (desc->cuda_slots != nullptr) {
#if defined(HIQ_CLIENT_HAVE_CUDA)
      spec.events = desc->cuda_slots->slots.Spec();
#else
      return Fail(StatusCode::kUnimplemented,
                  "cuda_slots: this libhiqcache was built without CUDA");
#endif
    }
    return Register(client, spec, pending_if_unavailable != 0, out, info);
  });
}

int hiq_release_pool(hiq_client* client, hiq_pool pool) {
  return Guarded([&]() -> int {
    HIQ_C_REQUIRE(client != nullptr, "hiq_release_pool: client is NULL");
    return Result(client->client->ReleasePool(hiqcache::PoolHandle{pool}));
  });
}

int hiq_pool_info_get(hiq_client* client, hiq_pool pool, hiq_pool_info* info) {
  return Guarded([&]() -> int {
    HIQ_C_REQUIRE(client != nullptr && info != nullptr, "hiq_pool_info_get: NULL argument");
    auto registered = client->client->PoolInfo(hiqcache::PoolHandle{pool});
    if (!registered.ok()) return Fail(registered.status());
    FillInfo(*registered, info);
    return HIQ_OK;
  });
}

// --- HOST pools ----------------------------------------------------------------------------

namespace {

static_assert(HIQ_HUGE_PAGES_AUTO == static_cast<int>(hiqcache::HugePages::kAuto) &&
              HIQ_HUGE_PAGES_REQUIRE == static_cast<int>(hiqcache::HugePages::kRequire));
static_assert(HIQ_BACKING_TRANSPARENT ==
                  static_cast<int>(hiqcache::HugePageBacking::kTransparent) &&
              HIQ_BACKING_HUGETLB == static_cast<int>(hiqcache::HugePageBacking::kHugetlb));

int CreateHostPool(const hiq_geometry* geometry, uint32_t layout, uint32_t num_rows,
                   uint32_t page_rows, uint32_t event_count, bool memfd,
                   hiqcache::HugePages huge_pages, hiq_host_pool** out) {
  HIQ_C_REQUIRE(geometry != nullptr && out != nullptr, "hiq_host_pool_create: NULL argument");
  *out = nullptr;
  HIQ_C_REQUIRE(layout <= HIQ_LAYOUT_VLLM_PACKED_KV, "layout: unknown value");
  if (Status s = CheckEnums(*geometry, HIQ_CODEC_INT8_PER_HEAD); !s.ok()) return Fail(s);
  const std::string kv_name =
      memfd ? std::string(hiqcache::HostShm::kMemfdPrefix) + "kv" : std::string();
  auto kv =
      hiqcache::HostKvPool::Create(ToGeometry(*geometry), static_cast<hiqcache::KvLayout>(layout),
                                   num_rows, page_rows, kv_name, huge_pages);
  if (!kv.ok()) return Fail(kv.status());
  auto pool = std::make_unique<hiq_host_pool>();
  pool->kv = std::move(kv).value();
  if (event_count > 0) {
    const std::string ev_name =
        memfd ? std::string(hiqcache::HostShm::kMemfdPrefix) + "ev" : std::string();
    auto events = hiqcache::HostEventPool::Create(event_count, ev_name);
    if (!events.ok()) return Fail(events.status());
    pool->events = std::move(events).value();
  }
  *out = pool.release();
  return HIQ_OK;
}

}  // namespace

int hiq_host_pool_create(const hiq_geometry* geometry, uint32_t layout, uint32_t num_rows,
                         uint32_t page_rows, uint32_t event_count, hiq_host_pool** out) {
  return Guarded([&]() -> int {
    return CreateHostPool(geometry, layout, num_rows, page_rows, event_count, /*memfd=*/false,
                          hiqcache::HugePages::kOff, out);
  });
}

int hiq_host_pool_create_memfd(const hiq_geometry* geometry, uint32_t layout, uint32_t num_rows,
                               uint32_t page_rows, uint32_t event_count, uint32_t huge_pages,
                               hiq_host_pool** out) {
  return Guarded([&]() -> int {
    if (out != nullptr) *out = nullptr;
    HIQ_C_REQUIRE(huge_pages <= HIQ_HUGE_PAGES_REQUIRE,
                  "huge_pages: unknown value (HIQ_HUGE_PAGES_OFF, _AUTO or _REQUIRE)");
    return CreateHostPool(geometry, layout, num_rows, page_rows, event_count, /*memfd=*/true,
                          static_cast<hiqcache::HugePages>(huge_pages), out);
  });
}

uint32_t hiq_host_pool_huge_pages(const hiq_host_pool* pool) {
  return pool == nullptr ? HIQ_BACKING_NONE
                         : static_cast<uint32_t>(pool->kv.shm().huge_page_backing());
}

void hiq_host_pool_destroy(hiq_host_pool* pool) {
  try {
    delete pool;
  } catch (...) {
  }
}

void* hiq_host_pool_data(const hiq_host_pool* pool, uint64_t* size_bytes) {
  if (pool == nullptr) return nullptr;
  if (size_bytes != nullptr) *size_bytes = pool->kv.shm().size();
  return pool->kv.shm().data();
}

uint32_t hiq_host_pool_num_rows(const hiq_host_pool* pool) {
  return pool == nullptr ? 0 : pool->kv.num_rows();
}

uint64_t hiq_host_pool_head_offset(const hiq_host_pool* pool, uint32_t layer, uint32_t plane,
                                   uint32_t row, uint32_t head) {
  if (pool == nullptr) return UINT64_MAX;
  const hiqcache::Geometry& g = pool->kv.geometry();
  if (layer >= g.num_layers || plane >= g.Planes() || row >= pool->kv.num_rows() ||
      head >= g.num_kv_heads) {
    return UINT64_MAX;
  }
  const hiqcache::LayerView& view = pool->kv.layers()[layer];
  const hiqcache::TensorView& t = plane == 0 ? view.k : *view.v;
  return t.HeadOffset(row, head, g.HeadBytes());
}

int hiq_host_pool_wait(const hiq_host_pool* pool, uint32_t slot, uint64_t ticket,
                       int64_t timeout_ms) {
  return Guarded([&]() -> int {
    HIQ_C_REQUIRE(pool != nullptr, "hiq_host_pool_wait: pool is NULL");
    if (!pool->events) return Fail(StatusCode::kFailedPrecondition, "the pool has no events");
    return Result(pool->events->Wait(slot, ticket,
                                     std::chrono::milliseconds(std::max<int64_t>(0, timeout_ms))));
  });
}

uint64_t hiq_host_pool_event_read(const hiq_host_pool* pool, uint32_t slot) {
  if (pool == nullptr || !pool->events || slot >= pool->events->count()) return 0;
  return pool->events->Read(slot);
}

void hiq_host_pool_event_store(const hiq_host_pool* pool, uint32_t slot, uint64_t v) {
  if (pool == nullptr || !pool->events || slot >= pool->events->count()) return;
  pool->events->Store(slot, v);
}

int hiq_register_host_pool(hiq_client* client, const char* model, const char* tenant,
                           uint32_t block_tokens, uint32_t codec, const hiq_host_pool* pool,
                           hiq_pool* out, hiq_pool_info* info) {
  return Guarded([&]() -> int {
    HIQ_C_REQUIRE(client != nullptr && model != nullptr && pool != nullptr && out != nullptr,
                  "hiq_register_host_pool: NULL argument");
    *out = 0;
    HIQ_C_REQUIRE(codec <= HIQ_CODEC_INT4_ALLOT, "codec: unknown value");
    hiqcache::PoolSpec spec = hiqcache::MakeHostPoolSpec(
        model, pool->kv, block_tokens, pool->events ? &*pool->events : nullptr, ToCodec(codec));
    if (tenant != nullptr) spec.tenant = tenant;
    return Register(client, spec, false, out, info);
  });
}

// --- data ----------------------------------------------------------------------------------

int hiq_lookup(hiq_client* client, hiq_pool pool, const uint8_t* keys, uint32_t num_keys,
               uint32_t* prefix_blocks) {
  return Guarded([&]() -> int {
    if (prefix_blocks != nullptr) *prefix_blocks = 0;
    HIQ_C_REQUIRE(client != nullptr, "hiq_lookup: client is NULL");
    HIQ_C_REQUIRE(num_keys == 0 || keys != nullptr, "keys: NULL");
    const std::vector<BlockKey> k = Keys(keys, num_keys);
    hiqcache::LookupResult r = client->client->Lookup(hiqcache::PoolHandle{pool}, k);
    if (prefix_blocks != nullptr) *prefix_blocks = r.prefix_blocks;
    return Result(r.status);
  });
}

int hiq_backup(hiq_client* client, hiq_pool pool, const uint8_t* keys, uint32_t num_keys,
               const uint32_t* rows, uint64_t num_rows, int32_t wait_event, uint64_t wait_value,
               int32_t done_event, int sync, uint8_t* block_status, uint64_t* ticket) {
  return Guarded([&]() -> int {
    if (block_status != nullptr) std::memset(block_status, HIQ_BLOCK_NOT_STORED, num_keys);
    if (ticket != nullptr) *ticket = 0;
    HIQ_C_REQUIRE(client != nullptr, "hiq_backup: client is NULL");
    HIQ_C_REQUIRE(num_keys == 0 || keys != nullptr, "keys: NULL");
    HIQ_C_REQUIRE(num_rows == 0 || rows != nullptr, "rows: NULL");
    const std::vector<BlockKey> k = Keys(keys, num_keys);
    hiqcache::BackupOptions o;
    o.wait_event = wait_event;
    o.wait_value = wait_value;
    o.done_event = done_event;
    o.sync = sync != 0;
    hiqcache::BackupResult r = client->client->Backup(hiqcache::PoolHandle{pool}, k,
                                                      std::span<const uint32_t>(rows, num_rows), o);
    if (block_status != nullptr) {
      for (size_t i = 0; i < r.blocks.size() && i < num_keys; ++i) {
        block_status[i] = static_cast<uint8_t>(r.blocks[i]);
      }
    }
    if (ticket != nullptr) *ticket = r.ticket;
    return Result(r.status);
  });
}

int hiq_restore(hiq_client* client, hiq_pool pool, const uint8_t* keys, uint32_t num_keys,
                const uint32_t* rows, uint64_t num_rows, int32_t wait_event, uint64_t wait_value,
                int32_t layer_event_base, int32_t done_event, int sync, uint32_t* restored_blocks,
                uint64_t* ticket) {
  return Guarded([&]() -> int {
    if (restored_blocks != nullptr) *restored_blocks = 0;
    if (ticket != nullptr) *ticket = 0;
    HIQ_C_REQUIRE(client != nullptr, "hiq_restore: client is NULL");
    HIQ_C_REQUIRE(num_keys == 0 || keys != nullptr, "keys: NULL");
    HIQ_C_REQUIRE(num_rows == 0 || rows != nullptr, "rows: NULL");
    const std::vector<BlockKey> k = Keys(keys, num_keys);
    hiqcache::RestoreOptions o;
    o.wait_event = wait_event;
    o.wait_value = wait_value;
    o.layer_event_base = layer_event_base;
    o.done_event = done_event;
    o.sync = sync != 0;
    hiqcache::RestoreResult r = client->client->Restore(
        hiqcache::PoolHandle{pool}, k, std::span<const uint32_t>(rows, num_rows), o);
    if (restored_blocks != nullptr) *restored_blocks = r.restored_blocks;
    if (ticket != nullptr) *ticket = r.ticket;
    return Result(r.status);
  });
}

int hiq_evict(hiq_client* client, hiq_pool pool, const uint8_t* keys, uint32_t num_keys,
              uint32_t* evicted) {
  return Guarded([&]() -> int {
    if (evicted != nullptr) *evicted = 0;
    HIQ_C_REQUIRE(client != nullptr, "hiq_evict: client is NULL");
    HIQ_C_REQUIRE(num_keys == 0 || keys != nullptr, "keys: NULL");
    const std::vector<BlockKey> k = Keys(keys, num_keys);
    auto r = client->client->Evict(hiqcache::PoolHandle{pool}, k);
    if (!r.ok()) return Fail(r.status());
    if (evicted != nullptr) *evicted = *r;
    return HIQ_OK;
  });
}

int hiq_get_stats(hiq_client* client, hiq_stats* stats) {
  return Guarded([&]() -> int {
    HIQ_C_REQUIRE(client != nullptr && stats != nullptr, "hiq_get_stats: NULL argument");
    std::memset(stats, 0, sizeof(*stats));
    auto s = client->client->GetStats();
    if (!s.ok()) return Fail(s.status());
    stats->pool_bytes = s->pool_bytes;
    stats->used_bytes = s->used_bytes;
    stats->capacity_bytes = s->capacity_bytes;
    stats->blocks = s->blocks;
    stats->clients = s->clients;
    stats->uptime_seconds = s->uptime_seconds;
    stats->num_namespaces = static_cast<uint32_t>(s->namespaces.size());
    stats->num_pools = static_cast<uint32_t>(s->pools.size());
    const size_t n = std::min(s->device.size(), sizeof(stats->device) - 1);
    std::memcpy(stats->device, s->device.data(), n);
    return HIQ_OK;
  });
}

int hiq_get_l3_stats(hiq_client* client, hiq_l3_stats* stats) {
  return Guarded([&]() -> int {
    HIQ_C_REQUIRE(client != nullptr && stats != nullptr, "hiq_get_l3_stats: NULL argument");
    std::memset(stats, 0, sizeof(*stats));
    // One namespace page is enough: only the daemon-wide l3 part is read.
    auto s = client->client->GetStats(/*namespaces_offset=*/0, /*namespaces_limit=*/1);
    if (!s.ok()) return Fail(s.status());
    const hiqcache::L3Stats& l = s->l3;
    if (!l.enabled) return HIQ_OK;
    stats->enabled = 1;
    stats->on_evict = l.write_policy == "on_evict" ? 1 : 0;
    stats->lookup_hits = l.lookup_hits;
    stats->lookup_misses = l.lookup_misses;
    stats->lookup_errors = l.lookup_errors;
    stats->fetches = l.fetches;
    stats->fetched_blocks = l.fetched_blocks;
    stats->fetch_errors = l.fetch_errors;
    stats->corrupt_values = l.corrupt_values;
    stats->promoted_blocks = l.promoted_blocks;
    stats->writes = l.writes;
    stats->write_errors = l.write_errors;
    stats->dropped_writes = l.dropped_writes;
    stats->skipped_writes = l.skipped_writes;
    stats->spilled_blocks = l.spilled_blocks;
    stats->write_queue_bytes = l.write_queue_bytes;
    stats->write_queue_blocks = l.write_queue_blocks;
    stats->bytes_in = l.bytes_in;
    stats->bytes_out = l.bytes_out;
    stats->fetch_latency_samples = l.fetch_latency_samples;
    stats->fetch_p50_us = l.fetch_p50_us;
    stats->fetch_p99_us = l.fetch_p99_us;
    stats->budget_bytes = l.budget_bytes;
    stats->budget_used_bytes = l.budget_used_bytes;
    stats->budget_deletes = l.budget_deletes;
    return HIQ_OK;
  });
}

int hiq_compute_block_keys(const uint32_t* tokens, uint64_t num_tokens, uint32_t block_tokens,
                           const char* salt, uint64_t salt_len, uint8_t* keys_out,
                           uint64_t max_keys, uint64_t* num_keys) {
  return Guarded([&]() -> int {
    if (num_keys != nullptr) *num_keys = 0;
    HIQ_C_REQUIRE(num_tokens == 0 || tokens != nullptr, "tokens: NULL");
    HIQ_C_REQUIRE(salt_len == 0 || salt != nullptr, "salt: NULL");
    HIQ_C_REQUIRE(max_keys == 0 || keys_out != nullptr, "keys_out: NULL");
    HIQ_C_REQUIRE(block_tokens > 0, "block_tokens: must be > 0");
    const std::vector<BlockKey> keys =
        hiqcache::ComputeBlockKeys(std::span<const uint32_t>(tokens, num_tokens), block_tokens,
                                   std::string_view(salt == nullptr ? "" : salt, salt_len));
    const size_t n = std::min<uint64_t>(keys.size(), max_keys);
    for (size_t i = 0; i < n; ++i) std::memcpy(keys_out + i * 16, keys[i].data(), 16);
    if (num_keys != nullptr) *num_keys = keys.size();
    return HIQ_OK;
  });
}

// --- CUDA ----------------------------------------------------------------------------------

#if defined(HIQ_CLIENT_HAVE_CUDA)

int hiq_cuda_available(void) {
  return Guarded([&]() -> int {
    std::string why;
    if (hiqcache::CudaClientAvailable(&why)) return HIQ_OK;
    return Fail(StatusCode::kFailedPrecondition, why);
  });
}

int hiq_cuda_device_uuid(int device, char* out, uint64_t out_len) {
  return Guarded([&]() -> int {
    HIQ_C_REQUIRE(out != nullptr && out_len > 0, "hiq_cuda_device_uuid: out is NULL");
    out[0] = '\0';
    auto uuid = hiqcache::CudaDeviceUuid(device);
    if (!uuid.ok()) return Fail(uuid.status());
    HIQ_C_REQUIRE(uuid->size() < out_len, "hiq_cuda_device_uuid: out_len too small (need 41)");
    std::memcpy(out, uuid->c_str(), uuid->size() + 1);
    return HIQ_OK;
  });
}

int hiq_cuda_export_pointer(const void* device_ptr, uint8_t* handle_out, uint64_t* offset_bytes,
                            uint64_t* allocation_bytes, int* device) {
  return Guarded([&]() -> int {
    HIQ_C_REQUIRE(device_ptr != nullptr && handle_out != nullptr,
                  "hiq_cuda_export_pointer: NULL argument");
    const hiqcache::CudaMemoryInfo& memory = hiqcache::CudaRuntimeMemory();
    auto a = memory.Find(reinterpret_cast<uintptr_t>(device_ptr));
    if (!a.ok()) return Fail(a.status());
    auto h = memory.ExportBase(*a);
    if (!h.ok()) return Fail(h.status());
    std::memcpy(handle_out, h->bytes.data(), h->bytes.size());
    if (offset_bytes != nullptr) *offset_bytes = reinterpret_cast<uintptr_t>(device_ptr) - a->base;
    if (allocation_bytes != nullptr) *allocation_bytes = a->size;
    if (device != nullptr) *device = a->device;
    return HIQ_OK;
  });
}

int hiq_cuda_slots_create(int device, uint32_t count, hiq_cuda_slots** out) {
  return Guarded([&]() -> int {
    HIQ_C_REQUIRE(out != nullptr, "hiq_cuda_slots_create: out is NULL");
    *out = nullptr;
    auto slots = hiqcache::CudaTicketSlots::Create(device, count);
    if (!slots.ok()) return Fail(slots.status());
    *out = new hiq_cuda_slots{std::move(slots).value()};
    return HIQ_OK;
  });
}

void hiq_cuda_slots_destroy(hiq_cuda_slots* slots) {
  try {
    delete slots;
  } catch (...) {
  }
}

uint32_t hiq_cuda_slots_count(const hiq_cuda_slots* slots) {
  return slots == nullptr ? 0 : slots->slots.count();
}

uint64_t hiq_cuda_slots_read(const hiq_cuda_slots* slots, uint32_t slot) {
  if (slots == nullptr || slot >= slots->slots.count()) return 0;
  return slots->slots.Read(slot);
}

void hiq_cuda_slots_store(const hiq_cuda_slots* slots, uint32_t slot, uint64_t value) {
  if (slots == nullptr || slot >= slots->slots.count()) return;
  slots->slots.Store(slot, value);
}

int hiq_cuda_slots_wait(const hiq_cuda_slots* slots, uint32_t slot, uint64_t ticket,
                        int64_t timeout_ms) {
  return Guarded([&]() -> int {
    HIQ_C_REQUIRE(slots != nullptr, "hiq_cuda_slots_wait: slots is NULL");
    return Result(slots->slots.Wait(slot, ticket,
                                    std::chrono::milliseconds(std::max<int64_t>(0, timeout_ms))));
  });
}

int hiq_cuda_slots_stream_wait(const hiq_cuda_slots* slots, uint32_t slot, uint64_t ticket,
                               void* stream) {
  return Guarded([&]() -> int {
    HIQ_C_REQUIRE(slots != nullptr, "hiq_cuda_slots_stream_wait: slots is NULL");
    return Result(slots->slots.StreamWait(static_cast<CUstream_st*>(stream), slot, ticket));
  });
}

int hiq_cuda_slots_stream_write(const hiq_cuda_slots* slots, uint32_t slot, uint64_t value,
                                void* stream) {
  return Guarded([&]() -> int {
    HIQ_C_REQUIRE(slots != nullptr, "hiq_cuda_slots_stream_write: slots is NULL");
    return Result(slots->slots.StreamWrite(static_cast<CUstream_st*>(stream), slot, value));
  });
}

uint64_t hiq_cuda_slots_device_address(const hiq_cuda_slots* slots, uint32_t slot) {
  if (slots == nullptr || slot >= slots->slots.count()) return 0;
  return slots->slots.device_address(slot);
}

#else  // !HIQ_CLIENT_HAVE_CUDA

static int NoCuda() {
  return Fail(StatusCode::kUnimplemented, "this libhiqcache was built without CUDA");
}

int hiq_cuda_available(void) { return NoCuda(); }
int hiq_cuda_device_uuid(int, char* out, uint64_t out_len) {
  if (out != nullptr && out_len > 0) out[0] = '\0';
  return NoCuda();
}
int hiq_cuda_export_pointer(const void*, uint8_t*, uint64_t*, uint64_t*, int*) { return NoCuda(); }
int hiq_cuda_slots_create(int, uint32_t, hiq_cuda_slots** out) {
  if (out != nullptr) *out = nullptr;
  return NoCuda();
}
void hiq_cuda_slots_destroy(hiq_cuda_slots*) {}
uint32_t hiq_cuda_slots_count(const hiq_cuda_slots*) { return 0; }
uint64_t hiq_cuda_slots_read(const hiq_cuda_slots*, uint32_t) { return 0; }
void hiq_cuda_slots_store(const hiq_cuda_slots*, uint32_t, uint64_t) {}
int hiq_cuda_slots_wait(const hiq_cuda_slots*, uint32_t, uint64_t, int64_t) { return NoCuda(); }
int hiq_cuda_slots_stream_wait(const hiq_cuda_slots*, uint32_t, uint64_t, void*) {
  return NoCuda();
}
int hiq_cuda_slots_stream_write(const hiq_cuda_slots*, uint32_t, uint64_t, void*) {
  return NoCuda();
}
uint64_t hiq_cuda_slots_device_address(const hiq_cuda_slots*, uint32_t) { return 0; }

#endif  // HIQ_CLIENT_HAVE_CUDA

}  // extern "C"
