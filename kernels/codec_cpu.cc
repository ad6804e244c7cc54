#include "codec_cpu.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "codec_cpu.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "codec_math.h"
#include "codec_reference.h"

HWY_BEFORE_NAMESPACE();
namespace hiqcache::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DU32 = hn::RebindToUnsigned<DF>;
using DI32 = hn::RebindToSigned<DF>;
using DU16 = hn::Rebind<uint16_t, DF>;  // half-width: one u16 per f32 lane
using DF16 = hn::Rebind<hwy::float16_t, DF>;
using DI8 = hn::Rebind<int8_t, DF>;

// Loads Lanes(DF) BF16/FP16 elements as f32 (exact).
template <DType kDType>
HWY_INLINE hn::Vec<DF> LoadHalf(const uint8_t* p) {
  const DF df;
  if constexpr (kDType == DType::kBF16) {
    const DU32 du32;
    const DU16 du16;
    auto u = hn::PromoteTo(du32, hn::LoadU(du16, reinterpret_cast<const uint16_t*>(p)));
    return hn::BitCast(df, hn::ShiftLeft<16>(u));
  } else {
    const DF16 df16;
    return hn::PromoteTo(df, hn::LoadU(df16, reinterpret_cast<const hwy::float16_t*>(p)));
  }
}

// Stores f32 lanes as BF16/FP16: round to nearest even, saturated to the largest finite value.
template <DType kDType>
HWY_INLINE void StoreHalf(hn::Vec<DF> y, uint8_t* p) {
  const DF df;
  if constexpr (kDType == DType::kBF16) {
    const DU32 du32;
    const DU16 du16;
    const auto lim = hn::Set(df, Bf16ToFloat(kBf16MaxFiniteBits));
    y = hn::Min(hn::Max(y, hn::Neg(lim)), lim);
    auto bits = hn::BitCast(du32, y);
    auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du32, 1));
    bits = hn::ShiftRight<16>(hn::Add(bits, hn::Add(hn::Set(du32, 0x7FFFu), lsb)));
    const DI32 di32;  // values are < 2^16: the saturating i32 -> u16 demotion is exact
    hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di32, bits)), du16, reinterpret_cast<uint16_t*>(p));
  } else {
    const DF16 df16;
    const auto lim = hn::Set(df, 65504.0f);
    y = hn::Min(hn::Max(y, hn::Neg(lim)), lim);
    hn::StoreU(hn::DemoteTo(df16, y), df16, reinterpret_cast<hwy::float16_t*>(p));
  }
}

template <DType kDType>
HWY_INLINE bool EncodeHead(const uint8_t* src, uint32_t d, int8_t* codes, uint8_t* scale_out) {
  const DF df;
  const DU32 du32;
  const DI32 di32;
  const DU16 du16;
  const DI8 di8;
  const size_t n = hn::Lanes(df);
  const uint32_t vec_end = static_cast<uint32_t>(d - d % n);
  const uint16_t* s16 = reinterpret_cast<const uint16_t*>(src);

  // |x| of BF16/FP16 orders like the integer bits with the sign cleared.
  auto vmax = hn::Zero(du32);
  const auto abs_mask = hn::Set(du32, 0x7FFFu);
  uint32_t i = 0;
  for (; i < vec_end; i += n) {
    vmax = hn::Max(vmax, hn::And(hn::PromoteTo(du32, hn::LoadU(du16, s16 + i)), abs_mask));
  }
  uint32_t amax_bits = vec_end > 0 ? hn::GetLane(hn::MaxOfLanes(du32, vmax)) : 0;
  for (; i < d; ++i) {
    uint16_t v;
    std::memcpy(&v, src + 2 * i, 2);
    amax_bits = std::max<uint32_t>(amax_bits, v & 0x7FFFu);
  }
  if (amax_bits >= InfBits(kDType)) return false;
  const uint16_t s_bits = ScaleBf16FromAmaxBits(static_cast<uint16_t>(amax_bits), kDType);
  const float s = Bf16ToFloat(s_bits);
  const auto vs = hn::Set(df, s);
  const auto qmax = hn::Set(df, static_cast<float>(kQMax));
  const auto qmin = hn::Neg(qmax);
  for (i = 0; i < vec_end; i += n) {
    auto x = LoadHalf<kDType>(src + 2 * i);
    auto q = hn::Round(hn::Div(x, vs));  // IEEE quotient, ties to even
    q = hn::Min(hn::Max(q, qmin), qmax);
    hn::StoreU(hn::DemoteTo(di8, hn::ConvertTo(di32, q)), di8, codes + i);
  }
  for (; i < d; ++i) {
    uint16_t v;
    std::memcpy(&v, src + 2 * i, 2);
    codes[i] = QuantizeElement(HalfToFloat(v, kDType), s);
  }
  std::memcpy(scale_out, &s_bits, 2);
  (void)du32;
  return true;
}

template <DType kDType>
HWY_INLINE void DecodeHead(const int8_t* codes, const uint8_t* scale_in, uint32_t d,
                           uint8_t* dst) {
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
    StoreHalf<kDType>(hn::Mul(q, vs), dst + 2 * i);
  }
  for (; i < d; ++i) {
    uint16_t out = DequantizeElement(codes[i], s, kDType);
    std::memcpy(dst + 2 * i, &out, 2);
  }
}

