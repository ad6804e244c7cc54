// The allot codecs' K plane on the SIMD CPU executor (see codec_cpu_allot.h and codec_math.h
// "INT4, INT5 and INT6 allot").
//
// Encode turns a plane's tokens 1.. back by RoPE into f32 scratch in f32 lanes (rotate-half
// pairs: a vector of first elements beside the vector of their partners, head_dim / 2 apart;
// interleaved pairs through codec_math.h's scalar turn), taking each channel's smallest and
// largest value on the way; the heads' steps, the channels' bounds and scales are per channel
// (scalar, H*D per block); the allotment counts its bisection's steps in u32 lanes; the codes
// are computed in f32 lanes and packed at their channels' widths through a 64-bit accumulator.
// Decode gathers each lane's code as a 32-bit word at its channel's byte (shifted and masked
// per lane), then dequantizes and turns the codes forward in f32 lanes. Every lane does the
// reference's fp32 operations in its order (no fused multiply-add: the kernels build with
// -ffp-contract=off), so every Highway target produces the reference's bytes.
#include "codec_cpu_allot.h"

#include <cstring>
#include <vector>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "codec_cpu_allot.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "codec_cpu.h"
#include "codec_math.h"
#include "codec_simd-inl.h"
#include "rope_turn.h"

HWY_BEFORE_NAMESPACE();
namespace hiqcache::kernels {
namespace HWY_NAMESPACE {
namespace {

// At most 16 lanes: head_dim / 2 >= 16 elements, so a vector never spans two heads' halves.
using DF = hn::CappedTag<float, 16>;
using DI32 = hn::RebindToSigned<DF>;
using DU32 = hn::RebindToUnsigned<DF>;

// Per channel of a K plane: width, bit offset in a row, and the halved zero point and scale
// (exact halvings: the products DequantizeAsymFloat takes), plus the zero point, scale and top
// level as the encoder's quantization takes them.
struct KeyChannels {
  std::vector<uint8_t> width;
  std::vector<float> zero;
  std::vector<float> scale;
  std::vector<float> top;
  std::vector<float> half_zero;
  std::vector<float> half_scale;
  std::vector<uint32_t> range;
  // Where a row holds channel c's code: a 32-bit word at byte `byte`, shifted right by `shift`
  // and masked by `mask` (the decoder's gather).
  std::vector<int32_t> byte;
  std::vector<uint32_t> shift;
  std::vector<uint32_t> mask;
};

// The widths from the channels' range bits: the bisection's counts in u32 lanes (the sum of
// AllotStepsAbove: k = ceil((u - t) / 2^23) where u > t, then min(max(k, 2) - 2, 6)).
void AllotWidths(KeyChannels* ch, uint32_t channels, AllotBits bits) {
  const DU32 du;
  const size_t n = hn::Lanes(du);
  const uint32_t* u = ch->range.data();
  const auto round_up = hn::Set(du, kAllotExponentOne - 1u);
  const auto min_bits = hn::Set(du, kAllotMinBits);
  const auto max_steps = hn::Set(du, kAllotMaxBits - kAllotMinBits);
  const uint32_t steps = AllotIncrements(channels, bits);
  const uint32_t t = AllotThreshold(steps, [&](uint32_t mid) HWY_ATTR {
    const auto vt = hn::Set(du, mid);
    auto sum = hn::Zero(du);
    for (uint32_t c = 0; c < channels; c += n) {
      const auto v = hn::LoadU(du, u + c);
      const auto k = hn::ShiftRight<23>(hn::Add(hn::Sub(v, vt), round_up));
      const auto cnt = hn::Min(hn::Sub(hn::Max(k, min_bits), min_bits), max_steps);
      sum = hn::Add(sum, hn::IfThenElseZero(hn::Gt(v, vt), cnt));
    }
    return static_cast<uint32_t>(hn::GetLane(hn::SumOfLanes(du, sum)));
  });
  AllotAssign(u, channels, steps, t, ch->width.data());
}

// The channels' parameters from a plane's stored steps and bounds (encode: just written).
void ReadChannels(const RowFormat& fmt, const uint8_t* params, KeyChannels* ch) {
  const uint32_t d = fmt.head_dim;
  const uint32_t channels = static_cast<uint32_t>(fmt.ElementsPerRow());
  const auto* lower = reinterpret_cast<const int8_t*>(params + 2 * fmt.num_heads);
  const int8_t* upper = lower + channels;
  for (auto* v : {&ch->zero, &ch->scale, &ch->top, &ch->half_zero, &ch->half_scale}) {
    v->resize(channels);
  }
  ch->width.resize(channels);
  ch->range.resize(channels);
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    uint16_t step_bits;
    std::memcpy(&step_bits, params + 2 * h, 2);
    const float step = Bf16ToFloat(step_bits);
    for (uint32_t c = h * d; c < (h + 1) * d; ++c) {
      ch->range[c] = AllotRangeBits(lower[c], upper[c], step);
      ch->zero[c] = static_cast<float>(lower[c]) * step;
      ch->scale[c] = static_cast<float>(upper[c]) * step;  // the upper bound, until below
    }
  }
  AllotWidths(ch, channels, fmt.Allot());
  ch->byte.resize(channels);
  ch->shift.resize(channels);
  ch->mask.resize(channels);
  uint32_t bit = 0;
  for (uint32_t c = 0; c < channels; ++c) {
    const uint32_t top = (1u << ch->width[c]) - 1u;
    ch->byte[c] = static_cast<int32_t>(bit >> 3);
    ch->shift[c] = bit & 7u;
    ch->mask[c] = top;
    bit += ch->width[c];
    ch->scale[c] = Bf16ToFloat(AsymScaleBf16(ch->zero[c], ch->scale[c], top));
    ch->top[c] = static_cast<float>(top);
    ch->half_zero[c] = 0.5f * ch->zero[c];
    ch->half_scale[c] = 0.5f * ch->scale[c];
  }
}

// Codes q8[0..channels) packed at their channels' widths, least significant bit first, into a
// row of AllotKeyRowBytes(channels, bits) bytes: every byte of it written (the widths an encoder
// allots sum to the row's bits exactly), so the row needs no clearing first.
void PackRow(const uint8_t* q8, const uint8_t* width, uint32_t channels, uint8_t* row) {
  uint64_t acc = 0;
  uint32_t bits = 0;
  uint8_t* out = row;
  for (uint32_t c = 0; c < channels; ++c) {
    acc |= static_cast<uint64_t>(q8[c]) << bits;
    bits += width[c];
    if (bits >= 32) {
      const uint32_t word = static_cast<uint32_t>(acc);
      std::memcpy(out, &word, 4);
      out += 4;
      acc >>= 32;
      bits -= 32;
    }
  }
  for (; bits > 0; bits = bits > 8 ? bits - 8 : 0) {
    *out++ = static_cast<uint8_t>(acc);
    acc >>= 8;
  }
}

template <DType kDType>
bool EncodeKeysT(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                 uint32_t num_rows, uint8_t* dst) {
  const DF df;
  const DI32 di;
  const size_t n = hn::Lanes(df);
  const uint32_t d = fmt.head_dim;
  const uint32_t half_d = d / 2;
  const uint32_t channels = static_cast<uint32_t>(fmt.ElementsPerRow());
  const uint32_t m = num_rows - 1;
  const bool interleaved = fmt.rope_interleaved;
  const RopeTurn& turn = RopeTurnFor(fmt, num_rows);
  thread_local std::vector<float> scratch;
  scratch.resize(size_t{m} * channels + 2 * channels + d);
  float* y = scratch.data();
  float* lo = y + size_t{m} * channels;
  float* hi = lo + channels;
  float* x = hi + channels;  // one head as f32 (interleaved pairs)
  const auto limit = hn::Set(di, static_cast<int32_t>(kAllotKeyLimitBits));
  const auto abs_bits = hn::Set(di, 0x7FFFFFFF);
  auto in_range = hn::Lt(hn::Zero(di), limit);  // all true
  const auto range = [&](hn::Vec<DF> v) HWY_ATTR {
    in_range = hn::And(in_range, hn::Lt(hn::And(hn::BitCast(di, v), abs_bits), limit));
  };
  const auto keep = [&](float* yp, size_t c, hn::Vec<DF> v, bool first) HWY_ATTR {
    hn::StoreU(v, df, yp + c);
    hn::StoreU(first ? v : hn::Min(hn::LoadU(df, lo + c), v), df, lo + c);
    hn::StoreU(first ? v : hn::Max(hn::LoadU(df, hi + c), v), df, hi + c);
  };
  for (uint32_t t = 1; t < num_rows; ++t) {
    if (t + kPrefetchRows < num_rows) PrefetchRow<false>(fmt, view, rows[t + kPrefetchRows]);
    float* yt = y + size_t{t - 1} * channels;
    const float* cs = turn.cos.data() + size_t{t} * turn.pairs;
    const float* sn = turn.sin.data() + size_t{t} * turn.pairs;
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      const uint8_t* src = view.Head(rows[t], h);
      const size_t c0 = size_t{h} * d;
      if (!interleaved) {
        for (uint32_t i = 0; i < half_d; i += static_cast<uint32_t>(n)) {
          const auto a = LoadHalf<kDType>(df, src + 2 * i);
          const auto b = LoadHalf<kDType>(df, src + 2 * (i + half_d));
          range(a);
          range(b);
          const auto c = hn::LoadU(df, cs + i);
          const auto s = hn::LoadU(df, sn + i);
          keep(yt, c0 + i, hn::Add(hn::Mul(a, c), hn::Mul(b, s)), t == 1);
          keep(yt, c0 + i + half_d, hn::Sub(hn::Mul(b, c), hn::Mul(a, s)), t == 1);
        }
        continue;
      }
      for (uint32_t i = 0; i < d; i += static_cast<uint32_t>(n)) {
        const auto v = LoadHalf<kDType>(df, src + 2 * i);
        range(v);
        hn::StoreU(v, df, x + i);
      }
      float* yh = yt + c0;
      for (uint32_t i = 0; i < d; ++i) {
        const uint32_t j = i / 2;
        yh[i] = TurnBack(x[i], x[i ^ 1u], cs[j], sn[j], (i & 1u) == 0);
      }
      for (uint32_t i = 0; i < d; i += static_cast<uint32_t>(n)) {
        keep(yt, c0 + i, hn::LoadU(df, yh + i), t == 1);
      }
    }
  }
  if (!hn::AllTrue(di, in_range)) return false;
  uint8_t* params = dst + fmt.PlaneRowOffset(0, num_rows);
  auto* lower = reinterpret_cast<int8_t*>(params + 2 * fmt.num_heads);
  int8_t* upper = lower + channels;
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    auto mv = hn::Zero(df);
    for (uint32_t i = 0; i < d; i += static_cast<uint32_t>(n)) {
      const size_t c = size_t{h} * d + i;
      mv = hn::Max(mv, hn::Max(hn::Abs(hn::LoadU(df, lo + c)), hn::Abs(hn::LoadU(df, hi + c))));
    }
    const uint16_t step_bits = AllotStepBf16(hn::GetLane(hn::MaxOfLanes(df, mv)));
    std::memcpy(params + 2 * h, &step_bits, 2);
    const float step = Bf16ToFloat(step_bits);
    for (uint32_t c = h * d; c < (h + 1) * d; ++c) {
      lower[c] = AllotLowerSteps(lo[c], step);
      upper[c] = AllotUpperSteps(hi[c], step);
    }
  }
  thread_local KeyChannels ch;
  ReadChannels(fmt, params, &ch);
  thread_local std::vector<uint8_t> q8;
  q8.resize(channels);
  const auto half = hn::Set(df, 0.5f);
  const auto two = hn::Set(df, 2.0f);
  for (uint32_t t = 0; t < m; ++t) {
    const float* yt = y + size_t{t} * channels;
    for (uint32_t c = 0; c < channels; c += static_cast<uint32_t>(n)) {
      const auto q =
          hn::Round(hn::Mul(two, hn::Div(hn::Sub(hn::Mul(half, hn::LoadU(df, yt + c)),
                                                 hn::Mul(half, hn::LoadU(df, ch.zero.data() + c))),
                                         hn::LoadU(df, ch.scale.data() + c))));
      const auto qc = hn::Min(hn::Max(q, hn::Zero(df)), hn::LoadU(df, ch.top.data() + c));
      StoreCodes(hn::ConvertTo(di, qc), q8.data() + c);
    }
    PackRow(q8.data(), ch.width.data(), channels, dst + fmt.PlaneRowOffset(0, t + 1));
  }
  return true;
}

