// The SIMD CPU executor (single rows and CpuCodec with several thread counts) against the
// float64 model and the scalar reference: same bytes for every input class, geometry, dtype and
// view shape, on every Highway target this machine can run; the error bound; non-finite
// flags (vector part and scalar tail); CODEC_RAW; decode writes exactly the requested rows.
#include "codec_cpu.h"

#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "codec_cpu_test_util.h"
#include "codec_reference.h"
#include "codec_test_util.h"

namespace hiqcache::kernels {
namespace {

using namespace testutil;  // NOLINT: test-only helpers

// Every input class x geometry x dtype (the view shape rotates), all executors.
TEST(CodecCpu, MatchesFloat64ModelEverywhere) {
  BoundStats bound;
  const std::vector<std::string> errors =
      RunEveryInputClass(CodecKind::kInt8PerHead, TestGeometries(), AllInputClasses(), 1000,
                         SimdExecutors({1u, 2u, 3u}), &bound);
  ExpectNoErrors(errors);
  EXPECT_EQ(bound.violations, 0u);
  EXPECT_GT(bound.max_err_over_s, 0.4);
  std::printf("  %llu elements checked, max |x^ - x| / s = %.4f (target %s)\n",
              static_cast<unsigned long long>(bound.elements), bound.max_err_over_s,
              CpuCodec::TargetName());
}

// Every view shape with every dtype for the engine geometry, and odd block sizes.
TEST(CodecCpu, EveryViewShape) {
  BoundStats bound;
  const std::vector<std::string> errors =
      RunEveryViewShape(CodecKind::kInt8PerHead, 2000, SimdExecutors({1u, 2u, 3u}), &bound);
  ExpectNoErrors(errors);
  EXPECT_EQ(bound.violations, 0u);
}

// Explicit shapes: K and V of a token interleaved in one row ([slots][K|V][heads][dim]), and
// heads further apart than their rows (head-major [heads][slots][dim]).
TEST(CodecCpu, ExplicitShapes) {
  BoundStats bound;
  std::vector<std::string> errors;
  std::vector<Executor> execs = SimdExecutors({1u, 2u, 3u});
  execs.push_back({"reference", [](const EncodeJob& j) { EncodeBlocksReference(j); },
                   [](const DecodeJob& j) { DecodeBlocksReference(j); }});
  uint64_t seed = 2500;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (const Geometry& g : {Geometry{8, 128, 2}, Geometry{3, 72, 2}}) {
      const uint64_t head_bytes = uint64_t{g.dim} * 2;
      KvPool::Shape interleaved;
      interleaved.head_stride = head_bytes;
      interleaved.plane_offset = g.heads * head_bytes;
      interleaved.row_stride = 2 * g.heads * head_bytes;
      KvPool::Shape head_major;
      head_major.row_stride = head_bytes;
      head_major.head_stride = 64 * head_bytes;  // pool_rows slots per head
      head_major.plane_offset = g.heads * head_major.head_stride;
      for (const KvPool::Shape& shape : {interleaved, head_major}) {
        CaseSpec spec;
        spec.layout = MakeLayout(g, dtype);
        spec.input = InputClass::kRowMix;
        spec.shape = shape;
        spec.seed = seed++;
        for (auto& e : RunCase(spec, execs, &bound)) errors.push_back(e);
      }
    }
  }
  ExpectNoErrors(errors);
  EXPECT_EQ(bound.violations, 0u);
  EXPECT_GT(bound.elements, 0u);
}

// Heads holding every finite value of the dtype up to amax (both signs) for many scales,
// including scales where half the values are exact ties x / s = k + 1/2: the quotient of the
// vector path must round exactly like the float64 one.
TEST(CodecCpu, EveryValueAtManyScales) {
  Rng rng(77);
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const uint16_t max_bits = FormatOf(dtype).max_bits;
    std::vector<double> amaxes = {0.0, MaxFinite(dtype)};
    for (int e = -8; e <= 8; ++e) {
      for (int m : {1, 3, 5, 7}) amaxes.push_back(127.0 * m * std::ldexp(1.0, e));  // s = m*2^e
    }
    std::vector<uint16_t> amax_bits;
    for (double a : amaxes) amax_bits.push_back(DoubleToHalfBits(a, dtype));
    for (int i = 0; i < 24; ++i) amax_bits.push_back(static_cast<uint16_t>(rng.Below(max_bits)));

    RowFormat fmt;
    fmt.num_heads = 8;
    fmt.head_dim = 128;
    fmt.dtype = dtype;
    std::vector<uint16_t> row(fmt.ElementsPerRow());
    std::vector<uint8_t> got(fmt.RowBytes()), want(fmt.RowBytes());
    const StridedView view = OneRowView(fmt, row.data());
    uint64_t rows_checked = 0;
    int mismatches = 0;
    for (uint16_t a : amax_bits) {
      // Values 0..a, alternating signs, 127 per head after the amax element.
      uint32_t next = 0;
      while (next <= a) {
        for (uint32_t h = 0; h < fmt.num_heads; ++h) {
          uint16_t* x = row.data() + h * fmt.head_dim;
          x[0] = a;
          for (uint32_t i = 1; i < fmt.head_dim; ++i) {
            const uint32_t v = next <= a ? next++ : 0;
            x[i] = static_cast<uint16_t>(v | ((i & 1) ? 0x8000u : 0u));
          }
        }
        ASSERT_TRUE(EncodeRowSimd(fmt, view, 0, got.data()));
        const uint8_t* heads[8];
        for (uint32_t h = 0; h < 8; ++h) heads[h] = view.base + h * view.head_stride;
        ASSERT_TRUE(ModelEncodeRow(fmt, heads, want.data()));
        ++rows_checked;
        if (got != want && mismatches++ < 5) {
          size_t off = 0;
          while (got[off] == want[off]) ++off;
          ADD_FAILURE() << DTypeName(dtype) << " amax 0x" << std::hex << a << ": byte " << std::dec
                        << off << " got " << int{got[off]} << " want " << int{want[off]};
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << DTypeName(dtype);
    EXPECT_GT(rows_checked, 1000u);
  }
}

// SIMD and scalar reference: identical bytes on a larger job, and identical restored pools,
// for 1, 2, 3 and 8 threads (more threads than cores, and than some jobs' items).
TEST(CodecCpu, SameBytesAsReferenceForAnyThreadCount) {
  ExpectNoErrors(RunSameBytesAsReference(CodecKind::kInt8PerHead));
}

// NaN (quiet, signaling, both signs) and +-Inf flag exactly the blocks holding them, whether
// they sit in the vector part of a head or in its scalar tail (head_dim 100: 96 + 4 with 16 or
// 8 lanes; 7: no vector part); the other blocks' payloads still match the model.
TEST(CodecCpu, NonfiniteRowsFlagTheirBlocks) {
  std::vector<Executor> execs = SimdExecutors({1u, 2u, 3u});
  execs.push_back({"reference", [](const EncodeJob& j) { EncodeBlocksReference(j); },
                   [](const DecodeJob& j) { DecodeBlocksReference(j); }});
  ExpectNoErrors(RunNonfiniteFlags(
      CodecKind::kInt8PerHead,
      {Geometry{2, 100, 2}, Geometry{1, 576, 1}, Geometry{3, 72, 2}, Geometry{1, 7, 1}},
      /*negative_quiet_nan=*/true, 3000, execs));
}

TEST(CodecCpu, NonfiniteFlagsMayBeNull) {
  const BlockLayout lay = MakeLayout({2, 100, 2}, DType::kBF16);
  KvPool src(lay, 32, ViewKind::kContiguous, 9);
  src.Fill(InputClass::kGaussian, 9);
  src.Head(0, 1, 0, 1)[99] = 0x7FC0;
  std::vector<uint32_t> rows(lay.block_tokens);
  for (uint32_t i = 0; i < rows.size(); ++i) rows[i] = i;
  BlockSet blocks(lay, 1);
  CpuCodec codec(2);
  codec.Encode(MakeEncodeJob(src, rows, blocks, nullptr));  // must not crash
  uint8_t flag = 0;
  codec.Encode(MakeEncodeJob(src, rows, blocks, &flag));
  EXPECT_EQ(flag, 1);
}

TEST(CodecCpu, AllZeroHeadsRestoreExactZeros) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const BlockLayout lay = MakeLayout({4, 72, 2}, dtype);
    KvPool src(lay, 32, ViewKind::kPackedKV, 3);
    src.Fill(InputClass::kZero, 3);  // +0 and -0
    Rng rng(3);
    const std::vector<uint32_t> rows = RandomRows(32, 2 * lay.block_tokens, rng);
    BlockSet blocks(lay, 2);
    CpuCodec codec(2);
    codec.Encode(MakeEncodeJob(src, rows, blocks, nullptr));
    KvPool out(lay, 32, ViewKind::kPackedKV, 3);
    out.FillBytes(0x77);
    codec.Decode(MakeDecodeJob(out, rows, blocks));
    int nonzero = 0;
    for (uint32_t l = 0; l < lay.num_layers; ++l)
      for (uint32_t p = 0; p < 2; ++p)
        for (uint32_t r : rows)
          for (uint32_t h = 0; h < 4; ++h)
            for (uint32_t i = 0; i < 72; ++i) nonzero += out.Head(l, p, r, h)[i] != 0;
    EXPECT_EQ(nonzero, 0) << DTypeName(dtype);
  }
}

TEST(CodecCpu, RawRoundTripIsBitExact) {
  BoundStats bound;
  std::vector<std::string> errors;
  uint64_t seed = 4000;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (ViewKind vk : AllViewKinds()) {
      for (const Geometry& g : {Geometry{8, 128, 2}, Geometry{1, 576, 1}, Geometry{3, 72, 2}}) {
        CaseSpec spec;
        spec.layout = MakeLayout(g, dtype, CodecKind::kRaw);
        spec.input = InputClass::kRowMix;
        spec.view = vk;
        spec.seed = seed++;
        for (auto& e : RunCase(spec, SimdExecutors({1u, 2u, 3u}), &bound)) errors.push_back(e);
      }
    }
  }
  ExpectNoErrors(errors);
  EXPECT_EQ(bound.violations, 0u);
  EXPECT_GT(bound.elements, 0u);
}

