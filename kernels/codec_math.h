// The per-element arithmetic of every codec that quantizes (INT8, FP8, INT4 grouped, INT4 KIVI,
// INT4 Hadamard, the allot codecs: its section at the end and kernels/README.md), written once.
//
// Every executor (scalar reference, SIMD CPU executor's tails, CUDA kernels) calls these inline
// functions, so the record bytes cannot drift apart between them. Pure functions on bit patterns;
// no state, thread-safe. See docs/design.md "Record format" and kernels/README.md.
//
// INT8:
//   s  = bf16_rne(max(amax, 2^-112) / 127)        (amax and the division in fp32)
//   q  = clamp(round_half_even(x / s), -127, 127) (quotient in fp32)
//   x^ = rne(q * s) in the output dtype, saturated to its largest finite value
//
// FP8 E4M3 (OCP E4M3FN: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits; subnormals m * 2^-9;
// largest finite 448 = 0x7E; no infinities; 0x7F/0xFF are NaN and never written):
//   s  = bf16_rne(max(amax, 2^-112) / 448)        (fp32; s >= 2^-120.8 stays a normal bf16)
//   c  = e4m3_rne(x / s), |x / s| >= 448 saturated to +-448 (0x7E/0xFE); the quotient in fp32
//        (x has <= 11 significant bits and s 8, so x / s is never within 2^-24 relative of an
//        e4m3 tie unless it is one: rounding the fp32 quotient equals rounding the exact one).
//        Signs are kept: -0 and negatives that round to zero store 0x80.
//   x^ = rne(e4m3(c) * s) in the output dtype, saturated (e4m3(c) * s is exact in fp32)
//   An all-zero head stores zero codes and restores exact zeros (of the input's signs).
//
// FP8 error bound, elementwise (y = e4m3(c) * s, the value before the output rounding):
//   |y - x|  <= 2^-4 * |y| + 2^-10 * s
//     normal codes (|x / s| >= 2^-6): rne to 4 significant bits, |y - x| <= 2^-4 |y|; saturation
//     (448 < |x / s| <= 448 / (1 - 2^-8), as s may round down) stays inside that; subnormal and
//     zero codes: half the subnormal spacing 2^-9, times s.
//   |x^ - y| <= u * |x^| + a,  u = 2^-8 (BF16) or 2^-11 (FP16), a = the output's half subnormal
//     spacing (2^-134 BF16, 2^-25 FP16) where |x^| <= its smallest normal (2^-126, 2^-14), else 0.
//   Together: |x^ - x| <= 2^-4 * |x^| + 2^-10 * s + (1 + 2^-4) * (u * |x^| + a).
//   (BF16, normal outputs: about 0.0664 |x^| + 2^-10 s; INT8's is 0.5 s + 2^-8 |x^|.)
//
// INT4 grouped (each head split into groups of kInt4GroupElems = 32 consecutive elements;
// head_dim must be a multiple of 32; amax is the group's):
//   s  = bf16_rne(max(amax, 2^-112) / 7)          (fp32; s >= 2^-114.9 stays a normal bf16)
//   q  = clamp(round_half_even(x / s), -7, 7)     (quotient in fp32), stored as a
//        two's-complement nibble: element 2i of the row in the low nibble of byte i, 2i+1 in
//        the high one. -0 and negatives that round to zero store 0 (restored as +0). The nibble
//        0x8 (-8) is never written; a decoder given one (a corrupt record) reads -8 * s.
//   x^ = rne(q * s) in the output dtype, saturated (q * s is exact in fp32: 3 + 8 bits)
//   An all-zero group stores zero codes and restores exact zeros.
//
// INT4 error bound, elementwise, s the element's group scale (derived as INT8's):
//   s rounds amax / 7 to 8 significant bits, so s >= (amax / 7)(1 - 2^-8) and |x / s| <= 7.03:
//     rne lands in [-7, 7] (the clamp never binds on a finite input);
//   the fp32 quotient is within 7.03 * 2^-24 < 2^-21 of x / s, so |q - x / s| <= 0.5 + 2^-21;
//   the output rounding adds at most 2^-8 |x^| (BF16; FP16: 2^-11 |x^|, plus 2^-25 where x^ is
//   an fp16 subnormal, |x^| <= 2^-14). Together, INT8's bound with the group's s:
//   |x^ - x| <= (0.5 + 2^-8) * s + 2^-8 * |x^|   (+ 2^-25 for FP16 subnormal x^)
//   (about 0.072 amax of the group, against INT8's 0.0039 amax of the head.)
//
// INT4 KIVI, K plane (per channel c = (head, dim) over the block's tokens; lo/hi the channel's
// smallest and largest x; every product by 0.5 or 2 below is exact in fp32):
//   z  = lo + 0 (the input dtype's bits: exact; -0 stored as +0)
//   s  = bf16_rne(max(0.5 hi - 0.5 lo, 2^-112) / 7.5)   (fp32; s >= 2^-114.9, a normal bf16)
//   q  = clamp(round_half_even(2 * ((0.5 x - 0.5 z) / s)), 0, 15)   (fp32; the halving keeps a
//        range near the dtype's largest values finite), an unsigned nibble, element 2i of a row
//        low. A channel of one value (lo == hi) stores q = 0 and restores z = x exactly.
//   x^ = rne(2 * (q * (0.5 s) + 0.5 z)) in the output dtype, saturated: fp32's q * s + z, halved
//        so that a range near the dtype's largest values does not overflow (q * 0.5 s is exact in
//        fp32: 4 + 8 bits, so a fused multiply-add gives the same sum)
// V plane: INT4 grouped rows, exactly as above.
//
// INT4 KIVI K error bound, elementwise, s the element's channel scale:
//   s rounds (hi - lo) / 15 to 8 significant bits, so (x - z) / s <= 15 / (1 - 2^-8) < 15.06:
//     rne lands in [0, 15] (the clamp never binds on a finite channel);
//   the fp32 difference and quotient add at most 2 * 15.06 * 2^-24 < 2^-19 to |q - (x - z) / s|,
//     so |q * s + z - x| <= (0.5 + 2^-19) * s;
//   the fp32 sum y = fl(q * s + z) adds 2^-24 |y| <= 2^-23 |x^| (+ subnormal terms far below
//     2^-9 s), and the output rounding u |x^| (u = 2^-8 BF16, 2^-11 FP16; + 2^-25 where x^ is an
//     fp16 subnormal). Together:
//   |x^ - x| <= (0.5 + 2^-8) * s + (u + 2^-22) * |x^|   (+ 2^-25 for FP16 subnormal x^)
//   (s is about (hi - lo) / 15 of the channel: an outlier channel keeps its step to itself.)
//
// INT4 Hadamard (CODEC_INT4_HADAMARD). Token 0 of every block, in every plane, is an INT8 row of
// the input as above. Every other token is rotated and stored at 4 bits. Each head splits into
// runs of r = HadamardRun(head_dim) elements, the largest power of two dividing head_dim, 2^k
// (head_dim % 32 == 0, so r >= 32); per run:
//   v  = H_r x, the unnormalized Walsh-Hadamard transform in fp32, as k stages of stride
//        1, 2, 4, ..., r/2: each stage replaces every pair (v_i, v_{i+s}) with bit s of i clear by
//        (v_i + v_{i+s}, v_i - v_{i+s}). A fixed order of fp32 sums: every executor gets its bits.
//   y  = bf16_rne(v * 2^-floor(k/2))   (the product by a power of two is exact). A run with a
//        |v| >= 2^(126 - ceil(k/2)) (HadamardLimitBits), or not finite (NaN or Inf inputs), is
//        refused as NaN is: only BF16 inputs of magnitude near 2^120 reach it, and below it the
//        decode's transform cannot overflow (its partial sums are at most sum_j |y^_j| <=
//        2^ceil(k/2) max |y^| <= 1.02 * 2^-floor(k/2) * 2^ceil(k/2) * max |v| < 2^127), so every
//        executor decodes the same finite values.
//   The y are then quantized with KIVI's K arithmetic above, in bf16 (z = lo as bf16 bits,
//   s = KiviKScaleBf16(lo, hi), q = QuantizeKiviKElement): plane 0 (K, MLA's latent plane) per
//   channel over the block's tokens 1..block_tokens-1, plane 1 (V) per group of 32 consecutive y
//   of one token.
//   Decode: y^ = DequantizeKiviKElement(q, z, s, bf16), w = H_r y^ (the same stages in fp32),
//   x^ = rne(w * 2^-ceil(k/2)) in the output dtype, saturated. H_r H_r = r = 2^k, so with exact
//   arithmetic x^ = x.
//
// INT4 Hadamard error bound, elementwise, for element i of a 4-bit token (c = 2^-ceil(k/2); the
// sums run over the r elements j of i's run in that token; s_j the scale of y_j's group; u and a
// as for FP8 above):
//   |x^_i - x_i| <= c * sum_j [(0.5 + 2^-6) s_j + 2^-6 |y^_j|] + 2^-20 sum_j |x_j|
//                   + u |x^_i| + a + 2^-120
//   Derivation: with y*_j = 2^-floor(k/2) (H x)_j exactly, c H y* = x. Each fp32 transform of k
//   stages errs by at most k 2^-24 < 2^-20 (k <= 12) times the sum of its inputs' magnitudes;
//   y rounds to 8 significant bits (2^-8 |y_j|, plus 2^-134 below bf16's normals); KIVI's bound
//   gives |y^_j - y_j| <= (0.5 + 2^-8) s_j + (2^-8 + 2^-22) |y^_j|, and |y_j| <= |y^_j| +
//   0.51 s_j; |c (H e)_i| <= c sum_j |e_j|; the output rounding adds u |x^_i| + a.
//   (The step of one element is shared by its run: a channel's outlier spreads over r elements
//   at 1/sqrt(r) of its size instead of setting its group's scale.)
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define HIQ_HD __host__ __device__ __forceinline__
#else
#define HIQ_HD inline
#endif

