/* hiqcache C ABI: the client library (hiqcache/client.h) behind opaque handles and flat structs,
 * so that engines in other languages (a Python engine through ctypes or cffi) can use hiqcached
 * today. Built as the shared library libhiqcache.so (CMake target hiqcache_c), which exports
 * the hiq_* symbols below and nothing else.
 *
 * Conventions
 *   - Every int-returning function returns a status code with the gRPC numbering (HIQ_OK = 0,
 *     HIQ_INVALID_ARGUMENT = 3, HIQ_FAILED_PRECONDITION = 9, HIQ_UNAVAILABLE = 14, ...). After a
 *     non-zero return, hiq_last_error() holds the message (it names the offending field).
 *   - The client is fail-open like the C++ one: with the daemon down, lookups report 0 blocks,
 *     backups report every block HIQ_BLOCK_NOT_STORED, restores report 0 blocks, each with the
 *     failure's code returned. Nothing aborts or throws across this boundary.
 *   - Keys are 16-byte block ids, passed as num_keys * 16 contiguous bytes.
 *   - Strings are NUL-terminated UTF-8; IPC handles are 64 raw bytes each.
 *   - Out-parameters may be NULL where noted.
 *
 * Thread-safety: a hiq_client may be used from any number of threads at once; hiq_last_error is
 * per thread. hiq_host_pool and hiq_cuda_slots objects may be used concurrently (waits, reads,
 * stores, stream operations) but must not be destroyed while in use.
 *
 * Completion uses ticket slots for both device kinds (docs/design.md "Completion: ticket slots";
 * the rules are in hiqcache/cuda_export.h): slot i is a uint64 at byte 64*i, bits 0..62 a ticket,
 * bit 63 the failed bit. A wait released by a value with the failed bit reports HIQ_ABORTED: treat
 * those rows as a miss. When the daemon dies, the library stores the failed bit into the slots of
 * the requests it answered, so no waiter hangs (hiqcache/client.h).
 *
 * CUDA: the hiq_cuda_* functions work when libhiqcache.so was built with CUDA (the CUDA runtime
 * is linked statically into it, so it needs only the NVIDIA driver at run time); otherwise they
 * return HIQ_UNIMPLEMENTED. hiq_register_pool itself needs no CUDA: handles are plain bytes, e.g.
 * from PyTorch (storage._share_cuda_()) or from hiq_cuda_export_pointer.
 */
#ifndef HIQCACHE_HIQCACHE_C_H_
#define HIQCACHE_HIQCACHE_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(HIQ_C_BUILDING)
#define HIQ_C_API __attribute__((visibility("default")))
#else
#define HIQ_C_API
#endif

/* Bumped whenever a struct below changes layout or a function changes meaning. */
#define HIQ_C_ABI_VERSION 4

enum hiq_status_code {
  HIQ_OK = 0,
  HIQ_CANCELLED = 1,
  HIQ_UNKNOWN = 2,
  HIQ_INVALID_ARGUMENT = 3,
  HIQ_DEADLINE_EXCEEDED = 4,
  HIQ_NOT_FOUND = 5,
  HIQ_ALREADY_EXISTS = 6,
  HIQ_PERMISSION_DENIED = 7,
  HIQ_RESOURCE_EXHAUSTED = 8,
  HIQ_FAILED_PRECONDITION = 9,
  HIQ_ABORTED = 10,
  HIQ_OUT_OF_RANGE = 11,
  HIQ_UNIMPLEMENTED = 12,
  HIQ_INTERNAL = 13,
  HIQ_UNAVAILABLE = 14,
  HIQ_DATA_LOSS = 15
};

