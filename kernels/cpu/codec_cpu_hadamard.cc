// CODEC_INT4_HADAMARD's planes on the SIMD CPU executor (see codec_cpu_hadamard.h and
// codec_math.h), and the allot codecs' V plane, which shares their rotation (4-, 5- or 6-bit codes,
// one zero point and scale per head; codec_cpu_allot.h).
//
// The transform works on a run in f32 lanes of n <= 16 (the run is at least 32): the stages of
// stride below n inside each vector (the partner lane i ^ s by an in-block shuffle on x86, a table
// lookup elsewhere; a lane with bit s clear takes partner + x, one with it set partner + (-x): the
// pair's a + b and a - b), then the stages of stride n and more between whole vectors. A run of
// up to 16 vectors stays in registers from its load to its store (head_dim 128 is 8 vectors on
// AVX-512); longer ones go through memory. Every stage runs in codec_math.h's order and each
// lane's sum is the reference's fp32 addition, so every Highway target produces the reference's
// bytes. Encode rotates a plane's tokens 1.. into f32 scratch (the K plane's channel ranges taken
// on the way), then quantizes as KIVI does (codec_cpu_kivi.cc): per channel over the tokens
// (plane 0) or per group of 32 of a token (plane 1). Decode dequantizes a run's codes into
// registers, transforms them back and stores the input dtype. Row 0 goes through the INT8 row
// executor.
#include "codec_cpu_hadamard.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "codec_cpu_allot.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "codec_cpu_hadamard.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "codec_cpu.h"
#include "codec_math.h"
#include "codec_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace hiqcache::kernels {
namespace HWY_NAMESPACE {
namespace {

constexpr uint32_t kG = kInt4GroupElems;
// At most 16 lanes, so a vector never spans two runs (>= 32) or two groups.
using DF = hn::CappedTag<float, 16>;
using DI32 = hn::RebindToSigned<DF>;
using DU8 = hn::Rebind<uint8_t, DF>;  // one code per f32 lane

// One in-vector stage: `p` holds each lane's partner (lane i ^ s) and `sign` the sign bit in the
// lanes with bit s set. Those take p + (-x) = p - x (the pair's a - b), the others p + x = x + p
// (a + b): IEEE sums, so the reference's bits.
template <class V>
HWY_INLINE V InVectorStage(V x, V p, V sign) {
  return hn::Add(p, hn::Xor(x, sign));
}

// The sign bit in the lanes whose index has bit `s` set (s a power of two below 2^31).
HWY_INLINE hn::Vec<DF> UpperLaneSigns(int32_t s) {
  const DF df;
  const DI32 di;
  const auto set = hn::Ne(hn::And(hn::Iota(di, 0), hn::Set(di, s)), hn::Zero(di));
  return hn::BitCast(df, hn::IfThenElseZero(set, hn::Set(di, static_cast<int32_t>(0x80000000u))));
}

// The stages of stride below Lanes(DF) (at most 16: strides 1, 2, 4, 8) on one vector, in
// codec_math.h's order: the partner lanes brought by in-block shuffles where x86 has them (one
// cycle, against three for a cross-lane permute) and by a table lookup elsewhere.
struct InVectorStages {
  hn::Vec<DF> s1, s2, s4, s8;
#if HWY_TARGET != HWY_SCALAR && !HWY_ARCH_X86
  hn::Indices<DF> p1, p2, p4, p8;
#endif

  InVectorStages()
      : s1(UpperLaneSigns(1)), s2(UpperLaneSigns(2)), s4(UpperLaneSigns(4)), s8(UpperLaneSigns(8)) {
#if HWY_TARGET != HWY_SCALAR && !HWY_ARCH_X86
    const DF df;
    const size_t n = hn::Lanes(df);
    HWY_ALIGN int32_t table[4][16];
    for (size_t k = 0; k < 4; ++k) {
      const size_t s = size_t{1} << k;
      for (size_t i = 0; i < n; ++i) table[k][i] = static_cast<int32_t>(s < n ? i ^ s : i);
    }
    p1 = hn::SetTableIndices(df, table[0]);
    p2 = hn::SetTableIndices(df, table[1]);
    p4 = hn::SetTableIndices(df, table[2]);
    p8 = hn::SetTableIndices(df, table[3]);
#endif
  }

