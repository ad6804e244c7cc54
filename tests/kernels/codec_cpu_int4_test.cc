// The SIMD CPU executor's CODEC_INT4_G32_PER_HEAD rows (codec_cpu_int4.cc, reached through
// codec_cpu.h's entry points): the float64 model's and the scalar reference's bytes for every
// input class, INT4 geometry, dtype and view shape, on every Highway target this machine runs;
// every value of the dtype at many group scales (ties, the clamp's neighbourhood); every
// nibble's decode; the INT4 error bound; non-finite flags; any thread count.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "codec_cpu.h"
#include "codec_reference.h"
#include "codec_test_util.h"

namespace hiqcache::kernels {
namespace {

using namespace testutil;  // NOLINT: test-only helpers

constexpr CodecKind kInt4 = CodecKind::kInt4G32PerHead;

void ExpectNoErrors(const std::vector<std::string>& errors) {
  for (size_t i = 0; i < errors.size() && i < 10; ++i) ADD_FAILURE() << errors[i];
  EXPECT_TRUE(errors.empty()) << errors.size() << " failures";
}

TEST(CodecCpuInt4, MatchesFloat64ModelEverywhere) {
  BoundStats bound;
  std::vector<std::string> errors;
  const std::vector<Executor> execs = SimdExecutors({1u, 3u});
  uint64_t seed = 17000;
  size_t vk = 0;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (const Geometry& g : Int4TestGeometries()) {
      for (InputClass c : Int4InputClasses()) {
        CaseSpec spec;
        spec.layout = MakeLayout(g, dtype, kInt4);
        spec.input = c;
        spec.view = AllViewKinds()[vk++ % AllViewKinds().size()];
        spec.seed = seed++;
        if (g.heads * g.dim >= 4096) spec.num_blocks = 2;
        for (auto& e : RunCase(spec, execs, &bound)) errors.push_back(e);
      }
    }
  }
  ExpectNoErrors(errors);
  EXPECT_EQ(bound.violations, 0u);
  EXPECT_GT(bound.max_err_over_s, 0.49);
  std::printf("  %llu elements checked, max err / s = %.4f, max err / bound = %.4f (target %s)\n",
              static_cast<unsigned long long>(bound.elements), bound.max_err_over_s,
              bound.max_err_over_bound, CpuCodec::TargetName());
}

// Every view shape with both dtypes for the engine geometry, odd block sizes.
TEST(CodecCpuInt4, EveryViewShape) {
  BoundStats bound;
  std::vector<std::string> errors;
  std::vector<Executor> execs = SimdExecutors({1u, 3u});
  execs.push_back(ReferenceExecutor());
  uint64_t seed = 17500;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (ViewKind vk : AllViewKinds()) {
      for (uint32_t tokens : {1u, 5u, 16u}) {
        CaseSpec spec;
        spec.layout = MakeLayout({8, 128, 2}, dtype, kInt4, 2, tokens);
        spec.input = InputClass::kRowMix;
        spec.view = vk;
        spec.seed = seed++;
        spec.num_blocks = 4;
        for (auto& e : RunCase(spec, execs, &bound)) errors.push_back(e);
      }
    }
  }
  ExpectNoErrors(errors);
  EXPECT_EQ(bound.violations, 0u);
}

