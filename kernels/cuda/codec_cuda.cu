// CUDA kernels of the codecs and their launchers (see codec_cuda.h for the contract).
//
// Work decomposition: a unit is one head of one stored row, i.e. one (block, layer, plane, token,
// head); units are numbered in payload order (cuda_detail::UnitShape), so consecutive groups of
// lanes read/write consecutive payload bytes. A group of G lanes (G = a power of two <= 32,
// cuda_detail::PlanGroups) owns a head; each lane holds chunks of 8 elements (one 16-byte load
// of BF16/FP16, 8 bytes of codes). Encode: load the head's chunks, reduce amax over the
// sign-cleared 16-bit patterns inside the lane (__vmaxu2) and across the group (xor shuffles),
// derive the scale and quantize every element with the codec's codec_math.h functions
// (ScaledCodec below: INT8, FP8 E4M3 or INT4, a template parameter of the kernels; IEEE fp32
// division: this file must never be built with --use_fast_math / -prec-div=false).
// INT4 scales groups of 32 elements, i.e. 4 chunks on 4 consecutive lanes (head_dim % 32 == 0
// makes a head span at least 4 lanes): its amax is reduced over those lanes only, and a lane
// packs its 8 codes into 4 bytes (nibbles).
// Decode: load codes and the head's (INT4: the group's) scale, dequantize, store 16 bytes per
// lane.
// Each lane keeps kUnits units in flight (all loads before any use) to hide memory latency.
// CODEC_INT4_KIVI: its V planes are INT4 rows (the same kernels, from plane 1); its K planes
// reduce over the block's tokens per channel, so their unit is a chunk of 8 channels of one
// head of one (block, layer) K plane, owned by one lane (KiviKEncodeKernel: min/max pass, then
// zero points, scales and a code pass; KiviKDecodeKernel), launched before the V rows.
// CODEC_INT4_HADAMARD: every plane's first token is an INT8 row (the INT8 kernels over one token
// per plane); its other tokens are rotated runs, each split over a group of lanes and transformed
// through xor shuffles (HadamardEncodeKKernel, HadamardEncodeVKernel, HadamardDecodeKernel, see
// their section), launched before the INT8 rows.
// CODEC_INT4/5/6_ALLOT (one format at three widths): first rows INT8 likewise; a
// warp per (block, layer) K plane (its channel
// bounds and allotted widths span the plane: AllotEncodeKKernel, AllotDecodeKKernel per 8
// tokens), a lane group per V row head (AllotEncodeVKernel, AllotDecodeVKernel); see its section.
//
// Launches are bounded (CudaLaunchConfig: a few CTAs per SM) and walk the units with a
// warp-uniform grid-stride loop, so the daemon never floods the GPU it shares with the engine.
#if defined(HIQ_CUDA_EMULATION)
// The host build for tests without a GPU (codec_cuda_emulated.cc, cuda_emulation.h): the same
// kernels and launchers, each CTA's lanes run as fibers on the calling thread.
#include "cuda_runtime_emulation.h"
#define HIQ_LAUNCH(kernel, grid, block, stream) \
  ::hiqcache::cuda_emulation::Launch(kernel, grid, block, stream)
#else
#include <cuda_runtime.h>
// HIQ_LAUNCH(k, grid, block, stream)(args) is k<<<grid, block, 0, stream>>>(args).
#define HIQ_LAUNCH(kernel, grid, block, stream) kernel<<<grid, block, 0, stream>>>
#endif

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#include "codec_cuda.h"

namespace hiqcache::kernels {
namespace {

using cuda_detail::FastDivmod;
using cuda_detail::GroupPlan;
using cuda_detail::kChunkElems;
using cuda_detail::UnitShape;

constexpr uint32_t kFullMask = 0xFFFFFFFFu;
constexpr uint32_t kMaxThreadsPerCta = 512;

struct EncodeParams {
  BlockLayout layout;
  UnitShape shape;
  const LayerViews* layers;
  const uint32_t* rows;    // this launch's first block
  uint8_t* const* blocks;  // this launch's first block
  uint8_t* nonfinite;      // this launch's first block, or null
  uint32_t first_plane;    // the shape's plane 0 is this plane (1: KIVI's V rows)
  uint32_t total_units;
  uint32_t group_log2;  // lanes per head = 1 << group_log2
};

struct DecodeParams {
  BlockLayout layout;
  UnitShape shape;
  const LayerViews* layers;
  const uint32_t* rows;
  const uint8_t* const* blocks;
  uint32_t first_layer;
  uint32_t first_plane;  // the shape's plane 0 is this plane (1: KIVI's V rows)
  uint32_t total_units;
  uint32_t group_log2;
};

// Eight 16-bit elements; element i is in the (i & 1) half of w[i / 2] (little endian).
struct Chunk {
  uint32_t w[4];
};

__device__ __forceinline__ uint16_t ChunkElem(const Chunk& c, int i) {
  return static_cast<uint16_t>(c.w[i >> 1] >> ((i & 1) * 16));
}

__device__ __forceinline__ uint16_t LoadU16Unaligned(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (static_cast<uint32_t>(p[1]) << 8));
}

__device__ __forceinline__ void StoreU16Unaligned(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}

__device__ __forceinline__ bool Aligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// StridedView::Head with a 32-bit page division (row < 2^32, so page_rows >= 2^32 means page 0).
__device__ __forceinline__ uint8_t* HeadPtr(const StridedView& v, uint32_t row, uint32_t head) {
  uint64_t off;
  if (v.page_rows == 0 || v.page_rows > 0xFFFFFFFFull) {
    off = static_cast<uint64_t>(row) * v.row_stride;
  } else {
    const uint32_t page_rows = static_cast<uint32_t>(v.page_rows);
    const uint32_t page = row / page_rows;
    const uint32_t t = row - page * page_rows;
    off = static_cast<uint64_t>(page) * v.page_stride + static_cast<uint64_t>(t) * v.row_stride;
  }
  return v.base + off + static_cast<uint64_t>(head) * v.head_stride;
}

// Loads elements [e0, e0 + 8) of a head (zeros past d). `aligned16`: the head starts 16-aligned.
__device__ __forceinline__ void LoadHalfChunk(const uint8_t* head, uint32_t e0, uint32_t d,
                                              bool aligned16, Chunk* c) {
  if (aligned16 && e0 + kChunkElems <= d) {
    const uint4 v = __ldcs(reinterpret_cast<const uint4*>(head + 2 * e0));
    c->w[0] = v.x;
    c->w[1] = v.y;
    c->w[2] = v.z;
    c->w[3] = v.w;
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t e = e0 + 2 * k;
    const uint32_t lo = e < d ? LoadU16Unaligned(head + 2 * e) : 0u;
    const uint32_t hi = e + 1 < d ? LoadU16Unaligned(head + 2 * e + 2) : 0u;
    c->w[k] = lo | (hi << 16);
  }
}

// Stores `n` (<= 8) bytes held little-endian in lo|hi at dst, with the widest aligned stores.
__device__ __forceinline__ void StoreBytes8(uint8_t* dst, uint32_t lo, uint32_t hi, uint32_t n) {
  if (n == 8) {
    if (Aligned(dst, 8)) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
      return;
    }
    if (Aligned(dst, 4)) {
      reinterpret_cast<uint32_t*>(dst)[0] = lo;
      reinterpret_cast<uint32_t*>(dst)[1] = hi;
      return;
    }
    if (Aligned(dst, 2)) {
      uint16_t* d16 = reinterpret_cast<uint16_t*>(dst);
      d16[0] = static_cast<uint16_t>(lo);
      d16[1] = static_cast<uint16_t>(lo >> 16);
      d16[2] = static_cast<uint16_t>(hi);
      d16[3] = static_cast<uint16_t>(hi >> 16);
      return;
    }
  }
  for (uint32_t i = 0; i < n; ++i) {
    dst[i] = static_cast<uint8_t>((i < 4 ? lo >> (8 * i) : hi >> (8 * (i - 4))));
  }
}

// Stores 4 bytes held little-endian in v at dst, with the widest aligned stores.
__device__ __forceinline__ void StoreBytes4(uint8_t* dst, uint32_t v) {
  if (Aligned(dst, 4)) {
    *reinterpret_cast<uint32_t*>(dst) = v;
  } else if (Aligned(dst, 2)) {
    reinterpret_cast<uint16_t*>(dst)[0] = static_cast<uint16_t>(v);
    reinterpret_cast<uint16_t*>(dst)[1] = static_cast<uint16_t>(v >> 16);
  } else {
    for (int i = 0; i < 4; ++i) dst[i] = static_cast<uint8_t>(v >> (8 * i));
  }
}

// Loads 4 bytes at src (little endian).
__device__ __forceinline__ uint32_t LoadBytes4(const uint8_t* src) {
  if (Aligned(src, 4)) return __ldcs(reinterpret_cast<const unsigned int*>(src));
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(src[i]) << (8 * i);
  return v;
}

// Loads `n` (<= 8) bytes at src into lo|hi (little endian, zeros past n).
__device__ __forceinline__ void LoadBytes8(const uint8_t* src, uint32_t n, uint32_t* lo,
                                           uint32_t* hi) {
  if (n == 8 && Aligned(src, 8)) {
    const uint2 v = __ldcs(reinterpret_cast<const uint2*>(src));
    *lo = v.x;
    *hi = v.y;
    return;
  }
  uint32_t l = 0, h = 0;
  for (uint32_t i = 0; i < n; ++i) {
    if (i < 4) {
      l |= static_cast<uint32_t>(src[i]) << (8 * i);
    } else {
      h |= static_cast<uint32_t>(src[i]) << (8 * (i - 4));
    }
  }
  *lo = l;
  *hi = h;
}

// Stores elements [e0, e0 + min(8, d - e0)) of a head from c.
__device__ __forceinline__ void StoreHalfChunk(uint8_t* head, uint32_t e0, uint32_t d,
                                               const Chunk& c) {
  uint8_t* dst = head + 2 * e0;
  if (e0 + kChunkElems <= d && Aligned(dst, 16)) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(c.w[0], c.w[1], c.w[2], c.w[3]);
    return;
  }
  const uint32_t n = min(kChunkElems, d - e0);
  const bool aligned2 = Aligned(dst, 2);
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // constant indices keep c in registers
    if (static_cast<uint32_t>(i) >= n) break;
    if (aligned2) {
      reinterpret_cast<uint16_t*>(dst)[i] = ChunkElem(c, i);
    } else {
      StoreU16Unaligned(dst + 2 * i, ChunkElem(c, i));
    }
  }
}

// Stores v[0..8) times `factor` at dst as 16-bit elements of kDType (saturating; a whole chunk).
template <DType kDType>
__device__ __forceinline__ void StoreScaledChunk(uint8_t* dst, const float* v, float factor) {
  Chunk out;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out.w[i] = static_cast<uint32_t>(FloatToHalfSat(v[2 * i] * factor, kDType)) |
               (static_cast<uint32_t>(FloatToHalfSat(v[2 * i + 1] * factor, kDType)) << 16);
  }
  StoreHalfChunk(dst, 0, kChunkElems, out);
}

// ---------------------------------------------------------------------------------------------
// The per-element arithmetic of the codecs with bf16 scales: kGroupChunks chunks (of 8 elements)
// share a scale; 0 means the whole head, with one code byte per element; grouped codecs (INT4)
// store nibbles.

template <CodecKind kCodec>
struct ScaledCodec;

template <>
struct ScaledCodec<CodecKind::kInt8PerHead> {
  static constexpr uint32_t kGroupChunks = 0;
  static HIQ_HD uint16_t Scale(uint16_t amax_bits, DType dtype) {
    return ScaleBf16FromAmaxBits(amax_bits, dtype);
  }
  static HIQ_HD uint32_t Quantize(float x, float s) {
    return static_cast<uint8_t>(QuantizeElement(x, s));
  }
  static HIQ_HD uint16_t Dequantize(uint32_t code, float s, DType dtype) {
    return DequantizeElement(static_cast<int8_t>(code), s, dtype);
  }
};

template <>
struct ScaledCodec<CodecKind::kFp8E4m3PerHead> {
  static constexpr uint32_t kGroupChunks = 0;
  static HIQ_HD uint16_t Scale(uint16_t amax_bits, DType dtype) {
    return Fp8ScaleBf16FromAmaxBits(amax_bits, dtype);
  }
  static HIQ_HD uint32_t Quantize(float x, float s) { return QuantizeFp8Element(x, s); }
  static HIQ_HD uint16_t Dequantize(uint32_t code, float s, DType dtype) {
    return DequantizeFp8Element(static_cast<uint8_t>(code), s, dtype);
  }
};

template <>
struct ScaledCodec<CodecKind::kInt4G32PerHead> {
  static constexpr uint32_t kGroupChunks = kInt4GroupElems / kChunkElems;  // 4
  static HIQ_HD uint16_t Scale(uint16_t amax_bits, DType dtype) {
    return Int4ScaleBf16FromAmaxBits(amax_bits, dtype);
  }
  static HIQ_HD uint32_t Quantize(float x, float s) { return QuantizeInt4Element(x, s); }
  static HIQ_HD uint16_t Dequantize(uint32_t code, float s, DType dtype) {
    return DequantizeInt4Element(code, s, dtype);
  }
};
static_assert(ScaledCodec<CodecKind::kInt4G32PerHead>::kGroupChunks * kChunkElems ==
              kInt4GroupElems);

// ---------------------------------------------------------------------------------------------
// Encode (INT8 or FP8 per head, INT4 per group of 32).

// Phases 2 and 3 of EncodeScaledKernel for a codec with a scale per kGroupChunks chunks: the
// group's amax over its lanes (xor shuffles below kGroupChunks; every lane of the warp calls
// this), then per chunk its group's scale, codes and (on the group's first lane) the scale.
template <typename Codec, DType kDType, int kChunks, int kUnits>
__device__ __forceinline__ void EncodeGroups(
    const EncodeParams& p, const Chunk (&c)[kUnits][kChunks], const bool (&valid)[kUnits],
    const uint32_t (&block)[kUnits], const uint32_t (&head)[kUnits],
    uint8_t* const (&dst_row)[kUnits], uint32_t gl, uint32_t group_lanes) {
  const uint32_t d = p.layout.row.head_dim;
  const uint32_t groups_per_head = d / kInt4GroupElems;
  const size_t code_bytes = p.layout.row.CodeBytes();
  uint32_t amax[kUnits][kChunks];
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      uint32_t acc = 0;
#pragma unroll
      for (int w = 0; w < 4; ++w) acc = __vmaxu2(acc, c[j][k].w[w] & 0x7FFF7FFFu);
      uint32_t a = max(acc & 0xFFFFu, acc >> 16);
#pragma unroll
      for (uint32_t off = 1; off < Codec::kGroupChunks; off <<= 1) {
        a = max(a, __shfl_xor_sync(kFullMask, a, off));
      }
      amax[j][k] = a;
    }
  }
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    if (!valid[j]) continue;
    uint8_t* codes = dst_row[j] + static_cast<size_t>(head[j]) * d / 2;
    uint8_t* scales = dst_row[j] + code_bytes + 2u * static_cast<size_t>(head[j]) * groups_per_head;
    bool nonfinite = false;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const uint32_t e0 = (gl + k * group_lanes) * kChunkElems;
      if (e0 >= d) continue;
      if (amax[j][k] >= InfBits(kDType)) {
        nonfinite = true;
        continue;
      }
      const uint16_t s_bits = Codec::Scale(static_cast<uint16_t>(amax[j][k]), kDType);
      const float s = Bf16ToFloat(s_bits);
      uint32_t packed = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        packed |= Codec::Quantize(HalfToFloat(ChunkElem(c[j][k], i), kDType), s) << (4 * i);
      }
      StoreBytes4(codes + e0 / 2, packed);
      if ((gl & (Codec::kGroupChunks - 1u)) == 0) {
        StoreU16Unaligned(scales + 2u * (e0 / kInt4GroupElems), s_bits);
      }
    }
    if (nonfinite && p.nonfinite != nullptr) p.nonfinite[block[j]] = 1;
  }
}

