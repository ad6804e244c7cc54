// CODEC_INT5_ALLOT, CODEC_INT6_ALLOT and CODEC_INT4_ALLOT (one format at three widths) on the
// scalar reference and the SIMD CPU executor (split heads, chunked decodes and every Highway target
// included): the record's size for Qwen3-8B and SmolLM2; the allotment against a selection written
// from its definition (sorted gains), with ties, zero ranges and a corrupt record's parameters;
// every restored element within its bound for both dtypes, both RoPE pairings, theta 0, head_dims
// 32 to 128 and blocks of 1 to 32 tokens; NaN, Inf and keys beyond 2^120 flag exactly their blocks;
// and the turn's worth: keys made by RoPE restore closer with the turn than without.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "codec_cpu.h"
#include "codec_cpu_test_util.h"
#include "codec_reference.h"
#include "codec_test_util.h"
#include "rope_turn.h"

namespace hiqcache::kernels {
namespace {

using namespace testutil;  // NOLINT: test-only helpers

constexpr CodecKind kAllotCodecs[] = {CodecKind::kInt5Allot, CodecKind::kInt6Allot,
                                      CodecKind::kInt4Allot};
constexpr AllotBits kAllotWidths[] = {kInt5AllotBits, kInt6AllotBits, kInt4AllotBits};

const char* AllotName(CodecKind codec) {
  return codec == CodecKind::kInt6Allot   ? "INT6 allot"
         : codec == CodecKind::kInt4Allot ? "INT4 allot"
                                          : "INT5 allot";
}

BlockLayout AllotLayout(uint32_t heads, uint32_t dim, uint32_t layers, uint32_t bt, DType dtype,
                        double theta = 0.0, bool interleaved = false,
                        CodecKind codec = CodecKind::kInt5Allot) {
  BlockLayout lay;
  lay.row.num_heads = heads;
  lay.row.head_dim = dim;
  lay.row.dtype = dtype;
  lay.row.codec = codec;
  lay.row.rope_theta = theta;
  lay.row.rope_interleaved = interleaved;
  lay.num_layers = layers;
  lay.kv_planes = 2;
  lay.block_tokens = bt;
  return lay;
}

TEST(AllotLayout, BytesPerToken) {
  // Qwen3-8B (36 layers, 8 x 128): per (block, layer) K = INT8 row 1,040 + (bt - 1) rows of
  // 5.25 * 1,024 bits + 16 + 2,048 parameter bytes; V = 1,040 + (bt - 1) * (640 + 32).
  EXPECT_EQ(AllotLayout(8, 128, 36, 32, DType::kBF16).BytesPerToken(), 51534u);
  EXPECT_EQ(AllotLayout(8, 128, 36, 16, DType::kBF16).BytesPerToken(), 54684u);
  // SmolLM2-135M (30 layers, 3 x 64): K 198 + 31 * 126 + 390, V 198 + 31 * 132.
  EXPECT_EQ(AllotLayout(3, 64, 30, 32, DType::kBF16).BytesPerToken(), 8235u);
  // One token per block: INT8's rows only.
  EXPECT_EQ(AllotLayout(8, 128, 36, 1, DType::kBF16).BytesPerToken(), 74880u);
  // INT6 allot: INT5 allot's K plane, V rows of 768 + 32 bytes.
  const CodecKind six = CodecKind::kInt6Allot;
  EXPECT_EQ(AllotLayout(8, 128, 36, 32, DType::kBF16, 0.0, false, six).BytesPerToken(), 55998u);
  EXPECT_EQ(AllotLayout(8, 128, 36, 16, DType::kBF16, 0.0, false, six).BytesPerToken(), 59004u);
  // SmolLM2: K 198 + 31 * 126 + 390, V 198 + 31 * 156 (9,528 per layer, 285,840 / 32 rounded up).
  EXPECT_EQ(AllotLayout(3, 64, 30, 32, DType::kBF16, 0.0, false, six).BytesPerToken(), 8933u);
  EXPECT_EQ(AllotLayout(8, 128, 36, 1, DType::kBF16, 0.0, false, six).BytesPerToken(), 74880u);
  // INT4 allot: K rows of 4.4375 * 1,024 bits (568 bytes), V rows of 512 + 32 bytes. At 64-token
  // blocks K = 1,040 + 63 * 568 + 2,064, V = 1,040 + 63 * 544: 74,200 per layer, 2,671,200 / 64
  // rounded up.
  const CodecKind four = CodecKind::kInt4Allot;
  EXPECT_EQ(AllotLayout(8, 128, 36, 64, DType::kBF16, 0.0, false, four).BytesPerToken(), 41738u);
  EXPECT_EQ(AllotLayout(8, 128, 36, 32, DType::kBF16, 0.0, false, four).BytesPerToken(), 43443u);
  // SmolLM2: 4.4375 * 192 = 852 bits, down to 106 bytes; K 198 + 31 * 106 + 390, V 198 + 31 * 108.
  EXPECT_EQ(AllotLayout(3, 64, 30, 32, DType::kBF16, 0.0, false, four).BytesPerToken(), 6957u);
  EXPECT_EQ(AllotLayout(8, 128, 36, 1, DType::kBF16, 0.0, false, four).BytesPerToken(), 74880u);
}

// The allotment from its definition: every channel at 2 bits, then the n steps b -> b + 1 of
// largest gain R * 2^-b (b = 2..7), equal gains in channel order (then b's); n = key_x16 / 16 bits
// per channel, down to whole bytes of the row, less the 2 every channel has.
std::vector<uint8_t> SortedAllotment(const std::vector<uint32_t>& range_bits, AllotBits bits) {
  const size_t channels = range_bits.size();
  struct Step {
    double gain;
    size_t c;
    uint32_t b;
  };
  std::vector<Step> steps;
  for (size_t c = 0; c < channels; ++c) {
    float r;
    std::memcpy(&r, &range_bits[c], 4);
    for (uint32_t b = 2; b < 8; ++b) steps.push_back({std::ldexp(double{r}, -int(b)), c, b});
  }
  std::stable_sort(steps.begin(), steps.end(), [](const Step& a, const Step& b) {
    if (a.gain != b.gain) return a.gain > b.gain;
    return a.c != b.c ? a.c < b.c : a.b < b.b;
  });
  const size_t n = channels * bits.key_x16 / 128 * 8 - 2 * channels;
  std::vector<uint8_t> widths(channels, 2);
  for (size_t i = 0; i < n; ++i) ++widths[steps[i].c];
  return widths;
}

TEST(AllotWidths, MatchTheSortedSelection) {
  Rng rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const AllotBits bits = kAllotWidths[trial % 3];
    const uint32_t heads = 1 + rng.Below(4);
    const uint32_t dim = 32 * (1 + rng.Below(4));
    const uint32_t channels = heads * dim;
    std::vector<uint32_t> range(channels);
    // Steps of a few distinct values (ties across heads), ranges 0..254 steps, some all-zero.
    std::vector<float> step(heads);
    for (auto& s : step) s = std::ldexp(1.0f + rng.Below(4) / 4.0f, rng.Range(-20, 5));
    const int kind = trial % 4;
    for (uint32_t c = 0; c < channels; ++c) {
      int r = kind == 0   ? static_cast<int>(rng.Below(255))
              : kind == 1 ? static_cast<int>(rng.Below(4))  // many ties
              : kind == 2 ? (rng.Below(3) == 0 ? 0 : static_cast<int>(rng.Below(255)))
                          : (c % 7 == 0 ? 254 : 1);
      range[c] = AllotRangeBits(0, static_cast<int8_t>(r > 127 ? 127 : r), step[c / dim]);
      if (r > 127) range[c] = AllotRangeBits(static_cast<int8_t>(127 - r), 127, step[c / dim]);
    }
    std::vector<uint8_t> widths(channels);
    AllotKeyWidths(range.data(), channels, bits, widths.data());
    const std::vector<uint8_t> want = SortedAllotment(range, bits);
    ASSERT_EQ(widths, want) << "trial " << trial;
    uint32_t sum = 0;
    for (uint8_t w : widths) sum += w;
    EXPECT_EQ(sum, AllotKeyRowBits(channels, bits));
  }
  // All ranges zero: every step gains 0; taken in channel order, 6 per channel.
  for (const AllotBits bits : kAllotWidths) {
    std::vector<uint32_t> zero(64, 0);
    std::vector<uint8_t> widths(64);
    AllotKeyWidths(zero.data(), 64, bits, widths.data());
    EXPECT_EQ(widths, SortedAllotment(zero, bits));
  }
}

TEST(AllotWidths, CorruptParametersStayInsideTheRow) {
  Rng rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const AllotBits bits = kAllotWidths[trial % 3];
    const uint32_t channels = 32 * (1 + rng.Below(8));
    std::vector<int8_t> lower(channels);
    std::vector<int8_t> upper(channels);
    std::vector<uint32_t> range(channels);
    for (uint32_t c = 0; c < channels; ++c) {
      lower[c] = static_cast<int8_t>(rng.Below(256));
      upper[c] = static_cast<int8_t>(rng.Below(256));
      uint32_t step_bits = static_cast<uint32_t>(rng.Below(65536)) << 16;  // any bf16: NaN too
      float step;
      std::memcpy(&step, &step_bits, 4);
      range[c] = AllotRangeBits(lower[c], upper[c], step);
    }
    std::vector<uint8_t> widths(channels);
    AllotKeyWidths(range.data(), channels, bits, widths.data());
    uint32_t sum = 0;
    for (uint8_t w : widths) {
      ASSERT_GE(w, 2);
      ASSERT_LE(w, 8);
      sum += w;
    }
    EXPECT_LE(sum, AllotKeyRowBits(channels, bits));
  }
}

