// CODEC_INT4_G32_PER_HEAD on the SIMD CPU executor (see codec_cpu_int4.h and codec_math.h).
//
// Per row and head, group by group (32 elements): the group's amax over the sign-cleared 16-bit
// patterns, its scale (codec_math.h, scalar), the quotients x / s in fp32 lanes rounded to
// nearest even and clamped to +-7, packed two per byte in registers (element 2i low;
// codec_simd-inl.h's StoreNibbles). Decode unpacks 16 bytes into 32 sign-extended int8 values and
// converts them like INT8's codes. Rows ahead are prefetched to L2. The 16-bit loads and stores and
// the prefetch are codec_simd-inl.h's, shared with the INT8 and FP8 executors (here on a DF capped
// at one group).
//
// Every operation is the vector form of the reference's (IEEE division, round-half-even, the
// same fp32 -> BF16/FP16 rounding), so every Highway target produces the reference's bytes.
#include "codec_cpu_int4.h"

#include <algorithm>
#include <cstring>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "codec_cpu_int4.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "codec_math.h"
#include "codec_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace hiqcache::kernels {
namespace HWY_NAMESPACE {
namespace {

// At most one group (32 elements) per vector, so the lane count divides the group.
using DF = hn::CappedTag<float, kInt4GroupElems>;
using DI32 = hn::RebindToSigned<DF>;
using DI8 = hn::Rebind<int8_t, DF>;  // one code per f32 lane
// Packing: at most 16 u16 lanes = one group's 32 int8 codes or 16 packed bytes.
using DP16 = hn::CappedTag<uint16_t, kInt4GroupElems / 2>;
using DP8 = hn::Rebind<uint8_t, DP16>;
using DPI8 = hn::Repartition<int8_t, DP16>;             // the bytes of the DP16 lanes
using DG16 = hn::CappedTag<uint16_t, kInt4GroupElems>;  // one group's 16-bit elements

// The largest |x| of one group (32 elements) as BF16/FP16 bits with the sign cleared.
HWY_INLINE uint32_t GroupAmaxBits(const uint8_t* src) {
  const DG16 dg;
  const size_t n = hn::Lanes(dg);
  const uint16_t* s16 = reinterpret_cast<const uint16_t*>(src);
  const auto abs_mask = hn::Set(dg, 0x7FFFu);
  auto vmax = hn::And(hn::LoadU(dg, s16), abs_mask);
  for (size_t i = n; i < kInt4GroupElems; i += n) {
    vmax = hn::Max(vmax, hn::And(hn::LoadU(dg, s16 + i), abs_mask));
  }
  return hn::GetLane(hn::MaxOfLanes(dg, vmax));
}

// Writes the 16 code bytes of one group with scale s.
template <DType kDType>
HWY_INLINE void QuantizeGroup(const uint8_t* src, float s, uint8_t* codes) {
  const DF df;
  const DI32 di32;
  const size_t n = hn::Lanes(df);
  const auto vs = hn::Set(df, s);
  const auto qmax = hn::Set(df, static_cast<float>(kInt4QMax));
  const auto qmin = hn::Set(df, -static_cast<float>(kInt4QMax));
  for (size_t i = 0; i < kInt4GroupElems; i += n) {
    const auto q =
        hn::Min(hn::Max(hn::Round(hn::Div(LoadHalf<kDType>(df, src + 2 * i), vs)), qmin), qmax);
    StoreNibbles(di32, hn::ConvertTo(di32, q), codes, i);
  }
}

// Decodes the 16 code bytes of one group with scale s into 32 BF16/FP16 elements at dst.
template <DType kDType>
HWY_INLINE void DequantizeGroup(const uint8_t* codes, float s, uint8_t* dst) {
  HWY_ALIGN int8_t q8[kInt4GroupElems];
#if HWY_TARGET == HWY_SCALAR
  for (size_t j = 0; j < kInt4GroupElems / 2; ++j) {
    q8[2 * j] = static_cast<int8_t>(Int4NibbleValue(codes[j]));
    q8[2 * j + 1] = static_cast<int8_t>(Int4NibbleValue(codes[j] >> 4));
  }
#else
  const DP16 dp16;
  const DP8 dp8;
  const DPI8 dpi8;
  const size_t m = hn::Lanes(dp16);
  for (size_t j = 0; j < kInt4GroupElems / 2; j += m) {
    const auto b = hn::PromoteTo(dp16, hn::LoadU(dp8, codes + j));
    // Low nibble to the low byte, high nibble to the high byte: the elements in order.
    const auto w = hn::Or(hn::And(b, hn::Set(dp16, 0x000Fu)),
                          hn::ShiftLeft<4>(hn::And(b, hn::Set(dp16, 0x00F0u))));
    const auto eight = hn::Set(dpi8, int8_t{8});
    hn::StoreU(hn::Sub(hn::Xor(hn::BitCast(dpi8, w), eight), eight), dpi8, q8 + 2 * j);
  }
#endif
  const DF df;
  const DI32 di32;
  const DI8 di8;
  const size_t n = hn::Lanes(df);
  const auto vs = hn::Set(df, s);
  for (size_t i = 0; i < kInt4GroupElems; i += n) {
    const auto q = hn::ConvertTo(df, hn::PromoteTo(di32, hn::LoadU(di8, q8 + i)));
    StoreHalf<kDType>(df, hn::Mul(q, vs), dst + 2 * i);
  }
}

template <DType kDType>
HWY_INLINE bool EncodeRowT(const RowFormat& fmt, const StridedView& view, uint32_t row,
                           uint8_t* dst) {
  const uint32_t d = fmt.head_dim;
  const uint32_t groups = d / kInt4GroupElems;
  uint8_t* scales = dst + fmt.CodeBytes();
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    const uint8_t* src = view.Head(row, h);
    uint8_t* codes = dst + static_cast<size_t>(h) * d / 2;
    for (uint32_t g = 0; g < groups; ++g) {
      const uint8_t* gs = src + 2 * g * kInt4GroupElems;
      const uint32_t amax = GroupAmaxBits(gs);
      if (amax >= InfBits(kDType)) return false;
      const uint16_t s_bits = Int4ScaleBf16FromAmaxBits(static_cast<uint16_t>(amax), kDType);
      QuantizeGroup<kDType>(gs, Bf16ToFloat(s_bits), codes + g * kInt4GroupElems / 2);
      std::memcpy(scales + 2 * (static_cast<size_t>(h) * groups + g), &s_bits, 2);
    }
  }
  return true;
}

template <DType kDType>
bool EncodeRowsT(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                 uint32_t num_rows, uint8_t* dst) {
  const size_t row_bytes = fmt.RowBytes();
  bool finite = true;
  for (uint32_t t = 0; t < num_rows; ++t) {
    if (t + kPrefetchRows < num_rows) PrefetchRow<false>(fmt, view, rows[t + kPrefetchRows]);
    finite &= EncodeRowT<kDType>(fmt, view, rows[t], dst + t * row_bytes);
  }
  return finite;
}

template <DType kDType>
void DecodeRowsT(const RowFormat& fmt, const uint8_t* src, const StridedView& view,
                 const uint32_t* rows, uint32_t num_rows) {
  const size_t row_bytes = fmt.RowBytes();
  const uint32_t d = fmt.head_dim;
  const uint32_t groups = d / kInt4GroupElems;
  for (uint32_t t = 0; t < num_rows; ++t) {
    if (t + kPrefetchRows < num_rows) PrefetchRow<true>(fmt, view, rows[t + kPrefetchRows]);
    const uint8_t* row_src = src + t * row_bytes;
    const uint8_t* scales = row_src + fmt.CodeBytes();
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      uint8_t* out = view.Head(rows[t], h);
      const uint8_t* codes = row_src + static_cast<size_t>(h) * d / 2;
      for (uint32_t g = 0; g < groups; ++g) {
        uint16_t s_bits;
        std::memcpy(&s_bits, scales + 2 * (static_cast<size_t>(h) * groups + g), 2);
        DequantizeGroup<kDType>(codes + g * kInt4GroupElems / 2, Bf16ToFloat(s_bits),
                                out + 2 * g * kInt4GroupElems);
      }
    }
  }
}

}  // namespace

