// A resolved strided view of one K, V or latent tensor of one layer in an engine's KV pool.
//
// Row r (a token slot) is page p = r / page_rows, t = r % page_rows when paged (page_rows > 0),
// else p = 0, t = r. Slot t is at t * row_stride, or, with slots grouped (row_group > 0), at
// (t / row_group) * row_group_stride + (t % row_group) * row_stride. Head h of row r starts at
//   base + p * page_stride + (slot t's offset) + h * head_stride
// and holds head_dim contiguous BF16/FP16 elements, or, with the head split (dim_run > 0),
// head_dim / dim_run runs of dim_run elements, run j at j * dim_run_stride from the head's start,
// element i of a run at i * dim_step from the run's start (2: contiguous; docs/design.md
// TensorView dim_stride_bytes). `base` already includes the view's offset_bytes.
// Bounds are checked once, at registration (ViewEnd in server/core/registration.h); executors
// index without checks. Executors that read a head as one run of elements take split heads
// through GatherHeads / ScatterHeads. Value type; thread-safe.
#pragma once

#include <cstdint>
#include <cstring>

#include "codec_math.h"

#if defined(__SSE2__) && !defined(__CUDACC__)
#include <emmintrin.h>
#define HIQ_TRANSPOSE_SSE2 1
#else
#define HIQ_TRANSPOSE_SSE2 0
#endif

namespace hiqcache::kernels {

struct StridedView {
  uint8_t* base = nullptr;
  uint64_t row_stride = 0;
  uint64_t head_stride = 0;
  uint64_t page_rows = 0;  // 0 = not paged
  uint64_t page_stride = 0;
  uint32_t num_rows = 0;
  uint64_t row_group = 0;  // 0 = slots not grouped
  uint64_t row_group_stride = 0;
  uint32_t dim_run = 0;  // 0 = every head one run of head_dim contiguous elements
  uint64_t dim_run_stride = 0;
  uint64_t dim_step = 2;  // bytes from one element of a run to the next; 2 when dim_run <= 1

