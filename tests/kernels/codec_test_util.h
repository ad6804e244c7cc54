// Test helpers for the codec executors: an independent float64 model of the record format,
// input generators for the input classes the tests cover, pools of per-layer K/V buffers with
// the view shapes engines use, block payload sets, and the SIMD CPU executor and the scalar
// reference wrapped as Executors for the SIMD tests.
//
// Header-only and CUDA-free, so the GPU tests (tests/gpu) can reuse it. The float64 model does
// not call codec_math.h: it is written from docs/design.md "Record format" alone, so a bug in the
// shared arithmetic cannot hide in both the executors and their oracle. Not thread-safe (plain
// containers); every helper is deterministic for a given seed.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "codec_cpu.h"
#include "codec_job.h"
#include "codec_reference.h"
#include "record_format.h"
#include "tensor_view.h"

namespace hiqcache::kernels::testutil {

// ---------------------------------------------------------------------------------------------
// Deterministic random numbers (splitmix64): the same sequence on every platform and library.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n).
  uint32_t Below(uint32_t n) { return static_cast<uint32_t>((Next() >> 32) * n >> 32); }
  // Uniform in [lo, hi].
  int32_t Range(int32_t lo, int32_t hi) {
    return lo + static_cast<int32_t>(Below(static_cast<uint32_t>(hi - lo + 1)));
  }
  // Uniform in [0, 1).
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  double Uniform(double lo, double hi) { return lo + (hi - lo) * Uniform(); }
  double Gaussian() {  // Box-Muller
    double u1 = Uniform();
    double u2 = Uniform();
    return std::sqrt(-2.0 * std::log(1.0 - u1)) * std::cos(6.283185307179586 * u2);
  }
  bool Coin() { return (Next() >> 63) != 0; }

 private:
  uint64_t state_;
};

// ---------------------------------------------------------------------------------------------
// The float64 model of the 16-bit formats (independent of codec_math.h).

struct HalfFormat {
  int man_bits;  // stored mantissa bits
  int bias;
  uint16_t inf_bits;
  uint16_t max_bits;  // largest finite magnitude
};

// One row of `fmt` (its heads contiguous) at `base`, as the codec's StridedView names it.
inline StridedView OneRowView(const RowFormat& fmt, void* base) {
  StridedView view;
  view.base = static_cast<uint8_t*>(base);
  view.row_stride = fmt.InputRowBytes();
  view.head_stride = fmt.head_dim * 2;
  view.num_rows = 1;
  return view;
}

inline HalfFormat FormatOf(DType dtype) {
  return dtype == DType::kBF16 ? HalfFormat{7, 127, 0x7F80, 0x7F7F}
                               : HalfFormat{10, 15, 0x7C00, 0x7BFF};
}

inline const char* DTypeName(DType dtype) { return dtype == DType::kBF16 ? "bf16" : "fp16"; }

// 2^k as a double, built from its bits. REQUIRES: -1022 <= k <= 1023.
inline double Pow2(int k) {
  const uint64_t bits = static_cast<uint64_t>(k + 1023) << 52;
  double d;
  std::memcpy(&d, &bits, sizeof(d));
  return d;
}

// Exponent of the leading bit of a normal double.
inline int Exponent(double a) {
  uint64_t bits;
  std::memcpy(&bits, &a, sizeof(bits));
  return static_cast<int>((bits >> 52) & 0x7FF) - 1023;
}

// Exact value of a BF16/FP16 bit pattern (NaN for NaN patterns), computed from the format.
inline double HalfBitsToDoubleSlow(uint16_t bits, DType dtype) {
  const HalfFormat f = FormatOf(dtype);
  const uint32_t mag = bits & 0x7FFFu;
  const uint32_t e = mag >> f.man_bits;
  const uint32_t m = mag & ((1u << f.man_bits) - 1u);
  double v;
  if (mag >= f.inf_bits) {
    v = m != 0 ? std::nan("") : HUGE_VAL;
  } else if (e == 0) {
    v = static_cast<double>(m) * Pow2(1 - f.bias - f.man_bits);
  } else {
    v = static_cast<double>(m | (1u << f.man_bits)) *
        Pow2(static_cast<int>(e) - f.bias - f.man_bits);
  }
  return (bits & 0x8000u) ? -v : v;
}

// The same through a table (the checks call this for every element).
inline double HalfBitsToDouble(uint16_t bits, DType dtype) {
  static const std::vector<double> table = [] {
    std::vector<double> t(2 << 16);
    for (uint32_t b = 0; b < (1u << 16); ++b) {
      t[b] = HalfBitsToDoubleSlow(static_cast<uint16_t>(b), DType::kBF16);
      t[(1u << 16) + b] = HalfBitsToDoubleSlow(static_cast<uint16_t>(b), DType::kFP16);
    }
    return t;
  }();
  return table[(dtype == DType::kBF16 ? 0u : 1u << 16) + bits];
}

inline bool HalfBitsFinite(uint16_t bits, DType dtype) {
  return (bits & 0x7FFFu) < FormatOf(dtype).inf_bits;
}

inline double MaxFinite(DType dtype) { return HalfBitsToDouble(FormatOf(dtype).max_bits, dtype); }

// Rounds a double to the nearest BF16/FP16 value, ties to even (subnormals included), with
// magnitudes that round beyond the largest finite value (and +-Inf) saturated to it.
// REQUIRES: !isnan(v), |v| zero or >= 2^-1000.
inline uint16_t DoubleToHalfBits(double v, DType dtype) {
  const HalfFormat f = FormatOf(dtype);
  const uint16_t sign = std::signbit(v) ? 0x8000u : 0u;
  const double a = std::fabs(v);
  if (a == 0.0) return sign;
  if (a > 2.0 * MaxFinite(dtype)) return sign | f.max_bits;
  const int emin = 1 - f.bias;  // exponent of the smallest normal
  const int quantum = std::max(Exponent(a), emin) - f.man_bits;
  const double units = std::nearbyint(a * Pow2(-quantum));  // exact scaling; RNE
  const double r = units * Pow2(quantum);
  if (r > MaxFinite(dtype)) return sign | f.max_bits;
  if (r < Pow2(emin)) return sign | static_cast<uint16_t>(units);  // subnormal
  const int e = Exponent(r);
  const uint32_t man = static_cast<uint32_t>(r * Pow2(f.man_bits - e)) - (1u << f.man_bits);
  return sign | static_cast<uint16_t>((static_cast<uint32_t>(e + f.bias) << f.man_bits) | man);
}

constexpr double kAmaxFloor = 0x1.0p-112;

// Model of one head: returns false (codes/scale untouched) when it holds NaN or Inf. Else
// s = bf16_rne(max(amax, 2^-112) / 127) computed in double, q = clamp(rne(x / s)) in double.
// (The format computes both in fp32; with <= 11-bit operands the fp32 results round the same
// way, which is exactly what comparing against this model checks.)
inline bool ModelEncodeHead(const uint16_t* x, uint32_t d, DType dtype, int8_t* codes,
                            uint16_t* scale_bits) {
  double amax = 0.0;
  for (uint32_t i = 0; i < d; ++i) {
    if (!HalfBitsFinite(x[i], dtype)) return false;
    amax = std::max(amax, std::fabs(HalfBitsToDouble(x[i], dtype)));
  }
  const uint16_t sb = DoubleToHalfBits(std::max(amax, kAmaxFloor) / 127.0, DType::kBF16);
  const double s = HalfBitsToDouble(sb, DType::kBF16);
  for (uint32_t i = 0; i < d; ++i) {
    double q = std::nearbyint(HalfBitsToDouble(x[i], dtype) / s);
    q = std::min(127.0, std::max(-127.0, q));
    codes[i] = static_cast<int8_t>(q);
  }
  *scale_bits = sb;
  return true;
}

inline double ScaleValue(uint16_t scale_bits) { return HalfBitsToDouble(scale_bits, DType::kBF16); }

// x^ = rne(q * s) in the output dtype (q * s is exact in double), saturated.
inline uint16_t ModelDecodeElement(int8_t q, uint16_t scale_bits, DType out) {
  return DoubleToHalfBits(static_cast<double>(q) * ScaleValue(scale_bits), out);
}

// The elementwise guarantee of docs/design.md: |x^ - x| <= (0.5 + 2^-8) * s + 2^-8 * |x^|.
// FP16 outputs: where x^ lies in the fp16 subnormal range (|x^| <= 2^-14) the grid spacing is a
// fixed 2^-24, so rounding q * s to it adds up to 2^-25 absolute error that the relative term
// cannot cover; that term is added there. BF16 needs none (its subnormals lie far below the
// smallest scale's reach: s >= 2^-119 makes the 0.5*s term dominate).
inline double ErrorBound(double s, double xhat, DType out) {
  double b = (0.5 + 0x1.0p-8) * s + 0x1.0p-8 * std::fabs(xhat);
  if (out == DType::kFP16 && std::fabs(xhat) <= 0x1.0p-14) b += 0x1.0p-25;
  return b;
}

