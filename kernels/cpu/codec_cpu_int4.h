// The SIMD CPU executor's CODEC_INT4_G32_PER_HEAD rows (Highway, runtime dispatch to the best
// target the CPU has). codec_cpu.cc's row entry points hand INT4 rows here; CpuCodec's threading
// and job walking are shared. Produces exactly the bytes of the scalar reference
// (codec_reference.h, arithmetic in codec_math.h). Pure functions; thread-safe.
#pragma once

#include <cstdint>

#include "record_format.h"
#include "tensor_view.h"

namespace hiqcache::kernels {

// Encodes rows[0..num_rows) of `view` into consecutive stored rows at `dst`; false when a row
// held NaN or Inf (the payload is then unspecified).
// REQUIRES: fmt.codec == kInt4G32PerHead, fmt.head_dim % kInt4GroupElems == 0.
bool EncodeRowsInt4Simd(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                        uint32_t num_rows, uint8_t* dst);
// Decodes consecutive stored rows at `src` into rows[0..num_rows) of `view`.
// REQUIRES: fmt.codec == kInt4G32PerHead, fmt.head_dim % kInt4GroupElems == 0.
void DecodeRowsInt4Simd(const RowFormat& fmt, const uint8_t* src, const StridedView& view,
                        const uint32_t* rows, uint32_t num_rows);

}  // namespace hiqcache::kernels
