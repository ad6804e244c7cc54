// Helpers of the SIMD CPU executor's tests (codec_cpu_test.cc, codec_cpu_fp8_test.cc,
// codec_cpu_int4_test.cc, codec_cpu_kivi_test.cc, codec_cpu_hadamard_test.cc) that need gtest and
// Highway: codec_test_util.h uses neither, so the
// GPU tests and the benchmarks can include it without them.
#pragma once

#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "codec_cpu.h"
#include "codec_reference.h"
#include "codec_test_util.h"

namespace hiqcache::kernels::testutil {

// Reports the first 10 messages as failures, and fails with their count if there are any.
inline void ExpectNoErrors(const std::vector<std::string>& errors) {
  for (size_t i = 0; i < errors.size() && i < 10; ++i) ADD_FAILURE() << errors[i];
  EXPECT_TRUE(errors.empty()) << errors.size() << " failures";
}

// Selects every Highway target compiled in and supported here in turn and runs `cases` on it
// (its messages get the target's name in front); then restores the default selection, expects
// no messages and prints the targets' names.
inline void ExpectNoErrorsOnEveryHighwayTarget(
    const std::function<std::vector<std::string>(int64_t target)>& cases) {
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  std::vector<std::string> errors;
  std::string names;
  for (int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    names += std::string(hwy::TargetName(target)) + " ";
    for (auto& e : cases(target)) errors.push_back(std::string(hwy::TargetName(target)) + ": " + e);
  }
  hwy::SetSupportedTargetsForTest(0);
  ExpectNoErrors(errors);
  std::printf("  targets: %s\n", names.c_str());
}

// One case of a codec stored per plane (INT4 KIVI, INT4 Hadamard) and its name in failures.
struct PlaneCodecCase {
  Geometry g;
  DType dtype;
  uint32_t block_tokens;
  InputClass cls;
  ViewKind view;
  uint64_t seed;
};

inline std::string Name(const PlaneCodecCase& c) {
  return GeometryName(c.g) + " " + DTypeName(c.dtype) + " bt" + std::to_string(c.block_tokens) +
         " " + InputClassName(c.cls) + " " + ViewKindName(c.view) + " seed " +
         std::to_string(c.seed);
}

// Runs every executor on one case of a codec stored per plane (INT4 KIVI, INT4 Hadamard): each
// encode of `in`'s `rows` must give the model's flags and, for unflagged blocks, its payload
// bytes; each decode of the model's unflagged payloads must write `expect` (a pool shaped as
// `in`) byte for byte. Messages start with `name`.
inline std::vector<std::string> CompareExecutorsWithModel(const std::string& name, const KvPool& in,
                                                          const std::vector<uint32_t>& rows,
                                                          const BlockSet& model,
                                                          const std::vector<uint8_t>& model_flags,
                                                          const KvPool& expect, uint64_t seed,
                                                          const std::vector<Executor>& execs) {
  std::vector<std::string> errors;
  const BlockLayout& lay = in.layout();
  const uint32_t blocks = static_cast<uint32_t>(model_flags.size());
  for (const Executor& ex : execs) {
    BlockSet got(lay, blocks);
    std::vector<uint8_t> flags(blocks, 0xFF);
    ex.encode(MakeEncodeJob(in, rows, got, flags.data()));
    for (uint32_t b = 0; b < blocks; ++b) {
      if (flags[b] != model_flags[b]) {
        errors.push_back(name + " " + ex.name + ": block " + std::to_string(b) + " flag " +
                         std::to_string(flags[b]) + ", model " + std::to_string(model_flags[b]));
        continue;
      }
      if (model_flags[b]) continue;
      for (size_t off = 0; off < lay.BlockBytes(); ++off) {
        if (got[b][off] != model[b][off]) {
          errors.push_back(name + " " + ex.name + ": block " + std::to_string(b) + " byte " +
                           std::to_string(off) + " is " + std::to_string(got[b][off]) + ", model " +
                           std::to_string(model[b][off]));
          break;
        }
      }
    }
    // Decode the model's payloads (unflagged blocks only, as a restore would).
    std::vector<uint32_t> ok_rows;
    BlockSet ok_blocks(lay, 0);
    std::vector<const uint8_t*> ptrs;
    for (uint32_t b = 0; b < blocks; ++b) {
      if (model_flags[b]) continue;
      ptrs.push_back(model[b].data());
      ok_rows.insert(ok_rows.end(), rows.begin() + size_t{b} * lay.block_tokens,
                     rows.begin() + size_t{b + 1} * lay.block_tokens);
    }
    KvPool out(lay, in.num_rows(), in.kind(), seed);
    out.FillBytes(0xEE);
    DecodeJob job = MakeDecodeJob(out, ok_rows, ok_blocks);
    job.blocks = ptrs.data();
    job.num_blocks = static_cast<uint32_t>(ptrs.size());
    ex.decode(job);
    for (uint32_t l = 0; l < lay.num_layers; ++l) {
      if (out.buffer(l) != expect.buffer(l)) {
        errors.push_back(name + " " + ex.name + ": decoded layer " + std::to_string(l) +
                         " differs from the model's");
        break;
      }
    }
  }
  return errors;
}

// Encodes `in`'s `rows` (want.size() blocks) on every executor: the nonfinite flags must equal
// `want`. `what` names the case in failures.
inline void ExpectEncodeFlags(const KvPool& in, const std::vector<uint32_t>& rows,
                              const std::vector<Executor>& execs, const std::vector<uint8_t>& want,
                              const std::string& what) {
  for (const Executor& ex : execs) {
    BlockSet got(in.layout(), static_cast<uint32_t>(want.size()));
    std::vector<uint8_t> flags(want.size(), 0xFF);
    ex.encode(MakeEncodeJob(in, rows, got, flags.data()));
    EXPECT_EQ(flags, want) << ex.name << " " << what;
  }
}

// A value with the 16-bit pattern `bits` (NaN, Inf) at the last element of head 1 of token
// `token` of layer 1's `plane`, in block 1 of three 8-token blocks of Gaussian 2 x 64 rows:
// every executor flags block 1 and no other.
inline void ExpectPlantedBlockFlagged(CodecKind codec, DType dtype, uint32_t plane, uint32_t token,
                                      uint16_t bits, const std::vector<Executor>& execs) {
  const BlockLayout lay = MakeLayout({2, 64, 2}, dtype, codec, 2, 8);
  KvPool in(lay, 40, ViewKind::kContiguous, 5);
  in.Fill(InputClass::kGaussian, 5);
  Rng rng(7);
  const std::vector<uint32_t> rows = RandomRows(40, 24, rng);
  in.Head(1, plane, rows[8 + token], 1)[63] = bits;
  ExpectEncodeFlags(in, rows, execs, {0, 1, 0},
                    std::string(DTypeName(dtype)) + " plane " + std::to_string(plane) + " token " +
                        std::to_string(token) + " bits " + std::to_string(bits));
}

// Rows whose groups (a whole head for FP8, 32 elements for INT4) hold every finite value of the
// dtype up to their amax (both signs, after the amax element) for many amaxes: qmax * m * 2^e
// (quotients land on ties, FP8's subnormal codes), 24 random ones and 8 whose scale rounds down
// (the amax's own quotient exceeds qmax: FP8's saturation, INT4's clamp). The SIMD encode and
// decode of every row (8 x 128) must write the float64 model's bytes, for both dtypes.
inline void ExpectEveryValueAtManyScales(CodecKind codec, double qmax, uint64_t rng_seed) {
  Rng rng(rng_seed);
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const uint16_t max_bits = FormatOf(dtype).max_bits;
    std::vector<double> amaxes = {0.0, MaxFinite(dtype)};
    for (int e = -8; e <= 6; ++e) {
      for (int m : {1, 3, 5, 7}) amaxes.push_back(qmax * m * std::ldexp(1.0, e));  // s = m*2^e
    }
    std::vector<uint16_t> amax_bits;
    for (double a : amaxes) amax_bits.push_back(DoubleToHalfBits(a, dtype));
    for (int i = 0; i < 24; ++i) amax_bits.push_back(static_cast<uint16_t>(rng.Below(max_bits)));
    // Scales that round down: amax / s > qmax for the amax element itself.
    int rounding_down = 0;
    for (uint32_t a = 1; a < max_bits && rounding_down < 8; a += 97) {
      const double s =
          ScaleValue(DoubleToHalfBits(HalfBitsToDouble(a, dtype) / qmax, DType::kBF16));
      if (HalfBitsToDouble(a, dtype) / s > qmax) {
        amax_bits.push_back(static_cast<uint16_t>(a));
        ++rounding_down;
      }
    }
    EXPECT_EQ(rounding_down, 8);

    RowFormat fmt;
    fmt.num_heads = 8;
    fmt.head_dim = 128;
    fmt.dtype = dtype;
    fmt.codec = codec;
    const size_t group = codec == CodecKind::kInt4G32PerHead ? kModelInt4Group : fmt.head_dim;
    std::vector<uint16_t> row(fmt.ElementsPerRow()), out(fmt.ElementsPerRow());
    std::vector<uint8_t> got(fmt.RowBytes()), want(fmt.RowBytes());
    const StridedView view = OneRowView(fmt, row.data());
    const StridedView out_view = OneRowView(fmt, out.data());
    std::vector<uint16_t> want_out(fmt.ElementsPerRow());
    uint64_t rows_checked = 0;
    int mismatches = 0;
    for (uint16_t a : amax_bits) {
      uint32_t next = 0;
      while (next <= a) {
        // Every group of the row: its amax first, then the next values up to it.
        for (size_t i = 0; i < row.size(); ++i) {
          if (i % group == 0) {
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

// Records whose code bytes count up through all 256 byte values (every FP8 code, every pair of
// INT4 nibbles) under many scales (alternating with their mirror image across scales, per head
// or per group) for 4 heads of each of `dims`: the SIMD decode writes the scalar reference's
// bits, for both dtypes.
inline void ExpectEveryCodeDecodesLikeTheReference(CodecKind codec,
                                                   std::initializer_list<uint32_t> dims) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (uint32_t dim : dims) {
      RowFormat fmt;
      fmt.num_heads = 4;
      fmt.head_dim = dim;
      fmt.dtype = dtype;
      fmt.codec = codec;
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

}  // namespace hiqcache::kernels::testutil