// ---------------------------------------------------------------------------------------------
// The float64 model of CODEC_FP8_E4M3_PER_HEAD (OCP E4M3FN from its definition: bias 7, 3
// mantissa bits, subnormals m * 2^-9, largest finite 448, 0x7F/0xFF NaN).

// Exact value of an E4M3 code; 0x7F/0xFF (NaN, never written) read as +-480 like the executors'.
inline double E4m3BitsToDouble(uint8_t c) {
  const uint32_t e = (c >> 3) & 0xFu;
  const uint32_t m = c & 0x7u;
  const double v = e == 0 ? static_cast<double>(m) * Pow2(-9)
                          : static_cast<double>(8 + m) * Pow2(static_cast<int>(e) - 7 - 3);
  return (c & 0x80u) ? -v : v;
}

// Rounds a double to the nearest E4M3 value, ties to even (subnormals included), magnitudes at
// or beyond 448 saturated to it. Keeps the sign of zero. REQUIRES: !isnan(v).
inline uint8_t DoubleToE4m3Bits(double v) {
  const uint8_t sign = std::signbit(v) ? 0x80u : 0u;
  const double a = std::fabs(v);
  if (a >= 448.0) return sign | 0x7Eu;
  if (a == 0.0 || a < Pow2(-1000)) return sign;  // far below the smallest tie 2^-10
  const int quantum = std::max(Exponent(a), -6) - 3;
  const double units = std::nearbyint(a * Pow2(-quantum));  // exact scaling; RNE
  const double r = units * Pow2(quantum);
  if (r < Pow2(-6)) return sign | static_cast<uint8_t>(units);  // subnormal
  const int e = Exponent(r);
  const uint32_t man = static_cast<uint32_t>(r * Pow2(3 - e)) - 8u;
  return sign | static_cast<uint8_t>((static_cast<uint32_t>(e + 7) << 3) | man);
}

// Model of one FP8 head: false (codes/scale untouched) when it holds NaN or Inf. Else
// s = bf16_rne(max(amax, 2^-112) / 448) and c = e4m3_rne_sat(x / s), both in double.
inline bool ModelEncodeHeadFp8(const uint16_t* x, uint32_t d, DType dtype, uint8_t* codes,
                               uint16_t* scale_bits) {
  double amax = 0.0;
  for (uint32_t i = 0; i < d; ++i) {
    if (!HalfBitsFinite(x[i], dtype)) return false;
    amax = std::max(amax, std::fabs(HalfBitsToDouble(x[i], dtype)));
  }
  const uint16_t sb = DoubleToHalfBits(std::max(amax, kAmaxFloor) / 448.0, DType::kBF16);
  const double s = HalfBitsToDouble(sb, DType::kBF16);
  for (uint32_t i = 0; i < d; ++i) codes[i] = DoubleToE4m3Bits(HalfBitsToDouble(x[i], dtype) / s);
  *scale_bits = sb;
  return true;
}

// x^ = rne(e4m3(c) * s) in the output dtype (the product is exact in double), saturated.
inline uint16_t ModelDecodeElementFp8(uint8_t c, uint16_t scale_bits, DType out) {
  return DoubleToHalfBits(E4m3BitsToDouble(c) * ScaleValue(scale_bits), out);
}

// The FP8 elementwise guarantee (codec_math.h, kernels/README.md):
//   |x^ - x| <= 2^-4 |x^| + 2^-10 s + (1 + 2^-4) (u |x^| + a)
// u = 2^-8 (BF16) or 2^-11 (FP16): the output rounding; a = its half subnormal spacing (2^-134,
// 2^-25) where |x^| is at most its smallest normal (2^-126, 2^-14), else 0.
inline double Fp8ErrorBound(double s, double xhat, DType out) {
  const double ax = std::fabs(xhat);
  const bool bf16 = out == DType::kBF16;
  const double u = bf16 ? 0x1.0p-8 : 0x1.0p-11;
  const double a = ax <= (bf16 ? 0x1.0p-126 : 0x1.0p-14) ? (bf16 ? 0x1.0p-134 : 0x1.0p-25) : 0.0;
  return 0x1.0p-4 * ax + 0x1.0p-10 * s + (1.0 + 0x1.0p-4) * (u * ax + a);
}

// ---------------------------------------------------------------------------------------------
// The float64 model of CODEC_INT4_G32_PER_HEAD: groups of 32 consecutive elements of a head,
// s = bf16_rne(max(amax_group, 2^-112) / 7), q = clamp(rne(x / s), -7, 7) in double, nibbles
// packed two per byte (element 2i of the row low), scales after the codes in group order.

constexpr uint32_t kModelInt4Group = 32;

// Model of one INT4 head: false (codes/scales untouched) when it holds NaN or Inf. `codes`
// receives d / 2 bytes, `scale_bits` d / 32 scales. REQUIRES: d % 32 == 0.
inline bool ModelEncodeHeadInt4(const uint16_t* x, uint32_t d, DType dtype, uint8_t* codes,
                                uint16_t* scale_bits) {
  for (uint32_t i = 0; i < d; ++i) {
    if (!HalfBitsFinite(x[i], dtype)) return false;
  }
  for (uint32_t g = 0; g < d / kModelInt4Group; ++g) {
    const uint16_t* gx = x + g * kModelInt4Group;
    double amax = 0.0;
    for (uint32_t i = 0; i < kModelInt4Group; ++i) {
      amax = std::max(amax, std::fabs(HalfBitsToDouble(gx[i], dtype)));
    }
    const uint16_t sb = DoubleToHalfBits(std::max(amax, kAmaxFloor) / 7.0, DType::kBF16);
    const double s = HalfBitsToDouble(sb, DType::kBF16);
    for (uint32_t i = 0; i < kModelInt4Group; ++i) {
      double q = std::nearbyint(HalfBitsToDouble(gx[i], dtype) / s);
      q = std::min(7.0, std::max(-7.0, q));
      const uint8_t nib = static_cast<uint8_t>(static_cast<int>(q) & 0xF);
      uint8_t& byte = codes[(g * kModelInt4Group + i) / 2];
      byte = (i % 2 == 0) ? static_cast<uint8_t>((byte & 0xF0u) | nib)
                          : static_cast<uint8_t>((byte & 0x0Fu) | (nib << 4));
    }
    scale_bits[g] = sb;
  }
  return true;
}

// The signed value of a nibble: 0..7 and -8..-1 (0x8 is never written).
inline int Int4Value(uint8_t nib) { return nib >= 8 ? static_cast<int>(nib) - 16 : nib; }

inline uint16_t ModelDecodeElementInt4(uint8_t nib, uint16_t scale_bits, DType out) {
  return DoubleToHalfBits(static_cast<double>(Int4Value(nib)) * ScaleValue(scale_bits), out);
}

inline double CodecErrorBound(CodecKind codec, double s, double xhat, DType out) {
  // INT4's bound is INT8's with s the element's group scale (codec_math.h).
  return codec == CodecKind::kFp8E4m3PerHead ? Fp8ErrorBound(s, xhat, out)
                                             : ErrorBound(s, xhat, out);
}

// The scale of element i of head h of a stored row.
inline double ElementScale(const RowFormat& fmt, const uint8_t* encoded, uint32_t h, uint32_t i) {
  const size_t idx = fmt.codec == CodecKind::kInt4G32PerHead
                         ? (static_cast<size_t>(h) * fmt.head_dim + i) / kModelInt4Group
                         : h;
  uint16_t sb;
  std::memcpy(&sb, encoded + fmt.CodeBytes() + 2 * idx, 2);
  return HalfBitsToDouble(sb, DType::kBF16);
}

inline const char* CodecName(CodecKind codec) {
  switch (codec) {
    case CodecKind::kInt8PerHead:
      return "int8";
    case CodecKind::kRaw:
      return "raw";
    case CodecKind::kFp8E4m3PerHead:
      return "fp8";
    case CodecKind::kInt4G32PerHead:
      return "int4";
    case CodecKind::kInt4Kivi:
      return "int4_kivi";
    case CodecKind::kInt4Hadamard:
      return "int4_hadamard";
    case CodecKind::kInt5Allot:
      return "int5_allot";
    case CodecKind::kInt6Allot:
      return "int6_allot";
    case CodecKind::kInt4Allot:
      return "int4_allot";
  }
  return "?";
}

inline uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline void StoreU16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