// Keys as RoPE makes them: per head a direction a few channels dominate, turned by each token's
// absolute position, plus noise; values Gaussian with an outlier channel.
void FillRopeLike(KvPool* pool, const std::vector<uint32_t>& rows, double theta, bool interleaved,
                  uint64_t seed) {
  const BlockLayout& lay = pool->layout();
  const uint32_t d = lay.row.head_dim;
  Rng rng(seed);
  for (uint32_t l = 0; l < lay.num_layers; ++l) {
    for (uint32_t h = 0; h < lay.row.num_heads; ++h) {
      std::vector<double> base(d);
      for (uint32_t i = 0; i < d; ++i) base[i] = rng.Gaussian() * (i % 13 == 0 ? 8.0 : 1.0);
      for (size_t k = 0; k < rows.size(); ++k) {
        const double pos = 100.0 + k;
        uint16_t* key = pool->Head(l, 0, rows[k], h);
        uint16_t* val = pool->Head(l, 1, rows[k], h);
        for (uint32_t i = 0; i < d; ++i) {
          const uint32_t j = RopePairIndex(i, d, interleaved);
          const uint32_t o = RopePartner(i, d, interleaved);
          const double ang = theta == 0.0 ? 0.0 : pos * std::pow(theta, -2.0 * j / d);
          const double sign = RopeIsFirst(i, d, interleaved) ? -1.0 : 1.0;
          const double x = base[i] * std::cos(ang) + sign * base[o] * std::sin(ang);
          key[i] = DoubleToHalfBits(x + 0.05 * rng.Gaussian(), lay.row.dtype);
          val[i] = DoubleToHalfBits(rng.Gaussian() * (i == 3 ? 20.0 : 1.0), lay.row.dtype);
        }
      }
    }
  }
}