  HWY_INLINE hn::Vec<DF> operator()(hn::Vec<DF> x) const {
#if HWY_TARGET == HWY_SCALAR
    return x;
#elif HWY_ARCH_X86
    const DF df;
    x = InVectorStage(x, hn::Shuffle2301(x), s1);
    x = InVectorStage(x, hn::Shuffle1032(x), s2);
#if HWY_TARGET <= HWY_AVX3
    x = InVectorStage(x, hn::SwapAdjacentBlocks(x), s4);
    x = InVectorStage(x, hn::ConcatLowerUpper(df, x, x), s8);
#elif HWY_TARGET == HWY_AVX2
    x = InVectorStage(x, hn::ConcatLowerUpper(df, x, x), s4);
#endif
    (void)df;
    return x;
#else
    const size_t n = hn::Lanes(DF());
    x = InVectorStage(x, hn::TableLookupLanes(x, p1), s1);
    if (n > 2) x = InVectorStage(x, hn::TableLookupLanes(x, p2), s2);
    if (n > 4) x = InVectorStage(x, hn::TableLookupLanes(x, p4), s4);
    if (n > 8) x = InVectorStage(x, hn::TableLookupLanes(x, p8), s8);
    return x;
#endif
  }
};

// v[0..r) = H_r v (codec_math.h's HadamardTransform): the in-vector stages on each vector while
// it is in a register, the others two at a time where they can (each element's two sums are the
// ones the two stages compute in turn). For runs the registers do not hold (more than 16
// vectors, or one lane). REQUIRES: r a power of two >= Lanes(DF), r >= 32.
HWY_INLINE void Transform(const InVectorStages& in_vector, float* HWY_RESTRICT v, uint32_t r) {
  const DF df;
  const size_t n = hn::Lanes(df);
  for (size_t i = 0; i < r; i += n) hn::StoreU(in_vector(hn::LoadU(df, v + i)), df, v + i);
  size_t s = n;
  for (; 4 * s <= r; s *= 4) {  // stages s and 2s together
    for (size_t i0 = 0; i0 < r; i0 += 4 * s) {
      for (size_t i = i0; i < i0 + s; i += n) {
        const auto a = hn::LoadU(df, v + i);
        const auto b = hn::LoadU(df, v + i + s);
        const auto c = hn::LoadU(df, v + i + 2 * s);
        const auto d = hn::LoadU(df, v + i + 3 * s);
        const auto ab = hn::Add(a, b);
        const auto amb = hn::Sub(a, b);
        const auto cd = hn::Add(c, d);
        const auto cmd = hn::Sub(c, d);
        hn::StoreU(hn::Add(ab, cd), df, v + i);
        hn::StoreU(hn::Add(amb, cmd), df, v + i + s);
        hn::StoreU(hn::Sub(ab, cd), df, v + i + 2 * s);
        hn::StoreU(hn::Sub(amb, cmd), df, v + i + 3 * s);
      }
    }
  }
  if (2 * s <= r) {  // the last stage alone
    for (size_t i = 0; i < s; i += n) {
      const auto a = hn::LoadU(df, v + i);
      const auto b = hn::LoadU(df, v + i + s);
      hn::StoreU(hn::Add(a, b), df, v + i);
      hn::StoreU(hn::Sub(a, b), df, v + i + s);
    }
  }
}

#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR  // arrays of vectors
// A run held in registers: v[k] is lanes [k n, k n + n) of the run (r = K n). The same stages
// in the same order as codec_math.h's HadamardTransform: the in-vector ones, then stride n, 2n,
// ... between whole vectors, each pair (a, b) becoming (a + b, a - b).
template <size_t K>
HWY_INLINE void TransformRegs(const InVectorStages& in_vector, hn::Vec<DF> (&v)[K]) {
#pragma GCC unroll 16
  for (size_t k = 0; k < K; ++k) v[k] = in_vector(v[k]);
#pragma GCC unroll 4
  for (size_t sv = 1; sv < K; sv <<= 1) {
#pragma GCC unroll 16
    for (size_t k = 0; k < K; ++k) {
      if ((k & sv) != 0) continue;
      const auto a = v[k];
      const auto b = v[k + sv];
      v[k] = hn::Add(a, b);
      v[k + sv] = hn::Sub(a, b);
    }
  }
}

// Runs a run of r = K Lanes(DF) elements through registers: load(k) gives vector k, the
// transform runs, store(k, v) takes vector k of the result.
template <size_t K, class Load, class Store>
HWY_INLINE void RunInRegs(const InVectorStages& in_vector, const Load& load, const Store& store) {
  hn::Vec<DF> v[K];
#pragma GCC unroll 16
  for (size_t k = 0; k < K; ++k) v[k] = load(k);
  TransformRegs<K>(in_vector, v);
#pragma GCC unroll 16
  for (size_t k = 0; k < K; ++k) store(k, v[k]);
}
#endif

// H_r over one run, `load(k)` / `store(k, v)` giving and taking vector k of it: in registers
// for runs of 2 to 16 vectors, through `tmp` (r floats) otherwise (`store` may write where `tmp`
// is: each vector is read back before it is stored).
template <class Load, class Store>
HWY_INLINE void TransformRun(const InVectorStages& in_vector, uint32_t r, float* tmp,
                             const Load& load, const Store& store) {
  const DF df;
  const size_t n = hn::Lanes(df);
#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
  switch (r / n) {
    case 2:
      return RunInRegs<2>(in_vector, load, store);
    case 4:
      return RunInRegs<4>(in_vector, load, store);
    case 8:
      return RunInRegs<8>(in_vector, load, store);
    case 16:
      return RunInRegs<16>(in_vector, load, store);
    default:
      break;
  }
#endif
  for (size_t k = 0; k < r / n; ++k) hn::StoreU(load(k), df, tmp + k * n);
  Transform(in_vector, tmp, r);
  for (size_t k = 0; k < r / n; ++k) store(k, hn::LoadU(df, tmp + k * n));
}

// y[0..d) = the rotated head at `src` as BF16 values; false when a run leaves the limit
// (HadamardLimitBits; NaN and Inf included). With kRange, lo / hi [0..d) take the running
// minimum and maximum of each channel over the tokens (set by the first, `first`) as each rotated
// value is stored (still in a register on the register path).
template <DType kDType, bool kRange>
HWY_INLINE bool RotateHead(const InVectorStages& in_vector, const uint8_t* src, uint32_t d,
                           float* HWY_RESTRICT y, float* HWY_RESTRICT lo, float* HWY_RESTRICT hi,
                           bool first) {
  const DF df;
  const size_t n = hn::Lanes(df);
  const uint32_t r = HadamardRun(d);
  const DI32 di;
  const auto e = hn::Set(df, HadamardEncodeFactor(r));
  // |v| < the limit on the sign-cleared bits as i32 (NaN and Inf lie above it).
  const auto limit = hn::Set(di, static_cast<int32_t>(HadamardLimitBits(r)));
  const auto abs_bits = hn::Set(di, 0x7FFFFFFF);
  auto in_range = hn::Lt(hn::Zero(di), limit);  // all true
  for (uint32_t j = 0; j < d; j += r) {
    TransformRun(
        in_vector, r, y + j,
        [&](size_t k) HWY_ATTR { return LoadHalf<kDType>(df, src + 2 * (j + k * n)); },
        [&](size_t k, hn::Vec<DF> v) HWY_ATTR {
          in_range = hn::And(in_range, hn::Lt(hn::And(hn::BitCast(di, v), abs_bits), limit));
          const size_t at = j + k * n;
          const auto yv = RoundToBf16(df, hn::Mul(v, e));
          hn::StoreU(yv, df, y + at);
          if constexpr (kRange) {
            hn::StoreU(first ? yv : hn::Min(hn::LoadU(df, lo + at), yv), df, lo + at);
            hn::StoreU(first ? yv : hn::Max(hn::LoadU(df, hi + at), yv), df, hi + at);
          }
        });
  }
  return hn::AllTrue(di, in_range);
}

// Codes of n rotated values y with zero points z and scales s (KIVI's QuantizeKiviKElement),
// stored as elements e.. of the row at `codes`.
HWY_INLINE void QuantizeCodes(DF df, hn::Vec<DF> y, hn::Vec<DF> z, hn::Vec<DF> s, uint8_t* codes,
                              size_t e) {
  const DI32 di32;
  const auto half = hn::Set(df, 0.5f);
  const auto q = hn::Round(
      hn::Mul(hn::Set(df, 2.0f), hn::Div(hn::Sub(hn::Mul(half, y), hn::Mul(half, z)), s)));
  const auto qc = hn::Min(hn::Max(q, hn::Zero(df)), hn::Set(df, static_cast<float>(kKiviKQMax)));
  StoreNibbles(di32, hn::ConvertTo(di32, qc), codes, e);
}

// Rows 1..num_rows-1 of the plane (row 0 is the caller's).
template <DType kDType>
bool EncodeRotatedT(const RowFormat& fmt, uint32_t plane, const StridedView& view,
                    const uint32_t* rows, uint32_t num_rows, uint8_t* dst) {
  const DF df;
  const size_t n = hn::Lanes(df);
  const uint32_t d = fmt.head_dim;
  const size_t ch = fmt.ElementsPerRow();
  const uint32_t m = num_rows - 1;
  const InVectorStages in_vector;
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(m) * ch + 2 * ch);
  float* y = scratch.data();
  // Plane 0: each channel's smallest and largest rotated value over the tokens, then its zero
  // point and scale as BF16 values (in place).
  float* zf = y + static_cast<size_t>(m) * ch;
  float* sf = zf + ch;
  for (uint32_t t = 0; t < m; ++t) {
    if (t + kPrefetchRows < m) PrefetchRow<false>(fmt, view, rows[t + 1 + kPrefetchRows]);
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      const uint8_t* src = view.Head(rows[t + 1], h);
      const size_t c0 = size_t{h} * d;
      float* yh = y + t * ch + c0;
      const bool ok =
          plane == 0 ? RotateHead<kDType, true>(in_vector, src, d, yh, zf + c0, sf + c0, t == 0)
                     : RotateHead<kDType, false>(in_vector, src, d, yh, nullptr, nullptr, false);
      if (!ok) return false;
    }
  }
  const auto half = hn::Set(df, 0.5f);
  const auto floor = hn::Set(df, BitsToFloat(kAmaxFloorBits));
  const auto levels = hn::Set(df, 7.5f);
  const auto zero = hn::Zero(df);
  if (plane == 0) {  // per channel over the tokens
    uint8_t* zeros = dst + fmt.PlaneRowOffset(0, num_rows);
    uint8_t* scales = zeros + 2 * ch;
    for (size_t c = 0; c < ch; c += n) {
      const auto lo = hn::LoadU(df, zf + c);
      const auto hi = hn::LoadU(df, sf + c);
      const auto r = hn::Max(hn::Sub(hn::Mul(half, hi), hn::Mul(half, lo)), floor);
      StoreHalf<DType::kBF16>(df, hn::Add(lo, zero), zeros + 2 * c);
      StoreHalf<DType::kBF16>(df, hn::Div(r, levels), scales + 2 * c);
      hn::StoreU(LoadHalf<DType::kBF16>(df, zeros + 2 * c), df, zf + c);
      hn::StoreU(LoadHalf<DType::kBF16>(df, scales + 2 * c), df, sf + c);
    }
    for (uint32_t t = 0; t < m; ++t) {
      uint8_t* codes = dst + fmt.PlaneRowOffset(0, t + 1);
      for (size_t c = 0; c < ch; c += n) {
        QuantizeCodes(df, hn::LoadU(df, y + t * ch + c), hn::LoadU(df, zf + c),
                      hn::LoadU(df, sf + c), codes, c);
      }
    }
    return true;
  }
  const size_t groups = ch / kG;  // plane 1: per group of 32 of one token
  for (uint32_t t = 0; t < m; ++t) {
    uint8_t* codes = dst + fmt.PlaneRowOffset(1, t + 1);
    uint8_t* zeros = codes + ch / 2;
    uint8_t* scales = zeros + 2 * groups;
    const float* yt = y + t * ch;
    for (size_t g = 0; g < groups; ++g) {
      const float* yg = yt + g * kG;
      auto lo = hn::LoadU(df, yg);
      auto hi = lo;
      for (size_t i = n; i < kG; i += n) {
        lo = hn::Min(lo, hn::LoadU(df, yg + i));
        hi = hn::Max(hi, hn::LoadU(df, yg + i));
      }
      const float glo = hn::GetLane(hn::MinOfLanes(df, lo));
      const float ghi = hn::GetLane(hn::MaxOfLanes(df, hi));
      const uint16_t z_bits = KiviKZeroBits(glo, DType::kBF16);
      const uint16_t s_bits = KiviKScaleBf16(glo, ghi);
      std::memcpy(zeros + 2 * g, &z_bits, 2);
      std::memcpy(scales + 2 * g, &s_bits, 2);
      const auto vz = hn::Set(df, Bf16ToFloat(z_bits));
      const auto vs = hn::Set(df, Bf16ToFloat(s_bits));
      for (size_t i = 0; i < kG; i += n) {
        QuantizeCodes(df, hn::LoadU(df, yg + i), vz, vs, codes, g * kG + i);
      }
    }
  }
  return true;
}

