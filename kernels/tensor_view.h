// A resolved strided view of one K, V or latent tensor of one layer in an engine's KV pool.
//
// Row r (a token slot) is page p = r / page_rows, t = r % page_rows when paged (page_rows > 0),
// else p = 0, t = r. Slot t is at t * row_stride, or, with slots grouped (row_group > 0), at
// (t / row_group) * row_group_stride + (t % row_group) * row_stride. Head h of row r starts at
//   base + p * page_stride + (slot t's offset) + h * head_stride
// and holds head_dim contiguous BF16/FP16 elements, or, with the head split (dim_run > 0),
// head_dim / dim_run runs of dim_run contiguous elements, run j at j * dim_run_stride from the
// head's start (docs/design.md TensorView). `base` already includes the view's offset_bytes.
// Bounds are checked once, at registration (ViewEnd in server/core/registration.h); executors
// index without checks. Executors that read a head as one run of elements take split heads
// through GatherHeads / ScatterHeads. Value type; thread-safe.
#pragma once

#include <cstdint>
#include <cstring>

#include "codec_math.h"

namespace hiqcache::kernels {

struct StridedView {
  uint8_t* base = nullptr;
  uint64_t row_stride = 0;
  uint64_t head_stride = 0;
  uint64_t page_rows = 0;  // 0 = not paged
  uint64_t page_stride = 0;
  uint32_t num_rows = 0;
  uint64_t row_group = 0;  // 0 = slots not grouped
  uint64_t row_group_stride = 0;
  uint32_t dim_run = 0;  // 0 = every head one run of head_dim elements
  uint64_t dim_run_stride = 0;

  HIQ_HD uint64_t SlotOffset(uint64_t t) const {
    if (row_group == 0) return t * row_stride;
    return (t / row_group) * row_group_stride + (t % row_group) * row_stride;
  }
  HIQ_HD uint64_t RowOffset(uint32_t row) const {
    if (page_rows == 0) return SlotOffset(row);
    return (row / page_rows) * page_stride + SlotOffset(row % page_rows);
  }
  HIQ_HD uint8_t* Head(uint32_t row, uint32_t head) const {
    return base + RowOffset(row) + static_cast<uint64_t>(head) * head_stride;
  }
  // Bytes from a head's first element to one past its last one.
  HIQ_HD uint64_t HeadSpan(uint32_t head_dim) const {
    if (dim_run == 0) return uint64_t{head_dim} * 2;
    return (head_dim / dim_run - 1) * dim_run_stride + uint64_t{dim_run} * 2;
  }
};

// Copies heads [0, heads) of rows[0, n) of a view with split heads (dim_run > 0) into
// out = [n][heads][head_dim], contiguous.
inline void GatherHeads(const StridedView& v, uint32_t heads, uint32_t head_dim,
                        const uint32_t* rows, uint32_t n, uint8_t* out) {
  const uint32_t runs = head_dim / v.dim_run;
  const size_t run_bytes = size_t{v.dim_run} * 2;
  for (uint32_t r = 0; r < n; ++r) {
    const uint8_t* row = v.Head(rows[r], 0);
    for (uint32_t h = 0; h < heads; ++h, out += size_t{head_dim} * 2) {
      const uint8_t* head = row + h * v.head_stride;
      if (v.dim_run == 1) {
        for (uint32_t j = 0; j < runs; ++j)
          std::memcpy(out + 2 * j, head + j * v.dim_run_stride, 2);
      } else {
        for (uint32_t j = 0; j < runs; ++j) {
          std::memcpy(out + j * run_bytes, head + j * v.dim_run_stride, run_bytes);
        }
      }
    }
  }
}

// The reverse of GatherHeads: in = [n][heads][head_dim] into rows[0, n) of `v`.
inline void ScatterHeads(const uint8_t* in, uint32_t heads, uint32_t head_dim, const StridedView& v,
                         const uint32_t* rows, uint32_t n) {
  const uint32_t runs = head_dim / v.dim_run;
  const size_t run_bytes = size_t{v.dim_run} * 2;
  for (uint32_t r = 0; r < n; ++r) {
    uint8_t* row = v.Head(rows[r], 0);
    for (uint32_t h = 0; h < heads; ++h, in += size_t{head_dim} * 2) {
      uint8_t* head = row + h * v.head_stride;
      if (v.dim_run == 1) {
        for (uint32_t j = 0; j < runs; ++j) std::memcpy(head + j * v.dim_run_stride, in + 2 * j, 2);
      } else {
        for (uint32_t j = 0; j < runs; ++j) {
          std::memcpy(head + j * v.dim_run_stride, in + j * run_bytes, run_bytes);
        }
      }
    }
  }
}

// The views of one layer: planes[0] = K (or the MLA latent), planes[1] = V (unused for MLA).
struct LayerViews {
  StridedView planes[2];
};

}  // namespace hiqcache::kernels