double OutUnit(DType dtype) { return dtype == DType::kBF16 ? 0x1.0p-8 : 0x1.0p-11; }
double OutSub(DType dtype, double xhat) {
  return dtype == DType::kBF16 ? (std::fabs(xhat) <= 0x1.0p-126 ? 0x1.0p-134 : 0.0)
                               : (std::fabs(xhat) <= 0x1.0p-14 ? 0x1.0p-25 : 0.0);
}

// Per element of a restored block, |x^ - x| against the bound written in codec_math.h, from the
// record's own parameters. Returns the largest ratio.
double CheckBlockBound(const KvPool& in, const KvPool& out, const std::vector<uint32_t>& rows,
                       const std::vector<uint8_t>& block, uint32_t b) {
  const BlockLayout& lay = in.layout();
  const RowFormat& fmt = lay.row;
  const uint32_t d = fmt.head_dim;
  const size_t channels = fmt.ElementsPerRow();
  const uint32_t bt = lay.block_tokens;
  double worst = 0.0;
  for (uint32_t l = 0; l < lay.num_layers; ++l) {
    // Key channel scales from the parameters (widths by the sorted selection).
    std::vector<double> ks(channels, 0.0);
    if (bt > 1) {
      const uint8_t* params = block.data() + lay.RowOffset(l, 0, bt);
      const auto* lower = reinterpret_cast<const int8_t*>(params + 2 * fmt.num_heads);
      const int8_t* upper = lower + channels;
      std::vector<uint32_t> range(channels);
      for (size_t c = 0; c < channels; ++c) {
        range[c] = AllotRangeBits(lower[c], upper[c],
                                  static_cast<float>(ScaleValue(LoadU16(params + 2 * (c / d)))));
      }
      const std::vector<uint8_t> w = SortedAllotment(range, fmt.Allot());
      for (size_t c = 0; c < channels; ++c) {
        const double step = ScaleValue(LoadU16(params + 2 * (c / d)));
        const double span = (upper[c] - lower[c]) * step;
        ks[c] = std::max(span, std::ldexp(1.0, -112)) / ((1u << w[c]) - 1) * (1 + 0x1.0p-8);
      }
    }
    for (uint32_t t = 0; t < bt; ++t) {
      const uint32_t r = rows[size_t{b} * bt + t];
      for (uint32_t p = 0; p < 2; ++p) {
        const uint8_t* rec = block.data() + lay.RowOffset(l, p, t);
        for (uint32_t h = 0; h < fmt.num_heads; ++h) {
          const uint16_t* x = in.Head(l, p, r, h);
          const uint16_t* xh = out.Head(l, p, r, h);
          for (uint32_t i = 0; i < d; ++i) {
            const double xi = HalfBitsToDouble(x[i], fmt.dtype);
            const double xhi = HalfBitsToDouble(xh[i], fmt.dtype);
            double bound;
            if (t == 0) {  // INT8's row
              bound = ErrorBound(ScaleValue(LoadU16(rec + channels + 2 * h)), xhi, fmt.dtype);
            } else if (p == 0) {
              const uint32_t o = RopePartner(i, d, fmt.rope_interleaved);
              const double xo = HalfBitsToDouble(x[o], fmt.dtype);
              bound = (0.5 + 0x1.0p-7) * (ks[size_t{h} * d + i] + ks[size_t{h} * d + o]) +
                      0x1.0p-20 * (std::fabs(xi) + std::fabs(xo)) +
                      OutUnit(fmt.dtype) * std::fabs(xhi) + OutSub(fmt.dtype, xhi) + 0x1.0p-120;
            } else {  // rotated values: the head is one run here (d a power of two or not)
              const uint32_t run = d & (~d + 1u);
              uint32_t k = 0;
              while ((1u << k) < run) ++k;
              const double cdec = std::ldexp(1.0, -static_cast<int>((k + 1) / 2));
              const uint8_t* zs = rec + channels * fmt.Allot().value / 8;
              const double s = ScaleValue(LoadU16(zs + 2 * fmt.num_heads + 2 * h));
              double sum_x = 0.0;
              const uint32_t j0 = i / run * run;
              for (uint32_t j = j0; j < j0 + run; ++j)
                sum_x += std::fabs(HalfBitsToDouble(x[j], fmt.dtype));
              // |y^_j| <= c_enc * sum |x| + s (c_enc * c_dec = 1 / run).
              const double yj = std::ldexp(sum_x, -static_cast<int>(k / 2)) + s;
              bound = cdec * run * ((0.5 + 0x1.0p-6) * s + 0x1.0p-6 * yj) + 0x1.0p-20 * sum_x +
                      OutUnit(fmt.dtype) * std::fabs(xhi) + OutSub(fmt.dtype, xhi) + 0x1.0p-120;
            }
            const double err = std::fabs(xhi - xi);
            if (!(err <= bound)) {
              ADD_FAILURE() << "layer " << l << " plane " << p << " token " << t << " head " << h
                            << " dim " << i << ": x " << xi << " restored " << xhi << " bound "
                            << bound;
              return 1e9;
            }
            worst = std::max(worst, bound > 0 ? err / bound : 0.0);
          }
        }
      }
    }
  }
  return worst;
}