// Decode's streaming stores (whole 64-byte lines of a head, or of a RAW row) at every alignment
// of the destination: rows on 64-byte boundaries (every head streams), 2, 16 and 48 bytes off
// (ordinary stores; RAW streams the inner lines), and heads 64 bytes apart beyond their data.
// The restored buffer must be the scalar reference's byte for byte, untouched bytes included,
// and nothing around it may change.
TEST(CodecCpu, DecodeAtEveryDestinationAlignment) {
  constexpr uint32_t kRows = 96;
  std::vector<std::string> errors;
  for (CodecKind codec : {CodecKind::kInt8PerHead, CodecKind::kRaw}) {
    for (DType dtype : {DType::kBF16, DType::kFP16}) {
      for (uint64_t head_pad : {uint64_t{0}, uint64_t{64}}) {
        for (uint64_t offset : {0, 2, 16, 48}) {
          BlockLayout lay = MakeLayout(Geometry{4, 128, 2}, dtype, codec);
          lay.block_tokens = 16;
          const uint64_t head_stride = 256 + head_pad;
          const uint64_t row_stride = 4 * head_stride;
          const uint64_t plane_bytes = row_stride * kRows;
          const uint64_t bytes = plane_bytes * lay.kv_planes * lay.num_layers;
          // Source and two destinations, each at `offset` from a 64-byte boundary.
          std::vector<uint8_t> src_store(bytes + 128), got_store(bytes + 128, 0x5A),
              want_store(bytes + 128, 0x5A);
          auto at = [&](std::vector<uint8_t>& v) {
            const uintptr_t p = reinterpret_cast<uintptr_t>(v.data());
            return v.data() + ((64 - p % 64) % 64) + offset;
          };
          auto views = [&](uint8_t* base) {
            std::vector<LayerViews> out(lay.num_layers);
            for (uint32_t l = 0; l < lay.num_layers; ++l) {
              for (uint32_t p = 0; p < lay.kv_planes; ++p) {
                StridedView& v = out[l].planes[p];
                v.base = base + (l * lay.kv_planes + p) * plane_bytes;
                v.row_stride = row_stride;
                v.head_stride = head_stride;
                v.num_rows = kRows;
              }
            }
            return out;
          };
          Rng rng(offset * 7 + head_pad + static_cast<uint64_t>(dtype) * 3 +
                  static_cast<uint64_t>(codec));
          const std::vector<LayerViews> src = views(at(src_store));
          for (uint32_t l = 0; l < lay.num_layers; ++l) {
            for (uint32_t p = 0; p < lay.kv_planes; ++p) {
              for (uint32_t r = 0; r < kRows; ++r) {
                for (uint32_t h = 0; h < 4; ++h) {
                  GenHead(InputClass::kGaussian, dtype, rng,
                          reinterpret_cast<uint16_t*>(src[l].planes[p].Head(r, h)), 128);
                }
              }
            }
          }
          const uint32_t blocks = 3;
          const std::vector<uint32_t> rows = RandomRows(kRows, blocks * lay.block_tokens, rng);
          BlockSet encoded(lay, blocks);
          std::vector<uint8_t> flags(blocks, 0);
          EncodeJob enc;
          enc.layout = lay;
          enc.layers = src.data();
          enc.rows = rows.data();
          enc.blocks = encoded.ptrs();
          enc.num_blocks = blocks;
          enc.nonfinite = flags.data();
          EncodeBlocksReference(enc);
          const std::vector<LayerViews> got = views(at(got_store));
          const std::vector<LayerViews> want = views(at(want_store));
          DecodeJob dec;
          dec.layout = lay;
          dec.rows = rows.data();
          dec.blocks = encoded.ptrs();
          dec.num_blocks = blocks;
          dec.layers = want.data();
          DecodeBlocksReference(dec);
          dec.layers = got.data();
          CpuCodec(2).Decode(dec);
          // The two destinations sit at different places in their vectors: compare from `at`.
          uint8_t* got_base = at(got_store);
          size_t stray = 0;
          for (size_t i = 0; i < got_store.size(); ++i) {
            const bool inside = &got_store[i] >= got_base && &got_store[i] < got_base + bytes;
            stray += !inside && got_store[i] != 0x5A;
          }
          if (std::memcmp(got_base, at(want_store), bytes) != 0 || stray != 0) {
            errors.push_back(std::string(codec == CodecKind::kRaw ? "RAW" : "INT8") + " " +
                             (dtype == DType::kBF16 ? "BF16" : "FP16") + " head_pad " +
                             std::to_string(head_pad) + " offset " + std::to_string(offset) +
                             ": restored bytes differ from the reference (" +
                             std::to_string(stray) + " written outside the buffer)");
          }
        }
      }
    }
  }
  ExpectNoErrors(errors);
}

