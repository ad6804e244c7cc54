// The per-element arithmetic of every codec that quantizes (INT8, FP8, INT4 grouped, INT4 KIVI,
// INT4 Hadamard), written once.
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
HIQ_HD uint16_t KiviKScaleBf16(float lo, float hi) {
  float r = 0.5f * hi - 0.5f * lo;
  const float floor = BitsToFloat(kAmaxFloorBits);
  if (!(r >= floor)) r = floor;
  return FloatToBf16Sat(r / 7.5f);
}

// q = clamp(rne(2 * ((0.5 x - 0.5 z) / s)), 0, 15), as an unsigned nibble.
HIQ_HD uint32_t QuantizeKiviKElement(float x, float z, float s) {
  float q = RoundHalfEven(2.0f * ((0.5f * x - 0.5f * z) / s));
  if (q > static_cast<float>(kKiviKQMax)) q = static_cast<float>(kKiviKQMax);
  if (q < 0.0f) q = 0.0f;
  return static_cast<uint32_t>(q);
}

// x^ = rne(2 * (q * (0.5 s) + 0.5 z)): fp32's q * s + z, without overflow where the channel's
// range is near the dtype's largest values.
HIQ_HD uint16_t DequantizeKiviKElement(uint32_t nibble, float z, float s, DType dtype) {
  return FloatToHalfSat(2.0f * (static_cast<float>(nibble & 0xFu) * (0.5f * s) + 0.5f * z), dtype);
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

}  // namespace hiqcache::kernels