  HIQ_HD uint64_t SlotOffset(uint64_t t) const {
    if (row_group == 0) return t * row_stride;
    return (t / row_group) * row_group_stride + (t % row_group) * row_stride;
  }
  HIQ_HD uint64_t RowOffset(uint32_t row) const {
    if (page_rows == 0) return SlotOffset(row);
    return (row / page_rows) * page_stride + SlotOffset(row % page_rows);
  }
  HIQ_HD uint8_t* Head(uint32_t row, uint32_t head) const {
    return base + RowOffset(row) + static_cast<uint64_t>(head) * head_stride;
  }
  // Bytes from a head's first element to one past its last one.
  HIQ_HD uint64_t HeadSpan(uint32_t head_dim) const {
    if (dim_run == 0) return uint64_t{head_dim} * 2;
    return (head_dim / dim_run - 1) * dim_run_stride + uint64_t{dim_run - 1} * dim_step + 2;
  }
};

// Transposes a rows x cols matrix of kSize-byte elements: dst[c][r] = src[r][c], the rows of src
// src_pitch bytes apart and those of dst dst_pitch bytes apart; kBlock x kBlock blocks move
// through `block(s, d)` (in registers, where SSE2 is), the edges element by element. The bytes
// move unchanged.
template <size_t kSize, uint32_t kBlock, class Block>
inline void TransposeInBlocks(const uint8_t* src, size_t src_pitch, uint8_t* dst, size_t dst_pitch,
                              uint32_t rows, uint32_t cols, [[maybe_unused]] const Block& block) {
  auto one = [&](uint32_t r, uint32_t c) {
    std::memcpy(dst + c * dst_pitch + size_t{r} * kSize, src + r * src_pitch + size_t{c} * kSize,
                kSize);
  };
  uint32_t r0 = 0;
#if HIQ_TRANSPOSE_SSE2
  for (; r0 + kBlock <= rows; r0 += kBlock) {
    uint32_t c0 = 0;
    for (; c0 + kBlock <= cols; c0 += kBlock) {
      block(src + r0 * src_pitch + size_t{c0} * kSize, dst + c0 * dst_pitch + size_t{r0} * kSize);
    }
    for (; c0 < cols; ++c0) {
      for (uint32_t r = r0; r < r0 + kBlock; ++r) one(r, c0);
    }
  }
#endif
  for (uint32_t c = 0; c < cols; ++c) {
    for (uint32_t r = r0; r < rows; ++r) one(r, c);
  }
}

// Transposes a rows x cols matrix of 2-byte elements (TransposeInBlocks).
inline void TransposeU16(const uint8_t* src, size_t src_pitch, uint8_t* dst, size_t dst_pitch,
                         uint32_t rows, uint32_t cols) {
  auto block = [&]([[maybe_unused]] const uint8_t* s, [[maybe_unused]] uint8_t* d) {
#if HIQ_TRANSPOSE_SSE2
    // 8 x 8 in registers: three rounds of interleaving 16-, 32- and 64-bit lanes.
    __m128i a[8];
    for (int i = 0; i < 8; ++i) {
      a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i * src_pitch));
    }
    const __m128i t0 = _mm_unpacklo_epi16(a[0], a[1]), t1 = _mm_unpackhi_epi16(a[0], a[1]);
    const __m128i t2 = _mm_unpacklo_epi16(a[2], a[3]), t3 = _mm_unpackhi_epi16(a[2], a[3]);
    const __m128i t4 = _mm_unpacklo_epi16(a[4], a[5]), t5 = _mm_unpackhi_epi16(a[4], a[5]);
    const __m128i t6 = _mm_unpacklo_epi16(a[6], a[7]), t7 = _mm_unpackhi_epi16(a[6], a[7]);
    const __m128i u0 = _mm_unpacklo_epi32(t0, t2), u1 = _mm_unpackhi_epi32(t0, t2);
    const __m128i u2 = _mm_unpacklo_epi32(t1, t3), u3 = _mm_unpackhi_epi32(t1, t3);
    const __m128i u4 = _mm_unpacklo_epi32(t4, t6), u5 = _mm_unpackhi_epi32(t4, t6);
    const __m128i u6 = _mm_unpacklo_epi32(t5, t7), u7 = _mm_unpackhi_epi32(t5, t7);
    const __m128i out[8] = {_mm_unpacklo_epi64(u0, u4), _mm_unpackhi_epi64(u0, u4),
                            _mm_unpacklo_epi64(u1, u5), _mm_unpackhi_epi64(u1, u5),
                            _mm_unpacklo_epi64(u2, u6), _mm_unpackhi_epi64(u2, u6),
                            _mm_unpacklo_epi64(u3, u7), _mm_unpackhi_epi64(u3, u7)};
    for (int i = 0; i < 8; ++i) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i * dst_pitch), out[i]);
    }
#endif
  };
  TransposeInBlocks<2, 8>(src, src_pitch, dst, dst_pitch, rows, cols, block);
}

// Transposes a rows x cols matrix of 4-byte elements (pairs of 2-byte ones; TransposeInBlocks).
inline void TransposeU32(const uint8_t* src, size_t src_pitch, uint8_t* dst, size_t dst_pitch,
                         uint32_t rows, uint32_t cols) {
  auto block = [&]([[maybe_unused]] const uint8_t* s, [[maybe_unused]] uint8_t* d) {
#if HIQ_TRANSPOSE_SSE2
    // 4 x 4 in registers: interleaving 32- then 64-bit lanes.
    __m128i a[4];
    for (int i = 0; i < 4; ++i) {
      a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i * src_pitch));
    }
    const __m128i t0 = _mm_unpacklo_epi32(a[0], a[1]), t1 = _mm_unpacklo_epi32(a[2], a[3]);
    const __m128i t2 = _mm_unpackhi_epi32(a[0], a[1]), t3 = _mm_unpackhi_epi32(a[2], a[3]);
    const __m128i out[4] = {_mm_unpacklo_epi64(t0, t1), _mm_unpackhi_epi64(t0, t1),
                            _mm_unpacklo_epi64(t2, t3), _mm_unpackhi_epi64(t2, t3)};
    for (int i = 0; i < 4; ++i) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i * dst_pitch), out[i]);
    }