namespace hiqcache::kernels {

enum class DType : uint8_t { kBF16 = 0, kFP16 = 1 };

// Largest |x| bit pattern (sign cleared) that is still finite.
constexpr uint16_t kBf16MaxFiniteBits = 0x7F7F;
constexpr uint16_t kFp16MaxFiniteBits = 0x7BFF;
// |x| bit patterns at or above these are Inf or NaN.
constexpr uint16_t kBf16InfBits = 0x7F80;
constexpr uint16_t kFp16InfBits = 0x7C00;
// 2^-112 as an fp32 bit pattern: the amax floor that keeps s a normal bf16 number.
constexpr uint32_t kAmaxFloorBits = (127u - 112u) << 23;
constexpr int kQMax = 127;

HIQ_HD float BitsToFloat(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

HIQ_HD uint32_t FloatToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

HIQ_HD float Bf16ToFloat(uint16_t bits) { return BitsToFloat(static_cast<uint32_t>(bits) << 16); }

// Exact fp16 -> fp32 (normals, subnormals, zero, Inf, NaN).
HIQ_HD float Fp16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return BitsToFloat(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return BitsToFloat(sign | ((exp + 112u) << 23) | (man << 13));
  // Zero or subnormal: man * 2^-24, exact in fp32.
  float mag = static_cast<float>(man) * BitsToFloat(0x33800000u);  // 2^-24
  return BitsToFloat(sign | FloatToBits(mag));
}

HIQ_HD float HalfToFloat(uint16_t bits, DType dtype) {
  return dtype == DType::kBF16 ? Bf16ToFloat(bits) : Fp16ToFloat(bits);
}

// fp32 -> bf16, round to nearest even, finite inputs saturated to +-bf16 max.
HIQ_HD uint16_t FloatToBf16Sat(float f) {
  uint32_t bits = FloatToBits(f);
  uint32_t sign = bits & 0x80000000u;
  uint32_t mag = bits & 0x7FFFFFFFu;
  mag += 0x7FFFu + ((mag >> 16) & 1u);
  uint32_t out = mag >> 16;
  if (out > kBf16MaxFiniteBits) out = kBf16MaxFiniteBits;
  return static_cast<uint16_t>((sign >> 16) | out);
}

// fp32 -> fp16, round to nearest even (subnormals included), saturated to +-65504.
HIQ_HD uint16_t FloatToFp16Sat(float f) {
  uint32_t bits = FloatToBits(f);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag >= 0x477FF000u) return sign | kFp16MaxFiniteBits;  // rounds to >= 65520: saturate
  if (mag >= 0x38800000u) {                                  // normal fp16 result
    uint32_t rounded = mag + 0xFFFu + ((mag >> 13) & 1u);
    return sign | static_cast<uint16_t>((rounded >> 13) - (112u << 10));
  }
  // Subnormal (or zero) fp16: value = m * 2^-24 with m rounded to nearest even.
  uint32_t exp = mag >> 23;
  if (exp < 102u) return sign;  // below 2^-25: rounds to zero
  uint32_t man = (mag & 0x7FFFFFu) | 0x800000u;
  uint32_t shift = 126u - exp;  // 14..24
  uint32_t q = man >> shift;
  uint32_t rem = man & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return sign | static_cast<uint16_t>(q);
}

HIQ_HD uint16_t FloatToHalfSat(float f, DType dtype) {
  return dtype == DType::kBF16 ? FloatToBf16Sat(f) : FloatToFp16Sat(f);
}

HIQ_HD uint16_t InfBits(DType dtype) { return dtype == DType::kBF16 ? kBf16InfBits : kFp16InfBits; }

// The bf16 scale of a head whose largest |x| has the (sign-cleared) bit pattern `amax_bits`.
// REQUIRES: amax_bits < InfBits(dtype) (the head is finite).
HIQ_HD uint16_t ScaleBf16FromAmaxBits(uint16_t amax_bits, DType dtype) {
  float amax = HalfToFloat(amax_bits, dtype);
  float floor = BitsToFloat(kAmaxFloorBits);
  if (amax < floor) amax = floor;
  return FloatToBf16Sat(amax / 127.0f);
}

HIQ_HD float RoundHalfEven(float v) {
#if defined(__CUDA_ARCH__)
  return rintf(v);
#else
  return __builtin_rintf(v);  // default rounding mode: to nearest, ties to even
#endif
}

// q = clamp(rne(x / s), -127, 127), quotient in fp32.
HIQ_HD int8_t QuantizeElement(float x, float s) {
  float q = RoundHalfEven(x / s);
  if (q > static_cast<float>(kQMax)) q = static_cast<float>(kQMax);
  if (q < -static_cast<float>(kQMax)) q = -static_cast<float>(kQMax);
  return static_cast<int8_t>(q);
}

HIQ_HD uint16_t DequantizeElement(int8_t q, float s, DType dtype) {
  return FloatToHalfSat(static_cast<float>(q) * s, dtype);
}

// ---------------------------------------------------------------------------------------------
// FP8 E4M3 per head.

constexpr uint8_t kE4m3MaxFinite = 0x7E;  // 448
constexpr float kE4m3MaxValue = 448.0f;
// |q| bit patterns (fp32): below kE4m3MinNormalBits (2^-6) the code is subnormal; at or above
// kE4m3SatBits (448.0f) it saturates.
constexpr uint32_t kE4m3MinNormalBits = 121u << 23;
constexpr uint32_t kE4m3SatBits = 0x43E00000u;
// 2^14: its fp32 ulp is 2^-9, the e4m3 subnormal spacing, so |q| + 2^14 rounds |q| / 2^-9 to
// nearest even in the low mantissa bits (|q| < 2^-6 there).
constexpr uint32_t kE4m3SubMagicBits = (127u + 14u) << 23;
// 2^120 = 2^(127 - 7): rebiases e4m3 bits placed in an fp32 exponent field.
constexpr uint32_t kE4m3RebiasBits = (127u + 120u) << 23;

// The bf16 scale of an FP8 head whose largest |x| has the (sign-cleared) bit pattern `amax_bits`.
// REQUIRES: amax_bits < InfBits(dtype) (the head is finite).
HIQ_HD uint16_t Fp8ScaleBf16FromAmaxBits(uint16_t amax_bits, DType dtype) {
  float amax = HalfToFloat(amax_bits, dtype);
  float floor = BitsToFloat(kAmaxFloorBits);
  if (amax < floor) amax = floor;
  return FloatToBf16Sat(amax / kE4m3MaxValue);
}

// fp32 -> OCP E4M3FN bits, round to nearest even (subnormals included), finite values saturated
// to +-448. Never returns 0x7F or 0xFF. REQUIRES: !isnan(q) (+-Inf saturates too).
HIQ_HD uint8_t FloatToE4m3Sat(float q) {
  const uint32_t bits = FloatToBits(q);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t mag = bits & 0x7FFFFFFFu;
  uint32_t code;
  if (mag >= kE4m3SatBits) {
    code = kE4m3MaxFinite;
  } else if (mag >= kE4m3MinNormalBits) {
    // Round the 20 dropped mantissa bits to nearest even; a carry moves into the exponent.
    // Below 448 this yields at most 0x7E (432..448 rounds to 448 at worst).
    const uint32_t rounded = mag + 0x7FFFFu + ((mag >> 20) & 1u);
    code = (rounded >> 20) - (120u << 3);
  } else {
    // Subnormal (or zero): rne(|q| / 2^-9) in 0..8 (8 is 2^-6, the smallest normal's code).
    const float t = BitsToFloat(mag) + BitsToFloat(kE4m3SubMagicBits);
    code = FloatToBits(t) - kE4m3SubMagicBits;
  }
  return static_cast<uint8_t>(sign | code);
}

// E4M3 bits -> fp32, exact (0x7F/0xFF, never written, read as +-480).
HIQ_HD float E4m3ToFloat(uint8_t c) {
  // The 7 magnitude bits placed at the top of an fp32 exponent/mantissa are 2^-120 times the
  // value, normal or (exponent field 0) an fp32 subnormal; the product by 2^120 is exact.
  const float mag =
      BitsToFloat(static_cast<uint32_t>(c & 0x7Fu) << 20) * BitsToFloat(kE4m3RebiasBits);
  return BitsToFloat(FloatToBits(mag) | (static_cast<uint32_t>(c & 0x80u) << 24));
}

// c = e4m3_rne_sat(x / s), quotient in fp32.
HIQ_HD uint8_t QuantizeFp8Element(float x, float s) { return FloatToE4m3Sat(x / s); }

HIQ_HD uint16_t DequantizeFp8Element(uint8_t c, float s, DType dtype) {
  return FloatToHalfSat(E4m3ToFloat(c) * s, dtype);
}

// ---------------------------------------------------------------------------------------------
// INT4, groups of 32 elements.

constexpr uint32_t kInt4GroupElems = 32;
constexpr int kInt4QMax = 7;

// The bf16 scale of an INT4 group whose largest |x| has the (sign-cleared) bit pattern
// `amax_bits`. REQUIRES: amax_bits < InfBits(dtype) (the group is finite).
HIQ_HD uint16_t Int4ScaleBf16FromAmaxBits(uint16_t amax_bits, DType dtype) {
  float amax = HalfToFloat(amax_bits, dtype);
  float floor = BitsToFloat(kAmaxFloorBits);
  if (amax < floor) amax = floor;
  return FloatToBf16Sat(amax / static_cast<float>(kInt4QMax));
}

// q = clamp(rne(x / s), -7, 7), quotient in fp32, as a two's-complement nibble (0..15).
HIQ_HD uint32_t QuantizeInt4Element(float x, float s) {
  float q = RoundHalfEven(x / s);
  if (q > static_cast<float>(kInt4QMax)) q = static_cast<float>(kInt4QMax);
  if (q < -static_cast<float>(kInt4QMax)) q = -static_cast<float>(kInt4QMax);
  return static_cast<uint32_t>(static_cast<int32_t>(q)) & 0xFu;
}

// The signed value of a nibble (its low 4 bits): -8..7.
HIQ_HD int32_t Int4NibbleValue(uint32_t nibble) {
  return static_cast<int32_t>((nibble & 0xFu) ^ 0x8u) - 8;
}

HIQ_HD uint16_t DequantizeInt4Element(uint32_t nibble, float s, DType dtype) {
  return FloatToHalfSat(static_cast<float>(Int4NibbleValue(nibble)) * s, dtype);
}

// ---------------------------------------------------------------------------------------------
// INT4 KIVI: K per channel over a block (asymmetric, 16 levels); V as INT4 grouped rows.

constexpr int kKiviKQMax = 15;

// The stored zero point of a channel whose smallest element is `lo` (a value of the input dtype,
// as fp32): lo's own bits, with -0 as +0.
HIQ_HD uint16_t KiviKZeroBits(float lo, DType dtype) { return FloatToHalfSat(lo + 0.0f, dtype); }

// The bf16 scale of a channel whose elements lie in [lo, hi] (finite values of the input dtype).
// The asymmetric codes of KIVI's K, of INT4 Hadamard and of the allot codecs, for
// `top` = 2^bits - 1 levels above the zero point z (bits <= 8): s = bf16_rne(max(0.5 hi - 0.5 lo,
// 2^-112) / (0.5 top)), q = clamp(rne(2 * ((0.5 x - 0.5 z) / s)), 0, top),
// x^ = 2 * (q * (0.5 s) + 0.5 z) in fp32 (q * 0.5 s is exact: 8 + 8 bits). The halvings keep a
// range near the largest finite values finite; 0.5 top is exact, so the scale is that of
// (hi - lo) / top.
HIQ_HD uint16_t AsymScaleBf16(float lo, float hi, uint32_t top) {
  float r = 0.5f * hi - 0.5f * lo;
  const float floor = BitsToFloat(kAmaxFloorBits);
  if (!(r >= floor)) r = floor;
  return FloatToBf16Sat(r / (0.5f * static_cast<float>(top)));
}

HIQ_HD uint32_t QuantizeAsymElement(float x, float z, float s, uint32_t top) {
  float q = RoundHalfEven(2.0f * ((0.5f * x - 0.5f * z) / s));
  if (q > static_cast<float>(top)) q = static_cast<float>(top);
  if (q < 0.0f) q = 0.0f;
  return static_cast<uint32_t>(q);
}

HIQ_HD float DequantizeAsymFloat(uint32_t q, float z, float s) {
  return 2.0f * (static_cast<float>(q) * (0.5f * s) + 0.5f * z);
}

// The bf16 scale of a channel whose elements lie in [lo, hi] (finite values of the input dtype).
HIQ_HD uint16_t KiviKScaleBf16(float lo, float hi) { return AsymScaleBf16(lo, hi, kKiviKQMax); }

// q = clamp(rne(2 * ((0.5 x - 0.5 z) / s)), 0, 15), as an unsigned nibble.
HIQ_HD uint32_t QuantizeKiviKElement(float x, float z, float s) {
  return QuantizeAsymElement(x, z, s, kKiviKQMax);
}

// x^ = rne(2 * (q * (0.5 s) + 0.5 z)): fp32's q * s + z, without overflow where the channel's
// range is near the dtype's largest values.
HIQ_HD uint16_t DequantizeKiviKElement(uint32_t nibble, float z, float s, DType dtype) {
  return FloatToHalfSat(DequantizeAsymFloat(nibble & 0xFu, z, s), dtype);
}

// ---------------------------------------------------------------------------------------------
// INT4 Hadamard: the rotation (its 4-bit codes are KIVI's K arithmetic on bf16 y).

// The rotation's run for `head_dim`: its largest power-of-two divisor.
HIQ_HD uint32_t HadamardRun(uint32_t head_dim) { return head_dim & (~head_dim + 1u); }

// log2 of a power of two (the Hadamard run's k; the CUDA launchers' lane groups).
HIQ_HD uint32_t Log2Pow2(uint32_t pow2) {
  uint32_t k = 0;
  while ((1u << k) < pow2) ++k;
  return k;
}

// 2^-floor(k/2) (encode) and 2^-ceil(k/2) (decode) for a run of r = 2^k: their product is 1/r.
HIQ_HD float HadamardEncodeFactor(uint32_t r) {
  return BitsToFloat((127u - Log2Pow2(r) / 2u) << 23);
}
HIQ_HD float HadamardDecodeFactor(uint32_t r) {
  return BitsToFloat((127u - (Log2Pow2(r) + 1u) / 2u) << 23);
}

// v[0..r) = H_r v, unnormalized, in fp32: stages of stride 1, 2, ..., r / 2, in that order.
// REQUIRES: r a power of two.
HIQ_HD void HadamardTransform(float* v, uint32_t r) {
  for (uint32_t s = 1; s < r; s <<= 1) {
    for (uint32_t i = 0; i < r; ++i) {
      if ((i & s) != 0) continue;
      const float a = v[i];
      const float b = v[i + s];
      v[i] = a + b;
      v[i + s] = a - b;
    }
  }
}

// The bound on |v| that encode accepts for a run of r = 2^k: 2^(126 - ceil(k/2)), as fp32 bits.
// Below it every partial sum of the decode's transform stays under 2^127 (finite).
HIQ_HD uint32_t HadamardLimitBits(uint32_t r) {
  return (127u + 126u - (Log2Pow2(r) + 1u) / 2u) << 23;
}

// Whether |v| < the limit whose bits are `limit_bits` (false for NaN and Inf).
HIQ_HD bool HadamardInRange(float v, uint32_t limit_bits) {
  return (FloatToBits(v) & 0x7FFFFFFFu) < limit_bits;
}

// ---------------------------------------------------------------------------------------------
// INT4, INT5 and INT6 allot (CODEC_INT4_ALLOT, CODEC_INT5_ALLOT, CODEC_INT6_ALLOT; the format is
// kernels/README.md's and record_format.h's): one format, three widths. AllotBits holds a codec's:
// its keys' bits per element on average, times 16, and its values' bits.
struct AllotBits {
  uint32_t key_x16 = 0;
  uint32_t value = 0;
};
constexpr AllotBits kInt4AllotBits{71, 4};  // keys 4.4375, values 4
constexpr AllotBits kInt5AllotBits{84, 5};  // keys 5.25, values 5
constexpr AllotBits kInt6AllotBits{84, 6};  // keys 5.25, values 6

// A channel's least and most bits.
constexpr uint32_t kAllotMinBits = 2;
constexpr uint32_t kAllotMaxBits = 8;
// The largest head_dim the CUDA kernels take (a head's 8-element chunks one per lane of a warp);
// registration refuses larger ones on a CUDA pool.
constexpr uint32_t kAllotCudaMaxHeadDim = 256;
// A head's step s_h = bf16_rne(max(m_h, 2^-112) / 126): the channel bounds floor(lo / s_h) and
// ceil(hi / s_h) stay in [-127, 127] (the rounding of s_h is at most 2^-8 relative).
constexpr float kAllotStepDivisor = 126.0f;
// Keys of magnitude >= 2^120 are refused as NaN is: their turned values and ranges stay finite.
constexpr uint32_t kAllotKeyLimitBits = (127u + 120u) << 23;
// One bit more for a channel (b -> b + 1) gains its range times 2^-b: the gain's fp32 bits are
// the range's less b << 23 (a range is >= 2^-119, so every gain is a normal number).
constexpr uint32_t kAllotExponentOne = 1u << 23;

// Bits of one stored key row (tokens 1..): key_x16 / 16 per element, down to whole bytes (no
// rounding at 5.25 bits, which D % 32 == 0 makes whole bytes; at 4.4375, where H*D % 128 != 0).
HIQ_HD size_t AllotKeyRowBits(size_t channels, AllotBits bits) {
  return channels * bits.key_x16 / 16 / 8 * 8;
}
HIQ_HD size_t AllotKeyRowBytes(size_t channels, AllotBits bits) {
  return AllotKeyRowBits(channels, bits) / 8;
}
// Widening steps shared by a block's channels: the row's bits less kAllotMinBits per channel.
HIQ_HD uint32_t AllotIncrements(size_t channels, AllotBits bits) {
  return static_cast<uint32_t>(AllotKeyRowBits(channels, bits) - kAllotMinBits * channels);
}
// Bytes of a value row's codes (H*D % 8 == 0), and a value code's largest level.
HIQ_HD size_t AllotValueCodeBytes(size_t channels, AllotBits bits) {
  return channels * bits.value / 8;
}
HIQ_HD uint32_t AllotValueTop(AllotBits bits) { return (1u << bits.value) - 1u; }

HIQ_HD float FloorFloat(float v) {
#if defined(__CUDA_ARCH__)
  return floorf(v);
#else
  return __builtin_floorf(v);
#endif
}

HIQ_HD float CeilFloat(float v) {
#if defined(__CUDA_ARCH__)
  return ceilf(v);
#else
  return __builtin_ceilf(v);
#endif
}

// The step of a head whose turned keys' largest |y| (tokens 1.., fp32) is m.
HIQ_HD uint16_t AllotStepBf16(float m) {
  const float floor = BitsToFloat(kAmaxFloorBits);
  if (!(m >= floor)) m = floor;
  return FloatToBf16Sat(m / kAllotStepDivisor);
}

// A channel's bounds in steps: floor(lo / s) and ceil(hi / s), quotients in fp32.
HIQ_HD int8_t AllotLowerSteps(float lo, float s) { return static_cast<int8_t>(FloorFloat(lo / s)); }
HIQ_HD int8_t AllotUpperSteps(float hi, float s) { return static_cast<int8_t>(CeilFloat(hi / s)); }

// The fp32 bits of a channel's range (upper - lower) * s, (a corrupt record's negative range
// or non-finite step read as the largest finite range or 0).
HIQ_HD uint32_t AllotRangeBits(int8_t lower, int8_t upper, float s) {
  const int32_t r = static_cast<int32_t>(upper) - static_cast<int32_t>(lower);
  const uint32_t u = FloatToBits(static_cast<float>(r > 0 ? r : 0) * s) & 0x7FFFFFFFu;
  return u > 0x7F7FFFFFu ? 0x7F7FFFFFu : u;
}

// Of a channel's widening steps b -> b + 1 (b = 2..7), how many gain more than fp32 bits t.
HIQ_HD uint32_t AllotStepsAbove(uint32_t range_bits, uint32_t t) {
  if (range_bits <= t) return 0;
  const uint32_t k = (range_bits - t + kAllotExponentOne - 1u) >> 23;  // b < k gain more
  if (k <= kAllotMinBits) return 0;
  return k - kAllotMinBits > kAllotMaxBits - kAllotMinBits ? kAllotMaxBits - kAllotMinBits
                                                           : k - kAllotMinBits;
}

// The allotment's threshold: the smallest fp32 bit pattern t with fewer than n widening steps
// gaining more than t, found by bisection over the bit patterns (a gain's bits order as its
// value); `above(t)` counts the steps of all channels gaining more than t (the sum of
// AllotStepsAbove; an executor may count in any order, the count is an integer). REQUIRES: n >= 1.
template <class CountAbove>
HIQ_HD uint32_t AllotThreshold(uint32_t n, const CountAbove& above) {
  uint32_t lo = 0;
  uint32_t hi = 0x7F800000u;  // above every range: no step gains more
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2u;
    if (above(mid) < n) {
      hi = mid;
    } else {
      lo = mid + 1u;
    }
  }
  return lo;
}