// Rows [begin, end) of the plane, begin >= 1.
template <DType kDType>
void DecodeRotatedT(const RowFormat& fmt, uint32_t plane, const uint8_t* src, uint32_t block_tokens,
                    uint32_t begin, uint32_t end, const StridedView& view, const uint32_t* rows) {
  const DF df;
  const DI32 di32;
  const DU8 du8;
  const size_t n = hn::Lanes(df);
  const uint32_t d = fmt.head_dim;
  const uint32_t r = HadamardRun(d);
  const size_t ch = fmt.ElementsPerRow();
  const auto half = hn::Set(df, 0.5f);
  const auto two = hn::Set(df, 2.0f);
  const auto cd = hn::Set(df, HadamardDecodeFactor(r));
  const InVectorStages in_vector;
  // tmp: a run that does not fit the registers; hz / hs: half of each zero point and scale (the
  // K plane's per channel, the V plane's per group of the current head), exact as the products
  // the element function takes them in.
  const size_t params = plane == 0 ? ch : d / kG;
  thread_local std::vector<float> scratch;
  scratch.resize(d + 2 * params);
  float* tmp = scratch.data();
  float* hz = tmp + d;
  float* hs = hz + params;
  thread_local std::vector<uint8_t> codes_scratch;
  codes_scratch.resize(d);
  uint8_t* q8 = codes_scratch.data();
  if (plane == 0) {
    const uint8_t* k_zeros = src + fmt.PlaneRowOffset(0, block_tokens);
    for (size_t c = 0; c < ch; c += n) {
      hn::StoreU(hn::Mul(half, LoadHalf<DType::kBF16>(df, k_zeros + 2 * c)), df, hz + c);
      hn::StoreU(hn::Mul(half, LoadHalf<DType::kBF16>(df, k_zeros + 2 * (ch + c))), df, hs + c);
    }
  }
  for (uint32_t t = begin; t < end; ++t) {
    const uint32_t row = rows[t - begin];
    if (t + kPrefetchRows < end) PrefetchRow<true>(fmt, view, rows[t + kPrefetchRows - begin]);
    const uint8_t* codes = src + fmt.PlaneRowOffset(plane, t);
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      const size_t c0 = size_t{h} * d;
      for (uint32_t g = 0; g < d; g += kG) UnpackNibbles32(codes + (c0 + g) / 2, q8 + g);
      uint8_t* out = view.Head(row, h);
      const auto store = [&](size_t e, hn::Vec<DF> v)
                             HWY_ATTR { StoreHalf<kDType>(df, hn::Mul(v, cd), out + 2 * e); };
      const auto code = [&](size_t e) HWY_ATTR {
        return hn::ConvertTo(df, hn::PromoteTo(di32, hn::LoadU(du8, q8 + e)));
      };
      if (plane == 0) {
        for (uint32_t j = 0; j < d; j += r) {
          TransformRun(
              in_vector, r, tmp,
              [&](size_t k) HWY_ATTR {
                const size_t e = j + k * n;
                return RoundToBf16(
                    df, hn::Mul(two, hn::Add(hn::Mul(code(e), hn::LoadU(df, hs + c0 + e)),
                                             hn::LoadU(df, hz + c0 + e))));
              },
              [&](size_t k, hn::Vec<DF> v) HWY_ATTR { store(j + k * n, v); });
        }
      } else {
        const uint8_t* zs = codes + ch / 2 + 2 * (c0 / kG);
        for (uint32_t g = 0; g < d / kG; ++g) {
          uint16_t z_bits;
          uint16_t s_bits;
          std::memcpy(&z_bits, zs + 2 * g, 2);
          std::memcpy(&s_bits, zs + 2 * (ch / kG + g), 2);
          hz[g] = 0.5f * Bf16ToFloat(z_bits);
          hs[g] = 0.5f * Bf16ToFloat(s_bits);
        }
        for (uint32_t j = 0; j < d; j += r) {
          TransformRun(
              in_vector, r, tmp,
              [&](size_t k) HWY_ATTR {
                const size_t e = j + k * n;
                return RoundToBf16(df,
                                   hn::Mul(two, hn::Add(hn::Mul(code(e), hn::Set(df, hs[e / kG])),
                                                        hn::Set(df, hz[e / kG]))));
              },
              [&](size_t k, hn::Vec<DF> v) HWY_ATTR { store(j + k * n, v); });
        }
      }
    }
  }
}