#endif
  };
  TransposeInBlocks<4, 4>(src, src_pitch, dst, dst_pitch, rows, cols, block);
}

// Splits n pairs of 2-byte elements (a0 b0 a1 b1 ...) at src into a[0, n) and b[0, n). The bytes
// move unchanged.
inline void DeinterleaveU16(const uint8_t* src, uint8_t* a, uint8_t* b, uint32_t n) {
  uint32_t i = 0;
#if HIQ_TRANSPOSE_SSE2
  // Each 32-bit lane holds a pair: its low half sign-extended and its high half shifted down
  // are in int16's range, so the saturating packs keep every bit.
  for (; i + 8 <= n; i += 8) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + size_t{i} * 4));
    const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + size_t{i} * 4 + 16));
    const __m128i lo = _mm_packs_epi32(_mm_srai_epi32(_mm_slli_epi32(x, 16), 16),
                                       _mm_srai_epi32(_mm_slli_epi32(y, 16), 16));
    const __m128i hi = _mm_packs_epi32(_mm_srai_epi32(x, 16), _mm_srai_epi32(y, 16));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a + size_t{i} * 2), lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b + size_t{i} * 2), hi);
  }
#endif
  for (; i < n; ++i) {
    std::memcpy(a + size_t{i} * 2, src + size_t{i} * 4, 2);
    std::memcpy(b + size_t{i} * 2, src + size_t{i} * 4 + 2, 2);
  }
}

// The reverse of DeinterleaveU16: a[0, n) and b[0, n) into n pairs at dst.
inline void InterleaveU16(const uint8_t* a, const uint8_t* b, uint8_t* dst, uint32_t n) {
  uint32_t i = 0;
#if HIQ_TRANSPOSE_SSE2
  for (; i + 8 <= n; i += 8) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + size_t{i} * 2));
    const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + size_t{i} * 2));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + size_t{i} * 4), _mm_unpacklo_epi16(x, y));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + size_t{i} * 4 + 16),
                     _mm_unpackhi_epi16(x, y));
  }
#endif
  for (; i < n; ++i) {
    std::memcpy(dst + size_t{i} * 4, a + size_t{i} * 2, 2);
    std::memcpy(dst + size_t{i} * 4 + 2, b + size_t{i} * 2, 2);
  }
}

// Copies n 2-byte elements, src_step bytes apart, to dst_step bytes apart. The bytes move
// unchanged.
inline void CopyU16(uint8_t* dst, size_t dst_step, const uint8_t* src, size_t src_step,
                    uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) std::memcpy(dst + i * dst_step, src + i * src_step, 2);
}

// How many of rows[i, n) from rows[i] on move together, their heads `unit` bytes after the one
// before inside a tile (1 where none do):
//  - runs of 1 or 2 contiguous elements (vLLM's CPU K tiles: "vec" [dim][token], AMX's dims in
//    pairs inside groups of 16 tokens): unit = one run, any number of rows, moved as one
//    transpose of runs (TransposeU16 / TransposeU32);
//  - runs of elements 4 bytes apart (AMX's V tiles, token pairs interleaved): unit = one
//    element, two rows, split from or merged into their pairs (DeinterleaveU16 / InterleaveU16).
inline uint32_t RowsMovingTogether(const StridedView& v, const uint32_t* rows, uint32_t i,
                                   uint32_t n) {
  uint64_t unit = 2;
  uint32_t most = 2;
  if (v.dim_step == 2 && (v.dim_run == 1 || v.dim_run == 2)) {
    unit = uint64_t{v.dim_run} * 2;
    most = n;
  } else if (v.dim_step != 4) {
    return 1;
  }
  const uint8_t* first = v.Head(rows[i], 0);
  uint32_t len = 1;
  while (len < most && i + len < n && v.Head(rows[i + len], 0) == first + len * unit) ++len;
  return len;
}

