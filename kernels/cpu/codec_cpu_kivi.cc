// CODEC_INT4_KIVI's K planes on the SIMD CPU executor (see codec_cpu_kivi.h and codec_math.h).
//
// Encode, per head and group of 32 channels: the channels' smallest and largest values over the
// block's rows (f32 lanes, Min/Max; the non-finite check on the sign-cleared 16-bit patterns),
// then their zero points and scales (stored, then read back as the decoder reads them), then per
// row the quotients 2 * ((0.5 x - 0.5 z) / s) rounded to nearest even and clamped to [0, 15],
// packed two per byte in registers (element 2i low; codec_simd-inl.h's StoreNibbles). Decode
// converts the plane's zero points and scales to f32 once per call, then unpacks 16 bytes into 32
// codes and computes q * s + z per lane. The 16-bit loads and stores are codec_simd-inl.h's.
//
// Every operation is the vector form of the reference's (IEEE division, round-half-even, the
// same fp32 -> BF16/FP16 rounding; -0 zero points stored as +0 by adding +0), so every Highway
// target produces the reference's bytes.
#include "codec_cpu_kivi.h"

#include <algorithm>
#include <cstring>
#include <vector>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "codec_cpu_kivi.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "codec_math.h"
#include "codec_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace hiqcache::kernels {
namespace HWY_NAMESPACE {
namespace {

constexpr uint32_t kG = kInt4GroupElems;  // channels handled together
// At most one group per vector, so the lane count divides the group.
using DF = hn::CappedTag<float, kG>;
using DI32 = hn::RebindToSigned<DF>;
using DU8 = hn::Rebind<uint8_t, DF>;  // one code per f32 lane

template <DType kDType>
bool EncodePlaneT(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                  uint32_t num_rows, uint8_t* dst) {
  const DF df;
  const DI32 di32;
  const size_t n = hn::Lanes(df);
  const uint32_t d = fmt.head_dim;
  const size_t channels = fmt.ElementsPerRow();
  const size_t code_bytes = channels / 2;
  uint8_t* zeros = dst + static_cast<size_t>(num_rows) * code_bytes;
  uint8_t* scales = zeros + 2 * channels;
  // The non-finite check first: every element's sign-cleared bits.
  uint32_t worst = 0;
  for (uint32_t t = 0; t < num_rows; ++t) {
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      worst = std::max(worst, HeadAmaxBits(view.Head(rows[t], h), d));
    }
  }
  if (worst >= InfBits(kDType)) return false;
  const auto half = hn::Set(df, 0.5f);
  const auto two = hn::Set(df, 2.0f);
  const auto floor = hn::Set(df, BitsToFloat(kAmaxFloorBits));
  const auto levels = hn::Set(df, 7.5f);
  const auto qmax = hn::Set(df, static_cast<float>(kKiviKQMax));
  const auto zero = hn::Zero(df);
  HWY_ALIGN float lo[kG];
  HWY_ALIGN float hi[kG];
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    for (uint32_t g = 0; g < d; g += kG) {
      const size_t c0 = static_cast<size_t>(h) * d + g;
      for (size_t i = 0; i < kG; i += n) {
        auto vlo = LoadHalf<kDType>(df, view.Head(rows[0], h) + 2 * (g + i));
        auto vhi = vlo;
        for (uint32_t t = 1; t < num_rows; ++t) {
          const auto x = LoadHalf<kDType>(df, view.Head(rows[t], h) + 2 * (g + i));
          vlo = hn::Min(vlo, x);
          vhi = hn::Max(vhi, x);
        }
        const auto r = hn::Max(hn::Sub(hn::Mul(half, vhi), hn::Mul(half, vlo)), floor);
        StoreHalf<kDType>(df, hn::Add(vlo, zero), zeros + 2 * (c0 + i));
        StoreHalf<DType::kBF16>(df, hn::Div(r, levels), scales + 2 * (c0 + i));
        hn::Store(LoadHalf<kDType>(df, zeros + 2 * (c0 + i)), df, lo + i);
        hn::Store(LoadHalf<DType::kBF16>(df, scales + 2 * (c0 + i)), df, hi + i);  // s
      }
      for (uint32_t t = 0; t < num_rows; ++t) {
        const uint8_t* src = view.Head(rows[t], h) + 2 * g;
        for (size_t i = 0; i < kG; i += n) {
          const auto x = LoadHalf<kDType>(df, src + 2 * i);
          const auto hz = hn::Mul(half, hn::Load(df, lo + i));
          const auto q =
              hn::Round(hn::Mul(two, hn::Div(hn::Sub(hn::Mul(half, x), hz), hn::Load(df, hi + i))));
          const auto qc = hn::Min(hn::Max(q, zero), qmax);
          StoreNibbles(di32, hn::ConvertTo(di32, qc), dst + t * code_bytes, c0 + i);
        }
      }
    }
  }
  return true;
}