enum hiq_dtype { HIQ_DTYPE_BF16 = 0, HIQ_DTYPE_FP16 = 1 };
enum hiq_attention { HIQ_ATTENTION_MHA = 0, HIQ_ATTENTION_MLA = 1 };
enum hiq_codec {
  HIQ_CODEC_INT8_PER_HEAD = 0,
  HIQ_CODEC_RAW = 1,
  HIQ_CODEC_FP8_E4M3_PER_HEAD = 2, /* FP8 E4M3 codes + BF16 scales, INT8's size */
  HIQ_CODEC_INT4_G32_PER_HEAD = 3, /* int4 codes + a BF16 scale per 32 elements (head_dim % 32) */
  HIQ_CODEC_INT4_KIVI = 4, /* int4: K per channel over a block, V as INT4_G32 (head_dim % 32) */
  /* int4 after a Hadamard rotation, each block's first token INT8 (head_dim % 32) */
  HIQ_CODEC_INT4_HADAMARD = 5,
  /* keys at 2-8 bits per channel by range (5.25 on average), values Hadamard-rotated at 5 bits,
   * each block's first token INT8 (head_dim % 32; not MLA; HOST pools only). The C ABI carries
   * no rope: keys are not turned (geometry.rope.theta 0). */
  HIQ_CODEC_INT5_ALLOT = 6,
  /* INT5 allot's format with values at 6 bits (its keys at 5.25 bits on average) */
  HIQ_CODEC_INT6_ALLOT = 7,
  /* INT5 allot's format with keys at 4.4375 bits on average and values at 4 bits */
  HIQ_CODEC_INT4_ALLOT = 8
};
enum hiq_device_kind { HIQ_DEVICE_HOST = 0, HIQ_DEVICE_CUDA = 1 };
enum hiq_kv_layout {
  HIQ_LAYOUT_SGLANG = 0,
  HIQ_LAYOUT_VLLM_PAGED = 1,
  HIQ_LAYOUT_VLLM_PACKED_KV = 2
};
/* hiq_host_pool_create_memfd: whether the KV memfd asks for huge pages (hiqcache::HugePages). */
enum hiq_huge_pages {
  HIQ_HUGE_PAGES_OFF = 0,
  HIQ_HUGE_PAGES_AUTO = 1,   /* hugetlb, else transparent huge pages, else 4 KiB pages */
  HIQ_HUGE_PAGES_REQUIRE = 2 /* as AUTO, but HIQ_FAILED_PRECONDITION when neither is there */
};
/* What backs a host pool's KV pages (hiqcache::HugePageBacking). */
enum hiq_huge_page_backing {
  HIQ_BACKING_NONE = 0,        /* 4 KiB pages */
  HIQ_BACKING_TRANSPARENT = 1, /* MADV_HUGEPAGE, honoured by the kernel's shmem_enabled */
  HIQ_BACKING_HUGETLB = 2      /* MFD_HUGETLB: the hugetlb pool's pages */
};
enum hiq_block_status {
  HIQ_BLOCK_STORED = 0,
  HIQ_BLOCK_ALREADY_PRESENT = 1,
  HIQ_BLOCK_REJECTED = 2,
  HIQ_BLOCK_NOT_STORED = 3 /* the call failed */
};

#define HIQ_KEY_BYTES 16
#define HIQ_IPC_HANDLE_BYTES 64
#define HIQ_HOST_EVENT_SLOT_BYTES 64

typedef struct hiq_client hiq_client;         /* a connection to hiqcached */
typedef struct hiq_host_pool hiq_host_pool;   /* KV buffers + event slots in shm */
typedef struct hiq_cuda_slots hiq_cuda_slots; /* ticket slots for a CUDA pool */
typedef uint64_t hiq_pool;                    /* a registered pool; 0 is never valid */

typedef struct hiq_geometry {
  uint32_t num_layers;
  uint32_t num_kv_heads; /* heads local to this rank */
  uint32_t head_dim;
  uint32_t dtype;     /* enum hiq_dtype */
  uint32_t attention; /* enum hiq_attention */
  uint32_t tp_rank;
  uint32_t tp_size; /* 0 is taken as 1 */
} hiq_geometry;

/* One shared memory object. HOST: host_shm_name set. CUDA: cuda_ipc_handle points at the
 * HIQ_IPC_HANDLE_BYTES bytes of the allocation base's cudaIpcMemHandle_t (cuda_ipc_handle_len
 * says how many bytes there are; anything but 64 is rejected by the daemon). */
