#include "codec_cpu.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "codec_cpu.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "codec_cpu_allot.h"
#include "codec_cpu_fp8.h"
#include "codec_cpu_hadamard.h"
#include "codec_cpu_int4.h"
#include "codec_cpu_kivi.h"
#include "codec_math.h"
#include "codec_reference.h"
#include "codec_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace hiqcache::kernels {
namespace HWY_NAMESPACE {

using DF = hn::ScalableTag<float>;
using DI32 = hn::RebindToSigned<DF>;
using DI8 = hn::Rebind<int8_t, DF>;

// Encode works on batches of rows of about kEncodeBatchBytes of input (4 Qwen3-8B rows), at
// most kEncodeBatchMaxRows rows and kEncodeBatchMaxHeads heads: first the amax of every head of
// the batch (its loads are independent, so their DRAM and TLB misses overlap), then the
// prefetch of the next batch, then the codes of this batch from the now cached elements while
// the next one arrives. On the Zen 4 VM (4 KiB pages, shuffled rows, one thread) codec_bench's
// encode took 48-53 ms of CPU time one row at a time whatever the prefetch distance (1-16 rows
// ahead, or none: the prefetches issued there did not help), 38-39 ms with 8-row batches alone,
// 29-31 ms with 4-row batches and the next batch prefetched between the passes.
constexpr size_t kEncodeBatchBytes = 8 << 10;
constexpr uint32_t kEncodeBatchMaxRows = 16;
constexpr uint32_t kEncodeBatchMaxHeads = 256;

// q = rne(x / s) as i32, with the IEEE fp32 quotient (exactly QuantizeElement's).
//
// No clamp to [-127, 127] is needed: |x| <= amax and s = bf16_rne(max(amax, 2^-112) / 127) is
// at least that / 127 * (1 - 2^-8), so |x / s| <= 127.498 and rne(x / s) already lies in
// [-127, 127] (CodecMath.ScaleKeepsCodesInRange checks this for every finite amax).
//
// The division is a real one. A reciprocal multiply with an exact-tie fix-up (x / s can only be
// exactly k + 1/2 or at least 2^-12 relative away from it, so rne(x * fl(1/s)) is wrong only
// at exact ties) gives the same bytes but measured slower on Zen 4: 8.4 against 10.8 GB/s
// single-threaded with the data in L2, as the divider there keeps up with the other ports. Even
// a bare multiply (not these codes) speeds an encode from DRAM by only 5% on 4 KiB pages and 13%
// on 2 MiB pages, where the gather dominates (bench/README.md, "What the division costs").
HWY_INLINE hn::Vec<DI32> QuantizeVec(hn::Vec<DF> x, hn::Vec<DF> vs) {
#if HIQ_CODEC_X86_AVX3
  return hn::Vec<DI32>{_mm512_cvt_roundps_epi32(_mm512_div_ps(x.raw, vs.raw),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
#elif HIQ_CODEC_X86_AVX2
  return hn::Vec<DI32>{_mm256_cvttps_epi32(_mm256_round_ps(
      _mm256_div_ps(x.raw, vs.raw), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))};
#else
  return hn::ConvertTo(DI32(), hn::Round(hn::Div(x, vs)));
#endif
}

// Writes the d codes of a head with scale s.
template <DType kDType>
HWY_INLINE void QuantizeHead(const uint8_t* src, uint32_t d, float s, int8_t* codes) {
  QuantizeHeadWith<kDType>(
      src, d, s, codes, [](hn::Vec<DF> x, hn::Vec<DF> vs) HWY_ATTR { return QuantizeVec(x, vs); },
      [](float x, float scale) { return QuantizeElement(x, scale); });
}

template <DType kDType>
HWY_INLINE void DecodeHead(const int8_t* codes, const uint8_t* scale_in, uint32_t d, uint8_t* dst) {
  const DF df;
  const DI32 di32;
  const DI8 di8;
  const size_t n = hn::Lanes(df);
  const uint32_t vec_end = static_cast<uint32_t>(d - d % n);
  uint16_t s_bits;
  std::memcpy(&s_bits, scale_in, 2);
  const float s = Bf16ToFloat(s_bits);
  const auto vs = hn::Set(df, s);
  uint32_t i = 0;
  for (; i < vec_end; i += n) {
    auto q = hn::ConvertTo(df, hn::PromoteTo(di32, hn::LoadU(di8, codes + i)));
    StoreHalf<kDType>(df, hn::Mul(q, vs), dst + 2 * i);
  }
  for (; i < d; ++i) {
    uint16_t out = DequantizeElement(codes[i], s, kDType);
    std::memcpy(dst + 2 * i, &out, 2);
  }
}

// Encodes one row in two passes: the amax of every head first (all of the row's loads are
// independent, so its cache misses overlap instead of arriving head by head), then the codes
// from the now cached elements.
template <DType kDType>
HWY_INLINE bool EncodeRowT(const RowFormat& fmt, const StridedView& view, uint32_t row,
                           uint8_t* dst) {
  constexpr uint32_t kGroup = 16;  // heads per pass
  const uint32_t d = fmt.head_dim;
  int8_t* codes = reinterpret_cast<int8_t*>(dst);
  uint8_t* scales = dst + fmt.ElementsPerRow();
  uint32_t amax[kGroup];
  // Head h at row_base + h * head_stride: the row's offset (a division for paged views) once per
  // row, not once per head (the code stores may alias the view, so it would be recomputed).
  const uint8_t* row_base = view.Head(row, 0);
  const uint64_t head_stride = view.head_stride;
  for (uint32_t h0 = 0; h0 < fmt.num_heads; h0 += kGroup) {
    const uint32_t h1 = std::min(fmt.num_heads, h0 + kGroup);
    uint32_t worst = 0;
    for (uint32_t h = h0; h < h1; ++h) {
      amax[h - h0] = HeadAmaxBits(row_base + h * head_stride, d);
      worst = std::max(worst, amax[h - h0]);
    }
    if (worst >= InfBits(kDType)) return false;
    for (uint32_t h = h0; h < h1; ++h) {
      const uint16_t s_bits = ScaleBf16FromAmaxBits(static_cast<uint16_t>(amax[h - h0]), kDType);
      QuantizeHead<kDType>(row_base + h * head_stride, d, Bf16ToFloat(s_bits),
                           codes + static_cast<size_t>(h) * d);
      std::memcpy(scales + 2 * h, &s_bits, 2);
    }
  }
  return true;
}

// Decode writes with non-temporal (streaming) stores on x86 where a head's destination is whole
// 64-byte lines (its address and length multiples of 64): a restore's rows go to the engine's KV
// pool, which the engine reads later (after the layer's event), not this thread, so the stores
// need not bring the destination's lines into the cache first (the read for ownership of every
// line: 2 of the 5 bytes of DRAM traffic per element of an INT8 decode). Other heads take ordinary
// stores, with the write prefetch. RAW rows whose heads are back to back stream their whole 64-byte
// lines and store the partial lines at their ends. Encode keeps ordinary stores: the block checksum
// reads each layer right after it is written.
#if HIQ_CODEC_X86_AVX3 || HIQ_CODEC_X86_AVX2
constexpr bool kStreamDecode = true;
#else
constexpr bool kStreamDecode = false;
#endif

// Whether heads of `view` can take streaming stores (rows whose first head is 64-byte aligned).
inline bool StreamsHeads(const RowFormat& fmt, const StridedView& view) {
  return kStreamDecode && fmt.head_dim % 32 == 0 &&
         (fmt.num_heads <= 1 || view.head_stride % 64 == 0);
}

inline bool Aligned64(const void* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; }

// Copies n bytes to dst: whole 64-byte lines of dst with non-temporal stores, the rest with
// ordinary ones. The caller issues StreamFence before anyone else may read dst.
HWY_INLINE void StreamCopy(uint8_t* dst, const uint8_t* src, size_t n) {
  size_t lead = (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64;
  if (lead > n) lead = n;
  std::memcpy(dst, src, lead);
  dst += lead;
  src += lead;
  n -= lead;
  for (; n >= 64; n -= 64, dst += 64, src += 64) {
#if HIQ_CODEC_X86_AVX3
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), _mm512_loadu_si512(src));
#elif HIQ_CODEC_X86_AVX2
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), lo);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), hi);
#else
    std::memcpy(dst, src, 64);