// TransposeU16 and TransposeU32 (the split-head moves' transposes) against an element-wise
// transpose, for sizes around their 8 x 8 and 4 x 4 blocks, with padded pitches.
TEST(CodecCpu, TransposesMoveEveryElement) {
  for (size_t e : {size_t{2}, size_t{4}}) {
    for (uint32_t rows = 1; rows <= 19; ++rows) {
      for (uint32_t cols = 1; cols <= 19; ++cols) {
        const size_t src_pitch = cols * e + 6, dst_pitch = rows * e + 10;
        std::vector<uint8_t> src(rows * src_pitch), dst(cols * dst_pitch, 0xEE);
        for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + rows);
        if (e == 2) {
          TransposeU16(src.data(), src_pitch, dst.data(), dst_pitch, rows, cols);
        } else {
          TransposeU32(src.data(), src_pitch, dst.data(), dst_pitch, rows, cols);
        }
        std::vector<uint8_t> want(cols * dst_pitch, 0xEE);
        for (uint32_t r = 0; r < rows; ++r) {
          for (uint32_t c = 0; c < cols; ++c) {
            std::memcpy(&want[c * dst_pitch + r * e], &src[r * src_pitch + c * e], e);
          }
        }
        ASSERT_EQ(dst, want) << e << " bytes, " << rows << " x " << cols;
      }
    }
  }
}