typedef struct hiq_buffer {
  const char* host_shm_name;
  const uint8_t* cuda_ipc_handle;
  uint32_t cuda_ipc_handle_len;
  uint32_t reserved;
  uint64_t size_bytes;
} hiq_buffer;

/* docs/design.md TensorView: head h of row r at base(buffer) + offset_bytes + p * page_stride_bytes
 * + slot(t) + h * head_stride_bytes (p, t = r / page_rows, r % page_rows), slot(t) =
 * t * row_stride_bytes, or with row_group > 0 (t / row_group) * row_group_stride_bytes +
 * (t % row_group) * row_stride_bytes. A head is head_dim contiguous elements, or with dim_run > 0
 * (a divisor of head_dim) head_dim / dim_run runs of dim_run elements, run j at
 * j * dim_run_stride_bytes from the head's start, element i of a run at i * dim_stride_bytes from
 * the run's start (0 = 2 bytes: contiguous). row_group, dim_run and dim_stride_bytes (split views,
 * for an engine's tiles) are for HOST pools; 0 = not split. The daemon checks every field and
 * names the bad one. */
typedef struct hiq_tensor_view {
  uint32_t buffer;
  uint32_t num_rows;
  uint64_t offset_bytes;
  uint64_t row_stride_bytes;
  uint64_t head_stride_bytes; /* 0 = head_dim elements */
  uint64_t page_rows;         /* 0 = not paged */
  uint64_t page_stride_bytes;
  uint32_t row_group; /* 0 = slots not grouped */
  uint32_t dim_run;   /* 0 = a head's elements contiguous */
  uint64_t row_group_stride_bytes;
  uint64_t dim_run_stride_bytes;
  uint64_t dim_stride_bytes; /* 0 = a run's elements contiguous */
} hiq_tensor_view;

typedef struct hiq_layer_view {
  hiq_tensor_view k;
  hiq_tensor_view v; /* ignored unless has_v */
  uint32_t has_v;    /* 0 for MLA */
  uint32_t reserved;
} hiq_layer_view;

/* Everything RegisterPool sends (the client's pid is added). */
typedef struct hiq_pool_desc {
  const char* model;  /* model name + revision */
  const char* tenant; /* may be NULL */
  hiq_geometry geometry;
  uint32_t block_tokens;
  uint32_t codec;       /* enum hiq_codec */
  uint32_t device_kind; /* enum hiq_device_kind */
  uint32_t num_buffers;
  const char* cuda_device_uuid; /* CUDA: "GPU-..." (hiq_cuda_device_uuid); else NULL */
  const hiq_buffer* buffers;
  const hiq_layer_view* layers; /* geometry.num_layers entries */
  /* Ticket slots: a shm object of event_count 64-byte slots (NULL/0 = none), or cuda_slots. */
  const char* event_shm_name;
  uint32_t event_count;
  uint32_t reserved_events; /* 0 */
  /* Ticket slots from hiq_cuda_slots_create (NULL = none or event_shm_name); with it,
   * event_shm_name must be NULL and event_count 0. Keep it alive while the pool is registered. */
  const hiq_cuda_slots* cuda_slots;
} hiq_pool_desc;

/* The daemon's answer to a registration. */
typedef struct hiq_pool_info {
  uint64_t pool_id; /* the daemon's id (changes if the client re-registers) */
  uint64_t encoded_bytes_per_token;
  uint64_t block_bytes;
  uint64_t capacity_tokens;
  char namespace_id[72]; /* NUL-terminated */
} hiq_pool_info;

typedef struct hiq_stats {
  uint64_t pool_bytes;
  uint64_t used_bytes;
  uint64_t capacity_bytes;
  uint64_t blocks;
  uint64_t clients;
  uint64_t uptime_seconds;
  uint32_t num_namespaces;
  uint32_t num_pools;
  char device[16]; /* "host" or "cuda" */
} hiq_stats;