// The allot codecs' V plane (codec_cpu_allot.h): b-bit codes (b = fmt.Allot().value: 4, 5, 6),
// element e's at bit b e, least significant first: 8 codes in b bytes (head_dim % 32 == 0, so a
// head starts on such a group).
void PackCodes(const uint8_t* q8, uint32_t count, uint32_t b, uint8_t* out) {
  for (uint32_t i = 0; i < count; i += 8, out += b) {
    uint64_t w = 0;
    for (uint32_t k = 0; k < 8; ++k) w |= static_cast<uint64_t>(q8[i + k]) << (b * k);
    std::memcpy(out, &w, b);  // little-endian, as the reference's PutBits
  }
}

// Lane L of a vector of b-bit codes from element e (e % 8 + L < 16): its 32-bit word at byte
// (b (e % 8 + L)) / 8 of the b-byte group of element e - e % 8, shifted right by
// b (e % 8 + L) % 8 (at most 7 + b <= 32 bits).
struct CodeGather {
  HWY_ALIGN int32_t byte[16];
  HWY_ALIGN uint32_t shift[16];
  explicit CodeGather(uint32_t b) {
    for (uint32_t k = 0; k < 16; ++k) {
      byte[k] = static_cast<int32_t>(b * k / 8);
      shift[k] = b * k % 8;
    }
  }
};

