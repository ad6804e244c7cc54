// The scalar reference executor against the independent float64 model of the record format:
// every input class, geometry, dtype and view shape; the elementwise error bounds (INT8, FP8
// E4M3, INT4 per group); non-finite rows; CODEC_RAW; and that decode writes exactly the requested
// rows.
#include "codec_reference.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "codec_test_util.h"

namespace hiqcache::kernels {
namespace {

using namespace testutil;  // NOLINT: test-only helpers

std::vector<Executor> ReferenceOnly() {
  return {{"reference", [](const EncodeJob& j) { EncodeBlocksReference(j); },
           [](const DecodeJob& j) { DecodeBlocksReference(j); }}};
}

void ExpectNoErrors(const std::vector<std::string>& errors) {
  for (size_t i = 0; i < errors.size() && i < 10; ++i) ADD_FAILURE() << errors[i];
  EXPECT_TRUE(errors.empty()) << errors.size() << " failures";
}

// Codes and scales equal the float64 quantizer's, decode equals rne(q * s), every element
// meets the bound, and nothing outside the requested rows is written: all input classes x
// geometries x dtypes, each view shape in turn.
TEST(CodecReference, MatchesFloat64ModelEverywhere) {
  BoundStats bound;
  std::vector<std::string> errors;
  uint64_t seed = 1;
  size_t vk = 0;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (const Geometry& g : TestGeometries()) {
      for (InputClass c : AllInputClasses()) {
        CaseSpec spec;
        spec.layout = MakeLayout(g, dtype);
        spec.input = c;
        spec.view = AllViewKinds()[vk++ % AllViewKinds().size()];
        spec.seed = seed++;
        if (g.heads * g.dim >= 4096) spec.num_blocks = 2;
        for (auto& e : RunCase(spec, ReferenceOnly(), &bound)) errors.push_back(e);
      }
    }
  }
  ExpectNoErrors(errors);
  EXPECT_EQ(bound.violations, 0u);
  EXPECT_GT(bound.elements, 1000000u);
  // Not vacuous: somewhere the error comes close to s / 2 (the grid class has exact ties).
  EXPECT_GT(bound.max_err_over_s, 0.4);
}

// The bound is tight enough to matter per input class, not only for the grid's ties.
TEST(CodecReference, BoundIsNotVacuousForGaussianInput) {
  BoundStats bound;
  CaseSpec spec;
  spec.layout = MakeLayout({8, 128, 2}, DType::kBF16);
  spec.input = InputClass::kGaussian;
  ExpectNoErrors(RunCase(spec, ReferenceOnly(), &bound));
  EXPECT_GT(bound.max_err_over_s, 0.4);
  EXPECT_LE(bound.max_err_over_s, 0.5 + 0x1.0p-8 + 0x1.0p-8 * 128);
}

TEST(CodecReference, AllZeroHeadsRestoreExactZeros) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const BlockLayout lay = MakeLayout({4, 64, 2}, dtype);
    KvPool src(lay, 32, ViewKind::kStrided, 3);
    src.Fill(InputClass::kZero, 3);  // +0 and -0
    Rng rng(3);
    const std::vector<uint32_t> rows = RandomRows(32, 2 * lay.block_tokens, rng);
    BlockSet blocks(lay, 2);
    uint8_t flags[2] = {9, 9};
    EncodeBlocksReference(MakeEncodeJob(src, rows, blocks, flags));
    EXPECT_EQ(flags[0], 0);
    EXPECT_EQ(flags[1], 0);
    KvPool out(lay, 32, ViewKind::kStrided, 3);
    out.FillBytes(0x77);
    DecodeBlocksReference(MakeDecodeJob(out, rows, blocks));
    int nonzero = 0;
    for (uint32_t l = 0; l < lay.num_layers; ++l) {
      for (uint32_t p = 0; p < 2; ++p) {
        for (uint32_t r : rows) {
          for (uint32_t h = 0; h < 4; ++h) {
            for (uint32_t i = 0; i < 64; ++i) nonzero += out.Head(l, p, r, h)[i] != 0;
          }
        }
      }
    }
    EXPECT_EQ(nonzero, 0) << DTypeName(dtype);
  }
}