/* What the daemon's L3 store (Redis Cluster) did since start; enabled = 0 (and every figure 0)
 * when it has none. An L3 error or deadline is a miss, counted in the *_errors fields. */
typedef struct hiq_l3_stats {
  uint32_t enabled;
  uint32_t on_evict;      /* the write policy: 1 = on_evict, 0 = write_through */
  uint64_t lookup_hits;   /* blocks Lookup found in L3 after the pool's leading run */
  uint64_t lookup_misses; /* keys Lookup asked L3 for after the run L3 held */
  uint64_t lookup_errors;
  uint64_t fetches;        /* restores that fetched from L3 */
  uint64_t fetched_blocks; /* values fetched and verified */
  uint64_t fetch_errors;
  uint64_t corrupt_values; /* fetched values that failed to verify: dropped, a miss */
  uint64_t promoted_blocks;
  uint64_t writes;
  uint64_t write_errors;
  uint64_t dropped_writes; /* not queued: the write queue was full (or over the budget) */
  uint64_t skipped_writes; /* queued, but the block left the pool before its turn */
  uint64_t spilled_blocks; /* on_evict: evicted blocks copied into the write queue */
  uint64_t write_queue_bytes;
  uint64_t write_queue_blocks;
  uint64_t bytes_in;              /* value bytes fetched */
  uint64_t bytes_out;             /* value bytes written */
  uint64_t fetch_latency_samples; /* the last fetches (at most 1024) the percentiles cover */
  uint64_t fetch_p50_us;
  uint64_t fetch_p99_us;
  uint64_t budget_bytes;      /* l3_budget_bytes; 0 = none */
  uint64_t budget_used_bytes; /* value bytes this daemon's ledger counts in L3 now */
  uint64_t budget_deletes;    /* blocks deleted from L3 to stay within the budget */
} hiq_l3_stats;

/* --- library ---------------------------------------------------------------------------- */

/* HIQ_C_ABI_VERSION of the library (also the N of its soname libhiqcache.so.N). */
HIQ_C_API int hiq_abi_version(void);
/* The hiqcache release the library belongs to, "X.Y.Z" (the version `hiqcached --version`
 * reports, and pkg-config's and the CMake package's). Static storage; never NULL. */
HIQ_C_API const char* hiq_version(void);
/* The message of the last failed call on this thread ("" when none). Valid until the next
 * hiq_* call on this thread. */
HIQ_C_API const char* hiq_last_error(void);

/* --- connection ------------------------------------------------------------------------- */

/* target: "unix:///path.sock", "/path.sock", "host:port", or NULL/"" for the default socket.
 * timeout_ms: deadline of each call (<= 0: 2000). Does not wait for the daemon (fail-open). */
HIQ_C_API int hiq_connect(const char* target, int64_t timeout_ms, hiq_client** out);
HIQ_C_API void hiq_close(hiq_client* client);

/* --- registration ----------------------------------------------------------------------- */

/* pending_if_unavailable != 0: with the daemon down, return a handle anyway that registers on
 * first use once it is back. info may be NULL. */
HIQ_C_API int hiq_register_pool(hiq_client* client, const hiq_pool_desc* desc,
                                int pending_if_unavailable, hiq_pool* out, hiq_pool_info* info);
HIQ_C_API int hiq_release_pool(hiq_client* client, hiq_pool pool);
HIQ_C_API int hiq_pool_info_get(hiq_client* client, hiq_pool pool, hiq_pool_info* info);

/* A HOST KV pool the library creates in POSIX shared memory (HostKvPool: one object holding
 * every layer in `layout`, zero-filled, unlinked on destroy) plus event_count event slots
 * (0 = none). Paged layouts round num_rows up to whole pages of page_rows. */
HIQ_C_API int hiq_host_pool_create(const hiq_geometry* geometry, uint32_t layout, uint32_t num_rows,
                                   uint32_t page_rows, uint32_t event_count, hiq_host_pool** out);
/* The same in sealed memfds (passed to the daemon by fd when registered), the KV memfd on huge
 * pages as huge_pages (enum hiq_huge_pages) asks: hugetlb rounds its size up to whole huge pages.
 * hiq_host_pool_huge_pages says what it got. */
