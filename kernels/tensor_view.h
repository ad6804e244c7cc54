// A resolved strided view of one K, V or latent tensor of one layer in an engine's KV pool.
//
// Row r (a token slot) is page p = r / page_rows, t = r % page_rows when paged (page_rows > 0),
// else p = 0, t = r. Head h of row r starts at
//   base + p * page_stride + t * row_stride + h * head_stride
// and holds head_dim contiguous BF16/FP16 elements (docs/design.md TensorView). `base` already
// includes the view's offset_bytes. Bounds are checked once, at registration (ViewEnd in
// server/core/registration.h); executors index without checks. Value type; thread-safe.
#pragma once

#include <cstdint>

#include "codec_math.h"

namespace hiqcache::kernels {

struct StridedView {
  uint8_t* base = nullptr;
  uint64_t row_stride = 0;
  uint64_t head_stride = 0;
  uint64_t page_rows = 0;  // 0 = not paged
  uint64_t page_stride = 0;
  uint32_t num_rows = 0;

  HIQ_HD uint64_t RowOffset(uint32_t row) const {
    if (page_rows == 0) return static_cast<uint64_t>(row) * row_stride;
    return (row / page_rows) * page_stride + (row % page_rows) * row_stride;
  }
  HIQ_HD uint8_t* Head(uint32_t row, uint32_t head) const {
    return base + RowOffset(row) + static_cast<uint64_t>(head) * head_stride;
  }
};

// The views of one layer: planes[0] = K (or the MLA latent), planes[1] = V (unused for MLA).
struct LayerViews {
  StridedView planes[2];
};

}  // namespace hiqcache::kernels
