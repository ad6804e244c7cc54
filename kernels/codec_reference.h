// Scalar reference executor of the codecs: the definition the SIMD and CUDA executors are tested
// against byte for byte. Straightforward loops over codec_math.h; single-threaded; thread-safe
// (no shared state).
#pragma once

#include <cstdint>

#include "codec_job.h"

namespace hiqcache::kernels {

// Encodes one row (all heads of `row` in `view`) into `dst` (fmt.RowBytes() bytes; for
// CODEC_INT4_KIVI a V row).
// Returns false, leaving `dst` unspecified, when an INT8, FP8 or INT4 row holds NaN or Inf.
// REQUIRES for INT4: fmt.head_dim % kInt4GroupElems == 0 (registration enforces it).
bool EncodeRowReference(const RowFormat& fmt, const StridedView& view, uint32_t row, uint8_t* dst);
// Decodes one stored row into all heads of `row` in `view`.
void DecodeRowReference(const RowFormat& fmt, const uint8_t* src, const StridedView& view,
                        uint32_t row);

// CODEC_INT4_KIVI's K plane of one (block, layer): encodes rows[0..num_rows) of `view` into
// `dst` (num_rows code rows of H*D/2 bytes, then H*D zero points and H*D bf16 scales). Returns
// false, leaving `dst` unspecified, when an element is NaN or Inf. REQUIRES: fmt.head_dim even.
bool EncodeKiviKPlaneReference(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                               uint32_t num_rows, uint8_t* dst);
// Decodes rows [begin, end) of a KIVI K plane of `block_tokens` rows at `plane` into
// rows[0..end - begin) of `view`.
void DecodeKiviKRowsReference(const RowFormat& fmt, const uint8_t* plane, uint32_t block_tokens,
                              uint32_t begin, uint32_t end, const StridedView& view,
                              const uint32_t* rows);

// CODEC_INT4_HADAMARD's plane `plane` of one (block, layer): encodes rows[0..num_rows) of `view`
// into `dst` (BlockLayout::PlaneBytes bytes: row 0 as INT8, the others rotated at 4 bits, plane
// 0's channel parameters last). Returns false, leaving `dst` unspecified, when an element is NaN
// or Inf or a rotated run reaches HadamardLimitBits. REQUIRES: fmt.head_dim % kInt4GroupElems == 0.
bool EncodeHadamardPlaneReference(const RowFormat& fmt, uint32_t plane, const StridedView& view,
                                  const uint32_t* rows, uint32_t num_rows, uint8_t* dst);
// Decodes rows [begin, end) of a Hadamard plane of `block_tokens` rows at `src` into
// rows[0..end - begin) of `view`.
void DecodeHadamardRowsReference(const RowFormat& fmt, uint32_t plane, const uint8_t* src,
                                 uint32_t block_tokens, uint32_t begin, uint32_t end,
                                 const StridedView& view, const uint32_t* rows);

// An allot codec's (CODEC_INT4/5/6_ALLOT) plane `plane` of one (block, layer):
// encodes rows[0..num_rows) of `view` into `dst` (BlockLayout::PlaneBytes bytes: row 0 as INT8,
// the others as turned keys at allotted widths or rotated values at fmt.Allot().value bits,
// plane 0's channel parameters last). Returns false, leaving
// `dst` unspecified, when an element is NaN or Inf, a key reaches 2^120 or a rotated run reaches
// HadamardLimitBits. REQUIRES: fmt.head_dim % kInt4GroupElems == 0.
bool EncodeAllotPlaneReference(const RowFormat& fmt, uint32_t plane, const StridedView& view,
                               const uint32_t* rows, uint32_t num_rows, uint8_t* dst);
// Decodes rows [begin, end) of an allot codec's plane of `block_tokens` rows at `src` into
// rows[0..end - begin) of `view`.
void DecodeAllotRowsReference(const RowFormat& fmt, uint32_t plane, const uint8_t* src,
                              uint32_t block_tokens, uint32_t begin, uint32_t end,
                              const StridedView& view, const uint32_t* rows);

void EncodeBlocksReference(const EncodeJob& job);
// Decodes layer `layer` of every block of the job.
void DecodeLayerReference(const DecodeJob& job, uint32_t layer);
void DecodeBlocksReference(const DecodeJob& job);

}  // namespace hiqcache::kernels
