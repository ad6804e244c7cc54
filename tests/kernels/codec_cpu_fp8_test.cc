// The SIMD CPU executor's CODEC_FP8_E4M3_PER_HEAD rows (codec_cpu_fp8.cc, reached through
// codec_cpu.h's entry points): the float64 model's and the scalar reference's bytes for every
// input class, geometry, dtype and view shape, on every Highway target this machine runs; every
// value of the dtype at many scales (ties, subnormal codes, saturation); every code's decode;
// the FP8 error bound; non-finite flags; any thread count.
#include <gtest/gtest.h>

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

constexpr CodecKind kFp8 = CodecKind::kFp8E4m3PerHead;

TEST(CodecCpuFp8, MatchesFloat64ModelEverywhere) {
  BoundStats bound;
  const std::vector<std::string> errors = RunEveryInputClass(
      kFp8, TestGeometries(), Fp8InputClasses(), 7000, SimdExecutors({1u, 3u}), &bound);
  ExpectNoErrors(errors);
  EXPECT_EQ(bound.violations, 0u);
  EXPECT_GT(bound.max_err_over_bound, 0.9);
  std::printf("  %llu elements checked, max err / bound = %.4f (target %s)\n",
              static_cast<unsigned long long>(bound.elements), bound.max_err_over_bound,
              CpuCodec::TargetName());
}

// Every view shape with both dtypes for the engine geometry, odd block sizes.
TEST(CodecCpuFp8, EveryViewShape) {
  BoundStats bound;
  std::vector<Executor> execs = SimdExecutors({1u, 3u});
  execs.push_back(ReferenceExecutor());
  const std::vector<std::string> errors = RunEveryViewShape(kFp8, 7500, execs, &bound);
  ExpectNoErrors(errors);
  EXPECT_EQ(bound.violations, 0u);
}

// Heads holding every finite value of the dtype up to amax (both signs) for many scales: exact
// powers of two (quotients land on e4m3 ties and subnormal codes), amaxes whose scale rounds
// down (quotients above 448: saturation), and random ones. The vector quotient and conversion
// must round exactly like the float64 model.
TEST(CodecCpuFp8, EveryValueAtManyScales) { ExpectEveryValueAtManyScales(kFp8, 448.0, 78); }

// Every one of the 256 codes (0x7F/0xFF, never written, included) at many scales, in head
// positions of the vector part and the scalar tail: the SIMD decode writes the reference's bits.
TEST(CodecCpuFp8, EveryCodeDecodesLikeTheReference) {
  ExpectEveryCodeDecodesLikeTheReference(kFp8, {128u, 100u, 7u});
}

// SIMD and scalar reference: identical bytes, flags and restored pools for any thread count.
TEST(CodecCpuFp8, SameBytesAsReferenceForAnyThreadCount) {
  ExpectNoErrors(RunSameBytesAsReference(kFp8));
}

// NaN and +-Inf in the vector part or the scalar tail flag exactly their blocks.
TEST(CodecCpuFp8, NonfiniteRowsFlagTheirBlocks) {
  std::vector<Executor> execs = SimdExecutors({1u, 3u});
  execs.push_back(ReferenceExecutor());
  ExpectNoErrors(RunNonfiniteFlags(kFp8, {{2, 100, 2}, {1, 576, 1}, {1, 7, 1}},
                                   /*negative_quiet_nan=*/false, 8000, execs));
}

// Every Highway target compiled in and supported here, selected in turn.
TEST(CodecCpuFp8, EveryHighwayTarget) {
  ExpectNoErrorsOnEveryHighwayTarget([](int64_t /*target*/) {
    const std::vector<Executor> execs = {SimdExecutors({1u, 3u})[0], SimdExecutors({1u, 3u})[1]};
    return RunOneHighwayTarget(
        kFp8, TestGeometries(),
        {InputClass::kRowMix, InputClass::kFp8Grid, InputClass::kTiny, InputClass::kHuge},
        {2, 100, 2}, 9000, execs);
  });
}

}  // namespace
}  // namespace hiqcache::kernels
