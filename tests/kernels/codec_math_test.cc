// codec_math.h against the independent float64 model in codec_test_util.h: the 16-bit
// conversions (exhaustively where the domain allows), the scales, the per-element quantizers
// (INT8 and FP8 E4M3: every code, ties, subnormal codes, saturation; INT4: every nibble, ties,
// the clamp) and the FP8 and INT4 error bounds.
#include "codec_math.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

#include "codec_test_util.h"

namespace hiqcache::kernels {
namespace {

using testutil::DoubleToHalfBits;
using testutil::HalfBitsToDouble;
using testutil::Rng;

float F32(uint32_t bits) { return BitsToFloat(bits); }

TEST(CodecMath, Fp16ToFloatExhaustive) {
  int mismatches = 0;
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float got = Fp16ToFloat(static_cast<uint16_t>(h));
    const double want = HalfBitsToDouble(static_cast<uint16_t>(h), DType::kFP16);
    bool ok;
    if (std::isnan(want)) {
      // NaN stays NaN with its sign and payload (shifted into the fp32 mantissa).
      ok = std::isnan(got) &&
           FloatToBits(got) == (((h & 0x8000u) << 16) | 0x7F800000u | ((h & 0x3FFu) << 13));
    } else {
      ok = static_cast<double>(got) == want && std::signbit(got) == std::signbit(want);
    }
    if (!ok && mismatches++ < 5) ADD_FAILURE() << "fp16 0x" << std::hex << h << " -> " << got;
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(CodecMath, Bf16ToFloatExhaustive) {
  int mismatches = 0;
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float got = Bf16ToFloat(static_cast<uint16_t>(h));
    const double want = HalfBitsToDouble(static_cast<uint16_t>(h), DType::kBF16);
    const bool ok = std::isnan(want) ? std::isnan(got)
                                     : static_cast<double>(got) == want &&
                                           std::signbit(got) == std::signbit(want);
    if (!ok && mismatches++ < 5) ADD_FAILURE() << "bf16 0x" << std::hex << h << " -> " << got;
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(CodecMath, HalfToFloatPicksTheDtype) {
  EXPECT_EQ(HalfToFloat(0x3C00, DType::kFP16), 1.0f);
  EXPECT_EQ(HalfToFloat(0x3F80, DType::kBF16), 1.0f);
  EXPECT_EQ(FloatToHalfSat(1.0f, DType::kFP16), 0x3C00);
  EXPECT_EQ(FloatToHalfSat(1.0f, DType::kBF16), 0x3F80);
  EXPECT_EQ(InfBits(DType::kFP16), 0x7C00);
  EXPECT_EQ(InfBits(DType::kBF16), 0x7F80);
}

// Every fp32 value that matters for rounding into `dtype`: each representable value, the exact
// midpoint to its upper neighbor (a tie), and the fp32 values just below and above each.
std::vector<float> RoundingProbes(DType dtype) {
  const float kInf = std::numeric_limits<float>::infinity();
  std::vector<float> probes;
  const uint16_t max_bits = testutil::FormatOf(dtype).max_bits;
  for (uint32_t b = 0; b <= max_bits; ++b) {
    const double lo = HalfBitsToDouble(static_cast<uint16_t>(b), dtype);
    const double hi = b < max_bits ? HalfBitsToDouble(static_cast<uint16_t>(b + 1), dtype)
                                   : 2 * lo - HalfBitsToDouble(static_cast<uint16_t>(b - 1), dtype);
    const float mid = static_cast<float>(0.5 * (lo + hi));  // exact: one more bit than dtype
    const float v = static_cast<float>(lo);
    for (float f :
         {v, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, kInf), std::nextafter(v, kInf)}) {
      probes.push_back(f);
      probes.push_back(-f);
    }
  }
  return probes;
}

void ExpectRoundsLikeModel(DType dtype, float f, int* mismatches) {
  const uint16_t got = FloatToHalfSat(f, dtype);
  const uint16_t want = DoubleToHalfBits(static_cast<double>(f), dtype);
  if (got != want && (*mismatches)++ < 5) {
    ADD_FAILURE() << testutil::DTypeName(dtype) << " of " << std::hexfloat << f << " (0x"
                  << std::hex << FloatToBits(f) << "): got 0x" << got << ", want 0x" << want;
  }
}

TEST(CodecMath, FloatToFp16SatTiesNeighborsAndSubnormals) {
  int mismatches = 0;
  const std::vector<float> probes = RoundingProbes(DType::kFP16);
  for (float f : probes) ExpectRoundsLikeModel(DType::kFP16, f, &mismatches);
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(probes.size(), 300000u);
  // Spot checks of the model itself, so it cannot be wrong in the same way.
  EXPECT_EQ(FloatToFp16Sat(0x1.0p-25f), 0x0000);  // tie between 0 and 2^-24
  EXPECT_EQ(FloatToFp16Sat(std::nextafter(0x1.0p-25f, 1.0f)), 0x0001);
  EXPECT_EQ(FloatToFp16Sat(0x1.8p-24f), 0x0002);         // tie 1.5 -> 2 (even)
  EXPECT_EQ(FloatToFp16Sat(0x1.4p-23f), 0x0002);         // tie 2.5 -> 2 (even)
  EXPECT_EQ(FloatToFp16Sat(0x1.ffcp-15f), 0x0400);       // largest subnormal tie up
  EXPECT_EQ(FloatToFp16Sat(1.0f + 0x1.0p-11f), 0x3C00);  // tie -> even 1.0
  EXPECT_EQ(FloatToFp16Sat(1.0f + 0x1.8p-10f), 0x3C02);  // tie -> even
  EXPECT_EQ(FloatToFp16Sat(-0.0f), 0x8000);
  EXPECT_EQ(FloatToFp16Sat(-0x1.0p-26f), 0x8000);
}

TEST(CodecMath, FloatToFp16SatSaturates) {
  EXPECT_EQ(FloatToFp16Sat(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToFp16Sat(65519.996f), 0x7BFF);  // below the tie: rounds to max
  EXPECT_EQ(FloatToFp16Sat(65520.0f), 0x7BFF);    // tie would round to 65536 = Inf
  EXPECT_EQ(FloatToFp16Sat(1e9f), 0x7BFF);
  EXPECT_EQ(FloatToFp16Sat(std::numeric_limits<float>::max()), 0x7BFF);
  EXPECT_EQ(FloatToFp16Sat(std::numeric_limits<float>::infinity()), 0x7BFF);
  EXPECT_EQ(FloatToFp16Sat(-std::numeric_limits<float>::infinity()), 0xFBFF);
  EXPECT_EQ(FloatToFp16Sat(-70000.0f), 0xFBFF);
}

TEST(CodecMath, FloatToBf16SatTiesNeighborsAndSubnormals) {
  int mismatches = 0;
  const std::vector<float> probes = RoundingProbes(DType::kBF16);
  for (float f : probes) ExpectRoundsLikeModel(DType::kBF16, f, &mismatches);
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(FloatToBf16Sat(1.0f + 0x1.0p-8f), 0x3F80);  // tie -> even
  EXPECT_EQ(FloatToBf16Sat(1.0f + 0x1.8p-7f), 0x3F82);  // tie -> even
  EXPECT_EQ(FloatToBf16Sat(F32(0x00008000u)), 0x0000);  // subnormal tie -> even 0
  EXPECT_EQ(FloatToBf16Sat(F32(0x00018000u)), 0x0002);  // subnormal tie -> even
  EXPECT_EQ(FloatToBf16Sat(F32(0x00008001u)), 0x0001);
  EXPECT_EQ(FloatToBf16Sat(F32(0x007FFFFFu)), 0x0080);  // rounds up into the normals
}

TEST(CodecMath, FloatToBf16SatSaturates) {
  EXPECT_EQ(FloatToBf16Sat(std::numeric_limits<float>::max()), 0x7F7F);
  EXPECT_EQ(FloatToBf16Sat(F32(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(FloatToBf16Sat(F32(0x7F7F8000u)), 0x7F7F);  // tie would round to Inf
  EXPECT_EQ(FloatToBf16Sat(std::numeric_limits<float>::infinity()), 0x7F7F);
  EXPECT_EQ(FloatToBf16Sat(-std::numeric_limits<float>::infinity()), 0xFF7F);
  EXPECT_EQ(FloatToBf16Sat(-std::numeric_limits<float>::max()), 0xFF7F);
}

// A stride through every fp32 bit pattern (finite ones), both signs, both dtypes.
TEST(CodecMath, FloatToHalfSatStrideOverAllFloats) {
  int mismatches = 0;
  for (uint64_t b = 0; b < 0x100000000ull; b += 509) {
    const uint32_t bits = static_cast<uint32_t>(b);
    if ((bits & 0x7F800000u) == 0x7F800000u) continue;  // Inf/NaN: not finite
    ExpectRoundsLikeModel(DType::kBF16, F32(bits), &mismatches);
    ExpectRoundsLikeModel(DType::kFP16, F32(bits), &mismatches);
  }
  EXPECT_EQ(mismatches, 0);
}

// The scale of every finite amax, both dtypes, against s computed in double.
TEST(CodecMath, ScaleExhaustive) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    int mismatches = 0;
    for (uint32_t a = 0; a < InfBits(dtype); ++a) {
      const double amax = HalfBitsToDouble(static_cast<uint16_t>(a), dtype);
      const uint16_t want =
          DoubleToHalfBits(std::max(amax, testutil::kAmaxFloor) / 127.0, DType::kBF16);
      const uint16_t got = ScaleBf16FromAmaxBits(static_cast<uint16_t>(a), dtype);
      if (got != want && mismatches++ < 5) {
        ADD_FAILURE() << testutil::DTypeName(dtype) << " amax 0x" << std::hex << a << ": 0x" << got
                      << " want 0x" << want;
      }
    }
    EXPECT_EQ(mismatches, 0) << testutil::DTypeName(dtype);
  }
  // The floor keeps s a normal bf16 number; a zero head gets the floor's scale.
  EXPECT_EQ(ScaleBf16FromAmaxBits(0, DType::kBF16), ScaleBf16FromAmaxBits(0, DType::kFP16));
  EXPECT_GE(ScaleBf16FromAmaxBits(0, DType::kBF16) & 0x7F80, 0x0080);
}

// The clamp of q to [-127, 127] never acts: for every finite amax, rne(amax / s) <= 127 with
// the fp32 quotient (and |x| <= amax gives smaller quotients). The SIMD executor relies on it.
TEST(CodecMath, ScaleKeepsCodesInRange) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    float worst = 0.0f;
    for (uint32_t a = 0; a < InfBits(dtype); ++a) {
      const float amax = HalfToFloat(static_cast<uint16_t>(a), dtype);
      const float s = Bf16ToFloat(ScaleBf16FromAmaxBits(static_cast<uint16_t>(a), dtype));
      worst = std::max(worst, amax / s);
      ASSERT_LE(RoundHalfEven(amax / s), 127.0f)
          << testutil::DTypeName(dtype) << " 0x" << std::hex << a;
    }
    EXPECT_GT(worst, 127.3f) << "the check should come close to the edge";
    EXPECT_LT(worst, 127.5f);
  }
}

TEST(CodecMath, RoundHalfEven) {
  EXPECT_EQ(RoundHalfEven(0.5f), 0.0f);
  EXPECT_EQ(RoundHalfEven(1.5f), 2.0f);
  EXPECT_EQ(RoundHalfEven(2.5f), 2.0f);
  EXPECT_EQ(RoundHalfEven(-2.5f), -2.0f);
  EXPECT_EQ(RoundHalfEven(-3.5f), -4.0f);
  EXPECT_EQ(RoundHalfEven(126.5f), 126.0f);
  EXPECT_EQ(RoundHalfEven(std::nextafter(126.5f, 200.0f)), 127.0f);
}

// QuantizeElement against the double quantizer: for many scales (from random amax values and
// the extremes), every finite x of the dtype with |x| <= amax.
TEST(CodecMath, QuantizeElementAgainstDouble) {
  Rng rng(7);
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    std::vector<uint16_t> amaxes = {0x0000, 0x0001, testutil::FormatOf(dtype).max_bits};
    for (int i = 0; i < 40; ++i) {
      amaxes.push_back(static_cast<uint16_t>(rng.Below(testutil::FormatOf(dtype).max_bits)));
    }
    amaxes.push_back(testutil::DoubleToHalfBits(127.0, dtype));  // s = 1: exact ties at k+1/2
    int mismatches = 0;
    for (uint16_t a : amaxes) {
      const float s = Bf16ToFloat(ScaleBf16FromAmaxBits(a, dtype));
      for (uint32_t xb = 0; xb <= a; ++xb) {
        for (uint32_t sign : {0u, 0x8000u}) {
          const uint16_t bits = static_cast<uint16_t>(xb | sign);
          const double x = HalfBitsToDouble(bits, dtype);
          const double q = std::min(127.0, std::max(-127.0, std::nearbyint(x / s)));
          const int8_t got = QuantizeElement(HalfToFloat(bits, dtype), s);
          if (got != static_cast<int8_t>(q) && mismatches++ < 5) {
            ADD_FAILURE() << testutil::DTypeName(dtype) << " x=" << x << " s=" << s << " got "
                          << int{got} << " want " << q;
          }
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << testutil::DTypeName(dtype);
  }
}

// Every code with every normal bf16 scale, both output dtypes.
TEST(CodecMath, DequantizeElementAgainstDouble) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    int mismatches = 0;
    for (uint32_t sb = 0x0080; sb <= 0x7F7F; ++sb) {
      const float s = Bf16ToFloat(static_cast<uint16_t>(sb));
      for (int q = -127; q <= 127; ++q) {
        const uint16_t got = DequantizeElement(static_cast<int8_t>(q), s, dtype);
        const uint16_t want =
            testutil::ModelDecodeElement(static_cast<int8_t>(q), static_cast<uint16_t>(sb), dtype);
        if (got != want && mismatches++ < 5) {
          ADD_FAILURE() << testutil::DTypeName(dtype) << " q=" << q << " s=" << s << " got 0x"
                        << std::hex << got << " want 0x" << want;
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << testutil::DTypeName(dtype);
  }
}

// ---------------------------------------------------------------------------------------------
// FP8 E4M3.

TEST(CodecMath, E4m3ToFloatEveryCode) {
  for (uint32_t c = 0; c < 256; ++c) {
    const float got = E4m3ToFloat(static_cast<uint8_t>(c));
    const double want = testutil::E4m3BitsToDouble(static_cast<uint8_t>(c));
    EXPECT_EQ(static_cast<double>(got), want) << "code 0x" << std::hex << c;
    EXPECT_EQ(std::signbit(got), (c & 0x80u) != 0) << "code 0x" << std::hex << c;
  }
  EXPECT_EQ(E4m3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(E4m3ToFloat(0x08), 0x1.0p-6f);
  EXPECT_EQ(E4m3ToFloat(0x01), 0x1.0p-9f);
  EXPECT_EQ(E4m3ToFloat(0x07), 7 * 0x1.0p-9f);
  EXPECT_EQ(E4m3ToFloat(0x38), 1.0f);
  EXPECT_EQ(E4m3ToFloat(0xBA), -1.25f);
  EXPECT_EQ(E4m3ToFloat(0x7F), 480.0f);  // NaN in E4M3FN: never written, read as 480
}

void ExpectE4m3LikeModel(float f, int* mismatches) {
  const uint8_t got = FloatToE4m3Sat(f);
  const uint8_t want = testutil::DoubleToE4m3Bits(static_cast<double>(f));
  if (got != want && (*mismatches)++ < 5) {
    ADD_FAILURE() << "e4m3 of " << std::hexfloat << f << " (0x" << std::hex << FloatToBits(f)
                  << "): got 0x" << int{got} << ", want 0x" << int{want};
  }
  if ((got & 0x7Fu) == 0x7Fu && (*mismatches)++ < 5) ADD_FAILURE() << "NaN code for " << f;
}

// Every e4m3 value, every midpoint (a tie) and the fp32 neighbours of both, both signs; then a
// stride through every finite fp32 bit pattern.
TEST(CodecMath, FloatToE4m3SatTiesNeighborsSubnormalsAndStride) {
  const float kInf = std::numeric_limits<float>::infinity();
  int mismatches = 0;
  size_t probes = 0;
  for (uint32_t c = 0; c <= 0x7E; ++c) {
    const float v = E4m3ToFloat(static_cast<uint8_t>(c));
    const float hi = c < 0x7E ? E4m3ToFloat(static_cast<uint8_t>(c + 1)) : 480.0f;
    const float mid = 0.5f * (v + hi);  // exact: one more bit than e4m3
    for (float f : {v, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, kInf),
                    std::nextafter(v, kInf), std::nextafter(v, 0.0f)}) {
      ExpectE4m3LikeModel(f, &mismatches);
      ExpectE4m3LikeModel(-f, &mismatches);
      probes += 2;
    }
  }
  for (uint64_t b = 0; b < 0x100000000ull; b += 257) {
    const uint32_t bits = static_cast<uint32_t>(b);
    if ((bits & 0x7F800000u) == 0x7F800000u) continue;  // Inf/NaN
    ExpectE4m3LikeModel(F32(bits), &mismatches);
    ++probes;
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(probes, 16000000u);
  // Hand-checked answers, so the model cannot be wrong in the same way.
  EXPECT_EQ(FloatToE4m3Sat(0x1.0p-10f), 0x00);  // tie between 0 and 2^-9 -> even 0
  EXPECT_EQ(FloatToE4m3Sat(std::nextafter(0x1.0p-10f, 1.0f)), 0x01);
  EXPECT_EQ(FloatToE4m3Sat(3 * 0x1.0p-10f), 0x02);        // tie 1.5 -> 2 (even)
  EXPECT_EQ(FloatToE4m3Sat(5 * 0x1.0p-10f), 0x02);        // tie 2.5 -> 2 (even)
  EXPECT_EQ(FloatToE4m3Sat(15 * 0x1.0p-10f), 0x08);       // tie 7.5 -> 8: the smallest normal
  EXPECT_EQ(FloatToE4m3Sat(1.0f + 0x1.0p-4f), 0x38);      // tie -> even 1.0
  EXPECT_EQ(FloatToE4m3Sat(1.0f + 3 * 0x1.0p-4f), 0x3A);  // tie -> even 1.25
  EXPECT_EQ(FloatToE4m3Sat(432.0f), 0x7E);                // tie 416|448 -> even 448
  EXPECT_EQ(FloatToE4m3Sat(std::nextafter(432.0f, 0.0f)), 0x7D);
  EXPECT_EQ(FloatToE4m3Sat(448.0f), 0x7E);
  EXPECT_EQ(FloatToE4m3Sat(464.0f), 0x7E);  // would round to 480 (NaN): saturates
  EXPECT_EQ(FloatToE4m3Sat(1e30f), 0x7E);
  EXPECT_EQ(FloatToE4m3Sat(kInf), 0x7E);
  EXPECT_EQ(FloatToE4m3Sat(-kInf), 0xFE);
  EXPECT_EQ(FloatToE4m3Sat(-449.75f), 0xFE);
  EXPECT_EQ(FloatToE4m3Sat(-0.0f), 0x80);
  EXPECT_EQ(FloatToE4m3Sat(-0x1.0p-12f), 0x80);
  EXPECT_EQ(FloatToE4m3Sat(F32(0x00000001u)), 0x00);  // fp32 subnormal
}

TEST(CodecMath, E4m3ModelSanity) {
  EXPECT_EQ(testutil::DoubleToE4m3Bits(1.0), 0x38);
  EXPECT_EQ(testutil::DoubleToE4m3Bits(-2.0), 0xC0);
  EXPECT_EQ(testutil::DoubleToE4m3Bits(448.0), 0x7E);
  EXPECT_EQ(testutil::DoubleToE4m3Bits(0x1.0p-9), 0x01);
  EXPECT_EQ(testutil::DoubleToE4m3Bits(0x1.0p-6), 0x08);
  EXPECT_EQ(testutil::DoubleToE4m3Bits(1.75 * 0x1.0p-7), 0x07);  // 7 * 2^-9, largest subnormal
  EXPECT_EQ(testutil::E4m3BitsToDouble(0x7E), 448.0);
  EXPECT_EQ(testutil::E4m3BitsToDouble(0x80), 0.0);
  EXPECT_EQ(testutil::E4m3BitsToDouble(0xF0), -128.0);
  EXPECT_EQ(testutil::E4m3BitsToDouble(0x7D), 416.0);
}

// The FP8 scale of every finite amax, both dtypes, against s computed in double; it stays a
// normal bf16 number, and the largest quotient amax / s stays within 448 / (1 - 2^-8) (the
// saturation the bound's derivation allows) while exceeding 448 somewhere (saturation happens).
TEST(CodecMath, Fp8ScaleExhaustive) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    int mismatches = 0;
    float worst = 0.0f;
    for (uint32_t a = 0; a < InfBits(dtype); ++a) {
      const double amax = HalfBitsToDouble(static_cast<uint16_t>(a), dtype);
      const uint16_t want =
          DoubleToHalfBits(std::max(amax, testutil::kAmaxFloor) / 448.0, DType::kBF16);
      const uint16_t got = Fp8ScaleBf16FromAmaxBits(static_cast<uint16_t>(a), dtype);
      if (got != want && mismatches++ < 5) {
        ADD_FAILURE() << testutil::DTypeName(dtype) << " amax 0x" << std::hex << a << ": 0x" << got
                      << " want 0x" << want;
      }
      ASSERT_GE(got & 0x7F80, 0x0080) << "scale not a normal bf16";
      ASSERT_LT(got & 0x7F80, 0x7F80) << "scale not finite";
      const float q = HalfToFloat(static_cast<uint16_t>(a), dtype) / Bf16ToFloat(got);
      worst = std::max(worst, q);
      if (q >= 432.0f) ASSERT_EQ(FloatToE4m3Sat(q), 0x7E) << q;
    }
    EXPECT_EQ(mismatches, 0) << testutil::DTypeName(dtype);
    EXPECT_GT(worst, 448.0f) << testutil::DTypeName(dtype);
    EXPECT_LE(worst, 448.0 / (1.0 - 0x1.0p-8)) << testutil::DTypeName(dtype);
  }
  EXPECT_EQ(Fp8ScaleBf16FromAmaxBits(0, DType::kBF16), Fp8ScaleBf16FromAmaxBits(0, DType::kFP16));
}

// QuantizeFp8Element against the double quantizer: for many scales (random amax values, the
// extremes, exact powers of two so that x / s hits e4m3 ties), every finite x with |x| <= amax.
TEST(CodecMath, QuantizeFp8ElementAgainstDouble) {
  Rng rng(11);
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const uint16_t max_bits = testutil::FormatOf(dtype).max_bits;
    std::vector<uint16_t> amaxes = {0x0000, 0x0001, max_bits};
    for (int i = 0; i < 40; ++i) amaxes.push_back(static_cast<uint16_t>(rng.Below(max_bits)));
    for (double a : {448.0, 448.0 * 3, 448.0 / 64, 448.0 * 0x1.0p-20}) {
      amaxes.push_back(testutil::DoubleToHalfBits(a, dtype));
    }
    int mismatches = 0;
    for (uint16_t a : amaxes) {
      const float s = Bf16ToFloat(Fp8ScaleBf16FromAmaxBits(a, dtype));
      for (uint32_t xb = 0; xb <= a; ++xb) {
        for (uint32_t sign : {0u, 0x8000u}) {
          const uint16_t bits = static_cast<uint16_t>(xb | sign);
          const uint8_t want = testutil::DoubleToE4m3Bits(HalfBitsToDouble(bits, dtype) / s);
          const uint8_t got = QuantizeFp8Element(HalfToFloat(bits, dtype), s);
          if (got != want && mismatches++ < 5) {
            ADD_FAILURE() << testutil::DTypeName(dtype) << " x=0x" << std::hex << bits << " s=" << s
                          << " got 0x" << int{got} << " want 0x" << int{want};
          }
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << testutil::DTypeName(dtype);
  }
}

// Every code (0x7F/0xFF included) with every normal bf16 scale, both output dtypes.
TEST(CodecMath, DequantizeFp8ElementAgainstDouble) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    int mismatches = 0;
    for (uint32_t sb = 0x0080; sb <= 0x7F7F; ++sb) {
      const float s = Bf16ToFloat(static_cast<uint16_t>(sb));
      for (uint32_t c = 0; c < 256; ++c) {
        const uint16_t got = DequantizeFp8Element(static_cast<uint8_t>(c), s, dtype);
        const uint16_t want = testutil::ModelDecodeElementFp8(static_cast<uint8_t>(c),
                                                              static_cast<uint16_t>(sb), dtype);
        if (got != want && mismatches++ < 5) {
          ADD_FAILURE() << testutil::DTypeName(dtype) << " c=0x" << std::hex << c << " s=" << s
                        << " got 0x" << got << " want 0x" << want;
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << testutil::DTypeName(dtype);
  }
}

// The FP8 bound, element by element through the shared arithmetic: for many amax values (zero,
// below the floor, subnormal, around the scale's rounding, the dtype's largest), every finite x
// with |x| <= amax, both signs. The largest error / bound ratio shows the bound is tight.
TEST(CodecMath, Fp8ErrorBoundHoldsForEveryValue) {
  Rng rng(13);
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const uint16_t max_bits = testutil::FormatOf(dtype).max_bits;
    std::vector<uint16_t> amaxes = {0x0000, 0x0001, 0x0003, max_bits,
                                    static_cast<uint16_t>(max_bits - 1)};
    for (int i = 0; i < 24; ++i) amaxes.push_back(static_cast<uint16_t>(rng.Below(max_bits)));
    for (double a : {448.0, 449.0, 1.0, 0x1.0p-112, 0x1.0p-113, 3e-4}) {
      amaxes.push_back(testutil::DoubleToHalfBits(a, dtype));
    }
    uint64_t checked = 0, violations = 0;
    double worst_ratio = 0.0, worst_rel = 0.0;
    for (uint16_t a : amaxes) {
      const uint16_t sb = Fp8ScaleBf16FromAmaxBits(a, dtype);
      const float s = Bf16ToFloat(sb);
      for (uint32_t xb = 0; xb <= a; ++xb) {
        for (uint32_t sign : {0u, 0x8000u}) {
          const uint16_t bits = static_cast<uint16_t>(xb | sign);
          const uint8_t c = QuantizeFp8Element(HalfToFloat(bits, dtype), s);
          const uint16_t yb = DequantizeFp8Element(c, s, dtype);
          const double x = HalfBitsToDouble(bits, dtype);
          const double y = HalfBitsToDouble(yb, dtype);
          const double err = std::fabs(y - x);
          const double bound = testutil::Fp8ErrorBound(s, y, dtype);
          ++checked;
          worst_ratio = std::max(worst_ratio, err / bound);
          if (std::fabs(y) > 64 * s) worst_rel = std::max(worst_rel, err / std::fabs(y));
          if (!(err <= bound) && violations++ < 5) {
            ADD_FAILURE() << testutil::DTypeName(dtype) << std::hexfloat << " x=" << x
                          << " x^=" << y << " s=" << s << " err=" << err << " bound=" << bound;
          }
        }
      }
    }
    EXPECT_EQ(violations, 0u) << testutil::DTypeName(dtype);
    EXPECT_GT(checked, 1000000u);
    EXPECT_GT(worst_ratio, 0.9) << "the bound should be nearly reached";
    EXPECT_GT(worst_rel, 0.05) << "relative error near 2^-4 for normal codes";
    std::printf("  %s: %llu elements, max err/bound %.4f, max rel err (|x^| > 64 s) %.5f\n",
                testutil::DTypeName(dtype), static_cast<unsigned long long>(checked), worst_ratio,
                worst_rel);
  }
}

// ---------------------------------------------------------------------------------------------
// INT4, groups of 32.

// The scale for every finite amax of both dtypes, and the largest quotient it allows (<= 7.03:
// every code of a finite group is in [-7, 7] before the clamp).
TEST(CodecMath, Int4ScaleExhaustive) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    int mismatches = 0;
    float worst = 0.0f;
    for (uint32_t a = 0; a < InfBits(dtype); ++a) {
      const double amax = HalfBitsToDouble(static_cast<uint16_t>(a), dtype);
      const uint16_t want =
          DoubleToHalfBits(std::max(amax, testutil::kAmaxFloor) / 7.0, DType::kBF16);
      const uint16_t got = Int4ScaleBf16FromAmaxBits(static_cast<uint16_t>(a), dtype);
      if (got != want && mismatches++ < 5) {
        ADD_FAILURE() << testutil::DTypeName(dtype) << " amax 0x" << std::hex << a << ": 0x" << got
                      << " want 0x" << want;
      }
      ASSERT_GE(got & 0x7F80, 0x0080) << "scale not a normal bf16";
      ASSERT_LT(got & 0x7F80, 0x7F80) << "scale not finite";
      const float q = HalfToFloat(static_cast<uint16_t>(a), dtype) / Bf16ToFloat(got);
      worst = std::max(worst, q);
      ASSERT_LT(q, 7.5f);
    }
    EXPECT_EQ(mismatches, 0) << testutil::DTypeName(dtype);
    EXPECT_GT(worst, 7.0f) << testutil::DTypeName(dtype);
    EXPECT_LE(worst, 7.0 / (1.0 - 0x1.0p-8)) << testutil::DTypeName(dtype);
  }
}

// QuantizeInt4Element against the double quantizer: for many scales (random amax values, the
// extremes, exact multiples so that x / s hits ties), every finite x with |x| <= amax and
// beyond it (the clamp), both signs.
TEST(CodecMath, QuantizeInt4ElementAgainstDouble) {
  Rng rng(17);
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const uint16_t max_bits = testutil::FormatOf(dtype).max_bits;
    std::vector<uint16_t> amaxes = {0x0000, 0x0001, max_bits};
    for (int i = 0; i < 40; ++i) amaxes.push_back(static_cast<uint16_t>(rng.Below(max_bits)));
    for (double a : {7.0, 7.0 * 3, 7.0 / 64, 7.0 * 0x1.0p-20, 14.0}) {
      amaxes.push_back(testutil::DoubleToHalfBits(a, dtype));
    }
    int mismatches = 0, clamped = 0;
    for (uint16_t a : amaxes) {
      const float s = Bf16ToFloat(Int4ScaleBf16FromAmaxBits(a, dtype));
      const uint32_t top = std::min<uint32_t>(max_bits, a + 0x400u);  // past amax: clamps
      for (uint32_t xb = 0; xb <= top; ++xb) {
        for (uint32_t sign : {0u, 0x8000u}) {
          const uint16_t bits = static_cast<uint16_t>(xb | sign);
          double q = std::nearbyint(HalfBitsToDouble(bits, dtype) / s);
          clamped += std::fabs(q) > 7.0;
          q = std::min(7.0, std::max(-7.0, q));
          const uint32_t want = static_cast<uint32_t>(static_cast<int>(q)) & 0xFu;
          const uint32_t got = QuantizeInt4Element(HalfToFloat(bits, dtype), s);
          if (got != want && mismatches++ < 5) {
            ADD_FAILURE() << testutil::DTypeName(dtype) << " x=0x" << std::hex << bits << " s=" << s
                          << " got 0x" << got << " want 0x" << want;
          }
          ASSERT_NE(got, 0x8u);
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << testutil::DTypeName(dtype);
    EXPECT_GT(clamped, 0) << testutil::DTypeName(dtype);
  }
}

// Every nibble (0x8 included) with every normal bf16 scale, both output dtypes.
TEST(CodecMath, DequantizeInt4ElementAgainstDouble) {
  EXPECT_EQ(Int4NibbleValue(0x7), 7);
  EXPECT_EQ(Int4NibbleValue(0x9), -7);
  EXPECT_EQ(Int4NibbleValue(0xF), -1);
  EXPECT_EQ(Int4NibbleValue(0x8), -8);
  EXPECT_EQ(Int4NibbleValue(0x13), 3);  // only the low 4 bits count
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    int mismatches = 0;
    for (uint32_t sb = 0x0080; sb <= 0x7F7F; ++sb) {
      const float s = Bf16ToFloat(static_cast<uint16_t>(sb));
      for (uint32_t c = 0; c < 16; ++c) {
        const uint16_t got = DequantizeInt4Element(c, s, dtype);
        const uint16_t want = testutil::ModelDecodeElementInt4(static_cast<uint8_t>(c),
                                                               static_cast<uint16_t>(sb), dtype);
        if (got != want && mismatches++ < 5) {
          ADD_FAILURE() << testutil::DTypeName(dtype) << " c=0x" << std::hex << c << " s=" << s
                        << " got 0x" << got << " want 0x" << want;
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << testutil::DTypeName(dtype);
  }
}

// The INT4 bound (INT8's with the group's scale), element by element through the shared
// arithmetic: for many amax values (zero, below the floor, subnormal, the dtype's largest, ones
// whose scale rounds down), every finite x with |x| <= amax, both signs. The largest error / s
// shows the bound is nearly reached (half a step).
TEST(CodecMath, Int4ErrorBoundHoldsForEveryValue) {
  Rng rng(19);
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const uint16_t max_bits = testutil::FormatOf(dtype).max_bits;
    std::vector<uint16_t> amaxes = {0x0000, 0x0001, 0x0003, max_bits,
                                    static_cast<uint16_t>(max_bits - 1)};
    for (int i = 0; i < 24; ++i) amaxes.push_back(static_cast<uint16_t>(rng.Below(max_bits)));
    for (double a : {7.0, 7.1, 1.0, 0x1.0p-112, 0x1.0p-113, 3e-4}) {
      amaxes.push_back(testutil::DoubleToHalfBits(a, dtype));
    }
    uint64_t checked = 0, violations = 0;
    double worst_ratio = 0.0, worst_over_s = 0.0;
    for (uint16_t a : amaxes) {
      const float s = Bf16ToFloat(Int4ScaleBf16FromAmaxBits(a, dtype));
      for (uint32_t xb = 0; xb <= a; ++xb) {
        for (uint32_t sign : {0u, 0x8000u}) {
          const uint16_t bits = static_cast<uint16_t>(xb | sign);
          const uint32_t c = QuantizeInt4Element(HalfToFloat(bits, dtype), s);
          const uint16_t yb = DequantizeInt4Element(c, s, dtype);
          const double x = HalfBitsToDouble(bits, dtype);
          const double y = HalfBitsToDouble(yb, dtype);
          const double err = std::fabs(y - x);
          const double bound = testutil::ErrorBound(s, y, dtype);
          ++checked;
          worst_ratio = std::max(worst_ratio, err / bound);
          worst_over_s = std::max(worst_over_s, err / s);
          if (!(err <= bound) && violations++ < 5) {
            ADD_FAILURE() << testutil::DTypeName(dtype) << std::hexfloat << " x=" << x
                          << " x^=" << y << " s=" << s << " err=" << err << " bound=" << bound;
          }
        }
      }
    }
    EXPECT_EQ(violations, 0u) << testutil::DTypeName(dtype);
    EXPECT_GT(checked, 500000u);
    EXPECT_GT(worst_over_s, 0.49) << "half a step should be reached";
    std::printf("  %s: %llu elements, max err/bound %.4f, max err/s %.4f\n",
                testutil::DTypeName(dtype), static_cast<unsigned long long>(checked), worst_ratio,
                worst_over_s);
  }
}

// INT4 Hadamard's rotation: the run is the largest power-of-two divisor of head_dim; the two
// factors multiply to 1/r; the transform applied twice is r times the identity where every sum
// is exact (small integers), and matches H_r's definition (entry (i, j) = (-1)^popcount(i & j));
// the encode's range limit.
TEST(CodecMath, HadamardRunFactorsAndTransform) {
  EXPECT_EQ(HadamardRun(128), 128u);
  EXPECT_EQ(HadamardRun(96), 32u);
  EXPECT_EQ(HadamardRun(576), 64u);
  EXPECT_EQ(HadamardRun(160), 32u);
  EXPECT_EQ(HadamardRun(4096), 4096u);
  for (uint32_t r : {32u, 64u, 128u, 256u, 512u, 4096u}) {
    EXPECT_EQ(static_cast<double>(HadamardEncodeFactor(r)) * HadamardDecodeFactor(r), 1.0 / r);
    std::vector<float> x(r);
    for (uint32_t i = 0; i < r; ++i) x[i] = static_cast<float>(static_cast<int>(i * 7 % 13) - 6);
    std::vector<float> v = x;
    HadamardTransform(v.data(), r);
    for (uint32_t i = 0; i < r; i += r / 16) {
      double want = 0.0;
      for (uint32_t j = 0; j < r; ++j) want += (__builtin_popcount(i & j) % 2 ? -1.0 : 1.0) * x[j];
      EXPECT_EQ(v[i], want) << "r " << r << " i " << i;
    }
    HadamardTransform(v.data(), r);
    for (uint32_t i = 0; i < r; ++i) ASSERT_EQ(v[i], x[i] * static_cast<float>(r)) << r << " " << i;
  }
  // The encode's limit: 2^(126 - ceil(k/2)); NaN and Inf lie outside it, of either sign.
  EXPECT_EQ(BitsToFloat(HadamardLimitBits(128)), 0x1.0p122f);
  EXPECT_EQ(BitsToFloat(HadamardLimitBits(64)), 0x1.0p123f);
  EXPECT_EQ(BitsToFloat(HadamardLimitBits(4096)), 0x1.0p120f);
  const uint32_t lim = HadamardLimitBits(128);
  EXPECT_TRUE(HadamardInRange(-0x1.fffffep121f, lim));
  EXPECT_FALSE(HadamardInRange(0x1.0p122f, lim));
  EXPECT_FALSE(HadamardInRange(-0x1.0p122f, lim));
  EXPECT_FALSE(HadamardInRange(BitsToFloat(0x7F800000u), lim));
  EXPECT_FALSE(HadamardInRange(BitsToFloat(0xFFC00000u), lim));
}

// The model's own conversions, checked on values whose answers are known by hand.
TEST(CodecMath, ModelSanity) {
  EXPECT_EQ(DoubleToHalfBits(1.0, DType::kFP16), 0x3C00);
  EXPECT_EQ(DoubleToHalfBits(65504.0, DType::kFP16), 0x7BFF);
  EXPECT_EQ(DoubleToHalfBits(0x1.0p-24, DType::kFP16), 0x0001);
  EXPECT_EQ(DoubleToHalfBits(-0x1.0p-14, DType::kFP16), 0x8400);
  EXPECT_EQ(DoubleToHalfBits(1.0, DType::kBF16), 0x3F80);
  EXPECT_EQ(DoubleToHalfBits(-2.0, DType::kBF16), 0xC000);
  EXPECT_EQ(DoubleToHalfBits(0x1.0p-133, DType::kBF16), 0x0001);
  EXPECT_EQ(HalfBitsToDouble(0x7BFF, DType::kFP16), 65504.0);
  EXPECT_EQ(HalfBitsToDouble(0x0001, DType::kBF16), 0x1.0p-133);
  EXPECT_TRUE(std::isinf(HalfBitsToDouble(0xFC00, DType::kFP16)));
  EXPECT_TRUE(std::isnan(HalfBitsToDouble(0x7FC0, DType::kBF16)));
}

}  // namespace
}  // namespace hiqcache::kernels
