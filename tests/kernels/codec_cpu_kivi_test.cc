// CODEC_INT4_KIVI on the scalar reference and the SIMD CPU executor (codec_cpu_kivi.cc for the K
// planes, codec_cpu_int4.cc for the V rows): byte for byte against a model written from
// kernels/README.md for every input class, geometry, dtype, view shape and block size (1 to 64
// tokens), with the elementwise bound checked on every restored element; every code byte's
// decode; NaN and Inf flag exactly their blocks; every Highway target this machine runs.
#include "codec_cpu_kivi.h"

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

constexpr CodecKind kKivi = CodecKind::kInt4Kivi;

// The V rows' format: INT4 grouped rows.
RowFormat VRowFormat(const RowFormat& fmt) {
  RowFormat v = fmt;
  v.codec = CodecKind::kInt4G32PerHead;
  return v;
}

// Model of a K plane: per channel lo, hi; z = lo (+0 for a zero); s = bf16_rne(fp32(0.5 hi -
// 0.5 lo) floored at 2^-112, / 7.5 in fp32); q = clamp(rne(2 * fp32((0.5 x - 0.5 z) / s)), 0, 15).
// False (dst untouched past what it wrote) when an element is NaN or Inf.
bool ModelEncodeKPlane(const KvPool& pool, uint32_t layer, const uint32_t* rows, uint32_t n,
                       uint8_t* dst) {
  const RowFormat& fmt = pool.row_format();
  const uint32_t d = fmt.head_dim;
  const size_t channels = fmt.ElementsPerRow();
  uint8_t* zeros = dst + n * channels / 2;
  uint8_t* scales = zeros + 2 * channels;
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    for (uint32_t i = 0; i < d; ++i) {
      const size_t c = static_cast<size_t>(h) * d + i;
      double lo = INFINITY;
      double hi = -INFINITY;
      for (uint32_t t = 0; t < n; ++t) {
        const uint16_t b = pool.Head(layer, 0, rows[t], h)[i];
        if (!HalfBitsFinite(b, fmt.dtype)) return false;
        const double x = HalfBitsToDouble(b, fmt.dtype);
        lo = std::min(lo, x);
        hi = std::max(hi, x);
      }
      if (lo == 0.0) lo = 0.0;  // +0
      const uint16_t zb = DoubleToHalfBits(lo, fmt.dtype);
      float r = 0.5f * static_cast<float>(hi) - 0.5f * static_cast<float>(lo);
      if (r < 0x1.0p-112f) r = 0x1.0p-112f;
      const uint16_t sb = DoubleToHalfBits(static_cast<double>(r / 7.5f), DType::kBF16);
      const double s = HalfBitsToDouble(sb, DType::kBF16);
      for (uint32_t t = 0; t < n; ++t) {
        const double x = HalfBitsToDouble(pool.Head(layer, 0, rows[t], h)[i], fmt.dtype);
        // The difference and the quotient in fp32, as the format computes them (x - z needs more
        // than 24 bits where the channel mixes binades far apart).
        const float xf = static_cast<float>(x);
        const float zf = static_cast<float>(lo);
        const float quot = (0.5f * xf - 0.5f * zf) / static_cast<float>(s);
        const double q = std::min(15.0, std::max(0.0, std::nearbyint(2.0 * quot)));
        uint8_t& byte = dst[t * channels / 2 + c / 2];
        const uint8_t nib = static_cast<uint8_t>(q);
        byte = (c % 2 == 0) ? static_cast<uint8_t>((byte & 0xF0u) | nib)
                            : static_cast<uint8_t>((byte & 0x0Fu) | (nib << 4));
      }
      StoreU16(zeros + 2 * c, zb);
      StoreU16(scales + 2 * c, sb);
    }
  }
  return true;
}

