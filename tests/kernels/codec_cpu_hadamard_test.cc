// CODEC_INT4_HADAMARD on the scalar reference and the SIMD CPU executor (codec_cpu_hadamard.cc):
// byte for byte against a model written from codec_math.h's text for every input class,
// geometry (rotation runs of 32 to 512 elements), dtype, view shape and block size (1 to 64
// tokens), with the elementwise bound checked on every restored element; every code byte's
// decode; NaN, Inf and a rotation beyond fp32's range flag exactly their blocks; every Highway
// target this machine runs.
#include "codec_cpu_hadamard.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "codec_cpu.h"
#include "codec_cpu_test_util.h"
#include "codec_reference.h"
#include "codec_test_util.h"

namespace hiqcache::kernels {
namespace {

using namespace testutil;  // NOLINT: test-only helpers

constexpr CodecKind kHadamard = CodecKind::kInt4Hadamard;

RowFormat Int8Format(const RowFormat& fmt) {
  RowFormat f = fmt;
  f.codec = CodecKind::kInt8PerHead;
  return f;
}

// The run r (largest power-of-two divisor of d) and k = log2 r, found by halving.
uint32_t RunOf(uint32_t d, uint32_t* k) {
  uint32_t r = 1;
  *k = 0;
  while (d % (2 * r) == 0) {
    r *= 2;
    ++*k;
  }
  return r;
}

// H_r v in fp32, written as butterflies over sub-blocks of doubling length (the same pairs in the
// same order as the format's stages of stride 1, 2, ..., r/2).
void ModelTransform(float* v, uint32_t r) {
  for (uint32_t len = 2; len <= r; len *= 2) {
    for (uint32_t start = 0; start < r; start += len) {
      for (uint32_t i = start; i < start + len / 2; ++i) {
        const float a = v[i];
        const float b = v[i + len / 2];
        v[i] = a + b;
        v[i + len / 2] = a - b;
      }
    }
  }
}

// y of one head (the rotated elements as bf16, held in doubles); false when a run's transform
// reaches the limit.
bool ModelRotate(const uint16_t* x, uint32_t d, DType dtype, double* y) {
  uint32_t k = 0;
  const uint32_t r = RunOf(d, &k);
  std::vector<float> v(r);
  for (uint32_t j0 = 0; j0 < d; j0 += r) {
    for (uint32_t i = 0; i < r; ++i) v[i] = static_cast<float>(HalfBitsToDouble(x[j0 + i], dtype));
    ModelTransform(v.data(), r);
    for (uint32_t i = 0; i < r; ++i) {
      // Refused at |v| >= 2^(126 - ceil(k/2)), NaN and Inf included.
      if (!(std::fabs(v[i]) < std::ldexp(1.0, 126 - static_cast<int>((k + 1) / 2)))) return false;
      const double scaled = std::ldexp(static_cast<double>(v[i]), -static_cast<int>(k / 2));
      y[j0 + i] = HalfBitsToDouble(DoubleToHalfBits(scaled, DType::kBF16), DType::kBF16);
    }
  }
  return true;
}

// KIVI's parameters of a group with smallest lo and largest hi (bf16 values): z = lo (+0 for a
// zero), s = bf16_rne(fp32(0.5 hi - 0.5 lo) floored at 2^-112, / 7.5 in fp32).
void ModelParams(double lo, double hi, uint16_t* zb, uint16_t* sb) {
  if (lo == 0.0) lo = 0.0;
  *zb = DoubleToHalfBits(lo, DType::kBF16);
  float r = 0.5f * static_cast<float>(hi) - 0.5f * static_cast<float>(lo);
  if (r < 0x1.0p-112f) r = 0x1.0p-112f;
  *sb = DoubleToHalfBits(static_cast<double>(r / 7.5f), DType::kBF16);
}

// q = clamp(rne(2 * fp32((0.5 y - 0.5 z) / s)), 0, 15).
uint8_t ModelCode(double y, uint16_t zb, uint16_t sb) {
  const float quot = (0.5f * static_cast<float>(y) -
                      0.5f * static_cast<float>(HalfBitsToDouble(zb, DType::kBF16))) /
                     static_cast<float>(HalfBitsToDouble(sb, DType::kBF16));
  return static_cast<uint8_t>(std::min(15.0, std::max(0.0, std::nearbyint(2.0 * quot))));
}

void PutNibble(uint8_t* codes, size_t c, uint8_t q) {
  uint8_t& byte = codes[c / 2];
  byte = (c % 2 == 0) ? static_cast<uint8_t>((byte & 0xF0u) | q)
                      : static_cast<uint8_t>((byte & 0x0Fu) | (q << 4));
}

// Model of plane `p` of one (block, layer): rows[0..n). False when an element is not finite.
bool ModelEncodePlane(const KvPool& pool, uint32_t layer, uint32_t p, const uint32_t* rows,
                      uint32_t n, uint8_t* dst) {
  const RowFormat& fmt = pool.row_format();
  if (!ModelEncodeRow(Int8Format(fmt), pool.HeadPtrs(layer, p, rows[0]).data(), dst)) {
    return false;
  }
  const uint32_t d = fmt.head_dim;
  const size_t ch = fmt.ElementsPerRow();
  const uint32_t m = n - 1;
  std::vector<double> y(static_cast<size_t>(m) * ch);
  for (uint32_t t = 0; t < m; ++t) {
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      if (!ModelRotate(pool.Head(layer, p, rows[t + 1], h), d, fmt.dtype,
                       &y[t * ch + static_cast<size_t>(h) * d])) {
        return false;
      }
    }
  }
  const size_t first = fmt.ElementsPerRow() + 2 * fmt.num_heads;
  if (p == 0) {
    const size_t row_bytes = ch / 2;
    uint8_t* zeros = dst + first + m * row_bytes;
    for (size_t c = 0; c < ch && m > 0; ++c) {
      double lo = INFINITY;
      double hi = -INFINITY;
      for (uint32_t t = 0; t < m; ++t) {
        lo = std::min(lo, y[t * ch + c]);
        hi = std::max(hi, y[t * ch + c]);
      }
      uint16_t zb = 0;
      uint16_t sb = 0;
      ModelParams(lo, hi, &zb, &sb);
      StoreU16(zeros + 2 * c, zb);
      StoreU16(zeros + 2 * ch + 2 * c, sb);
      for (uint32_t t = 0; t < m; ++t) {
        PutNibble(dst + first + t * row_bytes, c, ModelCode(y[t * ch + c], zb, sb));
      }
    }
    return true;
  }
  const size_t groups = ch / 32;
  const size_t row_bytes = ch / 2 + 4 * groups;
  for (uint32_t t = 0; t < m; ++t) {
    uint8_t* row = dst + first + t * row_bytes;
    for (size_t g = 0; g < groups; ++g) {
      double lo = INFINITY;
      double hi = -INFINITY;
      for (size_t i = g * 32; i < g * 32 + 32; ++i) {
        lo = std::min(lo, y[t * ch + i]);
        hi = std::max(hi, y[t * ch + i]);
      }
      uint16_t zb = 0;
      uint16_t sb = 0;
      ModelParams(lo, hi, &zb, &sb);
      StoreU16(row + ch / 2 + 2 * g, zb);
      StoreU16(row + ch / 2 + 2 * groups + 2 * g, sb);
      for (size_t i = g * 32; i < g * 32 + 32; ++i)
        PutNibble(row, i, ModelCode(y[t * ch + i], zb, sb));
    }
  }
  return true;
}

// Where token t (>= 1) of plane p keeps element c's code and its (zero point, scale) pair.
struct CodeRef {
  uint8_t q;
  double z;
  double s;
};

CodeRef ModelCodeRef(const RowFormat& fmt, uint32_t p, const uint8_t* plane, uint32_t bt,
                     uint32_t t, size_t c) {
  const size_t ch = fmt.ElementsPerRow();
  const size_t first = ch + 2 * fmt.num_heads;
  const size_t row_bytes = p == 0 ? ch / 2 : ch / 2 + 4 * (ch / 32);
  const uint8_t* row = plane + first + (t - 1) * row_bytes;
  const uint8_t q = (c % 2 == 0) ? (row[c / 2] & 0xF) : (row[c / 2] >> 4);
  const uint8_t* zs =
      p == 0 ? plane + first + (bt - 1) * row_bytes + 2 * c : row + ch / 2 + 2 * (c / 32);
  const size_t count = p == 0 ? ch : ch / 32;
  return {q, HalfBitsToDouble(LoadU16(zs), DType::kBF16),
          HalfBitsToDouble(LoadU16(zs + 2 * count), DType::kBF16)};
}

// y^ = bf16(fp32(q * s + z)).
double ModelYHat(const CodeRef& r) {
  const float y = static_cast<float>(r.q * r.s + r.z);
  return HalfBitsToDouble(DoubleToHalfBits(static_cast<double>(y), DType::kBF16), DType::kBF16);
}

using HadamardCase = PlaneCodecCase;

// The model's decode of token t >= 1 of plane p into `out` (d elements per head), with every
// element checked against codec_math.h's bound.
void ModelDecodeToken(const KvPool& in, uint32_t l, uint32_t p, uint32_t row, const uint8_t* plane,
                      uint32_t bt, uint32_t t, uint8_t* const* out, const std::string& name,
                      BoundStats* bound) {
  const RowFormat& fmt = in.row_format();
  const uint32_t d = fmt.head_dim;
  uint32_t k = 0;
  const uint32_t r = RunOf(d, &k);
  const double u = fmt.dtype == DType::kBF16 ? 0x1.0p-8 : 0x1.0p-11;
  std::vector<float> w(r);
  std::vector<double> yh(r);
  std::vector<double> sc(r);
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    const uint16_t* x = in.Head(l, p, row, h);
    for (uint32_t j0 = 0; j0 < d; j0 += r) {
      for (uint32_t i = 0; i < r; ++i) {
        const CodeRef ref = ModelCodeRef(fmt, p, plane, bt, t, size_t{h} * d + j0 + i);
        yh[i] = ModelYHat(ref);
        sc[i] = ref.s;
        w[i] = static_cast<float>(yh[i]);
      }
      ModelTransform(w.data(), r);
      double sum = 0.0;
      double xsum = 0.0;
      for (uint32_t i = 0; i < r; ++i) {
        sum += (0.5 + 0x1.0p-6) * sc[i] + 0x1.0p-6 * std::fabs(yh[i]);
        xsum += std::fabs(HalfBitsToDouble(x[j0 + i], fmt.dtype));
      }
      const double c_d = std::ldexp(1.0, -static_cast<int>((k + 1) / 2));
      for (uint32_t i = 0; i < r; ++i) {
        const uint16_t xb = DoubleToHalfBits(
            std::ldexp(static_cast<double>(w[i]), -static_cast<int>((k + 1) / 2)), fmt.dtype);
        StoreU16(out[h] + 2 * (j0 + i), xb);
        const double xv = HalfBitsToDouble(x[j0 + i], fmt.dtype);
        const double xh = HalfBitsToDouble(xb, fmt.dtype);
        double bnd = c_d * sum + 0x1.0p-20 * xsum + u * std::fabs(xh) + 0x1.0p-120;
        if (fmt.dtype == DType::kFP16 && std::fabs(xh) <= 0x1.0p-14) bnd += 0x1.0p-25;
        if (fmt.dtype == DType::kBF16) bnd += 0x1.0p-134;
        const double err = std::fabs(xh - xv);
        ++bound->elements;
        bound->max_err_over_s = std::max(bound->max_err_over_s, err / (c_d * sum));
        bound->max_err_over_bound = std::max(bound->max_err_over_bound, err / bnd);
        if (!(err <= bnd) && bound->violations++ == 0) {
          char buf[200];
          std::snprintf(buf, sizeof(buf), " plane %u head %u elem %u: x=%a x^=%a err=%a bound=%a",
                        p, h, j0 + i, xv, xh, err, bnd);
          bound->first_violation = name + buf;
        }
      }
    }
  }
}

