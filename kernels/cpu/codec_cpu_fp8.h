// The SIMD CPU executor's CODEC_FP8_E4M3_PER_HEAD rows (Highway, runtime dispatch to the best
// target the CPU has). codec_cpu.cc's row entry points hand FP8 rows here; CpuCodec's threading
// and job walking are shared. Produces exactly the bytes of the scalar reference
// (codec_reference.h, arithmetic in codec_math.h). Pure functions; thread-safe.
#pragma once

#include <cstdint>

#include "record_format.h"
#include "tensor_view.h"

namespace hiqcache::kernels {

// Encodes rows[0..num_rows) of `view` into consecutive stored rows at `dst`; false when a row
// held NaN or Inf (the payload is then unspecified). REQUIRES: fmt.codec == kFp8E4m3PerHead.
bool EncodeRowsFp8Simd(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                       uint32_t num_rows, uint8_t* dst);
// Decodes consecutive stored rows at `src` into rows[0..num_rows) of `view`.
// REQUIRES: fmt.codec == kFp8E4m3PerHead.
void DecodeRowsFp8Simd(const RowFormat& fmt, const uint8_t* src, const StridedView& view,
                       const uint32_t* rows, uint32_t num_rows);

}  // namespace hiqcache::kernels