// Groups holding every finite value of the dtype up to their amax (both signs) for many scales:
// amaxes 7 * m * 2^e (quotients land on ties), amaxes whose scale rounds down (quotients just
// above 7) and random ones. The vector quotient, rounding and packing must match the model.
TEST(CodecCpuInt4, EveryValueAtManyScales) {
  Rng rng(79);
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const uint16_t max_bits = FormatOf(dtype).max_bits;
    std::vector<double> amaxes = {0.0, MaxFinite(dtype)};
    for (int e = -8; e <= 6; ++e) {
      for (int m : {1, 3, 5, 7}) amaxes.push_back(7.0 * m * std::ldexp(1.0, e));  // s = m*2^e
    }
    std::vector<uint16_t> amax_bits;
    for (double a : amaxes) amax_bits.push_back(DoubleToHalfBits(a, dtype));
    for (int i = 0; i < 24; ++i) amax_bits.push_back(static_cast<uint16_t>(rng.Below(max_bits)));
    int rounding_down = 0;
    for (uint32_t a = 1; a < max_bits && rounding_down < 8; a += 97) {
      const double s = ScaleValue(DoubleToHalfBits(HalfBitsToDouble(a, dtype) / 7.0, DType::kBF16));
      if (HalfBitsToDouble(a, dtype) / s > 7.0) {
        amax_bits.push_back(static_cast<uint16_t>(a));
        ++rounding_down;
      }
    }
    EXPECT_EQ(rounding_down, 8);

    RowFormat fmt;
    fmt.num_heads = 8;
    fmt.head_dim = 128;
    fmt.dtype = dtype;
    fmt.codec = kInt4;
    std::vector<uint16_t> row(fmt.ElementsPerRow()), out(fmt.ElementsPerRow());
    std::vector<uint8_t> got(fmt.RowBytes()), want(fmt.RowBytes());
    StridedView view;
    view.base = reinterpret_cast<uint8_t*>(row.data());
    view.row_stride = fmt.InputRowBytes();
    view.head_stride = fmt.head_dim * 2;
    view.num_rows = 1;
    StridedView out_view = view;
    out_view.base = reinterpret_cast<uint8_t*>(out.data());
    std::vector<uint16_t> want_out(fmt.ElementsPerRow());
    uint64_t rows_checked = 0;
    int mismatches = 0;
    for (uint16_t a : amax_bits) {
      uint32_t next = 0;
      while (next <= a) {
        // Every group of the row: its amax first, then the next values up to it.
        for (size_t i = 0; i < row.size(); ++i) {
          if (i % 32 == 0) {
            row[i] = a;
            continue;
          }
          const uint32_t v = next <= a ? next++ : 0;
          row[i] = static_cast<uint16_t>(v | ((i & 1) ? 0x8000u : 0u));
        }
        ASSERT_TRUE(EncodeRowSimd(fmt, view, 0, got.data()));
        const uint8_t* heads[8];
        uint8_t* out_heads[8];
        for (uint32_t h = 0; h < 8; ++h) {
          heads[h] = view.base + h * view.head_stride;
          out_heads[h] = reinterpret_cast<uint8_t*>(want_out.data()) + h * view.head_stride;
        }
        ASSERT_TRUE(ModelEncodeRow(fmt, heads, want.data()));
        DecodeRowSimd(fmt, got.data(), out_view, 0);
        ModelDecodeRow(fmt, want.data(), out_heads);
        ++rows_checked;
        if ((got != want || out != want_out) && mismatches++ < 5) {
          size_t off = 0;
          while (off < got.size() && got[off] == want[off]) ++off;
          ADD_FAILURE() << DTypeName(dtype) << " amax 0x" << std::hex << a << ": byte " << std::dec
                        << off << (off < got.size() ? "" : " (decode differs)");
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << DTypeName(dtype);
    EXPECT_GT(rows_checked, 1000u);
  }
}

// Every byte value (so every nibble pair, 0x8 included) at many scales, per group: the SIMD
// decode writes the reference's bits.
TEST(CodecCpuInt4, EveryNibbleDecodesLikeTheReference) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (uint32_t dim : {128u, 32u, 96u}) {
      RowFormat fmt;
      fmt.num_heads = 4;
      fmt.head_dim = dim;
      fmt.dtype = dtype;
      fmt.codec = kInt4;
      std::vector<uint8_t> rec(fmt.RowBytes());
      std::vector<uint16_t> got(fmt.ElementsPerRow()), want(fmt.ElementsPerRow());
      StridedView gv;
      gv.base = reinterpret_cast<uint8_t*>(got.data());
      gv.row_stride = fmt.InputRowBytes();
      gv.head_stride = dim * 2;
      gv.num_rows = 1;
      StridedView wv = gv;
      wv.base = reinterpret_cast<uint8_t*>(want.data());
      int mismatches = 0;
      for (uint32_t sb = 0x0080; sb <= 0x7F7F; sb += 37) {
        for (uint32_t first = 0; first < 256; first += static_cast<uint32_t>(fmt.CodeBytes())) {
          for (size_t i = 0; i < fmt.CodeBytes(); ++i) rec[i] = static_cast<uint8_t>(first + i);
          for (size_t g = 0; g < fmt.ScaleCount(); ++g) {
            const uint16_t s = static_cast<uint16_t>(g % 2 ? 0x7F7F + 0x0080 - sb : sb);
            std::memcpy(rec.data() + fmt.CodeBytes() + 2 * g, &s, 2);
          }
          DecodeRowSimd(fmt, rec.data(), gv, 0);
          DecodeRowReference(fmt, rec.data(), wv, 0);
          if (got != want && mismatches++ < 5) {
            ADD_FAILURE() << DTypeName(dtype) << " dim " << dim << " scale 0x" << std::hex << sb;
          }
        }
      }
      EXPECT_EQ(mismatches, 0) << DTypeName(dtype) << " dim " << dim;
    }
  }
}