// The widths from the threshold t: each channel's steps gaining more than t, then the steps of
// gain exactly t channel by channel, until n steps are taken (never more).
HIQ_HD void AllotAssign(const uint32_t* range_bits, uint32_t channels, uint32_t n, uint32_t t,
                        uint8_t* widths) {
  uint32_t left = n;
  for (uint32_t c = 0; c < channels; ++c) {
    uint32_t k = AllotStepsAbove(range_bits[c], t);
    if (k > left) k = left;
    left -= k;
    widths[c] = static_cast<uint8_t>(kAllotMinBits + k);
  }
  for (uint32_t c = 0; c < channels && left > 0; ++c) {  // the steps of gain exactly t
    const uint32_t u = range_bits[c];
    const uint32_t room = kAllotMaxBits - widths[c];
    if (room == 0) continue;
    uint32_t k = 0;
    if (t == 0) {
      k = u == 0 ? room : 0;  // a zero range's steps all gain 0
    } else if (u > t && ((u - t) & (kAllotExponentOne - 1u)) == 0 && (u - t) >> 23 == widths[c]) {
      k = 1;  // its next step, b = widths[c], gains exactly t
    }
    if (k > left) k = left;
    left -= k;
    widths[c] = static_cast<uint8_t>(widths[c] + k);
  }
}