template <DType kDType>
void DecodeKeysT(const RowFormat& fmt, const uint8_t* src, uint32_t block_tokens, uint32_t begin,
                 uint32_t end, const StridedView& view, const uint32_t* rows) {
  const DF df;
  const DI32 di;
  const size_t n = hn::Lanes(df);
  const uint32_t d = fmt.head_dim;
  const uint32_t half_d = d / 2;
  const uint32_t channels = static_cast<uint32_t>(fmt.ElementsPerRow());
  const RopeTurn& turn = RopeTurnFor(fmt, block_tokens);
  const DU32 du;
  thread_local KeyChannels ch;
  ReadChannels(fmt, src + fmt.PlaneRowOffset(0, block_tokens), &ch);
  thread_local std::vector<float> yh;
  yh.resize(d);
  const auto two = hn::Set(df, 2.0f);
  const uint8_t* codes = nullptr;
  // y^ of channels [c, c + n) of the row at `codes`: each code gathered as a 32-bit word at its
  // byte, shifted and masked (a word reaches at most 3 bytes past the row's last, which the
  // plane's parameters after its last row hold), then 2 (q (0.5 s) + 0.5 z), the reference's
  // DequantizeAsymFloat.
  const auto dequant = [&](size_t c) HWY_ATTR {
    const auto word = hn::BitCast(du, hn::GatherOffset(di, reinterpret_cast<const int32_t*>(codes),
                                                       hn::LoadU(di, ch.byte.data() + c)));
    const auto q = hn::And(hn::operator>>(word, hn::LoadU(du, ch.shift.data() + c)),
                           hn::LoadU(du, ch.mask.data() + c));
    return hn::Mul(two, hn::Add(hn::Mul(hn::ConvertTo(df, hn::BitCast(di, q)),
                                        hn::LoadU(df, ch.half_scale.data() + c)),
                                hn::LoadU(df, ch.half_zero.data() + c)));
  };
  for (uint32_t t = begin; t < end; ++t) {
    const uint32_t row = rows[t - begin];
    if (t + kPrefetchRows < end) PrefetchRow<true>(fmt, view, rows[t + kPrefetchRows - begin]);
    codes = src + fmt.PlaneRowOffset(0, t);
    const float* cs = turn.cos.data() + size_t{t} * turn.pairs;
    const float* sn = turn.sin.data() + size_t{t} * turn.pairs;
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      uint8_t* out = view.Head(row, h);
      const size_t c0 = size_t{h} * d;
      if (!fmt.rope_interleaved) {
        for (uint32_t i = 0; i < half_d; i += static_cast<uint32_t>(n)) {
          const auto a = dequant(c0 + i);
          const auto b = dequant(c0 + i + half_d);
          const auto c = hn::LoadU(df, cs + i);
          const auto s = hn::LoadU(df, sn + i);
          StoreHalf<kDType>(df, hn::Sub(hn::Mul(a, c), hn::Mul(b, s)), out + 2 * i);
          StoreHalf<kDType>(df, hn::Add(hn::Mul(b, c), hn::Mul(a, s)), out + 2 * (i + half_d));
        }
        continue;
      }
      for (uint32_t i = 0; i < d; i += static_cast<uint32_t>(n)) {
        hn::StoreU(dequant(c0 + i), df, yh.data() + i);
      }
      for (uint32_t i = 0; i < d; ++i) {
        const uint32_t j = i / 2;
        const float v = TurnForward(yh[i], yh[i ^ 1u], cs[j], sn[j], (i & 1u) == 0);
        const uint16_t bits = FloatToHalfSat(v, kDType);
        std::memcpy(out + 2 * i, &bits, 2);
      }
    }
  }
}

}  // namespace