#endif
  }
  std::memcpy(dst, src, n);
}

// Orders this thread's streaming stores before whatever it does next (the end of its work item,
// after which a layer's event may be signalled).
HWY_INLINE void StreamFence() {
#if HIQ_CODEC_X86_AVX3 || HIQ_CODEC_X86_AVX2
  _mm_sfence();
#endif
}

// DecodeHead's values, written with non-temporal stores 64 bytes at a time. REQUIRES: dst
// 64-byte aligned, d % 32 == 0, kStreamDecode.
template <DType kDType>
HWY_INLINE void DecodeHeadStream(const int8_t* codes, const uint8_t* scale_in, uint32_t d,
                                 uint8_t* dst) {
#if HIQ_CODEC_X86_AVX3 || HIQ_CODEC_X86_AVX2
  const DF df;
  const DI32 di32;
  const DI8 di8;
  uint16_t s_bits;
  std::memcpy(&s_bits, scale_in, 2);
  const auto vs = hn::Set(df, Bf16ToFloat(s_bits));
  auto half = [&](uint32_t i) HWY_ATTR {
    return HalfBits<kDType>(
        df, hn::Mul(hn::ConvertTo(df, hn::PromoteTo(di32, hn::LoadU(di8, codes + i))), vs));
  };
  for (uint32_t i = 0; i < d; i += 32) {
#if HIQ_CODEC_X86_AVX3
    // 16 lanes: two vectors of 16 halves make a line.
    const __m512i line =
        _mm512_inserti64x4(_mm512_castsi256_si512(half(i).raw), half(i + 16).raw, 1);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 2 * i), line);
