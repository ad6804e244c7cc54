// Per-target SIMD helpers shared by the CPU codec executors (codec_cpu.cc for INT8,
// codec_cpu_fp8.cc, codec_cpu_int4.cc, codec_cpu_kivi.cc, codec_cpu_hadamard.cc): BF16/FP16
// loads and stores in f32 lanes, the amax of a head, the row prefetch, nibble packing, and the
// target macros. Every operation is the vector form of
// codec_math.h's, so every Highway target produces the scalar reference's bytes.
//
// A Highway "-inl.h" header: each executor includes it after <hwy/highway.h>, and
// foreach_target.h re-includes it once per target (the toggled guard below), so its functions
// land in hiqcache::kernels::HWY_NAMESPACE of that target. Pure functions; thread-safe.

#include <hwy/highway.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "codec_math.h"
#include "record_format.h"
#include "tensor_view.h"

// Per-target include guard (see hwy/contrib/*/-inl.h).
#if defined(HIQ_CODEC_SIMD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef HIQ_CODEC_SIMD_INL_H_
#undef HIQ_CODEC_SIMD_INL_H_
#else
#define HIQ_CODEC_SIMD_INL_H_
#endif

// Whether hn::DemoteTo(f32 -> f16) is the hardware conversion (round to nearest even, exact
// subnormals): x86 with F16C (the AVX2 and AVX-512 targets). Highway 1.0's emulation, used on
// SSSE3/SSE4, EMU128/SCALAR and NEON without FP16 support, truncates the mantissa instead, so
// every other target stores FP16 through FloatToFp16Vec below.
#undef HIQ_CODEC_HW_F16_DEMOTE
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
#define HIQ_CODEC_HW_F16_DEMOTE 1
#else
#define HIQ_CODEC_HW_F16_DEMOTE 0
#endif

// x86 targets with AVX2 or AVX-512, where the executors use a few raw intrinsics: Highway 1.0
// has no rounding f32 -> i32 conversion without an overflow fix-up (the codes never need one),
// and its i32 -> i8 demotion costs three shuffles per vector where four vectors can share three.
#undef HIQ_CODEC_X86_AVX3
#undef HIQ_CODEC_X86_AVX2
#define HIQ_CODEC_X86_AVX3 (HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3)
#define HIQ_CODEC_X86_AVX2 (HWY_ARCH_X86 && HWY_TARGET == HWY_AVX2)