// Runs one case on every executor: payload bytes and flags equal the model's; decoded pools
// equal the model's decode, byte for byte; every restored element within its bound.
std::vector<std::string> RunHadamardCase(const HadamardCase& hc, const std::vector<Executor>& execs,
                                         BoundStats* bound, BoundStats* int8_bound) {
  const BlockLayout lay = MakeLayout(hc.g, hc.dtype, kHadamard, 2, hc.block_tokens);
  const uint32_t blocks = 3;
  const uint32_t num_rows = blocks * hc.block_tokens + 5;
  KvPool in(lay, num_rows, hc.view, hc.seed);
  in.Fill(hc.cls, hc.seed);
  Rng rng(hc.seed);
  const std::vector<uint32_t> rows = RandomRows(num_rows, size_t{blocks} * hc.block_tokens, rng);
  BlockSet model(lay, blocks);
  std::vector<uint8_t> model_flags(blocks, 0);
  for (uint32_t b = 0; b < blocks; ++b) {
    const uint32_t* br = rows.data() + size_t{b} * lay.block_tokens;
    for (uint32_t l = 0; l < lay.num_layers; ++l) {
      for (uint32_t p = 0; p < lay.kv_planes; ++p) {
        if (!ModelEncodePlane(in, l, p, br, lay.block_tokens,
                              model[b].data() + lay.PlaneOffset(l, p))) {
          model_flags[b] = 1;
        }
      }
    }
  }
  KvPool expect(lay, num_rows, hc.view, hc.seed);
  expect.FillBytes(0xEE);
  const RowFormat int8 = Int8Format(lay.row);
  for (uint32_t b = 0; b < blocks; ++b) {
    if (model_flags[b]) continue;
    for (uint32_t l = 0; l < lay.num_layers; ++l) {
      for (uint32_t p = 0; p < lay.kv_planes; ++p) {
        const uint8_t* plane = model[b].data() + lay.PlaneOffset(l, p);
        for (uint32_t t = 0; t < lay.block_tokens; ++t) {
          const uint32_t r = rows[size_t{b} * lay.block_tokens + t];
          if (t == 0) {
            ModelDecodeRow(int8, plane, expect.HeadPtrs(l, p, r).data());
            CheckRowBound(int8, in.HeadPtrs(l, p, r).data(), expect.HeadPtrs(l, p, r).data(), plane,
                          int8_bound);
            continue;
          }
          ModelDecodeToken(in, l, p, r, plane, lay.block_tokens, t, expect.HeadPtrs(l, p, r).data(),
                           Name(hc), bound);
        }
      }
    }
  }
  return CompareExecutorsWithModel(Name(hc), in, rows, model, model_flags, expect, hc.seed, execs);
}