#else
    // 8 lanes: four vectors of 8 halves make a line.
    const __m256i a = _mm256_set_m128i(half(i + 8).raw, half(i).raw);
    const __m256i b = _mm256_set_m128i(half(i + 24).raw, half(i + 16).raw);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 2 * i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 2 * i + 32), b);
#endif
  }
#else
  DecodeHead<kDType>(codes, scale_in, d, dst);
#endif
}

template <DType kDType>
HWY_INLINE void DecodeRowT(const RowFormat& fmt, const uint8_t* src, const StridedView& view,
                           uint32_t row, bool stream) {
  const uint32_t d = fmt.head_dim;
  const int8_t* codes = reinterpret_cast<const int8_t*>(src);
  const uint8_t* scales = src + fmt.ElementsPerRow();
  if (stream && Aligned64(view.Head(row, 0))) {
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      DecodeHeadStream<kDType>(codes + static_cast<size_t>(h) * d, scales + 2 * h, d,
                               view.Head(row, h));
    }
    return;
  }
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    DecodeHead<kDType>(codes + static_cast<size_t>(h) * d, scales + 2 * h, d, view.Head(row, h));
  }
}

// Rows per encode batch for `fmt` (see kEncodeBatchBytes); 0 when a row has too many heads for
// the batch's amax buffer (then rows go one at a time).
inline uint32_t EncodeBatchRows(const RowFormat& fmt) {
  if (fmt.num_heads == 0 || fmt.num_heads > kEncodeBatchMaxHeads) return 0;
  const size_t by_bytes = kEncodeBatchBytes / std::max<size_t>(1, fmt.InputRowBytes());
  const size_t by_heads = kEncodeBatchMaxHeads / fmt.num_heads;
  return static_cast<uint32_t>(
      std::max<size_t>(1, std::min<size_t>({by_bytes, by_heads, kEncodeBatchMaxRows})));
}