using RoundTripParam = std::tuple<uint32_t, uint32_t, uint32_t, DType, double, bool>;

class AllotRoundTrip : public ::testing::TestWithParam<RoundTripParam> {};

TEST_P(AllotRoundTrip, ExecutorsAgreeAndEveryElementIsWithinItsBound) {
  const auto [heads, dim, bt, dtype, theta, interleaved] = GetParam();
  const uint32_t blocks = 3;
  const uint32_t slots = blocks * bt + 5;
  for (const CodecKind codec_kind : kAllotCodecs)
    for (ViewKind kind : {ViewKind::kContiguous, ViewKind::kPaged, ViewKind::kPackedKV}) {
      const BlockLayout lay = AllotLayout(heads, dim, 2, bt, dtype, theta, interleaved, codec_kind);
      SCOPED_TRACE(std::string(ViewKindName(kind)) + " " + AllotName(codec_kind));
      KvPool in(lay, slots, kind, 3);
      Rng rng(heads * 131 + dim + bt);
      const std::vector<uint32_t> rows = RandomRows(slots, size_t{blocks} * bt, rng);
      FillRopeLike(&in, rows, theta == 0.0 ? 1e4 : theta, interleaved, dim + bt);
      BlockSet ref(lay, blocks);
      std::vector<uint8_t> ref_flags(blocks, 9);
      EncodeBlocksReference(MakeEncodeJob(in, rows, ref, ref_flags.data()));
      EXPECT_EQ(ref_flags, std::vector<uint8_t>(blocks, 0));
      BlockSet cpu(lay, blocks, 0x5A);
      std::vector<uint8_t> cpu_flags(blocks, 9);
      CpuCodec codec(3);
      codec.Encode(MakeEncodeJob(in, rows, cpu, cpu_flags.data()));
      EXPECT_EQ(cpu_flags, ref_flags);
      ASSERT_TRUE(cpu == ref) << "the CPU executor's bytes differ from the reference's";

      KvPool out_ref(lay, slots, kind, 3);
      DecodeBlocksReference(MakeDecodeJob(out_ref, rows, ref));
      KvPool out_cpu(lay, slots, kind, 3);
      codec.Decode(MakeDecodeJob(out_cpu, rows, cpu));
      for (uint32_t l = 0; l < lay.num_layers; ++l) {
        ASSERT_EQ(out_cpu.buffer(l), out_ref.buffer(l)) << "layer " << l;
      }
      double worst = 0.0;
      for (uint32_t b = 0; b < blocks; ++b)
        worst = std::max(worst, CheckBlockBound(in, out_ref, rows, ref[b], b));
      // The bound is reached closely (0.97-0.99 of it on these inputs), so it says something.
      EXPECT_GT(worst, 0.5);
    }
}