HWY_BEFORE_NAMESPACE();
namespace hiqcache::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Rows ahead of the current one whose cache lines are prefetched (decode, and encode rows that
// are not batched). Rows are scattered to arbitrary slots, which the hardware prefetchers cannot
// predict. The prefetches go to L2 (locality hint 2, prefetcht1). On the Zen 4 VM of 2026-12-01
// the distance (1-16 rows, or no prefetch) made no measurable difference to decode, which is
// bound there by its stores' read-for-ownership traffic.
constexpr uint32_t kPrefetchRows = 2;
constexpr int kPrefetchLocality = 2;

// Loads Lanes(df) BF16/FP16 elements as f32 (exact).
template <DType kDType, class DF>
HWY_INLINE hn::Vec<DF> LoadHalf(DF df, const uint8_t* p) {
  if constexpr (kDType == DType::kBF16) {
    const hn::RebindToUnsigned<DF> du32;
    const hn::Rebind<uint16_t, DF> du16;
    auto u = hn::PromoteTo(du32, hn::LoadU(du16, reinterpret_cast<const uint16_t*>(p)));
    return hn::BitCast(df, hn::ShiftLeft<16>(u));
  } else {
    const hn::Rebind<hwy::float16_t, DF> df16;
    return hn::PromoteTo(df, hn::LoadU(df16, reinterpret_cast<const hwy::float16_t*>(p)));
  }
}

// f32 -> fp16 bits (in u32 lanes), round to nearest even incl. subnormals, for |y| <= 65504:
// the vector form of FloatToFp16Sat for targets without a hardware conversion.
template <class DF>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> FloatToFp16Vec(DF df, hn::Vec<DF> y) {
  const hn::RebindToUnsigned<DF> du32;
  const auto bits = hn::BitCast(du32, y);
  const auto mag = hn::And(bits, hn::Set(du32, 0x7FFFFFFFu));
  const auto sign = hn::And(hn::ShiftRight<16>(bits), hn::Set(du32, 0x8000u));
  // Normal results: round the 13 dropped mantissa bits to nearest even, rebias 127 -> 15.
  const auto lsb = hn::And(hn::ShiftRight<13>(mag), hn::Set(du32, 1u));
  const auto normal = hn::Sub(hn::ShiftRight<13>(hn::Add(mag, hn::Add(hn::Set(du32, 0xFFFu), lsb))),
                              hn::Set(du32, 112u << 10));
  // Subnormal results (|y| < 2^-14): adding 0.5 leaves a grid of 2^-24 in the mantissa, so the
  // fp32 addition itself rounds |y| / 2^-24 to nearest even.
  const auto sub = hn::Sub(hn::BitCast(du32, hn::Add(hn::BitCast(df, mag), hn::Set(df, 0.5f))),
                           hn::Set(du32, 0x3F000000u));
  const auto is_sub = hn::Lt(mag, hn::Set(du32, 0x38800000u));
  return hn::Or(sign, hn::IfThenElse(is_sub, sub, normal));
}

// The Lanes(df) f32 lanes of y as BF16/FP16 bits in u16 lanes: round to nearest even,
// saturated to the largest finite value.
template <DType kDType, class DF>
HWY_INLINE hn::Vec<hn::Rebind<uint16_t, DF>> HalfBits(DF df, hn::Vec<DF> y) {
  const hn::RebindToUnsigned<DF> du32;
  const hn::Rebind<uint16_t, DF> du16;
  // Values are < 2^16: the saturating i32 -> u16 demotion is exact.
  const hn::RebindToSigned<DF> di32;
  if constexpr (kDType == DType::kBF16) {
    const auto lim = hn::Set(df, Bf16ToFloat(kBf16MaxFiniteBits));
    y = hn::Min(hn::Max(y, hn::Neg(lim)), lim);
    auto bits = hn::BitCast(du32, y);
    auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du32, 1));
    bits = hn::ShiftRight<16>(hn::Add(bits, hn::Add(hn::Set(du32, 0x7FFFu), lsb)));
    return hn::DemoteTo(du16, hn::BitCast(di32, bits));
  } else {
    const auto lim = hn::Set(df, 65504.0f);
    y = hn::Min(hn::Max(y, hn::Neg(lim)), lim);
#if HIQ_CODEC_HW_F16_DEMOTE
    const hn::Rebind<hwy::float16_t, DF> df16;
    return hn::BitCast(du16, hn::DemoteTo(df16, y));
#else
    return hn::DemoteTo(du16, hn::BitCast(di32, FloatToFp16Vec(df, y)));
#endif
  }
}

// Stores the Lanes(df) f32 lanes of y as BF16/FP16 (HalfBits).
template <DType kDType, class DF>
HWY_INLINE void StoreHalf(DF df, hn::Vec<DF> y, uint8_t* p) {
  const hn::Rebind<uint16_t, DF> du16;
  hn::StoreU(HalfBits<kDType>(df, y), du16, reinterpret_cast<uint16_t*>(p));
}

// The largest |x| of a head of d elements as BF16/FP16 bits with the sign cleared (|x| orders
// like them).
HWY_INLINE uint32_t HeadAmaxBits(const uint8_t* src, uint32_t d) {
  const hn::ScalableTag<uint16_t> du16f;
  const size_t n16 = hn::Lanes(du16f);
  const uint16_t* s16 = reinterpret_cast<const uint16_t*>(src);
  auto vmax = hn::Zero(du16f);
  const auto abs_mask = hn::Set(du16f, 0x7FFFu);
  uint32_t i = 0;
  for (; i + n16 <= d; i += n16) {
    vmax = hn::Max(vmax, hn::And(hn::LoadU(du16f, s16 + i), abs_mask));
  }
  uint32_t amax_bits = i > 0 ? hn::GetLane(hn::MaxOfLanes(du16f, vmax)) : 0;
  for (; i < d; ++i) {
    uint16_t v;
    std::memcpy(&v, src + 2 * i, 2);
    amax_bits = std::max<uint32_t>(amax_bits, v & 0x7FFFu);
  }
  return amax_bits;
}

