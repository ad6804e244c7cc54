// The per-element arithmetic of CODEC_INT8_PER_HEAD, written once.
//
// Every executor (scalar reference, SIMD CPU executor's tails, CUDA kernels) calls these inline
// functions, so the record bytes cannot drift apart between them. Pure functions on bit patterns;
// no state, thread-safe. See ../shared/DESIGN.md "Record format".
//
//   s  = bf16_rne(max(amax, 2^-112) / 127)        (amax and the division in fp32)
//   q  = clamp(round_half_even(x / s), -127, 127) (quotient in fp32)
//   x^ = rne(q * s) in the output dtype, saturated to its largest finite value
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
  if (mag >= 0x38800000u) {                                     // normal fp16 result
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

HIQ_HD uint16_t InfBits(DType dtype) {
  return dtype == DType::kBF16 ? kBf16InfBits : kFp16InfBits;
}

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

}  // namespace hiqcache::kernels