// Runs of 128, 64, 32 (96 = 3 x 32, 160 = 5 x 32), 64 on MLA's 576 = 9 x 64, and 512.
std::vector<Geometry> HadamardGeometries() {
  return {{8, 128, 2}, {3, 64, 2}, {2, 32, 2}, {1, 576, 1}, {2, 96, 2}, {5, 160, 2}, {1, 512, 2}};
}

std::vector<InputClass> HadamardClasses() {
  std::vector<InputClass> c = AllInputClasses();
  c.push_back(InputClass::kInt4Grid);
  return c;
}

std::vector<Executor> Executors() {
  std::vector<Executor> ex = SimdExecutors({1u, 3u});
  ex.erase(ex.begin());  // simd_rows: row by row, no planes
  ex.push_back(ReferenceExecutor());
  return ex;
}

void Report(const BoundStats& bound, const BoundStats& int8_bound) {
  EXPECT_EQ(bound.violations, 0u) << bound.first_violation;
  EXPECT_EQ(int8_bound.violations, 0u) << int8_bound.first_violation;
  std::printf(
      "  %llu rotated elements checked, max err / bound = %.4f, max err / (c sum s) = "
      "%.4f; %llu INT8 elements, max err / bound = %.4f (target %s)\n",
      static_cast<unsigned long long>(bound.elements), bound.max_err_over_bound,
      bound.max_err_over_s, static_cast<unsigned long long>(int8_bound.elements),
      int8_bound.max_err_over_bound, CpuCodec::TargetName());
}