// Model decode of K element c of token t: y = fp32(q * s + z), then the output dtype's rne.
uint16_t ModelDecodeK(const RowFormat& fmt, const uint8_t* plane, uint32_t block_tokens, uint32_t t,
                      size_t c, double* s_out) {
  const size_t channels = fmt.ElementsPerRow();
  const uint8_t byte = plane[t * channels / 2 + c / 2];
  const int q = (c % 2 == 0) ? (byte & 0xF) : (byte >> 4);
  const uint8_t* zeros = plane + block_tokens * channels / 2;
  const double z = HalfBitsToDouble(LoadU16(zeros + 2 * c), fmt.dtype);
  const double s = HalfBitsToDouble(LoadU16(zeros + 2 * channels + 2 * c), DType::kBF16);
  *s_out = s;
  const float y = static_cast<float>(q * s + z);
  return DoubleToHalfBits(static_cast<double>(y), fmt.dtype);
}

// |x^ - x| <= (0.5 + 2^-8) s + (u + 2^-22) |x^| (+ 2^-25 for an fp16 subnormal x^).
double KiviKBound(double s, double xhat, DType out) {
  const double u = out == DType::kBF16 ? 0x1.0p-8 : 0x1.0p-11;
  double b = (0.5 + 0x1.0p-8) * s + (u + 0x1.0p-22) * std::fabs(xhat);
  if (out == DType::kFP16 && std::fabs(xhat) <= 0x1.0p-14) b += 0x1.0p-25;
  return b;
}

using KiviCase = PlaneCodecCase;

// The model's payloads and flags.
void ModelEncode(const KvPool& pool, const std::vector<uint32_t>& rows, BlockSet* out,
                 std::vector<uint8_t>* flags) {
  const BlockLayout& lay = pool.layout();
  const RowFormat v = VRowFormat(lay.row);
  flags->assign(out->size(), 0);
  for (uint32_t b = 0; b < out->size(); ++b) {
    const uint32_t* br = rows.data() + static_cast<size_t>(b) * lay.block_tokens;
    for (uint32_t l = 0; l < lay.num_layers; ++l) {
      if (!ModelEncodeKPlane(pool, l, br, lay.block_tokens,
                             (*out)[b].data() + lay.PlaneOffset(l, 0))) {
        (*flags)[b] = 1;
      }
      for (uint32_t p = 1; p < lay.kv_planes; ++p) {
        for (uint32_t t = 0; t < lay.block_tokens; ++t) {
          if (!ModelEncodeRow(v, pool.HeadPtrs(l, p, br[t]).data(),
                              (*out)[b].data() + lay.RowOffset(l, p, t))) {
            (*flags)[b] = 1;
          }
        }
      }
    }
  }
}

// Runs one case on every executor: payload bytes and flags equal the model's; decoded pools
// equal the model's decode, byte for byte; every restored element within its bound.
std::vector<std::string> RunKiviCase(const KiviCase& kc, const std::vector<Executor>& execs,
                                     BoundStats* bound) {
  const BlockLayout lay = MakeLayout(kc.g, kc.dtype, kKivi, 2, kc.block_tokens);
  const uint32_t blocks = 3;
  const uint32_t num_rows = blocks * kc.block_tokens + 5;
  KvPool in(lay, num_rows, kc.view, kc.seed);
  in.Fill(kc.cls, kc.seed);
  Rng rng(kc.seed);
  const std::vector<uint32_t> rows = RandomRows(num_rows, size_t{blocks} * kc.block_tokens, rng);
  BlockSet model(lay, blocks);
  std::vector<uint8_t> model_flags;
  ModelEncode(in, rows, &model, &model_flags);
  // The model's decode: K from the model's formula, V through the INT4 row model.
  KvPool expect(lay, num_rows, kc.view, kc.seed);
  expect.FillBytes(0xEE);
  const RowFormat v = VRowFormat(lay.row);
  for (uint32_t b = 0; b < blocks; ++b) {
    if (model_flags[b]) continue;
    for (uint32_t l = 0; l < lay.num_layers; ++l) {
      const uint8_t* plane = model[b].data() + lay.PlaneOffset(l, 0);
      for (uint32_t t = 0; t < lay.block_tokens; ++t) {
        const uint32_t r = rows[size_t{b} * lay.block_tokens + t];
        for (uint32_t h = 0; h < lay.row.num_heads; ++h) {
          for (uint32_t i = 0; i < lay.row.head_dim; ++i) {
            double s = 0;
            const uint16_t y = ModelDecodeK(lay.row, plane, lay.block_tokens, t,
                                            size_t{h} * lay.row.head_dim + i, &s);
            expect.Head(l, 0, r, h)[i] = y;
            const double x = HalfBitsToDouble(in.Head(l, 0, r, h)[i], lay.row.dtype);
            const double xh = HalfBitsToDouble(y, lay.row.dtype);
            const double err = std::fabs(xh - x);
            const double bnd = KiviKBound(s, xh, lay.row.dtype);
            ++bound->elements;
            bound->max_err_over_s = std::max(bound->max_err_over_s, err / s);
            bound->max_err_over_bound = std::max(bound->max_err_over_bound, err / bnd);
            if (!(err <= bnd) && bound->violations++ == 0) {
              char buf[200];
              std::snprintf(buf, sizeof(buf), "K x=%a x^=%a s=%a err=%a bound=%a", x, xh, s, err,
                            bnd);
              bound->first_violation = Name(kc) + ": " + buf;
            }
          }
        }
        for (uint32_t p = 1; p < lay.kv_planes; ++p) {
          ModelDecodeRow(v, model[b].data() + lay.RowOffset(l, p, t),
                         expect.HeadPtrs(l, p, r).data());
          CheckRowBound(v, in.HeadPtrs(l, p, r).data(), expect.HeadPtrs(l, p, r).data(),
                        model[b].data() + lay.RowOffset(l, p, t), bound);
        }
      }
    }
  }
  return CompareExecutorsWithModel(Name(kc), in, rows, model, model_flags, expect, kc.seed, execs);
}