template <DType kDType>
bool EncodeRowsT(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                 uint32_t num_rows, uint8_t* dst) {
  const size_t row_bytes = fmt.RowBytes();
  const uint32_t batch = EncodeBatchRows(fmt);
  bool finite = true;
  if (batch == 0) {
    for (uint32_t t = 0; t < num_rows; ++t) {
      if (t + kPrefetchRows < num_rows) PrefetchRow<false>(fmt, view, rows[t + kPrefetchRows]);
      finite &= EncodeRowT<kDType>(fmt, view, rows[t], dst + t * row_bytes);
    }
    return finite;
  }
  const uint32_t heads = fmt.num_heads;
  const uint32_t d = fmt.head_dim;
  const uint64_t head_stride = view.head_stride;
  uint32_t amax[kEncodeBatchMaxHeads];           // [row of the batch][head]
  const uint8_t* row_base[kEncodeBatchMaxRows];  // as in EncodeRowT
  for (uint32_t t0 = 0; t0 < num_rows; t0 += batch) {
    const uint32_t n = std::min(batch, num_rows - t0);
    uint32_t worst = 0;
    for (uint32_t r = 0; r < n; ++r) {
      row_base[r] = view.Head(rows[t0 + r], 0);
      for (uint32_t h = 0; h < heads; ++h) {
        const uint32_t a = HeadAmaxBits(row_base[r] + h * head_stride, d);
        amax[r * heads + h] = a;
        worst = std::max(worst, a);
      }
    }
    const uint32_t next = t0 + n;
    for (uint32_t t = next; t < std::min(num_rows, next + batch); ++t) {
      PrefetchRow<false>(fmt, view, rows[t]);
    }
    if (worst >= InfBits(kDType)) {
      // A NaN or Inf: the rows one by one, as EncodeRowT stops at the first non-finite group.
      for (uint32_t t = t0; t < next; ++t) {
        finite &= EncodeRowT<kDType>(fmt, view, rows[t], dst + t * row_bytes);
      }
      continue;
    }
    for (uint32_t r = 0; r < n; ++r) {
      uint8_t* out = dst + (t0 + r) * row_bytes;
      int8_t* codes = reinterpret_cast<int8_t*>(out);
      uint8_t* scales = out + fmt.ElementsPerRow();
      for (uint32_t h = 0; h < heads; ++h) {
        const uint16_t s_bits =
            ScaleBf16FromAmaxBits(static_cast<uint16_t>(amax[r * heads + h]), kDType);
        QuantizeHead<kDType>(row_base[r] + h * head_stride, d, Bf16ToFloat(s_bits),
                             codes + static_cast<size_t>(h) * d);
        std::memcpy(scales + 2 * h, &s_bits, 2);
      }
    }
  }
  return finite;
}

template <DType kDType>
void DecodeRowsT(const RowFormat& fmt, const uint8_t* src, const StridedView& view,
                 const uint32_t* rows, uint32_t num_rows, bool may_stream) {
  const size_t row_bytes = fmt.RowBytes();
  const bool stream = may_stream && StreamsHeads(fmt, view);
  for (uint32_t t = 0; t < num_rows; ++t) {
    // Streaming stores need no write prefetch: it would fetch the lines they avoid reading.
    if (t + kPrefetchRows < num_rows &&
        !(stream && Aligned64(view.Head(rows[t + kPrefetchRows], 0)))) {
      PrefetchRow<true>(fmt, view, rows[t + kPrefetchRows]);
    }
    DecodeRowT<kDType>(fmt, src + t * row_bytes, view, rows[t], stream);
  }
  if (stream) StreamFence();
}

bool EncodeRow(const RowFormat& fmt, const StridedView& view, uint32_t row, uint8_t* dst) {
  if (fmt.codec == CodecKind::kRaw) return EncodeRowReference(fmt, view, row, dst);
  if (fmt.codec == CodecKind::kFp8E4m3PerHead) return EncodeRowsFp8Simd(fmt, view, &row, 1, dst);
  if (fmt.IsInt4Rows()) return EncodeRowsInt4Simd(fmt, view, &row, 1, dst);
  return fmt.dtype == DType::kBF16 ? EncodeRowT<DType::kBF16>(fmt, view, row, dst)
                                   : EncodeRowT<DType::kFP16>(fmt, view, row, dst);
}