TEST(CodecReference, RawRoundTripIsBitExact) {
  BoundStats bound;
  std::vector<std::string> errors;
  uint64_t seed = 100;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (ViewKind vk : AllViewKinds()) {
      CaseSpec spec;
      spec.layout = MakeLayout({2, 96, 2}, dtype, CodecKind::kRaw);
      spec.input = InputClass::kRowMix;
      spec.view = vk;
      spec.seed = seed++;
      for (auto& e : RunCase(spec, ReferenceOnly(), &bound)) errors.push_back(e);
    }
  }
  ExpectNoErrors(errors);
  EXPECT_EQ(bound.violations, 0u);
  EXPECT_GT(bound.elements, 0u);
}

// RAW stores NaN and Inf like any other bits: nothing is flagged and they restore unchanged.
TEST(CodecReference, RawKeepsNonfiniteBits) {
  const BlockLayout lay = MakeLayout({1, 576, 1}, DType::kBF16, CodecKind::kRaw);
  KvPool src(lay, 40, ViewKind::kPaged, 5);
  src.Fill(InputClass::kGaussian, 5);
  Rng rng(5);
  const std::vector<uint32_t> rows = RandomRows(40, 2 * lay.block_tokens, rng);
  src.Head(0, 0, rows[3], 0)[5] = 0x7FC1;
  src.Head(1, 0, rows[12], 0)[575] = 0xFF80;
  BlockSet blocks(lay, 2);
  uint8_t flags[2] = {7, 7};
  EncodeBlocksReference(MakeEncodeJob(src, rows, blocks, flags));
  EXPECT_EQ(flags[0], 0);
  EXPECT_EQ(flags[1], 0);
  KvPool out(lay, 40, ViewKind::kPaged, 5);
  DecodeBlocksReference(MakeDecodeJob(out, rows, blocks));
  EXPECT_EQ(out.Head(0, 0, rows[3], 0)[5], 0x7FC1);
  EXPECT_EQ(out.Head(1, 0, rows[12], 0)[575], 0xFF80);
  for (uint32_t l = 0; l < 2; ++l) {
    for (uint32_t r : rows) {
      EXPECT_EQ(std::memcmp(out.Head(l, 0, r, 0), src.Head(l, 0, r, 0), 576 * 2), 0);
    }
  }
}

std::vector<Plant> NonfinitePlants(const BlockLayout& lay, uint16_t bits) {
  const uint32_t d = lay.row.head_dim;
  const uint32_t last_plane = lay.kv_planes - 1;
  const uint32_t t = lay.block_tokens;
  return {
      {1, last_plane, 1 * t + 2, lay.row.num_heads - 1, 5, bits},  // block 1, vector part
      {0, 0, 3 * t + t - 1, 0, d - 1, bits},                       // block 3, last element
      {0, last_plane, 5 * t + 7, 0, 0, bits},                      // no block holds this row
  };
}

// NaN and Inf (both signs, quiet and signaling NaN) flag exactly the blocks holding them.
TEST(CodecReference, NonfiniteRowsFlagTheirBlocks) {
  std::vector<std::string> errors;
  uint64_t seed = 200;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const uint16_t inf = InfBits(dtype);
    const uint16_t values[] = {inf, static_cast<uint16_t>(0x8000u | inf),
                               static_cast<uint16_t>(inf | 0x1u),  // signaling NaN
                               static_cast<uint16_t>(0x8000u | inf | (inf >> 1 & ~inf))};
    for (const Geometry& g : {Geometry{2, 100, 2}, Geometry{1, 576, 1}, Geometry{8, 128, 2}}) {
      for (uint16_t v : values) {
        CaseSpec spec;
        spec.layout = MakeLayout(g, dtype);
        spec.num_blocks = 4;
        spec.seed = seed++;
        for (auto& e : RunNonfiniteCase(spec, NonfinitePlants(spec.layout, v), ReferenceOnly())) {
          errors.push_back(e);
        }
      }
    }
  }
  ExpectNoErrors(errors);
}

// ---------------------------------------------------------------------------------------------
// CODEC_FP8_E4M3_PER_HEAD.

TEST(CodecReference, Fp8RowsHaveInt8Size) {
  const BlockLayout fp8 = MakeLayout({8, 128, 2}, DType::kBF16, CodecKind::kFp8E4m3PerHead, 36);
  const BlockLayout int8 = MakeLayout({8, 128, 2}, DType::kBF16, CodecKind::kInt8PerHead, 36);
  EXPECT_EQ(fp8.row.RowBytes(), 1040u);
  EXPECT_EQ(fp8.BytesPerToken(), int8.BytesPerToken());
  EXPECT_EQ(fp8.BytesPerToken(), 74880u);
}