// Tokens 1..num_rows-1 of an allot V plane: each head rotated (RotateHead), its smallest and
// largest value as its zero point and scale, its codes at fmt.Allot().value bits.
template <DType kDType>
bool EncodeAllotValuesT(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                        uint32_t num_rows, uint8_t* dst) {
  const DF df;
  const DI32 di32;
  const size_t n = hn::Lanes(df);
  const uint32_t d = fmt.head_dim;
  const size_t ch = fmt.ElementsPerRow();
  const InVectorStages in_vector;
  thread_local std::vector<float> y;
  thread_local std::vector<uint8_t> q8;
  y.resize(d);
  q8.resize(d);
  const auto half = hn::Set(df, 0.5f);
  const auto two = hn::Set(df, 2.0f);
  const AllotBits bits = fmt.Allot();
  const uint32_t top_level = AllotValueTop(bits);
  const auto top = hn::Set(df, static_cast<float>(top_level));
  for (uint32_t t = 1; t < num_rows; ++t) {
    if (t + kPrefetchRows < num_rows) PrefetchRow<false>(fmt, view, rows[t + kPrefetchRows]);
    uint8_t* codes = dst + fmt.PlaneRowOffset(1, t);
    uint8_t* zeros = codes + AllotValueCodeBytes(ch, bits);
    uint8_t* scales = zeros + 2 * fmt.num_heads;
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      if (!RotateHead<kDType, false>(in_vector, view.Head(rows[t], h), d, y.data(), nullptr,
                                     nullptr, false)) {
        return false;
      }
      auto lo = hn::LoadU(df, y.data());
      auto hi = lo;
      for (size_t i = n; i < d; i += n) {
        lo = hn::Min(lo, hn::LoadU(df, y.data() + i));
        hi = hn::Max(hi, hn::LoadU(df, y.data() + i));
      }
      const float glo = hn::GetLane(hn::MinOfLanes(df, lo));
      const float ghi = hn::GetLane(hn::MaxOfLanes(df, hi));
      const uint16_t z_bits = KiviKZeroBits(glo, DType::kBF16);
      const uint16_t s_bits = AsymScaleBf16(glo, ghi, top_level);
      std::memcpy(zeros + 2 * h, &z_bits, 2);
      std::memcpy(scales + 2 * h, &s_bits, 2);
      const auto hz = hn::Mul(half, hn::Set(df, Bf16ToFloat(z_bits)));
      const auto vs = hn::Set(df, Bf16ToFloat(s_bits));
      for (size_t i = 0; i < d; i += n) {
        const auto q = hn::Round(
            hn::Mul(two, hn::Div(hn::Sub(hn::Mul(half, hn::LoadU(df, y.data() + i)), hz), vs)));
        StoreCodes(hn::ConvertTo(di32, hn::Min(hn::Max(q, hn::Zero(df)), top)), q8.data() + i);
      }
      PackCodes(q8.data(), d, bits.value, codes + size_t{h} * d * bits.value / 8);
    }
  }
  return true;
}