template <DType kDType>
bool EncodeRowT(const RowFormat& fmt, const StridedView& view, uint32_t row, uint8_t* dst) {
  const uint32_t d = fmt.head_dim;
  int8_t* codes = reinterpret_cast<int8_t*>(dst);
  uint8_t* scales = dst + fmt.ElementsPerRow();
  bool finite = true;
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    finite &= EncodeHead<kDType>(view.Head(row, h), d, codes + static_cast<size_t>(h) * d,
                                 scales + 2 * h);
  }
  return finite;
}

template <DType kDType>
void DecodeRowT(const RowFormat& fmt, const uint8_t* src, const StridedView& view, uint32_t row) {
  const uint32_t d = fmt.head_dim;
  const int8_t* codes = reinterpret_cast<const int8_t*>(src);
  const uint8_t* scales = src + fmt.ElementsPerRow();
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    DecodeHead<kDType>(codes + static_cast<size_t>(h) * d, scales + 2 * h, d,
                       view.Head(row, h));
  }
}

bool EncodeRow(const RowFormat& fmt, const StridedView& view, uint32_t row, uint8_t* dst) {
  if (fmt.codec == CodecKind::kRaw) return EncodeRowReference(fmt, view, row, dst);
  return fmt.dtype == DType::kBF16 ? EncodeRowT<DType::kBF16>(fmt, view, row, dst)
                                   : EncodeRowT<DType::kFP16>(fmt, view, row, dst);
}

void DecodeRow(const RowFormat& fmt, const uint8_t* src, const StridedView& view, uint32_t row) {
  if (fmt.codec == CodecKind::kRaw) return DecodeRowReference(fmt, src, view, row);
  if (fmt.dtype == DType::kBF16) {
    DecodeRowT<DType::kBF16>(fmt, src, view, row);
  } else {
    DecodeRowT<DType::kFP16>(fmt, src, view, row);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace hiqcache::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace hiqcache::kernels {

HWY_EXPORT(EncodeRow);
HWY_EXPORT(DecodeRow);

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
// Rows per parallel work item: big enough to amortize dispatch, small enough to balance.
constexpr uint32_t kRowsPerItem = 64;
}  // namespace

CpuCodec::CpuCodec(unsigned threads)
    : pool_(std::make_unique<ThreadPool>(
          threads != 0 ? threads : std::max(1u, std::thread::hardware_concurrency()))) {}

void CpuCodec::Encode(const EncodeJob& job) {
  const BlockLayout& lay = job.layout;
  if (job.num_blocks == 0) return;
  auto* encode_row = HWY_DYNAMIC_DISPATCH(EncodeRow);
  // One item = one (block, layer) pair: all of its planes and tokens.
  const size_t items = static_cast<size_t>(job.num_blocks) * lay.num_layers;
  std::vector<uint8_t> bad(items, 0);
  pool_->ParallelFor(items, [&](size_t item) {
    const uint32_t b = static_cast<uint32_t>(item / lay.num_layers);
    const uint32_t l = static_cast<uint32_t>(item % lay.num_layers);
    const uint32_t* rows = job.rows + static_cast<size_t>(b) * lay.block_tokens;
    bool finite = true;
    for (uint32_t p = 0; p < lay.kv_planes; ++p) {
      const StridedView& view = job.layers[l].planes[p];
      uint8_t* dst = job.blocks[b] + lay.RowOffset(l, p, 0);
      const size_t row_bytes = lay.row.RowBytes();
      for (uint32_t t = 0; t < lay.block_tokens; ++t) {
        finite &= encode_row(lay.row, view, rows[t], dst + t * row_bytes);
      }
    }
    if (!finite) bad[item] = 1;
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
  auto* decode_row = HWY_DYNAMIC_DISPATCH(DecodeRow);
  const uint32_t chunks = (lay.block_tokens + kRowsPerItem - 1) / kRowsPerItem;
  const size_t items = static_cast<size_t>(job.num_blocks) * lay.kv_planes * chunks;
  const size_t row_bytes = lay.row.RowBytes();
  pool_->ParallelFor(items, [&](size_t item) {
    const uint32_t c = static_cast<uint32_t>(item % chunks);
    const uint32_t p = static_cast<uint32_t>((item / chunks) % lay.kv_planes);
    const uint32_t b = static_cast<uint32_t>(item / chunks / lay.kv_planes);
    const uint32_t* rows = job.rows + static_cast<size_t>(b) * lay.block_tokens;
    const StridedView& view = job.layers[layer].planes[p];
    const uint8_t* src = job.blocks[b] + lay.RowOffset(layer, p, 0);
    const uint32_t end = std::min(lay.block_tokens, (c + 1) * kRowsPerItem);
    for (uint32_t t = c * kRowsPerItem; t < end; ++t) {
      decode_row(lay.row, src + t * row_bytes, view, rows[t]);
    }
  });
}

void CpuCodec::Decode(const DecodeJob& job) {
  for (uint32_t l = 0; l < job.layout.num_layers; ++l) DecodeLayer(job, l);
}

}  // namespace hiqcache::kernels
#endif  // HWY_ONCE
