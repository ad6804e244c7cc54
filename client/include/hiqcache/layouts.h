// TensorViews for the KV layouts of common engines (docs/design.md TensorView).
//
//   SGLang  MHATokenToKVPool: per layer, K and V each [slots, heads, head_dim]
//   vLLM    paged:            per layer, K and V each [blocks, block_size, heads, head_dim]
//                             (FlashInfer's [blocks, 2, block_size, heads, head_dim] is the same
//                             view with page_stride_bytes = 2 * block bytes and V offset by one)
//   vLLM    packed K|V:       per layer [blocks, heads, block_size, 2 * head_dim], K in the first
//                             head_dim elements of the last dimension and V in the second
//
// A BufferRef says where the tensor starts: which PoolSpec::buffers entry and the byte offset of
// the tensor's first element from that buffer's base (for CUDA: from the allocation base that
// the IPC handle names). Pure functions; thread-safe.
#pragma once

#include <cstdint>

#include "hiqcache/pool_spec.h"

namespace hiqcache {

struct BufferRef {
  uint32_t buffer = 0;
  uint64_t offset_bytes = 0;
};

// --- SGLang: [num_slots, heads, head_dim] -------------------------------------------------------
TensorView SlotMajorView(const Geometry& g, uint32_t num_slots, BufferRef at);
// K and V views of one layer. For MLA geometry only `k` is used (the latent buffer).
LayerView SglangLayerView(const Geometry& g, uint32_t num_slots, BufferRef k, BufferRef v);
// Bytes of one [num_slots, heads, head_dim] tensor.
uint64_t SlotMajorBytes(const Geometry& g, uint32_t num_slots);

// --- vLLM paged: [num_blocks, block_size, heads, head_dim] --------------------------------------
// page_stride_bytes 0 = pages packed back to back (block_size * heads * head_dim elements).
TensorView VllmPagedView(const Geometry& g, uint32_t num_blocks, uint32_t block_size, BufferRef at,
                         uint64_t page_stride_bytes = 0);
LayerView VllmPagedLayerView(const Geometry& g, uint32_t num_blocks, uint32_t block_size,
                             BufferRef k, BufferRef v, uint64_t page_stride_bytes = 0);
// Bytes of one contiguous [num_blocks, block_size, heads, head_dim] tensor.
uint64_t VllmPagedBytes(const Geometry& g, uint32_t num_blocks, uint32_t block_size);

// --- vLLM packed K|V: [num_blocks, heads, block_size, 2 * head_dim] -----------------------------
// K at offset 0, V at head_dim elements; head_stride = block_size * 2 * head_dim elements,
// row_stride = 2 * head_dim elements, page_rows = block_size, page_stride = one block.
LayerView VllmPackedKvLayerView(const Geometry& g, uint32_t num_blocks, uint32_t block_size,
                                BufferRef kv);
// Bytes of one [num_blocks, heads, block_size, 2 * head_dim] tensor.
uint64_t VllmPackedKvBytes(const Geometry& g, uint32_t num_blocks, uint32_t block_size);

}  // namespace hiqcache