template <CodecKind kCodec, DType kDType, int kChunks, int kUnits>
__global__ void __launch_bounds__(kMaxThreadsPerCta) EncodeScaledKernel(const EncodeParams p) {
  using Codec = ScaledCodec<kCodec>;
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t group_lanes = 1u << p.group_log2;
  const uint32_t gl = lane & (group_lanes - 1u);
  const uint32_t group = lane >> p.group_log2;
  const uint32_t groups_per_warp = 32u >> p.group_log2;
  const uint32_t units_per_iter = groups_per_warp * kUnits;
  const uint64_t warp = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const uint64_t num_warps = (static_cast<uint64_t>(gridDim.x) * blockDim.x) >> 5;
  const uint32_t d = p.layout.row.head_dim;
  const uint32_t tokens = p.layout.block_tokens;
  const size_t elems_per_row = p.layout.row.ElementsPerRow();

  // The loop bound depends on the warp only, so every lane reaches the shuffles below.
  for (uint64_t base = warp * units_per_iter; base < p.total_units;
       base += num_warps * units_per_iter) {
    Chunk c[kUnits][kChunks];
    bool valid[kUnits];
    uint32_t block[kUnits];
    uint32_t head[kUnits];
    uint8_t* dst_row[kUnits];

    // Phase 1: issue every load of this iteration.
#pragma unroll
    for (int j = 0; j < kUnits; ++j) {
      const uint64_t u = base + static_cast<uint64_t>(j) * groups_per_warp + group;
      valid[j] = u < p.total_units;
      block[j] = 0;
      head[j] = 0;
      dst_row[j] = nullptr;
      const uint8_t* src = nullptr;
      bool aligned16 = false;
      if (valid[j]) {
        uint32_t l, pl, t;
        p.shape.Decompose(static_cast<uint32_t>(u), &block[j], &l, &pl, &t, &head[j]);
        pl += p.first_plane;
        const uint32_t row = p.rows[static_cast<size_t>(block[j]) * tokens + t];
        src = HeadPtr(p.layers[l].planes[pl], row, head[j]);
        aligned16 = Aligned(src, 16);
        dst_row[j] = p.blocks[block[j]] + p.layout.RowOffset(l, pl, t);
      }
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        const uint32_t e0 = (gl + k * group_lanes) * kChunkElems;
        if (valid[j] && e0 < d) {
          LoadHalfChunk(src, e0, d, aligned16, &c[j][k]);
        } else {
          c[j][k] = Chunk{{0u, 0u, 0u, 0u}};
        }
      }
    }

    if constexpr (Codec::kGroupChunks != 0) {
      EncodeGroups<Codec, kDType, kChunks, kUnits>(p, c, valid, block, head, dst_row, gl,
                                                   group_lanes);
    } else {
      // Phase 2: amax per head over the sign-cleared bit patterns (|x| orders like them).
      uint32_t amax[kUnits];
#pragma unroll
      for (int j = 0; j < kUnits; ++j) {
        uint32_t acc = 0;
#pragma unroll
        for (int k = 0; k < kChunks; ++k) {
#pragma unroll
          for (int w = 0; w < 4; ++w) acc = __vmaxu2(acc, c[j][k].w[w] & 0x7FFF7FFFu);
        }
        amax[j] = max(acc & 0xFFFFu, acc >> 16);
        for (uint32_t off = group_lanes >> 1; off > 0; off >>= 1) {
          amax[j] = max(amax[j], __shfl_xor_sync(kFullMask, amax[j], off));
        }
      }

      // Phase 3: scale, quantize, store.
#pragma unroll
      for (int j = 0; j < kUnits; ++j) {
        if (!valid[j]) continue;
        if (amax[j] >= InfBits(kDType)) {
          if (gl == 0 && p.nonfinite != nullptr) p.nonfinite[block[j]] = 1;
          continue;
        }
        const uint16_t s_bits = Codec::Scale(static_cast<uint16_t>(amax[j]), kDType);
        const float s = Bf16ToFloat(s_bits);
        uint8_t* codes = dst_row[j] + static_cast<size_t>(head[j]) * d;
#pragma unroll
        for (int k = 0; k < kChunks; ++k) {
          const uint32_t e0 = (gl + k * group_lanes) * kChunkElems;
          if (e0 >= d) continue;
          uint32_t lo = 0, hi = 0;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float x = HalfToFloat(ChunkElem(c[j][k], i), kDType);
            const uint32_t q = Codec::Quantize(x, s);
            if (i < 4) {
              lo |= q << (8 * i);
            } else {
              hi |= q << (8 * (i - 4));
            }
          }
          StoreBytes8(codes + e0, lo, hi, min(kChunkElems, d - e0));
        }
        if (gl == 0) StoreU16Unaligned(dst_row[j] + elems_per_row + 2u * head[j], s_bits);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Decode (INT8 or FP8 per head, INT4 per group of 32).

// One iteration of DecodeScaledKernel for a codec with a scale per kGroupChunks chunks: loads
// every chunk's 4 code bytes and its group's scale, then dequantizes and stores.
template <typename Codec, DType kDType, int kChunks, int kUnits>
__device__ __forceinline__ void DecodeGroups(const DecodeParams& p, uint64_t base,
                                             uint32_t groups_per_warp, uint32_t group, uint32_t gl,
                                             uint32_t group_lanes) {
  const uint32_t d = p.layout.row.head_dim;
  const uint32_t tokens = p.layout.block_tokens;
  const uint32_t groups_per_head = d / kInt4GroupElems;
  const size_t code_bytes = p.layout.row.CodeBytes();
  uint32_t codes[kUnits][kChunks];
  uint16_t s_bits[kUnits][kChunks];
  bool valid[kUnits];
  uint8_t* dst[kUnits];
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    const uint64_t u = base + static_cast<uint64_t>(j) * groups_per_warp + group;
    valid[j] = u < p.total_units;
    dst[j] = nullptr;
    const uint8_t* head_codes = nullptr;
    const uint8_t* head_scales = nullptr;
    if (valid[j]) {
      uint32_t b, l, pl, t, h;
      p.shape.Decompose(static_cast<uint32_t>(u), &b, &l, &pl, &t, &h);
      l += p.first_layer;
      pl += p.first_plane;
      const uint8_t* src_row = p.blocks[b] + p.layout.RowOffset(l, pl, t);
      head_codes = src_row + static_cast<size_t>(h) * d / 2;
      head_scales = src_row + code_bytes + 2u * static_cast<size_t>(h) * groups_per_head;
      const uint32_t row = p.rows[static_cast<size_t>(b) * tokens + t];
      dst[j] = HeadPtr(p.layers[l].planes[pl], row, h);
    }
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const uint32_t e0 = (gl + k * group_lanes) * kChunkElems;
      codes[j][k] = 0;
      s_bits[j][k] = 0;
      if (valid[j] && e0 < d) {
        codes[j][k] = LoadBytes4(head_codes + e0 / 2);
        s_bits[j][k] = LoadU16Unaligned(head_scales + 2u * (e0 / kInt4GroupElems));
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    if (!valid[j]) continue;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const uint32_t e0 = (gl + k * group_lanes) * kChunkElems;
      if (e0 >= d) continue;
      const float s = Bf16ToFloat(s_bits[j][k]);
      Chunk out;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t q0 = codes[j][k] >> (8 * i);
        out.w[i] = static_cast<uint32_t>(Codec::Dequantize(q0 & 0xFu, s, kDType)) |
                   (static_cast<uint32_t>(Codec::Dequantize((q0 >> 4) & 0xFu, s, kDType)) << 16);
      }
      StoreHalfChunk(dst[j], e0, d, out);
    }
  }
}

template <CodecKind kCodec, DType kDType, int kChunks, int kUnits>
__global__ void __launch_bounds__(kMaxThreadsPerCta) DecodeScaledKernel(const DecodeParams p) {
  using Codec = ScaledCodec<kCodec>;
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t group_lanes = 1u << p.group_log2;
  const uint32_t gl = lane & (group_lanes - 1u);
  const uint32_t group = lane >> p.group_log2;
  const uint32_t groups_per_warp = 32u >> p.group_log2;
  const uint32_t units_per_iter = groups_per_warp * kUnits;
  const uint64_t warp = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const uint64_t num_warps = (static_cast<uint64_t>(gridDim.x) * blockDim.x) >> 5;
  const uint32_t d = p.layout.row.head_dim;
  const uint32_t tokens = p.layout.block_tokens;
  const size_t elems_per_row = p.layout.row.ElementsPerRow();

  for (uint64_t base = warp * units_per_iter; base < p.total_units;
       base += num_warps * units_per_iter) {
    if constexpr (Codec::kGroupChunks != 0) {
      DecodeGroups<Codec, kDType, kChunks, kUnits>(p, base, groups_per_warp, group, gl,
                                                   group_lanes);
    } else {
      uint32_t lo[kUnits][kChunks];
      uint32_t hi[kUnits][kChunks];
      uint16_t s_bits[kUnits];
      bool valid[kUnits];
      uint8_t* dst[kUnits];

#pragma unroll
      for (int j = 0; j < kUnits; ++j) {
        const uint64_t u = base + static_cast<uint64_t>(j) * groups_per_warp + group;
        valid[j] = u < p.total_units;
        dst[j] = nullptr;
        s_bits[j] = 0;
        const uint8_t* codes = nullptr;
        if (valid[j]) {
          uint32_t b, l, pl, t, h;
          p.shape.Decompose(static_cast<uint32_t>(u), &b, &l, &pl, &t, &h);
          l += p.first_layer;
          pl += p.first_plane;
          const uint8_t* src_row = p.blocks[b] + p.layout.RowOffset(l, pl, t);
          codes = src_row + static_cast<size_t>(h) * d;
          s_bits[j] = LoadU16Unaligned(src_row + elems_per_row + 2u * h);
          const uint32_t row = p.rows[static_cast<size_t>(b) * tokens + t];
          dst[j] = HeadPtr(p.layers[l].planes[pl], row, h);
        }
#pragma unroll
        for (int k = 0; k < kChunks; ++k) {
          const uint32_t e0 = (gl + k * group_lanes) * kChunkElems;
          lo[j][k] = 0;
          hi[j][k] = 0;
          if (valid[j] && e0 < d)
            LoadBytes8(codes + e0, min(kChunkElems, d - e0), &lo[j][k], &hi[j][k]);
        }
      }

#pragma unroll
      for (int j = 0; j < kUnits; ++j) {
        if (!valid[j]) continue;
        const float s = Bf16ToFloat(s_bits[j]);
#pragma unroll
        for (int k = 0; k < kChunks; ++k) {
          const uint32_t e0 = (gl + k * group_lanes) * kChunkElems;
          if (e0 >= d) continue;
          Chunk out;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint32_t word = i < 2 ? lo[j][k] : hi[j][k];
            const int sh = (i & 1) * 16;
            const uint32_t q0 = (word >> sh) & 0xFFu;
            const uint32_t q1 = (word >> (sh + 8)) & 0xFFu;
            out.w[i] = static_cast<uint32_t>(Codec::Dequantize(q0, s, kDType)) |
                       (static_cast<uint32_t>(Codec::Dequantize(q1, s, kDType)) << 16);
          }
          StoreHalfChunk(dst[j], e0, d, out);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// CODEC_INT4_KIVI's K planes (its V planes are INT4 rows: the kernels above with first_plane 1).
// A K unit is one chunk (8 channels) of one head of one (block, layer) K plane:
// u = ((b * L + l) * H + h) * C + c, C = head_dim / 8 (head_dim % 32 == 0: whole chunks), so
// consecutive lanes read and write consecutive 16-byte runs of a head and 4-byte runs of a
// code row. A lane owns its 8 channels alone: the reduction over the block's tokens stays in the
// lane (no shuffles), in the reference's order (codec_reference.cc, EncodeKiviKPlaneReference).

struct KiviKShape {
  FastDivmod chunks, heads, layers;

  static KiviKShape Make(uint32_t head_dim, uint32_t num_heads, uint32_t num_layers) {
    return {FastDivmod::Make(head_dim / kChunkElems), FastDivmod::Make(num_heads),
            FastDivmod::Make(num_layers)};
  }
  HIQ_HD void Decompose(uint32_t u, uint32_t* block, uint32_t* layer, uint32_t* head,
                        uint32_t* chunk) const {
    u = chunks.DivMod(u, chunk);
    u = heads.DivMod(u, head);
    *block = layers.DivMod(u, layer);
  }
};

struct KiviKParams {
  BlockLayout layout;
  KiviKShape shape;
  const LayerViews* layers;
  const uint32_t* rows;    // this launch's first block
  uint8_t* const* blocks;  // this launch's first block (const-cast for decode: only read there)
  uint8_t* nonfinite;      // encode: this launch's first block, or null
  uint32_t first_layer;    // decode: the shape's layer 0 is this layer
  uint32_t total_units;
};

// Tokens whose loads a lane issues before using any of them.
constexpr uint32_t kKiviTokenBatch = 4;

// Loads token t's 8 channels of the unit's head (zeros past the block's tokens).
__device__ __forceinline__ void LoadKiviChunk(const KiviKParams& p, const StridedView& view,
                                              const uint32_t* rows, uint32_t t, uint32_t head,
                                              uint32_t e0, Chunk* c) {
  if (t >= p.layout.block_tokens) {
    *c = Chunk{{0u, 0u, 0u, 0u}};
    return;
  }
  const uint8_t* src = HeadPtr(view, rows[t], head);
  LoadHalfChunk(src, e0, p.layout.row.head_dim, Aligned(src, 16), c);
}

template <DType kDType>
__global__ void __launch_bounds__(kMaxThreadsPerCta) KiviKEncodeKernel(const KiviKParams p) {
  const uint32_t d = p.layout.row.head_dim;
  const uint32_t tokens = p.layout.block_tokens;
  const size_t code_bytes = p.layout.row.ElementsPerRow() / 2;
  const uint64_t num_lanes = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t u = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < p.total_units;
       u += num_lanes) {
    uint32_t b, l, h, c;
    p.shape.Decompose(static_cast<uint32_t>(u), &b, &l, &h, &c);
    const uint32_t e0 = c * kChunkElems;
    const StridedView view = p.layers[l].planes[0];  // in registers across the stores below
    const uint32_t* rows = p.rows + static_cast<size_t>(b) * tokens;

    // Pass 1: each channel's smallest and largest x (the reference's comparisons, token 0
    // first), and the largest sign-cleared bit pattern (NaN/Inf flag the block).
    float lo[kChunkElems] = {}, hi[kChunkElems] = {};
    uint32_t acc = 0;
    for (uint32_t t0 = 0; t0 < tokens; t0 += kKiviTokenBatch) {
      Chunk x[kKiviTokenBatch];
#pragma unroll
      for (uint32_t k = 0; k < kKiviTokenBatch; ++k) {
        LoadKiviChunk(p, view, rows, t0 + k, h, e0, &x[k]);
      }
#pragma unroll
      for (uint32_t k = 0; k < kKiviTokenBatch; ++k) {
        if (t0 + k >= tokens) break;
#pragma unroll
        for (int w = 0; w < 4; ++w) acc = __vmaxu2(acc, x[k].w[w] & 0x7FFF7FFFu);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float v = HalfToFloat(ChunkElem(x[k], i), kDType);
          if (t0 + k == 0 || v < lo[i]) lo[i] = v;
          if (t0 + k == 0 || v > hi[i]) hi[i] = v;
        }
      }
    }
    if (max(acc & 0xFFFFu, acc >> 16) >= InfBits(kDType)) {
      if (p.nonfinite != nullptr) p.nonfinite[b] = 1;
      continue;
    }

    // The channels' zero points and scales, stored after the plane's code rows.
    uint8_t* plane = p.blocks[b] + p.layout.PlaneOffset(l, 0);
    const size_t channel0 = static_cast<size_t>(h) * d;
    uint8_t* zeros = plane + static_cast<size_t>(tokens) * code_bytes + 2 * channel0;
    uint8_t* scales = zeros + 2 * p.layout.row.ElementsPerRow();
    float z[kChunkElems], s[kChunkElems];
    Chunk z_bits, s_bits;
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      const uint16_t z0 = KiviKZeroBits(lo[i], kDType), z1 = KiviKZeroBits(lo[i + 1], kDType);
      const uint16_t s0 = KiviKScaleBf16(lo[i], hi[i]), s1 = KiviKScaleBf16(lo[i + 1], hi[i + 1]);
      z[i] = HalfToFloat(z0, kDType);
      z[i + 1] = HalfToFloat(z1, kDType);
      s[i] = Bf16ToFloat(s0);
      s[i + 1] = Bf16ToFloat(s1);
      z_bits.w[i / 2] = static_cast<uint32_t>(z0) | (static_cast<uint32_t>(z1) << 16);
      s_bits.w[i / 2] = static_cast<uint32_t>(s0) | (static_cast<uint32_t>(s1) << 16);
    }
    StoreHalfChunk(zeros, e0, d, z_bits);
    StoreHalfChunk(scales, e0, d, s_bits);

    // Pass 2: the codes, token by token (the head's 8 nibbles: 4 bytes of code row t).
    uint8_t* codes = plane + (channel0 + e0) / 2;
    for (uint32_t t0 = 0; t0 < tokens; t0 += kKiviTokenBatch) {
      Chunk x[kKiviTokenBatch];
#pragma unroll
      for (uint32_t k = 0; k < kKiviTokenBatch; ++k) {
        LoadKiviChunk(p, view, rows, t0 + k, h, e0, &x[k]);
      }
#pragma unroll
      for (uint32_t k = 0; k < kKiviTokenBatch; ++k) {
        if (t0 + k >= tokens) break;
        uint32_t packed = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          packed |= QuantizeKiviKElement(HalfToFloat(ChunkElem(x[k], i), kDType), z[i], s[i])
                    << (4 * i);
        }
        StoreBytes4(codes + static_cast<size_t>(t0 + k) * code_bytes, packed);
      }
    }
  }
}