INSTANTIATE_TEST_SUITE_P(Geometries, AllotRoundTrip,
                         ::testing::Values(RoundTripParam{1, 32, 16, DType::kBF16, 1e4, false},
                                           RoundTripParam{3, 64, 32, DType::kBF16, 1e5, false},
                                           RoundTripParam{3, 64, 32, DType::kFP16, 1e5, true},
                                           RoundTripParam{2, 128, 16, DType::kBF16, 1e6, false},
                                           RoundTripParam{2, 128, 5, DType::kFP16, 0.0, false},
                                           RoundTripParam{1, 96, 8, DType::kBF16, 5e5, true},
                                           RoundTripParam{2, 64, 2, DType::kBF16, 1e4, false},
                                           RoundTripParam{2, 64, 1, DType::kBF16, 1e4, false}));

// The SIMD executor (codec_cpu_allot.cc, and codec_cpu_hadamard.cc for the V plane) on every
// Highway target this machine runs: the reference's bytes and the reference's decode, for both
// pairings, both dtypes, theta 0, head_dims 32 to 128 and blocks of 1 to 32 tokens.
TEST(AllotSimd, EveryHighwayTargetGivesTheReferencesBytes) {
  struct Case {
    uint32_t heads, dim, bt;
    DType dtype;
    double theta;
    bool interleaved;
  };
  const std::vector<Case> cases = {
      {3, 64, 32, DType::kBF16, 1e5, false}, {2, 128, 16, DType::kBF16, 1e6, false},
      {2, 128, 16, DType::kFP16, 1e6, true}, {1, 96, 8, DType::kBF16, 5e5, true},
      {2, 32, 5, DType::kFP16, 0.0, false},  {2, 64, 2, DType::kBF16, 1e4, false},
      {2, 64, 1, DType::kBF16, 1e4, false}};
  ExpectNoErrorsOnEveryHighwayTarget([&](int64_t) {
    std::vector<std::string> errors;
    for (const CodecKind codec_kind : kAllotCodecs)
      for (const Case& c : cases) {
        const std::string name = std::string(AllotName(codec_kind)) + " " +
                                 std::to_string(c.heads) + "x" + std::to_string(c.dim) + " bt " +
                                 std::to_string(c.bt) + " " + DTypeName(c.dtype) + " theta " +
                                 std::to_string(c.theta) + (c.interleaved ? " interleaved" : "");
        const BlockLayout lay =
            AllotLayout(c.heads, c.dim, 2, c.bt, c.dtype, c.theta, c.interleaved, codec_kind);
        const uint32_t blocks = 3;
        const uint32_t slots = blocks * c.bt + 3;
        KvPool in(lay, slots, ViewKind::kPaged, 7);
        Rng rng(c.dim * 7 + c.bt);
        const std::vector<uint32_t> rows = RandomRows(slots, size_t{blocks} * c.bt, rng);
        FillRopeLike(&in, rows, c.theta == 0.0 ? 1e4 : c.theta, c.interleaved, c.bt + 1);
        BlockSet ref(lay, blocks);
        EncodeBlocksReference(MakeEncodeJob(in, rows, ref, nullptr));
        BlockSet simd(lay, blocks, 0x77);
        std::vector<uint8_t> flags(blocks, 9);
        CpuCodec(2).Encode(MakeEncodeJob(in, rows, simd, flags.data()));
        if (flags != std::vector<uint8_t>(blocks, 0)) errors.push_back(name + ": flagged a block");
        for (uint32_t b = 0; b < blocks; ++b) {
          if (simd[b] != ref[b])
            errors.push_back(name + ": block " + std::to_string(b) + " differs");
        }
        KvPool out_ref(lay, slots, ViewKind::kPaged, 7);
        DecodeBlocksReference(MakeDecodeJob(out_ref, rows, ref));
        KvPool out_simd(lay, slots, ViewKind::kPaged, 7);
        CpuCodec(3).Decode(MakeDecodeJob(out_simd, rows, ref));
        for (uint32_t l = 0; l < lay.num_layers; ++l) {
          if (out_simd.buffer(l) != out_ref.buffer(l)) {
            errors.push_back(name + ": decode of layer " + std::to_string(l) + " differs");
          }
        }
      }
    return errors;
  });
}