// DeinterleaveU16 and InterleaveU16 (AMX V tiles' token pairs) against element-wise copies, for
// lengths around their 8 pairs, with bytes of every value (the sign trick of the packs).
TEST(CodecCpu, PairsSplitAndMergeEveryElement) {
  for (uint32_t n = 1; n <= 37; ++n) {
    std::vector<uint8_t> pairs(n * 4 + 4);
    for (size_t i = 0; i < pairs.size(); ++i) pairs[i] = static_cast<uint8_t>(i * 73 + n * 5);
    std::vector<uint8_t> a(n * 2 + 2, 0xEE), b(n * 2 + 2, 0xEE);
    DeinterleaveU16(pairs.data(), a.data(), b.data(), n);
    std::vector<uint8_t> want_a(a.size(), 0xEE), want_b(b.size(), 0xEE);
    for (uint32_t i = 0; i < n; ++i) {
      std::memcpy(&want_a[i * 2], &pairs[i * 4], 2);
      std::memcpy(&want_b[i * 2], &pairs[i * 4 + 2], 2);
    }
    ASSERT_EQ(a, want_a) << n;
    ASSERT_EQ(b, want_b) << n;
    std::vector<uint8_t> back(pairs.size(), 0xEE);
    InterleaveU16(a.data(), b.data(), back.data(), n);
    ASSERT_TRUE(std::equal(back.begin(), back.begin() + n * 4, pairs.begin())) << n;
    ASSERT_TRUE(std::all_of(back.begin() + n * 4, back.end(), [](uint8_t x) { return x == 0xEE; }))
        << n;
  }
}