template <DType kDType>
__global__ void __launch_bounds__(kMaxThreadsPerCta) KiviKDecodeKernel(const KiviKParams p) {
  const uint32_t d = p.layout.row.head_dim;
  const uint32_t tokens = p.layout.block_tokens;
  const size_t code_bytes = p.layout.row.ElementsPerRow() / 2;
  const uint64_t num_lanes = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t u = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < p.total_units;
       u += num_lanes) {
    uint32_t b, l, h, c;
    p.shape.Decompose(static_cast<uint32_t>(u), &b, &l, &h, &c);
    l += p.first_layer;
    const uint32_t e0 = c * kChunkElems;
    const StridedView view = p.layers[l].planes[0];  // in registers across the stores below
    const uint32_t* rows = p.rows + static_cast<size_t>(b) * tokens;
    const uint8_t* plane = p.blocks[b] + p.layout.PlaneOffset(l, 0);
    const size_t channel0 = static_cast<size_t>(h) * d;
    const uint8_t* zeros = plane + static_cast<size_t>(tokens) * code_bytes + 2 * channel0;
    const uint8_t* scales = zeros + 2 * p.layout.row.ElementsPerRow();
    Chunk z_bits, s_bits;
    LoadHalfChunk(zeros, e0, d, Aligned(zeros, 16), &z_bits);
    LoadHalfChunk(scales, e0, d, Aligned(scales, 16), &s_bits);
    float z[kChunkElems], s[kChunkElems];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      z[i] = HalfToFloat(ChunkElem(z_bits, i), kDType);
      s[i] = Bf16ToFloat(ChunkElem(s_bits, i));
    }
    const uint8_t* codes = plane + (channel0 + e0) / 2;
    for (uint32_t t0 = 0; t0 < tokens; t0 += kKiviTokenBatch) {
      uint32_t q[kKiviTokenBatch];
      uint8_t* dst[kKiviTokenBatch];
#pragma unroll
      for (uint32_t k = 0; k < kKiviTokenBatch; ++k) {
        q[k] = 0;
        dst[k] = nullptr;
        if (t0 + k < tokens) {
          q[k] = LoadBytes4(codes + static_cast<size_t>(t0 + k) * code_bytes);
          dst[k] = HeadPtr(view, rows[t0 + k], h);
        }
      }
#pragma unroll
      for (uint32_t k = 0; k < kKiviTokenBatch; ++k) {
        if (t0 + k >= tokens) break;
        Chunk out;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t q0 = q[k] >> (8 * i);
          out.w[i] =
              static_cast<uint32_t>(DequantizeKiviKElement(q0 & 0xFu, z[2 * i], s[2 * i], kDType)) |
              (static_cast<uint32_t>(
                   DequantizeKiviKElement((q0 >> 4) & 0xFu, z[2 * i + 1], s[2 * i + 1], kDType))
               << 16);
        }
        StoreHalfChunk(dst[k], e0, d, out);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// CODEC_INT4_HADAMARD. Row 0 of every plane (each block's first token) is an INT8 row: the INT8
// kernels above over a shape of one token per plane. Rows 1.. are rotated (codec_math.h "INT4
// Hadamard"): a unit is one run of r = HadamardRun(head_dim) elements of one head, owned by a
// group of G = r / kE lanes (a power of two <= 32; kE = 8 for r <= 256, else r / 32), lane gl
// holding elements [gl * kE, gl * kE + kE) of the run in registers. The transform's stages of
// stride 1 .. kE/2 pair elements inside a lane; the stages of stride kE .. r/2 pair lane gl with
// lane gl ^ (stride / kE) (xor shuffles inside the group), the lower element of a pair taking
// mine + partner (a + b), the upper one partner - mine (a - b): every stage in codec_math.h's
// order with the reference's fp32 additions, so the bits are HadamardTransform's.
//   Encode K (plane 0): unit (block, layer, head, run); pass 1 rotates tokens 1.. one by one
//     and keeps each channel's lo/hi in the lane, the channels' zero points and scales follow,
//     pass 2 rotates the tokens again (the same bits) and stores their codes.
//   Encode V (plane 1): unit (block, layer, token >= 1, head, run); lo/hi per group of 32
//     rotated elements: in the lane, then across the group's 32 / kE lanes (kE < 32).
//   Decode (both planes): unit (block, layer, plane, token >= 1, head, run).
// A run whose transform reaches HadamardLimitBits (NaN and Inf included) flags its block (any
// lane's element: reduced over the group); the unit then stores nothing more. Groups share a warp
// (G < 32), so every lane runs the same shuffles whatever its unit: invalid units (past the last)
// carry zeros and store nothing. Units are numbered with UnitShape, a "head" there being one run of
// one head (H * d / r).

struct HadamardParams {
  BlockLayout layout;
  UnitShape shape;  // heads = num_heads * runs: unit head index hr = h * runs + run
  FastDivmod runs;  // runs per head (head_dim / r)
  const LayerViews* layers;
  const uint32_t* rows;    // this launch's first block
  uint8_t* const* blocks;  // this launch's first block (const-cast for decode: only read there)
  uint8_t* nonfinite;      // encode: this launch's first block, or null
  uint32_t first_layer;    // decode: the shape's layer 0 is this layer
  uint32_t run;            // r
  uint32_t group_log2;     // lanes per run = 1 << group_log2
  uint32_t total_units;
};

// Elements per lane for a run of r (a power of two, 32 <= r <= kMaxHeadDim).
HIQ_HD uint32_t HadamardLaneElems(uint32_t r) { return r <= 256 ? 8u : r / 32u; }

__device__ __forceinline__ float MinF(float a, float b) { return b < a ? b : a; }
__device__ __forceinline__ float MaxF(float a, float b) { return b > a ? b : a; }

// v = the lane's kE elements of H_r (run), group_lanes lanes holding the run (see above).
template <int kE>
__device__ __forceinline__ void HadamardLaneTransform(float (&v)[kE], uint32_t gl,
                                                      uint32_t group_lanes) {
#pragma unroll
  for (int s = 1; s < kE; s <<= 1) {
#pragma unroll
    for (int i = 0; i < kE; ++i) {
      if ((i & s) != 0) continue;
      const float a = v[i];
      const float b = v[i + s];
      v[i] = a + b;
      v[i + s] = a - b;
    }
  }
  // Two elements per shuffle (a 64-bit shuffle is two 32-bit ones on a GPU; the emulator runs
  // half as many warp exchanges).
  for (uint32_t off = 1; off < group_lanes; off <<= 1) {
    const bool upper = (gl & off) != 0;
#pragma unroll
    for (int i = 0; i < kE; i += 2) {
      const unsigned long long mine =
          FloatToBits(v[i]) | (static_cast<unsigned long long>(FloatToBits(v[i + 1])) << 32);
      const unsigned long long other = __shfl_xor_sync(kFullMask, mine, static_cast<int>(off));
      const float o0 = BitsToFloat(static_cast<uint32_t>(other));
      const float o1 = BitsToFloat(static_cast<uint32_t>(other >> 32));
      v[i] = upper ? o0 - v[i] : v[i] + o0;
      v[i + 1] = upper ? o1 - v[i + 1] : v[i + 1] + o1;
    }
  }
}

// Loads kE elements of the input dtype at src as fp32 (kE % 8 == 0).
template <DType kDType, int kE>
__device__ __forceinline__ void LoadLaneElems(const uint8_t* src, float (&v)[kE]) {
#pragma unroll
  for (int k = 0; k < kE / 8; ++k) {
    const uint8_t* p = src + 16 * k;
    Chunk c;
    LoadHalfChunk(p, 0, kChunkElems, Aligned(p, 16), &c);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[8 * k + i] = HalfToFloat(ChunkElem(c, i), kDType);
  }
}

// Whether `mine` holds on all of the group's lanes (every lane of the warp calls this).
__device__ __forceinline__ bool GroupAllTrue(bool mine, uint32_t group_lanes) {
  uint32_t ok = mine ? 1u : 0u;
  for (uint32_t off = 1; off < group_lanes; off <<= 1) {
    ok &= __shfl_xor_sync(kFullMask, ok, static_cast<int>(off));
  }
  return ok != 0;
}

// Loads and rotates the lane's elements of one run of one token: y = bf16(H_r x * e) as fp32.
// Returns whether the lane's transformed values lie under `limit` (HadamardLimitBits: NaN and Inf
// do not). `src` null: zeros (invalid unit).
template <DType kDType, int kE>
__device__ __forceinline__ bool RotateLane(const uint8_t* src, uint32_t gl, uint32_t group_lanes,
                                           float e, uint32_t limit, float (&y)[kE]) {
  if (src != nullptr) {
    LoadLaneElems<kDType, kE>(src, y);
  } else {
#pragma unroll
    for (int i = 0; i < kE; ++i) y[i] = 0.0f;
  }
  HadamardLaneTransform<kE>(y, gl, group_lanes);
  bool finite = true;
#pragma unroll
  for (int i = 0; i < kE; ++i) {
    finite = finite && HadamardInRange(y[i], limit);
    y[i] = Bf16ToFloat(FloatToBf16Sat(y[i] * e));
  }
  return finite;
}

// Stores the kE codes of y with per-element zero points and scales, nibbles (element 2i low).
template <int kE>
__device__ __forceinline__ void StoreLaneCodes(uint8_t* dst, const float (&y)[kE],
                                               const float (&z)[kE], const float (&s)[kE]) {
#pragma unroll
  for (int k = 0; k < kE / 8; ++k) {
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      packed |= QuantizeKiviKElement(y[8 * k + i], z[8 * k + i], s[8 * k + i]) << (4 * i);
    }
    StoreBytes4(dst + 4 * k, packed);
  }
}

// The unit of a lane: its position and whether it exists.
struct HadamardUnit {
  bool valid;
  uint32_t block, layer, plane, token, head, run;
};

__device__ __forceinline__ HadamardUnit HadamardUnitOf(const HadamardParams& p, uint64_t u) {
  HadamardUnit x{};
  x.valid = u < p.total_units;
  if (x.valid) {
    uint32_t hr;
    p.shape.Decompose(static_cast<uint32_t>(u), &x.block, &x.layer, &x.plane, &x.token, &hr);
    x.head = p.runs.DivMod(hr, &x.run);
  }
  return x;
}

// The warp-uniform grid-stride walk of the units: body(unit, gl, group_lanes) once per iteration
// on every lane (the loop bound depends on the warp only, so every lane reaches every shuffle).
template <typename Body>
__device__ __forceinline__ void ForEachHadamardUnit(const HadamardParams& p, Body body) {
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t group_lanes = 1u << p.group_log2;
  const uint32_t gl = lane & (group_lanes - 1u);
  const uint32_t group = lane >> p.group_log2;
  const uint32_t units_per_warp = 32u >> p.group_log2;
  const uint64_t warp = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const uint64_t num_warps = (static_cast<uint64_t>(gridDim.x) * blockDim.x) >> 5;
  for (uint64_t base = warp * units_per_warp; base < p.total_units;
       base += num_warps * units_per_warp) {
    body(HadamardUnitOf(p, base + group), gl, group_lanes);
  }
}

