// The SIMD CPU executor's CODEC_INT4_HADAMARD planes (Highway, runtime dispatch to the best
// target the CPU has): each block's first token as an INT8 row (codec_cpu.h's row executor), the
// others rotated by the Walsh-Hadamard transform and stored at 4 bits (KIVI's asymmetric codes:
// per channel over the block in plane 0, per group of 32 in plane 1). Produces exactly the bytes
// of the scalar reference (codec_reference.h, arithmetic in codec_math.h). Pure functions;
// thread-safe.
#pragma once

#include <cstdint>

#include "record_format.h"
#include "tensor_view.h"

namespace hiqcache::kernels {

// Encodes plane `plane` of one (block, layer), rows[0..num_rows) of `view` (whole heads:
// view.dim_run == 0), into `dst` (BlockLayout::PlaneBytes(plane) bytes). False when an element
// was NaN or Inf or a rotated run reached HadamardLimitBits (the payload is then unspecified).
// REQUIRES: fmt.codec == kInt4Hadamard, fmt.head_dim % kInt4GroupElems == 0.
bool EncodeHadamardPlaneSimd(const RowFormat& fmt, uint32_t plane, const StridedView& view,
                             const uint32_t* rows, uint32_t num_rows, uint8_t* dst);
// Decodes rows [begin, end) of the plane of `block_tokens` rows at `src` into
// rows[0..end - begin) of `view` (whole heads).
// REQUIRES: fmt.codec == kInt4Hadamard, fmt.head_dim % kInt4GroupElems == 0.
void DecodeHadamardRowsSimd(const RowFormat& fmt, uint32_t plane, const uint8_t* src,
                            uint32_t block_tokens, uint32_t begin, uint32_t end,
                            const StridedView& view, const uint32_t* rows);

}  // namespace hiqcache::kernels