HIQ_C_API int hiq_host_pool_create_memfd(const hiq_geometry* geometry, uint32_t layout,
                                         uint32_t num_rows, uint32_t page_rows,
                                         uint32_t event_count, uint32_t huge_pages,
                                         hiq_host_pool** out);
/* enum hiq_huge_page_backing of the pool's KV pages (HIQ_BACKING_NONE for NULL). */
HIQ_C_API uint32_t hiq_host_pool_huge_pages(const hiq_host_pool* pool);
HIQ_C_API void hiq_host_pool_destroy(hiq_host_pool* pool);
/* The mapped KV bytes (writable) and their size. */
HIQ_C_API void* hiq_host_pool_data(const hiq_host_pool* pool, uint64_t* size_bytes);
HIQ_C_API uint32_t hiq_host_pool_num_rows(const hiq_host_pool* pool);
/* Byte offset in hiq_host_pool_data of head_dim elements of (layer, plane 0 = K / 1 = V, row,
 * head); UINT64_MAX for an index out of range. */
HIQ_C_API uint64_t hiq_host_pool_head_offset(const hiq_host_pool* pool, uint32_t layer,
                                             uint32_t plane, uint32_t row, uint32_t head);
/* Waits until event slot `slot` holds a value >= ticket. HIQ_DEADLINE_EXCEEDED after timeout. */
HIQ_C_API int hiq_host_pool_wait(const hiq_host_pool* pool, uint32_t slot, uint64_t ticket,
                                 int64_t timeout_ms);
/* Reads / stores event slot `slot` (acquire / release), e.g. to satisfy a wait_event. */
HIQ_C_API uint64_t hiq_host_pool_event_read(const hiq_host_pool* pool, uint32_t slot);
HIQ_C_API void hiq_host_pool_event_store(const hiq_host_pool* pool, uint32_t slot, uint64_t v);
/* Registers `pool` (buffers, views, events) as a HOST pool. info may be NULL. */
HIQ_C_API int hiq_register_host_pool(hiq_client* client, const char* model, const char* tenant,
                                     uint32_t block_tokens, uint32_t codec,
                                     const hiq_host_pool* pool, hiq_pool* out, hiq_pool_info* info);

/* --- data ------------------------------------------------------------------------------- */

/* prefix_blocks: the longest leading run of keys the pool's namespace holds (0 on failure). */
HIQ_C_API int hiq_lookup(hiq_client* client, hiq_pool pool, const uint8_t* keys, uint32_t num_keys,
                         uint32_t* prefix_blocks);
/* Stores num_keys blocks; block i is rows[i*block_tokens, (i+1)*block_tokens), so num_rows must
 * be num_keys * block_tokens. wait_event/done_event: -1 = none; wait_value 0 = 1 (HOST).
 * block_status (num_keys bytes, enum hiq_block_status) and ticket may be NULL. */
HIQ_C_API int hiq_backup(hiq_client* client, hiq_pool pool, const uint8_t* keys, uint32_t num_keys,
                         const uint32_t* rows, uint64_t num_rows, int32_t wait_event,
                         uint64_t wait_value, int32_t done_event, int sync, uint8_t* block_status,
                         uint64_t* ticket);
/* Writes the stored blocks into rows (laid out as for hiq_backup), stopping at the first missing
 * key. layer_event_base: event base + l is signalled once layer l is written (-1 = none).
 * restored_blocks and ticket may be NULL. */
HIQ_C_API int hiq_restore(hiq_client* client, hiq_pool pool, const uint8_t* keys, uint32_t num_keys,
                          const uint32_t* rows, uint64_t num_rows, int32_t wait_event,
                          uint64_t wait_value, int32_t layer_event_base, int32_t done_event,
                          int sync, uint32_t* restored_blocks, uint64_t* ticket);
/* Drops blocks from the pool's namespace; evicted (may be NULL) = how many were present. */
HIQ_C_API int hiq_evict(hiq_client* client, hiq_pool pool, const uint8_t* keys, uint32_t num_keys,
                        uint32_t* evicted);
