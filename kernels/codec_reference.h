// Scalar reference executor of the codecs: the definition the SIMD and CUDA executors are tested
// against byte for byte. Straightforward loops over codec_math.h; single-threaded; thread-safe
// (no shared state).
#pragma once

#include <cstdint>

#include "codec_job.h"

namespace hiqcache::kernels {

// Encodes one row (all heads of `row` in `view`) into `dst` (fmt.RowBytes() bytes).
// Returns false, leaving `dst` unspecified, when an INT8, FP8 or INT4 row holds NaN or Inf.
// REQUIRES for INT4: fmt.head_dim % kInt4GroupElems == 0 (registration enforces it).
bool EncodeRowReference(const RowFormat& fmt, const StridedView& view, uint32_t row, uint8_t* dst);
// Decodes one stored row into all heads of `row` in `view`.
void DecodeRowReference(const RowFormat& fmt, const uint8_t* src, const StridedView& view,
                        uint32_t row);

void EncodeBlocksReference(const EncodeJob& job);
// Decodes layer `layer` of every block of the job.
void DecodeLayerReference(const DecodeJob& job, uint32_t layer);
void DecodeBlocksReference(const DecodeJob& job);

}  // namespace hiqcache::kernels