// The widths of a block's key channels (the allotment): every channel starts at 2 bits, and
// the n = AllotIncrements(channels, bits) widening steps of largest gain are taken, a step
// b -> b + 1 of channel c gaining R_c * 2^-b (R_c = its range, AllotRangeBits): the least
// squared error sum_c R_c^2 4^-w_c, as each channel's gains fall with every bit. Steps of equal
// gain are taken in channel order (AllotThreshold, then AllotAssign). Never more than n steps, so
// a corrupt record's widths still fit its rows. range_bits[c] for c < channels; widths[c] out.
HIQ_HD void AllotKeyWidths(const uint32_t* range_bits, uint32_t channels, AllotBits bits,
                           uint8_t* widths) {
  const uint32_t n = AllotIncrements(channels, bits);
  const uint32_t t = AllotThreshold(n, [&](uint32_t mid) {
    uint32_t above = 0;
    for (uint32_t c = 0; c < channels; ++c) above += AllotStepsAbove(range_bits[c], mid);
    return above;
  });
  AllotAssign(range_bits, channels, n, t, widths);
}

// Bit fields of up to 8 bits, least significant bit first, at bit offset `bit` of `row`.
// PutBits ORs into a zeroed row; GetBits reads only the bytes the field covers.
HIQ_HD void PutBits(uint8_t* row, size_t bit, uint32_t value, uint32_t width) {
  const size_t byte = bit >> 3;
  const uint32_t shift = static_cast<uint32_t>(bit & 7u);
  const uint32_t v = (value & ((1u << width) - 1u)) << shift;
  row[byte] = static_cast<uint8_t>(row[byte] | (v & 0xFFu));
  if (shift + width > 8u) row[byte + 1] = static_cast<uint8_t>(row[byte + 1] | (v >> 8));
}