// Rows [begin, end), begin >= 1, of an allot V plane: a head's codes gathered into
// registers, dequantized (rounded to BF16, as the reference), transformed back and stored.
template <DType kDType>
void DecodeAllotValuesT(const RowFormat& fmt, const uint8_t* src, uint32_t begin, uint32_t end,
                        const StridedView& view, const uint32_t* rows) {
  const DF df;
  const DI32 di32;
  const hn::RebindToUnsigned<DF> du32;
  const size_t n = hn::Lanes(df);
  const uint32_t d = fmt.head_dim;
  const uint32_t r = HadamardRun(d);
  const size_t ch = fmt.ElementsPerRow();
  const auto two = hn::Set(df, 2.0f);
  const auto cd = hn::Set(df, HadamardDecodeFactor(r));
  const InVectorStages in_vector;
  const AllotBits bits = fmt.Allot();
  const CodeGather gather(bits.value);
  const auto mask = hn::Set(du32, AllotValueTop(bits));
  thread_local std::vector<float> tmp;
  tmp.resize(d);
  for (uint32_t t = begin; t < end; ++t) {
    const uint32_t row = rows[t - begin];
    if (t + kPrefetchRows < end) PrefetchRow<true>(fmt, view, rows[t + kPrefetchRows - begin]);
    const uint8_t* codes = src + fmt.PlaneRowOffset(1, t);
    const uint8_t* zeros = codes + AllotValueCodeBytes(ch, bits);
    const uint8_t* scales = zeros + 2 * fmt.num_heads;
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      const uint8_t* head_codes = codes + size_t{h} * d * bits.value / 8;
      uint16_t z_bits;
      uint16_t s_bits;
      std::memcpy(&z_bits, zeros + 2 * h, 2);
      std::memcpy(&s_bits, scales + 2 * h, 2);
      const auto hz = hn::Set(df, 0.5f * Bf16ToFloat(z_bits));
      const auto hs = hn::Set(df, 0.5f * Bf16ToFloat(s_bits));
      uint8_t* out = view.Head(row, h);
      for (uint32_t j = 0; j < d; j += r) {
        TransformRun(
            in_vector, r, tmp.data(),
            [&](size_t k) HWY_ATTR {
              // Gathered as 32-bit words: at most 3 bytes past the head's codes, which the
              // row's zero points and scales after its last head hold.
              const size_t e = j + k * n;
              const auto word = hn::BitCast(
                  du32,
                  hn::GatherOffset(
                      di32, reinterpret_cast<const int32_t*>(head_codes + bits.value * (e / 8)),
                      hn::LoadU(di32, gather.byte + e % 8)));
              const auto q =
                  hn::And(hn::operator>>(word, hn::LoadU(du32, gather.shift + e % 8)), mask);
              return RoundToBf16(
                  df,
                  hn::Mul(two, hn::Add(hn::Mul(hn::ConvertTo(df, hn::BitCast(di32, q)), hs), hz)));
            },
            [&](size_t k, hn::Vec<DF> v)
                HWY_ATTR { StoreHalf<kDType>(df, hn::Mul(v, cd), out + 2 * (j + k * n)); });
      }
    }
  }
}

}  // namespace

