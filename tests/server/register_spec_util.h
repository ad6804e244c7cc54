// Builders of RegisterSpec (server/core/requests.h) for the daemon-core unit tests that register
// pools: the namespace and geometry fields, and the per-layer K/V views of one buffer pair.
// Header-only; value functions.
#pragma once

#include <cstdint>
#include <string>

#include "core/requests.h"

namespace hiqcache::server::testing {

// `rows` rows of `row_stride` bytes at `offset` of buffer `buffer`.
inline ViewSpec RowView(uint32_t buffer, uint64_t offset, uint64_t row_stride, uint32_t rows) {
  ViewSpec v;
  v.present = true;
  v.buffer = buffer;
  v.offset_bytes = offset;
  v.row_stride_bytes = row_stride;
  v.num_rows = rows;
  return v;
}

// A spec of `model` with this geometry: BF16, MHA, TP rank 0 of 1, INT8, HOST; no tenant,
// buffers, layers or events yet.
inline RegisterSpec BaseSpec(const std::string& model, uint32_t layers, uint32_t heads,
                             uint32_t dim, uint32_t block_tokens) {
  RegisterSpec s;
  s.model = model;
  s.num_layers = layers;
  s.num_kv_heads = heads;
  s.head_dim = dim;
  s.dtype = 1;      // DTYPE_BF16
  s.attention = 1;  // ATTENTION_MHA
  s.tp_rank = 0;
  s.tp_size = 1;
  s.block_tokens = block_tokens;
  s.codec = 0;  // CODEC_INT8_PER_HEAD
  s.device_kind = static_cast<int>(DeviceKind::kHost);
  return s;
}

// Appends s->num_layers layers whose K lie in buffer 0 and V in buffer 1, layer after layer:
// layer l is `rows` rows of `row_bytes` at l * rows * row_bytes of each buffer.
inline void AddLayerMajorLayers(RegisterSpec* s, uint32_t rows, uint64_t row_bytes) {
  for (uint32_t l = 0; l < s->num_layers; ++l) {
    const uint64_t offset = uint64_t{l} * rows * row_bytes;
    s->layers.push_back({RowView(0, offset, row_bytes, rows), RowView(1, offset, row_bytes, rows)});
  }
}

}  // namespace hiqcache::server::testing