// Views with split addressing (StridedView::row_group, dim_run, dim_step): vLLM CPU attention's
// tiles, [pages][heads][K|V][...], K as [dim][token] (runs of one element) and as token groups
// of 8 with dims in pairs ([t / 8][d / 2][t % 8][d % 2]), V as [token][dim], and, as vLLM's AMX
// tiles, V with token pairs interleaved ([d / 16][t / 2][d % 16][t % 2]: a run's elements 4
// bytes apart) beside K in token groups of 16 with dims in pairs. Each codec encodes the
// same bytes as from a plain [row][head][dim] copy of the same values, on 1 and 3 threads and
// with the reference, and a decode writes exactly the plain decode's values at the split
// addresses and no other byte.
TEST(CodecCpu, SplitViewsEncodeAndDecodeAsPlainViews) {
  constexpr uint32_t kHeads = 3, kDim = 64, kBs = 16, kPages = 5;
  const uint64_t tile = uint64_t{kBs} * kDim * 2 * 2, page = tile * kHeads;
  const uint32_t rows_total = kPages * kBs;
  const uint32_t order[] = {3, 0, 4, 1};  // the blocks' pages, not in order
  for (int split = 0; split < 3; ++split) {
    StridedView k;
    k.page_rows = kBs;
    k.page_stride = page;
    k.head_stride = tile;
    k.num_rows = rows_total;
    if (split == 0) {
      k.row_stride = 2;
      k.dim_run = 1;
      k.dim_run_stride = kBs * 2;
    } else {
      const uint32_t group = split == 1 ? 8 : 16;
      k.row_stride = 4;
      k.row_group = group;
      k.row_group_stride = group * kDim * 2;
      k.dim_run = 2;
      k.dim_run_stride = group * 2 * 2;
    }
    StridedView v;
    v.row_stride = kDim * 2;
    v.head_stride = tile;
    v.page_rows = kBs;
    v.page_stride = page;
    v.num_rows = rows_total;
    if (split == 2) {
      v.row_stride = 2;
      v.row_group = 2;
      v.row_group_stride = 16 * 2 * 2;
      v.dim_run = 16;
      v.dim_run_stride = kBs * 16 * 2;
      v.dim_step = 4;
    }
    // Element (row, head, d) of each plane at its split address.
    auto at = [&](const StridedView& sv, uint8_t* base, uint32_t r, uint32_t h, uint32_t d) {
      StridedView b = sv;
      b.base = base;
      const uint32_t run = b.dim_run != 0 ? b.dim_run : kDim;
      return b.Head(r, h) + (d / run) * b.dim_run_stride + (d % run) * b.dim_step;
    };
    for (CodecKind codec :
         {CodecKind::kInt8PerHead, CodecKind::kRaw, CodecKind::kFp8E4m3PerHead,
          CodecKind::kInt4G32PerHead, CodecKind::kInt4Kivi, CodecKind::kInt4Hadamard}) {
      BlockLayout lay;
      lay.row = {kHeads, kDim, DType::kBF16, codec};
      lay.num_layers = 1;
      lay.block_tokens = kBs;
      std::vector<uint8_t> tiles(page * kPages);
      std::vector<uint8_t> plain(size_t{rows_total} * kHeads * kDim * 2 * 2);  // K rows, V rows
      uint64_t x = 12345 + static_cast<uint64_t>(codec) * 7 + split;
      for (uint32_t r = 0; r < rows_total; ++r) {
        for (uint32_t h = 0; h < kHeads; ++h) {
          for (uint32_t d = 0; d < kDim; ++d) {
            for (uint32_t p = 0; p < 2; ++p) {
              x = x * 6364136223846793005ull + 1442695040888963407ull;
              const uint16_t bits =
                  FloatToBf16Sat(static_cast<float>((x >> 40) % 2001) / 100.f - 10.f);
              uint8_t* tb = tiles.data() + (p == 1 ? kBs * kDim * 2 : 0);
              std::memcpy(at(p == 0 ? k : v, tb, r, h, d), &bits, 2);
              std::memcpy(
                  plain.data() + ((size_t{p} * rows_total + r) * kHeads + h) * kDim * 2 + d * 2,
                  &bits, 2);
            }
          }
        }
      }
      LayerViews split_views{{k, v}}, plain_views{};
      split_views.planes[0].base = tiles.data();
      split_views.planes[1].base = tiles.data() + kBs * kDim * 2;
      for (uint32_t p = 0; p < 2; ++p) {
        StridedView& pv = plain_views.planes[p];
        pv.base = plain.data() + size_t{p} * rows_total * kHeads * kDim * 2;
        pv.row_stride = kHeads * kDim * 2;
        pv.head_stride = kDim * 2;
        pv.num_rows = rows_total;
      }
      // Every other block's slots kinked (0..10, then 15 down to 11): a run of adjacent slots
      // that is not a multiple of 8, then single ones.
      std::vector<uint32_t> rows;
      for (uint32_t i = 0; i < 4; ++i) {
        for (uint32_t t = 0; t < kBs; ++t) {
          const uint32_t slot = (i % 2 == 1 && t > 10) ? kBs - 1 - (t - 11) : t;
          rows.push_back(order[i] * kBs + slot);
        }
      }
      const uint32_t blocks = 4;
      auto encode = [&](const LayerViews& views, auto&& run) {
        std::vector<uint8_t> out(blocks * lay.BlockBytes());
        std::vector<uint8_t*> ptrs;
        for (uint32_t b = 0; b < blocks; ++b) ptrs.push_back(out.data() + b * lay.BlockBytes());
        std::vector<uint8_t> nonfinite(blocks, 0);
        EncodeJob job{lay, &views, rows.data(), ptrs.data(), blocks, nonfinite.data()};
        run(job);
        return out;
      };
      const std::vector<uint8_t> want =
          encode(plain_views, [](const EncodeJob& j) { EncodeBlocksReference(j); });
      const std::string what =
          "codec " + std::to_string(static_cast<int>(codec)) + " split " + std::to_string(split);
      EXPECT_TRUE(encode(split_views, [](const EncodeJob& j) { EncodeBlocksReference(j); }) == want)
          << what << " (reference)";
      for (unsigned threads : {1u, 3u}) {
        CpuCodec codec_cpu(threads);
        EXPECT_TRUE(encode(split_views, [&](const EncodeJob& j) { codec_cpu.Encode(j); }) == want)
            << what << " threads " << threads;
      }
      // Decode into zeroed planes, both ways; the split one compared address by address.
      std::vector<const uint8_t*> src;
      for (uint32_t b = 0; b < blocks; ++b) src.push_back(want.data() + b * lay.BlockBytes());
      std::fill(plain.begin(), plain.end(), 0);
      DecodeJob plain_job{lay, &plain_views, rows.data(), src.data(), blocks};
      DecodeBlocksReference(plain_job);
      for (int exec = 0; exec < 2; ++exec) {
        std::fill(tiles.begin(), tiles.end(), 0xEE);
        DecodeJob job{lay, &split_views, rows.data(), src.data(), blocks};
        if (exec == 0) {
          DecodeBlocksReference(job);
        } else {
          CpuCodec(2).Decode(job);
        }
        std::vector<uint8_t> touched(tiles.size(), 0);
        size_t mismatches = 0;
        for (uint32_t r : rows) {
          for (uint32_t h = 0; h < kHeads; ++h) {
            for (uint32_t d = 0; d < kDim; ++d) {
              for (uint32_t p = 0; p < 2; ++p) {
                uint8_t* tb = tiles.data() + (p == 1 ? kBs * kDim * 2 : 0);
                uint8_t* got = at(p == 0 ? k : v, tb, r, h, d);
                touched[got - tiles.data()] = touched[got - tiles.data() + 1] = 1;
                mismatches +=
                    std::memcmp(got,
                                plain.data() +
                                    ((size_t{p} * rows_total + r) * kHeads + h) * kDim * 2 + d * 2,
                                2) != 0;
              }
            }
          }
        }
        size_t stray = 0;
        for (size_t i = 0; i < tiles.size(); ++i) stray += !touched[i] && tiles[i] != 0xEE;
        EXPECT_EQ(mismatches, 0u) << what << " exec " << exec;
        EXPECT_EQ(stray, 0u) << what << " exec " << exec;
      }
    }
  }
}