TEST(CodecHadamard, MatchesModelEverywhere) {
  BoundStats bound;
  BoundStats int8_bound;
  std::vector<std::string> errors;
  const std::vector<Executor> execs = Executors();
  uint64_t seed = 33000;
  for (const Geometry& g : HadamardGeometries()) {
    for (DType dt : {DType::kBF16, DType::kFP16}) {
      for (uint32_t bt : {1u, 3u, 16u}) {
        for (InputClass c : HadamardClasses()) {
          auto e = RunHadamardCase({g, dt, bt, c, ViewKind::kContiguous, ++seed}, execs, &bound,
                                   &int8_bound);
          errors.insert(errors.end(), e.begin(), e.end());
        }
      }
    }
  }
  ExpectNoErrors(errors);
  EXPECT_GT(bound.elements, 100000u);
  EXPECT_GT(int8_bound.elements, 10000u);
  Report(bound, int8_bound);
}

// Every view shape with both dtypes, larger and odd block sizes.
TEST(CodecHadamard, EveryViewShapeAndBlockSize) {
  BoundStats bound;
  BoundStats int8_bound;
  std::vector<std::string> errors;
  const std::vector<Executor> execs = Executors();
  uint64_t seed = 34000;
  for (ViewKind vk : AllViewKinds()) {
    for (DType dt : {DType::kBF16, DType::kFP16}) {
      for (uint32_t bt : {2u, 17u, 64u}) {
        auto e = RunHadamardCase({{3, 64, 2}, dt, bt, InputClass::kRowMix, vk, ++seed}, execs,
                                 &bound, &int8_bound);
        errors.insert(errors.end(), e.begin(), e.end());
      }
    }
  }
  ExpectNoErrors(errors);
  Report(bound, int8_bound);
}