// Prefetches every cache line of the heads of `row` (for writing when kWrite).
template <bool kWrite>
HWY_INLINE void PrefetchRow(const RowFormat& fmt, const StridedView& view, uint32_t row) {
  const size_t head_bytes = static_cast<size_t>(fmt.head_dim) * 2;
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    const uint8_t* p = view.Head(row, h);
    for (size_t off = 0; off < head_bytes; off += 64) {
      __builtin_prefetch(p + off, kWrite, kPrefetchLocality);
    }
    __builtin_prefetch(p + head_bytes - 1, kWrite, kPrefetchLocality);
  }
}

// Stores Lanes(i32) codes of `q` (a vector of i32 lanes) as bytes: int8_t codes in [-127, 127]
// (INT8) or uint8_t codes in [0, 0xFE] (FP8).
template <typename Byte, class VI32>
HWY_INLINE void StoreCodes(VI32 q, Byte* dst) {
  const hn::Rebind<Byte, hn::DFromV<VI32>> d8;
  hn::StoreU(hn::DemoteTo(d8, q), d8, dst);
}

// Stores 4 * Lanes(i32) codes as bytes, a's first, with the value ranges of StoreCodes.
template <typename Byte, class VI32>
HWY_INLINE void StoreCodes4(VI32 a, VI32 b, VI32 c, VI32 d, Byte* dst) {
  static_assert(std::is_same_v<Byte, int8_t> || std::is_same_v<Byte, uint8_t>);
  constexpr bool kSigned = std::is_same_v<Byte, int8_t>;
#if HIQ_CODEC_X86_AVX3
  // Per 128-bit block k the packs leave dwords a[4k..4k+3], b[..], c[..], d[..]; gather them.
  // Every code fits a signed 16-bit lane, so the first pack is the signed one for both kinds.
  const __m512i ab = _mm512_packs_epi32(a.raw, b.raw);
  const __m512i cd = _mm512_packs_epi32(c.raw, d.raw);
  const __m512i abcd = kSigned ? _mm512_packs_epi16(ab, cd) : _mm512_packus_epi16(ab, cd);
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi32(idx, abcd));
#elif HIQ_CODEC_X86_AVX2
  const __m256i ab = _mm256_packs_epi32(a.raw, b.raw);
  const __m256i cd = _mm256_packs_epi32(c.raw, d.raw);
  const __m256i abcd = kSigned ? _mm256_packs_epi16(ab, cd) : _mm256_packus_epi16(ab, cd);
  const __m256i idx = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permutevar8x32_epi32(abcd, idx));
#else
  const size_t n = hn::Lanes(hn::DFromV<VI32>());
  StoreCodes(a, dst);
  StoreCodes(b, dst + n);
  StoreCodes(c, dst + 2 * n);
  StoreCodes(d, dst + 3 * n);
#endif
}

// Writes the d codes of a head with scale s: `quantize(x, vs)` maps a vector of f32 values to i32
// codes (vs = s in every lane), `quantize_one(x, s)` one value (the head's tail), as
// codec_math.h's element function of the codec does. Lambdas passed here need HWY_ATTR.
template <DType kDType, typename Byte, class QuantizeVecFn, class QuantizeOneFn>
HWY_INLINE void QuantizeHeadWith(const uint8_t* src, uint32_t d, float s, Byte* codes,
                                 QuantizeVecFn quantize, QuantizeOneFn quantize_one) {
  const hn::ScalableTag<float> df;
  const size_t n = hn::Lanes(df);
  const auto vs = hn::Set(df, s);
  uint32_t i = 0;
  for (; i + 4 * n <= d; i += 4 * n) {
    const uint8_t* p = src + 2 * i;
    StoreCodes4(quantize(LoadHalf<kDType>(df, p), vs),
                quantize(LoadHalf<kDType>(df, p + 2 * n), vs),
                quantize(LoadHalf<kDType>(df, p + 4 * n), vs),
                quantize(LoadHalf<kDType>(df, p + 6 * n), vs), codes + i);
  }
  for (; i + n <= d; i += n) StoreCodes(quantize(LoadHalf<kDType>(df, src + 2 * i), vs), codes + i);
  for (; i < d; ++i) {
    uint16_t v;
    std::memcpy(&v, src + 2 * i, 2);
    codes[i] = quantize_one(HalfToFloat(v, kDType), s);
  }
}