// Plane 0 (K, MLA's latent plane), rows 1..block_tokens-1: per channel over the tokens.
template <DType kDType, int kE>
__global__ void __launch_bounds__(kMaxThreadsPerCta) HadamardEncodeKKernel(const HadamardParams p) {
  const uint32_t d = p.layout.row.head_dim;
  const uint32_t tokens = p.layout.block_tokens;
  const size_t channels = p.layout.row.ElementsPerRow();
  const float e = HadamardEncodeFactor(p.run);
  const uint32_t limit = HadamardLimitBits(p.run);
  ForEachHadamardUnit(p, [&](const HadamardUnit& x, uint32_t gl, uint32_t group_lanes) {
    const uint32_t* rows = p.rows + static_cast<size_t>(x.block) * tokens;
    const StridedView* view = x.valid ? &p.layers[x.layer].planes[0] : nullptr;
    // The lane's first element in its head, and its channel.
    const uint32_t e0 = x.run * p.run + gl * kE;
    const size_t c0 = static_cast<size_t>(x.head) * d + e0;

    // Pass 1: the channels' smallest and largest y over tokens 1.. (the reference's order).
    float lo[kE], hi[kE], y[kE];
    bool finite = true;
    for (uint32_t t = 1; t < tokens; ++t) {
      const uint8_t* src = x.valid ? HeadPtr(*view, rows[t], x.head) + 2 * e0 : nullptr;
      finite = RotateLane<kDType, kE>(src, gl, group_lanes, e, limit, y) && finite;
#pragma unroll
      for (int i = 0; i < kE; ++i) {
        lo[i] = t == 1 ? y[i] : MinF(lo[i], y[i]);
        hi[i] = t == 1 ? y[i] : MaxF(hi[i], y[i]);
      }
    }
    const bool store = GroupAllTrue(finite, group_lanes) && x.valid;
    if (x.valid && !store && gl == 0 && p.nonfinite != nullptr) p.nonfinite[x.block] = 1;

    // The channels' zero points and scales, after the plane's rows.
    uint8_t* plane = x.valid ? p.blocks[x.block] + p.layout.PlaneOffset(x.layer, 0) : nullptr;
    float z[kE], s[kE];
#pragma unroll
    for (int k = 0; k < kE / 8; ++k) {
      Chunk z_bits, s_bits;
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        const int j = 8 * k + i;
        uint16_t zb0 = 0, zb1 = 0, sb0 = 0, sb1 = 0;
        if (store) {
          zb0 = KiviKZeroBits(lo[j], DType::kBF16);
          zb1 = KiviKZeroBits(lo[j + 1], DType::kBF16);
          sb0 = KiviKScaleBf16(lo[j], hi[j]);
          sb1 = KiviKScaleBf16(lo[j + 1], hi[j + 1]);
        }
        z[j] = Bf16ToFloat(zb0);
        z[j + 1] = Bf16ToFloat(zb1);
        s[j] = Bf16ToFloat(sb0);
        s[j + 1] = Bf16ToFloat(sb1);
        z_bits.w[i / 2] = static_cast<uint32_t>(zb0) | (static_cast<uint32_t>(zb1) << 16);
        s_bits.w[i / 2] = static_cast<uint32_t>(sb0) | (static_cast<uint32_t>(sb1) << 16);
      }
      if (store) {
        uint8_t* zeros = plane + p.layout.row.PlaneRowOffset(0, tokens) + 2 * (c0 + 8 * k);
        StoreHalfChunk(zeros, 0, kChunkElems, z_bits);
        StoreHalfChunk(zeros + 2 * channels, 0, kChunkElems, s_bits);
      }
    }

    // Pass 2: the codes, token by token (the same rotation, so the same y).
    for (uint32_t t = 1; t < tokens; ++t) {
      const uint8_t* src = store ? HeadPtr(*view, rows[t], x.head) + 2 * e0 : nullptr;
      RotateLane<kDType, kE>(src, gl, group_lanes, e, limit, y);
      if (store) {
        StoreLaneCodes<kE>(plane + p.layout.row.PlaneRowOffset(0, t) + c0 / 2, y, z, s);
      }
    }
  });
}

// Plane 1 (V), one rotated row: per group of 32 rotated elements of the token.
template <DType kDType, int kE>
__global__ void __launch_bounds__(kMaxThreadsPerCta) HadamardEncodeVKernel(const HadamardParams p) {
  // A group of 32 spans kGroupLanes lanes (kE < 32) or a lane holds kLaneGroups groups.
  constexpr int kGroupLanes = kE < 32 ? 32 / kE : 1;
  constexpr int kLaneGroups = kE < 32 ? 1 : kE / 32;
  constexpr int kInLane = kE < 32 ? kE : 32;  // a group's elements in one lane
  const uint32_t d = p.layout.row.head_dim;
  const uint32_t tokens = p.layout.block_tokens;
  const size_t channels = p.layout.row.ElementsPerRow();
  const size_t groups = channels / kInt4GroupElems;
  const float e = HadamardEncodeFactor(p.run);
  const uint32_t limit = HadamardLimitBits(p.run);
  ForEachHadamardUnit(p, [&](const HadamardUnit& x, uint32_t gl, uint32_t group_lanes) {
    const uint32_t t = x.token + 1;
    const uint32_t e0 = x.run * p.run + gl * kE;
    const size_t c0 = static_cast<size_t>(x.head) * d + e0;
    const uint8_t* src = nullptr;
    if (x.valid) {
      const uint32_t row = p.rows[static_cast<size_t>(x.block) * tokens + t];
      src = HeadPtr(p.layers[x.layer].planes[1], row, x.head) + 2 * e0;
    }
    float y[kE];
    const bool finite = RotateLane<kDType, kE>(src, gl, group_lanes, e, limit, y);
    const bool store = GroupAllTrue(finite, group_lanes) && x.valid;
    if (x.valid && !store && gl == 0 && p.nonfinite != nullptr) p.nonfinite[x.block] = 1;

    float lo[kLaneGroups], hi[kLaneGroups];
#pragma unroll
    for (int g = 0; g < kLaneGroups; ++g) {
      lo[g] = y[g * kInLane];
      hi[g] = y[g * kInLane];
#pragma unroll
      for (int i = 1; i < kInLane; ++i) {
        lo[g] = MinF(lo[g], y[g * kInLane + i]);
        hi[g] = MaxF(hi[g], y[g * kInLane + i]);
      }
#pragma unroll
      for (int off = 1; off < kGroupLanes; off <<= 1) {  // lo and hi in one 64-bit shuffle
        const unsigned long long other = __shfl_xor_sync(
            kFullMask,
            FloatToBits(lo[g]) | (static_cast<unsigned long long>(FloatToBits(hi[g])) << 32), off);
        lo[g] = MinF(lo[g], BitsToFloat(static_cast<uint32_t>(other)));
        hi[g] = MaxF(hi[g], BitsToFloat(static_cast<uint32_t>(other >> 32)));
      }
    }
    if (!store) return;
    uint8_t* row = p.blocks[x.block] + p.layout.RowOffset(x.layer, 1, t);
    uint8_t* zeros = row + channels / 2;
    uint8_t* scales = zeros + 2 * groups;
    float z[kE], s[kE];
#pragma unroll
    for (int g = 0; g < kLaneGroups; ++g) {
      const uint16_t zb = KiviKZeroBits(lo[g], DType::kBF16);
      const uint16_t sb = KiviKScaleBf16(lo[g], hi[g]);
      const size_t group = (c0 + g * kInLane) / kInt4GroupElems;
      if ((gl & (kGroupLanes - 1)) == 0) {
        StoreU16Unaligned(zeros + 2 * group, zb);
        StoreU16Unaligned(scales + 2 * group, sb);
      }
#pragma unroll
      for (int i = 0; i < kInLane; ++i) {
        z[g * kInLane + i] = Bf16ToFloat(zb);
        s[g * kInLane + i] = Bf16ToFloat(sb);
      }
    }
    StoreLaneCodes<kE>(row + c0 / 2, y, z, s);
  });
}

