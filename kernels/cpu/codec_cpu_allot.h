// The SIMD CPU executor's planes of the allot codecs (CODEC_INT5_ALLOT, CODEC_INT6_ALLOT; Highway,
// runtime dispatch to the best target the CPU has): each block's first token as an INT8 row
// (codec_cpu.h's row executor); the K plane's other tokens turned back by RoPE, bounded, allotted
// and coded here (codec_cpu_allot.cc); the V plane's rotated at fmt.Allot().value bits by the
// Hadamard executor
// (codec_cpu_hadamard.cc). Produces exactly the bytes of the scalar reference
// (codec_reference.h, arithmetic in codec_math.h). Pure functions; thread-safe.
#pragma once

#include <cstdint>

#include "record_format.h"
#include "tensor_view.h"

namespace hiqcache::kernels {

// Encodes plane `plane` of one (block, layer), rows[0..num_rows) of `view` (whole heads:
// view.dim_run == 0), into `dst` (BlockLayout::PlaneBytes(plane) bytes). False when an element
// was NaN or Inf, a key reached 2^120 or a rotated run reached HadamardLimitBits (the payload is
// then unspecified). REQUIRES: fmt.IsAllot(), fmt.head_dim % kInt4GroupElems == 0.
bool EncodeAllotPlaneSimd(const RowFormat& fmt, uint32_t plane, const StridedView& view,
                          const uint32_t* rows, uint32_t num_rows, uint8_t* dst);
// Decodes rows [begin, end) of the plane of `block_tokens` rows at `src` into
// rows[0..end - begin) of `view` (whole heads). REQUIRES: as EncodeAllotPlaneSimd.
void DecodeAllotRowsSimd(const RowFormat& fmt, uint32_t plane, const uint8_t* src,
                         uint32_t block_tokens, uint32_t begin, uint32_t end,
                         const StridedView& view, const uint32_t* rows);

// The V plane's tokens 1..num_rows-1 (encode) and rows [begin, end), begin >= 1 (decode), in
// codec_cpu_hadamard.cc beside INT4 Hadamard's planes, whose rotation they share.
bool EncodeAllotValuesSimd(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                           uint32_t num_rows, uint8_t* dst);
void DecodeAllotValuesSimd(const RowFormat& fmt, const uint8_t* src, uint32_t begin, uint32_t end,
                           const StridedView& view, const uint32_t* rows);

}  // namespace hiqcache::kernels