// Tests run for every width.
class AllotCodec : public ::testing::TestWithParam<CodecKind> {};

INSTANTIATE_TEST_SUITE_P(EveryWidth, AllotCodec, ::testing::ValuesIn(kAllotCodecs),
                         [](const ::testing::TestParamInfo<CodecKind>& info) {
                           std::string name = AllotName(info.param);  // "INT4 allot"
                           return "Int" + name.substr(3, 1) + "Allot";
                         });

TEST_P(AllotCodec, SplitHeadsAndChunkedDecodeGiveTheSameBytes) {
  const BlockLayout lay = AllotLayout(2, 64, 2, 16, DType::kBF16, 1e4, false, GetParam());
  KvPool in(lay, 40, ViewKind::kContiguous, 3);
  Rng rng(5);
  const std::vector<uint32_t> rows = RandomRows(40, 32, rng);
  FillRopeLike(&in, rows, 1e4, false, 9);
  BlockSet ref(lay, 2);
  EncodeBlocksReference(MakeEncodeJob(in, rows, ref, nullptr));
  // The same rows through views that split each head into runs of 16 elements.
  KvPool::Shape sh = KvPool::ShapeOf(lay, 40, ViewKind::kContiguous);
  KvPool split_in(lay, 40, sh);
  std::vector<LayerViews> views(lay.num_layers);
  for (uint32_t l = 0; l < lay.num_layers; ++l) {
    split_in.buffer(l) = in.buffer(l);
    views[l] = split_in.ViewsAt(l, split_in.buffer(l).data());
  }
  // Runs of 16 stored 2 runs apart (the head's 4 runs interleaved with another 4 of padding).
  std::vector<std::vector<uint8_t>> split_bytes(lay.num_layers);
  for (uint32_t l = 0; l < lay.num_layers; ++l) {
    split_bytes[l].assign(40 * 2 * 2 * 64 * 2 * 2 + 64, 0);
    for (uint32_t p = 0; p < 2; ++p) {
      StridedView& v = views[l].planes[p];
      v.base = split_bytes[l].data() + p * 40 * 2 * 64 * 2 * 2;
      v.row_stride = 2 * 64 * 2 * 2;
      v.head_stride = 64 * 2 * 2;
      v.page_rows = 0;
      v.dim_run = 16;
      v.dim_run_stride = 64;
      for (uint32_t r = 0; r < 40; ++r) {
        for (uint32_t h = 0; h < 2; ++h) {
          for (uint32_t run = 0; run < 4; ++run) {
            std::memcpy(v.base + r * v.row_stride + h * v.head_stride + run * 64,
                        in.Head(l, p, r, h) + run * 16, 32);
          }
        }
      }
    }
  }
  EncodeJob job = MakeEncodeJob(in, rows, ref, nullptr);
  BlockSet split(lay, 2, 0x11);
  job.layers = views.data();
  job.blocks = split.ptrs();
  CpuCodec codec(2);
  codec.Encode(job);
  EXPECT_TRUE(split == ref);
  // Decoded through the split views by the CPU executor (chunks of a block's tokens on its
  // threads), then read back: equal to the reference's decode into plain views.
  KvPool out_ref(lay, 40, ViewKind::kContiguous, 3);
  DecodeBlocksReference(MakeDecodeJob(out_ref, rows, ref));
  for (auto& b : split_bytes) std::fill(b.begin(), b.end(), 0);
  DecodeJob djob = MakeDecodeJob(out_ref, rows, ref);
  djob.layers = views.data();
  for (uint32_t layer = 0; layer < lay.num_layers; ++layer) codec.DecodeLayer(djob, layer);
  for (uint32_t l = 0; l < lay.num_layers; ++l) {
    for (uint32_t p = 0; p < 2; ++p) {
      const StridedView& v = views[l].planes[p];
      for (uint32_t r : rows) {
        for (uint32_t h = 0; h < 2; ++h) {
          for (uint32_t run = 0; run < 4; ++run) {
            ASSERT_EQ(std::memcmp(v.base + r * v.row_stride + h * v.head_stride + run * 64,
                                  out_ref.Head(l, p, r, h) + run * 16, 32),
                      0);
          }
        }
      }
    }
  }
}