// Rows 1..block_tokens-1 of both planes: y^ = bf16(dequantized), w = H_r y^, x^ = w * c.
template <DType kDType, int kE>
__global__ void __launch_bounds__(kMaxThreadsPerCta) HadamardDecodeKernel(const HadamardParams p) {
  const uint32_t d = p.layout.row.head_dim;
  const uint32_t tokens = p.layout.block_tokens;
  const size_t channels = p.layout.row.ElementsPerRow();
  const size_t groups = channels / kInt4GroupElems;
  const float c_d = HadamardDecodeFactor(p.run);
  ForEachHadamardUnit(p, [&](const HadamardUnit& x, uint32_t gl, uint32_t group_lanes) {
    const uint32_t t = x.token + 1;
    const uint32_t l = x.layer + p.first_layer;
    const uint32_t e0 = x.run * p.run + gl * kE;
    const size_t c0 = static_cast<size_t>(x.head) * d + e0;
    float w[kE];
    uint8_t* dst = nullptr;
    if (x.valid) {
      const uint8_t* plane = p.blocks[x.block] + p.layout.PlaneOffset(l, x.plane);
      const uint8_t* codes = plane + p.layout.row.PlaneRowOffset(x.plane, t);
#pragma unroll
      for (int k = 0; k < kE / 8; ++k) {
        const uint32_t q = LoadBytes4(codes + c0 / 2 + 4 * k);
        float z[8], s[8];
        if (x.plane == 0) {  // a pair per channel, after the plane's rows
          const uint8_t* zeros = plane + p.layout.row.PlaneRowOffset(0, tokens) + 2 * (c0 + 8 * k);
          Chunk z_bits, s_bits;
          LoadHalfChunk(zeros, 0, kChunkElems, Aligned(zeros, 16), &z_bits);
          LoadHalfChunk(zeros + 2 * channels, 0, kChunkElems, Aligned(zeros + 2 * channels, 16),
                        &s_bits);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            z[i] = Bf16ToFloat(ChunkElem(z_bits, i));
            s[i] = Bf16ToFloat(ChunkElem(s_bits, i));
          }
        } else {  // a pair per group of 32, after the row's codes (8 elements: one group)
          const size_t group = (c0 + 8 * k) / kInt4GroupElems;
          const float zg = Bf16ToFloat(LoadU16Unaligned(codes + channels / 2 + 2 * group));
          const float sg =
              Bf16ToFloat(LoadU16Unaligned(codes + channels / 2 + 2 * (groups + group)));
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            z[i] = zg;
            s[i] = sg;
          }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          w[8 * k + i] =
              Bf16ToFloat(DequantizeKiviKElement((q >> (4 * i)) & 0xFu, z[i], s[i], DType::kBF16));
        }
      }
      const uint32_t row = p.rows[static_cast<size_t>(x.block) * tokens + t];
      dst = HeadPtr(p.layers[l].planes[x.plane], row, x.head) + 2 * e0;
    } else {
#pragma unroll
      for (int i = 0; i < kE; ++i) w[i] = 0.0f;
    }
    HadamardLaneTransform<kE>(w, gl, group_lanes);
    if (dst == nullptr) return;
#pragma unroll
    for (int k = 0; k < kE / 8; ++k) {
      StoreScaledChunk<kDType>(dst + 16 * k, w + 8 * k, c_d);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// CODEC_INT4/5/6_ALLOT (codec_math.h "INT4, INT5 and INT6 allot"; the widths
// are the layout's, RowFormat::Allot()). Row 0 of both planes is an INT8 row (the INT8
// kernels over one token per plane, as INT4 Hadamard's). For rows 1.., a head is one group of
// G = 2^group_log2 >= d/8 lanes (head_dim <= kAllotCudaMaxHeadDim, ValidateLayout), lane gl holding
// chunk gl (elements [8 gl, 8 gl + 8); none where gl >= d/8), so a warp covers 32 / G heads at a
// time (a pass), its lanes in channel order.
//   K plane: the channel bounds and widths belong to a whole (block, layer), so one warp owns it.
//     AllotEncodeKKernel: pass by pass, every token turned back (the job's RoPE table;
//     rotate-half partners from the lane d/16 chunks away, interleaved ones in the lane), each
//     channel's lo/hi and its head's largest |y| (reduced over the group), the steps and bounds
//     stored. Then the allotment's threshold (AllotThreshold; every count a warp sum over the
//     passes, from the stored bounds), then per pass the lanes' widths and bit offsets (warp
//     scans in channel order: AllotAssign's steps of gain exactly t taken while they last) and
//     per token the codes: a lane packs its 8 fields (16..64 bits), stores the bytes whose first
//     bit is in its fields, then, after a __syncwarp, ORs its first bits into the byte it shares
//     with the lane before it. Bytes past the last field are zeroed.
//     AllotDecodeKKernel: a warp per (block, layer, kAllotDecodeTokens tokens) computes the same
//     widths from the stored bounds, reads its fields, turns forward and stores.
//   V plane: a group per (block, layer, token >= 1, head) (HadamardParams, one run per unit):
//     the head rotated as INT4 Hadamard's (runs of r = HadamardRun(d) on r / 8 lanes each), a
//     zero point and scale for the head (reduced over the group), 8 codes of b = 4, 5 or 6 bits
//     (b bytes) per lane (AllotEncodeVKernel, AllotDecodeVKernel).
// A key of magnitude >= 2^120 (NaN, Inf) or a rotated value at HadamardLimitBits flags its block.

constexpr uint32_t kAllotDecodeTokens = 8;  // tokens of one K decode unit

struct AllotParams {
  BlockLayout layout;
  const LayerViews* layers;
  const uint32_t* rows;    // this launch's first block
  uint8_t* const* blocks;  // this launch's first block (const-cast for decode: only read there)
  uint8_t* nonfinite;      // encode: this launch's first block, or null
  const float* rope;       // cos [block_tokens][d/2], then sin (EncodeJob::rope)
  uint32_t first_layer;    // decode: the launch's layer 0 is this layer
  uint32_t num_layers;     // layers in the launch
  uint32_t token_units;    // K units per (block, layer): 1 (encode), or per kAllotDecodeTokens
  uint32_t group_log2;     // lanes per head = 1 << group_log2
  uint32_t total_units;
};

// The lane's chunk in a pass over heads [h0, h0 + heads_per_pass).
struct AllotLane {
  uint32_t lane, gl, group, heads_per_pass, chunks, group_lanes;
  uint32_t partner_lane;  // rotate-half: the lane holding the partner chunk
};

__device__ __forceinline__ AllotLane AllotLaneOf(const AllotParams& p) {
  AllotLane a;
  a.lane = threadIdx.x & 31u;
  a.group_lanes = 1u << p.group_log2;
  a.gl = a.lane & (a.group_lanes - 1u);
  a.group = a.lane >> p.group_log2;
  a.heads_per_pass = 32u >> p.group_log2;
  a.chunks = p.layout.row.head_dim / kChunkElems;
  const uint32_t half = a.chunks / 2;
  a.partner_lane = (a.group << p.group_log2) + (a.gl < half ? a.gl + half : a.gl - half);
  return a;
}

// The warp-uniform grid-stride walk of warp units.
template <typename Body>
__device__ __forceinline__ void ForEachWarpUnit(uint32_t total_units, Body body) {
  const uint64_t warp = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const uint64_t num_warps = (static_cast<uint64_t>(gridDim.x) * blockDim.x) >> 5;
  for (uint64_t u = warp; u < total_units; u += num_warps) body(static_cast<uint32_t>(u));
}

__device__ __forceinline__ uint32_t WarpSum(uint32_t v) {
  for (int off = 1; off < 32; off <<= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

// The sum of v over the lanes before this one; *total = the warp's sum.
__device__ __forceinline__ uint32_t WarpExclusiveSum(uint32_t v, uint32_t lane, uint32_t* total) {
  uint32_t inclusive = v;
  for (uint32_t off = 1; off < 32; off <<= 1) {
    const uint32_t o = __shfl_up_sync(kFullMask, inclusive, off);
    if (lane >= off) inclusive += o;
  }
  *total = __shfl_sync(kFullMask, inclusive, 31);
  return inclusive - v;
}

__device__ __forceinline__ float AbsF(float v) { return v < 0.0f ? -v : v; }

// The RoPE partners of the lane's 8 elements (every lane of the warp calls this).
__device__ __forceinline__ void AllotPartners(const AllotParams& p, const AllotLane& a,
                                              const float (&v)[8], float (&pv)[8]) {
  if (p.layout.row.rope_interleaved) {
#pragma unroll
    for (int i = 0; i < 8; ++i) pv[i] = v[i ^ 1];
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    const unsigned long long mine =
        FloatToBits(v[i]) | (static_cast<unsigned long long>(FloatToBits(v[i + 1])) << 32);
    const unsigned long long other = __shfl_sync(kFullMask, mine, static_cast<int>(a.partner_lane));
    pv[i] = BitsToFloat(static_cast<uint32_t>(other));
    pv[i + 1] = BitsToFloat(static_cast<uint32_t>(other >> 32));
  }
}

// out = the lane's 8 elements of token t turned back (kForward false) or forward, from the
// elements v and their partners pv (zeros on a lane without a chunk).
template <bool kForward>
__device__ __forceinline__ void AllotTurn(const AllotParams& p, const AllotLane& a, uint32_t t,
                                          const float (&v)[8], const float (&pv)[8],
                                          float (&out)[8]) {
  const uint32_t d = p.layout.row.head_dim;
  const bool inter = p.layout.row.rope_interleaved;
  const uint32_t pairs = d / 2;
  if (a.gl >= a.chunks) {
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = 0.0f;
    return;
  }
  const float* cos_t = p.rope + static_cast<size_t>(t) * pairs;
  const float* sin_t = cos_t + static_cast<size_t>(p.layout.block_tokens) * pairs;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t e = a.gl * kChunkElems + i;
    const uint32_t j = RopePairIndex(e, d, inter);
    const bool first = RopeIsFirst(e, d, inter);
    out[i] = kForward ? TurnForward(v[i], pv[i], cos_t[j], sin_t[j], first)
                      : TurnBack(v[i], pv[i], cos_t[j], sin_t[j], first);
  }
}

// The lane's 8 keys of token t at src (zeros where src is null) turned back into y. Returns
// whether every one lies under 2^120 (NaN and Inf do not). Every lane of the warp calls this.
template <DType kDType>
__device__ __forceinline__ bool AllotTurnBack(const AllotParams& p, const AllotLane& a,
                                              const uint8_t* src, uint32_t t, float (&y)[8]) {
  float x[8];
  if (src != nullptr) {
    LoadLaneElems<kDType, 8>(src, x);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = 0.0f;
  }
  bool ok = true;
#pragma unroll
  for (int i = 0; i < 8; ++i) ok = ok && (FloatToBits(x[i]) & 0x7FFFFFFFu) < kAllotKeyLimitBits;
  float px[8];
  AllotPartners(p, a, x, px);
  AllotTurn<false>(p, a, t, x, px, y);
  return ok;
}

// A (block, layer) K plane's stored parameters: H bf16 steps, H*D int8 lower and upper bounds.
struct AllotKeyParams {
  const uint8_t* steps;
  const int8_t* lower;
  const int8_t* upper;
};

__device__ __forceinline__ AllotKeyParams AllotKeyParamsAt(const RowFormat& row,
                                                           const uint8_t* params) {
  AllotKeyParams k;
  k.steps = params;
  k.lower = reinterpret_cast<const int8_t*>(params + 2 * row.num_heads);
  k.upper = k.lower + row.ElementsPerRow();
  return k;
}

// The lane's channels in the pass from h0: the head, whether it has any, its first channel.
struct AllotChannels {
  uint32_t head;
  bool valid;
  size_t c0;
};

__device__ __forceinline__ AllotChannels AllotChannelsOf(const AllotParams& p, const AllotLane& a,
                                                         uint32_t h0) {
  AllotChannels c;
  c.head = h0 + a.group;
  c.valid = c.head < p.layout.row.num_heads && a.gl < a.chunks;
  c.c0 = static_cast<size_t>(c.head) * p.layout.row.head_dim + a.gl * kChunkElems;
  return c;
}

// AllotRangeBits of the lane's 8 channels (0 where it has none), and their head's step.
__device__ __forceinline__ float AllotLaneRanges(const AllotKeyParams& k, const AllotChannels& c,
                                                 uint32_t (&range)[8]) {
  float step = 0.0f;
  if (c.valid) step = Bf16ToFloat(LoadU16Unaligned(k.steps + 2 * c.head));
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    range[i] = c.valid ? AllotRangeBits(k.lower[c.c0 + i], k.upper[c.c0 + i], step) : 0u;
  }
  return step;
}

// The allotment's threshold t and the steps of gain exactly t it takes (n less the steps gaining
// more), from the stored bounds. Every lane of the warp calls this and gets the same answer.
__device__ __forceinline__ void AllotThresholdOf(const AllotParams& p, const AllotLane& a,
                                                 const AllotKeyParams& k, uint32_t* threshold,
                                                 uint32_t* ties) {
  const uint32_t n = AllotIncrements(p.layout.row.ElementsPerRow(), p.layout.row.Allot());
  auto above = [&](uint32_t mid) {
    uint32_t count = 0;
    for (uint32_t h0 = 0; h0 < p.layout.row.num_heads; h0 += a.heads_per_pass) {
      uint32_t range[8];
      AllotLaneRanges(k, AllotChannelsOf(p, a, h0), range);
#pragma unroll
      for (int i = 0; i < 8; ++i) count += AllotStepsAbove(range[i], mid);
    }
    return WarpSum(count);
  };
  *threshold = AllotThreshold(n, above);
  *ties = n - above(*threshold);
}

// The lane's 8 fields in a row for one pass: widths, zero points, scales and the first bit.
struct AllotFields {
  uint32_t width[8];
  float zero[8], scale[8];
  uint32_t bit;   // the first field's bit offset in the row
  uint32_t bits;  // the fields' total
};

// AllotAssign for the lane's channels of one pass (see AllotKeyWidths), then AllotKeyChannels'
// zero points, scales and bit offsets. *tie_carry and *bit_carry carry the steps of gain exactly
// t offered and the bits of the passes before this one. Every lane of the warp calls this.
__device__ __forceinline__ AllotFields AllotFieldsOf(const AllotParams& p, const AllotLane& a,
                                                     const AllotKeyParams& k,
                                                     const AllotChannels& c, uint32_t threshold,
                                                     uint32_t ties, uint32_t* tie_carry,
                                                     uint32_t* bit_carry) {
  uint32_t range[8];
  const float step = AllotLaneRanges(k, c, range);
  AllotFields f;
  uint32_t offered[8];
  uint32_t lane_offered = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    f.width[i] = c.valid ? kAllotMinBits + AllotStepsAbove(range[i], threshold) : 0u;
    const uint32_t room = c.valid ? kAllotMaxBits - f.width[i] : 0u;
    const uint32_t u = range[i];
    offered[i] = 0;
    if (room > 0) {
      if (threshold == 0) {
        offered[i] = u == 0 ? room : 0u;
      } else if (u > threshold && ((u - threshold) & (kAllotExponentOne - 1u)) == 0 &&
                 (u - threshold) >> 23 == f.width[i]) {
        offered[i] = 1;
      }
    }
    lane_offered += offered[i];
  }
  uint32_t total = 0;
  uint32_t before = *tie_carry + WarpExclusiveSum(lane_offered, a.lane, &total);
  *tie_carry += total;
  uint32_t bits = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t left = before >= ties ? 0u : ties - before;
    f.width[i] += offered[i] < left ? offered[i] : left;
    before += offered[i];
    bits += f.width[i];
  }
  f.bits = bits;
  f.bit = *bit_carry + WarpExclusiveSum(bits, a.lane, &total);
  *bit_carry += total;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    f.zero[i] = 0.0f;
    f.scale[i] = 0.0f;
    if (f.width[i] == 0) continue;
    const float lo = static_cast<float>(k.lower[c.c0 + i]) * step;
    const float hi = static_cast<float>(k.upper[c.c0 + i]) * step;
    f.zero[i] = lo;
    f.scale[i] = Bf16ToFloat(AsymScaleBf16(lo, hi, (1u << f.width[i]) - 1u));
  }
  return f;
}

// Stores the lane's 8 codes into its fields of `row` (see the section's comment). Every lane of
// the warp calls this.
__device__ __forceinline__ void AllotStoreFields(uint8_t* row, const AllotFields& f,
                                                 const uint32_t (&q)[8]) {
  uint64_t v = 0;
  uint32_t pos = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (f.width[i] == 0) continue;
    v |= static_cast<uint64_t>(q[i]) << pos;
    pos += f.width[i];
  }
  const uint32_t shift = f.bit & 7u;
  const uint64_t lo = v << shift;                                                  // bytes 0..7
  const uint32_t hi = shift != 0 ? static_cast<uint32_t>(v >> (64 - shift)) : 0u;  // byte 8
  const uint32_t base = f.bit >> 3;
  const uint32_t end = (f.bit + f.bits + 7) >> 3;
  for (uint32_t b = (f.bit + 7) >> 3; b < end; ++b) {
    const uint32_t rel = b - base;
    row[b] = static_cast<uint8_t>(rel < 8 ? lo >> (8 * rel) : hi);
  }
  __syncwarp();  // the byte before this lane's first whole one is the lane before it's
  if (shift != 0 && f.bits > 0) row[base] = static_cast<uint8_t>(row[base] | (lo & 0xFFu));
}

// The lane's 8 codes from its fields of `row` (zeros where it has none).
__device__ __forceinline__ void AllotLoadFields(const uint8_t* row, const AllotFields& f,
                                                uint32_t (&q)[8]) {
  uint64_t lo = 0;
  uint32_t hi = 0;
  if (f.bits > 0) {
    const uint32_t base = f.bit >> 3;
    const uint32_t last = (f.bit + f.bits - 1) >> 3;
    for (uint32_t b = base; b <= last; ++b) {
      const uint32_t rel = b - base;
      if (rel < 8) {
        lo |= static_cast<uint64_t>(row[b]) << (8 * rel);
      } else {
        hi = row[b];
      }
    }
  }
  const uint32_t shift = f.bit & 7u;
  const uint64_t v = (lo >> shift) | (shift != 0 ? static_cast<uint64_t>(hi) << (64 - shift) : 0);
  uint32_t pos = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    q[i] = f.width[i] == 0 ? 0u : static_cast<uint32_t>(v >> pos) & ((1u << f.width[i]) - 1u);
    pos += f.width[i];
  }
}

template <DType kDType>
__global__ void __launch_bounds__(kMaxThreadsPerCta) AllotEncodeKKernel(const AllotParams p) {
  const AllotLane a = AllotLaneOf(p);
  const RowFormat& row = p.layout.row;
  const uint32_t tokens = p.layout.block_tokens;
  const size_t row_bytes = AllotKeyRowBytes(row.ElementsPerRow(), row.Allot());
  ForEachWarpUnit(p.total_units, [&](uint32_t u) {
    const uint32_t b = u / p.num_layers;
    const uint32_t l = u - b * p.num_layers;
    const uint32_t* rows = p.rows + static_cast<size_t>(b) * tokens;
    const StridedView& view = p.layers[l].planes[0];
    uint8_t* plane = p.blocks[b] + p.layout.PlaneOffset(l, 0);
    uint8_t* params = plane + row.PlaneRowOffset(0, tokens);
    auto* lower = reinterpret_cast<int8_t*>(params + 2 * row.num_heads);
    int8_t* upper = lower + row.ElementsPerRow();

    // The turned keys' bounds per channel and the heads' steps.
    bool ok = true;
    for (uint32_t h0 = 0; h0 < row.num_heads; h0 += a.heads_per_pass) {
      const AllotChannels c = AllotChannelsOf(p, a, h0);
      float lo[8], hi[8], y[8];
      float m = 0.0f;
      for (uint32_t t = 1; t < tokens; ++t) {
        const uint8_t* src =
            c.valid ? HeadPtr(view, rows[t], c.head) + 2 * kChunkElems * a.gl : nullptr;
        ok = AllotTurnBack<kDType>(p, a, src, t, y) && ok;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          lo[i] = t == 1 ? y[i] : MinF(lo[i], y[i]);
          hi[i] = t == 1 ? y[i] : MaxF(hi[i], y[i]);
          m = MaxF(m, AbsF(y[i]));
        }
      }
      for (uint32_t off = 1; off < a.group_lanes; off <<= 1) {
        m = MaxF(m, __shfl_xor_sync(kFullMask, m, static_cast<int>(off)));
      }
      // Bounds only from keys the codec takes (a NaN's or an Inf's quotient has no int8 value);
      // a block with any other is flagged below.
      ok = GroupAllTrue(ok, 32);
      if (c.valid && ok) {
        const uint16_t step_bits = AllotStepBf16(m);
        const float step = Bf16ToFloat(step_bits);
        if (a.gl == 0) StoreU16Unaligned(params + 2 * c.head, step_bits);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          lower[c.c0 + i] = AllotLowerSteps(lo[i], step);
          upper[c.c0 + i] = AllotUpperSteps(hi[i], step);
        }
      }
    }
    if (!ok) {
      if (a.lane == 0 && p.nonfinite != nullptr) p.nonfinite[b] = 1;
      return;
    }
    __syncwarp();  // every lane reads its head's step, stored by the head's first lane

    const AllotKeyParams k = AllotKeyParamsAt(row, params);
    uint32_t threshold = 0, ties = 0;
    AllotThresholdOf(p, a, k, &threshold, &ties);
    uint32_t tie_carry = 0, bit_carry = 0;
    for (uint32_t h0 = 0; h0 < row.num_heads; h0 += a.heads_per_pass) {
      const AllotChannels c = AllotChannelsOf(p, a, h0);
      const AllotFields f = AllotFieldsOf(p, a, k, c, threshold, ties, &tie_carry, &bit_carry);
      for (uint32_t t = 1; t < tokens; ++t) {
        const uint8_t* src =
            c.valid ? HeadPtr(view, rows[t], c.head) + 2 * kChunkElems * a.gl : nullptr;
        float y[8];
        AllotTurnBack<kDType>(p, a, src, t, y);  // the same bits as above
        uint32_t q[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          q[i] = f.width[i] == 0
                     ? 0u
                     : QuantizeAsymElement(y[i], f.zero[i], f.scale[i], (1u << f.width[i]) - 1u);
        }
        AllotStoreFields(plane + row.PlaneRowOffset(0, t), f, q);
      }
    }
    // Bytes past the last field (fewer bits taken than the row holds: ranges of zero).
    for (uint32_t t = 1; t < tokens; ++t) {
      uint8_t* codes = plane + row.PlaneRowOffset(0, t);
      for (size_t i = (bit_carry + 7) / 8 + a.lane; i < row_bytes; i += 32) codes[i] = 0;
    }
  });
}