// NaN and +-Inf anywhere (an INT8 first token or a rotated one, either plane), and a finite run
// whose transform overflows fp32, flag exactly their block; nothing else.
TEST(CodecHadamard, NonfiniteFlagsTheirBlock) {
  const std::vector<Executor> execs = Executors();
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    const uint16_t inf = dt == DType::kBF16 ? 0x7F80 : 0x7C00;
    for (uint16_t bits :
         {inf, static_cast<uint16_t>(inf | 0x8000), static_cast<uint16_t>(inf | 1)}) {
      for (uint32_t plane : {0u, 1u}) {
        for (uint32_t token : {0u, 5u}) {
          ExpectPlantedBlockFlagged(kHadamard, dt, plane, token, bits, execs);
        }
      }
    }
  }
  // BF16's largest values, all of one sign in one run of a rotated token: v = 64 x 3.39e38.
  const BlockLayout lay = MakeLayout({2, 64, 2}, DType::kBF16, kHadamard, 2, 8);
  KvPool in(lay, 40, ViewKind::kContiguous, 5);
  in.Fill(InputClass::kGaussian, 5);
  Rng rng(7);
  const std::vector<uint32_t> rows = RandomRows(40, 24, rng);
  for (uint32_t i = 0; i < 64; ++i) in.Head(0, 1, rows[17], 0)[i] = 0x7F7F;  // block 2
  ExpectEncodeFlags(in, rows, execs, {0, 0, 1}, "overflow");
}

