// The SIMD CPU executor's CODEC_INT4_G32_PER_HEAD rows (codec_cpu_int4.cc, reached through
// codec_cpu.h's entry points): the float64 model's and the scalar reference's bytes for every
// input class, INT4 geometry, dtype and view shape, on every Highway target this machine runs;
// every value of the dtype at many group scales (ties, the clamp's neighbourhood); every
// nibble's decode; the INT4 error bound; non-finite flags; any thread count.
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

constexpr CodecKind kInt4 = CodecKind::kInt4G32PerHead;

TEST(CodecCpuInt4, MatchesFloat64ModelEverywhere) {
  BoundStats bound;
  const std::vector<std::string> errors = RunEveryInputClass(
      kInt4, Int4TestGeometries(), Int4InputClasses(), 17000, SimdExecutors({1u, 3u}), &bound);
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
  std::vector<Executor> execs = SimdExecutors({1u, 3u});
  execs.push_back(ReferenceExecutor());
  const std::vector<std::string> errors = RunEveryViewShape(kInt4, 17500, execs, &bound);
  ExpectNoErrors(errors);
  EXPECT_EQ(bound.violations, 0u);
}

// Groups holding every finite value of the dtype up to their amax (both signs) for many scales:
// amaxes 7 * m * 2^e (quotients land on ties), amaxes whose scale rounds down (quotients just
// above 7) and random ones. The vector quotient, rounding and packing must match the model.
TEST(CodecCpuInt4, EveryValueAtManyScales) { ExpectEveryValueAtManyScales(kInt4, 7.0, 79); }

// Every byte value (so every nibble pair, 0x8 included) at many scales, per group: the SIMD
// decode writes the reference's bits.
TEST(CodecCpuInt4, EveryNibbleDecodesLikeTheReference) {
  ExpectEveryCodeDecodesLikeTheReference(kInt4, {128u, 32u, 96u});
}

// SIMD and scalar reference: identical bytes, flags and restored pools for any thread count.
TEST(CodecCpuInt4, SameBytesAsReferenceForAnyThreadCount) {
  ExpectNoErrors(RunSameBytesAsReference(kInt4));
}

// NaN and +-Inf in the first or the last group flag exactly their blocks.
TEST(CodecCpuInt4, NonfiniteRowsFlagTheirBlocks) {
  std::vector<Executor> execs = SimdExecutors({1u, 3u});
  execs.push_back(ReferenceExecutor());
  ExpectNoErrors(RunNonfiniteFlags(kInt4, {{2, 96, 2}, {1, 576, 1}, {1, 32, 1}},
                                   /*negative_quiet_nan=*/false, 18000, execs));
}

// Every Highway target compiled in and supported here, selected in turn.
TEST(CodecCpuInt4, EveryHighwayTarget) {
  ExpectNoErrorsOnEveryHighwayTarget([](int64_t /*target*/) {
    const std::vector<Executor> execs = {SimdExecutors({1u, 3u})[0], SimdExecutors({1u, 3u})[1]};
    return RunOneHighwayTarget(
        kInt4, Int4TestGeometries(),
        {InputClass::kRowMix, InputClass::kInt4Grid, InputClass::kTiny, InputClass::kHuge},
        {2, 96, 2}, 19000, execs);
  });
}

}  // namespace
}  // namespace hiqcache::kernels