void DecodeRow(const RowFormat& fmt, const uint8_t* src, const StridedView& view, uint32_t row) {
  if (fmt.codec == CodecKind::kRaw) return DecodeRowReference(fmt, src, view, row);
  if (fmt.codec == CodecKind::kFp8E4m3PerHead) return DecodeRowsFp8Simd(fmt, src, view, &row, 1);
  if (fmt.IsInt4Rows()) return DecodeRowsInt4Simd(fmt, src, view, &row, 1);
  if (fmt.dtype == DType::kBF16) {
    DecodeRowT<DType::kBF16>(fmt, src, view, row, false);
  } else {
    DecodeRowT<DType::kFP16>(fmt, src, view, row, false);
  }
}

// Whether a RAW row of `view` is one run of bytes, its heads back to back (as stored): then one
// memcpy moves the row instead of one per head.
inline bool RawRowContiguous(const RowFormat& fmt, const StridedView& view) {
  return fmt.num_heads <= 1 || view.head_stride == static_cast<uint64_t>(fmt.head_dim) * 2;
}

// Encodes rows[0..num_rows) of `view` into consecutive stored rows at `dst`; false when an
// INT8, FP8 or INT4 row held NaN or Inf.
bool EncodeRows(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                uint32_t num_rows, uint8_t* dst) {
  if (fmt.codec == CodecKind::kFp8E4m3PerHead) {
    return EncodeRowsFp8Simd(fmt, view, rows, num_rows, dst);
  }
  if (fmt.IsInt4Rows()) {  // INT4, and KIVI's V rows
    return EncodeRowsInt4Simd(fmt, view, rows, num_rows, dst);
  }
  if (fmt.codec == CodecKind::kRaw) {
    if (RawRowContiguous(fmt, view)) {
      const size_t bytes = fmt.RowBytes();
      for (uint32_t t = 0; t < num_rows; ++t) {
        std::memcpy(dst + t * bytes, view.Head(rows[t], 0), bytes);
      }
      return true;
    }
    for (uint32_t t = 0; t < num_rows; ++t) {
      EncodeRowReference(fmt, view, rows[t], dst + t * fmt.RowBytes());
    }
    return true;
  }
  return fmt.dtype == DType::kBF16 ? EncodeRowsT<DType::kBF16>(fmt, view, rows, num_rows, dst)
                                   : EncodeRowsT<DType::kFP16>(fmt, view, rows, num_rows, dst);
}