bool EncodeRowsInt4(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                    uint32_t num_rows, uint8_t* dst) {
  return fmt.dtype == DType::kBF16 ? EncodeRowsT<DType::kBF16>(fmt, view, rows, num_rows, dst)
                                   : EncodeRowsT<DType::kFP16>(fmt, view, rows, num_rows, dst);
}

void DecodeRowsInt4(const RowFormat& fmt, const uint8_t* src, const StridedView& view,
                    const uint32_t* rows, uint32_t num_rows) {
  if (fmt.dtype == DType::kBF16) {
    DecodeRowsT<DType::kBF16>(fmt, src, view, rows, num_rows);
  } else {
    DecodeRowsT<DType::kFP16>(fmt, src, view, rows, num_rows);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace hiqcache::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace hiqcache::kernels {

HWY_EXPORT(EncodeRowsInt4);
HWY_EXPORT(DecodeRowsInt4);

bool EncodeRowsInt4Simd(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                        uint32_t num_rows, uint8_t* dst) {
  return HWY_DYNAMIC_DISPATCH(EncodeRowsInt4)(fmt, view, rows, num_rows, dst);
}

void DecodeRowsInt4Simd(const RowFormat& fmt, const uint8_t* src, const StridedView& view,
                        const uint32_t* rows, uint32_t num_rows) {
  HWY_DYNAMIC_DISPATCH(DecodeRowsInt4)(fmt, src, view, rows, num_rows);
}

}  // namespace hiqcache::kernels
#endif  // HWY_ONCE