std::vector<Geometry> KiviGeometries() {
  return {{8, 128, 2}, {3, 64, 2}, {2, 32, 2}, {1, 576, 1}, {2, 96, 2}, {5, 160, 2}};
}

std::vector<InputClass> KiviClasses() {
  std::vector<InputClass> c = AllInputClasses();
  c.push_back(InputClass::kInt4Grid);
  return c;
}

std::vector<Executor> Executors() {
  std::vector<Executor> ex = SimdExecutors({1u, 3u});
  ex.erase(ex.begin());  // simd_rows: row by row, no K planes
  ex.push_back(ReferenceExecutor());
  return ex;
}

TEST(CodecKivi, MatchesModelEverywhere) {
  BoundStats bound;
  std::vector<std::string> errors;
  const std::vector<Executor> execs = Executors();
  uint64_t seed = 23000;
  for (const Geometry& g : KiviGeometries()) {
    for (DType dt : {DType::kBF16, DType::kFP16}) {
      for (uint32_t bt : {1u, 3u, 16u}) {
        for (InputClass c : KiviClasses()) {
          auto e = RunKiviCase({g, dt, bt, c, ViewKind::kContiguous, ++seed}, execs, &bound);
          errors.insert(errors.end(), e.begin(), e.end());
        }
      }
    }
  }
  ExpectNoErrors(errors);
  EXPECT_EQ(bound.violations, 0u) << bound.first_violation;
  EXPECT_GT(bound.max_err_over_s, 0.49);
  std::printf("  %llu elements checked, max err / s = %.4f, max err / bound = %.4f (target %s)\n",
              static_cast<unsigned long long>(bound.elements), bound.max_err_over_s,
              bound.max_err_over_bound, CpuCodec::TargetName());
}

// Every view shape with both dtypes, larger and odd block sizes.
TEST(CodecKivi, EveryViewShapeAndBlockSize) {
  BoundStats bound;
  std::vector<std::string> errors;
  const std::vector<Executor> execs = Executors();
  uint64_t seed = 24000;
  for (ViewKind vk : AllViewKinds()) {
    for (DType dt : {DType::kBF16, DType::kFP16}) {
      for (uint32_t bt : {2u, 17u, 64u}) {
        auto e = RunKiviCase({{3, 64, 2}, dt, bt, InputClass::kRowMix, vk, ++seed}, execs, &bound);
        errors.insert(errors.end(), e.begin(), e.end());
      }
    }
  }
  ExpectNoErrors(errors);
  EXPECT_EQ(bound.violations, 0u) << bound.first_violation;
}

