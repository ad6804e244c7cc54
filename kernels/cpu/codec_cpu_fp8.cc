// CODEC_FP8_E4M3_PER_HEAD on the SIMD CPU executor (see codec_cpu_fp8.h and codec_math.h).
//
// Same structure as codec_cpu.cc's INT8 rows: per row, the amax of every head first (the row's
// loads are independent, so their cache misses overlap), then scale and codes; rows ahead are
// prefetched to L2. The 16-bit loads and stores, the amax and the prefetch are codec_simd-inl.h's,
// shared with the INT8 and INT4 executors.
//
// The conversions are the vector forms of codec_math.h's FloatToE4m3Sat and E4m3ToFloat, with
// the same operations, so every Highway target produces the reference's bytes.
#include "codec_cpu_fp8.h"

#include <algorithm>
#include <cstring>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "codec_cpu_fp8.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "codec_math.h"
#include "codec_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace hiqcache::kernels {
namespace HWY_NAMESPACE {
namespace {

using DF = hn::ScalableTag<float>;
using DU32 = hn::RebindToUnsigned<DF>;
using DI32 = hn::RebindToSigned<DF>;
using DU8 = hn::Rebind<uint8_t, DF>;

// FloatToE4m3Sat(x / s) per lane, as i32 in [0, 0xFE]. The quotient is IEEE fp32 division.
HWY_INLINE hn::Vec<DI32> QuantizeFp8Vec(hn::Vec<DF> x, hn::Vec<DF> vs) {
  const DF df;
  const DI32 di32;
  const auto bits = hn::BitCast(di32, hn::Div(x, vs));
  const auto mag = hn::And(bits, hn::Set(di32, 0x7FFFFFFF));
  const auto sign = hn::And(hn::ShiftRight<24>(bits), hn::Set(di32, 0x80));  // arithmetic: masked
  // Normal codes: round the 20 dropped mantissa bits to nearest even and rebias; at and above
  // 448 the result is >= 0x7E, so the min saturates. (Below 2^-6 it is garbage, not selected.)
  const auto lsb = hn::And(hn::ShiftRight<20>(mag), hn::Set(di32, 1));
  const auto rounded = hn::Add(mag, hn::Add(hn::Set(di32, 0x7FFFF), lsb));  // < 2^31: no wrap
  const auto normal = hn::Min(hn::Sub(hn::ShiftRight<20>(rounded), hn::Set(di32, 120 << 3)),
                              hn::Set(di32, kE4m3MaxFinite));
  // Subnormal codes: |q| + 2^14 rounds |q| / 2^-9 to nearest even in its low mantissa bits.
  const auto magic = hn::Set(di32, static_cast<int32_t>(kE4m3SubMagicBits));
  const auto sub =
      hn::Sub(hn::BitCast(di32, hn::Add(hn::BitCast(df, mag), hn::BitCast(df, magic))), magic);
  const auto is_sub = hn::Lt(mag, hn::Set(di32, static_cast<int32_t>(kE4m3MinNormalBits)));
  return hn::Or(sign, hn::IfThenElse(is_sub, sub, normal));
}

// E4m3ToFloat per lane of Lanes(DF) codes at `codes`.
HWY_INLINE hn::Vec<DF> LoadE4m3(const uint8_t* codes) {
  const DF df;
  const DU32 du32;
  const DU8 du8;
  const auto c = hn::PromoteTo(du32, hn::LoadU(du8, codes));
  const auto mag = hn::Mul(hn::BitCast(df, hn::ShiftLeft<20>(hn::And(c, hn::Set(du32, 0x7Fu)))),
                           hn::BitCast(df, hn::Set(du32, kE4m3RebiasBits)));
  const auto sign = hn::ShiftLeft<24>(hn::And(c, hn::Set(du32, 0x80u)));
  return hn::BitCast(df, hn::Or(hn::BitCast(du32, mag), sign));
}

// Writes the d codes of a head with scale s.
template <DType kDType>
HWY_INLINE void QuantizeHead(const uint8_t* src, uint32_t d, float s, uint8_t* codes) {
  QuantizeHeadWith<kDType>(
      src, d, s, codes,
      [](hn::Vec<DF> x, hn::Vec<DF> vs) HWY_ATTR { return QuantizeFp8Vec(x, vs); },
      [](float x, float scale) { return QuantizeFp8Element(x, scale); });
}

template <DType kDType>
HWY_INLINE void DecodeHead(const uint8_t* codes, const uint8_t* scale_in, uint32_t d,
                           uint8_t* dst) {
  const DF df;
  const size_t n = hn::Lanes(df);
  uint16_t s_bits;
  std::memcpy(&s_bits, scale_in, 2);
  const float s = Bf16ToFloat(s_bits);
  const auto vs = hn::Set(df, s);
  uint32_t i = 0;
  for (; i + n <= d; i += n) StoreHalf<kDType>(df, hn::Mul(LoadE4m3(codes + i), vs), dst + 2 * i);
  for (; i < d; ++i) {
    const uint16_t out = DequantizeFp8Element(codes[i], s, kDType);
    std::memcpy(dst + 2 * i, &out, 2);
  }
}

template <DType kDType>
HWY_INLINE bool EncodeRowT(const RowFormat& fmt, const StridedView& view, uint32_t row,
                           uint8_t* dst) {
  constexpr uint32_t kGroup = 16;  // heads per pass
  const uint32_t d = fmt.head_dim;
  uint8_t* scales = dst + fmt.ElementsPerRow();
  uint32_t amax[kGroup];
  for (uint32_t h0 = 0; h0 < fmt.num_heads; h0 += kGroup) {
    const uint32_t h1 = std::min(fmt.num_heads, h0 + kGroup);
    uint32_t worst = 0;
    for (uint32_t h = h0; h < h1; ++h) {
      amax[h - h0] = HeadAmaxBits(view.Head(row, h), d);
      worst = std::max(worst, amax[h - h0]);
    }
    if (worst >= InfBits(kDType)) return false;
    for (uint32_t h = h0; h < h1; ++h) {
      const uint16_t s_bits = Fp8ScaleBf16FromAmaxBits(static_cast<uint16_t>(amax[h - h0]), kDType);
      QuantizeHead<kDType>(view.Head(row, h), d, Bf16ToFloat(s_bits),
                           dst + static_cast<size_t>(h) * d);
      std::memcpy(scales + 2 * h, &s_bits, 2);
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
  for (uint32_t t = 0; t < num_rows; ++t) {
    if (t + kPrefetchRows < num_rows) PrefetchRow<true>(fmt, view, rows[t + kPrefetchRows]);
    const uint8_t* row_src = src + t * row_bytes;
    const uint8_t* scales = row_src + fmt.ElementsPerRow();
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      DecodeHead<kDType>(row_src + static_cast<size_t>(h) * d, scales + 2 * h, d,
                         view.Head(rows[t], h));
    }
  }
}

}  // namespace

bool EncodeRowsFp8(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                   uint32_t num_rows, uint8_t* dst) {
  return fmt.dtype == DType::kBF16 ? EncodeRowsT<DType::kBF16>(fmt, view, rows, num_rows, dst)
                                   : EncodeRowsT<DType::kFP16>(fmt, view, rows, num_rows, dst);
}

void DecodeRowsFp8(const RowFormat& fmt, const uint8_t* src, const StridedView& view,
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

HWY_EXPORT(EncodeRowsFp8);
HWY_EXPORT(DecodeRowsFp8);

bool EncodeRowsFp8Simd(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                       uint32_t num_rows, uint8_t* dst) {
  return HWY_DYNAMIC_DISPATCH(EncodeRowsFp8)(fmt, view, rows, num_rows, dst);
}

void DecodeRowsFp8Simd(const RowFormat& fmt, const uint8_t* src, const StridedView& view,
                       const uint32_t* rows, uint32_t num_rows) {
  HWY_DYNAMIC_DISPATCH(DecodeRowsFp8)(fmt, src, view, rows, num_rows);
}

}  // namespace hiqcache::kernels
#endif  // HWY_ONCE