template <DType kDType>
__global__ void __launch_bounds__(kMaxThreadsPerCta) AllotDecodeKKernel(const AllotParams p) {
  const AllotLane a = AllotLaneOf(p);
  const RowFormat& row = p.layout.row;
  const uint32_t tokens = p.layout.block_tokens;
  ForEachWarpUnit(p.total_units, [&](uint32_t u) {
    const uint32_t per_block = p.num_layers * p.token_units;
    const uint32_t b = u / per_block;
    u -= b * per_block;
    const uint32_t l = u / p.token_units + p.first_layer;
    const uint32_t t_begin = 1 + (u % p.token_units) * kAllotDecodeTokens;
    const uint32_t t_end =
        t_begin + kAllotDecodeTokens < tokens ? t_begin + kAllotDecodeTokens : tokens;
    const uint32_t* rows = p.rows + static_cast<size_t>(b) * tokens;
    const StridedView& view = p.layers[l].planes[0];
    const uint8_t* plane = p.blocks[b] + p.layout.PlaneOffset(l, 0);
    const AllotKeyParams k = AllotKeyParamsAt(row, plane + row.PlaneRowOffset(0, tokens));
    uint32_t threshold = 0, ties = 0;
    AllotThresholdOf(p, a, k, &threshold, &ties);
    uint32_t tie_carry = 0, bit_carry = 0;
    for (uint32_t h0 = 0; h0 < row.num_heads; h0 += a.heads_per_pass) {
      const AllotChannels c = AllotChannelsOf(p, a, h0);
      const AllotFields f = AllotFieldsOf(p, a, k, c, threshold, ties, &tie_carry, &bit_carry);
      for (uint32_t t = t_begin; t < t_end; ++t) {
        uint32_t q[8];
        AllotLoadFields(plane + row.PlaneRowOffset(0, t), f, q);
        float y[8], py[8], x[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) y[i] = DequantizeAsymFloat(q[i], f.zero[i], f.scale[i]);
        AllotPartners(p, a, y, py);
        AllotTurn<true>(p, a, t, y, py, x);
        if (!c.valid) continue;
        // x * 1 is x: the reference stores x itself.
        StoreScaledChunk<kDType>(HeadPtr(view, rows[t], c.head) + 2 * kChunkElems * a.gl, x, 1.0f);
      }
    }
  });
}

// V rows 1..: a unit per (block, layer, token - 1, head), its group's lanes a chunk each.
template <DType kDType>
__global__ void __launch_bounds__(kMaxThreadsPerCta) AllotEncodeVKernel(const HadamardParams p) {
  const uint32_t d = p.layout.row.head_dim;
  const uint32_t chunks = d / kChunkElems;
  const uint32_t tokens = p.layout.block_tokens;
  const AllotBits bits = p.layout.row.Allot();
  const uint32_t top = AllotValueTop(bits);
  const size_t code_bytes = AllotValueCodeBytes(p.layout.row.ElementsPerRow(), bits);
  const float e = HadamardEncodeFactor(p.run);
  const uint32_t limit = HadamardLimitBits(p.run);
  const uint32_t run_lanes = p.run / kChunkElems;
  ForEachHadamardUnit(p, [&](const HadamardUnit& x, uint32_t gl, uint32_t group_lanes) {
    const uint32_t t = x.token + 1;
    const bool valid = x.valid && gl < chunks;
    const uint8_t* src = nullptr;
    if (valid) {
      const uint32_t r = p.rows[static_cast<size_t>(x.block) * tokens + t];
      src = HeadPtr(p.layers[x.layer].planes[1], r, x.head) + 2 * kChunkElems * gl;
    }
    float y[8];
    const bool finite = RotateLane<kDType, 8>(src, gl, run_lanes, e, limit, y);
    const bool store = GroupAllTrue(finite, group_lanes) && x.valid;
    if (x.valid && !store && gl == 0 && p.nonfinite != nullptr) p.nonfinite[x.block] = 1;
    float lo = BitsToFloat(0x7F800000u);  // +Inf and -Inf: no elements
    float hi = BitsToFloat(0xFF800000u);
    if (valid) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        lo = MinF(lo, y[i]);
        hi = MaxF(hi, y[i]);
      }
    }
    for (uint32_t off = 1; off < group_lanes; off <<= 1) {  // lo and hi in one 64-bit shuffle
      const unsigned long long other = __shfl_xor_sync(
          kFullMask, FloatToBits(lo) | (static_cast<unsigned long long>(FloatToBits(hi)) << 32),
          static_cast<int>(off));
      lo = MinF(lo, BitsToFloat(static_cast<uint32_t>(other)));
      hi = MaxF(hi, BitsToFloat(static_cast<uint32_t>(other >> 32)));
    }
    if (!store) return;
    uint8_t* row = p.blocks[x.block] + p.layout.RowOffset(x.layer, 1, t);
    uint8_t* zeros = row + code_bytes;
    uint8_t* scales = zeros + 2 * p.layout.row.num_heads;
    const uint16_t zb = KiviKZeroBits(lo, DType::kBF16);
    const uint16_t sb = AsymScaleBf16(lo, hi, top);
    if (gl == 0) {
      StoreU16Unaligned(zeros + 2 * x.head, zb);
      StoreU16Unaligned(scales + 2 * x.head, sb);
    }
    if (!valid) return;
    const float z = Bf16ToFloat(zb);
    const float s = Bf16ToFloat(sb);
    uint64_t packed = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      packed |= static_cast<uint64_t>(QuantizeAsymElement(y[i], z, s, top)) << (bits.value * i);
    }
    uint8_t* codes = row + (static_cast<size_t>(x.head) * chunks + gl) * bits.value;
    for (uint32_t i = 0; i < bits.value; ++i) codes[i] = static_cast<uint8_t>(packed >> (8 * i));
  });
}

template <DType kDType>
__global__ void __launch_bounds__(kMaxThreadsPerCta) AllotDecodeVKernel(const HadamardParams p) {
  const uint32_t d = p.layout.row.head_dim;
  const uint32_t chunks = d / kChunkElems;
  const uint32_t tokens = p.layout.block_tokens;
  const AllotBits bits = p.layout.row.Allot();
  const uint32_t top = AllotValueTop(bits);
  const size_t code_bytes = AllotValueCodeBytes(p.layout.row.ElementsPerRow(), bits);
  const float c_d = HadamardDecodeFactor(p.run);
  const uint32_t run_lanes = p.run / kChunkElems;
  ForEachHadamardUnit(p, [&](const HadamardUnit& x, uint32_t gl, uint32_t) {
    const uint32_t t = x.token + 1;
    const uint32_t l = x.layer + p.first_layer;
    const bool valid = x.valid && gl < chunks;
    float w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = 0.0f;
    if (valid) {
      const uint8_t* row = p.blocks[x.block] + p.layout.RowOffset(l, 1, t);
      const uint8_t* zeros = row + code_bytes;
      const float z = Bf16ToFloat(LoadU16Unaligned(zeros + 2 * x.head));
      const float s =
          Bf16ToFloat(LoadU16Unaligned(zeros + 2 * p.layout.row.num_heads + 2 * x.head));
      const uint8_t* codes = row + (static_cast<size_t>(x.head) * chunks + gl) * bits.value;
      uint64_t packed = 0;
      for (uint32_t i = 0; i < bits.value; ++i)
        packed |= static_cast<uint64_t>(codes[i]) << (8 * i);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t q = static_cast<uint32_t>(packed >> (bits.value * i)) & top;
        w[i] = Bf16ToFloat(FloatToBf16Sat(DequantizeAsymFloat(q, z, s)));
      }
    }
    HadamardLaneTransform<8>(w, gl, run_lanes);
    if (!valid) return;
    const uint32_t r = p.rows[static_cast<size_t>(x.block) * tokens + t];
    StoreScaledChunk<kDType>(HeadPtr(p.layers[l].planes[1], r, x.head) + 2 * kChunkElems * gl, w,
                             c_d);
  });
}

// ---------------------------------------------------------------------------------------------
// RAW: the input dtype's bytes as-is, in both directions. Same unit order; no reductions.

struct RawParams {
  BlockLayout layout;
  UnitShape shape;
  const LayerViews* layers;
  const uint32_t* rows;
  uint8_t* const* blocks;  // const-cast for decode; only read when !kEncode
  uint32_t first_layer;
  uint32_t total_units;
  uint32_t group_log2;
};

