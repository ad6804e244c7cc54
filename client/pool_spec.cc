#include "hiqcache/pool_spec.h"

#include <algorithm>

#include "hiqcache/split_view.h"

namespace hiqcache {

const char* DTypeName(DType dtype) { return dtype == DType::kFP16 ? "fp16" : "bf16"; }

const char* CodecName(Codec codec) {
  const auto i = static_cast<uint32_t>(codec);
  return i < kCodecCount ? kCodecNames[i].text : "unknown";
}

const char* CodecContractName(Codec codec) {
  const auto i = static_cast<uint32_t>(codec);
  return i < kCodecCount ? kCodecNames[i].contract : "CODEC_UNKNOWN";
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
  const uint64_t slot = row_group == 0 ? t * row_stride_bytes
                                       : (t / row_group) * row_group_stride_bytes +
                                             (t % row_group) * row_stride_bytes;
  return offset_bytes + p * page_stride_bytes + slot + uint64_t{head} * hs;
}

uint64_t TensorView::ElementOffset(uint32_t row, uint32_t head, uint32_t d,
                                   uint64_t head_bytes) const {
  const uint64_t step = dim_stride_bytes != 0 ? dim_stride_bytes : 2;
  const uint64_t in_head = dim_run == 0
                               ? uint64_t{d} * step
                               : (d / dim_run) * dim_run_stride_bytes + (d % dim_run) * step;
  return HeadOffset(row, head, head_bytes) + in_head;
}

uint64_t TensorView::EndOffset(uint32_t num_heads, uint64_t head_bytes) const {
  if (num_rows == 0 || num_heads == 0) return 0;
  if (SplitViewField(*this) != nullptr) {
    // Every axis at its largest index (the daemon's bound for split views): strides are
    // unsigned, so no element lies beyond.
    const uint64_t head_dim = head_bytes / 2;
    const uint64_t run = dim_run != 0 ? dim_run : head_dim;
    const uint64_t slots = page_rows != 0 ? std::min<uint64_t>(page_rows, num_rows) : num_rows;
    const uint64_t pages = page_rows != 0 ? (num_rows + page_rows - 1) / page_rows : 1;
    const uint64_t group = row_group != 0 ? std::min<uint64_t>(row_group, slots) : slots;
    const uint64_t hs = head_stride_bytes != 0 ? head_stride_bytes : head_bytes;
    const uint64_t step = dim_stride_bytes != 0 ? dim_stride_bytes : 2;
    return offset_bytes + (run - 1) * step + (head_dim / run - 1) * dim_run_stride_bytes +
           (num_heads - 1) * hs + (group - 1) * row_stride_bytes +
           ((slots + group - 1) / group - 1) * row_group_stride_bytes +
           (pages - 1) * page_stride_bytes + 2;
  }
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