TEST_P(AllotCodec, NonFiniteAndHugeKeysFlagOnlyTheirBlocks) {
  const BlockLayout lay = AllotLayout(2, 64, 2, 8, DType::kBF16, 1e4, false, GetParam());
  struct Case {
    uint32_t plane, token;
    uint16_t bits;
  };
  for (const Case& c : {Case{0, 0, 0x7FC0}, Case{0, 3, 0xFF80}, Case{0, 5, 0x7B80},  // 2^120
                        Case{1, 0, 0x7F80}, Case{1, 7, 0x7FC1}}) {
    KvPool in(lay, 24, ViewKind::kContiguous, 1);
    Rng rng(3);
    const std::vector<uint32_t> rows = RandomRows(24, 24, rng);
    FillRopeLike(&in, rows, 1e4, false, 4);
    in.Head(1, c.plane, rows[8 + c.token], 1)[7] = c.bits;  // block 1, layer 1
    BlockSet ref(lay, 3);
    std::vector<uint8_t> flags(3, 9);
    EncodeBlocksReference(MakeEncodeJob(in, rows, ref, flags.data()));
    EXPECT_EQ(flags, (std::vector<uint8_t>{0, 1, 0})) << c.plane << " " << c.token;
    std::vector<uint8_t> cpu_flags(3, 9);
    BlockSet cpu(lay, 3);
    CpuCodec(2).Encode(MakeEncodeJob(in, rows, cpu, cpu_flags.data()));
    EXPECT_EQ(cpu_flags, flags);
  }
}

// Mean squared error of plane `plane` (0: the keys) of layer 0 of `in`'s views, encoded and
// decoded through `lay` (the same geometry as `in`'s, any codec and RoPE).
double PlaneError(const BlockLayout& lay, const KvPool& in, const std::vector<uint32_t>& rows,
                  uint32_t plane = 0) {
  const uint32_t blocks = static_cast<uint32_t>(rows.size() / lay.block_tokens);
  BlockSet set(lay, blocks);
  EncodeJob job = MakeEncodeJob(in, rows, set, nullptr);
  job.layout = lay;  // the pool's views, encoded through `lay` (not the pool's own layout)
  EncodeBlocksReference(job);
  KvPool out(lay, in.num_rows(), ViewKind::kContiguous, 1);
  DecodeBlocksReference(MakeDecodeJob(out, rows, set));
  double sum = 0.0;
  for (uint32_t r : rows) {
    for (uint32_t h = 0; h < lay.row.num_heads; ++h) {
      for (uint32_t i = 0; i < lay.row.head_dim; ++i) {
        const double e = HalfBitsToDouble(out.Head(0, plane, r, h)[i], lay.row.dtype) -
                         HalfBitsToDouble(in.Head(0, plane, r, h)[i], lay.row.dtype);
        sum += e * e;
      }
    }
  }
  return sum / (rows.size() * lay.row.ElementsPerRow());
}