template <bool kEncode>
__global__ void __launch_bounds__(kMaxThreadsPerCta) RawKernel(const RawParams p) {
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t group_lanes = 1u << p.group_log2;
  const uint32_t gl = lane & (group_lanes - 1u);
  const uint32_t groups_per_warp = 32u >> p.group_log2;
  const uint64_t first_group =
      ((static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5) * groups_per_warp +
      (lane >> p.group_log2);
  const uint64_t num_groups =
      ((static_cast<uint64_t>(gridDim.x) * blockDim.x) >> 5) * groups_per_warp;
  const uint32_t d = p.layout.row.head_dim;
  for (uint64_t u = first_group; u < p.total_units; u += num_groups) {
    uint32_t b, l, pl, t, h;
    p.shape.Decompose(static_cast<uint32_t>(u), &b, &l, &pl, &t, &h);
    l += p.first_layer;
    uint8_t* stored = p.blocks[b] + p.layout.RowOffset(l, pl, t) + static_cast<size_t>(h) * d * 2;
    uint8_t* engine = HeadPtr(p.layers[l].planes[pl],
                              p.rows[static_cast<size_t>(b) * p.layout.block_tokens + t], h);
    const uint8_t* src = kEncode ? engine : stored;
    uint8_t* dst = kEncode ? stored : engine;
    const bool aligned = Aligned(src, 16) && Aligned(dst, 16);
    for (uint32_t e0 = gl * kChunkElems; e0 < d; e0 += group_lanes * kChunkElems) {
      if (aligned && e0 + kChunkElems <= d) {
        *reinterpret_cast<uint4*>(dst + 2 * e0) =
            __ldcs(reinterpret_cast<const uint4*>(src + 2 * e0));
      } else {
        const uint32_t n = 2 * min(kChunkElems, d - e0);
        for (uint32_t i = 0; i < n; ++i) dst[2 * e0 + i] = src[2 * e0 + i];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

std::string CudaErrorText(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + " (" + cudaGetErrorString(err) + ")";
}

Status CheckLaunch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status::Ok();
  return Internal(std::string(what) + ": " + CudaErrorText(err));
}

// SM count of the current device, cached per device (attribute queries are cheap but not free).
StatusOr<uint32_t> CurrentDeviceSmCount() {
  constexpr int kMaxCachedDevices = 64;
  static std::atomic<uint32_t> cache[kMaxCachedDevices];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Internal("cudaGetDevice: " + CudaErrorText(err));
  }
  if (device >= 0 && device < kMaxCachedDevices) {
    const uint32_t cached = cache[device].load(std::memory_order_relaxed);
    if (cached != 0) return cached;
  }
  int sms = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess || sms <= 0) {
    cudaGetLastError();
    return Internal("cudaDeviceGetAttribute(MultiProcessorCount): " + CudaErrorText(err));
  }
  if (device >= 0 && device < kMaxCachedDevices) {
    cache[device].store(static_cast<uint32_t>(sms), std::memory_order_relaxed);
  }
  return static_cast<uint32_t>(sms);
}

Status ValidateLayout(const BlockLayout& lay, const char* what) {
  const std::string w(what);
  if (lay.row.num_heads == 0) return InvalidArgument(w + ": layout.row.num_heads is 0");
  if (lay.row.head_dim == 0 || lay.row.head_dim > cuda_detail::kMaxHeadDim) {
    return InvalidArgument(w + ": layout.row.head_dim " + std::to_string(lay.row.head_dim) +
                           " outside [1, " + std::to_string(cuda_detail::kMaxHeadDim) + "]");
  }
  if (lay.row.dtype != DType::kBF16 && lay.row.dtype != DType::kFP16) {
    return InvalidArgument(w + ": layout.row.dtype is not BF16 or FP16");
  }
  if (lay.row.codec != CodecKind::kInt8PerHead && lay.row.codec != CodecKind::kRaw &&
      lay.row.codec != CodecKind::kFp8E4m3PerHead && lay.row.codec != CodecKind::kInt4G32PerHead &&
      lay.row.codec != CodecKind::kInt4Kivi && lay.row.codec != CodecKind::kInt4Hadamard &&
      !lay.row.IsAllot()) {
    return InvalidArgument(w + ": layout.row.codec is unknown");
  }
  if (lay.row.IsAllot()) {
    if (lay.row.head_dim % kInt4GroupElems != 0 || lay.row.head_dim > kAllotCudaMaxHeadDim) {
      return InvalidArgument(w + ": layout.row.head_dim " + std::to_string(lay.row.head_dim) +
                             " is not a multiple of 32 up to " +
                             std::to_string(kAllotCudaMaxHeadDim) + " (" +
                             CodecContractName(lay.row.codec) + "'s CUDA kernels)");
    }
    if (lay.kv_planes != 2) {
      return InvalidArgument(w + ": layout.kv_planes must be 2 for " +
                             CodecContractName(lay.row.codec));
    }
  }
  if (CodecNeedsGroupedHeads(lay.row.codec) && lay.row.head_dim % kInt4GroupElems != 0) {
    return InvalidArgument(w + ": layout.row.head_dim " + std::to_string(lay.row.head_dim) +
                           " is not a multiple of 32 (" + CodecContractName(lay.row.codec) + ")");
  }
  if (lay.kv_planes != 1 && lay.kv_planes != 2) {
    return InvalidArgument(w + ": layout.kv_planes must be 1 or 2");
  }
  if (lay.block_tokens == 0) return InvalidArgument(w + ": layout.block_tokens is 0");
  if (lay.num_layers == 0) return InvalidArgument(w + ": layout.num_layers is 0");
  return Status::Ok();
}

Status ValidateConfig(const CudaLaunchConfig& cfg, const char* what) {
  if (cfg.threads_per_cta == 0 || cfg.threads_per_cta % 32 != 0 ||
      cfg.threads_per_cta > kMaxThreadsPerCta) {
    return InvalidArgument(std::string(what) + ": config.threads_per_cta must be a multiple of " +
                           "32 in [32, " + std::to_string(kMaxThreadsPerCta) + "]");
  }
  return Status::Ok();
}

// Grid size: enough CTAs for the units, at most the configured bound.
StatusOr<uint32_t> GridFor(uint64_t total_units, uint32_t units_per_cta,
                           const CudaLaunchConfig& cfg) {
  uint64_t max_ctas = cfg.max_ctas;
  if (max_ctas == 0) {
    HIQ_ASSIGN_OR_RETURN(uint32_t sms, CurrentDeviceSmCount());
    max_ctas = static_cast<uint64_t>(std::max(1u, cfg.ctas_per_sm)) * sms;
  }
  const uint64_t needed = (total_units + units_per_cta - 1) / units_per_cta;
  return static_cast<uint32_t>(std::max<uint64_t>(1, std::min(needed, max_ctas)));
}

// Kernel variants per chunks_per_lane (cuda_detail::PlanGroups): a lane holds kChunks chunks of
// each of kUnits units, all loaded before any is used, so ~16-32 bytes of loads are outstanding
// per lane (decode holds 8-byte code chunks, so it keeps more units in flight).
template <typename Params>
using KernelFn = void (*)(Params);

template <CodecKind kCodec, DType kDType>
KernelFn<EncodeParams> PickEncodeKernel(uint32_t chunks_per_lane, uint32_t* units) {
  switch (chunks_per_lane) {
    case 1:
      *units = 2;
      return EncodeScaledKernel<kCodec, kDType, 1, 2>;
    case 2:
      *units = 1;
      return EncodeScaledKernel<kCodec, kDType, 2, 1>;
    case 4:
      *units = 1;
      return EncodeScaledKernel<kCodec, kDType, 4, 1>;
    case 8:
      *units = 1;
      return EncodeScaledKernel<kCodec, kDType, 8, 1>;
    default:
      return nullptr;
  }
}

template <CodecKind kCodec, DType kDType>
KernelFn<DecodeParams> PickDecodeKernel(uint32_t chunks_per_lane, uint32_t* units) {
  switch (chunks_per_lane) {
    case 1:
      *units = 4;
      return DecodeScaledKernel<kCodec, kDType, 1, 4>;
    case 2:
      *units = 2;
      return DecodeScaledKernel<kCodec, kDType, 2, 2>;
    case 4:
      *units = 1;
      return DecodeScaledKernel<kCodec, kDType, 4, 1>;
    case 8:
      *units = 1;
      return DecodeScaledKernel<kCodec, kDType, 8, 1>;
    default:
      return nullptr;
  }
}

// The kernel for a row format's codec (INT8, FP8, or INT4 rows: INT4's and KIVI's V; INT8 for
// CODEC_INT4_HADAMARD's first rows) and dtype.
KernelFn<EncodeParams> PickEncodeKernelFor(const RowFormat& row, uint32_t chunks_per_lane,
                                           uint32_t* units) {
  const bool bf16 = row.dtype == DType::kBF16;
  if (row.IsInt4Rows()) {
    return bf16
               ? PickEncodeKernel<CodecKind::kInt4G32PerHead, DType::kBF16>(chunks_per_lane, units)
               : PickEncodeKernel<CodecKind::kInt4G32PerHead, DType::kFP16>(chunks_per_lane, units);
  }
  if (row.codec == CodecKind::kFp8E4m3PerHead) {
    return bf16
               ? PickEncodeKernel<CodecKind::kFp8E4m3PerHead, DType::kBF16>(chunks_per_lane, units)
               : PickEncodeKernel<CodecKind::kFp8E4m3PerHead, DType::kFP16>(chunks_per_lane, units);
  }
  return bf16 ? PickEncodeKernel<CodecKind::kInt8PerHead, DType::kBF16>(chunks_per_lane, units)
              : PickEncodeKernel<CodecKind::kInt8PerHead, DType::kFP16>(chunks_per_lane, units);
}

KernelFn<DecodeParams> PickDecodeKernelFor(const RowFormat& row, uint32_t chunks_per_lane,
                                           uint32_t* units) {
  const bool bf16 = row.dtype == DType::kBF16;
  if (row.IsInt4Rows()) {
    return bf16
               ? PickDecodeKernel<CodecKind::kInt4G32PerHead, DType::kBF16>(chunks_per_lane, units)
               : PickDecodeKernel<CodecKind::kInt4G32PerHead, DType::kFP16>(chunks_per_lane, units);
  }
  if (row.codec == CodecKind::kFp8E4m3PerHead) {
    return bf16
               ? PickDecodeKernel<CodecKind::kFp8E4m3PerHead, DType::kBF16>(chunks_per_lane, units)
               : PickDecodeKernel<CodecKind::kFp8E4m3PerHead, DType::kFP16>(chunks_per_lane, units);
  }
  return bf16 ? PickDecodeKernel<CodecKind::kInt8PerHead, DType::kBF16>(chunks_per_lane, units)
              : PickDecodeKernel<CodecKind::kInt8PerHead, DType::kFP16>(chunks_per_lane, units);
}

// Splits [0, num_blocks) into launches of at most kMaxUnitsPerLaunch units and calls
// launch(first_block, blocks_in_launch, units_in_launch) for each.
template <typename Fn>
Status ForEachLaunch(uint32_t num_blocks, uint64_t units_per_block, const char* what, Fn launch) {
  if (units_per_block > cuda_detail::kMaxUnitsPerLaunch) {
    return InvalidArgument(std::string(what) + ": one block has " +
                           std::to_string(units_per_block) + " heads, more than one launch takes");
  }
  const uint32_t blocks_per_launch =
      static_cast<uint32_t>(cuda_detail::kMaxUnitsPerLaunch / units_per_block);
  for (uint64_t b0 = 0; b0 < num_blocks; b0 += blocks_per_launch) {
    const uint32_t n =
        static_cast<uint32_t>(std::min<uint64_t>(blocks_per_launch, num_blocks - b0));
    HIQ_RETURN_IF_ERROR(
        launch(static_cast<uint32_t>(b0), n, static_cast<uint32_t>(n * units_per_block)));
  }
  return Status::Ok();
}

// Sets p.nonfinite where the kernel's parameters have it (the encode kernels' flags).
template <typename Params>
auto SetNonfinite(Params& p, uint8_t* nonfinite, int) -> decltype(void(p.nonfinite = nonfinite)) {
  p.nonfinite = nonfinite;
}
template <typename Params>
void SetNonfinite(Params&, uint8_t*, long) {}

// Launches `kernel` with `p` over every block in ForEachLaunch's pieces, `units_per_cta` units
// per CTA: p.rows, p.blocks and p.nonfinite (where the kernel has it; null stays null) point at
// each piece's first block, p.total_units counts its units. `what` names the launch in errors.
template <typename Params>
Status LaunchOverBlocks(KernelFn<Params> kernel, Params& p, const uint32_t* rows,
                        decltype(Params::blocks) blocks, uint8_t* nonfinite, uint32_t num_blocks,
                        uint32_t block_tokens, uint64_t units_per_block, uint32_t units_per_cta,
                        CUstream_st* stream, const CudaLaunchConfig& config, const char* what) {
  return ForEachLaunch(num_blocks, units_per_block, what,
                       [&](uint32_t b0, uint32_t, uint32_t units) -> Status {
                         p.rows = rows + static_cast<size_t>(b0) * block_tokens;
                         p.blocks = blocks + b0;
                         SetNonfinite(p, nonfinite != nullptr ? nonfinite + b0 : nullptr, 0);
                         p.total_units = units;
                         HIQ_ASSIGN_OR_RETURN(uint32_t grid, GridFor(units, units_per_cta, config));
                         HIQ_LAUNCH(kernel, grid, config.threads_per_cta, stream)(p);
                         return CheckLaunch(what);
                       });
}

// Launches CODEC_INT4_KIVI's K-plane kernel (encode or decode) over layers
// [first_layer, first_layer + num_layers) of every block: one lane per KiviKShape unit.
template <bool kEncode>
Status LaunchKiviK(const BlockLayout& lay, const LayerViews* layers, const uint32_t* rows,
                   uint8_t* const* blocks, uint8_t* nonfinite, uint32_t num_blocks,
                   uint32_t first_layer, uint32_t num_layers, CUstream_st* stream,
                   const CudaLaunchConfig& config, const char* what) {
  const bool bf16 = lay.row.dtype == DType::kBF16;
  KernelFn<KiviKParams> kernel;
  if constexpr (kEncode) {
    kernel = bf16 ? KiviKEncodeKernel<DType::kBF16> : KiviKEncodeKernel<DType::kFP16>;
  } else {
    kernel = bf16 ? KiviKDecodeKernel<DType::kBF16> : KiviKDecodeKernel<DType::kFP16>;
  }
  KiviKParams p{};
  p.layout = lay;
  p.shape = KiviKShape::Make(lay.row.head_dim, lay.row.num_heads, num_layers);
  p.layers = layers;
  p.first_layer = first_layer;
  const uint64_t units_per_block =
      static_cast<uint64_t>(num_layers) * lay.row.num_heads * (lay.row.head_dim / kChunkElems);
  return LaunchOverBlocks(kernel, p, rows, blocks, nonfinite, num_blocks, lay.block_tokens,
                          units_per_block, config.threads_per_cta, stream, config, what);
}

// Launches CODEC_INT4_HADAMARD's rotated rows (tokens 1..block_tokens-1; nothing for one-token
// blocks) over layers [first_layer, first_layer + num_layers) of every block: encode, plane 0's
// kernel and (kv_planes == 2) plane 1's; decode, one kernel for both planes. Row 0 of every plane
// is the caller's (the INT8 row kernels).
template <DType kDType, int kE>
Status LaunchHadamardE(const BlockLayout& lay, const LayerViews* layers, const uint32_t* rows,
                       uint8_t* const* blocks, uint8_t* nonfinite, uint32_t num_blocks,
                       uint32_t first_layer, uint32_t num_layers, bool encode, CUstream_st* stream,
                       const CudaLaunchConfig& config, const char* what) {
  const uint32_t r = HadamardRun(lay.row.head_dim);
  const uint32_t runs = lay.row.head_dim / r;
  const uint32_t rotated = lay.block_tokens - 1;
  HadamardParams p{};
  p.layout = lay;
  p.runs = FastDivmod::Make(runs);
  p.layers = layers;
  p.first_layer = first_layer;
  p.run = r;
  p.group_log2 = Log2Pow2(r / kE);
  const uint32_t units_per_cta = (config.threads_per_cta / 32) * (32u >> p.group_log2);
  // One launch: plane `plane`'s kernel over `tokens` tokens per unit shape and `planes` planes.
  auto launch = [&](KernelFn<HadamardParams> kernel, uint32_t tokens, uint32_t planes) -> Status {
    p.shape = UnitShape::Make(lay.row.num_heads * runs, tokens, planes, num_layers);
    const uint64_t units_per_block =
        static_cast<uint64_t>(num_layers) * planes * tokens * lay.row.num_heads * runs;
    return LaunchOverBlocks(kernel, p, rows, blocks, nonfinite, num_blocks, lay.block_tokens,
                            units_per_block, units_per_cta, stream, config, what);
  };
  if (!encode) return launch(HadamardDecodeKernel<kDType, kE>, rotated, lay.kv_planes);
  HIQ_RETURN_IF_ERROR(launch(HadamardEncodeKKernel<kDType, kE>, 1, 1));
  if (lay.kv_planes == 1) return Status::Ok();
  return launch(HadamardEncodeVKernel<kDType, kE>, rotated, 1);
}

template <DType kDType>
Status LaunchHadamardT(const BlockLayout& lay, const LayerViews* layers, const uint32_t* rows,
                       uint8_t* const* blocks, uint8_t* nonfinite, uint32_t num_blocks,
                       uint32_t first_layer, uint32_t num_layers, bool encode, CUstream_st* stream,
                       const CudaLaunchConfig& config, const char* what) {
  switch (HadamardLaneElems(HadamardRun(lay.row.head_dim))) {
    case 8:
      return LaunchHadamardE<kDType, 8>(lay, layers, rows, blocks, nonfinite, num_blocks,
                                        first_layer, num_layers, encode, stream, config, what);
    case 16:
      return LaunchHadamardE<kDType, 16>(lay, layers, rows, blocks, nonfinite, num_blocks,
                                         first_layer, num_layers, encode, stream, config, what);
    case 32:
      return LaunchHadamardE<kDType, 32>(lay, layers, rows, blocks, nonfinite, num_blocks,
                                         first_layer, num_layers, encode, stream, config, what);
    case 64:
      return LaunchHadamardE<kDType, 64>(lay, layers, rows, blocks, nonfinite, num_blocks,
                                         first_layer, num_layers, encode, stream, config, what);
    default:
      return Internal(std::string(what) + ": no kernel for head_dim " +
                      std::to_string(lay.row.head_dim));
  }
}

Status LaunchHadamard(const BlockLayout& lay, const LayerViews* layers, const uint32_t* rows,
                      uint8_t* const* blocks, uint8_t* nonfinite, uint32_t num_blocks,
                      uint32_t first_layer, uint32_t num_layers, bool encode, CUstream_st* stream,
                      const CudaLaunchConfig& config, const char* what) {
  if (lay.block_tokens < 2) return Status::Ok();  // INT8 rows only
  return lay.row.dtype == DType::kBF16
             ? LaunchHadamardT<DType::kBF16>(lay, layers, rows, blocks, nonfinite, num_blocks,
                                             first_layer, num_layers, encode, stream, config, what)
             : LaunchHadamardT<DType::kFP16>(lay, layers, rows, blocks, nonfinite, num_blocks,
                                             first_layer, num_layers, encode, stream, config, what);
}

// Launches an allot codec's rows 1.. (nothing for one-token blocks) over layers
// [first_layer, first_layer + num_layers) of every block: the K planes' kernel, then the V rows'.
// Row 0 of every plane is the caller's (the INT8 row kernels).
template <DType kDType>
Status LaunchAllotT(const BlockLayout& lay, const LayerViews* layers, const uint32_t* rows,
                    uint8_t* const* blocks, uint8_t* nonfinite, const float* rope,
                    uint32_t num_blocks, uint32_t first_layer, uint32_t num_layers, bool encode,
                    CUstream_st* stream, const CudaLaunchConfig& config, const char* what) {
  const uint32_t rotated = lay.block_tokens - 1;
  const uint32_t group_log2 = Log2Pow2(cuda_detail::PlanGroups(lay.row.head_dim).group_lanes);
  const uint32_t warps_per_cta = config.threads_per_cta / 32;
  AllotParams k{};
  k.layout = lay;
  k.layers = layers;
  k.rope = rope;
  k.first_layer = first_layer;
  k.num_layers = num_layers;
  k.group_log2 = group_log2;
  k.token_units = encode ? 1u : (rotated + kAllotDecodeTokens - 1) / kAllotDecodeTokens;
  HIQ_RETURN_IF_ERROR(LaunchOverBlocks<AllotParams>(
      encode ? AllotEncodeKKernel<kDType> : AllotDecodeKKernel<kDType>, k, rows, blocks, nonfinite,
      num_blocks, lay.block_tokens, static_cast<uint64_t>(num_layers) * k.token_units,
      warps_per_cta, stream, config, what));
  HadamardParams v{};
  v.layout = lay;
  v.shape = UnitShape::Make(lay.row.num_heads, rotated, 1, num_layers);
  v.runs = FastDivmod::Make(1);
  v.layers = layers;
  v.first_layer = first_layer;
  v.run = HadamardRun(lay.row.head_dim);
  v.group_log2 = group_log2;
  return LaunchOverBlocks<HadamardParams>(
      encode ? AllotEncodeVKernel<kDType> : AllotDecodeVKernel<kDType>, v, rows, blocks, nonfinite,
      num_blocks, lay.block_tokens, static_cast<uint64_t>(num_layers) * rotated * lay.row.num_heads,
      warps_per_cta * (32u >> group_log2), stream, config, what);
}

Status LaunchAllot(const BlockLayout& lay, const LayerViews* layers, const uint32_t* rows,
                   uint8_t* const* blocks, uint8_t* nonfinite, const float* rope,
                   uint32_t num_blocks, uint32_t first_layer, uint32_t num_layers, bool encode,
                   CUstream_st* stream, const CudaLaunchConfig& config, const char* what) {
  if (lay.block_tokens < 2) return Status::Ok();  // INT8 rows only
  if (rope == nullptr) {
    return InvalidArgument(std::string(what) + ": job.rope must be set for " +
                           CodecContractName(lay.row.codec));
  }
  return lay.row.dtype == DType::kBF16
             ? LaunchAllotT<DType::kBF16>(lay, layers, rows, blocks, nonfinite, rope, num_blocks,
                                          first_layer, num_layers, encode, stream, config, what)
             : LaunchAllotT<DType::kFP16>(lay, layers, rows, blocks, nonfinite, rope, num_blocks,
                                          first_layer, num_layers, encode, stream, config, what);
}

size_t Align16(size_t n) { return (n + 15) & ~size_t{15}; }

struct ArraysLayout {
  size_t layers = 0, blocks = 0, rows = 0, rope = 0, total = 0;
};

ArraysLayout ArraysLayoutFor(const BlockLayout& lay, uint32_t num_blocks) {
  ArraysLayout a;
  a.layers = 0;
  a.blocks = Align16(sizeof(LayerViews) * lay.num_layers);
  a.rows = a.blocks + Align16(sizeof(uint8_t*) * num_blocks);
  a.rope = a.rows + Align16(sizeof(uint32_t) * static_cast<size_t>(num_blocks) * lay.block_tokens);
  a.total = a.rope + Align16(sizeof(float) * RopeTableFloats(lay));
  return a;
}

Status StageArrays(const BlockLayout& lay, const LayerViews* layers, const void* blocks,
                   const uint32_t* rows, const float* rope, uint32_t num_blocks, void* host_scratch,
                   void* device_scratch, size_t scratch_bytes, CUstream_st* stream,
                   const char* what, ArraysLayout* out) {
  const std::string w(what);
  if (layers == nullptr) return InvalidArgument(w + ": job.layers is null");
  if (num_blocks > 0 && (blocks == nullptr || rows == nullptr)) {
    return InvalidArgument(w + ": job.blocks or job.rows is null");
  }
  if (host_scratch == nullptr || device_scratch == nullptr) {
    return InvalidArgument(w + ": scratch buffer is null");
  }
  if ((reinterpret_cast<uintptr_t>(host_scratch) & 15) != 0 ||
      (reinterpret_cast<uintptr_t>(device_scratch) & 15) != 0) {
    return InvalidArgument(w + ": scratch buffers must be 16-byte aligned");
  }
  if (RopeTableFloats(lay) > 0 && rope == nullptr) {
    return InvalidArgument(w + ": job.rope is null (" + CodecContractName(lay.row.codec) +
                           " needs its RoPE table)");
  }
  const ArraysLayout a = ArraysLayoutFor(lay, num_blocks);
  if (scratch_bytes < a.total) {
    return InvalidArgument(w + ": scratch_bytes " + std::to_string(scratch_bytes) + " < " +
                           std::to_string(a.total) + " needed");
  }
  uint8_t* h = static_cast<uint8_t*>(host_scratch);
  std::memcpy(h + a.layers, layers, sizeof(LayerViews) * lay.num_layers);
  if (num_blocks > 0) {
    std::memcpy(h + a.blocks, blocks, sizeof(uint8_t*) * num_blocks);
    std::memcpy(h + a.rows, rows,
                sizeof(uint32_t) * static_cast<size_t>(num_blocks) * lay.block_tokens);
  }
  if (RopeTableFloats(lay) > 0) std::memcpy(h + a.rope, rope, sizeof(float) * RopeTableFloats(lay));
  const cudaError_t err =
      cudaMemcpyAsync(device_scratch, host_scratch, a.total, cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Internal(w + ": cudaMemcpyAsync of the job arrays: " + CudaErrorText(err));
  }
  *out = a;
  return Status::Ok();
}

}  // namespace

Status LaunchEncode(const EncodeJob& job, CUstream_st* stream, const CudaLaunchConfig& config) {
  constexpr const char* kWhat = "LaunchEncode";
  HIQ_RETURN_IF_ERROR(ValidateLayout(job.layout, kWhat));
  HIQ_RETURN_IF_ERROR(ValidateConfig(config, kWhat));
  if (job.num_blocks == 0) return Status::Ok();
  if (job.layers == nullptr || job.rows == nullptr || job.blocks == nullptr) {
    return InvalidArgument("LaunchEncode: job.layers, job.rows and job.blocks must be set");
  }
  const BlockLayout& lay = job.layout;
  if (job.nonfinite != nullptr) {
    const cudaError_t err = cudaMemsetAsync(job.nonfinite, 0, job.num_blocks, stream);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return Internal("LaunchEncode: cudaMemsetAsync(nonfinite): " + CudaErrorText(err));
    }
  }
  const GroupPlan plan = cuda_detail::PlanGroups(lay.row.head_dim);
  const uint32_t group_log2 = Log2Pow2(plan.group_lanes);
  // The planes stored as rows: all of them, or KIVI's V plane after its K planes' launch.
  uint32_t first_plane = 0;
  uint32_t row_planes = lay.kv_planes;
  if (lay.row.codec == CodecKind::kInt4Kivi) {
    HIQ_RETURN_IF_ERROR(LaunchKiviK<true>(lay, job.layers, job.rows, job.blocks, job.nonfinite,
                                          job.num_blocks, 0, lay.num_layers, stream, config,
                                          "LaunchEncode (CODEC_INT4_KIVI K planes)"));
    if (lay.kv_planes == 1) return Status::Ok();
    first_plane = 1;
    row_planes = lay.kv_planes - 1;
  }
  // The tokens stored as rows: all, or CODEC_INT4_HADAMARD's first (INT8 rows, the kernels below
  // over one token per plane) after its rotated rows' launches.
  uint32_t row_tokens = lay.block_tokens;
  if (lay.row.codec == CodecKind::kInt4Hadamard) {
    HIQ_RETURN_IF_ERROR(LaunchHadamard(lay, job.layers, job.rows, job.blocks, job.nonfinite,
                                       job.num_blocks, 0, lay.num_layers, /*encode=*/true, stream,
                                       config, "LaunchEncode (CODEC_INT4_HADAMARD rotated rows)"));
    row_tokens = 1;
  } else if (lay.row.IsAllot()) {
    HIQ_RETURN_IF_ERROR(LaunchAllot(lay, job.layers, job.rows, job.blocks, job.nonfinite, job.rope,
                                    job.num_blocks, 0, lay.num_layers, /*encode=*/true, stream,
                                    config, "LaunchEncode (allot rows 1..)"));
    row_tokens = 1;
  }
  const uint64_t units_per_block =
      static_cast<uint64_t>(lay.num_layers) * row_planes * row_tokens * lay.row.num_heads;
  const UnitShape shape =
      UnitShape::Make(lay.row.num_heads, row_tokens, row_planes, lay.num_layers);

  if (lay.row.codec == CodecKind::kRaw) {
    RawParams p{};
    p.layout = lay;
    p.shape = shape;
    p.layers = job.layers;
    p.first_layer = 0;
    p.group_log2 = group_log2;
    const uint32_t units_per_cta = (config.threads_per_cta / 32) * (32 / plan.group_lanes);
    return LaunchOverBlocks<RawParams>(RawKernel<true>, p, job.rows, job.blocks, nullptr,
                                       job.num_blocks, lay.block_tokens, units_per_block,
                                       units_per_cta, stream, config, "LaunchEncode (RAW)");
  }

  uint32_t units_per_lane = 0;
  KernelFn<EncodeParams> kernel =
      PickEncodeKernelFor(lay.row, plan.chunks_per_lane, &units_per_lane);
  if (kernel == nullptr) return Internal("LaunchEncode: no kernel for this head_dim");
  EncodeParams p{};
  p.layout = lay;
  p.shape = shape;
  p.layers = job.layers;
  p.first_plane = first_plane;
  p.group_log2 = group_log2;
  const uint32_t units_per_cta =
      (config.threads_per_cta / 32) * (32 / plan.group_lanes) * units_per_lane;
  return LaunchOverBlocks(kernel, p, job.rows, job.blocks, job.nonfinite, job.num_blocks,
                          lay.block_tokens, units_per_block, units_per_cta, stream, config, kWhat);
}