// Codes and scales equal the float64 model's, decode equals rne(e4m3(c) * s), every element
// meets the FP8 bound, nothing outside the requested rows is written: every input class (the
// e4m3 grid of exact ties included) x geometry x dtype, the view shape rotating.
TEST(CodecReference, Fp8MatchesFloat64ModelEverywhere) {
  BoundStats bound;
  std::vector<std::string> errors;
  uint64_t seed = 300;
  size_t vk = 0;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (const Geometry& g : TestGeometries()) {
      for (InputClass c : Fp8InputClasses()) {
        CaseSpec spec;
        spec.layout = MakeLayout(g, dtype, CodecKind::kFp8E4m3PerHead);
        spec.input = c;
        spec.view = AllViewKinds()[vk++ % AllViewKinds().size()];
        spec.seed = seed++;
        if (g.heads * g.dim >= 4096) spec.num_blocks = 2;
        for (auto& e : RunCase(spec, ReferenceOnly(), &bound)) errors.push_back(e);
      }
    }
  }
  ExpectNoErrors(errors);
  EXPECT_EQ(bound.violations, 0u);
  EXPECT_GT(bound.elements, 1000000u);
  EXPECT_GT(bound.max_err_over_bound, 0.9) << "the bound should be nearly reached";
}

// Zero heads restore bit-exact zeros, signs included (-0 stores code 0x80).
TEST(CodecReference, Fp8AllZeroHeadsRestoreExactZeros) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const BlockLayout lay = MakeLayout({4, 64, 2}, dtype, CodecKind::kFp8E4m3PerHead);
    KvPool src(lay, 32, ViewKind::kStrided, 3);
    src.Fill(InputClass::kZero, 3);  // +0 and -0
    Rng rng(3);
    const std::vector<uint32_t> rows = RandomRows(32, 2 * lay.block_tokens, rng);
    BlockSet blocks(lay, 2);
    uint8_t flags[2] = {9, 9};
    EncodeBlocksReference(MakeEncodeJob(src, rows, blocks, flags));
    EXPECT_EQ(flags[0], 0);
    EXPECT_EQ(flags[1], 0);
    KvPool out(lay, 32, ViewKind::kStrided, 3);
    out.FillBytes(0x77);
    DecodeBlocksReference(MakeDecodeJob(out, rows, blocks));
    int differ = 0, negative = 0;
    for (uint32_t l = 0; l < lay.num_layers; ++l) {
      for (uint32_t p = 0; p < 2; ++p) {
        for (uint32_t r : rows) {
          for (uint32_t h = 0; h < 4; ++h) {
            for (uint32_t i = 0; i < 64; ++i) {
              differ += out.Head(l, p, r, h)[i] != src.Head(l, p, r, h)[i];
              negative += src.Head(l, p, r, h)[i] == 0x8000u;
            }
          }
        }
      }
    }
    EXPECT_EQ(differ, 0) << DTypeName(dtype);
    EXPECT_GT(negative, 0) << DTypeName(dtype);
  }
}

// NaN and Inf flag exactly the FP8 blocks holding them, as for INT8.
TEST(CodecReference, Fp8NonfiniteRowsFlagTheirBlocks) {
  std::vector<std::string> errors;
  uint64_t seed = 400;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const uint16_t inf = InfBits(dtype);
    const uint16_t values[] = {inf, static_cast<uint16_t>(0x8000u | inf),
                               static_cast<uint16_t>(inf | 0x1u),
                               static_cast<uint16_t>(0x8000u | inf | (inf >> 1 & ~inf))};
    for (const Geometry& g : {Geometry{2, 100, 2}, Geometry{1, 576, 1}, Geometry{8, 128, 2}}) {
      for (uint16_t v : values) {
        CaseSpec spec;
        spec.layout = MakeLayout(g, dtype, CodecKind::kFp8E4m3PerHead);
        spec.num_blocks = 4;
        spec.seed = seed++;
        for (auto& e : RunNonfiniteCase(spec, NonfinitePlants(spec.layout, v), ReferenceOnly())) {
          errors.push_back(e);
        }
      }
    }
  }
  ExpectNoErrors(errors);
}

// ---------------------------------------------------------------------------------------------
// CODEC_INT4_G32_PER_HEAD.