// The encode's range limit (HadamardLimitBits) on a run of 64 (k = 6: 2^123): 64 equal elements
// make v_0 = 64 x, so x = 2^117 reaches the limit and flags its block; x = 1.5 x 2^116 stays
// under it, is stored, and decodes to the model's finite values within the bound (RunHadamardCase
// checks both on every executor).
TEST(CodecHadamard, RangeLimitFlagsExactlyAtTheBound) {
  const std::vector<Executor> execs = Executors();
  for (const double x : {0x1.0p117, 0x1.8p116}) {
    const BlockLayout lay = MakeLayout({1, 64, 2}, DType::kBF16, kHadamard, 1, 4);
    KvPool in(lay, 12, ViewKind::kContiguous, 9);
    in.Fill(InputClass::kGaussian, 9);
    Rng rng(9);
    const std::vector<uint32_t> rows = RandomRows(12, 12, rng);
    for (uint32_t i = 0; i < 64; ++i)
      in.Head(0, 1, rows[5], 0)[i] = DoubleToHalfBits(x, DType::kBF16);
    const uint8_t refused = x >= 0x1.0p117 ? 1 : 0;
    ExpectEncodeFlags(in, rows, execs, {0, refused, 0}, "x " + std::to_string(x));
  }
  // Through the whole comparison with the model: huge but accepted runs decode alike everywhere.
  BoundStats bound;
  BoundStats int8_bound;
  std::vector<std::string> errors;
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    auto e = RunHadamardCase({{2, 64, 2}, dt, 4, InputClass::kHuge, ViewKind::kContiguous, 36000},
                             execs, &bound, &int8_bound);
    errors.insert(errors.end(), e.begin(), e.end());
  }
  ExpectNoErrors(errors);
  EXPECT_EQ(bound.violations, 0u) << bound.first_violation;
}

// Every code byte with many zero points and scales, in both planes: the SIMD decode writes the
// reference's bits.
TEST(CodecHadamard, EveryCodeDecodesLikeTheReference) {
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    for (uint32_t p : {0u, 1u}) {
      RowFormat fmt{2, 64, dt, kHadamard};
      const uint32_t bt = 257;  // every byte value in every code position of rows 1..256
      const size_t ch = fmt.ElementsPerRow();
      BlockLayout lay = MakeLayout({2, 64, 2}, dt, kHadamard, 1, bt);
      std::vector<uint8_t> plane(lay.PlaneBytes(p));
      Rng rng(31 + p);
      // Row 0: an INT8 row of random codes and scales.
      for (size_t j = 0; j < ch; ++j) plane[j] = static_cast<uint8_t>(rng.Below(256));
      for (uint32_t h = 0; h < fmt.num_heads; ++h) {
        StoreU16(
            plane.data() + ch + 2 * h,
            DoubleToHalfBits(std::ldexp(1.0 + rng.Uniform(), rng.Range(-20, 4)), DType::kBF16));
      }
      auto params = [&](uint8_t* zs, size_t count) {
        for (size_t c = 0; c < count; ++c) {
          const double z = (rng.Uniform() - 0.5) * std::ldexp(1.0, rng.Range(-20, 10));
          StoreU16(zs + 2 * c, DoubleToHalfBits(z, DType::kBF16));
          StoreU16(
              zs + 2 * count + 2 * c,
              DoubleToHalfBits(std::ldexp(1.0 + rng.Uniform(), rng.Range(-24, 8)), DType::kBF16));
        }
      };
      for (uint32_t t = 1; t < bt; ++t) {
        uint8_t* row = plane.data() + fmt.PlaneRowOffset(p, t);
        for (size_t j = 0; j < ch / 2; ++j) row[j] = static_cast<uint8_t>(t + j);
        if (p == 1) params(row + ch / 2, ch / 32);
      }
      if (p == 0) params(plane.data() + fmt.PlaneRowOffset(0, bt), ch);
      std::vector<uint8_t> a(bt * ch * 2, 0x22), b(bt * ch * 2, 0x11);
      std::vector<uint32_t> rows(bt);
      for (uint32_t t = 0; t < bt; ++t) rows[t] = t;
      const StridedView view{a.data(), ch * 2, 128, 0, 0, bt};
      const StridedView view_b{b.data(), ch * 2, 128, 0, 0, bt};
      DecodeHadamardRowsReference(fmt, p, plane.data(), bt, 0, bt, view, rows.data());
      DecodeHadamardRowsSimd(fmt, p, plane.data(), bt, 0, bt, view_b, rows.data());
      EXPECT_EQ(a, b) << DTypeName(dt) << " plane " << p;
      // A range of rows starting past 0 decodes the same rows.
      std::vector<uint8_t> c(bt * ch * 2, 0x33);
      const StridedView view_c{c.data(), ch * 2, 128, 0, 0, bt};
      DecodeHadamardRowsSimd(fmt, p, plane.data(), bt, 100, 140, view_c, rows.data() + 100);
      EXPECT_EQ(0, std::memcmp(c.data() + 100 * ch * 2, a.data() + 100 * ch * 2, 40 * ch * 2));
    }
  }
}