Status LaunchDecodeLayers(const DecodeJob& job, uint32_t first_layer, uint32_t num_layers,
                          CUstream_st* stream, const CudaLaunchConfig& config) {
  constexpr const char* kWhat = "LaunchDecodeLayers";
  HIQ_RETURN_IF_ERROR(ValidateLayout(job.layout, kWhat));
  HIQ_RETURN_IF_ERROR(ValidateConfig(config, kWhat));
  const BlockLayout& lay = job.layout;
  if (num_layers == 0 || first_layer >= lay.num_layers ||
      num_layers > lay.num_layers - first_layer) {
    return InvalidArgument("LaunchDecodeLayers: layers [" + std::to_string(first_layer) + ", " +
                           std::to_string(uint64_t{first_layer} + num_layers) +
                           ") not inside [0, " + std::to_string(lay.num_layers) + ")");
  }
  if (job.num_blocks == 0) return Status::Ok();
  if (job.layers == nullptr || job.rows == nullptr || job.blocks == nullptr) {
    return InvalidArgument("LaunchDecodeLayers: job.layers, job.rows and job.blocks must be set");
  }
  const GroupPlan plan = cuda_detail::PlanGroups(lay.row.head_dim);
  const uint32_t group_log2 = Log2Pow2(plan.group_lanes);
  // The planes stored as rows: all of them, or KIVI's V plane after its K planes' launch.
  uint32_t first_plane = 0;
  uint32_t row_planes = lay.kv_planes;
  if (lay.row.codec == CodecKind::kInt4Kivi) {
    // The K kernel only reads through blocks.
    HIQ_RETURN_IF_ERROR(LaunchKiviK<false>(
        lay, job.layers, job.rows, const_cast<uint8_t* const*>(job.blocks), nullptr, job.num_blocks,
        first_layer, num_layers, stream, config, "LaunchDecodeLayers (CODEC_INT4_KIVI K planes)"));
    if (lay.kv_planes == 1) return Status::Ok();
    first_plane = 1;
    row_planes = lay.kv_planes - 1;
  }
  // The tokens stored as rows: all, or CODEC_INT4_HADAMARD's first (INT8 rows).
  uint32_t row_tokens = lay.block_tokens;
  if (lay.row.codec == CodecKind::kInt4Hadamard) {
    // The decode kernel only reads through blocks.
    HIQ_RETURN_IF_ERROR(
        LaunchHadamard(lay, job.layers, job.rows, const_cast<uint8_t* const*>(job.blocks), nullptr,
                       job.num_blocks, first_layer, num_layers, /*encode=*/false, stream, config,
                       "LaunchDecodeLayers (CODEC_INT4_HADAMARD rotated rows)"));
    row_tokens = 1;
  } else if (lay.row.IsAllot()) {
    // The decode kernels only read through blocks.
    HIQ_RETURN_IF_ERROR(LaunchAllot(lay, job.layers, job.rows,
                                    const_cast<uint8_t* const*>(job.blocks), nullptr, job.rope,
                                    job.num_blocks, first_layer, num_layers, /*encode=*/false,
                                    stream, config, "LaunchDecodeLayers (allot rows 1..)"));
    row_tokens = 1;
  }
  const uint64_t units_per_block =
      static_cast<uint64_t>(num_layers) * row_planes * row_tokens * lay.row.num_heads;
  const UnitShape shape = UnitShape::Make(lay.row.num_heads, row_tokens, row_planes, num_layers);

  if (lay.row.codec == CodecKind::kRaw) {
    RawParams p{};
    p.layout = lay;
    p.shape = shape;
    p.layers = job.layers;
    p.first_layer = first_layer;
    p.group_log2 = group_log2;
    const uint32_t units_per_cta = (config.threads_per_cta / 32) * (32 / plan.group_lanes);
    // RawKernel<false> only reads through blocks.
    return LaunchOverBlocks<RawParams>(RawKernel<false>, p, job.rows,
                                       const_cast<uint8_t* const*>(job.blocks), nullptr,
                                       job.num_blocks, lay.block_tokens, units_per_block,
                                       units_per_cta, stream, config, "LaunchDecodeLayers (RAW)");
  }

  uint32_t units_per_lane = 0;
  KernelFn<DecodeParams> kernel =
      PickDecodeKernelFor(lay.row, plan.chunks_per_lane, &units_per_lane);
  if (kernel == nullptr) return Internal("LaunchDecodeLayers: no kernel for this head_dim");
  DecodeParams p{};
  p.layout = lay;
  p.shape = shape;
  p.layers = job.layers;
  p.first_layer = first_layer;
  p.first_plane = first_plane;
  p.group_log2 = group_log2;
  const uint32_t units_per_cta =
      (config.threads_per_cta / 32) * (32 / plan.group_lanes) * units_per_lane;
  return LaunchOverBlocks(kernel, p, job.rows, job.blocks, nullptr, job.num_blocks,
                          lay.block_tokens, units_per_block, units_per_cta, stream, config, kWhat);
}

size_t JobArraysBytes(const BlockLayout& layout, uint32_t num_blocks) {
  return ArraysLayoutFor(layout, num_blocks).total;
}

Status StageEncodeJob(const EncodeJob& host_job, void* host_scratch, void* device_scratch,
                      size_t scratch_bytes, CUstream_st* stream, EncodeJob* device_job) {
  HIQ_RETURN_IF_ERROR(ValidateLayout(host_job.layout, "StageEncodeJob"));
  ArraysLayout a;
  HIQ_RETURN_IF_ERROR(StageArrays(host_job.layout, host_job.layers, host_job.blocks, host_job.rows,
                                  host_job.rope, host_job.num_blocks, host_scratch, device_scratch,
                                  scratch_bytes, stream, "StageEncodeJob", &a));
  uint8_t* dev = static_cast<uint8_t*>(device_scratch);
  *device_job = host_job;
  device_job->layers = reinterpret_cast<const LayerViews*>(dev + a.layers);
  device_job->blocks = reinterpret_cast<uint8_t* const*>(dev + a.blocks);
  device_job->rows = reinterpret_cast<const uint32_t*>(dev + a.rows);
  device_job->rope =
      RopeTableFloats(host_job.layout) > 0 ? reinterpret_cast<const float*>(dev + a.rope) : nullptr;
  return Status::Ok();
}

Status StageDecodeJob(const DecodeJob& host_job, void* host_scratch, void* device_scratch,
                      size_t scratch_bytes, CUstream_st* stream, DecodeJob* device_job) {
  HIQ_RETURN_IF_ERROR(ValidateLayout(host_job.layout, "StageDecodeJob"));
  ArraysLayout a;
  HIQ_RETURN_IF_ERROR(StageArrays(host_job.layout, host_job.layers, host_job.blocks, host_job.rows,
                                  host_job.rope, host_job.num_blocks, host_scratch, device_scratch,
                                  scratch_bytes, stream, "StageDecodeJob", &a));
  uint8_t* dev = static_cast<uint8_t*>(device_scratch);
  *device_job = host_job;
  device_job->layers = reinterpret_cast<const LayerViews*>(dev + a.layers);
  device_job->blocks = reinterpret_cast<const uint8_t* const*>(dev + a.blocks);
  device_job->rows = reinterpret_cast<const uint32_t*>(dev + a.rows);
  device_job->rope =
      RopeTableFloats(host_job.layout) > 0 ? reinterpret_cast<const float*>(dev + a.rope) : nullptr;
  return Status::Ok();
}

}  // namespace hiqcache::kernels