// Stores the codes in the i32 lanes of q (4-bit two's complement: 0..15 or -8..7) packed as the
// records hold them, element 2j in the low nibble of byte j: lane i of q is element e + i, and
// the Lanes(di) / 2 bytes from packed[e / 2] are written (e even). With one lane (HWY_SCALAR) a
// call writes its nibble of byte e / 2: an even e sets the whole byte, so element e + 1 must be
// stored after element e. Packed in registers: codes stored as bytes and packed from memory stall
// each group on a failed store-to-load forward.
template <class DI>
HWY_INLINE void StoreNibbles(DI di, hn::Vec<DI> q, uint8_t* packed, size_t e) {
#if HWY_TARGET == HWY_SCALAR
  (void)di;
  const auto c = static_cast<uint8_t>(hn::GetLane(q) & 0xF);
  packed[e / 2] = e % 2 == 0 ? c : static_cast<uint8_t>(packed[e / 2] | (c << 4));
#else
  (void)di;
  const hn::Repartition<uint64_t, DI> d64;
  const hn::Rebind<uint8_t, decltype(d64)> d8;
  const auto x = hn::BitCast(d64, q);
  const auto nibble = hn::Set(d64, uint64_t{0xF});
  const auto p =
      hn::Or(hn::And(x, nibble), hn::ShiftLeft<4>(hn::And(hn::ShiftRight<32>(x), nibble)));
  hn::StoreU(hn::TruncateTo(d8, p), d8, packed + e / 2);
#endif
}

// Unpacks 16 bytes into 32 codes (0..15), one per byte: StoreNibbles's inverse.
HWY_INLINE void UnpackNibbles32(const uint8_t* packed, uint8_t* q8) {
#if HWY_TARGET == HWY_SCALAR
  for (size_t j = 0; j < 16; ++j) {
    q8[2 * j] = packed[j] & 0xFu;
    q8[2 * j + 1] = packed[j] >> 4;
  }
#else
  const hn::CappedTag<uint16_t, 16> d16;
  const hn::Rebind<uint8_t, decltype(d16)> d8;
  const hn::Repartition<uint8_t, decltype(d16)> dbytes;
  const size_t m = hn::Lanes(d16);
  for (size_t j = 0; j < 16; j += m) {
    const auto b = hn::PromoteTo(d16, hn::LoadU(d8, packed + j));
    const auto w = hn::Or(hn::And(b, hn::Set(d16, 0x000Fu)),
                          hn::ShiftLeft<4>(hn::And(b, hn::Set(d16, 0x00F0u))));
    hn::StoreU(hn::BitCast(dbytes, w), dbytes, q8 + 2 * j);
  }
#endif
}

// The f32 lanes of y rounded to BF16 values (nearest even, saturated to the largest finite
// value), kept in f32 lanes: HalfBits<kBF16> without the narrowing.
template <class DF>
HWY_INLINE hn::Vec<DF> RoundToBf16(DF df, hn::Vec<DF> y) {
  const hn::RebindToUnsigned<DF> du32;
  const auto lim = hn::Set(df, Bf16ToFloat(kBf16MaxFiniteBits));
  const auto bits = hn::BitCast(du32, hn::Min(hn::Max(y, hn::Neg(lim)), lim));
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du32, 1));
  return hn::BitCast(
      df, hn::And(hn::Add(bits, hn::Add(hn::Set(du32, 0x7FFFu), lsb)), hn::Set(du32, 0xFFFF0000u)));
}

}  // namespace HWY_NAMESPACE
}  // namespace hiqcache::kernels
HWY_AFTER_NAMESPACE();

#endif  // HIQ_CODEC_SIMD_INL_H_
