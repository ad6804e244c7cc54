// The SIMD CPU executor's CODEC_INT4_KIVI K planes (Highway, runtime dispatch to the best target
// the CPU has): per channel (head, dim) over a block's tokens, asymmetric 4-bit codes. KIVI's V
// rows are kInt4G32PerHead rows (codec_cpu_int4.h). Produces exactly the bytes of the scalar
// reference (codec_reference.h, arithmetic in codec_math.h). Pure functions; thread-safe.
#pragma once

#include <cstdint>

#include "record_format.h"
#include "tensor_view.h"

namespace hiqcache::kernels {

// Encodes the K plane of one (block, layer), rows[0..num_rows) of `view`, into `dst`: num_rows
// code rows of H*D/2 bytes, then H*D zero points and H*D bf16 scales. False when an element was
// NaN or Inf (the payload is then unspecified).
// REQUIRES: fmt.codec == kInt4Kivi, fmt.head_dim % kInt4GroupElems == 0.
bool EncodeKiviKPlaneSimd(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                          uint32_t num_rows, uint8_t* dst);
// Decodes rows [begin, end) of the K plane of `block_tokens` rows at `plane` into
// rows[0..end - begin) of `view`.
// REQUIRES: fmt.codec == kInt4Kivi, fmt.head_dim % kInt4GroupElems == 0.
void DecodeKiviKRowsSimd(const RowFormat& fmt, const uint8_t* plane, uint32_t block_tokens,
                         uint32_t begin, uint32_t end, const StridedView& view,
                         const uint32_t* rows);

}  // namespace hiqcache::kernels