// Every Highway target compiled in and supported here, selected in turn: runs of 32 to 256
// elements (2 to 64 vectors, so every register path and the scratch path on each target's lane
// count), MLA's 576, and a block of 2 tokens (the K ranges set by the one rotated token).
TEST(CodecHadamard, EveryHighwayTarget) {
  ExpectNoErrorsOnEveryHighwayTarget([](int64_t /*target*/) {
    BoundStats bound;
    BoundStats int8_bound;
    std::vector<std::string> errors;
    const std::vector<Executor> execs = {Executors()[0]};
    uint64_t seed = 35000;
    for (DType dt : {DType::kBF16, DType::kFP16}) {
      for (InputClass c : {InputClass::kRowMix, InputClass::kTiny, InputClass::kHuge}) {
        for (Geometry g : {Geometry{2, 96, 2}, Geometry{3, 64, 2}, Geometry{2, 128, 2},
                           Geometry{1, 256, 2}, Geometry{1, 576, 1}}) {
          for (uint32_t bt : {2u, 5u}) {
            auto e = RunHadamardCase({g, dt, bt, c, ViewKind::kStrided, ++seed}, execs, &bound,
                                     &int8_bound);
            errors.insert(errors.end(), e.begin(), e.end());
          }
        }
      }
    }
    return errors;
  });
}

TEST(CodecHadamard, RecordSizes) {
  // Qwen3-8B: 36 layers, 8 x 128. Per layer of a 16-token block: K = 1,040 (INT8 row) + 15 x 512
  // + 4,096 (channel parameters); V = 1,040 + 15 x (512 + 128).
  BlockLayout q = MakeLayout({8, 128, 2}, DType::kBF16, kHadamard, 36, 16);
  EXPECT_EQ(q.PlaneBytes(0), 1040u + 15 * 512 + 4096);
  EXPECT_EQ(q.PlaneBytes(1), 1040u + 15 * 640);
  EXPECT_EQ(q.BytesPerToken(), 52776u);
  EXPECT_EQ(q.RowOffset(1, 1, 2), q.LayerBytes() + q.PlaneBytes(0) + 1040 + 640);
  q.block_tokens = 64;
  EXPECT_EQ(q.BytesPerToken(), 44298u);
  q.block_tokens = 1;  // INT8 rows only
  EXPECT_EQ(q.BytesPerToken(), 36u * 2 * 1040);
  // SmolLM2-135M: 30 layers, 3 x 64.
  BlockLayout s = MakeLayout({3, 64, 2}, DType::kBF16, kHadamard, 30, 16);
  EXPECT_EQ(s.BytesPerToken(), 8258u);
}

}  // namespace
}  // namespace hiqcache::kernels