// Copies heads [0, heads) of rows[0, n) of a view with split heads (dim_run > 0) into
// out = [n][heads][head_dim], contiguous.
inline void GatherHeads(const StridedView& v, uint32_t heads, uint32_t head_dim,
                        const uint32_t* rows, uint32_t n, uint8_t* out) {
  const uint32_t runs = head_dim / v.dim_run;
  const size_t run_bytes = size_t{v.dim_run} * 2, head_bytes = size_t{head_dim} * 2;
  const size_t out_row = heads * head_bytes;
  for (uint32_t r = 0; r < n;) {
    const uint32_t len = RowsMovingTogether(v, rows, r, n);
    const uint8_t* first = v.Head(rows[r], 0);
    for (uint32_t h = 0; h < heads; ++h) {
      const uint8_t* head = first + h * v.head_stride;
      uint8_t* o = out + h * head_bytes;
      if (len > 1 && v.dim_step == 4) {
        for (uint32_t j = 0; j < runs; ++j) {
          DeinterleaveU16(head + j * v.dim_run_stride, o + j * run_bytes,
                          o + out_row + j * run_bytes, v.dim_run);
        }
      } else if (len > 1 && v.dim_run == 1) {
        TransposeU16(head, v.dim_run_stride, o, out_row, runs, len);
      } else if (len > 1) {
        TransposeU32(head, v.dim_run_stride, o, out_row, runs, len);
      } else if (v.dim_run == 1) {
        CopyU16(o, 2, head, v.dim_run_stride, runs);
      } else if (v.dim_step != 2) {  // a run's elements spaced (tokens interleaved in the tile)
        for (uint32_t j = 0; j < runs; ++j) {
          CopyU16(o + j * run_bytes, 2, head + j * v.dim_run_stride, v.dim_step, v.dim_run);
        }
      } else {
        for (uint32_t j = 0; j < runs; ++j) {
          std::memcpy(o + j * run_bytes, head + j * v.dim_run_stride, run_bytes);
        }
      }
    }
    out += len * out_row;
    r += len;
  }
}

// The reverse of GatherHeads: in = [n][heads][head_dim] into rows[0, n) of `v`.
inline void ScatterHeads(const uint8_t* in, uint32_t heads, uint32_t head_dim, const StridedView& v,
                         const uint32_t* rows, uint32_t n) {
  const uint32_t runs = head_dim / v.dim_run;
  const size_t run_bytes = size_t{v.dim_run} * 2, head_bytes = size_t{head_dim} * 2;
  const size_t in_row = heads * head_bytes;
  for (uint32_t r = 0; r < n;) {
    const uint32_t len = RowsMovingTogether(v, rows, r, n);
    uint8_t* first = v.Head(rows[r], 0);
    for (uint32_t h = 0; h < heads; ++h) {
      uint8_t* head = first + h * v.head_stride;
      const uint8_t* i = in + h * head_bytes;
      if (len > 1 && v.dim_step == 4) {
        for (uint32_t j = 0; j < runs; ++j) {
          InterleaveU16(i + j * run_bytes, i + in_row + j * run_bytes, head + j * v.dim_run_stride,
                        v.dim_run);
        }
      } else if (len > 1 && v.dim_run == 1) {
        TransposeU16(i, in_row, head, v.dim_run_stride, len, runs);
      } else if (len > 1) {
        TransposeU32(i, in_row, head, v.dim_run_stride, len, runs);
      } else if (v.dim_run == 1) {
        CopyU16(head, v.dim_run_stride, i, 2, runs);
      } else if (v.dim_step != 2) {
        for (uint32_t j = 0; j < runs; ++j) {
          CopyU16(head + j * v.dim_run_stride, v.dim_step, i + j * run_bytes, 2, v.dim_run);
        }
      } else {
        for (uint32_t j = 0; j < runs; ++j) {
          std::memcpy(head + j * v.dim_run_stride, i + j * run_bytes, run_bytes);
        }
      }
    }
    in += len * in_row;
    r += len;
  }
}

// The views of one layer: planes[0] = K (or the MLA latent), planes[1] = V (unused for MLA).
struct LayerViews {
  StridedView planes[2];
};

}  // namespace hiqcache::kernels