TEST(CodecReference, Int4RowSizes) {
  const BlockLayout qwen = MakeLayout({8, 128, 2}, DType::kBF16, CodecKind::kInt4G32PerHead, 36);
  EXPECT_EQ(qwen.row.CodeBytes(), 512u);
  EXPECT_EQ(qwen.row.ScaleCount(), 32u);
  EXPECT_EQ(qwen.row.RowBytes(), 576u);
  EXPECT_EQ(qwen.BytesPerToken(), 41472u);  // BF16: 147,456 (3.56x)
  const BlockLayout smol = MakeLayout({3, 64, 2}, DType::kBF16, CodecKind::kInt4G32PerHead, 30);
  EXPECT_EQ(smol.row.RowBytes(), 108u);
  EXPECT_EQ(smol.BytesPerToken(), 6480u);
}

// Codes and scales equal the float64 model's, decode equals rne(q * s), every element meets
// the bound with its group's scale, nothing outside the requested rows is written: every input
// class (the per-group grid of exact ties included) x INT4 geometry x dtype, views rotating.
TEST(CodecReference, Int4MatchesFloat64ModelEverywhere) {
  BoundStats bound;
  std::vector<std::string> errors;
  uint64_t seed = 500;
  size_t vk = 0;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (const Geometry& g : Int4TestGeometries()) {
      for (InputClass c : Int4InputClasses()) {
        CaseSpec spec;
        spec.layout = MakeLayout(g, dtype, CodecKind::kInt4G32PerHead);
        spec.input = c;
        spec.view = AllViewKinds()[vk++ % AllViewKinds().size()];
        spec.seed = seed++;
        if (g.heads * g.dim >= 4096) spec.num_blocks = 2;
        for (auto& e : RunCase(spec, ReferenceOnly(), &bound)) errors.push_back(e);
      }
    }
  }
  ExpectNoErrors(errors);
  EXPECT_EQ(bound.violations, 0u);
  EXPECT_GT(bound.elements, 1000000u);
  EXPECT_GT(bound.max_err_over_s, 0.49) << "half a step should be reached (exact ties)";
  std::printf("  %llu elements, max err / s = %.4f, max err / bound = %.4f\n",
              static_cast<unsigned long long>(bound.elements), bound.max_err_over_s,
              bound.max_err_over_bound);
}

// The scale is per group: one outlier leaves the other groups of its head at their own scales
// (per head they would share the outlier's), so their error stays a fraction of their values.
TEST(CodecReference, Int4OutlierStaysInItsGroup) {
  RowFormat fmt;
  fmt.num_heads = 1;
  fmt.head_dim = 128;
  fmt.dtype = DType::kBF16;
  fmt.codec = CodecKind::kInt4G32PerHead;
  std::vector<uint16_t> x(128);
  Rng rng(9);
  for (uint32_t i = 0; i < 128; ++i) x[i] = DoubleToHalfBits(rng.Gaussian(), DType::kBF16);
  x[5] = DoubleToHalfBits(1000.0, DType::kBF16);
  StridedView view;
  view.base = reinterpret_cast<uint8_t*>(x.data());
  view.row_stride = 256;
  view.head_stride = 256;
  view.num_rows = 1;
  std::vector<uint8_t> rec(fmt.RowBytes());
  ASSERT_TRUE(EncodeRowReference(fmt, view, 0, rec.data()));
  std::vector<uint16_t> y(128);
  StridedView out = view;
  out.base = reinterpret_cast<uint8_t*>(y.data());
  DecodeRowReference(fmt, rec.data(), out, 0);
  EXPECT_EQ(ElementScale(fmt, rec.data(), 0, 0),
            ScaleValue(DoubleToHalfBits(1000.0 / 7, DType::kBF16)));
  for (uint32_t g = 1; g < 4; ++g) {
    double amax = 0, err = 0;
    for (uint32_t i = 32 * g; i < 32 * g + 32; ++i) {
      amax = std::max(amax, std::fabs(HalfBitsToDouble(x[i], DType::kBF16)));
      err = std::max(err, std::fabs(HalfBitsToDouble(y[i], DType::kBF16) -
                                    HalfBitsToDouble(x[i], DType::kBF16)));
    }
    EXPECT_LT(ElementScale(fmt, rec.data(), 0, 32 * g), amax / 6.9) << "group " << g;
    EXPECT_LT(err, 0.08 * amax) << "group " << g;
  }
}