bool EncodeAllotKeys(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                     uint32_t num_rows, uint8_t* dst) {
  return fmt.dtype == DType::kBF16 ? EncodeKeysT<DType::kBF16>(fmt, view, rows, num_rows, dst)
                                   : EncodeKeysT<DType::kFP16>(fmt, view, rows, num_rows, dst);
}

void DecodeAllotKeys(const RowFormat& fmt, const uint8_t* src, uint32_t block_tokens,
                     uint32_t begin, uint32_t end, const StridedView& view, const uint32_t* rows) {
  if (fmt.dtype == DType::kBF16) {
    DecodeKeysT<DType::kBF16>(fmt, src, block_tokens, begin, end, view, rows);
  } else {
    DecodeKeysT<DType::kFP16>(fmt, src, block_tokens, begin, end, view, rows);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace hiqcache::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace hiqcache::kernels {

HWY_EXPORT(EncodeAllotKeys);
HWY_EXPORT(DecodeAllotKeys);

bool EncodeAllotPlaneSimd(const RowFormat& fmt, uint32_t plane, const StridedView& view,
                          const uint32_t* rows, uint32_t num_rows, uint8_t* dst) {
  return EncodeAfterInt8RowSimd(fmt, view, rows, num_rows, dst, [&] {
    return plane == 1 ? EncodeAllotValuesSimd(fmt, view, rows, num_rows, dst)
                      : HWY_DYNAMIC_DISPATCH(EncodeAllotKeys)(fmt, view, rows, num_rows, dst);
  });
}

void DecodeAllotRowsSimd(const RowFormat& fmt, uint32_t plane, const uint8_t* src,
                         uint32_t block_tokens, uint32_t begin, uint32_t end,
                         const StridedView& view, const uint32_t* rows) {
  DecodeAfterInt8RowSimd(fmt, src, begin, end, view, rows, [&](uint32_t from, const uint32_t* r) {
    if (plane == 1) return DecodeAllotValuesSimd(fmt, src, from, end, view, r);
    HWY_DYNAMIC_DISPATCH(DecodeAllotKeys)(fmt, src, block_tokens, from, end, view, r);
  });
}

}  // namespace hiqcache::kernels
#endif  // HWY_ONCE