// DecodeLayer(l) writes layer l of the requested rows and no other byte of any layer.
TEST(CodecCpu, DecodeLayerWritesOnlyThatLayer) {
  for (ViewKind vk : AllViewKinds()) {
    for (CodecKind codec_kind : {CodecKind::kInt8PerHead, CodecKind::kRaw}) {
      const BlockLayout lay = MakeLayout({3, 72, 2}, DType::kBF16, codec_kind, 3, 16);
      KvPool src(lay, 80, vk, 13);
      src.Fill(InputClass::kGaussian, 13);
      Rng rng(13);
      const std::vector<uint32_t> rows = RandomRows(80, 3 * lay.block_tokens, rng);
      BlockSet blocks(lay, 3);
      CpuCodec codec(3);
      codec.Encode(MakeEncodeJob(src, rows, blocks, nullptr));
      KvPool want(lay, 80, vk, 13);
      want.FillBytes(0x5A);
      DecodeLayerReference(MakeDecodeJob(want, rows, blocks), 1);
      KvPool out(lay, 80, vk, 13);
      out.FillBytes(0x5A);
      codec.DecodeLayer(MakeDecodeJob(out, rows, blocks), 1);
      for (uint32_t l : {0u, 2u}) {
        EXPECT_EQ(out.buffer(l), std::vector<uint8_t>(out.buffer(l).size(), 0x5A))
            << ViewKindName(vk) << " layer " << l;
      }
      EXPECT_TRUE(out.buffer(1) == want.buffer(1)) << ViewKindName(vk);
      const std::vector<uint8_t> mask = out.AddressedMask(1, rows);
      size_t written = 0, stray = 0;
      for (size_t i = 0; i < mask.size(); ++i) {
        if (out.buffer(1)[i] != 0x5A) (mask[i] ? written : stray)++;
      }
      EXPECT_EQ(stray, 0u) << ViewKindName(vk);
      EXPECT_GT(written, mask.size() / 10) << ViewKindName(vk);
    }
  }
}