// Model of one stored row (INT8, FP8, INT4 or RAW) from the addresses of its heads. Returns false
// when an INT8, FP8 or INT4 row holds NaN or Inf.
inline bool ModelEncodeRow(const RowFormat& fmt, const uint8_t* const* heads, uint8_t* dst) {
  const uint32_t d = fmt.head_dim;
  std::vector<uint16_t> x(d);
  bool finite = true;
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    std::memcpy(x.data(), heads[h], static_cast<size_t>(d) * 2);
    if (fmt.codec == CodecKind::kRaw) {
      std::memcpy(dst + static_cast<size_t>(h) * d * 2, x.data(), static_cast<size_t>(d) * 2);
      continue;
    }
    if (fmt.codec == CodecKind::kInt4G32PerHead) {
      const uint32_t groups = d / kModelInt4Group;
      std::vector<uint16_t> sb(groups);
      if (!ModelEncodeHeadInt4(x.data(), d, fmt.dtype, dst + static_cast<size_t>(h) * d / 2,
                               sb.data())) {
        finite = false;
        continue;
      }
      for (uint32_t g = 0; g < groups; ++g) {
        StoreU16(dst + fmt.CodeBytes() + 2 * (static_cast<size_t>(h) * groups + g), sb[g]);
      }
      continue;
    }
    uint16_t sb = 0;
    const bool ok =
        fmt.codec == CodecKind::kFp8E4m3PerHead
            ? ModelEncodeHeadFp8(x.data(), d, fmt.dtype, dst + static_cast<size_t>(h) * d, &sb)
            : ModelEncodeHead(x.data(), d, fmt.dtype,
                              reinterpret_cast<int8_t*>(dst) + static_cast<size_t>(h) * d, &sb);
    if (!ok) {
      finite = false;
      continue;
    }
    StoreU16(dst + fmt.ElementsPerRow() + 2 * h, sb);
  }
  return finite;
}