// NaN and +-Inf anywhere in a K plane or a V row flag exactly their block; nothing else.
TEST(CodecKivi, NonfiniteFlagsTheirBlock) {
  const std::vector<Executor> execs = Executors();
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    const uint16_t inf = dt == DType::kBF16 ? 0x7F80 : 0x7C00;
    for (uint16_t bits :
         {inf, static_cast<uint16_t>(inf | 0x8000), static_cast<uint16_t>(inf | 1)}) {
      for (uint32_t plane : {0u, 1u}) ExpectPlantedBlockFlagged(kKivi, dt, plane, 5, bits, execs);
    }
  }
}

// Every code byte at many channel scales and zero points: the SIMD decode writes the
// reference's bits.
TEST(CodecKivi, EveryCodeDecodesLikeTheReference) {
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    RowFormat fmt{2, 64, dt, kKivi};
    const uint32_t bt = 256;  // every byte value in every code position
    const size_t channels = fmt.ElementsPerRow();
    std::vector<uint8_t> plane(bt * channels / 2 + 4 * channels);
    Rng rng(31);
    for (uint32_t t = 0; t < bt; ++t) {
      for (size_t j = 0; j < channels / 2; ++j)
        plane[t * channels / 2 + j] = static_cast<uint8_t>(t + j);
    }
    uint8_t* zeros = plane.data() + bt * channels / 2;
    uint8_t* scales = zeros + 2 * channels;
    for (size_t c = 0; c < channels; ++c) {
      const double z = (rng.Uniform() - 0.5) * std::ldexp(1.0, rng.Range(-20, 10));
      StoreU16(zeros + 2 * c, DoubleToHalfBits(z, dt));
      StoreU16(scales + 2 * c,
               DoubleToHalfBits(std::ldexp(1.0 + rng.Uniform(), rng.Range(-24, 8)), DType::kBF16));
    }
    std::vector<uint8_t> a(bt * channels * 2), b(bt * channels * 2, 0x11);
    std::vector<uint32_t> rows(bt);
    for (uint32_t t = 0; t < bt; ++t) rows[t] = t;
    const StridedView view{a.data(), channels * 2, 128, 0, 0, bt};
    const StridedView view_b{b.data(), channels * 2, 128, 0, 0, bt};
    DecodeKiviKRowsReference(fmt, plane.data(), bt, 0, bt, view, rows.data());
    DecodeKiviKRowsSimd(fmt, plane.data(), bt, 0, bt, view_b, rows.data());
    EXPECT_EQ(a, b) << DTypeName(dt);
  }
}

// Every Highway target compiled in and supported here, selected in turn.
TEST(CodecKivi, EveryHighwayTarget) {
  ExpectNoErrorsOnEveryHighwayTarget([](int64_t /*target*/) {
    BoundStats bound;
    std::vector<std::string> errors;
    const std::vector<Executor> execs = {Executors()[0]};
    uint64_t seed = 25000;
    for (DType dt : {DType::kBF16, DType::kFP16}) {
      for (InputClass c : {InputClass::kRowMix, InputClass::kTiny, InputClass::kHuge}) {
        auto e = RunKiviCase({{2, 96, 2}, dt, 5, c, ViewKind::kStrided, ++seed}, execs, &bound);
        errors.insert(errors.end(), e.begin(), e.end());
      }
    }
    return errors;
  });
}

TEST(CodecKivi, RecordSizes) {
  // Qwen3-8B: 36 layers, 8 x 128, per token 36 * (512 + 576) plus 36 * 4,096 / block_tokens.
  BlockLayout q = MakeLayout({8, 128, 2}, DType::kBF16, kKivi, 36, 16);
  EXPECT_EQ(q.PlaneBytes(0), 16u * 512 + 4096);
  EXPECT_EQ(q.PlaneBytes(1), 16u * 576);
  EXPECT_EQ(q.BytesPerToken(), 48384u);
  q.block_tokens = 64;
  EXPECT_EQ(q.BytesPerToken(), 41472u);
  // SmolLM2-135M: 30 layers, 3 x 64.
  BlockLayout s = MakeLayout({3, 64, 2}, DType::kBF16, kKivi, 30, 16);
  EXPECT_EQ(s.BytesPerToken(), 7560u);
}

}  // namespace
}  // namespace hiqcache::kernels