TEST(CodecCpu, EmptyJobsTouchNothing) {
  const BlockLayout lay = MakeLayout({8, 128, 2}, DType::kBF16);
  KvPool pool(lay, 16, ViewKind::kContiguous);
  pool.FillBytes(0x11);
  BlockSet blocks(lay, 1, 0x22);
  std::vector<uint32_t> rows(lay.block_tokens, 0);
  uint8_t flag = 0x33;
  CpuCodec codec(2);
  EncodeJob ej = MakeEncodeJob(pool, rows, blocks, &flag);
  ej.num_blocks = 0;
  codec.Encode(ej);
  DecodeJob dj = MakeDecodeJob(pool, rows, blocks);
  dj.num_blocks = 0;
  codec.Decode(dj);
  codec.DecodeLayer(dj, 0);
  EXPECT_EQ(flag, 0x33);
  EXPECT_EQ(blocks[0], std::vector<uint8_t>(lay.BlockBytes(), 0x22));
  EXPECT_EQ(pool.buffer(0), std::vector<uint8_t>(pool.buffer(0).size(), 0x11));
}

// Every Highway target compiled in and supported here (e.g. AVX3_ZEN4, AVX3, AVX2, SSE4,
// SSSE3, EMU128), selected in turn: each must produce the model's bytes. A machine with an
// older CPU runs one of the lesser targets in production.
TEST(CodecCpu, EveryHighwayTarget) {
  ExpectNoErrorsOnEveryHighwayTarget([](int64_t target) {
    EXPECT_STREQ(CpuCodec::TargetName(), hwy::TargetName(target));
    const std::vector<Executor> execs = {SimdExecutors({1u, 2u, 3u})[0],
                                         SimdExecutors({1u, 2u, 3u})[2]};
    return RunOneHighwayTarget(CodecKind::kInt8PerHead, TestGeometries(),
                               {InputClass::kRowMix, InputClass::kGrid, InputClass::kTiny},
                               {2, 100, 2}, 5000, execs);
  });
}

}  // namespace
}  // namespace hiqcache::kernels