bool EncodeAllotValuesRotated(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                              uint32_t num_rows, uint8_t* dst) {
  return fmt.dtype == DType::kBF16
             ? EncodeAllotValuesT<DType::kBF16>(fmt, view, rows, num_rows, dst)
             : EncodeAllotValuesT<DType::kFP16>(fmt, view, rows, num_rows, dst);
}

void DecodeAllotValuesRotated(const RowFormat& fmt, const uint8_t* src, uint32_t begin,
                              uint32_t end, const StridedView& view, const uint32_t* rows) {
  if (fmt.dtype == DType::kBF16) {
    DecodeAllotValuesT<DType::kBF16>(fmt, src, begin, end, view, rows);
  } else {
    DecodeAllotValuesT<DType::kFP16>(fmt, src, begin, end, view, rows);
  }
}

bool EncodeHadamardRotated(const RowFormat& fmt, uint32_t plane, const StridedView& view,
                           const uint32_t* rows, uint32_t num_rows, uint8_t* dst) {
  return fmt.dtype == DType::kBF16
             ? EncodeRotatedT<DType::kBF16>(fmt, plane, view, rows, num_rows, dst)
             : EncodeRotatedT<DType::kFP16>(fmt, plane, view, rows, num_rows, dst);
}

void DecodeHadamardRotated(const RowFormat& fmt, uint32_t plane, const uint8_t* src,
                           uint32_t block_tokens, uint32_t begin, uint32_t end,
                           const StridedView& view, const uint32_t* rows) {
  if (fmt.dtype == DType::kBF16) {
    DecodeRotatedT<DType::kBF16>(fmt, plane, src, block_tokens, begin, end, view, rows);
  } else {
    DecodeRotatedT<DType::kFP16>(fmt, plane, src, block_tokens, begin, end, view, rows);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace hiqcache::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace hiqcache::kernels {

HWY_EXPORT(EncodeHadamardRotated);
HWY_EXPORT(DecodeHadamardRotated);
HWY_EXPORT(EncodeAllotValuesRotated);
HWY_EXPORT(DecodeAllotValuesRotated);

bool EncodeHadamardPlaneSimd(const RowFormat& fmt, uint32_t plane, const StridedView& view,
                             const uint32_t* rows, uint32_t num_rows, uint8_t* dst) {
  return EncodeAfterInt8RowSimd(fmt, view, rows, num_rows, dst, [&] {
    return HWY_DYNAMIC_DISPATCH(EncodeHadamardRotated)(fmt, plane, view, rows, num_rows, dst);
  });
}

void DecodeHadamardRowsSimd(const RowFormat& fmt, uint32_t plane, const uint8_t* src,
                            uint32_t block_tokens, uint32_t begin, uint32_t end,
                            const StridedView& view, const uint32_t* rows) {
  DecodeAfterInt8RowSimd(fmt, src, begin, end, view, rows, [&](uint32_t from, const uint32_t* r) {
    HWY_DYNAMIC_DISPATCH(DecodeHadamardRotated)(fmt, plane, src, block_tokens, from, end, view, r);
  });
}

bool EncodeAllotValuesSimd(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                           uint32_t num_rows, uint8_t* dst) {
  return HWY_DYNAMIC_DISPATCH(EncodeAllotValuesRotated)(fmt, view, rows, num_rows, dst);
}

void DecodeAllotValuesSimd(const RowFormat& fmt, const uint8_t* src, uint32_t begin, uint32_t end,
                           const StridedView& view, const uint32_t* rows) {
  HWY_DYNAMIC_DISPATCH(DecodeAllotValuesRotated)(fmt, src, begin, end, view, rows);
}

}  // namespace hiqcache::kernels
#endif  // HWY_ONCE