TEST(AllotTurn, RopeKeysRestoreCloserWithTheModelsTurn) {
  for (bool interleaved : {false, true}) {
    const double theta = 1e4;
    const BlockLayout turned = AllotLayout(4, 128, 1, 32, DType::kBF16, theta, interleaved);
    KvPool in(turned, 128, ViewKind::kContiguous, 1);
    std::vector<uint32_t> rows(128);
    for (uint32_t i = 0; i < 128; ++i) rows[i] = i;
    FillRopeLike(&in, rows, theta, interleaved, 21);
    const double with_turn = PlaneError(turned, in, rows);
    const double without = PlaneError(AllotLayout(4, 128, 1, 32, DType::kBF16, 0.0), in, rows);
    const double other_pairing =
        PlaneError(AllotLayout(4, 128, 1, 32, DType::kBF16, theta, !interleaved), in, rows);
    EXPECT_LT(with_turn, 0.5 * without) << interleaved;
    EXPECT_LT(with_turn, 0.5 * other_pairing) << interleaved;
  }
}

// INT6 allot's bit more per value halves its values' step: their squared error falls to about a
// quarter of INT5 allot's (the INT8 first rows, the same in both, keep it a little above). Its
// keys are INT5 allot's: restored the same.
TEST(AllotWidths, Int6ValuesRestoreCloserThanInt5s) {
  const BlockLayout five = AllotLayout(4, 128, 1, 32, DType::kBF16, 1e4, false);
  const BlockLayout six =
      AllotLayout(4, 128, 1, 32, DType::kBF16, 1e4, false, CodecKind::kInt6Allot);
  KvPool in(five, 128, ViewKind::kContiguous, 1);
  std::vector<uint32_t> rows(128);
  for (uint32_t i = 0; i < 128; ++i) rows[i] = i;
  FillRopeLike(&in, rows, 1e4, false, 23);
  const double v5 = PlaneError(five, in, rows, 1);
  const double v6 = PlaneError(six, in, rows, 1);
  EXPECT_GT(v6, 0.0);
  EXPECT_LT(v6, 0.35 * v5) << v5 << " " << v6;
  const double k5 = PlaneError(five, in, rows, 0);
  EXPECT_GT(k5, 0.0);
  EXPECT_EQ(PlaneError(six, in, rows, 0), k5);
}

// INT4 allot's widths against INT5 allot's: a bit less per value quadruples the values' squared
// error (a little less, the INT8 first rows being the same), and 0.8125 bits less per key element
// raise the keys' error (less than the values': the channels at 2 bits, most of the noise, are
// alike in both; the bits taken are the wide channels').
TEST(AllotWidths, Int4RestoresFartherThanInt5) {
  const BlockLayout five = AllotLayout(4, 128, 1, 32, DType::kBF16, 1e4, false);
  const BlockLayout four =
      AllotLayout(4, 128, 1, 32, DType::kBF16, 1e4, false, CodecKind::kInt4Allot);
  KvPool in(five, 128, ViewKind::kContiguous, 1);
  std::vector<uint32_t> rows(128);
  for (uint32_t i = 0; i < 128; ++i) rows[i] = i;
  FillRopeLike(&in, rows, 1e4, false, 23);
  const double v5 = PlaneError(five, in, rows, 1);
  const double v4 = PlaneError(four, in, rows, 1);
  EXPECT_GT(v4, 2.8 * v5) << v5 << " " << v4;
  EXPECT_LT(v4, 4.5 * v5) << v5 << " " << v4;
  const double k5 = PlaneError(five, in, rows, 0);
  const double k4 = PlaneError(four, in, rows, 0);
  EXPECT_GT(k4, 1.2 * k5) << k5 << " " << k4;  // 1.43x here: the 2-bit channels are alike
}

TEST(AllotTurn, ThetaZeroTableIsTheIdentity) {
  RowFormat fmt;
  fmt.head_dim = 64;
  const RopeTurn none = MakeRopeTurn(fmt, 16);
  for (float c : none.cos) ASSERT_EQ(c, 1.0f);
  for (float s : none.sin) ASSERT_EQ(s, 0.0f);
  fmt.rope_theta = 1e4;
  const RopeTurn turn = MakeRopeTurn(fmt, 16);
  EXPECT_EQ(turn.Cos(0, 5), 1.0f);
  EXPECT_FLOAT_EQ(turn.Cos(3, 0), static_cast<float>(std::cos(3.0)));
  EXPECT_FLOAT_EQ(turn.Sin(7, 1), static_cast<float>(std::sin(7.0 * std::pow(1e4, -2.0 / 64))));
}

}  // namespace
}  // namespace hiqcache::kernels