inline void ModelDecodeRow(const RowFormat& fmt, const uint8_t* src, uint8_t* const* heads) {
  const uint32_t d = fmt.head_dim;
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    uint8_t* out = heads[h];
    if (fmt.codec == CodecKind::kRaw) {
      std::memcpy(out, src + static_cast<size_t>(h) * d * 2, static_cast<size_t>(d) * 2);
      continue;
    }
    if (fmt.codec == CodecKind::kInt4G32PerHead) {
      const uint32_t groups = d / kModelInt4Group;
      const uint8_t* codes = src + static_cast<size_t>(h) * d / 2;
      for (uint32_t i = 0; i < d; ++i) {
        const uint16_t sb = LoadU16(src + fmt.CodeBytes() +
                                    2 * (static_cast<size_t>(h) * groups + i / kModelInt4Group));
        const uint8_t nib = (i % 2 == 0) ? (codes[i / 2] & 0xFu) : (codes[i / 2] >> 4);
        StoreU16(out + 2 * i, ModelDecodeElementInt4(nib, sb, fmt.dtype));
      }
      continue;
    }
    const uint16_t sb = LoadU16(src + fmt.ElementsPerRow() + 2 * h);
    const uint8_t* codes = src + static_cast<size_t>(h) * d;
    for (uint32_t i = 0; i < d; ++i) {
      StoreU16(out + 2 * i, fmt.codec == CodecKind::kFp8E4m3PerHead
                                ? ModelDecodeElementFp8(codes[i], sb, fmt.dtype)
                                : ModelDecodeElement(static_cast<int8_t>(codes[i]), sb, fmt.dtype));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Input classes.

enum class InputClass {
  kGaussian,  // N(0, sigma), sigma log-uniform per head
  kZero,      // all-zero heads (+0 and -0)
  kTiny,      // around 1e-30 for BF16 (incl. subnormals), fp16 subnormals for FP16
  kHuge,      // near the dtype's largest finite value, incl. exactly +-max
  kMixed,     // magnitudes spanning many binades within one head
  kOutlier,   // gaussian with one large outlier per head
  kGrid,      // exact multiples of s/2 (grid points and exact ties)
  kRowMix,    // a different one of the above per head
  kFp8Grid,   // s = m * 2^e exactly; e4m3 values and exact e4m3 ties times s (FP8 tests only)
  kInt4Grid,  // per group of 32: s = m * 2^e exactly, multiples of s/2 (ties) (INT4 tests only)
};

inline const char* InputClassName(InputClass c) {
  switch (c) {
    case InputClass::kGaussian:
      return "gaussian";
    case InputClass::kZero:
      return "zero";
    case InputClass::kTiny:
      return "tiny";
    case InputClass::kHuge:
      return "huge";
    case InputClass::kMixed:
      return "mixed";
    case InputClass::kOutlier:
      return "outlier";
    case InputClass::kGrid:
      return "grid";
    case InputClass::kRowMix:
      return "rowmix";
    case InputClass::kFp8Grid:
      return "fp8grid";
    case InputClass::kInt4Grid:
      return "int4grid";
  }
  return "?";
}

inline std::vector<InputClass> AllInputClasses() {
  return {InputClass::kGaussian, InputClass::kZero,    InputClass::kTiny, InputClass::kHuge,
          InputClass::kMixed,    InputClass::kOutlier, InputClass::kGrid, InputClass::kRowMix};
}

// The FP8 tests' classes: all of the above plus the e4m3 grid.
inline std::vector<InputClass> Fp8InputClasses() {
  std::vector<InputClass> c = AllInputClasses();
  c.push_back(InputClass::kFp8Grid);
  return c;
}

// The INT4 tests' classes: all of the above plus the per-group grid.
inline std::vector<InputClass> Int4InputClasses() {
  std::vector<InputClass> c = AllInputClasses();
  c.push_back(InputClass::kInt4Grid);
  return c;
}

// Fills one head of d elements with values of class `c` (bit patterns of `dtype`).
inline void GenHead(InputClass c, DType dtype, Rng& rng, uint16_t* dst, uint32_t d) {
  const bool bf16 = dtype == DType::kBF16;
  auto put = [&](uint32_t i, double v) { dst[i] = DoubleToHalfBits(v, dtype); };
  if (c == InputClass::kRowMix) {
    c = static_cast<InputClass>(rng.Below(7));
  }
  switch (c) {
    case InputClass::kGaussian: {
      const double sigma = std::ldexp(1.0, rng.Range(-8, 8)) * rng.Uniform(0.5, 1.0);
      for (uint32_t i = 0; i < d; ++i) put(i, sigma * rng.Gaussian());
      break;
    }
    case InputClass::kZero:
      for (uint32_t i = 0; i < d; ++i) dst[i] = rng.Coin() ? 0x8000u : 0x0000u;
      break;
    case InputClass::kTiny: {
      // BF16: around 1e-30, with some heads entirely below the 2^-112 amax floor or subnormal.
      // FP16: the subnormal range 2^-24..2^-14 and the smallest normals.
      const uint32_t mode = rng.Below(3);
      for (uint32_t i = 0; i < d; ++i) {
        double v;
        if (bf16) {
          v = mode == 0   ? 1e-30 * rng.Gaussian()
              : mode == 1 ? std::ldexp(rng.Uniform(-1.0, 1.0), -118)  // below the floor
                          : std::ldexp(static_cast<double>(rng.Range(-127, 127)), -133);
        } else {
          v = mode == 0   ? std::ldexp(static_cast<double>(rng.Range(-1023, 1023)), -24)
              : mode == 1 ? std::ldexp(static_cast<double>(rng.Range(-7, 7)), -24)
                          : std::ldexp(rng.Uniform(-1.0, 1.0), -13);
        }
        put(i, v);
      }
      break;
    }
    case InputClass::kHuge: {
      const double mx = MaxFinite(dtype);
      for (uint32_t i = 0; i < d; ++i) put(i, (rng.Coin() ? 1 : -1) * mx * rng.Uniform(0.3, 1.0));
      const uint16_t sign = rng.Coin() ? 0x8000u : 0u;
      dst[rng.Below(d)] = sign | FormatOf(dtype).max_bits;
      break;
    }
    case InputClass::kMixed: {
      const int lo = bf16 ? -90 : -20;
      const int hi = bf16 ? 90 : 14;
      const int center = rng.Range(lo, hi);
      for (uint32_t i = 0; i < d; ++i) {
        const int e = std::min(hi, std::max(lo, center + rng.Range(-24, 8)));
        put(i, (rng.Coin() ? 1 : -1) * std::ldexp(rng.Uniform(1.0, 2.0), e));
      }
      break;
    }
    case InputClass::kOutlier: {
      const double sigma = std::ldexp(1.0, rng.Range(-6, 4));
      for (uint32_t i = 0; i < d; ++i) put(i, sigma * rng.Gaussian());
      put(rng.Below(d), (rng.Coin() ? 1 : -1) * sigma * rng.Uniform(50.0, 1000.0));
      break;
    }
    case InputClass::kGrid: {
      // s = m * 2^e exactly, with amax = 127 * s present, so the scale is s; every other element
      // is j * s / 2 (|j| <= 254; odd j are exact ties). BF16 (8 significant bits) holds these
      // only for m = 1; FP16 (11 bits) for m <= 7.
      const uint32_t m = bf16 ? 1u : 1u + 2u * rng.Below(4);
      const int e = bf16 ? rng.Range(-100, 100) : rng.Range(-10, 6);
      const double s = std::ldexp(static_cast<double>(m), e);
      for (uint32_t i = 0; i < d; ++i) put(i, rng.Range(-254, 254) * s * 0.5);
      put(rng.Below(d), (rng.Coin() ? 127.0 : -127.0) * s);
      break;
    }
    case InputClass::kFp8Grid: {
      // s = m * 2^e with amax = 448 * s present, so the scale is s; every other element is s
      // times an e4m3 value or the exact midpoint of two neighbours (a tie), subnormal ones
      // included. These need 5 (ties) + 3 (m) significant bits: BF16 holds them for m = 1,
      // FP16 for m <= 7 with e >= -14 (x stays on the 2^-24 grid) and 448 * 7 * 2^e <= 65504.
      const uint32_t m = bf16 ? 1u : 1u + 2u * rng.Below(4);
      const int e = bf16 ? rng.Range(-100, 100) : rng.Range(-14, 4);
      const double s = std::ldexp(static_cast<double>(m), e);
      for (uint32_t i = 0; i < d; ++i) {
        const uint32_t c = rng.Below(0x7E);  // 0x00..0x7D: c + 1 is finite
        const double lo = E4m3BitsToDouble(static_cast<uint8_t>(c));
        const double hi = E4m3BitsToDouble(static_cast<uint8_t>(c + 1));
        const double v = rng.Coin() ? lo : 0.5 * (lo + hi);
        put(i, (rng.Coin() ? 1 : -1) * v * s);
      }
      put(rng.Below(d), (rng.Coin() ? 448.0 : -448.0) * s);
      break;
    }
    case InputClass::kInt4Grid: {
      // Per group of 32 (a trailing partial group too): s = m * 2^e exactly with amax = 7 * s
      // present, so the group's scale is s; every other element is j * s / 2 (|j| <= 14; odd j
      // are exact ties). BF16 holds these for m = 1, FP16 for m <= 7 (e >= -23 keeps s / 2 on
      // the 2^-24 grid, 49 * 2^e <= 65504 keeps 7 * s finite).
      for (uint32_t g0 = 0; g0 < d; g0 += 32) {
        const uint32_t n = std::min<uint32_t>(32, d - g0);
        const uint32_t m = bf16 ? 1u : 1u + 2u * rng.Below(4);
        const int e = bf16 ? rng.Range(-100, 100) : rng.Range(-23, 10);
        const double s = std::ldexp(static_cast<double>(m), e);
        for (uint32_t i = 0; i < n; ++i) put(g0 + i, rng.Range(-14, 14) * s * 0.5);
        put(g0 + rng.Below(n), (rng.Coin() ? 7.0 : -7.0) * s);
      }
      break;
    }
    case InputClass::kRowMix:
      break;
  }
}

// ---------------------------------------------------------------------------------------------
// Pools of per-layer K/V buffers.

enum class ViewKind {
  kContiguous,  // SGLang: [slots, heads, dim] per layer and plane
  kStrided,     // odd row/head padding and a base not 16-byte aligned
  kPaged,       // vLLM: [blocks, block_size, heads, dim] with a gap between pages
  kPackedKV,    // vLLM: [blocks, heads, block_size, 2*dim], V starts dim elements after K
};

inline const char* ViewKindName(ViewKind k) {
  switch (k) {
    case ViewKind::kContiguous:
      return "contiguous";
    case ViewKind::kStrided:
      return "strided";
    case ViewKind::kPaged:
      return "paged";
    case ViewKind::kPackedKV:
      return "packed_kv";
  }
  return "?";
}

inline std::vector<ViewKind> AllViewKinds() {
  return {ViewKind::kContiguous, ViewKind::kStrided, ViewKind::kPaged, ViewKind::kPackedKV};
}

// One buffer per layer holding that layer's planes (layout.kv_planes of them) for `num_rows`
// token slots, addressed through StridedViews of the requested kind. Owns the memory.
//
// The pool computes head addresses with its own arithmetic (HeadAddr), not StridedView::Head,
// so the checks that use it (model rows, written-bytes masks) do not share a bug with the
// executors' addressing.
class KvPool {
 public:
  // Explicit strides (bytes) of every layer's buffer. Plane p of a layer starts at
  // base_offset + p * plane_offset; head h of row r of it at + page * page_stride +
  // slot * row_stride + h * head_stride (page = r / page_rows, slot = r % page_rows; page_rows
  // 0 = not paged). buffer_bytes 0 = just enough for num_rows rows, plus a 64-byte guard.
  struct Shape {
    uint64_t base_offset = 0;
    uint64_t plane_offset = 0;
    uint64_t head_stride = 0;
    uint64_t row_stride = 0;
    uint64_t page_rows = 0;
    uint64_t page_stride = 0;
    uint64_t buffer_bytes = 0;
  };

  // The shape engines use for `kind` (kStrided and kPaged draw their padding from `seed`).
  static Shape ShapeOf(const BlockLayout& layout, uint32_t num_rows, ViewKind kind,
                       uint64_t seed = 1, uint32_t page_rows = 16) {
    Rng rng(seed);
    const uint64_t h = layout.row.num_heads;
    const uint64_t d2 = static_cast<uint64_t>(layout.row.head_dim) * 2;
    Shape sh;
    switch (kind) {
      case ViewKind::kContiguous:
        sh.head_stride = d2;
        sh.row_stride = h * d2;
        sh.plane_offset = sh.row_stride * num_rows;
        break;
      case ViewKind::kStrided:
        sh.base_offset = 2 * (1 + rng.Below(7));
        sh.head_stride = d2 + 2 * rng.Below(6);
        sh.row_stride = h * sh.head_stride + 2 * rng.Below(10);
        sh.plane_offset = sh.row_stride * num_rows + 2 * (1 + rng.Below(20));
        break;
      case ViewKind::kPaged:
        sh.head_stride = d2;
        sh.row_stride = h * d2 + 2 * rng.Below(4);
        sh.page_rows = page_rows;
        sh.page_stride = page_rows * sh.row_stride + 2 * (1 + rng.Below(32));
        sh.plane_offset = (num_rows + page_rows - 1) / page_rows * sh.page_stride;
        break;
      case ViewKind::kPackedKV:
        sh.row_stride = 2 * d2;
        sh.head_stride = page_rows * sh.row_stride;
        sh.page_rows = page_rows;
        sh.page_stride = h * sh.head_stride;
        sh.plane_offset = d2;  // V is the second half of each (head, token) vector
        break;
    }
    return sh;
  }

  KvPool(const BlockLayout& layout, uint32_t num_rows, ViewKind kind, uint64_t seed = 1,
         uint32_t page_rows = 16)
      : KvPool(layout, num_rows, ShapeOf(layout, num_rows, kind, seed, page_rows)) {
    kind_ = kind;
  }

  KvPool(const BlockLayout& layout, uint32_t num_rows, const Shape& shape)
      : layout_(layout), num_rows_(num_rows), shape_(shape) {
    uint64_t bytes = shape.buffer_bytes;
    if (bytes == 0) {
      // One past the last byte any view addresses, plus the guard.
      const uint32_t last = num_rows - 1;
      const uint64_t page = shape.page_rows ? last / shape.page_rows : 0;
      const uint64_t slot = shape.page_rows ? last % shape.page_rows : last;
      uint64_t end = 0;
      for (uint32_t h = 0; h < layout.row.num_heads; ++h) {
        end = std::max(end, shape.base_offset + (layout.kv_planes - 1) * shape.plane_offset +
                                page * shape.page_stride + slot * shape.row_stride +
                                h * shape.head_stride + uint64_t{layout.row.head_dim} * 2);
      }
      // Paged shapes own whole pages.
      if (shape.page_rows) {
        end = std::max(end, shape.base_offset + (layout.kv_planes - 1) * shape.plane_offset +
                                (page + 1) * shape.page_stride);
      }
      bytes = end + 64;
    }
    buffers_.assign(layout.num_layers, std::vector<uint8_t>(bytes, 0));
    views_.resize(layout.num_layers);
    for (uint32_t l = 0; l < layout.num_layers; ++l) views_[l] = ViewsAt(l, buffers_[l].data());
  }

  // The views of layer `layer` for a copy of its buffer at `base` (e.g. in device memory).
  LayerViews ViewsAt(uint32_t layer, uint8_t* base) const {
    (void)layer;
    LayerViews lv;
    for (uint32_t p = 0; p < layout_.kv_planes; ++p) {
      StridedView& v = lv.planes[p];
      v.base = base + shape_.base_offset + p * shape_.plane_offset;
      v.row_stride = shape_.row_stride;
      v.head_stride = shape_.head_stride;
      v.page_rows = shape_.page_rows;
      v.page_stride = shape_.page_stride;
      v.num_rows = num_rows_;
    }
    return lv;
  }

  const BlockLayout& layout() const { return layout_; }
  const RowFormat& row_format() const { return layout_.row; }
  uint32_t num_rows() const { return num_rows_; }
  ViewKind kind() const { return kind_; }
  const LayerViews* views() const { return views_.data(); }
  const StridedView& view(uint32_t layer, uint32_t plane) const {
    return views_[layer].planes[plane];
  }
  std::vector<uint8_t>& buffer(uint32_t layer) { return buffers_[layer]; }
  const std::vector<uint8_t>& buffer(uint32_t layer) const { return buffers_[layer]; }

  const Shape& shape() const { return shape_; }

  // Byte offset of a head inside its layer's buffer.
  size_t HeadOffset(uint32_t plane, uint32_t row, uint32_t head) const {
    const uint64_t page = shape_.page_rows ? row / shape_.page_rows : 0;
    const uint64_t slot = shape_.page_rows ? row % shape_.page_rows : row;
    return shape_.base_offset + plane * shape_.plane_offset + page * shape_.page_stride +
           slot * shape_.row_stride + head * shape_.head_stride;
  }
  uint8_t* HeadAddr(uint32_t layer, uint32_t plane, uint32_t row, uint32_t head) const {
    return const_cast<uint8_t*>(buffers_[layer].data()) + HeadOffset(plane, row, head);
  }
  uint16_t* Head(uint32_t layer, uint32_t plane, uint32_t row, uint32_t head) const {
    return reinterpret_cast<uint16_t*>(HeadAddr(layer, plane, row, head));
  }
  // The addresses of all heads of one row.
  std::vector<uint8_t*> HeadPtrs(uint32_t layer, uint32_t plane, uint32_t row) const {
    std::vector<uint8_t*> out(layout_.row.num_heads);
    for (uint32_t h = 0; h < out.size(); ++h) out[h] = HeadAddr(layer, plane, row, h);
    return out;
  }

  // Calls f(layer, plane, row, head, uint16_t* elements) for every head of every row.
  template <class F>
  void ForEachHead(F&& f) const {
    for (uint32_t l = 0; l < layout_.num_layers; ++l)
      for (uint32_t p = 0; p < layout_.kv_planes; ++p)
        for (uint32_t r = 0; r < num_rows_; ++r)
          for (uint32_t h = 0; h < layout_.row.num_heads; ++h) f(l, p, r, h, Head(l, p, r, h));
  }

  // Fills every head with class `c` (kRowMix: a random class per head).
  void Fill(InputClass c, uint64_t seed) {
    Rng rng(seed);
    ForEachHead([&](uint32_t, uint32_t, uint32_t, uint32_t, uint16_t* x) {
      GenHead(c, layout_.row.dtype, rng, x, layout_.row.head_dim);
    });
  }

  void FillBytes(uint8_t value) {
    for (auto& b : buffers_) std::fill(b.begin(), b.end(), value);
  }

  // Byte mask of layer `layer`'s buffer: 1 where a head of one of `rows` (any plane) lies.
  std::vector<uint8_t> AddressedMask(uint32_t layer, const std::vector<uint32_t>& rows) const {
    std::vector<uint8_t> mask(buffers_[layer].size(), 0);
    const size_t head_bytes = static_cast<size_t>(layout_.row.head_dim) * 2;
    for (uint32_t p = 0; p < layout_.kv_planes; ++p) {
      for (uint32_t r : rows) {
        for (uint32_t h = 0; h < layout_.row.num_heads; ++h) {
          const size_t off = HeadOffset(p, r, h);
          std::fill(mask.begin() + off, mask.begin() + off + head_bytes, 1);
        }
      }
    }
    return mask;
  }

 private:
  BlockLayout layout_;
  uint32_t num_rows_;
  ViewKind kind_ = ViewKind::kStrided;  // what pools built from an explicit Shape report
  Shape shape_;
  std::vector<std::vector<uint8_t>> buffers_;
  std::vector<LayerViews> views_;
};

// `count` distinct rows of [0, num_rows) in random order.
inline std::vector<uint32_t> RandomRows(uint32_t num_rows, size_t count, Rng& rng) {
  std::vector<uint32_t> all(num_rows);
  for (uint32_t i = 0; i < num_rows; ++i) all[i] = i;
  for (size_t i = 0; i < count; ++i) {
    std::swap(all[i], all[i + rng.Below(static_cast<uint32_t>(num_rows - i))]);
  }
  all.resize(count);
  return all;
}

// Block payloads of one layout, filled with `fill` so unwritten bytes show.
class BlockSet {
 public:
  BlockSet(const BlockLayout& layout, uint32_t num_blocks, uint8_t fill = 0xCD)
      : payloads_(num_blocks, std::vector<uint8_t>(layout.BlockBytes(), fill)) {
    for (auto& p : payloads_) ptrs_.push_back(p.data());
  }
  uint32_t size() const { return static_cast<uint32_t>(payloads_.size()); }
  uint8_t* const* ptrs() const { return ptrs_.data(); }
  std::vector<uint8_t>& operator[](size_t b) { return payloads_[b]; }
  const std::vector<uint8_t>& operator[](size_t b) const { return payloads_[b]; }
  bool operator==(const BlockSet& o) const { return payloads_ == o.payloads_; }

 private:
  std::vector<std::vector<uint8_t>> payloads_;
  std::vector<uint8_t*> ptrs_;
};

inline EncodeJob MakeEncodeJob(const KvPool& pool, const std::vector<uint32_t>& rows,
                               const BlockSet& blocks, uint8_t* nonfinite) {
  EncodeJob job;
  job.layout = pool.layout();
  job.layers = pool.views();
  job.rows = rows.data();
  job.blocks = blocks.ptrs();
  job.num_blocks = blocks.size();
  job.nonfinite = nonfinite;
  return job;
}

inline DecodeJob MakeDecodeJob(const KvPool& pool, const std::vector<uint32_t>& rows,
                               const BlockSet& blocks) {
  DecodeJob job;
  job.layout = pool.layout();
  job.layers = pool.views();
  job.rows = rows.data();
  job.blocks = blocks.ptrs();
  job.num_blocks = blocks.size();
  return job;
}

// The model's payloads and nonfinite flags for `rows` of `pool` (payload bytes of flagged
// blocks are left as the model wrote them; callers compare only unflagged blocks).
inline void ModelEncodeBlocks(const KvPool& pool, const std::vector<uint32_t>& rows, BlockSet* out,
                              std::vector<uint8_t>* flags) {
  const BlockLayout& lay = pool.layout();
  flags->assign(out->size(), 0);
  for (uint32_t b = 0; b < out->size(); ++b) {
    for (uint32_t l = 0; l < lay.num_layers; ++l) {
      for (uint32_t p = 0; p < lay.kv_planes; ++p) {
        for (uint32_t t = 0; t < lay.block_tokens; ++t) {
          const uint32_t r = rows[static_cast<size_t>(b) * lay.block_tokens + t];
          if (!ModelEncodeRow(lay.row, pool.HeadPtrs(l, p, r).data(),
                              (*out)[b].data() + lay.RowOffset(l, p, t))) {
            (*flags)[b] = 1;
          }
        }
      }
    }
  }
}

// The model's decode of `blocks` into `rows` of `pool`.
inline void ModelDecodeBlocks(const BlockSet& blocks, const std::vector<uint32_t>& rows,
                              KvPool* pool) {
  const BlockLayout& lay = pool->layout();
  for (uint32_t b = 0; b < blocks.size(); ++b) {
    for (uint32_t l = 0; l < lay.num_layers; ++l) {
      for (uint32_t p = 0; p < lay.kv_planes; ++p) {
        for (uint32_t t = 0; t < lay.block_tokens; ++t) {
          ModelDecodeRow(
              lay.row, blocks[b].data() + lay.RowOffset(l, p, t),
              pool->HeadPtrs(l, p, rows[static_cast<size_t>(b) * lay.block_tokens + t]).data());
        }
      }
    }
  }
}

// Result of checking decoded heads against their inputs with the elementwise bound.
struct BoundStats {
  uint64_t elements = 0;
  uint64_t violations = 0;
  double max_err_over_s = 0.0;      // max |x^ - x| / s: shows the bound is not vacuous
  double max_err_over_bound = 0.0;  // max |x^ - x| / bound: how close the bound is to tight
  std::string first_violation;
};

// Checks every element of one row (input heads -> decoded heads), given its stored form.
inline void CheckRowBound(const RowFormat& fmt, const uint8_t* const* in_heads,
                          const uint8_t* const* out_heads, const uint8_t* encoded, BoundStats* st) {
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    const uint8_t* in = in_heads[h];
    const uint8_t* out = out_heads[h];
    for (uint32_t i = 0; i < fmt.head_dim; ++i) {
      const double s = ElementScale(fmt, encoded, h, i);  // the head's, or the group's (INT4)
      const uint16_t xb = LoadU16(in + 2 * i);
      const uint16_t yb = LoadU16(out + 2 * i);
      const double x = HalfBitsToDouble(xb, fmt.dtype);
      const double y = HalfBitsToDouble(yb, fmt.dtype);
      const double err = std::fabs(y - x);
      const double bound = CodecErrorBound(fmt.codec, s, y, fmt.dtype);
      ++st->elements;
      st->max_err_over_s = std::max(st->max_err_over_s, err / s);
      st->max_err_over_bound = std::max(st->max_err_over_bound, err / bound);
      if (!(err <= bound)) {
        if (st->violations++ == 0) {
          char buf[256];
          std::snprintf(buf, sizeof(buf),
                        "%s head %u elem %u: x=%a (0x%04x) x^=%a (0x%04x) s=%a err=%a bound=%a",
                        DTypeName(fmt.dtype), h, i, x, xb, y, yb, s, err, bound);
          st->first_violation = buf;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Round-trip harness: runs executors on one case and compares them with the model.

struct Geometry {
  uint32_t heads;
  uint32_t dim;
  uint32_t planes;  // 2 = K and V, 1 = MLA latent
};

inline std::string GeometryName(const Geometry& g) {
  return std::to_string(g.heads) + "x" + std::to_string(g.dim) + (g.planes == 1 ? "(MLA)" : "");
}

// Engine geometries plus head_dims that leave a scalar tail after the vector part for 16, 8
// and 4 lanes (72, 100, 40, 7) or have no vector part at all (7).
inline std::vector<Geometry> TestGeometries() {
  return {{8, 128, 2}, {4, 64, 2},  {32, 128, 2}, {1, 576, 1}, {2, 96, 2},
          {3, 72, 2},  {2, 100, 2}, {5, 40, 2},   {1, 7, 1}};
}

// CODEC_INT4_G32_PER_HEAD's: head_dims that are multiples of 32 (engine shapes, one group, an
// odd number of groups, MLA's 576 = 18 groups, the CUDA kernels' largest head).
inline std::vector<Geometry> Int4TestGeometries() {
  return {{8, 128, 2}, {4, 64, 2}, {32, 128, 2}, {1, 576, 1},
          {2, 96, 2},  {3, 32, 2}, {5, 160, 2},  {1, 2048, 1}};
}

inline BlockLayout MakeLayout(const Geometry& g, DType dtype,
                              CodecKind codec = CodecKind::kInt8PerHead, uint32_t layers = 2,
                              uint32_t block_tokens = 8) {
  BlockLayout lay;
  lay.row.num_heads = g.heads;
  lay.row.head_dim = g.dim;
  lay.row.dtype = dtype;
  lay.row.codec = codec;
  lay.num_layers = layers;
  lay.kv_planes = g.planes;
  lay.block_tokens = block_tokens;
  return lay;
}

// An executor under test: encode fills job.blocks (and job.nonfinite when not null); decode
// writes the job's rows of every layer.
struct Executor {
  std::string name;
  std::function<void(const EncodeJob&)> encode;
  std::function<void(const DecodeJob&)> decode;
};

// Where byte `in_row` of an INT4 row (INT4's, KIVI's V) lies, for failure messages.
inline std::string DescribeInt4RowByte(const RowFormat& row, size_t in_row) {
  const size_t half_dim = row.head_dim / 2;
  const size_t groups = row.head_dim / kModelInt4Group;
  if (in_row < row.CodeBytes()) {
    return " head " + std::to_string(in_row / half_dim) + " codes " +
           std::to_string(2 * (in_row % half_dim)) + "," +
           std::to_string(2 * (in_row % half_dim) + 1);
  }
  const size_t sc = (in_row - row.CodeBytes()) / 2;
  return " scale of head " + std::to_string(sc / groups) + " group " + std::to_string(sc % groups);
}

// Where byte `off` of a block payload lies, for failure messages.
inline std::string DescribePayloadOffset(const BlockLayout& lay, size_t off) {
  if (lay.row.codec == CodecKind::kInt4Kivi) {
    const size_t d = lay.row.head_dim;
    const size_t channels = lay.row.ElementsPerRow();
    const std::string where = "layer " + std::to_string(off / lay.LayerBytes());
    const size_t in_layer = off % lay.LayerBytes();
    if (in_layer >= lay.PlaneBytes(0)) {  // V: INT4 rows
      const size_t in_plane = in_layer - lay.PlaneBytes(0);
      return where + " plane 1 token " + std::to_string(in_plane / lay.row.RowBytes()) +
             DescribeInt4RowByte(lay.row, in_plane % lay.row.RowBytes());
    }
    const size_t rows_bytes = size_t{lay.block_tokens} * channels / 2;
    if (in_layer < rows_bytes) {
      const size_t c = 2 * (in_layer % (channels / 2));
      return where + " plane 0 token " + std::to_string(in_layer / (channels / 2)) + " head " +
             std::to_string(c / d) + " codes " + std::to_string(c % d) + "," +
             std::to_string(c % d + 1);
    }
    const size_t param = (in_layer - rows_bytes) / 2;
    const size_t c = param % channels;
    return where + " plane 0 " + (param < channels ? "zero point" : "scale") + " of head " +
           std::to_string(c / d) + " dim " + std::to_string(c % d);
  }
  const size_t row_bytes = lay.row.RowBytes();
  const size_t layer = off / lay.LayerBytes();
  const size_t plane = off % lay.LayerBytes() / lay.PlaneBytes(0);
  const size_t token = off % lay.PlaneBytes(0) / row_bytes;
  const size_t in_row = off % row_bytes;
  std::string where = "layer " + std::to_string(layer) + " plane " + std::to_string(plane) +
                      " token " + std::to_string(token);
  if (lay.row.codec == CodecKind::kRaw) return where + " byte " + std::to_string(in_row);
  if (lay.row.codec == CodecKind::kInt4G32PerHead) {
    return where + DescribeInt4RowByte(lay.row, in_row);
  }
  if (in_row < lay.row.ElementsPerRow()) {
    return where + " head " + std::to_string(in_row / lay.row.head_dim) + " code " +
           std::to_string(in_row % lay.row.head_dim);
  }
  return where + " scale of head " + std::to_string((in_row - lay.row.ElementsPerRow()) / 2);
}

struct CaseSpec {
  BlockLayout layout;
  InputClass input = InputClass::kGaussian;
  ViewKind view = ViewKind::kContiguous;
  uint64_t seed = 1;
  uint32_t pool_rows = 64;
  uint32_t num_blocks = 3;
  // When set, the pools use this shape instead of `view`'s.
  std::optional<KvPool::Shape> shape;
};

inline KvPool MakePool(const CaseSpec& spec) {
  return spec.shape ? KvPool(spec.layout, spec.pool_rows, *spec.shape)
                    : KvPool(spec.layout, spec.pool_rows, spec.view, spec.seed);
}

inline std::string CaseName(const CaseSpec& c) {
  return std::string(DTypeName(c.layout.row.dtype)) + " " +
         GeometryName({c.layout.row.num_heads, c.layout.row.head_dim, c.layout.kv_planes}) + " " +
         CodecName(c.layout.row.codec) + " " + InputClassName(c.input) + " " +
         (c.shape ? "custom_shape" : ViewKindName(c.view)) + " seed " + std::to_string(c.seed);
}

// Encodes the case's rows with every executor and compares payload bytes and flags with the
// model; decodes each executor's payload into a sentinel-filled pool of the same shape and
// compares the whole buffers (requested rows and every other byte) with the model's decode;
// checks the elementwise bound (INT8, FP8) or bit-exactness (RAW) of the round trip. Returns one
// message per failure (empty: all agree). Adds the bound statistics of the case to `*bound`.
inline std::vector<std::string> RunCase(const CaseSpec& spec, const std::vector<Executor>& execs,
                                        BoundStats* bound) {
  std::vector<std::string> errors;
  const BlockLayout& lay = spec.layout;
  Rng rng(spec.seed);
  KvPool src = MakePool(spec);
  src.Fill(spec.input, spec.seed * 7919 + 1);
  const std::vector<uint32_t> rows =
      RandomRows(spec.pool_rows, static_cast<size_t>(spec.num_blocks) * lay.block_tokens, rng);

  BlockSet want(lay, spec.num_blocks);
  std::vector<uint8_t> want_flags;
  ModelEncodeBlocks(src, rows, &want, &want_flags);
  for (uint8_t f : want_flags) {
    if (f) errors.push_back(CaseName(spec) + ": the model saw a non-finite input");
  }
  constexpr uint8_t kSentinel = 0xA5;
  KvPool want_out = MakePool(spec);
  want_out.FillBytes(kSentinel);
  ModelDecodeBlocks(want, rows, &want_out);

  for (const Executor& ex : execs) {
    const std::string prefix = CaseName(spec) + " [" + ex.name + "]: ";
    BlockSet got(lay, spec.num_blocks);
    std::vector<uint8_t> flags(spec.num_blocks, 0xEE);
    ex.encode(MakeEncodeJob(src, rows, got, flags.data()));
    for (uint32_t b = 0; b < spec.num_blocks; ++b) {
      if (lay.row.codec != CodecKind::kRaw && flags[b] != 0) {
        errors.push_back(prefix + "nonfinite flag " + std::to_string(flags[b]) + " on block " +
                         std::to_string(b) + " of finite input");
      }
      if (got[b] != want[b]) {
        size_t off = 0;
        while (got[b][off] == want[b][off]) ++off;
        size_t count = 0;
        for (size_t i = 0; i < got[b].size(); ++i) count += got[b][i] != want[b][i];
        errors.push_back(prefix + "block " + std::to_string(b) + ": " + std::to_string(count) +
                         " payload bytes differ from the float64 model, first at " +
                         DescribePayloadOffset(lay, off) + " (got " + std::to_string(got[b][off]) +
                         ", want " + std::to_string(want[b][off]) + ")");
      }
    }

    KvPool out = MakePool(spec);
    out.FillBytes(kSentinel);
    ex.decode(MakeDecodeJob(out, rows, got));
    for (uint32_t l = 0; l < lay.num_layers; ++l) {
      if (out.buffer(l) == want_out.buffer(l)) continue;
      const std::vector<uint8_t> mask = out.AddressedMask(l, rows);
      size_t inside = 0, outside = 0, first = SIZE_MAX;
      for (size_t i = 0; i < mask.size(); ++i) {
        if (out.buffer(l)[i] == want_out.buffer(l)[i]) continue;
        (mask[i] ? inside : outside)++;
        first = std::min(first, i);
      }
      errors.push_back(prefix + "decode layer " + std::to_string(l) + ": " +
                       std::to_string(inside) + " bytes of requested rows differ from the model, " +
                       std::to_string(outside) + " bytes outside them were written (first at " +
                       "buffer offset " + std::to_string(first) + ")");
    }

    BoundStats st;
    for (uint32_t l = 0; l < lay.num_layers; ++l) {
      for (uint32_t p = 0; p < lay.kv_planes; ++p) {
        for (uint32_t b = 0; b < spec.num_blocks; ++b) {
          for (uint32_t t = 0; t < lay.block_tokens; ++t) {
            const uint32_t r = rows[static_cast<size_t>(b) * lay.block_tokens + t];
            if (lay.row.codec == CodecKind::kRaw) {
              for (uint32_t h = 0; h < lay.row.num_heads; ++h) {
                ++st.elements;
                if (std::memcmp(src.HeadAddr(l, p, r, h), out.HeadAddr(l, p, r, h),
                                static_cast<size_t>(lay.row.head_dim) * 2) != 0 &&
                    st.violations++ == 0) {
                  st.first_violation = "raw head " + std::to_string(h) + " differs";
                }
              }
            } else {
              const std::vector<uint8_t*> in = src.HeadPtrs(l, p, r);
              const std::vector<uint8_t*> dec = out.HeadPtrs(l, p, r);
              CheckRowBound(lay.row, in.data(), dec.data(), got[b].data() + lay.RowOffset(l, p, t),
                            &st);
            }
          }
        }
      }
    }
    if (st.violations != 0) {
      errors.push_back(prefix + std::to_string(st.violations) + " of " +
                       std::to_string(st.elements) +
                       " elements break the bound: " + st.first_violation);
    }
    bound->elements += st.elements;
    bound->violations += st.violations;
    bound->max_err_over_s = std::max(bound->max_err_over_s, st.max_err_over_s);
    bound->max_err_over_bound = std::max(bound->max_err_over_bound, st.max_err_over_bound);
  }
  return errors;
}

// Where a non-finite value is planted: (layer, plane, index into the case's row list, head,
// element). Rows past the row list's end address pool rows that no block references.
struct Plant {
  uint32_t layer, plane, row_index, head, elem;
  uint16_t bits;
};

// Encodes after planting non-finite values and checks that exactly the blocks holding them are
// flagged, by every executor, and that the other blocks' payloads still match the model.
inline std::vector<std::string> RunNonfiniteCase(const CaseSpec& spec,
                                                 const std::vector<Plant>& plants,
                                                 const std::vector<Executor>& execs) {
  std::vector<std::string> errors;
  const BlockLayout& lay = spec.layout;
  Rng rng(spec.seed);
  KvPool src = MakePool(spec);
  src.Fill(spec.input, spec.seed * 7919 + 1);
  const size_t n = static_cast<size_t>(spec.num_blocks) * lay.block_tokens;
  std::vector<uint32_t> all = RandomRows(spec.pool_rows, spec.pool_rows, rng);
  const std::vector<uint32_t> rows(all.begin(), all.begin() + n);
  std::vector<uint8_t> expect_flags(spec.num_blocks, 0);
  for (const Plant& p : plants) {
    src.Head(p.layer, p.plane, all[p.row_index], p.head)[p.elem] = p.bits;
    if (p.row_index < n) expect_flags[p.row_index / lay.block_tokens] = 1;
  }
  BlockSet want(lay, spec.num_blocks);
  std::vector<uint8_t> model_flags;
  ModelEncodeBlocks(src, rows, &want, &model_flags);
  if (model_flags != expect_flags) errors.push_back(CaseName(spec) + ": model flags differ");
  for (const Executor& ex : execs) {
    const std::string prefix = CaseName(spec) + " [" + ex.name + "]: ";
    BlockSet got(lay, spec.num_blocks);
    std::vector<uint8_t> flags(spec.num_blocks, 0xEE);
    ex.encode(MakeEncodeJob(src, rows, got, flags.data()));
    for (uint32_t b = 0; b < spec.num_blocks; ++b) {
      if (flags[b] != expect_flags[b]) {
        errors.push_back(prefix + "block " + std::to_string(b) + " flag " +
                         std::to_string(flags[b]) + ", want " + std::to_string(expect_flags[b]));
      } else if (!expect_flags[b] && got[b] != want[b]) {
        errors.push_back(prefix + "unflagged block " + std::to_string(b) +
                         " differs from the model");
      }
    }
  }
  return errors;
}

// ---------------------------------------------------------------------------------------------
// The SIMD CPU executor (codec_cpu.h) and the scalar reference as Executors, for the SIMD tests.

// Row-at-a-time use of EncodeRowSimd / DecodeRowSimd over a whole job.
inline void EncodeRowsSimd(const EncodeJob& job) {
  const BlockLayout& lay = job.layout;
  for (uint32_t b = 0; b < job.num_blocks; ++b) {
    bool finite = true;
    for (uint32_t l = 0; l < lay.num_layers; ++l) {
      for (uint32_t p = 0; p < lay.kv_planes; ++p) {
        for (uint32_t t = 0; t < lay.block_tokens; ++t) {
          finite &= EncodeRowSimd(lay.row, job.layers[l].planes[p],
                                  job.rows[static_cast<size_t>(b) * lay.block_tokens + t],
                                  job.blocks[b] + lay.RowOffset(l, p, t));
        }
      }
    }
    if (job.nonfinite != nullptr) job.nonfinite[b] = finite ? 0 : 1;
  }
}

inline void DecodeRowsSimd(const DecodeJob& job) {
  const BlockLayout& lay = job.layout;
  for (uint32_t b = 0; b < job.num_blocks; ++b) {
    for (uint32_t l = 0; l < lay.num_layers; ++l) {
      for (uint32_t p = 0; p < lay.kv_planes; ++p) {
        for (uint32_t t = 0; t < lay.block_tokens; ++t) {
          DecodeRowSimd(lay.row, job.blocks[b] + lay.RowOffset(l, p, t), job.layers[l].planes[p],
                        job.rows[static_cast<size_t>(b) * lay.block_tokens + t]);
        }
      }
    }
  }
}

// The SIMD executors under test: single rows ("simd_rows", always first), a CpuCodec per count
// of `threads` (Encode, Decode), and a 2-thread CpuCodec that decodes with DecodeLayer in
// reverse layer order, as a restore that signals per layer might call it. The codecs are shared
// by the returned closures.
inline std::vector<Executor> SimdExecutors(std::initializer_list<unsigned> threads) {
  std::vector<Executor> ex;
  ex.push_back({"simd_rows", EncodeRowsSimd, DecodeRowsSimd});
  for (unsigned n : threads) {
    auto codec = std::make_shared<CpuCodec>(n);
    ex.push_back({"cpu_codec_" + std::to_string(n) + "t",
                  [codec](const EncodeJob& j) { codec->Encode(j); },
                  [codec](const DecodeJob& j) { codec->Decode(j); }});
  }
  auto codec = std::make_shared<CpuCodec>(2);
  ex.push_back({"cpu_codec_2t_by_layer", [codec](const EncodeJob& j) { codec->Encode(j); },
                [codec](const DecodeJob& j) {
                  for (uint32_t l = j.layout.num_layers; l-- > 0;) codec->DecodeLayer(j, l);
                }});
  return ex;
}

// The scalar reference (codec_reference.h) as an Executor.
inline Executor ReferenceExecutor() {
  return {"reference", [](const EncodeJob& j) { EncodeBlocksReference(j); },
          [](const DecodeJob& j) { DecodeBlocksReference(j); }};
}

// Non-finite `bits` at element `elem` of three rows of a case's row list: in block 1 (its last
// plane and head), in the last row of block 3, and in a row past the list (no block holds it).
inline std::vector<Plant> NonfinitePlants(const BlockLayout& lay, uint16_t bits, uint32_t elem) {
  const uint32_t last_plane = lay.kv_planes - 1;
  const uint32_t t = lay.block_tokens;
  return {
      {1, last_plane, 1 * t + 2, lay.row.num_heads - 1, elem, bits},  // block 1
      {0, 0, 3 * t + t - 1, 0, elem, bits},                           // block 3, last row
      {0, last_plane, 5 * t + 7, 0, elem, bits},                      // a row no block holds
  };
}

// ---------------------------------------------------------------------------------------------
// Sweeps shared by the SIMD tests of every codec (codec_cpu_test.cc, codec_cpu_fp8_test.cc,
// codec_cpu_int4_test.cc): what differs between codecs is passed in. Each returns one message
// per failure (empty: all agree); seeds count up from `seed`, one per case.

// Every input class x geometry x dtype (the view shape rotates), all executors; rows of 4096
// elements or more get 2 blocks instead of 3.
inline std::vector<std::string> RunEveryInputClass(CodecKind codec,
                                                   const std::vector<Geometry>& geometries,
                                                   const std::vector<InputClass>& classes,
                                                   uint64_t seed,
                                                   const std::vector<Executor>& execs,
                                                   BoundStats* bound) {
  std::vector<std::string> errors;
  size_t vk = 0;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (const Geometry& g : geometries) {
      for (InputClass c : classes) {
        CaseSpec spec;
        spec.layout = MakeLayout(g, dtype, codec);
        spec.input = c;
        spec.view = AllViewKinds()[vk++ % AllViewKinds().size()];
        spec.seed = seed++;
        if (g.heads * g.dim >= 4096) spec.num_blocks = 2;
        for (auto& e : RunCase(spec, execs, bound)) errors.push_back(e);
      }
    }
  }
  return errors;
}

// Every view shape with both dtypes for the engine geometry, and odd block sizes (1, 5, 16).
inline std::vector<std::string> RunEveryViewShape(CodecKind codec, uint64_t seed,
                                                  const std::vector<Executor>& execs,
                                                  BoundStats* bound) {
  std::vector<std::string> errors;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (ViewKind vk : AllViewKinds()) {
      for (uint32_t tokens : {1u, 5u, 16u}) {
        CaseSpec spec;
        spec.layout = MakeLayout({8, 128, 2}, dtype, codec, 2, tokens);
        spec.input = InputClass::kRowMix;
        spec.view = vk;
        spec.seed = seed++;
        spec.num_blocks = 4;
        for (auto& e : RunCase(spec, execs, bound)) errors.push_back(e);
      }
    }
  }
  return errors;
}

// CpuCodec and the scalar reference on a larger job (engine geometry, 3 layers, 64-token
// blocks, 5 blocks of a 512-row paged pool): identical payloads, no flags and identical
// restored pools (sentinel bytes included) for 1, 2, 3 and 8 threads (more threads than cores,
// and than some jobs' items), both dtypes.
inline std::vector<std::string> RunSameBytesAsReference(CodecKind codec) {
  std::vector<std::string> errors;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const BlockLayout lay = MakeLayout({8, 128, 2}, dtype, codec, 3, 64);
    KvPool src(lay, 512, ViewKind::kPaged, 5);
    src.Fill(InputClass::kRowMix, 5);
    Rng rng(5);
    const std::vector<uint32_t> rows = RandomRows(512, 5 * lay.block_tokens, rng);
    BlockSet ref(lay, 5);
    EncodeBlocksReference(MakeEncodeJob(src, rows, ref, nullptr));
    KvPool ref_out(lay, 512, ViewKind::kPaged, 5);
    ref_out.FillBytes(0x3C);
    DecodeBlocksReference(MakeDecodeJob(ref_out, rows, ref));
    for (unsigned threads : {1u, 2u, 3u, 8u}) {
      const std::string prefix = std::string(CodecName(codec)) + " " + DTypeName(dtype) + " " +
                                 std::to_string(threads) + " threads";
      CpuCodec cpu(threads);
      if (cpu.threads() != threads) {
        errors.push_back(prefix + ": threads() is " + std::to_string(cpu.threads()));
      }
      BlockSet got(lay, 5);
      std::vector<uint8_t> flags(5, 0xEE);
      cpu.Encode(MakeEncodeJob(src, rows, got, flags.data()));
      if (!(got == ref)) errors.push_back(prefix + ": payloads differ from the reference");
      if (flags != std::vector<uint8_t>(5, 0)) {
        errors.push_back(prefix + ": nonfinite flags on finite input");
      }
      KvPool out(lay, 512, ViewKind::kPaged, 5);
      out.FillBytes(0x3C);
      cpu.Decode(MakeDecodeJob(out, rows, got));
      for (uint32_t l = 0; l < lay.num_layers; ++l) {
        if (!(out.buffer(l) == ref_out.buffer(l))) {
          errors.push_back(prefix + ", layer " + std::to_string(l) +
                           ": restored pool differs from the reference's");
        }
      }
    }
  }
  return errors;
}

// NaN (quiet, signaling; -qNaN too when `negative_quiet_nan`) and +-Inf planted by
// NonfinitePlants at element 3 and at the last element of a head, for each geometry and both
// dtypes (4 blocks, the view shape rotating with the seed): RunNonfiniteCase checks that
// exactly the blocks holding them are flagged and that the others still match the model.
inline std::vector<std::string> RunNonfiniteFlags(CodecKind codec,
                                                  const std::vector<Geometry>& geometries,
                                                  bool negative_quiet_nan, uint64_t seed,
                                                  const std::vector<Executor>& execs) {
  std::vector<std::string> errors;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const uint16_t inf = InfBits(dtype);
    const uint16_t quiet = static_cast<uint16_t>(inf | (inf >> 1 & ~inf));
    std::vector<uint16_t> values = {inf, static_cast<uint16_t>(0x8000u | inf), quiet};
    if (negative_quiet_nan) values.push_back(static_cast<uint16_t>(0x8000u | quiet));
    values.push_back(static_cast<uint16_t>(inf | 1u));
    for (const Geometry& g : geometries) {
      for (uint32_t elem : {3u, g.dim - 1}) {
        for (uint16_t v : values) {
          CaseSpec spec;
          spec.layout = MakeLayout(g, dtype, codec);
          spec.num_blocks = 4;
          spec.view = AllViewKinds()[seed % 4];
          spec.seed = seed++;
          for (auto& e : RunNonfiniteCase(spec, NonfinitePlants(spec.layout, v, elem), execs)) {
            errors.push_back(e);
          }
        }
      }
    }
  }
  return errors;
}

// What the EveryHighwayTarget tests run on each target, once it is selected: the classes on
// every geometry (1 layer, 4-token blocks, 2 blocks, the view shape rotating), then a signaling
// NaN in the last element of `nonfinite` (4 blocks), for both dtypes.
inline std::vector<std::string> RunOneHighwayTarget(CodecKind codec,
                                                    const std::vector<Geometry>& geometries,
                                                    const std::vector<InputClass>& classes,
                                                    const Geometry& nonfinite, uint64_t seed,
                                                    const std::vector<Executor>& execs) {
  std::vector<std::string> errors;
  BoundStats bound;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (const Geometry& g : geometries) {
      for (InputClass c : classes) {
        CaseSpec spec;
        spec.layout = MakeLayout(g, dtype, codec, 1, 4);
        spec.input = c;
        spec.view = AllViewKinds()[seed % 4];
        spec.seed = seed++;
        spec.num_blocks = 2;
        for (auto& e : RunCase(spec, execs, &bound)) errors.push_back(e);
      }
    }
    CaseSpec spec;
    spec.layout = MakeLayout(nonfinite, dtype, codec);
    spec.num_blocks = 4;
    spec.seed = seed++;
    const uint16_t snan = static_cast<uint16_t>(InfBits(dtype) | 1u);
    for (auto& e :
         RunNonfiniteCase(spec, NonfinitePlants(spec.layout, snan, nonfinite.dim - 1), execs)) {
      errors.push_back(e);
    }
  }
  return errors;
}

}  // namespace hiqcache::kernels::testutil