HIQ_HD uint32_t GetBits(const uint8_t* row, size_t bit, uint32_t width) {
  const size_t byte = bit >> 3;
  const uint32_t shift = static_cast<uint32_t>(bit & 7u);
  uint32_t v = row[byte];
  if (shift + width > 8u) v |= static_cast<uint32_t>(row[byte + 1]) << 8;
  return (v >> shift) & ((1u << width) - 1u);
}

// The partner of element i in its RoPE pair and whether i is the pair's first: rotate-half
// pairs (i, i + D/2), or interleaved (2j, 2j + 1); the pair's frequency index is j.
HIQ_HD uint32_t RopePairIndex(uint32_t i, uint32_t head_dim, bool interleaved) {
  return interleaved ? i / 2u : (i < head_dim / 2u ? i : i - head_dim / 2u);
}
HIQ_HD uint32_t RopePartner(uint32_t i, uint32_t head_dim, bool interleaved) {
  return interleaved ? (i ^ 1u) : (i < head_dim / 2u ? i + head_dim / 2u : i - head_dim / 2u);
}
HIQ_HD bool RopeIsFirst(uint32_t i, uint32_t head_dim, bool interleaved) {
  return interleaved ? (i & 1u) == 0 : i < head_dim / 2u;
}

// The turn of a pair (a, b) by an angle of cosine c and sine s, in fp32 with every product and
// sum rounded on its own (never fused): back (encode) a c + b s, b c - a s; forward (decode)
// a c - b s, b c + a s. Element i of a pair is the first or the second.
HIQ_HD float TurnBack(float a, float b, float c, float s, bool first) {
  return first ? a * c + b * s : a * c - b * s;  // for the second, a is it and b the first
}
HIQ_HD float TurnForward(float a, float b, float c, float s, bool first) {
  return first ? a * c - b * s : a * c + b * s;
}

}  // namespace hiqcache::kernels