HIQ_C_API int hiq_get_stats(hiq_client* client, hiq_stats* stats);
/* The L3 part of GetStats (one GetStats call; *stats is zeroed first). */
HIQ_C_API int hiq_get_l3_stats(hiq_client* client, hiq_l3_stats* stats);

/* Keys of the floor(num_tokens / block_tokens) full blocks (hiqcache/block_keys.h: chained
 * XXH3-128 with `salt`, salt_len bytes, NULL = empty). Writes min(that, max_keys) keys into
 * keys_out (16 bytes each) and the full count into *num_keys. */
HIQ_C_API int hiq_compute_block_keys(const uint32_t* tokens, uint64_t num_tokens,
                                     uint32_t block_tokens, const char* salt, uint64_t salt_len,
                                     uint8_t* keys_out, uint64_t max_keys, uint64_t* num_keys);

/* --- CUDA (HIQ_UNIMPLEMENTED when built without CUDA) ----------------------------------- */

/* HIQ_OK when a CUDA device is usable; else the reason is in hiq_last_error(). */
HIQ_C_API int hiq_cuda_available(void);
/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" of CUDA device `device` into out (>= 41 bytes). */
HIQ_C_API int hiq_cuda_device_uuid(int device, char* out, uint64_t out_len);
/* For a device pointer: the IPC handle of its allocation's base (64 bytes into handle_out), the
 * pointer's offset from that base, the allocation's size and its device. Any out but
 * handle_out may be NULL. */
HIQ_C_API int hiq_cuda_export_pointer(const void* device_ptr, uint8_t* handle_out,
                                      uint64_t* offset_bytes, uint64_t* allocation_bytes,
                                      int* device);
/* `count` zeroed ticket slots for CUDA device `device` (hiqcache::CudaTicketSlots: a sealed
 * memfd, page-locked and mapped for the GPU), for hiq_pool_desc.cuda_slots. */
HIQ_C_API int hiq_cuda_slots_create(int device, uint32_t count, hiq_cuda_slots** out);
/* Only once no stream waits on or writes its slots. */
HIQ_C_API void hiq_cuda_slots_destroy(hiq_cuda_slots* slots);
HIQ_C_API uint32_t hiq_cuda_slots_count(const hiq_cuda_slots* slots);
/* Acquire load / release store of slot `slot` from the host (0 / nothing when out of range). */
HIQ_C_API uint64_t hiq_cuda_slots_read(const hiq_cuda_slots* slots, uint32_t slot);
HIQ_C_API void hiq_cuda_slots_store(const hiq_cuda_slots* slots, uint32_t slot, uint64_t value);
/* Host wait until slot `slot` holds a ticket >= ticket: HIQ_OK, HIQ_ABORTED with the failed bit,
 * HIQ_DEADLINE_EXCEEDED after timeout_ms. */
HIQ_C_API int hiq_cuda_slots_wait(const hiq_cuda_slots* slots, uint32_t slot, uint64_t ticket,
                                  int64_t timeout_ms);
/* Work enqueued later on `stream` (a cudaStream_t; NULL = legacy default stream) waits until
 * slot `slot` holds ticket `ticket` or later, failed or not (a reply's done or layer slot). */
HIQ_C_API int hiq_cuda_slots_stream_wait(const hiq_cuda_slots* slots, uint32_t slot,
                                         uint64_t ticket, void* stream);
/* Stores `value` into slot `slot` once the work enqueued on `stream` before it has completed
 * (a request's wait_value). */
HIQ_C_API int hiq_cuda_slots_stream_write(const hiq_cuda_slots* slots, uint32_t slot,
                                          uint64_t value, void* stream);
/* Device address of slot `slot` (0 when out of range), for the engine's own kernels. */
HIQ_C_API uint64_t hiq_cuda_slots_device_address(const hiq_cuda_slots* slots, uint32_t slot);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* HIQCACHE_HIQCACHE_C_H_ */
