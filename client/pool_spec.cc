#include "hiqcache/pool_spec.h"

#include <algorithm>

namespace hiqcache {

const char* DTypeName(DType dtype) { return dtype == DType::kFP16 ? "fp16" : "bf16"; }

const char* CodecName(Codec codec) {
  switch (codec) {
    case Codec::kRaw:
      return "raw";
    case Codec::kFp8E4m3PerHead:
      return "fp8_e4m3_per_head";
    case Codec::kInt4G32PerHead:
      return "int4_g32_per_head";
    case Codec::kInt4Kivi:
      return "int4_kivi";
    case Codec::kInt8PerHead:
      break;
  }
  return "int8_per_head";
}

const char* DeviceKindName(DeviceKind kind) { return kind == DeviceKind::kCuda ? "cuda" : "host"; }

uint64_t TensorView::HeadOffset(uint32_t row, uint32_t head, uint64_t head_bytes) const {
  uint64_t p = 0;
  uint64_t t = row;
  if (page_rows != 0) {
    p = row / page_rows;
    t = row % page_rows;
  }
  const uint64_t hs = head_stride_bytes != 0 ? head_stride_bytes : head_bytes;
  return offset_bytes + p * page_stride_bytes + t * row_stride_bytes + uint64_t{head} * hs;
}

uint64_t TensorView::EndOffset(uint32_t num_heads, uint64_t head_bytes) const {
  if (num_rows == 0 || num_heads == 0) return 0;
  // Strides are unsigned, so within a page the last row is the farthest; across pages the last
  // page may be partial, so the last row of the page before it can lie farther still.
  uint64_t far = HeadOffset(num_rows - 1, num_heads - 1, head_bytes);
  if (page_rows != 0 && num_rows > page_rows) {
    const uint64_t last_page = (num_rows - 1) / page_rows;
    const uint64_t row = last_page * page_rows - 1;  // last row of the previous page
    far = std::max(far, HeadOffset(static_cast<uint32_t>(row), num_heads - 1, head_bytes));
  }
  return far + head_bytes;
}

}  // namespace hiqcache
