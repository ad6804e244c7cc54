// The CUDA emulator itself (kernels/cuda/cuda_emulation.h): every thread of a launch runs once with
// the right built-in variables, warp shuffles have CUDA's semantics (sources, widths, masks, all
// values posted before any is read), and the cases CUDA leaves undefined (a shuffle naming an
// exited or diverged lane, a misaligned vector load) are reported as launch errors instead of
// passing silently. The codec kernels' tests (codec_cuda_emulation_test.cc) rely on all of it.
#include "cuda_emulation.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_runtime_emulation.h"

namespace hiqcache::cuda_emulation {
namespace {

constexpr unsigned kFull = 0xFFFFFFFFu;

// Runs `kernel(params)` as kernel<<<grid, block>>>(params); returns the launch's error text ("" =
// success).
template <typename P>
std::string LaunchAndCheck(void (*kernel)(P), dim3 grid, dim3 block, const P& params) {
  Launch(kernel, grid, block, nullptr)(params);
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return "";
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

// ---------------------------------------------------------------------------------------------
// Built-in variables.

struct IdsParams {
  std::vector<std::tuple<uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t>>* seen;
  dim3* block_dims;
  dim3* grid_dims;
};

void RecordIds(IdsParams p) {
  p.seen->emplace_back(blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
  *p.block_dims = blockDim;
  *p.grid_dims = gridDim;
}

TEST(CudaEmulation, EveryThreadRunsOnceWithItsIds) {
  for (const auto& [grid, block] : std::vector<std::pair<dim3, dim3>>{
           {dim3(3), dim3(64)}, {dim3(1), dim3(48)}, {dim3(2, 3, 1), dim3(8, 4, 2)}}) {
    std::vector<std::tuple<uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t>> seen;
    dim3 bd, gd;
    ASSERT_EQ(LaunchAndCheck(RecordIds, grid, block, IdsParams{&seen, &bd, &gd}), "");
    const size_t want = size_t{grid.x} * grid.y * grid.z * block.x * block.y * block.z;
    EXPECT_EQ(seen.size(), want);
    EXPECT_EQ(std::set(seen.begin(), seen.end()).size(), want) << "a thread ran twice";
    for (const auto& [bx, by, bz, tx, ty, tz] : seen) {
      ASSERT_TRUE(bx < grid.x && by < grid.y && bz < grid.z);
      ASSERT_TRUE(tx < block.x && ty < block.y && tz < block.z);
    }
    EXPECT_EQ(bd.x * bd.y * bd.z, block.x * block.y * block.z);
    EXPECT_EQ(gd.x, grid.x);
  }
}

TEST(CudaEmulation, InvalidConfigurationsFailTheLaunch) {
  std::vector<std::tuple<uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t>> seen;
  dim3 bd, gd;
  EXPECT_NE(LaunchAndCheck(RecordIds, dim3(1), dim3(1025), IdsParams{&seen, &bd, &gd}), "");
  EXPECT_NE(LaunchAndCheck(RecordIds, dim3(0), dim3(32), IdsParams{&seen, &bd, &gd}), "");
  EXPECT_TRUE(seen.empty());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "cudaGetLastError clears the error";
}

// ---------------------------------------------------------------------------------------------
// Shuffles.

struct ShflParams {
  int kind;  // 0 xor, 1 down, 2 up, 3 idx
  int arg;
  int width;
  unsigned* out;  // per global thread
};

void ShuffleOnce(ShflParams p) {
  const unsigned lane = threadIdx.x & 31u;
  const unsigned v = 1000u + lane;  // the value each lane posts
  unsigned r = 0;
  switch (p.kind) {
    case 0:
      r = __shfl_xor_sync(kFull, v, p.arg, p.width);
      break;
    case 1:
      r = __shfl_down_sync(kFull, v, static_cast<unsigned>(p.arg), p.width);
      break;
    case 2:
      r = __shfl_up_sync(kFull, v, static_cast<unsigned>(p.arg), p.width);
      break;
    default:
      r = __shfl_sync(kFull, v, p.arg, p.width);
      break;
  }
  p.out[blockIdx.x * blockDim.x + threadIdx.x] = r;
}

// What the CUDA programming guide specifies for lane `l` (value 1000 + lane).
unsigned Expected(int kind, int arg, int width, unsigned l) {
  const unsigned seg = l & ~static_cast<unsigned>(width - 1);
  int src = 0;
  switch (kind) {
    case 0:
      src = static_cast<int>(l ^ static_cast<unsigned>(arg));
      if (src >= static_cast<int>(seg) + width) src = static_cast<int>(l);
      break;
    case 1:
      src = static_cast<int>(l) + arg;
      if (src >= static_cast<int>(seg) + width) src = static_cast<int>(l);
      break;
    case 2:
      src = static_cast<int>(l) - arg;
      if (src < static_cast<int>(seg)) src = static_cast<int>(l);
      break;
    default:
      src = static_cast<int>(seg) + (arg % width);
      break;
  }
  return 1000u + static_cast<unsigned>(src);
}

TEST(CudaEmulation, ShufflesFollowCudaSemantics) {
  std::vector<unsigned> out(2 * 64);
  for (int kind = 0; kind < 4; ++kind) {
    for (int width : {32, 16, 8, 4, 2, 1}) {
      for (int arg : {0, 1, 2, 3, 5, 8, 16, 31}) {
        std::fill(out.begin(), out.end(), 0u);
        ASSERT_EQ(LaunchAndCheck(ShuffleOnce, dim3(2), dim3(64),
                                 ShflParams{kind, arg, width, out.data()}),
                  "");
        for (unsigned t = 0; t < out.size(); ++t) {
          ASSERT_EQ(out[t], Expected(kind, arg, width, t & 31u))
              << "kind " << kind << " width " << width << " arg " << arg << " thread " << t;
        }
      }
    }
  }
}

// A butterfly: each step reads the partner's value from before the step, so any lane reading a
// value updated in the same step would break the sums.
struct ButterflyParams {
  unsigned* out;
};

void ButterflySum(ButterflyParams p) {
  const unsigned lane = threadIdx.x & 31u;
  unsigned v = lane * lane + 1u;
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
  uint64_t w = (uint64_t{1} << 40) + lane;  // 64-bit values move whole
  w = __shfl_xor_sync(kFull, w, 1);
  p.out[threadIdx.x] = v + (w == (uint64_t{1} << 40) + (lane ^ 1u) ? 0u : 1u);
}

TEST(CudaEmulation, ButterflyReductionSeesPreStepValues) {
  unsigned want = 0;
  for (unsigned l = 0; l < 32; ++l) want += l * l + 1u;
  std::vector<unsigned> out(96, 0);
  ASSERT_EQ(LaunchAndCheck(ButterflySum, dim3(1), dim3(96), ButterflyParams{out.data()}), "");
  for (unsigned t = 0; t < out.size(); ++t) EXPECT_EQ(out[t], want) << "thread " << t;
}

// Two half-warps shuffle with disjoint masks at the same time: both complete.
void HalfWarpMasks(ButterflyParams p) {
  const unsigned lane = threadIdx.x & 31u;
  const unsigned mask = lane < 16 ? 0x0000FFFFu : 0xFFFF0000u;
  p.out[threadIdx.x] = __shfl_xor_sync(mask, lane, 1);
}

TEST(CudaEmulation, DisjointMasksCompleteIndependently) {
  std::vector<unsigned> out(32, 99);
  ASSERT_EQ(LaunchAndCheck(HalfWarpMasks, dim3(1), dim3(32), ButterflyParams{out.data()}), "");
  for (unsigned l = 0; l < 32; ++l) EXPECT_EQ(out[l], l ^ 1u);
}

// ---------------------------------------------------------------------------------------------
// Undefined behaviour on a GPU is an error here.

void ShuffleAfterHalfExited(ButterflyParams p) {
  if ((threadIdx.x & 31u) < 8) return;  // diverged: these lanes never reach the shuffle
  p.out[threadIdx.x] = __shfl_xor_sync(kFull, threadIdx.x, 1);
}

void ShuffleWithDifferentMasks(ButterflyParams p) {
  const unsigned lane = threadIdx.x & 31u;
  p.out[threadIdx.x] = __shfl_xor_sync(lane == 3 ? 0x0000FFFFu : kFull, lane, 1);
}

void ShuffleReadsOutsideMask(ButterflyParams p) {
  const unsigned lane = threadIdx.x & 31u;
  if (lane < 16) p.out[lane] = __shfl_xor_sync(0x0000FFFFu, lane, 16);  // reads lanes 16..31
}

void ShuffleMaskWithoutSelf(ButterflyParams p) {
  const unsigned lane = threadIdx.x & 31u;
  p.out[lane] = __shfl_sync(kFull & ~1u, lane, 0);
}

TEST(CudaEmulation, UndefinedShufflesFailTheLaunch) {
  std::vector<unsigned> out(64, 0);
  const std::string exited =
      LaunchAndCheck(ShuffleAfterHalfExited, dim3(1), dim3(64), ButterflyParams{out.data()});
  EXPECT_NE(exited.find("exited"), std::string::npos) << exited;
  EXPECT_NE(exited.find("cudaErrorLaunchFailure"), std::string::npos) << exited;
  const std::string divergent =
      LaunchAndCheck(ShuffleWithDifferentMasks, dim3(1), dim3(32), ButterflyParams{out.data()});
  EXPECT_NE(divergent, "");
  const std::string outside =
      LaunchAndCheck(ShuffleReadsOutsideMask, dim3(1), dim3(32), ButterflyParams{out.data()});
  EXPECT_NE(outside, "");
  const std::string self =
      LaunchAndCheck(ShuffleMaskWithoutSelf, dim3(1), dim3(32), ButterflyParams{out.data()});
  EXPECT_NE(self.find("does not name the calling lane"), std::string::npos) << self;
  // A partial warp (48 threads: lanes 16..31 of warp 1 do not exist) cannot use a full mask.
  const std::string partial =
      LaunchAndCheck(ButterflySum, dim3(1), dim3(48), ButterflyParams{out.data()});
  EXPECT_NE(partial.find("do not exist"), std::string::npos) << partial;
  // The emulator is reusable after failures.
  EXPECT_EQ(LaunchAndCheck(ButterflySum, dim3(1), dim3(32), ButterflyParams{out.data()}), "");
}

struct LoadParams {
  const uint8_t* src;
  unsigned* out;
};

void VectorLoad(LoadParams p) {
  const uint4 v = __ldcs(reinterpret_cast<const uint4*>(p.src));
  p.out[threadIdx.x] = v.x;
}

TEST(CudaEmulation, MisalignedVectorLoadFailsTheLaunch) {
  alignas(16) uint8_t buf[64] = {};
  unsigned out[32];
  EXPECT_EQ(LaunchAndCheck(VectorLoad, dim3(1), dim3(32), LoadParams{buf + 16, out}), "");
  const std::string err = LaunchAndCheck(VectorLoad, dim3(1), dim3(32), LoadParams{buf + 8, out});
  EXPECT_NE(err.find("misaligned"), std::string::npos) << err;
}

TEST(CudaEmulation, IntrinsicsAndHostApi) {
  EXPECT_EQ(__vmaxu2(0x00017FFFu, 0x80000001u), 0x80007FFFu);
  EXPECT_EQ(__vmaxu2(0xFFFF0000u, 0x0001FFFFu), 0xFFFFFFFFu);
  EXPECT_EQ(sizeof(uint4), 16u);
  EXPECT_EQ(alignof(uint4), 16u);
  EXPECT_EQ(alignof(uint2), 8u);
  int sms = 0;
  SetSmCount(3);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  EXPECT_EQ(sms, 3);
  SetSmCount(2);
  uint8_t a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8] = {};
  ASSERT_EQ(cudaMemcpyAsync(b, a, 8, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(b[7], 8);
  ASSERT_EQ(cudaMemsetAsync(b, 0x5A, 4), cudaSuccess);
  EXPECT_EQ(b[0], 0x5A);
  EXPECT_EQ(b[4], 5);
  EXPECT_EQ(cudaMemsetAsync(nullptr, 0, 4), cudaErrorInvalidValue);
}

// The fault switch the codec tests use to prove they catch a broken shuffle.
TEST(CudaEmulation, WrongLaneFaultChangesShuffleResults) {
  std::vector<unsigned> out(32, 0);
  SetFault(Fault::kShuffleWrongLane);
  ASSERT_EQ(LaunchAndCheck(ShuffleOnce, dim3(1), dim3(32), ShflParams{0, 1, 32, out.data()}), "");
  SetFault(Fault::kNone);
  for (unsigned l = 0; l < 32; ++l) EXPECT_EQ(out[l], 1000u + (((l ^ 1u) + 1u) % 32u));
}

TEST(CudaEmulation, StatsCountLaunchesAndShuffles) {
  ResetStats();
  std::vector<unsigned> out(64, 0);
  ASSERT_EQ(LaunchAndCheck(ButterflySum, dim3(1), dim3(64), ButterflyParams{out.data()}), "");
  const Stats st = GetStats();
  EXPECT_EQ(st.launches, 1u);
  EXPECT_EQ(st.ctas, 1u);
  EXPECT_EQ(st.lanes, 64u);
  EXPECT_EQ(st.shuffles, 2u * 6u);  // 2 warps x (5 butterfly steps + one 64-bit shuffle)
}

}  // namespace
}  // namespace hiqcache::cuda_emulation
