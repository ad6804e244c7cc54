#include "hiqcache/layouts.h"

namespace hiqcache {

TensorView SlotMajorView(const Geometry& g, uint32_t num_slots, BufferRef at) {
  TensorView v;
  v.buffer = at.buffer;
  v.offset_bytes = at.offset_bytes;
  v.row_stride_bytes = g.RowBytes();
  v.num_rows = num_slots;
  v.head_stride_bytes = g.HeadBytes();
  return v;
}

LayerView SglangLayerView(const Geometry& g, uint32_t num_slots, BufferRef k, BufferRef v) {
  LayerView layer;
  layer.k = SlotMajorView(g, num_slots, k);
  if (g.attention != Attention::kMLA) layer.v = SlotMajorView(g, num_slots, v);
  return layer;
}

uint64_t SlotMajorBytes(const Geometry& g, uint32_t num_slots) {
  return uint64_t{num_slots} * g.RowBytes();
}

TensorView VllmPagedView(const Geometry& g, uint32_t num_blocks, uint32_t block_size, BufferRef at,
                         uint64_t page_stride_bytes) {
  TensorView v;
  v.buffer = at.buffer;
  v.offset_bytes = at.offset_bytes;
  v.row_stride_bytes = g.RowBytes();
  v.num_rows = num_blocks * block_size;
  v.head_stride_bytes = g.HeadBytes();
  v.page_rows = block_size;
  v.page_stride_bytes = page_stride_bytes != 0 ? page_stride_bytes : block_size * g.RowBytes();
  return v;
}

LayerView VllmPagedLayerView(const Geometry& g, uint32_t num_blocks, uint32_t block_size,
                             BufferRef k, BufferRef v, uint64_t page_stride_bytes) {
  LayerView layer;
  layer.k = VllmPagedView(g, num_blocks, block_size, k, page_stride_bytes);
  if (g.attention != Attention::kMLA) {
    layer.v = VllmPagedView(g, num_blocks, block_size, v, page_stride_bytes);
  }
  return layer;
}

uint64_t VllmPagedBytes(const Geometry& g, uint32_t num_blocks, uint32_t block_size) {
  return uint64_t{num_blocks} * block_size * g.RowBytes();
}

LayerView VllmPackedKvLayerView(const Geometry& g, uint32_t num_blocks, uint32_t block_size,
                                BufferRef kv) {
  const uint64_t e = Geometry::kElementBytes;
  TensorView k;
  k.buffer = kv.buffer;
  k.offset_bytes = kv.offset_bytes;
  k.row_stride_bytes = 2 * uint64_t{g.head_dim} * e;
  k.num_rows = num_blocks * block_size;
  k.head_stride_bytes = uint64_t{block_size} * 2 * g.head_dim * e;
  k.page_rows = block_size;
  k.page_stride_bytes = uint64_t{g.num_kv_heads} * block_size * 2 * g.head_dim * e;
  LayerView layer;
  layer.k = k;
  TensorView v = k;
  v.offset_bytes += uint64_t{g.head_dim} * e;
  layer.v = v;
  return layer;
}

uint64_t VllmPackedKvBytes(const Geometry& g, uint32_t num_blocks, uint32_t block_size) {
  return uint64_t{num_blocks} * g.num_kv_heads * block_size * 2 * g.head_dim *
         Geometry::kElementBytes;
}

}  // namespace hiqcache