template <DType kDType>
void DecodeRowsT(const RowFormat& fmt, const uint8_t* plane, uint32_t block_tokens, uint32_t begin,
                 uint32_t end, const StridedView& view, const uint32_t* rows) {
  const DF df;
  const DI32 di32;
  const DU8 du8;
  const size_t n = hn::Lanes(df);
  const uint32_t d = fmt.head_dim;
  const size_t channels = fmt.ElementsPerRow();
  const size_t code_bytes = channels / 2;
  const uint8_t* zeros = plane + static_cast<size_t>(block_tokens) * code_bytes;
  const uint8_t* scales = zeros + 2 * channels;
  const auto half = hn::Set(df, 0.5f);
  const auto two = hn::Set(df, 2.0f);
  // Half of each channel's scale and zero point, converted once for every row decoded here
  // (exact: the products the element function takes them in).
  thread_local std::vector<float> params;
  params.resize(2 * channels);
  float* hs = params.data();
  float* hz = hs + channels;
  for (size_t c = 0; c < channels; c += n) {
    hn::StoreU(hn::Mul(half, LoadHalf<DType::kBF16>(df, scales + 2 * c)), df, hs + c);
    hn::StoreU(hn::Mul(half, LoadHalf<kDType>(df, zeros + 2 * c)), df, hz + c);
  }
  HWY_ALIGN uint8_t q8[kG];
  for (uint32_t t = begin; t < end; ++t) {
    const uint32_t row = rows[t - begin];
    if (t + kPrefetchRows < end) PrefetchRow<true>(fmt, view, rows[t + kPrefetchRows - begin]);
    const uint8_t* codes = plane + t * code_bytes;
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      uint8_t* out = view.Head(row, h);
      for (uint32_t g = 0; g < d; g += kG) {
        const size_t c0 = static_cast<size_t>(h) * d + g;
        UnpackNibbles32(codes + c0 / 2, q8);
        for (size_t i = 0; i < kG; i += n) {
          const auto q = hn::ConvertTo(df, hn::PromoteTo(di32, hn::LoadU(du8, q8 + i)));
          const auto v =
              hn::Add(hn::Mul(q, hn::LoadU(df, hs + c0 + i)), hn::LoadU(df, hz + c0 + i));
          StoreHalf<kDType>(df, hn::Mul(two, v), out + 2 * (g + i));
        }
      }
    }
  }
}

}  // namespace

bool EncodeKiviKPlane(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                      uint32_t num_rows, uint8_t* dst) {
  return fmt.dtype == DType::kBF16 ? EncodePlaneT<DType::kBF16>(fmt, view, rows, num_rows, dst)
                                   : EncodePlaneT<DType::kFP16>(fmt, view, rows, num_rows, dst);
}

void DecodeKiviKRows(const RowFormat& fmt, const uint8_t* plane, uint32_t block_tokens,
                     uint32_t begin, uint32_t end, const StridedView& view, const uint32_t* rows) {
  if (fmt.dtype == DType::kBF16) {
    DecodeRowsT<DType::kBF16>(fmt, plane, block_tokens, begin, end, view, rows);
  } else {
    DecodeRowsT<DType::kFP16>(fmt, plane, block_tokens, begin, end, view, rows);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace hiqcache::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace hiqcache::kernels {

HWY_EXPORT(EncodeKiviKPlane);
HWY_EXPORT(DecodeKiviKRows);

bool EncodeKiviKPlaneSimd(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                          uint32_t num_rows, uint8_t* dst) {
  if (num_rows == 0) return true;
  return HWY_DYNAMIC_DISPATCH(EncodeKiviKPlane)(fmt, view, rows, num_rows, dst);
}

void DecodeKiviKRowsSimd(const RowFormat& fmt, const uint8_t* plane, uint32_t block_tokens,
                         uint32_t begin, uint32_t end, const StridedView& view,
                         const uint32_t* rows) {
  HWY_DYNAMIC_DISPATCH(DecodeKiviKRows)(fmt, plane, block_tokens, begin, end, view, rows);
}

}  // namespace hiqcache::kernels
#endif  // HWY_ONCE