TEST(CodecCpuInt4, SameBytesAsReferenceForAnyThreadCount) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const BlockLayout lay = MakeLayout({8, 128, 2}, dtype, kInt4, 3, 64);
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
      CpuCodec codec(threads);
      BlockSet got(lay, 5);
      std::vector<uint8_t> flags(5, 0xEE);
      codec.Encode(MakeEncodeJob(src, rows, got, flags.data()));
      EXPECT_TRUE(got == ref) << DTypeName(dtype) << " " << threads << " threads";
      EXPECT_EQ(flags, std::vector<uint8_t>(5, 0));
      KvPool out(lay, 512, ViewKind::kPaged, 5);
      out.FillBytes(0x3C);
      codec.Decode(MakeDecodeJob(out, rows, got));
      for (uint32_t l = 0; l < lay.num_layers; ++l) {
        EXPECT_TRUE(out.buffer(l) == ref_out.buffer(l))
            << DTypeName(dtype) << " " << threads << " threads, layer " << l;
      }
    }
  }
}

// NaN and +-Inf in the first or the last group flag exactly their blocks.
TEST(CodecCpuInt4, NonfiniteRowsFlagTheirBlocks) {
  std::vector<std::string> errors;
  std::vector<Executor> execs = SimdExecutors({1u, 3u});
  execs.push_back(ReferenceExecutor());
  uint64_t seed = 18000;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const uint16_t inf = InfBits(dtype);
    const uint16_t quiet = static_cast<uint16_t>(inf | (inf >> 1 & ~inf));
    const uint16_t values[] = {inf, static_cast<uint16_t>(0x8000u | inf), quiet,
                               static_cast<uint16_t>(inf | 1u)};
    for (const Geometry& g : {Geometry{2, 96, 2}, Geometry{1, 576, 1}, Geometry{1, 32, 1}}) {
      for (uint32_t elem : {3u, g.dim - 1}) {
        for (uint16_t v : values) {
          CaseSpec spec;
          spec.layout = MakeLayout(g, dtype, kInt4);
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
  ExpectNoErrors(errors);
}

// Every Highway target compiled in and supported here, selected in turn.
TEST(CodecCpuInt4, EveryHighwayTarget) {
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  std::vector<std::string> errors;
  std::string names;
  for (int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    names += std::string(hwy::TargetName(target)) + " ";
    const std::vector<Executor> execs = {SimdExecutors({1u, 3u})[0],
                                         SimdExecutors({1u, 3u})[1]};
    BoundStats bound;
    uint64_t seed = 19000;
    for (DType dtype : {DType::kBF16, DType::kFP16}) {
      for (const Geometry& g : Int4TestGeometries()) {
        for (InputClass c :
             {InputClass::kRowMix, InputClass::kInt4Grid, InputClass::kTiny, InputClass::kHuge}) {
          CaseSpec spec;
          spec.layout = MakeLayout(g, dtype, kInt4, 1, 4);
          spec.input = c;
          spec.view = AllViewKinds()[seed % 4];
          spec.seed = seed++;
          spec.num_blocks = 2;
          for (auto& e : RunCase(spec, execs, &bound)) {
            errors.push_back(std::string(hwy::TargetName(target)) + ": " + e);
          }
        }
      }
      CaseSpec spec;
      spec.layout = MakeLayout({2, 96, 2}, dtype, kInt4);
      spec.num_blocks = 4;
      spec.seed = seed++;
      for (auto& e : RunNonfiniteCase(
               spec, NonfinitePlants(spec.layout, static_cast<uint16_t>(InfBits(dtype) | 1u), 95),
               execs)) {
        errors.push_back(std::string(hwy::TargetName(target)) + ": " + e);
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);
  ExpectNoErrors(errors);
  std::printf("  targets: %s\n", names.c_str());
}

}  // namespace
}  // namespace hiqcache::kernels