// Zero groups restore exact zeros (as +0: a nibble has no -0) and cost nothing to their
// neighbours: a head half zero, half gaussian.
TEST(CodecReference, Int4AllZeroGroupsRestoreExactZeros) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const BlockLayout lay = MakeLayout({4, 64, 2}, dtype, CodecKind::kInt4G32PerHead);
    KvPool src(lay, 32, ViewKind::kStrided, 3);
    src.Fill(InputClass::kZero, 3);  // +0 and -0
    Rng rng(3);
    const std::vector<uint32_t> rows = RandomRows(32, 2 * lay.block_tokens, rng);
    BlockSet blocks(lay, 2);
    uint8_t flags[2] = {9, 9};
    EncodeBlocksReference(MakeEncodeJob(src, rows, blocks, flags));
    EXPECT_EQ(flags[0], 0);
    EXPECT_EQ(flags[1], 0);
    KvPool out(lay, 32, ViewKind::kStrided, 3);
    out.FillBytes(0x77);
    DecodeBlocksReference(MakeDecodeJob(out, rows, blocks));
    int nonzero = 0, negative = 0;
    for (uint32_t l = 0; l < lay.num_layers; ++l) {
      for (uint32_t p = 0; p < 2; ++p) {
        for (uint32_t r : rows) {
          for (uint32_t h = 0; h < 4; ++h) {
            for (uint32_t i = 0; i < 64; ++i) {
              nonzero += out.Head(l, p, r, h)[i] != 0;
              negative += src.Head(l, p, r, h)[i] == 0x8000u;
            }
          }
        }
      }
    }
    EXPECT_EQ(nonzero, 0) << DTypeName(dtype);
    EXPECT_GT(negative, 0) << DTypeName(dtype);
  }
}

// NaN and Inf flag exactly the INT4 blocks holding them, in any group.
TEST(CodecReference, Int4NonfiniteRowsFlagTheirBlocks) {
  std::vector<std::string> errors;
  uint64_t seed = 600;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const uint16_t inf = InfBits(dtype);
    const uint16_t values[] = {inf, static_cast<uint16_t>(0x8000u | inf),
                               static_cast<uint16_t>(inf | 0x1u),
                               static_cast<uint16_t>(0x8000u | inf | (inf >> 1 & ~inf))};
    for (const Geometry& g : {Geometry{2, 96, 2}, Geometry{1, 576, 1}, Geometry{8, 128, 2}}) {
      for (uint16_t v : values) {
        CaseSpec spec;
        spec.layout = MakeLayout(g, dtype, CodecKind::kInt4G32PerHead);
        spec.num_blocks = 4;
        spec.seed = seed++;
        for (auto& e : RunNonfiniteCase(spec, NonfinitePlants(spec.layout, v), ReferenceOnly())) {
          errors.push_back(e);
        }
      }
    }
  }
  ExpectNoErrors(errors);
}

// DecodeLayerReference writes layer `l` of the requested rows and nothing else.
TEST(CodecReference, DecodeLayerWritesOnlyThatLayer) {
  for (ViewKind vk : AllViewKinds()) {
    const BlockLayout lay = MakeLayout({3, 72, 2}, DType::kFP16, CodecKind::kInt8PerHead, 3);
    KvPool src(lay, 48, vk, 11);
    src.Fill(InputClass::kGaussian, 11);
    Rng rng(11);
    const std::vector<uint32_t> rows = RandomRows(48, 2 * lay.block_tokens, rng);
    BlockSet blocks(lay, 2);
    EncodeBlocksReference(MakeEncodeJob(src, rows, blocks, nullptr));
    KvPool out(lay, 48, vk, 11);
    out.FillBytes(0x5A);
    DecodeLayerReference(MakeDecodeJob(out, rows, blocks), 1);
    for (uint32_t l : {0u, 2u}) {
      EXPECT_EQ(out.buffer(l), std::vector<uint8_t>(out.buffer(l).size(), 0x5A))
          << ViewKindName(vk) << " layer " << l;
    }
    const std::vector<uint8_t> mask = out.AddressedMask(1, rows);
    size_t written = 0, stray = 0;
    for (size_t i = 0; i < mask.size(); ++i) {
      if (out.buffer(1)[i] != 0x5A) (mask[i] ? written : stray)++;
    }
    EXPECT_EQ(stray, 0u) << ViewKindName(vk);
    EXPECT_GT(written, 0u) << ViewKindName(vk);
  }
}

}  // namespace
}  // namespace hiqcache::kernels