// Decodes consecutive stored rows at `src` into rows[0..num_rows) of `view`. may_stream false
// keeps INT8 and RAW rows to ordinary stores: for a destination this thread reads next (the
// scratch copy of split heads), which streaming stores would send to DRAM.
void DecodeRows(const RowFormat& fmt, const uint8_t* src, const StridedView& view,
                const uint32_t* rows, uint32_t num_rows, bool may_stream) {
  if (fmt.codec == CodecKind::kFp8E4m3PerHead) {
    return DecodeRowsFp8Simd(fmt, src, view, rows, num_rows);
  }
  if (fmt.IsInt4Rows()) {  // INT4, and KIVI's V rows
    return DecodeRowsInt4Simd(fmt, src, view, rows, num_rows);
  }
  if (fmt.codec == CodecKind::kRaw) {
    if (RawRowContiguous(fmt, view)) {
      const size_t bytes = fmt.RowBytes();
      for (uint32_t t = 0; t < num_rows; ++t) {
        if (kStreamDecode && may_stream) {
          StreamCopy(view.Head(rows[t], 0), src + t * bytes, bytes);
        } else {
          std::memcpy(view.Head(rows[t], 0), src + t * bytes, bytes);
        }
      }
      StreamFence();
      return;
    }
    for (uint32_t t = 0; t < num_rows; ++t) {
      DecodeRowReference(fmt, src + t * fmt.RowBytes(), view, rows[t]);
    }
  } else if (fmt.dtype == DType::kBF16) {
    DecodeRowsT<DType::kBF16>(fmt, src, view, rows, num_rows, may_stream);
  } else {
    DecodeRowsT<DType::kFP16>(fmt, src, view, rows, num_rows, may_stream);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace hiqcache::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace hiqcache::kernels {

HWY_EXPORT(EncodeRow);
HWY_EXPORT(DecodeRow);
HWY_EXPORT(EncodeRows);
HWY_EXPORT(DecodeRows);

bool EncodeRowSimd(const RowFormat& fmt, const StridedView& view, uint32_t row, uint8_t* dst) {
  return HWY_DYNAMIC_DISPATCH(EncodeRow)(fmt, view, row, dst);
}

void DecodeRowSimd(const RowFormat& fmt, const uint8_t* src, const StridedView& view,
                   uint32_t row) {
  HWY_DYNAMIC_DISPATCH(DecodeRow)(fmt, src, view, row);
}

const char* CpuCodec::TargetName() {
  // The best target that is both compiled in and supported here: the one dispatch picks.
  std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  return targets.empty() ? "none" : hwy::TargetName(targets.front());
}

namespace {
// Rows per parallel decode work item: big enough to amortize dispatch, small enough to balance.
constexpr uint32_t kRowsPerItem = 64;
// A decode work item is split down to this many input bytes (BF16 side) when a loop would
// otherwise have fewer than kItemsPerThread items per thread.
constexpr size_t kMinItemBytes = 16 << 10;
constexpr size_t kItemsPerThread = 4;

// Rows per decode work item for `blocks` blocks of one layer on `threads` threads: a layer of a
// single block (one 64-token Qwen3-8B page: 2 planes x 64 rows) would otherwise give 2 items,
// leaving one thread idle on 2 cores and none at all for a third.
uint32_t DecodeRowsPerItem(const BlockLayout& lay, uint32_t blocks, unsigned threads) {
  const size_t planes = static_cast<size_t>(blocks) * lay.kv_planes;
  const size_t want = kItemsPerThread * threads;
  const uint32_t min_rows = static_cast<uint32_t>(
      std::max<size_t>(1, kMinItemBytes / std::max<size_t>(1, lay.row.InputRowBytes())));
  uint32_t per_item = std::max<uint32_t>(1, std::min(kRowsPerItem, lay.block_tokens));
  while (per_item > min_rows && planes * ((lay.block_tokens + per_item - 1) / per_item) < want) {
    per_item = std::max(min_rows, per_item / 2);
  }
  return per_item;
}

// The row executors read and write a head as one run of elements. A view with split heads
// (StridedView::dim_run) is encoded from a contiguous copy of the work item's rows (GatherHeads)
// and decoded into one (with ordinary stores) that is then scattered (ScatterHeads); the copy
// stays in the thread's cache. RAW rows are scattered straight from the stored rows, which are
// laid out as the copy is. Returns the copy's view; rows `*index` (0, 1, ... n - 1) address it.
StridedView SplitScratch(const RowFormat& fmt, uint32_t n, const uint32_t** index) {
  thread_local std::vector<uint8_t> bytes;
  thread_local std::vector<uint32_t> rows;
  const uint64_t head_bytes = uint64_t{fmt.head_dim} * 2;
  bytes.resize(static_cast<size_t>(n) * fmt.num_heads * head_bytes);
  if (rows.size() < n) {
    const size_t old = rows.size();
    rows.resize(n);
    for (size_t i = old; i < n; ++i) rows[i] = static_cast<uint32_t>(i);
  }
  *index = rows.data();
  StridedView v;
  v.base = bytes.data();
  v.row_stride = fmt.num_heads * head_bytes;
  v.head_stride = head_bytes;
  v.num_rows = n;
  return v;
}

// Encodes `n` rows of `view` into consecutive stored rows at `dst` (EncodeRows).
bool EncodeViewRows(const RowFormat& fmt, const StridedView& view, const uint32_t* rows, uint32_t n,
                    uint8_t* dst) {
  if (view.dim_run == 0) return HWY_DYNAMIC_DISPATCH(EncodeRows)(fmt, view, rows, n, dst);
  if (fmt.codec == CodecKind::kRaw) {  // stored RAW rows are GatherHeads' layout: no copy between
    GatherHeads(view, fmt.num_heads, fmt.head_dim, rows, n, dst);
    return true;
  }
  const uint32_t* index = nullptr;
  const StridedView copy = SplitScratch(fmt, n, &index);
  GatherHeads(view, fmt.num_heads, fmt.head_dim, rows, n, copy.base);
  return HWY_DYNAMIC_DISPATCH(EncodeRows)(fmt, copy, index, n, dst);
}

// Encodes plane p of one (block, layer) of a codec stored per plane (KIVI's K plane:
// EncodeKiviKPlaneSimd; Hadamard's planes: EncodeHadamardPlaneSimd) from `view`, split heads
// from a contiguous copy.
bool EncodeViewPlane(const RowFormat& fmt, uint32_t p, const StridedView& view,
                     const uint32_t* rows, uint32_t n, uint8_t* dst) {
  auto encode = [&](const StridedView& from, const uint32_t* from_rows) {
    return fmt.codec == CodecKind::kInt4Hadamard
               ? EncodeHadamardPlaneSimd(fmt, p, from, from_rows, n, dst)
           : fmt.IsAllot() ? EncodeAllotPlaneSimd(fmt, p, from, from_rows, n, dst)
                           : EncodeKiviKPlaneSimd(fmt, from, from_rows, n, dst);
  };
  if (view.dim_run == 0) return encode(view, rows);
  const uint32_t* index = nullptr;
  const StridedView copy = SplitScratch(fmt, n, &index);
  GatherHeads(view, fmt.num_heads, fmt.head_dim, rows, n, copy.base);
  return encode(copy, index);
}

// Whether plane p of the layout is stored per plane (EncodeViewPlane) rather than as rows.
inline bool StoredPerPlane(const BlockLayout& lay, uint32_t p) {
  return lay.row.codec == CodecKind::kInt4Hadamard || lay.row.IsAllot() ||
         (lay.row.codec == CodecKind::kInt4Kivi && p == 0);
}

// Decodes rows [begin, end) of plane p of block b of `layer`.
void DecodeRange(const DecodeJob& job, uint32_t layer, uint32_t b, uint32_t p, uint32_t begin,
                 uint32_t end) {
  const BlockLayout& lay = job.layout;
  const uint8_t* src = job.blocks[b] + lay.RowOffset(layer, p, begin);
  const StridedView& view = job.layers[layer].planes[p];
  const uint32_t* rows = job.rows + static_cast<size_t>(b) * lay.block_tokens + begin;
  const bool per_plane = StoredPerPlane(lay, p);
  auto decode = [&](const StridedView& to, const uint32_t* to_rows, bool may_stream) {
    const uint8_t* plane = job.blocks[b] + lay.PlaneOffset(layer, p);
    if (lay.row.codec == CodecKind::kInt4Hadamard) {
      DecodeHadamardRowsSimd(lay.row, p, plane, lay.block_tokens, begin, end, to, to_rows);
    } else if (lay.row.IsAllot()) {
      DecodeAllotRowsSimd(lay.row, p, plane, lay.block_tokens, begin, end, to, to_rows);
    } else if (per_plane) {
      DecodeKiviKRowsSimd(lay.row, plane, lay.block_tokens, begin, end, to, to_rows);
    } else {
      HWY_DYNAMIC_DISPATCH(DecodeRows)(lay.row, src, to, to_rows, end - begin, may_stream);
    }
  };
  if (view.dim_run == 0) return decode(view, rows, /*may_stream=*/true);
  if (!per_plane && lay.row.codec == CodecKind::kRaw) {
    return ScatterHeads(src, lay.row.num_heads, lay.row.head_dim, view, rows, end - begin);
  }
  const uint32_t* index = nullptr;
  const StridedView copy = SplitScratch(lay.row, end - begin, &index);
  decode(copy, index, /*may_stream=*/false);
  ScatterHeads(copy.base, lay.row.num_heads, lay.row.head_dim, view, rows, end - begin);
}
}  // namespace

CpuCodec::CpuCodec(unsigned threads)
    : pool_(std::make_unique<ThreadPool>(
          threads != 0 ? threads : std::max(1u, std::thread::hardware_concurrency()))) {}

// Work items call HWY_DYNAMIC_DISPATCH themselves rather than sharing a function pointer taken
// once: before the first dispatch in the process the table holds Highway's initializing
// trampoline, which re-runs CPU detection (CPUID, very slow under a hypervisor) on every call
// made through a pointer taken from it.
void CpuCodec::Encode(const EncodeJob& job) {
  const BlockLayout& lay = job.layout;
  if (job.num_blocks == 0) return;
  // One item = one (block, layer) pair: all of its planes and tokens.
  const size_t items = static_cast<size_t>(job.num_blocks) * lay.num_layers;
  std::vector<uint8_t> bad(items, 0);
  pool_->ParallelFor(items, [&](size_t item) {
    const uint32_t b = static_cast<uint32_t>(item / lay.num_layers);
    const uint32_t l = static_cast<uint32_t>(item % lay.num_layers);
    const uint32_t* rows = job.rows + static_cast<size_t>(b) * lay.block_tokens;
    bool finite = true;
    for (uint32_t p = 0; p < lay.kv_planes; ++p) {
      if (StoredPerPlane(lay, p)) {
        finite &= EncodeViewPlane(lay.row, p, job.layers[l].planes[p], rows, lay.block_tokens,
                                  job.blocks[b] + lay.PlaneOffset(l, p));
        continue;
      }
      finite &= EncodeViewRows(lay.row, job.layers[l].planes[p], rows, lay.block_tokens,
                               job.blocks[b] + lay.RowOffset(l, p, 0));
    }
    if (!finite) bad[item] = 1;
    if (job.layer_encoded != nullptr) job.layer_encoded(job.layer_encoded_context, b, l);
  });
  if (job.nonfinite != nullptr) {
    for (uint32_t b = 0; b < job.num_blocks; ++b) {
      uint8_t any = 0;
      for (uint32_t l = 0; l < lay.num_layers; ++l) any |= bad[b * lay.num_layers + l];
      job.nonfinite[b] = any;
    }
  }
}

void CpuCodec::DecodeLayer(const DecodeJob& job, uint32_t layer) {
  const BlockLayout& lay = job.layout;
  if (job.num_blocks == 0) return;
  const uint32_t per_item = DecodeRowsPerItem(lay, job.num_blocks, threads());
  const uint32_t chunks = (lay.block_tokens + per_item - 1) / per_item;
  const size_t items = static_cast<size_t>(job.num_blocks) * lay.kv_planes * chunks;
  pool_->ParallelFor(items, [&](size_t item) {
    const uint32_t c = static_cast<uint32_t>(item % chunks);
    const uint32_t p = static_cast<uint32_t>((item / chunks) % lay.kv_planes);
    const uint32_t b = static_cast<uint32_t>(item / chunks / lay.kv_planes);
    const uint32_t begin = c * per_item;
    DecodeRange(job, layer, b, p, begin, std::min(lay.block_tokens, begin + per_item));
  });
}

// All layers in one loop: a restore without layer events (or a sub-task that signals none) needs
// no layer to finish before the next starts, and one loop costs one hand-off instead of one per
// layer.
void CpuCodec::Decode(const DecodeJob& job) {
  const BlockLayout& lay = job.layout;
  if (job.num_blocks == 0 || lay.num_layers == 0) return;
  const uint32_t per_item = DecodeRowsPerItem(lay, job.num_blocks * lay.num_layers, threads());
  const uint32_t chunks = (lay.block_tokens + per_item - 1) / per_item;
  const size_t per_layer = static_cast<size_t>(job.num_blocks) * lay.kv_planes * chunks;
  pool_->ParallelFor(per_layer * lay.num_layers, [&](size_t item) {
    const uint32_t l = static_cast<uint32_t>(item / per_layer);
    const size_t i = item % per_layer;
    const uint32_t c = static_cast<uint32_t>(i % chunks);
    const uint32_t p = static_cast<uint32_t>((i / chunks) % lay.kv_planes);
    const uint32_t b = static_cast<uint32_t>(i / chunks / lay.kv_planes);
    const uint32_t begin = c * per_item;
    DecodeRange(job, l, b, p, begin, std::min(lay.block_tokens, begin + per_item));
  });
}

}  // namespace hiqcache::kernels
#endif  // HWY_ONCE
